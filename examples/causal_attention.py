"""Causal softmax attention: the mask is a predicate on indices.

    O[b,h,i,j] = softmax[m](where(m <= i, Q[b,h,i,k] * K[b,h,m,k] * scale, -inf)) * V[b,h,m,j]

A masked score is -inf, so it lifts to (r, l, u) = (-inf, 0, 0): the identity
of the derived summary.  Masked positions and ragged tiles are padding with
the identity; no special case is written for them.

Two checks, both in float64 on the torch side:
1. against torch.nn.functional.scaled_dot_product_attention(is_causal=True);
2. with the mask shifted by three (m + 3 <= i) the first three query rows have
   no unmasked key at all.  Their softmax is 0/0 = NaN, exactly as
   torch.softmax on a row of -inf gives; the rows with keys must still match.
   (scaled_dot_product_attention returns 0 for such rows instead; einfold
   follows the softmax definition.)

Run: python examples/causal_attention.py   (exits non-zero on a mismatch)
"""
from __future__ import annotations

import math

import torch

import compiler

SOURCE = "O[b,h,i,j] = softmax[m](where(m <= i, Q[b,h,i,k] * K[b,h,m,k] * scale, -inf)) * V[b,h,m,j]"
SHIFTED = "O[b,h,i,j] = softmax[m](where(m + 3 <= i, Q[b,h,i,k] * K[b,h,m,k] * scale, -inf)) * V[b,h,m,j]"


def softmax_attention(q, k, v, scale, allowed):
    """The textbook definition in float64: masked scores are -inf."""
    scores = torch.einsum("bhik,bhmk->bhim", q, k) * scale
    scores = scores.masked_fill(~allowed, -math.inf)
    return torch.einsum("bhim,bhmj->bhij", torch.softmax(scores, dim=-1), v)


def main() -> None:
    device = "cuda" if torch.cuda.is_available() else "cpu"
    program = compiler.compile(SOURCE)
    print(program.explain())

    batch, heads, seq, d, dv = 2, 3, 37, 16, 12      # non-power-of-two sequence and value sizes
    g = torch.Generator().manual_seed(1)
    q = torch.randn(batch, heads, seq, d, generator=g)
    k = torch.randn(batch, heads, seq, d, generator=g)
    v = torch.randn(batch, heads, seq, dv, generator=g)
    scale = 1.0 / math.sqrt(d)
    inputs = {"Q": q.to(device), "K": k.to(device), "V": v.to(device), "scale": scale}

    print(program.plan(**inputs))
    out = program(**inputs)
    expected = torch.nn.functional.scaled_dot_product_attention(q.double(), k.double(), v.double(),
                                                                is_causal=True, scale=scale)
    got = out.detach().cpu().double()
    torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-4)
    error = float((got - expected).abs().max())

    # Fully masked rows: NaN, as the softmax of a row of -inf.
    shifted = compiler.compile(SHIFTED)
    out2 = shifted(**inputs).detach().cpu().double()
    i = torch.arange(seq)[:, None]
    m = torch.arange(seq)[None, :]
    expected2 = softmax_attention(q.double(), k.double(), v.double(), scale, m + 3 <= i)
    torch.testing.assert_close(out2, expected2, rtol=1e-4, atol=1e-4, equal_nan=True)
    nan_rows = torch.isnan(out2).all(dim=-1)
    assert nan_rows[..., :3].all() and not torch.isnan(out2[..., 3:, :]).any(), "NaN exactly on masked rows"
    finite = ~torch.isnan(expected2)
    error = max(error, float((out2[finite] - expected2[finite]).abs().max()))
    print(f"fully masked rows (m + 3 <= i): {int(nan_rows.sum())} rows of "
          f"{nan_rows.numel()} are NaN, as torch.softmax of a -inf row")

    print(f"causal attention {tuple(out.shape)} {out.dtype} vs torch sdpa(is_causal=True) and the "
          f"masked softmax (float64): max error {error:.2e} ok")


if __name__ == "__main__":
    main()
