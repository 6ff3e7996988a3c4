"""Probe (issue 13): how fast is attention on Hopper when written in Gluon with the
FlashAttention-3 structure, and how general can that structure stay?  A loader warp
feeds K and V through TMA into rings of shared memory guarded by mbarriers; two
consumer warpgroups of 64 query rows each issue the next tile's scores Q K^T as an
asynchronous warpgroup MMA before their softmax of the current tile, so the tensor
cores run while the softmax does.  What varies between programs is one function, the
tile's logits c * y from the scores, the row and column indices, the head and one extra
tensor (plain, softcap, ALiBi with per-head slopes), and the causal predicate, which
sets the loop's bounds and masks the tiles that straddle it.  Descriptors are 3-D
([batch x heads, rows, d]) so that ragged lengths read zeros past a head's end and
stores stop there; grouped-query heads map to their K/V head.  Timed beside einfold's
generated `tl` kernel and SDPA's cuDNN backend in one process, checked against float64.

    python3 scripts/gluon_probe.py                 # on an sm_90 GPU: a table; rows to $OUT/gluon_probe.json
    python3 scripts/gluon_probe.py --compile-only  # no GPU needed: every variant built for sm_90a

PROBE_CASES=score[-causal]:batch:heads:sequence:d[:kv heads],... and
PROBE_CONFIGS=key tile:stages:consumer registers:loader registers,... pick others;
PROBE_IN_ORDER=1 adds consumers that run each tile in program order (scores, softmax,
P V, each waited for), as the `tl` emitter writes the loop.  Rows with no key at all
(none arise here) would divide by a zero sum: einfold's _natural epilogue is not copied.
"""
from __future__ import annotations

import importlib.util
import inspect
import json
import os
import re
import sys
import traceback

import torch
import triton
import triton.testing
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (fence_async_shared, mbarrier, tma, warpgroup_mma,
                                                              warpgroup_mma_wait)
from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

import compiler
from compiler.bench import GROUPED_QUERY, SCALED, attention_of, training_attention

LOG2E = gl.constexpr(1.4426950408889634)
ROWS = gl.constexpr(64)    # query rows of one consumer warpgroup (wgmma's M per warpgroup)
# Triton 3.6 names the TMA copies async_copy_global_to_shared / async_copy_shared_to_global
tma_load = getattr(tma, "async_load", None) or tma.async_copy_global_to_shared
tma_store = getattr(tma, "async_store", None) or tma.async_copy_shared_to_global
# Triton 3.6 takes (default args, default fn, worker args, worker fns, warps, regs);
# later versions take a list of (fn, args) pairs
LISTED_PARTITIONS = gl.constexpr("functions_and_args" in inspect.signature(gl.warp_specialize).parameters)


@gluon.jit
def _tanh(x):
    # einfold's tanh (compiler/backend/triton/ops.py), in gl
    e = gl.exp(-2.0 * gl.abs(x))
    t = (1.0 - e) / (1.0 + e)
    t = gl.where(x < 0, -t, t)
    x2 = x * x
    series = x * (1.0 - x2 * (1.0 / 3.0 - x2 * (2.0 / 15.0 - x2 * (17.0 / 315.0))))
    return gl.where(gl.abs(x) < 0.1, series, t)


# Score functions: the logits of a tile as c * y, from the scores qk = Q K^T, the
# tile's query rows and key columns (index vectors), the head, the softmax scale and
# one extra tensor: y and the positive scalar c, which carries log2(e) (the weights are
# exp2(y c - r): one fma a score, and the max of c y is c times the max of y).  An
# emitter would generate this function from the program's logits expression; the
# loop around it does not change.
@gluon.jit
def plain_score(qk, rows, cols, head, scale, extra_ptr):
    return qk, scale * LOG2E


@gluon.jit
def softcap_score(qk, rows, cols, head, scale, extra_ptr):
    return _tanh(qk * (scale / 30.0)), 30.0 * LOG2E


@gluon.jit
def alibi_score(qk, rows, cols, head, scale, extra_ptr):
    slope = gl.load(extra_ptr + head).to(gl.float32)
    distance = gl.abs(rows[:, None] - cols[None, :]).to(gl.float32)
    return qk * scale - slope * distance, LOG2E


