"""contract: a squared difference summed over an index between two sides that
each vary over an index the other does not (a pairwise distance) becomes the
sides' squared norms and one contraction between them:

    sum[k](w * (a - b) ** 2) = sum[k](w * a * a) + sum[k](w * b * b) - 2 * sum[k](w * a * b)

`a` reads the indices A besides k, `b` the indices B; where A and B each hold an
index the other lacks (a point `i` of X, a point `m` of Y), the cross term is a
matrix product over k (a tl.dot on tensor cores) and the norms are one sum per
row of each side, not a [rows, points, k] broadcast.  The factors w must each lie
on one side (a weight over k, or over one side's indices), so that the cross
term stays a contraction.  `(a + b) ** 2` and `(a - b) * (a - b)` are read alike.

The error is the price of the expansion, as in torch.cdist's matrix-product
path (which torch takes past 25 points a side): the result's absolute error is
bounded by about k * u * (|a|^2 + |b|^2) (u: the unit roundoff of the float32
accumulation), where the direct sum's is bounded by k * u * |a - b|^2, so near
points lose relative accuracy to the size of their norms.  Where the inputs are
16-bit, torch's own direct spelling rounds each difference to 16 bits first and
the expansion's products are exact in float32: it is the more accurate one.
A plain squared distance (w = 1) is clamped at 0, as torch.cdist clamps, so that
cancellation never gives a negative distance (a square root of it would be NaN).

A sum whose sides share all their indices (a row's variance around its own
mean, `sum[k]((X[i,k] - Y[i,k]) ** 2)`) is left direct: it has no matrix product
to gain, and its cancellation would be the whole value."""
from __future__ import annotations

from dataclasses import replace

from ..algebra import BUILTINS
from ..ir import Call, Const, Expr, Program, Reduce, format_expr, free_indices, transform
from ..ops import FLOAT
from .canonicalise import ExpressionTypes, order_operands
from .stabilise import factors, is_sum, product, signed_sum, terms


def _square_base(num: list[Expr]) -> tuple[Expr, list[Expr]] | None:
    """The base D of a square among the numerator's factors (`D ** 2`, or D twice),
    and the other factors."""
    for n, f in enumerate(num):
        if isinstance(f, Call) and f.op == "pow" and isinstance(f.args[1], Const) and f.args[1].value == 2:
            return f.args[0], num[:n] + num[n + 1:]
        if f in num[n + 1:]:
            rest = list(num)
            rest.remove(f)
            rest.remove(f)
            return f, rest
    return None


def _one_side(f: Expr, reduced: set[str], sides: tuple[set[str], set[str]]) -> bool:
    outer = set(free_indices(f)) - reduced
    return any(outer <= side for side in sides)


def expanded_distance(e: Expr, types: ExpressionTypes) -> Expr | None:
    """`e` (a sum) as norms and a contraction, or None where it is not a squared
    difference between two sides."""
    if not is_sum(e):
        return None
    num, den = factors(e.args[0])
    found = _square_base(num)
    if found is None:
        return None
    base, rest = found
    parts = terms(base)
    if len(parts) != 2 or types(base) != FLOAT:
        return None
    (sa, a), (sb, b) = parts
    reduced = set(e.indices)
    if not (reduced <= set(free_indices(a)) and reduced <= set(free_indices(b))):
        return None
    sides = set(free_indices(a)) - reduced, set(free_indices(b)) - reduced
    if not (sides[0] - sides[1] and sides[1] - sides[0]):
        return None
    if not all(_one_side(f, reduced, sides) for f in rest + den):
        return None

    def summed(*fs: Expr) -> Reduce:
        return Reduce(BUILTINS["sum"], e.indices, (product([*rest, *fs], den),))

    cross = Call("mul", (Const(2), summed(a, b)))
    distance = signed_sum([(1, summed(a, a)), (1, summed(b, b)), (sa * sb, cross)])
    return Call("maximum", (distance, Const(0.0))) if not rest and not den else distance


def contract(program: Program) -> Program:
    types = ExpressionTypes({t.name: t.dtype for t in (*program.inputs, *program.statements)})
    notes: list[str] = []

    def rewrite(node: Expr) -> Expr:
        new = expanded_distance(node, types)
        if new is None:
            return node
        new = order_operands(new, types)
        over = ", ".join(node.indices)
        clamped = ", clamped at 0" if isinstance(new, Call) and new.op == "maximum" else ""
        notes.append(f"{format_expr(node)}: the sides' squared norms and a contraction over {over} (tensor cores)"
                     f"{clamped}; absolute error up to about len({over}) * u * (the sides' squared norms), "
                     f"torch.cdist's")
        return new

    statements = tuple(replace(s, expr=transform(s.expr, rewrite)) for s in program.statements)
    if not notes:
        return program
    return replace(program, statements=statements, notes=program.notes + tuple(dict.fromkeys(notes)))
