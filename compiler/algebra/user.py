"""User summaries from Python callables.

    import math, compiler
    from compiler.algebra.user import fn

    affine = compiler.summary(
        "affine", fields=("A", "B"), identity=(1.0, 0.0),
        lift=lambda a, b: (a, b),
        combine=lambda l, r: (r.A * l.A, r.A * l.B + r.B),   # r after l
        finalize=lambda s: s.B)

The callables are *traced*: they run once on symbolic values whose operators
(+ - * / ** unary -, comparisons, & | ~) and the functions of `fn` (one per row
of ops.OPS: fn.exp, fn.max, fn.where, ...) build IR formulas.  The summary is
then law-checked (algebra.laws.require_laws); one that breaks a law is refused
with a counterexample.
"""
from __future__ import annotations

import inspect
import math
import re
from collections.abc import Callable, Iterable, Mapping
from types import SimpleNamespace
from typing import Any

from ..errors import CheckError
from ..ir import Call, Const, Expr, Var
from ..ops import BOOL, CONSTANTS, FLOAT, FUNCTIONS, INT, OPS
from .composites import COMPOSITES
from .laws import DEFAULT_EXAMPLES, require_laws
from .summary import BUILTINS, Field, Summary, formula_type

_NAME = re.compile(r"[A-Za-z_][A-Za-z_0-9]*\Z")
_KEYWORDS = ("and", "or", "not", "len")


class Sym:
    """A traced value: wraps the IR formula that computes it.  Python operators
    on it are generated from ops.OPS (see _PYTHON below)."""

    __slots__ = ("expr",)

    def __init__(self, expr: Expr):
        self.expr = expr

    def __repr__(self) -> str:
        from ..ir import format_expr
        return f"Sym({format_expr(self.expr)})"

    def __bool__(self):
        raise TypeError("a traced summary value has no truth value: `if`, `and`, `or`, `not` and "
                        "chained comparisons cannot be traced; use fn.where(cond, x, y) and & | ~")

    def __float__(self):
        raise TypeError("a traced summary value is symbolic: use compiler.algebra.user.fn "
                        "(fn.exp, fn.log, fn.max, ...) instead of math functions")

    __int__ = __index__ = __float__
    __hash__ = object.__hash__


def lift_value(v: Any) -> Expr:
    """A Python value as an IR formula: Syms unwrap, numbers become Consts."""
    if isinstance(v, Sym):
        return v.expr
    if isinstance(v, Expr):
        return v
    if isinstance(v, bool):
        raise TypeError("booleans are not summary values; compare traced values instead")
    if isinstance(v, int | float):
        return Const(v)
    raise TypeError(f"cannot use {type(v).__name__} {v!r} in a summary formula")


def _apply(op: str, *args: Any) -> Sym:
    if len(args) != OPS[op].arity:
        raise TypeError(f"{op} takes {OPS[op].arity} argument(s), got {len(args)}")
    return Sym(Call(op, tuple(lift_value(a) for a in args)))


# Python's spelling of the operators of ops.OPS: (dunder, reflected dunder or None).
# A row of OPS whose symbol is listed here gets the dunder; every row is also in `fn`.
_PYTHON: dict[tuple[str, str], tuple[str, str | None]] = {
    ("infix", "+"): ("__add__", "__radd__"),
    ("infix", "-"): ("__sub__", "__rsub__"),
    ("infix", "*"): ("__mul__", "__rmul__"),
    ("infix", "/"): ("__truediv__", "__rtruediv__"),
    ("infix", "**"): ("__pow__", "__rpow__"),
    ("infix", "<"): ("__lt__", None),
    ("infix", "<="): ("__le__", None),
    ("infix", ">"): ("__gt__", None),
    ("infix", ">="): ("__ge__", None),
    ("infix", "=="): ("__eq__", None),
    ("infix", "!="): ("__ne__", None),
    ("infix", "and"): ("__and__", "__rand__"),
    ("infix", "or"): ("__or__", "__ror__"),
    ("prefix", "-"): ("__neg__", None),
    ("prefix", "not"): ("__invert__", None),
    ("function", "abs"): ("__abs__", None),
}


def _install_operators() -> None:
    for op in OPS.values():
        names = _PYTHON.get((op.syntax, op.symbol))
        if names is None:
            continue
        direct, reflected = names
        setattr(Sym, direct, lambda *args, _op=op.name: _apply(_op, *args))
        if reflected is not None:
            setattr(Sym, reflected, lambda self, other, _op=op.name: _apply(_op, other, self))
    Sym.__hash__ = object.__hash__          # __eq__ builds a formula; keep Syms hashable
    Sym.__pos__ = lambda self: self


_install_operators()


