"""The public entry point: compile(source) -> Program, a callable on tensors."""
from __future__ import annotations

from functools import cached_property
from typing import TYPE_CHECKING, Iterable

if TYPE_CHECKING:
    import torch

from . import backend as backends
from .algebra import Summary
from .check import check
from .errors import BackendError, EinfoldError
from .ir import Program as IRProgram
from .parse import parse
from .passes import run_pipeline
from .schedule import Plan

# summaries: user summaries usable by name; split: force a split count for every
# reduction (a schedule option: the Triton backend splits, the oracle has no schedule)
SCHEDULE_OPTIONS = ("split",)
KNOWN_OPTIONS = ("summaries", *SCHEDULE_OPTIONS)


class Program:
    """A compiled program.  Call it with its inputs by name."""

    def __init__(self, source: str, *, outputs: Iterable[str] | None = None, backend: str = "auto",
                 **options):
        unknown = sorted(set(options) - set(KNOWN_OPTIONS))
        if unknown:
            raise EinfoldError(f"unknown option{'s' * (len(unknown) > 1)} {', '.join(unknown)}; "
                               f"known: {', '.join(KNOWN_OPTIONS)}")
        summaries = {s.name: _checked_user_summary(s) for s in options.get("summaries", ())}
        self.backend_name = backends.check_name(backend)
        split = options.get("split")
        if split is not None and (isinstance(split, bool) or not isinstance(split, int) or split < 1):
            raise BackendError(f"split must be a positive integer (or None for the default), not {split!r}")
        self.text = source
        self.checked: IRProgram = check(parse(source), outputs=tuple(outputs) if outputs else None,
                                        summaries=summaries)
        self.factorised: IRProgram = run_pipeline(self.checked)
        self.outputs = self.checked.outputs
        self.schedule_options = {k: v for k, v in options.items() if k in SCHEDULE_OPTIONS}
        self._runners: dict[tuple, object] = {}

    @cached_property
    def backend(self):
        """The backend object (made on first use: it imports torch and Triton)."""
        return backends.choose(self.backend_name)(self.factorised, self.outputs, **self.schedule_options)

    @cached_property
    def binder(self):
        """Checks inputs at call time (made on first use: it needs torch)."""
        from .bind import Binder
        return Binder(self.checked, extents_of=self.factorised)

    def __call__(self, **inputs) -> torch.Tensor | tuple[torch.Tensor, ...]:
        # Inputs of the shapes, dtypes and devices seen before bind the same way:
        # reuse that call's runner (no re-checking, no re-specialising).
        import torch
        key = tuple((name, v.shape, v.dtype, v.device) if isinstance(v, torch.Tensor) else (name, type(v))
                    for name, v in inputs.items())
        runner = self._runners.get(key)
        if runner is None:
            runner = self.backend.runner(self.binder(inputs))
            self._runners[key] = runner
        results = runner(inputs)
        values = tuple(results[name] for name in self.outputs)
        return values[0] if len(values) == 1 else values

    def plan(self, **inputs) -> Plan:
        return self.backend.plan(self.binder(inputs))

    @property
    def source(self) -> str:
        return self.backend.source

    def explain(self) -> str:
        from .explain import explain
        return explain(self)

    def __repr__(self) -> str:
        return f"<einfold.Program {self.outputs} backend={self.backend_name}>"


def _checked_user_summary(s: Summary) -> Summary:
    """A summary given to compile(): no builtin's name, laws checked (never assumed)."""
    from .algebra import BUILTINS, COMPOSITES
    from .algebra.laws import require_laws
    from .ops import FUNCTIONS
    if not isinstance(s, Summary):
        raise EinfoldError(f"summaries= takes compiler.summary(...) values, not {type(s).__name__}")
    if s.name in BUILTINS or s.name in COMPOSITES or s.name in FUNCTIONS:
        raise EinfoldError(f"a user summary cannot take the builtin name '{s.name}'")
    return s if s.laws is not None else require_laws(s)


def compile(source: str, *, outputs: Iterable[str] | None = None, backend: str = "auto",
            **options) -> Program:
    """Parse, check and compile `source` for `backend`."""
    return Program(source, outputs=outputs, backend=backend, **options)


__all__ = ["Program", "compile", "Summary"]
