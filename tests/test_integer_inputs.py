"""Integer and bool tensor inputs, and integer results (issue 42, item 1), on the
reference oracle and the Triton backend (under the interpreter without a GPU):
labels compare exactly with an index, bool masks select, argmax's position is an
int64, and gradients flow to the float inputs only."""
import warnings

import pytest
import torch
import torch.nn.functional as F

import compiler
from compiler import BindError, CheckError

pytestmark = pytest.mark.usefixtures("private_cache")
warnings.filterwarnings("ignore", message="einfold: no CUDA tensors", category=RuntimeWarning)

BACKENDS = ["reference", "triton"]
CROSS_ENTROPY = "L[i] = logsumexp[c](X[i, c]) - sum[c](where(c == Y[i], X[i, c], 0))"
# torch's ignore_index=-100: an ignored row's loss is 0
IGNORING = "L[i] = where(Y[i] == -100, 0, logsumexp[c](X[i, c]) - sum[c](where(c == Y[i], X[i, c], 0)))"


def logits_and_labels(dtype, rows=5, classes=300, seed=0):
    """Logits over 300 classes and labels past 256, where a bf16 label would round."""
    g = torch.Generator().manual_seed(seed)
    x = (3 * torch.randn(rows, classes, generator=g, dtype=torch.float64)).to(dtype)
    y = torch.tensor([257, 299, 3, 511 % classes, 258])[:rows]
    return x, y


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.bfloat16])
def test_cross_entropy_with_int64_labels_matches_torch(backend, dtype):
    x, y = logits_and_labels(dtype)
    out = compiler.compile(CROSS_ENTROPY, backend=backend)(X=x, Y=y)
    assert out.dtype == dtype                       # the labels do not set the float dtype
    want = F.cross_entropy(x.double(), y, reduction="none")     # the exact loss of these logits
    tolerance = {torch.float64: 1e-12, torch.float32: 1e-5, torch.bfloat16: 2e-2}[dtype]
    # labels 257 and 258 read as bf16 would pick the logits of 256 and 258: off by ~4
    torch.testing.assert_close(out.double(), want, rtol=tolerance, atol=tolerance)


@pytest.mark.parametrize("backend", BACKENDS)
def test_cross_entropy_with_int32_labels(backend):
    x, y = logits_and_labels(torch.float32)
    out = compiler.compile(CROSS_ENTROPY, backend=backend)(X=x, Y=y.int())
    torch.testing.assert_close(out, F.cross_entropy(x, y.long(), reduction="none"))


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_cross_entropy_ignores_label_minus_100_and_its_gradient_matches_autograd(backend, dtype):
    x, y = logits_and_labels(dtype)
    y[1] = -100
    loss = compiler.compile(IGNORING, backend=backend)
    mine = x.clone().requires_grad_()
    out = loss(X=mine, Y=y)
    theirs = x.clone().requires_grad_()
    want = F.cross_entropy(theirs, y, reduction="none")
    torch.testing.assert_close(out, want)
    weights = torch.arange(1.0, 6.0, dtype=dtype)       # a different upstream gradient per row
    (out * weights).sum().backward()
    (want * weights).sum().backward()
    torch.testing.assert_close(mine.grad, theirs.grad)
    assert mine.grad[1].abs().sum() == 0


@pytest.mark.parametrize("backend", BACKENDS)
def test_derived_gradient_reads_integer_labels(backend):
    x, y = logits_and_labels(torch.float64)
    backward = compiler.grad(CROSS_ENTROPY, wrt=("X",), backend=backend)
    dL = torch.linspace(0.5, 2.0, 5, dtype=torch.float64)
    dX = backward(X=x, Y=y, dL=dL)
    theirs = x.clone().requires_grad_()
    (F.cross_entropy(theirs, y, reduction="none") * dL).sum().backward()
    torch.testing.assert_close(dX, theirs.grad)


@pytest.mark.parametrize("backend", BACKENDS)
def test_bf16_logits_with_labels_past_256_backward(backend):
    x, y = logits_and_labels(torch.bfloat16)
    mine = x.clone().requires_grad_()
    compiler.compile(CROSS_ENTROPY, backend=backend)(X=mine, Y=y).sum().backward()
    theirs = x.double().requires_grad_()
    F.cross_entropy(theirs, y, reduction="sum").backward()
    assert mine.grad.dtype == torch.bfloat16
    # the -1 of the label's class lands on class 257, not on bf16's 256
    torch.testing.assert_close(mine.grad.double(), theirs.grad, rtol=2e-2, atol=1e-2)


