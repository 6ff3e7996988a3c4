"""Convolutions and pooling written with affine subscripts against torch (GPU).

    python3 scripts/conv_probe.py [OUT_DIR]

Per case (bf16 unless named): einfold's program, torch's own op (cuDNN) and
torch.compile of it, side by side in one process: the forward, and forward +
backward under autograd (every float input needs a gradient), in ms (medians of
triton.testing.do_bench), with einfold's error against float64.  Each case has its
own time limit, so one slow compile costs that case only; a short table prints
last, and OUT_DIR/conv_probe.json keeps the rows."""
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

CASES = [
    # (name, source, torch function, shapes, sizes of the call)
    ("conv1d B16 C256 O256 L4096 r3", "Y[b, o, t] = sum[c, r](W[o, c, r] * X[b, c, t + r])",
     lambda X, W: F.conv1d(X, W), {"X": (16, 256, 4096), "W": (256, 256, 3)}, {}),
    ("depthwise causal conv1d B8 C2048 L4096 r4 (Mamba)",
     "Y[b, c, t] = sum[r](W[c, r] * X[b, c, t + r - 3])",
     lambda X, W: F.conv1d(X, W[:, None], padding=3, groups=W.shape[0])[..., :X.shape[-1]],
     {"X": (8, 2048, 4096), "W": (2048, 4)}, {}),
    ("conv2d B32 C64 O64 56x56 3x3", "Y[b, o, y, x] = sum[c, p, q](W[o, c, p, q] * X[b, c, y + p, x + q])",
     lambda X, W: F.conv2d(X, W), {"X": (32, 64, 58, 58), "W": (64, 64, 3, 3)}, {}),
    ("max pool 2x2/2 B32 C64 112x112", "P[b, c, y, x] = max[p, q](X[b, c, 2*y + p, 2*x + q])",
     lambda X: F.max_pool2d(X, 2), {"X": (32, 64, 112, 112)}, {"p": 2, "q": 2}),
]


def case(name, source, reference, shapes, sizes) -> dict:
    g = torch.Generator(device="cuda").manual_seed(0)
    base = {k: torch.randn(*s, device="cuda", generator=g) for k, s in shapes.items()}
    inputs = {k: v.bfloat16().requires_grad_() for k, v in base.items()}
    program = compiler.compile(source)
    ours = lambda **kw: program(**kw, **sizes)          # noqa: E731
    compiled = torch.compile(reference)
    want = reference(**{k: v.double() for k, v in base.items()})
    with torch.no_grad():
        got = ours(**inputs)
    error = float((got.double() - want).abs().max() / want.abs().max())
    with torch.no_grad():
        theirs = reference(**inputs)
    torch_error = float((theirs.double() - want).abs().max() / want.abs().max())
    upstream = torch.randn(got.shape, device="cuda", generator=g).bfloat16()
    row = {"case": name, "error": error, "torch error": torch_error}
    for tag, fn in (("einfold", ours), ("torch", reference), ("torch.compile", compiled)):
        with torch.no_grad():
            row[f"{tag} fwd"] = timed(lambda: fn(**inputs))
        row[f"{tag} f+b"] = timed(step(fn, inputs, upstream))
    return row


def main(out: Path) -> None:
    out.mkdir(parents=True, exist_ok=True)
    print("torch", torch.__version__, "triton", triton.__version__, torch.cuda.get_device_name(0))
    rows = run_cases(CASES, case, LIMIT_S)
    (out / "conv_probe.json").write_text(json.dumps(rows, indent=1))
    print(f"\n{'case':52s} {'ours fwd':>9s} {'cuDNN':>8s} {'compile':>8s} {'ours f+b':>9s} {'cuDNN':>8s} "
          f"{'compile':>8s} {'vs cuDNN f, f+b':>16s} {'error':>8s} {'torch':>8s}")
    for r in rows:
        if "failed" in r:
            print(f"{r['case']:52s} failed: {r['failed']}")
            continue
        print(f"{r['case']:52s} {r['einfold fwd']:9.3f} {r['torch fwd']:8.3f} {r['torch.compile fwd']:8.3f} "
              f"{r['einfold f+b']:9.3f} {r['torch f+b']:8.3f} {r['torch.compile f+b']:8.3f} "
              f"{r['torch fwd'] / r['einfold fwd']:7.2f}x {r['torch f+b'] / r['einfold f+b']:6.2f}x "
              f"{r['error']:8.1e} {r['torch error']:8.1e}")


if __name__ == "__main__":
    main(Path(sys.argv[1] if len(sys.argv) > 1 else "conv-probe-out"))
