"""Kernel forms beside the `tl` kernel, as rows chosen per specialised kernel.

A form is a way to build a kernel that only some kernels and GPUs take: its row
names the compute capability it needs and a rule that reads the kernel's schedule,
the way its program fold streams and the signature, and returns what the backend
needs to build it (the roles of its operands, its tiling) or why it does not apply.
One row today:

- the sm_90 warp-specialised form of a streamed rescaled fold (FlashAttention-3's
  structure: a TMA loader warp, consumer warpgroups, mbarrier rings; built in Gluon
  by backend/triton/hopper.py): one program fold, a rescaled summary whose leader
  argument holds one contraction `sum[k](A[.., i, k] * B[.., m, k])` and whose
  weighted values are `V[.., m, j]`, 16-bit inputs, a contraction depth with a
  tiling in TILINGS.  Its leader argument may be any elementwise function of the
  scores but one that costs a transcendental or a division per score
  (ops.COSTLY), where the tl kernel measured faster."""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from ..ir import Access, Call, Const, Expr, Extent, Index, Reduce, Var, children, format_expr, transform, walk
from ..ops import COSTLY, OPS
from ..schedule import KernelSchedule
from ..schedule.bounds import Bound
from .ir import FoldLoops, Signature

# rows of one consumer warpgroup: the warpgroup MMA's M
ROWS = 64


@dataclass(frozen=True)
class Tiling:
    """How one block of the form is cut: `consumers` warpgroups of ROWS rows each, key tiles
    of `key_tile` rows through a ring of `stages` shared-memory buffers, and the registers a
    thread each consumer and the loader asks for (warp_specialize's setmaxnreg)."""
    consumers: int
    key_tile: int
    stages: int
    consumer_regs: int
    loader_regs: int

    @property
    def rows(self) -> int:
        return self.consumers * ROWS


# By contraction depth.  d = 128: the tiling the probe measured fastest on the H100
# (docs/performance.md, nineteenth session; 232 / 40 registers spilled there).
TILINGS = {128: Tiling(consumers=2, key_tile=128, stages=2, consumer_regs=240, loader_regs=24)}
WIDTHS = (64, 128)
OPERAND_DTYPES = frozenset({torch.bfloat16, torch.float16})
INTEGER_DTYPES = frozenset({torch.int8, torch.int16, torch.int32, torch.int64, torch.uint8})


@dataclass(frozen=True)
class HopperFold:
    """What the skeleton needs, read off a kernel's schedule."""
    fold: Reduce
    rows: str                    # i: the rows operand's row index
    keys: str                    # m: the fold's index
    depth: str                   # k: the contraction's index
    width: str                   # j: the value tensor's free index
    batch: tuple[str, ...]       # the grid's other indices, in the rows operand's order
    a: Access                    # A[.., i, k]
    b: Access                    # B[.., m, k]
    v: Access                    # V[.., m, j]
    contraction: Reduce
    bounds: tuple[Bound, ...]    # relations on m that bound the loop
    leader: str                  # field names by role
    weight_sum: str | None
    weighted: str
    dtype: torch.dtype           # of A, B, V
    tiling: Tiling

    def __str__(self) -> str:
        t = self.tiling
        return (f"Hopper (sm_90, warp-specialised): rows {self.rows} in blocks of {t.consumers} consumer "
                f"warpgroups x {ROWS}, "
                f"keys {self.keys} in tiles of {t.key_tile} through {t.stages} shared-memory stages fed by a TMA "
                f"loader warp; {self.a.tensor} {self.b.tensor}^T over {self.depth}, weights times {self.v.tensor}")


