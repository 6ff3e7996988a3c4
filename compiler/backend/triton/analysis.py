"""Kernel formation: which statements share a kernel, what the grid is, and
which reductions must be materialised in global memory.

Everything here works on IR names; the emitter turns names into tile axes.

Vocabulary (for one kernel whose widest statement has left-hand indices L):

- a *fold* is a Reduce node without its projection (`node.fold`);
- a *top fold* is a fold reachable from the statement whose free indices are
  all names of L (it may sit inside another fold's arguments, but it does not
  read that fold's bound indices, so it can be hoisted out of its loop);
- the *grid* G is the intersection of the top folds' free indices (all of L
  when there are none): one program per G-tile, every top fold with free
  indices G is computed once per program (a *program fold*);
- the *epilogue* E = L minus G is looped inside the program, in tiles; top
  folds that also vary over E indices are computed inside that loop.

A single-kernel schedule therefore always exists; when the grid would be empty
while the output is not (a full reduction next to an elementwise output, or
reductions with disjoint free indices) the program count would be 1, so those
reductions are *materialised*: each becomes a buffer statement with its own
kernel, read back by an access."""
from __future__ import annotations

from dataclasses import dataclass, field, replace
from functools import cache

from ...algebra import BUILTINS
from ...errors import BackendError
from ...ir import (
    Access,
    Assign,
    Call,
    Composite,
    Const,
    Expr,
    Extent,
    Index,
    Program,
    Reduce,
    Var,
    alpha_key,
    children,
    format_expr,
    free_indices,
    reads,
    transform,
    walk,
    with_children,
)
from ...ops import OPS
from ...passes.fuse import rename_indices
from ...schedule import Loop


@cache
def free(e: Expr) -> frozenset:
    return frozenset(free_indices(e))


# ---------------------------------------------------------------- inlining
def rename(e: Expr, mapping: dict[str, str], avoid: frozenset, fresh_names: dict[str, str]) -> Expr:
    """Capture-avoiding renaming of free indices (the fuse pass's), with fresh names
    `origin_<n>` not in `avoid`, recorded in `fresh_names` (fresh -> original)."""
    targets = set(mapping.values())

    def fresh(b: str) -> str:
        origin = fresh_names.get(b, b)
        n = 1
        while f"{origin}_{n}" in avoid or f"{origin}_{n}" in targets or f"{origin}_{n}" in fresh_names:
            n += 1
        fresh_names[f"{origin}_{n}"] = origin
        return f"{origin}_{n}"

    return rename_indices(e, mapping, fresh)


def all_index_names(e: Expr) -> set[str]:
    names = set()
    for n in walk(e):
        if isinstance(n, Access):
            names.update(n.indices)
        elif isinstance(n, Index | Extent):
            names.add(n.name)
        elif isinstance(n, Reduce):
            names.update(n.indices)
    return names


def inline(e: Expr, defs: dict[str, Assign], avoid: frozenset, fresh_names: dict[str, str],
           reading: tuple[str, ...] = ()) -> Expr:
    """Replace accesses to the statements in `defs` by their (inlined) bodies."""
    if isinstance(e, Access) and e.tensor in defs:
        if e.tensor in reading:
            cycle = " -> ".join(reading[reading.index(e.tensor):] + (e.tensor,))
            raise BackendError(f"statement '{e.tensor}' reads itself ({cycle}); the IR is not a program")
        st = defs[e.tensor]
        body = inline(st.expr, defs, avoid, fresh_names, reading + (e.tensor,))
        mapping = dict(zip(st.indices, e.indices))
        return rename(body, mapping, avoid | all_index_names(body) | set(e.indices), fresh_names)
    return with_children(e, tuple(inline(c, defs, avoid, fresh_names, reading) for c in children(e)))


# ---------------------------------------------------------------- restricted folds
def _substitute(e: Expr, mapping: dict[str, Expr]) -> Expr:
    if isinstance(e, Var):
        return mapping.get(e.name, e)
    return with_children(e, tuple(_substitute(c, mapping) for c in children(e)))