@pytest.mark.parametrize("backend", BACKENDS)
def test_integer_comparison_is_exact_past_float_precision(backend):
    # 2**24 + 1 has no float32, 2**53 + 1 no float64: a comparison through a float would match both
    p = compiler.compile("B[i] = where(Y[i] == 16777217, 1, 0) + where(Y[i] == 9007199254740993, 10, 0)",
                         backend=backend)
    y = torch.tensor([16777216, 16777217, 9007199254740992, 9007199254740993])
    out = p(Y=y)
    assert out.dtype == torch.int64
    assert out.tolist() == [0, 1, 0, 10]


@pytest.mark.parametrize("backend", BACKENDS)
def test_an_input_changing_dtype_between_calls(backend):
    p = compiler.compile("Z[i] = Y[i] + 1\nB[i] = where(Y[i] == 4294967297, 1, 0)", backend=backend)
    z, b = p(Y=torch.tensor([1.5, 4294967297.0], dtype=torch.float64))
    assert z.dtype == torch.float64 and z.tolist() == [2.5, 4294967298.0] and b.tolist() == [0, 1]
    z, b = p(Y=torch.tensor([3, 4294967297]))                   # int64: integer arithmetic
    assert z.dtype == torch.int64 and z.tolist() == [4, 4294967298] and b.tolist() == [0, 1]
    z, b = p(Y=torch.tensor([3, 1], dtype=torch.int32))         # int32 kernels of their own
    assert z.dtype == torch.int64 and z.tolist() == [4, 2] and b.tolist() == [0, 0]
    z, b = p(Y=torch.tensor([1.5, 2.0]))                        # and float again
    assert z.dtype == torch.float32 and z.tolist() == [2.5, 3.0] and b.tolist() == [0, 0]


@pytest.mark.parametrize("backend", BACKENDS)
def test_integers_mixed_with_floats_promote_and_fold_exactly(backend):
    p = compiler.compile("S[i] = sum[j](Y[i, j])\nW[i] = sum[j](Y[i, j] * X[i, j])", backend=backend)
    y = torch.tensor([[200, 250, 255], [1, 2, 3]], dtype=torch.uint8)
    x = torch.tensor([[0.5, 1.0, 2.0], [1.0, 1.0, 1.0]], dtype=torch.float16)
    s, w = p(Y=y, X=x)
    assert s.dtype == torch.int64 and s.tolist() == [705, 6]          # no uint8 wrap-around
    assert w.dtype == torch.float16 and w.tolist() == [860.0, 6.0]
    only_integers = compiler.compile("H[i] = Y[i] * 0.5", backend=backend)(Y=torch.tensor([3, 4]))
    assert only_integers.dtype == torch.float32 and only_integers.tolist() == [1.5, 2.0]


@pytest.mark.parametrize("backend", BACKENDS)
def test_bool_mask_in_where_and_logic(backend):
    g = torch.Generator().manual_seed(1)
    x = torch.randn(6, generator=g)
    m = torch.tensor([True, False, True, True, False, False])
    out = compiler.compile("O[i] = where(M[i] and not (X[i] < 0), X[i], 0.0)", backend=backend)(M=m, X=x)
    torch.testing.assert_close(out, torch.where(m & (x >= 0), x, 0.0))


