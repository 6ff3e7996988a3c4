"""The compiled program as it runs: IR after the passes, bound to inputs at each
call and run by its backend's kernels.

`CompiledProgram` is what `Program` (program.py) is built on, and all that the
code wrapping a program needs of it: the torch op (autograd.py) finds a live
program by its key in `LIVE`, and a sharded reduction (distributed.py) runs its
local and merge programs, made from IR, as compiled programs.  Nothing here
parses, differentiates or imports torch at import time.
"""
from __future__ import annotations

import itertools
import os
import sys
import weakref
from functools import cached_property
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

    from .bind import Binding

from . import backend as backends
from .arguments import LEAST_POSITIVE, MOST_POSITIVE, number_input
from .config import deep
from .errors import BindError
from .ir import Program as IRProgram, format_program
from .passes import run_pipeline
from .schedule import Plan, Schedule

# Live programs by key: torch.compile passes a program's key, a string it can
# keep as a constant, to the code that names its custom op (compiler/autograd.py)
LIVE: weakref.WeakValueDictionary[str, CompiledProgram] = weakref.WeakValueDictionary()
_keys = itertools.count()


class CompiledProgram:
    """A program compiled to kernels: its IR (`checked`, `factorised`, `trace`),
    its `schedule` and `backend`, and the runtime that binds a call's inputs and
    runs the kernels (`plan`, `source`, `capture`).  `Program` adds compiling
    from source and what a call under torch needs; `_of_ir` makes one from IR
    that a rewrite built (a sharded reduction's local and merge programs).
    """

    # What a process makes for itself, never pickled: runners (loaded kernels), compiled
    # gradient programs, custom ops, the key torch.compile names the program by, and what
    # the cached properties made on first use; an unpickled program makes them again.
    _PER_PROCESS = frozenset(("_runners", "_eager", "_gradients", "_batches", "_ops", "_key", "schedule", "backend",
                              "binder", "_saving", "_variants", "_last_typed", "_sizes"))

    def __getstate__(self) -> dict:
        return {k: v for k, v in self.__dict__.items() if k not in self._PER_PROCESS}

    def __setstate__(self, state: dict) -> None:
        self.__dict__.update(state)
        if self.backend_name == "triton":
            choose_triton_interpreter()
        self._start_runtime()

    def _start_runtime(self) -> None:
        self._runners: dict[tuple, object] = {}
        # (wrt, saved statistics read or recomputed) -> compiled gradient program
        self._gradients: dict[tuple[tuple[str, ...], bool], CompiledProgram] = {}
        self._batches: dict[tuple[str, ...], tuple[CompiledProgram, str]] = {}     # see Program._batched()
        self._ops: dict[tuple[str, ...], object] = {}            # argument kinds -> torch custom op
        self._eager: dict[tuple, object] = {}       # runner key -> its eager call under autograd (autograd.EagerCall)
        self._variants: dict[tuple[tuple[str, str], ...], CompiledProgram] = {}     # see _specialised()
        self._last_typed = self         # the program that the last call ran (_typed): its source is shown
        # size inputs (an index only on the left takes its extent from the call): their value keys a runner
        self._sizes = frozenset(self.checked.sizes)
        self._key = f"program_{next(_keys)}"
        LIVE[self._key] = self

    @classmethod
    def _of_ir(cls, ir: IRProgram, backend: str, **schedule_options) -> CompiledProgram:
        """A program that a rewrite built as factorised IR (there is no source of
        it to parse): the local and merge programs of a sharded reduction."""
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

    def _run(self, inputs: dict, key: tuple | None = None, out: dict | None = None) \
            -> torch.Tensor | tuple[torch.Tensor, ...]:
        """The outputs for `inputs` (whose runner key is `key` when known), outside autograd;
        those named in `out` written into its tensors (of their shapes and dtypes)."""
        return self._in_order(self._runner(inputs, key)(inputs, out))

    def _runner(self, inputs: dict, key: tuple | None = None):
        """The runner of `inputs` (whose runner key is `key` when known): a function of
        such inputs to the outputs by name.  Inputs of the shapes, dtypes and devices
        seen before bind the same way: that call's runner is reused (no re-checking,
        no re-specialising)."""
        if key is None:
            key, _ = self._key_of(inputs)
        runner = self._runners.get(key)
        if runner is None:
            program, binding = self._typed(inputs)
            runner = deep(lambda: program.backend.runner(binding), what="the program", source=self.text)
            self._runners[key] = runner
        return runner

    def _in_order(self, results: dict):
        """A run's results by name as a call returns them: the output, or a tuple of them."""
        if len(self.outputs) == 1:
            return results[self.outputs[0]]
        return tuple(results[name] for name in self.outputs)

    def _traced(self, inputs: dict) -> torch.Tensor | tuple[torch.Tensor, ...] | None:
        """The outputs for `inputs` as torch traces the program's op (its fake or
        functional tensors; compiler/autograd.py): the kernels launched through
        `torch.library.wrap_triton`, so that the traced graph holds them; None where
        the backend cannot launch them so (backend.traced_runner; the reference
        backend evaluates with torch, which the op hides)."""
        program, binding = self._typed(inputs)
        traced = getattr(program.backend, "traced_runner", None)
        run = traced and deep(lambda: traced(binding), what="the program", source=self.text)
        if run is None:
            return None
        return self._in_order(run(binding.values))

    def _typed(self, inputs: dict) -> tuple[CompiledProgram, Binding]:
        """(the program that runs `inputs`: this one, or where an integer tensor comes for
        an input it reads as a float, its specialisation to such inputs (_specialised);
        `inputs` bound to that program)."""
        binding = self.binder(inputs)
        changed = tuple((i.name, binding.input_types[i.name]) for i in self.checked.inputs
                        if binding.input_types[i.name] != i.dtype)
        self._last_typed = self._specialised(changed) if changed else self
        return (self, binding) if not changed else (self._last_typed, self._last_typed.binder(inputs))

    def _specialised(self, types: tuple[tuple[str, str], ...]) -> CompiledProgram:
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
                found.trace = deep(lambda: passes_of(typed), what="the program", source=self.text)
            else:           # a rewrite's IR (a sharded program's parts): already past the passes
                found.trace = (("rewrite", typed),)
            found.checked, found.factorised = found.trace[0][1], found.trace[-1][1]
            found._start_runtime()
            self._variants[types] = found
        return found

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

    def __repr__(self) -> str:
        return f"<einfold.Program {self.outputs} backend={self.backend_name}>"


def choose_triton_interpreter() -> None:
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


def passes_of(checked: IRProgram) -> tuple[tuple[str, IRProgram], ...]:
    """("check", `checked`), then (pass name, IR) per pass."""
    trace = [("check", checked)]
    run_pipeline(checked, observe=lambda name, ir: trace.append((name, ir)))
    return tuple(trace)


choose_triton_interpreter()

__all__ = ["CompiledProgram", "LIVE", "choose_triton_interpreter", "passes_of"]
