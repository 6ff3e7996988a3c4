"""The public entry point: compile(source) -> Program, a callable on tensors."""
from __future__ import annotations

import itertools
import os
import sys
import weakref
from functools import cached_property
from collections.abc import Iterable
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

    from .bind import Binding

from . import backend as backends
from .algebra import Summary
from .arguments import (LEAST_POSITIVE, MOST_POSITIVE, SCHEDULE_OPTIONS, check_options, check_source, checked_outputs,
                        checked_user_summaries, number_input)
from .check import check
from .config import deep
from .errors import BackendError, BindError, EinfoldError, TransformError
from .ir import Program as IRProgram
from .parse import deepest_statement, parse
from .passes import run_pipeline
from .schedule import Plan, Schedule

# Live programs by key: torch.compile passes a program's key, a string it can
# keep as a constant, to the code that names its custom op (compiler/autograd.py)
LIVE: weakref.WeakValueDictionary[str, Program] = weakref.WeakValueDictionary()
_keys = itertools.count()


class Program:
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
                 **options):
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
            _choose_triton_interpreter()
        self._start_runtime()

    # What a process makes for itself, never pickled: runners (loaded kernels), compiled
    # gradient programs, custom ops, the key torch.compile names the program by, and what
    # the cached properties made on first use; an unpickled program makes them again.
    _PER_PROCESS = frozenset(("_runners", "_gradients", "_batches", "_ops", "_key", "schedule", "backend", "binder",
                              "_saving", "_variants", "_last_typed", "_sizes"))

    def __getstate__(self) -> dict:
        return {k: v for k, v in self.__dict__.items() if k not in self._PER_PROCESS}

    def __setstate__(self, state: dict) -> None:
        self.__dict__.update(state)
        if self.backend_name == "triton":
            _choose_triton_interpreter()
        self._start_runtime()

    def __prepare_scriptable__(self):
        """What torch.jit.script asks of an object before compiling it: TorchScript
        cannot compile a program (keyword inputs, kernels launched from Python)."""
        raise TransformError("torch.jit.script cannot compile an einfold program (its inputs are keywords and "
                             "its kernels launch from Python); use torch.compile, or torch.jit.trace over a "
                             "function that calls the program (it records the program's custom op)")

    def _start_runtime(self) -> None:
        self._runners: dict[tuple, object] = {}
        # (wrt, saved statistics read or recomputed) -> compiled gradient program
        self._gradients: dict[tuple[tuple[str, ...], bool], Program] = {}
        self._batches: dict[tuple[str, ...], tuple[Program, str]] = {}     # see _batched()
        self._ops: dict[tuple[str, ...], object] = {}            # argument kinds -> torch custom op
        self._variants: dict[tuple[tuple[str, str], ...], Program] = {}     # see _specialised()
        self._last_typed = self         # the program that the last call ran (_typed): its source is shown
        # size inputs (an index only on the left takes its extent from the call): their value keys a runner
        self._sizes = frozenset(self.checked.sizes)
        self._key = f"program_{next(_keys)}"
        LIVE[self._key] = self

    @classmethod
    def _of_ir(cls, ir: IRProgram, backend: str, **schedule_options) -> Program:
        """A program that a rewrite built as factorised IR (there is no source of
        it to parse): the local and merge programs of a sharded reduction."""
        from .ir import format_program
        self = cls.__new__(cls)
        self.text = format_program(ir)
        self.backend_name = backend
        self.checked = self.factorised = ir
        self.trace = (("rewrite", ir),)
        self.outputs = ir.outputs
        self.schedule_options = dict(schedule_options)
        self._options = dict(schedule_options)
        self._start_runtime()
        return self

    @cached_property
    def schedule(self) -> Schedule:
        """The schedule stage's result (compiler.schedule): the kernels, their grids,
        streamed loops and buffers, for any sizes.  It walks the program
        recursively, so it is made under deep()."""
        from .schedule import schedule
        return deep(lambda: schedule(self.factorised, self.outputs, self.schedule_options.get("split")),
                    what="the program", source=self.text)

    @cached_property
    def backend(self):
        """The backend object (made on first use: it imports torch and Triton)."""
        return backends.choose(self.backend_name).for_program(self)

    # inputs that do not set the dtype of float results (a gradient program's statistics)
    statistic_inputs: frozenset = frozenset()

    @cached_property
    def binder(self):
        """Checks inputs at call time (made on first use: it needs torch)."""
        from .bind import Binder
        return Binder(self.checked, extents_of=self.factorised, statistics=self.statistic_inputs)

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
        import torch
        if torch.compiler.is_compiling():       # traced: no per-call bookkeeping (the op does it when it runs)
            from .autograd import call_op
            return call_op(self, inputs)
        key, requires_grad = self._key_of(inputs)
        if requires_grad and torch.is_grad_enabled() or _transformed(torch):
            from .autograd import call_op
            return call_op(self, inputs)
        return self._run(inputs, key)

    def _key_of(self, inputs: dict) -> tuple[tuple, bool]:
        """(the runner key of `inputs`: each tensor's shape, dtype and device, each
        number's type; whether a tensor requires grad), in one pass over them: a
        cached call's host time is mostly such bookkeeping.  Each tensor is made
        readable in `inputs` (bind.readable: a lazily negated view is resolved), and
        its layout keys the runner (a sparse tensor goes to the binder, which refuses
        it).  The key is flat (name, shape, dtype, device, layout, name, ...): Python
        hashes a tuple's items on every lookup, and tuples nested in it again (on
        the CPU here 4.4 -> 2.5 us for attention's key and its lookup; resolving and
        the layout add about 0.4 us).  Numbers are converted to the float64
        scalars they run as, in `inputs`; a number's key is whether it is a
        positive factor (arguments.positive_number: kernels are specialised on that),
        a size input's its value (an extent)."""
        import torch
        key, requires_grad = [], False
        for name, v in inputs.items():
            if isinstance(v, torch.Tensor):
                if v.is_neg():          # bind.readable, inline (a call's host time)
                    v = inputs[name] = v.resolve_neg()
                key += (name, v.shape, v.dtype, v.device, v.layout)
                requires_grad = requires_grad or v.requires_grad
            else:
                if type(v) is not float:            # numbers run as float64 scalars
                    v = inputs[name] = number_input(self.checked, name, v)
                if name in self._sizes:
                    key += (name, v)                # a size input: an extent
                else:
                    key += (name, LEAST_POSITIVE <= v <= MOST_POSITIVE) if type(v) is float else (name, type(v))
        return tuple(key), requires_grad

    def _run(self, inputs: dict, key: tuple | None = None) -> torch.Tensor | tuple[torch.Tensor, ...]:
        """The outputs for `inputs` (whose runner key is `key` when known), outside autograd."""
        # Inputs of the shapes, dtypes and devices seen before bind the same way:
        # reuse that call's runner (no re-checking, no re-specialising).
        if key is None:
            key, _ = self._key_of(inputs)
        runner = self._runners.get(key)
        if runner is None:
            program, binding = self._typed(inputs)
            runner = deep(lambda: program.backend.runner(binding), what="the program", source=self.text)
            self._runners[key] = runner
        results = runner(inputs)
        if len(self.outputs) == 1:
            return results[self.outputs[0]]
        return tuple(results[name] for name in self.outputs)

    def _typed(self, inputs: dict) -> tuple[Program, Binding]:
        """(the program that runs `inputs`: this one, or where an integer tensor comes for
        an input it reads as a float, its specialisation to such inputs (_specialised);
        `inputs` bound to that program)."""
        binding = self.binder(inputs)
        changed = tuple((i.name, binding.input_types[i.name]) for i in self.checked.inputs
                        if binding.input_types[i.name] != i.dtype)
        self._last_typed = self._specialised(changed) if changed else self
        return (self, binding) if not changed else (self._last_typed, self._last_typed.binder(inputs))

    def _specialised(self, types: tuple[tuple[str, str], ...]) -> Program:
        """This program with the inputs `types` names of those types ((name, ops.INT):
        an integer tensor), made on first use and kept: its IR typed again
        (check.specialised), then the passes.  Integers stay exact in it (a comparison
        with an index compares integers) and a statement on integers alone is an int;
        its kernels read the integer tensors as such."""
        found = self._variants.get(types)
        if found is None:
            from .check import specialised
            found = object.__new__(type(self))
            found.__dict__.update(self.__getstate__())
            typed = deep(lambda: specialised(self.checked, dict(types)), what="the program", source=self.text)
            if self.trace[0][0] == "check":
                found.trace = deep(lambda: _passes_of(typed), what="the program", source=self.text)
            else:           # a rewrite's IR (a sharded program's parts): already past the passes
                found.trace = (("rewrite", typed),)
            found.checked, found.factorised = found.trace[0][1], found.trace[-1][1]
            found._start_runtime()
            self._variants[types] = found
        return found

    def _gradient(self, wrt: tuple[str, ...], saved: bool = False) -> Program:
        """The gradient program for inputs `wrt`, reading the statistics that
        `_saving` saves where `saved` (compiled on first use, then kept)."""
        program = self._gradients.get((wrt, saved))
        if program is None:
            from .grad import grad
            program = self._gradients[wrt, saved] = grad(self.text, wrt=wrt, outputs=self.outputs,
                                                         backend=self.backend_name, saved=saved, **self._options)
        return program

    def _batched(self, inputs: tuple[str, ...]) -> tuple[Program, str]:
        """This program with a leading batch index on the tensor `inputs` and on every
        statement that reads one, directly or through another statement (compiled on
        first use, then kept), and the batch index's name: torch.vmap's rule runs it
        once for the whole batch (compiler/autograd.py), no loop over its items."""
        found = self._batches.get(inputs)
        if found is None:
            from .ir import format_program
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
        same kernels); this program itself when there is none."""
        from .grad import saving_forward
        from .ir import format_statement
        found = deep(lambda: saving_forward(self.checked), what="the program", source=self.text)
        if not found.saved:
            return self
        text = self.text.rstrip() + "\n" + "".join(format_statement(s) + "\n" for s in found.saved)
        return Program(text, outputs=(*self.outputs, *(s.name for s in found.saved)), backend=self.backend_name,
                       **{**self._options, "float32_outputs": tuple(s.name for s in found.saved)})

    def _positional_error(self, args: tuple) -> None:
        names = ", ".join(i.name for i in self.checked.inputs)
        example = ", ".join(f"{i.name}=..." for i in self.checked.inputs)
        raise BindError(f"inputs are passed by name, not by position (got {len(args)} positional "
                        f"argument{'s' * (len(args) != 1)}); call it as ({example}) -- the program's "
                        f"inputs are: {names or 'none'}")

    def capture(self, *args, **inputs):
        """The program recorded as one CUDA graph for inputs of these shapes, dtypes
        and numbers (Triton backend, CUDA tensors): calling the result replays it,
        a few microseconds of host time whatever the number of kernels. See
        compiler/capture.py for its inputs and outputs (its own tensors).

        Raises:
            BindError: the inputs do not fit the program.
            BackendError: not the Triton backend, or not CUDA tensors.
        """
        if args:
            self._positional_error(args)
        from .capture import CapturedProgram
        inputs = {name: number_input(self.checked, name, v) for name, v in inputs.items()}
        return CapturedProgram(self, inputs)

    def plan(self, *args, **inputs) -> Plan:
        """The plan the backend follows for these inputs (nothing runs): its
        kernels, what each writes and folds, and the tiles and splits chosen
        for these sizes."""
        if args:
            self._positional_error(args)
        program, binding = self._typed(inputs)
        return deep(lambda: program.backend.plan(binding), what="the program", source=self.text)

    @property
    def source(self) -> str:
        """The generated module: for the Triton backend, the Triton source of
        the last call (before any call, the module for float32 inputs with
        every extent 128); for the reference backend, the IR it evaluates
        (of the program typed for the last call's integer inputs, if any)."""
        return deep(lambda: self._last_typed.backend.source, what="the program", source=self.text)

    def shard(self, index: str, group=None, layout: str = "contiguous", rows: str | None = None):
        """This program with the reduction over `index` sharded across the ranks
        of a torch.distributed process group (None: the default group): each
        rank passes the inputs with only its own part of `index` (`layout`
        "contiguous": rank r holds the r-th of W parts; "zigzag": rank r holds
        parts r and 2W - 1 - r of 2W, which balances a causal mask), and gets
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
        outputs vary over the rows, not over `index`; such a call has no
        gradient.

        Raises:
            ShardError: the program has no reduction over `index`, or one such
                reduction sits inside another; with `rows`, a reduction over
                the rows, a tensor over both indices or an output over `index`.
        """
        from .distributed import ShardedProgram
        return ShardedProgram(self, index, group, layout, rows)

    def explain(self) -> str:
        """The derivation, pass by pass, as text (what `einfold explain`
        prints): the checked program, the IR after each pass that changed it,
        each derived summary (fields, identity, lift, merge, how it was
        derived, its checked laws), the results from the final states, and the
        backend's plan."""
        from .explain import explain
        return deep(lambda: explain(self), what="the program", source=self.text)

    def __repr__(self) -> str:
        return f"<einfold.Program {self.outputs} backend={self.backend_name}>"


def _with_batch_index(ir: IRProgram, batched: frozenset[str]) -> tuple[IRProgram, str]:
    """`ir` with a fresh leading index on every access of the tensors `batched` and on
    every statement that reads one (its accesses by later statements with it), and
    that index's name."""
    from dataclasses import replace

    from .ir import Access, reads, transform, unused_name
    index = unused_name("batch", {i for i, _ in ir.extents} | {i.name for i in ir.inputs}
                        | {s.name for s in ir.statements})
    wide = set(batched)

    def widen(e):
        return replace(e, indices=(index, *e.indices)) if isinstance(e, Access) and e.tensor in wide else e

    statements = []
    for st in ir.statements:
        if reads(st.expr) & wide:
            st = replace(st, indices=(index, *st.indices), expr=transform(st.expr, widen))
            wide.add(st.name)
        statements.append(st)
    return replace(ir, statements=tuple(statements)), index


def _transformed(torch) -> bool:
    """Whether a torch transform or tracer sees this call: functorch (vmap, func.grad,
    func.jvp), a forward-mode AD dual level, torch.jit.trace.  Such a call goes through
    the program's custom op (compiler/autograd.py): torch transforms that, or einfold
    refuses naming the transform, where running the kernels on the wrapped tensors
    would fail or lose the transform."""
    return (torch._C._functorch.maybe_current_level() is not None or torch._C._is_tracing()
            or torch.autograd.forward_ad._current_level >= 0)


def _choose_triton_interpreter() -> None:
    """Without CUDA the triton backend runs under Triton's interpreter, which must be
    chosen (TRITON_INTERPRET=1) before triton.language is first imported.  torch.compile
    imports it (through torch._dynamo) before a program it traces first runs, so where
    torch is loaded the choice is made when einfold is imported or a program is made,
    not at the first call.  Where torch is not loaded, nothing has imported Triton
    either, and the CLI's parse, ir and explain must not load torch: the backend
    chooses at its own import."""
    torch = sys.modules.get("torch")
    if torch is not None and not torch.cuda.is_available():
        os.environ.setdefault("TRITON_INTERPRET", "1")


def _front_end(syntax, outputs, summaries) -> tuple[tuple[str, IRProgram], ...]:
    """The trace of the front end: ("check", IR), then (pass name, IR) per pass."""
    return _passes_of(check(syntax, outputs=outputs, summaries=summaries))


def _passes_of(checked: IRProgram) -> tuple[tuple[str, IRProgram], ...]:
    """("check", `checked`), then (pass name, IR) per pass."""
    trace = [("check", checked)]
    run_pipeline(checked, observe=lambda name, ir: trace.append((name, ir)))
    return tuple(trace)


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


_choose_triton_interpreter()

__all__ = ["Program", "compile", "Summary"]
