"""Regressions for the triton backend's crash classes measured on the GPU (issue 9).

Each class has a test that runs the generated kernels under Triton's interpreter
(tiny, ragged sizes) against the float64 oracle, except the autotuning class,
which only shows on a GPU: its test builds the module a GPU would run
(`TritonBackend.source_for`) and checks the generated source itself.

1. outputs of different rank sharing one fold (attention's O with its row
   logsumexp L, or with the probabilities P): KeyError in the emitter;
2. a chain whose reduced index is renamed between statements: a field of a fold
   read outside the loop that computes it (UnboundLocalError in the kernel);
3. autotune configs that do not bind every BLOCK_* constexpr (GPU only);
4. generated names colliding with user names (n_val, n_s0, pid_ptr, ...);
5. an index of extent 0 (unmasked loads: a segfault);
6. a streamed row sum read by several later loops: Triton 3.6's thread-locality
   rewrite of `acc += tl.sum(tile)` asserts its loop result has one use (GPU only;
   a streamed sum, max or min now keeps one running value per lane of the tile);
and numpy's RuntimeWarnings from identity padding under the interpreter."""
import ast
import re
import warnings

import pytest
import torch

import compiler
from compiler.backend.triton import TritonBackend
from compiler.schedule import schedule
from compiler.bind import Binder, Binding
from compiler.ir import accesses, walk
from compiler.ops import FLOAT
from compiler.random_inputs import _dimension, random_inputs
from test_passes import PROGRAMS as CORPUS

pytestmark = pytest.mark.filterwarnings("ignore:einfold. no CUDA tensors")

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
TOL = {torch.float32: {"rtol": 1e-4, "atol": 1e-4}, torch.float16: {"rtol": 2e-2, "atol": 2e-2},
       torch.bfloat16: {"rtol": 3e-2, "atol": 3e-2}}

ATTENTION = "O[i,j] = softmax[m](Q[i,k] * K[m,k] * scale) * V[m,j]"
ATTENTION_LSE = ("S[i,m] = Q[i,k] * K[m,k] * scale\n"
                 "O[i,j] = softmax[m](S[i,m]) * V[m,j]\n"
                 "L[i] = logsumexp[m](S[i,m])")
ATTENTION_PROBS = ("S[i, m] = Q[i, k] * K[m, k]\n"           # docs/language.md's outputs=["O", "P"] example
                   "P[i, m] = softmax[m](S[i, m])\n"
                   "O[i, j] = P[i, m] * V[m, j]")
LAYERNORM = ("mu[i] = sum[j](X[i,j]) / len(j); var[i] = sum[j]((X[i,j] - mu[i]) ** 2) / len(j)\n"
             "Y[i,j] = (X[i,j] - mu[i]) * rsqrt(var[i] + 1e-5)")

# the realistic programs that crashed on the GPU (issue 9), at tiny sizes for the interpreter
GPU_CRASHES = {
    "cosine_attention": ("O[i,j] = softmax[m](sum[c](Q[i,c] * K[m,c]) / (sqrt(sum[c](Q[i,c] * Q[i,c])) * "
                         "sqrt(sum[c](K[m,c] * K[m,c]))) * 8.0) * V[m,j]"),
    "rotary_attention": ("O[i,j] = softmax[m](sum[c]((Q[i,c] * Cq[i,c] + R[i,c] * Sq[i,c]) * "
                         "(K[m,c] * Ck[m,c] + RK[m,c] * Sk[m,c])) * scale) * V[m,j]"),
    "key_grid_attention": "O[i,j] = softmax[m,n](Q[i,c] * K[m,n,c]) * V[m,n,j]",
    "softmax_entropy": "H[i] = -sum[j](softmax[j](X[i,j]) * log(softmax[j](X[i,j])))",
    "softmax_kl": "D[i] = sum[j](softmax[j](X[i,j]) * (log(softmax[j](X[i,j])) - log(softmax[j](Y[i,j]))))",
    "label_smoothing": "L[i] = logsumexp[v](X[i,v]) - (1 - eps) * X[i,v] * T[i,v] - eps * mean[v](X[i,v])",
    "bottom_right_causal": ("O[i,j] = softmax[m](where(m <= i + len(m) - len(i), Q[i,c] * K[m,c] * scale, "
                            "-inf)) * V[m,j]"),
    # found by the generated-program test on the GPU: each row sum is read by every later loop
    "repeated_centring": ("A[i,v] = X[i,v]; R0[i] = sum[v](A[i,v]); B0[i,v] = A[i,v] - R0[i]\n"
                          "R1[i] = sum[v](B0[i,v]); B1[i,v] = B0[i,v] - R1[i]\n"
                          "R2[i] = sum[v](B1[i,v]); B2[i,v] = B1[i,v] - R2[i]"),
}


@pytest.fixture(autouse=True)
def _cache_dir(tmp_path_factory, monkeypatch):
    monkeypatch.setenv("EINFOLD_CACHE_DIR", str(tmp_path_factory.getbasetemp() / "einfold-cache"))