SCORES = {"plain": plain_score, "softcap": softcap_score, "alibi": alibi_score}
SCORE = plain_score           # the variant's (see variant())
CAUSAL = gl.constexpr(False)
ROTATE = gl.constexpr(True)   # the next tile's scores issued before this tile's softmax


@gluon.jit
def _scores(q, k_smem, k_ready, t, zeros):
    """Issue tile t's scores Q K^T as an asynchronous warpgroup MMA, once its K tile has landed."""
    STAGES: gl.constexpr = k_smem.shape[0]
    mbarrier.wait(k_ready.index(t % STAGES), (t // STAGES) & 1)
    return warpgroup_mma(q, k_smem.index(t % STAGES).permute((1, 0)), zeros, use_acc=False, is_async=True)


@gluon.jit
def _logits(qk, t, rows, head, scale, extra_ptr, seq_kv, MASKED: gl.constexpr):
    """Tile t's logits as c * y; on tiles that may hold them, keys past the end or (causal) after the
    row are -inf."""
    BLOCK_N: gl.constexpr = qk.shape[1]
    cols = t * BLOCK_N + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, qk.type.layout))
    y, c = SCORE(qk, rows, cols, head, scale, extra_ptr)
    if MASKED:
        keep = cols[None, :] < seq_kv
        if CAUSAL:
            keep = keep & (cols[None, :] <= rows[:, None])
        y = gl.where(keep, y, -float("inf"))
    return y, c


@gluon.jit
def _weights(y, c, r):
    """The running max (base 2) moved by the tile's logits c * y, its repair factor and the tile's
    weights; a row with no key yet keeps the stand-in 0 so that no -inf - -inf appears."""
    r_new = gl.maximum(r, gl.max(y, 1) * c)
    r_use = gl.where(r_new == -float("inf"), 0.0, r_new)
    return r_new, gl.exp2(r - r_use), gl.exp2(y * c - r_use[:, None])


