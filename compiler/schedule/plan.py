"""Kernel plans: what would launch, in order, the loops each kernel streams,
and which intermediates would be materialised in global memory."""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Loop:
    """A loop of a kernel: over `indices` (tiles of them), carrying the running
    states of `folds` (summary names), with the loops nested inside it.  An
    epilogue loop carries no fold; a split kernel's merge loop runs over the
    partial states (`indices` is empty).  A loop whose extent fits one tile runs once; a
    bound from a predicate (`m <= i`) lets it skip the tiles where the predicate
    fails everywhere, and a predicate on data (`D[i] == D[m]`) is tested per tile
    at run time, the tiles where it fails everywhere skipped."""

    indices: tuple[str, ...]
    folds: tuple[str, ...]
    inner: tuple["Loop", ...] = ()
    bounds: tuple[str, ...] = ()    # relations from index predicates that bound it (`m <= i`)
    skips: tuple[str, ...] = ()     # predicates on data tested per tile (`D[i] == D[m]`)
    # a grid index run in order through each program, its folds the prefixes (scans) the
    # relations `s <= t` make of them (schedule.bounds.Prefix); "last tile first": suffixes
    scans: tuple[str, ...] = ()
    reverse: bool = False
    # for any sizes: the index its folds are prefixes (suffixes) along (schedule.bounds.prefix_of),
    # which a kernel scans where that index is a grid index
    prefix: str = ""

    def __str__(self) -> str:
        if self.scans:
            nested = f" {{ {'; '.join(str(loop) for loop in self.inner)} }}" if self.inner else ""
            return (f"loop {', '.join(self.indices)} in order{', last tile first' * self.reverse}, "
                    f"scanning {', '.join(self.folds)} [{', '.join(self.scans)}]{nested}")
        over = ", ".join(self.indices) if self.indices else "partial states"
        bounded = f" [bounds: {', '.join(self.bounds)}]" if self.bounds else ""
        bounded += f" [skips tiles where {' and '.join(self.skips)} fails]" if self.skips else ""
        bounded += f" [{self.prefix}]" if self.prefix else ""
        carries = f": {', '.join(self.folds)}" if self.folds else " (epilogue)"
        nested = f" {{ {'; '.join(str(loop) for loop in self.inner)} }}" if self.inner else ""
        return f"loop {over}{bounded}{carries}{nested}"


@dataclass(frozen=True)
class Kernel:
    name: str
    writes: tuple[str, ...]     # statement results it stores
    why: str                    # one line: why this is a separate kernel / what it does
    loops: tuple[Loop, ...] = ()  # streamed loops in program order, each with those nested inside


@dataclass(frozen=True)
class Plan:
    backend: str
    kernels: tuple[Kernel, ...]
    buffers: tuple[str, ...]    # intermediates stored in global memory
    chunks: str = ""            # which kernels run once per chunk of an index, and why (schedule/chunks.py)

    def __str__(self) -> str:
        lines = [f"backend {self.backend}: {len(self.kernels)} kernel(s)"]
        for k in self.kernels:
            lines.append(f"  {k.name}: writes {', '.join(k.writes)}  # {k.why}")
            lines += [f"    {loop}" for loop in k.loops]
        lines.append(f"  intermediate buffers: {', '.join(self.buffers) or 'none'}")
        if self.chunks:
            lines.append(f"  {self.chunks}")
        return "\n".join(lines)
