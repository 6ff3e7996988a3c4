"""Layer normalisation as three statements; mean and variance never reach memory.

    mu[i]  = sum[j](X[i,j]) / len(j)
    var[i] = sum[j]((X[i,j] - mu[i])**2) / len(j)
    Y[i,j] = (X[i,j] - mu[i]) * rsqrt(var[i] + eps)

`fuse` inlines mu and var into Y (only Y is an output).  The variance is a sum
over j that depends on another sum over j (the mean): naively two passes.
`factorise` sees that its body is a polynomial of degree 2 in (x - mean) and
folds the centred moments (count, mean, err, M2) with Chan's parallel merge
(Welford's update), the numerically stable choice: one pass, no
catastrophic cancellation of E[x^2] - E[x]^2; the mean is compensated
(mean + err, err the rounding error the merges left in mean), so rows far
from zero lose no digits of their mean.  The rows here have mean 100
and spread 3, so the cancellation would show: the script also prints the
error of that one-pass float32 formula, for comparison only.

Checked against torch.nn.functional.layer_norm in float64.

Run: python examples/layernorm.py   (exits non-zero on a mismatch)
"""
from __future__ import annotations

import torch

import compiler

SOURCE = """
mu[i] = sum[j](X[i,j]) / len(j)
var[i] = sum[j]((X[i,j] - mu[i])**2) / len(j)
Y[i,j] = (X[i,j] - mu[i]) * rsqrt(var[i] + eps)
"""


def main() -> None:
    device = "cuda" if torch.cuda.is_available() else "cpu"
    program = compiler.compile(SOURCE)
    print(program.explain())

    rows, width, eps = 37, 203, 1e-5                 # non-power-of-two rows and row width
    g = torch.Generator().manual_seed(2)
    x = 100.0 + 3.0 * torch.randn(rows, width, generator=g)
    inputs = {"X": x.to(device), "eps": eps}

    print(program.plan(**inputs))
    out = program(**inputs)

    expected = torch.nn.functional.layer_norm(x.double(), (width,), eps=eps)
    got = out.detach().cpu().double()
    torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-4)
    # For comparison only: the unguarded one-pass formula var = E[x^2] - E[x]^2 in float32.
    mean = x.mean(dim=1, keepdim=True)
    naive = (x - mean) * torch.rsqrt((x * x).mean(dim=1, keepdim=True) - mean * mean + eps)
    print(f"(unguarded E[x^2] - E[x]^2 in float32 would be off by "
          f"{float((naive.double() - expected).abs().max()):.1e})")
    print(f"layernorm {tuple(out.shape)} {out.dtype} vs torch layer_norm (float64): "
          f"max error {float((got - expected).abs().max()):.2e} ok")


if __name__ == "__main__":
    main()
