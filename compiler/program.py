"""The public entry points: compile(source) -> Program, a callable on tensors,
and grad(source) -> GradientProgram, its derived backward.

A Program is a compiled program (compiled.py) made from source, with what a
call under torch needs: the custom op that autograd, torch.compile and
torch.func see (autograd.py), the gradient programs its backward runs
(derived by grad.py), a leading batch index for torch.vmap, sharding across
ranks (distributed.py) and the derivation as text (explain.py).
"""
from __future__ import annotations

from dataclasses import replace
from functools import cached_property
from collections.abc import Iterable
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

from . import backend as backends, config
from .algebra import Summary
from .arguments import SCHEDULE_OPTIONS, check_options, check_source, checked_outputs, checked_user_summaries
from .check import check
from .compiled import CompiledProgram, choose_triton_interpreter, passes_of
from .config import deep
from .errors import BackendError, BindError, EinfoldError, TransformError
from .explain import explain
from .grad import gradient_of, saving_forward
from .ir import Access, Program as IRProgram, format_program, format_statement, reads, transform, unused_name
from .parse import deepest_statement, parse
from .passes.differentiate import Statistics


class Program(CompiledProgram):
    """A compiled program: call it with its inputs by keyword.

    `compile(source, ...)` makes one. A call binds the inputs (a tensor with one
    dimension per index of its access for each tensor input, a number or 0-d
    tensor for each 0-d input), checks their ranks, dtypes, devices and
    extents, and runs the backend. A later call with inputs of the same shapes,
    dtypes and devices reuses the first call's kernels.

    Attributes:
        text: the source text.
        checked: the checked IR (every reduction explicit), before the passes.
        factorised: the IR after the passes (compiler.passes.PIPELINE).
        trace: (stage, IR) for check and each pass in order, as compiled
            (`explain` reads it; nothing runs twice).
        schedule: the schedule stage's Schedule IR (made on first use):
            kernels, grids, streamed loops with their bounds, buffers, for
            any sizes; `print(program.schedule)` shows it.
        outputs: the names of the statements a call returns, in statement order.
    """

    def __init__(self, source: str, *, outputs: Iterable[str] | None = None, backend: str = "auto",
                 checked: IRProgram | None = None, **options):
        check_options(options)
        check_source(source)
        summaries = checked_user_summaries(options.get("summaries", ()))
        self.backend_name = backends.check_name(backend)
        split = options.get("split")
        if split is not None and (isinstance(split, bool) or not isinstance(split, int) or split < 1):
            raise BackendError(f"split must be a positive integer (or None for the default), not {split!r}")
        wanted = checked_outputs(outputs)
        wide = options.get("float32_outputs", ())
        if isinstance(wide, str) or not all(isinstance(n, str) for n in wide):
            raise EinfoldError(f"float32_outputs= takes a list of output names, not {wide!r}")
        self.text = source
        if checked is not None:
            # IR made by a rewrite (a derived gradient) whose extents its text alone cannot fix
            self.trace = deep(lambda: passes_of(checked), what="the program", source=source)
        else:
            syntax = parse(source)          # iterative; enforces config's size limits
            # Checking and the passes recurse over expressions: deep() reruns them on a
            # large stack when the default one is too small (compiler/config.py).
            where = deepest_statement(syntax)
            self.trace = deep(lambda: _front_end(syntax, wanted, summaries), what="the program", source=source,
                              span=where.span if where is not None else None)
        self.checked, self.factorised = self.trace[0][1], self.trace[-1][1]
        self.outputs = self.checked.outputs
        if set(wide) - set(self.outputs):
            raise EinfoldError(f"float32_outputs= names {', '.join(sorted(set(wide) - set(self.outputs)))}, "
                               f"which {'is' if len(set(wide) - set(self.outputs)) == 1 else 'are'} not among "
                               f"the outputs ({', '.join(self.outputs)})")
        options = {**options, "float32_outputs": tuple(wide)} if wide else options
        self.schedule_options = {k: v for k, v in options.items() if k in SCHEDULE_OPTIONS}
        # what a gradient program of this one is compiled with (summaries already checked)
        self._options = dict(self.schedule_options)
        if summaries:
            self._options["summaries"] = tuple(summaries.values())
        if self.backend_name == "triton":
            choose_triton_interpreter()
        self._start_runtime()

    def __prepare_scriptable__(self):
        """What torch.jit.script asks of an object before compiling it: TorchScript
        cannot compile a program (keyword inputs, kernels launched from Python)."""
        raise TransformError("torch.jit.script cannot compile an einfold program (its inputs are keywords and "
                             "its kernels launch from Python); use torch.compile, or torch.jit.trace over a "
                             "function that calls the program (it records the program's custom op)")

    def __call__(self, *args, **inputs) -> torch.Tensor | tuple[torch.Tensor, ...]:
        """Run the program on `inputs`, one keyword per input name.

        Returns:
            The output tensor, or a tuple of them in statement order when the
            program has several outputs.

        When torch's grad mode is on and a tensor input requires grad, the
        outputs carry a `grad_fn`: `backward()` runs the compiled gradient
        program (`compiler.grad`, same backend, compiled once per set of inputs
        that require grad) and fills `.grad` of exactly those inputs. Such a
        call, and a call that `torch.compile` traces, runs as a torch custom
        op (`compiler/autograd.py`).

        Raises:
            BindError: an input is missing or unexpected, or has the wrong rank,
                dtype or device, or an extent that disagrees with another.
        """
        if args:
            self._positional_error(args)
        # torch loads at the first call, autograd.py (and in shard, distributed.py) where one
        # needs it: `import compiler` and the CLI's parse, ir and explain stay free of torch
        import torch
        if torch.compiler.is_compiling():       # traced: no per-call bookkeeping (the op does it when it runs)
            from .autograd import call_op
            return call_op(self, inputs)
        key, requires_grad = self._key_of(inputs)
        if self.binder.gathered and config.check_positions():
            self.binder(inputs)     # checked mode: every call's gathered positions (a cached runner binds none)
        transformed = _transformed(torch)
        if transformed or requires_grad and torch.is_grad_enabled():
            from .autograd import call_op
            return call_op(self, inputs, None if transformed else key)     # an eager call: by its key
        return self._run(inputs, key)

    def _gradient(self, wrt: tuple[str, ...], saved: bool = False) -> GradientProgram:
        """The gradient program for inputs `wrt`, reading the statistics that
        `_saving` saves where `saved` (compiled on first use, then kept)."""
        program = self._gradients.get((wrt, saved))
        if program is None:
            # a gradient takes its input's dtype, whichever outputs are float32 here
            options = {k: v for k, v in self._options.items() if k != "float32_outputs"}
            program = self._gradients[wrt, saved] = grad(self.text, wrt=wrt, outputs=self.outputs,
                                                         backend=self.backend_name, saved=saved, **options)
        return program

    def _batched(self, inputs: tuple[str, ...]) -> tuple[Program, str]:
        """This program with a leading batch index on the tensor `inputs` and on every
        statement that reads one, directly or through another statement (compiled on
        first use, then kept), and the batch index's name: torch.vmap's rule runs it
        once for the whole batch (compiler/autograd.py), no loop over its items."""
        found = self._batches.get(inputs)
        if found is None:
            ir, index = _with_batch_index(self.checked, frozenset(inputs))
            program = Program(deep(lambda: format_program(ir), what="the program", source=self.text),
                              outputs=self.outputs, backend=self.backend_name, **self._options)
            found = self._batches[inputs] = (program, index)
        return found

    @cached_property
    def _saving(self) -> Program:
        """The forward that a call under autograd runs: this program plus one
        output `lse_<Statement>[rows] = logsumexp[I](x)` per softmax[I](x) that
        its gradient programs read (the statistic shares the softmax's fold:
        same kernels), and one per row fold they would fold again (a norm's
        mean and variance, `<op>_<Statement>[rows]`);
        this program itself when there is none."""
        found = deep(lambda: saving_forward(self.checked), what="the program", source=self.text)
        if not found.saved:
            return self
        text = self.text.rstrip() + "\n" + "".join(format_statement(s) + "\n" for s in found.saved)
        return Program(text, outputs=(*self.outputs, *(s.name for s in found.saved)), backend=self.backend_name,
                       **{**self._options, "float32_outputs": (*self._options.get("float32_outputs", ()),
                                                               *(s.name for s in found.saved))})

    def shard(self, index: str, group=None, layout: str = "contiguous", rows: str | None = None):
        """This program with the reduction over `index` sharded across the ranks
        of a torch.distributed process group (None: the default group): each
        rank passes the inputs with only its own part of `index` (`layout`
        "contiguous": rank r holds the r-th of W parts; "zigzag": rank r holds
        parts r and 2W - 1 - r of 2W, which balances a causal mask; "balanced":
        zigzag where a mask bounds `index` by another index, else contiguous,
        read back as the result's `layout`), and gets
        the whole of each output that does not vary over `index` and its part
        of the others.  Each rank summarises its parts, the states are
        all-gathered, and each rank merges them in order with the summary's
        own combine (`compiler/distributed.py`, `compiler/passes/shard.py`).

        Under autograd, `backward()` runs the gradient program sharded the same
        way: an input indexed by `index` gets the gradient of its part, the
        others the whole gradient.

        `rows` (context parallelism): an index of the outputs sharded as well,
        in the same layout (the queries of attention).  Each rank then passes
        its part of the rows too, and of the tensors over `index` (K, V), which
        travel around a ring of the ranks while each rank summarises its rows
        against every part; it gets its rows of each output.  No states are
        exchanged.  A tensor may be indexed by `rows` or by `index`, not both;
        outputs vary over the rows, not over `index`.  Its backward is two
        rings: gradients over the rows on this one, gradients over `index` on
        one where the inputs over the rows travel (deterministic: inputs are
        exchanged, states merged in order).

        Raises:
            ShardError: the program has no reduction over `index`, or one such
                reduction sits inside another; with `rows`, a reduction over
                the rows, a tensor over both indices or an output over `index`,
                and under autograd an input read at neither index.
        """
        from .distributed import ShardedProgram
        return ShardedProgram(self, index, group, layout, rows)

    def explain(self) -> str:
        """The derivation, pass by pass, as text (what `einfold explain`
        prints): the checked program, the IR after each pass that changed it,
        each derived summary (fields, identity, lift, merge, how it was
        derived, its checked laws), the results from the final states, and the
        backend's plan."""
        return deep(lambda: explain(self), what="the program", source=self.text)


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

    def _specialised(self, types: tuple[tuple[str, str], ...]) -> GradientProgram:
        """As CompiledProgram's, but an integer tensor for an input it is the gradient with
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


def _with_batch_index(ir: IRProgram, batched: frozenset[str]) -> tuple[IRProgram, str]:
    """`ir` with a fresh leading index on every access of the tensors `batched` and on
    every statement that reads one (its accesses by later statements with it), and
    that index's name."""
    index = unused_name("batch", {i for i, _ in ir.extents} | {i.name for i in ir.inputs}
                        | {s.name for s in ir.statements})
    wide = set(batched)

    def rows(layout, width: int, batched: bool) -> tuple:
        """`layout` (coefficients over `width` indices) over the indices with the batch index
        first: a column of zeros, and a leading dimension read at it where the tensor is batched."""
        first = (((1,) + (0,) * width, 0),) if batched else ()
        return (*first, *(((0, *coeffs), c) for coeffs, c in layout))

    def widen(e):
        if not isinstance(e, Access) or not ({e.tensor} | {g.tensor for g in e.gathers or () if g}) & wide:
            return e
        if e.layout is None:
            return replace(e, indices=(index, *e.indices))
        gathers = None if e.gathers is None else (
            *((None,) if e.tensor in wide else ()),
            *(g and replace(g, layout=rows(g.layout, len(e.indices), g.tensor in wide)) for g in e.gathers))
        return replace(e, indices=(index, *e.indices), layout=rows(e.layout, len(e.indices), e.tensor in wide),
                       gathers=gathers)

    statements = []
    for st in ir.statements:
        if reads(st.expr) & wide:
            st = replace(st, indices=(index, *st.indices), expr=transform(st.expr, widen))
            wide.add(st.name)
        statements.append(st)
    # an affine subscript's dimension of a widened tensor moves one place on
    dimensions = tuple((f"{t}#{int(d) + 1}" if t in wide else f"{t}#{d}", symbol)
                       for (t, d), symbol in ((key.rsplit("#", 1), symbol) for key, symbol in ir.dimensions))
    return replace(ir, statements=tuple(statements), dimensions=dimensions), index


