"""The backend's emission table: one row per elementwise operator of ops.OPS.

Each row turns operand code strings (already broadcast to a common rank) into a
Triton expression.  Operands that the language types as int are converted to
the compute dtype first where the operator computes in floating point."""
from __future__ import annotations

import math

# Helper functions emitted into the generated module when an operator needs more
# than one expression (each is small, readable and uses core tl ops only).
HELPERS = {
    "tanh": '''\
@triton.jit
def _tanh(x):
    # tanh from one exponential; a short series near 0 keeps the relative error small
    e = tl.exp(-2.0 * tl.abs(x))
    t = (1.0 - e) / (1.0 + e)
    t = tl.where(x < 0, -t, t)
    x2 = x * x
    series = x * (1.0 - x2 * (1.0 / 3.0 - x2 * (2.0 / 15.0 - x2 * (17.0 / 315.0))))
    return tl.where(tl.abs(x) < 0.1, series, t)
''',
    "pow": '''\
@triton.jit
def _pow(x, y):
    # x ** y with torch's conventions: negative bases take integer exponents only
    magnitude = tl.exp2(y * tl.log2(tl.abs(x)))
    integral = y == tl.floor(y)
    odd = integral & ((y - 2.0 * tl.floor(0.5 * y)) == 1.0)
    signed = tl.where(odd, -magnitude, magnitude)
    out = tl.where(x < 0, tl.where(integral, signed, float("nan")), magnitude)
    return tl.where(y == 0, 1.0, out)
''',
}

_UNARY_TL = {"exp": "tl.exp", "exp2": "tl.exp2", "log": "tl.log", "log2": "tl.log2", "sqrt": "tl.sqrt",
             "rsqrt": "tl.rsqrt", "erf": "tl.erf", "sigmoid": "tl.sigmoid"}
_INFIX = {"add": "+", "sub": "-", "mul": "*", "div": "/", "lt": "<", "le": "<=", "gt": ">", "ge": ">=",
          "eq": "==", "ne": "!=", "and": "&", "or": "|"}


def literal(value) -> str:
    """A Python literal usable inside a @triton.jit function."""
    if isinstance(value, bool):
        return "True" if value else "False"
    if isinstance(value, int):
        return str(value)
    if math.isnan(value):
        return 'float("nan")'
    if math.isinf(value):
        return 'float("inf")' if value > 0 else '-float("inf")'
    return repr(float(value))


def emit(op: str, args: list[str], helpers: set[str]) -> str:
    """Triton source for `op` applied to operand expressions `args`."""
    if op in _INFIX:
        a, b = args
        return f"({a} {_INFIX[op]} {b})"
    if op == "neg":
        return f"(-{args[0]})"
    if op == "not":
        return f"(~{args[0]})"
    if op in _UNARY_TL:
        return f"{_UNARY_TL[op]}({args[0]})"
    if op == "where":
        return f"tl.where({args[0]}, {args[1]}, {args[2]})"
    if op == "maximum":
        return f"tl.maximum({args[0]}, {args[1]})"
    if op == "minimum":
        return f"tl.minimum({args[0]}, {args[1]})"
    if op == "abs":
        return f"tl.abs({args[0]})"
    x = args[0]
    if op == "gelu":
        return f"(0.5 * {x} * (1.0 + tl.erf({x} * 0.7071067811865476)))"
    if op == "silu":
        return f"({x} * tl.sigmoid({x}))"
    if op == "relu":
        return f"tl.maximum({x}, 0.0)"
    if op == "softplus":
        return f"(tl.maximum({x}, 0.0) + tl.log(1.0 + tl.exp(-tl.abs({x}))))"
    if op == "tanh":
        helpers.add("tanh")
        return f"_tanh({x})"
    if op == "pow":
        helpers.add("pow")
        return f"_pow({args[0]}, {args[1]})"
    raise NotImplementedError(f"the triton backend has no emission rule for operator '{op}'")


def small_integer_power(exponent) -> int | None:
    """x ** n for a literal small integer n is emitted as repeated products."""
    if isinstance(exponent, bool) or not isinstance(exponent, int | float):
        return None
    if float(exponent).is_integer() and abs(exponent) <= 8:
        return int(exponent)
    return None


# Operators whose result is floating point even for integer operands (ops.OPS `_to_float`).
FLOAT_RESULT = {"div", "pow", "exp", "exp2", "log", "log2", "sqrt", "rsqrt", "tanh", "sigmoid", "erf",
                "gelu", "silu", "relu", "softplus"}
BOOL_RESULT = {"lt", "le", "gt", "ge", "eq", "ne", "and", "or", "not"}
