"""Probe (issue 13): the FlexAttention variants' generated kernels as emitted (each
loop's tiles addressed as the first tile's addresses, made once before the loop,
plus the loop's start times the stride) against the same kernels with the tile's
addresses computed in every step (the emitter's form before 66214ca), side by side
in one process on the GPU, with the same autotune candidates.

    python3 scripts/hoist_probe.py      # prints a table; rows to $OUT/hoist_probe.json
"""
from __future__ import annotations

import json
import math
import os
import re

import torch
import triton
import triton.testing

import compiler
from compiler.backend.triton.cache import load
from compiler.bench import flex_variants, document_ids

TILE = re.compile(r"^( *)(\w+_tile(?:_\d+)?) = (.*)\n", re.M)


def per_step(source: str) -> str:
    """`source` with every `<tile> + tl.cast(start_v, tl.int64) * s` written as the tile's
    own addresses (offs_v for tl.arange(0, BLOCK_v)), and the tile definitions dropped."""
    tiles = {name: expr for _, name, expr in TILE.findall(source)}
    source = TILE.sub("", source)

    def address(m):
        expr, var = tiles[m[1]], m[2]
        return "(" + expr.replace(f"tl.arange(0, BLOCK_{var})", f"offs_{var}") + ")"
    source, n = re.subn(r"\b(\w+_tile(?:_\d+)?) \+ tl\.cast\(start_(\w+), tl\.int64\) \* \w+", address, source)
    assert n, "no hoisted tile"
    # every loop defines its offsets first (drop_unread removes them where unread)
    return re.sub(r"^( *)for start_(\w+) in (.*):\n", lambda m: f"{m[0]}{m[1]}    offs_{m[2]} = start_{m[2]} + "
                  f"tl.arange(0, BLOCK_{m[2]})\n", source, flags=re.M)



def main() -> None:
    b, h, s, d = 4, 16, 4096, 128
    g = torch.Generator(device="cuda").manual_seed(0)
    x = {k: torch.randn(b, h, s, d, device="cuda", dtype=torch.bfloat16, generator=g) for k in "QKV"}
    x.update(scale=1 / math.sqrt(d), cap=30.0, A=2.0 ** (-8 * torch.arange(1, h + 1, device="cuda") / h),
             D=document_ids(b, s).cuda().bfloat16())
    rows = []
    for variant, (source, _, _) in flex_variants(s, document_ids(b, s)).items():
        program = compiler.compile(source)
        inputs = {k: v for k, v in x.items() if re.search(rf"\b{k}\b", source)}
        program(**inputs)
        n = {"b": b, "h": h, "i": s, "m": s, "i_2": s, "k": d, "j": d}
        timings = {}
        for form, edit in (("hoisted", lambda t: t), ("per step", per_step)):
            module = load(edit(program.source), f"hoist_probe {variant} {form}", interpret=False)
            out = torch.empty(b, h, s, d, device="cuda", dtype=program(**inputs).dtype)
            t = {**inputs, "O": out}
            fn = lambda module=module, t=t, out=out: (module.launch(t, n, "cuda"), out)[1]
            fn()
            timings[form] = triton.testing.do_bench(fn, warmup=25, rep=200, return_mode="median")
        rows.append({"variant": variant, **{f"{k} ms": v for k, v in timings.items()},
                     "hoisted speed-up": timings["per step"] / timings["hoisted"]})
        print(f"{variant:18s} hoisted {timings['hoisted']:.3f} ms  per step {timings['per step']:.3f} ms  "
              f"{timings['per step'] / timings['hoisted']:.3f}x", flush=True)
    with open(os.path.join(os.environ.get("OUT", "."), "hoist_probe.json"), "w") as f:
        json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
