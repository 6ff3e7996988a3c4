"""The algebra of associative mergeable summaries (monoids) and the composite
reductions defined in terms of them."""
from .composites import COMPOSITES, CompositeRule
from .summary import BUILTINS, Field, Rescaled, Summary

__all__ = ["BUILTINS", "COMPOSITES", "CompositeRule", "Field", "Rescaled", "Summary"]
