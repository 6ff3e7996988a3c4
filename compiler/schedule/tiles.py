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

DOT_BLOCK = 64        # the untuned tile of an index that takes part in tl.dot
WHOLE_MAX = 256       # a value or contraction index up to this (padded) size is held whole
EXACT_DOT_WHOLE_MAX = 64  # ... but a float32 contraction without TF32 only up to this: tl.dot sums its
                          # products in order, so longer ones stream tiles summed with compensation
ROW_BLOCK = 1024      # tile of an elementwise grid index
STREAM_BLOCK = 8192   # tile of a streamed index without tl.dot: a row of up to 8192 in one tile, so
                      # that an epilogue re-reading it finds it in cache
TILE_BUDGET = 4096    # elements of a two-dimensional non-dot tile
COLUMN_BLOCK = 64     # grid tile of an index contiguous in memory under a streamed row index

# Autotuned tilings, by the shape of a kernel's tl.dot tiles (not by what it computes):
# (rows, keys, warps, stages) for one tuned grid tile x one tuned loop tile (a fold
# streamed against a matrix product: attention-like)
STREAMED = [(128, 64, 8, 3), (128, 64, 4, 3), (128, 128, 8, 3), (128, 64, 8, 4), (128, 32, 4, 4),
            (64, 64, 4, 3), (64, 128, 4, 3), (64, 32, 4, 4)]
# (rows, cols, depth, warps, stages) for two tuned grid tiles x one tuned loop tile (a matrix product)
MATMUL = [(128, 128, 64, 8, 3), (128, 256, 64, 8, 3), (256, 128, 64, 8, 3), (128, 128, 64, 4, 4),
          (128, 128, 32, 4, 4), (64, 128, 64, 4, 4), (128, 64, 64, 4, 4), (64, 64, 64, 4, 4)]
# (warps, stages) when no tile is tuned
LAUNCH = [(4, 2), (8, 2), (16, 2), (8, 3)]

# Splits (flash-decoding): a kernel whose program folds are independent splits their
# first loop over N programs per output tile when it launches fewer than 2 programs
# per SM and streams at least SPLIT_MIN_TILES tiles; each split streams 8 tiles or more.
SPLIT_MIN_TILES = 64
SPLIT_MAX = 64
PROGRAMS_PER_SM = 8    # a streaming split needs several programs per SM to keep HBM busy


def np2(n: int) -> int:
    return 1 if n <= 1 else 1 << (n - 1).bit_length()


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


def one_at_a_time(fold, dot) -> tuple[str, ...]:
    """The leading indices of a fold over several indices that it streams one value
    at a time: all but the last when it keeps order (not commutative), or when an
    index takes part in a matrix product (softmax[m, n] of Q K^T times V over a 2-D
    key grid: tiles of every index at once would make the product's tile
    [rows, m, n, k], past Triton's limit, and no tl.dot; with m one value at a time
    each step is FlashAttention over a tile of n).  `dot`: the tl.dot indices."""
    if len(fold.indices) > 1 and (not fold.summary.commutative or set(fold.indices) & dot):
        return fold.indices[:-1]
    return ()


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


def auto_split(programs: int, tiles: int, sm_count: int | None) -> int:
    """The default number of splits (1: none) for a kernel of `programs` programs whose
    longest fold streams `tiles` tiles, on a GPU with `sm_count` SMs."""
    if not sm_count or tiles < SPLIT_MIN_TILES or programs >= 2 * sm_count:
        return 1
    n = min(math.ceil(PROGRAMS_PER_SM * sm_count / max(programs, 1)), tiles // 8, SPLIT_MAX)
    return n if n >= 2 else 1


def _set(sizes) -> str:
    return "{" + ", ".join(str(s) for s in sorted(set(sizes))) + "}"


def describe(kernel) -> list[str]:
    """The tile symbols of a KernelSchedule with their candidate sets, and its split
    policy, as the schedule prints them."""
    dot = kernel.dot_indices
    singles = {b for f in kernel.program_folds for b in one_at_a_time(f, dot)}
    folded = {b for f in kernel.program_folds for b in f.indices} - singles
    loops = sorted(folded & dot)
    rows = sorted(g for g in kernel.grid if g in dot and g not in kernel.value_only)
    streamed = len(rows) == 1 and len(loops) == 1
    matmul = len(rows) == 2 and len(loops) == 1
    tiles = []
    for g in rows:
        sizes = ({r for r, *_ in STREAMED} if streamed else
                 {t[rows.index(g)] for t in MATMUL} if matmul else {DOT_BLOCK})
        tiles.append(f"BLOCK_{g} in {_set(sizes)} (tl.dot {'rows' if g == rows[0] else 'columns'}"
                     f"{', tuned' if streamed or matmul else ''})")
    for g in sorted(kernel.value_only):
        tiles.append(f"BLOCK_{g} = np2(n_{g}) up to {WHOLE_MAX} (values held whole), else {DOT_BLOCK}")
    for b in loops:
        sizes = {k for _, k, *_ in STREAMED} if streamed else {t[2] for t in MATMUL} if matmul else {DOT_BLOCK}
        tiles.append(f"BLOCK_{b} in {_set(sizes)} (tl.dot, streamed{', tuned' if streamed or matmul else ''})")
    for b in sorted(dot - set(rows) - set(loops) - kernel.value_only - kernel.batch_indices - singles):
        tiles.append(f"BLOCK_{b} = np2(n_{b}) up to {WHOLE_MAX}, {EXACT_DOT_WHOLE_MAX} for float32 without TF32 "
                     f"(nested tl.dot, whole), else {DOT_BLOCK}")
    for f in kernel.program_folds:
        plain = [b for b in f.indices if b not in dot and b not in singles]
        if len(plain) == 1:
            tiles.append(f"BLOCK_{plain[0]} = np2(n_{plain[0]}) up to {STREAM_BLOCK} (streamed)")
        elif plain:
            tiles.append(f"{', '.join(f'BLOCK_{b}' for b in plain)} = np2 of each, sharing {STREAM_BLOCK} "
                         f"elements, the last first (streamed)")
    if kernel.batch_indices | singles:
        tiles.append(f"{', '.join(sorted(kernel.batch_indices | singles))}: one value at a time")
    others = [g for g in kernel.grid if g not in dot and g not in kernel.batch_indices]
    if others:
        tiles.append(f"{', '.join(others)}: elementwise tiles sharing a {TILE_BUDGET}-element budget with the "
                     f"streamed tile (up to {ROW_BLOCK} alone), or one program each")
    untuned = "" if streamed or matmul else f"; warps and stages from {len(LAUNCH)} launch configs"
    lines = [f"  tiles: {'; '.join(tiles)}{untuned}"] if tiles else []
    if kernel.program_folds and not kernel.dependent:
        lines.append(f"  split (unless split= says): under 2 programs per SM and >= {SPLIT_MIN_TILES} tiles, over "
                     f"min({PROGRAMS_PER_SM} SMs / programs, tiles / 8, {SPLIT_MAX}) programs, merged in order "
                     f"by the combine")
    return lines
