"""Gathered subscripts (issue 42, item 1): `E[T[i], d]`, `X[i, Y[i]]`, `2*T[i] - 1`
read a tensor at positions an integer input holds, 0 outside it.  An embedding
lookup, a label's logit (cross-entropy with integer targets and ignore_index) and a
paged KV cache read through a block table match torch forward and backward (the
gradient is the scatter: a sum over the positions equal to each row,
deterministic) on the oracle and the Triton backend (the interpreter without a
GPU; GPU-marked cases on the device); errors point at the subscript (the unsupported subscripts' carets:
test_affine_subscripts.py)."""
import re
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
EMBEDDING = "Y[i, d] = E[T[i], d]"
LABELLED_CROSS_ENTROPY = "L[i] = where(Y[i] == -100, 0, logsumexp[c](X[i, c]) - X[i, Y[i]])"
PAGED_ATTENTION = "O[b, i, j] = softmax[p, s](Q[b, i, k] * K[B[b, p], s, k] * scale) * V[B[b, p], s, j]"


def randn(*shape, seed=0, dtype=torch.float64):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed), dtype=torch.float64).to(dtype)


def randint(high, *shape, seed=0):
    return torch.randint(0, high, shape, generator=torch.Generator().manual_seed(seed))


def paged_attention(Q, K, V, B, scale):
    """The dense reference: each sequence's pages in order, then attention over them."""
    b, pages = B.shape
    keys = K[B].reshape(b, pages * K.shape[1], K.shape[2])
    values = V[B].reshape(b, pages * V.shape[1], V.shape[2])
    return torch.softmax(Q @ keys.transpose(1, 2) * scale, dim=-1) @ values


CASES = [
    # (name, source, torch, inputs, wrt)
    ("embedding", EMBEDDING, lambda E, T: F.embedding(T, E),
     lambda: {"E": randn(11, 6), "T": torch.tensor([0, 10, 3, 3, 7, 5, 3])}, ("E",)),
    ("embedding projection", "Y[i, d] = sum[k](E[T[i], k] * W[d, k])", lambda E, T, W: F.embedding(T, E) @ W.T,
     lambda: {"E": randn(13, 5), "T": randint(13, 9, seed=1), "W": randn(7, 5, seed=2)}, ("E", "W")),
    ("cross-entropy with labels", LABELLED_CROSS_ENTROPY, lambda X, Y: F.cross_entropy(X, Y, reduction="none"),
     lambda: {"X": randn(6, 37), "Y": torch.tensor([1, 36, 0, -100, 2, 36])}, ("X",)),
    ("paged attention", PAGED_ATTENTION, paged_attention,
     lambda: {"Q": randn(2, 3, 4), "K": randn(5, 3, 4, seed=1), "V": randn(5, 3, 2, seed=2),
              "B": torch.tensor([[4, 0], [2, 4]]), "scale": 0.5}, ("Q", "K", "V")),
    # two gathered dimensions, a negative factor, ids of rank 0
    ("both dimensions", "Y[i, j] = E[T[i], T[j]]", lambda E, T: E[T][:, T],
     lambda: {"E": randn(5, 5), "T": torch.tensor([1, 4, 2, 1])}, ("E",)),
    ("reversed", "Y[i, d] = E[3 - T[i], d]", lambda E, T: E[3 - T],
     lambda: {"E": randn(5, 3), "T": torch.tensor([0, 3, 1, 1])}, ("E",)),
    ("one id", "Y[d] = E[T[], d]", lambda E, T: E[T], lambda: {"E": randn(5, 3), "T": torch.tensor(3)}, ("E",)),
    # a statement read through a gather (fuse inlines it there), at a shifted position and a scaled one
    ("statement at shifted positions", "H[v, d] = E[v, d] * S[v]\nY[i, d] = H[T[i], d] + H[2*T[i] - 1, d]",
     lambda E, S, T: _shifted(E * S[:, None], T),
     lambda: {"E": randn(11, 3), "S": randn(11, seed=1), "T": torch.tensor([0, 10, 3, 5, 6, 1])}, ("E", "S")),
]


def _shifted(H, T):
    def read(t):
        inside = (t >= 0) & (t < H.shape[0])
        return torch.where(inside[:, None], H[t.clamp(0, H.shape[0] - 1)], 0)
    return read(T) + read(2 * T - 1)


def run(source, inputs, wrt, backend, device="cpu", dtype=torch.float64, seed=1):
    """(output, gradients) of `source` under torch autograd on `backend`."""
    program = compiler.compile(source, backend=backend)
    leaves = {k: (v.to(device, dtype if v.is_floating_point() else v.dtype, copy=True).requires_grad_(k in wrt)
                  if isinstance(v, torch.Tensor) else v) for k, v in inputs.items()}
    out = program(**leaves)
    out.backward(randn(*out.shape, seed=seed, dtype=out.dtype).to(out.device))
    return out, [leaves[k].grad for k in wrt]


