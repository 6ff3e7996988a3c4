"""Probe (issue 40): where the host time of an eager training step goes, on the GPU.

The eager GPT step (bench_gpt, size d64) is host-bound: a step takes as long as
the host takes to issue it (docs/performance.md, thirty-third session).  For each einfold module of that model and torch's op beside it, at
the step's shapes, this times how long the host takes to issue a call (forward
with grad, and forward + backward) with nothing synchronised (the launches
queue), and the call's time to completion; then it profiles eager steps with
cProfile (the functions by own time and by cumulative time) and counts the
kernel launches of a step with torch.profiler.

    python3 scripts/step_host_probe.py     # prints tables; the profiles to $OUT/step_host_*.txt
"""
from __future__ import annotations

import cProfile
import io
import os
import pstats
import statistics
import time
from pathlib import Path

import torch
import torch.nn.functional as F

import compiler
from compiler import bench_gpt

OUT = Path(os.environ.get("OUT", "."))


def timed(fn, calls: int = 40, rounds: int = 5) -> tuple[float, float]:
    """(us of host time to issue one call, us until it completes), medians of rounds.
    Where the two are close the call is host-bound (its GPU work takes less than its
    host time); where the second is larger the GPU is behind (the launches queue)."""
    fn()
    torch.cuda.synchronize()
    issue, total = [], []
    for _ in range(rounds):
        start = time.perf_counter()
        for _ in range(calls):
            fn()
        issued = time.perf_counter()
        torch.cuda.synchronize()
        done = time.perf_counter()
        issue.append((issued - start) / calls * 1e6)
        total.append((done - start) / calls * 1e6)
    return statistics.median(issue), statistics.median(total)


def profiled(name: str, fn, calls: int = 200) -> None:
    """cProfile of `calls` calls of `fn`, by own time, to $OUT/step_host_<name>.txt."""
    fn()
    profile = cProfile.Profile()
    profile.enable()
    for _ in range(calls):
        fn()
    profile.disable()
    torch.cuda.synchronize()
    text = io.StringIO()
    pstats.Stats(profile, stream=text).sort_stats("tottime").print_stats(40)
    (OUT / f"step_host_{name}.txt").write_text(text.getvalue())


def module_rows(config: bench_gpt.GPTConfig) -> dict[str, tuple[float, float]]:
    b, s, d, h = config.batch, config.seq, config.d_model, config.heads
    ours, theirs = bench_gpt.einfold_kit(compiler), bench_gpt.torch_kit()
    x = torch.randn(b, s, d, device="cuda", requires_grad=True)            # the float32 residual stream
    qkv = torch.randn(b, s, 3, h, d // h, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    q, k, v = qkv.permute(2, 0, 3, 1, 4)                                   # the model's views
    hidden = torch.randn(b, s, d, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    weight = (0.02 * torch.randn(config.vocab, d, device="cuda")).bfloat16().requires_grad_()
    labels = torch.randint(0, config.vocab, (b, s), device="cuda")
    rows = {}
    for kit in (ours, theirs):
        norm = kit.norm(d).cuda()
        cases = {"norm": lambda: norm(x), "attention": lambda: kit.attend(q, k, v),
                 "loss": lambda: kit.loss(hidden, weight, labels)}
        for name, call in cases.items():
            rows[f"{name} fwd, {kit.name}"] = timed(call)
            rows[f"{name} f+b, {kit.name}"] = timed(lambda call=call: call().sum().backward())
            if kit is ours:
                profiled(f"{name}_fb", lambda call=call: call().sum().backward())
    return rows


def profile_steps(config: bench_gpt.GPTConfig) -> None:
    kit = bench_gpt.einfold_kit(compiler)
    bench_gpt.train(config, kit, False, 4, 2)                   # compiled and tuned
    profile = cProfile.Profile()
    profile.enable()
    bench_gpt.train(config, kit, False, 6, 0)
    profile.disable()
    for order in ("tottime", "cumulative"):
        text = io.StringIO()
        pstats.Stats(profile, stream=text).sort_stats(order).print_stats(45)
        (OUT / f"step_host_{order}.txt").write_text(text.getvalue())
        print(text.getvalue()[:6000])
    from torch.profiler import ProfilerActivity
    for kit in (kit, bench_gpt.torch_kit()):
        bench_gpt.train(config, kit, False, 3, 1)
        with torch.profiler.profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            bench_gpt.train(config, kit, False, 3, 0)
        events = prof.key_averages()
        launches = sum(e.count for e in events if "LaunchKernel" in e.key) / 3
        print(f"{kit.name}: {launches:.0f} kernel launches a step")
        (OUT / f"step_host_events_{kit.name}.txt").write_text(
            events.table(sort_by="self_cpu_time_total", row_limit=40))


def main() -> None:
    config = bench_gpt.SIZES[0]
    bench_gpt.train(config, bench_gpt.einfold_kit(compiler), False, 3, 1)       # builds and tunes every module
    with torch.autocast("cuda", dtype=torch.bfloat16):
        rows = module_rows(config)
    profile_steps(config)
    print(f"{'call at the GPT d64 step shapes':28s} {'host us':>9s} {'done us':>9s}")
    for name, (issue, total) in rows.items():
        print(f"{name:28s} {issue:9.1f} {total:9.1f}")


if __name__ == "__main__":
    main()
