"""The backend's emission table: one row per elementwise operator of ops.OPS.

Each row turns operand code strings (already broadcast to a common rank) into a
Triton expression.  Operands that the language types as int are converted to
the compute dtype first where the operator computes in floating point."""
from __future__ import annotations

import ast
import math

from ...ops import BOOL, FLOAT, INT, OPS

# A fold's NaN-keeping extremum and the elementwise operator its tile reduction combines with.
NAN_KEEPING = {"max": "maximum", "min": "minimum"}

# Helper functions emitted into the generated module when an operator or a fold needs
# more than one expression (each is small, readable and uses core tl ops only).
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
    "base2": '''\
@triton.jit
def _base2(r, c=1.0):
    # the factor a of the base-2 weights exp2(y * a - r2) of x = c * y (c > 0; r the max of y,
    # r2 = r * a rounded: _scaled).  The weights share the factor exp2(r * a - r2), half an ulp of
    # r * a at most, which _natural divides out; a keeps it below 2**64 (2**512 in float64):
    # c * log2(e) while |c * r| < limit (r * a < 2**31, 2**61); beyond it the floats near c * r lie
    # 64 (128) or more apart, so every weight but the leader's is below the dtype's precision in
    # either base, and a = reach / |r| keeps r * a near reach, the other exponents 44 (358) or more
    # below the leader's
    if r.dtype == tl.float64:
        limit, reach = 1.152921504606847e18, 6.456542290346556e18     # 2**60, 1.4 * 2**62
    else:
        limit, reach = 1073741824.0, 1503238553.6                    # 2**30, 1.4 * 2**30
    # (tl.full in r's dtype: a bare literal would be a float32 log2(e) in a float64 kernel)
    natural = c * tl.full(r.shape, 1.4426950408889634, r.dtype)
    return tl.where(tl.abs(c * r) < limit, natural, reach / tl.abs(r))


@triton.jit
def _scaled(r, c=1.0):
    # r2 = r * a rounded once (a = _base2(r, c)), written as an fma: a plain product may be fused
    # into the subtraction that reads it (fp contraction on the GPU), and the repair
    # exp2(r2_old - r2_new) must subtract the very values the weights were taken against
    return tl.fma(r, _base2(r, c), 0.0)


@triton.jit
def _repair(r, r_new, c=1.0):
    # the repair of weights taken against _scaled(r), from here against _scaled(r_new): exp2 of the
    # difference of the very references while a stays; where a changed (the leader crossed the
    # limit of _base2, or moved beyond it) the leader moved by 32 or more: exp(c * (r - r_new)) is 0
    same = _base2(r, c) == _base2(r_new, c)
    return tl.where(same, tl.exp2(_scaled(r, c) - _scaled(r_new, c)), 0.0)
''',
    "natural": '''\
@triton.jit
def _natural(t, r, c=1.0):
    # t summed with weights exp2(y * a - r2), r2 = r * a rounded (a = _base2(r, c)): each weight
    # is exp(c * (y - r)) * exp2(r * a - r2), and fma(r, a, -r2) is that exponent exactly;
    # divide the common factor out (r = -inf: t is 0)
    return t * tl.exp2(tl.where(r == -float("inf"), 0.0, -tl.fma(r, _base2(r, c), -_scaled(r, c))))
''',
    # a max or min reduction that keeps NaN, as torch's: tl.max and tl.min drop it (their combine
    # is tl.maximum's default, the hardware's fmax); same cost (max.NaN is one instruction too)
    **{f"{op}_nan": f'''\
@triton.jit
def _{combine}_nan(a, b):
    return tl.{combine}(a, b, propagate_nan=tl.PropagateNan.ALL)


@triton.jit
def _{op}_nan(x, axis: tl.constexpr):
    return tl.reduce(x, axis, _{combine}_nan)
''' for op, combine in NAN_KEEPING.items()},
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

# every function the helpers define (a module global: no kernel-local name may shadow one)
HELPER_FUNCTIONS = frozenset(node.name for source in HELPERS.values() for node in ast.parse(source).body
                             if isinstance(node, ast.FunctionDef))

