"""Affine subscripts (issue 42, item 2): `X[b, c, t + r]`, `X[2*t + r]`, `X[t - 1]`
read a tensor at an affine combination of indices, 0 outside it.  Convolutions,
strides, dilations, padding and pooling match torch in the forward and the
derived backward (the transposed convolution falls out of differentiating the
subscript), on the oracle and the Triton backend (the interpreter without a GPU;
GPU-marked cases on the device); extents are derived, windows are sizes of the
call, and the errors point at the subscript."""
import warnings

import pytest
import torch
import torch.nn.functional as F

import compiler
from compiler import BindError, CheckError, ShardError
from compiler.ir import format_program

pytestmark = pytest.mark.usefixtures("private_cache")
warnings.filterwarnings("ignore", message="einfold: no CUDA tensors", category=RuntimeWarning)

BACKENDS = ["reference", "triton"]
CONV1D = "Y[b, o, t] = sum[c, r](W[o, c, r] * X[b, c, t + r])"
CONV2D = "Y[b, o, y, x] = sum[c, p, q](W[o, c, p, q] * X[b, c, y + p, x + q])"


def randn(*shape, seed=0, dtype=torch.float64):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed), dtype=torch.float64).to(dtype)


def forward_and_backward(source, inputs, wrt, backend, sizes=None, seed=1):
    """(output, gradients) of `source` under torch autograd, with an upstream gradient
    drawn from `seed`."""
    program = compiler.compile(source, backend=backend)
    leaves = {k: v.clone().requires_grad_(k in wrt) for k, v in inputs.items()}
    out = program(**leaves, **(sizes or {}))
    out.backward(randn(*out.shape, seed=seed, dtype=out.dtype).to(out.device))
    return out, [leaves[k].grad for k in wrt]


def torch_forward_and_backward(fn, inputs, wrt, seed=1):
    leaves = {k: v.double().clone().requires_grad_(k in wrt) for k, v in inputs.items()}
    out = fn(**leaves)
    out.backward(randn(*out.shape, seed=seed).to(out.device))
    return out, [leaves[k].grad for k in wrt]


