"""The float64 oracle (backend="reference") on every construct of the language,
each against an independent, hand-written torch computation."""
import math

import pytest
import torch
import torch.nn.functional as F

import compiler

torch.manual_seed(0)


def ref(src: str, outputs=None, **inputs):
    return compiler.compile(src, backend="reference", outputs=outputs)(**inputs)


def randn(*shape, dtype=torch.float64):
    return torch.randn(*shape, dtype=torch.float64).to(dtype)


def close(got, want, **kw):
    assert got.dtype == want.dtype, (got.dtype, want.dtype)
    torch.testing.assert_close(got, want, **kw)


# ---------------------------------------------------------------- contractions
def test_matmul_ragged_sizes():
    a, b = randn(5, 7), randn(7, 3)
    close(ref("C[i, j] = A[i, k] * B[k, j]", A=a, B=b), a @ b)


def test_batch_matmul():
    a, b = randn(2, 5, 3), randn(2, 3, 6)
    close(ref("C[b, i, j] = A[b, i, k] * B[b, k, j]", A=a, B=b), torch.bmm(a, b))


def test_sum_then_add():
    a, b, d = randn(3, 4), randn(4, 5), randn(3, 5)
    close(ref("C[i, j] = A[i, k] * B[k, j] + D[i, j]", A=a, B=b, D=d), a @ b + d)


def test_transposed_output_and_non_contiguous_input():
    a = randn(6, 4).t()                      # a view, 4 x 6
    close(ref("T[j, i] = A[i, j]", A=a), a.t())


def test_outer_product():
    x, y = randn(3), randn(5)
    close(ref("O[i, j] = x[i] * y[j]", x=x, y=y), torch.outer(x, y))


def test_diagonal_and_trace():
    s = randn(5, 5)
    close(ref("d[i] = S[i, i]", S=s), torch.diagonal(s))
    close(ref("t[] = S[i, i]", S=s), torch.trace(s))


def test_diagonal_of_three_dimensions():
    s = randn(4, 3, 4)
    want = torch.stack([s[n, :, n] for n in range(4)])
    close(ref("d[i, j] = S[i, j, i]", S=s), want)


# ---------------------------------------------------------------- attention
def _softmax_rows(s):
    e = torch.exp(s - s.max(dim=-1, keepdim=True).values)
    return e / e.sum(dim=-1, keepdim=True)


ATTENTION = "O[i, j] = softmax[m](Q[i, k] * K[m, k] / sqrt(len(k))) * V[m, j]"


def test_attention():
    q, k, v = randn(5, 3), randn(7, 3), randn(7, 6)
    want = _softmax_rows(q @ k.T / math.sqrt(3)) @ v
    close(ref(ATTENTION, Q=q, K=k, V=v), want)


def test_batched_attention_with_a_scale_parameter():
    q, k, v = randn(2, 3, 5, 4), randn(2, 3, 7, 4), randn(2, 3, 7, 6)
    got = ref("O[b,h,i,j] = softmax[m](Q[b,h,i,k] * K[b,h,m,k] * scale) * V[b,h,m,j]",
              Q=q, K=k, V=v, scale=0.3)
    close(got, F.scaled_dot_product_attention(q, k, v, scale=0.3))


def test_causal_attention():
    q, k, v = randn(6, 4), randn(6, 4), randn(6, 3)
    got = ref("O[i, j] = softmax[m](where(m <= i, Q[i, k] * K[m, k], -inf)) * V[m, j]", Q=q, K=k, V=v)
    close(got, F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=1.0))


def test_sliding_window_attention():
    q, k, v = randn(7, 2), randn(7, 2), randn(7, 3)
    got = ref("O[i, j] = softmax[m](where(m <= i and i - m < 3, Q[i, k] * K[m, k], -inf)) * V[m, j]",
              Q=q, K=k, V=v)
    rows = torch.arange(7)[:, None]
    cols = torch.arange(7)[None, :]
    allowed = (cols <= rows) & (rows - cols < 3)
    s = (q @ k.T).masked_fill(~allowed, -math.inf)
    close(got, _softmax_rows(s) @ v)


