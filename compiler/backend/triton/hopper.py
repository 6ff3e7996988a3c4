"""The Hopper form of a streamed rescaled fold (sm_90, Gluon).

A kernel whose one program fold is a rescaled summary (a running max r with a
weight sum l and a weighted sum acc of a value tensor) over the key index m,
whose leader argument holds one contraction `sum[k](A[.., i, k] * B[.., m, k])`
and whose weighted values are `V[.., m, j]`, runs on Hopper GPUs as a
warp-specialised Gluon kernel with FlashAttention-3's structure
(scripts/gluon_probe.py measured it: docs/performance.md, nineteenth session):

- a loader warp copies the tiles of B and V with TMA into two-stage rings of
  shared memory, handed back and forth with `ready` / `empty` mbarriers;
- two consumer warpgroups of 64 rows each run the fold; each issues tile t's
  `A B^T` as an asynchronous warpgroup MMA before tile t-1's `P V`, so the
  weights of one tile are computed while the tensor cores work on the other.

The skeleton is the fold's, not an operator's: what varies is generated from
the program.  The leader argument becomes the `logits` function (its positive
scalar factor c split off, as `KernelEmitter.positive_factor` does: the max of
c y is c times the max of y), evaluated in full on the tiles where a mask may
bite and with the bounding relations assumed true on interior tiles
(schedule.bounds); the loop's tile range comes from the same bounds; the
outputs are the statements over the final (r, l, acc), stored by pointer.  The
base-2 weights, the stand-in 0 for a leader with no mass and `_natural` are
the `tl` emitter's (passes/base2.py): the same formulas, rounded alike but for
the order of the sums.

Whether a kernel takes this form, and the roles and tiling it is built from, is
the specialisation stage's decision (specialise.forms: its row); `emit` writes it.  The `tl` kernel of the same schedule stays in the module:
the launcher runs it where TMA cannot read the operands (strides, alignment)."""
from __future__ import annotations

import re
from dataclasses import dataclass, replace
from string import Template

import torch

from ...ir import Access, Call, Const, Expr, Extent, Index, constant, format_expr, walk
from ...ops import OPS
from ...schedule import KernelSchedule
from ...schedule.bounds import assume_relation
from ...specialise.forms import INTEGER_DTYPES, ROWS, HopperFold, outside_folds
from . import ops as emission
from .emit import ident

GL_DTYPES = {torch.bfloat16: "gl.bfloat16", torch.float16: "gl.float16"}


def gluon_available() -> bool:
    try:
        from triton.experimental.gluon.language.nvidia.hopper import warpgroup_mma  # noqa: F401
        from triton.experimental.gluon.nvidia.hopper import TensorDescriptor  # noqa: F401
    except ImportError:
        return False
    return True


# ---------------------------------------------------------------- expressions in gl
GL_HELPERS = {
    "base2": '''\
@gluon.jit
def _gl_base2(r, c=1.0):
    # _base2 in gl (float32 states): the factor a of the weights exp2(y * a - r2) of x = c * y,
    # c * log2(e) while |c * r| < 2**30, else 1.4 * 2**30 / |r| (r2 then errs by 64 at most)
    return gl.where(gl.abs(c * r) < 1073741824.0, c * 1.4426950408889634, 1503238553.6 / gl.abs(r))


@gluon.jit
def _gl_scaled(r, c=1.0):
    # _scaled in gl: r2 = r * a rounded once, as an fma
    return gl.fma(r, _gl_base2(r, c), 0.0)


@gluon.jit
def _gl_repair(r, r_new, c=1.0):
    # _repair in gl: exp2(r2 - r2_new) while a stays, else 0 (the leader moved by 32 or more)
    same = _gl_base2(r, c) == _gl_base2(r_new, c)
    return gl.where(same, gl.exp2(_gl_scaled(r, c) - _gl_scaled(r_new, c)), 0.0)


@gluon.jit
def _gl_natural(t, r, c=1.0):
    # _natural in gl: divide the factor exp2(r * a - r2) of every base-2 weight out of t
    return t * gl.exp2(gl.where(r == -float("inf"), 0.0, -gl.fma(r, _gl_base2(r, c), -_gl_scaled(r, c))))
''',
    "sigmoid": '''\
@gluon.jit
def _gl_sigmoid(x):
    return 1.0 / (1.0 + gl.exp(-x))
''',
}


def gl_helper(name: str) -> str:
    """A helper of the operator table (ops.HELPERS) in gl: the same formula."""
    if name in GL_HELPERS:
        return GL_HELPERS[name]
    source = emission.HELPERS[name].replace("@triton.jit", "@gluon.jit").replace("tl.", "gl.")
    for other in emission.HELPERS:
        source = source.replace(f"_{other}(", f"_gl_{other}(")
    return source