def match(spec: KernelSchedule, loops: FoldLoops | None, sig: Signature, extent, known: set[str]) -> HopperFold | str:
    """The Hopper form of `spec` under signature `sig`, or why it does not apply; `loops`:
    how its program fold streams, `known`: the tensors it may read (inputs, and what
    this and earlier kernels store)."""
    if len(spec.program_folds) != 1 or spec.buffers or spec.epilogue or spec.dependent:
        return "not one program fold storing its results"
    (fold,) = spec.program_folds
    if any(isinstance(n, Access) and n.layout is not None for st in spec.statements for n in walk(st.expr)):
        return "a tensor is read at affine subscripts, which the TMA loads do not take"
    s = fold.summary
    if len(fold.indices) != 1 or len(s.rescaled) != 1 or len(spec.loops) != 1 or spec.loops[0].skips:
        return "not one rescaled fold over one index without per-tile tests"
    (rs,) = s.rescaled
    if not rs.base2 or rs.leader_monoid != "max" or rs.leader_arg != Var("x0") or rs.shifts:
        return "the leader is not a base-2 running max of the first argument"
    keys = fold.indices[0]
    weight_sum, weighted = None, None
    for name, value in rs.values:
        if value == Const(1) and weight_sum is None:
            weight_sum = name
        elif isinstance(value, Var) and value.name != "x0" and weighted is None:
            weighted = name
            v = fold.args[int(value.name[1:])]
        else:
            return f"field {name} is neither the weight sum nor one weighted tensor"
    if weighted is None or set(s.field_names) != {rs.leader, weighted} | ({weight_sum} - {None}):
        return "no weighted value tensor, or fields outside the rescaled structure"
    contractions = [n for n in walk(fold.args[0]) if isinstance(n, Reduce)]
    if len(contractions) != 1:
        return "the leader argument does not hold exactly one contraction"
    (contraction,) = contractions
    operands = contraction.args[0]
    if (contraction.summary.name != "sum" or len(contraction.indices) != 1 or len(contraction.args) != 1
            or not (isinstance(operands, Call) and operands.op == "mul")
            or not all(isinstance(x, Access) for x in operands.args)):
        return "the contraction is not a sum of a product of two tensors over one index"
    (depth,) = contraction.indices
    b_side = [x for x in operands.args if keys in x.indices]
    a_side = [x for x in operands.args if keys not in x.indices]
    if len(a_side) != 1 or len(b_side) != 1 or not isinstance(v, Access):
        return "the contraction does not pair a row operand with a key operand"
    (a,), (b,) = a_side, b_side
    # the rows: the row operand's own index of the largest extent (a grouped query's replica
    # index beside it runs one value a program, as a batch index)
    own = [x for x in a.indices if x != depth and x not in b.indices]
    if not own or len(set(a.indices)) != len(a.indices):
        return "the row operand has no index of its own"
    rows = max(reversed(own), key=extent)
    batch = tuple(x for x in a.indices if x not in (rows, depth))
    widths = [x for x in v.indices if x != keys and x not in batch]
    if len(widths) != 1:
        return "the value tensor does not have exactly one index of its own"
    width = widths[0]
    if (set(spec.grid) != set(batch) | {rows, width} or depth not in b.indices
            or not set(b.indices) - {keys, depth} <= set(batch) or len(batch) > 3
            or len(set(b.indices)) != len(b.indices) or len(set(v.indices)) != len(v.indices)):
        return "the operands are not A[.., i, k], B[.., m, k], V[.., m, j] over the grid's batch indices"
    inputs = {name: dtype for name, kind, _, dtype in sig.inputs if kind == "tensor"}
    dtypes = {inputs[x.tensor] for x in (a, b, v) if x.tensor in inputs}
    if len(dtypes) != 1 or next(iter(dtypes)) not in OPERAND_DTYPES or {a.tensor, b.tensor, v.tensor} - set(inputs):
        return "the operands are not inputs of one 16-bit dtype"
    tiling = TILINGS.get(extent(depth))
    if tiling is None or extent(width) not in WIDTHS:
        return (f"contraction depth {extent(depth)} / value width {extent(width)} outside "
                f"{tuple(TILINGS)} / {WIDTHS}")
    # below one full row block the tl kernel's smaller tiles waste less
    if extent(rows) < tiling.rows or any(extent(x) < 1 for x in (keys, *batch)):
        return f"fewer than {tiling.rows} rows or an empty index"
    bounds = dict(loops.bounds).get(keys, ())
    positions = {name for name, kind, rank, dtype in sig.inputs
                 if kind == "tensor" and rank == 0 and dtype in INTEGER_DTYPES}
    for bound in bounds:
        if bound.other not in (rows, None, *batch) or not _integral(bound.offset, positions) or bound.scale != 1:
            return f"the bound {bound} is not a shift of the rows by integers"
    costly = sorted({n.op for n in walk(fold.args[0]) if isinstance(n, Call) and n.op in COSTLY
                     and not (n.op == "div" and _power_of_two(n.args[1]))})
    if costly:
        return (f"the leader argument computes {', '.join(costly)} on every score, where the tl kernel measured "
                f"faster (the weights' exponentials already load the special-function unit)")
    scoped = {"score": set(batch) | {rows, keys}, "out": set(batch) | {rows, width}}
    for leaf in walk(transform(fold.args[0], lambda n: Var("qk") if n == contraction else n)):
        if leaf != Var("qk") and not _elementwise(leaf, scoped["score"], known):
            return f"the leader argument reads {format_expr(leaf)} (not elementwise over rows and keys)"
    for st in spec.statements:
        if st.dtype != "float" or set(st.indices) not in (scoped["out"], scoped["out"] - {width}):
            return f"statement {st.name} is not a float over the rows (and values)"
        for leaf in outside_folds(st.expr):
            if isinstance(leaf, Reduce):
                if leaf.fold != fold:
                    return f"statement {st.name} reads another fold"
            elif not _elementwise(leaf, set(st.indices), known):
                return f"statement {st.name} reads {format_expr(leaf)}"
    return HopperFold(fold, rows, keys, depth, width, batch, a, b, v, contraction, bounds, rs.leader,
                      weight_sum, weighted, next(iter(dtypes)), tiling)