def test_alibi_bias():
    q, k, v = randn(5, 4), randn(6, 4), randn(6, 2)
    got = ref("O[i, j] = softmax[m](Q[i, k] * K[m, k] - slope * abs(i - m)) * V[m, j]",
              Q=q, K=k, V=v, slope=0.5)
    bias = -0.5 * (torch.arange(5)[:, None] - torch.arange(6)[None, :]).abs().double()
    close(got, _softmax_rows(q @ k.T + bias) @ v)


def test_attention_as_three_statements_with_intermediates():
    q, k, v = randn(4, 3), randn(5, 3), randn(5, 2)
    src = "S[i, m] = Q[i, k] * K[m, k]\nP[i, m] = softmax[m](S[i, m])\nO[i, j] = P[i, m] * V[m, j]"
    s, p, o = ref(src, outputs=["O", "S", "P"], Q=q, K=k, V=v)
    close(s, q @ k.T)
    close(p, torch.softmax(q @ k.T, dim=-1))
    close(o, torch.softmax(q @ k.T, dim=-1) @ v)


def test_fully_masked_softmax_rows_are_nan():
    # m >= i + 3 with 4 positions: row 0 sees m = 3 only, rows 1..3 see nothing at all:
    # no mass, 0/0, NaN (as torch.softmax gives on an all -inf row)
    s, v = randn(4, 4), randn(4, 2)
    src = "O[i, j] = softmax[m](where(m >= i + 3, S[i, m], -inf)) * V[m, j]"
    got = ref(src, S=s, V=v)
    assert torch.isnan(got[1:]).all()
    close(got[0], v[3])
    p = ref("P[i, m] = softmax[m](where(m >= i + 3, S[i, m], -inf))", S=s)
    assert torch.isnan(p[1:]).all()
    close(p[0], torch.tensor([0.0, 0.0, 0.0, 1.0], dtype=torch.float64))


# ---------------------------------------------------------------- elementwise
X = randn(3, 5)
POSITIVE = X.abs() + 0.1
FUNCTIONS = [
    ("exp", X, torch.tensor([[math.exp(v) for v in row] for row in X.tolist()], dtype=torch.float64)),
    ("exp2", X, 2.0 ** X),
    ("log", POSITIVE, torch.tensor([[math.log(v) for v in row] for row in POSITIVE.tolist()],
                                   dtype=torch.float64)),
    ("log2", POSITIVE, torch.tensor([[math.log2(v) for v in row] for row in POSITIVE.tolist()],
                                    dtype=torch.float64)),
    ("sqrt", POSITIVE, POSITIVE ** 0.5),
    ("rsqrt", POSITIVE, 1.0 / POSITIVE ** 0.5),
    ("abs", X, torch.where(X < 0, -X, X)),
    ("tanh", X, (torch.exp(2 * X) - 1) / (torch.exp(2 * X) + 1)),
    ("sigmoid", X, 1 / (1 + torch.exp(-X))),
    ("erf", X, torch.tensor([[math.erf(v) for v in row] for row in X.tolist()], dtype=torch.float64)),
    ("gelu", X, F.gelu(X)),
    ("silu", X, F.silu(X)),
    ("relu", X, torch.where(X > 0, X, torch.zeros_like(X))),
    ("softplus", X, torch.log1p(torch.exp(X))),
]


@pytest.mark.parametrize("name, x, want", FUNCTIONS, ids=[f[0] for f in FUNCTIONS])
def test_function(name, x, want):
    close(ref(f"Y[i, j] = {name}(A[i, j])", A=x), want)


def test_softplus_does_not_overflow():
    x = torch.tensor([-800.0, 0.0, 800.0], dtype=torch.float64)
    close(ref("Y[i] = softplus(A[i])", A=x), torch.tensor([0.0, math.log(2), 800.0], dtype=torch.float64))


def test_two_argument_max_and_min():
    a, b = randn(4), randn(4)
    close(ref("Y[i] = max(A[i], B[i])", A=a, B=b), torch.where(a > b, a, b))
    close(ref("Y[i] = min(A[i], B[i])", A=a, B=b), torch.where(a < b, a, b))
    close(ref("Y[i] = max(A[i], 0)", A=a), a.clamp(min=0))