def restrict(fold: Reduce, available: frozenset) -> Reduce | None:
    """`fold` folding only the fields that vary over no free index outside
    `available`, with just the arguments those fields read (the fold itself when
    every field qualifies; None when none does).

    A fold shared by several projections may vary over more indices than one of
    them: after factorise, attention's logsumexp L[i] reads the fields (r, l) of
    the fold (r, l, u) whose u also varies over the value index j.  Where j does
    not exist (L's own kernel) or lives in a deeper loop, the projection folds
    the restricted summary (r, l) instead."""
    s = fold.summary
    bound = set(fold.indices)
    ok = {k for k, a in enumerate(fold.args) if set(free(a)) - bound <= available}
    keep = [f for f in s.field_names if s.arguments_of(f) <= ok]
    if len(keep) == len(s.field_names):
        return fold
    if not keep:
        return None
    used = sorted(set().union(*(s.arguments_of(f) for f in keep)))
    xs = {f"x{k}": Var(f"x{j}") for j, k in enumerate(used)}
    index = {f: s.field_names.index(f) for f in keep}
    finalize = s.finalize
    if not {v.name for v in walk(finalize) if isinstance(v, Var)} <= set(keep):
        finalize = Var(keep[0])            # never evaluated: every use projects a kept field
    rescaled = tuple(
        replace(rs, leader_arg=_substitute(rs.leader_arg, xs), weight=_substitute(rs.weight, xs),
                values=tuple((f, _substitute(v, xs)) for f, v in rs.values if f in index))
        for rs in s.rescaled if rs.leader in index)
    summary = replace(
        s, fields=tuple(s.fields[index[f]] for f in keep), arity=len(used),
        identity=tuple(s.identity[index[f]] for f in keep),
        lift=tuple(_substitute(s.lift[index[f]], xs) for f in keep),
        combine=tuple(s.combine[index[f]] for f in keep), finalize=finalize, rescaled=rescaled,
        notes=s.notes + (f"restricted to the fields ({', '.join(keep)})",))
    return replace(fold, summary=summary, args=tuple(fold.args[k] for k in used), result=None)


def narrow_projections(e: Expr, lhs: tuple[str, ...]) -> Expr:
    """Projections whose fold varies over an index that neither the statement's left
    side nor an enclosing reduction provides read a restricted fold (see `restrict`)."""
    def visit(node: Expr, bound: frozenset) -> Expr:
        inner = bound | set(node.indices) if isinstance(node, Reduce) else bound
        node = with_children(node, tuple(visit(c, inner) for c in children(node)))
        if isinstance(node, Reduce) and node.result is not None:
            available = frozenset(lhs) | bound
            if not free(node.fold) <= available:
                narrowed = restrict(node.fold, available)
                if narrowed is not None and node.result in narrowed.summary.field_names:
                    return replace(narrowed, result=node.result)
        return node
    return visit(e, frozenset())


# ---------------------------------------------------------------- folds
def top_folds(e: Expr, lhs: tuple[str, ...]) -> list[Reduce]:
    """Folds whose free indices are names of the left-hand side (not bound by an
    enclosing reduction), innermost first, each once."""
    out: dict[Reduce, None] = {}

    def visit(node: Expr, bound: frozenset) -> None:
        inner = bound | set(node.indices) if isinstance(node, Reduce) else bound
        for c in children(node):
            visit(c, inner)
        if isinstance(node, Reduce) and not (free(node) & bound):
            out[node.fold] = None

    visit(e, frozenset())
    return list(out)


def replace_folds(e: Expr, table: dict[Reduce, Access]) -> Expr:
    """Replace the (unshadowed) occurrences of materialised Reduce nodes by reads."""
    def visit(node: Expr, bound: frozenset) -> Expr:
        if isinstance(node, Reduce) and node in table and not (free(node) & bound):
            return table[node]
        inner = bound | set(node.indices) if isinstance(node, Reduce) else bound
        return with_children(node, tuple(visit(c, inner) for c in children(node)))
    return visit(e, frozenset())


def flatten_mul(e: Expr) -> list[Expr]:
    if isinstance(e, Call) and e.op == "mul":
        return flatten_mul(e.args[0]) + flatten_mul(e.args[1])
    return [e]


