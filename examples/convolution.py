"""Two convolution layers and their gradients from affine subscripts.

    H[b,o,t] = relu(sum[c,r](W[o,c,r] * X[b,c,t+r]))
    Y[b,p,u] = sum[o,q](V[p,o,q] * H[b,o,2*u+q])

`X[b,c,t+r]` reads X at position t + r (0 outside it): the valid convolution's
output has len(X) - len(W) + 1 positions, derived from the read; the second
layer has stride 2.  A read at affine subscripts is one through strides (r moves
along X's last dimension as t does), so the window and the channels are the
depth of one tensor-core product, and the first layer is fused into the second
(H is never stored).  Differentiating the subscripts gives the transposed
convolutions, dX[b,c,s] = sum[r](dH[b,o,s-r] * W[o,c,r]) where s - r is a
position of H: `compiler.grad` prints them.

Checked against torch.nn.functional.conv1d, forward and backward, in float64.

Run: python examples/convolution.py   (exits non-zero on a mismatch)
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

import compiler

SOURCE = """
H[b,o,t] = relu(sum[c,r](W[o,c,r] * X[b,c,t+r]))
Y[b,p,u] = sum[o,q](V[p,o,q] * H[b,o,2*u+q])
"""


def main() -> None:
    device = "cuda" if torch.cuda.is_available() else "cpu"
    program = compiler.compile(SOURCE, outputs=["Y"])
    print(compiler.grad(SOURCE, wrt="X", outputs="Y").text)

    batch, channels, hidden, out_channels, length = 2, 5, 6, 7, 61      # a prime length
    g = torch.Generator().manual_seed(3)
    x = torch.randn(batch, channels, length, generator=g, dtype=torch.float64)
    w = torch.randn(hidden, channels, 4, generator=g, dtype=torch.float64)
    v = torch.randn(out_channels, hidden, 3, generator=g, dtype=torch.float64)
    xs, ws, vs = (t.to(device).float().requires_grad_() for t in (x, w, v))

    print(program.plan(X=xs, W=ws, V=vs))
    out = program(X=xs, W=ws, V=vs)
    upstream = torch.randn(out.shape, generator=g, dtype=torch.float64)
    out.backward(upstream.to(device).float())

    x64, w64, v64 = (t.clone().requires_grad_() for t in (x, w, v))
    expected = F.conv1d(F.relu(F.conv1d(x64, w64)), v64, stride=2)
    expected.backward(upstream)
    for name, got, want in (("Y", out, expected), ("dX", xs.grad, x64.grad), ("dW", ws.grad, w64.grad),
                            ("dV", vs.grad, v64.grad)):
        got, want = got.detach().cpu().double(), want.detach()
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
        print(f"{name} {tuple(got.shape)} vs torch (float64): max error {float((got - want).abs().max()):.2e} ok")


if __name__ == "__main__":
    main()