def test_arithmetic_and_precedence():
    a, b, c = randn(5), randn(5), randn(5).abs() + 0.5
    got = ref("Y[i] = -A[i] ** 2 + B[i] / C[i] - (A[i] - B[i]) * 3 + C[i] ** B[i] ** 2",
              A=a, B=b, C=c)
    close(got, -(a ** 2) + b / c - (a - b) * 3 + c ** (b ** 2))


def test_constants():
    a = randn(3)
    close(ref("Y[i] = A[i] * pi + max(A[i], -inf)", A=a), a * math.pi + a)
    close(ref("Y[i] = min(A[i], inf) * 0.5e1", A=a), a * 5)


def test_comparisons_and_logic():
    a = torch.tensor([-2.0, -1.0, 0.0, 1.0, 2.0], dtype=torch.float64)
    src = "Y[i] = where({}, 1.0, 0.0) + A[i] * 0"
    cases = {
        "A[i] < 0": a < 0, "A[i] <= 0": a <= 0, "A[i] > 0": a > 0, "A[i] >= 0": a >= 0,
        "A[i] == 0": a == 0, "A[i] != 0": a != 0,
        "A[i] > -2 and A[i] < 2": (a > -2) & (a < 2),
        "A[i] < -1 or A[i] > 1": (a < -1) | (a > 1),
        "not A[i] < 0": ~(a < 0),
        "not A[i] < 0 and A[i] != 2": ~(a < 0) & (a != 2),
    }
    for cond, want in cases.items():
        close(ref(src.format(cond), A=a), want.double(), msg=cond)


def test_predicate_and_index_statements_keep_their_types():
    s = randn(3, 4)
    mask, dist = ref("T[i, m] = S[i, m] * 2\nM[i, m] = m <= i\nD[i, m] = abs(i - m)",
                     outputs=["M", "D"], S=s)
    rows, cols = torch.arange(3)[:, None], torch.arange(4)[None, :]
    close(mask, cols <= rows)
    close(dist, (rows - cols).abs())


def test_index_values_and_true_division():
    a = randn(4)
    close(ref("Y[i] = A[i] + i / 2", A=a), a + torch.arange(4) / 2)
    close(ref("Y[i] = A[i] * len(i)", A=a), a * 4)


def test_where_with_integer_branches():
    a = randn(6)
    close(ref("Y[i] = A[i] * where(A[i] > 0, 2, -1)", A=a), a * torch.where(a > 0, 2.0, -1.0).double())


# ---------------------------------------------------------------- reductions
R = randn(3, 4, 5)


@pytest.mark.parametrize("name, want", [
    ("sum", R.sum(dim=1)),
    ("max", R.amax(dim=1)),
    ("min", R.amin(dim=1)),
    ("prod", R.prod(dim=1)),
    ("mean", R.mean(dim=1)),
    ("logsumexp", torch.logsumexp(R, dim=1)),
])
def test_reduction(name, want):
    close(ref(f"Y[i, j] = {name}[k](A[i, k, j])", A=R), want)


@pytest.mark.parametrize("name, want", [
    ("sum", R.sum(dim=(0, 2))),
    ("max", R.amax(dim=(0, 2))),
    ("min", R.amin(dim=(0, 2))),
    ("prod", R.prod(dim=2).prod(dim=0)),
    ("mean", R.mean(dim=(0, 2))),
    ("logsumexp", torch.logsumexp(R, dim=(0, 2))),
])
def test_reduction_over_two_indices(name, want):
    close(ref(f"Y[k] = {name}[i, j](A[i, k, j])", A=R), want)


def test_softmax_over_two_indices():
    want = torch.softmax(R.reshape(3, 20), dim=1).reshape(3, 4, 5)
    close(ref("P[i, k, j] = softmax[k, j](A[i, k, j])", A=R), want)


def test_softmax_keeps_its_index():
    s = randn(4, 6)
    close(ref("P[i, m] = softmax[m](S[i, m])", S=s), torch.softmax(s, dim=1))


def test_logsumexp_of_large_values_is_finite():
    x = torch.tensor([[1000.0, 1000.0], [-1000.0, -1000.0]], dtype=torch.float64)
    close(ref("Y[i] = logsumexp[k](A[i, k])", A=x),
          torch.tensor([1000 + math.log(2), -1000 + math.log(2)], dtype=torch.float64))


