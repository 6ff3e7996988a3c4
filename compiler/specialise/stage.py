"""specialise(Schedule, Signature) -> ConcreteSchedule: the schedule stage's tile
rules (compiler.schedule.tiles) evaluated at one call's extents and dtypes.

Per kernel, in this order (each step reads the ones before):
1. the grid: which indices are tiled and by how much (tiles.grid_tiling), which
   are tuned, and the order of the programs (longest loops first under an upper
   bound such as m <= i; groups of tile rows for a matrix product's two tuned tiles);
2. the epilogue's tiles;
3. every fold the kernel streams, walked as the kernel evaluates them (statements
   at the grid or the epilogue, each fold's arguments inside its loop): per
   reduced index, a loop of tiles, one tile holding it whole (the grid's or the
   epilogue's where they hold the index whole in a tile of that size), or one
   value at a time;
4. the split of its program folds (tiles.auto_split, or the split asked for), and
   for a split kernel the folds again at the split's tiles, tuned with the split
   loop's tile capped at its share;
5. the autotune table its tuned tiles draw from."""
from __future__ import annotations

import math
from collections import Counter
from dataclasses import replace

import torch

from ..ir import Access, Call, Expr, Index, Reduce, constant, outer_reductions, walk
from ..schedule import KernelSchedule, Schedule
from ..schedule.chunks import CHUNK_ALIGN, Chunking
from ..schedule.bounds import Prefix, assume_relation, data_tests, index_bounds, prefix_of, tile_tests
from ..schedule.folds import contraction_names, contractions, dot_batch_names, free, restrict
from ..schedule.tiles import (LAUNCH, MATMUL, MATMUL_PROGRAMS_PER_SM, PAIRED, SCAN_CHUNK_TILES, SPLIT_FLOOR,
                              TF32X3_DEPTH_MAX, TF32X3_DEPTH_MIN,
                              SPLIT_MAX, STREAMED, STREAMED_DEPTH,
                              TUNE_SPLIT_WORK,
                              auto_split, fold_caps, free_tile,
                              grid_tiling, held_whole, held_whole_in_epilogue, loop_tile, nested_steps, np2,
                              one_at_a_time, scan_tile, size_class, sorted_tile, split_tile, uniform_work, whole_tile)
from . import forms
from .ir import (ONE_AT_A_TIME, RANGED, TILED, WHOLE, Candidate, ConcreteKernel, ConcreteSchedule, FoldLoops,
                 Signature, SortedLoop, Tile)


def specialise(schedule: Schedule, signature: Signature) -> ConcreteSchedule:
    """The concrete schedule of `schedule` for a call of this signature (the
    materialised schedule where these extents call for it: Schedule.for_extents)."""
    extents = dict(signature.extents)
    chosen = schedule.for_extents(lambda index: extents[index])
    fresh = dict(chosen.fresh_names)

    def extent(name: str) -> int:
        while name not in extents and name in fresh:
            name = fresh[name]
        return extents[name]
    dtypes = storage(chosen, signature)
    readers = Counter(t for k in chosen.kernels for t in {n.tensor for st in k.statements for n in walk(st.expr)
                                                          if isinstance(n, Access)})
    shared = frozenset(t for t, count in readers.items() if count > 1)
    run = chosen.chunking

    def specialised(run) -> list[ConcreteKernel]:
        def chunk_extent(name: str) -> int:
            # the kernels of a chunked run are specialised to a full chunk (the last one is
            # shorter: whole tiles of the full chunk's sizes mask it)
            return run.size if name in run.names else extent(name)
        # the tensors each kernel may read: the inputs, and what it and earlier kernels store
        kernels, known = [], {name for name, *_ in signature.inputs}
        for position, k in enumerate(chosen.kernels):
            known |= {st.name for st in k.statements}
            chunked = run is not None and run.first <= position <= run.last
            kernels.append(_Kernel(k, chosen.split, signature, chunk_extent if chunked else extent, chunked)
                           .specialised(frozenset(known), shared, dtypes))
        return kernels
    kernels = specialised(run)
    if run is not None and signature.sm_count:
        size, why = chunk_length(run, kernels[run.first:run.last + 1], extent, signature.sm_count)
        if size != run.size:
            run = replace(run, size=size, sized=why)
            chosen = replace(chosen, chunking=run)
            kernels = specialised(run)
    return ConcreteSchedule(chosen, signature, tuple(kernels), tuple(dtypes.items()))


