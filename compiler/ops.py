"""Per-operator facts, one row per elementwise operator.

Printing, parsing, type checking, the float64 oracle, the symbolic algebra and
differentiation all read this table; a new function is a new row here (plus a
row in the backend's emission table), not edits in five places.
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
    # Reverse-mode rule, read by passes/differentiate.py: adjoint(fn, g, out, *args)
    # returns one adjoint per argument given the adjoint g of the result, or None
    # for an argument that carries no gradient.  It is called on traced values
    # (algebra.user.Sym: Python operators and fn.<function> build IR), `out` is
    # the result itself (cheaper than recomputing it for exp, tanh, sigmoid).
    # None for the whole row: the result carries no gradient (predicates).
    adjoint: Callable | None


# Operators that cost a transcendental function (the special-function unit) or a
# division per element on a GPU, where a multiply-add costs one instruction: a kernel
# form weighs what each element costs by them (specialise.forms).  A division by a
# literal power of two is exact and cheap; the rule that reads this says so.
COSTLY = frozenset({"div", "pow", "exp", "exp2", "log", "log2", "sqrt", "rsqrt", "erf", "tanh", "sigmoid",
                    "silu", "gelu", "softplus"})
# Operators whose value grows exponentially with their operand: a fold of them may overflow
# as a value where the ratios a program takes of it do not (the stabiliser rescales such
# folds), so the forward does not save one for the backward (passes.differentiate).
EXPONENTIAL = frozenset({"exp", "exp2"})


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
_LN2 = math.log(2.0)


def _pow_adjoint(fn, g, out, a, b):
    # as torch: a zero exponent gives the base no gradient (0 ** -1 would be inf), and a
    # zero base gives a nonnegative exponent none (log 0 would be -inf)
    return (fn.where(b == 0, 0.0, g * b * a ** (b - 1)),
            fn.where((a == 0) & (b >= 0), 0.0, g * out * fn.log(a)))


def _extremum_adjoint(loses):
    """max(a, b) / min(a, b): the adjoint goes to the winning argument; on a tie
    each gets half, as torch.maximum and torch.minimum give."""
    def adjoint(fn, g, out, a, b):
        share = fn.where(a == b, 0.5, 1.0)
        return fn.where(loses(a, b), 0.0, g * share), fn.where(loses(b, a), 0.0, g * share)
    return adjoint


def _gelu_adjoint(fn, g, out, x):
    # d/dx x/2 (1 + erf(x/sqrt 2)) = (1 + erf(x/sqrt 2))/2 + x exp(-x^2/2)/sqrt(2 pi)
    cdf = 0.5 * (1 + fn.erf(x * (1 / math.sqrt(2.0))))
    return (g * (cdf + x * fn.exp(-0.5 * x * x) * (1 / math.sqrt(2 * math.pi))),)


def _silu_adjoint(fn, g, out, x):
    s = fn.sigmoid(x)
    return (g * s * (1 + x * (1 - s)),)


OPS: dict[str, Op] = {op.name: op for op in [
    Op("add", 2, "infix", "+", PREC_ADD, _join, _torch("add"), lambda a, b: a + b,
       lambda fn, g, out, a, b: (g, g)),
    Op("sub", 2, "infix", "-", PREC_ADD, _join, _torch("sub"), lambda a, b: a - b,
       lambda fn, g, out, a, b: (g, -g)),
    Op("mul", 2, "infix", "*", PREC_MUL, _join, _torch("mul"), lambda a, b: a * b,
       lambda fn, g, out, a, b: (g * b, g * a)),
    Op("div", 2, "infix", "/", PREC_MUL, _to_float, _torch("div"), lambda a, b: a / b,
       lambda fn, g, out, a, b: (g / b, -g * out / b)),
    Op("pow", 2, "infix", "**", PREC_POW, _to_float, _torch("pow"), lambda a, b: a ** b,
       _pow_adjoint),
    Op("neg", 1, "prefix", "-", PREC_UNARY, _join, _torch("neg"), lambda a: -a,
       lambda fn, g, out, a: (-g,)),
    Op("lt", 2, "infix", "<", PREC_CMP, _to_bool, _torch("lt"), sympy.StrictLessThan,
       None),
    Op("le", 2, "infix", "<=", PREC_CMP, _to_bool, _torch("le"), sympy.LessThan,
       None),
    Op("gt", 2, "infix", ">", PREC_CMP, _to_bool, _torch("gt"), sympy.StrictGreaterThan,
       None),
    Op("ge", 2, "infix", ">=", PREC_CMP, _to_bool, _torch("ge"), sympy.GreaterThan,
       None),
    Op("eq", 2, "infix", "==", PREC_CMP, _to_bool, _torch("eq"), sympy.Eq,
       None),
    Op("ne", 2, "infix", "!=", PREC_CMP, _to_bool, _torch("ne"), sympy.Ne,
       None),
    Op("and", 2, "infix", "and", PREC_AND, _logical, _torch("logical_and"), sympy.And,
       None),
    Op("or", 2, "infix", "or", PREC_OR, _logical, _torch("logical_or"), sympy.Or,
       None),
    Op("not", 1, "prefix", "not", PREC_NOT, _logical, _torch("logical_not"), sympy.Not,
       None),
    Op("where", 3, "function", "where", PREC_ATOM, _select, _torch("where"), _where_sympy,
       lambda fn, g, out, c, a, b: (None, fn.where(c, g, 0.0), fn.where(c, 0.0, g))),
    Op("maximum", 2, "function", "max", PREC_ATOM, _join, _torch("maximum"), sympy.Max,
       _extremum_adjoint(lambda a, b: a < b)),
    Op("minimum", 2, "function", "min", PREC_ATOM, _join, _torch("minimum"), sympy.Min,
       _extremum_adjoint(lambda a, b: a > b)),
    Op("exp", 1, "function", "exp", PREC_ATOM, _to_float, _torch("exp"), sympy.exp,
       lambda fn, g, out, x: (g * out,)),
    Op("exp2", 1, "function", "exp2", PREC_ATOM, _to_float, _torch("exp2"), lambda x: 2 ** x,
       lambda fn, g, out, x: (g * out * _LN2,)),
    Op("log", 1, "function", "log", PREC_ATOM, _to_float, _torch("log"), sympy.log,
       lambda fn, g, out, x: (g / x,)),
    Op("log2", 1, "function", "log2", PREC_ATOM, _to_float, _torch("log2"), lambda x: sympy.log(x, 2),
       lambda fn, g, out, x: (g / (x * _LN2),)),
    Op("sqrt", 1, "function", "sqrt", PREC_ATOM, _to_float, _torch("sqrt"), sympy.sqrt,
       lambda fn, g, out, x: (g / (2 * out),)),
    Op("rsqrt", 1, "function", "rsqrt", PREC_ATOM, _to_float, _torch("rsqrt"), lambda x: 1 / sympy.sqrt(x),
       lambda fn, g, out, x: (-0.5 * g * out ** 3,)),
    Op("abs", 1, "function", "abs", PREC_ATOM, _join, _torch("abs"), sympy.Abs,
       lambda fn, g, out, x: (g * fn.where(x > 0, 1.0, fn.where(x < 0, -1.0, 0.0)),)),
    Op("tanh", 1, "function", "tanh", PREC_ATOM, _to_float, _torch("tanh"), sympy.tanh,
       lambda fn, g, out, x: (g * (1 - out * out),)),
    Op("sigmoid", 1, "function", "sigmoid", PREC_ATOM, _to_float, _torch("sigmoid"), lambda x: 1 / (1 + sympy.exp(-x)),
       lambda fn, g, out, x: (g * out * (1 - out),)),
    Op("erf", 1, "function", "erf", PREC_ATOM, _to_float, _torch("erf"), sympy.erf,
       lambda fn, g, out, x: (g * (2 / math.sqrt(math.pi)) * fn.exp(-x * x),)),
    Op("gelu", 1, "function", "gelu", PREC_ATOM, _to_float, _gelu_torch,
       lambda x: x / 2 * (1 + sympy.erf(x / _SQRT2)),
       _gelu_adjoint),
    Op("silu", 1, "function", "silu", PREC_ATOM, _to_float, lambda x: x * _torch("sigmoid")(x),
       lambda x: x / (1 + sympy.exp(-x)),
       _silu_adjoint),
    Op("relu", 1, "function", "relu", PREC_ATOM, _to_float, _torch("relu"),
       lambda x: sympy.Max(x, 0),
       lambda fn, g, out, x: (fn.where(x > 0, g, 0.0),)),
    Op("softplus", 1, "function", "softplus", PREC_ATOM, _to_float, _softplus_torch,
       lambda x: sympy.log(1 + sympy.exp(x)),
       lambda fn, g, out, x: (g * fn.sigmoid(x),)),
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
# comparisons and their logical combinations: the calls that make a predicate
PREDICATES = frozenset(op.name for op in OPS.values() if op.result in (_to_bool, _logical))
