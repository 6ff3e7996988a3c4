"""Squared distances as contractions (issue 41, item 2; compiler/passes/contract.py):
`sum[k]((a - b) ** 2)` between two sides that each vary over an index the other
lacks is the sides' norms and one contraction (a tl.dot), clamped at 0.  The
rewrite's error is bounded by about len(k) * u * (|a|^2 + |b|^2), torch.cdist's,
and these tests hold the backend to that bound against float64, with gradients,
coincident points, points far from the origin and 16-bit inputs (where the
expansion is the more accurate spelling than torch's own)."""
import re
import warnings

import pytest
import torch

import compiler
from compiler.parse import parse
from compiler.check import check
from compiler.ir import format_program
from compiler.passes import run_pipeline

pytestmark = pytest.mark.usefixtures("private_cache")
warnings.filterwarnings("ignore", message="einfold: no CUDA tensors", category=RuntimeWarning)

CHAMFER = "C[b,i] = min[m](sum[k]((X[b,i,k] - Y[b,m,k]) ** 2))"
KMEANS = "A[i] = argmin[c](sum[k]((X[i,k] - M[c,k]) ** 2), c)"
U32 = 2.0 ** -24


def contracted(source: str) -> str:
    return format_program(run_pipeline(check(parse(source)), stop_after="contract")).strip()


def test_a_squared_distance_is_norms_and_a_contraction_clamped_at_zero():
    assert contracted(CHAMFER) == (
        "C[b, i] = min[m](max(0.0, sum[k](X[b, i, k] * X[b, i, k]) + sum[k](Y[b, m, k] * Y[b, m, k]) "
        "- 2 * sum[k](X[b, i, k] * Y[b, m, k])))")


@pytest.mark.parametrize("spelling", [
    "C[b,i] = min[m](sum[k]((Y[b,m,k] - X[b,i,k]) ** 2))",
    "C[b,i] = min[m](sum[k]((X[b,i,k] - Y[b,m,k]) * (X[b,i,k] - Y[b,m,k])))",
    "C[b,i] = min[m](sum[k]((-Y[b,m,k] + X[b,i,k]) ** 2))",
])
def test_every_spelling_of_the_square_contracts_alike(spelling):
    assert contracted(spelling) == contracted(CHAMFER)


def test_spellings_and_renamed_indices_of_a_distance_get_one_specialised_schedule():
    # equal programs, one plan: the square's spellings and any names of the bound indices (the
    # printed schedule names them as written: named back to m and k, the schedules are one)
    shapes = {"X": (2, 300, 64), "Y": (2, 500, 64)}
    schedules = set()
    for source, names in ((CHAMFER, {}),
                          ("C[b,i] = min[j](sum[d]((Y[b,j,d] - X[b,i,d]) * (Y[b,j,d] - X[b,i,d])))",
                           {"j": "m", "d": "k"}),
                          ("C[b,i] = min[n](sum[c]((-Y[b,n,c] + X[b,i,c]) ** 2))", {"n": "m", "c": "k"})):
        program = compiler.compile(source, backend="triton")
        binding = program.binder({k: torch.zeros(1, 1, 1).expand(*v) for k, v in shapes.items()})
        # (the first line lists the extents sorted by their names)
        text = str(program.backend.specialised_for(binding, sm_count=132, arch=90)).split("\n", 1)[1]
        schedules.add(re.sub(r"\b[a-z]\b", lambda x: names.get(x.group(), x.group()), text))
    (schedule,) = schedules
    assert "float32 tl.dot: three TF32 products" in schedule


def test_a_weight_on_one_side_stays_in_each_term_and_a_sum_of_sides_adds_the_cross_term():
    # a diagonal Gaussian's weighted distance: the weight is on the centres' side, no clamp
    # (a weight of either sign could make the sum negative)
    assert contracted("L[n] = logsumexp[c](-sum[d](IV[c,d] * (X[n,d] - MU[c,d]) ** 2))") == (
        "L[n] = log(sum[c](exp(-(sum[d](IV[c, d] * MU[c, d] * MU[c, d]) + sum[d](IV[c, d] * X[n, d] * X[n, d]) "
        "- 2 * sum[d](IV[c, d] * MU[c, d] * X[n, d])))))")
    assert contracted("C[i,m] = sum[k]((X[i,k] + Y[m,k]) ** 2)") == (
        "C[i, m] = max(0.0, 2 * sum[k](X[i, k] * Y[m, k]) + sum[k](X[i, k] * X[i, k]) + sum[k](Y[m, k] * Y[m, k]))")


