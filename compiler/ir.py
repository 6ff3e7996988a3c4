"""The IR: a small vocabulary of frozen expression nodes, statements and programs,
with one canonical printed form that parses back.

Every node may carry the source span it came from (`span`, ignored by equality)
so that errors found late can still point at the text.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field, replace
from itertools import chain, count
from typing import Callable, Iterator, Mapping

import sympy

from .errors import Span
from .ops import FLOAT, OPS, PREC_ADD, PREC_ATOM, PREC_CMP, PREC_UNARY

_node = dataclass(frozen=True, slots=True)


def _span_field():
    return field(default=None, compare=False, repr=False)


def _hash_field():
    """A value computed once from the node's fields (not compared, not printed)."""
    return field(default=None, init=False, compare=False, repr=False)


class Expr:
    """Base of expression nodes."""

    __slots__ = ()


def _pairs_agree(a, b, agree) -> bool:
    """Walk `a` and `b` together, each pair of node objects once, so that trees that
    share subtrees (a lowered softmax repeats its argument; nested, the tree is
    exponential in the depth) compare in time linear in their distinct nodes.
    `agree(x, y)` (nodes of one type): None where they differ, else the pairs of
    their children still to compare."""
    stack, compared = [(a, b)], set()
    while stack:
        x, y = stack.pop()
        if x is y or (id(x), id(y)) in compared:
            continue
        compared.add((id(x), id(y)))
        if type(x) is not type(y):
            return False
        pairs = agree(x, y)
        if pairs is None:
            return False
        stack.extend(pairs)
    return True


def _equal(self: Expr, other: object) -> bool:
    """`==` of two expressions (the nodes that have children use it), each pair of
    nodes once (_pairs_agree); hashes, computed once per node, settle most unequal
    pairs at once.  Constants compare as numbers (1 == 1.0)."""
    if self is other:
        return True
    if type(other) is not type(self):
        return NotImplemented
    return _pairs_agree(self, other, _fields_agree)


def _fields_agree(x, y):
    """_equal's step: None where the nodes' own fields differ, else their child pairs."""
    fields = getattr(x, "_hashed", None)
    if fields is None:                      # a leaf: plain values
        return () if x == y else None
    if hash(x) != hash(y):
        return None
    pairs = []
    for f in fields:
        a, b = getattr(x, f), getattr(y, f)
        if f == "args":
            if len(a) != len(b):
                return None
            pairs.extend(zip(a, b))
        elif f == "arg":
            pairs.append((a, b))
        elif a != b:
            return None
    return pairs


@_node
class Const(Expr):
    value: int | float
    span: Span | None = _span_field()


@_node
class Gather:
    """What a gathered dimension's position adds to its affine part: the value of an
    integer input read at affine subscripts over the enclosing read's indices, times
    `scale` (`T[i]` of `E[T[i], d]`).  `layout` holds, per dimension of `tensor`,
    (coefficients over the enclosing Access's indices, constant): positional, so
    renaming the enclosing read's indices renames these too."""

    tensor: str
    layout: tuple[tuple[tuple[int, ...], int], ...]
    scale: int = 1


