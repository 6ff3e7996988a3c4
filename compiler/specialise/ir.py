"""The concrete schedule: a Schedule with every size decided for one call's signature.

The Schedule (compiler.schedule) states tiles as symbols with rules and candidate
sets, for any sizes.  Specialised to a Signature, each kernel has its grid tiles
and the order of its programs, each epilogue index its tile, each fold its loop
kind and tile per index (streamed, held whole, one value at a time), whether its
tiles are tuned and from which table, and the split of its program folds.  A
backend reads these and decides nothing of them itself."""
from __future__ import annotations

from dataclasses import dataclass, replace

import torch

from ..ir import Expr, Reduce, format_expr
from ..schedule import KernelSchedule, Schedule
from ..schedule.bounds import Bound, Prefix

POSITIVE = "positive"


@dataclass(frozen=True)
class Signature:
    """What a generated module is specialised to (besides the program)."""
    extents: tuple[tuple[str, int], ...]
    # name, "tensor" | "number", rank, dtype; a number's dtype slot holds its sign class: POSITIVE
    # (arguments.positive_number: a factor that commutes with max) or None
    inputs: tuple[tuple[str, str, int, object], ...]
    dtype: torch.dtype                                  # float results
    sm_count: int | None                                # None: no auto split (no GPU)
    interpret: bool = False                             # kernels run under Triton's interpreter
    tf32: bool = False                                  # float32 tl.dot in TF32 (torch's matmul setting)
    l2_bytes: int | None = None                         # the GPU's L2 cache (eviction hints); None: unknown
    arch: int | None = None                             # compute capability as 10 * major + minor (90: Hopper)

    def sums_in_order(self, dtype) -> bool:
        """Whether tl.dot of `dtype` operands sums each tile's products in order in
        float32 (IEEE float32, not TF32): long contractions need compensated tiles."""
        return dtype == torch.float32 and not self.tf32

    def __str__(self) -> str:
        device = "Triton's interpreter" if self.interpret else (
            f"{self.sm_count} SMs" if self.sm_count else "no SM count") + (f", sm_{self.arch}" if self.arch else "")
        return (f"{', '.join(f'{k}={v}' for k, v in self.extents)}; {str(self.dtype).removeprefix('torch.')}; "
                f"{device}" + ("; TF32" if self.tf32 else ""))


# how a float32 tl.dot multiplies, as printed
DOT_PRECISIONS = {
    "tf32": "TF32 (torch's float32 matmul precision allows it)",
    "tf32x3": "three TF32 products (tf32x3: float32's accuracy at its contractions' depth, and the faster)",
    "ieee": "IEEE float32 (a contraction too shallow for tf32x3's rounding, or deeper than it pays for)",
}

# how a loop or program axis covers its index
TILED = "tiled"            # tiles of `size` values
WHOLE = "whole"            # one tile of `size` values holds the whole extent (no loop)
ONE_AT_A_TIME = "one"      # one value per step (size 0): a batch index, or in order (not commutative)


@dataclass(frozen=True)
class Tile:
    """One index of a kernel's grid, epilogue or a fold's loop, sized."""
    index: str
    how: str               # TILED, WHOLE or ONE_AT_A_TIME
    size: int              # values per tile (TILED, WHOLE); 0 for ONE_AT_A_TIME (1: one at a time, in order)
    tuned: bool = False    # an autotuner tries the candidates of the kernel's table for it
    why: str = ""          # the rule that sized it, in a few words

    @property
    def scalar(self) -> bool:
        return self.size == 0

    def __str__(self) -> str:
        if self.how == ONE_AT_A_TIME:
            text = f"{self.index}: one at a time" + (", in order" if self.size == 1 else "")
        else:
            text = f"{self.index}/{self.size}" + (" whole" if self.how == WHOLE else "")
        return text + (" tuned" if self.tuned else "") + (f" ({self.why})" if self.why else "")


# comparisons that the least and greatest value of each side over a tile decide
# (a tile where one fails everywhere is skipped, a live span scanned by them)
RANGED = frozenset({"lt", "le", "gt", "ge", "eq"})


@dataclass(frozen=True)
class SortedLoop:
    """A loop that visits its index in the order of an integer input's values: the fold
    sums only where `tensor[*rows, index] + offset == by` (a gathered read's scatter,
    `sum[i](where(T[i] == s, dY[i, d], 0))`), so each program runs over the positions
    whose value is one of its tile's `by`, which the launcher's stable sort of the
    tensor along its last dimension and the start of each value in it give.  Ids over
    several indices (`T[b, t]`) sort each row: the fold's other indices, `rows`, run
    one value at a time outside the sorted loop.  The comparison stays in the body."""
    index: str
    tensor: str
    by: str
    offset: int
    conjunct: Expr
    rows: tuple[str, ...] = ()

    def __str__(self) -> str:
        each = f" in each row of {', '.join(self.rows)}" if self.rows else ""
        return (f"visits {self.index} sorted by {self.tensor}{each}, only the positions where "
                f"{format_expr(self.conjunct)} can hold")