@dataclass(frozen=True)
class Contraction:
    """A matrix-product-like fold: a sum over one index of a product, or a rescaled
    summary's weights times values that carry another free index (attention's P V).
    `sides` vary over only some of the factors that read the reduced index (the rows
    and columns of tl.dot); `batch` over all of them: tiling a batch index, or two
    side indices of one factor, would make an operand 3-D, which tl.dot does not take.
    `bound`: the indices of the folds around it (not the names of outer indices)."""
    reduced: frozenset
    sides: frozenset
    batch: frozenset
    factors: tuple[frozenset, ...]
    bound: frozenset

    def clashes(self, a: str, b: str) -> bool:
        """Whether outer indices a and b are both sides of one operand."""
        inner = self.reduced | self.bound
        return a not in inner and b not in inner and any(a in f and b in f for f in self.factors)


def contractions(e: Expr) -> list[Contraction]:
    out = []

    def visit(n: Expr, bound: frozenset) -> None:
        parts = None
        if isinstance(n, Reduce) and n.summary == BUILTINS["sum"] and len(n.indices) == 1:
            parts = flatten_mul(n.args[0])
        elif isinstance(n, Reduce) and getattr(n.summary, "rescaled", ()) and value_only_names(n):
            parts = list(n.args)
        if parts is not None:
            reduced = frozenset(n.indices)
            factors = tuple(f for f in (frozenset(free_indices(p)) for p in parts) if f & reduced)
            if factors:
                batch = frozenset.intersection(*factors) - reduced
                sides = frozenset().union(*factors) - batch - reduced
                if sides:
                    out.append(Contraction(reduced, sides, batch, factors, bound))
        inner = bound | set(n.indices) if isinstance(n, Reduce) else bound
        for c in children(n):
            visit(c, inner)

    visit(e, frozenset())
    return out


def contraction_names(e: Expr) -> set[str]:
    """Index names that take part in a matrix-product-like contraction as its reduced
    index or a row or column; their tiles are kept at least 16 wide so that the
    emitter can use tl.dot."""
    return {i for c in contractions(e) for i in c.reduced | c.sides}


def dot_batch_names(e: Expr) -> set[str]:
    """Indices that every operand of some contraction reads (attention's batch and
    head): taken one value at a time, never as a tile dimension."""
    return {i for c in contractions(e) for i in c.batch - c.bound}


def value_only_names(e: Expr) -> set[str]:
    """Free indices of a rescaled fold that its weights do not vary over (attention's
    output feature index j): tiling them would recompute the weights per tile, so the
    schedule prefers to keep them whole."""
    names: set[str] = set()
    for n in walk(e):
        if isinstance(n, Reduce) and getattr(n.summary, "rescaled", ()):
            for rs in n.summary.rescaled:
                used = {v.name for part in (rs.weight, rs.leader_arg) for v in walk(part) if isinstance(v, Var)}
                weight_free = set()
                for k, a in enumerate(n.args):
                    if f"x{k}" in used:
                        weight_free |= set(free_indices(a))
                names |= set(free_indices(n)) - weight_free
    return names


# ---------------------------------------------------------------- index predicates
_FLIP = {"le": "ge", "lt": "gt", "ge": "le", "gt": "lt"}


def _conjuncts(e: Expr) -> list[Expr]:
    if isinstance(e, Call) and e.op == "and":
        return _conjuncts(e.args[0]) + _conjuncts(e.args[1])
    return [e]


def constant(e: Expr) -> float | None:
    """The value of an expression made of constants only (`-inf` is neg(inf))."""
    if not all(isinstance(n, Const | Call) for n in walk(e)):
        return None
    from ...algebra.formula import evaluate
    return float(evaluate(e, {}))


def acts_as_identity(summary, k: int, value) -> bool:
    """Whether an element whose k-th argument is `value` contributes nothing to a
    fold, whatever the other arguments: its lift is the identity, or (rescaled
    fields) its leader argument is the leader's identity and its weight is 0.
    Checked numerically in float64 on random other arguments."""
    import torch

    from ...algebra.formula import evaluate
    g = torch.Generator().manual_seed(0)
    xs = {f"x{j}": torch.randn(16, generator=g, dtype=torch.float64) * 3 for j in range(summary.arity)}
    xs[f"x{k}"] = torch.full((16,), float(value), dtype=torch.float64)
    identity = dict(zip(summary.field_names, (float(c.value) for c in summary.identity)))
    covered = set()
    for rs in summary.rescaled:
        r = torch.randn(16, generator=g, dtype=torch.float64) * 3
        if not torch.all(evaluate(rs.leader_arg, xs) == identity[rs.leader]):
            return False
        if not torch.all(evaluate(rs.weight, {**xs, "r": r}) == 0):
            return False
        covered |= {rs.leader} | {f for f, _ in rs.values}
    for name, lift in zip(summary.field_names, summary.lift):
        if name not in covered and not torch.all(evaluate(lift, xs).expand(16) == identity[name]):
            return False
    return True