@_node
class Access(Expr):
    """Read of a tensor (input or earlier statement); rank 0 reads a scalar.

    `indices` are the indices the read varies over.  Without a `layout`, dimension d
    of the tensor is read at `indices[d]`.  With one (an affine subscript,
    `X[b, c, t + r]`), dimension d is read at `sum(layout[d][0][j] * indices[j]) +
    layout[d][1]`, plus, where `gathers[d]` is set (`E[T[i], d]`), the integer it
    reads; a position outside the tensor reads 0 (docs/language.md)."""

    tensor: str
    indices: tuple[str, ...]
    span: Span | None = _span_field()
    layout: tuple[tuple[tuple[int, ...], int], ...] | None = None
    gathers: tuple[Gather | None, ...] | None = None

    @property
    def rank(self) -> int:
        """The tensor's number of dimensions."""
        return len(self.indices) if self.layout is None else len(self.layout)

    def affine(self, d: int) -> tuple[dict[str, int], int]:
        """Dimension d's subscript as ({index: coefficient}, constant), less any
        gathered value (`gathered`)."""
        if self.layout is None:
            return {self.indices[d]: 1}, 0
        coeffs, constant = self.layout[d]
        return {n: c for n, c in zip(self.indices, coeffs) if c}, constant

    def gathered(self, d: int) -> tuple[Access, int] | None:
        """The integer read that dimension d's position adds, and its factor; None
        where the dimension is affine."""
        g = self.gathers[d] if self.gathers is not None else None
        if g is None:
            return None
        subscripts = tuple(({n: c for n, c in zip(self.indices, coeffs) if c}, constant)
                           for coeffs, constant in g.layout)
        return affine_access(g.tensor, subscripts, self.span), g.scale

    def gather_reads(self) -> tuple[Access, ...]:
        """The integer reads of its gathered dimensions, in dimension order."""
        return tuple(found[0] for d in range(self.rank) if (found := self.gathered(d)) is not None)

    def subscripts(self) -> tuple[str, ...]:
        """Each dimension's subscript as written: an index name, `2*t + r - 1`, `T[i] + 1`."""
        if self.layout is None:
            return self.indices
        out = []
        for d in range(self.rank):
            terms, constant = self.affine(d)
            found = self.gathered(d)
            if found is not None:
                read, scale = found
                terms = {format_expr(read): scale, **terms}
            out.append(format_affine(terms, constant))
        return tuple(out)

    def dimension_index(self, d: int) -> str | None:
        """The index dimension d reads alone (coefficient 1, no constant), or None."""
        if self.layout is None:
            return self.indices[d]
        if self.gathers is not None and self.gathers[d] is not None:
            return None
        terms, constant = self.affine(d)
        return next(iter(terms)) if constant == 0 and list(terms.values()) == [1] else None


def affine_access(tensor: str, subscripts: tuple[tuple[dict[str, int], int], ...],
                  span: Span | None = None,
                  gathers: tuple[tuple[Access, int] | None, ...] | None = None) -> Access:
    """The read of `tensor` whose dimension d is at `sum(c * index) + constant` for
    `subscripts[d] = ({index: c}, constant)`, plus `scale` times the integer read
    `gathers[d] = (read, scale)` where one is given: a plain Access where every
    dimension reads one index, else one with a layout over the indices in order of
    occurrence."""
    gathers = gathers if gathers is not None and any(g is not None for g in gathers) else None
    if gathers is None and all(constant == 0 and len(terms) == 1 and set(terms.values()) == {1}
                               for terms, constant in subscripts):
        return Access(tensor, tuple(next(iter(terms)) for terms, _ in subscripts), span)
    occurring = []
    for d, (terms, _) in enumerate(subscripts):
        if gathers is not None and gathers[d] is not None:
            read = gathers[d][0]
            occurring += [n for k in range(read.rank) for n, c in read.affine(k)[0].items() if c]
        occurring += [n for n, c in terms.items() if c]
    names = tuple(dict.fromkeys(occurring))

    def row(terms: Mapping[str, int], constant: int) -> tuple[tuple[int, ...], int]:
        return tuple(terms.get(n, 0) for n in names), constant

    layout = tuple(row(terms, constant) for terms, constant in subscripts)
    if gathers is None:
        return Access(tensor, names, span, layout)
    rows = tuple(None if g is None else Gather(g[0].tensor, tuple(row(*g[0].affine(k)) for k in range(g[0].rank)),
                                               g[1]) for g in gathers)
    return Access(tensor, names, span, layout, rows)


def format_affine(terms: Mapping[str, int], constant: int) -> str:
    """`2*t + r - 1`: an affine subscript as the language writes it."""
    parts = []
    for name, c in terms.items():
        if c == 0:
            continue
        term = name if abs(c) == 1 else f"{abs(c)}*{name}"
        parts.append(("- " if c < 0 else "+ ") + term if parts else ("-" if c < 0 else "") + term)
    if constant or not parts:
        parts.append(f"{'-' if constant < 0 else '+'} {abs(constant)}" if parts else str(constant))
    return " ".join(parts)


@_node
class Index(Expr):
    """An index used as an integer value (`m <= i`)."""

    name: str
    span: Span | None = _span_field()


@_node
class Extent(Expr):
    """`len(k)`: the extent of an index."""

    name: str
    span: Span | None = _span_field()


@_node
class Var(Expr):
    """A local name inside a summary's formulas (lift arguments, fields)."""

    name: str
    span: Span | None = _span_field()