@pytest.mark.parametrize("backend", BACKENDS)
def test_bool_mask_under_a_softmax_matches_masked_attention(backend):
    g = torch.Generator().manual_seed(2)
    q, k, v = torch.randn(5, 4, generator=g), torch.randn(7, 4, generator=g), torch.randn(7, 3, generator=g)
    mask = torch.rand(5, 7, generator=g) > 0.4
    mask[:, 0] = True                                   # every row keeps a key
    attention = compiler.compile("O[i, j] = softmax[m](where(M[i, m], Q[i, k] * K[m, k], -inf)) * V[m, j]",
                                 backend=backend)
    want = F.scaled_dot_product_attention(q[None], k[None], v[None], attn_mask=mask[None], scale=1.0)[0]
    torch.testing.assert_close(attention(Q=q, K=k, V=v, M=mask), want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("name, torch_fn", [("argmax", torch.argmax), ("argmin", torch.argmin)])
def test_argmax_and_argmin_positions_are_int64_like_torch(backend, name, torch_fn):
    g = torch.Generator().manual_seed(3)
    x = torch.randint(-2, 3, (6, 9), generator=g).float()      # small integers: many ties
    x[4] = 1.0                                                   # a row of ties: the first position
    out = compiler.compile(f"I[i] = {name}[j](X[i, j], j)", backend=backend)(X=x)
    assert out.dtype == torch.int64
    assert torch.equal(out, torch_fn(x, dim=1))


@pytest.mark.parametrize("backend", BACKENDS)
def test_argmax_of_logits_beside_integer_labels_counts_hits(backend):
    x, y = logits_and_labels(torch.float32)
    y[2] = int(x[2].argmax())
    hits = compiler.compile("H[] = sum[i](where(argmax[c](X[i, c], c) == Y[i], 1, 0))", backend=backend)(X=x, Y=y)
    assert hits.dtype == torch.int64 and hits.item() == int((x.argmax(dim=1) == y).sum())


def test_a_float_tensor_for_an_input_read_as_a_condition():
    p = compiler.compile("O[i] = where(M[i], X[i], 0.0)", backend="reference")
    with pytest.raises(BindError, match=r"input 'M' is read as a condition .* takes a bool tensor, "
                                        r"not a torch.int64 tensor") as caught:
        p(M=torch.tensor([1, 0]), X=torch.randn(2))
    span = caught.value.span
    assert p.text[span.start:span.end] == "M[i]"


def test_a_bool_tensor_read_as_a_number():
    p = compiler.compile("O[i] = M[i] * X[i]", backend="reference")
    with pytest.raises(BindError, match=r"input 'M' is a bool tensor but the program reads it as a number"):
        p(M=torch.tensor([True, False]), X=torch.randn(2))


@pytest.mark.parametrize("dtype", [torch.complex64, torch.uint32])
def test_an_unsupported_dtype_names_the_input(dtype):
    p = compiler.compile(CROSS_ENTROPY, backend="reference")
    with pytest.raises(BindError, match=rf"input 'Y' has dtype {dtype}; einfold takes float16, bfloat16, float32, "
                                        rf"float64, integer \(int8, int16, int32, int64, uint8\) or bool tensors"):
        p(X=torch.randn(2, 3), Y=torch.zeros(2, dtype=dtype))


def test_no_gradient_with_respect_to_an_integer_input():
    backward = compiler.grad(CROSS_ENTROPY, backend="reference")       # wrt every tensor input: X and Y
    x, y = logits_and_labels(torch.float64)
    with pytest.raises(BindError, match=r"input 'Y' is an integer tensor, which has no gradient"):
        backward(X=x, Y=y, dL=torch.ones(5, dtype=torch.float64))
    dX, dY = backward(X=x, Y=y.double(), dL=torch.ones(5, dtype=torch.float64))    # float labels: a gradient
    assert dY.abs().sum() == 0


def test_no_gradient_with_respect_to_an_input_read_as_a_condition():
    source = "O[i] = where(M[i], X[i], 0.0)"
    assert compiler.grad(source, backend="reference").wrt == ("X",)
    with pytest.raises(CheckError, match=r"cannot differentiate with respect to 'M': it holds bools"):
        compiler.grad(source, wrt=("M",), backend="reference")


def test_an_integer_matrix_in_a_half_precision_product_stays_exact():
    # a tl.dot takes its operands in the stored dtype of its loaded matrices (bfloat16 x
    # bfloat16 on tensor cores); an integer matrix beside a bfloat16 one was converted to
    # bfloat16, rounding every count past 256 (the GPU's module, built here: nothing runs)
    program = compiler.compile("Y[i,j] = sum[c](X[i,c] * N[c,j])", backend="triton")
    inputs = {"X": torch.randn(256, 128, dtype=torch.bfloat16), "N": torch.randint(0, 1000, (128, 256))}
    typed, binding = program._typed(inputs)
    module = typed.backend.source_for(binding, sm_count=132)
    assert "tl.dot(" in module and ".to(tl.bfloat16)" not in module
    assert 'input_precision="tf32x3"' in module                  # float32 operands, not TF32
    both = {"X": inputs["X"], "N": inputs["N"].bfloat16()}            # a bfloat16 N: a bfloat16 dot
    assert "input_precision" not in program.backend.source_for(program.binder(both), sm_count=132)