def gl_template(op: str, helpers: set[str]) -> str:
    template, helper = emission.TEMPLATES[op]
    if helper is not None:
        helpers.add(helper)
        template = template.replace(f"_{helper}(", f"_gl_{helper}(")
    if "tl.sigmoid(" in template:
        helpers.add("sigmoid")
        template = template.replace("tl.sigmoid(", "_gl_sigmoid(")
    # gl has no PropagateNan of its own: tl's constant (the module imports both)
    return template.replace("tl.", "gl.").replace("gl.PropagateNan", "tl.PropagateNan")


class Printer:
    """An expression as gl code over tiles of one layout context: `indices` map an index
    to its code (a row vector expanded `[:, None]`, a column `[None, :]`, a batch
    coordinate), `masks` an index to the validity test of its loads, `leaves` a node
    to its code (the scores, the fold's fields)."""

    def __init__(self, ctx, names: dict, indices: dict[str, str], masks: dict[str, str],
                 leaves: dict[Expr, str], helpers: set[str]):
        self.ctx, self.names, self.indices, self.masks, self.leaves, self.helpers = \
            ctx, names, indices, masks, leaves, helpers

    def code(self, e: Expr) -> tuple[str, str]:
        """(code, kind): kind is float, int or bool."""
        for node, code in self.leaves.items():
            if e == node:
                return code, "float"
        if isinstance(e, Const):
            kind = "bool" if isinstance(e.value, bool) else "int" if isinstance(e.value, int) else "float"
            return emission.literal(e.value), kind
        if isinstance(e, Index):
            return self.indices[e.name], "int"
        if isinstance(e, Extent):
            return self.names[("extent", e.name)], "int"
        if isinstance(e, Access):
            return self.load(e)
        assert isinstance(e, Call), e
        args = [self.code(a) for a in e.args]
        kinds = tuple(k for _, k in args)
        kind = OPS[e.op].result(kinds)
        codes = [f"{c}.to(gl.float32)" if k == "int" and e.op in emission.FLOAT_RESULT else c for c, k in args]
        return gl_template(e.op, self.helpers).format(*codes), kind

    def load(self, e: Access) -> tuple[str, str]:
        info = self.ctx.tensors[e.tensor]
        if info.kind == "number":
            return self.names[("tensor", e.tensor)], "float"
        pointer, strides = self.names[("tensor", e.tensor)]
        terms = [pointer] + [f"{self.indices[x]}.to(gl.int64) * {stride}" for x, stride in zip(e.indices, strides)]
        masks = [self.masks[x] for x in dict.fromkeys(e.indices) if x in self.masks]
        mask = f", mask={' & '.join(masks)}, other=0" if masks else ""
        value = f"gl.load({' + '.join(terms)}{mask})"
        if info.dtype == torch.bool:
            return f"({value} != 0)", "bool"
        if info.dtype in INTEGER_DTYPES:
            return value, "int"
        return f"{value}.to(gl.float32)", "float"


def positive_split(e: Expr, positive: set[str]) -> tuple[Expr | None, Expr]:
    """(c, y) with e = c * y for a positive scalar c (a number input held positive, or a
    positive literal), also under a mask against -inf; (None, e) otherwise (the IR
    form of KernelEmitter.positive_factor)."""
    if isinstance(e, Call) and e.op == "where" and constant(e.args[2]) == -float("inf"):
        c, y = positive_split(e.args[1], positive)
        if c is not None:
            return c, Call("where", (e.args[0], y, e.args[2]))
    if isinstance(e, Call) and e.op == "mul":
        for c, y in (e.args, e.args[::-1]):
            if (isinstance(c, Access) and not c.indices and c.tensor in positive) or \
                    (isinstance(c, Const) and not isinstance(c.value, bool) and 0 < c.value < float("inf")):
                return c, y
    return None, e


