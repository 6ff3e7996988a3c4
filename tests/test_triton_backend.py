"""The triton backend against the float64 oracle.

On a CPU machine the kernels run under Triton's interpreter (conftest sets
TRITON_INTERPRET=1), so shapes here are tiny and deliberately not powers of
two.  Tests marked `gpu` run realistic sizes against torch on the device machine."""
import itertools
import math
import re
import os
import warnings
from dataclasses import replace

import pytest
import torch

import compiler
from compiler import reference
from compiler.backend.triton import TritonBackend, cache
from compiler.schedule.tiles import auto_split
from compiler.schedule import schedule
from compiler.bind import Binder, bind
from compiler.check import check
from compiler.errors import BackendError
from compiler.ir import Reduce, transform, walk
from compiler.random_inputs import relative_error
from compiler.parse import parse

warnings.filterwarnings("ignore", message="einfold: no CUDA tensors")

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
TOL = {torch.float32: {"rtol": 1e-4, "atol": 1e-4}, torch.float16: {"rtol": 2e-2, "atol": 2e-2},
       torch.bfloat16: {"rtol": 2e-2, "atol": 2e-2}}

ATTENTION = "O[b,h,i,j] = softmax[m](Q[b,h,i,k] * K[b,h,m,k] * scale) * V[b,h,m,j]"
CAUSAL = "O[i,j] = softmax[m](where(m <= i, Q[i,k] * K[m,k] * scale, -inf)) * V[m,j]"
LAYERNORM = """
mu[i] = sum[j](X[i,j]) / len(j)
var[i] = sum[j]((X[i,j] - mu[i]) ** 2) / len(j)
Y[i,j] = (X[i,j] - mu[i]) * rsqrt(var[i] + 1e-5)
"""


@pytest.fixture(autouse=True)
def _cache_dir(tmp_path_factory, monkeypatch):
    monkeypatch.setenv("EINFOLD_CACHE_DIR", str(tmp_path_factory.getbasetemp() / "einfold-cache"))


def randn(*shape, dtype=torch.float32, seed=0):
    g = torch.Generator().manual_seed(seed + sum(shape))
    return torch.randn(*shape, generator=g).to(dtype=dtype, device=DEVICE)


def triton_backend(src, outputs=None, **options):
    """(oracle program, triton backend).  Without options the backend is the one
    compiler.compile(src, backend="triton") builds; options such as split are given
    to the backend directly (Program does not pass options to backends)."""
    ref = compiler.compile(src, backend="reference", outputs=outputs)
    if not options:
        program = compiler.compile(src, backend="triton", outputs=outputs)
        assert program.factorised == ref.factorised
        return ref, program.backend
    return ref, TritonBackend(schedule(ref.factorised, ref.outputs, options.get("split")),
                              float32_outputs=options.get("float32_outputs", ()))


def run(backend, ref, inputs):
    results = backend.run(Binder(ref.checked, extents_of=backend.program)(inputs))
    return tuple(results[n] for n in ref.outputs)


def plan(backend, ref, inputs):
    return backend.plan(Binder(ref.checked, extents_of=backend.program)(inputs))


def assert_matches_oracle(src, inputs, outputs=None, **options):
    ref, backend = triton_backend(src, outputs, **options)
    got = run(backend, ref, inputs)
    want = ref(**inputs)
    want = want if isinstance(want, tuple) else (want,)
    for g, w in zip(got, want):
        assert g.dtype == w.dtype and g.shape == w.shape
        tol = TOL.get(g.dtype, {})
        torch.testing.assert_close(g.cpu(), w.cpu(), equal_nan=True, **tol)
    return ref, backend


def unfactorised(src, inputs, outputs=None):
    checked = check(parse(src), outputs=tuple(outputs) if outputs else None)
    backend = TritonBackend(schedule(checked, checked.outputs))
    binding = bind(checked, inputs)
    got = backend.run(binding)
    want = reference.run(checked, inputs, binding.extents)     # the oracle on the same, unfactorised IR
    for name in checked.outputs:
        torch.testing.assert_close(got[name].cpu(), want[name].to(binding.dtype), **TOL[binding.dtype])
    return backend, backend.plan(bind(checked, inputs))


def kernel_names(p):
    return [k.name for k in p.kernels]


# ---------------------------------------------------------------- one fused kernel each
def test_elementwise_add_gelu_is_one_kernel():
    src = "Y[i,j] = gelu(X[i,j] + Z[i,j]) * sigmoid(Z[i,j]) + tanh(X[i,j] / 3) + softplus(Z[i,j])"
    inputs = {"X": randn(7, 45), "Z": randn(7, 45, seed=1)}
    ref, backend = assert_matches_oracle(src, inputs)
    p = plan(backend, ref, inputs)
    assert len(p.kernels) == 1 and p.buffers == ()
    assert "elementwise" in p.kernels[0].why


def test_through_compile_with_the_triton_backend():
    program = compiler.compile("Y[i] = relu(X[i]) - silu(X[i]) ** 2", backend="triton")
    x = randn(37)
    torch.testing.assert_close(program(X=x), torch.relu(x) - torch.nn.functional.silu(x) ** 2)
    assert len(program.plan(X=x).kernels) == 1
    assert "@triton.jit" in program.source and "def launch(" in program.source


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_softmax_rows(dtype):
    inputs = {"X": randn(7, 45, dtype=dtype) * 4}
    ref, backend = assert_matches_oracle("Y[i,j] = softmax[j](X[i,j])", inputs)
    p = plan(backend, ref, inputs)
    assert len(p.kernels) == 1 and p.buffers == ()


def test_softmax_of_huge_logits_does_not_overflow():
    x = randn(3, 21) * 1e4
    ref, backend = triton_backend("Y[i,j] = softmax[j](X[i,j])")
    (got,) = run(backend, ref, {"X": x})
    torch.testing.assert_close(got.cpu(), torch.softmax(x.cpu().double(), 1).float(), rtol=1e-4, atol=1e-5)


def test_logsumexp():
    assert_matches_oracle("L[i] = logsumexp[j](X[i,j])", {"X": randn(5, 37) * 30})


def test_sum_max_min_prod_share_one_kernel():
    src = "S[i] = sum[j](X[i,j])\nM[i] = max[j](X[i,j])\nN[i] = min[j](X[i,j])\nP[i] = prod[j](X[i,j])"
    inputs = {"X": 0.5 + torch.rand(5, 13, device=DEVICE)}
    ref, backend = assert_matches_oracle(src, inputs)
    assert len(plan(backend, ref, inputs).kernels) == 1


def test_reductions_over_two_indices_and_full_reductions():
    assert_matches_oracle("S[i] = sum[j, k](X[i,j,k] * X[i,j,k])", {"X": randn(3, 5, 7)})
    assert_matches_oracle("T = max[i](X[i]) + sum[i](X[i])", {"X": randn(37)})


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_matmul_uses_tl_dot(dtype):
    inputs = {"A": randn(20, 33, dtype=dtype), "B": randn(33, 19, dtype=dtype, seed=1)}
    ref, backend = triton_backend("C[i,j] = A[i,k] * B[k,j]")
    (got,) = run(backend, ref, inputs)
    want = (inputs["A"].double() @ inputs["B"].double()).to(dtype)
    torch.testing.assert_close(got.cpu(), want.cpu(), **TOL[dtype], check_dtype=True)
    assert "tl.dot(" in backend.source
    assert len(plan(backend, ref, inputs).kernels) == 1


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_layernorm_is_one_kernel(dtype):
    inputs = {"X": (randn(5, 37) * 3 + 10).to(dtype)}
    ref, backend = assert_matches_oracle(LAYERNORM, inputs)
    p = plan(backend, ref, inputs)
    assert len(p.kernels) == 1 and p.buffers == ()


