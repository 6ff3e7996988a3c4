"""The training rows (compiler/bench_gpt.py) with earlier revisions beside this tree,
on the GPU, in one process:

    python3 scripts/gpt_probe.py [REVISION ...]     (REVISION: a package in .before/)

Each size of bench_gpt.SIZES (PROBE_QUICK=1: QUICK; PROBE_SIZES=d64,...: those),
eager and under torch.compile (PROBE_MODES=eager or compiled: that one): this tree's einfold model, each revision's, and
torch's (SDPA), each trained from the same weights on the same batches.  A contender
that takes more than PROBE_LIMIT seconds (default 240) is stopped and reported.
PROBE_OPAQUE=1 adds this tree with every program's op opaque to torch.compile (the
custom op of its kernels, as before the ops were triton_ops).
Writes $OUT/gpt.json (losses included); the last lines are a short table: ms per
step (the median, and the 10th and 90th percentiles of the timed steps), peak MiB,
the largest step difference of the loss from torch's, and torch's time over each
contender's (> 1: faster than torch).  PROBE_PROFILE=1 instead prints,
for each size, the CUDA time of each kernel over three eager steps of each model
(torch.profiler), the largest first."""
from __future__ import annotations

import json
import os
import signal
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from compare_revisions import revisions  # noqa: E402

from compiler import bench_gpt  # noqa: E402
from compiler.backend.triton.backend import TritonBackend  # noqa: E402


class _TooLong(Exception):
    pass


def _stop(signum, frame):
    raise _TooLong()


def profile(configs) -> None:
    """The kernels of three eager steps of each model, by CUDA time."""
    from torch.profiler import ProfilerActivity
    for config in configs:
        for kit in (bench_gpt.einfold_kit(__import__("compiler")), bench_gpt.torch_kit()):
            bench_gpt.train(config, kit, False, 4, 2)              # compiled and tuned
            with torch.profiler.profile(activities=[ProfilerActivity.CUDA]) as prof:
                bench_gpt.train(config, kit, False, 3, 0)
            events = sorted(prof.key_averages(), key=lambda e: -e.device_time_total)
            total = sum(e.device_time_total for e in events) / 3e3
            print(f"{config.name} {kit.name}: {total:.2f} ms of kernels a step (with the setup's)")
            for e in events[:14]:
                print(f"  {e.device_time_total / 3e3:8.3f} ms  x{e.count // 3:<4} {e.key[:100]}")


def main(names: list[str]) -> None:
    packages = revisions(names)
    quick = bool(os.environ.get("PROBE_QUICK"))
    wanted = [w for w in os.environ.get("PROBE_SIZES", "").split(",") if w]
    configs = [c for c in (bench_gpt.QUICK if quick else bench_gpt.SIZES) if not wanted or c.name in wanted]
    if os.environ.get("PROBE_PROFILE"):
        return profile(configs)
    steps, warmup = (40, 15) if quick else (200, 30)
    limit = int(os.environ.get("PROBE_LIMIT", "240"))
    signal.signal(signal.SIGALRM, _stop)
    modes = os.environ.get("PROBE_MODES", "eager,compiled").split(",")
    rows = []
    for config in configs:
        for compiled in [m == "compiled" for m in ("eager", "compiled") if m in modes]:
            kits = {f"einfold {tag}": (lambda p=package: bench_gpt.einfold_kit(p)) for tag, package in packages.items()}
            if os.environ.get("PROBE_OPAQUE"):
                kits["einfold opaque"] = lambda: bench_gpt.einfold_kit(packages["new"])
            kits["torch"] = bench_gpt.torch_kit
            results = {}
            for name, kit in kits.items():
                signal.alarm(limit)
                # "einfold opaque": this tree with every program's op opaque to torch.compile (the
                # custom op of its kernels, as before triton_op), by taking away the traced runner
                traced = TritonBackend.traced_runner
                if name == "einfold opaque":
                    TritonBackend.traced_runner = lambda self, binding: None
                try:
                    results[name] = bench_gpt.train(config, kit(), compiled, steps, warmup)
                except _TooLong:
                    results[name] = f"stopped after {limit} s"
                except Exception as e:
                    results[name] = f"{type(e).__name__}: {str(e).splitlines()[0][:100]}"
                finally:
                    signal.alarm(0)
                    TritonBackend.traced_runner = traced
                torch._dynamo.reset()
                run = results[name]
                print(f"  {config.name} {'compiled' if compiled else 'eager'} {name}: "
                      f"{run if isinstance(run, str) else (run.ms, run.peak_mib)}", flush=True)
            torch_run = results["torch"] if not isinstance(results["torch"], str) else None
            for name, result in results.items():
                row = {"size": config.name, "mode": "torch.compile" if compiled else "eager", "contender": name}
                if isinstance(result, str):
                    row["failed"] = result
                else:
                    row.update(ms=result.ms, p10=result.p10, p90=result.p90, peak_mib=result.peak_mib,
                               losses=result.losses, first=result.losses[0], last=result.losses[-1])
                    if torch_run:
                        row["apart"] = max(abs(a - b) for a, b in zip(result.losses, torch_run.losses))
                        row["torch_over_this"] = torch_run.ms / result.ms
                rows.append(row)
    out = Path(os.environ.get("OUT", "."))
    (out / "gpt.json").write_text(json.dumps({"device": torch.cuda.get_device_name(), "rows": rows}, indent=1))
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}")
    print(f"{'size':10} {'mode':14} {'contender':22} {'ms/step':>8} {'p10-p90':>13} {'peak MiB':>9} "
          f"{'loss first->last':>17} {'apart':>6} {'torch/this':>10}")
    for r in rows:
        if "failed" in r:
            print(f"{r['size']:10} {r['mode']:14} {r['contender']:22} FAILED {r['failed']}")
            continue
        print(f"{r['size']:10} {r['mode']:14} {r['contender']:22} {r['ms']:8.2f} {r['p10']:6.2f}-{r['p90']:6.2f} "
              f"{r['peak_mib']:9.0f} "
              f"{r['first']:8.3f}->{r['last']:7.3f} {r.get('apart', float('nan')):6.3f} "
              f"{r.get('torch_over_this', float('nan')):9.2f}x")


if __name__ == "__main__":
    main(sys.argv[1:])
