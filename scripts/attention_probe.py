"""Probe (issue 13): einfold's generated attention kernel as emitted against hand
edits of it, and SDPA's cuDNN backend, side by side in one process on the GPU.  Each
variant is the generated kernel with a few lines replaced, so a ratio is what the
emitter would gain by emitting that.  (Since 66214ca the emitted kernel addresses
K's and V's tiles as their first tiles' addresses, made once before the loop, plus
the loop's start times the stride: 1.00x / 1.04x / 1.05x over computing them in
every step at S = 4k / 16k / 1k.)
Since 718d78a the emitter folds a positive scale into the max and the weights'
fma itself (the "folded" variant of the thirteenth session: max(c qk) = c max(qk),
exp2(fma(qk, c a, -r2))).  Variants (PROBE_VARIANTS=name,name picks some):
- descriptor: the Q, K and V tiles loaded through device-side tensor descriptors
  (tl.make_tensor_descriptor: TMA on Hopper);
- lean: the accuracy contract's per-row guards dropped (a = log2(e) always, r2 =
  r a unrounded as an fma operand): what the contract costs;
- rotated: the loop rotated by one contraction: the next tile's scores
  `tl.dot(Q, K[next])` are issued before this tile's softmax (their wgmma could
  run while the softmax does: FlashAttention-3's intra-warpgroup overlap), the
  scores carried to the next step;
- emulated: half of each tile's exponentials (alternate columns) computed on the
  FMA pipe, a degree-4 polynomial of 2^f times 2^j put into the exponent bits
  (FlashAttention-4's trick), the other half on MUFU.EX2: whether the
  exponentials' pipe limits the loop;
- persistent, persistent2: one (two) programs per SM, each looping over the
  output tiles in the emitted order; persistent_flat: the loop as
  `tl.range(..., flatten=True)` (Triton's pipeliner may then fetch the next
  tile's first K and V during this tile's epilogue): whether the programs'
  prologue and epilogue, 8 key tiles apart at S = 1k, cost what cuDNN does not.

    python3 scripts/attention_probe.py      # prints a table; rows to $OUT/attention_probe.json
"""
from __future__ import annotations

import json
import os
import re

import torch
import triton
import triton.testing

import compiler
from compiler.backend.triton.cache import load

