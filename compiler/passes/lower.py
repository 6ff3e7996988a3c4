"""lower: expand composite reductions (softmax, mean, logsumexp) into primitive
ones, by their definitions."""
from __future__ import annotations

from dataclasses import replace

from ..algebra import BUILTINS
from ..ir import Call, Composite, Expr, Extent, Program, Reduce, transform


def _sum(indices, body):
    return Reduce(BUILTINS["sum"], indices, (body,))


def _count(indices) -> Expr:
    out = Extent(indices[0])
    for i in indices[1:]:
        out = Call("mul", (out, Extent(i)))
    return out


# One row per composite: (indices, argument) -> primitive expression.
LOWERINGS = {
    "mean": lambda ix, x: Call("div", (_sum(ix, x), _count(ix))),
    "logsumexp": lambda ix, x: Call("log", (_sum(ix, Call("exp", (x,))),)),
    # softmax keeps its index: the free occurrences in exp(x) are the kept index,
    # the ones inside the sum are bound by it.
    "softmax": lambda ix, x: Call("div", (Call("exp", (x,)), _sum(ix, Call("exp", (x,))))),
}


def _lower_node(e: Expr) -> Expr:
    if isinstance(e, Composite):
        return LOWERINGS[e.op](e.indices, e.arg)
    return e


def lower(program: Program) -> Program:
    return replace(program, statements=tuple(
        replace(s, expr=transform(s.expr, _lower_node)) for s in program.statements))
