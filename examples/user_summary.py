"""A user-defined, ordered summary: the affine recurrence h <- a[t] * h + b[t].

The state (A, B) stands for the affine map h -> A*h + B.  Composing the map of
an earlier segment (left) with that of a later one (right) is again affine:

    right(left(h)) = rA * (lA*h + lB) + rB  =  (rA*lA) * h + (rA*lB + rB)

so `combine(l, r) = (r.A * l.A, r.A * l.B + r.B)` is associative, with the
identity map (1, 0), but not commutative: segments must merge in order.  With
h0 = 0 the result is B.  The law checker proves this when the summary is
defined; a wrong summary (subtraction as combine) is refused with a
counterexample.

Run: python examples/user_summary.py   (exits non-zero on any mismatch)
"""
from __future__ import annotations

import sys

import torch

import compiler


def main() -> int:
    ok = True

    affine = compiler.summary(
        "affine",
        fields=("A", "B"),
        identity=(1.0, 0.0),
        lift=lambda a, b: (a, b),                         # one step: h -> a*h + b
        combine=lambda l, r: (r.A * l.A, r.A * l.B + r.B),  # l first, then r
        finalize=lambda s: s.B,                           # h0 = 0
    )
    print(f"affine: {affine.laws}")

    program = compiler.compile("H[i] = affine[t](A[i,t], Bv[i,t])", summaries=[affine],
                               backend="reference")
    torch.manual_seed(0)
    rows, steps = 4, 13
    a = torch.rand(rows, steps, dtype=torch.float64) * 1.5     # some steps grow, some shrink
    b = torch.randn(rows, steps, dtype=torch.float64)
    got = program(A=a, Bv=b)

    h = torch.zeros(rows, dtype=torch.float64)
    for t in range(steps):                                      # the sequential definition
        h = a[:, t] * h + b[:, t]
    match = torch.allclose(got, h, rtol=1e-12, atol=1e-12)
    print(f"H[i] = affine[t](A[i,t], Bv[i,t]) over {steps} steps vs a sequential loop: "
          f"{'match' if match else 'MISMATCH'} (max error {float((got - h).abs().max()):.2e})")
    ok &= match

    try:
        compiler.summary("difference", fields=("h",), identity=(0.0,),
                         lift=lambda x: x, combine=lambda l, r: l.h - r.h, finalize=lambda s: s.h)
    except compiler.LawError as err:
        print(f"subtraction as combine is refused:\n  {err}")
        ok &= "associative" in str(err) and "combine(combine(a, b), c)" in str(err)
    else:
        print("MISMATCH: subtraction as combine was accepted")
        ok = False

    print("all checks passed: ok" if ok else "SOME CHECKS FAILED")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
