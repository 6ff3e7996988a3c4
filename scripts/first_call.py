"""First calls of attention programs on the GPU, each in a new process with empty
Triton and einfold caches (what a fresh machine sees): the autotune candidates
compiled in parallel (launch.DirectLaunch.compile_candidates) against one after
another; then one program in two processes sharing a cache (the second reuses the
compiled kernels and the autotuner's choice).  Prints a table; rows as JSON to
$OUT/first_call.json.

    python3 scripts/first_call.py
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time


def one(variant: str, mode: str) -> None:
    """In this process: the first call of `variant`, compiled `mode`; prints its ms."""
    import torch
    from compiler import bench
    from compiler.backend.triton.launch import DirectLaunch
    import compiler
    s, d, b, h = 4096, 128, 4, 16
    g = torch.Generator(device="cuda").manual_seed(0)
    q, k, v = (torch.randn(b, h, s, d, device="cuda", dtype=torch.bfloat16, generator=g) for _ in range(3))
    x = {"Q": q, "K": k, "V": v, "scale": d ** -0.5, "cap": 30.0,
         "A": 2.0 ** (-8 * torch.arange(1, h + 1, device="cuda") / h),
         "D": bench.document_ids(b, s).cuda().bfloat16()}
    source = bench.ATTENTION if variant == "attention" else bench.flex_variants(s, x["D"])[variant][0]
    if mode == "serial":
        DirectLaunch.compile_candidates = lambda *a: None
    torch.cuda.synchronize()
    start = time.perf_counter()
    program = compiler.compile(source, backend="triton")
    program(**{k: v for k, v in x.items() if k in {i.name for i in program.checked.inputs}})
    torch.cuda.synchronize()
    print((time.perf_counter() - start) * 1e3)


def timed(variant: str, mode: str, cache: str) -> float:
    env = {**os.environ, "TRITON_CACHE_DIR": os.path.join(cache, "triton"),
           "EINFOLD_CACHE_DIR": os.path.join(cache, "einfold")}
    done = subprocess.run([sys.executable, __file__, variant, mode], env=env, capture_output=True, text=True)
    if done.returncode:
        raise RuntimeError(done.stderr[-2000:])
    return float(done.stdout.split()[-1])


def main() -> None:
    variants = ["attention", "softcap", "softcap causal", "alibi", "alibi causal", "window 1024", "document causal"]
    rows = []
    for variant in variants:
        row = {"variant": variant}
        for mode in ("serial", "parallel"):
            with tempfile.TemporaryDirectory() as cache:
                row[mode] = timed(variant, mode, cache)
        rows.append(row)
        print(f"{variant:20s} serial {row['serial']:8.0f} ms  parallel {row['parallel']:8.0f} ms", flush=True)
    with tempfile.TemporaryDirectory() as cache:
        rows.append({"variant": "attention, 1st process", "parallel": timed("attention", "parallel", cache)})
        rows.append({"variant": "attention, 2nd process", "parallel": timed("attention", "parallel", cache)})
    with open(os.path.join(os.environ.get("OUT", "."), "first_call.json"), "w") as f:
        json.dump(rows, f, indent=1)
    print(f"\n{'first call, empty caches (ms)':30s} {'serial':>8s} {'parallel':>9s}")
    for r in rows:
        print(f"{r['variant']:30s} {r.get('serial', float('nan')):8.0f} {r['parallel']:9.0f}")


if __name__ == "__main__":
    one(*sys.argv[1:]) if len(sys.argv) > 1 else main()
