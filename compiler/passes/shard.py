"""Shard a reduction across processes: one factorised program becomes two.

A fold is a monoid: split its index, summarise each part, merge the states.
The split path of the Triton backend does that across the programs of one
launch; this rewrite does it across the ranks of a process group, on the IR,
so every backend runs it and every factorised summary (derived or a user's)
merges by its own combine.

Given the factorised program and a reduced index `m` (with every index that
shares its extent: the same axis of the same tensors):

- the *local* program runs on each rank's shard of the inputs.  For every
  outermost fold over a sharded index it returns each field of the fold's
  state, `S<k>_<field>[the free indices that field varies over]`.  Inside those folds an index
  value `m` becomes `m + start` (the shard's first global position, a scalar
  input) and `len(m)` the global extent (another scalar input), so masks and
  position terms see global positions (and a causal loop bound still skips
  the tiles a shard cannot see);
- the *merge* program reads the states of every rank stacked along a new
  index `rank` (rank order) and computes the original outputs with each of
  those folds replaced by the fold over `rank` of a summary whose element is a
  whole state: the same fields, identity, combine and finalize, its lift the
  identity.  Ordered (non-commutative) summaries merge in rank order.  It runs
  on each rank with that rank's part of the inputs: an output that varies over
  a sharded index comes out sharded like the inputs (a layernorm over a
  sharded feature axis), every other output is the same on every rank.

A fold over a sharded index inside another fold over one (its inner fold would
see one part only) is a ShardError.

With `rows` (context parallelism's sharded queries), an index the outputs vary
over is sharded too: in both programs its values become `i + rows_start` and
`len(i)` its global extent, so a causal mask compares global positions.  The
runtime then moves the inputs of the reduced index around a ring instead of
gathering states (compiler/distributed.py); a fold over the rows index would
see this rank's rows only and is a ShardError.
"""
from __future__ import annotations

from dataclasses import dataclass, replace

import sympy

from ..algebra.summary import Summary
from ..errors import ShardError
from ..ops import FLOAT, INT
from ..ir import (
    Access,
    Assign,
    Call,
    Expr,
    Extent,
    Index,
    Input,
    Program,
    Reduce,
    Var,
    accesses,
    children,
    free_indices,
    transform,
    unused_name,
    walk,
)


@dataclass(frozen=True)
class Sharded:
    """The two programs a sharded reduction runs as (see the module docstring)."""

    indices: tuple[str, ...]      # the sharded indices (all of one extent)
    local: Program
    merge: Program
    states: tuple[str, ...]       # the local program's outputs, the merge program's state inputs
    start: str                    # scalar input of the local program: the shard's first position
    total: str                    # scalar input of the local program: the global extent
    rank: str                     # the merge program's index over ranks
    ordered: bool                 # some merged summary is not commutative: states merge in index order
    rows: tuple[str, ...] = ()    # the sharded rows index and those of its extent (none: rows replicated)
    rows_start: str | None = None  # scalar input of both programs: this rank's first row
    rows_total: str | None = None  # scalar input of both programs: the global number of rows
    # with rows: the folds inside a sharded fold that read only the inputs that travel (the
    # ring's dK's D[i] = sum[j](O[i,j] dO[i,j])), which each rank computes once on its own part
    # and which travel in their inputs' place; the local program reads them as inputs
    precomputed: Program | None = None

    def __str__(self) -> str:
        from ..ir import format_program
        rows = f"; rows {', '.join(self.rows)} sharded too, the inputs over the index passed around a ring" \
            if self.rows else ""
        ahead = "" if self.precomputed is None else \
            f"# each rank first computes, on its own part (travelling with it)\n{format_program(self.precomputed)}"
        return (f"{ahead}# sharded over {', '.join(self.indices)}{rows}: each rank runs\n{format_program(self.local)}"
                f"# states {'of every part stacked' if self.rows else 'gathered'} along {self.rank} "
                f"({'global' if self.rows else 'rank'} order); every rank then runs\n"
                f"{format_program(self.merge)}")


