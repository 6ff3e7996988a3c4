"""The algebra of associative mergeable summaries (monoids) and the composite
reductions defined in terms of them."""
from .composites import COMPOSITES, CompositeRule
from .summary import BUILTINS, Block, Field, Rescaled, Summary

__all__ = ["BUILTINS", "Block", "COMPOSITES", "CompositeRule", "Field", "Rescaled", "Summary"]