# ---------------------------------------------------------------- the kernel
SKELETON = Template('''\
@gluon.jit
def ${K}_scores(q, k_smem, k_ready, n, zeros):
    # ring position n's scores A B^T, issued to the tensor cores once its B tile has landed
    STAGES: gl.constexpr = k_smem.shape[0]
    mbarrier.wait(k_ready.index(n % STAGES), (n // STAGES) & 1)
    return warpgroup_mma(q, k_smem.index(n % STAGES).permute((1, 0)), zeros, use_acc=False, is_async=True)


@gluon.jit
def ${K}_weights(y, c, r):
    # the leader r, the max of y (x = c * y, c > 0: c * r is the max of x), moved by the tile; its
    # stand-in 0 while no key has mass; the repair alpha = exp(c * (r - r_new)) and the weights
    # p = exp(x - c * r_new), in base 2 at one fma a score (r2 = r * a rounded: _gl_scaled)
    r_new = gl.maximum(r, gl.max(y, 1))
    r_use = gl.where(r_new == -float("inf"), 0.0, r_new)
    r2 = _gl_scaled(r_use, c)
    alpha = _gl_repair(r, r_use, c)
    p = gl.exp2(gl.fma(y, _gl_base2(r_use, c)[:, None], -r2[:, None]))
    return r_new, alpha, p


@gluon.jit
def ${K}_step(q, k_smem, v_smem, k_ready, k_empty, v_ready, v_empty, t, n, zeros, r, p, l, acc, rows, ${EXTRA},
        MASKED):
    # key tile t (ring position n): its scores go to the tensor cores, then the previous tile's
    # weights times V; this tile's weights are computed while P V is in flight (MASKED: a
    # constant where a loop's tiles are all of one kind, else the tile's test)
    STAGES: gl.constexpr = k_smem.shape[0]
    BLOCK_N: gl.constexpr = k_smem.shape[1]
    o_rows: gl.constexpr = gl.SliceLayout(1, acc.type.layout)
    p_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=acc.type.layout, k_width=2)
    qk_token = ${K}_scores(q, k_smem, k_ready, n, zeros)
    prev = (n - 1) % STAGES
    mbarrier.wait(v_ready.index(prev), ((n - 1) // STAGES) & 1)
    p_op = gl.convert_layout(p.to(v_smem.dtype), p_layout)
    acc_token = warpgroup_mma(p_op, v_smem.index(prev), acc, is_async=True)
    qk = warpgroup_mma_wait(1, deps=(qk_token, ))
    mbarrier.arrive(k_empty.index(n % STAGES), count=1)
    cols = t * BLOCK_N + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, qk.type.layout))
    y, c = ${K}_logits(qk, rows, cols, ${EXTRA}, MASKED)
    r_new, alpha, p = ${K}_weights(y, c, r)
    l = l * alpha + gl.sum(p, 1)
    acc, p_op = warpgroup_mma_wait(0, deps=(acc_token, p_op))
    mbarrier.arrive(v_empty.index(prev), count=1)
    acc = acc * gl.convert_layout(alpha, o_rows)[:, None]
    return r_new, p, l, acc


@gluon.jit
def ${K}_fold(q, k_smem, v_smem, k_ready, k_empty, v_ready, v_empty, zeros, acc, rows, lo, hi, inner_lo, inner_hi,
        ${EXTRA}):
    # the fold over key tiles lo .. hi - 1, rotated: tile lo's weights before the loop, the last
    # P V after it; tiles inner_lo .. inner_hi - 1 hold no masked element and skip the masks
    # (masked tiles before them only under a lower bound, after them only where an upper bound
    # or a partial last tile can mask; with both, one loop tests each tile: one copy of its code)
    STAGES: gl.constexpr = k_smem.shape[0]
    BLOCK_N: gl.constexpr = k_smem.shape[1]
    p_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=acc.type.layout, k_width=2)
    qk = warpgroup_mma_wait(0, deps=(${K}_scores(q, k_smem, k_ready, 0, zeros), ))
    mbarrier.arrive(k_empty.index(0), count=1)
    cols = lo * BLOCK_N + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, qk.type.layout))
    y, c = ${K}_logits(qk, rows, cols, ${EXTRA}, True)
    r, alpha, p = ${K}_weights(y, c, gl.full([ROWS], -float("inf"), gl.float32, gl.SliceLayout(1, qk.type.layout)))
    l = gl.sum(p, 1)
${LOOPS}    last = hi - 1 - lo
    mbarrier.wait(v_ready.index(last % STAGES), (last // STAGES) & 1)
    p_op = gl.convert_layout(p.to(v_smem.dtype), p_layout)
    acc, p_op = warpgroup_mma_wait(0, deps=(warpgroup_mma(p_op, v_smem.index(last % STAGES), acc, is_async=True),
                                            p_op))
    mbarrier.arrive(v_empty.index(last % STAGES), count=1)
    return r, l, acc


@gluon.jit
def ${K}_consumer(part: gl.constexpr, q_smem, k_smem, v_smem, q_bar, k_ready, k_empty, v_ready, v_empty, row0, lo,
        hi, inner_lo, inner_hi, ${EXTRA}):
    # rows row0 + part * ROWS .. + ROWS - 1 of the block: the fold, then the results
    BLOCK_N: gl.constexpr = k_smem.shape[1]
    WIDTH: gl.constexpr = v_smem.shape[2]
    s_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                       instr_shape=[16, BLOCK_N, 16])
    o_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                       instr_shape=[16, WIDTH, 16])
    rows = row0 + part * ROWS + gl.arange(0, ROWS, layout=gl.SliceLayout(1, s_layout))
    q = q_smem.index(part)
    mbarrier.wait(q_bar.index(part), 0)
    zeros = gl.zeros([ROWS, BLOCK_N], gl.float32, s_layout)
    acc = gl.zeros([ROWS, WIDTH], gl.float32, o_layout)
    r, l, acc = ${K}_fold(q, k_smem, v_smem, k_ready, k_empty, v_ready, v_empty, zeros, acc, rows, lo, hi, inner_lo,
                          inner_hi, ${EXTRA})
    ${K}_store(r, l, acc, rows, ${EXTRA})


@gluon.jit
def ${K}_loader(q_desc, k_desc, v_desc, q_smem, k_smem, v_smem, q_bar, k_ready, k_empty, v_ready, v_empty, row0, lo,
        hi, ${EXTRA}):
    # one warp: the block's A rows once, then B and V tiles lo .. hi - 1 through the rings
    STAGES: gl.constexpr = k_smem.shape[0]
    BLOCK_N: gl.constexpr = k_smem.shape[1]
    for part in gl.static_range(${CONSUMERS}):
        mbarrier.expect(q_bar.index(part), q_desc.block_type.nbytes)
        tma_load(q_desc, [${A_AT}row0 + part * ROWS, 0], q_bar.index(part), q_smem.index(part).reshape(${A_BLOCK}))
    for t in range(lo, hi):
        stage = (t - lo) % STAGES
        free = (((t - lo) // STAGES) & 1) ^ 1     # the first pass over the ring waits for nothing
        mbarrier.wait(k_empty.index(stage), free)
        mbarrier.expect(k_ready.index(stage), k_desc.block_type.nbytes)
        tma_load(k_desc, [${B_AT}t * BLOCK_N, 0], k_ready.index(stage), k_smem.index(stage).reshape(${B_BLOCK}))
        mbarrier.wait(v_empty.index(stage), free)
        mbarrier.expect(v_ready.index(stage), v_desc.block_type.nbytes)
        tma_load(v_desc, [${V_AT}t * BLOCK_N, 0], v_ready.index(stage), v_smem.index(stage).reshape(${V_BLOCK}))


# the partitions (Triton 3.6 gives every partition the same arguments)
${PARTITIONS}

@gluon.jit
def ${K}(q_desc, k_desc, v_desc, ${PARAMS}, BLOCK_N: gl.constexpr, STAGES: gl.constexpr):
    """${WHY}"""
    BLOCK_M: gl.constexpr = ${CONSUMERS} * ROWS
${COORDS}
    row0 = pid_m * BLOCK_M
    # the key tiles the block's rows may read, and the interior ones that need no mask
    lo = gl.to_tensor(0)
    hi = (${N_KEYS} + BLOCK_N - 1) // BLOCK_N
    inner_lo = gl.to_tensor(0)
    inner_hi = ${N_KEYS} // BLOCK_N
${BOUNDS}
    hi = gl.maximum(hi, lo + 1)     # a block no key reaches still runs one (masked) tile
    inner_lo = gl.minimum(gl.maximum(inner_lo, lo), hi)
    inner_hi = gl.minimum(gl.maximum(inner_hi, inner_lo), hi)
    q_smem = gl.allocate_shared_memory(${DTYPE}, [${CONSUMERS}, ROWS, ${DEPTH}],
                                       gl.NVMMASharedLayout.get_default_for([ROWS, ${DEPTH}], ${DTYPE}))
    k_smem = gl.allocate_shared_memory(${DTYPE}, [STAGES, BLOCK_N, ${DEPTH}],
                                       gl.NVMMASharedLayout.get_default_for([BLOCK_N, ${DEPTH}], ${DTYPE}))
    v_smem = gl.allocate_shared_memory(${DTYPE}, [STAGES, BLOCK_N, ${WIDTH}],
                                       gl.NVMMASharedLayout.get_default_for([BLOCK_N, ${WIDTH}], ${DTYPE}))
    q_bar = gl.allocate_shared_memory(gl.int64, [${CONSUMERS}, 1], mbarrier.MBarrierLayout())
    k_ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    k_empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    v_ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    v_empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    for part in gl.static_range(${CONSUMERS}):
        mbarrier.init(q_bar.index(part), count=1)
    for s in gl.static_range(STAGES):
        mbarrier.init(k_ready.index(s), count=1)
        mbarrier.init(v_ready.index(s), count=1)
        mbarrier.init(k_empty.index(s), count=${CONSUMERS})    # every consumer releases a stage
        mbarrier.init(v_empty.index(s), count=${CONSUMERS})
    args = (q_desc, k_desc, v_desc, q_smem, k_smem, v_smem, q_bar, k_ready, k_empty, v_ready, v_empty, row0, lo, hi,
            inner_lo, inner_hi, ${EXTRA})
    if LISTED_PARTITIONS:
        gl.warp_specialize([${LISTED}], [${WARPS}], [${REGS}])
    else:
        gl.warp_specialize(args, ${K}_part0, args, [${WORKERS}], [${WARPS}], [${REGS}])
''')

