"""Chunked runs: a schedule whose buffers would outgrow the inputs runs part of its
kernels once per chunk of one index, so that each buffer holds one chunk.

The materialised schedule (Schedule.materialised) stores a value that the fused one
recomputes for every tile of a grid index: a fused linear cross-entropy's backward
stores dZ[t, v] once and reads it as the operand of two matrix products (dH = dZ W,
dW = dZ^T H), where the fused kernels recompute the logits for every tile of the
hidden dimension.  Stored whole, dZ is [tokens, vocab]: larger than any input.  Run
over chunks of v, the kernels from the one that stores dZ to the last that reads it
need dZ[t, one chunk of v] at a time:

- a statement over v (dZ, dW[v, d]) is written one chunk at a time: the launcher
  hands the kernels views of the chunk (`Tensor.narrow` of every tensor along the
  dimension v indexes), the chunk's length as v's extent and its first value as
  `start`, which a kernel adds where it reads v's value (`v == Y[t]`);
- a statement without v that sums over v (dH[t, d] = sum[v](...)) is each chunk's
  partial sum, added up in float32 across the chunks (an additive fold's partial
  sums add);
- anything else that reads v (a fold over v nested in a value, a loop bound or
  tile test on v, a tensor read along v at two dimensions, or along v at one
  access and another index at another) would see one chunk where it needs all:
  no chunked run over v.

`chunked(schedule, added, extent, budget)` picks the index whose run adds the fewest
float32 partial sums, and a chunk length (a multiple of CHUNK_ALIGN, chunks of
near-equal length) such that no added buffer holds more than `budget` elements; the
specialisation stage may take a shorter one that fills a GPU's SMs better
(specialise.stage.chunk_length)."""
from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

from ..algebra.properties import additive
from ..ir import Access, Reduce, nodes
from .bounds import index_bounds, tile_tests
from .folds import all_index_names

CHUNK_ALIGN = 256       # a chunk holds whole tiles of every tile size (tiles.py: up to 256)