def _transformed(torch) -> bool:
    """Whether a torch transform or tracer sees this call: functorch (vmap, func.grad,
    func.jvp), a forward-mode AD dual level, torch.jit.trace.  Such a call goes through
    the program's custom op (compiler/autograd.py): torch transforms that, or einfold
    refuses naming the transform, where running the kernels on the wrapped tensors
    would fail or lose the transform."""
    return (torch._C._functorch.maybe_current_level() is not None or torch._C._is_tracing()
            or torch.autograd.forward_ad._current_level >= 0)


def _front_end(syntax, outputs, summaries) -> tuple[tuple[str, IRProgram], ...]:
    """The trace of the front end: ("check", IR), then (pass name, IR) per pass."""
    return passes_of(check(syntax, outputs=outputs, summaries=summaries))


def compile(source: str, *, outputs: Iterable[str] | None = None, backend: str = "auto",
            **options) -> Program:
    """Parse, check and compile `source` for `backend`.

    Args:
        source: the program: one or more statements in index notation,
            separated by newlines or `;` (see the language reference).
        outputs: the statements a call returns, in statement order
            (default: the statements that no later statement reads).
        backend: `"auto"` (Triton kernels; on CPU tensors under Triton's
            interpreter), `"triton"`, or `"reference"` (the float64 oracle).
        **options: `summaries=[...]`: user summaries (`compiler.summary`)
            usable by name in the program; `split=N`: force a split count on
            every reduction (a schedule option of the Triton backend).

    Returns:
        A `Program`; call it with the inputs by keyword.

    Raises:
        ParseError: the text is not a program.
        CheckError: the program means nothing (an unknown name, a bad index, a type error).
        LawError: a user summary breaks a monoid law.
        BackendError: an unknown backend.
        LimitError: the program passes a documented size or depth limit.
        EinfoldError: an unknown option.

    Example:
        ```python
        attention = compiler.compile(
            "O[i,j] = softmax[m](Q[i,k] * K[m,k] * scale) * V[m,j]")
        out = attention(Q=q, K=k, V=v, scale=0.125)
        ```
    """
    return Program(source, outputs=outputs, backend=backend, **options)


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
    derived = gradient_of(forward, wrt, saved)
    if summaries:
        options["summaries"] = tuple(summaries.values())
    backward = derived.backward
    # Where affine subscripts read tensors, the text cannot say every extent the derivation
    # knows (a pooling window's size, a position the forward derived): the IR is compiled, its
    # spans (into the forward's source) dropped, and the text is what it prints
    checked = _without_spans(backward) if backward.dimensions or backward.derived else None
    return GradientProgram(format_program(backward), wrt=derived.wrt, upstream=derived.upstream,
                           inputs=tuple(i.name for i in backward.inputs), statistics=derived.statistics,
                           outputs=backward.outputs, backend=backend, checked=checked, **options)


def _without_spans(program: IRProgram) -> IRProgram:
    """`program` with no node pointing into a source: its text is not the one they point into."""
    def unspanned(e):
        return replace(e, span=None) if getattr(e, "span", None) is not None else e
    statements = tuple(replace(s, expr=transform(s.expr, unspanned), span=None) for s in program.statements)
    return replace(program, statements=statements, inputs=tuple(replace(i, span=None) for i in program.inputs),
                   source=format_program(program))


__all__ = ["Program", "compile", "GradientProgram", "grad", "Summary"]
