"""Loop bounds from index predicates: a conjunct of a mask such as `m <= i`,
`i - m < W` or `m <= i + len(m) - len(i)` bounds a fold's loop over `m` when
the elements where it fails contribute nothing (their masked argument acts as
the summary's identity).  A loop over `m` then starts at the first and stops
after the last tile where every such relation can hold, and the tiles where a
relation holds everywhere run without its mask (`assume_relation`).  A
conjunct that reads tensors (a document mask's `D[i] == D[m]`) bounds nothing
before the run, but a tile where it fails everywhere contributes nothing
either: the loop tests it per tile and skips the tile (`tile_tests`).  Where such
a conjunct is a comparison whose sides vary over the loop index alone (`D[b,m]`
beside the row's `D[b,i]`), the Triton backend also scans the sides before the
loop and runs it over the live span only: from the first to the last tile where
the comparison may hold (KernelEmitter.live_span)."""
from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, replace
from functools import lru_cache
from types import MappingProxyType

import sympy

from ..algebra.formula import to_sympy
from ..errors import CheckError
from ..ir import (Call, Composite, Const, Expr, Index, Reduce, Var, children, constant, format_expr, free_indices,
                  linear_form, nodes, reads, substitute, transform, walk)
from ..ops import OPS, PREDICATES
from ..passes.fuse import substitute_affine


_FLIP = {"le": "ge", "lt": "gt", "ge": "le", "gt": "lt"}


def _conjuncts(e: Expr) -> list[Expr]:
    if isinstance(e, Call) and e.op == "and":
        return _conjuncts(e.args[0]) + _conjuncts(e.args[1])
    return [e]


def _real(name: str) -> sympy.Symbol:
    """Any finite real value (an argument, a leader, an element read from memory)."""
    return sympy.Symbol(name, real=True, finite=True)


@lru_cache(maxsize=None)
def acts_as_identity(summary, masked: tuple[tuple[int, sympy.Expr], ...]) -> bool:
    """Whether an element whose arguments k are the values `masked` ((k, value) each)
    contributes nothing to a fold, whatever the other (finite) arguments: its lift is the identity, or
    (rescaled fields) its leader argument is the leader's identity and its weight
    is 0 for any finite leader.  Decided symbolically: each formula with the other
    arguments as finite real symbols must reduce to the identity itself (sympy's
    automatic evaluation: exp(-oo) = 0, max(-oo, y) = y, 0 * y = 0)."""
    xs = {f"x{j}": _real(f"x{j}") for j in range(summary.arity)}
    xs.update({f"x{k}": value for k, value in masked})
    try:
        identity = {name: to_sympy(c, {}) for name, c in zip(summary.field_names, summary.identity)}
        covered = set()
        for rs in summary.rescaled:
            if to_sympy(rs.leader_arg, xs) != identity[rs.leader] or \
                    to_sympy(rs.weight, {**xs, "r": _real("r")}) != 0:
                return False
            covered |= {rs.leader} | {f for f, _ in rs.values}
        return all(to_sympy(lift, xs) == identity[name]
                   for name, lift in zip(summary.field_names, summary.lift) if name not in covered)
    except (TypeError, ValueError):      # a formula sympy cannot state: no claim
        return False


@dataclass(frozen=True)
class Bound:
    """`index op sign * other + offset`, read off a conjunct of a masking predicate:
    `other` is an index outside the fold (None: the bound is the same for the whole
    program), `offset` an expression of scalars, extents and constants.  So
    `m <= i` is (m, le, i, +1, 0), a window `i - m < W` is (m, gt, i, +1, -W),
    bottom-right causal `m <= i + len(m) - len(i)` is (m, le, i, +1, len(m) - len(i))."""

    index: str
    op: str                 # le, lt, ge, gt
    other: str | None
    sign: int               # +1 or -1: the coefficient of `other`
    offset: Expr
    conjunct: Expr          # the predicate conjunct it was read off
    # the index's coefficient, > 0: `scale * index op sign * other + offset` (a stride's
    # window, `s - 2 * y < 2` read off a pooling gradient, bounds y by halves of s)
    scale: int = 1

    @property
    def upper(self) -> bool:
        return self.op in ("le", "lt")

    @property
    def side(self) -> Expr:
        """The right-hand side as an expression."""
        if self.other is None:
            return self.offset
        other = Index(self.other) if self.sign > 0 else Call("neg", (Index(self.other),))
        c = constant(self.offset)
        if c == 0:
            return other
        if c is not None and c < 0:
            return Call("sub", (other, Const(-c if c != int(c) else -int(c))))
        if isinstance(self.offset, Call) and self.offset.op == "neg":
            return Call("sub", (other, self.offset.args[0]))
        return Call("add", (other, self.offset))

    def __str__(self) -> str:
        index = self.index if self.scale == 1 else f"{self.scale} * {self.index}"
        return f"{index} {OPS[self.op].symbol} {format_expr(self.side)}"


