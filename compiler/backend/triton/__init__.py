"""The "triton" backend: generated, fused Triton kernels.

    analysis.py  which statements share a kernel, grid and epilogue indices,
                 materialised reductions (names only, independent of sizes)
    emit.py      one kernel's source from templates: tiles, loops, folds
    ops.py       the operator emission table
    module.py    the whole module (kernels + launcher), split decisions, Plan
    backend.py   TritonBackend: signatures, runners, plans
    cache.py     the on-disk module cache and import

Source is generated once per signature (input kinds and dtypes, extents), and
the imported launcher is kept, so a repeated call costs a dict lookup, the
output allocation and the kernel launches.  CUDA tensors run compiled kernels;
CPU tensors run the same kernels under Triton's interpreter (slow; said once
with a warning).

The package imports nothing heavy: `TritonBackend` (and torch with it) loads on
first use, so the command line can read kernel plans without importing torch."""
from __future__ import annotations


def outline(program, outputs: tuple[str, ...], *, split: int | None = None):
    """The kernels for any sizes (sizes then choose tiles and automatic splits)."""
    from ...schedule import Kernel, Plan
    from .analysis import form, loops
    kernels = form(program, tuple(outputs), split).kernels
    return Plan("triton", tuple(Kernel(k.name, tuple(s.name for s in k.statements), k.why, loops(k))
                                for k in kernels),
                tuple(b for k in kernels for b in k.buffers))


def __getattr__(name: str):
    if name in ("TritonBackend", "auto_split"):
        from . import backend
        return getattr(backend, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = ["TritonBackend", "auto_split", "outline"]
