"""Tuning ahead of time: a program run on a CUDA GPU at the shapes it will see,
so that each of its tuned kernels makes its choice now.  The choices are this
process's tuning records (compiler/backend/triton/records.py), which
`save_tuning` writes to a file that machines of the same GPU model load instead
of timing the candidates again."""
from __future__ import annotations

from collections.abc import Iterable, Mapping

from .errors import TuningError


def tune(program, shapes: Iterable[Mapping[str, int]], *, dtype=None) -> None:
    """Run `program` (a `Program` on the triton backend) once at each shape of
    `shapes`, each a mapping index -> extent that gives every index of the program
    (an index of the same extent as one given may be left out), on random CUDA
    inputs with floats of `dtype` (default `torch.float32`), so that each tuned
    kernel it launches is tuned for the shape classes of these shapes.  Then
    `compiler.save_tuning(path)` writes the choices.  It runs the forward program
    only: to tune a backward, tune its `compiler.grad` program.  Without a CUDA
    GPU, or with shapes that do not fit the program, a `TuningError`."""
    import torch

    from .random_inputs import random_inputs
    if not torch.cuda.is_available():
        raise TuningError("tuning times each kernel's candidates on a CUDA GPU, and this machine has none")
    if program.backend.name != "triton":
        raise TuningError(f"the program runs on the {program.backend.name} backend, which has nothing to "
                          f"tune: compile it with backend='triton'")
    sizes = [shape_sizes(program, shape) for shape in shapes]
    for extents in sizes:
        inputs = random_inputs(program.checked, extents, dtype=dtype or torch.float32, device="cuda")
        program(**inputs)
    torch.cuda.synchronize()


def shape_sizes(program, shape: Mapping[str, int]) -> dict[str, int]:
    """`shape` as the extents of `program`'s indices, checked: only its indices,
    each a positive integer, and one extent for each (indices of one extent share
    it); a TuningError naming what does not fit."""
    shown = ", ".join(f"{name}={extent}" for name, extent in shape.items())
    symbol_of = dict(program.checked.extents)
    unknown = [name for name in shape if name not in symbol_of]
    if unknown:
        raise TuningError(f"the shape {shown} names no index of the program: {', '.join(map(str, unknown))}")
    for name, extent in shape.items():
        if type(extent) is not int or extent < 1:
            raise TuningError(f"the shape {shown} gives {name} the extent {extent!r}, not a positive integer")
    given = {symbol_of[name] for name in shape}
    missing = [name for name, symbol in program.checked.extents if symbol not in given]
    if missing:
        raise TuningError(f"the shape {shown} gives no extent for {', '.join(missing)} (a shape gives every "
                          f"index of the program an extent)")
    return dict(shape)
