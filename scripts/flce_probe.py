"""Fused linear cross-entropy, forward and forward + backward, on the GPU: this tree's
`compiler.nn.FusedLinearCrossEntropy` (and each earlier revision's in .before/)
against torch (eager and torch.compile), Liger-Kernel and Cut Cross-Entropy where
installed, one process, one shape (FLCE_SHAPE=tokens,hidden,vocab; default the
training GPT's 8192,768,32768; bf16).

    python3 scripts/flce_probe.py [REVISION ...]

Prints ms (median of do_bench), peak MiB and the errors of the loss (absolute) and of
dH and dW (relative, in norm) against float64 of each, then for this tree the kernels
of one forward + backward by CUDA time and the concrete plans of the forward and
its gradient program.  Writes $OUT/flce.json."""
from __future__ import annotations

import importlib
import json
import os
import sys
from pathlib import Path

import torch
import torch.nn.functional as F
import triton.testing

sys.path.insert(0, str(Path(__file__).resolve().parent))
from compare_revisions import revisions  # noqa: E402


def main(names: list[str]) -> None:
    packages = revisions(names)
    tokens, hidden, vocab = (int(x) for x in os.environ.get("FLCE_SHAPE", "8192,768,32768").split(","))
    g = torch.Generator(device="cuda").manual_seed(0)
    h = torch.randn(8, tokens // 8, hidden, device="cuda", dtype=torch.bfloat16, generator=g).requires_grad_()
    w = (0.02 * torch.randn(vocab, hidden, device="cuda", dtype=torch.bfloat16, generator=g)).requires_grad_()
    y = torch.randint(0, vocab, (8, tokens // 8), device="cuda", generator=g)

    def torch_loss(h, w, y):
        return F.cross_entropy(F.linear(h, w).flatten(0, 1).float(), y.flatten())
    contenders = {f"einfold {tag}": importlib.import_module(f"{p.__name__}.nn").FusedLinearCrossEntropy()
                  for tag, p in packages.items()}
    contenders["torch eager"] = torch_loss
    contenders["torch.compile"] = torch.compile(torch_loss)
    try:
        from liger_kernel.transformers import LigerFusedLinearCrossEntropyLoss
        liger = LigerFusedLinearCrossEntropyLoss()
        contenders["liger"] = lambda h, w, y: liger(w, h.flatten(0, 1), y.flatten())
    except Exception as e:
        print("liger unavailable:", e)
    try:
        from cut_cross_entropy import linear_cross_entropy
        contenders["cut cross-entropy"] = lambda h, w, y: linear_cross_entropy(h, w, y)
    except Exception as e:
        print("cut cross-entropy unavailable:", e)
    # the float64 oracle of the loss and of both gradients (the bfloat16 inputs, widened)
    h64, w64 = (t.detach().double().requires_grad_() for t in (h, w))
    want = F.cross_entropy(F.linear(h64, w64).flatten(0, 1), y.flatten())      # in float64 throughout
    want.backward()
    rows = []
    for name, fn in contenders.items():
        row = {"contender": name}
        try:
            loss = fn(h, w, y)
            row["error"] = abs(float(loss) - float(want))
            loss.backward()
            for grad, oracle, label in ((h.grad, h64.grad, "dH error"), (w.grad, w64.grad, "dW error")):
                row[label] = float((grad.double() - oracle).norm() / oracle.norm())
            h.grad = w.grad = None

            def step(fn=fn):
                fn(h, w, y).backward()
            for what, call in (("forward", lambda fn=fn: fn(h, w, y)), ("forward+backward", step)):
                with torch.no_grad() if what == "forward" else torch.enable_grad():
                    call()
                    torch.cuda.synchronize()
                    torch.cuda.reset_peak_memory_stats()
                    base = torch.cuda.memory_allocated()
                    call()
                    torch.cuda.synchronize()
                    row[f"{what} MiB"] = (torch.cuda.max_memory_allocated() - base) / 2 ** 20
                    row[f"{what} ms"] = triton.testing.do_bench(call, warmup=25, rep=100, return_mode="median")
        except Exception as e:
            row["failed"] = f"{type(e).__name__}: {str(e).splitlines()[0][:120]}"
        h.grad = w.grad = None
        rows.append(row)
        print(row, flush=True)

    from torch.profiler import ProfilerActivity
    ours = contenders["einfold new"]
    with torch.profiler.profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(3):
            ours(h, w, y).backward()
        torch.cuda.synchronize()
    print("this tree's kernels of one forward + backward:")
    for e in sorted(prof.key_averages(), key=lambda e: -e.device_time_total)[:12]:
        print(f"  {e.device_time_total / 3e3:8.3f} ms  x{e.count // 3:<3} {e.key[:90]}")
    from compiler.nn import shared_program
    program = shared_program(ours.source(3), "auto", ("loss",))
    inputs = {"H": h.detach(), "W": w.detach(), "Y": y}
    print(program._saving.plan(**inputs))
    gradient = program._gradient(("H", "W"), saved=True)
    print(gradient.backend._last.plan if gradient.backend._last is not None else "no gradient plan")
    out = Path(os.environ.get("OUT", "."))
    (out / "flce.json").write_text(json.dumps({"device": torch.cuda.get_device_name(), "shape": [tokens, hidden, vocab],
                                               "rows": rows}, indent=1))
    print(f"{torch.cuda.get_device_name()}: tokens {tokens}, hidden {hidden}, vocab {vocab}, bf16")
    print(f"{'contender':20} {'fwd ms':>8} {'fwd MiB':>8} {'f+b ms':>8} {'f+b MiB':>8} {'|err|':>8} "
          f"{'dH err':>8} {'dW err':>8}")
    for r in rows:
        if "failed" in r:
            print(f"{r['contender']:20} FAILED {r['failed']}")
        else:
            print(f"{r['contender']:20} {r['forward ms']:8.3f} {r['forward MiB']:8.0f} {r['forward+backward ms']:8.3f} "
                  f"{r['forward+backward MiB']:8.0f} {r['error']:8.1e} {r['dH error']:8.1e} {r['dW error']:8.1e}")


if __name__ == "__main__":
    main(sys.argv[1:])
