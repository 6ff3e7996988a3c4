"""Per-operator facts, one row per elementwise operator.

Printing, parsing, type checking, the float64 oracle and the symbolic algebra all
read this table; a new function is a new row here (plus a row in the backend's
emission table), not edits in five places.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable

import sympy

# Printing precedence, loosest first.  Mirrors the grammar's rule ladder.
PREC_OR, PREC_AND, PREC_NOT, PREC_CMP, PREC_ADD, PREC_MUL, PREC_UNARY, PREC_POW, PREC_ATOM = range(1, 10)

# Value types of the language.  Float is the data type (its width is bound at call),
# int is the type of index values and integer literals, bool of predicates.
FLOAT, INT, BOOL = "float", "int", "bool"


def _numeric(types: tuple[str, ...]) -> bool:
    return all(t in (INT, FLOAT) for t in types)


def _join(types: tuple[str, ...]) -> str | None:
    """int op int -> int; any float -> float; bools are not numbers."""
    if not _numeric(types):
        return None
    return FLOAT if FLOAT in types else INT


def _to_float(types: tuple[str, ...]) -> str | None:
    return FLOAT if _numeric(types) else None


def _to_bool(types: tuple[str, ...]) -> str | None:
    return BOOL if _numeric(types) else None


def _logical(types: tuple[str, ...]) -> str | None:
    return BOOL if all(t == BOOL for t in types) else None


def _select(types: tuple[str, ...]) -> str | None:
    cond, *branches = types
    return _join(tuple(branches)) if cond == BOOL else None


@dataclass(frozen=True, slots=True)
class Op:
    name: str          # the IR name
    arity: int
    syntax: str        # "infix", "prefix" or "function"
    symbol: str        # infix/prefix symbol, or the function's name in the language
    precedence: int    # for printing; functions print as atoms
    result: Callable[[tuple[str, ...]], str | None]   # operand types -> result type (None: ill-typed)
    torch: Callable    # float64 oracle implementation on torch tensors
    sympy: Callable    # symbolic meaning, for the algebra


def _torch(name: str) -> Callable:
    """torch.<name>, looked up when first called: the table (and the command
    line's parse/ir/explain) must not import torch."""
    def call(*args):
        import torch
        return getattr(torch, name)(*args)
    call.__name__ = f"torch.{name}"
    return call


def _gelu_torch(x):
    import torch
    return 0.5 * x * (1.0 + torch.erf(x / math.sqrt(2.0)))


def _softplus_torch(x):
    import torch
    return torch.logaddexp(x, torch.zeros_like(x))


def _where_sympy(c, a, b):
    return sympy.Piecewise((a, c), (b, True))


_SQRT2 = sympy.sqrt(2)

OPS: dict[str, Op] = {op.name: op for op in [
    Op("add", 2, "infix", "+", PREC_ADD, _join, _torch("add"), lambda a, b: a + b),
    Op("sub", 2, "infix", "-", PREC_ADD, _join, _torch("sub"), lambda a, b: a - b),
    Op("mul", 2, "infix", "*", PREC_MUL, _join, _torch("mul"), lambda a, b: a * b),
    Op("div", 2, "infix", "/", PREC_MUL, _to_float, _torch("div"), lambda a, b: a / b),
    Op("pow", 2, "infix", "**", PREC_POW, _to_float, _torch("pow"), lambda a, b: a ** b),
    Op("neg", 1, "prefix", "-", PREC_UNARY, _join, _torch("neg"), lambda a: -a),
    Op("lt", 2, "infix", "<", PREC_CMP, _to_bool, _torch("lt"), sympy.StrictLessThan),
    Op("le", 2, "infix", "<=", PREC_CMP, _to_bool, _torch("le"), sympy.LessThan),
    Op("gt", 2, "infix", ">", PREC_CMP, _to_bool, _torch("gt"), sympy.StrictGreaterThan),
    Op("ge", 2, "infix", ">=", PREC_CMP, _to_bool, _torch("ge"), sympy.GreaterThan),
    Op("eq", 2, "infix", "==", PREC_CMP, _to_bool, _torch("eq"), sympy.Eq),
    Op("ne", 2, "infix", "!=", PREC_CMP, _to_bool, _torch("ne"), sympy.Ne),
    Op("and", 2, "infix", "and", PREC_AND, _logical, _torch("logical_and"), sympy.And),
    Op("or", 2, "infix", "or", PREC_OR, _logical, _torch("logical_or"), sympy.Or),
    Op("not", 1, "prefix", "not", PREC_NOT, _logical, _torch("logical_not"), sympy.Not),
    Op("where", 3, "function", "where", PREC_ATOM, _select, _torch("where"), _where_sympy),
    Op("maximum", 2, "function", "max", PREC_ATOM, _join, _torch("maximum"), sympy.Max),
    Op("minimum", 2, "function", "min", PREC_ATOM, _join, _torch("minimum"), sympy.Min),
    Op("exp", 1, "function", "exp", PREC_ATOM, _to_float, _torch("exp"), sympy.exp),
    Op("exp2", 1, "function", "exp2", PREC_ATOM, _to_float, _torch("exp2"), lambda x: 2 ** x),
    Op("log", 1, "function", "log", PREC_ATOM, _to_float, _torch("log"), sympy.log),
    Op("log2", 1, "function", "log2", PREC_ATOM, _to_float, _torch("log2"), lambda x: sympy.log(x, 2)),
    Op("sqrt", 1, "function", "sqrt", PREC_ATOM, _to_float, _torch("sqrt"), sympy.sqrt),
    Op("rsqrt", 1, "function", "rsqrt", PREC_ATOM, _to_float, _torch("rsqrt"), lambda x: 1 / sympy.sqrt(x)),
    Op("abs", 1, "function", "abs", PREC_ATOM, _join, _torch("abs"), sympy.Abs),
    Op("tanh", 1, "function", "tanh", PREC_ATOM, _to_float, _torch("tanh"), sympy.tanh),
    Op("sigmoid", 1, "function", "sigmoid", PREC_ATOM, _to_float, _torch("sigmoid"), lambda x: 1 / (1 + sympy.exp(-x))),
    Op("erf", 1, "function", "erf", PREC_ATOM, _to_float, _torch("erf"), sympy.erf),
    Op("gelu", 1, "function", "gelu", PREC_ATOM, _to_float, _gelu_torch,
       lambda x: x / 2 * (1 + sympy.erf(x / _SQRT2))),
    Op("silu", 1, "function", "silu", PREC_ATOM, _to_float, lambda x: x * _torch("sigmoid")(x),
       lambda x: x / (1 + sympy.exp(-x))),
    Op("relu", 1, "function", "relu", PREC_ATOM, _to_float, _torch("relu"),
       lambda x: sympy.Max(x, 0)),
    Op("softplus", 1, "function", "softplus", PREC_ATOM, _to_float, _softplus_torch,
       lambda x: sympy.log(1 + sympy.exp(x))),
]}

# The language's function names (`max(a, b)` is the op "maximum").
FUNCTIONS: dict[str, Op] = {op.symbol: op for op in OPS.values() if op.syntax == "function"}
INFIX: dict[str, Op] = {op.symbol: op for op in OPS.values() if op.syntax == "infix"}

# Algebraic facts the canonical form uses: operands of a commutative operator are
# ordered canonically, and chains of an associative one are flattened first.
COMMUTATIVE = frozenset({"add", "mul", "maximum", "minimum", "and", "or", "eq", "ne"})
ASSOCIATIVE = frozenset({"add", "mul", "maximum", "minimum", "and", "or"})

# Named constants of the language.
CONSTANTS: dict[str, float] = {"inf": math.inf, "pi": math.pi}