def test_a_weighted_difference_of_the_two_sides_is_distributed_into_a_contraction():
    # the gradient of a distance: undistributed, (X - Y) spans both sides and no factor is a matrix
    assert contracted("D[i,k] = sum[m](G[i,m] * (X[i,k] - Y[m,k]))") == (
        "D[i, k] = sum[m](G[i, m] * X[i, k]) - sum[m](G[i, m] * Y[m, k])")
    # a difference on one side is already a contraction's operand: attention's dS (dP - D) stays whole
    assert contracted("D[i,k] = sum[m](P[i,m] * (Q[i,m] - R[i]) * K[m,k])") == (
        "D[i, k] = sum[m](K[m, k] * P[i, m] * (Q[i, m] - R[i]))")
    text = compiler.grad(CHAMFER, wrt=["X"]).source
    assert "sum[m](" in text and "(X[b, i, k] - Y[b, m, k])" in text    # the gradient as derived ...
    grad = compiler.grad(CHAMFER, wrt=["X"], backend="triton")
    factorised = format_program(grad.factorised)
    assert "2 * X[b, i, k] * sum[m](where(" in factorised and "2 * sum[m](Y[b, m, k] * where(" in factorised


@pytest.mark.parametrize("source", [
    "V[i] = sum[k]((X[i,k] - Y[i,k]) ** 2)",              # both sides over i: no matrix product to gain
    "V[i] = sum[k]((X[i,k] - Y[k]) ** 2)",                # one side only
    "V[i] = sum[k]((X[i,k] - mean[k](X[i,k])) ** 2)",     # a variance: its cancellation would be the value
    "C[i,m] = sum[k](W[i,m,k] * (X[i,k] - Y[m,k]) ** 2)",  # a weight over both sides: no contraction
    "C[i,m] = sum[k]((X[i,k] - Y[m,k]) ** 3)",            # not a square
    "C[i,m] = sum[k]((X[i,k] - Y[m,k] + Z[k]) ** 2)",     # three terms
    "C[i,m] = sum[k]((X[i,k] - Y[m]) ** 2)",              # Y does not vary over k
])
def test_what_is_not_a_distance_between_two_sides_stays_direct(source):
    assert contracted(source) == format_program(run_pipeline(check(parse(source)), stop_after="canonicalise")).strip()


def test_explain_says_what_was_contracted_and_its_error_bound():
    text = compiler.compile(CHAMFER).explain()
    assert "after contract:" in text
    assert ("sum[k]((X[b, i, k] - Y[b, m, k]) ** 2): the sides' squared norms and a contraction over k "
            "(tensor cores), clamped at 0; absolute error up to about len(k) * u * (the sides' squared norms), "
            "torch.cdist's") in text


def pairwise(x, y):
    return ((x[..., :, None, :] - y[..., None, :, :]) ** 2).sum(-1)


def bound(x, y):
    """The expansion's error bound for the minimum over y of each x's distance."""
    k = x.shape[-1]
    return 2 * (k + 3) * U32 * (x.square().sum(-1) + y.square().sum(-1).amax(-1, keepdim=True))


def run(source, device="cpu", dtype=torch.float32, **inputs):
    program = compiler.compile(source, backend="triton")
    return program(**{k: v.to(device, dtype) for k, v in inputs.items()})


@pytest.mark.parametrize("offset", [0.0, 30.0])
def test_the_minimum_is_within_the_stated_bound_of_float64(offset):
    # points far from the origin lose to cancellation what their norms say, and no more
    g = torch.Generator().manual_seed(0)
    x = torch.randn(2, 37, 19, generator=g, dtype=torch.float64) + offset
    y = torch.randn(2, 53, 19, generator=g, dtype=torch.float64) + offset
    got = run(CHAMFER, X=x, Y=y).double()
    want = pairwise(x, y).amin(-1)
    assert ((got - want).abs() <= bound(x, y)).all()