def exact_identity(summary, fields: tuple[str, ...]) -> bool:
    """Whether combine(e, e) = e, combine(e, x) = x and combine(x, e) = x hold exactly
    in floating point on `fields` (x: lifts of random elements).  A tree reduction on
    the GPU combines two padding elements; a formula such as exp(a.m - max(a.m, b.m))
    gives NaN there, so such summaries get an identity-guarded combine."""
    import torch

    from ...algebra.formula import evaluate
    g = torch.Generator().manual_seed(1)
    n = 16
    xs = {f"x{j}": torch.randn(n, generator=g, dtype=torch.float64) * 3 for j in range(summary.arity)}
    index = {f: summary.field_names.index(f) for f in fields}
    e = {f: torch.full((n,), float(summary.identity[index[f]].value), dtype=torch.float64) for f in fields}
    x = {f: evaluate(summary.lift[index[f]], xs).expand(n).double() for f in fields}

    def combine(a, b):
        env = {f"a.{f}": a[f] for f in fields} | {f"b.{f}": b[f] for f in fields}
        return {f: evaluate(summary.combine[index[f]], env).expand(n) for f in fields}

    for a, b, want in ((e, e, e), (e, x, x), (x, e, x)):
        got = combine(a, b)
        if not all(torch.equal(got[f], want[f]) for f in fields):
            return False
    return True


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
        return f"{self.index} {OPS[self.op].symbol} {format_expr(self.side)}"


def _linear(e: Expr) -> tuple[dict[str, int], list[tuple[int, Expr]]] | None:
    """`e` as sum(c * index) + sum(+-term) with integer c and index-free terms, or None."""
    if isinstance(e, Index):
        return {e.name: 1}, []
    if not free_indices(e) and not any(isinstance(n, Index | Reduce) for n in walk(e)):
        return {}, [(1, e)]         # the same everywhere in the kernel: scalars, extents, constants
    if isinstance(e, Call) and e.op in ("add", "sub"):
        parts = [_linear(a) for a in e.args]
        if None in parts:
            return None
        (c0, t0), (c1, t1) = parts
        k = 1 if e.op == "add" else -1
        coeffs = dict(c0)
        for n, c in c1.items():
            coeffs[n] = coeffs.get(n, 0) + k * c
        return {n: c for n, c in coeffs.items() if c}, t0 + [(k * s, t) for s, t in t1]
    if isinstance(e, Call) and e.op == "neg":
        part = _linear(e.args[0])
        return None if part is None else ({n: -c for n, c in part[0].items()}, [(-s, t) for s, t in part[1]])
    if isinstance(e, Call) and e.op == "mul":
        for a, b in (e.args, e.args[::-1]):
            c = constant(a)
            if c in (1, -1):
                part = _linear(b)
                return None if part is None else ({n: int(c) * v for n, v in part[0].items()},
                                                  [(int(c) * s, t) for s, t in part[1]])
    return None


def _sum_of(terms: list[tuple[int, Expr]]) -> Expr:
    out: Expr | None = None
    for sign, t in terms:
        if out is None:
            out = t if sign > 0 else Call("neg", (t,))
        else:
            out = Call("add" if sign > 0 else "sub", (out, t))
    return Const(0) if out is None else out


def _bound(c: Expr, index: str, bound: tuple[str, ...]) -> Bound | None:
    """The bound `c` puts on `index`, if it is a comparison linear in `index` with
    coefficient +-1, involving at most one other index (outside the fold's
    `bound` indices), also with coefficient +-1."""
    if not (isinstance(c, Call) and c.op in _FLIP):
        return None
    left, right = _linear(c.args[0]), _linear(c.args[1])
    if left is None or right is None:
        return None
    coeffs = dict(left[0])                  # left - right  op  0
    for n, v in right[0].items():
        coeffs[n] = coeffs.get(n, 0) - v
    coeffs = {n: v for n, v in coeffs.items() if v}
    terms = left[1] + [(-s, t) for s, t in right[1]]
    own = coeffs.pop(index, 0)
    if abs(own) != 1 or any(n in bound for n in coeffs) or len(coeffs) > 1 \
            or any(abs(v) != 1 for v in coeffs.values()):
        return None
    # own * index + co * other + terms  op  0
    op = c.op if own > 0 else _FLIP[c.op]
    other, co = next(iter(coeffs.items()), (None, 0))
    offset = _sum_of([(-own * s, t) for s, t in terms])
    return Bound(index, op, other, -own * co if other else 1, offset, c)