@_node
class Call(Expr):
    """Elementwise operator application; `op` keys ops.OPS."""

    op: str
    args: tuple[Expr, ...]
    span: Span | None = _span_field()
    _hash: int | None = _hash_field()
    _free: tuple[str, ...] | None = _hash_field()     # free_indices, once computed
    _hashed = ("op", "args")
    __eq__ = _equal

    def __hash__(self) -> int:
        # computed once per node: a structural hash of a deep tree costs its size
        if self._hash is None:
            object.__setattr__(self, "_hash", hash((type(self), *(getattr(self, f) for f in self._hashed))))
        return self._hash


@_node
class Reduce(Expr):
    """Fold of `args` over `indices` in the monoid `summary` (an algebra.Summary).

    The value is `summary.finalize` of the folded state, or, when `result` names a
    field, that field of the state.  Reduce nodes equal but for `result` are one
    fold: a backend computes the state once and projects several fields."""

    summary: object
    indices: tuple[str, ...]
    args: tuple[Expr, ...]
    result: str | None = None
    span: Span | None = _span_field()
    _hash: int | None = _hash_field()
    _free: tuple[str, ...] | None = _hash_field()     # free_indices, once computed
    _hashed = ("summary", "indices", "args", "result")
    __eq__ = _equal

    def __hash__(self) -> int:
        # computed once per node: a structural hash of a deep tree costs its size
        if self._hash is None:
            object.__setattr__(self, "_hash", hash((type(self), *(getattr(self, f) for f in self._hashed))))
        return self._hash

    @property
    def fold(self) -> "Reduce":
        """The fold itself, independent of which result is projected."""
        return self if self.result is None else replace(self, result=None)


# The composites whose result keeps the reduced index (softmax's is a distribution
# over it): the IR needs this to know which indices a node binds, so it lives here,
# below algebra/composites.py, which reads it for the rest of each composite's meaning.
COMPOSITES_KEEPING_INDEX = frozenset({"softmax"})


@_node
class Composite(Expr):
    """A reduction defined in terms of primitive ones (softmax, mean, logsumexp);
    the `lower` pass expands it.  `op` keys algebra.COMPOSITES."""

    op: str
    indices: tuple[str, ...]
    arg: Expr
    span: Span | None = _span_field()
    _hash: int | None = _hash_field()
    _free: tuple[str, ...] | None = _hash_field()     # free_indices, once computed
    _hashed = ("op", "indices", "arg")
    __eq__ = _equal

    def __hash__(self) -> int:
        # computed once per node: a structural hash of a deep tree costs its size
        if self._hash is None:
            object.__setattr__(self, "_hash", hash((type(self), *(getattr(self, f) for f in self._hashed))))
        return self._hash


@_node
class Assign:
    name: str
    indices: tuple[str, ...]
    expr: Expr
    dtype: str                      # ops.FLOAT / INT / BOOL
    span: Span | None = _span_field()


@_node
class Input:
    name: str
    rank: int
    span: Span | None = _span_field()   # first use
    # ops.FLOAT / INT / BOOL, as Assign.dtype: bool where the program reads it as a condition,
    # else float, or int in a program specialised to an integer tensor (Program._specialised)
    dtype: str = FLOAT


@_node
class DerivedExtent:
    """The extent of an index that no dimension measures and affine subscripts read
    (`t` of `X[t + r]`): the positions 0, 1, ... at which each such read stays below
    its dimension's extent, len(X) - len(r) + 1 there.  `reads` holds, per read,
    (the dimension's extent, the index's coefficient (> 0), the other indices'
    (extent, coefficient), the constant)."""

    symbol: sympy.Symbol
    reads: tuple[tuple[sympy.Symbol, int, tuple[tuple[sympy.Symbol, int], ...], int], ...]

    @staticmethod
    def symbols(read) -> tuple[sympy.Symbol, ...]:
        """The extents one of `reads` needs."""
        dimension, _, others, _ = read
        return (dimension, *(n for n, _ in others))

    def value(self, extent: Callable[[sympy.Symbol], int]) -> int:
        """The extent, given those of the other symbols (ints, or torch's symbolic sizes)."""
        out = None
        for dimension, c, others, constant in self.reads:
            # the largest position of the other terms (a negative coefficient: at 0)
            reach = constant + sum(k * (extent(n) - 1) for n, k in others if k > 0)
            if any(extent(n) == 0 for n, _ in others):
                continue            # no reads at all: no bound
            fits = (extent(dimension) - 1 - reach) // c + 1
            out = fits if out is None else min(out, fits)
        return max(out, 0) if out is not None else 0


