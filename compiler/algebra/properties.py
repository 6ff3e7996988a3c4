"""Algebraic properties of a summary, read off its formulas with sympy.

The factorisation rules state preconditions in these terms, never in names: a
leader is any one-field summary whose merge selects the larger (smaller) of two
states and whose identity is -inf (+inf), built-in `max` or a user's
`where(a.m > b.m, a.m, b.m)` alike; a dependent or a base of moments is any
one-field summary that adds its states, starting from 0, with the element
itself as its lift."""
from __future__ import annotations

import math
from functools import lru_cache

import sympy

from ..ir import Call, Const, Expr, Var, transform
from .formula import to_sympy
from .summary import Summary

_U, _D = sympy.Symbol("u", real=True), sympy.Symbol("d", positive=True)


def _one_field_combine(s: Summary, a: sympy.Expr, b: sympy.Expr) -> sympy.Expr | None:
    if len(s.fields) != 1:
        return None
    (f,) = s.field_names
    try:
        return sympy.simplify(to_sympy(s.combine[0], {f"a.{f}": a, f"b.{f}": b}))
    except (TypeError, KeyError):
        return None


@lru_cache(maxsize=256)
def extremum(s: Summary) -> str | None:
    """"max" or "min" if the merge selects the larger (smaller) state, ties
    included, and the identity is -inf (+inf); else None."""
    if len(s.fields) != 1 or s.lift != (Var("x0"),) or s.arity != 1:
        return None
    low, high = _U, _U + _D
    picks = [_one_field_combine(s, *pair) for pair in ((low, high), (high, low), (low, low))]
    if any(p is None for p in picks):
        return None
    if picks == [high, high, low] and s.identity == (Const(-math.inf),):
        return "max"
    if picks == [low, low, low] and s.identity == (Const(math.inf),):
        return "min"
    return None


@lru_cache(maxsize=256)
def additive(s: Summary) -> bool:
    """Does the summary add its states (a sum of its single argument)?"""
    if len(s.fields) != 1 or s.lift != (Var("x0"),) or s.arity != 1 or s.identity[0].value != 0:
        return False
    a, b = sympy.Symbol("a", real=True), sympy.Symbol("b", real=True)
    merged = _one_field_combine(s, a, b)
    return merged is not None and sympy.simplify(merged - (a + b)) == 0


@lru_cache(maxsize=None)
def exact_identity(summary: Summary, fields: tuple[str, ...]) -> bool:
    """Whether combine(e, e) = e, combine(e, x) = x and combine(x, e) = x hold exactly
    in floating point on `fields` (x: lifts of random elements).  A tree reduction on
    the GPU combines two padding elements; a formula such as exp(a.m - max(a.m, b.m))
    gives NaN there, so such summaries get an identity-guarded combine."""
    import torch

    from .formula import evaluate
    g = torch.Generator().manual_seed(1)
    n = 16
    xs = {f"x{j}": torch.randn(n, generator=g, dtype=torch.float64) * 3 for j in range(summary.arity)}
    index = {f: summary.field_names.index(f) for f in fields}
    e = {f: torch.full((n,), float(summary.identity[index[f]].value), dtype=torch.float64) for f in fields}
    x = {f: evaluate(summary.lift[index[f]], xs).expand(n).double() for f in fields}

    def combine(a, b):
        env = {f"a.{f}": a[f] for f in fields} | {f"b.{f}": b[f] for f in fields}
        return {f: evaluate(summary.combine[index[f]], env).expand(n) for f in fields}

    for a, b, want in ((e, e, e), (e, x, x), (x, e, x)):
        got = combine(a, b)
        if not all(torch.equal(got[f], want[f]) for f in fields):
            return False
    return True


# Comparisons that select one of two states (b.m > a.m); see selecting_combine.
_SELECTIONS = frozenset({"gt", "lt", "ge", "le"})


@lru_cache(maxsize=None)
def selecting_combine(summary: Summary) -> tuple[Expr, ...]:
    """The summary's combine as the oracle evaluates it, with torch's extremum
    semantics: a comparison of one field of the two states treats a NaN as beyond
    every number in the compared direction (a NaN state wins over a number's; of
    two NaNs the comparison stays false, so argmax's left state: the first NaN).
    argmax and argmin then give the first NaN's position, as torch.argmax does, and
    a max that selects its state propagates NaN, as torch.maximum does.  The oracle
    folds with it and the Triton kernels emit it: one NaN rule for both."""
    return tuple(transform(c, _nan_is_extreme) for c in summary.combine)


def _nan_is_extreme(e: Expr) -> Expr:
    """cmp(u, v) as cmp(u, v) or (u is NaN and v is not), where u and v are states' fields."""
    if not (isinstance(e, Call) and e.op in _SELECTIONS and _compares_states(*e.args)):
        return e
    u, v = e.args
    return Call("or", (e, Call("and", (Call("ne", (u, u)), Call("eq", (v, v))))))


def _compares_states(u: Expr, v: Expr) -> bool:
    """Whether `u` and `v` are one field of the two states (a.m and b.m)."""
    if not (isinstance(u, Var) and isinstance(v, Var)):
        return False
    (side_u, _, field_u), (side_v, _, field_v) = u.name.partition("."), v.name.partition(".")
    return field_u == field_v != "" and {side_u, side_v} == {"a", "b"}
