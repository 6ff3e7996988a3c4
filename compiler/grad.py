"""compiler.grad: the gradient program of a program, compiled like any program.

The forward program is parsed and checked, differentiated in index notation
(passes/differentiate.py), printed, and the printed text is compiled through
the normal pipeline: the gradient program is an ordinary einfold program.
"""
from __future__ import annotations

from collections.abc import Iterable

from .arguments import check_options, check_source, checked_outputs, checked_user_summaries, checked_wrt
from .check import check
from .config import deep
from .errors import BindError, CheckError
from .ir import format_program
from .ops import FLOAT
from .parse import parse
from .passes.differentiate import Statistics, differentiate, read_outputs, read_saved, statistics
from .program import Program


class GradientProgram(Program):
    """A gradient program made by `compiler.grad`.

    A `Program` whose source is the derived backward program. A call takes the
    forward inputs and one upstream gradient `d<Output>` per float output;
    inputs its statements do not read (a gradient that does not depend on
    them) are accepted and ignored.

    Attributes:
        wrt: the inputs whose gradients it returns, in order (`outputs` names
            them: `d<Input>` each).
        upstream: the name of each float output's upstream gradient input
            (`{"O": "dO"}`).
        inputs: the names a call takes: the forward inputs, then the upstream
            gradients, then (`saved=True`) the forward outputs it reads and the
            saved statistics.
        saved: the statistics it reads instead of recomputing them
            (`grad(..., saved=True)`), as the statements that compute them from
            the forward inputs (`lse_O[i] = logsumexp[m](...)`); empty
            otherwise.
        unsaved: for each softmax it recomputes although the forward has it
            (`saved=True`), why its statistic cannot be saved.

    A name that the forward program uses already takes the first free suffix:
    the upstream gradient of `O` in a program with an input `dO` is `dO_1`.
    """

    def __init__(self, source: str, *, wrt: tuple[str, ...], upstream: dict[str, str],
                 inputs: tuple[str, ...], statistics: Statistics = Statistics((), ()), **kwargs):
        super().__init__(source, **kwargs)
        self.wrt = wrt
        self.upstream = upstream
        self.inputs = inputs
        self.saved = statistics.saved
        self.unsaved = statistics.unsaved
        # the saved statistics (float32 beside bf16 inputs, as the saving forward stores
        # them) leave the gradients and their tensor-core operands in bf16
        self.statistic_inputs = frozenset(s.name for s in self.saved)

    def _specialised(self, types: tuple[tuple[str, str], ...]) -> Program:
        """As Program's, but an integer tensor for an input it is the gradient with
        respect to is refused: an integer input has no gradient."""
        for name, _ in types:
            if name in self.wrt:
                decl = next(i for i in self.checked.inputs if i.name == name)
                raise BindError(f"input '{name}' is an integer tensor, which has no gradient, but this is the "
                                f"gradient program with respect to {', '.join(self.wrt)}; make it with wrt= "
                                f"naming float inputs only", self.checked.source, decl.span)
        return super()._specialised(types)

    def _read(self, inputs: dict) -> dict:
        declared = {i.name for i in self.checked.inputs}
        return {k: v for k, v in inputs.items() if k in declared or k not in self.inputs}

    def __call__(self, *args, **inputs):
        return super().__call__(*args, **self._read(inputs))

    def plan(self, *args, **inputs):
        return super().plan(*args, **self._read(inputs))


def grad(source: str, wrt: Iterable[str] | str | None = None, outputs: Iterable[str] | str | None = None,
         backend: str = "auto", saved: bool = False, **options) -> GradientProgram:
    """Compile the gradient program of `source`.

    Args:
        source: the forward program.
        wrt: the inputs to differentiate with respect to, in the order the
            gradients come back (default: every tensor input, i.e. every input
            read with indices; a 0-d input only when named here).
        outputs: the forward outputs the gradients flow from (default: the
            program's outputs); an int or predicate output carries none.
        backend: as for `compile`: `"auto"`, `"triton"` or `"reference"`.
        saved: read each softmax it needs as `exp(x - L)` from its saved
            statistic `L = logsumexp[I](x)`, an extra input `lse_<Statement>`
            (the program's `saved` gives the statements that compute them from
            the forward inputs), instead of recomputing its normaliser, and
            read a forward output (an extra input named like it) where it would
            fold that output again (a softmax's rowsum(dO * O)): the backward
            that a call under torch autograd runs. Default: recompute.
        **options: as for `compile` (`summaries=`, `split=`).

    Returns:
        A `GradientProgram`: call it with the forward inputs plus `d<O>`, the
        upstream gradient of each float output O (indexed like O); it returns
        `d<X>` for each X in `wrt`, in that order (one tensor for one input);
        with `saved=True` it also takes the statistics named in its `saved` and
        the forward outputs its `inputs` name.
        A name the program uses already takes a suffix (`dO_1`); the
        program's `upstream` and `outputs` say which.

    Raises:
        ParseError, CheckError: the program is not valid, a name in `wrt` is not
            an input, or a summary on a gradient's path has no derivative.

    Example:
        ```python
        backward = compiler.grad("C[i,j] = A[i,k] * B[k,j]")
        dA, dB = backward(A=a, B=b, dC=torch.ones(3, 5))
        ```
    """
    check_options(options)
    check_source(source)
    summaries = checked_user_summaries(options.pop("summaries", ()))
    wanted = checked_outputs(outputs)
    forward = deep(lambda: check(parse(source), outputs=wanted, summaries=summaries), what="the program",
                   source=source)
    names = checked_wrt(wrt, forward)
    statements = {s.name: s for s in forward.statements}
    flowing = tuple(o for o in forward.outputs if statements[o].dtype == FLOAT)
    backward, found = derive(forward, names, flowing, saved)
    upstream = dict(zip(flowing, (i.name for i in backward.inputs[len(forward.inputs):])))
    if summaries:
        options["summaries"] = tuple(summaries.values())
    return GradientProgram(format_program(backward), wrt=names, upstream=upstream,
                           inputs=tuple(i.name for i in backward.inputs), statistics=found,
                           outputs=backward.outputs, backend=backend, **options)


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
    return read_saved(backward, found.saved), found


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


__all__ = ["grad", "GradientProgram"]