@_node
class Program:
    statements: tuple[Assign, ...]
    inputs: tuple[Input, ...]
    outputs: tuple[str, ...]
    extents: tuple[tuple[str, sympy.Symbol], ...]   # index -> extent symbol (shared by unified indices)
    source: str = field(default="", compare=False, repr=False)
    # what a pass says of reductions it left as they are (factorise: why no rule applied)
    notes: tuple[str, ...] = field(default=(), compare=False, repr=False)
    # extents that affine subscripts derive, in the order they are computed (check._derive_extents)
    derived: tuple[DerivedExtent, ...] = ()
    # the dimensions read at affine subscripts ("X#2") and the symbols of their extents
    dimensions: tuple[tuple[str, sympy.Symbol], ...] = ()

    def extent(self, index: str) -> sympy.Symbol:
        return dict(self.extents)[index]

    def statement(self, name: str) -> Assign:
        for s in self.statements:
            if s.name == name:
                return s
        raise KeyError(name)

    @property
    def sizes(self) -> dict[str, sympy.Symbol]:
        """The size inputs (an index only on a left-hand side, which no input measures,
        takes its extent from the call under its own name: check._check_extents_known),
        with the extent symbol each gives."""
        extents = dict(self.extents)
        return {i.name: extents[i.name] for i in self.inputs if i.name in extents}


# ---------------------------------------------------------------- traversal
def children(e: Expr) -> tuple[Expr, ...]:
    if isinstance(e, Call | Reduce):
        return e.args
    if isinstance(e, Composite):
        return (e.arg,)
    return ()


def with_children(e: Expr, new: tuple[Expr, ...]) -> Expr:
    if isinstance(e, Call | Reduce):
        # identity, not equality: comparing deep trees would recurse (and cost their size)
        same = len(new) == len(e.args) and all(a is b for a, b in zip(new, e.args))
        return e if same else replace(e, args=tuple(new))
    if isinstance(e, Composite):
        return e if new[0] is e.arg else replace(e, arg=new[0])
    return e


def walk(e: Expr) -> Iterator[Expr]:
    """Pre-order traversal (iterative: any depth, linear time)."""
    stack = [e]
    while stack:
        node = stack.pop()
        yield node
        kids = children(node)
        if kids:
            stack.extend(reversed(kids))


def nodes(e: Expr) -> Iterator[Expr]:
    """walk's nodes, each node object once: a subtree shared by several parents (a
    lowered softmax repeats its argument; nested, the tree is exponential in the
    depth) is visited at its first occurrence only.  The same nodes in the same
    first-occurrence order, for questions of membership, not of counts."""
    stack, seen = [e], set()
    while stack:
        node = stack.pop()
        if id(node) in seen:
            continue
        seen.add(id(node))
        yield node
        kids = children(node)
        if kids:
            stack.extend(reversed(kids))


def outer_reductions(exprs) -> list[Expr]:
    """The Reduce nodes in `exprs` that no other Reduce there holds, each node once
    (a shared subtree is walked once), in first-occurrence order."""
    found: dict[Expr, None] = {}
    stack, seen = list(reversed(exprs)), set()
    while stack:
        e = stack.pop()
        if id(e) in seen:
            continue
        seen.add(id(e))
        if isinstance(e, Reduce):
            found.setdefault(e)
        else:
            stack.extend(reversed(children(e)))
    return list(found)


