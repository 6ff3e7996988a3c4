"""Where a norm's training step spends its time, kernel by kernel (GPU).

    python3 scripts/norm_probe.py [REVISION ...]     (REVISION: a package in .before/)

For layernorm and RMSNorm (bf16, 16384 x 4096, the training group's case): each
revision's forward + backward under torch autograd, profiled; prints the CUDA time
of each kernel per step, and the step's total, beside torch.compile's and eager's."""
from __future__ import annotations

import sys

import torch
from compare_revisions import revisions
from torch.profiler import ProfilerActivity, profile

import compiler.bench as bench


def kernels(step, steps: int = 20) -> list[tuple[str, float]]:
    for _ in range(3):
        step()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            step()
        torch.cuda.synchronize()
    rows = [(e.key, e.device_time_total / steps / 1e3) for e in prof.key_averages() if e.device_time_total > 0]
    return sorted(rows, key=lambda r: -r[1])


def main(names: list[str]) -> None:
    packages = revisions(names)
    n, features = 16384, 4096
    g = torch.Generator(device="cuda").manual_seed(0)
    x = {key: torch.randn(*shape, device="cuda", dtype=torch.bfloat16, generator=g)
         for key, shape in (("X", (n, features)), ("dY", (n, features)), ("G", (features,)), ("B", (features,)))}
    norms = {"layernorm": (bench.LAYERNORM_AFFINE, bench.torch_layernorm, ("X", "G", "B")),
             "rmsnorm": (bench.RMSNORM, bench.torch_rmsnorm, ("X", "G"))}
    for name, (source, fn, wrt) in norms.items():
        inputs = {k: (v.clone().requires_grad_() if k in wrt else v) for k, v in x.items()}
        inputs["eps"] = 1e-6
        contenders = {tag: bench._step(bench._inputs_of(p.compile(source, backend="triton")), wrt, "dY")
                      for tag, p in packages.items()}
        contenders["torch.compile"] = bench._step(torch.compile(fn), wrt, "dY")
        contenders["torch eager"] = bench._step(fn, wrt, "dY")
        for tag, step in contenders.items():
            rows = kernels(lambda s=step: s(inputs))
            total = sum(ms for _, ms in rows)
            print(f"\n{name} {tag}: {total:.3f} ms of kernels a step")
            for key, ms in rows[:8]:
                print(f"  {ms:8.3f} ms  {key[:100]}")


if __name__ == "__main__":
    main(sys.argv[1:])