def shard(program: Program, index: str, rows: str | None = None) -> Sharded:
    """Split `program` (factorised) into its local and merge programs for a
    reduction whose index `index` is sharded across ranks (and, with `rows`,
    the outputs' rows as well)."""
    extents = dict(program.extents)
    for name in (index, rows):
        if name is not None and name not in extents:
            raise ShardError(f"cannot shard index '{name}': the program has no such index "
                             f"(its indices: {', '.join(sorted(extents))})", program.source)
    sharded = tuple(ix for ix, symbol in program.extents if symbol == extents[index])
    row_indices = () if rows is None else tuple(ix for ix, symbol in program.extents if symbol == extents[rows])
    cut_at = {*sharded, *row_indices}
    reads = [node for st in program.statements for node in accesses(st.expr)]
    cut = {(node.tensor, d) for node in reads for d in range(node.rank) if node.dimension_index(d) in cut_at}
    for node in reads:
        if node.layout is None:
            continue
        crossing = set(node.indices) & cut_at or any((node.tensor, d) in cut for d in range(node.rank)
                                                     if node.dimension_index(d) is None)
        if crossing:
            # a rank's part of the tensor would have to reach into its neighbour's
            what = "a gathered subscript" if node.gathers is not None else "an affine subscript"
            raise ShardError(f"'{node.tensor}' is read at {what} of a sharded index or dimension "
                             f"({', '.join(node.subscripts())}): parts cut at one index cannot be read "
                             f"across their edges", program.source, node.span)
    if rows in sharded:
        raise ShardError(f"the rows index '{rows}' is the sharded index '{index}' or shares its extent: rows "
                         f"must be an index of the outputs that the reduction does not run over", program.source)
    taken = ({s.name for s in program.statements} | {i.name for i in program.inputs} | set(extents)
             | {n.name for s in program.statements for n in walk(s.expr) if isinstance(n, Var)})

    def fresh(base: str) -> str:
        name = unused_name(base, taken)
        taken.add(name)
        return name

    start, total, rank = fresh(f"{index}_start"), fresh(f"{index}_total"), fresh("rank")
    rows_start, rows_total = (fresh(f"{rows}_start"), fresh(f"{rows}_total")) if rows else (None, None)

    folds: dict[Reduce, int] = {}        # outermost folds over a sharded index -> their number
    # a fold's state keeps the index order of the first statement that reads it (dK[m, k]'s
    # state is S[m, k], not S[k, m]): the merge then reads every part's state along the rows
    # it writes
    order: dict[Reduce, tuple[str, ...]] = {}

    def collect(e: Expr, written: tuple[str, ...]) -> None:
        stack = [e]
        while stack:
            node = stack.pop()
            if isinstance(node, Reduce) and set(node.indices) & set(row_indices):
                raise ShardError(f"a reduction over the rows index '{rows}' would see this rank's rows only",
                                 program.source, node.span)
            if isinstance(node, Reduce) and set(node.indices) & set(sharded):
                inner = next((n for n in walk(node) if n is not node and isinstance(n, Reduce)
                              and set(n.indices) & set(sharded)), None)
                if inner is not None:
                    raise ShardError(f"a reduction over the sharded index '{index}' sits inside another one: its "
                                     f"value for one element needs every shard", program.source,
                                     inner.span or node.span)
                folds.setdefault(node.fold, len(folds))
                order.setdefault(node.fold, written)
                continue
            if isinstance(node, Call | Reduce):
                stack.extend(node.args)

    for s in program.statements:
        collect(s.expr, s.indices)
    if not folds:
        raise ShardError(f"no reduction runs over the sharded index '{index}'", program.source)

    offsets = {ix: (start, total) for ix in sharded} | {ix: (rows_start, rows_total) for ix in row_indices}

    def globally(e: Expr) -> Expr:
        """Index values and extents of the sharded indices (and rows) as global positions."""
        def shift(node: Expr) -> Expr:
            if isinstance(node, Index) and node.name in offsets:
                return Call("add", (node, Access(offsets[node.name][0], ())))
            if isinstance(node, Extent) and node.name in offsets:
                return Access(offsets[node.name][1], ())
            return node
        return transform(e, shift)

    def scalars(read: set[str]) -> tuple[Input, ...]:
        # positions are integers (0-d int64 tensors): exact at any length, and a bound they
        # offset is an integer shift of the rows, as the Hopper form takes it
        return tuple(Input(name, 0, dtype=INT) for name in (start, total, rows_start, rows_total)
                     if name and name in read)

    # with rows, a fold inside a sharded fold that reads only inputs that travel is computed
    # once by the rank holding them, and travels in their place
    hoisted: dict[Expr, Assign] = {}
    if rows is not None:
        for fold in folds:
            for node in _outermost(fold.args, lambda n: _travels(n, set(sharded), set(row_indices))):
                if node not in hoisted:
                    hoisted[node] = Assign(fresh(f"T{len(hoisted)}"), free_indices(node), node, FLOAT, node.span)

    def read_hoisted(node: Expr) -> Expr:
        return Access(hoisted[node].name, hoisted[node].indices) if node in hoisted else node

    precomputed = None
    if hoisted:
        statements = tuple(hoisted.values())
        read = {n.tensor for st in statements for n in walk(st.expr) if isinstance(n, Access)}
        precomputed = Program(statements, tuple(i for i in program.inputs if i.name in read),
                              tuple(st.name for st in statements), _used_extents(program.extents, statements),
                              program.source)

    # the local program: every field of every such fold
    states: list[Assign] = []
    names: dict[tuple[int, str], str] = {}
    for fold, k in folds.items():
        shifted = globally(transform(fold, read_hoisted))
        for f in fold.summary.fields:
            name = names[k, f.name] = fresh(f"S{k}_{f.name}")
            field = replace(shifted, result=f.name)     # varies over the indices of its own arguments only
            free = free_indices(field)
            written = [ix for ix in order[fold] if ix in free]
            states.append(Assign(name, (*written, *(ix for ix in free_indices(fold) if ix in free and ix not in written)),
                                 field, f.dtype, fold.span))
    used = {n.tensor for s in states for n in walk(s.expr) if isinstance(n, Access)}
    local_inputs = (*(i for i in program.inputs if i.name in used),
                    *(Input(st.name, len(st.indices)) for st in hoisted.values()), Input(start, 0, dtype=INT),
                    Input(total, 0, dtype=INT),
                    *(i for i in scalars(used) if i.name in (rows_start, rows_total)))
    local = Program(tuple(states), local_inputs, tuple(s.name for s in states),
                    _used_extents(program.extents, states), program.source)

    # the merge program: each fold over a shard becomes a fold over the states of every rank
    indices = {s.name: s.indices for s in states}
    merged = {fold: _merged(fold.summary) for fold in folds}

    def merge_fold(node: Expr) -> Expr:
        # the folds in `folds` are outermost and hold none of the others (checked above)
        if isinstance(node, Reduce) and node.fold in folds:
            k = folds[node.fold]
            reads = tuple(Access(names[k, f.name], (rank, *indices[names[k, f.name]])) for f in node.summary.fields)
            return Reduce(merged[node.fold], (rank,), reads, node.result, node.span)
        return node

    statements = tuple(replace(s, expr=globally(transform(s.expr, merge_fold))) for s in program.statements)
    read = {n.tensor for s in statements for n in walk(s.expr) if isinstance(n, Access)}
    merge_inputs = (*(i for i in program.inputs if i.name in read),
                    *(Input(s.name, 1 + len(s.indices)) for s in states), *scalars(read))
    extents_out = (*_used_extents(program.extents, statements), (rank, sympy.Symbol(f"n_{rank}")))
    merge = Program(statements, merge_inputs, program.outputs, extents_out, program.source)
    return Sharded(sharded, local, merge, tuple(s.name for s in states), start, total, rank,
                   any(not fold.summary.commutative for fold in folds), row_indices, rows_start, rows_total,
                   precomputed)