def transform(e: Expr, fn: Callable[[Expr], Expr]) -> Expr:
    """Post-order rewrite: children first, then `fn` on the rebuilt node
    (iterative: any depth).  `fn` is a function of the node: equal subtrees are
    rewritten once, so the cost follows the distinct subtrees, not the tree
    (a lowered softmax repeats its argument three times; nested, the tree is
    exponential in the depth, the distinct subtrees linear)."""
    rewritten: dict[Expr, tuple[Expr, Expr]] = {}      # node -> (the node rewritten, its rewrite)
    done: list[Expr] = []
    stack: list[tuple[Expr, bool]] = [(e, False)]
    while stack:
        node, expanded = stack.pop()
        if not expanded and node in rewritten:
            seen, new = rewritten[node]
            if identical(seen, node):
                done.append(new)
                continue
        kids = children(node)
        if kids and not expanded:
            stack.append((node, True))
            stack.extend((c, False) for c in reversed(kids))
            continue
        if kids:
            k = len(kids)
            new = fn(with_children(node, tuple(done[-k:])))
            del done[-k:]
        else:
            new = fn(node)
        rewritten.setdefault(node, (node, new))
        done.append(new)
    return done[0]


def substitute(e: Expr, table: Mapping[Expr, Expr]) -> Expr:
    """`e` with every outermost occurrence of a key of `table` replaced by its value
    (top-down: a key's own subtree is not searched), each shared subtree once."""
    done: dict[int, Expr] = {}

    def visit(n: Expr) -> Expr:
        if id(n) not in done:
            done[id(n)] = table[n] if n in table else with_children(n, tuple(visit(c) for c in children(n)))
        return done[id(n)]
    return visit(e)


def identical(a: Expr, b: Expr) -> bool:
    """`a == b` with each constant of one type: == takes 1, 1.0 and True (and 0.0,
    -0.0) as equal, which an integer count, a float and a predicate are not.  Linear
    in the distinct pairs of nodes compared (_pairs_agree)."""
    return _pairs_agree(a, b, _identical_nodes)


def _identical_nodes(x: Expr, y: Expr):
    """identical's step: None where the nodes differ but for their children, or are
    constants of another type or sign, else their child pairs."""
    if isinstance(x, Const):
        same = type(x.value) is type(y.value) and x.value == y.value and \
            math.copysign(1.0, x.value) == math.copysign(1.0, y.value)
        return () if same else None
    kx, ky = children(x), children(y)
    if len(kx) != len(ky) or with_children(x, ky) != y:
        return None
    return zip(kx, ky)


def postorder(e: Expr, unique: bool = False) -> Iterator[Expr]:
    """Every node after its children, left to right (iterative: any depth).
    With `unique`, a node object shared by several parents is visited once."""
    stack: list[tuple[Expr, bool]] = [(e, False)]
    seen: set[int] = set()
    while stack:
        node, expanded = stack.pop()
        if unique and id(node) in seen:
            continue
        kids = children(node)
        if expanded or not kids:
            if unique:
                seen.add(id(node))
            yield node
        else:
            stack.append((node, True))
            stack.extend((c, False) for c in reversed(kids))


def unused_name(base: str, taken, first_plain: bool = True) -> str:
    """`base` (if first_plain), else base2, base3... (base1, base2... otherwise),
    the first not in `taken`."""
    taken = set(taken)
    numbered = (f"{base}{n}" for n in count(2 if first_plain else 1))
    return next(c for c in chain([base] if first_plain else [], numbered) if c not in taken)


def reads(e: Expr) -> set[str]:
    """The names of the tensors (inputs or statements) `e` reads, the integer inputs
    of gathered subscripts included."""
    return {n.tensor for n in accesses(e)}


def accesses(e: Expr) -> Iterator[Access]:
    """Every tensor read in `e`, each node object once, a gathered read followed by the
    integer reads of its subscripts (`E[T[i], d]`, then `T[i]`)."""
    for n in nodes(e):
        if isinstance(n, Access):
            yield n
            if n.gathers is not None:
                yield from n.gather_reads()


def bound_indices(e: Expr) -> tuple[str, ...]:
    """Indices a node binds in its arguments and removes from its result."""
    if isinstance(e, Reduce):
        return e.indices
    if isinstance(e, Composite):
        return () if e.op in COMPOSITES_KEEPING_INDEX else e.indices
    return ()


