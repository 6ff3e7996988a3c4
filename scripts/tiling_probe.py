"""Probe (issue 13): tilings of the Hopper form at contraction depth 64, side by side.

For attention and causal attention at d = 64 (the bench's shapes: B = 16384 / S, H = 32),
times einfold with each candidate tiling of the sm_90 form (compiler/specialise/forms.py) (set
in TILINGS before the program's first call), einfold's `tl` kernel (no tiling at d = 64)
and SDPA's cuDNN backend, in one process, in alternating rounds (median of the rounds'
do_bench medians); every output is compared with cuDNN's.

    python3 scripts/tiling_probe.py [NAME ...]     # on an sm_90 GPU; NAMEs from TRIALS

Spills of a tiling can be read without a GPU: build the kernel for sm_90a with
tests/gpu_compile.py's `build` and run ptxas -v on its PTX."""
from __future__ import annotations

import json
import math
import os
import statistics
import sys

import torch
import triton.testing

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import compiler  # noqa: E402
from compiler.specialise import forms  # noqa: E402

ATTENTION = "O[b,h,i,j] = softmax[m](Q[b,h,i,k] * K[b,h,m,k] * scale) * V[b,h,m,j]"
CAUSAL = "O[b,h,i,j] = softmax[m](where(m <= i, Q[b,h,i,k] * K[b,h,m,k] * scale, -inf)) * V[b,h,m,j]"
T = forms.Tiling
TRIALS = {"tl": None,
          "c2k128": T(consumers=2, key_tile=128, stages=2, consumer_regs=240, loader_regs=24),
          "c2k64": T(consumers=2, key_tile=64, stages=2, consumer_regs=240, loader_regs=24),
          "c3k64": T(consumers=3, key_tile=64, stages=2, consumer_regs=160, loader_regs=24),
          "c3k64s3": T(consumers=3, key_tile=64, stages=3, consumer_regs=160, loader_regs=24)}
DEPTH = 64
ROUNDS = 3


def sdpa_cudnn(causal: bool):
    from torch.nn.attention import SDPBackend, sdpa_kernel

    def run(x):
        with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
            return torch.nn.functional.scaled_dot_product_attention(x["Q"], x["K"], x["V"], is_causal=causal,
                                                                    scale=x["scale"])
    return run


def main(names: list[str]) -> None:
    names = names or list(TRIALS)
    programs = {}
    for name in names:               # each program's module is generated at its first call, under its tiling
        programs[name] = {}
        for causal in (False, True):
            if TRIALS[name] is None:
                forms.TILINGS.pop(DEPTH, None)
            else:
                forms.TILINGS[DEPTH] = TRIALS[name]
            program = compiler.compile(CAUSAL if causal else ATTENTION, backend="triton")
            x = {n: torch.randn(1, 1, 256, DEPTH, device="cuda", dtype=torch.bfloat16) for n in "QKV"}
            program(**x, scale=0.125)
            programs[name][causal] = program
    rows = []
    for s in (1024, 4096, 16384):
        b, h = 16384 // s, 2048 // DEPTH
        for causal in (False, True):
            g = torch.Generator(device="cuda").manual_seed(0)
            x = {n: torch.randn(b, h, s, DEPTH, device="cuda", dtype=torch.bfloat16, generator=g)
                 for n in "QKV"}
            x["scale"] = 1 / math.sqrt(DEPTH)
            baseline = sdpa_cudnn(causal)
            want = baseline(x).float()
            runs = {"cudnn": baseline, **{n: (lambda x, p=programs[n][causal]: p(**x)) for n in names}}
            errors = {n: float((f(x).float() - want).abs().max()) for n, f in runs.items()}
            times = {n: [] for n in runs}
            for _ in range(ROUNDS):
                for n, f in runs.items():
                    times[n].append(triton.testing.do_bench(lambda f=f: f(x), warmup=25, rep=100,
                                                            return_mode="median"))
            ms = {n: statistics.median(t) for n, t in times.items()}
            flops = 4 * b * h * s * s * DEPTH / (2 if causal else 1)
            row = {"case": f"B{b} H{h} S{s} d{DEPTH}{' causal' if causal else ''}", "ms": ms,
                   "max_abs_err": errors, "tflops": {n: flops / t / 1e9 for n, t in ms.items()}}
            rows.append(row)
            print(json.dumps(row), flush=True)
    out = os.environ.get("OUT")
    if out:
        with open(os.path.join(out, "tiling_probe.json"), "w") as f:
            json.dump(rows, f, indent=1)
    print(f"\n{'case':<24}" + "".join(f"{n:>10}" for n in names) + "   (cuDNN time / einfold's; max abs err)")
    for row in rows:
        print(f"{row['case']:<24}" + "".join(f"{row['ms']['cudnn'] / row['ms'][n]:>9.3f}x" for n in names) +
              "   " + " ".join(f"{row['max_abs_err'][n]:.1e}" for n in names))


if __name__ == "__main__":
    main(sys.argv[1:])
