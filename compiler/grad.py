"""The gradient program of a program, as IR: the derivation behind compiler.grad.

A checked forward program is differentiated in index notation
(passes/differentiate.py) into a backward program, an ordinary einfold program:
`grad` (program.py) prints it and compiles the text through the normal
pipeline as a GradientProgram.  `saving_forward` finds the statistics that the
forward a call under autograd runs saves for its backward.
"""
from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from .arguments import checked_wrt
from .errors import CheckError
from .ir import Program
from .ops import FLOAT
from .passes.differentiate import (Statistics, anchor_extents, differentiate, read_outputs, read_saved,
                                  statistics)


@dataclass(frozen=True)
class Gradient:
    """A forward program's gradient program, and what its GradientProgram reports of it.

    Attributes:
        backward: the gradient program (IR).
        wrt: the inputs whose gradients it returns, in order.
        upstream: the name of each float output's upstream gradient input.
        statistics: the statistics it reads (`saved`) and why others are recomputed.
    """

    backward: Program
    wrt: tuple[str, ...]
    upstream: dict[str, str]
    statistics: Statistics


def gradient_of(forward: Program, wrt: Iterable[str] | str | None, saved: bool) -> Gradient:
    """The gradient program of `forward` (checked IR) with respect to the inputs
    `wrt` names (arguments.checked_wrt: every tensor input where None), from its
    float outputs, reading saved statistics where `saved` (see `derive`)."""
    names = checked_wrt(wrt, forward)
    statements = {s.name: s for s in forward.statements}
    flowing = tuple(o for o in forward.outputs if statements[o].dtype == FLOAT)
    backward, found = derive(forward, names, flowing, saved)
    upstream = dict(zip(flowing, (i.name for i in backward.inputs[len(forward.inputs):])))
    return Gradient(backward, names, upstream, found)


def derive(forward, wrt: tuple[str, ...], outputs: tuple[str, ...], saved: bool):
    """The gradient program of `forward` (checked IR), reading the saved
    statistics and the forward outputs it would otherwise fold again (the
    softmax adjoint's rowsum(dO * O)) where `saved`, and those statistics."""
    if not isinstance(saved, bool):
        raise CheckError(f"saved= takes True or False, not {type(saved).__name__} {saved!r}")
    backward = differentiate(forward, wrt, outputs)
    if not saved:
        return backward, Statistics((), ())
    found = statistics(forward, backward)
    backward, _ = read_outputs(backward, forward)      # before the softmaxes become exp(x - L)
    return anchor_extents(read_saved(backward, found.saved), forward), found


def saving_forward(forward) -> Statistics:
    """What the forward (checked IR) saves for any of its gradient programs: the
    statistics the backward with respect to every input reads (none where a
    summary without a derivative is on a path: that backward recomputes)."""
    statements = {s.name: s for s in forward.statements}
    flowing = tuple(o for o in forward.outputs if statements[o].dtype == FLOAT)
    wrt = tuple(i.name for i in forward.inputs if i.dtype == FLOAT)
    if not flowing or not wrt:
        return Statistics((), ())
    try:
        return statistics(forward, differentiate(forward, wrt, flowing))
    except CheckError:
        return Statistics((), ())


__all__ = ["Gradient", "gradient_of", "derive", "saving_forward"]
