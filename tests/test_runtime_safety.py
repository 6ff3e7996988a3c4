"""Runtime safety: what a call reads (lazily negated views, complex, sparse and
absurdly large inputs), what it returns (never the caller's memory), the oracle's
integer and NaN semantics (torch's), torch's transforms over a program
(forward-mode AD, torch.func, vmap, TorchScript), pickling and torch.compile.
Each test is the regression test of a measured failure."""
import gc
import os
import pickle
import subprocess
import sys
import warnings

import pytest
import torch
import torch.autograd.forward_ad as forward_ad

import compiler
from compiler.errors import BindError, TransformError

pytestmark = [pytest.mark.filterwarnings("ignore:einfold. no CUDA tensors"),
              pytest.mark.usefixtures("private_cache")]

BACKENDS = ["reference", "triton"]
DTYPE = {"reference": torch.float64, "triton": torch.float32}
DEVICE = {"reference": "cpu", "triton": "cuda" if torch.cuda.is_available() else "cpu"}
TOL = {"reference": {"rtol": 1e-9, "atol": 1e-9}, "triton": {"rtol": 1e-4, "atol": 1e-4}}
ATTENTION = "O[i,j] = softmax[m](Q[i,k] * K[m,k] * s) * V[m,j]"
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def attention(q, k, v, s=0.5):
    return torch.softmax(q @ k.T * s, -1) @ v


def qkv(backend, *batch):
    torch.manual_seed(0)
    return tuple(torch.randn(*batch, 3, 4, dtype=DTYPE[backend], device=DEVICE[backend]) for _ in range(3))


# ---------------------------------------------------------------- what a call reads
@pytest.mark.parametrize("backend", BACKENDS)
def test_a_negated_view_is_read_as_its_values(backend):
    # x.conj().imag is -imag as a bit beside the memory: kernels read the memory
    program = compiler.compile("Y[i,j] = X[i,j] * 2", backend=backend)
    plain = torch.randn(3, 4, dtype=DTYPE[backend], device=DEVICE[backend])
    program(X=plain)                                  # a runner for this shape exists: the view reuses it
    complex_dtype = {torch.float32: torch.complex64, torch.float64: torch.complex128}[DTYPE[backend]]
    negated = torch.randn(3, 4, dtype=complex_dtype, device=DEVICE[backend]).conj().imag
    assert negated.is_neg()
    for x in (negated, torch._neg_view(plain)):
        torch.testing.assert_close(program(X=x), x * 2, **TOL[backend])


def test_a_complex_input_is_an_einfold_error_naming_its_parts():
    with pytest.raises(BindError, match=r"dtype torch.complex64; .*complex values are not supported: pass the "
                                        r"real and imaginary parts, X.real and X.imag, as two inputs"):
        compiler.compile("Y[i] = X[i] * 2", backend="reference")(X=torch.ones(3, dtype=torch.complex64))


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("layout", ["to_sparse", "to_sparse_csr"])
def test_a_sparse_input_is_an_einfold_error(backend, layout):
    program = compiler.compile("Y[i] = sum[j](X[i,j])", backend=backend)
    x = torch.randn(3, 4, dtype=DTYPE[backend], device=DEVICE[backend])
    program(X=x)                                      # a dense call of the same shape and dtype first
    with pytest.raises(BindError, match=r"'X' is a sparse_(coo|csr) tensor.*X.to_dense\(\)"):
        program(X=getattr(x, layout)())


@pytest.mark.parametrize("backend", BACKENDS)
def test_outputs_larger_than_memory_are_an_einfold_error_before_allocating(backend):
    # three expanded 2**15 vectors: an output of 2**45 elements (128 TiB in float32)
    program = compiler.compile("Y[i,j,k] = A[i] * B[j] * C[k]", backend=backend)
    a = torch.ones(1, dtype=torch.float32, device=DEVICE[backend]).expand(2 ** 15)
    with pytest.raises(BindError, match=r"outputs would take \d+\.\d TiB .*output 'Y'.*\[32768, 32768, 32768\]"):
        program(A=a, B=a, C=a)


# ---------------------------------------------------------------- what a call returns
@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("source", ["Y[i,j] = X[i,j]", "Y[j,i] = X[i,j]", "Y[i] = X[i,i]",
                                    "Y[i,j] = X[i,j]\nZ[i,j] = Y[i,j]"])
def test_outputs_never_share_memory_with_inputs_or_each_other(backend, dtype, source):
    x = torch.randn(*((3, 3) if "i,i" not in source else (1, 1)), dtype=dtype, device=DEVICE[backend])
    before = x.clone()
    outputs = compiler.compile(source, backend=backend)(X=x)
    outputs = outputs if isinstance(outputs, tuple) else (outputs,)
    for out in outputs:
        out.add_(1)                                   # the caller's to change
    assert torch.equal(x, before)
    assert len({o.untyped_storage().data_ptr() for o in outputs}) == len(outputs)