@gluon.jit
def _step(q, k_smem, v_smem, k_ready, k_empty, v_ready, v_empty, t, zeros, r, p, l, acc, rows, head, scale,
          extra_ptr, seq_kv, MASKED: gl.constexpr):
    """One step of the rotated loop: tile t's scores go to the tensor cores, then tile t - 1's weights
    P times V; tile t's softmax runs while P V is in flight."""
    STAGES: gl.constexpr = k_smem.shape[0]
    o_rows: gl.constexpr = gl.SliceLayout(1, acc.type.layout)
    p_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=acc.type.layout, k_width=2)
    qk_token = _scores(q, k_smem, k_ready, t, zeros)
    prev = (t - 1) % STAGES
    mbarrier.wait(v_ready.index(prev), ((t - 1) // STAGES) & 1)
    p_op = gl.convert_layout(p.to(v_smem.dtype), p_layout)
    acc_token = warpgroup_mma(p_op, v_smem.index(prev), acc, is_async=True)
    qk = warpgroup_mma_wait(1, deps=(qk_token, ))
    mbarrier.arrive(k_empty.index(t % STAGES), count=1)
    y, c = _logits(qk, t, rows, head, scale, extra_ptr, seq_kv, MASKED)
    r_new, alpha, p = _weights(y, c, r)
    l = l * alpha + gl.sum(p, 1)
    acc, p_op = warpgroup_mma_wait(0, deps=(acc_token, p_op))
    mbarrier.arrive(v_empty.index(prev), count=1)
    acc = acc * gl.convert_layout(alpha, o_rows)[:, None]
    return r_new, p, l, acc


@gluon.jit
def _plain_step(q, k_smem, v_smem, k_ready, k_empty, v_ready, v_empty, t, zeros, r, l, acc, rows, head, scale,
                extra_ptr, seq_kv, MASKED: gl.constexpr):
    """One step of the loop in program order (as `tl` emits it): scores, softmax, then P V, each
    waited for; only the other consumer's work overlaps this one's softmax."""
    STAGES: gl.constexpr = k_smem.shape[0]
    o_rows: gl.constexpr = gl.SliceLayout(1, acc.type.layout)
    p_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=acc.type.layout, k_width=2)
    qk = warpgroup_mma_wait(0, deps=(_scores(q, k_smem, k_ready, t, zeros), ))
    mbarrier.arrive(k_empty.index(t % STAGES), count=1)
    y, c = _logits(qk, t, rows, head, scale, extra_ptr, seq_kv, MASKED)
    r_new, alpha, p = _weights(y, c, r)
    l = l * alpha + gl.sum(p, 1)
    acc = acc * gl.convert_layout(alpha, o_rows)[:, None]
    mbarrier.wait(v_ready.index(t % STAGES), (t // STAGES) & 1)
    p_op = gl.convert_layout(p.to(v_smem.dtype), p_layout)
    acc, p_op = warpgroup_mma_wait(0, deps=(warpgroup_mma(p_op, v_smem.index(t % STAGES), acc, is_async=True), p_op))
    mbarrier.arrive(v_empty.index(t % STAGES), count=1)
    return r_new, l, acc


@gluon.jit
def _in_order(q, k_smem, v_smem, k_ready, k_empty, v_ready, v_empty, zeros, acc, rows, head, scale, extra_ptr, seq_kv,
              n_tiles, n_unmasked):
    """The loop in program order: (acc, l) after every tile."""
    r = gl.full([ROWS], -float("inf"), gl.float32, gl.SliceLayout(1, zeros.type.layout))
    l = gl.zeros([ROWS], gl.float32, gl.SliceLayout(1, zeros.type.layout))
    for t in range(0, n_unmasked):
        r, l, acc = _plain_step(q, k_smem, v_smem, k_ready, k_empty, v_ready, v_empty, t, zeros, r, l, acc, rows,
                                head, scale, extra_ptr, seq_kv, False)
    for t in range(n_unmasked, n_tiles):
        r, l, acc = _plain_step(q, k_smem, v_smem, k_ready, k_empty, v_ready, v_empty, t, zeros, r, l, acc, rows,
                                head, scale, extra_ptr, seq_kv, True)
    return acc, l


@gluon.jit
def _rotated(q, k_smem, v_smem, k_ready, k_empty, v_ready, v_empty, zeros, acc, rows, head, scale, extra_ptr, seq_kv,
             n_tiles, n_unmasked):
    """The rotated loop: tile 0's softmax before it, the last tile's P V after it; (acc, l)."""
    STAGES: gl.constexpr = k_smem.shape[0]
    p_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=acc.type.layout, k_width=2)
    qk = warpgroup_mma_wait(0, deps=(_scores(q, k_smem, k_ready, 0, zeros), ))
    mbarrier.arrive(k_empty.index(0), count=1)
    y, c = _logits(qk, 0, rows, head, scale, extra_ptr, seq_kv, True)
    r, alpha, p = _weights(y, c, gl.full([ROWS], -float("inf"), gl.float32, gl.SliceLayout(1, zeros.type.layout)))
    l = gl.sum(p, 1)
    for t in range(1, n_unmasked):
        r, p, l, acc = _step(q, k_smem, v_smem, k_ready, k_empty, v_ready, v_empty, t, zeros, r, p, l, acc, rows,
                             head, scale, extra_ptr, seq_kv, False)
    for t in range(gl.maximum(n_unmasked, 1), n_tiles):
        r, p, l, acc = _step(q, k_smem, v_smem, k_ready, k_empty, v_ready, v_empty, t, zeros, r, p, l, acc, rows,
                             head, scale, extra_ptr, seq_kv, True)
    last = (n_tiles - 1) % STAGES
    mbarrier.wait(v_ready.index(last), ((n_tiles - 1) // STAGES) & 1)
    p_op = gl.convert_layout(p.to(v_smem.dtype), p_layout)
    acc, p_op = warpgroup_mma_wait(0, deps=(warpgroup_mma(p_op, v_smem.index(last), acc, is_async=True), p_op))
    mbarrier.arrive(v_empty.index(last), count=1)
    return acc, l


@gluon.jit
def _consumer(part: gl.constexpr, q_smem, k_smem, v_smem, q_bar, k_ready, k_empty, v_ready, v_empty, o_desc, q_bh,
              row0, head, scale, extra_ptr, seq_kv, n_tiles, n_unmasked):
    BLOCK_N: gl.constexpr = k_smem.shape[1]
    HEAD_D: gl.constexpr = k_smem.shape[2]
    s_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                       instr_shape=[16, BLOCK_N, 16])
    o_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                       instr_shape=[16, HEAD_D, 16])
    rows = row0 + part * ROWS + gl.arange(0, ROWS, layout=gl.SliceLayout(1, s_layout))
    q = q_smem.index(part)
    mbarrier.wait(q_bar.index(part), 0)
    zeros = gl.zeros([ROWS, BLOCK_N], gl.float32, s_layout)
    acc = gl.zeros([ROWS, HEAD_D], gl.float32, o_layout)
    if ROTATE:
        acc, l = _rotated(q, k_smem, v_smem, k_ready, k_empty, v_ready, v_empty, zeros, acc, rows, head, scale,
                          extra_ptr, seq_kv, n_tiles, n_unmasked)
    else:
        acc, l = _in_order(q, k_smem, v_smem, k_ready, k_empty, v_ready, v_empty, zeros, acc, rows, head, scale,
                           extra_ptr, seq_kv, n_tiles, n_unmasked)
    o = acc / gl.convert_layout(l, gl.SliceLayout(1, o_layout))[:, None]
    q.store(o.to(o_desc.dtype))    # Q's buffer is free: it holds O on its way out
    fence_async_shared()
    tma_store(o_desc, [q_bh, row0 + part * ROWS, 0], q.reshape([1, ROWS, HEAD_D]))
    tma.store_wait(0)


@gluon.jit
def _loader(q_desc, k_desc, v_desc, q_smem, k_smem, v_smem, q_bar, k_ready, k_empty, v_ready, v_empty, q_bh, kv_bh,
            row0, n_tiles):
    STAGES: gl.constexpr = k_smem.shape[0]
    BLOCK_N: gl.constexpr = k_smem.shape[1]
    HEAD_D: gl.constexpr = k_smem.shape[2]
    CONSUMERS: gl.constexpr = q_smem.shape[0]
    for part in gl.static_range(CONSUMERS):
        mbarrier.expect(q_bar.index(part), q_desc.block_type.nbytes)
        tma_load(q_desc, [q_bh, row0 + part * ROWS, 0], q_bar.index(part),
                 q_smem.index(part).reshape([1, ROWS, HEAD_D]))
    for t in range(n_tiles):
        stage = t % STAGES
        free = ((t // STAGES) & 1) ^ 1     # the first pass over the ring waits for nothing
        mbarrier.wait(k_empty.index(stage), free)
        mbarrier.expect(k_ready.index(stage), k_desc.block_type.nbytes)
        tma_load(k_desc, [kv_bh, t * BLOCK_N, 0], k_ready.index(stage),
                 k_smem.index(stage).reshape([1, BLOCK_N, HEAD_D]))
        mbarrier.wait(v_empty.index(stage), free)
        mbarrier.expect(v_ready.index(stage), v_desc.block_type.nbytes)
        tma_load(v_desc, [kv_bh, t * BLOCK_N, 0], v_ready.index(stage),
                 v_smem.index(stage).reshape([1, BLOCK_N, HEAD_D]))


# one function per partition: Triton 3.6 passes every worker the same arguments
@gluon.jit
def _part0(q_desc, k_desc, v_desc, o_desc, q_smem, k_smem, v_smem, q_bar, k_ready, k_empty, v_ready, v_empty, q_bh,
           kv_bh, row0, head, scale, extra_ptr, seq_kv, n_tiles, n_unmasked):
    _consumer(0, q_smem, k_smem, v_smem, q_bar, k_ready, k_empty, v_ready, v_empty, o_desc, q_bh, row0, head, scale,
              extra_ptr, seq_kv, n_tiles, n_unmasked)


@gluon.jit
def _part1(q_desc, k_desc, v_desc, o_desc, q_smem, k_smem, v_smem, q_bar, k_ready, k_empty, v_ready, v_empty, q_bh,
           kv_bh, row0, head, scale, extra_ptr, seq_kv, n_tiles, n_unmasked):
    _consumer(1, q_smem, k_smem, v_smem, q_bar, k_ready, k_empty, v_ready, v_empty, o_desc, q_bh, row0, head, scale,
              extra_ptr, seq_kv, n_tiles, n_unmasked)


@gluon.jit
def _load(q_desc, k_desc, v_desc, o_desc, q_smem, k_smem, v_smem, q_bar, k_ready, k_empty, v_ready, v_empty, q_bh,
          kv_bh, row0, head, scale, extra_ptr, seq_kv, n_tiles, n_unmasked):
    _loader(q_desc, k_desc, v_desc, q_smem, k_smem, v_smem, q_bar, k_ready, k_empty, v_ready, v_empty, q_bh, kv_bh,
            row0, n_tiles)


@gluon.jit
def attention_kernel(q_desc, k_desc, v_desc, o_desc, scale, extra_ptr, heads, group, seq_kv, BLOCK_N: gl.constexpr,
                     HEAD_D: gl.constexpr, STAGES: gl.constexpr, CONSUMER_REGS: gl.constexpr,
                     LOADER_REGS: gl.constexpr):
    """Q, O: [batch x heads, rows, d]; K, V: [batch x heads / group, keys, d] (grouped-query heads)."""
    BLOCK_M: gl.constexpr = 2 * ROWS
    pid_m = gl.program_id(0)
    if CAUSAL:    # the longest rows first
        pid_m = gl.num_programs(0) - 1 - pid_m
    q_bh = gl.program_id(1)
    head = q_bh % heads
    kv_bh = (q_bh // heads) * (heads // group) + head // group
    row0 = pid_m * BLOCK_M
    n_tiles = (seq_kv + BLOCK_N - 1) // BLOCK_N
    n_unmasked = seq_kv // BLOCK_N
    if CAUSAL:    # keys up to the block's last row; tiles past its first row are masked
        n_tiles = gl.minimum((row0 + BLOCK_M + BLOCK_N - 1) // BLOCK_N, n_tiles)
        n_unmasked = gl.minimum((row0 + 1) // BLOCK_N, n_unmasked)
    q_smem = gl.allocate_shared_memory(gl.bfloat16, [2, ROWS, HEAD_D],
                                       gl.NVMMASharedLayout.get_default_for([ROWS, HEAD_D], gl.bfloat16))
    kv_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_N, HEAD_D], gl.bfloat16)
    k_smem = gl.allocate_shared_memory(gl.bfloat16, [STAGES, BLOCK_N, HEAD_D], kv_layout)
    v_smem = gl.allocate_shared_memory(gl.bfloat16, [STAGES, BLOCK_N, HEAD_D], kv_layout)
    q_bar = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    k_ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    k_empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    v_ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    v_empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    for part in gl.static_range(2):
        mbarrier.init(q_bar.index(part), count=1)
    for s in gl.static_range(STAGES):
        mbarrier.init(k_ready.index(s), count=1)
        mbarrier.init(v_ready.index(s), count=1)
        mbarrier.init(k_empty.index(s), count=2)    # both consumers release a stage
        mbarrier.init(v_empty.index(s), count=2)
    args = (q_desc, k_desc, v_desc, o_desc, q_smem, k_smem, v_smem, q_bar, k_ready, k_empty, v_ready, v_empty, q_bh,
            kv_bh, row0, head, scale, extra_ptr, seq_kv, n_tiles, n_unmasked)
    if LISTED_PARTITIONS:
        gl.warp_specialize([(_part0, args), (_part1, args), (_load, args)], [4, 1], [CONSUMER_REGS, LOADER_REGS])
    else:
        gl.warp_specialize(args, _part0, args, [_part1, _load], [4, 1], [CONSUMER_REGS, LOADER_REGS])


def variant(score: str, causal: bool, rotate: bool = True):
    """A copy of this module whose kernels compute `score` (causal or not): Triton 3.6's
    warp_specialize passes its partitions tensors only, so a variant's constants are the
    module's globals, as a generated module would have them in its text."""
    key = f"gluon_probe_{score}_{int(causal)}_{int(rotate)}"
    if key not in sys.modules:
        spec = importlib.util.spec_from_file_location(key, __file__)
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        module.SCORE = module.SCORES[score]
        module.CAUSAL = gl.constexpr(causal)
        module.ROTATE = gl.constexpr(rotate)
        sys.modules[key] = module
    return sys.modules[key]


def gluon_attention(x, score, causal, block_n, stages, consumer_regs, loader_regs, rotate=True):
    module = variant(score, causal, rotate)
    q, k, v = x["Q"], x["K"], x["V"]
    b, h, s, d = q.shape
    h_kv, keys = k.shape[1], k.shape[2]
    out = torch.empty_like(q)
    rows = [ROWS.value, d]
    row_layout = gl.NVMMASharedLayout.get_default_for([1, *rows], gl.bfloat16)
    kv_layout = gl.NVMMASharedLayout.get_default_for([1, block_n, d], gl.bfloat16)

    def descriptor(t, block, layout):
        t3 = t.reshape(-1, t.shape[2], d)
        return TensorDescriptor(t3, list(t3.shape), list(t3.stride()), block, layout)
    q_desc = descriptor(q, [1, *rows], row_layout)
    o_desc = descriptor(out, [1, *rows], row_layout)
    k_desc = descriptor(k, [1, block_n, d], kv_layout)
    v_desc = descriptor(v, [1, block_n, d], kv_layout)
    extra = x.get("A", q)
    grid = (triton.cdiv(s, 2 * ROWS.value), b * h)

    def run():
        module.attention_kernel[grid](q_desc, k_desc, v_desc, o_desc, x["scale"], extra, h, h // h_kv, keys, block_n, d,
                               stages, consumer_regs, loader_regs, num_warps=4)
        return out
    return run


def reference(x, score, causal):
    """float64 attention of the variant."""
    q, k, v = (x[n].double() for n in "QKV")
    k = k.repeat_interleave(q.shape[1] // k.shape[1], 1)
    v = v.repeat_interleave(q.shape[1] // v.shape[1], 1)
    logits = q @ k.transpose(-1, -2) * x["scale"]
    i = torch.arange(q.shape[2], device=q.device)[:, None]
    m = torch.arange(k.shape[2], device=q.device)[None, :]
    if score == "softcap":
        logits = 30.0 * torch.tanh(logits / 30.0)
    elif score == "alibi":
        logits = logits - x["A"].double()[:, None, None] * (i - m).abs()
    if causal:
        logits = logits.masked_fill(m > i, -float("inf"))
    return torch.softmax(logits, -1) @ v


def einfold_run(score, causal, kv_heads):
    """einfold's generated kernel of the variant (compiler/bench.py's sources), on x."""
    if kv_heads:
        grouped = compiler.compile(GROUPED_QUERY)

        def run(x):
            b, h, s, d = x["Q"].shape
            q = x["Q"].view(b, kv_heads, h // kv_heads, s, d)
            return grouped(Q=q, K=x["K"], V=x["V"], scale=x["scale"]).reshape(b, h, s, d)
        return run
    program = compiler.compile(training_attention(score, causal) if score != "plain" else
                               attention_of(SCALED, "m <= i" if causal else None))
    names = {i.name for i in program.checked.inputs}
    return lambda x: program(**{k: v for k, v in x.items() if k in names})


def compile_only() -> None:
    """Compile every variant for sm_90a without a GPU (Triton's own ptxas; d = 128 and 64):
    whether the kernels build and, from the PTX, the registers each partition is given."""
    from triton.backends.compiler import GPUTarget
    from triton.experimental.gluon._runtime import GluonASTSource
    for score in SCORES:
        for causal, rotate in ((False, True), (True, True), (True, False)):
            for d in (128, 64):
                module = variant(score, causal, rotate)
                rows = gl.NVMMASharedLayout.get_default_for([1, ROWS.value, d], gl.bfloat16)
                keys = gl.NVMMASharedLayout.get_default_for([1, 128, d], gl.bfloat16)
                signature = {"q_desc": f"tensordesc<bf16[1,{ROWS.value},{d}],{rows!r}>",
                             "k_desc": f"tensordesc<bf16[1,128,{d}],{keys!r}>",
                             "v_desc": f"tensordesc<bf16[1,128,{d}],{keys!r}>",
                             "o_desc": f"tensordesc<bf16[1,{ROWS.value},{d}],{rows!r}>", "scale": "fp32",
                             "extra_ptr": "*bf16", "heads": "i32", "group": "i32", "seq_kv": "i32"}
                constants = {"BLOCK_N": 128, "HEAD_D": d, "STAGES": 2, "CONSUMER_REGS": 240, "LOADER_REGS": 24}
                names = list(signature) + list(constants)
                signature.update({n: "constexpr" for n in constants})
                source = GluonASTSource(module.attention_kernel, signature,
                                        {(names.index(n),): v for n, v in constants.items()})
                kernel = triton.compile(source, target=GPUTarget("cuda", 90, 32), options={"num_warps": 4})
                regs = sorted(set(re.findall(r"setmaxnreg\.\w+\.sync\.aligned\.u32\s+(\d+)", kernel.asm["ptx"])))
                print(f"{score:8s} causal={causal!s:5s} rotated={rotate!s:5s} d={d:3d}: {kernel.metadata.shared} bytes of shared memory, "
                      f"partition registers {', '.join(regs)}", flush=True)


def main() -> None:
    if sys.argv[1:] == ["--compile-only"]:
        return compile_only()
    print("triton", triton.__version__, "listed partitions:", bool(LISTED_PARTITIONS), flush=True)
    # score[-causal]:batch:heads:sequence:head dimension[:kv heads]
    cases = [c.split(":") for c in os.environ.get(
        "PROBE_CASES", "plain:16:16:1024:128,plain:4:16:4096:128,plain-causal:4:16:4096:128,softcap:4:16:4096:128,"
        "alibi:4:16:4096:128,alibi-causal:4:16:4096:128,plain:4:32:4096:128:8,plain:4:16:4000:128,"
        "plain-causal:3:5:1021:128,alibi-causal:2:3:333:64,plain:2:3:1:128").split(",")]
    # key tile:stages:consumer registers:loader registers
    configs = [tuple(int(v) for v in c.split(":")) for c in os.environ.get("PROBE_CONFIGS", "128:2:240:24").split(",")]
    rows = []
    from torch.nn.attention import SDPBackend, sdpa_kernel
    for case in cases:
        score, causal = case[0].split("-")[0], case[0].endswith("-causal")
        b, h, s, d = (int(v) for v in case[1:5])
        kv_heads = int(case[5]) if len(case) > 5 else 0
        g = torch.Generator(device="cuda").manual_seed(0)
        x = {"Q": torch.randn(b, h, s, d, device="cuda", dtype=torch.bfloat16, generator=g)}
        for n in "KV":
            x[n] = torch.randn(b, kv_heads or h, s, d, device="cuda", dtype=torch.bfloat16, generator=g)
        x["scale"] = d ** -0.5
        x["cap"] = 30.0
        x["A"] = torch.tensor([2 ** (-8 * (n + 1) / h) for n in range(h)], device="cuda", dtype=torch.bfloat16)
        ref = reference(x, score, causal)
        contenders = {"einfold": (lambda run: lambda: run(x))(einfold_run(score, causal, kv_heads))}
        if score == "plain":
            def cudnn():
                with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
                    return torch.nn.functional.scaled_dot_product_attention(
                        x["Q"], x["K"], x["V"], is_causal=causal, enable_gqa=bool(kv_heads))
            contenders["cudnn"] = cudnn
        for block_n, stages, cregs, lregs in configs:
            contenders[f"gluon n{block_n} st{stages} r{cregs}/{lregs}"] = gluon_attention(
                x, score, causal, block_n, stages, cregs, lregs)
            if os.environ.get("PROBE_IN_ORDER"):
                contenders[f"in order n{block_n} st{stages} r{cregs}/{lregs}"] = gluon_attention(
                    x, score, causal, block_n, stages, cregs, lregs, rotate=False)
        flops = 4 * b * h * s * s * d / (2 if causal else 1)
        shape = f"{case[0]} B{b} H{h}{'/' + str(kv_heads) if kv_heads else ''} S{s} d{d}"
        for name, fn in contenders.items():
            try:
                out = fn()
                torch.cuda.synchronize()
                err = ((out.double() - ref).norm() / ref.norm()).item()
                ms = triton.testing.do_bench(fn, warmup=25, rep=200, return_mode="median")
            except Exception as e:   # a probe: report the failure and go on
                print(f"{shape} {name}: FAILED {type(e).__name__}: {str(e)[-1500:]}", flush=True)
                traceback.print_exc(limit=3)
                rows.append({"case": shape, "contender": name, "error": str(e)[-3000:]})
                continue
            rows.append({"case": shape, "contender": name, "ms": ms, "tflops": flops / ms / 1e9, "rel_err": err})
            print(f"{shape:32s} {name:24s} {ms:7.3f} ms {flops / ms / 1e9:6.0f} TFLOP/s err {err:.1e}", flush=True)
    with open(os.path.join(os.environ.get("OUT", "."), "gluon_probe.json"), "w") as f:
        json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