CASES = [
    # (name, source, torch, shapes, window sizes)
    ("conv1d", CONV1D, lambda X, W: F.conv1d(X, W), {"X": (2, 3, 13), "W": (4, 3, 3)}, {}),
    ("stride 2", "Y[b, o, t] = sum[c, r](W[o, c, r] * X[b, c, 2*t + r])",
     lambda X, W: F.conv1d(X, W, stride=2), {"X": (2, 3, 13), "W": (4, 3, 3)}, {}),
    ("dilation 2", "Y[b, o, t] = sum[c, r](W[o, c, r] * X[b, c, t + 2*r])",
     lambda X, W: F.conv1d(X, W, dilation=2), {"X": (2, 3, 13), "W": (4, 3, 3)}, {}),
    # padding 1 on the left: the position t = 0 reads X[-1], which is 0
    ("padded", "Y[b, o, t] = sum[c, r](W[o, c, r] * X[b, c, t + r - 1])",
     lambda X, W: F.conv1d(X, W, padding=1)[..., :-1], {"X": (2, 3, 13), "W": (4, 3, 3)}, {}),
    ("conv2d", CONV2D, lambda X, W: F.conv2d(X, W), {"X": (2, 3, 7, 6), "W": (4, 3, 3, 2)}, {}),
    ("max pool", "P[b, c, t] = max[r](X[b, c, 2*t + r])", lambda X: F.max_pool1d(X, 2), {"X": (2, 3, 13)},
     {"r": 2}),
    ("average pool", "P[b, c, t] = mean[r](X[b, c, 3*t + r])", lambda X: F.avg_pool1d(X, 3), {"X": (2, 3, 13)},
     {"r": 3}),
    ("pooled convolution", "Y[b, o, t] = sum[c, r](W[o, c, r] * X[b, c, t + r])\nP[b, o, u] = max[q](Y[b, o, 2*u + q])",
     lambda X, W: F.max_pool1d(F.conv1d(X, W), 2), {"X": (2, 3, 13), "W": (4, 3, 3)}, {"q": 2}),
    ("two layers", "H[b, o, t] = relu(sum[c, r](W[o, c, r] * X[b, c, t + r]))\n"
                   "Y[b, p, u] = sum[o, q](V[p, o, q] * H[b, o, u + q])",
     lambda X, W, V: F.conv1d(F.relu(F.conv1d(X, W)), V), {"X": (2, 3, 13), "W": (4, 3, 3), "V": (5, 4, 2)}, {}),
]


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("name, source, reference, shapes, sizes", CASES, ids=[c[0] for c in CASES])
def test_matches_torch_forward_and_backward(name, source, reference, shapes, sizes, backend):
    inputs = {k: randn(*shape, seed=k.encode()[0]) for k, shape in shapes.items()}
    wrt = tuple(inputs)
    got, grads = forward_and_backward(source, inputs, wrt, backend, sizes)
    want, wanted = torch_forward_and_backward(reference, inputs, wrt)
    assert got.shape == want.shape
    torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)
    for k, g, w in zip(wrt, grads, wanted):
        torch.testing.assert_close(g, w, rtol=1e-12, atol=1e-12, msg=lambda m, k=k: f"d{k}: {m}")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_triton_in_low_precision_is_as_accurate_as_torch(dtype):
    """Against float64, at a ragged (prime) length: within the differential corpus's bar,
    twice torch's own conv1d error in the same precision plus the roundings the kernel
    adds (test_differential.floor_of, for a product 5 x 4 deep)."""
    from test_differential import floor_of
    x, w = randn(3, 5, 31), randn(7, 5, 4, seed=2)
    want = F.conv1d(x, w)
    scale = want.abs().max()
    got = compiler.compile(CONV1D)(X=x.to(dtype), W=w.to(dtype)).double()
    torch_error = (F.conv1d(x.to(dtype), w.to(dtype)).double() - want).abs().max() / scale
    assert (got - want).abs().max() / scale <= 2 * torch_error + floor_of(dtype, [5 * 4])


@pytest.mark.parametrize("backend", BACKENDS)
def test_extents_are_derived_and_a_window_larger_than_the_input_gives_nothing(backend):
    program = compiler.compile(CONV1D, backend=backend)
    assert program(X=randn(1, 2, 5), W=randn(3, 2, 5)).shape == (1, 3, 1)
    assert program(X=randn(1, 2, 4), W=randn(3, 2, 5)).shape == (1, 3, 0)
    assert program(X=randn(1, 2, 0), W=randn(3, 2, 1)).shape == (1, 3, 0)
    strided = compiler.compile("Y[t] = sum[r](W[r] * X[3*t + r])", backend=backend)
    assert strided(X=randn(11), W=randn(2)).shape == (4,)           # torch: (11 - 2) // 3 + 1
    pool = compiler.compile("P[t] = max[r](X[2*t + r])", backend=backend)
    assert pool.checked.sizes.keys() == {"r"}                         # the window is the call's
    torch.testing.assert_close(pool(X=randn(9), r=3), F.max_pool1d(randn(9)[None], 3, 2)[0])


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_constant_subscript_reads_one_position_and_its_gradient_lands_there(backend):
    x, z = randn(5), randn(4, seed=2)
    upstream = randn(4, seed=1)                       # forward_and_backward's, seed 1
    for position in (3, 7):                           # 7: outside X, read as 0, no gradient
        got, (dx,) = forward_and_backward(f"Y[t] = X[{position}] + Z[t]", {"X": x, "Z": z}, ("X",), backend)
        torch.testing.assert_close(got, (x[position] if position < 5 else 0.0) + z)
        want = torch.where(torch.arange(5) == position, upstream.sum(), 0.0)
        torch.testing.assert_close(dx, want)


