"""Probe (issue 13): where the host time of a cached call goes, on the GPU.  One
attention call (B1 H1 S16 d64 bf16) timed layer by layer, each the median of 5
rounds of 2000 calls, beside SDPA's call and the floor of a Triton launch (the
compiled kernel's `run` with its arguments already gathered):

    python3 scripts/host_probe.py      # prints a table; rows to $OUT/host_probe.json
"""
from __future__ import annotations

import cProfile
import io
import json
import os
import pstats
import statistics
import time

import torch
import torch.nn.functional as F

import compiler
from compiler.bind import bind


def host_us(fn, calls: int = 2000, rounds: int = 5) -> float:
    fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(rounds):
        start = time.perf_counter()
        for _ in range(calls):
            fn()
        times.append((time.perf_counter() - start) / calls * 1e6)
        torch.cuda.synchronize()
    return statistics.median(times)


def main() -> None:
    source = "O[b,h,i,j] = softmax[m](Q[b,h,i,k] * K[b,h,m,k] * scale) * V[b,h,m,j]"
    program = compiler.compile(source)
    x = {k: torch.randn(1, 1, 16, 64, device="cuda", dtype=torch.bfloat16) for k in "QKV"}
    x["scale"] = 0.125
    program(**x)
    key, _ = program._key_of(x)
    runner = program._runners[key]
    (built, launch, _), = program.backend._built.values()
    kernel = launch.__globals__[built.plan.kernels[0].name]         # its DirectLaunch
    (compiled, grid3, tail), = kernel.bound.values()
    n = program.backend._extents(bind(program.backend.program, x))
    table = {**x, "O": torch.empty_like(x["Q"])}
    seen = []                                   # the launcher's arguments to its kernel, as passed
    launch_of = kernel.launch
    kernel.launch = lambda grid, args, constexprs: seen.append((grid, args, constexprs))
    launch(table, n, "cuda")
    kernel.launch = launch_of
    (grid, args, constexprs), = seen
    full = (*args, *tail)
    stream = torch.cuda.current_stream().cuda_stream

    def floor():
        compiled.run(*grid3, stream, compiled.function, compiled.packed_metadata, None, None, None, *full)

    q, k, v = x["Q"], x["K"], x["V"]
    rows = {
        "einfold call": host_us(lambda: program(**x)),
        "  key of inputs": host_us(lambda: program._key_of(x)),
        "  runner (alloc + launcher)": host_us(lambda: runner(x)),
        "  launcher (module.launch)": host_us(lambda: launch(table, n, "cuda")),
        "  DirectLaunch.launch": host_us(lambda: kernel.launch(grid, args, constexprs)),
        "  compiled.run (floor)": host_us(floor),
        "  DirectLaunch guard": host_us(lambda: kernel.guard(args, 0)),
        "  torch.empty_like": host_us(lambda: torch.empty_like(q)),
        "  tensor.new_empty(shape)": host_us(lambda: q.new_empty((1, 1, 16, 64))),
        "  torch.empty(tuple)": host_us(lambda: torch.empty((1, 1, 16, 64), dtype=torch.bfloat16, device=q.device)),
        "  torch.empty": host_us(lambda: torch.empty((1, 1, 16, 64), dtype=torch.bfloat16, device="cuda")),
        "  torch.is_grad_enabled + is_compiling": host_us(lambda: torch.is_grad_enabled() or torch.compiler.is_compiling()),
        "SDPA call": host_us(lambda: F.scaled_dot_product_attention(q, k, v, scale=0.125)),
    }
    before = os.environ.get("HOST_PROBE_BEFORE")      # a package of an earlier revision (compare_revisions.py's .before/)
    if before:
        import importlib
        import sys
        sys.path.insert(0, ".before")
        # its own generated modules (as in compare_revisions.py): a module shared with this
        # tree would carry this tree's launch wrappers
        backend = importlib.import_module(f"{before}.backend.triton.backend")
        backend.load = lambda source, key, interpret, load=backend.load: load(source, f"{key} {before}", interpret)
        earlier = importlib.import_module(before).compile(source)
        earlier(**x)
        # alternating rounds, so that both see the same host
        rows.update({"einfold call, again": host_us(lambda: program(**x)),
                     f"{before} call": host_us(lambda: earlier(**x)),
                     "einfold call, a third time": host_us(lambda: program(**x)),
                     f"{before} call, again": host_us(lambda: earlier(**x))})
    profile = cProfile.Profile()
    profile.enable()
    for _ in range(5000):
        program(**x)
    profile.disable()
    torch.cuda.synchronize()
    text = io.StringIO()
    pstats.Stats(profile, stream=text).sort_stats("tottime").print_stats(20)
    out_dir = os.environ.get("OUT", ".")
    with open(os.path.join(out_dir, "host_probe.json"), "w") as f:
        json.dump(rows, f, indent=1)
    with open(os.path.join(out_dir, "host_profile.txt"), "w") as f:
        f.write(text.getvalue())
    print(text.getvalue()[:3000])
    print(f"{'host time of one call (B1 H1 S16 d64 bf16)':45s} {'us':>7s}")
    for name, us in rows.items():
        print(f"{name:45s} {us:7.1f}")


if __name__ == "__main__":
    main()
