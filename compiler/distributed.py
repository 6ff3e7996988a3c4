"""A reduction sharded across the ranks of a torch.distributed process group.

`Program.shard(index, group, layout)` returns a ShardedProgram.  A call on each
rank, with that rank's parts of `index` in its inputs (one part, or two for the
zigzag layout):

1. exchanges the part lengths between the hosts (`_lengths`: one int64 per
   rank, over a group that moves CPU tensors, `_host_group`), so that each rank
   knows where its part starts and how long the whole index is, and no call
   waits for the GPU; a rank whose inputs do not bind stops every rank;
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

With `rows` (context parallelism: the queries sharded as well), each rank holds
its part of the rows and of `index`; the states of its rows need every part
of `index`, so the inputs over `index` (K and V) travel around a ring of the
ranks instead: at each of W steps a rank sends the part it holds to the next
rank while it runs the local program on that part, and receives the previous
rank's (on a GPU from a stream of its own: `_pass_on`).  Each local call writes
its states into its slot of one buffer per row part; the W (zigzag: 2W) states
of its rows then merge in global order with the same merge program; nothing
else is exchanged.  What a call runs follows from every rank's part lengths
and is decided once per lengths (`_Ring`).  A fold that reads only the
travelling inputs is computed once by their owner and travels in their place
(`Sharded.precomputed`); a pair of parts a mask hides whole is not run.  Under
autograd the backward is two rings: gradients over the rows on this one,
gradients over `index` on one where the inputs over the rows travel.
"""
from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property

import torch

from .compiled import CompiledProgram
from .config import deep
from .errors import EinfoldError, ShardError
from .ir import Access, Const, Extent, Reduce, constant, transform, walk
from .passes.shard import Sharded, shard
from .schedule import Plan
from .schedule.bounds import Bound, index_bounds


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


def _part_extent(binding, index: str, rows: slice | None, row_indices: tuple[str, ...]) -> int:
    """The extent of `index` in one local call: a rows index takes its part's length."""
    return rows.stop - rows.start if rows is not None and index in row_indices else binding.extents[index]


def _indented(plan: Plan) -> str:
    return "\n".join("  " + line for line in str(plan).splitlines())


LAYOUTS = ("contiguous", "zigzag", "balanced")


@dataclass(frozen=True)
class _Ring:
    """What one ring call runs on this rank, decided on the host from every rank's
    part lengths (ShardedProgram._ring): the same lengths give the same ring."""

    row_parts: tuple[tuple[slice, int], ...]     # this rank's rows: (local slice, global start) per part
    # per step: (the part of the held index, its global start, the row part, the slot of its states)
    steps: tuple[tuple[tuple[slice, int, int, int], ...], ...]
    slots: tuple[int, ...]          # per row part: the states it merges (at least one: the identity's)
    empty: tuple[int, ...]          # row parts that no part of the index reaches
    incoming: tuple[int, ...]       # per step: the length of the part received for the next step
    totals: tuple[int, int]         # the global extents of the index and of the rows
    dtypes: tuple[torch.dtype, ...]  # the local program's states' (float32 at least)


@dataclass(frozen=True)
class _Transfer:
    """One ring step's sends and receives in flight (ShardedProgram._pass_on)."""

    requests: list
    received: dict[str, torch.Tensor]

    def wait(self) -> dict[str, torch.Tensor]:
        """The received tensors, once the current stream has waited for them (on a GPU
        the host does not wait)."""
        for r in self.requests:
            r.wait()
        return self.received


_HOST_GROUPS: dict = {}


def _host_group(group):
    """A process group of `group`'s ranks (None: the default group) that moves CPU
    tensors between the hosts: the group itself where a gloo backend serves it ("gloo",
    or "cpu:gloo,cuda:nccl"), else a gloo group beside it, made at its first use (by
    its ranks only: a sharded call is collective over them) and kept."""
    dist = torch.distributed
    if "gloo" in str(dist.get_backend(group)):
        return group
    group = dist.group.WORLD if group is None else group
    found = _HOST_GROUPS.get(group)
    if found is None:
        found = _HOST_GROUPS[group] = dist.new_group(dist.get_process_group_ranks(group), backend="gloo",
                                                     use_local_synchronization=True)
    return found