ATTENTION = "O[b,h,i,j] = softmax[m](Q[b,h,i,k] * K[b,h,m,k] * scale) * V[b,h,m,j]"
LEAN = {
    r"a = _base2\(r_use\)": "a = r_use * 0.0 + 1.4426950408889634",
    r"r2 = _scaled\(r_use\)": "r2 = r_use * 1.4426950408889634",
    r"alpha = tl\.exp2\(_scaled\(r\) - r2\)": "alpha = tl.exp2(r * 1.4426950408889634 - r2)",
}
ROTATED = {
    r"    for start_m in range\(0, n_m, BLOCK_m\):\n        # fold 1: sum\[k\] \(whole\)\n"
    r"        x_K0 = tl\.load\(K_tile \+ tl\.cast\(start_m, tl\.int64\) \* K_s2\)\n"
    r"        qk = tl\.dot\(x_Q1, x_K0\)\n":
        "    qk = tl.dot(x_Q1, tl.load(K_tile))\n"
        "    for start_m in range(0, n_m, BLOCK_m):\n"
        "        next_m = tl.minimum(start_m + BLOCK_m, n_m - BLOCK_m)\n"
        "        qk_next = tl.dot(x_Q1, tl.load(K_tile + tl.cast(next_m, tl.int64) * K_s2))\n",
    r"        r = r_new\n": "        r = r_new\n        qk = qk_next\n",
}
EXP2_FMA = '''@triton.jit
def _exp2_fma(x):
    # 2^x = 2^j 2^f, j = round(x) through the magic 1.5 * 2^23 (its bits hold j), |f| <= 1/2
    t = tl.maximum(x, -126.0) + 12582912.0
    f = tl.maximum(x, -126.0) - (t - 12582912.0)
    q = (((0.009676046752378807 * f + 0.05592211933425916) * f + 0.2402210717480768) * f
         + 0.6931210235306724) * f + 1.0000000755330614
    j = t.to(tl.int32, bitcast=True) - 0x4B400000
    return (q.to(tl.int32, bitcast=True) + (j << 23)).to(tl.float32, bitcast=True)


def _time_candidate'''
EMULATED = {
    r"def _time_candidate": EXP2_FMA,
    r"        p = tl\.exp2\(tl\.fma\(qk, \(scale_val \* a\)\[:, None\], -r2\[:, None\]\)\)\n":
        "        z = tl.fma(qk, (scale_val * a)[:, None], -r2[:, None])\n"
        "        za, zb = tl.split(tl.reshape(z, (BLOCK_i, BLOCK_m // 2, 2)))\n"
        "        p = tl.reshape(tl.join(tl.exp2(za), _exp2_fma(zb)), (BLOCK_i, BLOCK_m))\n",
}
LOADS = {   # pointer load (as emitted) -> descriptor load of the same tile
    r"x_Q1 = tl\.load\(Q_ptr .*\)\n":
        "x_Q1 = tl.make_tensor_descriptor(Q_ptr + idx_b.to(tl.int64) * Q_s0 + idx_h.to(tl.int64) * Q_s1, "
        "shape=[n_i, n_k], strides=[Q_s2, 1], block_shape=[BLOCK_i, BLOCK_k]).load([pid_i * BLOCK_i, 0])\n",
    r"x_K0 = tl\.load\(K_tile .*\)\n":
        "x_K0 = k_desc.load([start_m, 0]).T\n",
    r"x_V3 = tl\.load\(V_tile .*\)\n":
        "x_V3 = v_desc.load([start_m, pid_j * BLOCK_j])\n",
    r"    r = tl\.full\(\[BLOCK_i\]":
        "    k_desc = tl.make_tensor_descriptor(K_ptr + idx_b.to(tl.int64) * K_s0 + idx_h.to(tl.int64) * K_s1, "
        "shape=[n_m, n_k], strides=[K_s2, 1], block_shape=[BLOCK_m, BLOCK_k])\n"
        "    v_desc = tl.make_tensor_descriptor(V_ptr + idx_b.to(tl.int64) * V_s0 + idx_h.to(tl.int64) * V_s1, "
        "shape=[n_m, n_j], strides=[V_s2, 1], block_shape=[BLOCK_m, BLOCK_j])\n"
        "    r = tl.full([BLOCK_i]",
}


def persistent(programs: int, flatten: bool):
    """Edits that make the kernel persistent: `programs` programs (per SM count),
    each looping over the output tiles it owns."""
    def edit(source: str) -> str:
        head, rest = source.split("    pid = tl.program_id(0)\n", 1)
        body, tail = rest.split("\n\n\ndef launch(", 1)
        loop = (f"    tiles = tl.cdiv(n_j, BLOCK_j) * tl.cdiv(n_i, BLOCK_i) * n_h * n_b\n"
                f"    for tile in tl.range(tl.program_id(0), tiles, tl.num_programs(0), flatten={flatten}):\n"
                f"        pid = tile\n")
        body = "\n".join("    " + line if line else line for line in ("    pid = tl.program_id(0)\n" + body)
                         .split("\n")[1:])
        sms = torch.cuda.get_device_properties(0).multi_processor_count
        tail = re.sub(r"grid = lambda META: \((.*),\)\n", lambda m: f"grid = lambda META: (min({m.group(1)}, "
                      f"{programs * sms}),)\n", tail)
        return head + loop + body + "\n\n\ndef launch(" + tail
    return edit


def variant(program, x, name: str, edits):
    """A launcher of the program's module for inputs x, with `edits` (pattern ->
    replacement, each matching once; or a function of the source) applied to its
    source."""
    program(**x)
    source = program.source
    if callable(edits):
        source = edits(source)
    for pattern, replacement in ({} if callable(edits) else edits).items():
        source, n = re.subn(pattern, replacement, source)
        assert n == 1, pattern
    module = load(source, f"attention_probe {name} {x['Q'].shape[2]}", interpret=False)
    b, h, s, d = x["Q"].shape
    out = torch.empty_like(x["Q"])
    t = {**x, "O": out}
    n = {"b": b, "h": h, "i": s, "m": s, "k": d, "j": d}
    return lambda: (module.launch(t, n, x["Q"].device), out)[1]


