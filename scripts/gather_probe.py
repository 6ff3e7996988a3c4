"""Gathered subscripts against torch (GPU): an embedding lookup, cross-entropy with
integer labels (from logits, and fused with the output projection), a paged KV
cache's decode.

    python3 scripts/gather_probe.py [OUT_DIR [WORD]]      (WORD: only the cases whose name holds it)

Per case (bf16): einfold's program, torch's own ops and torch.compile of them, side
by side in one process: the forward, and where the case has one, forward + backward
under autograd (the float inputs named need a gradient), in ms (medians of
triton.testing.do_bench), with einfold's and torch's errors against float64.  Each
case has its own time limit, so one slow compile costs that case only; a short
table prints last, and OUT_DIR/gather_probe.json keeps the rows."""
from __future__ import annotations

import json
import sys
from pathlib import Path

import torch
import torch.nn.functional as F
import triton

import compiler
from probing import run_cases, step, timed

LIMIT_S = 150


def _randn(g, *shape, scale=1.0):
    return scale * torch.randn(*shape, device="cuda", generator=g)


def _labels(g, rows, vocab, ignored=0.0):
    labels = torch.randint(0, vocab, (rows,), device="cuda", generator=g)
    drop = torch.rand(rows, device="cuda", generator=g) < ignored
    return torch.where(drop, -100, labels)


def embedding(n):
    def make(g):
        return {"E": _randn(g, n["v"], n["d"]), "T": torch.randint(0, n["v"], (n["i"],), device="cuda", generator=g)}
    return make


def logits(n):
    def make(g):
        return {"Z": _randn(g, n["i"], n["v"], scale=2.0), "Y": _labels(g, n["i"], n["v"], 0.1)}
    return make


def hidden(n):
    def make(g):
        return {"H": _randn(g, n["i"], n["k"]), "W": _randn(g, n["v"], n["k"], scale=0.02),
                "Y": _labels(g, n["i"], n["v"])}
    return make


def paged(n):
    def make(g):
        pages = n["b"] * n["p"]
        table = torch.randperm(pages, device="cuda", generator=g).reshape(n["b"], n["p"])
        return {"Q": _randn(g, n["b"], n["h"], 1, n["k"]), "K": _randn(g, pages, n["s"], n["h"], n["k"]),
                "V": _randn(g, pages, n["s"], n["h"], n["k"]), "B": table, "scale": n["k"] ** -0.5}
    return make


def torch_paged(Q, K, V, B, scale):
    b, pages = B.shape
    keys = K[B].reshape(b, pages * K.shape[1], K.shape[2], K.shape[3]).transpose(1, 2)
    values = V[B].reshape(b, pages * V.shape[1], V.shape[2], V.shape[3]).transpose(1, 2)
    return F.scaled_dot_product_attention(Q, keys, values, scale=scale)


EMB = {"i": 16384, "v": 50257, "d": 4096}
CE = {"i": 8192, "v": 32000}
LCE = {"i": 8192, "k": 2048, "v": 32000}
PAGE = {"b": 32, "h": 32, "p": 256, "s": 16, "k": 128}
CASES = [
    # (name, source, torch function, inputs, float inputs that take a gradient (none: forward only))
    (f"embedding N{EMB['i']} V{EMB['v']} d{EMB['d']}", "Y[i, d] = E[T[i], d]",
     lambda E, T: F.embedding(T, E), embedding(EMB), ("E",)),
    (f"cross-entropy, int labels N{CE['i']} V{CE['v']}",
     "L[i] = where(Y[i] == -100, 0, logsumexp[v](Z[i, v]) - Z[i, Y[i]])",
     lambda Z, Y: F.cross_entropy(Z.float(), Y, reduction="none"), logits(CE), ("Z",)),
    (f"linear cross-entropy, int labels N{LCE['i']} d{LCE['k']} V{LCE['v']}",
     "L[i] = logsumexp[v](H[i, k] * W[v, k]) - sum[k](H[i, k] * W[Y[i], k])",
     lambda H, W, Y: F.cross_entropy((H @ W.T).float(), Y, reduction="none"), hidden(LCE), ("H", "W")),
    (f"paged decode B{PAGE['b']} H{PAGE['h']} {PAGE['p']}x{PAGE['s']} d{PAGE['k']}",
     "O[b, h, i, j] = softmax[p, s](Q[b, h, i, k] * K[B[b, p], s, h, k] * scale) * V[B[b, p], s, h, j]",
     torch_paged, paged(PAGE), ()),
]


def relative(got, want) -> float:
    return float((got.double() - want).abs().max() / want.abs().max())


def case(name, source, reference, make, wrt) -> dict:
    base = make(torch.Generator(device="cuda").manual_seed(0))
    inputs = {k: v.bfloat16().requires_grad_(k in wrt) if isinstance(v, torch.Tensor) and v.is_floating_point()
              else v for k, v in base.items()}
    wide = {k: v.double() if isinstance(v, torch.Tensor) and v.is_floating_point() else v for k, v in base.items()}
    program = compiler.compile(source)
    compiled = torch.compile(reference)
    want = reference(**wide)
    with torch.no_grad():
        row = {"case": name, "error": relative(program(**inputs), want),
               "torch error": relative(reference(**inputs), want)}
    upstream = torch.randn(want.shape, device="cuda").bfloat16()
    for tag, fn in (("einfold", program), ("torch", reference), ("torch.compile", compiled)):
        with torch.no_grad():
            row[f"{tag} fwd"] = timed(lambda: fn(**inputs))
        if wrt:
            row[f"{tag} f+b"] = timed(step(fn, inputs, upstream.to(fn(**inputs).dtype)))
    return row


def main(out: Path, word: str = "") -> None:
    out.mkdir(parents=True, exist_ok=True)
    print("torch", torch.__version__, "triton", triton.__version__, torch.cuda.get_device_name(0))
    rows = run_cases([c for c in CASES if word in c[0]], case, LIMIT_S)
    (out / "gather_probe.json").write_text(json.dumps(rows, indent=1))
    print(f"\n{'case':52s} {'ours fwd':>9s} {'torch':>8s} {'compile':>8s} {'ours f+b':>9s} {'torch':>8s} "
          f"{'compile':>8s} {'vs torch f, f+b':>16s} {'error':>8s} {'torch':>8s}")
    for r in rows:
        if "failed" in r:
            print(f"{r['case']:52s} failed: {r['failed']}")
            continue
        fb = [r.get(f"{t} f+b", float("nan")) for t in ("einfold", "torch", "torch.compile")]
        print(f"{r['case']:52s} {r['einfold fwd']:9.3f} {r['torch fwd']:8.3f} {r['torch.compile fwd']:8.3f} "
              f"{fb[0]:9.3f} {fb[1]:8.3f} {fb[2]:8.3f} "
              f"{r['torch fwd'] / r['einfold fwd']:7.2f}x {fb[1] / fb[0]:6.2f}x {r['error']:8.1e} {r['torch error']:8.1e}")


if __name__ == "__main__":
    main(Path(sys.argv[1] if len(sys.argv) > 1 else "gather-probe-out"), sys.argv[2] if len(sys.argv) > 2 else "")
