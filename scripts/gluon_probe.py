"""Probe (issue 13): is a Gluon attention loop on Hopper faster than the `tl.dot` loop
einfold emits?  A hand-written FlashAttention-3 structure (a loader warp feeding K and V
through TMA into rings of shared memory guarded by mbarriers; two consumer warpgroups of
64 query rows each, every one issuing the next tile's scores `Q K^T` as an asynchronous
warpgroup MMA before its softmax of the current tile, so the tensor cores run while the
softmax does), timed beside einfold's generated kernel and SDPA's cuDNN backend in one
process.  Non-causal, bf16, sizes that divide the tiles: a measurement of the loop, not
a kernel for users.

    python3 scripts/gluon_probe.py      # prints a table; rows to $OUT/gluon_probe.json
"""
from __future__ import annotations

import inspect
import json
import os
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

ATTENTION = "O[b,h,i,j] = softmax[m](Q[b,h,i,k] * K[b,h,m,k] * scale) * V[b,h,m,j]"
CAUSAL = "O[b,h,i,j] = softmax[m](where(m <= i, Q[b,h,i,k] * K[b,h,m,k] * scale, -inf)) * V[b,h,m,j]"
LOG2E = 1.4426950408889634
ROWS = gl.constexpr(64)    # query rows of one consumer warpgroup (wgmma's M per warpgroup)
# Triton 3.6 takes (default args, default fn, worker args, worker fns, warps, regs);
# later versions take a list of (fn, args) pairs
# Triton 3.6 names the TMA copies async_copy_global_to_shared / async_copy_shared_to_global
tma_load = getattr(tma, "async_load", None) or tma.async_copy_global_to_shared
tma_store = getattr(tma, "async_store", None) or tma.async_copy_shared_to_global
LISTED_PARTITIONS = gl.constexpr("functions_and_args" in inspect.signature(gl.warp_specialize).parameters)


