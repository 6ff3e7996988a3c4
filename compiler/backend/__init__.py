"""Backends turn a (factorised) IR program into something that runs.

A backend is a class with `name`, made for a compiled Program by
`for_program(program)` (the reference backend evaluates its factorised IR, the
triton backend runs its Schedule), with `run(binding) -> {output: tensor}`,
`plan(binding) -> Plan` and `source`.
Backend classes are imported on first use: choosing one by name loads torch
(and Triton) only then."""
from __future__ import annotations

from importlib import import_module

from ..errors import BackendError

# name -> (module, class); "auto" runs compiled kernels on CUDA tensors, and on CPU
# tensors the same kernels under Triton's interpreter (the backend warns once).
# Each module holds the backend class, `outline(program, outputs, **options)`, its
# plan for any sizes of an IR program, and `outline_of(program)`, that of a compiled one.
BACKENDS = {"reference": ("compiler.backend.oracle", "OracleBackend"),
            "triton": ("compiler.backend.triton", "TritonBackend")}
CHOICES = ("auto", *BACKENDS)


def check_name(name: str) -> str:
    """The backend `name` would run ("auto" -> "triton"); an einfold error if unknown."""
    if name == "auto":
        return "triton"
    if not isinstance(name, str) or name not in BACKENDS:
        raise BackendError(f"unknown backend {name!r}; choose one of: {', '.join(CHOICES)}")
    return name


def choose(name: str):
    module, cls = BACKENDS[check_name(name)]
    return getattr(import_module(module), cls)


def outline_of(program):
    """The plan of a compiled Program's backend for any sizes, from what the
    program already computed (the triton backend's: its schedule)."""
    return import_module(BACKENDS[check_name(program.backend_name)][0]).outline_of(program)


def outline(name: str, program, outputs: tuple[str, ...], **options):
    """The plan backend `name` would follow for any sizes (no torch needed)."""
    return import_module(BACKENDS[check_name(name)][0]).outline(program, outputs, **options)