def _function(op: str) -> Callable[..., Sym]:
    def call(*args):
        return _apply(op, *args)
    call.__name__ = op
    call.__doc__ = f"Trace the operator '{op}' ({OPS[op].arity} argument(s))."
    return call


# fn.<language name> for functions (fn.max, fn.where, fn.exp), fn.<IR name> for every
# operator (fn.maximum, fn.add, fn.lt), fn.inf / fn.pi for the language's constants.
fn = SimpleNamespace(**{name: _function(op.name) for name, op in
                        {**OPS, **FUNCTIONS}.items()}, **CONSTANTS)


class _State:
    """A summary state during tracing: fields as attributes (a.h), items (a["h"], a[0])."""

    def __init__(self, prefix: str, fields: tuple[str, ...]):
        object.__setattr__(self, "_prefix", prefix)
        object.__setattr__(self, "_fields", fields)

    def __getattr__(self, name: str) -> Sym:
        fields = object.__getattribute__(self, "_fields")
        if name in fields:
            return Sym(Var(f"{object.__getattribute__(self, '_prefix')}{name}"))
        raise AttributeError(f"the summary has no field '{name}'; its fields are {', '.join(fields)}")

    def __getitem__(self, key: int | str) -> Sym:
        fields = object.__getattribute__(self, "_fields")
        return getattr(self, fields[key] if isinstance(key, int) else key)

    def __iter__(self):
        return (getattr(self, f) for f in object.__getattribute__(self, "_fields"))

    def __len__(self) -> int:
        return len(object.__getattribute__(self, "_fields"))


def state(prefix: str, fields: tuple[str, ...]) -> _State:
    """A symbolic state whose fields read as Vars `{prefix}{field}` (a.n, b.mean)."""
    return _State(prefix, fields)


# ---------------------------------------------------------------- the constructor
def summary(name: str, *, fields: Iterable[str | tuple[str, str]], identity: Iterable[float],
            lift: Callable, combine: Callable, finalize: Callable | None,
            commutative: bool = False, arity: int | None = None,
            examples: int = DEFAULT_EXAMPLES) -> Summary:
    """Build a Summary by tracing Python callables, then check its laws.

    The callables run once on symbolic values: Python's operators and the
    functions of `compiler.algebra.user.fn` (`fn.exp`, `fn.max`, `fn.where`,
    ...) build the IR formulas. Pass the result to `compile(...,
    summaries=[...])` and use it by name: `H[i] = affine[t](A[i,t], B[i,t])`.

    Args:
        name: the name the program uses; not a builtin's.
        fields: the carrier, `("h",)` or `(("m", "float"), ("n", "int"), ...)`.
        identity: one number per field (`math.inf` allowed): the state of an
            empty fold.
        lift: `(x0, x1, ...) ->` one value per field (a bare value for one
            field): the state of one element.
        combine: `(a, b) ->` one value per field, `a` the earlier (left) state
            and `b` the later one; fields are attributes: `a.h`, `b.h`.
        finalize: state `->` the result (`None`: the only field).
        commutative: claim it only if the merge order does not matter; it is
            checked.
        arity: the number of element arguments (default: `lift`'s positional
            parameters).
        examples: how many sampled examples test a law that sympy cannot prove.

    Returns:
        The `Summary`, with its law report attached (`laws`).

    Raises:
        CheckError: a bad definition (a bad name, field count, or formula).
        LawError: the summary breaks associativity, identity or a claimed
            commutativity; the message holds a counterexample.

    Example:
        ```python
        affine = compiler.summary(
            "affine", fields=("A", "B"), identity=(1.0, 0.0),
            lift=lambda a, b: (a, b),
            combine=lambda l, r: (r.A * l.A, r.A * l.B + r.B),   # r after l
            finalize=lambda s: s.B)
        ```
    """
    _check_name(name)
    field_list = _fields(name, fields)
    names = tuple(f.name for f in field_list)
    ident = _identity(name, identity, len(names))
    n_args = _arity(name, lift, arity)

    xs = [Sym(Var(f"x{k}")) for k in range(n_args)]
    lifted = _per_field(name, "lift", _trace(name, "lift", lift, *xs), names)
    combined = _per_field(name, "combine", _trace(name, "combine", combine,
                                                 _State("a.", names), _State("b.", names)), names)
    if finalize is None:
        if len(names) != 1:
            raise CheckError(f"summary '{name}' has {len(names)} fields; give finalize=")
        final = Var(names[0])
    else:
        final = lift_value(_trace(name, "finalize", finalize, _State("", names)))

    types = {f"x{k}": FLOAT for k in range(n_args)}
    for f in field_list:
        types.update({f"a.{f.name}": f.dtype, f"b.{f.name}": f.dtype, f.name: f.dtype})
    for part, formulas in (("lift", lifted), ("combine", combined), ("finalize", (final,))):
        for k, formula in enumerate(formulas):
            t = formula_type(formula, types)
            if t not in (INT, FLOAT):
                where = f"field '{names[k]}' of {part}" if part != "finalize" else "finalize"
                raise CheckError(f"summary '{name}': {where} is {t or 'ill-typed'}, not a number"
                                 f"{'; select with fn.where(cond, x, y)' if t == BOOL else ''}")

    built = Summary(name=name, fields=tuple(field_list), arity=n_args, identity=ident,
                    lift=lifted, combine=combined, finalize=final, commutative=bool(commutative),
                    notes=("user summary, traced from Python",))
    return require_laws(built, examples=examples)


