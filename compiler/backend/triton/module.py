"""Assemble a complete generated module: header, helpers, combine functions,
kernels and a launcher that runs them in order; and the Plan that describes it.

Split reductions (flash-decoding).  A kernel whose program folds are
independent can split each fold's loop over N programs per output tile: the
`_partial` kernel writes every field of each program's summary state to a
buffer, and the last of a tile's N programs to finish (an atomic arrival
counter) calls the `_merge` function, which folds the N states in order with
the summary's combine (the rescaled merge for rescaled fields), finalizes and
runs the rest of the kernel: one launch.  How many ways a kernel splits, and
why, is the specialisation stage's decision (compiler.specialise: the schedule's
split policy, compiler.schedule.tiles.auto_split, at the call's sizes); this
module builds what it decided."""
from __future__ import annotations

from dataclasses import dataclass, replace

import torch

from ...ir import format_expr
from ...schedule import Kernel, KernelSchedule, Loop, Plan
from ...specialise import ConcreteKernel, ConcreteSchedule
from . import hopper
from .emit import (PROGRAMS, Arg, KernelCode, KernelEmitter, ModuleContext, PartialEmitter, ScanTotalsEmitter,
                   TensorInfo)
from .ops import HELPERS
from .tuning import TIMING, binding, candidates, decorator


@dataclass
class Built:
    source: str
    plan: Plan
    launched: tuple[str, ...] = ()      # every kernel the launcher may launch (the plan's, and fallbacks)
    gluon: tuple[str, ...] = ()         # those of them in Gluon (the Hopper form), which torch cannot trace
    # some kernels run per chunk of an index, on views (schedule/chunks.py): the chunk's length, which
    # the launcher reads from its extents as CHUNK_LENGTH (0: none), so that the sizes whose chunks
    # differ in length alone share a module
    chunk_length: int = 0

    @property
    def chunked(self) -> bool:
        return self.chunk_length > 0


CHUNK_LENGTH = "chunk length"       # the launcher's extents hold a chunked run's length under this key


def packed_strides(args: list[Arg]) -> list[str]:
    """The launcher's expressions for `args`, each tensor's strides `t["X"].stride(0)`,
    ..., `.stride(r - 1)` passed as `*t["X"].stride()`: one call per tensor on the
    host's hot path instead of one per dimension (a kernel takes every stride of
    a tensor it reads, consecutively and in order: KernelEmitter.tensor_params)."""
    return [f'*t["{a.name}"].stride()' if a.kind == "stride" else str(a) for a in args
            if a.kind != "stride" or a.dim == 0]


def tile_count(index: str, block: int | str | None, optional: bool) -> str:
    """The launcher's count of programs along one grid index: its extent where each
    value is a program (`block` None or 1), else a ceil-division by the tile (a value,
    or the name of one) in plain integer arithmetic (triton.cdiv costs microseconds
    per host call), parenthesised so that it stays one factor of a product; an
    optional index launches at least one."""
    extent = f'n["{index}"]'
    if block in (None, 1):
        return f"max({extent}, 1)" if optional else extent
    rounded_up = f"{extent} + {block - 1}" if isinstance(block, int) else f"{extent} + {block} - 1"
    count = f"({rounded_up}) // {block}"
    return f"max({count}, 1)" if optional else f"({count})"


def program_count(code: KernelCode, block_of) -> str:
    """The launcher's expression for the number of programs along grid axis 0 of
    `code`: the product of one tile count per grid index (code.grid_blocks), exact
    whatever the factors' order.  `block_of(name)` gives a tile constexpr: its value
    in an untuned launch, `META["BLOCK_x"]` in the autotuner's grid.  Every launch
    of a tl kernel and the size of its arrival counters use it."""
    factors = [tile_count(index, None if block is None else block_of(block), index in code.optional)
               for index, block in code.grid_blocks]
    return " * ".join(factors) or "1"


