"""The pass pipeline: pure functions Program -> Program, each named with a verb,
run in the order listed in PIPELINE."""
from __future__ import annotations

from typing import Callable

from ..ir import Program
from .base2 import use_base2
from .canonicalise import canonicalise
from .contract import contract
from .factorise import factorise
from .fuse import fuse
from .lower import lower
from .stabilise import stabilise

Pass = Callable[[Program], Program]

PIPELINE: tuple[tuple[str, Pass], ...] = (
    ("lower", lower),
    ("fuse", fuse),
    ("canonicalise", canonicalise),
    ("contract", contract),
    ("stabilise", stabilise),
    ("factorise", factorise),
    ("base2", use_base2),
)


def run_pipeline(program: Program, stop_after: str | None = None,
                 observe: Callable[[str, Program], None] | None = None) -> Program:
    """Run the passes in order; `observe(name, program)` sees the IR after each."""
    for name, pass_ in PIPELINE:
        program = pass_(program)
        if observe is not None:
            observe(name, program)
        if name == stop_after:
            break
    return program