def _check_name(name: str) -> None:
    if not isinstance(name, str) or not _NAME.match(name):
        raise CheckError(f"summary name {name!r} is not a name of the language "
                         f"(letters, digits and _, not starting with a digit)")
    if name in BUILTINS:
        raise CheckError(f"cannot define summary '{name}': it is a built-in reduction "
                         f"({', '.join(BUILTINS)}); choose another name")
    if name in COMPOSITES:
        raise CheckError(f"cannot define summary '{name}': it is a composite reduction "
                         f"({', '.join(COMPOSITES)}); choose another name")
    if name in FUNCTIONS:
        raise CheckError(f"cannot define summary '{name}': it is a function of the language; "
                         f"choose another name")
    if name in CONSTANTS or name in _KEYWORDS:
        raise CheckError(f"cannot define summary '{name}': the name is reserved by the language")


def _fields(name: str, fields) -> list[Field]:
    if isinstance(fields, str):
        fields = (fields,)
    out = []
    for f in fields:
        fname, dtype = (f, FLOAT) if isinstance(f, str) else tuple(f)
        if not isinstance(fname, str) or not _NAME.match(fname):
            raise CheckError(f"summary '{name}': field name {fname!r} is not an identifier")
        if dtype not in (FLOAT, INT):
            raise CheckError(f"summary '{name}': field '{fname}' has dtype {dtype!r}; "
                             f"use '{FLOAT}' or '{INT}'")
        if fname in (g.name for g in out):
            raise CheckError(f"summary '{name}': field '{fname}' is declared twice")
        out.append(Field(fname, dtype))
    if not out:
        raise CheckError(f"summary '{name}' needs at least one field")
    return out


def _identity(name: str, identity, n: int) -> tuple[Const, ...]:
    if isinstance(identity, int | float):
        identity = (identity,)
    values = tuple(identity)
    if len(values) != n:
        raise CheckError(f"summary '{name}': identity has {len(values)} value(s) for {n} field(s)")
    for v in values:
        if isinstance(v, bool) or not isinstance(v, int | float) or math.isnan(v):
            raise CheckError(f"summary '{name}': identity value {v!r} is not a number")
    return tuple(Const(float(v)) for v in values)


def _arity(name: str, lift: Callable, arity: int | None) -> int:
    if arity is not None:
        if not isinstance(arity, int) or arity < 1:
            raise CheckError(f"summary '{name}': arity must be a positive integer, got {arity!r}")
        return arity
    try:
        params = inspect.signature(lift).parameters.values()
    except (TypeError, ValueError):
        raise CheckError(f"summary '{name}': cannot read lift's parameters; give arity=") from None
    if any(p.kind is p.VAR_POSITIONAL for p in params):
        raise CheckError(f"summary '{name}': lift takes *args; give arity=")
    n = sum(1 for p in params if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)
            and p.default is p.empty)
    if n < 1:
        raise CheckError(f"summary '{name}': lift must take at least one element argument")
    return n


def _trace(name: str, part: str, f: Callable, *args) -> Any:
    try:
        return f(*args)
    except (TypeError, AttributeError) as err:
        raise CheckError(f"summary '{name}': cannot trace {part}: {err}") from err


def _per_field(name: str, part: str, value, names: tuple[str, ...]) -> tuple[Expr, ...]:
    if isinstance(value, Mapping):
        missing = set(names) - set(value)
        extra = set(value) - set(names)
        if missing or extra:
            raise CheckError(f"summary '{name}': {part} returned fields {sorted(value)}, "
                             f"expected {list(names)}")
        value = tuple(value[n] for n in names)
    elif not isinstance(value, tuple | list):
        value = (value,)
    if len(value) != len(names):
        raise CheckError(f"summary '{name}': {part} returned {len(value)} value(s) for "
                         f"{len(names)} field(s) ({', '.join(names)})")
    try:
        return tuple(lift_value(v) for v in value)
    except TypeError as err:
        raise CheckError(f"summary '{name}': {part}: {err}") from err


__all__ = ["Sym", "fn", "state", "summary"]
