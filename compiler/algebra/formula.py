"""Evaluate the small formulas that define summaries (lift, combine, finalize):
numerically on torch tensors and symbolically with sympy.  Both read ops.OPS."""
from __future__ import annotations

import math
from typing import Mapping

from typing import TYPE_CHECKING

import sympy

if TYPE_CHECKING:
    import torch

from ..ir import Call, Const, Expr, Var
from ..ops import OPS


def evaluate(e: Expr, env: Mapping[str, torch.Tensor]) -> torch.Tensor:
    """Evaluate `e` elementwise on tensors bound to its Vars (float64 in, float64 out)."""
    if isinstance(e, Var):
        return env[e.name]
    if isinstance(e, Const):
        import torch
        return torch.tensor(float(e.value), dtype=torch.float64)
    if isinstance(e, Call):
        return OPS[e.op].torch(*(evaluate(a, env) for a in e.args))
    raise TypeError(f"cannot evaluate {type(e).__name__} inside a summary formula")


def to_sympy(e: Expr, env: Mapping[str, sympy.Expr]) -> sympy.Expr:
    if isinstance(e, Var):
        return env[e.name]
    if isinstance(e, Const):
        if e.value == math.inf:
            return sympy.oo
        if e.value == -math.inf:
            return -sympy.oo
        return sympy.nsimplify(e.value) if isinstance(e.value, float) else sympy.Integer(e.value)
    if isinstance(e, Call):
        return OPS[e.op].sympy(*(to_sympy(a, env) for a in e.args))
    raise TypeError(f"cannot translate {type(e).__name__} inside a summary formula")
