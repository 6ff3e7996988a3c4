"""Random inputs for a program at given index sizes, and the error measure the
tests and the CLI report."""
from __future__ import annotations

import torch

from .ir import Access, Program, accesses
from .ops import BOOL, INT

DEFAULT_EXTENT = 16


def random_inputs(program: Program, sizes: dict[str, int], *, dtype=torch.float32, seed: int = 0,
                  device="cpu") -> dict[str, torch.Tensor | float]:
    """Standard-normal tensors for every input (numbers for rank-0 inputs), a
    random mask for an input read as a condition (bool), int64 positions inside the
    dimension an input read as a subscript gathers from (`T` of `E[T[i], d]`), the
    extent of a size input.  Indices sharing an extent take the size given for any of
    them."""
    symbols = dict(program.extents)
    by_symbol = {symbols[i]: n for i, n in sizes.items() if i in symbols}
    generator = torch.Generator().manual_seed(seed)
    inputs: dict[str, torch.Tensor | float] = {}
    for decl in program.inputs:
        if decl.name in program.sizes:            # a size input: the extent of the index it names
            inputs[decl.name] = by_symbol.get(program.sizes[decl.name], DEFAULT_EXTENT)
            continue
        if decl.rank == 0:
            inputs[decl.name] = float(torch.rand((), generator=generator)) + 0.5
            continue
        access = _first_access(program, decl.name)
        shape = [_dimension(program, access, d, by_symbol) for d in range(access.rank)]
        if decl.dtype == INT:
            inputs[decl.name] = torch.randint(0, max(1, _gathered_extent(program, decl.name, by_symbol)), shape,
                                              generator=generator).to(device)
            continue
        values = torch.randn(shape, generator=generator, dtype=torch.float64)
        inputs[decl.name] = (values > 0 if decl.dtype == BOOL else values.to(dtype)).to(device)
    return inputs


def _dimension(program: Program, access: Access, d: int, by_symbol: dict) -> int:
    """The extent of dimension `d` of the tensor `access` reads: its index's, or, at an
    affine subscript, one past the largest position it reads (the derived extents of
    its indices are then the sizes asked for)."""
    symbols = dict(program.extents)
    index = access.dimension_index(d)
    if index is not None:
        return by_symbol.get(symbols[index], DEFAULT_EXTENT)
    given = by_symbol.get(dict(program.dimensions)[f"{access.tensor}#{d}"])
    if given is not None:
        return given
    if access.gathered(d) is not None:
        return DEFAULT_EXTENT
    coeffs, constant = access.layout[d]
    sizes = [by_symbol.get(symbols[i], DEFAULT_EXTENT) for i in access.indices]
    if 0 in sizes:
        return 0
    return max(0, constant + 1 + sum(c * (n - 1) for c, n in zip(coeffs, sizes) if c > 0))


def _first_access(program: Program, name: str) -> Access:
    for st in program.statements:
        for node in accesses(st.expr):
            if node.tensor == name:
                return node
    raise KeyError(name)


def _gathered_extent(program: Program, name: str, by_symbol: dict) -> int:
    """The extent of the first dimension that input `name`'s values are positions in."""
    for st in program.statements:
        for node in accesses(st.expr):
            for d in range(node.rank):
                found = node.gathered(d)
                if found is not None and found[0].tensor == name:
                    return _dimension(program, node, d, by_symbol)
    return DEFAULT_EXTENT


def relative_error(got: torch.Tensor, want: torch.Tensor) -> float:
    """max |got - want| / max(max |want|, tiny), in float64; NaN/inf mismatches count as inf."""
    got, want = got.detach().to("cpu", torch.float64), want.detach().to("cpu", torch.float64)
    if got.numel() == 0:
        return 0.0
    same_special = (got == want) | (torch.isnan(got) & torch.isnan(want))
    if bool((~torch.isfinite(want) | ~torch.isfinite(got))[~same_special].any()):
        return float("inf")
    diff = torch.where(same_special, torch.zeros_like(got), got - want).abs().max()
    scale = want[torch.isfinite(want)].abs().max() if torch.isfinite(want).any() else torch.tensor(1.0)
    return float(diff / max(float(scale), 1e-30))