@gluon.jit
def _scores(q, k_smem, k_ready, t, zeros):
    """Issue tile t's scores Q K^T as an asynchronous warpgroup MMA, once its K tile has landed."""
    STAGES: gl.constexpr = k_smem.shape[0]
    mbarrier.wait(k_ready.index(t % STAGES), (t // STAGES) & 1)
    return warpgroup_mma(q, k_smem.index(t % STAGES).permute((1, 0)), zeros, use_acc=False, is_async=True)


@gluon.jit
def _causal(qk, t, row0, BLOCK_N: gl.constexpr):
    """Scores of keys after the query row are -inf (keys t * BLOCK_N + column, rows row0 + row)."""
    rows = row0 + gl.arange(0, qk.shape[0], layout=gl.SliceLayout(1, qk.type.layout))
    cols = t * BLOCK_N + gl.arange(0, qk.shape[1], layout=gl.SliceLayout(0, qk.type.layout))
    return gl.where(cols[None, :] <= rows[:, None], qk, -float("inf"))


@gluon.jit
def _step(q, k_smem, v_smem, k_ready, k_empty, v_ready, v_empty, t, zeros, r, p, l, acc, qk_scale, row0,
          MASKED: gl.constexpr):
    """One step of the rotated loop: tile t's scores go to the tensor cores, then tile t - 1's weights
    P times V; tile t's softmax runs while P V is in flight."""
    STAGES: gl.constexpr = k_smem.shape[0]
    BLOCK_N: gl.constexpr = k_smem.shape[1]
    o_rows: gl.constexpr = gl.SliceLayout(1, acc.type.layout)
    p_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=acc.type.layout, k_width=2)
    qk_token = _scores(q, k_smem, k_ready, t, zeros)
    prev = (t - 1) % STAGES
    mbarrier.wait(v_ready.index(prev), ((t - 1) // STAGES) & 1)
    p_op = gl.convert_layout(p.to(v_smem.dtype), p_layout)
    acc_token = warpgroup_mma(p_op, v_smem.index(prev), acc, is_async=True)
    qk = warpgroup_mma_wait(1, deps=(qk_token, ))
    mbarrier.arrive(k_empty.index(t % STAGES), count=1)
    if MASKED:
        qk = _causal(qk, t, row0, BLOCK_N)
    r_new = gl.maximum(r, gl.max(qk, 1) * qk_scale)
    alpha = gl.exp2(r - r_new)
    p = gl.exp2(qk * qk_scale - r_new[:, None])
    l = l * alpha + gl.sum(p, 1)
    acc, p_op = warpgroup_mma_wait(0, deps=(acc_token, p_op))
    mbarrier.arrive(v_empty.index(prev), count=1)
    acc = acc * gl.convert_layout(alpha, o_rows)[:, None]
    return r_new, p, l, acc


@gluon.jit
def _consumer(part: gl.constexpr, q_smem, k_smem, v_smem, q_bar, k_ready, k_empty, v_ready, v_empty, o_desc, q_row,
              row0, qk_scale, n_tiles, n_unmasked, CAUSAL: gl.constexpr):
    STAGES: gl.constexpr = k_smem.shape[0]
    BLOCK_N: gl.constexpr = k_smem.shape[1]
    HEAD_D: gl.constexpr = k_smem.shape[2]
    s_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                       instr_shape=[16, BLOCK_N, 16])
    o_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                       instr_shape=[16, HEAD_D, 16])
    p_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=o_layout, k_width=2)
    o_rows: gl.constexpr = gl.SliceLayout(1, o_layout)
    row0 = row0 + part * ROWS
    q = q_smem.index(part)
    mbarrier.wait(q_bar.index(part), 0)
    zeros = gl.zeros([ROWS, BLOCK_N], gl.float32, s_layout)

    qk = warpgroup_mma_wait(0, deps=(_scores(q, k_smem, k_ready, 0, zeros), ))
    mbarrier.arrive(k_empty.index(0), count=1)
    if CAUSAL:
        qk = _causal(qk, 0, row0, BLOCK_N)
    r = gl.max(qk, 1) * qk_scale
    p = gl.exp2(qk * qk_scale - r[:, None])
    l = gl.sum(p, 1)
    acc = gl.zeros([ROWS, HEAD_D], gl.float32, o_layout)
    for t in range(1, n_unmasked):
        r, p, l, acc = _step(q, k_smem, v_smem, k_ready, k_empty, v_ready, v_empty, t, zeros, r, p, l, acc,
                             qk_scale, row0, False)
    if CAUSAL:
        for t in range(gl.maximum(n_unmasked, 1), n_tiles):
            r, p, l, acc = _step(q, k_smem, v_smem, k_ready, k_empty, v_ready, v_empty, t, zeros, r, p, l, acc,
                                 qk_scale, row0, True)
    last = (n_tiles - 1) % STAGES
    mbarrier.wait(v_ready.index(last), ((n_tiles - 1) // STAGES) & 1)
    p_op = gl.convert_layout(p.to(v_smem.dtype), p_layout)
    acc_token = warpgroup_mma(p_op, v_smem.index(last), acc, is_async=True)
    acc, p_op = warpgroup_mma_wait(0, deps=(acc_token, p_op))
    mbarrier.arrive(v_empty.index(last), count=1)
    o = acc / gl.convert_layout(l, o_rows)[:, None]
    q.store(o.to(o_desc.dtype))    # Q's buffer is free: it holds O on its way out
    fence_async_shared()
    tma_store(o_desc, [q_row + part * ROWS, 0], q)
    tma.store_wait(0)


@gluon.jit
def _loader(q_desc, k_desc, v_desc, q_smem, k_smem, v_smem, q_bar, k_ready, k_empty, v_ready, v_empty, q_row, kv_row,
            n_tiles):
    STAGES: gl.constexpr = k_smem.shape[0]
    BLOCK_N: gl.constexpr = k_smem.shape[1]
    CONSUMERS: gl.constexpr = q_smem.shape[0]
    for part in gl.static_range(CONSUMERS):
        mbarrier.expect(q_bar.index(part), q_desc.block_type.nbytes)
        tma_load(q_desc, [q_row + part * ROWS, 0], q_bar.index(part), q_smem.index(part))
    for t in range(n_tiles):
        stage = t % STAGES
        free = ((t // STAGES) & 1) ^ 1     # the first pass over the ring waits for nothing
        mbarrier.wait(k_empty.index(stage), free)
        mbarrier.expect(k_ready.index(stage), k_desc.block_type.nbytes)
        tma_load(k_desc, [kv_row + t * BLOCK_N, 0], k_ready.index(stage), k_smem.index(stage))
        mbarrier.wait(v_empty.index(stage), free)
        mbarrier.expect(v_ready.index(stage), v_desc.block_type.nbytes)
        tma_load(v_desc, [kv_row + t * BLOCK_N, 0], v_ready.index(stage), v_smem.index(stage))


# one function per partition: Triton 3.6 passes every worker the same arguments
@gluon.jit
def _part0(q_desc, k_desc, v_desc, o_desc, q_smem, k_smem, v_smem, q_bar, k_ready, k_empty, v_ready, v_empty, q_row,
           kv_row, row0, qk_scale, n_tiles, n_unmasked, CAUSAL: gl.constexpr):
    _consumer(0, q_smem, k_smem, v_smem, q_bar, k_ready, k_empty, v_ready, v_empty, o_desc, q_row, row0, qk_scale,
              n_tiles, n_unmasked, CAUSAL)


@gluon.jit
def _part1(q_desc, k_desc, v_desc, o_desc, q_smem, k_smem, v_smem, q_bar, k_ready, k_empty, v_ready, v_empty, q_row,
           kv_row, row0, qk_scale, n_tiles, n_unmasked, CAUSAL: gl.constexpr):
    _consumer(1, q_smem, k_smem, v_smem, q_bar, k_ready, k_empty, v_ready, v_empty, o_desc, q_row, row0, qk_scale,
              n_tiles, n_unmasked, CAUSAL)


@gluon.jit
def _part2(q_desc, k_desc, v_desc, o_desc, q_smem, k_smem, v_smem, q_bar, k_ready, k_empty, v_ready, v_empty, q_row,
           kv_row, row0, qk_scale, n_tiles, n_unmasked, CAUSAL: gl.constexpr):
    _consumer(2, q_smem, k_smem, v_smem, q_bar, k_ready, k_empty, v_ready, v_empty, o_desc, q_row, row0, qk_scale,
              n_tiles, n_unmasked, CAUSAL)


@gluon.jit
def _load(q_desc, k_desc, v_desc, o_desc, q_smem, k_smem, v_smem, q_bar, k_ready, k_empty, v_ready, v_empty, q_row,
          kv_row, row0, qk_scale, n_tiles, n_unmasked, CAUSAL: gl.constexpr):
    _loader(q_desc, k_desc, v_desc, q_smem, k_smem, v_smem, q_bar, k_ready, k_empty, v_ready, v_empty, q_row, kv_row,
            n_tiles)


@gluon.jit
def attention_kernel(q_desc, k_desc, v_desc, o_desc, qk_scale, seq_q, seq_kv, BLOCK_N: gl.constexpr,
                     HEAD_D: gl.constexpr, STAGES: gl.constexpr, CONSUMERS: gl.constexpr,
                     CONSUMER_REGS: gl.constexpr, LOADER_REGS: gl.constexpr, CAUSAL: gl.constexpr):
    BLOCK_M: gl.constexpr = CONSUMERS * ROWS
    pid_m = gl.program_id(0)
    if CAUSAL:    # the longest rows first
        pid_m = gl.num_programs(0) - 1 - pid_m
    bh = gl.program_id(1)
    row0 = pid_m * BLOCK_M
    q_row = bh * seq_q + row0
    kv_row = bh * seq_kv
    n_tiles = (seq_kv + BLOCK_N - 1) // BLOCK_N
    n_unmasked = n_tiles
    if CAUSAL:    # keys up to the block's last row; tiles past its first row are masked
        n_tiles = gl.minimum((row0 + BLOCK_M + BLOCK_N - 1) // BLOCK_N, n_tiles)
        n_unmasked = gl.minimum((row0 + 1) // BLOCK_N, n_tiles)
    q_smem = gl.allocate_shared_memory(q_desc.dtype, [CONSUMERS, ROWS, HEAD_D], q_desc.layout)
    k_smem = gl.allocate_shared_memory(k_desc.dtype, [STAGES, BLOCK_N, HEAD_D], k_desc.layout)
    v_smem = gl.allocate_shared_memory(v_desc.dtype, [STAGES, BLOCK_N, HEAD_D], v_desc.layout)
    q_bar = gl.allocate_shared_memory(gl.int64, [CONSUMERS, 1], mbarrier.MBarrierLayout())
    k_ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    k_empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    v_ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    v_empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    for part in gl.static_range(CONSUMERS):
        mbarrier.init(q_bar.index(part), count=1)
    for s in gl.static_range(STAGES):
        mbarrier.init(k_ready.index(s), count=1)
        mbarrier.init(v_ready.index(s), count=1)
        mbarrier.init(k_empty.index(s), count=CONSUMERS)    # every consumer releases a stage
        mbarrier.init(v_empty.index(s), count=CONSUMERS)
    args = (q_desc, k_desc, v_desc, o_desc, q_smem, k_smem, v_smem, q_bar, k_ready, k_empty, v_ready, v_empty, q_row,
            kv_row, row0, qk_scale, n_tiles, n_unmasked, CAUSAL)
    if CONSUMERS == 2:
        if LISTED_PARTITIONS:
            gl.warp_specialize([(_part0, args), (_part1, args), (_load, args)], [4, 1], [CONSUMER_REGS, LOADER_REGS])
        else:
            gl.warp_specialize(args, _part0, args, [_part1, _load], [4, 1], [CONSUMER_REGS, LOADER_REGS])
    else:
        if LISTED_PARTITIONS:
            gl.warp_specialize([(_part0, args), (_part1, args), (_part2, args), (_load, args)], [4, 4, 1],
                               [CONSUMER_REGS, CONSUMER_REGS, LOADER_REGS])
        else:
            gl.warp_specialize(args, _part0, args, [_part1, _part2, _load], [4, 4, 1],
                               [CONSUMER_REGS, CONSUMER_REGS, LOADER_REGS])


def gluon_attention(q, k, v, scale, causal, block_n, stages, consumers, consumer_regs, loader_regs):
    b, h, s, d = q.shape
    out = torch.empty_like(q)
    row_layout = gl.NVMMASharedLayout.get_default_for([ROWS.value, d], gl.bfloat16)
    kv_layout = gl.NVMMASharedLayout.get_default_for([block_n, d], gl.bfloat16)
    flat = [t.reshape(b * h * s, d) for t in (q, k, v, out)]
    q_desc = TensorDescriptor(flat[0], list(flat[0].shape), list(flat[0].stride()), [ROWS.value, d], row_layout)
    k_desc = TensorDescriptor(flat[1], list(flat[1].shape), list(flat[1].stride()), [block_n, d], kv_layout)
    v_desc = TensorDescriptor(flat[2], list(flat[2].shape), list(flat[2].stride()), [block_n, d], kv_layout)
    o_desc = TensorDescriptor(flat[3], list(flat[3].shape), list(flat[3].stride()), [ROWS.value, d], row_layout)
    grid = (s // (consumers * ROWS.value), b * h)

    def run():
        attention_kernel[grid](q_desc, k_desc, v_desc, o_desc, scale * LOG2E, s, s, block_n, d, stages, consumers,
                               consumer_regs, loader_regs, causal, num_warps=4)
        return out
    return run


def main() -> None:
    print("triton", triton.__version__, "listed partitions:", bool(LISTED_PARTITIONS), "AutoLayout:",
          hasattr(gl, "AutoLayout"), "smem reshape:", hasattr(gl.shared_memory_descriptor, "reshape"),
          "device descriptors:", hasattr(tma, "make_tensor_descriptor"), flush=True)
    # kind:batch:heads:sequence:head dimension
    shapes = [(c.split(":")[0], *(int(v) for v in c.split(":")[1:])) for c in os.environ.get(
        "PROBE_SHAPES", "full:16:16:1024:128,full:4:16:4096:128,causal:16:16:1024:128,causal:4:16:4096:128,"
        "full:16:32:1024:64,full:4:32:4096:64,causal:4:32:4096:64").split(",")]
    # key tile:stages:consumer warpgroups:consumer registers:loader registers
    configs = [tuple(int(v) for v in c.split(":")) for c in os.environ.get(
        "PROBE_CONFIGS", "128:2:2:232:40,128:2:3:160:40,128:3:2:232:40").split(",")]
    rows = []
    from torch.nn.attention import SDPBackend, sdpa_kernel
    for kind, b, h, s, d in shapes:
        causal = kind == "causal"
        program = compiler.compile(CAUSAL if causal else ATTENTION)
        g = torch.Generator(device="cuda").manual_seed(0)
        x = {k: torch.randn(b, h, s, d, device="cuda", dtype=torch.bfloat16, generator=g) for k in "QKV"}
        x["scale"] = d ** -0.5
        ref = torch.nn.functional.scaled_dot_product_attention(x["Q"].double(), x["K"].double(), x["V"].double(),
                                                               is_causal=causal)

        def cudnn():
            with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
                return torch.nn.functional.scaled_dot_product_attention(x["Q"], x["K"], x["V"], is_causal=causal)
        contenders = {"einfold": lambda: program(**x), "cudnn": cudnn}
        for block_n, stages, consumers, cregs, lregs in configs:
            if s % (consumers * ROWS.value) == 0:
                contenders[f"gluon n{block_n} st{stages} c{consumers} r{cregs}/{lregs}"] = gluon_attention(
                    x["Q"], x["K"], x["V"], x["scale"], causal, block_n, stages, consumers, cregs, lregs)
        flops = 4 * b * h * s * s * d / (2 if causal else 1)
        shape = f"{kind} B{b} H{h} S{s} d{d}"
        for name, fn in contenders.items():
            try:
                out = fn()
                torch.cuda.synchronize()
                err = ((out.double() - ref).norm() / ref.norm()).item()
                ms = triton.testing.do_bench(fn, warmup=25, rep=200, return_mode="median")
            except Exception as e:   # a probe: report the failure and go on
                print(f"{shape} {name}: FAILED {type(e).__name__}: {str(e)[-1500:]}", flush=True)
                traceback.print_exc(limit=3)
                rows.append({"shape": shape, "contender": name, "error": str(e)[-3000:]})
                continue
            rows.append({"shape": shape, "contender": name, "ms": ms, "tflops": flops / ms / 1e9, "rel_err": err})
            print(f"{shape:26s} {name:28s} {ms:7.3f} ms {flops / ms / 1e9:6.0f} TFLOP/s err {err:.1e}", flush=True)
    with open(os.path.join(os.environ.get("OUT", "."), "gluon_probe.json"), "w") as f:
        json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