def backend_for(src, outputs=None, split=None):
    ref = compiler.compile(src, backend="reference", outputs=outputs)
    if split is None:
        program = compiler.compile(src, backend="triton", outputs=outputs)
        return ref, program.backend
    return ref, TritonBackend(schedule(ref.factorised, ref.outputs, split))


def inputs_for(ref, sizes, dtype=torch.float32, seed=0):
    extents = {ix: sizes.get(ix, 5) for ix, _ in ref.checked.extents}
    return random_inputs(ref.checked, extents, dtype=dtype, seed=seed, device=DEVICE)


def assert_matches_oracle(src, inputs, outputs=None, split=None):
    """The triton backend against the oracle; returns (oracle program, backend, binding)."""
    ref, backend = backend_for(src, outputs, split)
    binding = Binder(ref.checked, extents_of=backend.program)(inputs)
    got = backend.run(binding)
    shapes = {name: [binding.extents[i] for i in ref.checked.statement(name).indices] for name in ref.outputs}
    results = ref(**inputs)           # every output, the non-empty ones beside empty ones included
    want = dict(zip(ref.outputs, results if isinstance(results, tuple) else (results,)))
    for name in ref.outputs:
        g = got[name]
        assert list(g.shape) == shapes[name], name
        assert g.dtype == binding.dtype or ref.checked.statement(name).dtype != "float"
        torch.testing.assert_close(g.cpu(), want[name].cpu(), equal_nan=True, **TOL.get(g.dtype, {}))
    return ref, backend, binding


# ---------------------------------------------------------------- 1. outputs of different rank, one fold
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("src, outputs", [(ATTENTION_LSE, ["O", "L"]), (ATTENTION_PROBS, ["O", "P"]),
                                          (ATTENTION_PROBS, ["P"])])
def test_outputs_of_different_rank_sharing_a_fold(src, outputs, dtype):
    ref = compiler.compile(src, backend="reference", outputs=outputs)
    inputs = inputs_for(ref, {"i": 7, "m": 11, "k": 3, "j": 2}, dtype)
    ref, backend, binding = assert_matches_oracle(src, inputs, outputs)
    plan = backend.plan(binding)                                     # plan() and the dump work too
    assert {w for k in plan.kernels for w in k.writes} >= set(outputs)
    assert "def launch(" in backend.source_for(binding, sm_count=132)


def test_row_logsumexp_joins_the_attention_kernel_in_either_order():
    # the row statistic L[i] projects the fold the output O[i, j] streams: one kernel, one
    # pass over m, whichever statement the text gives first; L is stored by the programs
    # of the first tile of j
    scores, output, statistic = ATTENTION_LSE.split("\n")
    plans = []
    for src in (ATTENTION_LSE, f"{scores}\n{statistic}\n{output}"):
        ref = compiler.compile(src, backend="reference", outputs=["O", "L"])
        _, backend, binding = assert_matches_oracle(src, inputs_for(ref, {"i": 3, "m": 5, "j": 37}), ["O", "L"])
        (kernel,) = backend.plan(binding).kernels
        assert set(kernel.writes) == {"O", "L"}
        assert backend.source.count("for start_m in range(") == 1
        plans.append(str(backend.plan(binding)))
    assert plans[0] == plans[1]