def alpha_key(e: Expr, first: tuple[str, ...] = ()) -> tuple[Expr, tuple[str, ...]]:
    """`e` up to a consistent renaming of its indices: the free ones become #0, #1,
    ... (`first` first, then in the order they appear), bound ones ~0, ~1, ...
    Two expressions are equal up to index names iff their keys are equal.
    Returns the key and the original names of the free placeholders, in order."""
    free: dict[str, str] = {i: f"#{k}" for k, i in enumerate(first)}
    bound = iter(range(1 << 62))

    def name(i: str, scope: dict[str, str]) -> str:
        if i in scope:
            return scope[i]
        if i not in free:
            free[i] = f"#{len(free)}"
        return free[i]

    def rename(n: Expr, scope: dict[str, str]) -> Expr:
        if isinstance(n, Access):
            return replace(n, indices=tuple(name(i, scope) for i in n.indices))
        if isinstance(n, Index | Extent):
            return replace(n, name=name(n.name, scope))
        if isinstance(n, Reduce | Composite) and bound_indices(n):
            inner = {**scope, **{i: f"~{next(bound)}" for i in n.indices}}
            n = replace(n, indices=tuple(inner[i] for i in n.indices))
            return with_children(n, tuple(rename(c, inner) for c in children(n)))
        if isinstance(n, Composite):           # a softmax inside: its indices are free in it
            n = replace(n, indices=tuple(name(i, scope) for i in n.indices))
        return with_children(n, tuple(rename(c, scope) for c in children(n)))

    return rename(e, {}), tuple(free)


def _leaf_or_known_free(node: Expr) -> tuple[str, ...] | None:
    """The free indices of a leaf, or those already computed for an inner node."""
    if isinstance(node, Access):
        return tuple(dict.fromkeys(node.indices))
    if isinstance(node, Index):
        return (node.name,)
    if not children(node):
        return ()
    return node._free


def free_indices(e: Expr) -> tuple[str, ...]:
    """Indices the value of `e` varies over, in order of first occurrence.  An
    inner node keeps its answer (computed once: linear over a whole program)."""
    known = _leaf_or_known_free(e)
    if known is not None:
        return known
    stack: list[tuple[Expr, bool]] = [(e, False)]
    while stack:
        node, expanded = stack.pop()
        if not expanded:
            if _leaf_or_known_free(node) is None:
                stack.append((node, True))
                stack.extend((c, False) for c in children(node))
            continue
        if node._free is not None:            # shared by several parents: done already
            continue
        out: dict[str, None] = {}
        args = children(node)
        if isinstance(node, Reduce) and node.result is not None:   # a field varies over its own arguments only
            used = node.summary.arguments_of(node.result)
            args = tuple(a for k, a in enumerate(args) if k in used)
        for c in args:
            out.update(dict.fromkeys(_leaf_or_known_free(c)))
        for i in bound_indices(node):
            out.pop(i, None)
        object.__setattr__(node, "_free", tuple(out))
    return e._free


def constant(e: Expr) -> float | None:
    """The value of an expression made of constants only (`-inf` is neg(inf)), folded
    in float64 by the ops' torch meaning, as algebra.formula.evaluate folds a formula
    (not imported from there: the IR sits below the algebra)."""
    if not all(isinstance(n, Const | Call) for n in walk(e)):
        return None
    import torch

    def fold(n: Expr):
        if isinstance(n, Const):
            return torch.tensor(float(n.value), dtype=torch.float64)
        return OPS[n.op].torch(*(fold(a) for a in n.args))
    return float(fold(e))


def linear_form(e: Expr) -> tuple[dict[str, int], list[tuple[int, Expr]]] | None:
    """`e` as sum(c * index) + sum(+-term) with integer c and index-free terms (scalars,
    extents, constants), or None.  An integer multiple of a form scales its terms as
    products (`2 * (i - W)` has the term -(2 * W))."""
    if isinstance(e, Index):
        return {e.name: 1}, []
    if not free_indices(e) and not any(isinstance(n, Index | Reduce) for n in walk(e)):
        return {}, [(1, e)]         # the same everywhere in the kernel: scalars, extents, constants
    if isinstance(e, Call) and e.op in ("add", "sub"):
        parts = [linear_form(a) for a in e.args]
        if None in parts:
            return None
        (c0, t0), (c1, t1) = parts
        k = 1 if e.op == "add" else -1
        coeffs = dict(c0)
        for n, c in c1.items():
            coeffs[n] = coeffs.get(n, 0) + k * c
        return {n: c for n, c in coeffs.items() if c}, t0 + [(k * s, t) for s, t in t1]
    if isinstance(e, Call) and e.op == "neg":
        part = linear_form(e.args[0])
        return None if part is None else ({n: -c for n, c in part[0].items()}, [(-s, t) for s, t in part[1]])
    if isinstance(e, Call) and e.op == "mul":
        for a, b in (e.args, e.args[::-1]):
            c = constant(a)
            if c is not None and math.isfinite(c) and c == int(c) and c != 0:
                part = linear_form(b)
                if part is None:
                    return None
                k = int(c)
                scaled = [(s if k > 0 else -s, t if abs(k) == 1 else Call("mul", (Const(abs(k)), t)))
                          for s, t in part[1]]
                return {n: k * v for n, v in part[0].items()}, scaled
    return None


