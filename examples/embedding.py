"""Token and position embeddings, normalised, from a gathered subscript.

    X[b,t,d] = E[T[b,t],d] + P[t,d]
    Y[b,t,d] = X[b,t,d] * rsqrt(mean[e](X[b,t,e] ** 2) + eps) * G[d]

`E[T[b,t],d]` reads row T[b,t] of the table E: T is an integer tensor of token
ids, and a subscript that adds its value is a gather (a position outside E
reads 0).  The lookup is fused into the RMS norm (X is never stored): each
program loads its ids, then the rows through them, a tile of addresses.  The
gradient with respect to the table is derived as the scatter,
dE[s,d] = sum[b,t](where(T[b,t] == s, dX[b,t,d], 0)): each row sums the
positions that read it, deterministically, without atomics.

Checked against torch.nn.functional.embedding and torch's RMS norm in float64,
forward and backward.

Run: python examples/embedding.py   (exits non-zero on a mismatch)
"""
from __future__ import annotations

import torch

import compiler

SOURCE = """
X[b,t,d] = E[T[b,t],d] + P[t,d]
Y[b,t,d] = X[b,t,d] * rsqrt(mean[e](X[b,t,e] ** 2) + eps) * G[d]
"""


def main() -> None:
    device = "cuda" if torch.cuda.is_available() else "cpu"
    program = compiler.compile(SOURCE, outputs=["Y"])
    print(compiler.grad(SOURCE, wrt="E", outputs="Y").text)

    batch, length, width, vocab = 3, 17, 24, 101         # prime sizes
    g = torch.Generator().manual_seed(5)
    table = torch.randn(vocab, width, generator=g, dtype=torch.float64)
    positions = torch.randn(length, width, generator=g, dtype=torch.float64)
    gain = torch.randn(width, generator=g, dtype=torch.float64)
    tokens = torch.randint(0, vocab, (batch, length), generator=g)
    es, ps, gs = (t.to(device).float().requires_grad_() for t in (table, positions, gain))
    inputs = {"E": es, "T": tokens.to(device), "P": ps, "G": gs, "eps": 1e-6}

    print(program.plan(**inputs))
    out = program(**inputs)
    upstream = torch.randn(out.shape, generator=g, dtype=torch.float64)
    out.backward(upstream.to(device).float())

    e64, p64, g64 = (t.clone().requires_grad_() for t in (table, positions, gain))
    x = torch.nn.functional.embedding(tokens, e64) + p64
    expected = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6) * g64
    expected.backward(upstream)
    for name, got, want in (("Y", out, expected), ("dE", es.grad, e64.grad), ("dP", ps.grad, p64.grad),
                            ("dG", gs.grad, g64.grad)):
        got, want = got.detach().cpu().double(), want.detach()
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
        print(f"{name} {tuple(got.shape)} vs torch (float64): max error {float((got - want).abs().max()):.2e} ok")


if __name__ == "__main__":
    main()
