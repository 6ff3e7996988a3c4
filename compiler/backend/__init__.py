"""Backends turn a (factorised) IR program into something that runs.

A backend is a class with `name`, constructed from a Program and options, with
`run(binding) -> {output: tensor}`, `plan(binding) -> Plan` and `source`."""
from __future__ import annotations

from ..errors import BackendError
from .oracle import OracleBackend

BACKENDS = {OracleBackend.name: OracleBackend}


def choose(name: str):
    if name == "auto":
        return OracleBackend
    if name not in BACKENDS:
        raise BackendError(f"unknown backend '{name}'; choose one of: auto, {', '.join(BACKENDS)}")
    return BACKENDS[name]
