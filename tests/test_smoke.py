import torch

import compiler


def test_attention_one_liner_matches_sdpa():
    program = compiler.compile("O[b,h,i,j] = softmax[m](Q[b,h,i,k] * K[b,h,m,k] * scale) * V[b,h,m,j]")
    q, k, v = torch.randn(2, 3, 5, 4), torch.randn(2, 3, 7, 4), torch.randn(2, 3, 7, 6)
    out = program(Q=q, K=k, V=v, scale=0.5)
    want = torch.nn.functional.scaled_dot_product_attention(q.double(), k.double(), v.double(), scale=0.5)
    assert out.dtype == torch.float32
    torch.testing.assert_close(out.double(), want, rtol=1e-6, atol=1e-6)


def test_repeated_calls_reuse_the_runner_but_check_new_shapes():
    program = compiler.compile("Y[i] = sum[j](X[i,j] * w[j]) * s", backend="reference")
    x, w = torch.randn(3, 4), torch.randn(4)
    first = program(X=x, w=w, s=2.0)
    second = program(X=x * 2, w=w, s=3.0)             # same shapes: the cached runner, new values
    torch.testing.assert_close(second, 3.0 * (2 * x @ w))
    torch.testing.assert_close(first, 2.0 * (x @ w))
    assert len(program._runners) == 1
    import pytest
    with pytest.raises(compiler.BindError, match="index 'j' has extent 4 in X"):
        program(X=x, w=torch.randn(5), s=1.0)          # new shapes are bound and checked again
    with pytest.raises(compiler.BindError, match="must be a torch tensor or a number"):
        program(X=x, w=w, s="2")
