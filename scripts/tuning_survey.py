"""Survey (issue 13): how each autotune candidate of the attention-like kernels times,
relative to the fastest, over the attention shapes and FlexAttention variants the
benchmark runs.  A candidate that is never within a few percent of the fastest
costs every first call a compile and a timing and wins nothing.

    python3 scripts/tuning_survey.py      # prints a table; rows to $OUT/tuning_survey.json

Runs with a fresh Triton cache (the autotuner's remembered choices would skip the
timing)."""
from __future__ import annotations

import json
import os
import tempfile

os.environ["TRITON_CACHE_DIR"] = tempfile.mkdtemp(prefix="survey-triton-")
os.environ["EINFOLD_CACHE_DIR"] = tempfile.mkdtemp(prefix="survey-einfold-")

import torch  # noqa: E402

import compiler  # noqa: E402
from compiler import bench  # noqa: E402

CAUSAL = "O[b,h,i,j] = softmax[m](where(m <= i, Q[b,h,i,k] * K[b,h,m,k] * scale, -inf)) * V[b,h,m,j]"


def cases():
    g = torch.Generator(device="cuda").manual_seed(0)

    def qkv(b, h, s, d):
        return {k: torch.randn(b, h, s, d, device="cuda", dtype=torch.bfloat16, generator=g) for k in "QKV"}
    for d in (64, 128):
        for s, b in ((1024, 16), (4096, 4)):
            for name, source in (("attention", bench.ATTENTION), ("causal", CAUSAL)):
                yield f"{name} S{s} d{d}", source, {**qkv(b, 16, s, d), "scale": d ** -0.5}
    x = {**qkv(4, 16, 4096, 128), "scale": 128 ** -0.5, "cap": 30.0,
         "A": 2.0 ** (-8 * torch.arange(1, 17, device="cuda") / 16),
         "D": bench.document_ids(4, 4096).cuda().bfloat16()}
    for variant, (source, *_) in bench.flex_variants(4096, x["D"]).items():
        yield variant, source, x
    kv = {k: torch.randn(4, 8, 4096, 128, device="cuda", dtype=torch.bfloat16, generator=g) for k in "KV"}
    q = torch.randn(4, 8, 4, 4096, 128, device="cuda", dtype=torch.bfloat16, generator=g)
    yield "grouped query", bench.GROUPED_QUERY, {**kv, "Q": q, "scale": 128 ** -0.5}


def main() -> None:
    rows = []
    for name, source, x in cases():
        program = compiler.compile(source, backend="triton")
        program(**{k: v for k, v in x.items() if k in {i.name for i in program.checked.inputs}})
        for built, launch, _ in program.backend._built.values():
            for kernel in built.plan.kernels:
                tuner = getattr(launch.__globals__[kernel.name], "kernel", None)
                timings = getattr(tuner, "configs_timings", None)
                if not timings:
                    continue
                best = min(t[0] if isinstance(t, list) else t for t in timings.values())
                for config, t in timings.items():
                    ms = t[0] if isinstance(t, list) else t
                    rows.append({"case": name, "kernel": kernel.name, "config": str(config), "ms": ms,
                                 "relative": ms / best})
        print(name, flush=True)
    with open(os.path.join(os.environ.get("OUT", "."), "tuning_survey.json"), "w") as f:
        json.dump(rows, f, indent=1)
    configs = sorted({r["config"] for r in rows})
    print(f"\n{'case':28s} " + " ".join(f"c{k:<5d}" for k in range(len(configs))))
    for case in dict.fromkeys(r["case"] for r in rows):
        rel = {r["config"]: r["relative"] for r in rows if r["case"] == case}
        print(f"{case:28s} " + " ".join(f"{rel[c]:6.3f}" if c in rel else "   -  " for c in configs))
    for k, c in enumerate(configs):
        print(f"c{k}: {c}")


if __name__ == "__main__":
    main()
