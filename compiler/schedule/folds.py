"""Facts about the folds of an expression that kernel formation and tiling read:
which folds a statement's kernel streams (top folds), which contract like a
matrix product (tl.dot candidates), which indices only values vary over, and
the rewrites that place them: inlining with capture-avoiding renaming, and
restriction of a shared fold to the fields one projection reads."""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import TypeVar

from ..algebra.properties import additive
from ..algebra.summary import Summary, independent_fields
from ..errors import BackendError
from ..ir import (
    Access,
    Assign,
    Call,
    Const,
    Expr,
    Extent,
    Index,
    Reduce,
    Var,
    children,
    free_indices,
    nodes,
    with_children,
)
from ..passes.fuse import rename_indices
from ..passes.stabilise import factors as quotient_factors, product


T = TypeVar("T")


def free(e: Expr) -> frozenset:
    # free_indices keeps its answer on the node; a cache keyed by expressions would
    # compare each with the equal trees of earlier programs
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
    for n in nodes(e):
        if isinstance(n, Access):
            names.update(n.indices)
        elif isinstance(n, Index | Extent):
            names.add(n.name)
        elif isinstance(n, Reduce):
            names.update(n.indices)
    return names


def inline(e: Expr, defs: dict[str, Assign], avoid: frozenset, fresh_names: dict[str, str],
           reading: tuple[str, ...] = ()) -> Expr:
    """Replace accesses to the statements in `defs` by their (inlined) bodies (each
    shared subtree once)."""
    done: dict[tuple[int, tuple[str, ...]], Expr] = {}

    def visit(e: Expr, reading: tuple[str, ...]) -> Expr:
        key = (id(e), reading)
        if key in done:
            return done[key]
        if isinstance(e, Access) and e.tensor in defs:
            if e.tensor in reading:
                cycle = " -> ".join(reading[reading.index(e.tensor):] + (e.tensor,))
                raise BackendError(f"statement '{e.tensor}' reads itself ({cycle}); the IR is not a program")
            st = defs[e.tensor]
            body = visit(st.expr, reading + (e.tensor,))
            mapping = dict(zip(st.indices, e.indices))
            out = rename(body, mapping, avoid | all_index_names(body) | set(e.indices), fresh_names)
        else:
            out = with_children(e, tuple(visit(c, reading) for c in children(e)))
        done[key] = out
        return out
    return visit(e, reading)


# ---------------------------------------------------------------- restricted folds
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
    return restrict_fields(fold, keep)


def fields_read(s: Summary, name: str) -> list[str]:
    """The fields whose states field `name` of `s` needs: itself and, transitively, those
    its combine reads (a rescaled weight sum reads its running max), in field order."""
    needed, todo = set(), [name]
    while todo:
        f = todo.pop()
        if f not in needed:
            needed.add(f)
            combine = s.combine[s.field_names.index(f)]
            todo += [v.name.split(".", 1)[1] for v in nodes(combine) if isinstance(v, Var) and "." in v.name]
    return [f for f in s.field_names if f in needed]


def restrict_fields(fold: Reduce, keep: list[str]) -> Reduce:
    """`fold` folding only the fields `keep` (closed under what their combines read), with
    just the arguments those fields read (Summary.restricted)."""
    s = fold.summary
    if len(keep) == len(s.field_names):
        return replace(fold, result=None)
    summary, used = s.restricted(tuple(keep))
    summary = replace(summary, notes=s.notes + (f"restricted to the fields ({', '.join(keep)})",))
    return replace(fold, summary=summary, args=tuple(fold.args[k] for k in used), result=None)


def narrow_projections(e: Expr, lhs: tuple[str, ...]) -> Expr:
    """Projections whose fold varies over an index that neither the statement's left
    side nor an enclosing reduction provides read a restricted fold (see `restrict`)."""
    @once_per_node
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


def once_per_node(visit: Callable[[Expr, frozenset], T]) -> Callable[[Expr, frozenset], T]:
    """A visitor of (node, indices bound around it) run once per node object and
    bound set: a subtree shared by several parents (a lowered softmax repeats its
    argument; nested, the tree is exponential in the depth) is visited once."""
    done: dict[tuple[int, frozenset], T] = {}

    def once(node: Expr, bound: frozenset) -> T:
        key = (id(node), bound)
        if key not in done:
            done[key] = visit(node, bound)
        return done[key]
    return once


# ---------------------------------------------------------------- folds
def top_folds(e: Expr, lhs: tuple[str, ...]) -> list[Reduce]:
    """Folds whose free indices are names of the left-hand side (not bound by an
    enclosing reduction), innermost first, each once."""
    out: dict[Reduce, None] = {}

    @once_per_node
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
    @once_per_node
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


