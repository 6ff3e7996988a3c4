"""logsumexp in one pass, without overflow.

    L[i] = logsumexp[j](X[i,j])

`lower` writes it as log(sum[j](exp(X[i,j]))); `stabilise` shifts the
exponentials by their max (max + log(sum exp(x - max))), so nothing inside the
sum exceeds 1; `factorise` finds that the shifted sum depends on the max over
the same index and folds both in one pass as the summary (r, l) with repair
factor exp(r - r_new): L = r + log(l).

The logits here reach a few hundred: exp(x) overflows float32 beyond 88, so
the unshifted formula gives inf; the stabilised form does not.  One row is all
-inf: its logsumexp is -inf (l = 0, the sum of no mass), as torch.logsumexp
gives.

Checked against torch.logsumexp in float64.

Run: python examples/logsumexp.py   (exits non-zero on a mismatch)
"""
from __future__ import annotations

import math

import torch

import compiler

SOURCE = "L[i] = logsumexp[j](X[i,j])"


def main() -> None:
    device = "cuda" if torch.cuda.is_available() else "cpu"
    program = compiler.compile(SOURCE)
    print(program.explain())

    rows, width = 37, 1013                           # non-power-of-two; several tiles of j
    g = torch.Generator().manual_seed(3)
    x = 100.0 * torch.randn(rows, width, generator=g)   # logits of a few hundred
    x[5] = -math.inf                                    # a row with no mass at all
    inputs = {"X": x.to(device)}

    print(program.plan(**inputs))
    out = program(**inputs)

    expected = torch.logsumexp(x.double(), dim=1)
    got = out.detach().cpu().double()
    torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-4)   # -inf must match -inf
    assert got[5] == -math.inf, "logsumexp of an all -inf row is -inf"
    finite = torch.isfinite(expected)
    naive = torch.log(torch.exp(x).sum(dim=1))
    print(f"(the unshifted float32 log(sum(exp(x))) is inf on {int(torch.isinf(naive[finite]).sum())} "
          f"of {int(finite.sum())} rows)")
    print(f"logsumexp {tuple(out.shape)} {out.dtype} vs torch.logsumexp (float64): "
          f"max error {float((got[finite] - expected[finite]).abs().max()):.2e}, "
          f"all -inf row -> {float(got[5])} ok")


if __name__ == "__main__":
    main()
