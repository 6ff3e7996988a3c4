"""A reduction sharded across the ranks of a torch.distributed process group.

`Program.shard(index, group, layout)` returns a ShardedProgram.  A call on each
rank, with that rank's parts of `index` in its inputs (one part, or two for the
zigzag layout):

1. all-gathers the part lengths (one int64 per rank), so that each rank knows
   where its part starts and how long the whole index is;
2. runs the local program (`passes/shard.py`) on each part: the state of every
   fold over the index, with global positions in masks (a causal bound still
   skips what a part cannot see), states in float32;
3. all-gathers the states: one collective per state dtype, the states of
   every rank stacked in rank order (bytes moved per rank: (ranks - 1) x the
   state size, not the inputs);
4. runs the merge program: each fold becomes the fold over the parts' states
   with the summary's own combine, in global order, then the rest of each
   output's expression.  Every rank returns the whole of each output that does
   not vary over the index and its parts of the others, in the dtype the
   unsharded program gives.

Under autograd the forward also returns the row statistics its gradient reads
(`Program._saving`), and the backward runs the gradient program sharded the
same way (`_ShardedCall`).
"""
from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property

import torch

from .config import deep
from .errors import ShardError
from .ir import Access, walk
from .passes.shard import Sharded, shard
from .program import Program
from .schedule import Plan


@dataclass(frozen=True)
class ShardedPlan:
    """What a sharded call runs: the local kernels, the exchange, the merge."""

    local: Plan
    exchange: str
    merge: Plan

    def __str__(self) -> str:
        return (f"local (each rank, on its part):\n{_indented(self.local)}\n"
                f"exchange: {self.exchange}\n"
                f"merge (each rank, on every rank's states):\n{_indented(self.merge)}")


def _indented(plan: Plan) -> str:
    return "\n".join("  " + line for line in str(plan).splitlines())


LAYOUTS = ("contiguous", "zigzag")


