"""Probe (issue 13): two misses of the memory-bound targets, measured against their ceilings.

1. Decode (one query row, d = 128, bf16) at each forced split (`split=N`) beside the
   schedule's own choice and SDPA's cuDNN backend: whether another split would reach
   0.9x cuDNN at L = 8k, where the bench measures 0.82x.
2. Few long rows: bf16 logsumexp over 256 x 262144 (32 tiles a row, under the split's
   SPLIT_MIN_TILES) at forced splits.
3. Pure reads: bf16 logsumexp over 8192 x 8192 reads the tensor once and writes almost
   nothing; the target counts against copy bandwidth (read + write).  torch's own
   reductions that only read (sum, amax over the rows) give the read ceiling.

    python3 scripts/split_probe.py     # a table; rows to $OUT/split_probe.json
"""
from __future__ import annotations

import json
import math
import os

import torch
import triton.testing

import compiler
from compiler.bench import ATTENTION, copy_bandwidth

LOGSUMEXP = "Y[i] = logsumexp[j](X[i,j])"


def bench(fn) -> float:
    return triton.testing.do_bench(fn, warmup=25, rep=200, return_mode="median")


def main() -> None:
    from torch.nn.attention import SDPBackend, sdpa_kernel
    rows = []
    copy = copy_bandwidth()
    print(f"copy bandwidth {copy:.0f} GB/s", flush=True)
    splits = [int(s) for s in os.environ.get("PROBE_SPLITS", "8,16,32,64,128").split(",")]
    # PROBE_DECODE: heads:keys[:query rows] each (one query row: decode; more: a short prefill)
    for h, length, *more in [tuple(int(v) for v in c.split(":")) for c in
                             os.environ.get("PROBE_DECODE", "8:8192,32:8192,8:65536").split(",") if c]:
        queries = more[0] if more else 1
        g = torch.Generator(device="cuda").manual_seed(0)
        x = {"Q": torch.randn(1, h, queries, 128, device="cuda", dtype=torch.bfloat16, generator=g),
             "K": torch.randn(1, h, length, 128, device="cuda", dtype=torch.bfloat16, generator=g),
             "V": torch.randn(1, h, length, 128, device="cuda", dtype=torch.bfloat16, generator=g),
             "scale": 1 / math.sqrt(128)}

        def cudnn():
            with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
                return torch.nn.functional.scaled_dot_product_attention(x["Q"], x["K"], x["V"])
        ref = cudnn().double()
        contenders = {"cudnn": cudnn, "einfold (auto split)": (lambda p: lambda: p(**x))(compiler.compile(ATTENTION))}
        for n in splits:
            contenders[f"einfold split={n}"] = (lambda p: lambda: p(**x))(compiler.compile(ATTENTION, split=n))
        nbytes = 2 * (2 * h * length * 128 + 2 * h * queries * 128)
        base = None
        for name, fn in contenders.items():
            out = fn()
            err = ((out.double() - ref).norm() / ref.norm()).item()
            ms = bench(fn)
            base = base or ms
            case = f"decode H{h} L{length}" + (f" rows {queries}" if queries > 1 else "")
            rows.append({"case": case, "contender": name, "ms": ms, "vs_cudnn": base / ms, "rel_err_vs_cudnn": err})
            print(f"{case} {name:22s} {ms * 1e3:7.1f} us {nbytes / ms / 1e6:6.0f} GB/s {base / ms:5.2f}x cuDNN "
                  f"(err {err:.1e})", flush=True)
    if not os.environ.get("PROBE_ATTENTION_ONLY"):
        rows += memory_bound(splits, copy)
    with open(os.path.join(os.environ.get("OUT", "."), "split_probe.json"), "w") as f:
        json.dump(rows, f, indent=1)


def memory_bound(splits: list[int], copy: float) -> list[dict]:
    rows = []
    x = torch.randn(256, 262144, device="cuda", dtype=torch.bfloat16)
    nbytes = x.numel() * x.element_size()
    for n in [None] + splits[:4]:
        program = compiler.compile(LOGSUMEXP, **({} if n is None else {"split": n}))
        fn = (lambda p: lambda: p(X=x))(program)
        fn()
        ms = bench(fn)
        name = "auto" if n is None else f"split={n}"
        rows.append({"case": "logsumexp 256 x 262144 bf16", "contender": name, "ms": ms,
                     "pct_copy": nbytes / ms / 1e6 / copy})
        print(f"logsumexp 256 x 262144 bf16 {name:10s} {ms * 1e3:7.1f} us {100 * nbytes / ms / 1e6 / copy:5.1f}% "
              f"of copy bandwidth", flush=True)
    for dtype in (torch.bfloat16, torch.float32):
        x = torch.randn(8192, 8192, device="cuda", dtype=dtype)
        program = compiler.compile(LOGSUMEXP)
        nbytes = x.numel() * x.element_size()
        for name, fn in {"einfold logsumexp": lambda: program(X=x), "torch.logsumexp": lambda: torch.logsumexp(x, 1),
                         "torch.sum (rows)": lambda: x.sum(1), "torch.amax (rows)": lambda: x.amax(1),
                         "torch.sum (all)": lambda: x.sum()}.items():
            fn()
            ms = bench(fn)
            rows.append({"case": f"read {dtype}", "contender": name, "ms": ms,
                         "pct_copy": nbytes / ms / 1e6 / copy})
            print(f"read 8192^2 {str(dtype):15s} {name:20s} {ms * 1e3:7.1f} us {100 * nbytes / ms / 1e6 / copy:5.1f}% "
                  f"of copy bandwidth", flush=True)
    return rows


if __name__ == "__main__":
    main()