def test_coincident_points_are_at_distance_zero_and_their_square_root_is_not_nan():
    g = torch.Generator().manual_seed(1)
    y = torch.randn(1, 29, 7, generator=g, dtype=torch.float64) * 10
    x = y[:, [3, 17, 17, 28]]
    got = run("D[b,i] = min[m](sqrt(sum[k]((X[b,i,k] - Y[b,m,k]) ** 2)))", X=x, Y=y)
    assert not got.isnan().any() and (got >= 0).all()
    assert (got.double() <= bound(x, y).sqrt()).all()


def test_the_gradient_of_the_minimum_matches_float64():
    g = torch.Generator().manual_seed(2)
    x = torch.randn(2, 23, 5, generator=g, dtype=torch.float64)
    y = torch.randn(2, 31, 5, generator=g, dtype=torch.float64)
    xs, ys = x.float().requires_grad_(), y.float().requires_grad_()
    compiler.compile(CHAMFER, backend="triton")(X=xs, Y=ys).sum().backward()
    x64, y64 = x.clone().requires_grad_(), y.clone().requires_grad_()
    pairwise(x64, y64).amin(-1).sum().backward()
    torch.testing.assert_close(xs.grad.double(), x64.grad, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(ys.grad.double(), y64.grad, rtol=1e-5, atol=1e-5)


def test_an_assignment_picks_a_nearest_centre_up_to_ties_within_the_bound():
    g = torch.Generator().manual_seed(3)
    x = torch.randn(200, 16, generator=g, dtype=torch.float64)
    centres = torch.randn(24, 16, generator=g, dtype=torch.float64)
    got = run(KMEANS, X=x, M=centres)
    assert got.dtype == torch.int64
    d = pairwise(x, centres)
    chosen = d.gather(1, got[:, None])[:, 0]
    assert (chosen - d.amin(1) <= 2 * bound(x, centres)).all()


def test_16_bit_points_are_no_less_accurate_than_torchs_own_spelling():
    # torch rounds each difference and square to bfloat16; the contraction's products are exact
    g = torch.Generator().manual_seed(4)
    x = torch.randn(2, 40, 32, generator=g, dtype=torch.float64).bfloat16()
    y = torch.randn(2, 50, 32, generator=g, dtype=torch.float64).bfloat16()
    want = pairwise(x.double(), y.double()).amin(-1)
    torch_error = (pairwise(x, y).amin(-1).double() - want).norm() / want.norm()
    got = run(CHAMFER, dtype=torch.bfloat16, X=x, Y=y)
    assert got.dtype == torch.bfloat16
    assert (got.double() - want).norm() / want.norm() <= 2 * torch_error


@pytest.mark.gpu
@pytest.mark.parametrize("k", [3, 64])
def test_on_the_gpu_the_minimum_and_its_gradient_hold_the_bound(k):
    # IEEE products at depth 3, three TF32 products at 64 (ConcreteKernel.dot_precision)
    g = torch.Generator().manual_seed(5)
    x = torch.randn(1, 700, k, generator=g, dtype=torch.float64)
    y = torch.randn(1, 900, k, generator=g, dtype=torch.float64)
    xs, ys = x.float().cuda().requires_grad_(), y.float().cuda().requires_grad_()
    got = compiler.compile(CHAMFER)(X=xs, Y=ys)
    want = pairwise(x, y).amin(-1)
    assert ((got.double().cpu() - want).abs() <= bound(x, y)).all()
    got.sum().backward()
    x64, y64 = x.clone().requires_grad_(), y.clone().requires_grad_()
    pairwise(x64, y64).amin(-1).sum().backward()
    torch.testing.assert_close(xs.grad.double().cpu(), x64.grad, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(ys.grad.double().cpu(), y64.grad, rtol=1e-4, atol=1e-4)


@pytest.mark.gpu
def test_on_the_gpu_an_assignment_picks_a_nearest_centre():
    g = torch.Generator().manual_seed(6)
    x = torch.randn(20000, 64, generator=g, dtype=torch.float64)
    centres = torch.randn(300, 64, generator=g, dtype=torch.float64)
    got = compiler.compile(KMEANS)(X=x.float().cuda(), M=centres.float().cuda()).cpu()
    d = pairwise(x, centres)
    chosen = d.gather(1, got[:, None])[:, 0]
    assert (chosen - d.amin(1) <= 2 * bound(x, centres)).all()