def chunk_length(run: Chunking, kernels: list[ConcreteKernel], extent, sm_count: int) -> tuple[int, str]:
    """The chunk length (a multiple of CHUNK_ALIGN up to the budget's longest) whose run
    takes the fewest waves of tile steps on `sm_count` SMs, the longest of those (fewest
    chunks' sums to add), and why.  Each kernel of the run (`kernels`, specialised to the
    schedule's chunk) costs, per chunk, its waves of programs (ceil(programs / SMs)) times
    the steps each program takes, at the tiles its first candidate takes: a weight
    gradient dW[v, d] = sum[t](dZ[t, v] * H[t, d]) over chunks of 3072 of v is 144
    programs of 128 x 128, two waves of which the second has 12, where 2816 is one wave
    (H200: 0.103 against 0.055 ms a chunk; the chunks' sum of dH and the logits' gradient
    take as long per value of v at either length)."""
    def cost(size: int) -> int:
        full, rest = divmod(run.extent, size)
        return sum(count * sum(math.ceil(programs / sm_count) * steps for programs, steps in
                               (_work(k, length if length else size, run, extent) for k in kernels))
                   for count, length in ((full, size), (1 if rest else 0, rest)))
    sizes = range(CHUNK_ALIGN, run.longest + 1, CHUNK_ALIGN)
    best = min(sizes, key=lambda size: (cost(size), -size))
    return best, (f"{best} fills {sm_count} SMs best ({cost(best)} waves of tile steps against "
                  f"{cost(run.size)} at {run.size})" if best != run.size else "")


