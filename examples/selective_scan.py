"""Mamba's selective scan as the prefix of an ordered summary, in one kernel.

    H[b,d,n,t] = affine[s](where(s <= t, exp(D[b,d,s] * A[d,n]), 1.0),
                           where(s <= t, D[b,d,s] * Bm[b,n,s] * X[b,d,s], 0.0))
    Y[b,d,t]   = sum[n](C[b,n,t] * H[b,d,n,t])

The recurrence h[t] = exp(D[t] A) h[t-1] + D[t] B[t] x[t] (per channel d and
state n) composes affine maps h -> a h + b in order: `affine` is that
composition, a user summary the law checker proves associative (not
commutative).  H[t] is its fold over every step s <= t: a prefix.  The relation
`s <= t` is the only thing that masks s, and the arguments read t nowhere else,
so the Triton backend runs t in order through each program: a tile of steps
scanned with the combine (tl.associative_scan), the state of the tiles before
carried in.  `fuse` inlines H into Y, and the fold over n holds n whole (the
carried state has a value per n), so H is never stored: one kernel reads D, A,
Bm, C, X and writes Y.

Checked against the step-by-step loop (Mamba's selective_scan_ref) in float64.
A user summary has no derivative, so this program has no gradient.

Run: python examples/selective_scan.py   (exits non-zero on a mismatch)
"""
from __future__ import annotations

import torch

import compiler

SOURCE = """
H[b,d,n,t] = affine[s](where(s <= t, exp(D[b,d,s] * A[d,n]), 1.0),
                       where(s <= t, D[b,d,s] * Bm[b,n,s] * X[b,d,s], 0.0))
Y[b,d,t] = sum[n](C[b,n,t] * H[b,d,n,t])
"""


def reference(D, A, Bm, C, X):
    """The recurrence, one step at a time."""
    h = torch.zeros(D.shape[0], D.shape[1], A.shape[1], dtype=D.dtype)
    ys = []
    for t in range(D.shape[2]):
        h = torch.exp(D[:, :, t, None] * A) * h + D[:, :, t, None] * Bm[:, None, :, t] * X[:, :, t, None]
        ys.append((h * C[:, None, :, t]).sum(-1))
    return torch.stack(ys, -1)


def main() -> int:
    affine = compiler.summary("affine", fields=("A", "B"), identity=(1.0, 0.0),
                              lift=lambda a, b: (a, b),                            # one step: h -> a*h + b
                              combine=lambda l, r: (r.A * l.A, r.A * l.B + r.B),   # l first, then r
                              finalize=lambda s: s.B)                              # from h = 0
    scan = compiler.compile(SOURCE, summaries=[affine])
    g = torch.Generator().manual_seed(0)
    batch, channels, states, steps = 2, 6, 4, 300
    inputs = {"D": torch.nn.functional.softplus(torch.randn(batch, channels, steps, generator=g, dtype=torch.float64) - 2),
              "A": -torch.rand(channels, states, generator=g, dtype=torch.float64),
              "Bm": torch.randn(batch, states, steps, generator=g, dtype=torch.float64),
              "C": torch.randn(batch, states, steps, generator=g, dtype=torch.float64),
              "X": torch.randn(batch, channels, steps, generator=g, dtype=torch.float64)}
    print(scan.plan(**inputs))
    got, want = scan(**inputs), reference(**inputs)
    error = float((got - want).abs().max())
    ok = error < 1e-10
    print(f"Y against the step-by-step loop over {steps} steps: max error {error:.1e} "
          f"({'ok' if ok else 'MISMATCH'})")
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