def tiling(rows: int, keys: int, warps: int, stages: int, maxnreg: int | None = None):
    """The emitted kernel with one tiling instead of the autotuned candidates: `rows` x
    `keys` tiles, and with `maxnreg` a register cap (triton.Config's maxnreg), so that two
    programs of 8 warps share an SM (128 registers each; their shared memory must fit
    too): one program's softmax may then run while the other's tensor cores do."""
    def edit(source: str) -> str:
        def one(m):
            config = re.sub(r"'BLOCK_i': \d+", f"'BLOCK_i': {rows}", m.group(1))
            config = re.sub(r"'BLOCK_m': \d+", f"'BLOCK_m': {keys}", config)
            cap = f", maxnreg={maxnreg}" if maxnreg else ""
            return f"configs=[triton.Config({config}, num_warps={warps}, num_stages={stages}{cap})], key="
        return re.sub(r"configs=\[triton\.Config\((\{[^}]*\}).*?\], key=", one, source, count=1)
    return edit


VARIANTS = {"emitted": {}, "descriptor": LOADS, "lean": LEAN, "rotated": ROTATED, "emulated": EMULATED,
            "persistent": persistent(1, False), "persistent2": persistent(2, False),
            "persistent_flat": persistent(1, True),
            "t128x128s3": tiling(128, 128, 8, 3), "t128x64s2": tiling(128, 64, 8, 2),
            "t128x64s2r128": tiling(128, 64, 8, 2, 128), "t128x128s2r128": tiling(128, 128, 8, 2, 128),
            "t128x128s3r128": tiling(128, 128, 8, 3, 128), "t128x64s3r128": tiling(128, 64, 8, 3, 128)}
PROGRAMS = {"attention": ATTENTION,
            "causal": "O[b,h,i,j] = softmax[m](where(m <= i, Q[b,h,i,k] * K[b,h,m,k] * scale, -inf)) * V[b,h,m,j]"}


# (batch, heads, sequence, head dimension); PROBE_SHAPES=b:h:s:d,... picks others
SHAPES = [tuple(map(int, shape.split(":"))) for shape in
          os.environ.get("PROBE_SHAPES", "4:16:4096:128,1:16:16384:128,16:16:1024:128").split(",")]


def main() -> None:
    triton.set_allocator(lambda size, align, stream: torch.empty(size, dtype=torch.int8, device="cuda"))
    wanted = os.environ.get("PROBE_VARIANTS", "emitted,descriptor,lean,rotated,emulated").split(",")
    programs = os.environ.get("PROBE_PROGRAMS", "attention").split(",")
    rows = []
    for kind in programs:
        causal = kind == "causal"
        for b, h, s, d in SHAPES:
            g = torch.Generator(device="cuda").manual_seed(0)
            x = {k: torch.randn(b, h, s, d, device="cuda", dtype=torch.bfloat16, generator=g) for k in "QKV"}
            x["scale"] = d ** -0.5
            program = compiler.compile(PROGRAMS[kind])
            ref = torch.nn.functional.scaled_dot_product_attention(x["Q"].double(), x["K"].double(),
                                                                   x["V"].double(), is_causal=causal)
            contenders = {name: variant(program, x, f"{kind} {name}", VARIANTS[name]) for name in wanted}
            from torch.nn.attention import SDPBackend, sdpa_kernel

            def cudnn():
                with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
                    return torch.nn.functional.scaled_dot_product_attention(x["Q"], x["K"], x["V"], is_causal=causal)
            contenders["cudnn"] = cudnn
            flops = 4 * b * h * s * s * d / (2 if causal else 1)
            shape = f"{kind} B{b} H{h} S{s} d{d}"
            for name, fn in contenders.items():
                out = fn()
                err = ((out.double() - ref).norm() / ref.norm()).item()
                ms = triton.testing.do_bench(fn, warmup=25, rep=200, return_mode="median")
                rows.append({"shape": shape, "contender": name, "ms": ms, "tflops": flops / ms / 1e9, "rel_err": err})
                print(f"{shape} {name:16s} {ms:7.3f} ms {flops / ms / 1e9:6.0f} TFLOP/s err {err:.1e}", flush=True)
    with open(os.path.join(os.environ.get("OUT", "."), "attention_probe.json"), "w") as f:
        json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