@pytest.mark.parametrize("backend", BACKENDS)
def test_an_index_named_only_in_len_is_a_size_of_the_call(backend):
    # what a derived gradient's count of a window reads (dP / len(r)); a tensor's name in len(...)
    # stays an error (test_errors)
    program = compiler.compile("Y[i] = X[i] / len(n)", backend=backend)
    assert program.checked.sizes.keys() == {"n"}
    torch.testing.assert_close(program(X=randn(5), n=4), randn(5) / 4)
    with pytest.raises(BindError, match="missing size 'n'"):
        program(X=randn(5))


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_position_read_in_a_statement_is_derived_once_the_statement_has_its_extent(backend):
    # q's extent follows from H's positions t, themselves derived from X and r: t first
    source = ("H[b, o, t] = relu(sum[c, r](W[o, c, r] * X[b, c, t + r]))\n"
              "dV[p, o, q] = sum[b, u](dY[b, p, u] * H[b, o, u + q])")
    x, w, dy = randn(2, 3, 13), randn(4, 3, 3, seed=2), randn(2, 5, 10, seed=3)
    got = compiler.compile(source, backend=backend, outputs=("dV",))(X=x, W=w, dY=dy)
    h = F.relu(F.conv1d(x, w))                                   # 11 positions: q takes 11 - 10 + 1
    want = torch.einsum("bpu,bouq->poq", dy, h.unfold(2, 2, 1))
    torch.testing.assert_close(got, want)


@pytest.mark.parametrize("backend", BACKENDS)
def test_reads_outside_are_zero_and_nan_stays_where_it_is_read(backend):
    x = torch.tensor([1.0, float("nan"), 3.0, float("inf"), 5.0], dtype=torch.float64)
    shifted = compiler.compile("Y[t] = X[t - 1] + 0 * Z[t]", backend=backend)
    got = shifted(X=x, Z=torch.zeros(5, dtype=torch.float64))
    assert torch.equal(torch.isnan(got), torch.tensor([False, False, True, False, False]))
    assert got[0] == 0 and got[1] == 1 and got[3] == 3 and got[4] == float("inf")
    # a statement read past its extent is 0 as well, whatever its expression gives there
    ones = compiler.compile("S[t] = exp(X[t] * 0)\nY[t] = S[t + 1] + 0 * X[t]", backend=backend)
    torch.testing.assert_close(ones(X=x.nan_to_num(0.0, 0.0)), torch.tensor([1.0, 1, 1, 1, 0], dtype=torch.float64))


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_gradient_through_a_nonlinear_function_is_zero_outside(backend):
    """log's adjoint divides by the value: at the positions no output reads, the
    recomputed value is a read past the edge (0), and its 1 / 0 must not leak."""
    source = "Y[t] = log(sum[r](W[r] * X[t + r]))"
    x, w = randn(9).abs() + 0.5, randn(3, seed=3).abs() + 0.5
    got, (dx,) = forward_and_backward(source, {"X": x, "W": w}, ("X",), backend)
    want, (wanted,) = torch_forward_and_backward(lambda X, W: torch.log(F.conv1d(X[None, None], W[None, None])[0, 0]),
                                                 {"X": x, "W": w}, ("X",))
    torch.testing.assert_close(got, want)
    torch.testing.assert_close(dx, wanted)
    assert torch.isfinite(dx).all()


def test_the_derived_gradient_is_the_transposed_convolution():
    text = format_program(compiler.grad(CONV1D, wrt="X").checked)
    assert "dX[b, c, t_1] = sum[r](where(t_1 - r >= 0 and t_1 - r < len(t), sum[o](dY[b, o, t_1 - r] * W[o, c, r])" \
           in text, text
    # a stride with no coefficient 1 on the position keeps the positions that match
    text = format_program(compiler.grad("Y[t] = X[2*t] * Z[t]", wrt="X").checked)
    assert "where(2 * t == t_1, dY[t] * Z[t], 0.0)" in text, text