@dataclass(frozen=True)
class FoldLoops:
    """How one fold streams: a Tile per index it reduces, in its order, and the
    bands of its loops (schedule.bounds: each fact read off the fold once, here)."""
    fold: Reduce
    nested: bool           # inside another fold's loop (its indices may be held whole)
    tiles: tuple[Tile, ...]
    # loop index -> relations from index predicates that bound it (`m <= i`): the loop runs
    # from the first to the last tile where they can hold
    bounds: tuple[tuple[str, tuple[Bound, ...]], ...] = ()
    # loop index -> predicates on data (`D[i] == D[m]`): a tile where one fails everywhere is skipped
    skips: tuple[tuple[str, tuple[Expr, ...]], ...] = ()
    # a single loop's relations that hold everywhere on a band of interior tiles, which run
    # without them; the boundary tiles on either side evaluate them
    interior: tuple[Bound, ...] = ()
    # a single loop's comparisons on data whose live span (first to last tile where each may
    # hold) a scan of their sides finds before the loop
    span: tuple[Expr, ...] = ()
    # an index held whole -> "grid" or "epilogue": the kernel's whole tile of that index there
    # is the same tile (same extent, same size), so the fold reduces over that axis itself
    # (one load of a tensor serves both, read in either layout)
    shared: tuple[tuple[str, str], ...] = ()
    # the index whose loop a split kernel's programs divide among them, one chunk of its
    # tiles each (a split program fold's; "" otherwise)
    chunked: str = ""
    # a loop over the positions sorted by the values an equality with data compares (its rows
    # one value at a time outside it)
    sorted: SortedLoop | None = None
    # a prefix (or suffix) of the fold along a grid index the program runs in order: no loop
    prefix: Prefix | None = None

    def tile(self, index: str) -> Tile:
        return next(t for t in self.tiles if t.index == index)

    def __str__(self) -> str:
        where = "nested fold" if self.nested else "fold"
        fields = ", ".join(self.fold.summary.field_names)
        notes = [f"bounds: {', '.join(str(b) for _, bs in self.bounds for b in bs)}"] if self.bounds else []
        if self.prefix is not None:
            notes.append(str(self.prefix))
        if self.sorted is not None:
            notes.append(str(self.sorted))
        if self.interior:
            notes.append(f"interior tiles without {', '.join(str(b) for b in self.interior)}")
        notes += [f"skips tiles where {' and '.join(format_expr(c) for c in cs)} fails" for _, cs in self.skips]
        if self.span:
            notes.append(f"live span of {' and '.join(format_expr(c) for c in self.span)} scanned first")
        notes += [f"{index} shares the {where}'s tile" for index, where in self.shared]
        if self.chunked and self.chunked != self.fold.indices[0]:
            notes.append(f"the split divides the tiles of {self.chunked}")
        tiles = "; ".join(str(t) for t in self.tiles) or "no loop"
        return f"{where}[{', '.join(self.fold.indices)}] of {fields}: {tiles}" + "".join(f" [{n}]" for n in notes)


@dataclass(frozen=True)
class Candidate:
    """One tiling the autotuner tries: the tuned indices' tiles (the other tiles as
    decided), warps, pipeline stages, and a register cap a thread (two programs an SM),
    which the backend keeps only where the kernel's float32 state fits it."""
    tiles: tuple[tuple[str, int], ...]
    warps: int
    stages: int
    registers: int | None = None

    def __str__(self) -> str:
        tiles = " x ".join(f"{i}/{size}" for i, size in self.tiles)
        return (f"{tiles + ', ' if tiles else ''}{self.warps} warps, {self.stages} stages"
                + (f", {self.registers} registers" if self.registers else ""))