def index_bounds(fold: Reduce) -> dict[str, list[Bound]]:
    """Per bound index b of `fold`: the bounds (b op sign * other + offset) such that
    elements where one fails contribute nothing.  Where the relation fails,
    every where(...) with it among its conjuncts selects its else branch, wherever
    it sits in an argument (the argument itself, a factor of a product, inside an
    exponential); the argument must then be a constant that acts as the identity,
    for any finite value of everything else (checked numerically).  So
    where(m <= i, x, -inf) under a softmax's max, K * where(m <= i, g, 0) under a
    sum and exp(min(where(m <= i, x, -inf) - L, 0)) * dO under a sum all bound m.
    A loop over b starts at the first and stops after the last tile where every
    such relation can hold (a causal mask's upper triangle, a window's far past)."""
    out: dict[str, list[Bound]] = {}
    conjuncts = dict.fromkeys(c for arg in fold.args for w in walk(arg)
                              if isinstance(w, Call) and w.op == "where" for c in _conjuncts(w.args[0]))
    for c in conjuncts:
        for index in fold.indices:
            found = _bound(c, index, fold.indices)
            if found is None or found in out.get(index, []):
                continue
            # one argument that acts as the identity there suffices, whatever the others are
            if any(_masks(arg, c) and _vanishes(fold, k, arg, c) for k, arg in enumerate(fold.args)):
                out.setdefault(index, []).append(found)
    return out


def _masks(arg: Expr, relation: Expr) -> bool:
    return any(_selects_by(w, relation) for w in walk(arg))


def _selects_by(e: Expr, relation: Expr) -> bool:
    return isinstance(e, Call) and e.op == "where" and relation in _conjuncts(e.args[0])


def _vanishes(fold: Reduce, k: int, arg: Expr, relation: Expr) -> bool:
    """Whether argument k of `fold` acts as the identity wherever `relation` fails:
    its masks take their else branches, the rest stands for random finite values."""
    import torch

    from ...algebra.formula import evaluate
    leaves: dict[Expr, Var] = {}

    def failing(e: Expr) -> Expr | None:
        if _selects_by(e, relation):
            return failing(e.args[2])
        if not any(_selects_by(w, relation) for w in walk(e)):
            return e if constant(e) is not None else leaves.setdefault(e, Var(f"v{len(leaves)}"))
        if not isinstance(e, Call):
            return None                       # a mask inside a reduction or an access: unknown
        parts = [failing(a) for a in e.args]
        return None if None in parts else Call(e.op, tuple(parts))

    masked = failing(arg)
    if masked is None:
        return False
    g = torch.Generator().manual_seed(2)
    env = {v.name: torch.randn(16, generator=g, dtype=torch.float64) * 3 for v in leaves.values()}
    values = evaluate(masked, env).expand(16)
    return bool(torch.all(values == values[0])) and acts_as_identity(fold.summary, k, float(values[0]))


def assume_relation(fold: Reduce, relation: Bound) -> Reduce:
    """`fold` on the tiles where `relation` holds for every element: that
    conjunct of the masking predicates is true there, and a predicate left with
    no conjunct selects its value outright (interior tiles pay for no mask)."""
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
    return replace(fold, args=tuple(transform(a, rewrite) for a in fold.args))


# ---------------------------------------------------------------- kernels
@dataclass
class KernelSpec:
    name: str
    statements: tuple[Assign, ...]         # stored by this kernel; same-kernel reads inlined
    grid: tuple[str, ...]                  # G, in left-hand order
    epilogue: tuple[str, ...]              # E = L - G, in left-hand order
    why: str
    buffers: tuple[str, ...] = ()          # which of `statements` are intermediate buffers
    program_folds: tuple[Reduce, ...] = ()  # top folds with free indices exactly G
    dependent: bool = False                # some program fold reads another one
    separate: str = ""                     # why it is not part of the previous kernel
    reads: str = ""                        # buffers it reads instead of recomputing folds

    @property
    def lhs(self) -> tuple[str, ...]:
        return self.grid + self.epilogue


