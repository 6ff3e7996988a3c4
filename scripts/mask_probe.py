"""Probe (issue 13): einfold's document-masked causal attention as emitted against
hand edits of it, and FlexAttention with a block mask, side by side in one process
on the GPU.  Each variant is the generated kernel with a few lines replaced, so a
ratio is what the emitter would gain by emitting that:
- no scan: without the live-span scan before the loops (every tile below the
  diagonal loaded, tested and skipped one after another);
- prefetch: the K and V loads moved out of the tile's `if`, masked by its test
  (no traffic for a skipped tile), so the software pipeliner can prefetch them.
The emitted kernel tests a tile by the ranges of the two sides of D[b,i] == D[b,m]
over it (two 1-D min/max) since this probe measured that against the comparison
over the whole tile and its max (B4 H16 S4096, H100: 0.519 -> 0.485 ms, 1.07x;
prefetch 0.561 ms, both 0.516 ms; FlexAttention 0.284 ms), and emits the live-span
scan since a hand edit of it measured 0.493 -> 0.428 / 0.368 / 0.360 ms at 1, 8 and
16 tiles a step (FlexAttention 0.284 ms).

    python3 scripts/mask_probe.py      # prints a table; rows to $OUT/mask_probe.json
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
from compiler.bench import DOCUMENT, SCALED, _flex, attention_of, document_ids, document_mask, kept_fraction

BLOCK = re.compile(r"(?P<pad> +)if (?P<cond>.+):\n(?P<body>(?:(?P=pad)    .*\n)+)")
LOAD = re.compile(r" +(x_[KV]\d+) = tl\.load\(([^\n]*)\)\n")


def prefetched(source: str) -> str:
    def edit(m):
        pad, body = m["pad"], m["body"]
        loads = LOAD.findall(body)
        body = LOAD.sub("", body)
        lines = [f"{pad}live = {m['cond']}\n"]
        lines += [f"{pad}{x} = tl.load({address}, mask=live, other=0.0)\n" for x, address in loads]
        return "".join(lines) + f"{pad}if live:\n" + body
    source, n = BLOCK.subn(edit, source)
    assert n == 2, n
    return source


def unscanned(source: str) -> str:
    """The kernel without its live-span scan: the loops run over every tile below the
    diagonal, each tested (as emitted before the scan)."""
    source, n = re.subn(r"    # the live span of i_2.*?\n    last_i_2 = tl\.maximum\(first_i_2, [^\n]*\n", "", source,
                        flags=re.S)
    assert n == 1, n
    for old, new in (("range(first_i_2, mid_i_2,", "range(0, mid_i_2,"), ("tl.maximum(first_i_2,", "tl.maximum(0,"),
                     ("range(mid_i_2, last_i_2,", "range(mid_i_2, hi_i_2,"), ("tl.minimum(last_i_2,", "tl.minimum(hi_i_2,")):
        assert old in source, old
        source = source.replace(old, new)
    return source


def main() -> None:
    b, h, s, d = 4, 16, 4096, 128
    docs = document_ids(b, s).cuda()
    g = torch.Generator(device="cuda").manual_seed(0)
    x = {k: torch.randn(b, h, s, d, device="cuda", dtype=torch.bfloat16, generator=g) for k in "QKV"}
    x["scale"], x["D"] = 1 / math.sqrt(d), docs.bfloat16()
    program = compiler.compile(attention_of(SCALED, DOCUMENT))
    program(**x)
    contenders = {}
    for name, edit in (("emitted", lambda t: t), ("no scan", unscanned), ("prefetch", prefetched)):
        module = load(edit(program.source), f"mask_probe {name}", interpret=False)
        out = torch.empty_like(x["Q"])
        t = {**x, "O": out}
        n = {"b": b, "h": h, "i": s, "i_2": s, "k": d, "j": d}
        contenders[name] = lambda module=module, t=t, out=out: (module.launch(t, n, "cuda"), out)[1]
    flex = _flex(s, None, document_mask(docs), batch=b)
    contenders["flex"] = lambda: flex(x)
    flops = 4 * b * h * s * s * d * kept_fraction(document_mask(docs), b, s, "cuda")
    reference = contenders["emitted"]().double()
    rows = []
    for name, fn in contenders.items():
        out = fn()
        err = ((out.double() - reference).norm() / reference.norm()).item()
        ms = triton.testing.do_bench(fn, warmup=25, rep=200, return_mode="median")
        rows.append({"contender": name, "ms": ms, "tflops": flops / ms / 1e9, "diff_to_emitted": err})
        print(f"document B{b} H{h} S{s} d{d} {name:9s} {ms:7.3f} ms {flops / ms / 1e9:6.0f} TFLOP/s "
              f"diff {err:.1e}", flush=True)
    with open(os.path.join(os.environ.get("OUT", "."), "mask_probe.json"), "w") as f:
        json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
