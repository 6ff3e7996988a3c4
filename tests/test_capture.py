"""Program.capture: a program recorded as one CUDA graph (compiler/capture.py).
Its errors on the CPU; replays, in-place inputs, copied inputs and the split
decode on the GPU."""
from __future__ import annotations

import pytest
import torch

import compiler
from compiler.errors import BackendError, BindError

ATTENTION = "O[h,i,j] = softmax[m](Q[h,i,k] * K[h,m,k] * scale) * V[h,m,j]"


def test_capture_needs_the_triton_backend_and_cuda_tensors():
    x = torch.ones(3)
    with pytest.raises(BackendError, match="reference backend"):
        compiler.compile("Y[i] = X[i] * 2", backend="reference").capture(X=x)
    if not torch.cuda.is_available():
        with pytest.raises(BackendError, match="needs CUDA tensors.*X is on cpu"):
            compiler.compile("Y[i] = X[i] * 2", backend="triton").capture(X=x)
    with pytest.raises(BindError, match="by name"):
        compiler.compile("Y[i] = X[i] * 2", backend="triton").capture(x)


def _attention(q, k, v, scale):
    return torch.softmax((q.double() @ k.double().transpose(1, 2)) * scale, -1) @ v.double()


@pytest.mark.gpu
@pytest.mark.parametrize("m", [40, 8192])          # 8192 keys of one query row: the split decode
def test_a_captured_program_replays_with_new_inputs(m):
    g = torch.Generator(device="cuda").manual_seed(0)
    i = 1 if m > 1000 else 33

    def randn(*shape):
        return torch.randn(*shape, device="cuda", generator=g, dtype=torch.float16)
    program = compiler.compile(ATTENTION, backend="triton")
    q, k, v = randn(8, i, 64), randn(8, m, 64), randn(8, m, 64)
    captured = program.capture(Q=q, K=k, V=v, scale=0.125)
    out = captured()
    torch.testing.assert_close(out.double(), _attention(q, k, v, 0.125), rtol=2e-2, atol=2e-2)
    assert torch.equal(out, program(Q=q, K=k, V=v, scale=0.125))
    # new values passed by call are copied in; the outputs are the same tensors, rewritten
    q2, k2, v2 = randn(8, i, 64), randn(8, m, 64), randn(8, m, 64)
    again = captured(Q=q2, K=k2, V=v2, scale=0.125)
    assert again is out
    torch.testing.assert_close(out.double(), _attention(q2, k2, v2, 0.125), rtol=2e-2, atol=2e-2)
    # the caller's tensors were copied, not kept: the capture's own inputs are written in place
    q2_before = q2.clone()
    captured.inputs["Q"].mul_(2)
    captured()
    torch.testing.assert_close(out.double(), _attention(2 * q2, k2, v2, 0.125), rtol=2e-2, atol=2e-2)
    assert torch.equal(q2, q2_before)
    if m > 1000:
        (kernel,) = program.plan(Q=q, K=k, V=v, scale=0.125).kernels     # split; its last programs merge
        assert kernel.name.endswith("_partial")


@pytest.mark.gpu
def test_a_captured_program_refuses_other_shapes_and_numbers():
    program = compiler.compile("Y[i,j] = X[i,j] * s + max[j](X[i,j])", backend="triton")
    x = torch.randn(5, 7, device="cuda")
    captured = program.capture(X=x, s=2)
    torch.testing.assert_close(captured(), x * 2 + x.amax(1, keepdim=True))
    with pytest.raises(BindError, match="captured for shape \\(5, 7\\)"):
        captured(X=torch.randn(5, 8, device="cuda"))
    with pytest.raises(BindError, match="captured with s = 2.0"):
        captured(s=3)
    with pytest.raises(BindError, match="no input 'Z'"):
        captured(Z=x)
    assert torch.equal(captured(s=2.0), captured())
