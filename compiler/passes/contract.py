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


def distributed_difference(e: Expr, types: ExpressionTypes) -> Expr | None:
    """`sum[r](w * (a - b))` as `sum[r](w * a) - sum[r](w * b)` where `w * b` is a
    contraction over r that the difference hides: b reads r and an index w lacks, w
    reads one that b lacks, a reads no r (it leaves its sum), and the difference spans
    both sides (so that, undistributed, no factor lies on one side).  The gradient of a
    distance has this form: `sum[m](G[i,m] * (X[i,k] - Y[m,k]))` is
    `X[i,k] * sum[m](G[i,m]) - sum[m](G[i,m] * Y[m,k])`, a row sum and a matrix product."""
    if not is_sum(e):
        return None
    reduced = set(e.indices)
    num, den = factors(e.args[0])
    for n, d in enumerate(num):
        parts = terms(d)
        rest = num[:n] + num[n + 1:]
        if len(parts) != 2 or not rest:
            continue
        (sa, a), (sb, b) = parts if not reduced & set(free_indices(parts[0][1])) else parts[::-1]
        if reduced & set(free_indices(a)) or not reduced <= set(free_indices(b)):
            continue
        read = set().union(*(free_indices(f) for f in rest + den))
        weight, own = read - reduced, set(free_indices(b)) - reduced
        if not (reduced <= read and own - weight and weight - own and set(free_indices(d)) & (weight - own)):
            continue
        summed = [Reduce(BUILTINS["sum"], e.indices, (product([*rest, t], den),)) for t in (a, b)]
        return signed_sum([(sa, summed[0]), (sb, summed[1])])
    return None


def _distance_note(old: Reduce, new: Expr) -> str:
    over = ", ".join(old.indices)
    clamped = ", clamped at 0" if isinstance(new, Call) and new.op == "maximum" else ""
    return (f"{format_expr(old)}: the sides' squared norms and a contraction over {over} (tensor cores){clamped}; "
            f"absolute error up to about len({over}) * u * (the sides' squared norms), torch.cdist's")


def _distributed_note(old: Reduce, new: Expr) -> str:
    return (f"{format_expr(old)}: distributed over the difference, a contraction over {', '.join(old.indices)} "
            f"(tensor cores) and a sum the other term leaves")


# One row per rewrite, tried in order on every node: (the rewrite of a node, or None; what
# explain says of it).
REWRITES = (
    (expanded_distance, _distance_note),
    (distributed_difference, _distributed_note),
)


def contract(program: Program) -> Program:
    types = ExpressionTypes({t.name: t.dtype for t in (*program.inputs, *program.statements)})
    notes: list[str] = []

    def rewrite(node: Expr) -> Expr:
        for rule, note in REWRITES:
            new = rule(node, types)
            if new is not None:
                new = order_operands(new, types)
                notes.append(note(node, new))
                return new
        return node

    statements = tuple(replace(s, expr=transform(s.expr, rewrite)) for s in program.statements)
    if not notes:
        return program
    return replace(program, statements=statements, notes=program.notes + tuple(dict.fromkeys(notes)))
