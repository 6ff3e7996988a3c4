"""Softmax attention from its one-line definition.

    O[b,h,i,j] = softmax[m](Q[b,h,i,k] * K[b,h,m,k] * scale) * V[b,h,m,j]

einfold lowers the softmax, max-rescales the exponentials, finds that the
numerator and the denominator are sums over m that depend on the running max
(repair factor exp(r - r_new), derived with sympy) and share their weights
(the pullback), and folds all of it in one pass over m with the summary
(r, l, u): O = u / l.  `program.explain()` prints that derivation.

Checked against torch.nn.functional.scaled_dot_product_attention in float64.

Run: python examples/attention.py   (exits non-zero on a mismatch)
"""
from __future__ import annotations

import math

import torch

import compiler

SOURCE = "O[b,h,i,j] = softmax[m](Q[b,h,i,k] * K[b,h,m,k] * scale) * V[b,h,m,j]"


def main() -> None:
    device = "cuda" if torch.cuda.is_available() else "cpu"
    program = compiler.compile(SOURCE)
    print(program.explain())

    # Small, non-power-of-two shapes: 37 queries, 29 keys, head size 16, value size 12.
    batch, heads, queries, keys, d, dv = 2, 3, 37, 29, 16, 12
    g = torch.Generator().manual_seed(0)
    q = torch.randn(batch, heads, queries, d, generator=g)
    k = torch.randn(batch, heads, keys, d, generator=g)
    v = torch.randn(batch, heads, keys, dv, generator=g)
    scale = 1.0 / math.sqrt(d)
    inputs = {"Q": q.to(device), "K": k.to(device), "V": v.to(device), "scale": scale}

    print(program.plan(**inputs))
    out = program(**inputs)

    expected = torch.nn.functional.scaled_dot_product_attention(q.double(), k.double(), v.double(),
                                                                scale=scale)
    got = out.detach().cpu().double()
    torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-4)
    print(f"attention {tuple(out.shape)} {out.dtype} vs torch sdpa (float64): "
          f"max error {float((got - expected).abs().max()):.2e} ok")


if __name__ == "__main__":
    main()
