"""A reduction sharded across the ranks of a torch.distributed process group.

`Program.shard(index, group)` returns a ShardedProgram.  A call on each rank,
with that rank's contiguous part of `index` in its inputs:

1. all-gathers the part lengths (one int64 per rank), so that each rank knows
   where its part starts and how long the whole index is;
2. runs the local program (`passes/shard.py`): the state of every fold over
   the index, on this rank's part, with global positions in masks (a causal
   bound still skips what a part cannot see), states in float32;
3. all-gathers the states: one collective per state dtype, the states of
   every rank stacked in rank order (bytes moved per rank: (ranks - 1) x the
   state size, not the inputs);
4. runs the merge program: each fold becomes the fold over the ranks' states
   with the summary's own combine, in rank order, then the rest of each
   output's expression.  Every rank returns the whole outputs, in the dtype
   the unsharded program gives.

Gradients do not flow through a sharded call (a ShardError says so).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from .config import deep
from .errors import ShardError
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


class ShardedProgram:
    """A program whose reduction over one index is sharded across ranks."""

    def __init__(self, program: Program, index: str, group=None):
        self.program = program
        self.index = index
        self.group = group
        self.sharded: Sharded = deep(lambda: shard(program.factorised, index), what="the program",
                                     source=program.text)
        options = {k: v for k, v in program.schedule_options.items() if k != "float32_outputs"}
        # states stay float32 whatever the inputs' dtype (a bf16 running sum loses the merge)
        self.local = Program._of_ir(self.sharded.local, program.backend_name,
                                    float32_outputs=self.sharded.states, **options)
        self.merge = Program._of_ir(self.sharded.merge, program.backend_name, **options)
        self._local_inputs = {i.name for i in self.sharded.local.inputs}
        self._merge_inputs = {i.name for i in self.sharded.merge.inputs} - set(self.sharded.states)

    def __repr__(self) -> str:
        return f"<einfold.ShardedProgram {self.program.outputs} over {self.index}>"

    def _group_size_and_rank(self) -> tuple[int, int]:
        dist = torch.distributed
        if not (dist.is_available() and dist.is_initialized()):
            raise ShardError("a sharded program runs across the ranks of a torch.distributed process group, "
                             "and none is initialised: call torch.distributed.init_process_group first")
        return dist.get_world_size(self.group), dist.get_rank(self.group)

    def __call__(self, *args, **inputs):
        """Run on this rank's part of the inputs; every rank gets the whole outputs.

        Raises:
            BindError: the inputs do not fit the program (as for the program).
            ShardError: no process group, or an input requires grad.
        """
        if args:
            self.program._positional_error(args)
        if torch.is_grad_enabled() and any(isinstance(v, torch.Tensor) and v.requires_grad for v in inputs.values()):
            raise ShardError("gradients do not flow through a sharded program; call it under torch.no_grad() "
                             "or with inputs that do not require grad")
        world, rank = self._group_size_and_rank()
        binding = self.program.binder(inputs)            # names any mistake in the inputs
        lengths = self._gather(torch.tensor([binding.extents[self.index]], dtype=torch.int64,
                                            device=binding.device), world).view(-1).tolist()
        local = {k: v for k, v in inputs.items() if k in self._local_inputs}
        local[self.sharded.start] = float(sum(lengths[:rank]))
        local[self.sharded.total] = float(sum(lengths))
        states = self.local._run(local)
        states = states if isinstance(states, tuple) else (states,)
        merge = {k: v for k, v in inputs.items() if k in self._merge_inputs}
        if self.sharded.total in self._merge_inputs:
            merge[self.sharded.total] = float(sum(lengths))
        merge.update(self._exchange(dict(zip(self.sharded.states, states)), world))
        results = self.merge._run(merge)
        results = results if isinstance(results, tuple) else (results,)
        dtype = binding.dtype
        results = tuple(r.to(dtype) if r.is_floating_point() else r for r in results)
        return results[0] if len(results) == 1 else results

    def _gather(self, flat: torch.Tensor, world: int) -> torch.Tensor:
        """Every rank's `flat` (one dimension), stacked in rank order: [world, n]."""
        out = torch.empty(world * flat.numel(), dtype=flat.dtype, device=flat.device)
        dist = torch.distributed
        gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor  # torch < 2.13
        gather(out, flat.contiguous(), group=self.group)
        return out.view(world, flat.numel())

    def _exchange(self, states: dict[str, torch.Tensor], world: int) -> dict[str, torch.Tensor]:
        """Every rank's states, [world, *shape] each: one all-gather per dtype."""
        out = {}
        for dtype in dict.fromkeys(s.dtype for s in states.values()):
            names = [n for n, s in states.items() if s.dtype == dtype]
            gathered = self._gather(torch.cat([states[n].reshape(-1) for n in names]), world)
            at = 0
            for n in names:
                size = states[n].numel()
                out[n] = gathered[:, at:at + size].reshape(world, *states[n].shape)
                at += size
        return out

    def plan(self, *args, **inputs) -> ShardedPlan:
        """What a call with these inputs (this rank's part) runs; nothing runs."""
        if args:
            self.program._positional_error(args)
        world, _ = self._group_size_and_rank()
        binding = self.program.binder(inputs)
        local = {k: v for k, v in inputs.items() if k in self._local_inputs}
        local.update({self.sharded.start: 0.0, self.sharded.total: 0.0})
        local_plan = self.local.plan(**local)
        device = binding.device
        states = {}
        for s in self.sharded.local.statements:
            shape = [world, *(binding.extents[ix] for ix in s.indices)]
            dtype = torch.float32 if s.dtype == "float" else torch.int64
            states[s.name] = torch.empty(shape, dtype=dtype, device=device)
        merge = {k: v for k, v in inputs.items() if k in self._merge_inputs}
        if self.sharded.total in self._merge_inputs:
            merge[self.sharded.total] = 0.0
        merge_plan = self.merge.plan(**merge, **states)
        size = sum(t[0].numel() * t.element_size() for t in states.values())
        exchange = (f"all-gather of {len(states)} state tensor(s) ({', '.join(states)}), "
                    f"{size} bytes per rank, {size * (world - 1)} bytes received by each of {world} ranks")
        return ShardedPlan(local_plan, exchange, merge_plan)

    def explain(self) -> str:
        """The unsharded derivation, then the local and merge programs."""
        return f"{self.program.explain()}\n{self.sharded}"