PARTITION = Template('''\
@gluon.jit
def ${K}_part${N}(q_desc, k_desc, v_desc, q_smem, k_smem, v_smem, q_bar, k_ready, k_empty, v_ready, v_empty, row0, lo,
        hi, inner_lo, inner_hi, ${EXTRA}):
    ${CALL}

''')

# the module's Gluon prelude: imports, the TMA copies' names in Triton 3.6 and later, the
# partitions' calling convention, and the TMA-readiness test of the launcher
PRELUDE = '''\
import inspect

from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import mbarrier, tma, warpgroup_mma, warpgroup_mma_wait
from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

ROWS = gl.constexpr(%d)    # rows of one consumer warpgroup (the warpgroup MMA's M)
# Triton 3.6 names the TMA copy async_copy_global_to_shared; later versions async_load
tma_load = getattr(tma, "async_load", None) or tma.async_copy_global_to_shared
# Triton 3.6 takes (default args, default fn, worker args, worker fns, warps, regs); later a list
LISTED_PARTITIONS = gl.constexpr("functions_and_args" in inspect.signature(gl.warp_specialize).parameters)


def _tma_ready(*views):
    # TMA reads a view whose last stride is 1 and whose base and other strides are 16-byte multiples
    # (the stores of tile results assume the same)
    return all(v.stride(-1) == 1 and v.data_ptr() %% 16 == 0 and
               all(s * v.element_size() %% 16 == 0 for s in v.stride()[:-1]) for v in views)
''' % ROWS


