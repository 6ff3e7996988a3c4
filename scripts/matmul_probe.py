"""Probe (issue 13): einfold's generated matmul kernel as emitted against hand edits
of it, and torch.matmul (cuBLAS), side by side in one process on the GPU.  Each
variant is the generated kernel with a few lines replaced, so a ratio is what the
emitter would gain by emitting that.  The emitted kernel addresses each tile as
its first tile's addresses, made once before the loop, plus the loop's start times
the stride (since 66214ca; before, it computed the tile's addresses in every step:
633 TFLOP/s at 4096^3 against 688 with the first tile hoisted, 600 against 663 at
8192^3, H100):
- increment: the tiles' addresses advanced by one slab per step instead (a
  loop-carried pointer tile);
- descriptor: the A and B tiles loaded through device-side tensor descriptors
  (tl.make_tensor_descriptor: TMA on Hopper);
- persistent: descriptor, and one program per SM walking the output tiles in
  the grouped order (tl.range(..., flatten=True)), the store through a descriptor.
Every variant is autotuned over the same candidates: the schedule's MATMUL list
plus WIDE (deeper pipelines of the wide tiles), so a gain from the list alone shows
as the emitted row's tile against the others'.

    python3 scripts/matmul_probe.py      # prints a table; rows to $OUT/matmul_probe.json
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
from compiler.schedule.tiles import MATMUL

SOURCE = "C[i,j] = A[i,k] * B[k,j]"
WIDE = [(128, 256, 64, 8, 4), (256, 128, 64, 8, 4), (128, 256, 32, 8, 4), (256, 128, 32, 8, 4)]
INCREMENT = {
    r"x_A0 = tl\.load\(A_tile .*\)\n": "x_A0 = tl.load(A_tile)\n",
    r"x_B1 = tl\.load\(B_tile .*\)\n": "x_B1 = tl.load(B_tile)\n",
    r"        acc = tl\.dot\(x_A0, x_B1, acc\)\n":
        "        acc = tl.dot(x_A0, x_B1, acc)\n        A_tile += BLOCK_k * A_s1\n        B_tile += BLOCK_k * B_s0\n",
}
DESCRIPTOR = {
    r"    A_tile = .*\n":
        "    a_desc = tl.make_tensor_descriptor(A_ptr, shape=[n_i, n_k], strides=[A_s0, 1], "
        "block_shape=[BLOCK_i, BLOCK_k])\n",
    r"    B_tile = .*\n":
        "    b_desc = tl.make_tensor_descriptor(B_ptr, shape=[n_k, n_j], strides=[B_s0, 1], "
        "block_shape=[BLOCK_k, BLOCK_j])\n",
    r"x_A0 = tl\.load\(A_tile .*\)\n": "x_A0 = a_desc.load([pid_i * BLOCK_i, start_k])\n",
    r"x_B1 = tl\.load\(B_tile .*\)\n": "x_B1 = b_desc.load([start_k, pid_j * BLOCK_j])\n",
}
PERSISTENT_KERNEL = '''
@triton.autotune(configs=CONFIGS, key=["n_i", "n_j", "n_k"])
@triton.jit
def persistent_C(n_i, n_j, n_k, A_ptr, A_s0, B_ptr, B_s0, C_ptr, C_s0, n_programs,
                 BLOCK_i: tl.constexpr, BLOCK_j: tl.constexpr, BLOCK_k: tl.constexpr):
    a_desc = tl.make_tensor_descriptor(A_ptr, shape=[n_i, n_k], strides=[A_s0, 1], block_shape=[BLOCK_i, BLOCK_k])
    b_desc = tl.make_tensor_descriptor(B_ptr, shape=[n_k, n_j], strides=[B_s0, 1], block_shape=[BLOCK_k, BLOCK_j])
    c_desc = tl.make_tensor_descriptor(C_ptr, shape=[n_i, n_j], strides=[C_s0, 1], block_shape=[BLOCK_i, BLOCK_j])
    rows = tl.cdiv(n_i, BLOCK_i)
    in_group = 8 * tl.cdiv(n_j, BLOCK_j)
    tiles = rows * tl.cdiv(n_j, BLOCK_j)
    for tile in tl.range(tl.program_id(0), tiles, n_programs, flatten=True):
        first_row = (tile // in_group) * 8
        group_rows = tl.minimum(rows - first_row, 8)
        pid_i = first_row + (tile % in_group) % group_rows
        pid_j = (tile % in_group) // group_rows
        acc = tl.zeros([BLOCK_i, BLOCK_j], tl.float32)
        for start_k in range(0, n_k, BLOCK_k):
            acc = tl.dot(a_desc.load([pid_i * BLOCK_i, start_k]), b_desc.load([start_k, pid_j * BLOCK_j]), acc)
        c_desc.store([pid_i * BLOCK_i, pid_j * BLOCK_j], acc.to(C_ptr.dtype.element_ty))
'''


def configs() -> str:
    return "[" + ", ".join(f"triton.Config({{'BLOCK_i': {r}, 'BLOCK_j': {c}, 'BLOCK_k': {d}}}, num_warps={w}, "
                           f"num_stages={s})" for r, c, d, w, s in MATMUL + WIDE) + "]"



def variant(program, x, name: str, edits: dict):
    """A launcher of the program's module for inputs x, with `edits` (pattern ->
    replacement, each matching once) applied to its source and every variant's
    candidates in its autotune line."""
    program(**x)
    source = re.sub(r"configs=\[.*?\], key=", f"configs={configs()}, key=", program.source, count=1)
    for pattern, replacement in edits.items():
        source, n = re.subn(pattern, replacement, source)
        assert n == 1, pattern
    module = load(source, f"matmul_probe {name} {x['A'].shape[0]}", interpret=False)
    n = x["A"].shape[0]
    out = torch.empty(n, n, device="cuda", dtype=x["A"].dtype)
    t = {**x, "C": out}
    return (lambda: (module.launch(t, {"i": n, "j": n, "k": n}, x["A"].device), out)[1]), module.einfold_C


def persistent(x):
    module = load("import triton\nimport triton.language as tl\nCONFIGS = " + configs() + "\n" + PERSISTENT_KERNEL,
                  f"matmul_probe persistent {x['A'].shape[0]}", interpret=False)
    n = x["A"].shape[0]
    out = torch.empty(n, n, device="cuda", dtype=x["A"].dtype)
    sms = torch.cuda.get_device_properties(0).multi_processor_count

    def run():
        grid = lambda meta: (min(sms, triton.cdiv(n, meta["BLOCK_i"]) * triton.cdiv(n, meta["BLOCK_j"])),)
        module.persistent_C[grid](n, n, n, x["A"], x["A"].stride(0), x["B"], x["B"].stride(0), out, out.stride(0),
                                  sms)
        return out
    return run, module.persistent_C


def main() -> None:
    triton.set_allocator(lambda size, align, stream: torch.empty(size, dtype=torch.int8, device="cuda"))
    rows = []
    for n in (4096, 8192):
        g = torch.Generator(device="cuda").manual_seed(0)
        x = {k: torch.randn(n, n, device="cuda", dtype=torch.bfloat16, generator=g) for k in "AB"}
        program = compiler.compile(SOURCE)
        ref = x["A"].double() @ x["B"].double()
        contenders = {name: variant(program, x, name, edits) for name, edits in
                      (("emitted", {}), ("increment", INCREMENT), ("descriptor", DESCRIPTOR))}
        contenders["persistent"] = persistent(x)
        contenders["program"] = (lambda: program(**x)), None
        contenders["cublas"] = (lambda: x["A"] @ x["B"]), None
        flops = 2 * n ** 3
        for name, (fn, tuner) in contenders.items():
            out = fn()
            err = ((out.double() - ref).norm() / ref.norm()).item()
            ms = triton.testing.do_bench(fn, warmup=25, rep=200, return_mode="median")
            chosen = str(tuner.best_config) if tuner is not None else ""
            rows.append({"shape": f"{n}^3", "contender": name, "ms": ms, "tflops": flops / ms / 1e9,
                         "rel_err": err, "config": chosen})
            print(f"{n}^3 {name:11s} {ms:7.3f} ms {flops / ms / 1e9:6.0f} TFLOP/s err {err:.1e} {chosen}", flush=True)
    with open(os.path.join(os.environ.get("OUT", "."), "matmul_probe.json"), "w") as f:
        json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
