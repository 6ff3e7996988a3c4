"""The tile and split policy of the schedule stage: tiles as symbols with their
candidate sets, and when a kernel's program folds split over several programs.

A kernel's tiles follow from the roles its folds give its indices (KernelSchedule:
tl.dot indices, batch indices, value indices); their sizes depend on the extents,
so the schedule states each tile's rule and candidate set and a backend
evaluates them for a call's signature (compiler.backend.triton: the emitter sizes
its axes with these functions, the autotuner tries these tables).  Every size is
a power of two, at least 16 for an index that takes part in tl.dot, and at most
the next power of two of its extent.
"""
from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

from ..algebra.properties import additive, extremum
from ..algebra.summary import independent_fields
from ..ir import Access, Reduce, free_indices, nodes, outer_reductions
from .folds import contractions

DOT_BLOCK = 64        # the untuned tile of an index that takes part in tl.dot
WHOLE_MAX = 256       # a value or contraction index up to this (padded) size is held whole
EXACT_DOT_WHOLE_MAX = 64  # ... but a float32 contraction without TF32 only up to this: tl.dot sums its
                          # products in order, so longer ones stream tiles summed with compensation
# A float32 contraction (without TF32) of a depth in [TF32X3_DEPTH_MIN, TF32X3_DEPTH_MAX] multiplies as
# three TF32 products.  Each product then rounds at about 2^-21 where IEEE's does at 2^-24, which the
# float32 accumulation's own error (sqrt(depth) * 2^-24, typically) matches from depth 64; on the H200
# it ran 2.3x-3.3x IEEE tl.dot's speed at depths 64-1024 (1.1x-1.45x cuBLAS's float32), and IEEE was
# the faster at 4096 (docs/performance.md)
TF32X3_DEPTH_MIN = 64
TF32X3_DEPTH_MAX = 1024
ROW_BLOCK = 1024      # tile of an elementwise grid index
STREAM_BLOCK = 8192   # tile of a streamed index without tl.dot: a row of up to 8192 in one tile, so
                      # that an epilogue re-reading it finds it in cache
TILE_BUDGET = 4096    # elements of a two-dimensional non-dot tile
SCAN_BLOCK = 1024     # the longest tile a scan runs its index through in order (tl.associative_scan)
SCAN_CHUNK_TILES = 4  # the fewest tiles a chunk of a scan across programs takes
COLUMN_BLOCK = 64     # grid tile of an index contiguous in memory under a streamed row index
COLUMN_TILE = 16384   # elements of a column sum's tile: COLUMN_BLOCK columns by 256 rows a step (H200,
                      # bf16 column mean and variance, 262144 x 256: 0.175 ms at 4096 elements, 0.112 at
                      # 8192, 0.072 at 16384, torch.compile 0.091; 65536 x 4096: 0.596, 0.302, 0.239, 0.259)

# Autotuned tilings, by the shape of a kernel's tl.dot tiles (not by what it computes):
# (rows, keys, warps, stages) for one tuned grid tile x one tuned loop tile (a fold
# streamed against a matrix product: attention-like).  Each candidate costs a first
# call a compile and a timing: the first four were the fastest in every case of a
# survey on the H100 (scripts/tuning_survey.py, 15 cases: attention and causal at d 64
# and 128, S 1k and 4k, the FlexAttention variants, grouped queries; bf16; wins 4, 9, 1,
# 1), and the three dropped never were (at best 0.4%, 2.6% and 2.7% behind, median
# 12-43%).  (64, 32, 4, 4), never the fastest there, is the small one that fits shared
# memory where the others do not (float32 operands, wide heads, smaller GPUs).
STREAMED = [(128, 128, 8, 3), (64, 64, 4, 3), (128, 64, 8, 3), (128, 64, 8, 4), (64, 32, 4, 4)]
# Two programs on one SM: the first STREAMED tiling with its registers capped at 128 a
# thread (triton.Config's maxnreg), so that two programs of 8 warps fit the register file
# (and, where the value tile is narrow, shared memory): one program's softmax then runs
# while the other's matrix products do, which one program alone cannot overlap.  On the
# H100 at d = 64 (session 17): alone, 1.07x (S = 1k) and 1.10x-1.12x (S = 4k) over the
# autotuned choice of the other candidates (scripts/attention_probe.py); as a candidate,
# side by side (scripts/compare_revisions.py), 1.06x-1.08x at S = 1k, 1.00x at S = 4k
# (where the tuner's 25 ms timing prefers (64, 64, 4, 3) by 4%) and 1.08x-1.10x at
# S = 16k, cuDNN's 0.80x-0.84x becoming 0.93x at S = 1k; at d = 128 the capped
# registers cannot hold the accumulator and the scores (33 TFLOP/s, spilled), so it is a
# candidate only where that float32 state fits PAIRED_STATE registers a thread, and only
# for programs that all do the same work (uniform_work): causal attention at d = 64,
# whose programs' loops differ in length, ran 0.92x-0.95x at S = 16k with it.
# (rows, keys, warps, stages, registers a thread)
PAIRED = (*STREAMED[0], 128)
PAIRED_STATE = 96
# (rows, cols, depth, warps, stages) for two tuned grid tiles x one tuned loop tile (a matrix product)
MATMUL = [(128, 128, 64, 8, 3), (128, 256, 64, 8, 3), (256, 128, 64, 8, 3), (128, 128, 64, 4, 4),
          (128, 128, 32, 4, 4), (64, 128, 64, 4, 4), (128, 64, 64, 4, 4), (64, 64, 64, 4, 4)]