@dataclass
class HopperCode:
    name: str
    source: str          # its operands' TMA blocks and layouts (globals), the gl functions and the kernel
    launch: list[str]    # launcher lines (the TMA path; the caller adds the fallback)
    why: str
    helpers: set[str]


def emit(h: HopperFold, spec: KernelSchedule, ctx, name: str) -> HopperCode | str:
    """The Gluon kernel `name` of the Hopper form, or why it cannot be written (a name clash)."""
    helpers = {"base2"}
    taken: set[str] = set()
    names: dict = {}

    def fresh(key, text: str) -> str:
        if text in taken:
            raise _Clash(text)
        taken.add(text)
        names[key] = text
        return text

    try:
        params: list[str] = []          # kernel parameters after the descriptors
        launch_args: list[str] = []
        for x in (h.rows, h.keys, *h.batch):
            params.append(fresh(("extent", x), f"n_{ident(x)}"))
            launch_args.append(f'n["{x}"]')
        tensors = {}
        for e in [n for n in walk(h.fold.args[0]) if isinstance(n, Access) and n not in (h.a, h.b)] + \
                 [n for st in spec.statements for n in outside_folds(st.expr) if isinstance(n, Access)]:
            tensors.setdefault(e.tensor, ctx.tensors[e.tensor])
        for n in {n.name for st in spec.statements for n in outside_folds(st.expr) if isinstance(n, Extent)} | \
                {n.name for n in walk(h.fold.args[0]) if isinstance(n, Extent)} | \
                {n.name for b in h.bounds for n in walk(b.offset) if isinstance(n, Extent)}:
            if ("extent", n) not in names:
                params.append(fresh(("extent", n), f"n_{ident(n)}"))
                launch_args.append(f'n["{n}"]')
        for st in spec.statements:
            tensors[st.name] = ctx.tensors[st.name]
        # the bounds' positions (a shard's start: 0-d integer tensors), read once as int32
        offsets = dict.fromkeys(n.tensor for b in h.bounds for n in walk(b.offset) if isinstance(n, Access))
        for tensor in offsets:
            tensors.setdefault(tensor, ctx.tensors[tensor])
            fresh(("position", tensor), f"{ident(tensor)}_at")
        for tensor, info in tensors.items():
            if info.kind == "number":
                params.append(fresh(("tensor", tensor), f"{ident(tensor)}_val"))
                launch_args.append(f'float(t["{tensor}"])')
            else:
                pointer = fresh(("pointer", tensor), f"{ident(tensor)}_ptr")
                strides = [fresh(("stride", tensor, d), f"{ident(tensor)}_s{d}") for d in range(info.rank)]
                names[("tensor", tensor)] = (pointer, strides)
                params += [pointer, *strides]
                launch_args += [f't["{tensor}"]'] + ([f'*t["{tensor}"].stride()'] if info.rank else [])
        coords = [fresh(("coord", x), f"idx_{ident(x)}") for x in h.batch]
    except _Clash as clash:     # a scalar `n` and an index `val` would both be n_val (the skeleton's
        return f"the generated name {clash} would mean two things"     # own names match no such spelling)
    extra = ", ".join(coords + params)
    logits = _logits_function(h, ctx, names, helpers, name, extra)
    store = _store_function(h, spec, ctx, names, helpers, name, extra)
    n_rows, n_keys = names[("extent", h.rows)], names[("extent", h.keys)]
    coord_lines = _coordinates(h, names)
    bounds = _bound_lines(h, names, helpers, n_rows)
    dtype = GL_DTYPES[h.dtype]
    at, block, globals_ = {}, {}, []
    for x, access, inner, rows, height in _operands(h):
        batch = [i for i in access.indices if i not in inner]
        at[x] = "".join(f"{names[('coord', y)]}, " for y in batch)
        block[x] = "[" + ", ".join(["1"] * len(batch) + [rows, str(ctx.extent(inner[1]))]) + "]"
        # each operand's TMA block and its shared-memory layout, module globals of the launcher
        globals_.append(f"{name}_{x}_block = {[1] * len(batch) + [height, ctx.extent(inner[1])]}")
        globals_.append(f"{name}_{x}_layout = gl.NVMMASharedLayout.get_default_for({name}_{x}_block, {dtype})")
    tiling = h.tiling
    consumers = tiling.consumers
    workers = [f"{name}_part{n}" for n in range(1, consumers + 1)]
    partitions = "".join(PARTITION.substitute(
        K=name, N=n, EXTRA=extra,
        CALL=(f"{name}_consumer({n}, q_smem, k_smem, v_smem, q_bar, k_ready, k_empty, v_ready, v_empty, row0, lo, "
              f"hi, inner_lo, inner_hi, {extra})" if n < consumers else
              f"{name}_loader(q_desc, k_desc, v_desc, q_smem, k_smem, v_smem, q_bar, k_ready, k_empty, v_ready, "
              f"v_empty, row0, lo, hi, {extra})")) for n in range(consumers + 1))
    before = any(not b.upper for b in h.bounds)
    after = any(b.upper for b in h.bounds) or ctx.extent(h.keys) % tiling.key_tile != 0
    # (start, stop, MASKED) of each loop after the first tile: masked tiles on both sides share one
    # loop that tests each tile (the window: built in 4.2 s instead of 7.4 s on the H100, as fast);
    # one masked side keeps its own loop (causal: one loop measured 2-4% slower)
    ranges = ([("lo + 1", "hi", "(t < inner_lo) | (t >= inner_hi)")] if before and after else
              [("lo + 1", "inner_lo", "True")] * before + [("gl.maximum(inner_lo, lo + 1)", "inner_hi", "False")] +
              [("gl.maximum(inner_hi, lo + 1)", "hi", "True")] * after)
    loops = "".join(f"    for t in range({start}, {stop}):\n"
                    f"        r, p, l, acc = {name}_step(q, k_smem, v_smem, k_ready, k_empty, v_ready, v_empty, t, "
                    f"t - lo, zeros, r, p, l,\n"
                    f"                                 acc, rows, {extra}, {masked})\n"
                    for start, stop, masked in ranges)
    why = (f"{spec.why}; on sm_90 in the Hopper form (Gluon): a TMA loader warp and {consumers} consumer "
           f"warpgroups of {ROWS} rows, each tile's scores issued before the previous tile's P V")
    source = SKELETON.substitute(
        K=name, EXTRA=extra, PARAMS=", ".join(params), WHY=why, LOOPS=loops,
        CONSUMERS=consumers, COORDS="\n".join(coord_lines),
        N_ROWS=n_rows, N_KEYS=n_keys, BOUNDS="\n".join(bounds), DTYPE=dtype, DEPTH=ctx.extent(h.depth),
        WIDTH=ctx.extent(h.width), A_AT=at["a"], B_AT=at["b"], V_AT=at["v"], A_BLOCK=block["a"],
        B_BLOCK=block["b"], V_BLOCK=block["v"], PARTITIONS=partitions.rstrip() + "\n",
        LISTED=", ".join(f"({w}, args)" for w in [f"{name}_part0", *workers]), WORKERS=", ".join(workers),
        WARPS=", ".join(["4"] * (consumers - 1) + ["1"]),
        REGS=", ".join([str(tiling.consumer_regs)] * (consumers - 1) + [str(tiling.loader_regs)]))
    source = "\n".join(globals_) + "\n\n\n" + "\n\n".join([logits, store, source])
    launch = _launch_lines(h, spec, name, launch_args)
    return HopperCode(name, source, launch, why, helpers)