def _work(kernel: ConcreteKernel, length: int, run: Chunking, extent) -> tuple[int, int]:
    """(programs, tile steps each) of a chunked run's kernel over a chunk of `length`,
    at its first candidate's tiles (its own where it has none)."""
    nominal = dict(kernel.candidates[0].tiles) if kernel.candidates else {}

    def count(t: Tile) -> int:
        n = length if t.index in run.names else extent(t.index)
        if t.how == WHOLE:
            return 1
        if t.how == ONE_AT_A_TIME:
            return n
        return math.ceil(n / nominal.get(t.index, t.size))
    programs = math.prod(count(t) for t in kernel.grid) * kernel.split
    steps = math.prod(count(t) for f in kernel.folds for t in f.tiles)
    return programs, max(1, steps // kernel.split)


def dot_dtype(fold: Reduce, inputs: dict[str, torch.dtype], sig: Signature):
    """The operand dtype of a contraction `fold`'s tl.dot: the promoted dtype of the
    program inputs it reads (a bfloat16 Q K^T stays bfloat16 beside a float32 slope
    outside it), else the results' (none in float64)."""
    stored = [inputs[n.tensor] for a in fold.args for n in walk(a)
              if isinstance(n, Access) and inputs.get(n.tensor) is not None]
    dtype = stored[0] if stored else (None if sig.dtype == torch.float64 else sig.dtype)
    for other in stored[1:]:
        dtype = torch.promote_types(dtype, other)
    return dtype


def storage(schedule: Schedule, sig: Signature) -> dict[str, torch.dtype]:
    """Every tensor's dtype in memory: an input's own; a statement's by its type (float
    results in the signature's dtype); an intermediate buffer in the float type kernels
    compute in, except that a buffer only contractions read (Schedule.operand_buffers)
    is stored as their tl.dot reads it, where all of them read float16 or bfloat16 (the
    same products, half the bytes: the logits' gradient of a linear cross-entropy,
    beside its float32 row statistics)."""
    out = {name: dtype for name, kind, _, dtype in sig.inputs if kind == "tensor"}
    inputs = dict(out)
    computed = torch.float64 if sig.dtype == torch.float64 else torch.float32
    read_by: dict[str, set] = {}
    for k in schedule.kernels:
        for st in k.statements:
            for n in walk(st.expr):
                if isinstance(n, Reduce):
                    for b in {a.tensor for arg in n.args for a in walk(arg) if isinstance(a, Access)}:
                        read_by.setdefault(b, set()).add(dot_dtype(n, inputs, sig))

    def operand_dtype(name: str):
        dtypes = read_by.get(name, set())
        low = len(dtypes) == 1 and next(iter(dtypes)) in (torch.float16, torch.bfloat16)
        return next(iter(dtypes)) if low and name in schedule.operand_buffers else computed
    for k in schedule.kernels:
        for st in k.statements:
            if st.name in k.buffers:
                out[st.name] = operand_dtype(st.name)
            elif schedule.chunking is not None and st.name in schedule.chunking.accumulated:
                out[st.name] = computed     # the chunks add their sums to it, in float32
            else:
                out[st.name] = {"float": sig.dtype, "int": torch.int64, "bool": torch.bool}[st.dtype]
    return out


class _Kernel:
    """One kernel's decisions, made in the stage's order."""

    def __init__(self, spec: KernelSchedule, requested: int | None, sig: Signature, extent, chunked: bool = False):
        self.spec, self.requested, self.sig, self.extent = spec, requested, sig, extent
        self.chunked = chunked          # run once per chunk of an index (schedule/chunks.py): in tl
        self.split_work = 0             # the program folds' work at the shape classes (split)
        self.dot = set(spec.dot_indices)
        self.inputs = {name: dtype for name, kind, _, dtype in sig.inputs if kind == "tensor"}
        self.scan: tuple[str, bool] | None = None     # (the grid index run in order, last tile first)
        self.grid_scope = {g: ("grid", False) for g in spec.grid}

    def specialised(self, known: frozenset, shared: frozenset, dtypes: dict) -> ConcreteKernel:
        spec = self.spec
        grid_scope = self.grid_scope
        # a chunked run's kernel sees views of its tensors: the launcher's sort would be of the
        # whole, and a scan of a chunk would start from nothing
        prefixes = [] if self.chunked else [(f, p) for f in self.all_folds() for p in [self.prefix_loop(f, grid_scope)]
                                             if p]
        self.scan = (prefixes[0][1].over, prefixes[0][1].reverse) if prefixes else None
        ordered = [] if self.chunked or self.scan else [
            o for f in spec.program_folds for o in [self.sorted_fold(f, grid_scope)] if o]
        scanned = None
        if self.scan:
            # a scan nested in a fold over n holds a state per value of n beside the tile (held whole)
            width = max(math.prod(np2(self.extent(i)) for i in free(f) - set(spec.grid)) for f, _ in prefixes)
            scanned = (self.scan[0], scan_tile(self.extent(self.scan[0]), width), width)
        tiling = grid_tiling(spec, self.extent, (ordered[0].by, self.sorted_tile(ordered[0])) if ordered else None,
                             scanned)
        blocks = dict(tiling.blocks)
        lacking = {g for g in spec.grid if any(g not in st.indices for st in spec.statements)}
        for g in lacking:
            if self.extent(g) == 0:
                blocks[g] = max(blocks.get(g, 0), 1)    # masked, so that its one tile reads nothing
        self.loop_cap = tiling.loop_cap
        # the split is decided on the kernel as it would run whole (at the split asked for, if any)
        hint = self.requested if self.requested and spec.program_folds and not spec.dependent else 1
        split, why = self.split(blocks, hint)
        # a split kernel's tiles are tuned too: its programs find their chunk of the loop from the
        # tile (chunk_<v> in the kernel), and its loop tile is capped so that every split has one
        whole = split == 1
        self.split_caps: dict[str, int] = {}
        grid = tuple(Tile(g, TILED, scanned[1], why="in order: the scan's tile") if scanned and g == scanned[0]
                     else self.grid_tile(g, blocks.get(g, 0), g in tiling.whole) for g in spec.grid)
        if self.scan is None and not self.chunked:
            self.scan = self.epilogue_scan()
        epilogue = tuple(self.epilogue_tile(e) for e in spec.epilogue)
        self.epilogue_sizes = {t.index: t.size for t in epilogue}
        # the grid's and the epilogue's whole tiles, which a nested fold's whole tile may share
        self.held = {t.index: (where, t) for where, tiles in (("grid", grid), ("epilogue", epilogue))
                     for t in tiles if t.how == WHOLE}
        folds = self.folds(blocks, split if split > 1 else hint, whole)
        tuned_grid = [t for t in grid if t.tuned]
        table, candidates = self.tuning(tuned_grid, folds, whole) if not self.sig.interpret else ("", ())
        form, form_why = None, ""
        if whole and not self.chunked and not self.scan:    # a split kernel: its partial and merge functions, in tl
            program = next((f for f in folds if spec.program_folds and f.fold == spec.program_folds[0]), None)
            form, form_why = forms.choose(spec, program, self.sig, self.extent, set(known))
            if not any(f.summary.rescaled for f in spec.program_folds):
                form_why = ""
        return ConcreteKernel(spec, grid, self.longest_first(grid) if whole and not self.scan else None,
                              whole and len(grid) == 2 and len(tuned_grid) == 2, epilogue, folds, self.loop_cap, split,
                              why, table, candidates, form, form_why,
                              self.past_cache(grid, shared, dtypes), *(self.scan or ("", False)),
                              *self.scan_chunks(grid), scan_epilogue=bool(self.scan) and self.scan[0] in spec.epilogue,
                              dot_precision=self.dot_precision())

    def dot_precision(self) -> str:
        """How the kernel's float32 tl.dot multiplies ("" where it has none): TF32 where
        torch's float32 matmuls may use it; three TF32 products where every contraction
        is TF32X3_DEPTH_MIN to TF32X3_DEPTH_MAX deep (float32's accuracy there, and the
        faster); IEEE float32 otherwise."""
        def float32_dot(fold: Reduce) -> bool:
            # (emit.operand_dtype: Triton's interpreter multiplies bfloat16 tiles as float32, and
            # an integer matrix beside a 16-bit one joins it in float32 where it could round)
            dtype = dot_dtype(fold, self.inputs, self.sig)
            integers = any(isinstance(n, Access) and self.inputs.get(n.tensor) is not None
                           and not self.inputs[n.tensor].is_floating_point for a in fold.args for n in walk(a))
            return dtype == torch.float32 or (dtype == torch.bfloat16 and self.sig.interpret) or (
                dtype in (torch.float16, torch.bfloat16) and integers)
        if not any(set(f.indices) & self.dot and float32_dot(f) for f in self.all_folds()):
            return ""
        if self.sig.tf32:
            return "tf32"
        depths = [math.prod(self.extent(i) for i in c.reduced) for st in self.spec.statements
                  for c in contractions(st.expr)]
        shallow = depths and all(TF32X3_DEPTH_MIN <= d <= TF32X3_DEPTH_MAX for d in depths)
        return "tf32x3" if shallow else "ieee"

    def past_cache(self, grid: tuple[Tile, ...], shared: frozenset, dtypes: dict):
        """The reads of a kernel that folds without tl.dot (a memory-bound reduction)
        whose elements no other program of the module reads: the access varies along
        every grid index of more than one program, and no other kernel reads the
        tensor.  Only there: with the same hints, elementwise kernels ran 0.98x-0.99x,
        and decode's K and V 0.95x-0.97x at L >= 64k (H100, scripts/compare_revisions.py)."""
        spec = self.spec
        if self.dot or not any(isinstance(n, Reduce) for st in spec.statements for n in walk(st.expr)):
            return ()
        several = {t.index for t in grid if t.tuned or self.extent(t.index) > max(t.size, 1)}
        l2 = self.sig.l2_bytes
        out = {}
        for n in (n for st in spec.statements for n in walk(st.expr)):
            if isinstance(n, Access) and n.tensor in dtypes and n.tensor not in shared and several <= set(n.indices):
                size = math.prod(self.extent(i) for i in n.indices) * dtypes[n.tensor].itemsize
                out[n.tensor, n.indices] = l2 is not None and size > l2
        return tuple((t, ix, big) for (t, ix), big in out.items())

    # ------------------------------------------------------------ 1. the grid
    def grid_tile(self, g: str, block: int, whole: bool) -> Tile:
        if not block:
            return Tile(g, ONE_AT_A_TIME, 0)
        if whole:
            return Tile(g, WHOLE, block, why="a field does not vary over it")
        return Tile(g, TILED, block, tuned=g in self.dot,
                    why="tl.dot" if g in self.dot else "values" if g in self.spec.value_only else "elementwise")

    def longest_first(self, grid: tuple[Tile, ...]) -> str | None:
        """A tiled grid index that bounds a program fold's loop from above (m <= i):
        the higher its tile, the longer that program runs, so those start first and
        the short ones fill the tail."""
        tiled = {t.index for t in grid if not t.scalar}
        for fold in self.spec.program_folds:
            for relations in index_bounds(fold).values():
                for b in relations:
                    if b.upper and b.sign > 0 and b.other in tiled:
                        return b.other
        return None

    # ------------------------------------------------------------ 2. the epilogue
    def epilogue_tile(self, e: str) -> Tile:
        n, dot = self.extent(e), e in self.dot
        if held_whole_in_epilogue(self.spec, e, self.extent):
            return Tile(e, WHOLE, whole_tile(n, dot), why="a tile would recompute the folds nested in its fold")
        block = free_tile(n, dot, e in self.spec.value_only)
        return Tile(e, TILED, block or loop_tile(n, dot, self.loop_cap))

    # ------------------------------------------------------------ 3. the folds
    def folds(self, blocks: dict[str, int], split: int, whole: bool) -> tuple[FoldLoops, ...]:
        """Every fold the kernel evaluates, in the order it meets them: the program
        folds, then each statement's folds (at the grid, or inside the epilogue loop),
        each followed by the folds nested in its arguments."""
        spec = self.spec
        out: dict[tuple[Reduce, bool], FoldLoops] = {}
        # scope: each index the kernel has at a point -> (where it lives, whether one value at a time)
        grid = {g: ("grid", not blocks.get(g)) for g in spec.grid}
        epilogue = {**grid, **{e: ("epilogue", False) for e in spec.epilogue}}
        for f in spec.program_folds:
            self.visit(f, grid, split, whole, out)
        for st in spec.statements:
            self.visit(st.expr, grid if set(st.indices) <= set(spec.grid) else epilogue, split, whole, out)
        return tuple(out.values())

    def visit(self, e, scope: dict[str, tuple[str, bool]], split: int, whole: bool, out: dict) -> None:
        for R in outer_reductions((e,)):
            fold = R.fold
            if R.result is not None and not free(fold) <= set(scope):
                # the projected field varies over fewer indices than the fold: where the
                # others do not exist, only the fields that do not vary over them are folded
                narrowed = restrict(fold, frozenset(scope))
                if narrowed is not None and R.result in narrowed.summary.field_names:
                    fold = narrowed
            if not free(fold) <= set(scope):
                continue        # the emitter reports the index this kernel does not loop over
            nested = any(scope[i][0] == "loop" for i in free(fold))
            loops = out.get((fold, nested))
            if loops is None:
                loops = out[fold, nested] = self.fold_loops(fold, nested, split, whole, scope)
            if loops.prefix is not None:
                # the elements are evaluated where the scan's tile is: at the grid's indices
                for a in loops.prefix.element:
                    self.visit(a, scope, split, whole, out)
                continue
            inner = {**scope, **{t.index: ("whole" if t.how == WHOLE else "loop", t.scalar) for t in loops.tiles}}
            for a in fold.args:
                self.visit(a, inner, split, whole, out)

    def fold_loops(self, fold: Reduce, nested: bool, split: int, whole: bool, scope) -> FoldLoops:
        """The loops of `fold`; `whole`: the kernel is not split (a split program's loop
        runs its chunk of the tiles, with no unmasked interior band)."""
        s = fold.summary
        if self.scan is not None and not nested:
            prefix = self.prefix_loop(fold, scope)
            if prefix is not None and (prefix.over, prefix.reverse) == self.scan:
                return FoldLoops(fold, nested, (), prefix=prefix)
        carried = self.scanned_inside(fold)
        singles = one_at_a_time(fold, self.dot, self.extent)
        batch = _batch_indices(fold)
        exact = self.sig.sums_in_order(dot_dtype(fold, self.inputs, self.sig))
        caps = self.caps(fold, scope)
        tiles = []
        for p, b in enumerate(fold.indices):
            n, dot = self.extent(b), b in self.dot
            if not s.commutative and b in singles:
                tiles.append(Tile(b, ONE_AT_A_TIME, 1, why="in order"))
            elif b in batch:
                tiles.append(Tile(b, ONE_AT_A_TIME, 0, why="a contraction's batch index"))
            elif b in singles:
                tiles.append(Tile(b, ONE_AT_A_TIME, 0, why="beside a tl.dot over another index"))
            elif nested and held_whole(n, dot and exact):
                tiles.append(Tile(b, WHOLE, whole_tile(n, dot)))
            elif b in carried:
                tiles.append(Tile(b, WHOLE, whole_tile(n, dot), why="the scan inside carries a state per value"))
            else:
                block = self.loop_block(fold, p, split, caps)
                divided = self.split_here(fold, p, split)
                if divided:
                    self.split_caps[b] = split_tile(n, dot, split, n)
                why = ("tl.dot" if dot else "streamed") + (f", sized for {split} splits" if divided else "")
                tiles.append(Tile(b, TILED, block, tuned=dot and b in contraction_names(fold), why=why))
        chunked = next((b for p, b in enumerate(fold.indices) if self.split_here(fold, p, split)), "")
        return self.bands(FoldLoops(fold, nested, tuple(tiles), shared=self.shared(tiles), chunked=chunked),
                          whole, scope)

    def shared(self, tiles: list[Tile]) -> tuple[tuple[str, str], ...]:
        """The indices a nested fold holds whole in the tile the grid or the epilogue holds
        them whole in: an index has one extent wherever it is bound, so the two tiles hold
        the same values and are one axis (dK's Q[i, k], read by the sum over i and by the
        scores' sum over k: one load, read in either layout)."""
        out = []
        for t in tiles:
            where, held = self.held.get(t.index, (None, None))
            if t.how == WHOLE and held is not None and held.size == t.size:
                out.append((t.index, where))
        return tuple(out)

    def bands(self, loops: FoldLoops, whole: bool, scope) -> FoldLoops:
        """The loops' bounds from index predicates, the tiles a predicate on data skips,
        and, for a single loop, the band of tiles where the bounds hold everywhere (run
        without the mask: `interior`) and the comparisons on data whose live span a
        scan finds before the loop (`span`)."""
        fold = loops.fold
        streamed = [t for t in loops.tiles if t.how != WHOLE]
        relations = index_bounds(fold)
        tests = tile_tests(fold)
        bounds = tuple((t.index, relations[t.index]) for t in streamed if t.index in relations)
        skips = tuple((t.index, tests[t.index]) for t in streamed if not t.scalar and t.index in tests)
        interior, span = (), ()
        if len(streamed) == 1 and not streamed[0].scalar:
            (t,) = streamed
            if whole:
                interior = tuple(b for b in relations.get(t.index, ()) if b.other is None or b.other in free(fold))
                assumed = fold
                for b in interior:
                    assumed = assume_relation(assumed, b)
                if free(assumed) != free(fold):
                    # without its mask the element reads fewer indices than the state varies over
                    # (a suffix sum at fewer positions than it sums: its state is per position,
                    # its element not): every tile evaluates the mask
                    interior = ()
            one_value = {i for i in free(fold) if scope[i][1]}

            def scannable(x) -> bool:
                # each side varies over the loop's index alone or not at all within the program
                others = free(x) - {t.index}
                return others <= (one_value if t.index in free(x) else free(fold))
            span = tuple(c for c in tests.get(t.index, ()) if isinstance(c, Call) and c.op in RANGED
                         and all(map(scannable, c.args)))
        ordered = None if loops.chunked or self.chunked or self.scan else self.sorted_fold(fold, scope)
        if ordered is not None:
            # positions in sorted order: no bound, band or span of the index's own order holds there;
            # a tile of about the positions a value has, each row of the values one at a time
            tiles = tuple(Tile(t.index, TILED, self.sorted_tile(ordered), why="sorted: the positions a value has")
                          if t.index == ordered.index else Tile(t.index, ONE_AT_A_TIME, 0, why="a row of the sorted values")
                          for t in loops.tiles)
            # with one value of `by` a program, its range holds no tile a test could skip
            kept = () if scope[ordered.by][1] else tuple((i, cs) for i, cs in skips if i == ordered.index)
            return replace(loops, tiles=tiles, shared=(), bounds=(), skips=kept, sorted=ordered)
        return replace(loops, bounds=bounds, skips=skips, interior=interior, span=span)

    def all_folds(self) -> list[Reduce]:
        """Every fold of the kernel's statements, outermost first."""
        return list(dict.fromkeys(n.fold for st in self.spec.statements for n in walk(st.expr)
                                  if isinstance(n, Reduce)))

    def scanned_inside(self, fold: Reduce) -> set[str]:
        """The indices of `fold` that a prefix fold of the kernel's scan nested in its
        arguments varies over, where each can be held whole (a selective scan's state
        index n under Y[t] = sum[n](C[n, t] * H[n, t])): the scan's carried state holds
        one value per element of their tile, so each is one tile, not a loop."""
        if self.scan is None:
            return set()
        out: set[str] = set()
        for n in (n for a in fold.args for n in walk(a) if isinstance(n, Reduce)):
            p = self.prefix_loop(n.fold, self.grid_scope)
            if p is not None and (p.over, p.reverse) == self.scan:
                out |= free(n.fold) & set(fold.indices)
        return {b for b in out if held_whole(self.extent(b), False)}

    def scan_chunks(self, grid: tuple[Tile, ...]) -> tuple[int, str]:
        """(chunks of the scanned index across programs, why): where a scan's rows make
        fewer programs than the GPU has SMs, the index is cut into chunks of at least
        SCAN_CHUNK_TILES tiles, enough for two programs an SM (up to SPLIT_MAX); `split=N`
        asks for N.  16 rows of a 262144-long cumsum ran 16 programs, 256 tiles each, at
        0.15x torch.compile (H200)."""
        if not self.scan or self.scan[0] not in self.spec.grid:
            return 1, ""            # an epilogue's scan runs after its program's folds: in one program
        t = next(g for g in grid if g.index == self.scan[0])
        tiles = math.ceil(self.extent(t.index) / t.size)
        if self.requested:
            n = max(1, min(self.requested, tiles))
            return n, f"{self.requested} asked for" + (f", capped at its {tiles} tiles" if n < self.requested else "")
        if not self.sig.sm_count:
            return 1, ""
        rows = math.prod(1 if g.how == WHOLE else self.extent(g.index) if g.scalar else
                         math.ceil(self.extent(g.index) / g.size) for g in grid if g.index != t.index)
        n = min(SPLIT_MAX, math.ceil(2 * self.sig.sm_count / max(rows, 1)), tiles // SCAN_CHUNK_TILES)
        if rows >= self.sig.sm_count or n < 2:
            return 1, ""
        return n, f"{rows} programs of rows for {self.sig.sm_count} SMs and {tiles} tiles"

    def epilogue_scan(self) -> tuple[str, bool] | None:
        """(the epilogue's index, a suffix) where the epilogue loops over one index t and a
        fold of a statement there is a prefix along it: the epilogue's loop runs t's
        tiles in order in each program already, after the program folds (a CDF's
        `sum[s](where(s <= t, P[b, s], 0)) / sum[s](P[b, s])`: the row's total first)."""
        if len(self.spec.epilogue) != 1:
            return None
        (t,) = self.spec.epilogue
        scope = {**self.grid_scope, t: ("epilogue", False)}
        found = next((p for f in self.all_folds() for p in [self.prefix_loop(f, scope)] if p and p.over == t), None)
        return (t, found.reverse) if found else None

    def prefix_loop(self, fold: Reduce, scope) -> Prefix | None:
        """The prefix `fold` is (schedule.bounds.prefix_of) where the index it runs
        along is a grid index of the kernel or the epilogue's, and its elements stay
        inside s's extent: the last t's element, at s = t + offset, is at most the last
        s (a read at s = t is of a dimension of s's extent), and for a suffix it is the
        last s, which every suffix holds."""
        p = prefix_of(fold)
        if p is None or scope.get(p.over, ("",))[0] not in ("grid", "epilogue"):
            return None
        last = self.extent(p.over) + p.offset
        return p if last == self.extent(p.index) or last < self.extent(p.index) and not p.reverse else None

    def sorted_tile(self, ordered: SortedLoop) -> int:
        return sorted_tile(self.extent(ordered.index), self.extent(ordered.by))

    def sorted_fold(self, fold: Reduce, scope) -> SortedLoop | None:
        """The sorted loop of `fold` where one of its data tests is an equality
        `T[..., index] + offset == by`: T an integer input read at the fold's indices in
        order, `index` the last, `by` an index of the grid."""
        return next(filter(None, (self.sorted_loop(c, fold.indices, scope)
                                  for c in data_tests(fold).get(fold.indices[-1], ()))), None)

    def sorted_loop(self, c: Expr, indices: tuple[str, ...], scope) -> SortedLoop | None:
        if not (isinstance(c, Call) and c.op == "eq"):
            return None
        for data, other in (c.args, c.args[::-1]):
            offset = 0
            if isinstance(data, Call) and data.op in ("add", "sub"):
                k = constant(data.args[1])
                if k is None or k != int(k):
                    continue
                offset, data = (int(k) if data.op == "add" else -int(k)), data.args[0]
            dtype = self.inputs.get(data.tensor) if isinstance(data, Access) else None
            if (isinstance(other, Index) and dtype is not None and not dtype.is_floating_point
                    and dtype != torch.bool and data.layout is None and data.indices == indices
                    and scope.get(other.name, ("",))[0] == "grid"):
                return SortedLoop(indices[-1], data.tensor, other.name, offset, c, indices[:-1])
        return None

    def caps(self, fold: Reduce, scope: dict | None = None) -> list[int]:
        """The caps of `fold`'s streamed tiles; inside the epilogue loop (`scope`), within
        the streamed budget shared with the epilogue's tiles its body spans: a column sum
        over m in a loop over k tiles [m, k] (a gradient's sum[m](where(m == A[i], g, 0)
        * (X[i,k] - Y[m,k])) took m/4096 beside k/128, a tile of 512k elements)."""
        width = math.prod(self.epilogue_sizes[i] for i in free(fold)
                          if scope is not None and scope.get(i, ("",))[0] == "epilogue")
        return fold_caps(fold, self.extent, self.dot, max(1, self.loop_cap // width))

    def split_here(self, fold: Reduce, p: int, split: int) -> bool:
        return split > 1 and p == self.split_position(fold) and fold in self.spec.program_folds

    def split_position(self, fold: Reduce) -> int:
        """Which of `fold`'s indices a split divides among its programs: the first, in
        order; a fold whose order does not matter, its longest (a weight's gradient
        summed over [b0, b1] rows, 8 x 1024: b1's tiles, where b0's 8 gave 2 splits of
        12 programs on 132 SMs, 0.5 ms for 50 MB)."""
        if not fold.summary.commutative:
            return 0
        batch = _batch_indices(fold)
        lengths = [0 if b in batch else self.extent(b) for b in fold.indices]
        return lengths.index(max(lengths))

    def loop_block(self, fold: Reduce, p: int, split: int, caps: list[int]) -> int:
        """The loop tile of `fold`'s p-th index: its share of the streamed budget beside
        the tiles its nested folds hold (tiles.fold_caps); a split program fold's,
        small enough for `split` tiles."""
        b = fold.indices[p]
        block = loop_tile(self.extent(b), b in self.dot, caps[p])
        return split_tile(self.extent(b), b in self.dot, split, block) if self.split_here(fold, p, split) else block

    # ------------------------------------------------------------ 4. the split
    def split(self, blocks: dict[str, int], hint: int) -> tuple[int, str]:
        spec = self.spec
        if self.scan:
            return 1, ""            # a split asked for cuts the scanned index instead (scan_chunks)
        if not spec.program_folds:
            return 1, "" if self.requested in (None, 1) else "no fold streams per program; nothing to split"
        if spec.dependent:
            return 1, "" if self.requested in (None, 1) else "its program folds read each other; not split"
        # the work counted at each extent's shape class: one split serves the class
        programs, tiles, steps, divisions = self.work(blocks, hint, lambda index: size_class(self.extent(index)))
        self.split_work = programs * tiles * steps
        if self.requested is None:
            matrix = len(spec.grid) == 2 and set(spec.grid) <= self.dot
            n = auto_split(programs, tiles, self.sig.sm_count, steps, divisions,
                           MATMUL_PROGRAMS_PER_SM if matrix else 2)
            why = (f"{programs} programs for {self.sig.sm_count} SMs and {tiles} tiles to stream"
                   + (f" of {steps} nested steps each" if steps > 1 else "")) if n > 1 else ""
            return n, why
        _, tiles, _, _ = self.work(blocks, hint, self.extent)
        n = max(1, min(self.requested, tiles))
        return n, f"split={self.requested} requested" + (f" (capped at {tiles} tiles)" if n < self.requested else "")

    def work(self, blocks: dict[str, int], hint: int, extent) -> tuple[int, int, int, int]:
        """(programs, tiles of the longest program fold's divided index, steps a tile of the
        rest of the fold's and of the folds nested in it, how many chunks that index may
        take: where a tile without tl.dot may shrink to SPLIT_FLOOR values) at `extent`."""
        spec = self.spec
        programs = math.prod(extent(g) if not blocks.get(g) else math.ceil(extent(g) / blocks[g])
                             for g in spec.grid)
        tiles, steps, divisions = 0, 1, 0
        for f in spec.program_folds:
            p = self.split_position(f)
            divided = f.indices[p]
            singles, caps = one_at_a_time(f, self.dot, extent), self.caps(f)
            blocks_of = [1 if b in singles else self.loop_block(f, q, hint, caps) for q, b in enumerate(f.indices)]
            tiles = max(tiles, math.ceil(extent(divided) / blocks_of[p]))
            floor = blocks_of[p] if divided in self.dot else min(blocks_of[p], SPLIT_FLOOR)
            divisions = max(divisions, math.ceil(extent(divided) / floor))
            # each tile of the divided index comes with every tile of the fold's other indices
            beside = math.prod(math.ceil(extent(b) / block) for q, (b, block) in enumerate(zip(f.indices, blocks_of))
                               if q != p)
            steps = max(steps, beside * nested_steps(f, extent, self.dot))
        return programs, tiles, steps, divisions

    # ------------------------------------------------------------ 5. tuning
    def tuning(self, grid: list[Tile], folds: tuple[FoldLoops, ...], whole: bool
               ) -> tuple[str, tuple[Candidate, ...]]:
        """The autotune table of the kernel's tuned tiles and its candidates, each tile
        clamped to its index's extent (next power of two, at least 16) and a split loop's
        to its share of the split: one tuned grid tile beside one tuned loop tile (a fold
        streamed against a matrix product) takes STREAMED, and PAIRED where every program
        does the same work; beside a loop tile and the loop tile of a contraction nested in
        it (the matrix product's depth streamed too) STREAMED_DEPTH; two grid tiles and a
        loop tile (a matrix product) MATMUL; any other kernel keeps its tiles and tries
        LAUNCH's warps and stages.  A split kernel (`whole` false) of less work than
        TUNE_SPLIT_WORK, or with no tile to tune, launches as decided."""
        loops = [t for f in folds for t in f.tiles if t.tuned]
        if not whole and self.split_work < TUNE_SPLIT_WORK:
            return "", ()

        def tiles(*sizes: int) -> tuple[tuple[str, int], ...]:
            return tuple((t.index, min(size, max(16, np2(self.extent(t.index))), self.split_caps.get(t.index, size)))
                         for t, size in zip(grid + loops, sizes))
        if len(grid) == 1 and len(loops) == 1:
            out = [Candidate(tiles(rows, keys), warps, stages) for rows, keys, warps, stages in STREAMED]
            if uniform_work(self.spec):
                rows, keys, warps, stages, registers = PAIRED
                out.append(Candidate(tiles(rows, keys), warps, stages, registers))
            table = f"streamed tilings of {grid[0].index} x {loops[0].index}"
        elif len(grid) == 1 and len(loops) == 2 and self.nested_depth(folds, loops):
            out = [Candidate(tiles(rows, keys, depth), warps, stages)
                   for rows, keys, depth, warps, stages in STREAMED_DEPTH]
            table = f"streamed tilings of {grid[0].index} x {loops[0].index} over a depth {loops[1].index}"
        elif len(grid) == 2 and len(loops) == 1:
            out = [Candidate(tiles(rows, cols, depth), warps, stages) for rows, cols, depth, warps, stages in MATMUL]
            table = f"matrix-product tilings of {grid[0].index} x {grid[1].index} x {loops[0].index}"
        elif not whole:
            return "", ()
        else:
            out = [Candidate((), warps, stages) for warps, stages in LAUNCH]
            table = "launch configurations, tiles as decided"
        return table, tuple(dict.fromkeys(out))

    @staticmethod
    def nested_depth(folds: tuple[FoldLoops, ...], loops: list[Tile]) -> bool:
        """Whether the second tuned loop tile is a fold's nested in the first's fold: the
        depth of the matrix product whose tiles the outer fold streams."""
        outer = next(f for f in folds if loops[0] in f.tiles)
        inner = next(f for f in folds if loops[1] in f.tiles)
        return inner.nested and any(n == inner.fold for a in outer.fold.args for n in walk(a))


def _batch_indices(fold: Reduce) -> set[str]:
    """The batch indices of the contractions in `fold`'s arguments."""
    return set().union(*(dot_batch_names(a) for a in fold.args))