def _sum_of(terms: list[tuple[int, Expr]]) -> Expr:
    out: Expr | None = None
    for sign, t in terms:
        if out is None:
            out = t if sign > 0 else Call("neg", (t,))
        else:
            out = Call("add" if sign > 0 else "sub", (out, t))
    return Const(0) if out is None else out


def _bound(c: Expr, index: str, bound: tuple[str, ...]) -> Bound | None:
    """The bound `c` puts on `index`, if it is a comparison linear in `index` with an
    integer coefficient, involving at most one other index (outside the fold's
    `bound` indices), with coefficient +-1."""
    if not (isinstance(c, Call) and c.op in _FLIP):
        return None
    left, right = linear_form(c.args[0]), linear_form(c.args[1])
    if left is None or right is None:
        return None
    coeffs = dict(left[0])                  # left - right  op  0
    for n, v in right[0].items():
        coeffs[n] = coeffs.get(n, 0) - v
    coeffs = {n: v for n, v in coeffs.items() if v}
    terms = left[1] + [(-s, t) for s, t in right[1]]
    own = coeffs.pop(index, 0)
    if own == 0 or any(n in bound for n in coeffs) or len(coeffs) > 1 \
            or any(abs(v) != 1 for v in coeffs.values()):
        return None
    # own * index + co * other + terms  op  0, as |own| * index op' u * (-co * other - terms)
    u = 1 if own > 0 else -1
    op = c.op if own > 0 else _FLIP[c.op]
    other, co = next(iter(coeffs.items()), (None, 0))
    offset = _sum_of([(-u * s, t) for s, t in terms])
    return Bound(index, op, other, -u * co if other else 1, offset, c, abs(own))


@lru_cache(maxsize=4096)
def index_bounds(fold: Reduce) -> Mapping[str, tuple[Bound, ...]]:
    """Per bound index b of `fold`: the bounds (b op sign * other + offset) such that
    elements where one fails contribute nothing.  Where the relation fails,
    every where(...) with it among its conjuncts selects its else branch, wherever
    it sits in an argument (the argument itself, a factor of a product, inside an
    exponential); the argument must then be a constant that acts as the identity,
    for any finite value of everything else (decided symbolically: _contributes_nothing).  So
    where(m <= i, x, -inf) under a softmax's max, K * where(m <= i, g, 0) under a
    sum and exp(min(where(m <= i, x, -inf) - L, 0)) * dO under a sum all bound m.
    A loop over b starts at the first and stops after the last tile where every
    such relation can hold (a causal mask's upper triangle, a window's far past)."""
    out: dict[str, list[Bound]] = {}
    conjuncts = dict.fromkeys(c for arg in fold.args for w in nodes(arg)
                              if isinstance(w, Call) and w.op == "where" for c in _conjuncts(w.args[0]))
    for c in conjuncts:
        for index in fold.indices:
            found = _bound(c, index, fold.indices)
            if found is None or found in out.get(index, []):
                continue
            if _contributes_nothing(fold, c):
                out.setdefault(index, []).append(found)
    return MappingProxyType({index: tuple(found) for index, found in out.items()})   # cached: read-only


