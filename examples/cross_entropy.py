"""Cross-entropy with integer labels over a vocabulary, without materialising the logits.

    L[i] = logsumexp[v](H[i,k] * W[v,k]) - sum[k](H[i,k] * W[Y[i],k])

H holds hidden states, W the output embedding, Y each token's class label (an
integer tensor).  The logits H W^T are an inner contraction over k inside the
reduction over v; `stabilise` max-shifts the exponentials and `factorise` folds
the max and the rescaled sum over v into one summary (r, l), so each row's loss
is r + log(l) minus its label's logit, computed in one pass over the vocabulary
with the logits never written to memory.  `W[Y[i],k]` is a gathered subscript:
the row of W at the label's position, read through the labels.  Its gradient is
derived as the scatter: dW[v,k] gains -dL[i] * H[i,k] where Y[i] == v.

Checked against torch.nn.functional.cross_entropy(reduction="none") on the
float64 logits, forward and backward.

Run: python examples/cross_entropy.py   (exits non-zero on a mismatch)
"""
from __future__ import annotations

import torch

import compiler

SOURCE = "L[i] = logsumexp[v](H[i,k] * W[v,k]) - sum[k](H[i,k] * W[Y[i],k])"


def main() -> None:
    device = "cuda" if torch.cuda.is_available() else "cpu"
    program = compiler.compile(SOURCE)
    print(program.explain())
    print(compiler.grad(SOURCE, wrt=["H", "W"]).text)

    tokens, hidden, vocab = 37, 24, 301              # non-power-of-two sizes
    g = torch.Generator().manual_seed(4)
    h = torch.randn(tokens, hidden, generator=g, dtype=torch.float64)
    w = torch.randn(vocab, hidden, generator=g, dtype=torch.float64) / hidden ** 0.5
    labels = torch.randint(0, vocab, (tokens,), generator=g)
    hs, ws = (t.to(device).float().requires_grad_() for t in (h, w))
    inputs = {"H": hs, "W": ws, "Y": labels.to(device)}

    print(program.plan(**inputs))
    out = program(**inputs)
    upstream = torch.randn(tokens, generator=g, dtype=torch.float64)
    out.backward(upstream.to(device).float())

    h64, w64 = (t.clone().requires_grad_() for t in (h, w))
    expected = torch.nn.functional.cross_entropy(h64 @ w64.T, labels, reduction="none")
    expected.backward(upstream)
    for name, got, want in (("L", out, expected), ("dH", hs.grad, h64.grad), ("dW", ws.grad, w64.grad)):
        got, want = got.detach().cpu().double(), want.detach()
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
        print(f"{name} {tuple(got.shape)} vs torch cross_entropy (float64): "
              f"max error {float((got - want).abs().max()):.2e} ok")


if __name__ == "__main__":
    main()