# ---------------------------------------------------------------- the oracle is torch
@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("reduction, value, n", [("sum", 2 ** 62, 3), ("sum", 2 ** 53 + 1, 2),
                                                 ("max", 2 ** 62 + 1, 3), ("min", 2 ** 62 + 1, 3)],
                         ids=["sum wraps past 2**63", "sum exact past 2**53", "max exact", "min exact"])
def test_an_integer_reduction_is_int64_arithmetic_as_torch(backend, reduction, value, n):
    # an odd count: the fold pads with the identity, the int64 extreme for max and min
    program = compiler.compile(f"Y[] = {reduction}[i](where(X[i] == X[i], {value}, 0))", backend=backend)
    out = program(X=torch.zeros(n, device=DEVICE[backend]))
    assert out.dtype == torch.int64
    assert int(out) == int(getattr(torch.full((n,), value, dtype=torch.int64), reduction)())


NAN = float("nan")
ROWS = torch.tensor([[1.0, NAN, 5.0, NAN, 2.0], [3.0, 1.0, 2.0, NAN, 7.0], [NAN, 1.0, 9.0, 0.0, 1.0],
                     [4.0, 8.0, 8.0, 1.0, 0.0]], dtype=torch.float64)


@pytest.mark.parametrize("source, want", [
    ("Y[i] = argmax[j](X[i,j], j)", lambda x: torch.argmax(x, 1)),
    ("Y[i] = argmin[j](X[i,j], j)", lambda x: torch.argmin(x, 1)),
    ("Y[i] = max[j](X[i,j])", lambda x: x.amax(1)),
    ("Y[i] = min[j](X[i,j])", lambda x: x.amin(1)),
    # argmax and max over one index share one fold
    ("Y[i] = argmax[j](X[i,j], j)\nZ[i] = max[j](X[i,j])", lambda x: (torch.argmax(x, 1), x.amax(1))),
])
def test_the_oracle_gives_torchs_extremum_of_a_row_with_nan(source, want):
    torch.testing.assert_close(compiler.compile(source, backend="reference")(X=ROWS), want(ROWS), equal_nan=True)


# ---------------------------------------------------------------- torch's transforms
@pytest.mark.parametrize("backend", BACKENDS)
def test_forward_mode_ad_is_an_einfold_error_not_a_missing_tangent(backend):
    program = compiler.compile("Y[i] = sum[j](X[i,j] * X[i,j])", backend=backend)
    x, t = (torch.randn(3, 4, dtype=DTYPE[backend], device=DEVICE[backend]) for _ in range(2))
    with pytest.raises(TransformError, match="forward-mode AD"), forward_ad.dual_level():
        program(X=forward_ad.make_dual(x, t))
    with pytest.raises(TransformError, match="forward-mode AD"):
        torch.func.jvp(lambda a: program(X=a), (x,), (t,))


@pytest.mark.parametrize("backend", BACKENDS)
def test_func_grad_and_vjp_of_a_program(backend):
    program = compiler.compile(ATTENTION, backend=backend)
    q, k, v = qkv(backend)
    got = torch.func.grad(lambda a, b: program(Q=a, K=b, V=v, s=0.5).square().sum(), argnums=(0, 1))(q, k)
    want = torch.func.grad(lambda a, b: attention(a, b, v).square().sum(), argnums=(0, 1))(q, k)
    torch.testing.assert_close(got, want, **TOL[backend])
    out, pull = torch.func.vjp(lambda a: program(Q=a, K=k, V=v, s=0.5), q)
    torch.testing.assert_close(pull(torch.ones_like(out)), torch.func.vjp(lambda a: attention(a, k, v), q)[1](
        torch.ones_like(out)), **TOL[backend])


@pytest.mark.parametrize("backend", BACKENDS)
def test_vmap_runs_the_batch_as_one_program(backend):
    program = compiler.compile(ATTENTION, backend=backend)
    q, k, v = qkv(backend, 2)
    with warnings.catch_warnings():
        warnings.simplefilter("error", UserWarning)   # torch's "performance drop": a loop over the batch
        got = torch.vmap(lambda a, b: program(Q=a, K=b, V=v[0], s=0.5), in_dims=(0, 1))(q, k.transpose(0, 1))
    torch.testing.assert_close(got, torch.vmap(lambda a, b: attention(a, b, v[0]))(q, k), **TOL[backend])
    wide, index = program._batched(("Q", "K"))
    assert f"O[{index}, i, j]" in wide.text and "V[m, j]" in wide.text