def contraction_sides(factors: list[frozenset], reduced: frozenset) -> tuple[frozenset, frozenset]:
    """(batch, sides) of a product over `reduced` whose factors reading it vary over these
    indices: the indices every such factor reads, and the others (tl.dot's rows and columns)."""
    batch = frozenset.intersection(*factors) - reduced
    return batch, frozenset().union(*factors) - batch - reduced


def summed_factors(e: Expr, reduced: frozenset, beside: tuple[frozenset, ...] = ()) -> list[Expr]:
    """The factors of a summed product over `reduced`: flatten_mul's, except that a
    quotient of a matrix product by a divisor whose other indices one operand reads
    (`sum[i](P[m,i] * dO[i,j] / D[i])`, a row normaliser; `/ D[m]`, a column one)
    gives its numerator's factors and the divisor's reciprocal, which tl.dot takes
    into an operand, or applies to its result, instead of a broadcast product of all
    three.  `beside`: the indices of operands outside `e` (a rescaled fold's weights,
    which multiply its values: `V[m,j] / D[i]` beside weights over (i, m))."""
    out: list[Expr] = []
    for part in flatten_mul(e):
        numerator, denominator = quotient_factors(part)
        inner = [free(f) for f in numerator if free(f) & reduced] + list(beside)
        if denominator and len(inner) >= 2:
            _, sides = contraction_sides(inner, reduced)
            divisor = product(denominator, [])
            if len(sides) >= 2 and any(free(divisor) - reduced <= f for f in inner):
                out += numerator + [Call("div", (Const(1.0), divisor))]
                continue
        out.append(part)
    return out


@dataclass(frozen=True)
class Contraction:
    """A matrix-product-like fold: a sum of a product (over several indices, all but
    one taken one value at a time beside a tl.dot over the last: a weight gradient
    summed over batch and rows), or a rescaled
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


def fold_parts(fold: Reduce) -> list[Reduce]:
    """`fold` as its independent parts (algebra.summary.independent_fields), each a
    fold over the same indices of its part's summary on the arguments that part
    reads: two sums fused over one index are two matrix products, not one tl.reduce
    of a pair.  One part: [the fold itself]."""
    groups = independent_fields(fold.summary) if isinstance(fold.summary, Summary) else ((),)
    return [restrict_fields(fold, list(fields)) for fields in groups] if len(groups) > 1 else [fold.fold]


def contractions(e: Expr) -> list[Contraction]:
    """The contractions of `e`, each node (in its enclosing folds) once, each
    independent part of a fold (fold_parts) on its own."""
    out = []

    @once_per_node
    def visit(n: Expr, bound: frozenset) -> None:
        for part in fold_parts(n) if isinstance(n, Reduce) else ():
            factors = None
            if additive(part.summary):
                factors = summed_factors(part.args[0], frozenset(part.indices))
            elif getattr(part.summary, "rescaled", ()) and value_only_names(part):
                factors = list(part.args)
            reduced = frozenset(part.indices)
            read = tuple(f for f in (frozenset(free_indices(p)) for p in factors or ()) if f & reduced)
            if read:
                batch, sides = contraction_sides(list(read), reduced)
                if two_sided(read, sides):
                    out.append(Contraction(reduced, sides, batch, read, bound))
        inner = bound | set(n.indices) if isinstance(n, Reduce) else bound
        for c in children(n):
            visit(c, inner)

    visit(e, frozenset())
    return out


def two_sided(factors: tuple[frozenset, ...], sides: frozenset) -> bool:
    """Whether the factors of a product over a reduced index form two operands, each
    with a side index the other lacks (X[i,k] * W[j,k]: rows i, columns j): a matrix
    product, for tl.dot.  A product whose sides one factor holds all of, beside factors
    over the reduced index alone (sum[n](G[n] * X[i,n] * dY[i,n]), a matrix times a
    vector), reads each element once: a row reduction, not a tl.dot padded to 16
    columns."""
    return any(sides & (a - b) and sides & (b - a) for a in factors for b in factors)


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
    for n in nodes(e):
        if isinstance(n, Reduce) and getattr(n.summary, "rescaled", ()):
            for rs in n.summary.rescaled:
                used = {v.name for part in (rs.weight, rs.leader_arg) for v in nodes(part) if isinstance(v, Var)}
                weight_free = set()
                for k, a in enumerate(n.args):
                    if f"x{k}" in used:
                        weight_free |= set(free_indices(a))
                names |= set(free_indices(n)) - weight_free
    return names