class ShardedProgram:
    """A program whose reduction over one index is sharded across ranks.

    Layouts of the index over W ranks: "contiguous" (rank r holds the r-th of W
    parts), or "zigzag" (the index cut into 2W parts; rank r holds parts r and
    2W - 1 - r, in that order: under a causal mask every rank then has the same
    work, as in PyTorch's load-balanced context parallelism).  Parts may differ
    in length; a zigzag rank's two parts are the halves of its local extent."""

    def __init__(self, program: Program, index: str, group=None, layout: str = "contiguous"):
        if layout not in LAYOUTS:
            raise ShardError(f"layout must be one of {', '.join(LAYOUTS)}, not {layout!r}")
        self.program = program
        self.index = index
        self.group = group
        self.layout = layout
        self.sharded: Sharded = deep(lambda: shard(program.factorised, index), what="the program",
                                     source=program.text)
        options = {k: v for k, v in program.schedule_options.items() if k != "float32_outputs"}
        # states stay float32 whatever the inputs' dtype (a bf16 running sum loses the merge)
        self.local = Program._of_ir(self.sharded.local, program.backend_name,
                                    float32_outputs=self.sharded.states, **options)
        self.merge = Program._of_ir(self.sharded.merge, program.backend_name, **options)
        self._local_inputs = {i.name for i in self.sharded.local.inputs}
        self._merge_inputs = {i.name for i in self.sharded.merge.inputs} - set(self.sharded.states)
        # tensor -> its dimensions indexed by a sharded index (where a part is cut)
        self._cut: dict[str, tuple[int, ...]] = {}
        for st in program.checked.statements:
            for node in walk(st.expr):
                if isinstance(node, Access):
                    dims = tuple(d for d, ix in enumerate(node.indices) if ix in self.sharded.indices)
                    if dims:
                        self._cut[node.tensor] = dims
        statements = {st.name: st for st in program.checked.statements}
        # outputs over the sharded index: the merge runs once per part and they are joined
        self._joined = {o: next((d for d, ix in enumerate(statements[o].indices) if ix in self.sharded.indices), None)
                        for o in program.outputs}
        self._merge_per_part = (any(d is not None for d in self._joined.values())
                                or self.sharded.start in self._merge_inputs)
        self._gradients: dict[tuple[str, ...], ShardedProgram] = {}     # wrt -> sharded gradient program

    def __repr__(self) -> str:
        return f"<einfold.ShardedProgram {self.program.outputs} over {self.index} ({self.layout})>"

    def _group_size_and_rank(self) -> tuple[int, int]:
        dist = torch.distributed
        if not (dist.is_available() and dist.is_initialized()):
            raise ShardError("a sharded program runs across the ranks of a torch.distributed process group, "
                             "and none is initialised: call torch.distributed.init_process_group first")
        return dist.get_world_size(self.group), dist.get_rank(self.group)

    def _parts(self, lengths: torch.Tensor, rank: int, world: int, extent: int):
        """This rank's parts as (local slice, global start: a 0-d float32 tensor on the
        device), and for each part in global order its position among the gathered
        parts (rank-major)."""
        if self.layout == "contiguous":
            starts = torch.cumsum(lengths, 0) - lengths
            return [(slice(0, extent), starts[rank])], list(range(world))
        if extent % 2:
            raise ShardError(f"the zigzag layout cuts each rank's part of '{self.index}' in two halves, and this "
                             f"rank's part has an odd length ({extent})")
        half = lengths // 2
        ordered = torch.cat([half, half.flip(0)])            # the lengths of the 2W parts, in global order
        starts = torch.cumsum(ordered, 0) - ordered
        mine = [(slice(0, extent // 2), starts[rank]), (slice(extent // 2, extent), starts[2 * world - 1 - rank])]
        order = [2 * g if g < world else 2 * (2 * world - 1 - g) + 1 for g in range(2 * world)]
        return mine, order

    def _narrowed(self, inputs: dict, names, part: slice) -> dict:
        out = {}
        for k, v in inputs.items():
            if k not in names:
                continue
            for d in self._cut.get(k, ()) if isinstance(v, torch.Tensor) else ():
                v = v.narrow(d, part.start, part.stop - part.start)
            out[k] = v
        return out

    def __call__(self, *args, **inputs):
        """Run on this rank's part of the inputs; every rank gets the whole of each
        output that does not vary over the sharded index, and its part of the others.

        Under autograd (an input requires grad), the outputs carry a grad_fn
        whose backward runs the gradient program sharded the same way.

        Raises:
            BindError: the inputs do not fit the program (as for the program).
            ShardError: no process group, or a zigzag part of odd length.
        """
        if args:
            self.program._positional_error(args)
        if torch.is_grad_enabled() and any(isinstance(v, torch.Tensor) and v.requires_grad for v in inputs.values()):
            names = tuple(i.name for i in self.program.checked.inputs)
            if inputs.keys() != set(names):
                self.program.binder(inputs)      # names what is wrong (a BindError)
            results = _ShardedCall.apply(self, names, *(inputs[n] for n in names))
            return results[0] if len(results) == 1 else results
        return self._run(inputs)

    def _run(self, inputs: dict):
        """The outputs for this rank's `inputs`, outside autograd."""
        world, rank = self._group_size_and_rank()
        binding = self.program.binder(inputs)            # names any mistake in the inputs
        extent = binding.extents[self.index]
        lengths = self._gather(torch.tensor([extent], dtype=torch.int64, device=binding.device), world).view(-1)
        # starts and the whole length stay on the device as 0-d tensors, which kernels
        # load: reading them on the host would wait for the GPU at every call
        parts, order = self._parts(lengths, rank, world, extent)
        total = lengths.sum().to(torch.float32)
        states: dict[str, list[torch.Tensor]] = {n: [] for n in self.sharded.states}
        for part, start in parts:
            local = self._narrowed(inputs, self._local_inputs, part)
            local.update({self.sharded.start: start.to(torch.float32), self.sharded.total: total})
            found = self.local._run(local)
            for n, t in zip(self.sharded.states, found if isinstance(found, tuple) else (found,)):
                states[n].append(t)
        if not self.sharded.ordered:        # commutative merges take the states as gathered
            order = list(range(len(order)))
        gathered = self._exchange({n: ts[0].unsqueeze(0) if len(ts) == 1 else torch.stack(ts)
                                   for n, ts in states.items()}, world, order)
        merges = []
        for part, start in (parts if self._merge_per_part else parts[:1]):
            merge = self._narrowed(inputs, self._merge_inputs, part)
            merge.update({k: v for k, v in {self.sharded.start: start.to(torch.float32),
                                             self.sharded.total: total}.items() if k in self._merge_inputs})
            found = self.merge._run({**merge, **gathered})
            merges.append(found if isinstance(found, tuple) else (found,))
        results = tuple(torch.cat([m[k] for m in merges], self._joined[o]) if self._joined[o] is not None
                        else merges[0][k] for k, o in enumerate(self.program.outputs))
        wide = self.program.schedule_options.get("float32_outputs", ())
        results = tuple(r.to(binding.float_dtype(o in wide)) if r.is_floating_point() else r
                        for o, r in zip(self.program.outputs, results))
        return results[0] if len(results) == 1 else results

    @cached_property
    def _saving(self) -> ShardedProgram:
        """The program's saving forward (its outputs, then the row statistics its
        gradient programs read), sharded like this one."""
        return ShardedProgram(self.program._saving, self.index, self.group, self.layout)

    def _gradient(self, wrt: tuple[str, ...]) -> ShardedProgram:
        """The gradient program for `wrt` (reading the saved statistics), sharded like
        this one (made on first use, then kept)."""
        if wrt not in self._gradients:
            self._gradients[wrt] = ShardedProgram(self.program._gradient(wrt, saved=True), self.index,
                                                  self.group, self.layout)
        return self._gradients[wrt]

    def _gather(self, flat: torch.Tensor, world: int) -> torch.Tensor:
        """Every rank's `flat` (one dimension), stacked in rank order: [world, n]."""
        out = torch.empty(world * flat.numel(), dtype=flat.dtype, device=flat.device)
        dist = torch.distributed
        gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor  # torch < 2.13
        gather(out, flat.contiguous(), group=self.group)
        return out.view(world, flat.numel())

    def _exchange(self, states: dict[str, torch.Tensor], world: int, order: list[int]) -> dict[str, torch.Tensor]:
        """Every rank's states ([parts, *shape] each) as [parts of every rank in global
        order, *shape]: one all-gather per dtype."""
        out = {}
        for dtype in dict.fromkeys(s.dtype for s in states.values()):
            names = [n for n, s in states.items() if s.dtype == dtype]
            gathered = self._gather(torch.cat([states[n].reshape(-1) for n in names]), world)
            at = 0
            for n in names:
                size = states[n].numel()
                every = gathered[:, at:at + size].reshape(world * states[n].shape[0], *states[n].shape[1:])
                out[n] = every if order == list(range(len(order))) else every[order]
                at += size
        return out

    def plan(self, *args, **inputs) -> ShardedPlan:
        """What a call with these inputs (this rank's part) runs; nothing runs."""
        if args:
            self.program._positional_error(args)
        world, _ = self._group_size_and_rank()
        binding = self.program.binder(inputs)
        device = binding.device
        extent = binding.extents[self.index]
        parts = 1 if self.layout == "contiguous" else 2
        first = slice(0, extent // parts)
        position = torch.zeros((), dtype=torch.float32, device=device)
        local = self._narrowed(inputs, self._local_inputs, first)
        local.update({self.sharded.start: position, self.sharded.total: position})
        local_plan = self.local.plan(**local)
        states = {}
        for s in self.sharded.local.statements:
            shape = [world * parts, *(binding.extents[ix] for ix in s.indices)]
            dtype = torch.float32 if s.dtype == "float" else torch.int64
            states[s.name] = torch.empty(shape, dtype=dtype, device=device)
        merge = self._narrowed(inputs, self._merge_inputs, first)
        merge.update({k: position for k in (self.sharded.start, self.sharded.total) if k in self._merge_inputs})
        merge_plan = self.merge.plan(**merge, **states)
        size = parts * sum(t[0].numel() * t.element_size() for t in states.values())
        exchange = (f"{self.layout} layout, {parts} part(s) per rank; all-gather of {len(states)} state "
                    f"tensor(s) ({', '.join(states)}), {size} bytes per rank, {size * (world - 1)} bytes "
                    f"received by each of {world} ranks")
        return ShardedPlan(local_plan, exchange, merge_plan)

    def explain(self) -> str:
        """The unsharded derivation, then the local and merge programs."""
        return f"{self.program.explain()}\n{self.sharded}"


class _ShardedCall(torch.autograd.Function):
    """A sharded call under autograd.  The forward runs the sharded saving forward
    (outputs plus row statistics); the backward runs the gradient program, sharded
    the same way: gradients of inputs indexed by the sharded index come out as
    this rank's part, the others whole (every rank holds the whole loss)."""

    @staticmethod
    def forward(ctx, sharded: ShardedProgram, names: tuple[str, ...], *values):
        saving = sharded._saving
        results = saving._run(dict(zip(names, values)))
        results = results if isinstance(results, tuple) else (results,)
        shown = len(sharded.program.outputs)
        ctx.sharded, ctx.names = sharded, names
        ctx.numbers = {n: v for n, v in zip(names, values) if not isinstance(v, torch.Tensor)}
        ctx.mark_non_differentiable(*results[shown:])
        ctx.save_for_backward(*(v for v in values if isinstance(v, torch.Tensor)), *results)
        ctx.saving_outputs = saving.program.outputs
        return results[:shown]

    @staticmethod
    def backward(ctx, *upstream):
        sharded, names = ctx.sharded, ctx.names
        saved = iter(ctx.saved_tensors)
        inputs = {n: ctx.numbers[n] if n in ctx.numbers else next(saved) for n in names}
        produced = dict(zip(ctx.saving_outputs, saved))
        wrt = tuple(n for n, needed in zip(names, ctx.needs_input_grad[2:]) if needed)
        if not wrt:
            return (None, None, *(None for _ in names))
        gradient = sharded._gradient(wrt)
        program = gradient.program
        call = {**inputs, **{k: v for k, v in produced.items() if k in program.inputs}}
        for o, g in zip(sharded.program.outputs, upstream):
            if o in program.upstream:           # float outputs; one backward() did not reach: zeros
                call[program.upstream[o]] = torch.zeros_like(produced[o]) if g is None else g.contiguous()
        results = gradient._run(program._read(call))
        results = dict(zip(wrt, results if isinstance(results, tuple) else (results,)))
        return (None, None, *(results[n].to(inputs[n].dtype) if n in results else None for n in names))
