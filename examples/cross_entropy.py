"""Cross-entropy over a vocabulary without materialising the logits.

    L[i] = logsumexp[v](H[i,k] * W[v,k]) - T[i]

H holds hidden states, W the output embedding, T the logit of each token's
target (gathered by the caller).  The logits H W^T are an inner contraction
over k inside the reduction over v; `stabilise` max-shifts the exponentials and
`factorise` folds the max and the rescaled sum over v into one summary (r, l),
so each row's loss is r + log(l) - T, computed in one pass over the vocabulary
with the logits never written to memory.

Checked against torch.nn.functional.cross_entropy(reduction="none") on the
float64 logits.

Run: python examples/cross_entropy.py   (exits non-zero on a mismatch)
"""
from __future__ import annotations

import torch

import compiler

SOURCE = "L[i] = logsumexp[v](H[i,k] * W[v,k]) - T[i]"


def main() -> None:
    device = "cuda" if torch.cuda.is_available() else "cpu"
    program = compiler.compile(SOURCE)
    print(program.explain())

    tokens, hidden, vocab = 37, 24, 301              # non-power-of-two sizes
    g = torch.Generator().manual_seed(4)
    h = torch.randn(tokens, hidden, generator=g)
    w = torch.randn(vocab, hidden, generator=g) / hidden ** 0.5
    target = torch.randint(0, vocab, (tokens,), generator=g)
    logits = h.double() @ w.double().T                           # the reference's logits, float64
    t = logits[torch.arange(tokens), target].float()             # the target logits, an input
    inputs = {"H": h.to(device), "W": w.to(device), "T": t.to(device)}

    print(program.plan(**inputs))
    out = program(**inputs)

    expected = torch.nn.functional.cross_entropy(logits, target, reduction="none")
    got = out.detach().cpu().double()
    torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-4)
    print(f"cross-entropy {tuple(out.shape)} {out.dtype} vs torch cross_entropy (float64): "
          f"max error {float((got - expected).abs().max()):.2e} ok")


if __name__ == "__main__":
    main()