class _Clash(Exception):
    pass


def _operands(h: HopperFold):
    """(role, access, its (row, inner) indices, the rows of its TMA block by name and by value)
    of each operand the loader copies."""
    key_tile = h.tiling.key_tile
    return (("a", h.a, (h.rows, h.depth), "ROWS", ROWS), ("b", h.b, (h.keys, h.depth), "BLOCK_N", key_tile),
            ("v", h.v, (h.keys, h.width), "BLOCK_N", key_tile))


def _coordinates(h: HopperFold, names) -> list[str]:
    """The program's row block and batch coordinates (the last batch index fastest); the
    row blocks whose loops are longest (an upper bound rising with the row) first."""
    rising = any(b.upper and b.other == h.rows and b.sign > 0 for b in h.bounds)
    lines = ["    pid_m = gl.program_id(0)"]
    if rising:
        lines.append("    pid_m = gl.num_programs(0) - 1 - pid_m     # the longest rows first")
    if h.batch:
        lines.append("    pid = gl.program_id(1)")
    for k, x in enumerate(reversed(h.batch)):
        coord = names[("coord", x)]
        if k == len(h.batch) - 1:
            lines.append(f"    {coord} = pid")
        else:
            lines.append(f"    {coord} = pid % {names[('extent', x)]}")
            lines.append(f"    pid = pid // {names[('extent', x)]}")
    return lines