@dataclass
class Structure:
    kernels: list[KernelSpec]
    fresh_names: dict[str, str]            # renamed bound index -> original index name
    buffer_indices: dict[str, tuple[str, ...]] = field(default_factory=dict)


def _grid_of(expr: Expr, lhs: tuple[str, ...]) -> tuple[tuple[str, ...], list[Reduce]]:
    folds = top_folds(expr, lhs)
    if not folds:
        return lhs, folds
    common = set(lhs)
    for f in folds:
        common &= free(f)
    return tuple(i for i in lhs if i in common), folds


def _describe(folds) -> str:
    names = []
    for f in folds:
        text = f"{f.summary.name}[{', '.join(f.indices)}]"
        if text not in names:
            names.append(text)
    return ", ".join(names)


class Former:
    """Builds the kernel list of a program (independent of extents)."""

    def __init__(self, program: Program, outputs: tuple[str, ...], split: int | None):
        if any(isinstance(n, Composite) for s in program.statements for n in walk(s.expr)):
            from ...passes.lower import lower
            program = lower(program)
        self.program = program
        self.outputs = outputs
        self.split = split
        self.avoid = frozenset(i for i, _ in program.extents)
        self.fresh_names: dict[str, str] = {}
        self.kernels: list[KernelSpec] = []
        self.buffer_count = 0
        self.taken = {s.name for s in program.statements} | {i.name for i in program.inputs}
        self.buffer_indices: dict[str, tuple[str, ...]] = {}
        self.stored: dict[tuple[str, Reduce], str] = {}     # (kernel, projection it stores) -> buffer

    def run(self) -> Structure:
        defs = {s.name: s for s in self.program.statements}
        non_outputs = {n: s for n, s in defs.items() if n not in self.outputs}
        for s in self._widest_first(non_outputs):
            last = self.kernels[-1] if self.kernels else None
            joined = None
            if last is not None and not last.buffers:
                group_defs = {**non_outputs, **{t.name: t for t in last.statements}}
                wide = inline(s.expr, group_defs, self.avoid, self.fresh_names, (s.name,))
                expr = narrow_projections(wide, s.indices)
                grid, _ = _grid_of(expr, s.indices)
                folds = top_folds(wide, s.indices)
                if grid == last.grid and (s.indices == last.grid or s.indices == last.lhs or
                                          (last.lhs == last.grid and s.indices[:len(grid)] == grid)):
                    joined = replace(s, expr=expr)
                elif set(s.indices) < set(last.grid) and folds and set(folds) <= set(last.program_folds):
                    # fewer indices than the kernel's grid, and only folds the kernel already
                    # streams (attention's row logsumexp beside its output): it projects those
                    # folds' states, and the programs of the first tile of each missing grid
                    # index store it
                    joined = replace(s, expr=wide)
            if joined is not None:
                expr, stored = self._reuse(joined.expr, s.indices, exclude=last)
                if stored and stored not in last.reads:
                    last.reads += f"; {s.name} reads {stored} instead of recomputing it per program"
                self._join(last, replace(joined, expr=expr))
            else:
                if s.name in reads(s.expr):
                    raise BackendError(f"statement '{s.name}' reads itself; the IR is not a program")
                expr = narrow_projections(inline(s.expr, non_outputs, self.avoid, self.fresh_names, (s.name,)),
                                          s.indices)
                expr, stored = self._reuse(expr, s.indices)
                self._add(replace(s, expr=expr), buffer=False)
                if stored:
                    self.kernels[-1].reads = f"; reads {stored} instead of recomputing it per program"
                    self.kernels[-1].why += self.kernels[-1].reads
                if last is not None:
                    own = self.kernels[-1]
                    earlier = [t.name for k in self.kernels[:-1] for t in k.statements if t.name in reads(expr)]
                    because = (f"reads {', '.join(earlier)} from memory" if earlier else
                               f"its grid ({', '.join(own.grid)}) or output indices differ from {last.name}'s")
                    own.separate = f"; a kernel of its own: {because}"
                    own.why += own.separate
        return Structure(self.kernels, self.fresh_names, self.buffer_indices)

    def _widest_first(self, non_outputs: dict[str, Assign]) -> list[Assign]:
        """The output statements in an order that respects what reads what, taking
        the one with the most indices first among those ready: a row statistic then
        joins the kernel of the row tile's output whichever comes first in the text."""
        def needs(e: Expr, seen: frozenset = frozenset()) -> set[str]:
            out = set()
            for name in reads(e) - seen:
                out |= {name} if name not in non_outputs else needs(non_outputs[name].expr, seen | {name})
            return out

        pending = [s for s in self.program.statements if s.name in self.outputs]
        depends = {s.name: needs(s.expr) for s in pending}
        ordered = []
        while pending:
            waiting = {t.name for t in pending}
            ready = [s for s in pending if not (depends[s.name] - {s.name}) & waiting] or pending[:1]
            pick = max(ready, key=lambda s: len(s.indices))        # the first of the widest
            ordered.append(pick)
            pending.remove(pick)
        return ordered

    # ------------------------------------------------------------
    def _join(self, k: KernelSpec, s: Assign) -> None:
        statements = k.statements + (s,)
        widest = max(statements, key=lambda t: len(t.indices))
        epilogue = tuple(i for i in widest.indices if i not in k.grid)
        folds = []
        for t in statements:
            folds += [f for f in top_folds(t.expr, t.indices) if f not in folds]
        k.statements = statements
        k.epilogue = epilogue
        k.program_folds = tuple(f for f in folds if free(f) == set(k.grid))
        k.dependent = _dependent(k.program_folds)
        k.why = _why(k.grid, epilogue, folds, len(statements)) + k.reads + k.separate

    def _add(self, s: Assign, buffer: bool) -> None:
        grid, folds = _grid_of(s.expr, s.indices)
        if not grid and s.indices and folds:
            # No index shared by every reduction: one program would do all the work.
            # Materialise the reductions that do not vary over the whole output.
            todo = [f for f in folds if free(f) != set(s.indices)]
            s = self._materialise(s, todo, "it shares no output index with the others")
            grid, folds = _grid_of(s.expr, s.indices)
        program_folds = tuple(f for f in folds if free(f) == set(grid))
        if self.split and self.split > 1 and _dependent(program_folds):
            # A split kernel merges independent states; materialise what others read.
            inner = [f for f in program_folds if any(f in _sub_folds(g) for g in program_folds if g != f)]
            s = self._materialise(s, inner, "a split fold reads it")
            grid, folds = _grid_of(s.expr, s.indices)
            program_folds = tuple(f for f in folds if free(f) == set(grid))
        epilogue = tuple(i for i in s.indices if i not in grid)
        why = _why(grid, epilogue, folds, 1)
        if buffer:
            why = f"materialises {s.name}: {why}"
        self.kernels.append(KernelSpec(
            name=self._kernel_name(s.name), statements=(s,), grid=grid, epilogue=epilogue, why=why,
            buffers=(s.name,) if buffer else (), program_folds=program_folds,
            dependent=_dependent(program_folds)))

    def _reuse(self, expr: Expr, lhs: tuple[str, ...], exclude: KernelSpec | None = None) -> tuple[Expr, str]:
        """Folds nested in `expr` that miss one of its grid indices are recomputed by
        every program along that index (the backward's D = rowsum(dO * O) inside the
        dK loop, a layernorm's row statistics inside a column sum).  Where an earlier
        kernel streams the same fold once per program (a program fold: one value per
        row of its grid, so never a score-sized buffer), that kernel also stores it
        into a float32 buffer (even where it stores the same value as an output: in
        the output's dtype, a bf16 S would make Y less accurate than recomputing it
        does) and `expr` reads the buffer instead (`exclude`: the
        kernel `expr` joins, which cannot read what its own programs store)."""
        grid = set(_grid_of(expr, lhs)[0])
        table: dict[Reduce, Access] = {}
        notes: dict[str, list[str]] = {}         # what, by whom -> buffers
        for node in walk(expr):
            if not isinstance(node, Reduce) or node in table or grid <= free(node):
                continue
            key, order = alpha_key(node.fold)
            for k in self.kernels:
                match = None if k is exclude else next((f for f in k.program_folds if alpha_key(f)[0] == key), None)
                if match is None:
                    continue
                theirs = dict(zip(alpha_key(match)[1], order))          # k's names -> expr's names
                indices = tuple(g for g in k.grid if g in free(match))
                projection = replace(match, result=node.result)
                name = self.stored.get((k.name, projection))
                if name is None:
                    name = self.stored[(k.name, projection)] = self._buffer_name()
                    self._join(k, Assign(name, indices, projection, "float"))
                    k.buffers += (name,)
                    self.buffer_indices[name] = indices
                table[node] = Access(name, tuple(theirs[g] for g in indices))
                names = notes.setdefault(f"{node.summary.name}[{', '.join(node.indices)}], stored by {k.name}", [])
                names += [name] if name not in names else []
                break
        if not table:
            return expr, ""
        def substitute(n: Expr) -> Expr:
            return table[n] if n in table else with_children(n, tuple(substitute(c) for c in children(n)))
        return substitute(expr), ", ".join(f"{', '.join(names)} ({what})" for what, names in notes.items())

    def _buffer_name(self) -> str:
        name = f"buf{self.buffer_count}"
        self.buffer_count += 1
        while name in self.taken:
            name = f"buf{self.buffer_count}"
            self.buffer_count += 1
        self.taken.add(name)
        return name

    def _kernel_name(self, stem: str) -> str:
        """einfold_<statement>, unless that or one of its split variants (_partial,
        _merge) is another kernel's name (a statement named `Y_merge` next to Y)."""
        variants = ("", "_partial", "_merge")
        taken = {k.name + v for k in self.kernels for v in variants}
        name, n = f"einfold_{stem}", 1
        while any(name + v in taken for v in variants):
            n += 1
            name = f"einfold_{stem}_{n}"
        return name

    def _materialise(self, s: Assign, todo: list[Reduce], reason: str) -> Assign:
        table: dict[Reduce, Access] = {}
        for f in todo:                                  # innermost first
            body = replace_folds(f, table)
            indices = tuple(i for i in s.indices if i in free(f))
            name = self._buffer_name()
            self.buffer_indices[name] = indices
            note = f"{f.summary.name}[{', '.join(f.indices)}] over ({', '.join(indices)})"
            self._add(Assign(name, indices, body, "float"), buffer=True)
            self.kernels[-1].why = f"materialises {note} into {name} ({reason})"
            table[f] = Access(name, indices)
        return replace(s, expr=replace_folds(s.expr, table))


