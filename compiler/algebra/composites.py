"""Composite reductions: defined by a formula over primitive reductions.

Each row gives the oracle's direct torch meaning (so that the `lower` pass is
tested against an independent implementation) and whether the result keeps the
reduced index (softmax does, mean and logsumexp do not).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable

if TYPE_CHECKING:
    import torch


@dataclass(frozen=True, slots=True)
class CompositeRule:
    name: str
    keeps_index: bool
    # float64 meaning: (tensor, dims to reduce) -> tensor (dims kept with size 1 when keeps_index)
    torch: Callable[[torch.Tensor, tuple[int, ...]], torch.Tensor]


def _softmax(x: torch.Tensor, dims: tuple[int, ...]) -> torch.Tensor:
    # A row whose every element is -inf has no mass: its softmax is 0/0 = NaN,
    # as torch.softmax gives and as the factorised form u / l gives.
    import torch
    m = torch.amax(x, dim=dims, keepdim=True)
    w = torch.exp(x - m)
    return w / w.sum(dim=dims, keepdim=True)


def _mean(x: torch.Tensor, dims: tuple[int, ...]) -> torch.Tensor:
    return x.double().mean(dim=dims)


def _logsumexp(x: torch.Tensor, dims: tuple[int, ...]) -> torch.Tensor:
    import torch
    return torch.logsumexp(x.double(), dim=dims)


COMPOSITES: dict[str, CompositeRule] = {
    r.name: r for r in [
        CompositeRule("softmax", True, _softmax),       # NaN on a row that is all -inf
        CompositeRule("mean", False, _mean),
        CompositeRule("logsumexp", False, _logsumexp),
    ]
}
