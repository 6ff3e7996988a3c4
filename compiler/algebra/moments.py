"""Known numerically stable merges for separable summaries.

Centred moments: the state (count, mean, M2) with Chan et al.'s parallel merge
(Welford's update when one side is a single element).  Written with the same
tracing as user summaries, so the formulas read as the textbook does."""
from __future__ import annotations

from ..ir import Const, Expr
from .summary import Field
from .user import fn, lift_value, state


def centred_moments(prefix: str, element: Expr):
    """Fields `{prefix}_n`, `{prefix}_mean`, `{prefix}_m2`, for the element `element`;
    returns (fields, identity, lift, combine) formula lists."""
    n, mean, m2 = (f"{prefix}_n", f"{prefix}_mean", f"{prefix}_m2")
    a, b = state("a.", (n, mean, m2)), state("b.", (n, mean, m2))
    count = a[n] + b[n]
    delta = b[mean] - a[mean]
    empty = count == 0.0                  # two empty states merge to the empty state
    combine = (
        count,
        a[mean] + fn.where(empty, 0.0, delta * b[n] / count),
        a[m2] + b[m2] + fn.where(empty, 0.0, delta * delta * a[n] * b[n] / count),
    )
    lift = (Const(1.0), element, Const(0.0))
    return ([Field(n), Field(mean), Field(m2)], [Const(0.0)] * 3, list(lift),
            [lift_value(c) for c in combine])


__all__ = ["centred_moments"]