# (rows, keys, depth, warps, stages) for one tuned grid tile x one tuned loop tile whose matrix
# product streams its depth too (a loop nested in the first): a logsumexp over the vocabulary of
# sum[d](H[t, d] * W[v, d]) at d = 768, the tiles of a matrix product with a running state beside
# it.  The last is the tiling such a kernel had before it was tuned (every tile tl.dot's 64).
STREAMED_DEPTH = [(128, 128, 64, 8, 3), (128, 128, 64, 8, 4), (128, 64, 64, 4, 3), (64, 128, 64, 4, 3),
                  (64, 64, 64, 4, 3)]
# A split kernel is tuned from this much work (programs x tiles of the split loop x nested steps
# each, at the shape classes): below it, a kernel split because it has few programs is a decode
# or a short prefill of some tens of microseconds, where a first call of each length class would
# compile and time every candidate (the first generation of a model's tokens) to gain
# microseconds; it launches at the split's tiles, as measured against cuDNN (tiles.py's splits).
# The linear cross-entropy's logsumexp over 32768 of the vocabulary at 8192 rows is 524288.
TUNE_SPLIT_WORK = 1 << 16
# (warps, stages) when no tile is tuned
LAUNCH = [(4, 2), (8, 2), (16, 2), (8, 3)]

# Splits (flash-decoding): a kernel whose program folds are independent splits their
# first loop over N programs per output tile when it launches fewer than 2 programs
# per SM and streams at least SPLIT_MIN_TILES tiles; each split streams SPLIT_MIN_RUN
# tiles or more (H100, decode H8 L8k, 128 tiles: 8 a split 0.82x cuDNN, 4 a split 0.96x).
SPLIT_MIN_TILES = 64
SPLIT_MIN_RUN = 4
SPLIT_FLOOR = 16        # the smallest tile a split gives a streamed loop without tl.dot (rows of a column sum)
# A kernel of at most one program for four SMs splits from two runs of SPLIT_MIN_RUN
# tiles (H200, scripts/split_probe.py, unsplit -> as split now): decode over 8 heads at L
# 1024, 2048, 3000 (16 to 47 tiles): 39.3 -> 23.6, 72.7 -> 21.4 (8 splits), 105.4 -> 21.6
# us (cuDNN 34.8-67.0, 14.9-56.9 us across runs); a prefill of 4 or 8 heads (32 programs of
# 128 rows, 16 tiles): 29.8 -> 20.1, 34.3 -> 20.9 us.  Not at 128 programs (16 heads, 2048
# keys: 68.1 us unsplit, 69.3 split 4 ways); 64 were not measured.
SPLIT_SHORT_TILES = 2 * SPLIT_MIN_RUN
SPLIT_MAX = 64
# ... or, for a kernel of fewer than 4 programs (a scalar or a few values: a mean loss, a
# dot product), up to this many splits an SM in all: one program over a 512 MB sum ran
# 0.19x torch.compile split 64 ways, 0.36x 128 ways and 0.63x 256 ways (H200; the merge of
# 256 scalar states is cheap beside it)
SPLITS_PER_SM = 2
# A GPU's tensor-core FLOPs per byte of memory traffic (H100 bf16: ~990 TFLOP/s over
# ~3.35 TB/s), and the products per element past which recomputing a nested fold per
# tile costs more than a float32 buffer's 8 bytes (recompute_costs)
FLOPS_PER_BYTE = 300
CHAIN_BREAK = 8 * FLOPS_PER_BYTE // 2
PROGRAMS_PER_SM = 8    # a streaming split needs several programs per SM to keep HBM busy
# A matrix product's kernel (two tuned tl.dot grid tiles) splits only under one program an SM
# at its smallest tiles, not two: the autotuner sizes its tiles for the SMs, and a split fixes
# them at the smallest (H200, a weight gradient dW[v, d] = sum[t](G[t, v] * H[t, d]) at v 3072,
# d 768, t 8192, 256 programs at the shape classes: split 5 ways 0.126 ms, unsplit 0.087; summed
# over (b, t) = (8, 1024): 0.148 -> 0.112; cuBLAS 0.056)
MATMUL_PROGRAMS_PER_SM = 1


