"""First calls of attention programs on the GPU, each in a new process with empty
Triton and einfold caches (what a fresh machine sees): the autotune candidates
compiled in parallel (launch.DirectLaunch.compile_candidates) against one after
another; then one program in two processes sharing a cache (the second reuses the
compiled kernels and the autotuner's choice).  Prints a table; rows as JSON to
$OUT/first_call.json.

    python3 scripts/first_call.py
    python3 scripts/first_call.py phases   # each variant's first call split into its phases
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time


VARIANTS = ["attention", "softcap", "softcap causal", "alibi", "alibi causal", "window 1024", "document causal"]


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
    phases = timing_phases() if mode == "phases" else {}
    torch.cuda.synchronize()
    start = time.perf_counter()
    program = compiler.compile(source, backend="triton")
    program(**{k: v for k, v in x.items() if k in {i.name for i in program.checked.inputs}})
    torch.cuda.synchronize()
    if phases:
        print(json.dumps(phases))
    print((time.perf_counter() - start) * 1e3)


def timing_phases() -> dict:
    """Wrap the steps of a first call so that each adds its milliseconds to the dict
    returned: the candidates' parallel compile, the autotuner's timing of each, the
    final bind (einfold's passes and emission are the rest); within them, Triton's
    own compile stages summed over the kernels compiled (`triton ttgir`, `triton
    llir` (LLVM), `triton ptx`, `triton cubin` (ptxas); the frontend is the rest of
    `triton compile`), which run in parallel threads where candidates do, and the
    build of its C launcher for a new signature."""
    import triton.compiler
    import triton.backends.nvidia.driver as nvidia_driver
    from triton.backends.nvidia.compiler import CUDABackend
    from triton.runtime.autotuner import Autotuner
    from compiler.backend.triton.launch import DirectLaunch
    phases: dict[str, float] = {}

    def timing(inner, phase):
        def wrapper(*args, **kwargs):
            start = time.perf_counter()
            try:
                return inner(*args, **kwargs)
            finally:
                phases[phase] = phases.get(phase, 0.0) + (time.perf_counter() - start) * 1e3
        return wrapper

    def timed(owner, name, phase):
        setattr(owner, name, timing(getattr(owner, name), phase))
    timed(DirectLaunch, "compile_candidates", "compile candidates")
    timed(Autotuner, "_bench", "autotune timing")
    timed(DirectLaunch, "bind", "bind")
    timed(triton.compiler, "compile", "triton compile")      # as JITFunction imports it, at first use
    timed(nvidia_driver, "compile_module_from_src", "C launcher build")
    add_stages = CUDABackend.add_stages

    def timed_stages(self, stages, options, *rest):
        add_stages(self, stages, options, *rest)
        for stage, run in list(stages.items()):
            stages[stage] = timing(run, f"triton {stage}")
    CUDABackend.add_stages = timed_stages
    return phases


def timed(variant: str, mode: str, cache: str) -> float | tuple[float, dict]:
    env = {**os.environ, "TRITON_CACHE_DIR": os.path.join(cache, "triton"),
           "EINFOLD_CACHE_DIR": os.path.join(cache, "einfold")}
    done = subprocess.run([sys.executable, __file__, variant, mode], env=env, capture_output=True, text=True)
    if done.returncode:
        raise RuntimeError(done.stderr[-2000:])
    lines = done.stdout.split("\n")
    ms = float(lines[-2] if not lines[-1] else lines[-1])
    if mode == "phases":
        return ms, json.loads([line for line in lines if line.startswith("{")][-1])
    return ms


def phases() -> None:
    """Each variant's first call with empty caches, split into its phases."""
    rows = []
    for variant in VARIANTS:
        with tempfile.TemporaryDirectory() as cache:
            ms, parts = timed(variant, "phases", cache)
        rows.append({"variant": variant, "ms": ms, **parts})
        print(f"{variant:20s} {ms:8.0f} ms " + " ".join(f"{k} {v:6.0f}" for k, v in parts.items()), flush=True)
    with open(os.path.join(os.environ.get("OUT", "."), "first_call_phases.json"), "w") as f:
        json.dump(rows, f, indent=1)


def main() -> None:
    rows = []
    for variant in VARIANTS:
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
    if sys.argv[1:] == ["phases"]:
        phases()
    else:
        one(*sys.argv[1:]) if len(sys.argv) > 1 else main()