def _bound_lines(h: HopperFold, names, helpers: set[str], n_rows: str) -> list[str]:
    """Tile bounds from each relation `m op sign * other + offset` over the block's rows
    row0 .. row_last (numerators kept >= 0 so that // floors).  A position in an offset
    (a 0-d integer tensor) is loaded once, as int32 like the tile indices."""
    lines = ([f"    row_last = gl.minimum(row0 + BLOCK_M, {n_rows}) - 1"]
             if any(b.other == h.rows for b in h.bounds) else [])
    positions = {n: names[("position", n.tensor)] for b in h.bounds for n in walk(b.offset)
                 if isinstance(n, Access)}
    lines += [f"    {at} = gl.load({names[('tensor', n.tensor)][0]}).to(gl.int32)" for n, at in positions.items()]
    printer = Printer(None, names, {}, {}, positions, helpers)
    for b in h.bounds:
        step = {"le": 0, "lt": -1, "ge": 0, "gt": 1}[b.op]
        c = constant(b.offset)
        if c is not None:
            total = int(c) + step
            shift = "" if total == 0 else f" + {total}" if total > 0 else f" - {-total}"
        else:
            shift = f" + {printer.code(b.offset)[0]}" + ("" if step == 0 else f" + {step}" if step > 0 else " - 1")
        if b.other is None:
            low = high = f"(0{shift})"
        elif b.other == h.rows:
            ends = ("row0", "row_last") if b.sign > 0 else ("-row_last", "-row0")
            low, high = (f"({end}{shift})" if shift else end for end in ends)
        else:
            coord = names[("coord", b.other)]
            low = high = f"({'' if b.sign > 0 else '-'}{coord}{shift})"
        lines.append(f"    # {b}")
        if b.upper:
            lines.append(f"    hi = gl.minimum(hi, (gl.maximum({high}, -1) + BLOCK_N) // BLOCK_N)")
            lines.append(f"    inner_hi = gl.minimum(inner_hi, gl.maximum({low} + 1, 0) // BLOCK_N)")
        else:
            lines.append(f"    lo = gl.maximum(lo, gl.maximum({low}, 0) // BLOCK_N)")
            lines.append(f"    inner_lo = gl.maximum(inner_lo, (gl.maximum({high}, 0) + BLOCK_N - 1) // BLOCK_N)")
    return lines


def _leader_factor(h: HopperFold, ctx) -> tuple[Expr | None, Expr, Expr]:
    """(c, y on tiles where a mask may bite, y on interior tiles): the leader's argument x = c * y
    with its positive scalar factor c split off, shared by both kinds of tile (else None)."""
    x0 = h.fold.args[0]
    interior = h.fold
    for b in h.bounds:
        interior = assume_relation(interior, b)
    c, y_masked = positive_split(x0, set(ctx.positive))
    c_inner, y_inner = positive_split(interior.args[0], set(ctx.positive))
    if c != c_inner:        # both kinds of tile must share the factor: none
        return None, x0, interior.args[0]
    return c, y_masked, y_inner


def _logits_function(h: HopperFold, ctx, names, helpers, name: str, extra: str) -> str:
    indices = {x: names[("coord", x)] for x in h.batch} | {h.rows: "rows[:, None]", h.keys: "cols[None, :]"}
    masks = {h.rows: f"(rows[:, None] < {names[('extent', h.rows)]})",
             h.keys: f"(cols[None, :] < {names[('extent', h.keys)]})"}
    printer = Printer(ctx, names, indices, masks, {h.contraction: "qk"}, helpers)
    x0 = h.fold.args[0]
    c, y_masked, y_inner = _leader_factor(h, ctx)
    factor = "1.0" if c is None else printer.code(c)[0]
    lines = ["@gluon.jit", f"def {name}_logits(qk, rows, cols, {extra}, MASKED):",
             f"    # the leader's argument x = c * y on one tile from its scores qk = {format_expr(h.contraction)}:",
             f"    # x = {format_expr(x0)}" + (f", c = {format_expr(c)}" if c is not None else ""),
             "    if MASKED:     # a tile that may hold masked keys, or keys past the end",
             f"        y = {printer.code(y_masked)[0]}",
             f"        y = gl.where({masks[h.keys]}, y, -float(\"inf\"))",
             "    else:          # the bounding relations hold on the whole tile",
             f"        y = {printer.code(y_inner)[0]}",
             f"    return y, {factor}"]
    return "\n".join(lines) + "\n"