# op -> (Triton template over operands {0}, {1}, {2}; helper it needs, if any)
TEMPLATES: dict[str, tuple[str, str | None]] = {
    **{op: (f"({{0}} {sym} {{1}})", None) for op, sym in {
        "add": "+", "sub": "-", "mul": "*", "div": "/", "lt": "<", "le": "<=", "gt": ">", "ge": ">=",
        "eq": "==", "ne": "!=", "and": "&", "or": "|"}.items()},
    **{op: (f"{fn}({{0}})", None) for op, fn in {
        "exp": "tl.exp", "exp2": "tl.exp2", "log": "tl.log", "log2": "tl.log2", "sqrt": "tl.sqrt",
        "rsqrt": "tl.rsqrt", "erf": "tl.erf", "sigmoid": "tl.sigmoid", "abs": "tl.abs"}.items()},
    "neg": ("(-{0})", None),
    # not as a comparison: ~ of a plain bool (a scalar truth value under the interpreter) is -2
    "not": ("({0} == 0)", None),
    "where": ("tl.where({0}, {1}, {2})", None),
    # NaN in either operand gives NaN, as torch.maximum / torch.minimum (the hardware's
    # fmax / fmin would return the other operand)
    "maximum": ("tl.maximum({0}, {1}, propagate_nan=tl.PropagateNan.ALL)", None),
    "minimum": ("tl.minimum({0}, {1}, propagate_nan=tl.PropagateNan.ALL)", None),
    "gelu": ("(0.5 * {0} * (1.0 + tl.erf({0} * 0.7071067811865476)))", None),
    "silu": ("({0} * tl.sigmoid({0}))", None),
    "relu": ("tl.where({0} < 0.0, 0.0, {0})", None),          # NaN stays NaN, as in torch
    "softplus": ("(tl.maximum({0}, 0.0) + tl.log(1.0 + tl.exp(-tl.abs({0}))))", None),
    "tanh": ("_tanh({0})", "tanh"),
    "pow": ("_pow({0}, {1})", "pow"),
}


# A fold's max or min: (its helper of HELPERS, the helper's tile reduction, the elementwise
# operator of TEMPLATES that joins a tile to the running value), both keeping NaN.
EXTREMA = {op: (f"{op}_nan", f"_{op}_nan", combine) for op, combine in NAN_KEEPING.items()}


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
    template, helper = TEMPLATES[op]
    if helper is not None:
        helpers.add(helper)
    return template.format(*args)


def small_integer_power(exponent) -> int | None:
    """x ** n for a literal small integer n is emitted as repeated products."""
    if isinstance(exponent, bool) or not isinstance(exponent, int | float):
        return None
    if float(exponent).is_integer() and abs(exponent) <= 8:
        return int(exponent)
    return None


# Result kinds, read off the language's typing rules (ops.OPS): operators whose result
# is floating point even for integer operands, and predicates.
FLOAT_RESULT = {op.name for op in OPS.values() if op.result((INT,) * op.arity) == FLOAT}
BOOL_RESULT = {op.name for op in OPS.values()
               if op.result((INT,) * op.arity) == BOOL or op.result((BOOL,) * op.arity) == BOOL}
# the logical operators written with Triton's bitwise & and | (and, or)
LOGICAL = {op for op, (template, _) in TEMPLATES.items() if " & " in template or " | " in template}


def int_bounds(op: str, bounds: list[tuple[int, int] | None]) -> tuple[int, int] | None:
    """The range of an integer operation from its operands' ranges (None: unknown)."""
    if op == "where":
        bounds = bounds[1:]
    if any(b is None for b in bounds):
        return None
    if op == "neg":
        return (-bounds[0][1], -bounds[0][0])
    if op == "abs":
        lo, hi = bounds[0]
        return (0 if lo <= 0 <= hi else min(abs(lo), abs(hi)), max(abs(lo), abs(hi)))
    if op in ("add", "sub", "mul", "maximum", "minimum"):
        (a, b), (c, d) = bounds
        corners = {"add": (a + c, b + d), "sub": (a - d, b - c), "maximum": (max(a, c), max(b, d)),
                   "minimum": (min(a, c), min(b, d)), "mul": (a * c, a * d, b * c, b * d)}[op]
        return (min(corners), max(corners))
    if op == "where":
        (a, b), (c, d) = bounds
        return (min(a, c), max(b, d))
    return None
