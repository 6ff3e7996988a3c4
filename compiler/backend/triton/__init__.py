"""The "triton" backend: generated, fused Triton kernels.

The backend runs a Schedule (compiler.schedule decides kernels, grids, loops
and buffers for any sizes, and the tile and split policy); per signature it
evaluates the policy's tiles and splits:

    emit.py      one kernel's source from templates: tiles, loops, folds
    hopper.py    the Hopper form (sm_90, Gluon) of a streamed rescaled fold
    ops.py       the operator emission table
    tuning.py    autotune candidates (the schedule's tables), complete configs
    records.py   tuning records: the autotuner's choices, saved and loaded
    module.py    the whole module (kernels + launcher), splits, Plan
    backend.py   TritonBackend: signatures, runners, plans
    cache.py     the on-disk module cache and import
    launch.py    the hot path: compiled kernels launched without Triton's binder

Source is generated once per signature (input kinds and dtypes, extents), and
the imported launcher is kept, so a repeated call costs a dict lookup, the
output allocation and the kernel launches (each a direct call of the compiled
kernel once its first launch has bound it: launch.py).  CUDA tensors run compiled kernels;
CPU tensors run the same kernels under Triton's interpreter (slow; said once
with a warning).

The package imports nothing heavy: `TritonBackend` (and torch with it) loads on
first use, so the command line can read kernel plans without importing torch."""
from __future__ import annotations


def outline(program, outputs: tuple[str, ...], *, split: int | None = None, **options):
    """The kernels for any sizes (sizes then choose tiles and automatic splits)."""
    from ...schedule import schedule
    return schedule(program, tuple(outputs), split).outline("triton")


def outline_of(program):
    """The kernels of a compiled Program for any sizes, from its schedule."""
    return program.schedule.outline("triton")


def __getattr__(name: str):
    if name == "TritonBackend":
        from . import backend
        return getattr(backend, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = ["TritonBackend", "outline", "outline_of"]