def _sub_folds(f: Reduce) -> set[Reduce]:
    return {n.fold for a in f.args for n in walk(a) if isinstance(n, Reduce)}


def _dependent(program_folds) -> bool:
    return any(f in _sub_folds(g) for g in program_folds for f in program_folds if f != g)


def _why(grid, epilogue, folds, n_statements) -> str:
    if not folds:
        return f"elementwise over ({', '.join(grid)}): one fused kernel"
    parts = [f"one program per ({', '.join(grid)}) tile" if grid else "one program"]
    parts.append(f"folds {_describe(folds)} streamed over their indices")
    if epilogue:
        parts.append(f"epilogue loop over ({', '.join(epilogue)})")
    if n_statements > 1:
        parts.append(f"{n_statements} statements share it")
    return "; ".join(parts)


def loops(spec: KernelSpec) -> tuple[Loop, ...]:
    """The streamed loops of a kernel, in program order: one per set of reduced
    indices of its top folds (folds over the same indices share it), each with
    the loops of the folds inside its folds' arguments; then the epilogue."""
    return (*_fold_loops([f for s in spec.statements for f in top_folds(s.expr, s.indices)]),
            *((Loop(spec.epilogue, ()),) if spec.epilogue else ()))


def _fold_loops(folds: list[Reduce]) -> tuple[Loop, ...]:
    by_indices: dict[tuple[str, ...], list[Reduce]] = {}
    for f in folds:
        if f not in by_indices.setdefault(f.indices, []):
            by_indices[f.indices].append(f)
    out = []
    for indices, group in by_indices.items():
        inner = [n.fold for f in group for a in f.args for n in top_folds(a, tuple(free(a)))]
        names = tuple(dict.fromkeys(f.summary.name for f in group))
        bounds = tuple(dict.fromkeys(str(b) for f in group for relations in index_bounds(f).values()
                                     for b in relations))
        out.append(Loop(indices, names, _fold_loops(inner), bounds))
    return tuple(out)


def form(program: Program, outputs: tuple[str, ...], split: int | None) -> Structure:
    return Former(program, outputs, split).run()