def torch_run(fn, inputs, wrt, seed=1):
    leaves = {k: (v.clone().requires_grad_(k in wrt) if isinstance(v, torch.Tensor) else v) for k, v in inputs.items()}
    out = fn(**leaves)
    out.backward(randn(*out.shape, seed=seed))
    return out, [leaves[k].grad for k in wrt]


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("name, source, reference, make, wrt", CASES, ids=[c[0] for c in CASES])
def test_matches_torch_forward_and_backward(name, source, reference, make, wrt, backend):
    inputs = make()
    got, grads = run(source, inputs, wrt, backend)
    want, wanted = torch_run(reference, inputs, wrt)
    torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-10)
    for k, g, w in zip(wrt, grads, wanted):
        torch.testing.assert_close(g, w, rtol=1e-10, atol=1e-10, msg=lambda m, k=k: f"d{k}: {m}")


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("rows", [0, 1, 7])
def test_ragged_rows_and_positions_outside_read_zero(backend, rows):
    # negative positions and ones past the table read 0, as an affine subscript outside does
    E = randn(5, 3)
    T = torch.tensor([-1, 5, 4, 0, 99, -100, 2])[:rows]
    got = compiler.compile(EMBEDDING, backend=backend)(E=E, T=T)
    want = torch.where(((T >= 0) & (T < 5))[:, None], E[T.clamp(0, 4)], 0)
    assert got.shape == (rows, 3)
    torch.testing.assert_close(got, want, rtol=0, atol=0)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("positions", [11, 32])