# ---------------------------------------------------------------- 2. a reduced index renamed along a chain
@pytest.mark.parametrize("src", ["P[x,y] = softmax[y](S[x,y])\nZ[u,v] = P[u,w] * C[w,v]",
                                 "P[x,y] = softmax[y](S[x,y])\nZ[x,v] = P[x,y] * C[y,v]",
                                 "P[x,y] = softmax[y](S[x,y])\nZ[u,v] = P[u,w] * C[w,v] + max[w](P[u,w])"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_renamed_reduced_index_in_a_chain(src, dtype):
    ref = compiler.compile(src, backend="reference")
    assert_matches_oracle(src, inputs_for(ref, {"x": 5, "u": 5, "y": 19, "w": 19, "v": 3}, dtype))


# ---------------------------------------------------------------- 3. autotune configs bind every constexpr
def launch_problems(source: str) -> list[str]:
    """Parse a generated module: for every launched kernel, every autotune candidate
    (or the one untuned launch) together with the launch's keyword arguments binds
    each `tl.constexpr` parameter of the kernel exactly once and nothing else; the
    grid reads only bound tiles; every autotuned kernel is launched."""
    tree = ast.parse(source)
    declared, configs, problems = {}, {}, []
    for node in tree.body:
        if not isinstance(node, ast.FunctionDef):
            continue
        if any(ast.unparse(d) == "triton.jit" for d in node.decorator_list):
            declared[node.name] = {a.arg for a in node.args.args
                                   if a.annotation is not None and ast.unparse(a.annotation) == "tl.constexpr"}
        for d in node.decorator_list:
            if isinstance(d, ast.Call) and ast.unparse(d.func) == "triton.autotune":
                kw = {k.arg: k.value for k in d.keywords}
                configs[node.name] = [ast.literal_eval(c.args[0]) for c in kw["configs"].elts]
                keys = ast.literal_eval(kw["key"])
                params = {a.arg for a in node.args.args}
                if not set(keys) <= params:
                    problems.append(f"{node.name}: autotune key {keys} names no parameter")
    launch = next(n for n in tree.body if isinstance(n, ast.FunctionDef) and n.name == "launch")
    grids = {}
    for n in ast.walk(launch):
        if isinstance(n, ast.Assign) and isinstance(n.value, ast.Lambda):
            grids[n.targets[0].id] = {s.slice.value for s in ast.walk(n.value.body)
                                      if isinstance(s, ast.Subscript) and ast.unparse(s.value) == "META"}
    launched = set()
    for call in ast.walk(launch):
        if not (isinstance(call, ast.Call) and isinstance(call.func, ast.Subscript)
                and isinstance(call.func.value, ast.Name) and call.func.value.id in declared):
            continue
        name = call.func.value.id
        launched.add(name)
        kwargs = {k.arg for k in call.keywords}
        grid_reads = grids.get(ast.unparse(call.func.slice), set())
        for c, cfg in enumerate(configs.get(name, [{}])):
            bound = set(cfg) | kwargs
            if declared[name] - bound:
                problems.append(f"{name} candidate {c}: {sorted(declared[name] - bound)} unbound")
            if set(cfg) & kwargs:
                problems.append(f"{name} candidate {c}: {sorted(set(cfg) & kwargs)} bound twice")
            if bound - declared[name]:
                problems.append(f"{name} candidate {c}: binds {sorted(bound - declared[name])}, not declared")
            if grid_reads - bound:
                problems.append(f"{name} candidate {c}: the grid reads unbound {sorted(grid_reads - bound)}")
    problems += [f"{k} is autotuned but never launched" for k in configs if k not in launched]
    return problems


def meta_binding(src, sizes, dtype, outputs=None, split=None):
    """A backend and a binding of shape-only (meta) tensors, built directly (the
    binder takes tensors with data only): modules for large GPU shapes are
    generated without allocating anything.  Nothing runs on it."""
    ref, backend = backend_for(src, outputs, split)
    extents = {ix: sizes.get(ix, 64) for ix, _ in ref.checked.extents}
    inputs = {}
    for decl in ref.checked.inputs:
        if decl.rank == 0:
            inputs[decl.name] = 0.5
            continue
        access = next(n for st in ref.checked.statements for n in accesses(st.expr) if n.tensor == decl.name)
        by_symbol = {symbol: extents[ix] for ix, symbol in ref.checked.extents}
        shape = [_dimension(ref.checked, access, d, by_symbol) for d in range(access.rank)]
        # positions (an input read as a subscript) are integers
        inputs[decl.name] = torch.empty(shape, dtype=dtype if decl.dtype == FLOAT else torch.int64, device="meta")
    return backend, Binding(inputs, extents, dtype, torch.device("cpu"),
                            {decl.name: decl.dtype for decl in ref.checked.inputs})


def test_the_launch_checker_finds_an_unbound_tile():
    backend, binding = meta_binding(ATTENTION, {"i": 8192, "m": 1000}, torch.float16)
    source = backend.source_for(binding, sm_count=132)
    assert "@triton.autotune(" in source and launch_problems(source) == []
    doctored = re.sub(r"'BLOCK_j': \d+, ", "", source)
    assert doctored != source and any("'BLOCK_j'] unbound" in p for p in launch_problems(doctored))


GPU_SIZES = {"i": 300, "m": 700, "n": 40, "c": 64, "j": 64, "v": 5000}
SOURCE_CASES = [(name, src, {}) for name, src in CORPUS.items()]
SOURCE_CASES += [(name, src, GPU_SIZES) for name, src in GPU_CRASHES.items()]
SOURCE_CASES += [
    ("attention_lse", ATTENTION_LSE, {"i": 1000, "m": 1000}),
    ("renamed_chain", "P[x,y] = softmax[y](S[x,y])\nZ[u,v] = P[u,w] * C[w,v]", {"x": 512, "u": 512}),
    ("chunked_prefill", GPU_CRASHES["bottom_right_causal"], {"i": 256, "m": 4096, "c": 128, "j": 128}),
    ("matmul", "C[i,j] = A[i,k] * B[k,j]", {"i": 1000, "j": 1000, "k": 1000}),
    ("batched_decode", "O[b,h,i,j] = softmax[m](Q[b,h,i,k] * K[b,h,m,k] * scale) * V[b,h,m,j]",
     {"b": 64, "h": 64, "i": 1, "m": 32768}),
]
# the automatic split (sm_count given, few programs, a long reduced axis) at a small head dimension
AUTO_SPLIT = [("decode_head_dim_8", "O[h,i,j] = softmax[m](Q[h,i,k] * K[h,m,k] * scale) * V[h,m,j]",
               {"h": 8, "i": 1, "m": 32768, "k": 8, "j": 8}),
              ("decode_head_dim_16", ATTENTION, {"i": 1, "m": 65536, "k": 16, "j": 16}),
              ("long_logsumexp", "L[i] = logsumexp[j](X[i,j])", {"i": 4, "j": 1 << 20}),
              # a scalar result: its one program splits
              ("scalar_sum", "L[] = sum[t](X[t] * X[t])", {"t": 1 << 22}),
              # a scalar of a few long rows (a loss over 4 rows of 1M logits; the same from hidden
              # states, a contraction nested in the logsumexp): the rows' kernel splits each row
              ("scalar_loss", "L[] = mean[t](logsumexp[v](Z[t,v]))", {"t": 4, "v": 1 << 20}),
              ("scalar_linear_loss", "L[] = mean[t](logsumexp[v](sum[k](H[t,k] * W[v,k])))",
               {"t": 4, "v": 32000, "k": 2048})]


@pytest.mark.parametrize("dtype", [torch.float16, torch.float32])
@pytest.mark.parametrize("split", [None, 4])
@pytest.mark.parametrize("name, src, sizes", SOURCE_CASES + AUTO_SPLIT,
                         ids=[case[0] for case in SOURCE_CASES + AUTO_SPLIT])
def test_every_candidate_binds_every_constexpr(name, src, sizes, split, dtype):
    outputs = ["O", "L"] if name == "attention_lse" else None
    backend, binding = meta_binding(src, sizes, dtype, outputs, split)
    gpu = backend.source_for(binding, sm_count=132)
    assert launch_problems(gpu) == []
    if (name, src, sizes) in AUTO_SPLIT and split is None:
        assert "_partial[" in gpu and "_merge(" in gpu          # the automatic split happened (one launch)
    if split is None:
        from dataclasses import replace
        sig = backend.signature(binding, backend._extents(binding))
        interpreted = backend.build(replace(sig, interpret=True, sm_count=None)).source
        assert "@triton.autotune" not in interpreted and launch_problems(interpreted) == []


def test_a_scalar_of_rows_that_fold_others_makes_the_rows_in_a_kernel_of_their_own():
    """A scalar loss over 8k rows of 32k logits was one program holding a [8192, 8192]
    tile (a BackendError), then one program streaming row tiles, split over the rows:
    now a kernel whose grid is the rows folds each row's logits, tile by tile of v, and
    stores the 8k values the scalar then folds."""
    backend, binding = meta_binding("L[] = mean[t](logsumexp[v](Z[t,v]))", {"t": 8192, "v": 32000},
                                    torch.bfloat16)
    rows, scalar = backend.specialised_for(binding, sm_count=132).kernels
    assert [t.index for t in rows.grid] == ["t"] and not scalar.grid
    assert "for start_v in range(0, n_v, BLOCK_v):" in backend.source_for(binding, sm_count=132)


@pytest.mark.parametrize("split", [None, 3])
@pytest.mark.parametrize("src, sizes", [("L[] = mean[t](logsumexp[v](Z[t,v]))", {"t": 5, "v": 9000}),
                                        ("L[] = sum[t](logsumexp[v](sum[k](H[t,k] * W[v,k])))",
                                         {"t": 7, "v": 300, "k": 5})],
                         ids=["scalar_loss", "scalar_linear_loss"])
def test_scalar_results_of_nested_streamed_folds(src, sizes, split):
    """Scalar results whose fold streams a nested one over several tiles (v = 9000: two
    tiles of 8192 a row), whole and split over programs, against the oracle."""
    ref = compiler.compile(src, backend="reference")
    assert_matches_oracle(src, inputs_for(ref, sizes), split=split)


SWIGLU_BLOCK = ("Y[i,e] = sum[f](silu(sum[d](X[i,d] * W1[f,d])) * sum[d](X[i,d] * W3[f,d]) * W2[e,f])",
                "H[i,f] = silu(sum[d](X[i,d] * W1[f,d])) * sum[d](X[i,d] * W3[f,d])\nY[i,e] = H[i,f] * W2[e,f]")


@pytest.mark.parametrize("src", SWIGLU_BLOCK, ids=["inline", "statements"])
@pytest.mark.parametrize("sizes, kernels", [({"i": 3, "f": 5, "d": 7, "e": 6}, 1),
                                            ({"i": 3, "f": 5, "d": 700, "e": 300}, 2)],
                         ids=["recomputed", "stored"])
def test_a_contraction_chained_behind_another_is_stored_where_recomputing_costs_more(src, sizes, kernels):
    """The SwiGLU block: one kernel per (i, e) tile recomputes silu(X W1) * (X W3) for every
    tile of e.  Where e spans several tiles and d is long (recompute_costs), the schedule
    stores it once (a kernel of its own) and the block is a matrix product by W2; else
    one fused kernel.  Either spelling, either plan, against the oracle."""
    ref = compiler.compile(src, backend="reference")
    inputs = inputs_for(ref, sizes)
    inputs["X"] = inputs["X"] / sizes["d"] ** 0.5        # unit-sized gates: Y does not cancel to noise
    assert_matches_oracle(src, inputs)
    program = compiler.compile(src, backend="triton")
    plan = program.plan(**inputs)
    assert len(plan.kernels) == kernels
    if kernels == 2:
        assert "whose tiles of e would each recompute it" in plan.kernels[0].why
    assert "materialised (for the longer extents)" in str(program.schedule)


RMS_WEIGHT_GRADIENT = ("dG[k] = sum[i](dY[i,k] * X[i,k] * rsqrt(mean[n](X[i,n] ** 2) + eps))",
                       "R[i] = rsqrt(mean[n](X[i,n] ** 2) + eps)\ndG[k] = sum[i](dY[i,k] * X[i,k] * R[i])")


@pytest.mark.parametrize("src", RMS_WEIGHT_GRADIENT, ids=["inline", "statements"])
@pytest.mark.parametrize("sizes, kernels", [({"i": 5, "k": 7, "n": 7}, 1), ({"i": 5, "k": 700, "n": 700}, 2)],
                         ids=["recomputed", "stored"])
def test_a_row_statistic_nested_in_a_column_sum_is_stored_where_its_tiles_would_recompute_it(src, sizes, kernels):
    """RMSNorm's weight gradient written directly: the row statistic nested in the sum
    over rows varies over no column, so a kernel over tiles of the columns recomputes it
    for each (35 ms where torch.compile takes 0.14, H200, 16384 x 4096); where the columns
    span several tiles it is a buffer of one value a row, made once.  The statistic
    inline or as a statement of its own: one plan."""
    ref = compiler.compile(src, backend="reference")
    inputs = inputs_for(ref, sizes)
    assert_matches_oracle(src, inputs)
    plan = compiler.compile(src, backend="triton").plan(**inputs)
    assert len(plan.kernels) == kernels
    if kernels == 2:
        assert plan.buffers and "whose tiles of k would each recompute it" in plan.kernels[0].why


@pytest.mark.parametrize("outputs", [["S", "Y"], ["Y", "S"]])
def test_an_elementwise_output_is_stored_by_the_kernel_of_its_row_statistic(outputs):
    """Residual + RMSNorm with both results: S = X + R is stored in the epilogue of the
    kernel that streams the row's mean square (one pass over the rows, as fused libraries
    do), not by a kernel of its own that writes what the other recomputes."""
    src = "S[i,k] = X[i,k] + R[i,k]\nY[i,k] = S[i,k] * rsqrt(mean[n](S[i,n] ** 2) + eps) * G[k]"
    ref = compiler.compile(src, backend="reference", outputs=outputs)
    inputs = inputs_for(ref, {"i": 7, "k": 300}, torch.float16)
    assert_matches_oracle(src, inputs, outputs)
    program = compiler.compile(src, backend="triton", outputs=outputs)
    (kernel,) = program.plan(**inputs).kernels
    assert set(kernel.writes) == {"S", "Y"}


@pytest.mark.parametrize("name", sorted(GPU_CRASHES))
def test_gpu_crash_programs_match_the_oracle(name):
    src = GPU_CRASHES[name]
    ref = compiler.compile(src, backend="reference")
    dtype = torch.float16 if name == "bottom_right_causal" else torch.float32
    sizes = {"i": 5, "m": 7, "n": 3, "c": 3, "j": 2, "v": 11}
    inputs = inputs_for(ref, sizes, dtype)
    if "T" in inputs:
        inputs["T"] = torch.rand_like(inputs["T"])
    assert_matches_oracle(src, inputs)


GPU_CASES = ([(n, s, GPU_SIZES) for n, s in GPU_CRASHES.items()]
             + [c for c in SOURCE_CASES if c[0] in ("attention_lse", "renamed_chain")] + AUTO_SPLIT[:2])


@pytest.mark.gpu
@pytest.mark.parametrize("name, src, sizes", GPU_CASES, ids=[case[0] for case in GPU_CASES])
def test_gpu_autotuned_launches_match_the_oracle(name, src, sizes):
    """The programs that crashed on the GPU, compiled and autotuned, at sizes with
    ragged tiles (the oracle runs on the CPU in float64)."""
    outputs = ["O", "L"] if name == "attention_lse" else None
    ref = compiler.compile(src, backend="reference", outputs=outputs)
    dtype = torch.float16 if name in ("bottom_right_causal", "decode_head_dim_8") else torch.float32
    extents = {ix: sizes.get(ix, 64) for ix, _ in ref.checked.extents}
    inputs = random_inputs(ref.checked, extents, dtype=dtype, device="cuda")
    program = compiler.compile(src, backend="triton", outputs=outputs)
    got = program(**inputs)
    want = ref(**{k: v.cpu() if isinstance(v, torch.Tensor) else v for k, v in inputs.items()})
    for g, w in zip(got if isinstance(got, tuple) else (got,), want if isinstance(want, tuple) else (want,)):
        torch.testing.assert_close(g.cpu(), w, equal_nan=True, **{torch.float16: {"rtol": 2e-2, "atol": 2e-2},
                                                                  torch.float32: {"rtol": 2e-3, "atol": 2e-3}}[dtype])


# ---------------------------------------------------------------- 6. a loop result read by several loops
PER_TILE = {"tl.sum", "tl.max", "tl.min"}


def per_tile_reductions(source: str) -> list[str]:
    """The loop-carried updates Triton 3.6's thread-locality pass rewrites and then
    asserts on when the loop's result has several uses: `v += tl.sum(...)` or
    `v = tl.maximum(v, tl.max(...))` inside a `for` (tl.min likewise)."""
    found = []
    for loop in (n for n in ast.walk(ast.parse(source)) if isinstance(n, ast.For)):
        for st in ast.walk(loop):
            value = None
            if isinstance(st, ast.AugAssign) and isinstance(st.target, ast.Name):
                value = st.value
            elif isinstance(st, ast.Assign) and isinstance(st.value, ast.Call) and st.value.args and \
                    isinstance(st.value.args[0], ast.Name) and st.value.args[0].id == ast.unparse(st.targets[0]):
                value = st.value.args[-1]
            if isinstance(value, ast.Call) and ast.unparse(value.func) in PER_TILE:
                found.append(ast.unparse(st))
    return found


def test_the_per_tile_reduction_finder_finds_one():
    assert per_tile_reductions("for s in range(4):\n    acc += tl.sum(x, 1)\n    r = tl.maximum(r, tl.max(y, 1))")\
        == ["acc += tl.sum(x, 1)", "r = tl.maximum(r, tl.max(y, 1))"]


@pytest.mark.parametrize("name, src, sizes", SOURCE_CASES, ids=[case[0] for case in SOURCE_CASES])
def test_a_streamed_sum_max_or_min_keeps_lanes(name, src, sizes):
    """A streamed sum, max or min keeps one running value per lane of its tile and
    reduces the lanes after the loop: no per-tile reduction into a loop-carried value
    (class 6, a GPU-only compiler assertion)."""
    outputs = ["O", "L"] if name == "attention_lse" else None
    backend, binding = meta_binding(src, sizes, torch.float32, outputs, None)
    assert per_tile_reductions(backend.source_for(binding, sm_count=132)) == []


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_a_streamed_sum_inside_a_streamed_fold_reduces_only_its_own_lanes(dtype):
    # found by the generated-program test on the GPU: the row sum over k, streamed inside
    # the softmax's loop over j, once reduced the j lanes as well
    src = "S[i,j] = sum[k](Q[i,k] * K[j,k]) * 0.5\nO[i,m] = softmax[j](S[i,j]) * V[j,m]"
    ref = compiler.compile(src, backend="reference")
    assert_matches_oracle(src, inputs_for(ref, {"i": 1, "j": 2, "k": 67, "m": 1}, dtype))


# ---------------------------------------------------------------- 4. generated names vs user names
@pytest.mark.parametrize("src, inputs", [
    ("Y[val] = X[val] * n + len(val)", {"X": [7], "n": 2.5}),                 # scalar n, extent of val: n_val
    ("Y[s0] = n[s0] * 2", {"n": [7]}),                                          # tensor n, index s0: n_s0
    ("Y[i] = ptr[i] + pid[i] * offs[i]", {"ptr": [7], "pid": [7], "offs": [7]}),
    ("Y[i] = sum[ptr](X[i,ptr]) + max[pid](Z[i,pid])", {"X": [3, 5], "Z": [3, 4]}),
    ("O[ptr,j] = softmax[s0](offs[ptr,val] * n[s0,val] * BLOCK + mask[ptr,s0]) * pid[s0,j]",
     {"offs": [5, 3], "n": [7, 3], "pid": [7, 2], "mask": [5, 7], "BLOCK": 0.7}),
    # names of numbered temporaries (t7) and roles (alpha, w, x0): a role is given to a temporary
    # when the kernel is written out, and must touch neither the program's names nor its comments
    ("t6[i,t7] = softmax[t8](t9[i,t8] + alpha[i,t8] * w) * x0[t8,t7]",
     {"t9": [3, 67], "alpha": [3, 67], "w": 0.5, "x0": [67, 5]}),
    ("acc[t, tl] = triton[t, torch] * launch[torch, tl] + grid[t, tl] * META", {
        "triton": [5, 3], "launch": [3, 4], "grid": [5, 4], "META": 1.5}),
])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_user_names_equal_to_generated_names(src, inputs, dtype):
    g = torch.Generator().manual_seed(0)
    values = {k: torch.randn(*v, generator=g).to(DEVICE, dtype) if isinstance(v, list) else v
              for k, v in inputs.items()}
    assert_matches_oracle(src, values)


@pytest.mark.parametrize("src, tensor", [("L[i] = logsumexp[split](X[i,split])", "X"),      # n_split
                                         ("Y[i] = sum[j](einfold_Y_state0_acc[i,j])", "einfold_Y_state0_acc")])
def test_user_names_equal_to_split_names(src, tensor):
    x = torch.randn(3, 41, generator=torch.Generator().manual_seed(1)).to(DEVICE)
    ref, backend, binding = assert_matches_oracle(src, {tensor: x}, split=3)
    (kernel,) = backend.plan(binding).kernels
    assert kernel.name.endswith("_partial")


def test_statements_named_like_split_kernels():
    src = "Y[i] = sum[j](X[i,j])\nY_partial[j] = max[i](X[i,j])\nY_merge[i] = min[j](X[i,j] * 2)"
    x = torch.randn(4, 45, generator=torch.Generator().manual_seed(2)).to(DEVICE)
    ref, backend, binding = assert_matches_oracle(src, {"X": x}, split=3)
    names = [k.name for k in backend.plan(binding).kernels]
    assert len(names) == len(set(names)) == 3
    # each split kernel calls its merge: six jit functions, all named apart
    functions = [f for f in re.findall(r"^def (einfold_\w+)\(", backend.source_for(binding), re.M)]
    assert len(functions) == len(set(functions)) == 6


LANGUAGE_NAMES = {"inf", "pi", "len", "and", "or", "not", "where", "sum", "max", "min", "prod", "argmax",
                  "argmin", "mean", "logsumexp", "softmax"}


def dumped_names() -> list[str]:
    """Every identifier of the module generated for attention (parameters, locals,
    globals), minus names the language itself reserves."""
    from compiler.ops import FUNCTIONS
    ref, backend = backend_for(ATTENTION)
    inputs = inputs_for(ref, {"i": 3, "m": 5, "k": 2, "j": 2})
    source = backend.source_for(Binder(ref.checked, extents_of=backend.program)(inputs))
    names = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Name):
            names.add(node.id)
        elif isinstance(node, ast.arg):
            names.add(node.arg)
        elif isinstance(node, ast.FunctionDef):
            names.add(node.name)
    return sorted(n for n in names if n not in LANGUAGE_NAMES and n not in FUNCTIONS and not n.startswith("_"))


ROLES = ("O", "i", "j", "m", "k", "Q", "K", "V", "scale")


def test_attention_with_every_generated_name_as_a_user_name():
    """Attention, once per group of nine dumped names, each name in some role: a
    tensor, the scalar, an index or the statement."""
    names = dumped_names()
    assert {"pid", "offs_i", "mask_m", "BLOCK_m", "n_k", "Q_ptr", "scale_val", "launch", "tl"} <= set(names)
    names += [f"pad{p}" for p in range(-len(names) % len(ROLES))]
    template = "{O}[{i},{j}] = softmax[{m}]({Q}[{i},{k}] * {K}[{m},{k}] * {scale}) * {V}[{m},{j}]"
    for start in range(0, len(names), len(ROLES)):
        role = dict(zip(ROLES, names[start:start + len(ROLES)]))
        g = torch.Generator().manual_seed(start)
        inputs = {role["Q"]: torch.randn(3, 2, generator=g).to(DEVICE),
                  role["K"]: torch.randn(5, 2, generator=g).to(DEVICE),
                  role["V"]: torch.randn(5, 2, generator=g).to(DEVICE), role["scale"]: 0.8}
        assert_matches_oracle(template.format(**role), inputs)


# ---------------------------------------------------------------- 5. extent 0
EMPTY_CASES = {
    "attention": (ATTENTION, {"i": 3, "j": 5, "k": 7, "m": 11}),
    "matmul": ("C[i,j] = A[i,k] * B[k,j]", {"i": 3, "j": 5, "k": 7}),
    "softmax": ("P[i,j] = softmax[j](X[i,j])", {"i": 3, "j": 7}),
    "layernorm": (LAYERNORM, {"i": 3, "j": 7}),
    "logsumexp": ("L[i] = logsumexp[j](X[i,j])", {"i": 3, "j": 7}),
    "sum_max_min": ("S[i] = sum[j](X[i,j]) + max[j](X[i,j]) - min[j](X[i,j])", {"i": 3, "j": 7}),
}


@pytest.mark.parametrize("name, index", [(n, ix) for n, (_, sizes) in EMPTY_CASES.items() for ix in sizes])
def test_an_empty_index_gives_the_identity_or_an_empty_output(name, index):
    src, sizes = EMPTY_CASES[name]
    ref = compiler.compile(src, backend="reference")
    inputs = inputs_for(ref, {**sizes, index: 0})
    assert_matches_oracle(src, inputs)


@pytest.mark.parametrize("split", [None, 2])
@pytest.mark.parametrize("sizes", [{"i": 5, "j": 0, "k": 13, "m": 17}, {"i": 70, "j": 0, "k": 20, "m": 100},
                                   {"i": 2, "j": 0, "k": 1, "m": 1}])
def test_a_narrower_output_is_written_when_the_kernels_widest_is_empty(sizes, split):
    # L[i] is stored by the programs of the first j tile of O's kernel: with no j at all the
    # kernel still runs one (masked) j tile, or L would keep whatever torch.empty held
    ref = compiler.compile(ATTENTION_LSE, backend="reference", outputs=["O", "L"])
    _, backend, binding = assert_matches_oracle(ATTENTION_LSE, inputs_for(ref, sizes), ["O", "L"], split=split)
    # at least one j tile: max(<tiles of j>, 1), tiles counted by the autotuned or the fixed block
    assert re.search(r'max\((triton\.cdiv\(|\()?n\["j"\][^\n]*, 1\)', backend.source_for(binding, sm_count=132))


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_matmul_and_attention_over_an_empty_contraction(dtype):
    a, b = torch.randn(5, 0).to(DEVICE, dtype), torch.randn(0, 3).to(DEVICE, dtype)
    _, backend, binding = assert_matches_oracle("C[i,j] = A[i,k] * B[k,j]", {"A": a, "B": b})
    assert torch.equal(backend.run(binding)["C"].cpu(), torch.zeros(5, 3, dtype=dtype))
    q, k, v = torch.randn(5, 0), torch.randn(7, 0), torch.randn(7, 3)
    _, backend, binding = assert_matches_oracle(ATTENTION, {"Q": q.to(DEVICE, dtype), "K": k.to(DEVICE, dtype),
                                                            "V": v.to(DEVICE, dtype), "scale": 0.5})
    want = torch.softmax(torch.zeros(5, 7), 1) @ v                 # scores of an empty dot product are 0
    torch.testing.assert_close(backend.run(binding)["O"].cpu().float(), want, **TOL[dtype])


# ---------------------------------------------------------------- numpy warnings under the interpreter
@pytest.mark.skipif(torch.cuda.is_available(), reason="the interpreter runs CPU tensors")
@pytest.mark.parametrize("src, shapes", [
    ("Y[i,j] = softmax[j](X[i,j])", {"X": (3, 5)}),                   # 5 columns in a tile of 8
    ("P[i,m] = softmax[m](where(m < i, S[i,m], -inf))", {"S": (6, 6)}),       # row 0 is -inf - -inf
    ("O[i,j] = softmax[m](where(m < i, S[i,m], -inf)) * V[m,j]", {"S": (6, 6), "V": (6, 3)}),   # 0/0
    ("Y[i,j] = X[i,j] / Z[i,j] + log(Z[i,j] * Z[i,j])", {"X": (3, 5), "Z": (3, 5)})])   # padding: 0/0, log 0
def test_interpreted_padding_emits_no_numpy_warning(src, shapes):
    program = compiler.compile(src, backend="triton")
    g = torch.Generator().manual_seed(3)
    inputs = {name: torch.randn(*shape, generator=g) for name, shape in shapes.items()}
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        got = program(**inputs)
    torch.testing.assert_close(got, compiler.compile(src, backend="reference")(**inputs), equal_nan=True)
    numpy_warnings = [w for w in caught if issubclass(w.category, RuntimeWarning)
                      and not str(w.message).startswith("einfold:")]
    assert numpy_warnings == [], [str(w.message) for w in numpy_warnings]
    assert numpy_seterr_unchanged()


def numpy_seterr_unchanged() -> bool:
    """The silencing is scoped to the launches: numpy's settings are restored."""
    import numpy
    return numpy.geterr()["invalid"] != "ignore"


@pytest.mark.parametrize("sizes", [{"b": 2, "n": 37, "k": 5}, {"b": 3, "n": 1, "k": 70}, {"b": 1, "n": 64, "k": 3}])
def test_a_split_divides_the_longest_index_of_a_fold_whose_order_does_not_matter(sizes):
    """A weight's gradient summed over two row indices: the split divides the tiles of the
    longer one (the first's few values gave few splits), each program folding all of the
    other beside its chunk; against the oracle, ragged chunks included."""
    src = "dG[k] = sum[b, n](dY[b, n, k] * X[b, n, k])"
    ref, backend, binding = assert_matches_oracle(src, inputs_for(compiler.compile(src, backend="reference"), sizes),
                                                  split=3)
    source = backend.build(backend.signature(binding, backend._extents(binding))).source
    longest, other = ("n", "b") if sizes["n"] > sizes["b"] else ("b", "n")
    assert f"lo_{longest} = split_id * chunk_{longest}" in source and f"chunk_{other}" not in source