def _store_function(h: HopperFold, spec, ctx, names, helpers, name: str, extra: str) -> str:
    n_rows = names[("extent", h.rows)]
    width = ctx.extent(h.width)
    lanes = min(32, width // 8)
    c, _, _ = _leader_factor(h, ctx)
    factor = None if c is None else Printer(ctx, names, {}, {}, {}, helpers).code(c)[0]
    with_factor = "" if factor is None else f", {factor}"
    lines = ["@gluon.jit", f"def {name}_store(r, l, acc, rows, {extra}):",
             "    # the results from the final states: _gl_natural divides the rounding of the base-2 reference",
             "    # point out of the fields; tiles are stored from a blocked layout, 8 consecutive values a thread,",
             "    # their alignment given: a worker partition does not see its arguments' (Triton 3.6 stored one",
             "    # value an instruction there, 4.5 times the ideal store traffic)",
             "    o_rows: gl.constexpr = gl.SliceLayout(1, acc.type.layout)",
             f"    out: gl.constexpr = gl.BlockedLayout([1, 8], [{32 // lanes}, {lanes}], [4, 1], [1, 0])",
             f"    l = _gl_natural(l, r{with_factor})" if h.weight_sum else "",
             "    rows_o = gl.convert_layout(rows, o_rows)",
             "    cols_o = gl.arange(0, acc.shape[1], layout=gl.SliceLayout(0, acc.type.layout))",
             "    rows_out = gl.convert_layout(rows, gl.SliceLayout(1, out))",
             "    cols_out = gl.arange(0, acc.shape[1], layout=gl.SliceLayout(0, out))",
             f"    u = _gl_natural(acc, gl.convert_layout(r, o_rows)[:, None]{with_factor})",
             # the fold's leader is the max of y; the statements read the max of x = c * y
             f"    r = {factor} * r" if factor is not None else ""]
    by_field = {h.leader: "r", h.weighted: "u"} | ({h.weight_sum: "l"} if h.weight_sum else {})
    batch = {x: names[("coord", x)] for x in h.batch}
    for st in spec.statements:
        tile = h.width in st.indices
        if tile:
            indices = batch | {h.rows: "rows_o[:, None]", h.width: "cols_o[None, :]"}
            leaves = {replace(h.fold, result=f): code if code == "u" else f"gl.convert_layout({code}, o_rows)[:, None]"
                      for f, code in by_field.items()}
            masks = {h.rows: f"(rows_o[:, None] < {n_rows})"}
            at = batch | {h.rows: "rows_out[:, None]", h.width: "cols_out[None, :]"}
            mask = f"rows_out[:, None] < {n_rows}"
        else:
            indices = at = batch | {h.rows: "rows"}
            leaves = {replace(h.fold, result=f): code for f, code in by_field.items() if code != "u"}
            masks = {h.rows: f"(rows < {n_rows})"}
            mask = f"rows < {n_rows}"
        value, _ = Printer(ctx, names, indices, masks, leaves, helpers).code(st.expr)
        if tile:
            value = f"gl.convert_layout({value}, out)"
        pointer, strides = names[("tensor", st.name)]
        address = " + ".join([pointer] + [f"{at[x]}.to(gl.int64) * {s}" for x, s in zip(st.indices, strides)])
        if _stored_aligned(st, h):    # rows 16-byte aligned, values contiguous: the launcher checked
            address = f"gl.max_contiguous(gl.multiple_of({address}, [16, 16]), [1, 8])"
        lines.append(f"    # {st.name}[{', '.join(st.indices)}]")
        lines.append(f"    gl.store({address}, ({value}).to({pointer}.dtype.element_ty), mask={mask})")
    lines = [line for line in lines if line]
    # the names no statement reads (a per-row result alone reads no column) are not defined
    for local in ("u", "cols_out", "rows_out", "cols_o", "rows_o"):
        definition = next(k for k, line in enumerate(lines) if line.startswith(f"    {local} = "))
        if not any(re.search(rf"\b{local}\b", line) for line in lines[definition + 1:]):
            del lines[definition]
    return "\n".join(lines) + "\n"


def _stored_aligned(st, h: HopperFold) -> bool:
    """Whether the tile result `st` is stored with its alignment stated (the launcher checks
    it): its values' index is its last, as laid out contiguously (a result laid out otherwise,
    `O[.., j, i]`, is stored without the statement)."""
    return st.indices[-1] == h.width


def _view(tensor: str, indices: tuple[str, ...], inner: tuple[str, str]) -> str:
    """t[tensor] viewed as (batch.., *inner)."""
    order = [*(i for i in indices if i not in inner), *inner]
    perm = [indices.index(i) for i in order]
    return f't["{tensor}"]' + (f".permute({', '.join(map(str, perm))})" if perm != sorted(perm) else "")


def _launch_lines(h: HopperFold, spec: KernelSchedule, name: str, launch_args: list[str]) -> list[str]:
    """The launch through TMA descriptors: each operand viewed as (batch.., rows, inner); the
    tile results, stored by pointer, must meet TMA's alignment too (their stores assume it)."""
    lines = []
    views = []
    for x, access, inner, _, _ in _operands(h):
        view = f'{name}_{x}'
        lines.append(f'    {view} = {_view(access.tensor, access.indices, inner)}')
        views.append(view)
    results = [_view(st.name, st.indices, (h.rows, h.width)) for st in spec.statements if _stored_aligned(st, h)]
    grid = " * ".join(f'n["{x}"]' for x in h.batch) or "1"
    lines.append(f"    if _tma_ready({', '.join(views + results)}):")
    lines.append(f"        {name}[(triton.cdiv(n[\"{h.rows}\"], {h.tiling.rows}), {grid})](")
    descriptors = [f"TensorDescriptor({view}, list({view}.shape), list({view}.stride()), {name}_{x}_block, "
                   f"{name}_{x}_layout)"
                   for view, x in zip(views, "abv")]
    lines.append("            " + ", ".join(descriptors) + ",")
    lines.append("            " + ", ".join(launch_args) +
                 f", BLOCK_N={h.tiling.key_tile}, STAGES={h.tiling.stages}, num_warps=4)")
    return lines