def np2(n: int) -> int:
    return 1 if n <= 1 else 1 << (n - 1).bit_length()


def size_class(n: int) -> int:
    """The shape class of an extent: the power of two at or below it (0 for 0).  Work
    counts (the split) are decided at it and the autotuner keys on it, so every extent
    of a class runs one module and one tuned choice (a decode step one key longer, a
    prompt a few tokens shorter): modules are shared by their source (cache.load)."""
    return 1 << (n.bit_length() - 1) if n > 0 else 0


def dot_tile(n: int) -> int:
    return min(DOT_BLOCK, max(16, np2(n)))


def loop_tile(n: int, dot: bool, cap: int = STREAM_BLOCK) -> int:
    """A streamed loop's tile: tl.dot's, or up to STREAM_BLOCK (`cap`: less where a
    grid tile of columns shares the tile budget)."""
    return dot_tile(n) if dot else min(np2(n), STREAM_BLOCK, cap)


def shared_loop_caps(indices: list[tuple[int, bool]], cap: int = STREAM_BLOCK) -> list[int]:
    """The cap of each streamed tile of one fold over several indices ((extent, takes
    part in tl.dot) each): the tiles without tl.dot share `cap` elements, the last
    index (innermost in memory) first, so that softmax[m, n] streams tiles of at
    most `cap` elements, not [8192, 256]."""
    caps, used = [cap] * len(indices), 1
    for p in reversed(range(len(indices))):
        n, dot = indices[p]
        if not dot:
            caps[p] = max(1, cap // used)
            used *= loop_tile(n, False, caps[p])
    return caps


def nested_width(fold, extent: Callable[[str], int], dot, memo: dict | None = None) -> int:
    """The elements each element of `fold`'s streamed tile carries in the widest chain of
    folds nested in its arguments that run inside its loop (they read its indices; one
    that does not is computed once, outside the loop), each counted at the tiles it holds
    at once: an index held whole at its width, a streamed one at its loop tile.
    sum[k]((X[i,k] - Y[m,k]) ** 2) under min[m] broadcasts every tile of m over all of
    k, so a tile of m shares its budget with k's width; logsumexp[v] of a 32k-wide row
    under sum[t] streams tiles of v, so each step of t holds one such tile per row.
    Indices of a nested tl.dot are reduced inside the dot and widen nothing.  `memo`:
    each nested fold's width, found once (eight nested softmaxes share their subtrees)."""
    memo = {} if memo is None else memo
    if fold in memo:
        return memo[fold]
    widest = 1
    for e in _nested_in_loop(fold):
        inner = nested_width(e, extent, dot, memo)
        caps = _caps_within(e, extent, dot, STREAM_BLOCK, inner)
        own = math.prod(np2(extent(b)) if held_whole(extent(b), False) else loop_tile(extent(b), False, c)
                        for b, c in zip(e.indices, caps) if b not in dot)
        widest = max(widest, own * inner)
    memo[fold] = widest
    return widest


def _nested_in_loop(fold) -> list:
    """The outermost folds in `fold`'s arguments that read its indices: they run inside
    its loop (the others are hoisted out of it: a row constant in a gradient's sum)."""
    return [e for e in outer_reductions(fold.args) if set(free_indices(e)) & set(fold.indices)]


def fold_caps(fold, extent: Callable[[str], int], dot, cap: int = STREAM_BLOCK) -> list[int]:
    """The cap of each streamed tile of `fold` (shared_loop_caps), within `cap`
    elements counted with the width its nested folds hold whole (nested_width)."""
    return _caps_within(fold, extent, dot, cap, nested_width(fold, extent, dot))


def _caps_within(fold, extent: Callable[[str], int], dot, cap: int, width: int) -> list[int]:
    indices = [(extent(b), b in dot) for b in fold.indices]
    return shared_loop_caps(indices, max(1, cap // width))


def one_at_a_time(fold, dot, extent: Callable[[str], int] | None = None) -> tuple[str, ...]:
    """The indices of a fold over several indices that it streams one value at a
    time: all but the last when it keeps order (not commutative), or when an index
    takes part in a matrix product (softmax[m, n] of Q K^T times V over a 2-D key
    grid: tiles of every index at once would make the product's tile [rows, m, n, k],
    past Triton's limit, and no tl.dot; with m one value at a time each step is
    FlashAttention over a tile of n).  `dot`: the tl.dot indices.  With `extent` (a
    call's), a sum's tiled index is its tl.dot index of the largest extent,
    whichever order they are written in: a convolution's sum[c, r] over 256
    channels and a window of 3 is a product 256 deep, not 3 (16 with padding).
    Besides, an index of the fold that a contraction nested in it has for a side
    beside a longer side of the same operand (side_clash)."""
    singles: set[str] = set()
    if len(fold.indices) > 1 and (not fold.summary.commutative or set(fold.indices) & dot):
        if extent is None or not additive(fold.summary):
            singles = set(fold.indices[:-1])
        else:
            deepest = max(reversed([b for b in fold.indices if b in dot]), key=lambda b: np2(extent(b)))
            singles = set(fold.indices) - {deepest}
    nested = [c for c in contractions(fold) if set(fold.indices) <= c.bound]
    for b in [b for b in fold.indices if b not in singles]:      # in order: of two that clash, one stays tiled
        if side_clash(nested, b, extent, longer=True, among=lambda name: name not in singles):
            singles.add(b)
    return tuple(b for b in fold.indices if b in singles)


def side_clash(contractions, index: str, extent: Callable[[str], int] | None, longer: bool,
               among: Callable[[str], bool] = lambda name: True) -> bool:
    """Whether `index` is a side of one of `contractions` beside another side of the
    same operand (of those `among` admits) that is longer (`longer`), or at least as
    long: tiles of both would make that operand 3-D, which tl.dot does not take, so
    the shorter runs one value at a time (a max pool of a convolution: max[q] over
    X[b, c, 2*u + q + r] tiles the positions u, not the window q; the pooled
    convolution's weight gradient, summed over u, the same).  Without `extent`
    (the schedule's symbols) any other side clashes."""
    for c in contractions:
        if index not in c.sides:
            continue
        for f in c.factors:
            for other in (f & c.sides) - {index} if index in f else ():
                if among(other) and (extent is None or (extent(other) > extent(index) if longer
                                                        else extent(other) >= extent(index))):
                    return True
    return False


def held_whole(n: int, exact_dot: bool) -> bool:
    """Whether a nested fold's index of extent n is held whole (one tile, no loop);
    `exact_dot`: it is the reduced index of a float32 tl.dot without TF32."""
    return np2(n) <= (EXACT_DOT_WHOLE_MAX if exact_dot else WHOLE_MAX)


def whole_tile(n: int, dot: bool) -> int:
    """The tile of an index held whole (a nested fold's index, a value index)."""
    return max(16 if dot else 1, np2(n))


def split_tile(n: int, dot: bool, split: int, loop: int) -> int:
    """A program fold's loop tile when it is split `split` ways: small enough for
    `split` tiles, never above its unsplit tile `loop`."""
    return min(loop, max(16 if dot else 1, np2(-(-n // split))))


def free_tile(n: int, dot: bool, value: bool) -> int:
    """The tile of a grid or epilogue index that tl.dot or a rescaled fold's values
    read (0: sized by the elementwise budget instead)."""
    if value and np2(n) <= WHOLE_MAX:
        return max(16, np2(n))
    return dot_tile(n) if dot else 0


def streams(kernel) -> bool:
    """Whether a program of `kernel` loops: it folds, or loops over epilogue indices."""
    return bool(kernel.epilogue) or any(isinstance(n, Reduce) for st in kernel.statements for n in nodes(st.expr))


def streamed_width(kernel, extent: Callable[[str], int], cap: int = STREAM_BLOCK) -> int:
    """The largest non-dot tile a loop of `kernel` streams (it bounds the grid tiles):
    the product of a fold's streamed tiles, which share `cap` elements, or an
    epilogue index's loop tile."""
    dot = kernel.dot_indices
    widest = 1
    for s in kernel.statements:
        for n in nodes(s.expr):
            if isinstance(n, Reduce):
                indices = [(extent(b), b in dot) for b in n.indices]
                caps = fold_caps(n, extent, dot, cap)
                widest = max(widest, nested_width(n, extent, dot)
                             * math.prod(loop_tile(e, False, c) for (e, d), c in zip(indices, caps) if not d))
    for e in kernel.epilogue:
        if not free_tile(extent(e), e in dot, e in kernel.value_only):
            widest = max(widest, loop_tile(extent(e), e in dot, cap))
    return widest


def contiguous(kernel, g: str) -> bool:
    """Whether every multi-dimensional tensor `kernel` reads with `g` has it last (the
    innermost dimension of a row-major tensor) and some read has it: tiles of g are
    then contiguous in memory."""
    reads = [n for st in kernel.statements for n in nodes(st.expr)
             if isinstance(n, Access) and len(n.indices) > 1 and g in n.indices]
    return bool(reads) and all(a.indices[-1] == g for a in reads)


def tiled_grid(kernel, extent: Callable[[str], int]) -> tuple[str, ...]:
    """The grid indices `kernel` tiles (the others are one program each): up to two,
    the last first, of extent above 1 and not batch-like -- in a kernel with a
    contraction, neither read by every access nor by every operand of the contraction
    (tiling those makes every operand 3-D), nor two sides of one operand.  A kernel
    without a contraction whose indices are all batch-like tiles its last two."""
    accesses = [n for st in kernel.statements for n in nodes(st.expr) if isinstance(n, Access) and n.indices]
    batch = kernel.batch_indices | {g for g in kernel.grid if kernel.contractions and accesses
                                    and all(g in a.indices for a in accesses)}
    candidates = [g for g in kernel.grid if extent(g) > 1]
    whole = {g for g in candidates if held_whole_in_grid(kernel, g, extent)}
    tiled: list[str] = []
    grid = set(kernel.grid)
    for g in reversed([g for g in candidates if g not in batch]):
        if any(c.clashes(g, t) for c in kernel.contractions for t in tiled):
            continue
        # beside an at least as long index of a fold around a nested contraction, in one operand
        if side_clash([c for c in kernel.contractions if c.bound], g, extent, longer=False,
                      among=lambda name: name not in grid):
            continue
        if g in whole or len(set(tiled) - whole) < 2:
            tiled.insert(0, g)
    if not tiled and not kernel.contractions:
        tiled = candidates[-2:]
    return tuple(tiled)


def held_whole_in_grid(kernel, g: str, extent: Callable[[str], int]) -> bool:
    """Whether `kernel` holds its grid index g whole (one tile, not tuned): tl.dot or a
    rescaled fold's values read it, it fits WHOLE_MAX, and some field the kernel projects
    does not vary over it, so that tiles of g would each recompute that field (attention's
    r and l over the value index j; dK's sum beside dV's in one loop, over j and k).
    Such an index is a whole tile of every program, beside the (up to two) tiled ones."""
    n = extent(g)
    return bool(free_tile(n, g in kernel.dot_indices, g in kernel.value_only)) and np2(n) <= WHOLE_MAX \
        and g in lacked(kernel)


def lacked(kernel) -> frozenset:
    """The grid indices that some field `kernel` projects does not vary over."""
    return frozenset(g for g in kernel.grid for st in kernel.statements for n in nodes(st.expr)
                     if isinstance(n, Reduce) and n.result is not None and g not in free_indices(n))


def recomputed_per_grid_tile(kernel, g: str) -> bool:
    """Whether every tile of grid index g recomputes the folds nested in the kernel's
    program folds, which do not read g: a fused linear cross-entropy's dW[v, d] (and
    dH[t, d]) folds the logits sum[d](H[t, d] * W[v, d]) afresh for each tile of d."""
    return any(g not in free_indices(x) for f in kernel.program_folds for x in _nested_in_loop(f))


def held_whole_in_epilogue(kernel, e: str, extent: Callable[[str], int]) -> bool:
    """Whether `kernel` loops over its epilogue index e in one whole tile: tl.dot or a
    rescaled fold's values read it, it fits WHOLE_MAX, and a fold over e in the loop
    recomputes folds nested in it that do not read e in every tile of e (the scores and
    dO V^T of an attention backward's dQ, for every tile of the head dimension k)."""
    n = extent(e)
    return bool(free_tile(n, e in kernel.dot_indices, e in kernel.value_only)) and np2(n) <= WHOLE_MAX \
        and _recomputed_per_tile(kernel, e)


def _recomputed_per_tile(kernel, e: str) -> bool:
    """Whether a fold over epilogue index e nests folds that do not read e."""
    return any(e in free_indices(f) and any(e not in free_indices(x) for x in _nested_in_loop(f))
               for st in kernel.statements for f in outer_reductions((st.expr,)))


@dataclass(frozen=True)
class GridTiling:
    blocks: dict          # tiled grid index -> its tile
    whole: frozenset      # tiled grid indices held whole (not tuned)
    loop_cap: int         # the elements a streamed non-dot tile may hold beside the grid tiles


def sorted_tile(positions: int, values: int) -> int:
    """The loop tile of a sorted loop (specialise.ir.SortedLoop) over `positions` whose
    programs each take the positions of one of `values`: the mean count a value,
    between 16 (tl's smallest) and 256.  An embedding's rows average a fraction of a
    token: a streamed tile of 256 zeroed and reduced a 256-wide tile per row."""
    return max(16, min(256, np2(-(-positions // max(values, 1)))))


def scan_tile(n: int, width: int = 1) -> int:
    """The tile of a grid index a scan runs through in order (schedule.bounds.Prefix):
    the whole extent up to SCAN_BLOCK, at least 16 (tl's smallest); beside a state
    `width` values wide for each position (a selective scan's n), within TILE_BUDGET."""
    return max(16, min(SCAN_BLOCK, np2(n), np2(TILE_BUDGET // width + 1) // 2))


def grid_tiling(kernel, extent: Callable[[str], int], ordered: tuple[str, int] | None = None,
                scanned: tuple[str, int, int] | None = None) -> GridTiling:
    """The tiles of `kernel`'s grid indices for these extents, the last index first.
    `ordered`: (the grid index, the loop tile) of a sorted loop (specialise.ir.SortedLoop):
    that index runs one value at a time, each program the contiguous range of the sorted
    order its value has, and the others share the budget with the loop's tile (the rows
    it gathers are read whole-line, not a column's stride).  `scanned`: (the grid index,
    its tile, the state's width beside it) of a scan (schedule.bounds.Prefix): each
    program runs through that index in order, and the other grid indices share the
    budget with its tile (a long scan's rows one a program: more programs)."""
    dot = kernel.dot_indices
    tiled = tiled_grid(kernel, extent)
    if scanned:
        blocks = {scanned[0]: scanned[1]}
        rows = next((g for g in reversed(kernel.grid) if g in tiled and g != scanned[0]), None)
        if rows is not None and extent(scanned[0]) < SCAN_BLOCK:
            blocks[rows] = min(np2(extent(rows)), max(1, TILE_BUDGET // (scanned[1] * scanned[2])))
        return GridTiling(blocks, frozenset(), STREAM_BLOCK)
    streamed = (ordered[1] if ordered else streamed_width(kernel, extent)) if streams(kernel) else 0
    blocks: dict[str, int] = {}
    whole: set[str] = set()
    cap = STREAM_BLOCK
    for g in reversed(kernel.grid):
        if g not in tiled or ordered and g == ordered[0]:
            continue
        n = np2(extent(g))
        b = free_tile(extent(g), g in dot, g in kernel.value_only)
        if held_whole_in_grid(kernel, g, extent):
            b = max(16, n)
            whole.add(g)
        elif g in dot and n > WHOLE_MAX and recomputed_per_grid_tile(kernel, g):
            # too wide to hold whole: the widest tile, the fewest times to recompute
            b = WHOLE_MAX
        if not b and streamed and contiguous(kernel, g) and not ordered:
            # a column sum (dG[k] = sum[i](...) of row-major tensors): programs one
            # column wide would read memory with a stride per element; a tile of
            # columns reads whole lines, and the streamed rows share the budget
            b = min(n, COLUMN_BLOCK)
            cap = max(1, COLUMN_TILE // (b * lane_fields(kernel)))
        if not b:
            if streamed:        # the streamed tile and the other grid tiles share the budget
                b = min(n, max(1, TILE_BUDGET // (streamed * max(blocks.values(), default=1))))
            elif not blocks:
                b = min(n, ROW_BLOCK)
            else:
                b = min(n, max(1, TILE_BUDGET // max(blocks.values())))
        blocks[g] = b
    return GridTiling(blocks, frozenset(whole), cap)


def lane_fields(kernel) -> int:
    """The fields of a kernel's program folds that keep a running value per element of
    the streamed tile (a sum's or a max's: its lanes, reduced once after the loop), at
    least 1: each holds the whole tile in registers, so they share the tile's budget.
    A layernorm's dG[k] and dB[k] (two sums over rows, 64 columns by 256 rows each)
    spilled: 0.94-1.02 ms, 256 GB/s, on the H200 (scripts/norm_probe.py)."""
    lanes = 0
    for f in kernel.program_folds:
        parts = (f.summary.restricted(g)[0] for g in independent_fields(f.summary))
        lanes += sum(1 for part in parts if additive(part) or extremum(part) is not None)
    return max(1, lanes)


def nested_steps(fold, extent: Callable[[str], int], dot, memo: dict | None = None) -> int:
    """The tile steps the folds nested in `fold`'s loop take for each of its steps (the
    longest chain): logsumexp[v] of sum[k](H[t,k] * W[v,k]) under sum[t] steps over every
    tile of v, and inside each over every tile of k, for each tile of t.  An index held
    whole is one step.  `memo`: each nested fold's steps, found once."""
    memo = {} if memo is None else memo
    if fold in memo:
        return memo[fold]
    most = 1
    widths: dict = {}
    for e in _nested_in_loop(fold):
        steps = 1
        for b, c in zip(e.indices, _caps_within(e, extent, dot, STREAM_BLOCK, nested_width(e, extent, dot, widths))):
            n = extent(b)
            if not held_whole(n, False):
                steps *= -(-n // loop_tile(n, b in dot, c))
        most = max(most, steps * nested_steps(e, extent, dot, memo))
    memo[fold] = most
    return most


def auto_split(programs: int, tiles: int, sm_count: int | None, steps: int = 1, divisions: int | None = None,
               full: int = 2) -> int:
    """The default number of splits (1: none) for a kernel of `programs` programs whose
    longest fold streams `tiles` tiles, each of `steps` steps of the folds nested in it,
    on a GPU with `sm_count` SMs: it splits from SPLIT_MIN_TILES steps, or from
    SPLIT_SHORT_TILES with at most one program for four SMs; every split streams one
    of the loop's `divisions` (default: its tiles; more where its tile may shrink) or
    more and SPLIT_MIN_RUN steps or more, and there are at most SPLIT_MAX splits, or
    SPLITS_PER_SM programs an SM in all where that is more.  From `full` programs an SM
    (MATMUL_PROGRAMS_PER_SM for a matrix product's kernel) it does not split."""
    if not sm_count or programs >= full * sm_count:
        return 1
    work = tiles * steps
    if work < (SPLIT_SHORT_TILES if 4 * programs <= sm_count else SPLIT_MIN_TILES):
        return 1
    most = max(SPLIT_MAX, SPLITS_PER_SM * sm_count // max(programs, 1))
    n = min(math.ceil(PROGRAMS_PER_SM * sm_count / max(programs, 1)), divisions or tiles, work // SPLIT_MIN_RUN,
            most)
    return n if n >= 2 else 1


def uniform_work(kernel) -> bool:
    """Whether every program of a kernel does the same work: it streams program folds
    whose loops no index predicate bounds and whose tiles no predicate on data skips."""
    from .bounds import index_bounds, tile_tests
    return bool(kernel.program_folds) and not any(index_bounds(f) or tile_tests(f) for f in kernel.program_folds)


def recompute_costs(extent: Callable[[str], int], g: str, work: tuple[tuple[str, ...], ...]) -> bool:
    """Whether recomputing nested folds (each element costs one step per value of each
    fold's reduced indices, `work`) once per tile of g after the first (a tile holds at
    most WHOLE_MAX values of g) costs more than storing each element once in float32
    and reading it back: (tiles - 1) * 2 FLOPs per product against 8 bytes at
    FLOPS_PER_BYTE; a step of a fold without a contraction reads memory, so the bound
    errs towards recomputing it.  The SwiGLU block at e = 4096: 15 * 2 * 8192 FLOPs
    against 8 bytes, stored; an RMSNorm weight gradient's row statistic over 4096
    columns, for each of 16 tiles of them, stored; attention's backward at d = 512
    recomputes the scores once more (512 products), which beats a score-sized buffer."""
    tiles = -(-extent(g) // WHOLE_MAX)
    products = sum(math.prod(extent(r) for r in reduced) for reduced in work)
    return (tiles - 1) * products > CHAIN_BREAK


def _set(sizes) -> str:
    return "{" + ", ".join(str(s) for s in sorted(set(sizes))) + "}"


def describe(kernel) -> list[str]:
    """The tile symbols of a KernelSchedule with their candidate sets, and its split
    policy, as the schedule prints them."""
    dot = kernel.dot_indices
    # a sum over several tl.dot indices streams the deepest at the call (one_at_a_time): each may
    at_call = [[b for b in f.indices if b in dot] for f in kernel.program_folds
               if additive(f.summary) and len(set(f.indices) & dot) > 1]
    choices = {b for names in at_call for b in names}
    singles = {b for f in kernel.program_folds for b in one_at_a_time(f, dot)} - choices
    # the streamed index of an outermost contraction (the emitter tunes its tile)
    loops = sorted({i for c in kernel.contractions if not c.bound for i in c.reduced} - singles)
    depths = len(loops) - sum(len(set(names) & set(loops)) - 1 for names in at_call if set(names) & set(loops))
    whole = (lacked(kernel) & dot) - kernel.value_only
    rows = sorted(g for g in kernel.grid if g in dot and g not in kernel.value_only and g not in whole)
    streamed = len(rows) == 1 and depths == 1
    matmul = len(rows) == 2 and depths == 1
    tiles = []
    for g in rows:
        sizes = ({r for r, *_ in STREAMED} if streamed else
                 {t[rows.index(g)] for t in MATMUL} if matmul else {DOT_BLOCK})
        tiles.append(f"BLOCK_{g} in {_set(sizes)} (tl.dot {'rows' if g == rows[0] else 'columns'}"
                     f"{', tuned' if streamed or matmul else ''})")
    for g in sorted(kernel.value_only):
        tiles.append(f"BLOCK_{g} = np2(n_{g}) up to {WHOLE_MAX} (values held whole), else {DOT_BLOCK}")
    for e in kernel.epilogue:
        if (e in dot or e in kernel.value_only) and _recomputed_per_tile(kernel, e):
            tiles.append(f"BLOCK_{e} = np2(n_{e}) up to {WHOLE_MAX} (epilogue: a tile of it would recompute "
                         f"the folds nested in its fold), else {DOT_BLOCK}")
    for g in sorted(whole):
        tiles.append(f"BLOCK_{g} = np2(n_{g}) up to {WHOLE_MAX} (a field does not vary over it: held whole), "
                     f"else {DOT_BLOCK}")
    for b in loops:
        sizes = {k for _, k, *_ in STREAMED} if streamed else {t[2] for t in MATMUL} if matmul else {DOT_BLOCK}
        among = next((names for names in at_call if b in names), None)
        chosen = (f", if the deepest of {', '.join(among)} at the call; else one value at a time"
                  if among else "")
        tiles.append(f"BLOCK_{b} in {_set(sizes)} (tl.dot, streamed{', tuned' if streamed or matmul else ''}"
                     f"{chosen})")
    for b in sorted(dot - set(rows) - set(loops) - kernel.value_only - kernel.batch_indices - singles - whole):
        tiles.append(f"BLOCK_{b} = np2(n_{b}) up to {WHOLE_MAX}, {EXACT_DOT_WHOLE_MAX} for float32 without TF32 "
                     f"(nested tl.dot, whole), else {DOT_BLOCK}")
    for f in kernel.program_folds:
        plain = [b for b in f.indices if b not in dot and b not in singles]
        inner = sorted({b for n in f.args for r in nodes(n) if isinstance(r, Reduce) for b in r.indices
                        if b not in dot})
        budget = f"{STREAM_BLOCK}" + (f" / the width of {', '.join(inner)} where held whole" if inner else "")
        if len(plain) == 1:
            tiles.append(f"BLOCK_{plain[0]} = np2(n_{plain[0]}) up to {budget} (streamed)")
        elif plain:
            tiles.append(f"{', '.join(f'BLOCK_{b}' for b in plain)} = np2 of each, sharing {budget} "
                         f"elements, the last first (streamed)")
    tiled = tiled_grid(kernel, lambda g: 2)     # an index of extent 1 is one program instead
    elementwise = [g for g in tiled if g not in dot and g not in kernel.value_only]
    if elementwise:
        names = ", ".join(f"BLOCK_{g}" for g in elementwise)
        columns = [g for g in elementwise if streams(kernel) and contiguous(kernel, g)]
        sizes = (f"np2(n_{elementwise[0]})" if len(elementwise) == 1 else "np2 of each") + f" up to {ROW_BLOCK}"
        tiles.append(f"{names} = {sizes}{', the last first' if len(elementwise) > 1 else ''}, the program's "
                     f"tiles within {TILE_BUDGET} elements (elementwise grid tile{'s' * (len(elementwise) > 1)}"
                     + "".join(f"; {COLUMN_BLOCK} for {g}, contiguous in memory, beside streamed rows within {COLUMN_TILE} "
                             f"elements" for g in columns) + ")")
    ones = sorted(kernel.batch_indices | singles | (set(kernel.grid) - set(tiled)))
    if ones:
        tiles.append(f"{', '.join(ones)}: one value at a time")
    tuning = "" if streamed or matmul else f"; warps and stages from {len(LAUNCH)} launch configs"
    if streamed and uniform_work(kernel):
        tuning = (f"; also {PAIRED[0]} x {PAIRED[1]} at {PAIRED[4]} registers a thread (two programs an SM) "
                  f"where the float32 state fits {PAIRED_STATE}")
    lines = [f"  tiles: {'; '.join(tiles)}{tuning}"] if tiles else []
    if kernel.program_folds and not kernel.dependent:
        lines.append(f"  split (unless split= says): under 2 programs per SM and >= {SPLIT_MIN_TILES} tiles (with their "
                     f"nested steps; >= {SPLIT_SHORT_TILES} under a quarter of a program per SM), over min({PROGRAMS_PER_SM} SMs / programs, tiles, steps / {SPLIT_MIN_RUN}, "
                     f"max({SPLIT_MAX}, {SPLITS_PER_SM} SMs / programs)) programs, merged in order by the combine")
    return lines
