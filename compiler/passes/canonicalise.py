"""canonicalise: one spelling for programs that mean the same thing.

1. Bound indices get canonical names (alpha-equivalence).  A reduction's index
   is named after its extent class (`len_m` -> `m`), numbered (`m_2`, ...) only
   where the reduction reads an outer index of that name.  A size `len(n)`
   names the class the same way.  Reductions over one axis then carry
   one index name however they were written (`sum[n](P[i,n])` beside
   `sum[m](P[i,m])`), so equal reductions are equal values and the reductions
   of one axis fall into one group for `factorise`.
2. Base-2 exponentials and logarithms are written in the natural base
   (exp2(x) = exp(x * ln 2), log2(x) = log(x) / ln 2), so one stabiliser covers
   the exponential family; a backend may rewrite back to base 2.
3. Operands of commutative operators are put in one order (their printed form),
   after flattening chains of an associative one: Q*K and K*Q, (a+b)+c and
   a+(c+b) are one expression, so equal reductions are equal values.

4. Sums over the same indices, with the same free indices, that are added or
   subtracted are one sum (linearity), with the factors their terms share
   pulled out:
   sum[v](a * W) + sum[v](b * W * Y) = sum[v]((a + b * Y) * W).  A gradient
   accumulates one such term per use of an input; as one product the sum is
   one contraction (one tl.dot) instead of a fold of a pair of sums.

5. A sum over several indices keeps inside each index's sum only the factors
   that vary over it: sum[v, k](Y[i,v] * H[i,k] * W[v,k]) =
   sum[v](Y[i,v] * sum[k](H[i,k] * W[v,k])), a contraction (the logits a
   cross-entropy's logsumexp already folds) rather than a fold one v at a time.

Free (left-hand) indices keep the names the program gives them."""
from __future__ import annotations

import math
from dataclasses import replace

from ..algebra import BUILTINS
from ..ir import (
    Call,
    Const,
    Expr,
    Extent,
    Program,
    Reduce,
    children,
    format_expr,
    free_indices,
    transform,
    walk,
    with_children,
)
from ..ops import ASSOCIATIVE, COMMUTATIVE
from .fuse import FreshNames, rename_indices
from .stabilise import factors, is_sum, product

LN2 = Const(math.log(2.0))

# One row per base-2 function: its natural-base form.
NATURAL_BASE = {
    "exp2": lambda x: Call("exp", (Call("mul", (x, LN2)),)),
    "log2": lambda x: Call("div", (Call("log", (x,)), LN2)),
}


def natural_base(e: Expr) -> Expr:
    if isinstance(e, Call) and e.op in NATURAL_BASE:
        return NATURAL_BASE[e.op](e.args[0])
    return e


def order_operands(e: Expr) -> Expr:
    """`e` with the operands of every commutative call sorted by their printed form,
    chains of an associative operator flattened first and rebuilt from the left.
    Iterative, and each chain is flattened once at its top: linear in its length."""
    done: dict[int, Expr] = {}
    stack: list[tuple[Expr, list[Expr] | None]] = [(e, None)]
    while stack:
        node, operands = stack.pop()
        if id(node) in done:
            continue
        if operands is None:
            operands = _operands(node)
            pending = [a for a in operands if id(a) not in done]
            if pending:
                stack.append((node, operands))
                stack.extend((a, None) for a in pending)
                continue
        new = [done[id(a)] for a in operands]
        if isinstance(node, Call) and node.op in COMMUTATIVE:
            new.sort(key=format_expr)
            out = new[0]
            for a in new[1:]:
                out = Call(node.op, (out, a))
            done[id(node)] = out
        else:
            done[id(node)] = with_children(node, tuple(new))
    return done[id(e)]


def _operands(node: Expr) -> list[Expr]:
    """A node's children; for an associative call, the operands of its whole chain."""
    if not (isinstance(node, Call) and node.op in ASSOCIATIVE):
        return list(children(node))
    operands, pending = [], [node]
    while pending:
        n = pending.pop()
        if isinstance(n, Call) and n.op == node.op:
            pending.extend(reversed(n.args))
        else:
            operands.append(n)
    return operands


