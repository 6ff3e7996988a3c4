"""Kernel formation, the schedule stage's pass: which statements share a kernel,
what the grid is, and which reductions must be materialised in global memory.

Everything here works on IR names, for any sizes; a backend turns names into
tile axes.

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

from dataclasses import dataclass, replace
from functools import cache

from ..algebra.properties import additive
from ..algebra.summary import product_of
from ..errors import BackendError
from ..ir import (Access, Assign, Composite, Expr, Program, Reduce, Var, alpha_key, children, format_expr,
                  nodes, outer_reductions, reads, substitute, transform, with_children)
from ..passes.lower import lower
from ..passes.stabilise import product
from .bounds import index_bounds, prefix_of, tile_tests
from .folds import (
    contraction_names,
    contractions,
    dot_batch_names,
    fields_read,
    flatten_mul,
    fold_parts,
    free,
    inline,
    narrow_projections,
    replace_folds,
    restrict_fields,
    summed_factors,
    top_folds,
    value_only_names,
)
from .ir import KernelSchedule, Schedule
from .plan import Loop


@dataclass
class _Draft:
    """A kernel while statements join it (frozen into a KernelSchedule at the end)."""
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
    recomputes: tuple = ()                 # (grid index, reduced indices of the contractions its tiles recompute)

    @property
    def lhs(self) -> tuple[str, ...]:
        return self.grid + self.epilogue


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

    def __init__(self, program: Program, outputs: tuple[str, ...], split: int | None,
                 materialise_chains: bool = False):
        self.program = program
        self.outputs = outputs
        self.split = split
        self.materialise_chains = materialise_chains
        self.avoid = frozenset(i for i, _ in program.extents)
        self.fresh_names: dict[str, str] = {}
        self.kernels: list[_Draft] = []
        self.buffer_count = 0
        self.taken = {s.name for s in program.statements} | {i.name for i in program.inputs}
        self.buffer_indices: dict[str, tuple[str, ...]] = {}
        self.stored: dict[tuple[str, Reduce], str] = {}     # (kernel, projection it stores) -> buffer
        self.operand_buffers: list[str] = []                  # chained operands stored (Schedule.operand_buffers)
        # what a buffer holds -> (its name, its indices): a value two statements materialise is
        # stored once
        self.held: dict[Expr, tuple[str, tuple[str, ...]]] = {}

    def run(self) -> Schedule:
        defs = {s.name: s for s in self.program.statements}
        non_outputs = {n: s for n, s in defs.items() if n not in self.outputs}
        for s in self._widest_first(non_outputs):
            last = self.kernels[-1] if self.kernels else None
            joined, sibling = None, False
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
                elif not last.epilogue and set(s.indices) == set(grid) and \
                        _siblings(last.program_folds, top_folds(expr, s.indices), grid, last.grid):
                    # the same loop as the kernel's fold, recomputing the same nested folds
                    # (a backward's dK beside dV): one program streams both, over the union
                    # of their grids, and each statement stores its own indices
                    joined, sibling = replace(s, expr=expr), True
            if joined is not None:
                expr, stored = self._reuse(joined.expr, s.indices, exclude=last)
                if stored and stored not in last.reads:
                    last.reads += f"; {s.name} reads {stored} instead of recomputing it per program"
                if sibling:
                    self._share_loop(last, replace(joined, expr=expr))
                else:
                    self._join(last, replace(joined, expr=expr))
            else:
                if s.name in reads(s.expr):
                    raise BackendError(f"statement '{s.name}' reads itself; the IR is not a program")
                expr = narrow_projections(inline(s.expr, non_outputs, self.avoid, self.fresh_names, (s.name,)),
                                          s.indices)
                expr = self._partial_sum(last, replace(s, expr=expr)) or expr
                expr, stored = self._reuse(expr, s.indices)
                self._add(replace(s, expr=expr), buffer=False)
                if stored:
                    self.kernels[-1].reads = f"; reads {stored} instead of recomputing it per program"
                    self.kernels[-1].why += self.kernels[-1].reads
                if last is not None and self._absorbs(self.kernels[-1], last):
                    own = self.kernels.pop()
                    self.kernels[-1] = replace(last, grid=own.grid, epilogue=(), why="", reads=own.reads,
                                               separate=last.separate, recomputes=own.recomputes)
                    for t in own.statements:
                        self._join(self.kernels[-1], t)
                    self.kernels[-1].why += (f"; stores {', '.join(t.name for t in last.statements)} in its "
                                             f"epilogue (elementwise over the same indices)")
                elif last is not None:
                    own = self.kernels[-1]
                    earlier = [t.name for k in self.kernels[:-1] for t in k.statements if t.name in reads(expr)]
                    because = (f"reads {', '.join(earlier)} from memory" if earlier else
                               f"its grid ({', '.join(own.grid)}) or output indices differ from {last.name}'s")
                    own.separate = f"; a kernel of its own: {because}"
                    own.why += own.separate
        kernels = tuple(_frozen(k) for k in self.kernels)
        return Schedule(self.program, self.outputs, self.split, kernels, tuple(self.buffer_indices.items()),
                        tuple(self.fresh_names.items()), operand_buffers=tuple(self.operand_buffers))

    def _widest_first(self, non_outputs: dict[str, Assign]) -> list[Assign]:
        """The output statements in an order that respects what reads what, taking
        the one with the most indices first among those ready: a row statistic then
        joins the kernel of the row output whichever comes first in the text.  Among
        the equally wide ones, a kernel reads a fold that another streams once per
        program only from an earlier kernel (_reuse), so a statement waits for those
        that supply it (_supplies), and of the rest one that supplies another comes
        first; only then the text decides.  So an attention backward's dQ, whose
        programs fold D = rowsum(dO * O) once per row, comes before dK, which would
        refold it for every tile of keys, and before dV, which would part dK from
        the loop they share, in whichever order the gradients were asked."""
        def needs(e: Expr, seen: frozenset = frozenset()) -> set[str]:
            out = set()
            for name in reads(e) - seen:
                out |= {name} if name not in non_outputs else needs(non_outputs[name].expr, seen | {name})
            return out

        pending = [s for s in self.program.statements if s.name in self.outputs]
        statements = {s.name: s for s in pending}
        depends = {s.name: needs(s.expr) for s in pending}

        @cache
        def alone(name: str) -> Assign:           # as its kernel reads it
            s = statements[name]
            expr = inline(s.expr, non_outputs, self.avoid, {}, (name,))
            return replace(s, expr=narrow_projections(expr, s.indices))

        @cache
        def supplies(s: str, t: str) -> bool:
            return _supplies(alone(s), alone(t))

        ordered = []
        while pending:
            waiting = {t.name for t in pending}
            ready = [s for s in pending if not (depends[s.name] - {s.name}) & waiting] or pending[:1]
            widest = [s for s in ready if len(s.indices) == max(len(t.indices) for t in ready)]
            first = [s for s in widest if not any(supplies(t.name, s.name) for t in widest if t is not s)] or widest
            pick = next((s for s in first if any(supplies(s.name, t.name) for t in widest if t is not s)), first[0])
            ordered.append(pick)
            pending.remove(pick)
        return ordered

    # ------------------------------------------------------------
    @staticmethod
    def _absorbs(own: _Draft, last: _Draft) -> bool:
        """Whether kernel `own` (just made) can also store the statements of `last`, an
        elementwise kernel over exactly its output indices whose values it does not read
        from memory (residual + RMSNorm: S = X + R beside Y = S * rsqrt(mean(S^2)), which
        recomputes X + R): one pass over the rows instead of two."""
        return (not last.buffers and not own.buffers and not last.program_folds
                and all(t.indices == own.lhs and not top_folds(t.expr, t.indices) for t in last.statements)
                and not {t.name for t in last.statements} & set().union(*(reads(t.expr) for t in own.statements)))

    def _join(self, k: _Draft, s: Assign) -> None:
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

    def _share_loop(self, k: _Draft, s: Assign) -> None:
        """Join `s` to kernel `k`, whose one program fold streams the same indices as
        the one top fold of `s` (_siblings): the two become one fold of the product of
        their summaries (algebra.summary.product_of), so that one loop carries both states
        and computes the nested folds they share once per tile; each statement projects
        its own fields.  The grid is the union of both grids."""
        theirs, = k.program_folds
        mine, = top_folds(s.expr, s.indices)
        grid = _grid_of(s.expr, s.indices)[0]
        # the nested folds both recompute, spelled alike (a bound index that a grid index
        # of one statement renamed in it is the other's name again), so each is one value
        spelled = {alpha_key(n): n for n in nodes(theirs) if isinstance(n, Reduce)}
        summary, names = product_of((theirs.summary, mine.summary))
        shared = Reduce(summary, theirs.indices, theirs.args + _respelled(mine, spelled).args)
        parts = {theirs: names[0], mine: names[1]}

        def projected(node: Reduce) -> Expr:
            return replace(shared, result=parts[node.fold][_field_of(node)])
        k.grid += tuple(g for g in grid if g not in k.grid)
        statements = tuple(replace(t, expr=_folds_replaced(t.expr, parts, projected))
                           for t in k.statements + (s,))
        k.statements = ()
        for t in statements:
            self._join(k, t)
        k.why += f"; {', '.join(t.name for t in k.statements)} share one loop over ({', '.join(theirs.indices)})"

    def _partial_sum(self, k: _Draft | None, s: Assign) -> Expr | None:
        """Where the one top fold of `s` is a sum over the indices of kernel `k`'s loop and
        more, its partial sum over those indices, the rest of its indices among `k`'s grid,
        joins `k`'s loop (_siblings) and is stored, and `s` sums that buffer over the rest:
        an ALiBi slope's gradient dA[h] = sum[i, m](sum[b](dS) * |i - m|) is partial sums
        over i beside dK and dV (which recompute dS anyway), one per (b, h, m), then a sum
        of those over (b, m), in order (deterministic), not a score-sized fold of its own.
        The expression of `s` then, or None."""
        if k is None or k.buffers or k.epilogue or len(k.program_folds) != 1:
            return None
        folds = top_folds(s.expr, s.indices)
        if len(folds) != 1:
            return None
        within = k.program_folds[0].indices
        flat = _flattened(folds[0])
        if not additive(flat.summary) or flat.result is not None or not set(within) < set(flat.indices):
            return None
        inner = Reduce(flat.summary, within, flat.args)
        indices = tuple(g for g in k.grid if g in free(inner))
        if not free(inner) <= set(k.grid) or not _siblings(k.program_folds, [inner], indices, k.grid):
            return None
        name = self._buffer_name()
        self.buffer_indices[name] = indices
        self._share_loop(k, Assign(name, indices, self._reuse(inner, indices, exclude=k)[0], "float"))
        k.buffers += (name,)
        rest = Reduce(flat.summary, tuple(i for i in flat.indices if i not in within), (Access(name, indices),))
        return _folds_replaced(s.expr, {folds[0]}, lambda node: rest)

    def _add(self, s: Assign, buffer: bool) -> None:
        grid, folds = _grid_of(s.expr, s.indices)
        if not grid and s.indices and folds:
            # No index shared by every reduction: one program would do all the work.
            # Materialise the reductions that do not vary over the whole output.
            todo = [f for f in folds if free(f) != set(s.indices)]
            s = self._materialise(s, todo, "it shares no output index with the others")
            grid, folds = _grid_of(s.expr, s.indices)
        if not s.indices and any(_folded_elements(f) for f in folds):
            s = self._materialise_elements(s, folds)
            grid, folds = _grid_of(s.expr, s.indices)
        chains = _recomputed(folds, grid)
        if chains and self.materialise_chains:
            s = self._materialise_operands(s, chains)
            grid, folds = _grid_of(s.expr, s.indices)
            chains = []
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
        self.kernels.append(_Draft(
            name=self._kernel_name(s.name), statements=(s,), grid=grid, epilogue=epilogue, why=why,
            buffers=(s.name,) if buffer else (), program_folds=program_folds,
            dependent=_dependent(program_folds),
            recomputes=tuple(dict.fromkeys((part.index, part.work) for part in chains))))

    def _reuse(self, expr: Expr, lhs: tuple[str, ...], exclude: _Draft | None = None) -> tuple[Expr, str]:
        """Folds nested in `expr` that miss one of its grid indices are recomputed by
        every program along that index (the backward's D = rowsum(dO * O) inside the
        dK loop, a layernorm's row statistics inside a column sum).  Where an earlier
        kernel streams the same fold once per program (one value per row of its grid,
        so never a score-sized buffer), that kernel also stores it into a float32
        buffer (even where it stores the same value as an output: in the output's
        dtype, a bf16 S would make Y less accurate than recomputing it does) and `expr`
        reads the buffer instead (`exclude`: the kernel `expr` joins, which cannot read
        what its own programs store).

        A projection (`f.r`) needs only the fields it reads (`fields_read`): it is the
        same value as that projection of any fold whose restriction to those fields is
        its own, up to index and summary names.  So the row statistics (r, l) of a
        sink's normaliser, which the dK kernel of its backward would refold over m for
        every i, are stored by the dQ kernel, whose fold (r, l, u, ...) streams them
        once per row beside fields over another index."""
        table: dict[Reduce, Access] = {}
        notes: dict[str, list[str]] = {}         # what, by whom -> buffers
        for node in _refolded(expr, lhs):
            if node in table:
                continue
            found = _stored_match([k for k in self.kernels if k is not exclude], node)
            if found is None:
                continue
            k, fold, part = found
            theirs = dict(zip(_stored_key(part)[1], _stored_key(_read_part(node))[1]))  # k's names -> expr's
            indices = tuple(g for g in k.grid if g in free(part))
            projection = replace(fold, result=node.result)
            name = self.stored.get((k.name, projection))
            if name is None:
                name = self.stored[(k.name, projection)] = self._buffer_name()
                self._join(k, Assign(name, indices, projection, "float"))
                k.buffers += (name,)
                self.buffer_indices[name] = indices
            table[node] = Access(name, tuple(theirs[g] for g in indices))
            names = notes.setdefault(f"{node.summary.name}[{', '.join(node.indices)}], stored by {k.name}", [])
            names += [name] if name not in names else []
        if not table:
            return expr, ""
        return substitute(expr, table), ", ".join(f"{', '.join(names)} ({what})" for what, names in notes.items())

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

    def _stored(self, value: Expr, as_operand: bool) -> tuple[str, tuple[str, ...]] | None:
        """The buffer an earlier statement stored `value` in, its name and indices (the
        count of rows not ignored, which a loss's dH and dW both divide by; a backward's
        dZ[t, v], which dH reads over (t, v) and dW over (v, t)), or None.  Equal values are
        equal nodes (frozen, hashed by structure), so this costs a lookup; equal up to index
        names only (alpha_key) would cost a walk of every tree, which on a deep program
        (sixteen nested softmaxes) is not a walk of its DAG but of its unfolded tree.  A
        buffer read otherwise than as a matrix product's operand is no operand buffer."""
        found = self.held.get(value)
        if found is not None and not as_operand and found[0] in self.operand_buffers:
            self.operand_buffers.remove(found[0])
        return found

    def _materialise(self, s: Assign, todo: list[Reduce], reason: str) -> Assign:
        table: dict[Reduce, Access] = {}
        for f in todo:                                  # innermost first
            body = replace_folds(f, table)
            indices = tuple(i for i in s.indices if i in free(f))
            before = self._stored(body, as_operand=False)
            if before is not None:
                table[f] = Access(*before)
                continue
            name = self._buffer_name()
            self.held[body] = (name, indices)
            self.buffer_indices[name] = indices
            note = f"{f.summary.name}[{', '.join(f.indices)}] over ({', '.join(indices)})"
            self._add(Assign(name, indices, body, "float"), buffer=True)
            self.kernels[-1].why = f"materialises {note} into {name} ({reason})"
            table[f] = Access(name, indices)
        return replace(s, expr=replace_folds(s.expr, table))

    def _materialise_elements(self, s: Assign, folds: list[Reduce]) -> Assign:
        """A scalar is one program: where a fold's elements fold others (a mean loss over
        rows, each a logsumexp over a vocabulary of contractions), that program would
        fold them one row tile after another, a split over the outermost index at
        most.  Each such argument becomes a buffer over the fold's indices, made by a
        kernel whose grid they are, and the scalar folds the buffer."""
        table: dict[Reduce, Reduce] = {}
        for f in folds:
            args = []
            for arg in f.args:
                if _folds_in(arg):
                    indices = tuple(i for i in f.indices if i in free(arg))
                    name = self._buffer_name()
                    self.buffer_indices[name] = indices
                    elements = Assign(name, indices, arg, "float")
                    why = (f"the elements of {f.summary.name}[{', '.join(f.indices)}] into {name}[{', '.join(indices)}] "
                           f"(they fold others: in the scalar's one program they would run one after another)")
                    last = self.kernels[-1] if self.kernels else None
                    if last is not None and self._folds_again(last, elements):
                        self._join(last, elements)          # one fold, one loop: _join keeps equal folds once
                        last.buffers += (name,)
                        last.why += f"; stores {why}"
                    else:
                        self._add(elements, buffer=True)
                        self.kernels[-1].why = f"materialises {why}"
                    arg = Access(name, indices)
                args.append(arg)
            table[f] = replace(f, args=tuple(args))
        return replace(s, expr=_folds_replaced(s.expr, set(table), lambda node: replace(table[node.fold],
                                                                                        result=node.result)))

    @staticmethod
    def _folds_again(k: _Draft, s: Assign) -> bool:
        """Whether buffer statement `s` has kernel `k`'s grid and folds every program fold
        of `k` (a saved row logsumexp beside the row losses, which fold the same logits
        and the label's logit in one fold): joined, `k` computes both in one loop over
        the logits, where two kernels would each fold them."""
        if k.buffers or k.epilogue or not k.program_folds or s.indices != k.grid:
            return False
        grid, folds = _grid_of(s.expr, s.indices)
        return grid == k.grid and set(k.program_folds) <= set(folds)

    def _materialise_operands(self, s: Assign, found: list[_Recomputed]) -> Assign:
        """Each recomputed part (_recomputed) as a buffer over its own indices, the outer
        fold's reduced index among them, made by a kernel of its own: the SwiGLU block's
        silu(X W1) * (X W3) once, then a matrix product by W2; an RMSNorm weight
        gradient's row statistic once, then the column sum that reads it."""
        regrouped: dict[Reduce, Reduce] = {}
        stored: dict[Expr, Access] = {}
        for part in found:
            if part.fold in regrouped or (not part.factors and part.operand[0] in stored):
                continue
            operand = product(list(part.operand), [])
            before = self._stored(operand, as_operand=part.factors)
            if before is not None:
                name, indices = before
            else:
                indices = (tuple(i for i in s.indices if i in free(operand))
                           + tuple(i for i in part.fold.indices if i in free(operand)))
                name = self._buffer_name()
                self.buffer_indices[name] = indices
                self.held[operand] = (name, indices)
                if part.factors:
                    self.operand_buffers.append(name)
                self._add(Assign(name, indices, operand, "float"), buffer=True)
                self.kernels[-1].why = (f"materialises {format_expr(operand)} into {name}[{', '.join(indices)}] "
                                        f"(read by {part.fold.summary.name}[{', '.join(part.fold.indices)}], whose "
                                        f"tiles of {part.index} would each recompute it)")
            if part.factors:
                rest = [f for f in summed_factors(part.fold.args[0], frozenset(part.fold.indices))
                        if f not in part.operand]
                regrouped[part.fold] = replace(part.fold, args=(product(rest + [Access(name, indices)], []),))
            else:
                stored[part.operand[0]] = Access(name, indices)

        def regroup(e: Expr) -> Expr:
            return replace(regrouped[e.fold], result=e.result) if isinstance(e, Reduce) and e.fold in regrouped else e
        return replace(s, expr=substitute(transform(s.expr, regroup), stored))


@dataclass(frozen=True)
class _Recomputed:
    """A part of a top fold's body that one kernel recomputes for every tile of the grid
    index `index`, which it does not vary over: a contraction chained behind the fold's
    own (`factors`: the factors of the fold's summed product that form it, stored
    together and regrouped, the SwiGLU block's silu(X W1) * (X W3) under the sum over f
    by W2[e,f]), or a fold nested in it that reads the fold's index (one node, stored
    where it stands: an RMSNorm weight gradient's row statistic under the sum over i,
    for every tile of the columns k)."""
    fold: Reduce
    index: str
    operand: tuple[Expr, ...]
    factors: bool

    @property
    def work(self) -> tuple[tuple[str, ...], ...]:
        """The reduced indices of each fold the part recomputes (its work per element)."""
        if not self.factors:
            return (tuple(self.operand[0].indices),)
        return _contracted(self.operand)


def _contracted(operand: tuple[Expr, ...]) -> tuple[tuple[str, ...], ...]:
    """The reduced indices of each contraction in `operand`, each outermost fold once
    however many of its fields the operand projects."""
    folds = dict.fromkeys(n.fold for n in outer_reductions(operand))
    return tuple(tuple(sorted(c.reduced)) for fold in folds for c in contractions(fold))


def _weighted(operand) -> bool:
    """Whether `operand` reads a rescaled fold (a softmax's running max, its weights): stored,
    it would be a score-sized buffer, [rows, keys] (a cross-entropy backward's
    probabilities over the vocabulary), which the FlashAttention-style fold exists to
    avoid; the schedule recomputes those instead."""
    return any(isinstance(n, Reduce) and getattr(n.summary, "rescaled", ()) for e in operand for n in nodes(e))


def _reads_past_the_tile(inner: Reduce, fold: Reduce, grid: tuple[str, ...]) -> bool:
    """Whether `inner` reduces a tensor along a dimension that `fold` reads elsewhere by
    a grid index: each program has one tile of it, and `inner` reads all of it (the row
    statistic of X[i, n] beside X[i, k], tiled by k), so recomputing it costs memory
    traffic; a norm of the keys a kernel loads anyway (cosine attention's sum[c](K[m,c]
    ** 2) beside the scores' K[m,c]) costs none."""
    tiled = {(n.tensor, p) for n in nodes(fold) if isinstance(n, Access)
             for p, index in enumerate(n.indices) if index in grid}
    return any((n.tensor, p) in tiled for n in nodes(inner) if isinstance(n, Access)
               for p, index in enumerate(n.indices) if index in inner.indices)


def _recomputed(folds: list[Reduce], grid: tuple[str, ...]) -> list[_Recomputed]:
    """The parts of the top folds' bodies that a kernel over `grid` recomputes for every
    tile of a grid index they do not vary over.  A contraction chained behind a sum's own
    (the sum's factors that do not read g but hold a contraction, beside factors that
    read g) is one part; else, in a sum, each plain fold nested in its body (no fold
    inside it, no contraction: a contraction there is the attention-like fusion, whose
    values the schedule keeps whole) that reads the sum's index, misses g and reads
    past the program's tile (_reads_past_the_tile).  Neither may read a rescaled fold
    (_weighted).  Stored once, a chained contraction
    is a matrix product's operand read from memory, a nested fold a vector.  A part two
    statements recompute alike (dH and dW of a loss over the logits) is stored once
    (Former._stored)."""
    found = []
    for fold in dict.fromkeys(folds):
        chained = None
        if additive(fold.summary):
            factors = summed_factors(fold.args[0], frozenset(fold.indices))
            for g in grid:
                group = tuple(f for f in factors if g not in free(f))
                rest = [f for f in factors if g in free(f)]
                if rest and group and any(contractions(f) for f in group) and \
                        not any(isinstance(n, Reduce) for f in rest for n in nodes(f)) and not _weighted(group):
                    chained = _Recomputed(fold, g, group, True)
                    break
        if chained is not None:
            found.append(chained)
            continue
        if not additive(fold.summary):
            continue
        for node in outer_reductions(fold.args):
            inner = node.fold
            missing = [g for g in grid if g not in free(inner)]
            if missing and free(inner) & set(fold.indices) and not contractions(inner) and \
                    not outer_reductions(inner.args) and _reads_past_the_tile(inner, fold, grid) and \
                    not _weighted((inner,)):
                found.append(_Recomputed(fold, missing[0], (node,), False))
    return found


def _field_of(fold: Reduce) -> str:
    """The field a fold's value is: its projection, or the field its finalize reads."""
    return fold.result if fold.result is not None else fold.summary.finalize.name


def _siblings(program_folds, folds: list[Reduce], grid: tuple[str, ...], kernel_grid: tuple[str, ...]) -> bool:
    """Whether a statement whose one top fold is `folds` and whose grid is `grid` shares
    the loop of a kernel whose one program fold is `program_folds`: both fold over the
    same indices, each value is one field of its state, both recompute a nested fold (up
    to index names) in every step, which one loop computes once, and one program can
    hold what the other tiles: over the union of the grids, every index some field does
    not vary over is a side of a matrix product (held whole, tiles.held_whole_in_grid),
    and an index every field varies over is one too (the tiles the programs share).  So
    dK[m, k] = sum[i](dS[i, m] * Q[i, k]) joins dV[m, j] = sum[i](P[i, m] * dO[i, j]),
    both reading the scores sum[k](Q[i, k] * K[m, k]) (one program per tile of m over
    whole k and j), and an ALiBi slope's partial sum over i, over (b, h, m), joins them;
    a sink's dS[h] = sum[i](...) does not: every field would be recomputed per tile of m."""
    if len(program_folds) != 1 or len(folds) != 1:
        return False
    theirs, mine = program_folds[0], folds[0]
    if grid == kernel_grid or theirs.indices != mine.indices or free(mine) != set(grid):
        return False
    parts = fold_parts(theirs) + [mine]
    union = set(kernel_grid) | set(grid)
    lacked = {g for g in union if any(g not in free(p) for p in parts)}
    sides = set().union(*(_sides(p) for p in parts))
    if not lacked <= sides or not (union - lacked) & sides:
        return False
    if not all(f.result is not None or isinstance(f.summary.finalize, Var) for f in (theirs, mine)):
        return False
    nested = {alpha_key(n) for n in nodes(theirs) if isinstance(n, Reduce) and n is not theirs}
    return any(alpha_key(n) in nested for n in nodes(mine) if isinstance(n, Reduce) and n is not mine)


def _flattened(fold: Reduce) -> Reduce:
    """`fold` with the sums nested in its summed product taken into its own indices:
    sum[I](sum[J](x) * c) is sum[I, J](x * c) where c does not read J (a sum distributes
    over a product)."""
    while additive(fold.summary) and fold.result is None and len(fold.args) == 1:
        factors = flatten_mul(fold.args[0])
        nested = [f for f in factors if isinstance(f, Reduce) and f.summary == fold.summary and f.result is None
                  and len(f.args) == 1]
        if len(nested) != 1:
            break
        rest = [f for f in factors if f is not nested[0]]
        if set(nested[0].indices) & (set(fold.indices) | set().union(*(free(f) for f in rest))):
            break
        fold = Reduce(fold.summary, fold.indices + nested[0].indices, (product(rest + [nested[0].args[0]], []),))
    return fold


def _folds_in(e: Expr) -> bool:
    return any(isinstance(n, Reduce) for n in nodes(e))


def _folded_elements(fold: Reduce) -> bool:
    """Whether an element of `fold` folds others (an argument holds a fold)."""
    return any(_folds_in(arg) for arg in fold.args)


def _folds_replaced(e: Expr, folds, by) -> Expr:
    """`e` with every node of one of `folds` (a projection of it too) replaced by
    `by(node)`; a fold's node is free of the bound indices around it (a top fold)."""
    return transform(e, lambda n: by(n) if isinstance(n, Reduce) and n.fold in folds else n)


def _sides(fold: Reduce) -> set[str]:
    """The free indices that are a row or column of one of `fold`'s own matrix products."""
    return {i for c in contractions(fold) if c.reduced == frozenset(fold.indices) for i in c.sides}


def _respelled(e: Expr, spelled: dict) -> Expr:
    """`e` with each fold equal up to index names to one of `spelled` (by alpha_key)
    written as that one, where its free indices are the same names."""
    def respelled(n: Expr) -> Expr:
        other = spelled.get(alpha_key(n)) if isinstance(n, Reduce) else None
        return other if other is not None and free(other) == free(n) else n
    return transform(e, respelled)


def _unread_fields_dropped(k: _Draft) -> _Draft:
    """`k` with each fold restricted to the fields some projection in the kernel reads
    (`restrict_fields`): a fold the stabiliser gave fields that no statement reads (the
    sink backward's dK reads only the running max r of a fold with three weighted sums
    over 3-D values) would compute them all the same."""
    read: dict[Reduce, set[str]] = {}
    for st in k.statements:
        for n in nodes(st.expr):
            if isinstance(n, Reduce):
                read.setdefault(n.fold, set()).update(
                    n.summary.field_names if n.result is None else fields_read(n.summary, n.result))
    restricted: dict[Reduce, Reduce] = {}
    done: dict[int, Expr] = {}

    def rewrite(e: Expr) -> Expr:
        if id(e) in done:                        # a subtree shared by several parents
            return done[id(e)]
        new = e
        if isinstance(e, Reduce) and e.result is not None and len(read[e.fold]) < len(e.summary.field_names):
            if e.fold not in restricted:
                keep = [f for f in e.summary.field_names if f in read[e.fold]]
                restricted[e.fold] = restrict_fields(e.fold, keep)
            new = replace(restricted[e.fold], result=e.result)
        done[id(e)] = new = with_children(new, tuple(rewrite(c) for c in children(new)))
        return new

    statements = tuple(replace(st, expr=rewrite(st.expr)) for st in k.statements)
    if not restricted:
        return k
    program_folds = tuple(rewrite(restricted.get(f, f)) for f in k.program_folds)
    return replace(k, statements=statements, program_folds=program_folds, dependent=_dependent(program_folds))


def _frozen(k: _Draft) -> KernelSchedule:
    k = _unread_fields_dropped(k)
    exprs = [s.expr for s in k.statements]
    return KernelSchedule(
        k.name, k.statements, k.grid, k.epilogue, k.why, loops(k), k.buffers, k.program_folds, k.dependent,
        contractions=tuple(c for e in exprs for c in contractions(e)),
        dot_indices=frozenset().union(*(contraction_names(e) for e in exprs)),
        batch_indices=frozenset().union(*(dot_batch_names(e) for e in exprs)),
        value_only=frozenset().union(*(value_only_names(e) for e in exprs)),
        recomputes=k.recomputes)


def _read_part(node: Reduce) -> Reduce:
    """The fold a node reads: a projection's fold restricted to the fields it reads
    (with its projection), else the fold itself."""
    if node.result is None:
        return node.fold
    return replace(restrict_fields(node.fold, fields_read(node.summary, node.result)), result=node.result)


def _stored_key(node: Reduce) -> tuple[Expr, tuple[str, ...]]:
    """`node` up to index names (`alpha_key`) and, where it projects one field, up to its
    summary's name and finalize, which a projection does not read."""
    if node.result is not None:
        node = replace(node, summary=replace(node.summary, name="", finalize=Var(node.result)))
    return alpha_key(node)


def _storable(k: _Draft, node: Reduce) -> list[Reduce]:
    """Folds of kernel `k` that can store what `node` reads once per program: its program
    folds and, for a projection, its top folds whose part read by that projection varies
    over exactly k's grid."""
    if node.result is None:
        return list(k.program_folds)
    found = [f for f in k.program_folds if node.result in f.summary.field_names]
    for s in k.statements:
        for f in top_folds(s.expr, s.indices):
            if f not in found and node.result in f.summary.field_names and \
                    free(_read_part(replace(f, result=node.result))) == set(k.grid):
                found.append(f)
    return found


def _stored_match(kernels: list[_Draft], node: Reduce) -> tuple[_Draft, Reduce, Reduce] | None:
    """The first of `kernels` with a fold that streams once per program what `node`
    reads (_storable, equal up to names by _stored_key): that kernel, the fold and the
    part of it that `node` reads; None if there is none."""
    key = _stored_key(_read_part(node))[0]
    for k in kernels:
        for fold in _storable(k, node):
            part = _read_part(replace(fold, result=node.result))
            if _stored_key(part)[0] == key:
                return k, fold, part
    return None


def _refolded(expr: Expr, lhs: tuple[str, ...]) -> list[Reduce]:
    """The folds nested in `expr` that miss one of its grid indices: every program
    along that index recomputes them."""
    grid = set(_grid_of(expr, lhs)[0])
    return [n for n in nodes(expr) if isinstance(n, Reduce) and not grid <= free(n)]


def _supplies(s: Assign, t: Assign) -> bool:
    """Whether a kernel of `s` alone would stream once per program a fold that `t`
    recomputes per program (_refolded), which `t` could then read from memory (the
    backward's dQ, which folds D = rowsum(dO * O) once per row, supplies dK)."""
    grid, folds = _grid_of(s.expr, s.indices)
    alone = _Draft("", (s,), grid, (), "", program_folds=tuple(f for f in folds if free(f) == set(grid)))
    return any(_stored_match([alone], node) is not None for node in _refolded(t.expr, t.indices))


def _sub_folds(f: Reduce) -> set[Reduce]:
    return {n.fold for a in f.args for n in nodes(a) if isinstance(n, Reduce)}


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


def loops(spec: _Draft) -> tuple[Loop, ...]:
    """The streamed loops of a kernel, in program order: one per set of reduced
    indices of its top folds (folds over the same indices share it), each with
    the loops of the folds inside its folds' arguments; then the epilogue."""
    return (*_fold_loops(tuple(f for s in spec.statements for f in top_folds(s.expr, s.indices)), {}),
            *((Loop(spec.epilogue, ()),) if spec.epilogue else ()))


def _fold_loops(folds: tuple[Reduce, ...], made: dict[tuple[Reduce, ...], tuple[Loop, ...]]) -> tuple[Loop, ...]:
    """The loops of `folds`; `made`: those of the fold tuples already seen (the loops
    of a fold nested in several others are one value, derived once)."""
    if folds in made:
        return made[folds]
    by_indices: dict[tuple[str, ...], list[Reduce]] = {}
    for f in folds:
        if f not in by_indices.setdefault(f.indices, []):
            by_indices[f.indices].append(f)
    out = []
    for indices, group in by_indices.items():
        inner = tuple(n.fold for f in group for a in f.args for n in top_folds(a, tuple(free(a))))
        names = tuple(dict.fromkeys(f.summary.name for f in group))
        bounds = tuple(dict.fromkeys(str(b) for f in group for relations in index_bounds(f).values()
                                     for b in relations))
        skips = tuple(dict.fromkeys(format_expr(c) for f in group for tests in tile_tests(f).values()
                                    for c in tests))
        prefixes = {prefix_of(f) for f in group}
        along = next(iter(prefixes)) if len(prefixes) == 1 else None
        prefix = f"{'suffix' if along.reverse else 'prefix'} along {along.over}" if along else ""
        out.append(Loop(indices, names, _fold_loops(inner, made), bounds, skips, prefix=prefix))
    made[folds] = tuple(out)
    return made[folds]


def schedule(program: Program, outputs: tuple[str, ...], split: int | None = None) -> Schedule:
    """The schedule stage: factorised IR -> Schedule (kernels, grids, loops, buffers).
    Composites (softmax, logsumexp, ...) are lowered to reductions first; `split`
    (None: the backend's default) materialises what a forced split cannot merge."""
    if any(isinstance(n, Composite) for s in program.statements for n in nodes(s.expr)):
        program = lower(program)
    fused = Former(program, tuple(outputs), split).run()
    if not any(k.recomputes for k in fused.kernels):
        return fused
    return replace(fused, materialised=Former(program, tuple(outputs), split, materialise_chains=True).run())