def test_reduction_of_index_values():
    a = randn(5)
    close(ref("Y[i] = A[i] + max[k](k * B[k])", A=a, B=torch.ones(3, dtype=torch.float64)),
          a + 2)


def test_layer_norm_in_three_statements():
    x, g, b = randn(4, 10), randn(10), randn(10)
    src = ("mu[i] = mean[k](X[i, k])\n"
           "var[i] = mean[k]((X[i, k] - mu[i]) ** 2)\n"
           "Y[i, k] = (X[i, k] - mu[i]) * rsqrt(var[i] + eps) * G[k] + B[k]")
    close(ref(src, X=x, G=g, B=b, eps=1e-5), F.layer_norm(x, (10,), g, b, eps=1e-5))


def test_rms_norm():
    x, g = randn(3, 7), randn(7)
    got = ref("Y[i, k] = X[i, k] * rsqrt(mean[n](X[i, n] ** 2) + eps) * G[k]", X=x, G=g, eps=1e-6)
    close(got, x / torch.sqrt((x ** 2).mean(dim=1, keepdim=True) + 1e-6) * g)


# ---------------------------------------------------------------- inputs, dtypes, outputs
def test_scalar_as_python_number_and_as_0d_tensor():
    a = randn(4)
    close(ref("Y[i] = A[i] * s + 1", A=a, s=2.5), a * 2.5 + 1)
    close(ref("Y[i] = A[i] * s + 1", A=a, s=3), a * 3 + 1)
    close(ref("Y[i] = A[i] * s + 1", A=a, s=torch.tensor(2.5, dtype=torch.float64)), a * 2.5 + 1)


def test_0d_output():
    a = randn(6)
    got = ref("X[] = sum[i](A[i])", A=a)
    assert got.shape == ()
    close(got, a.sum())


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32, torch.float64])
def test_output_has_the_input_dtype(dtype):
    a, b = randn(5, 7, dtype=dtype), randn(7, 3, dtype=dtype)
    got = ref("C[i, j] = A[i, k] * B[k, j]", A=a, B=b)
    # the oracle computes in float64 from the given values and rounds once at the end
    close(got, (a.double() @ b.double()).to(dtype))


@pytest.mark.parametrize("first, second, result", [
    (torch.float16, torch.float32, torch.float32),
    (torch.bfloat16, torch.float16, torch.float32),
    (torch.float32, torch.float64, torch.float64),
])
def test_mixed_dtypes_promote(first, second, result):
    a, b = randn(4, dtype=first), randn(4, dtype=second)
    got = ref("Y[i] = A[i] * B[i]", A=a, B=b)
    close(got, (a.double() * b.double()).to(result))


def test_python_numbers_do_not_promote():
    # float results take the promoted dtype of the tensor inputs; a Python number is not a tensor
    a = randn(3, dtype=torch.float16)
    close(ref("Y[i] = A[i] * s", A=a, s=2.0), (a.double() * 2).half())


def test_scalars_alone_give_float32():
    close(ref("Y[] = s * 2 + 1", s=1.5), torch.tensor(4.0))


def test_outputs_come_back_in_statement_order():
    a = randn(3, 4)
    src = "S[i] = sum[k](A[i, k])\nT[i] = S[i] * 2\nU[] = sum[i](T[i])"
    got = ref(src, outputs=["U", "S"], A=a)
    assert isinstance(got, tuple) and len(got) == 2
    close(got[0], a.sum(dim=1))
    close(got[1], a.sum() * 2)


def test_default_outputs_are_the_unread_statements():
    a = randn(3)
    got = ref("S[i] = A[i] * 2\nT[i] = S[i] + 1\nU[i] = S[i] - 1", A=a)
    assert isinstance(got, tuple) and len(got) == 2
    close(got[0], a * 2 + 1)
    close(got[1], a * 2 - 1)


def test_one_output_is_a_tensor_not_a_tuple():
    got = ref("S[i] = A[i] * 2\nT[i] = S[i] + 1", A=randn(3))
    assert isinstance(got, torch.Tensor)