def merge_sums(e: Expr) -> Expr:
    """sum[I](a) +/- sum[I](b) -> sum[I]((a' +/- b') * common), `common` the factors
    of the numerators a and b share (structurally, with canonical bound names).
    Only sums with the same free indices: dP[i,m] - D[i] = sum[j](dO V) -
    sum[j](dO O) as one sum would compute D once per (i, m), and would make
    (V[m,j] - O[i,j]) one factor, not a matrix product."""
    if not (isinstance(e, Call) and e.op in ("add", "sub") and all(is_sum(a) for a in e.args)
            and e.args[0].indices == e.args[1].indices
            and set(free_indices(e.args[0])) == set(free_indices(e.args[1]))):
        return e
    (left, left_den), (right, right_den) = factors(e.args[0].args[0]), factors(e.args[1].args[0])
    common = []
    for f in list(left):
        if f in right:
            common.append(f)
            left.remove(f)
            right.remove(f)
    body = product([Call(e.op, (product(left, left_den), product(right, right_den))), *common], [])
    return Reduce(BUILTINS["sum"], e.args[0].indices, (body,))


def nest_sums(e: Expr, elsewhere: frozenset = frozenset()) -> Expr:
    """sum[v, k](Y[i,v] * H[i,k] * W[v,k]) -> sum[v](Y[i,v] * sum[k](H[i,k] * W[v,k])):
    the factors that do not vary over one reduced index leave its sum
    (distributivity), so the product over all indices at once (a fold one v at a
    time, or an n^4 matrix chain) becomes nested contractions.  The inner index is
    chosen whatever the order the indices are written in: first one whose inner
    sum is a reduction found `elsewhere` in the statement (the logits a
    logsumexp beside it folds: one value for both), then the one that leaves most
    factors over the other reduced indices outside, then the first by (canonical)
    name."""
    if not (is_sum(e) and len(e.indices) > 1):
        return e
    num, den = factors(e.args[0])
    best = None
    for x in sorted(e.indices):
        inside = ([f for f in num if x in free_indices(f)], [f for f in den if x in free_indices(f)])
        outside = ([f for f in num if x not in free_indices(f)], [f for f in den if x not in free_indices(f)])
        # only a factor over another reduced index separates x (one over none of them,
        # a softmax's normaliser, leaves the whole sum alike: no nesting for it)
        separating = sum(bool(set(free_indices(f)) & set(e.indices)) for f in outside[0] + outside[1])
        if not any(inside) or not separating:
            continue
        inner = order_operands(Reduce(BUILTINS["sum"], (x,), (product(*inside),)))
        rank = (inner in elsewhere, separating)
        if best is None or rank > best[0]:
            best = (rank, x, inner, outside)
    if best is None:
        return e
    _, x, inner, (out_num, out_den) = best
    rest = tuple(i for i in e.indices if i != x)
    return nest_sums(Reduce(BUILTINS["sum"], rest, (product([*out_num, inner], out_den),)), elsewhere)


def _linear_forms(e: Expr) -> Expr:
    elsewhere = frozenset(n for n in walk(e) if is_sum(n))
    return order_operands(transform(e, lambda n: merge_sums(nest_sums(n, elsewhere))))


class _Binders:
    """Canonical names for bound indices, with the extent table kept complete."""

    def __init__(self, extents: dict):
        self.extents = extents
        # a binder that a renaming would capture gets a fresh name (made canonical later)
        self.fresh = FreshNames(extents).fresh

    def canonical(self, index: str, taken: set[str]) -> str:
        base = str(self.extents[index]).removeprefix("len_")
        name, n = base, 1
        while name in taken:
            n += 1
            name = f"{base}_{n}"
        self.extents.setdefault(name, self.extents[index])
        return name

    def rename(self, e: Expr) -> Expr:
        if isinstance(e, Extent):           # a size, not a position: any index of the class names it
            return replace(e, name=self.canonical(e.name, set()))
        if isinstance(e, Reduce):
            # Any name but the reduction's own free indices is safe: an enclosing
            # binder's index that the body does not read may be shadowed.
            taken = set(free_indices(e))
            mapping = {}
            for bound in e.indices:
                mapping[bound] = self.canonical(bound, taken)
                taken.add(mapping[bound])
            renamed = replace(e, indices=tuple(mapping[b] for b in e.indices))
            body = tuple(rename_indices(c, {b: c_ for b, c_ in mapping.items() if b != c_}, self.fresh)
                         for c in children(e))
            return with_children(renamed, tuple(self.rename(c) for c in body))
        return with_children(e, tuple(self.rename(c) for c in children(e)))


def canonicalise(program: Program) -> Program:
    binders = _Binders(dict(program.extents))
    statements = tuple(
        replace(s, expr=_linear_forms(order_operands(binders.rename(transform(s.expr, natural_base)))))
        for s in program.statements)
    named = {i for s in statements for n in walk(s.expr) if isinstance(n, Reduce) for i in n.indices} | {
        n.name for s in statements for n in walk(s.expr) if isinstance(n, Extent)}
    extents = tuple(sorted((k, v) for k, v in binders.extents.items() if k in named or k in dict(program.extents)))
    return replace(program, statements=statements, extents=extents)