def test_layernorm_statistics_as_outputs_share_the_kernel():
    # the checked (unfactorised) IR: mu and var are outputs that Y reads
    checked = check(parse(LAYERNORM), outputs=("mu", "var", "Y"))
    backend = TritonBackend(schedule(checked, checked.outputs))
    x = randn(5, 37) * 3 + 10
    got = backend.run(bind(checked, {"X": x}))
    torch.testing.assert_close(got["mu"].cpu(), x.cpu().mean(1))
    torch.testing.assert_close(got["var"].cpu(), x.cpu().var(1, unbiased=False), rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(got["Y"].cpu(), torch.nn.functional.layer_norm(x.cpu(), (37,)), rtol=1e-4,
                               atol=1e-4)
    p = backend.plan(bind(checked, {"X": x}))
    assert len(p.kernels) == 1 and set(p.kernels[0].writes) == {"mu", "var", "Y"} and p.buffers == ()


def test_a_statement_that_reads_itself_is_refused():
    from compiler.ir import Access, Assign, Call, replace
    checked = check(parse("Y[i] = X[i] + 1"))
    st = checked.statements[0]
    bad = replace(checked, statements=(replace(st, expr=Call("add", (st.expr, Access("Y", ("i",))))),))
    with pytest.raises(BackendError, match="reads itself"):
        TritonBackend(schedule(bad, bad.outputs))
    del Assign


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_attention_with_batch_and_heads_is_one_flash_kernel(dtype):
    inputs = {"Q": randn(2, 3, 20, 16, dtype=dtype), "K": randn(2, 3, 37, 16, dtype=dtype, seed=1),
              "V": randn(2, 3, 37, 12, dtype=dtype, seed=2), "scale": 0.25}
    ref, backend = assert_matches_oracle(ATTENTION, inputs)
    p = plan(backend, ref, inputs)
    assert len(p.kernels) == 1 and p.buffers == ()
    src = backend.source
    assert src.count("tl.dot(") == 2                       # Q K^T and P V
    assert "finite stand-in" in src and "running max" in src
    q, k, v = (inputs[n].double().cpu() for n in "QKV")
    want = torch.nn.functional.scaled_dot_product_attention(q, k, v, scale=0.25)
    torch.testing.assert_close(run(backend, ref, inputs)[0].cpu().double(), want, **TOL[dtype])


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_causal_attention(dtype):
    inputs = {"Q": randn(29, 16, dtype=dtype), "K": randn(29, 16, dtype=dtype, seed=1),
              "V": randn(29, 8, dtype=dtype, seed=2), "scale": 0.3}
    ref, backend = assert_matches_oracle(CAUSAL, inputs)
    q, k, v = (inputs[n].double().cpu() for n in "QKV")
    want = torch.nn.functional.scaled_dot_product_attention(q, k, v, scale=0.3, is_causal=True)
    torch.testing.assert_close(run(backend, ref, inputs)[0].cpu().double(), want, **TOL[dtype])
    # the masked branch is -inf, which the rescaled summary treats as the identity:
    # the loop over m stops after the last tile that can hold m <= i
    assert "hi_m = tl.minimum(n_m, tl.max(offs_i, 0) + 1)" in backend.source


@pytest.mark.parametrize("src, relation", [
    ("L[i] = logsumexp[m](where(m > i, X[i,m], -inf))", "lo_m = tl.maximum(0, (tl.min(offs_i, 0) + 1)"),
    ("S[i] = sum[m](where(m < i, X[i,m], 0.0))", "hi_m = tl.minimum(n_m, tl.max(offs_i, 0))"),
    ("S[i] = max[m](where(i <= m and m < i + 3, X[i,m], -inf))", "lo_m = tl.maximum(0, (tl.min(offs_i, 0))"),
    ("S[i] = sum[m](where(m < i, X[i,m], 1.0))", None)])   # 1 is not the sum's identity: no bound
def test_index_predicates_bound_the_loops(src, relation):
    _, backend = assert_matches_oracle(src, {"X": randn(40, 2100)})
    if relation:
        assert relation in backend.source
    else:
        assert "lo_m" not in backend.source and "hi_m" not in backend.source


def test_causal_attention_split():
    inputs = {"Q": randn(70, 16), "K": randn(70, 16, seed=1), "V": randn(70, 8, seed=2), "scale": 0.3}
    ref, backend = assert_matches_oracle(CAUSAL, inputs, split=3)
    (kernel,) = plan(backend, ref, inputs).kernels              # the split and its merge: one launch
    assert kernel.name.endswith("_partial") and "einfold_O_merge, called: one launch" in kernel.why


@pytest.mark.parametrize("keep", ["m <= i and i - m < 20", "m <= i + len(m) - len(i)", "m + 30 <= i"],
                         ids=["window", "bottom-right causal", "rows no key reaches"])
def test_a_split_fold_under_index_masks_matches_the_oracle(keep):
    """A fold of few programs splits on the GPU from 8 tiles (tiles.SPLIT_SHORT_TILES), so
    a short masked prefill runs split: chunks a mask leaves empty merge as the identity,
    and a row no key reaches is NaN (0/0) as the oracle's."""
    src = f"O[h,i,j] = softmax[m](where({keep}, Q[h,i,k] * K[h,m,k] * scale, -inf)) * V[h,m,j]"
    inputs = {"Q": randn(2, 37, 16), "K": randn(2, 53, 16, seed=1), "V": randn(2, 53, 8, seed=2), "scale": 0.3}
    ref, backend = assert_matches_oracle(src, inputs, split=3)
    (name,) = kernel_names(plan(backend, ref, inputs))
    assert name.endswith("_partial")


def test_fully_masked_rows_follow_the_oracle():
    # row 0 of a strict causal mask has no mass: the language defines 0/0 there
    src = "O[i,j] = softmax[m](where(m < i, S[i,m], -inf)) * V[m,j]"
    assert_matches_oracle(src, {"S": randn(6, 6), "V": randn(6, 3)})


def test_strided_and_transposed_inputs():
    a = randn(33, 20).t()                       # transposed view
    b = randn(19, 66)[:, ::2].t()               # non-unit stride, transposed
    assert not a.is_contiguous() and not b.is_contiguous()
    assert_matches_oracle("C[i,j] = A[i,k] * B[k,j]", {"A": a, "B": b})
    x = randn(9, 40)[1::2, 3:40]
    assert_matches_oracle("Y[i,j] = softmax[j](X[i,j])", {"X": x})
    q = randn(2, 20, 3, 16).transpose(1, 2)     # (b, s, h, d) storage read as (b, h, s, d)
    assert_matches_oracle(ATTENTION, {"Q": q, "K": randn(2, 3, 37, 16), "V": randn(2, 3, 37, 12), "scale": 0.5})


def test_outputs_of_other_dtypes_and_index_values():
    src = "N[i,j] = i * len(j) + j\nB[i,j] = X[i,j] > 0\nF[i,j] = X[i,j] * i / (j + 1)"
    ref, backend = assert_matches_oracle(src, {"X": randn(5, 7)})
    got = run(backend, ref, {"X": randn(5, 7)})
    assert got[0].dtype == torch.int64 and got[1].dtype == torch.bool


@pytest.mark.parametrize("scale", [0.5, -0.5, 0.0, 1e-300, float("inf")])
@pytest.mark.parametrize("masked", [False, True])
def test_a_positive_factor_leaves_the_tile_and_no_other_does(scale, masked):
    """A positive number (or literal) factor of a softmax's logits is taken out of
    the tile's max and into the weights' fma (KernelEmitter.positive_factor), also
    through a mask's select against -inf: the kernel is specialised on the number
    being a normal positive float32.  One program called with each kind of scale in
    turn follows the oracle (a kernel made for a positive scale would take a
    negative one's min for its max)."""
    src = CAUSAL if masked else ATTENTION
    program = compiler.compile(src, backend="triton")
    oracle = compiler.compile(src, backend="reference")
    if masked:
        x = {"Q": randn(37, 16), "K": randn(41, 16, seed=1), "V": randn(41, 12, seed=2)}
    else:
        x = {"Q": randn(2, 3, 37, 16), "K": randn(2, 3, 41, 16, seed=1), "V": randn(2, 3, 41, 12, seed=2)}
    for s in (0.5, scale):
        got, want = program(**x, scale=s), oracle(**x, scale=s)
        torch.testing.assert_close(got.cpu(), want.cpu(), equal_nan=True, **TOL[torch.float32])
        folded = "_base2(r_use, scale_val)" in program.source     # the weights' factor, not the max's
        assert folded == (0 < s < float("inf") and s > 1e-38)
        assert folded != ("(scale_val * qk)" in program.source)


def test_a_positive_literal_factor_leaves_the_tile():
    softcap = "O[i,j] = softmax[m](30.0 * tanh(Q[i,k] * K[m,k] / 30.0)) * V[m,j]"
    x = {"Q": randn(37, 16) * 30, "K": randn(41, 16, seed=1), "V": randn(41, 12, seed=2)}
    ref, backend = assert_matches_oracle(softcap, x)
    kernel = backend.source[backend.source.index("def einfold_"):]
    assert "_base2(r_use, 30.0)" in kernel and "(30.0 * " not in kernel


@pytest.mark.parametrize("src, shapes, paired", [
    (ATTENTION, {"Q": (4, 16, 4096, 64), "K": (4, 16, 4096, 64), "V": (4, 16, 4096, 64)}, True),
    (CAUSAL, {"Q": (65536, 64), "K": (65536, 64), "V": (65536, 64)}, False),
    (ATTENTION, {"Q": (4, 16, 4096, 128), "K": (4, 16, 4096, 128), "V": (4, 16, 4096, 128)}, False),
    (ATTENTION, {"Q": (4, 16, 4096, 64), "K": (4, 16, 4096, 64), "V": (4, 16, 4096, 256)}, False),
    ("C[i,j] = A[i,k] * B[k,j]", {"A": (4096, 64), "B": (64, 4096)}, False)])
def test_two_programs_per_sm_are_a_candidate_where_their_state_fits(src, shapes, paired):
    """A streamed contraction whose float32 state (scores and accumulator, 128 rows)
    fits 96 registers a thread of 8 warps, and whose programs all do the same work,
    gets one more autotune candidate, capped at 128 registers so that two programs
    share an SM (schedule.tiles.PAIRED); a wider value tile (d = 128, 256) would
    spill, causal programs differ in length, and a matrix product has its own tilings."""
    ref, backend = triton_backend(src)
    x = {k: torch.zeros(1, dtype=torch.bfloat16).expand(*shape) for k, shape in shapes.items()}
    x.update({i.name: 0.125 for i in ref.checked.inputs if not i.rank})
    source = backend.source_for(Binder(ref.checked, extents_of=backend.program)(x), sm_count=132)
    assert source.count("maxnreg=128") == paired


EVICTION_CASES = {
    # a row streamed once by the program that folds it: read past the cache
    "L[i] = logsumexp[j](X[i,j])": {"X": ["evict_first"]},
    # the fold reads the row, the epilogue reads it again and streams it past (an L2 cache
    # of 190 KB, smaller than X: the first read keeps the rows for the second)
    "Y[i,j] = softmax[j](X[i,j])": {"X": ["evict_last", "evict_first"]},
    # every program reads the weights W[j]: no hint
    "Y[i,j] = (X[i,j] - mean[j](X[i,j])) * W[j]": {"X": ["evict_last", "evict_first"], "W": [None]},
    # two kernels read X (one folds columns, one rows): the second may find it in cache
    "C[j] = sum[i](X[i,j]); R[i] = max[j](X[i,j])": {"X": [None, None]},
    # no fold: elementwise kernels ran slower with the hints
    "Y[i,j] = X[i,j] + Z[i,j]": {"X": [None], "Z": [None]},
    # tl.dot: K and V are read by every row tile's program, Q's hint did not pay
    "O[i,j] = softmax[m](Q[i,k] * K[m,k] * scale) * V[m,j]": {"Q": [None], "K": [None], "V": [None]},
}


def eviction_hints(src: str, l2_bytes: int | None) -> dict[str, list]:
    """{tensor: the eviction hint of each of its loads, in kernel order} of the module
    a GPU with 132 SMs and an L2 cache of `l2_bytes` would run for `src` (1000 x 48
    rows)."""
    import re
    from compiler.ir import Access
    ref, backend = triton_backend(src)
    extent = {"i": 1000}        # rows over several programs (and a single one over the others)
    x = {n.tensor: torch.zeros(1).expand(*[extent.get(i, 48) for i in n.indices])
         for st in ref.checked.statements for n in walk(st.expr) if isinstance(n, Access) and n.indices}
    x.update({i.name: 0.125 for i in ref.checked.inputs if not i.rank})
    x = {name: value for name, value in x.items() if name in {i.name for i in ref.checked.inputs}}
    binding = Binder(ref.checked, extents_of=backend.program)(x)
    source = backend.source_for(binding, sm_count=132, l2_bytes=l2_bytes)
    hints = {}
    for tensor, policy in re.findall(r"x_(\w+?)\d+ = tl\.load\(.*?(?:eviction_policy=\"(\w+)\")?\)$", source, re.M):
        hints.setdefault(tensor, []).append(policy or None)
    return hints


@pytest.mark.parametrize("src", list(EVICTION_CASES))
def test_rows_streamed_once_are_read_past_the_cache(src):
    """Loads of a memory-bound fold whose elements no other program reads carry
    eviction hints (the last read of a tensor evict_first, an earlier one evict_last
    where the tensor is larger than the L2 cache); other loads none."""
    assert eviction_hints(src, l2_bytes=190_000) == EVICTION_CASES[src]


def test_a_row_read_again_is_kept_in_cache_only_where_the_cache_cannot_hold_the_tensor():
    """X (1000 x 48 float32, 192 KB): kept for the epilogue's second read by a cache
    smaller than it; a cache that holds it keeps the rows without the mark, and where
    the cache is not known (no GPU) nothing is marked for it."""
    softmax = "Y[i,j] = softmax[j](X[i,j])"
    assert eviction_hints(softmax, l2_bytes=190_000) == {"X": ["evict_last", "evict_first"]}
    assert eviction_hints(softmax, l2_bytes=200_000) == {"X": [None, "evict_first"]}
    assert eviction_hints(softmax, l2_bytes=None) == {"X": [None, "evict_first"]}


def _op_expression(op):
    from compiler.ops import OPS
    info = OPS[op]
    if info.syntax == "function":
        args = {1: "X[i]", 2: "X[i], Z[i]", 3: "X[i] > 0, X[i], Z[i]"}[info.arity]
        return f"{info.symbol}({args})"
    if info.name in ("and", "or"):
        return f"where((X[i] > 0) {info.symbol} (Z[i] < 0.5), 1.0, -1.0)"
    if info.name == "not":
        return "where(not (X[i] > 0), 1.0, -1.0)"
    if info.precedence == 4:                     # comparisons
        return f"where(X[i] {info.symbol} Z[i], X[i], Z[i])"
    if info.syntax == "prefix":
        return f"{info.symbol}X[i]"
    return f"X[i] {info.symbol} Z[i]"


@pytest.mark.parametrize("op", sorted(__import__("compiler.ops", fromlist=["OPS"]).OPS))
def test_every_operator_of_the_language(op):
    x = torch.linspace(-3, 3, 29, device=DEVICE)
    z = torch.linspace(2.5, -1.5, 29, device=DEVICE)
    src = f"Y[i] = {_op_expression(op)}"
    assert_matches_oracle(src, {"X": x, "Z": z} if "Z[i]" in src else {"X": x})


def test_powers_and_constant_folding():
    src = ("Y[i] = where(1 < 2, X[i], 0.0) + where(i > 2 and not (i > 5), 1.0, 2.0) + 2 ** 3 + X[i] ** -2"
           " + abs(X[i]) ** 0.5 + abs(X[i]) ** 1.7 + (X[i] * 4) ** 3.0 + (X[i] * 4) ** (i - 4) + X[i] ** 0")
    assert_matches_oracle(src, {"X": randn(11)})


@pytest.mark.parametrize("src, shape", [("Y[i] = sum[j](X[i,j])", (0, 5)), ("Y[i] = sum[j](X[i,j])", (5, 0)),
                                        ("Y[i] = max[j](X[i,j])", (3, 0)), ("Y[i,j] = X[i,j] * 2", (0, 3)),
                                        ("Y[i,j] = softmax[j](X[i,j])", (1, 1))])
def test_empty_and_unit_extents(src, shape):
    # an empty reduction is the identity; an empty output launches nothing
    assert_matches_oracle(src, {"X": randn(*shape)})


def test_scalar_inputs_as_numbers_and_zero_dim_tensors():
    src = "Y[i] = X[i] * a + b"
    assert_matches_oracle(src, {"X": randn(11), "a": 2.5, "b": torch.tensor(-1.0, device=DEVICE)})


# ---------------------------------------------------------------- a corpus: each program one kernel
from test_passes import PROGRAMS as CORPUS  # noqa: E402 - the pass library's programs, one kernel each


@pytest.mark.parametrize("name", list(CORPUS))
def test_corpus_program_is_one_kernel(name):
    from compiler.random_inputs import random_inputs
    src = CORPUS[name]
    ref = compiler.compile(src, backend="reference")
    sizes = dict(zip("ijkmv", [19, 6, 8, 37, 23]))
    inputs = random_inputs(ref.checked, {ix: sizes.get(ix, 5) for ix, _ in ref.checked.extents}, device=DEVICE)
    ref, backend = assert_matches_oracle(src, inputs)
    p = plan(backend, ref, inputs)
    assert len(p.kernels) == 1 and p.buffers == ()


# ---------------------------------------------------------------- algebra: order, payloads, user summaries
def test_argmax_keeps_the_first_of_ties():
    x = torch.randint(-2, 3, (6, 13), generator=torch.Generator().manual_seed(3)).float().to(DEVICE)
    x[2] = 1.0
    ref, backend = triton_backend("I[i] = argmax[k](X[i,k], k)")
    (got,) = run(backend, ref, {"X": x})
    assert torch.equal(got.cpu().long(), torch.argmax(x.cpu(), dim=1))
    assert "tl.associative_scan" in backend.source          # non-commutative: order kept


def affine():
    return compiler.summary("affine", fields=("A", "B"), identity=(1.0, 0.0), lift=lambda a, b: (a, b),
                            combine=lambda l, r: (r.A * l.A, r.A * l.B + r.B), finalize=lambda s: s.B,
                            examples=20)


def test_base2_is_a_pass_the_emitter_follows():
    """passes/base2 marks the weights exp(x - r) of a leader's own argument; the
    emitter evaluates marked weights in base 2 (exp2 of one fma) and others as
    their formula says, with the same values."""
    from compiler.passes.base2 import use_base2
    src = "O[i,j] = softmax[m](Q[i,k] * K[m,k]) * V[m,j]"
    ref = compiler.compile(src, backend="reference")
    (fold,) = {n.fold for n in walk(ref.factorised.statements[0].expr) if isinstance(n, Reduce)
               and n.summary.rescaled}
    assert all(rs.base2 for rs in fold.summary.rescaled)

    def unmark(e):
        if isinstance(e, Reduce) and e.summary.rescaled:
            rescaled = tuple(replace(rs, base2=False) for rs in e.summary.rescaled)
            return replace(e, summary=replace(e.summary, rescaled=rescaled))
        return e
    plain = replace(ref.factorised, statements=tuple(replace(s, expr=transform(s.expr, unmark))
                                                     for s in ref.factorised.statements))
    assert use_base2(plain) == ref.factorised
    inputs = {"Q": randn(37, 16), "K": randn(41, 16), "V": randn(41, 8)}
    want = ref(**inputs)
    for program, base2 in ((ref.factorised, True), (plain, False)):
        backend = TritonBackend(schedule(program, ref.outputs))
        (got,) = run(backend, ref, inputs)
        assert ("tl.exp2(tl.fma(" in backend.source) == base2
        assert relative_error(got, want) < 1e-5


def test_user_sum_and_max_lower_like_the_built_in_ones():
    """The emitter picks a fold's lowering by the summary's algebra (FOLD_LOWERINGS),
    not its name: a user's sum contracts through tl.dot, a user's max reduces with the
    built-in max's NaN-propagating helper, no generic tl.reduce in the kernel."""
    from compiler.algebra.user import fn
    mysum = compiler.summary("mysum", fields=("s",), identity=(0.0,), lift=lambda x: (x,),
                             combine=lambda a, b: (a.s + b.s,), finalize=lambda s: s.s, examples=20)
    mymax = compiler.summary("mymax", fields=("m",), identity=(-math.inf,), lift=lambda x: (x,),
                             combine=lambda a, b: (fn.where(a.m > b.m, a.m, b.m),), finalize=lambda s: s.m,
                             examples=20)
    src = "C[i,j] = mysum[k](A[i,k] * B[k,j])\nM[i] = mymax[k](A[i,k])"
    program = compiler.compile(src, summaries=[mysum, mymax], backend="triton")
    source = program.backend.source
    kernels = source[source.index("def einfold_"):]        # after the helpers
    assert "tl.dot(" in kernels and "_max_nan(" in kernels and "tl.reduce(" not in kernels
    inputs = {"A": randn(37, 19), "B": randn(19, 23)}
    got = program(**inputs)
    want = compiler.compile(src, summaries=[mysum, mymax], backend="reference")(**inputs)
    for g, w in zip(got, want):
        assert relative_error(g, w) < 1e-5


@pytest.mark.parametrize("split", [None, 3])
def test_non_commutative_affine_recurrence_in_order(split):
    program = compiler.compile("H[i] = affine[t](A[i,t], Bv[i,t])", summaries=[affine()], backend="reference")
    backend = TritonBackend(schedule(program.factorised, program.outputs, split))
    a = torch.rand(5, 23, generator=torch.Generator().manual_seed(0), device="cpu").to(DEVICE) * 1.2
    b = randn(5, 23)
    got = backend.run(Binder(program.checked, extents_of=program.factorised)({"A": a, "Bv": b}))["H"]
    h = torch.zeros(5, dtype=torch.float64)
    for t in range(23):
        h = a[:, t].cpu().double() * h + b[:, t].cpu().double()
    torch.testing.assert_close(got.cpu().double(), h, rtol=1e-4, atol=1e-4)


def test_user_summary_through_compile():
    from compiler.algebra.user import fn
    lse = compiler.summary("lse", fields=("m", "l"), identity=(-math.inf, 0.0), lift=lambda x: (x, 1.0),
                           combine=lambda a, b: (fn.max(a.m, b.m), a.l * fn.exp(a.m - fn.max(a.m, b.m))
                                                 + b.l * fn.exp(b.m - fn.max(a.m, b.m))),
                           finalize=lambda s: s.m + fn.log(s.l), commutative=True, examples=20)
    x = randn(4, 19) * 5
    program = compiler.compile("L[i] = lse[k](X[i,k])", summaries=[lse], backend="triton")
    torch.testing.assert_close(program(X=x).cpu(), torch.logsumexp(x.cpu(), 1))
    # exp(a.m - max(a.m, b.m)) is NaN for two padding elements, which a GPU tree reduction
    # combines: the generated combine passes the identity through
    assert "a_empty = (a_m == -float(\"inf\")) & (a_l == 0.0)" in program.source


def test_identity_guard_only_where_the_formulas_need_it():
    from compiler.algebra import BUILTINS
    from compiler.algebra.properties import exact_identity
    assert exact_identity(BUILTINS["sum"], ("acc",)) and exact_identity(BUILTINS["argmax"], ("m", "p"))
    assert exact_identity(affine(), ("A", "B"))
    ref, backend = triton_backend(LAYERNORM)            # Chan's merge guards its division itself
    backend.plan(Binder(ref.checked, extents_of=backend.program)({"X": randn(3, 5)}))
    # and a tile's moments come from tl.sum reductions (the moments' tile formula), not tl.reduce
    assert "a_empty" not in backend.source and "sum_count = tl.sum(" in backend.source
    assert "tl.reduce(" not in backend.source


# ---------------------------------------------------------------- IR the passes did not factorise
def test_checked_ir_with_composites_and_intermediates():
    p = unfactorised(ATTENTION, {"Q": randn(2, 3, 20, 8), "K": randn(2, 3, 37, 8), "V": randn(2, 3, 37, 6),
                                 "scale": 0.3})[1]
    assert len(p.kernels) == 1
    src = "S[i,m] = Q[i,k] * K[m,k]\nP[i,m] = softmax[m](S[i,m])\nO[i,j] = P[i,m] * V[m,j]"
    p = unfactorised(src, {"Q": randn(20, 8), "K": randn(37, 8), "V": randn(37, 6)})[1]
    assert len(p.kernels) == 1 and p.buffers == ()
    p = unfactorised(LAYERNORM, {"X": randn(5, 37)}, outputs=["mu", "Y"])[1]
    assert len(p.kernels) == 1


def test_reductions_without_a_common_output_index_are_materialised():
    ref, backend = assert_matches_oracle("Y[i] = X[i] / sum[j](X[j])", {"X": randn(37)})
    p = plan(backend, ref, {"X": randn(37)})
    assert kernel_names(p) == ["einfold_buf0", "einfold_Y"] and p.buffers == ("buf0",)
    assert "materialises sum[" in p.kernels[0].why          # over j (or i: passes may rename bound indices)
    src = "Y[i,j] = max[k](A[i,k]) * sum[k](B[j,k]) + C[i,j]"
    inputs = {"A": randn(5, 7), "B": randn(6, 7), "C": randn(5, 6)}
    assert_matches_oracle(src, inputs)          # factorised: one fold of (max, sum) over k per (i, j)
    backend, p = unfactorised(src, inputs)      # two folds, no common free index: two buffers
    assert len(p.kernels) == 3 and p.buffers == ("buf0", "buf1")


def test_outputs_with_different_grids_get_kernels_of_their_own():
    # fuse inlines S into Y, where it would be recomputed per tile of j: the first
    # kernel, which streams S once per row, also stores it in float32 for Y to read
    src = "S[i] = sum[j](X[i,j])\nY[j] = max[i](X[i,j] - S[i])"
    ref, backend = assert_matches_oracle(src, {"X": randn(9, 11)}, outputs=["S", "Y"])
    p = plan(backend, ref, {"X": randn(9, 11)})
    assert kernel_names(p) == ["einfold_S", "einfold_Y"] and p.buffers == ("buf0",)
    assert p.kernels[0].writes == ("S", "buf0")
    assert "reads buf0 (sum[j], stored by einfold_S) instead of recomputing it" in p.kernels[1].why
    # Y alone: nothing streams S once per row, so Y recomputes it (no buffer of its own)
    ref, backend = assert_matches_oracle(src, {"X": randn(9, 11)}, outputs=["Y"])
    assert kernel_names(plan(backend, ref, {"X": randn(9, 11)})) == ["einfold_Y"]


# ---------------------------------------------------------------- split reductions
def test_forced_split_plans_one_launch_whose_last_program_merges():
    inputs = {"Q": randn(2, 3, 1, 16), "K": randn(2, 3, 150, 16, seed=1), "V": randn(2, 3, 150, 8, seed=2),
              "scale": 0.25}
    ref, backend = assert_matches_oracle(ATTENTION, inputs, split=3)
    p = plan(backend, ref, inputs)
    assert kernel_names(p) == ["einfold_O_partial"]
    assert sorted(p.buffers) == ["einfold_O_arrivals", "einfold_O_state0_l", "einfold_O_state0_r",
                                 "einfold_O_state0_u"]
    assert "in order" in p.kernels[0].why and "O" in p.kernels[0].writes
    source = backend.source
    assert "rescale both sides to the common leader" in source
    # the merge is a function the last program of a tile calls; one launch, counters zeroed per call
    assert "einfold_O_merge[" not in source and "        einfold_O_merge(n_split, " in source
    assert 'tl.atomic_add(einfold_O_arrivals_ptr + tl.program_id(0) * einfold_O_arrivals_s0, 1, sem="acq_rel")' \
        in source
    # the counters are made at 0 once (scratch) and every launch leaves them at 0
    assert '"einfold_O_arrivals": torch.zeros(' in source
    assert "    tl.store(einfold_O_arrivals_ptr + tl.program_id(0) * einfold_O_arrivals_s0, 0)" in source


def test_a_kept_scratch_serves_repeated_split_launches():
    """The runner keeps a split kernel's partial states and arrival counters across
    calls: each launch must leave the counters at 0, or the next call's last program
    would never merge (or merge early)."""
    ref, backend = triton_backend(ATTENTION, split=3)
    for seed in range(3):
        inputs = {"Q": randn(2, 3, 1, 16, seed=seed), "K": randn(2, 3, 150, 16, seed=seed + 10),
                  "V": randn(2, 3, 150, 8, seed=seed + 20), "scale": 0.25}
        runner = backend.runner(Binder(ref.checked, extents_of=backend.program)(inputs))
        for _ in range(2):
            got = runner(inputs)["O"]
            torch.testing.assert_close(got.cpu(), ref(**inputs).cpu(), **TOL[torch.float32])


@pytest.mark.parametrize("src, shape", [("Y[i,j] = softmax[j](X[i,j])", (5, 300)),
                                        ("L = logsumexp[i](X[i])", (1000,)),
                                        ("I[i] = argmax[k](X[i,k], k)", (4, 50)),
                                        (LAYERNORM, (3, 70))])
def test_split_3_matches_the_oracle(src, shape):
    inputs = {"X": randn(*shape)}
    ref, backend = assert_matches_oracle(src, inputs, split=3)
    (name,) = kernel_names(plan(backend, ref, inputs))
    assert name.endswith("_partial") and name.removesuffix("_partial") + "_merge(" in backend.source


def test_split_of_dependent_folds_materialises_the_inner_one():
    # unfactorised softmax: the sum reads the max; the max becomes a buffer of its own split kernel
    src = "Y[i,j] = exp(X[i,j]) / sum[j](exp(X[i,j] - max[j](X[i,j]))) * exp(-max[j](X[i,j]))"
    checked = check(parse(src))
    backend = TritonBackend(schedule(checked, checked.outputs, 2))
    x = randn(4, 50)
    got = backend.run(bind(checked, {"X": x}))["Y"]
    torch.testing.assert_close(got.cpu(), torch.softmax(x.cpu(), 1), rtol=1e-4, atol=1e-6)
    p = backend.plan(bind(checked, {"X": x}))
    assert len(p.kernels) == 2 and "buf0" in p.buffers          # two split kernels, each merging itself


def test_auto_split_heuristic():
    assert auto_split(programs=8, tiles=512, sm_count=132) == 64       # decode: 8 heads, 32768 keys
    assert auto_split(programs=32, tiles=512, sm_count=132) == 33      # about 8 programs per SM
    assert auto_split(programs=16, tiles=96, sm_count=132) == 24       # every split streams >= 4 tiles
    assert auto_split(programs=8, tiles=128, sm_count=132) == 32       # decode: 8 heads, 8192 keys
    assert auto_split(programs=1024, tiles=512, sm_count=132) == 1      # enough programs already
    assert auto_split(programs=256, tiles=16, sm_count=132) == 1        # prefill: too short to be worth it
    assert auto_split(programs=8, tiles=10_000, sm_count=132) == 64     # capped
    assert auto_split(programs=1, tiles=10_000, sm_count=132) == 264    # a scalar: 2 programs per SM
    assert auto_split(programs=2, tiles=10_000, sm_count=132) == 132
    assert auto_split(programs=1, tiles=40, sm_count=132) == 10         # 40 tiles, one program: runs of 4
    assert auto_split(programs=64, tiles=40, sm_count=132) == 1         # ... but not beside a quarter of the SMs
    assert auto_split(programs=8, tiles=7, sm_count=132) == 1           # under two runs of 4
    assert auto_split(programs=1, tiles=40, sm_count=132, steps=500) == 40   # 40 long ones: one each
    assert auto_split(programs=16, tiles=512, sm_count=None) == 1       # no GPU: never by default


def test_bad_split_is_refused():
    with pytest.raises(BackendError, match="split"):
        triton_backend("Y[i] = X[i]", split=0)


# ---------------------------------------------------------------- source, cache, determinism
def test_source_is_deterministic_and_headed():
    a = triton_backend(ATTENTION)[1].source
    b = triton_backend(ATTENTION)[1].source
    assert a == b
    assert ATTENTION in a and "# passes (compiler.passes.PIPELINE): lower, fuse" in a
    compile(a, "<generated>", "exec")                       # valid Python


def test_module_cache_files_are_reused(tmp_path, monkeypatch):
    monkeypatch.setenv("EINFOLD_CACHE_DIR", str(tmp_path))
    ref, backend = triton_backend("Y[i] = X[i] * 2")
    run(backend, ref, {"X": randn(10)})
    files = sorted(tmp_path.glob("einfold_*.py"))
    assert len(files) == 1 and files[0].read_text() == backend.source
    stamp = files[0].stat().st_mtime_ns
    ref, again = triton_backend("Y[i] = X[i] * 2")
    run(again, ref, {"X": randn(10)})
    assert sorted(tmp_path.glob("einfold_*.py")) == files and files[0].stat().st_mtime_ns == stamp
    assert not list(tmp_path.glob(".*.tmp"))
    # a different specialisation is another file
    run(again, ref, {"X": randn(3000)})
    assert len(list(tmp_path.glob("einfold_*.py"))) == 2


def test_cache_write_is_atomic_under_concurrency(tmp_path, monkeypatch):
    from concurrent.futures import ThreadPoolExecutor
    monkeypatch.setenv("EINFOLD_CACHE_DIR", str(tmp_path))
    source = "X = 1\n" * 10000
    with ThreadPoolExecutor(8) as pool:
        paths = list(pool.map(lambda _: cache.write(source, "key"), range(16)))
    assert len(set(paths)) == 1 and paths[0].read_text() == source
    assert not list(tmp_path.glob(".*.tmp"))


def test_launch_overhead_probe_times_the_launcher():
    program = compiler.compile("Y[i] = X[i] * 2", backend="triton")
    assert program.backend.launch_overhead_probe({"X": randn(5)}, calls=3) > 0


def test_auto_backend_is_triton():
    program = compiler.compile("Y[i] = X[i] + 1")
    assert program.backend.name == "triton"
    if not torch.cuda.is_available():
        assert os.environ.get("TRITON_INTERPRET") == "1"


# ---------------------------------------------------------------- GPU, realistic sizes
gpu = pytest.mark.gpu


def bench_inputs(*shapes, dtype):
    return [torch.randn(*s, device="cuda", dtype=dtype) for s in shapes]


@gpu
def test_gpu_attention_bf16():
    q, k, v = bench_inputs((2, 8, 1024, 64), (2, 8, 1024, 64), (2, 8, 1024, 64), dtype=torch.bfloat16)
    program = compiler.compile(ATTENTION, backend="triton")
    out = program(Q=q, K=k, V=v, scale=0.125)
    want = torch.nn.functional.scaled_dot_product_attention(q, k, v, scale=0.125)
    torch.testing.assert_close(out, want, rtol=2e-2, atol=2e-2)
    assert len(program.plan(Q=q, K=k, V=v, scale=0.125).kernels) == 1


@gpu
def test_gpu_causal_attention_fp16():
    q, k, v = bench_inputs((1024, 64), (1024, 64), (1024, 64), dtype=torch.float16)
    out = compiler.compile(CAUSAL, backend="triton")(Q=q, K=k, V=v, scale=0.125)
    want = torch.nn.functional.scaled_dot_product_attention(q[None], k[None], v[None], scale=0.125,
                                                            is_causal=True)[0]
    torch.testing.assert_close(out, want, rtol=2e-2, atol=2e-2)


@gpu
def test_gpu_decode_uses_the_automatic_split():
    q, k, v = bench_inputs((1, 8, 1, 64), (1, 8, 32768, 64), (1, 8, 32768, 64), dtype=torch.bfloat16)
    program = compiler.compile(ATTENTION, backend="triton")
    out = program(Q=q, K=k, V=v, scale=0.125)
    want = torch.nn.functional.scaled_dot_product_attention(q.float(), k.float(), v.float(), scale=0.125)
    torch.testing.assert_close(out.float(), want, rtol=2e-2, atol=2e-2)
    names = kernel_names(program.plan(Q=q, K=k, V=v, scale=0.125))
    assert names == ["einfold_O_partial"]                       # its last programs merge: one launch


@gpu
def test_gpu_every_candidate_of_a_tuned_split_kernel_matches_float64():
    """A logsumexp over a vocabulary of logits (2048 rows: 32 programs, so the fold splits
    over v, with work enough to be tuned: tiles.TUNE_SPLIT_WORK) is autotuned over rows x
    vocabulary x depth tiles: every candidate, at a ragged vocabulary (the last split left
    without a tile at 128) and large logits, is as accurate as torch in bfloat16 against
    float64."""
    from compiler.backend.triton.launch import DirectLaunch
    g = torch.Generator(device=DEVICE).manual_seed(3)
    h = torch.randn(2048, 768, device=DEVICE, dtype=torch.bfloat16, generator=g)
    w = (0.5 * torch.randn(20011, 768, device=DEVICE, dtype=torch.bfloat16, generator=g))
    program = compiler.compile("lse[t] = logsumexp[v](sum[d](H[t, d] * W[v, d]))", backend="triton")
    want = torch.logsumexp(h.double() @ w.double().T, 1)
    bar = 2 * relative_error(torch.logsumexp((h @ w.T).float(), 1), want) + 2 * torch.finfo(torch.bfloat16).eps
    program(H=h, W=w)
    assert kernel_names(program.plan(H=h, W=w)) == ["einfold_lse_partial"]
    (entry,) = program.backend._built.values()
    (kernel,) = [k for k in entry[1].__globals__.values() if isinstance(k, DirectLaunch) and k.tuned]
    candidates = list(kernel.kernel.configs)
    assert len(candidates) > 1 and {c.kwargs["BLOCK_v"] for c in candidates} == {64, 128}
    try:
        for config in candidates:
            kernel.kernel.configs, kernel.kernel.cache, kernel.bound = [config], {}, {}
            ours = relative_error(program(H=h, W=w), want)
            assert ours <= bar, (str(config), ours, bar)
    finally:
        kernel.kernel.configs, kernel.kernel.cache, kernel.bound = candidates, {}, {}


@gpu
def test_gpu_layernorm_4096():
    (x,) = bench_inputs((4096, 4096), dtype=torch.float32)
    out = compiler.compile(LAYERNORM, backend="triton")(X=x)
    torch.testing.assert_close(out, torch.nn.functional.layer_norm(x, (4096,), eps=1e-5), rtol=1e-4, atol=1e-4)


@gpu
def test_gpu_matmul_and_softmax():
    a, b = bench_inputs((1000, 700), (700, 900), dtype=torch.float16)
    out = compiler.compile("C[i,j] = A[i,k] * B[k,j]", backend="triton")(A=a, B=b)
    torch.testing.assert_close(out, a @ b, rtol=2e-2, atol=2e-1)
    (x,) = bench_inputs((3000, 5000), dtype=torch.float32)
    out = compiler.compile("Y[i,j] = softmax[j](X[i,j])", backend="triton")(X=x)
    torch.testing.assert_close(out, torch.softmax(x, 1), rtol=1e-4, atol=1e-6)


def test_causal_interior_tiles_skip_the_predicate():
    """Only boundary tiles pay for the causal mask: tiles below the diagonal run
    without it, tiles above it are skipped, and the result is unchanged."""
    inputs = {"Q": randn(70, 16), "K": randn(70, 16, seed=1), "V": randn(70, 8, seed=2), "scale": 0.25}
    ref, backend = assert_matches_oracle(CAUSAL, inputs)
    source = backend.source
    interior = source[source.index("for start_m in range(0, mid_m"):source.index("# the boundary tiles")]
    boundary = source[source.index("# the boundary tiles"):]
    assert "<=" not in interior and "offs_m[None, :] <= offs_i[:, None]" in boundary
    assert "hi_m = tl.minimum(n_m, tl.max(offs_i, 0) + 1)" in source


@gpu
def test_gpu_offsets_beyond_2_pow_31_elements():
    """Addresses past 2**31 elements need 64-bit offsets (bf16: 4 GiB per tensor)."""
    n = 2**31 + 7
    x = torch.empty(n, device="cuda", dtype=torch.bfloat16)
    x[:16] = 1.5
    x[-16:] = -2.5
    y = compiler.compile("Y[i] = X[i] * 2.0", backend="triton")(X=x)
    assert float(y[0]) == 3.0 and float(y[-1]) == -5.0 and float(y[-16]) == -5.0
    del x, y
    rows = torch.empty(2, 2**30 + 3, device="cuda", dtype=torch.bfloat16)
    rows[0].fill_(0.0)
    rows[1].fill_(0.0)
    rows[1, -1] = 3.0                    # the last element, 2**31 + 5 elements from the start
    rows[0, 0] = 2.0
    top = compiler.compile("M[i] = max[j](X[i,j])", backend="triton")(X=rows)
    assert top.tolist() == [2.0, 3.0]


@gpu
def test_gpu_ragged_causal_batched_attention_matches_sdpa():
    """Ragged sizes keep the masks (1000 is no multiple of the tuned tiles)."""
    src = "O[b,h,i,j] = softmax[m](where(m <= i, Q[b,h,i,k] * K[b,h,m,k] * scale, -inf)) * V[b,h,m,j]"
    q, k, v = bench_inputs((2, 4, 1000, 64), (2, 4, 1000, 64), (2, 4, 1000, 64), dtype=torch.bfloat16)
    out = compiler.compile(src, backend="triton")(Q=q, K=k, V=v, scale=0.125)
    want = torch.nn.functional.scaled_dot_product_attention(q.double(), k.double(), v.double(), scale=0.125,
                                                            is_causal=True)
    assert float((out.double() - want).norm() / want.norm()) < 1e-2


@gpu
def test_gpu_fully_masked_rows_are_nan_and_the_rest_exact():
    src = "O[i,j] = softmax[m](where(m < i, S[i,m], -inf)) * V[m,j]"     # row 0 sees no m
    s, v = bench_inputs((300, 300), (300, 64), dtype=torch.float32)
    out = compiler.compile(src, backend="triton")(S=s, V=v)
    want = compiler.compile(src, backend="reference")(S=s.cpu().double(), V=v.cpu().double())
    assert torch.isnan(out[0]).all() and torch.isfinite(out[1:]).all()
    torch.testing.assert_close(out[1:].cpu().double(), want[1:], rtol=1e-4, atol=1e-4)


@gpu
def test_gpu_strided_inputs_and_forced_split():
    q, k, v = bench_inputs((3, 1, 64), (3, 5000, 64), (3, 64, 5000), dtype=torch.float16)
    v_t = v.transpose(1, 2)                                        # non-contiguous value tensor
    src = "O[h,i,j] = softmax[m](Q[h,i,k] * K[h,m,k] * scale) * V[h,m,j]"
    program = compiler.compile(src, backend="triton", split=7)
    out = program(Q=q, K=k, V=v_t, scale=0.125)
    assert [kk.name for kk in program.plan(Q=q, K=k, V=v_t, scale=0.125).kernels] == ["einfold_O_partial"]
    want = torch.nn.functional.scaled_dot_product_attention(q.double(), k.double(), v_t.double(), scale=0.125)
    torch.testing.assert_close(out.double(), want, rtol=2e-2, atol=2e-2)


def test_plan_lists_each_kernels_loops_in_nesting_order():
    from compiler.schedule import Loop
    attention = compiler.compile("O[i,j] = softmax[m](Q[i,k] * K[m,k] * scale) * V[m,j]\n"
                                 "L[i] = logsumexp[m](Q[i,k] * K[m,k] * scale)", outputs=["O", "L"])
    small = {"Q": torch.randn(5, 4), "K": torch.randn(7, 4), "V": torch.randn(7, 3), "scale": 0.5}
    (kernel,) = attention.plan(**small).kernels         # both outputs from one fold, in one kernel
    (loop,) = kernel.loops
    assert loop.indices == ("m",) and len(loop.folds) == 1 and loop.folds[0].startswith("fold")
    assert loop.inner == (Loop(("k",), ("sum",)),)      # the scores' contraction, inside the loop over m
    layernorm = compiler.compile("mu[i] = mean[j](X[i,j]); v[i] = mean[j]((X[i,j] - mu[i])**2)\n"
                                 "Y[i,j] = (X[i,j] - mu[i]) * rsqrt(v[i] + 1e-5)")
    (kernel,) = layernorm.plan(X=torch.randn(4, 9)).kernels
    assert [str(loop) for loop in kernel.loops] == [f"loop j: {kernel.loops[0].folds[0]}", "loop j (epilogue)"]
    split = compiler.compile(attention.text, outputs=["O"], split=4)
    (kernel,) = split.plan(**{**small, "K": torch.randn(700, 4), "V": torch.randn(700, 3)}).kernels
    streamed, merged = kernel.loops         # the program's chunk of m, then (its last program) the merge
    assert streamed.indices == ("m",) and (merged.indices, merged.folds) == ((), streamed.folds)


# ---------------------------------------------------------------- dtype policy of tl.dot operands
ALIBI = "O[b,h,i,j] = softmax[m](Q[b,h,i,k] * K[b,h,m,k] * scale - A[h] * abs(i - m)) * V[b,h,m,j]"


def gpu_source(source: str, **inputs) -> str:
    """The module a GPU would run for these (CPU) inputs."""
    program = compiler.compile(source, backend="triton")
    return program.backend.source_for(program.binder(inputs), sm_count=None)


def dots(module: str) -> list[str]:
    return [line.strip() for line in module.splitlines() if "tl.dot(" in line]


def test_a_float32_parameter_keeps_bfloat16_tensor_core_operands():
    # float32 slopes beside bfloat16 Q, K, V: both dots stay bf16 x bf16 (P cast to V's
    # dtype), no IEEE float32 dot; the result takes torch's promotion (float32)
    q, k, v = (torch.randn(1, 2, 64, 32, dtype=torch.bfloat16) for _ in range(3))
    module = gpu_source(ALIBI, Q=q, K=k, V=v, A=torch.rand(2), scale=0.2)
    assert len(dots(module)) == 2 and not any("input_precision" in d for d in dots(module))
    assert "p.to(tl.bfloat16)" in module
    assert "float results in torch.float32" in module
    a = torch.rand(2)
    on = {n: x.to(DEVICE) for n, x in dict(Q=q, K=k, V=v, A=a).items()}
    got = compiler.compile(ALIBI, backend="triton")(**on, scale=0.2)
    want = compiler.compile(ALIBI, backend="reference")(Q=q, K=k, V=v, A=a, scale=0.2)
    assert got.dtype == want.dtype == torch.float32
    torch.testing.assert_close(got.cpu(), want, **TOL[torch.bfloat16])


def test_a_float32_parameter_leaves_a_bfloat16_contraction_held_whole():
    # d = 128: a bf16 Q K^T holds k whole (one tl.dot per key tile), as without the float32
    # slopes; only an in-order float32 dot streams k in compensated tiles of 64
    q, k, v = (torch.randn(1, 2, 64, 128, dtype=torch.bfloat16) for _ in range(3))
    alibi = gpu_source(ALIBI, Q=q, K=k, V=v, A=torch.rand(2), scale=0.2)
    plain = gpu_source(ALIBI.replace(" - A[h] * abs(i - m)", ""), Q=q, K=k, V=v, scale=0.2)
    assert "for start_k" not in alibi and "for start_k" not in plain
    exact = gpu_source(ALIBI, Q=q.float(), K=k.float(), V=v.float(), A=torch.rand(2), scale=0.2)
    assert "for start_k" in exact


def test_float32_statistics_keep_a_gradient_programs_dots_in_bfloat16():
    # the saved row logsumexp is float32 beside bf16 tensors; every dot of dQ, dK, dV stays bf16
    causal = "O[b,h,i,j] = softmax[m](where(m <= i, Q[b,h,i,k] * K[b,h,m,k] * scale, -inf)) * V[b,h,m,j]"
    gradient = compiler.grad(causal, saved=True).text
    t = {n: torch.randn(1, 2, 64, 32, dtype=torch.bfloat16) for n in ("Q", "K", "V", "O", "dO")}
    module = gpu_source(gradient, **t, lse_O=torch.randn(1, 2, 64), scale=0.2)
    assert len(dots(module)) >= 4 and not any("input_precision" in d for d in dots(module))


def loop_loads(module: str, kernel: str, index: str) -> list[str]:
    """The tensor of each load in a step of `kernel`'s loop over `index` in `module` (a
    load reads `<tensor>_ptr` or a tile of addresses `<tensor>_tile`)."""
    body = module.split(f"def {kernel}(")[1].split("\n@triton")[0].split("\n\n\n")[0]
    header = re.search(rf"\n( *)for start_{index} in range\(", body)
    lines = body[header.end():].split("\n")[1:]
    deeper = header.group(1) + " "
    inside = itertools.takewhile(lambda line: line.startswith(deeper) or not line.strip(), lines)
    return [m.group(1) for line in inside for m in re.finditer(r"tl\.load\((\w+?)_(?:tile\w*|ptr)\b", line)]


def test_the_attention_backward_loads_each_tile_once_a_step():
    """dK and dV's loop over the queries reads Q for dK's sum (rows i) and for the
    scores' sum over k (columns i), dO for dV's sum and for dO V^T's sum over j: each
    index held whole by the grid and by the nested sum is one axis, so each tile is
    loaded once a step and read the other way as tl.trans (FlashAttention-2's loop).
    dQ's loop over the keys likewise loads K once, and dO not at all (once a program)."""
    gradient = compiler.grad(ATTENTION, saved=True)
    t = {n: torch.zeros(1, 1, 1, 1, dtype=torch.bfloat16).expand(2, 4, 1024, 128)
         for n in ("Q", "K", "V", "O", "dO")}
    module = gpu_source(gradient.text, **t, lse_O=torch.zeros(2, 4, 1024), scale=0.088)
    assert sorted(loop_loads(module, "einfold_dK", "i")) == ["Q", "buf0", "dO", "lse_O"]
    assert sorted(loop_loads(module, "einfold_dQ", "m")) == ["K", "V"]
    dk = module.split("def einfold_dK(")[1]
    assert re.search(r"tl\.dot\(\w+, tl\.trans\(x_Q\d*\), acc\)", dk)
    assert re.search(r"tl\.dot\(\w+, tl\.trans\(x_dO\d*\), acc_2\)", dk)
    assert "BLOCK_k2" not in module and "pid_k" not in module


@pytest.mark.parametrize("inner", ["sum[j](V[m,j] * V[m,j])", "max[j](V[m,j])"])
def test_a_nested_fold_over_the_grids_whole_index_reduces_that_tile(inner):
    """The grid holds j whole (the row statistics do not vary over it), and so does the
    fold over j nested in the loop over m: one axis, which the nested fold reduces (the
    lanes past j = 5 of the tile of 16 at its identity) and the values beside it keep."""
    src = f"O[i,j] = softmax[m](X[i,m] + {inner}) * (V[m,j] + X[i,m])"
    ref, backend = assert_matches_oracle(src, {"X": randn(70, 150), "V": randn(150, 5, seed=1)})
    assert "offs_j = tl.arange(0, BLOCK_j)" in backend.source and "BLOCK_j2" not in backend.source


def test_mixed_matrix_dtypes_promote_and_float32_dots_follow_torchs_tf32_setting():
    a = torch.randn(64, 32, dtype=torch.bfloat16)
    b = torch.randn(32, 48, dtype=torch.float32)
    matmul = torch.backends.cuda.matmul
    before = matmul.fp32_precision
    try:
        matmul.fp32_precision = "ieee"
        module = gpu_source("C[i,j] = A[i,k] * B[k,j]", A=a, B=b)
        assert dots(module) and all('input_precision="ieee"' in d for d in dots(module))
        matmul.fp32_precision = "tf32"
        module = gpu_source("C[i,j] = A[i,k] * B[k,j]", A=a, B=b)
        assert dots(module) and all('input_precision="tf32"' in d for d in dots(module))
        # bf16 x bf16 has no precision to choose
        module = gpu_source("C[i,j] = A[i,k] * B[k,j]", A=a, B=b.bfloat16())
        assert dots(module) and not any("input_precision" in d for d in dots(module))
    finally:
        matmul.fp32_precision = before


@gpu
def test_gpu_alibi_with_float32_slopes_and_bfloat16_tensors():
    q, k, v = bench_inputs((2, 8, 1000, 64), (2, 8, 1000, 64), (2, 8, 1000, 64), dtype=torch.bfloat16)
    a = torch.rand(8, device="cuda")
    got = compiler.compile(ALIBI, backend="triton")(Q=q, K=k, V=v, A=a, scale=0.125)
    i = torch.arange(1000, device="cuda")
    bias = -a.double()[:, None, None] * (i[:, None] - i[None, :]).abs().double()
    want = torch.softmax(q.double() @ k.double().transpose(-1, -2) * 0.125 + bias, -1) @ v.double()
    assert got.dtype == torch.float32
    torch.testing.assert_close(got.double(), want, rtol=2e-2, atol=2e-2)


# ---------------------------------------------------------------- integer folds
INTEGER_FOLDS = [
    # sums past 2**24 (float32's exact integers) and 2**31 (int32's range)
    ("S[i] = sum[j](where(X[i,j] > 0, j * j, 0))", lambda x, j: (torch.where(x > 0, j * j, 0)).sum(1)),
    ("S[i] = sum[j](where(X[i,j] > 0, 3000000000, 0) * (j + 1))",
     lambda x, j: (torch.where(x > 0, 3000000000, 0) * (j + 1)).sum(1)),
    ("M[i] = max[j](where(X[i,j] > 0, j * 1000000007, -j))",
     lambda x, j: torch.where(x > 0, j * 1000000007, -j).amax(1)),
    ("M[i] = min[j](where(X[i,j] > 0, -j * 1000000007, j))",
     lambda x, j: torch.where(x > 0, -j * 1000000007, j).amin(1)),
    # an integral field beside a float one in one derived summary (the generic fold)
    ("S[i] = sum[j](X[i,j]); C[i] = sum[j](where(X[i,j] > 0, j * 100003, 0))",
     lambda x, j: (torch.where(x > 0, j * 100003, 0)).sum(1)),
]


@pytest.mark.parametrize("split", [None, 3])
@pytest.mark.parametrize("k", range(len(INTEGER_FOLDS)))
def test_integer_folds_are_exact_in_64_bits(k, split):
    """An integer sum, max or min folds in int64 (the language types it int): exact
    where float32 state would round (past 2**24) and int32 would wrap (past 2**31),
    split or not, alone or as a field of a derived summary."""
    src, want_of = INTEGER_FOLDS[k]
    x = randn(3, 3001)
    x[1] = x[1].abs()                     # a row where every position passes
    ref, backend = triton_backend(src, **({"split": split} if split else {}))
    got = run(backend, ref, {"X": x})
    got = got[-1] if isinstance(got, tuple) else got
    want = want_of(x.cpu(), torch.arange(x.shape[1], dtype=torch.int64))
    assert got.dtype == torch.int64 and want.abs().max() > 2 ** 31
    assert torch.equal(got.cpu(), want), (got, want)


def test_an_empty_integer_max_or_min_saturates_on_every_backend():
    for src, limit in (("M[i] = max[j](where(X[i,j] > 0, j, 0))", torch.iinfo(torch.int64).min),
                       ("M[i] = min[j](where(X[i,j] > 0, j, 0))", torch.iinfo(torch.int64).max)):
        for backend in ("reference", "triton"):
            got = compiler.compile(src, backend=backend)(X=randn(2, 0))
            assert got.tolist() == [limit, limit], (src, backend)


@pytest.mark.parametrize("backend", ["reference", "triton"])
def test_integer_arithmetic_and_constant_folding_follow_the_documented_types(backend):
    """Index arithmetic past 2**31 is computed in 64 bits; `**` and `/` give floats
    even where both operands are integer literals (2 ** -1 is 0.5, not 0)."""
    x = randn(5).abs()
    i = torch.arange(5, dtype=torch.int64)
    wide = compiler.compile("Y[i] = where(X[i] > 0, i * 100000 * 100000 + 1, -i)", backend=backend)(X=x)
    assert wide.dtype == torch.int64 and torch.equal(wide.cpu(), i * 10 ** 10 + 1)
    for src in ("Y[i] = where(X[i] > 0, i, 0) * 2 ** -1", "Y[i] = where(X[i] > 0, i, 0) * (1 / 2)"):
        half = compiler.compile(src, backend=backend)(X=x)
        assert half.dtype.is_floating_point and torch.equal(half.cpu().double(), i / 2), src


@gpu
def test_gpu_split_scratch_is_kept_per_stream():
    """Calls of one split program on two streams at once each keep their own scratch;
    with one scratch the counters of concurrent launches would mix and merge early."""
    g = torch.Generator(device="cuda").manual_seed(0)
    q = torch.randn(1, 8, 1, 128, device="cuda", generator=g)
    k, v = (torch.randn(1, 8, 65536, 128, device="cuda", generator=g) for _ in range(2))
    program = compiler.compile(ATTENTION)
    assert "_partial" in program.plan(Q=q, K=k, V=v, scale=0.088).kernels[0].name
    want = torch.softmax((q.double() @ k.double().transpose(-1, -2)) * 0.088, -1) @ v.double()
    streams = [torch.cuda.Stream(), torch.cuda.Stream()]
    outs = []
    for _ in range(4):
        for s in streams:
            with torch.cuda.stream(s):
                outs.append(program(Q=q, K=k, V=v, scale=0.088))
    torch.cuda.synchronize()
    for out in outs:
        assert ((out.double() - want).norm() / want.norm()).item() < 1e-5


# ---------------------------------------------------------------- divisors beside tl.dot
# The Einstein reading of a difference of two attentions whose k is left free: k is summed
# over the whole right-hand side, so each k has its own softmax (its statistics fold
# inside the loop over k) and the value a weight multiplies is V[m,j] / D[i] with D the
# row's statistics at that k.  The divisor rides beside tl.dot(P, V) on the result; as a
# [rows, columns, keys] broadcast product its tile was 64^3 elements a program, which
# LLVM took minutes to compile on the H200 (session 25).
PER_K_DIFFERENCE = ("O[h,i,j] = softmax[m](Q1[h,i,k] * K1[h,m,k] * scale) * V[h,m,j]"
                    " - lam * softmax[m](Q2[h,i,k] * K2[h,m,k] * scale) * V[h,m,j]")


def test_a_value_divided_by_a_row_statistic_takes_tl_dot_with_the_divisor_beside():
    q1, k1, q2, k2, v = (torch.randn(1, 64, 16, dtype=torch.bfloat16) for _ in range(5))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", compiler.ImplicitSumWarning)
        module = gpu_source(PER_K_DIFFERENCE, Q1=q1, K1=k1, Q2=q2, K2=k2, V=v, scale=0.3, lam=0.5)
        inputs = {"Q1": randn(2, 5, 3), "K1": randn(2, 37, 3, seed=1), "Q2": randn(2, 5, 3, seed=2),
                  "K2": randn(2, 37, 3, seed=3), "V": randn(2, 37, 7, seed=4), "scale": 0.3, "lam": 0.5}
        ref, _ = assert_matches_oracle(PER_K_DIFFERENCE, inputs)
    # the weights' product with V, scaled on its result: acc = acc * alpha + (tl.dot(p, V) * t)
    weighted = [d for d in dots(module) if re.search(r"tl\.dot\(p(_\d+)?\.to\(", d)]
    assert len(weighted) == 2 and all(re.search(r"tl\.dot\([^()]*\([^()]*\)[^()]*\) \* \w+", d)
                                      for d in weighted), dots(module)
    assert "[:, None, :]" not in module                    # no [rows, columns, keys] product
    d = {n: x.double() if isinstance(x, torch.Tensor) else x for n, x in inputs.items()}
    want = sum(torch.einsum("him,hmj->hij", torch.softmax(torch.einsum("hi,hm->him", d["Q1"][..., c],
                                                                       d["K1"][..., c]) * 0.3, -1), d["V"])
               - 0.5 * torch.einsum("him,hmj->hij", torch.softmax(torch.einsum("hi,hm->him", d["Q2"][..., c],
                                                                               d["K2"][..., c]) * 0.3, -1), d["V"])
               for c in range(3))
    torch.testing.assert_close(ref(**inputs).double(), want)



@pytest.mark.parametrize("source, shapes", [
    ("C[i,j] = sum[b,k](A[b,k,i] * B[b,k,j])", {"A": (3, 37, 50), "B": (3, 37, 21)}),
    ("C[i,j] = sum[b,k](A[b,k,i] * B[j,k,b])", {"A": (2, 70, 33), "B": (19, 70, 2)}),
    ("C[i,j] = exp(sum[b,k](A[b,k,i] * B[b,k,j]) / 8)", {"A": (1, 16, 16), "B": (1, 16, 17)})])
def test_a_contraction_over_two_indices_is_a_matrix_product(source, shapes):
    # a weight gradient summed over batch and rows (dW[v, d] = sum[b, t](dZ[b, t, v] *
    # H[b, t, d])): one reduced index one value at a time beside a tl.dot over the other
    g = torch.Generator().manual_seed(0)
    inputs = {n: torch.randn(*s, generator=g) for n, s in shapes.items()}
    program = compiler.compile(source, backend="triton")
    got = program(**inputs)
    assert "tl.dot(" in program.source
    want = compiler.compile(source, backend="reference")(**{n: v.double() for n, v in inputs.items()})
    assert ((got.double() - want).abs().max() / want.abs().max()).item() < 1e-5
