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


def test_a_run_writes_the_outputs_it_is_given():
    # the ring's local calls write their states into one slot of a stacked buffer
    for backend in ("triton", "reference"):
        program = compiler.compile("Y[i,j] = sum[k](X[i,k] * W[j,k]) + B[j]", backend=backend)
        x, w, b = torch.randn(5, 3), torch.randn(4, 3), torch.randn(4)
        buffer = torch.full((3, 5, 4), float("nan"))
        into = buffer[1]
        got = program._run({"X": x, "W": w, "B": b}, out={"Y": into})
        assert got.data_ptr() == into.data_ptr()
        torch.testing.assert_close(buffer[1], x @ w.T + b)
        assert buffer[0].isnan().all() and buffer[2].isnan().all()
        # a strided view (the columns of a wider buffer) is written through its strides
        wide = torch.zeros(5, 9)
        program._run({"X": x, "W": w, "B": b}, out={"Y": wide[:, 1:9:2]})
        torch.testing.assert_close(wide[:, 1:9:2], x @ w.T + b)
        assert (wide[:, 0::2] == 0).all()