def test_canonical_form_prints_and_parses_back():
    source = "Y[b, o, t] = sum[c, r](W[o, c, r] * X[b, c, 2*t + r - 1]) + Z[b, o, t]"
    printed = format_program(compiler.compile(source, backend="reference").checked)
    assert "X[b, c, 2*t + r - 1]" in printed
    again = compiler.compile(printed, backend="reference")
    assert format_program(again.checked) == printed


@pytest.mark.parametrize("source, pointed, words", [
    ("Y[t] = X[t * t]", "t * t", "a product needs one integer factor"),
    ("Y[t] = X[t / 2] * Z[t]", "t / 2", "affine combination"),
    ("Y[t] = X[t + 1.5] * Z[t]", "1.5", "is not an integer"),
    # gathered subscripts (tests/test_gathers.py) beyond what they take
    ("Y[t] = X[L[L[t]]]", "L[t]]]", "not another gather"),
    ("Y[t] = X[L[t] + M[t]]", "L[t] + M[t]", "this one adds 2 tensor reads"),
    ("Y[t] = X[L[t] * L[t]]", "L[t] * L[t]", "a product needs one integer factor"),
    ("Y[t] = where(L[t], X[L[t]], 0)", "L[t], X", "read both as a condition and as a subscript"),
])
def test_a_subscript_beyond_affine_or_gathered_is_an_error_at_it(source, pointed, words):
    with pytest.raises(CheckError) as info:
        compiler.compile(source, backend="reference")
    message = str(info.value)
    assert words in message
    caret_line = message.splitlines()[-1]
    column = caret_line.index("^")
    assert source[column - caret_line.index("|") - 2:].startswith(pointed), message


def test_an_affine_dimension_and_a_plain_one_must_agree():
    program = compiler.compile("Y[t] = X[t + 1] * Z[t] + X[t]", backend="reference")
    with pytest.raises(BindError, match="extent 6 in Z .* but 5 in X|extent 5 in X .* but 6 in Z"):
        program(X=randn(5), Z=randn(6))


def test_sharding_a_windowed_index_is_refused_at_the_read():
    from compiler.passes.shard import shard
    program = compiler.compile("Y[t] = sum[r](W[r] * X[t + r])", backend="reference")
    with pytest.raises(ShardError, match="affine subscript of a sharded index"):
        shard(program.factorised, "r")


def test_sharding_an_index_that_cuts_a_dimension_read_affinely_elsewhere_is_refused():
    # X[m] cuts X's one dimension across the ranks; X[t + 1] would read each rank's part at
    # positions of the whole
    from compiler.passes.shard import shard
    program = compiler.compile("L[t] = X[t + 1] * sum[m](X[m] * W[m])", backend="reference")
    with pytest.raises(ShardError, match=r"'X' is read at an affine subscript of a sharded index or dimension"):
        shard(program.factorised, "m")


@pytest.mark.gpu
@pytest.mark.parametrize("name, source, reference, shapes, sizes", CASES, ids=[c[0] for c in CASES])
def test_matches_torch_on_the_gpu(name, source, reference, shapes, sizes):
    inputs = {k: randn(*shape, seed=k.encode()[0]).float().cuda() for k, shape in shapes.items()}
    wrt = tuple(inputs)
    got, grads = forward_and_backward(source, inputs, wrt, "triton", sizes)
    want, wanted = torch_forward_and_backward(reference, inputs, wrt)
    torch.testing.assert_close(got.double(), want, rtol=1e-4, atol=1e-4)
    for k, g, w in zip(wrt, grads, wanted):
        torch.testing.assert_close(g.double(), w, rtol=1e-4, atol=1e-4, msg=lambda m, k=k: f"d{k}: {m}")