def _kept(cache: dict, key, value, limit: int = 64):
    """`value`, stored in `cache` under `key`; past `limit` entries the oldest goes
    (lengths that vary call to call: the latest are kept)."""
    if len(cache) >= limit:
        cache.pop(next(iter(cache)))
    cache[key] = value
    return value


def _on_device(positions: set[int], device: torch.device) -> dict[int, torch.Tensor]:
    """Each of `positions` as a 0-d int64 tensor on `device` (which kernels load), all
    from one copy."""
    every = sorted(positions)
    return dict(zip(every, torch.tensor(every, dtype=torch.int64, device=device).unbind()))


_RING_STREAMS: dict[torch.device, torch.cuda.Stream] = {}


def _ring_stream(device: torch.device) -> torch.cuda.Stream:
    """The stream that issues a ring's transfers on `device` (ShardedProgram._pass_on)."""
    found = _RING_STREAMS.get(device)
    if found is None:
        found = _RING_STREAMS[device] = torch.cuda.Stream(device)
    return found


class ShardedProgram:
    """A program whose reduction over one index is sharded across ranks.

    Layouts of the index over W ranks: "contiguous" (rank r holds the r-th of W
    parts), or "zigzag" (the index cut into 2W parts; rank r holds parts r and
    2W - 1 - r, in that order: under a causal mask every rank then has the same
    work, as in PyTorch's load-balanced context parallelism).  Parts may differ
    in length; a zigzag rank's two parts are the halves of its local extent.
    `Program.shard` makes one, passing itself as `program`."""

    def __init__(self, program, index: str, group=None, layout: str = "contiguous",
                 rows: str | None = None):
        if layout not in LAYOUTS:
            raise ShardError(f"layout must be one of {', '.join(LAYOUTS)}, not {layout!r}")
        self.program = program
        self.index = index
        self.group = group
        self.rows = rows
        self.sharded: Sharded = deep(lambda: shard(program.factorised, index, rows), what="the program",
                                     source=program.text)
        # per fold of the local program: the bounds on the sharded index that a mask puts
        # there relative to the rows (or to nothing), which can hide a whole pair of parts
        self._bounds: tuple[tuple[Bound, ...], ...] = tuple(
            tuple(b for ix in self.sharded.indices for b in index_bounds(fold).get(ix, ())
                  if b.other is None or b.other in self.sharded.rows or not self.sharded.rows)
            for fold in dict.fromkeys(st.expr for st in self.sharded.local.statements if isinstance(st.expr, Reduce)))
        # "balanced": zigzag where a mask bounds the index by another index (a causal mask:
        # contiguous parts would give rank 0 the keys every query sees), else contiguous
        self.layout = layout if layout != "balanced" else \
            "zigzag" if any(b.other is not None for bounds in self._bounds for b in bounds) else "contiguous"
        options = {k: v for k, v in program.schedule_options.items() if k != "float32_outputs"}
        # states stay float32 whatever the inputs' dtype (a bf16 running sum loses the merge)
        self.local = CompiledProgram._of_ir(self.sharded.local, program.backend_name,
                                            float32_outputs=self.sharded.states, **options)
        self.merge = CompiledProgram._of_ir(self.sharded.merge, program.backend_name, **options)
        ahead = self.sharded.precomputed
        # computed once by each rank on its own part, then travelling: float32 like the states
        self.precomputed = None if ahead is None else CompiledProgram._of_ir(
            ahead, program.backend_name, float32_outputs=ahead.outputs, **options)
        self._precomputed_inputs = set() if ahead is None else {i.name for i in ahead.inputs}
        self._local_inputs = {i.name for i in self.sharded.local.inputs}
        self._merge_inputs = {i.name for i in self.sharded.merge.inputs} - set(self.sharded.states)
        # a gradient program's saved statistics (float32 beside bf16 tensors) leave the dtype of
        # its parts' results, and of their tl.dots, to the other tensors, as in the program itself
        self.local.statistic_inputs = (frozenset(program.statistic_inputs) & self._local_inputs
                                       | frozenset(ahead.outputs if ahead is not None else ()))
        self.merge.statistic_inputs = frozenset(program.statistic_inputs) & self._merge_inputs
        # tensor -> its dimensions indexed by a sharded index (where a part is cut)
        self._cut: dict[str, tuple[int, ...]] = {}
        for st in program.checked.statements:
            for node in walk(st.expr):
                if isinstance(node, Access):
                    dims = tuple(d for d, ix in enumerate(node.indices) if ix in self.sharded.indices)
                    if dims:
                        self._cut[node.tensor] = dims
        for st in ahead.statements if ahead is not None else ():
            self._cut[st.name] = tuple(d for d, ix in enumerate(st.indices) if ix in self.sharded.indices)
        statements = {st.name: st for st in program.checked.statements}
        # outputs over the sharded index: the merge runs once per part and they are joined
        self._joined = {o: next((d for d, ix in enumerate(statements[o].indices) if ix in self.sharded.indices), None)
                        for o in program.outputs}
        self._merge_per_part = (any(d is not None for d in self._joined.values())
                                or self.sharded.start in self._merge_inputs)
        self._gradients: dict[tuple[str, ...], ShardedProgram] = {}     # wrt -> sharded gradient program
        # with rows: tensor -> its dimensions indexed by the rows index, and the tensors the ring moves
        self._row_cut: dict[str, tuple[int, ...]] = {}
        self._rings: dict[tuple, tuple[_Ring, dict]] = {}      # a ring call's key -> its ring (_ring)
        # without rows: (every rank's lengths, device) -> (this rank's parts, their positions on the device)
        self._placed: dict[tuple, tuple[list, dict]] = {}
        # the numbers a mask's bounds read (a window's width): part of a ring's key
        self._bound_numbers = tuple(sorted({n.tensor for bounds in self._bounds for b in bounds
                                            for n in walk(b.offset) if isinstance(n, Access)}
                                           & {i.name for i in program.checked.inputs if not i.rank}))
        if rows is not None:
            self._check_rows(statements)

    def _check_rows(self, statements: dict) -> None:
        """What sharding the rows as well needs of the program's inputs (see __call__);
        a statement read at both (a gradient's dP[i, m]) is computed where it is read."""
        inputs = {i.name for i in self.program.checked.inputs}
        for st in self.program.checked.statements:
            for node in walk(st.expr):
                if isinstance(node, Access) and node.tensor in inputs:
                    dims = tuple(d for d, ix in enumerate(node.indices) if ix in self.sharded.rows)
                    if dims and node.tensor in self._cut:
                        raise ShardError(f"'{node.tensor}' is indexed by the rows index '{self.rows}' and by the "
                                         f"sharded index '{self.index}': with rows sharded, a tensor holds a part "
                                         f"of one of them", self.program.text, node.span)
                    if dims:
                        self._row_cut[node.tensor] = dims
        for o in self.program.outputs:
            if self._joined[o] is not None:
                raise ShardError(f"output '{o}' varies over the sharded index '{self.index}': with rows sharded, "
                                 f"outputs vary over the rows only", self.program.text, statements[o].span)
        self._joined = {o: next((d for d, ix in enumerate(statements[o].indices) if ix in self.sharded.rows), None)
                        for o in self.program.outputs}

    def __repr__(self) -> str:
        rows = f", rows {self.rows}" if self.rows else ""
        return f"<einfold.ShardedProgram {self.program.outputs} over {self.index}{rows} ({self.layout})>"

    def _group_size_and_rank(self) -> tuple[int, int]:
        dist = torch.distributed
        if not (dist.is_available() and dist.is_initialized()):
            raise ShardError("a sharded program runs across the ranks of a torch.distributed process group, "
                             "and none is initialised: call torch.distributed.init_process_group first")
        return dist.get_world_size(self.group), dist.get_rank(self.group)

    def _parts(self, lengths: list[int], owner: int, extent: int, what: str) -> list[tuple[slice, int, int]]:
        """The parts of `owner`'s local extent of `what` (`lengths`: every rank's), as
        (local slice, global start, position among the parts in global order)."""
        world = len(lengths)
        if self.layout == "contiguous":
            ordered, halves = lengths, [(owner, slice(0, extent))]
        else:
            if extent % 2:
                raise ShardError(f"the zigzag layout cuts each rank's part of '{what}' in two halves, and rank "
                                 f"{owner}'s part has an odd length ({extent})")
            # the lengths of the 2W parts in global order: rank r's first half is part r,
            # its second part 2W - 1 - r
            ordered = [n // 2 for n in lengths]
            ordered = ordered + ordered[::-1]
            halves = [(owner, slice(0, extent // 2)), (2 * world - 1 - owner, slice(extent // 2, extent))]
        return [(part, sum(ordered[:g]), g) for g, part in halves]

    def _every_rank_parts(self, lengths: tuple[int, ...], what: str) -> list[list[tuple[slice, int, int]]]:
        """`_parts` of every rank (`lengths`: every rank's local extent of `what`): cut for
        all of them, so that a part no layout takes (an odd zigzag part) is an error on
        every rank, not on its own while the others wait for it."""
        return [self._parts(list(lengths), owner, lengths[owner], what) for owner in range(len(lengths))]

    def _hidden(self, values: dict[str, float], extents: dict[str, int], part: int, rows: int) -> bool:
        """Whether a mask hides every element of the local program for a part of the
        index `part` long and `rows` rows long, the starts and totals in `values`: each
        fold has a bound on the index that fails over the whole part (causal: the keys
        all lie after the last row).  Such a part's states are the identity, and its
        call is skipped.  Undecided (a bound reading a tensor or another index): no."""
        if part == 0 or rows == 0:
            return True

        def side(b: Bound) -> tuple[float, float] | None:
            offset = constant(transform(b.offset, lambda n: Const(values[n.tensor]) if isinstance(n, Access)
                                        and n.tensor in values else Const(extents[n.name])
                                        if isinstance(n, Extent) and n.name in extents else n))
            if offset is None:
                return None
            if b.other is None:
                return offset, offset
            ends = (0, b.sign * (rows - 1))
            return min(ends) + offset, max(ends) + offset

        def fails(b: Bound) -> bool:
            found = side(b)
            if found is None:
                return False
            low, high = found
            if b.upper:         # the smallest position of the part already lies past the largest bound
                return 0 > high if b.op == "le" else 0 >= high
            last = b.scale * (part - 1)
            return last < low if b.op == "ge" else last <= low
        return bool(self._bounds) and all(any(fails(b) for b in bounds) for bounds in self._bounds)

    def _narrowed(self, inputs: dict, names, part: slice, cut: dict | None = None) -> dict:
        """`inputs` among `names`, the tensors in `cut` (default: those over the
        sharded index) narrowed to `part` along their cut dimensions."""
        cut = self._cut if cut is None else cut
        out = {}
        for k, v in inputs.items():
            if k not in names:
                continue
            for d in cut.get(k, ()) if isinstance(v, torch.Tensor) else ():
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
            if self.rows is not None:
                self._check_ring_gradients(inputs)
            results = _ShardedCall.apply(self, names, *(inputs[n] for n in names))
            return results[0] if len(results) == 1 else results
        return self._run(inputs)

    def _run(self, inputs: dict):
        """The outputs for this rank's `inputs`, outside autograd."""
        if self.rows is not None:
            return self._run_ring(inputs)
        world, rank = self._group_size_and_rank()
        binding, (lengths,) = self._lengths(inputs, world, (self.index,))
        found = self._placed.get((lengths, binding.device))
        if found is None:
            parts = self._every_rank_parts(lengths, self.index)[rank]
            found = _kept(self._placed, (lengths, binding.device),
                          (parts, _on_device({0, sum(lengths), *(start for _, start, _ in parts)}, binding.device)))
        parts, on_device = found
        total = on_device[sum(lengths)]
        parts = [(part, on_device[start], g) for part, start, g in parts]
        states: dict[str, list[torch.Tensor]] = {n: [] for n in self.sharded.states}
        for part, start, _ in parts:
            local = self._narrowed(inputs, self._local_inputs, part)
            local.update({self.sharded.start: start, self.sharded.total: total})
            found = self.local._run(local)
            for n, t in zip(self.sharded.states, found if isinstance(found, tuple) else (found,)):
                states[n].append(t)
        # the gathered states are rank-major (each rank's parts in turn); ordered merges take
        # them in global order, commutative ones as gathered
        order = list(range(world * len(parts)))
        if self.sharded.ordered and len(parts) == 2:
            order = [2 * g if g < world else 2 * (2 * world - 1 - g) + 1 for g in range(2 * world)]
        gathered = self._exchange({n: ts[0].unsqueeze(0) if len(ts) == 1 else torch.stack(ts)
                                   for n, ts in states.items()}, world, order)
        merges = []
        for part, start, _ in (parts if self._merge_per_part else parts[:1]):
            merge = self._narrowed(inputs, self._merge_inputs, part)
            merge.update({k: v for k, v in {self.sharded.start: start,
                                             self.sharded.total: total}.items() if k in self._merge_inputs})
            found = self.merge._run({**merge, **gathered})
            merges.append(found if isinstance(found, tuple) else (found,))
        return self._joined_outputs(merges, binding)

    def _run_ring(self, inputs: dict):
        """The outputs for this rank's rows (`rows` sharded): the inputs over the
        index go around the ring, each rank merges the states of its own rows.  A
        pair of parts that a mask hides whole (`_hidden`) is not run."""
        world, rank = self._group_size_and_rank()
        # the parts' lengths size the buffers the ring receives into, give every start and
        # decide which pairs of parts a mask hides
        binding, (lengths, row_lengths) = self._lengths(inputs, world, (self.index, self.rows))
        device = binding.device
        numbers = {n: float(v) for n, v in inputs.items() if isinstance(v, int | float)}
        key = (lengths, row_lengths, tuple(binding.extents.items()), device,
               tuple(v.dtype for v in inputs.values() if isinstance(v, torch.Tensor)),
               tuple(numbers.get(n) for n in self._bound_numbers))
        ring, on_device = self._rings.get(key) or self._ring(key, world, rank, inputs, binding, numbers)
        sharded = self.sharded
        if self.precomputed is not None:        # on this rank's own part, before it travels
            ahead = self.precomputed
            found = ahead._run({n: v for n, v in inputs.items() if n in self._precomputed_inputs})
            inputs = {**inputs, **dict(zip(ahead.outputs, found if isinstance(found, tuple) else (found,)))}
        moving = {n: v for n, v in inputs.items() if n in self._cut and n in self._local_inputs}
        totals = {sharded.total: on_device[ring.totals[0]], sharded.rows_total: on_device[ring.totals[1]]}
        # every part's states land in their slot of one buffer per row part and state (global
        # order), which the merge reads as they are: nothing is stacked or copied
        stacked = [{s.name: torch.empty((slots, *(_part_extent(binding, ix, rows, sharded.rows) for ix in s.indices)),
                                        dtype=dtype, device=device)
                    for s, dtype in zip(sharded.local.statements, ring.dtypes)}
                   for (rows, _), slots in zip(ring.row_parts, ring.slots)]

        def run(held: dict, part: slice, start: int, k: int, slot: int) -> None:
            rows, row_start = ring.row_parts[k]
            local = self._narrowed(self._narrowed(held, self._local_inputs, part), self._local_inputs, rows,
                                   self._row_cut)
            local.update({sharded.start: on_device[start], sharded.rows_start: on_device[row_start], **totals})
            self.local._run({n: v for n, v in local.items() if n in self._local_inputs},
                            out={n: t[slot] for n, t in stacked[k].items()})

        transfer = None
        for step, pairs in enumerate(ring.steps):
            if step < world - 1:
                transfer = self._pass_on(moving, ring.incoming[step], world, rank, transfer)
            held = {**inputs, **moving}
            for part, start, k, slot in pairs:
                run(held, part, start, k, slot)
            if step < world - 1:
                moving = transfer.wait()
        for k in ring.empty:            # every part hidden from these rows: the identity, from an empty part
            run({**inputs, **moving}, slice(0, 0), 0, k, 0)
        merges = []
        for ((rows, row_start), states) in zip(ring.row_parts, stacked):
            merge = self._narrowed(inputs, self._merge_inputs, rows, self._row_cut)
            merge.update({n: v for n, v in {sharded.rows_start: on_device[row_start], **totals}.items()
                          if n in self._merge_inputs})
            out = self.merge._run({**merge, **states})
            merges.append(out if isinstance(out, tuple) else (out,))
        return self._joined_outputs(merges, binding)

    def _lengths(self, inputs: dict, world: int, indices: tuple[str, ...]) -> tuple[object, list[tuple[int, ...]]]:
        """This rank's inputs bound, and every rank's extents of `indices` (per index, in
        rank order), exchanged between the hosts over a group that moves CPU tensors
        (`_host_group`): no call waits for the GPU, and the host can queue a call while the
        previous one runs.  A rank whose inputs do not bind sends -1s and raises its error;
        the others raise a ShardError naming it instead of waiting for it."""
        host = _host_group(self.group)
        try:
            binding = self.program.binder(inputs)
        except EinfoldError:
            self._gather(torch.full((len(indices),), -1, dtype=torch.int64), world, host)
            raise
        mine = torch.tensor([binding.extents[ix] for ix in indices], dtype=torch.int64)
        columns = [tuple(column) for column in zip(*self._gather(mine, world, host).tolist())]
        failed = [r for r, n in enumerate(columns[0]) if n < 0]
        if failed:
            raise ShardError(f"rank{'s' * (len(failed) > 1)} {', '.join(map(str, failed))} could not bind "
                             f"{'their' if len(failed) > 1 else 'its'} inputs (the error is raised there): "
                             f"the call runs on no rank")
        return binding, columns

    def _ring(self, key: tuple, world: int, rank: int, inputs: dict, binding, numbers: dict) -> tuple[_Ring, dict]:
        """The ring of a call whose every rank's lengths, this rank's extents and dtypes,
        and the numbers the mask reads are `key` (made once, then kept), and its
        positions as 0-d int64 tensors on the device (all from one copy)."""
        lengths, row_lengths = key[0], key[1]
        index_parts = self._every_rank_parts(lengths, self.index)
        row_parts = self._every_rank_parts(row_lengths, self.rows)[rank]
        sharded = self.sharded
        totals = (sum(lengths), sum(row_lengths))
        found: list[list[int]] = [[] for _ in row_parts]       # per row part: the positions of the parts run
        steps = []
        for step in range(world):
            owner = (rank - step) % world          # whose part of the index this rank holds at this step
            pairs = []
            for part, start, position in index_parts[owner]:
                for k, (rows, row_start, _) in enumerate(row_parts):
                    values = {**numbers, sharded.total: totals[0], sharded.rows_total: totals[1],
                              sharded.start: start, sharded.rows_start: row_start}
                    if not self._hidden(values, binding.extents, part.stop - part.start, rows.stop - rows.start):
                        pairs.append((part, start, k, position))
                        found[k].append(position)
            steps.append(pairs)
        on_device = _on_device({0, *totals, *(start for _, start, _ in row_parts),
                                *(start for parts in index_parts for _, start, _ in parts)}, binding.device)
        # the states' dtypes, as the local program's binding gives them (float32 at least)
        local = {n: v for n, v in inputs.items() if n in self._local_inputs}
        local.update({n: on_device[0] for n in (sharded.start, sharded.total, sharded.rows_start,
                                                sharded.rows_total) if n in self._local_inputs})
        for st in sharded.precomputed.statements if sharded.precomputed is not None else ():
            local[st.name] = torch.empty([binding.extents[ix] for ix in st.indices], dtype=torch.float32,
                                         device=binding.device)
        typed = self.local.binder(local)
        # a part's slot: its place in global order among the parts run for its rows
        slot = [{p: s for s, p in enumerate(sorted(positions))} for positions in found]
        ring = _Ring(row_parts=tuple((rows, start) for rows, start, _ in row_parts),
                     steps=tuple(tuple((part, start, k, slot[k][p]) for part, start, k, p in pairs) for pairs in steps),
                     slots=tuple(max(1, len(f)) for f in found),
                     empty=tuple(k for k, f in enumerate(found) if not f),
                     incoming=tuple(lengths[(rank - step - 1) % world] for step in range(world)),
                     totals=totals,
                     dtypes=tuple(typed.result_dtype(st.dtype, wide=True) for st in sharded.local.statements))
        return _kept(self._rings, key, (ring, on_device))

    def _joined_outputs(self, merges: list[tuple], binding):
        """The outputs from the merge program's results per part: an output over a
        sharded index joined along it, the others from the first part; floats in
        the dtype the unsharded program gives."""
        results = tuple(torch.cat([m[k] for m in merges], self._joined[o]) if self._joined[o] is not None
                        else merges[0][k] for k, o in enumerate(self.program.outputs))
        wide = self.program.schedule_options.get("float32_outputs", ())
        results = tuple(r.to(binding.float_dtype(o in wide)) if r.is_floating_point() else r
                        for o, r in zip(self.program.outputs, results))
        return results[0] if len(results) == 1 else results

    def _pass_on(self, held: dict[str, torch.Tensor], incoming: int, world: int, rank: int,
                 after: _Transfer | None) -> _Transfer:
        """Send the tensors `held` to the next rank of the ring and receive the previous
        rank's (whose part of the index has length `incoming`), without waiting.
        `after`: the previous step's transfer, which received `held` (None: the first step,
        sending this rank's inputs).

        On a GPU the transfers are issued from a stream of their own (`_ring_stream`):
        torch makes the communication wait for everything queued on the stream that
        issues it, and from the compute stream a step's transfer would wait for the
        previous step's kernel, then find every SM taken by the next one (a kernel of
        thousands of programs lets another stream's kernel in only at its tail), and
        the step after would wait for it.  From its own stream a transfer waits only for
        the data it forwards: the previous step's receipt, or for the first the inputs,
        queued on the compute stream before the call."""
        dist = torch.distributed
        peer = (lambda r: r) if self.group is None else (lambda r: dist.get_global_rank(self.group, r))
        held = {n: t.contiguous() for n, t in held.items()}
        # allocated on the compute stream, which reads them; communication records its own use
        received = {}
        for n, t in held.items():
            shape = list(t.shape)
            for d in self._cut[n]:
                shape[d] = incoming
            received[n] = torch.empty(shape, dtype=t.dtype, device=t.device)
        ops = [op for n, t in held.items() for op in (dist.P2POp(dist.isend, t, peer((rank + 1) % world), self.group),
                                                       dist.P2POp(dist.irecv, received[n], peer((rank - 1) % world),
                                                                  self.group))]
        device = next(iter(held.values())).device
        if device.type != "cuda":
            return _Transfer(dist.batch_isend_irecv(ops), received)
        stream = _ring_stream(device)
        if after is None:
            stream.wait_stream(torch.cuda.current_stream(device))
        with torch.cuda.stream(stream):
            for r in after.requests if after is not None else ():
                r.wait()            # this stream waits for the receipt it forwards
            return _Transfer(dist.batch_isend_irecv(ops), received)

    @cached_property
    def _saving(self) -> ShardedProgram:
        """The program's saving forward (its outputs, then the row statistics its
        gradient programs read), sharded like this one."""
        return ShardedProgram(self.program._saving, self.index, self.group, self.layout, self.rows)

    def _gradient(self, wrt: tuple[str, ...]) -> ShardedProgram:
        """The gradient program for `wrt` (reading the saved statistics), sharded like
        this one (made on first use, then kept).  With rows sharded, `wrt` is all read
        at the rows or all at the index (`_gradient_rings`): a gradient over the rows
        folds over the index, and runs on the same ring; a gradient over the index folds
        over the rows, and runs on the ring with the roles swapped (the inputs over the
        rows travel, each rank keeps its part of the index and merges its states)."""
        if wrt not in self._gradients:
            index, rows = self.index, self.rows
            if rows is not None and wrt[0] in self._cut:
                index, rows = rows, index
            self._gradients[wrt] = ShardedProgram(self.program._gradient(wrt, saved=True), index,
                                                  self.group, self.layout, rows)
        return self._gradients[wrt]

    def _gradient_rings(self, wrt: tuple[str, ...]) -> list[tuple[str, ...]]:
        """`wrt` grouped into the calls of `_gradient`: one, or with rows sharded those
        read at the rows and those read at the index (each its own ring)."""
        if self.rows is None:
            return [wrt]
        groups = [tuple(n for n in wrt if n in self._row_cut), tuple(n for n in wrt if n in self._cut)]
        return [g for g in groups if g]

    def _check_ring_gradients(self, inputs: dict) -> None:
        """With rows sharded, a gradient is derived for inputs read at the rows or at the
        index: one read at neither (a per-head bias under attention) needs a fold over
        both, which no rank holds."""
        for name, value in inputs.items():
            if (isinstance(value, torch.Tensor) and value.requires_grad and name not in self._row_cut
                    and name not in self._cut):
                raise ShardError(f"the gradient of '{name}' is not derived with the rows '{self.rows}' sharded: "
                                 f"'{name}' is read at neither the rows nor the sharded index '{self.index}', so "
                                 f"its gradient folds over both, and each rank holds a part of each; pass it "
                                 f"without requires_grad, or shard '{self.index}' alone (rows replicated)")

    def _gather(self, flat: torch.Tensor, world: int, group=None) -> torch.Tensor:
        """Every rank's `flat` (one dimension), stacked in rank order: [world, n]; over
        `group` where given (default: the program's)."""
        out = torch.empty(world * flat.numel(), dtype=flat.dtype, device=flat.device)
        dist = torch.distributed
        gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor  # torch < 2.13
        gather(out, flat.contiguous(), group=self.group if group is None else group)
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
        rows = slice(0, binding.extents[self.rows] // parts) if self.rows else None
        position = torch.zeros((), dtype=torch.int64, device=device)
        scalars = (self.sharded.start, self.sharded.total, self.sharded.rows_start, self.sharded.rows_total)
        if self.sharded.precomputed is not None:        # what each rank computes before the ring
            inputs = {**inputs, **{st.name: torch.empty([binding.extents[ix] for ix in st.indices],
                                                        dtype=torch.float32, device=device)
                                   for st in self.sharded.precomputed.statements}}
        local = self._narrowed(inputs, self._local_inputs, first)
        if rows is not None:
            local = self._narrowed(local, self._local_inputs, rows, self._row_cut)
        local.update({k: position for k in scalars if k in self._local_inputs})
        local_plan = self.local.plan(**local)
        states = {}
        for s in self.sharded.local.statements:
            shape = [world * parts, *(_part_extent(binding, ix, rows, self.sharded.rows) for ix in s.indices)]
            states[s.name] = torch.empty(shape, dtype=binding.result_dtype(s.dtype, wide=True), device=device)
        merge = self._narrowed(inputs, self._merge_inputs, rows if rows is not None else first,
                               self._row_cut if rows is not None else None)
        merge.update({k: position for k in scalars if k in self._merge_inputs})
        merge_plan = self.merge.plan(**merge, **states)
        if rows is not None:
            moved = {n: v for n, v in inputs.items() if n in self._cut and n in self._local_inputs}
            size = sum(t.numel() * t.element_size() for t in moved.values())
            exchange = (f"{self.layout} layout of '{self.index}' and of the rows '{self.rows}', {parts} part(s) "
                        f"per rank; ring: {world - 1} step(s), each passing this rank's part of "
                        f"{', '.join(moved)} ({size} bytes) to the next rank while the local program runs; "
                        f"states stay on their rank (up to {world * parts} per row part: one per part of the "
                        f"index a mask does not hide from it, each in its slot of one buffer, merged in global "
                        f"order)")
            return ShardedPlan(local_plan, exchange, merge_plan)
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
        results = {}
        for group in sharded._gradient_rings(wrt):
            gradient = sharded._gradient(group)
            program = gradient.program
            call = {**inputs, **{k: v for k, v in produced.items() if k in program.inputs}}
            for o, g in zip(sharded.program.outputs, upstream):
                if o in program.upstream:           # float outputs; one backward() did not reach: zeros
                    call[program.upstream[o]] = torch.zeros_like(produced[o]) if g is None else g.contiguous()
            found = gradient._run(program._read(call))
            results.update(zip(group, found if isinstance(found, tuple) else (found,)))
        return (None, None, *(results[n].to(inputs[n].dtype) if n in results else None for n in names))