def _travels(node: Expr, sharded: set[str], rows: set[str]) -> bool:
    """Whether `node` is a fold that its part of the sharded index decides alone: it folds
    over neither index, varies over the sharded one and not the rows, reads no tensor at the
    rows nor at a subscript that is not an index, and uses no position (whose start differs
    between the owner and the rank it visits)."""
    if not isinstance(node, Reduce) or set(node.indices) & (sharded | rows):
        return False
    free = set(free_indices(node))
    if not free & sharded or free & rows:
        return False
    return all(not (isinstance(n, Access) and (set(n.indices) & rows or n.layout is not None
                                               or n.gathers is not None))
               and not (isinstance(n, Index | Extent) and n.name in sharded | rows) for n in walk(node))


def _outermost(exprs, chosen) -> list[Expr]:
    """The nodes of `exprs` that `chosen` picks, not descending into a picked one."""
    found, stack = [], list(reversed(exprs))
    while stack:
        e = stack.pop()
        if chosen(e):
            found.append(e)
        else:
            stack.extend(reversed(children(e)))
    return found


def _merged(s: Summary) -> Summary:
    """`s` with a whole state as its element: lift is the identity on the fields."""
    return replace(s, name=f"{s.name}_states", arity=len(s.fields),
                   lift=tuple(Var(f"x{k}") for k in range(len(s.fields))), rescaled=(), blocks=(),
                   notes=(*s.notes, f"merged across ranks: the element is a state of {s.name}"))


def _used_extents(extents, statements) -> tuple:
    used = {ix for s in statements for n in walk(s.expr)
            for ix in (n.indices if isinstance(n, Access | Reduce) else (n.name,) if isinstance(n, Index | Extent) else ())}
    used |= {ix for s in statements for ix in s.indices}
    return tuple((ix, symbol) for ix, symbol in extents if ix in used)
