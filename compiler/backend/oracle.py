"""The "reference" backend: runs the float64 oracle and casts the results."""
from __future__ import annotations

from dataclasses import replace
from typing import TYPE_CHECKING

from ..ir import Program, format_program
from ..ops import FLOAT
from ..schedule import Kernel, Plan

if TYPE_CHECKING:
    import torch

    from ..bind import Binding


class OracleBackend:
    name = "reference"

    def __init__(self, program: Program, outputs: tuple[str, ...], *, split: int | None = None,
                 float32_outputs: tuple[str, ...] = ()):
        # `split` is a schedule option; the oracle evaluates without a schedule.
        self.program = program
        self.outputs = outputs
        self.float32_outputs = tuple(float32_outputs)

    @classmethod
    def for_program(cls, program) -> OracleBackend:
        """The backend of a compiled Program: the oracle evaluates its factorised IR."""
        return cls(program.factorised, program.outputs, **program.schedule_options)

    @property
    def source(self) -> str:
        return ("# reference backend: the float64 torch oracle evaluates this IR statement by "
                "statement; it generates no kernel source\n" + format_program(self.program))

    def run(self, binding: Binding) -> dict[str, torch.Tensor]:
        from .. import reference
        results = reference.run(self.program, binding.values, binding.extents, self.outputs)
        out = {}
        for name, value in results.items():
            dtype = binding.float_dtype(name in self.float32_outputs) if self.program.statement(name).dtype == FLOAT \
                else value.dtype
            out[name] = value.to(device=binding.device, dtype=dtype)
        return out

    def runner(self, binding: Binding):
        """Run on inputs of this binding's shapes and dtypes (the values may differ),
        into the tensors of `out` where given (see TritonBackend.runner)."""
        def run(values, out=None):
            results = self.run(replace(binding, values=dict(values)))
            for name, into in (out or {}).items():
                results[name] = into.copy_(results[name])
            return results
        return run

    def plan(self, binding: Binding | None = None) -> Plan:
        return outline(self.program, self.outputs)


def outline(program: Program, outputs: tuple[str, ...], **options) -> Plan:
    """The oracle's plan for any sizes: one torch float64 evaluation per statement
    (schedule options such as `split` do not apply)."""
    kernels = tuple(Kernel(f"oracle_{s.name}", (s.name,), "torch float64 evaluation of one statement")
                    for s in program.statements)
    buffers = tuple(s.name for s in program.statements if s.name not in outputs)
    return Plan("reference", kernels, buffers)


def outline_of(program) -> Plan:
    """The oracle's plan of a compiled Program."""
    return outline(program.factorised, program.outputs)
