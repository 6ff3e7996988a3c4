"""The Schedule IR: what the schedule stage decides for any sizes.

A Schedule is the program's kernels in launch order.  Each kernel stores some
statements (reads of statements in the same kernel inlined), runs one program
per tile of its grid indices, loops over its epilogue indices inside the
program, streams its folds in loops (nesting order, with the bounds that index
predicates give them) and may store intermediate buffers that later kernels
read.  Sizes are not known here: each kernel's tiles are symbols with their
candidate sets and its split a policy (tiles.py); a backend specialises a
Schedule to a call's signature (tile sizes, splits) and reports what it
launches as a Plan."""
from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, replace

from ..ir import Access, Assign, Program, Reduce, format_expr, nodes
from .chunks import Chunking, cheapest, chunk_candidates
from .folds import Contraction
from .plan import Kernel, Loop, Plan
from .tiles import CHAIN_BREAK, WHOLE_MAX, describe, recompute_costs


@dataclass(frozen=True)
class KernelSchedule:
    name: str
    statements: tuple[Assign, ...]         # stored by this kernel; same-kernel reads inlined
    grid: tuple[str, ...]                  # G: one program per tile of these, in left-hand order
    epilogue: tuple[str, ...]              # E = L - G: looped inside the program, in left-hand order
    why: str                               # one line: what it does and why it is a kernel of its own
    loops: tuple[Loop, ...]                # streamed loops in program order, nested ones inside
    buffers: tuple[str, ...] = ()          # which of `statements` are intermediate buffers
    program_folds: tuple[Reduce, ...] = ()  # top folds with free indices exactly G
    dependent: bool = False                # some program fold reads another one (not splittable)
    # tile roles, read off the folds (a backend sizes the tiles per call):
    contractions: tuple[Contraction, ...] = ()   # matrix-product-like folds (tl.dot candidates)
    dot_indices: frozenset = frozenset()   # a contraction's reduced, row or column index: tiles >= 16
    batch_indices: frozenset = frozenset()  # read by every operand of a contraction: one value at a time
    value_only: frozenset = frozenset()    # a rescaled fold's value index: kept whole where it fits
    # (grid index g, the reduced indices of each fold nested in another that every tile of g
    # recomputes, form._recomputed): the SwiGLU block's (e, ((d,), (d,))), X W1 and X W3 per tile of e
    recomputes: tuple[tuple[str, tuple[tuple[str, ...], ...]], ...] = ()

    @property
    def lhs(self) -> tuple[str, ...]:
        return self.grid + self.epilogue

    def __str__(self) -> str:
        grid = f"grid ({', '.join(self.grid)})" if self.grid else "one program"
        epilogue = f", epilogue ({', '.join(self.epilogue)})" if self.epilogue else ""
        lines = [f"kernel {self.name}: {grid}{epilogue}  # {self.why}"]
        # each fold the statements project is printed once, named, and read as fN.field
        folds: dict[str, str] = {}
        notes: dict[str, list[str]] = {}
        for s in self.statements:
            for node in nodes(s.expr):
                if isinstance(node, Reduce) and node.result is not None:
                    text = format_expr(node.fold)
                    if text not in folds:
                        folds[text] = f"f{len(folds)}"
                        notes[text] = ["base-2 weights"] if any(rs.base2 for rs in node.summary.rescaled) else []
        for f in self.program_folds:
            notes.get(format_expr(f), []).insert(0, "one per program")
        for text, name in folds.items():
            lines.append(f"  {name} = {text}" + (f"  # {'; '.join(notes[text])}" if notes[text] else ""))
        for s in self.statements:
            text = format_expr(s.expr)
            for fold, name in sorted(folds.items(), key=lambda item: -len(item[0])):
                text = text.replace(fold + ".", name + ".")
            stored = "  # buffer" if s.name in self.buffers else ""
            lines.append(f"  {s.name}[{', '.join(s.indices)}] = {text}{stored}")
        if self.dependent:
            lines.append("  not splittable: a program fold reads another")
        for g, work in self.recomputes:
            lines.append(f"  every tile of {g} recomputes {len(work)} fold(s) nested in another: the "
                         f"materialised schedule where (ceil(n_{g} / {WHOLE_MAX}) - 1) * "
                         f"({' + '.join('*'.join(f'n_{r}' for r in reduced) for reduced in work)}) > {CHAIN_BREAK} "
                         f"and no buffer it adds outgrows the largest input")
        lines += describe(self)
        lines += [f"  {loop}" for loop in self.loops]
        return "\n".join(lines)


