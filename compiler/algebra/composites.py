"""Composite reductions: defined by a formula over primitive reductions.

Each row gives the oracle's direct torch meaning (so that the `lower` pass is
tested against an independent implementation), whether the result keeps the
reduced index (softmax does, mean and logsumexp do not), and its reverse-mode
rule (read by passes/differentiate.py: the composite keeps its own adjoint, so
the max-shift of softmax and logsumexp contributes nothing).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable

from ..ir import COMPOSITES_KEEPING_INDEX, Call, Composite, Expr, Extent, Reduce
from .summary import BUILTINS

if TYPE_CHECKING:
    import torch


@dataclass(frozen=True, slots=True)
class CompositeRule:
    name: str
    # float64 meaning: (tensor, dims to reduce) -> tensor (dims kept with size 1 when keeps_index)
    torch: Callable[[torch.Tensor, tuple[int, ...]], torch.Tensor]
    # reverse mode: (g, out, node) -> the adjoint of node.arg, given the adjoint g of
    # the result (g varies over no index the result lacks) and `out`, the result
    # itself or a read of the statement that holds it
    adjoint: Callable[[Expr, Expr, Composite], Expr]

    @property
    def keeps_index(self) -> bool:
        return self.name in COMPOSITES_KEEPING_INDEX


def _softmax(x: torch.Tensor, dims: tuple[int, ...]) -> torch.Tensor:
    # A row whose every element is -inf has no mass: its softmax is 0/0 = NaN,
    # as torch.softmax gives and as the factorised form u / l gives.
    import torch
    if x.numel() == 0:      # no row, or rows of no element: nothing to normalise
        return x.clone()
    m = torch.amax(x, dim=dims, keepdim=True)
    w = torch.exp(x - m)
    return w / w.sum(dim=dims, keepdim=True)


def _mean(x: torch.Tensor, dims: tuple[int, ...]) -> torch.Tensor:
    return x.double().mean(dim=dims)


def _logsumexp(x: torch.Tensor, dims: tuple[int, ...]) -> torch.Tensor:
    import torch
    return torch.logsumexp(x.double(), dim=dims)


def _softmax_adjoint(g: Expr, p: Expr, node: Composite) -> Expr:
    # p * (g - sum_m p * g): the m of g and p inside the sum is the kept index
    weighted = Reduce(BUILTINS["sum"], node.indices, (Call("mul", (p, g)),))
    return Call("mul", (p, Call("sub", (g, weighted))))


def _mean_adjoint(g: Expr, out: Expr, node: Composite) -> Expr:
    count: Expr = Extent(node.indices[0])
    for i in node.indices[1:]:
        count = Call("mul", (count, Extent(i)))
    return Call("div", (g, count))


def _logsumexp_adjoint(g: Expr, out: Expr, node: Composite) -> Expr:
    # softmax recomputed from the argument rather than exp(x - out): the max it
    # subtracts is exact, where the rounded out loses digits at large logits
    return Call("mul", (g, Composite("softmax", node.indices, node.arg)))


COMPOSITES: dict[str, CompositeRule] = {
    r.name: r for r in [
        CompositeRule("softmax", _softmax, _softmax_adjoint),       # NaN on a row that is all -inf
        CompositeRule("mean", _mean, _mean_adjoint),
        CompositeRule("logsumexp", _logsumexp, _logsumexp_adjoint),
    ]
}