def scanned_loops(kernel: ConcreteKernel) -> tuple[Loop, ...]:
    """The kernel's loops for its plan: a scan kernel's prefix folds stream no loop of
    their own (those whose loop folds nothing else go); the loop over the index it runs
    in order scans them, around the others' loops (a grid index) or as the epilogue's
    loop, after them."""
    spec = kernel.schedule
    prefixes = [f for f in kernel.folds if f.prefix is not None]
    if not kernel.scan or not prefixes:
        return spec.loops

    relations = tuple(dict.fromkeys(format_expr(f.prefix.conjunct) for f in prefixes))

    def kept(loop: Loop) -> Loop | None:
        if loop.prefix and loop.indices in {(f.prefix.index,) for f in prefixes}:
            return None
        # a loop the prefix folds shared with others: its bounds were theirs
        return replace(loop, inner=tuple(filter(None, map(kept, loop.inner))),
                       bounds=tuple(b for b in loop.bounds if b not in relations))
    names = tuple(dict.fromkeys(f.fold.summary.name for f in prefixes))
    others = tuple(filter(None, map(kept, (loop for loop in spec.loops if loop.folds))))
    scan = Loop((kernel.scan,), names, scans=relations, reverse=kernel.scan_reverse)
    return (*others, scan) if kernel.scan_epilogue else (replace(scan, inner=others),)