@lru_cache(maxsize=4096)
def data_tests(fold: Reduce) -> Mapping[str, tuple[Expr, ...]]:
    """Per bound index b of `fold`: the conjuncts of its masking predicates that
    read a tensor and vary over b (data: no bound follows from them before the
    run), such that elements where one fails contribute nothing, as for
    `index_bounds` (a sorted loop's equality: specialise.ir.SortedLoop)."""
    out: dict[str, list[Expr]] = {}
    conjuncts = dict.fromkeys(c for arg in fold.args for w in nodes(arg)
                              if isinstance(w, Call) and w.op == "where" for c in _conjuncts(w.args[0]))
    for c in conjuncts:
        if not reads(c):
            continue
        for index in fold.indices:
            # a conjunct linear in the index whose tensors are scalars (a shard's start)
            # is a bound (index_bounds): the loop's range decides it, no tile tests it
            if index in free_indices(c) and _bound(c, index, fold.indices) is None \
                    and _contributes_nothing(fold, c):
                out.setdefault(index, []).append(c)
    return MappingProxyType({index: tuple(tests) for index, tests in out.items()})   # cached: read-only


@lru_cache(maxsize=4096)
def tile_tests(fold: Reduce) -> Mapping[str, tuple[Expr, ...]]:
    """`data_tests` that read no tensor the update reads otherwise (a document's ids, a
    padding mask, beside the keys and values).  A tile of b where such a conjunct
    fails for every element leaves the state as it was: the loop may skip it.
    Testing one that reads the update's own data (`where(X > 0, X, 0)`) would load
    that data to save nothing."""
    def rest(c: Expr) -> set[str]:
        return reads(Call("and", tuple(transform(a, lambda n: Const(True) if n == c else n) for a in fold.args))
                     if len(fold.args) > 1 else transform(fold.args[0], lambda n: Const(True) if n == c else n))
    return MappingProxyType({index: kept for index, tests in data_tests(fold).items()
                             if (kept := tuple(c for c in tests if not reads(c) & rest(c)))})


def _masks(arg: Expr, relation: Expr) -> bool:
    return any(_selects_by(w, relation) for w in nodes(arg))


def _selects_by(e: Expr, relation: Expr) -> bool:
    return isinstance(e, Call) and e.op == "where" and relation in _conjuncts(e.args[0])


def _contributes_nothing(fold: Reduce, relation: Expr) -> bool:
    """Whether an element of `fold` where `relation` fails contributes nothing: one
    masked argument that acts as the identity there suffices, whatever the others are
    (a softmax's scores); else every argument `relation` masks, taken together (a
    product of two sums, each over its own masked argument: dK's and dV's)."""
    masked = [(k, _masked_value(arg, relation)) for k, arg in enumerate(fold.args) if _masks(arg, relation)]
    masked = [(k, v) for k, v in masked if v is not None]
    if any(acts_as_identity(fold.summary, ((k, v),)) for k, v in masked):
        return True
    return len(masked) > 1 and acts_as_identity(fold.summary, tuple(masked))


def _masked_value(arg: Expr, relation: Expr) -> sympy.Expr | None:
    """The constant `arg` is wherever `relation` fails, or None: its masks take their
    else branches, and what they leave must be one constant whatever the rest holds
    (each other leaf a finite real symbol, a predicate left standing a boolean one)."""
    leaves: dict[Expr, sympy.Symbol] = {}

    def failing(e: Expr) -> sympy.Expr | None:
        if _selects_by(e, relation):
            return failing(e.args[2])
        if not any(_selects_by(w, relation) for w in nodes(e)):
            if constant(e) is not None:
                return to_sympy(e, {})
            if e not in leaves:
                name = f"v{len(leaves)}"
                leaves[e] = sympy.Symbol(name) if _predicate(e) else _real(name)
            return leaves[e]
        if not isinstance(e, Call):
            return None                       # a mask inside a reduction or an access: unknown
        parts = [failing(a) for a in e.args]
        return None if None in parts else OPS[e.op].sympy(*parts)

    try:
        masked = failing(arg)
    except (TypeError, ValueError):
        return None
    # one constant (no symbol left); NaN then equals no identity
    return masked if masked is not None and masked.is_number else None


def _predicate(e: Expr) -> bool:
    """Whether `e` is a comparison or a logical combination of them."""
    return isinstance(e, Call) and e.op in PREDICATES


