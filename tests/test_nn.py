"""compiler.nn: torch modules whose forward is one line of index notation.  Each
matches torch's own module (float64 on the oracle; float32 on the Triton
interpreter) in value and gradient, takes its state dict, and reads strided views."""
import pytest
import torch
import torch.nn.functional as F

import compiler
from compiler import nn

pytestmark = pytest.mark.filterwarnings("ignore:einfold. no CUDA tensors")


def randn(*shape, seed=0, dtype=torch.float64):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed), dtype=dtype)


def same_gradients(ours, theirs, inputs, tol):
    """Value and the gradients of every input and parameter agree with torch's."""
    ys = [m(*[x.clone().requires_grad_() if isinstance(x, torch.Tensor) else x for x in inputs]) for m in (ours, theirs)]
    torch.testing.assert_close(ys[0], ys[1], **tol)
    dy = randn(*ys[0].shape, seed=9, dtype=ys[0].dtype)
    grads = []
    for m in (ours, theirs):
        xs = [x.clone().requires_grad_() for x in inputs]
        m(*xs).backward(dy)
        grads.append([x.grad for x in xs] + [p.grad for p in getattr(m, "parameters", tuple)()])
    assert len(grads[0]) == len(grads[1])
    for g, h in zip(*grads):
        torch.testing.assert_close(g, h, **tol)


F64 = {"rtol": 1e-10, "atol": 1e-10}


@pytest.mark.parametrize("shape,normalized", [((3, 5, 7), 7), ((2, 3, 4, 5), (4, 5)), ((7,), 7)])
def test_rmsnorm_is_torchs(shape, normalized):
    ours = nn.RMSNorm(normalized, eps=1e-6, dtype=torch.float64, backend="reference")
    theirs = torch.nn.RMSNorm(normalized, eps=1e-6, dtype=torch.float64)
    with torch.no_grad():
        theirs.weight.copy_(randn(*theirs.weight.shape, seed=3))
    ours.load_state_dict(theirs.state_dict())            # the same keys: weight
    same_gradients(ours, theirs, [randn(*shape)], F64)


@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("affine", [True, False])
def test_layernorm_is_torchs(affine, bias):
    ours = nn.LayerNorm((4, 6), elementwise_affine=affine, bias=bias, dtype=torch.float64, backend="reference")
    theirs = torch.nn.LayerNorm((4, 6), elementwise_affine=affine, bias=bias, dtype=torch.float64)
    with torch.no_grad():
        for p in theirs.parameters():
            p.copy_(randn(*p.shape, seed=4))
    ours.load_state_dict(theirs.state_dict())            # weight, bias (or nothing)
    same_gradients(ours, theirs, [randn(2, 3, 4, 6)], F64)


def test_rmsnorm_without_eps_takes_the_dtypes_epsilon_as_torch():
    ours, theirs = nn.RMSNorm(5, backend="reference"), torch.nn.RMSNorm(5)
    x = randn(4, 5, dtype=torch.float32) * 1e-4
    torch.testing.assert_close(ours(x), theirs(x), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("module", ["RMSNorm", "LayerNorm"])
def test_a_norm_returns_the_inputs_dtype_beside_float32_weights_as_torch(module):
    x = randn(4, 8, dtype=torch.bfloat16)
    ours, theirs = getattr(nn, module)(8, eps=1e-5, backend="reference"), getattr(torch.nn, module)(8, eps=1e-5)
    assert ours(x).dtype == theirs(x).dtype == torch.bfloat16
    torch.testing.assert_close(ours(x), theirs(x))


@pytest.mark.parametrize("is_causal", [False, True])
def test_attention_is_scaled_dot_product_attention(is_causal):
    ours = nn.Attention(is_causal=is_causal, backend="reference")

    def theirs(q, k, v):
        return F.scaled_dot_product_attention(q, k, v, is_causal=is_causal)
    # 5 queries, 7 keys: torch's causal mask is top-left aligned (m <= i)
    same_gradients(ours, theirs, [randn(2, 3, 5, 4, seed=1), randn(2, 3, 7, 4, seed=2), randn(2, 3, 7, 6, seed=3)],
                   F64)


def test_the_triton_backend_runs_the_modules_under_the_interpreter():
    x = randn(3, 37, dtype=torch.float32)
    norm = nn.RMSNorm(37, eps=1e-5)
    torch.testing.assert_close(norm(x), torch.nn.RMSNorm(37, eps=1e-5)(x), rtol=1e-5, atol=1e-5)
    q, k, v = (randn(1, 2, 9, 8, seed=s, dtype=torch.float32) for s in range(3))
    torch.testing.assert_close(nn.Attention(is_causal=True)(q, k, v),
                               F.scaled_dot_product_attention(q, k, v, is_causal=True), rtol=1e-5, atol=1e-5)


def test_a_strided_view_is_read_in_place_and_each_rank_compiles_once():
    ours = nn.Attention(backend="reference")
    q = randn(2, 5, 3, 4).transpose(1, 2)            # [b, h, i, k] as transformers passes it: a view
    k, v = randn(2, 3, 7, 4, seed=1), randn(2, 3, 7, 4, seed=2)
    torch.testing.assert_close(ours(q, k, v), F.scaled_dot_product_attention(q, k, v), **F64)
    ours(q[0], k[0], v[0])
    assert sorted(ours._programs) == [3, 4]
    ours(q, k, v)
    assert sorted(ours._programs) == [3, 4]


def test_a_module_from_any_program_owns_its_parameters():
    layer = nn.Module("Y[i,o] = X[i,c] * W[o,c] + B[o]", parameters={"W": randn(4, 3), "B": randn(4, seed=1)},
                      backend="reference")
    assert sorted(dict(layer.named_parameters())) == ["B", "W"]
    x = randn(5, 3, seed=2).requires_grad_()
    y = layer(X=x)
    torch.testing.assert_close(y, x @ layer.W.T + layer.B, **F64)
    y.sum().backward()
    torch.testing.assert_close(layer.B.grad, torch.full((4,), 5.0, dtype=torch.float64))
    torch.testing.assert_close(layer.W.grad, x.detach().sum(0).expand(4, 3), **F64)


def test_wrong_names_and_shapes_are_einfold_errors():
    with pytest.raises(compiler.CheckError, match="'Z'"):
        nn.Module("Y[i] = X[i] * W[i]", parameters={"Z": randn(3)}, backend="reference")
    with pytest.raises(compiler.BindError, match=r"RMSNorm\(\[5\]\) got an input of shape \[3, 4\]"):
        nn.RMSNorm(5, backend="reference")(randn(3, 4))
    with pytest.raises(compiler.BindError, match="rank 1"):
        nn.Attention(backend="reference")(randn(3), randn(3), randn(3))