@dataclass(frozen=True)
class ConcreteKernel:
    schedule: KernelSchedule
    grid: tuple[Tile, ...]          # in the kernel's grid order
    longest_first: str | None       # a grid index whose higher tiles run longer loops: launched first
    grouped: bool                   # two tuned grid tiles: programs in groups of GROUP tile rows (L2 reuse)
    epilogue: tuple[Tile, ...]      # in the kernel's epilogue order
    folds: tuple[FoldLoops, ...]    # every fold it streams, nested ones after their parent
    loop_cap: int                   # elements a streamed tile without tl.dot may hold
    split: int                      # programs each program fold's loop is split over (1: none)
    split_why: str                  # why (or why a requested split was refused); "" when nothing to say
    tuning: str                     # the autotune table its candidates come from ("" untuned)
    candidates: tuple[Candidate, ...] = ()   # what the autotuner tries (none: launched as decided)
    form: object = None             # a form of specialise.forms the kernel takes (what it is built from)
    form_why: str = ""              # why a GPU's forms do not take a kernel of a rescaled fold
    # reads whose elements no other program reads (a memory-bound kernel's rows): (tensor, its
    # indices, whether they hold more than the GPU's L2 cache); the last read of each streams
    # past the cache (evict_first), an earlier one larger than L2 is kept for it (evict_last)
    past_cache: tuple[tuple[str, tuple[str, ...], bool], ...] = ()
    # the grid index each program runs through in order, tile after tile, and whether from
    # its last tile down: its prefix folds' state is carried from tile to tile ("": none)
    scan: str = ""
    scan_reverse: bool = False
    # chunks of the scanned index across programs (1: each program runs the whole index): a
    # kernel of its own first reduces each chunk, then each program scans its chunk from the
    # combined totals of the chunks before it (after it, for a suffix); and why
    scan_chunks: int = 1
    scan_chunks_why: str = ""
    scan_epilogue: bool = False     # the scanned index is the epilogue's (its loop runs in order)
    # how a float32 tl.dot multiplies ("": the kernel has none): "tf32" where torch's matmuls may,
    # "tf32x3" (three TF32 products) for contractions 64 to 1024 deep, else "ieee"
    dot_precision: str = ""

    @property
    def name(self) -> str:
        return self.schedule.name

    @property
    def tuned(self) -> bool:
        """Whether an autotuner chooses among candidates for it (none under the
        interpreter; a split kernel only where its table tunes a tile)."""
        return bool(self.candidates)

    def loops_of(self, fold: Reduce, nested: bool) -> FoldLoops:
        for f in self.folds:
            if f.fold == fold and f.nested == nested:
                return f
        raise AssertionError(f"{self.name}: the specialised schedule has no "
                             f"{'nested ' * nested}fold {fold.summary.name}[{', '.join(fold.indices)}]")

    def __str__(self) -> str:
        # "tuned" where a candidate varies the tile (none under the interpreter, none for a
        # table of launch configurations), though the kernel keeps every tuned tile's mask
        varied = {i for c in self.candidates for i, _ in c.tiles}

        def untuned(t: Tile) -> Tile:
            return replace(t, tuned=t.tuned and t.index in varied)
        order = "" if not self.grid else (f"; programs: longest first along {self.longest_first}"
                                          if self.longest_first else "; programs: in groups of tile rows"
                                          if self.grouped else "")
        grid = f"grid ({', '.join(str(untuned(t)) for t in self.grid)})" if self.grid else "one program"
        lines = [f"kernel {self.name}: {grid}{order}"]
        if self.scan:
            runs = f"the epilogue's loop runs {self.scan}" if self.scan_epilogue else f"{self.scan} runs"
            lines.append(f"  {runs} in order through each program{', last tile first' * self.scan_reverse}, "
                         f"the scans' state carried from tile to tile")
            if self.scan_chunks > 1:
                lines.append(f"  {self.scan} in {self.scan_chunks} chunks across programs ({self.scan_chunks_why}): "
                             f"a kernel reduces each chunk first, then each program scans its chunk from the "
                             f"chunks {'after' if self.scan_reverse else 'before'} it")
        if self.epilogue:
            # an index held whole is one tile of the kernel's: no loop over it
            looped = any(t.how != WHOLE for t in self.epilogue)
            lines.append(f"  epilogue{' loop' if looped else ''} ({', '.join(str(t) for t in self.epilogue)})")
        lines += [f"  {'  ' * f.nested}{replace(f, tiles=tuple(map(untuned, f.tiles)))}" for f in self.folds]
        if self.split > 1:
            lines.append(f"  split {self.split} ways: {self.split_why}")
        elif self.split_why:
            lines.append(f"  not split: {self.split_why}")
        if self.past_cache:
            lines.append("  read past the cache: " + ", ".join(
                f"{t}[{', '.join(ix)}]" + (" (larger than L2: kept for a second read)" if big else "")
                for t, ix, big in self.past_cache))
        if self.dot_precision:
            lines.append(f"  float32 tl.dot: {DOT_PRECISIONS[self.dot_precision]}")
        if self.form is not None:
            lines.append(f"  form: {self.form}")
        elif self.form_why:
            lines.append(f"  form: tl ({self.form_why})")
        if self.tuning:
            fallback = " (the tl kernel, where TMA cannot read the operands)" if self.form is not None else ""
            lines.append(f"  autotuned{fallback} over {self.tuning}:")
            lines += [f"    {c}" for c in self.candidates]
        return "\n".join(lines)


@dataclass(frozen=True)
class ConcreteSchedule:
    schedule: Schedule              # the schedule for these extents (Schedule.for_extents)
    signature: Signature
    kernels: tuple[ConcreteKernel, ...]
    # every tensor's storage dtype: the inputs', the outputs' and each intermediate buffer's
    dtypes: tuple[tuple[str, torch.dtype], ...] = ()

    def kernel(self, name: str) -> ConcreteKernel:
        return next(k for k in self.kernels if k.name == name)

    def dtype(self, name: str) -> torch.dtype:
        return dict(self.dtypes)[name]

    def __str__(self) -> str:
        lines = [f"specialised to {self.signature}: {len(self.kernels)} kernel(s)"]
        lines += [str(k) for k in self.kernels]
        if self.schedule.chunking is not None:
            lines.append(self.schedule.chunking.describe([k.name for k in self.kernels]))
        if self.schedule.recomputes:
            lines.append(f"recomputes the nested folds: it {self.schedule.recomputes}")
        return "\n".join(lines)