def test_the_scatter_runs_over_sorted_positions_and_skips_those_outside(backend, positions):
    # the Triton gradient visits the positions in the order of their values (a sorted loop), each
    # row of dE the range holding its id; ids outside the table reach no row.  32 positions: a
    # multiple of the loop's tile, whose masks (the range's end, not the extent's) must stay
    T = torch.tensor([5, -1, 4, 0, 99, 2, 2, 4, 4, -100, 3] * 3)[:positions]
    E = randn(6, 3)
    got, (dE,) = run(EMBEDDING, {"E": E, "T": T}, ("E",), backend)
    want = torch.zeros(6, 3, dtype=torch.float64)
    inside = (T >= 0) & (T < 6)
    want.index_add_(0, T[inside], randn(positions, 3, seed=1)[inside])
    torch.testing.assert_close(dE, want, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("shape", [(3, 7), (2, 16), (2, 3, 5)])
def test_ids_over_several_indices_sort_each_row(shape):
    # E[T[b, t], d]: the scatter's loop visits t sorted within each row b (the rows one at a time)
    indices = "abt"[-len(shape):]
    source = f"X[{', '.join(indices)}, d] = E[T[{', '.join(indices)}], d]"
    T = torch.tensor([5, -1, 4, 0, 99, 2, 2, 4, 4, -100, 3] * 3)[:torch.Size(shape).numel()].reshape(shape)
    got, (dE,) = run(source, {"E": randn(6, 3), "T": T}, ("E",), "triton")
    upstream = randn(*shape, 3, seed=1)
    inside = (T >= 0) & (T < 6)
    want = torch.zeros(6, 3, dtype=torch.float64).index_add_(0, T[inside], upstream[inside])
    torch.testing.assert_close(dE, want, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("dtype", [torch.int32, torch.int16, torch.uint8])
def test_positions_of_any_integer_dtype(dtype):
    E = randn(7, 4)
    T = torch.tensor([6, 0, 3], dtype=dtype)
    got = compiler.compile(EMBEDDING)(E=E, T=T)
    torch.testing.assert_close(got, E[T.long()], rtol=0, atol=0)


def test_checked_mode_names_the_position_outside(monkeypatch):
    program = compiler.compile("Y[i, d] = E[T[i] + 1, d]", backend="reference")
    E = randn(7, 3)
    program(E=E, T=torch.tensor([0, 6]))         # unchecked: the position 7 reads 0
    monkeypatch.setenv("EINFOLD_CHECK_POSITIONS", "1")
    program(E=E, T=torch.tensor([0, 5]))         # every position inside: runs
    with pytest.raises(BindError, match=r"subscript 'T\[i\] \+ 1' of E reads position 7, outside its dimension 0 "
                                        r"of extent 7") as info:
        program(E=E, T=torch.tensor([0, 6]))     # the cached runner binds nothing, the check still runs
    assert info.value.span is not None


def test_a_float_tensor_of_positions_is_a_bind_error():
    program = compiler.compile(EMBEDDING, backend="reference")
    with pytest.raises(BindError, match=r"input 'T' is read as a subscript, so holds integer positions, but the "
                                        r"call passes a torch.float32 tensor; pass an integer tensor \(T.long\(\)\)"):
        program(E=randn(5, 3), T=torch.tensor([0.0, 1.0]))


def test_positions_have_no_gradient_and_default_wrt_leaves_them_out():
    backward = compiler.grad(EMBEDDING, backend="reference")       # wrt every input of numbers: E alone
    dE = backward(E=randn(5, 3), T=torch.tensor([1, 1, 4]), dY=torch.ones(3, 3, dtype=torch.float64))
    torch.testing.assert_close(dE, torch.tensor([0, 2, 0, 0, 1], dtype=torch.float64)[:, None].expand(5, 3))
    with pytest.raises(CheckError, match="cannot differentiate with respect to 'T': it is an integer tensor"):
        compiler.grad(EMBEDDING, wrt=["E", "T"], backend="reference")


def test_the_gradient_is_the_scatter_as_a_sum_over_equal_positions():
    text = format_program(compiler.grad(EMBEDDING, backend="reference").checked)
    assert "sum[i](where(T[i] == " in text, text


def test_canonical_form_prints_and_parses_back():
    source = "Y[b, i, d] = E[2*T[b, i + 1] - 1, d] + X[b, Y2[i]]"
    printed = format_program(compiler.compile(source, backend="reference").checked)
    assert "E[2*T[b, i + 1] - 1, d]" in printed and "X[b, Y2[i]]" in printed
    again = compiler.compile(printed, backend="reference")
    assert format_program(again.checked) == printed


def test_vmap_batches_the_positions_the_table_or_both():
    program = compiler.compile(EMBEDDING)
    E, T = randn(11, 6), randint(11, 3, 5)
    tables = randn(3, 11, 6, seed=1)
    torch.testing.assert_close(torch.vmap(lambda t: program(E=E, T=t))(T), E[T])
    torch.testing.assert_close(torch.vmap(lambda e, t: program(E=e, T=t))(tables, T),
                               torch.stack([tables[b][T[b]] for b in range(3)]))
    torch.testing.assert_close(torch.vmap(lambda e: program(E=e, T=T[0]))(tables),
                               torch.stack([tables[b][T[0]] for b in range(3)]))
    # ids of rank 0 batched: the gather's layout gains its first dimension
    one = compiler.compile("Y[d] = E[T[], d]")
    torch.testing.assert_close(torch.vmap(lambda t: one(E=E, T=t))(T[0]), E[T[0]])


def test_a_statement_of_positions_is_an_error_at_its_read():
    source = "S[i] = X[i]\nY[i, d] = E[S[i], d]"
    with pytest.raises(CheckError, match="a gathered subscript reads an integer input, and 'S' is a statement"):
        compiler.compile(source, backend="reference")


@pytest.mark.parametrize("source, words", [
    ("H[v, w] = A[v + w]\nY[i] = H[T[i], U[i]]", "reading H at T[i], U[i] would gather twice in one subscript"),
    ("H[v] = A[P[v]]\nY[i] = H[T[i]]", "reading H at T[i] would make a gathered subscript read through another"),
])
def test_a_statement_that_cannot_be_read_through_a_gather_is_an_error_at_the_read(source, words):
    # fuse inlines H into its reader, composing the subscripts: these compositions have no gather
    with pytest.raises(CheckError, match=re.escape(words)) as info:
        compiler.compile(source, backend="reference")
    assert info.value.span is not None and "Y[i] = H[T[i]" in str(info.value)


def test_sharding_a_gathered_read_is_refused_at_it():
    from compiler.passes.shard import shard
    program = compiler.compile("L[i] = logsumexp[c](X[i, c]) - X[i, Y[i]]", backend="reference")
    with pytest.raises(ShardError, match="gathered subscript"):
        shard(program.factorised, "c")


@pytest.mark.gpu
@pytest.mark.parametrize("name, source, reference, make, wrt", CASES, ids=[c[0] for c in CASES])
def test_matches_torch_on_the_gpu(name, source, reference, make, wrt):
    inputs = make()
    got, grads = run(source, inputs, wrt, "triton", device="cuda", dtype=torch.float32)
    want, wanted = torch_run(reference, inputs, wrt)
    torch.testing.assert_close(got.double().cpu(), want, rtol=1e-4, atol=1e-4)
    for k, g, w in zip(wrt, grads, wanted):
        torch.testing.assert_close(g.double().cpu(), w, rtol=1e-4, atol=1e-4, msg=lambda m, k=k: f"d{k}: {m}")


@pytest.mark.gpu
def test_a_large_labelled_cross_entropy_in_bfloat16_on_the_gpu():
    # classes past 256, which a label cast to bf16 would round
    X = randn(64, 1000, seed=3).to("cuda", torch.bfloat16)
    Y = randint(1000, 64, seed=4).cuda()
    Y[::7] = -100
    got = compiler.compile(LABELLED_CROSS_ENTROPY)(X=X, Y=Y)
    want = F.cross_entropy(X.double(), Y, reduction="none")
    torch.testing.assert_close(got.double(), want, rtol=2e-2, atol=2e-2)