@pytest.mark.parametrize("backend", BACKENDS)
def test_per_sample_gradients_by_vmap_of_grad(backend):
    program = compiler.compile(ATTENTION, backend=backend)
    q, k, v = qkv(backend, 2)
    loss = lambda f: lambda kk, a: f(a, kk).square().sum()           # noqa: E731 -- K is shared, Q batched
    got = torch.vmap(torch.func.grad(loss(lambda a, kk: program(Q=a, K=kk, V=v[0], s=0.5))), (None, 0))(k[0], q)
    want = torch.vmap(torch.func.grad(loss(lambda a, kk: attention(a, kk, v[0]))), (None, 0))(k[0], q)
    torch.testing.assert_close(got, want, **TOL[backend])


@pytest.mark.parametrize("backend", BACKENDS)
def test_vmap_of_a_statement_reading_a_batched_one_a_batched_0d_tensor_and_an_unbatched_output(backend):
    program = compiler.compile("A[i] = sum[j](X[i,j]) * c\nB[i] = A[i] * 2\nC[i] = sum[j](W[i,j])",
                               outputs=["B", "C"], backend=backend)
    x, w, c = (torch.randn(*shape, dtype=DTYPE[backend], device=DEVICE[backend])
               for shape in ((5, 3, 4), (3, 4), (5,)))
    b, s = torch.vmap(lambda x_, c_: program(X=x_, W=w, c=c_))(x, c)
    torch.testing.assert_close(b, x.sum(-1) * c[:, None] * 2, **TOL[backend])
    torch.testing.assert_close(s, w.sum(-1).expand(5, 3), **TOL[backend])


@pytest.mark.parametrize("backend", BACKENDS)
def test_jit_trace_records_the_programs_op_and_jit_script_is_an_einfold_error(backend):
    program = compiler.compile(ATTENTION, backend=backend)
    q, k, v = qkv(backend)
    traced = torch.jit.trace(lambda a: program(Q=a, K=k, V=v, s=0.5), (q,))
    assert "einfold::program_" in str(traced.graph)
    torch.testing.assert_close(traced(q + 1), attention(q + 1, k, v), **TOL[backend])
    with pytest.raises(TransformError, match="torch.jit.script"):
        torch.jit.script(program)


# ---------------------------------------------------------------- pickling
@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("called", [False, True], ids=["before a call", "after a call"])
def test_an_unpickled_program_runs_forward_and_backward_after_the_original_is_gone(backend, called):
    program = compiler.compile(ATTENTION, backend=backend)
    q, k, v = qkv(backend)
    if called:
        program(Q=q.requires_grad_(), K=k, V=v, s=0.5).sum().backward()
        q = q.detach()
    data = pickle.dumps(program)
    del program
    gc.collect()
    restored = pickle.loads(data)
    q.requires_grad_()
    out = restored(Q=q, K=k, V=v, s=0.5)
    out.square().sum().backward()
    want = q.detach().clone().requires_grad_()
    attention(want, k, v).square().sum().backward()
    torch.testing.assert_close(out, attention(q.detach(), k, v), **TOL[backend])
    torch.testing.assert_close(q.grad, want.grad, **TOL[backend])


# ---------------------------------------------------------------- torch.compile
def test_inductor_compiles_a_program_over_a_transposed_view_forward_and_backward(tmp_path, monkeypatch):
    # the backward op's fake gave the gradient the input's strides; the real one is
    # contiguous, which inductor's generated code asserts
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path))   # no compiled graph of an earlier run
    torch._dynamo.reset()
    program = compiler.compile("Y[i,j] = sum[k](X[i,k] * W[k,j])", backend="reference")
    x = torch.randn(4, 3, dtype=torch.float64, requires_grad=True)
    w = torch.randn(4, 5, dtype=torch.float64, requires_grad=True)
    torch.compile(lambda a, b: program(X=a.t(), W=b).sin().sum(), fullgraph=True)(x, w).backward()
    want = [t.detach().clone().requires_grad_() for t in (x, w)]
    (want[0].t() @ want[1]).sin().sum().backward()
    torch.testing.assert_close(x.grad, want[0].grad)
    torch.testing.assert_close(w.grad, want[1].grad)


def test_torch_compile_runs_a_triton_program_without_triton_interpret_in_the_environment(tmp_path):
    # torch.compile imports Triton (through torch._dynamo) before the traced program
    # first runs: without CUDA, Triton's interpreter has to be chosen before that
    script = ("import torch, compiler\n"
              "device = 'cuda' if torch.cuda.is_available() else 'cpu'\n"
              "program = compiler.compile('Y[i] = sum[j](X[i,j] * X[i,j])', backend='triton')\n"
              "x = torch.randn(3, 5, device=device)\n"
              "y = torch.compile(lambda a: program(X=a) * 2, fullgraph=True, backend='aot_eager')(x)\n"
              "torch.testing.assert_close(y, (x * x).sum(1) * 2)\n")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, (ROOT, env.get("PYTHONPATH"))))
    done = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=300,
                          cwd=tmp_path)
    assert done.returncode == 0, done.stderr[-3000:]