class ModuleBuilder:
    def __init__(self, concrete: ConcreteSchedule, passes: tuple[str, ...]):
        schedule = concrete.schedule
        self.concrete = concrete
        self.program = schedule.program
        self.outputs = schedule.outputs
        self.schedule = schedule
        self.sig = signature = concrete.signature
        self.passes = passes
        self.ctx = ModuleContext(signature, dict(schedule.fresh_names))
        # the launcher's tensor table holds inputs, statements and buffers by name; the
        # module's globals are the kernels (their split variants included)
        self.ctx.reserved |= {i.name for i in self.program.inputs} | {s.name for s in self.program.statements}
        self.ctx.reserved |= set(schedule.buffers)
        self.ctx.module_names |= {spec.name + suffix for spec in schedule.kernels
                                  for suffix in ("", "_partial", "_merge")}
        self.run = run = schedule.chunking
        if run is not None:
            self.ctx.chunking = run
            self.ctx.chunked_kernels = frozenset(k.name for k in schedule.kernels[run.first:run.last + 1])
        self.kernels: list[tuple[KernelCode, int]] = []     # (kernel, n_split of its group)
        self.tuned: dict[str, str] = {}                      # kernel name -> its @triton.autotune line
        self.configs: dict[str, list] = {}                   # a tuned split kernel's name -> its candidates
        self.hopper: dict[str, hopper.HopperCode] = {}       # tl kernel name -> its Hopper form
        self.notes: list[str] = []

    def _register(self, spec: KernelSchedule) -> None:
        for st in spec.statements:
            self.ctx.tensors[st.name] = TensorInfo("tensor", len(st.indices), self.concrete.dtype(st.name))

    def build(self) -> Built:
        plan_kernels: list[Kernel] = []
        buffers: list[str] = []
        for kernel in self.concrete.kernels:
            spec = kernel.schedule
            self._register(spec)
            n_split, why = kernel.split, kernel.split_why
            if n_split > 1:
                # one launch: the last program of each tile calls the merge (PartialEmitter.finish);
                # tuned like any kernel where its table tunes a tile (a direct launch costs a tuned
                # kernel no more host time than an untuned one: launch.py)
                partial = PartialEmitter(self.ctx, kernel).build()
                (merge,) = partial.functions
                self.kernels.append((partial, n_split))
                if kernel.candidates:
                    self.configs[partial.name] = candidates(partial, kernel.candidates)
                    self.tuned[partial.name] = decorator(partial, self.configs[partial.name])
                streamed = spec.loops
                merged = Loop((), tuple(dict.fromkeys(f.summary.name for f in spec.program_folds)))
                plan_kernels.append(Kernel(partial.name, (*partial.writes, *merge.writes),
                                           f"{partial.why}; the program folds split over {n_split} programs per "
                                           f"tile ({why}), each writing its summary state; the last of a tile "
                                           f"merges the {n_split} states in order with the combine, finalizes "
                                           f"and stores ({merge.name}, called: one launch)",
                                           (*(loop for loop in streamed if loop.folds), merged,
                                            *(loop for loop in streamed if not loop.folds))))
                buffers += [b for b, _, _ in partial.buffers]
            else:
                if kernel.scan_chunks > 1:
                    # the chunks' totals first (a kernel of its own), then the scan from them
                    totals = ScanTotalsEmitter(self.ctx, kernel).build()
                    self.kernels.append((totals, kernel.scan_chunks))
                    if kernel.candidates:
                        self.tuned[totals.name] = decorator(totals, candidates(totals, kernel.candidates))
                    plan_kernels.append(Kernel(totals.name, totals.writes, f"{totals.why} "
                                               f"({kernel.scan_chunks} chunks: {kernel.scan_chunks_why})",
                                               scanned_loops(kernel)))
                    buffers += [b for b, _, _ in totals.buffers]
                code = KernelEmitter(self.ctx, kernel).build()
                if why:
                    self.notes.append(f"{spec.name}: {why}")
                self.kernels.append((code, kernel.scan_chunks))
                if kernel.candidates:
                    self.tuned[code.name] = decorator(code, candidates(code, kernel.candidates))
                form = self._hopper_form(kernel)
                if form is None:
                    plan_kernels.append(Kernel(code.name, code.writes, code.why + (f" ({why})" if why else ""),
                                               scanned_loops(kernel)))
                else:
                    plan_kernels.append(Kernel(form.name, code.writes, f"{form.why} (the tl kernel {code.name} "
                                               f"where TMA cannot read the operands)", spec.loops))
            buffers += list(spec.buffers)
        launched = tuple(code.name for code, _ in self.kernels) + tuple(form.name for form in self.hopper.values())
        gluon = tuple(form.name for form in self.hopper.values())
        chunks = self.run.describe([k.name for k in plan_kernels]) if self.run is not None else ""
        return Built(self.source(), Plan("triton", tuple(plan_kernels), tuple(buffers), chunks), launched, gluon,
                     self.run.size if self.run is not None else 0)

    def _hopper_form(self, kernel: ConcreteKernel) -> hopper.HopperCode | None:
        """The kernel's Hopper form (hopper.py) where the specialised kernel takes it
        (specialise.forms); why not, as a note of the module, where it is a Hopper
        GPU's kernel of a rescaled fold."""
        spec = kernel.schedule
        why = kernel.form_why
        if kernel.form is not None:
            if not hopper.gluon_available():
                why = "not in the Hopper form: this Triton has no Gluon for Hopper"
            else:
                name = spec.name + "_hopper"
                self.ctx.module_names.add(name)
                form = hopper.emit(kernel.form, spec, self.ctx, name)
                if isinstance(form, hopper.HopperCode):
                    self.hopper[spec.name] = form
                    return form
                why = f"not in the Hopper form: {form}"
        if why:
            self.notes.append(f"{spec.name}: {why}")
        return None

    # ------------------------------------------------------------ source
    def header(self) -> list[str]:
        lines = ["# Generated by einfold's triton backend. Do not edit: regenerated from the source below.",
                 "#", "# source:"]
        lines += [f"#   {line}" for line in (self.program.source or "").replace("\0", "\\x00").strip().splitlines()] or ["#   (none)"]
        lines.append(f"# passes (compiler.passes.PIPELINE): {', '.join(self.passes) or 'none'}")
        lines.append(f"# outputs: {', '.join(self.outputs)}; float results in {self.sig.dtype}")
        # no extent is written into the module: every size whose decisions give this text runs
        # it (cache.load shares modules by their text)
        lines.append("# extents: launch arguments; the tiles, masks and splits below are those "
                     "`einfold ir --print-after specialise` prints for them")
        if self.sig.interpret:
            bfloat16 = any(dtype == torch.bfloat16 for _, _, _, dtype in self.sig.inputs)
            lines.append("# for Triton's interpreter" + (" (bfloat16 tl.dot operands widened to float32)"
                                                         if bfloat16 else ""))
        lines += [f"# note: {n}" for n in self.notes]
        return lines

    def scratch(self) -> list[str]:
        """`scratch(n, device)`: the split kernels' partial states and arrival counters,
        which a caller may keep across launches on one stream (the counters return to 0
        at the end of each launch); only in a module with split kernels."""
        lines = ["def scratch(n, device):",
                 '    """The buffers of the split kernels (partial states, arrival counters at 0) by name:',
                 '    kept by the caller across launches on one stream, or made by launch."""',
                 "    return {"]
        for code, n_split in self.kernels:
            # one counter per program at the smallest tiles a candidate may take
            smallest = {b: min([size, *(blocks[b] for blocks, *_ in self.configs.get(code.name, ()))])
                        for b, size in code.constexprs.items()}
            for name, shape, dtype in code.buffers:
                allocate = "torch.zeros" if name in code.zeroed else "torch.empty"
                size = ", ".join(program_count(code, smallest.__getitem__) if s == PROGRAMS
                                 else str(n_split) if s == "n_split" else s for s in shape)
                lines.append(f'        "{name}": {allocate}(({size},), dtype={dtype}, device=device),')
        lines.append("    }")
        return lines

    def launch_lines(self, code: KernelCode, n_split: int) -> list[str]:
        """The launcher's lines that launch one kernel (tl)."""
        lines = []
        if code.split_axis or n_split > 1:
            lines.append(f"    n_split = {n_split}")
        args = packed_strides([arg for _, arg in code.params])
        if code.name in self.tuned:
            # the autotuner binds every tile (each candidate is complete): the grid follows its choice
            grid = program_count(code, lambda block: f'META["{block}"]')
            sizes = " and ".join(f'n["{g}"] > 0' for g, _ in code.grid_blocks if g not in code.optional) or "True"
            second = " n_split" if code.split_axis else ""
            lines.append(f"    grid = lambda META: ({grid},{second})")
            lines.append(f"    if {sizes}:                       # an empty output launches nothing")
            lines.append(f"        {code.name}[grid](")
        else:
            # every constexpr, as each autotune candidate would bind it (tuning.binding)
            blocks = binding(code)
            args += [f"{k}={v}" for k, v in blocks.items()]
            grid = program_count(code, blocks.__getitem__)
            dims = "grid, n_split" if code.split_axis else "grid,"
            lines.append(f"    grid = {grid}")
            lines.append("    if grid > 0:                       # an empty output launches nothing")
            lines.append(f"        {code.name}[({dims})](")
        lines.append("            " + ", ".join(args) + ")")
        return lines

    def launcher(self) -> list[str]:
        kept = [name for code, _ in self.kernels for name, _, _ in code.buffers]
        lines = ["def launch(t, n, device):",
                 '    """Run the kernels in order.  t: tensors and numbers by name (inputs, outputs;',
                 f'    buffers{" and scratch" if kept else ""} are added); n: extent of every index by name."""']
        if kept:
            lines.append(f'    if "{kept[0]}" not in t:')
            lines.append("        t.update(scratch(n, device))")
        run = self.run
        for position, (code, n_split) in enumerate(self.kernels):
            launch = [f"    # {code.name}: {code.why}"]
            if code.name in self.hopper:
                launch += self.hopper[code.name].launch
                launch.append("    else:                       # TMA cannot read the operands: the tl kernel")
                launch += ["    " + line for line in self.launch_lines(code, n_split)]
            else:
                launch += self.launch_lines(code, n_split)
            if run is not None and position == run.first:
                lines += self.chunks_opened()
            if run is not None and run.first <= position <= run.last:
                launch = ["    " + line for line in launch]
            lines += launch
            if run is not None and position == run.last:
                lines += self.chunks_closed()
        # what sorted loops read, prepared once per launch: each integer input's stable order, each
        # value's start in it (emit.Arg.prepared)
        prepared = dict(arg.prepared for code, _ in self.kernels for _, arg in code.params if arg.prepared)
        lines[3:3] = [f'    t["{key}"] = {expression}' for key, expression in prepared.items()]
        for spec in self.schedule.kernels:
            for b in spec.buffers:
                chunked = run is not None and b in run.buffers
                shape = ", ".join(f'min(n["{CHUNK_LENGTH}"], n["{i}"])' if chunked and i in run.names
                                  else f'n["{i}"]' for i in self.schedule.indices_of(b))
                lines.insert(3, f'    t["{b}"] = torch.empty(({shape}{"," if shape else ""}), '
                                f'dtype={self.concrete.dtype(b)}, device=device)')
        return lines

    def chunks_opened(self) -> list[str]:
        """The launcher's head of a chunked run (schedule/chunks.py): the loop over the
        chunks, each with the chunk's extents and views of the tensors along the index.
        An output summed over the index is a float32 sum that starts at zero, to which each
        chunk's kernel adds its sum (KernelEmitter.store), copied to the output after the
        last chunk."""
        run = self.run
        x = run.index
        first = self.kernels[run.first][0].name
        last = self.kernels[run.last][0].name
        # the length and why are the call's (the plan prints them): the sizes whose chunks differ in
        # length alone share this module
        lines = [f"    # {first} to {last}: in chunks of {x}, each buffer within the largest input",
                 "    whole, whole_t = n, t"]
        if run.accumulated:
            lines.append(f"    sums = {{}}          # the chunks add their sums over {x} to these, in float32")
        for name in run.accumulated:
            shape = "".join(f'n["{i}"], ' for i in self.schedule.indices_of(name)).rstrip(" ")
            lines.append(f'    sums["{name}"] = torch.zeros(({shape}), dtype={self.concrete.dtype(name)}, '
                         f'device=device)')
        lengths = ", ".join(f'"{i}": length' for i in run.names)
        views = [f'"{tensor}": whole_t["{tensor}"].narrow({dim}, start, length)' for tensor, dim in run.narrowed]
        views += [f'"{name}": sums["{name}"]' for name in run.accumulated]
        lines += [f'    for start in range(0, whole["{x}"], whole["{CHUNK_LENGTH}"]):',
                  f'        length = min(whole["{CHUNK_LENGTH}"], whole["{x}"] - start)',
                  f"        n = {{**whole, {lengths}}}",
                  f"        t = {{**whole_t, {', '.join(views)}}}"]
        return lines

    def chunks_closed(self) -> list[str]:
        # the output takes the sum in its own dtype (a bfloat16 gradient: rounded once)
        return ["    n, t = whole, whole_t"] + [f'    t["{name}"].copy_(sums["{name}"])' for name in self.run.accumulated]

    def source(self) -> str:
        parts = ["\n".join(self.header()), "import torch\nimport triton\nimport triton.language as tl"]
        if self.hopper:
            parts.append(hopper.PRELUDE.rstrip())
        parts += [HELPERS[h].rstrip() for h in sorted(self.ctx.helpers)]
        gl_helpers = sorted({h for form in self.hopper.values() for h in form.helpers})
        parts += [hopper.gl_helper(h).rstrip() for h in gl_helpers]
        parts += [src.rstrip() for _, src in self.ctx.combines.values()]
        if self.tuned:
            parts.append(TIMING)
        for code, _ in self.kernels:
            parts += [f.source.rstrip() for f in code.functions]
            parts.append((f"{self.tuned[code.name]}\n" if code.name in self.tuned else "") + code.source.rstrip())
            if code.name in self.hopper:
                parts.append(self.hopper[code.name].source.rstrip())
        if any(code.buffers for code, _ in self.kernels):
            parts.append("\n".join(self.scratch()))
        parts.append("\n".join(self.launcher()))
        return "\n\n\n".join(parts) + "\n"