def assume_relation(fold: Reduce, relation: Bound) -> Reduce:
    """`fold` on the tiles where `relation` holds for every element: that
    conjunct of the masking predicates is true there, and a predicate left with
    no conjunct selects its value outright (interior tiles pay for no mask).
    A fold nested in the arguments that binds an index the relation names binds
    another variable: its masks stay (dQ's sum over m recomputes the softmax
    statistics of its row over every m, causal mask and all; cummax's gradient
    at s, summed over t >= s, recomputes max[s](where(s <= t, X[s], -inf)), whose
    s is its own)."""
    # the outermost such folds are set aside as opaque names while the masks are rewritten
    named = {relation.index} | ({relation.other} if relation.other else set())
    shadowing: dict[Expr, Var] = {}
    stack = list(fold.args)
    while stack:
        n = stack.pop()
        if isinstance(n, Reduce) and named & set(n.indices):
            shadowing.setdefault(n, Var(f"\0shadow{len(shadowing)}"))
        else:
            stack.extend(children(n))
    restore = {v: n for n, v in shadowing.items()}

    def rewrite(arg: Expr) -> Expr:
        if not (isinstance(arg, Call) and arg.op == "where"):
            return arg
        kept = [c for c in _conjuncts(arg.args[0]) if c != relation.conjunct]
        if len(kept) == len(_conjuncts(arg.args[0])):
            return arg
        if not kept:
            return arg.args[1]
        condition = kept[0]
        for c in kept[1:]:
            condition = Call("and", (condition, c))
        return Call("where", (condition, arg.args[1], arg.args[2]))
    # top-down: a shadowed fold's own subtree (which may hold another) is not searched
    args = [substitute(a, shadowing) for a in fold.args]
    args = [transform(a, rewrite) for a in args]
    return replace(fold, args=tuple(substitute(a, restore) for a in args))


@dataclass(frozen=True)
class Prefix:
    """A fold that is the prefix (or suffix) of another along an index `over`: its one
    index `index` masked by a single relation to `over` (`s <= t + offset`; a suffix,
    `reverse`: `s >= t + offset`), its arguments reading `over` nowhere else.  The value
    at t is the fold of the elements at s = t + offset for every t up to it (from it),
    so a kernel may run `over` in order and scan (specialise.ir.FoldLoops.prefix: where
    `over` is a grid index, and a suffix's last element reaches the last s).
    `element`: the fold's arguments at s = t + offset, the relation assumed (the
    condition's other conjuncts stay)."""
    index: str
    over: str
    offset: int
    reverse: bool
    conjunct: Expr
    element: tuple[Expr, ...]

    @property
    def position(self) -> str:
        """The position of s that the element at t reads: `t - 1`."""
        return self.over + (f" + {self.offset}" if self.offset > 0 else f" - {-self.offset}" if self.offset else "")

    def __str__(self) -> str:
        kind = "suffix" if self.reverse else "prefix"
        return (f"{kind} scan along {self.over} ({format_expr(self.conjunct)}): the element of {self.over} "
                f"is {self.index} = {self.position}")


@lru_cache(maxsize=4096)
def prefix_of(fold: Reduce) -> Prefix | None:
    """The prefix `fold` is, where its one index s is masked by a single relation
    `s <= t + c` (`s < t + c`; a suffix: `s >= t + c`, `s > t + c`), c an integer, to an
    index t that its arguments read nowhere else.  A prefix's elements start at
    s = t + c <= 0, so that a scan from t's first position covers every s from 0."""
    if len(fold.indices) != 1:
        return None
    (index,) = fold.indices
    relations = index_bounds(fold).get(index, ())
    if len(relations) != 1:
        return None
    (b,) = relations
    c = constant(b.offset)
    if b.other is None or b.sign != 1 or c is None or c != int(c):
        return None
    offset = int(c) + {"le": 0, "lt": -1, "ge": 0, "gt": 1}[b.op]
    reverse = b.op in ("ge", "gt")
    if offset > 0 and not reverse:
        return None
    assumed = assume_relation(fold, b)
    if any(b.other in free_indices(a) for a in assumed.args) or any(
            isinstance(n, Composite) and index in n.indices for a in assumed.args for n in walk(a)):
        return None
    taken = {n.name for a in assumed.args for n in walk(a) if isinstance(n, Index)} | set(fold.indices)

    def fresh(name: str) -> str:
        k = 1
        while f"{name}{k}" in taken:
            k += 1
        taken.add(f"{name}{k}")
        return f"{name}{k}"
    try:
        element = tuple(substitute_affine(a, {index: ({b.other: 1}, offset)}, fresh, None) for a in assumed.args)
    except CheckError:
        return None
    return Prefix(index, b.other, offset, reverse, b.conjunct, element)