@dataclass(frozen=True)
class Schedule:
    program: Program                        # the scheduled IR (composites lowered)
    outputs: tuple[str, ...]
    split: int | None                       # the split the user asked for (None: the backend's default)
    kernels: tuple[KernelSchedule, ...]     # in launch order
    buffer_indices: tuple[tuple[str, tuple[str, ...]], ...] = ()   # intermediate buffer -> its indices
    fresh_names: tuple[tuple[str, str], ...] = ()   # bound index renamed by inlining -> the original
    # the same program with every recomputed nested fold stored once (KernelSchedule.recomputes)
    materialised: Schedule | None = None
    # buffers only a contraction reads, as an operand (a chained contraction stored): a backend
    # may store them in the dtype its matrix product reads
    operand_buffers: tuple[str, ...] = ()
    # kernels run once per chunk of an index at these extents (for_extents), so that a buffer
    # holds one chunk: chunks.py
    chunking: Chunking | None = None
    # why the materialised schedule was not taken at these extents although recomputing costs
    # more (for_extents): a buffer outgrows the inputs and no index allows a chunked run
    recomputes: str = ""

    def for_extents(self, extent: Callable[[str], int]) -> Schedule:
        """The schedule to run at these extents: the materialised one where some kernel's
        tiles would recompute nested folds at a cost above storing them
        (tiles.recompute_costs) and no buffer it adds holds more elements than the
        largest tensor the program reads (a store never outgrows the inputs: a fused
        linear cross-entropy's backward at a wide hidden dimension would store
        [tokens, vocab] logits, an attention backward at a wide head dimension its
        scores), else this one."""
        if self.materialised is None or not any(recompute_costs(extent, g, work) for k in self.kernels
                                                for g, work in k.recomputes):
            return self
        inputs = {i.name for i in self.program.inputs}
        largest = max((math.prod(extent(i) for i in n.indices) for s in self.program.statements
                       for n in nodes(s.expr) if isinstance(n, Access) and n.tensor in inputs), default=0)
        # by what they hold, not their names: the two schedules number their buffers apart (the
        # fused one's buf1 may be a count where the materialised one's is [tokens, vocab] logits)
        ours = set(self.buffer_definitions().values())
        added = {name for (name, _) in self.materialised.buffer_indices
                 if self.materialised.buffer_definitions()[name] not in ours}
        if all(math.prod(extent(i) for i in self.materialised.indices_of(b)) <= largest for b in added):
            return self.materialised
        runs = chunk_candidates(self.materialised, added, extent, largest)
        run = cheapest(self.materialised, runs, extent)
        if run is None:
            why = "; ".join(f"{x}: {reason}" for x, reason in runs.items())
            return replace(self, recomputes=f"stores no buffer larger than the largest input ({largest}), and "
                                            f"no index allows chunks of one ({why})")
        return replace(self.materialised, chunking=run)

    def buffer_definitions(self) -> dict[str, Assign]:
        """Each buffer's statement, with the buffer's name left out (what it holds)."""
        return {st.name: replace(st, name="") for k in self.kernels for st in k.statements if st.name in self.buffers}

    def indices_of(self, name: str) -> tuple[str, ...]:
        """The indices of a buffer or of a statement a kernel stores."""
        return next(st.indices for k in self.kernels for st in k.statements if st.name == name)

    @property
    def buffers(self) -> tuple[str, ...]:
        return tuple(b for k in self.kernels for b in k.buffers)

    def outline(self, backend: str = "triton") -> Plan:
        """The kernels as a Plan, for any sizes (sizes then choose tiles and splits)."""
        return Plan(backend, tuple(Kernel(k.name, tuple(s.name for s in k.statements), k.why, k.loops)
                                   for k in self.kernels), self.buffers)

    def __str__(self) -> str:
        lines = [f"schedule: {len(self.kernels)} kernel(s), outputs {', '.join(self.outputs)}"
                 + (f", split={self.split}" if self.split else "")]
        lines += [str(k) for k in self.kernels]
        buffers = ", ".join(f"{b}[{', '.join(ix)}]" for b, ix in self.buffer_indices)
        lines.append(f"intermediate buffers: {buffers or 'none'}")
        if self.chunking is not None:
            lines.append(self.chunking.describe([k.name for k in self.kernels]))
        if self.recomputes:
            lines.append(f"recomputes the nested folds: it {self.recomputes}")
        if self.materialised is not None:
            lines.append("materialised (for the longer extents):")
            lines += ["  " + line for line in str(self.materialised).splitlines()]
        return "\n".join(lines)