@dataclass(frozen=True)
class Chunking:
    """Kernels `first`..`last` (positions in the schedule) run once per chunk of `index`."""
    index: str
    names: tuple[str, ...]          # `index` and the names inlining gave its bound copies
    size: int                       # a chunk's length; the last chunk holds the rest
    extent: int                     # the whole extent of `index`
    first: int
    last: int
    narrowed: tuple[tuple[str, int], ...]   # tensor -> the dimension `index` indexes (a view per chunk)
    buffers: tuple[str, ...]        # buffers made in the run over `index`: one chunk long
    accumulated: tuple[str, ...]    # outputs that sum over `index`: chunks' sums added in float32
    why: str
    longest: int                    # the longest chunk the budget allows (a multiple of CHUNK_ALIGN)
    sized: str = ""                 # why `size`, where a GPU's SMs chose it (specialise)

    @property
    def lengths(self) -> tuple[int, ...]:
        """The distinct chunk lengths a run launches (the last chunk may be shorter)."""
        rest = self.extent % self.size
        return (self.size,) + ((rest,) if rest else ())

    def describe(self, kernels: list[str]) -> str:
        """One line: which of `kernels` (the schedule's names, in order) run per chunk, and why."""
        count = -(-self.extent // self.size)
        line = (f"{kernels[self.first]} to {kernels[self.last]} run in {count} chunks of {self.index}, "
                f"{self.size} at a time: {self.why}" + (f"; {self.sized}" if self.sized else ""))
        if self.accumulated:
            line += f"; {', '.join(self.accumulated)}: the chunks' sums, added in float32"
        return line


def chunked(schedule, added: set[str], extent: Callable[[str], int], budget: int) -> Chunking | None:
    """A chunked run of `schedule` in which no buffer of `added` holds more than `budget`
    elements, or None where no index allows one: of the indices that allow one, the one
    whose chunks add the fewest float32 partial sums (each chunk's are written and added
    once more), then the longest chunk."""
    return cheapest(schedule, chunk_candidates(schedule, added, extent, budget), extent)


def cheapest(schedule, runs: dict[str, Chunking | str], extent: Callable[[str], int]) -> Chunking | None:
    """Of `runs` (chunk_candidates), the run `chunked` takes, or None where none is one."""
    found = [run for run in runs.values() if isinstance(run, Chunking)]

    def cost(run: Chunking) -> tuple[int, int]:
        sums = sum(math.prod(extent(i) for i in schedule.indices_of(a)) for a in run.accumulated)
        return -(-run.extent // run.size) * sums, -run.size
    return min(found, key=cost) if found else None


def chunk_candidates(schedule, added: set[str], extent: Callable[[str], int], budget: int
                     ) -> dict[str, Chunking | str]:
    """Each index of the buffers `added` -> its chunked run, or why it allows none."""
    kernels = schedule.kernels
    stores = [{st.name for st in k.statements} for k in kernels]
    read = [{n.tensor for st in k.statements for n in nodes(st.expr) if isinstance(n, Access)} for k in kernels]
    first = min(p for p, names in enumerate(stores) if names & added)
    last = max(p for p in range(len(kernels)) if (read[p] | stores[p]) & added)
    region = kernels[first:last + 1]
    fresh = dict(schedule.fresh_names)

    def origin(name: str) -> str:
        while name in fresh:
            name = fresh[name]
        return name
    candidates = dict.fromkeys(origin(i) for b in added for i in schedule.indices_of(b))
    return {x: _run(schedule, region, first, last, added, x, origin, extent, budget) for x in candidates}


def _run(schedule, region, first: int, last: int, added: set[str], x: str, origin, extent,
         budget: int) -> Chunking | str:
    statements = [st for k in region for st in k.statements]
    names = frozenset(i for st in statements for i in all_index_names(st.expr) | set(st.indices) if origin(i) == x)
    missing = [b for b in added if not names & set(schedule.indices_of(b))]
    if missing:
        return f"{missing[0]} does not vary over {x}"
    # each added buffer's elements per value of x
    per_value = {b: math.prod(extent(i) for i in schedule.indices_of(b) if i not in names) for b in added}
    most = budget // max(max(per_value.values()), 1) // CHUNK_ALIGN * CHUNK_ALIGN
    whole = extent(x)
    if most < CHUNK_ALIGN:
        return f"a chunk of {CHUNK_ALIGN} values of {x} would hold more than {budget} elements"
    if most >= whole:
        return f"{x} is no longer than a chunk"
    count = -(-whole // most)
    size = -(-whole // (count * CHUNK_ALIGN)) * CHUNK_ALIGN       # near-equal chunks, aligned
    read_in_run = {n.tensor for st in statements for n in nodes(st.expr) if isinstance(n, Access)}
    read_after = {n.tensor for k in schedule.kernels[last + 1:] for st in k.statements for n in nodes(st.expr)
                  if isinstance(n, Access)}
    buffers, accumulated = [], []
    for st in statements:
        top = st.expr if isinstance(st.expr, Reduce) else None
        for n in nodes(st.expr):
            if isinstance(n, Reduce) and n is not top and names & set(n.indices):
                return f"{st.name} folds over {x} inside a value: one chunk is not all of {x}"
            if isinstance(n, Reduce) and _bounded_by(n, names):
                return f"a loop bound or tile test of {st.name}'s fold reads {x}: a chunk's view would shift it"
        if names & set(st.indices):
            if st.name in schedule.buffers:
                if st.name in read_after:
                    return f"{st.name} is read after the run, which keeps one chunk of it"
                buffers.append(st.name)
        elif (top is not None and additive(top.summary) and top.result is None and names & set(top.indices)
              and st.name in schedule.outputs and st.name not in read_in_run):
            accumulated.append(st.name)
        else:
            return f"{st.name} reads {x} but neither varies over it nor is an output that sums over it"
    # every other tensor read or stored in the run indexes x at one dimension in all its
    # accesses, or nowhere: a chunk's view of it is one narrow
    at: dict[str, set[tuple[int, ...]]] = {}
    for st in statements:
        reads = [n for n in nodes(st.expr) if isinstance(n, Access)]
        crossing = next((n for n in reads if n.layout is not None and names & set(n.indices)), None)
        if crossing is not None:
            return f"{crossing.tensor} is read at an affine subscript of {x}: a chunk's view would cut its window"
        accesses = [(st.name, st.indices)] + [(n.tensor, n.indices) for n in reads]
        for tensor, indices in accesses:
            at.setdefault(tensor, set()).add(tuple(p for p, i in enumerate(indices) if i in names))
    narrowed = []
    for tensor, patterns in at.items():
        if tensor in buffers or patterns == {()}:
            continue
        if len(patterns) != 1 or len(next(iter(patterns))) != 1:
            return f"{tensor} is read along {x} at other dimensions, or beside reads that do not vary over it"
        narrowed.append((tensor, next(iter(patterns))[0]))
    largest = max(per_value, key=per_value.get)
    why = (f"{largest}[{', '.join(schedule.indices_of(largest))}] would hold {per_value[largest] * whole} "
           f"elements, more than the largest input ({budget}); at most {most} values of {x} at a time, "
           f"{per_value[largest] * most}")
    return Chunking(x, tuple(sorted(names)), size, whole, first, last, tuple(narrowed), tuple(buffers),
                    tuple(accumulated), why, most)


def _bounded_by(fold: Reduce, names: frozenset) -> bool:
    """Whether a loop bound or tile test of `fold` reads x: a chunk's view would shift it."""
    for index, bounds in index_bounds(fold).items():
        if index in names or any(b.other in names or names & all_index_names(b.offset) for b in bounds):
            return True
    return any(index in names or any(names & all_index_names(c) for c in tests)
               for index, tests in tile_tests(fold).items())