# ---------------------------------------------------------------- printing
def _prec(e: Expr) -> int:
    if isinstance(e, Const) and (e.value < 0 or (isinstance(e.value, float) and math.copysign(1, e.value) < 0)):
        return PREC_UNARY
    if isinstance(e, Call):
        return OPS[e.op].precedence
    return PREC_ATOM


def format_number(value: int | float) -> str:
    if isinstance(value, bool):
        return str(int(value))
    if isinstance(value, int):
        return str(value)
    if value == math.inf:
        return "inf"
    if value == -math.inf:
        return "-inf"
    if value == math.pi:
        return "pi"
    if math.isnan(value):
        raise ValueError("NaN has no literal in the language")
    text = repr(float(value))
    return text


def format_expr(e: Expr) -> str:
    """The canonical text of `e` (iterative: any depth)."""
    text: dict[int, str] = {}                   # id(node) -> its text

    def wrap(c: Expr, at_least: int) -> str:
        return text[id(c)] if _prec(c) >= at_least else f"({text[id(c)]})"

    for node in postorder(e, unique=True):
        text[id(node)] = _format_node(node, text, wrap)
    return text[id(e)]


def _format_node(e: Expr, text: dict[int, str], wrap) -> str:
    if isinstance(e, Const):
        return format_number(e.value)
    if isinstance(e, Access):
        return e.tensor + (f"[{', '.join(e.subscripts())}]" if e.rank else "")
    if isinstance(e, Index | Var):
        return e.name
    if isinstance(e, Extent):
        return f"len({e.name})"
    if isinstance(e, Reduce):
        args = ", ".join(text[id(a)] for a in e.args)
        out = f"{e.summary.name}[{', '.join(e.indices)}]({args})"
        return out if e.result is None else f"{out}.{e.result}"
    if isinstance(e, Composite):
        return f"{e.op}[{', '.join(e.indices)}]({text[id(e.arg)]})"
    if isinstance(e, Call):
        op = OPS[e.op]
        if op.syntax == "function":
            return f"{op.symbol}({', '.join(text[id(a)] for a in e.args)})"
        if op.syntax == "prefix":
            sep = " " if op.symbol.isalpha() else ""
            return f"{op.symbol}{sep}{wrap(e.args[0], op.precedence)}"
        left, right = e.args
        p = op.precedence
        if op.name == "pow":            # right-associative; the base must be an atom
            return f"{wrap(left, PREC_ATOM)} ** {wrap(right, PREC_UNARY)}"
        if p == PREC_CMP:               # comparisons do not chain
            return f"{wrap(left, PREC_ADD)} {op.symbol} {wrap(right, PREC_ADD)}"
        return f"{wrap(left, p)} {op.symbol} {wrap(right, p + 1)}"
    raise TypeError(f"not an expression: {e!r}")


def _wrap(e: Expr, at_least: int) -> str:
    text = format_expr(e)
    return text if _prec(e) >= at_least else f"({text})"


def format_statement(s: Assign) -> str:
    return f"{s.name}[{', '.join(s.indices)}] = {format_expr(s.expr)}"


def format_program(p: Program) -> str:
    return "\n".join(format_statement(s) for s in p.statements) + "\n"


__all__ = ["Expr", "Const", "Access", "Index", "Extent", "Var", "Call", "Reduce", "Composite",
           "Assign", "Input", "Program", "DerivedExtent", "affine_access", "format_affine", "walk", "nodes", "postorder", "transform", "substitute", "identical",
           "children", "with_children",
           "free_indices", "bound_indices", "alpha_key", "format_expr", "format_statement", "format_program"]