def _power_of_two(e: Expr) -> bool:
    """A literal power of two: dividing by it is an exact multiplication."""
    return isinstance(e, Const) and not isinstance(e.value, bool) and e.value > 0 and \
        math.isfinite(e.value) and math.frexp(e.value)[0] == 0.5


def outside_folds(e: Expr):
    """The nodes of `e`, not descending into folds."""
    yield e
    if not isinstance(e, Reduce):
        for c in children(e):
            yield from outside_folds(c)


def _integral(e: Expr, positions: set[str]) -> bool:
    """An offset made of integer constants, extents and `positions` (0-d integer tensor
    inputs: a shard's start), so that floor divisions of it are exact."""
    return all(isinstance(n, Extent) or (isinstance(n, Const) and isinstance(n.value, int))
               or (isinstance(n, Access) and not n.indices and n.tensor in positions)
               or (isinstance(n, Call) and n.op in ("add", "sub", "neg", "mul")) for n in walk(e))


def _elementwise(e: Expr, indices: set, known: set[str]) -> bool:
    """Whether a node of an expression is one the generated functions compute in place."""
    if isinstance(e, Call):
        return e.op in OPS
    if isinstance(e, Access):
        return set(e.indices) <= indices and e.tensor in known
    if isinstance(e, Index):
        return e.name in indices
    return isinstance(e, Const | Extent)


@dataclass(frozen=True)
class Form:
    """A row: a kernel form, the compute capability it needs, and its rule."""
    name: str
    arch: int
    match: object          # (spec, loops, signature, extent, known) -> what the backend builds it from, or why not


FORMS = (Form("Hopper", 90, match),)


def choose(spec: KernelSchedule, loops: FoldLoops | None, sig: Signature, extent, known: set[str]):
    """(the first form whose rule takes the kernel, or None; why the others did not, or "")."""
    why = []
    for form in FORMS:
        if sig.interpret or sig.arch != form.arch:
            continue
        found = form.match(spec, loops, sig, extent, known)
        if not isinstance(found, str):
            return found, ""
        why.append(f"not in the {form.name} form: {found}")
    return None, "; ".join(why)
