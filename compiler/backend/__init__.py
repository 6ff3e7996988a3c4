"""Backends turn a (factorised) IR program into something that runs.

A backend is a class with `name`, constructed from a Program and options, with
`run(binding) -> {output: tensor}`, `plan(binding) -> Plan` and `source`."""
from __future__ import annotations

from ..errors import BackendError
from .oracle import OracleBackend
from .triton import TritonBackend

BACKENDS = {OracleBackend.name: OracleBackend, TritonBackend.name: TritonBackend}


def choose(name: str):
    if name == "auto":
        # Compiled kernels on CUDA tensors; on CPU tensors the same kernels run under
        # Triton's interpreter (the backend warns once when it does).
        return TritonBackend
    if name not in BACKENDS:
        raise BackendError(f"unknown backend '{name}'; choose one of: auto, {', '.join(BACKENDS)}")
    return BACKENDS[name]
