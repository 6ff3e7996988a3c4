"""A two-way bridge between IR expressions and sympy, for the passes.

Reductions, accesses and index values become opaque symbols (so sympy reasons
about the algebra around them); the elementary operators map to sympy's own;
every other operator becomes an opaque sympy Function of its name, so that
rewriting never expands gelu or where into something unreadable.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field

import sympy

from ..ir import Access, Call, Const, Expr, Extent, Index, Reduce, Var
from ..ops import OPS

_ELEMENTARY = {"add", "sub", "mul", "div", "pow", "neg", "exp", "log"}


@dataclass
class SymbolTable:
    """Opaque leaves <-> sympy symbols, with assumptions that let sympy cancel."""

    to_symbol: dict[Expr, sympy.Symbol] = field(default_factory=dict)
    to_expr: dict[sympy.Symbol, Expr] = field(default_factory=dict)

    def symbol(self, e: Expr, **assumptions) -> sympy.Symbol:
        if e not in self.to_symbol:
            s = sympy.Symbol(f"_e{len(self.to_symbol)}", **assumptions)
            self.to_symbol[e] = s
            self.to_expr[s] = e
        return self.to_symbol[e]


def to_sympy(e: Expr, table: SymbolTable, positive: frozenset = frozenset()) -> sympy.Expr:
    """`positive`: opaque leaves known to be > 0 (sums of exponentials)."""
    if isinstance(e, Const):
        if e.value == math.inf:
            return sympy.oo
        if e.value == -math.inf:
            return -sympy.oo
        if isinstance(e.value, int):
            return sympy.Integer(e.value)
        return sympy.Float(e.value) if e.value != math.pi else sympy.pi
    if isinstance(e, Call) and e.op in _ELEMENTARY:
        return OPS[e.op].sympy(*(to_sympy(a, table, positive) for a in e.args))
    if isinstance(e, Call):
        return sympy.Function(e.op)(*(to_sympy(a, table, positive) for a in e.args))
    if isinstance(e, Extent):
        return table.symbol(e, integer=True, positive=True)
    if isinstance(e, Access | Index | Var | Reduce):
        return table.symbol(e, positive=True) if e in positive else table.symbol(e, real=True)
    raise TypeError(f"no symbolic form for {type(e).__name__}")


def from_sympy(s: sympy.Expr, table: SymbolTable) -> Expr:
    if s in table.to_expr:
        return table.to_expr[s]
    if s == sympy.oo:
        return Const(math.inf)
    if s == -sympy.oo:
        return Const(-math.inf)
    if s == sympy.pi:
        return Const(math.pi)
    if s.is_Integer:
        return Const(int(s))
    if s.is_Rational:
        return Call("div", (Const(int(s.p)), Const(int(s.q))))
    if s.is_Number:
        return Const(float(s))
    if isinstance(s, sympy.Add):
        terms = sorted(s.args, key=_is_negative)       # positive terms first
        out = from_sympy(terms[0], table)
        for t in terms[1:]:
            if _is_negative(t):
                out = Call("sub", (out, from_sympy(-t, table)))
            else:
                out = Call("add", (out, from_sympy(t, table)))
        return out
    if isinstance(s, sympy.Mul):
        coeff, rest = s.as_coeff_Mul()
        if coeff == -1:
            return Call("neg", (from_sympy(rest, table),))
        num, den = [], []
        for f in sympy.Mul.make_args(s):
            if f.is_Pow and f.exp.is_Number and f.exp < 0:
                den.append(f.base ** -f.exp)
            elif f.is_Rational and not f.is_Integer and f.p == 1:
                den.append(sympy.Integer(f.q))
            else:
                num.append(f)
        out = _product([from_sympy(f, table) for f in num]) if num else Const(1)
        return Call("div", (out, _product([from_sympy(f, table) for f in den]))) if den else out
    if isinstance(s, sympy.Pow):
        if s.exp == sympy.Rational(1, 2):
            return Call("sqrt", (from_sympy(s.base, table),))
        if s.exp == -sympy.Rational(1, 2):
            return Call("rsqrt", (from_sympy(s.base, table),))
        if s.exp.is_Number and s.exp < 0:
            return Call("div", (Const(1), from_sympy(s.base ** -s.exp, table)))
        if s.base == sympy.E:
            return Call("exp", (from_sympy(s.exp, table),))
        return Call("pow", (from_sympy(s.base, table), from_sympy(s.exp, table)))
    if isinstance(s, sympy.exp):
        return Call("exp", (from_sympy(s.args[0], table),))
    if isinstance(s, sympy.log):
        return Call("log", (from_sympy(s.args[0], table),))
    if isinstance(s, sympy.core.function.AppliedUndef) and str(s.func) in OPS:
        return Call(str(s.func), tuple(from_sympy(a, table) for a in s.args))
    raise TypeError(f"cannot turn {s} back into the IR")


def _is_negative(t: sympy.Expr) -> bool:
    return t.could_extract_minus_sign()


def _product(factors: list[Expr]) -> Expr:
    out = factors[0]
    for f in factors[1:]:
        out = Call("mul", (out, f))
    return out
