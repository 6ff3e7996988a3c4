"""The recomputing attention backward (compiler.grad's default: the forward's row
statistics folded again) of this tree against an earlier revision in .before/, side by
side on the GPU: time, and each gradient's error against torch's float32 autograd.

    python3 scripts/recompute_probe.py einfold_before

(make .before/einfold_before as scripts/compare_revisions.py says).  bf16, B2 H16
S4096; causal at d = 64 and 128 (and with WINDOW=1 a 256-wide window too)."""
from __future__ import annotations

import importlib
import os
import sys
import time
from pathlib import Path

import torch
import triton.testing

import compiler

CAUSAL = "O[b,h,i,j] = softmax[m](where(m <= i, Q[b,h,i,k] * K[b,h,m,k] * scale, -inf)) * V[b,h,m,j]"
WINDOW = "O[b,h,i,j] = softmax[m](where(m <= i and i - m < 256, Q[b,h,i,k] * K[b,h,m,k] * scale, -inf)) * V[b,h,m,j]"


def reference(q, k, v, do, scale, window):
    """dQ, dK, dV by torch's autograd in float32."""
    q, k, v = (x.float().requires_grad_() for x in (q, k, v))
    s = (q @ k.transpose(-1, -2)) * scale
    i = torch.arange(s.shape[-2], device=s.device)[:, None]
    m = torch.arange(s.shape[-1], device=s.device)[None, :]
    keep = (m <= i) & ((i - m < window) if window else True)
    o = torch.softmax(s.masked_fill(~keep, float("-inf")), -1) @ v
    return torch.autograd.grad(o, (q, k, v), do.float())


def main(name: str) -> None:
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent / ".before"))
    packages = {"new": compiler, name: importlib.import_module(name)}
    rows = []
    cases = ((CAUSAL, 0), (WINDOW, 256)) if os.environ.get("WINDOW") == "1" else ((CAUSAL, 0),)
    for source, window in cases:
        for d in (64, 128):
            g = torch.Generator(device="cuda").manual_seed(0)
            q, k, v, do = (torch.randn(2, 16, 4096, d, device="cuda", generator=g).bfloat16() for _ in range(4))
            scale = d ** -0.5
            want = reference(q, k, v, do, scale, window)
            line = [f"{'window' if window else 'causal'} d{d}"]
            for tag, package in packages.items():
                backward = package.grad(source, backend="triton")
                run = lambda: backward(Q=q, K=k, V=v, scale=scale, dO=do)   # noqa: E731
                start = time.perf_counter()
                got = run()
                first = time.perf_counter() - start
                errors = [float((a.float() - b).norm() / b.norm()) for a, b in zip(got, want)]
                ms = triton.testing.do_bench(run, warmup=25, rep=100)
                line.append(f"{tag} {ms:.3f} ms (first call {first:.0f} s), rel err dQ {errors[0]:.1e} dK {errors[1]:.1e} dV {errors[2]:.1e}")
            rows.append(" | ".join(line))
            print(rows[-1], flush=True)
    print("\n".join(["", "recomputing backward, new vs " + name, *rows]))


if __name__ == "__main__":
    main(sys.argv[1])
