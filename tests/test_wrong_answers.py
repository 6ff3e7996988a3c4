"""Wrong answers of the triton backend (issue "Correct, installable and memory-safe"):
one regression test per class, each run on the oracle (`backend="reference"`, float64)
and on the triton backend (Triton's interpreter on CPU, compiled kernels on a GPU) at
small ragged sizes, against float64 and torch.

1. two rescaled structures in one fold (differential attention): a tl.dot of the
   first laid V's load out anew and the second read the stale layout;
2. flash-decoding over a latent cache (MLA), split with empty chunks and the value
   axis tiled over several programs: the merge takes empty states as the identity,
   and the launch counts one program per tile (programs past the last tile stored
   out of bounds: NaN on the GPU);
3. max, min, argmax and argmin of rows holding NaN: NaN wins, as in torch;
4. softmax and logsumexp of rows at +-1e30 (and crossing 2**30 within a row): the
   base-2 reference point erred by half an ulp of r * log2(e), up to 2**76;
5. a rescaled fold over an index streamed one value at a time (a Gaussian
   mixture's log-likelihood): its leader was kept over the loop's own axis;
6. argmax / argmin beside every other summary kind over the same index: the
   ordered scan named one result for every field of the fold;
7. predicates mixing a scalar and a tensor with `and`, `or`, `not`;
8. user names equal to the functions the generated module defines."""
from __future__ import annotations

import math
import re

import pytest
import torch

import compiler
from compiler.backend.triton.ops import HELPER_FUNCTIONS

pytestmark = pytest.mark.filterwarnings("ignore:einfold. no CUDA tensors")

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
TOL = {torch.float64: {"rtol": 1e-9, "atol": 1e-9}, torch.float32: {"rtol": 2e-4, "atol": 2e-4},
       torch.float16: {"rtol": 2e-2, "atol": 2e-2}, torch.bfloat16: {"rtol": 3e-2, "atol": 3e-2}}


@pytest.fixture(autouse=True)
def _cache_dir(tmp_path_factory, monkeypatch):
    monkeypatch.setenv("EINFOLD_CACHE_DIR", str(tmp_path_factory.getbasetemp() / "einfold-cache"))


def randn(*shape, seed=0, dtype=torch.float32):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed), dtype=torch.float64).to(dtype)


def results(src, inputs, outputs=None, split=None):
    """(the triton backend's outputs, the oracle's), each a tuple, on `inputs` moved to DEVICE."""
    options = {} if split is None else {"split": split}
    triton = compiler.compile(src, backend="triton", outputs=outputs, **options)
    oracle = compiler.compile(src, backend="reference", outputs=outputs)
    on_device = {k: v.to(DEVICE) if isinstance(v, torch.Tensor) else v for k, v in inputs.items()}
    got, want = triton(**on_device), oracle(**inputs)
    as_tuple = lambda r: r if isinstance(r, tuple) else (r,)       # noqa: E731
    return as_tuple(got), as_tuple(want)


def check(src, inputs, *expected, outputs=None, split=None):
    """The triton backend matches the oracle, and both match `expected` (torch, in float64
    where it can), NaN where they have NaN."""
    got, want = results(src, inputs, outputs, split)
    for g, w, e in zip(got, want, expected or want):
        tol = TOL.get(g.dtype, {"rtol": 0, "atol": 0})
        torch.testing.assert_close(g.cpu(), w.to(g.dtype), equal_nan=True, **tol)
        torch.testing.assert_close(w, e.to(w.dtype), equal_nan=True, **tol)


# ---------------------------------------------------------------- 1. several rescaled structures
DIFFERENTIAL = {
    "statements": ("S1[h,i,m] = Q1[h,i,k] * K1[h,m,k] * scale\nS2[h,i,m] = Q2[h,i,k] * K2[h,m,k] * scale\n"
                   "O[h,i,j] = softmax[m](S1[h,i,m]) * V[h,m,j] - lam * softmax[m](S2[h,i,m]) * V[h,m,j]"),
    # (k is summed inside each softmax: left free it would be summed over both terms)
    "inline": ("O[h,i,j] = softmax[m](sum[k](Q1[h,i,k] * K1[h,m,k]) * scale) * V[h,m,j]"
               " - lam * softmax[m](sum[k](Q2[h,i,k] * K2[h,m,k]) * scale) * V[h,m,j]"),
}


@pytest.mark.parametrize("split", [None, 3])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("spelling", sorted(DIFFERENTIAL))
def test_differential_attention_folds_two_rescaled_structures(spelling, dtype, split):
    h, i, m, k, j = 2, 3, 37, 5, 7
    x = {name: randn(*shape, seed=s, dtype=dtype) for s, (name, shape) in enumerate(
        {"Q1": (h, i, k), "K1": (h, m, k), "Q2": (h, i, k), "K2": (h, m, k), "V": (h, m, j)}.items())}
    x |= {"scale": 0.7, "lam": 0.4}
    d = {n: v.double() if isinstance(v, torch.Tensor) else v for n, v in x.items()}
    attend = lambda q, kk: torch.softmax(q @ kk.transpose(1, 2) * d["scale"], -1) @ d["V"]   # noqa: E731
    want = attend(d["Q1"], d["K1"]) - d["lam"] * attend(d["Q2"], d["K2"])
    check(DIFFERENTIAL[spelling], x, want, split=split)


# ---------------------------------------------------------------- 2. a split decode over a latent cache
MLA = "OL[b,h,i,c] = softmax[m]((QL[b,h,i,e] * Cl[b,m,e] + Qr[b,h,i,r] * Kr[b,m,r]) * scale) * Cl[b,m,c]"


@pytest.mark.parametrize("m", [1, 70, 133])          # 70 and 133 keys in 4 or 6 splits: an empty chunk
@pytest.mark.parametrize("split", [4, 6])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_split_latent_decode_merges_empty_states_as_the_identity(m, split, dtype):
    b, h, e, c, r = 2, 3, 19, 131, 5           # 131 values: several programs along c
    x = {"QL": randn(b, h, 1, e, seed=1, dtype=dtype), "Cl": randn(b, m, e, seed=2, dtype=dtype),
         "Qr": randn(b, h, 1, r, seed=3, dtype=dtype), "Kr": randn(b, m, r, seed=4, dtype=dtype),
         "scale": 0.3}
    d = {n: v.double() if isinstance(v, torch.Tensor) else v for n, v in x.items()}
    scores = (d["QL"] @ d["Cl"][:, None].transpose(2, 3) + d["Qr"] @ d["Kr"][:, None].transpose(2, 3)) * 0.3
    check(MLA, x, torch.softmax(scores, -1) @ d["Cl"][:, None], split=split)


def test_a_split_launches_one_program_per_tile():
    # the launcher's program count is a product of tile counts: `(n + 63) // 64 * ...` read left
    # to right once launched programs past the last tile, which read and wrote out of bounds
    # (MLA decode at B16 H128 L4096, c = 512: 368 programs for 256 tiles, NaN in the output)
    program = compiler.compile(MLA, backend="triton")
    sizes = {"b": 16, "h": 128, "i": 1, "m": 4096, "e": 512, "c": 512, "r": 64}
    shapes = {"QL": "bhie", "Cl": "bme", "Qr": "bhir", "Kr": "bmr"}
    inputs = {n: torch.zeros((1,) * len(s), dtype=torch.bfloat16).expand(*(sizes[a] for a in s))
              for n, s in shapes.items()} | {"scale": 0.04}
    source = program.backend.source_for(program.binder(inputs), sm_count=132)
    (grid,) = [line.split("=", 1)[1] for line in source.splitlines() if line.strip().startswith("grid = ")]
    blocks = {index: int(block) for index, block in re.findall(r"BLOCK_(\w+)=(\d+)", source)}
    tiles = math.prod(-(-sizes[g] // blocks.get(g, 1)) for g in "bhic")
    assert eval(grid, {"n": sizes}) == tiles, grid          # noqa: S307 (the launcher's own arithmetic)


# ---------------------------------------------------------------- 3. NaN in max, min, argmax, argmin
def nan_rows(n: int) -> torch.Tensor:
    x = randn(5, n, seed=5)
    x[0, 2] = x[0, n - 1] = float("nan")        # two NaN: the first one's position
    x[1, n - 1] = float("nan")                  # in the last (ragged) tile
    x[2, 0], x[2, n // 2] = float("inf"), float("nan")
    x[3] = float("nan")
    return x                                    # row 4 without NaN


EXTREMA = {"max": lambda x: x.amax(-1), "min": lambda x: x.amin(-1)}


@pytest.mark.parametrize("split", [None, 3])
@pytest.mark.parametrize("n", [1, 7, 300])      # one tile, a ragged tile, streamed
@pytest.mark.parametrize("name", sorted(EXTREMA))
def test_max_and_min_keep_nan(name, n, split):
    x = nan_rows(max(n, 3))[:, :n]
    check(f"M[i] = {name}[k](X[i,k])", {"X": x}, EXTREMA[name](x.double()), split=split)


# folded whole inside the loop over j (a row of 5 values)
HELD_WHOLE = {"max": ("max[k](X[i,j,k])", lambda x: x.amax(-1)),
              "min": ("min[k](X[i,j,k])", lambda x: x.amin(-1)),
              "argmax": ("argmax[k](X[i,j,k], k)", lambda x: x.argmax(-1)),
              "argmin": ("argmin[k](X[i,j,k], k)", lambda x: x.argmin(-1))}


@pytest.mark.parametrize("name", sorted(HELD_WHOLE))
def test_an_extremum_held_whole_inside_a_loop_keeps_nan(name):
    source, torch_code = HELD_WHOLE[name]
    x = randn(3, 40, 5, seed=6)
    x[1, 17, 3] = x[1, 17, 1] = x[2, 39, 4] = float("nan")
    check(f"S[i] = sum[j]({source})", {"X": x}, torch_code(x.double()).sum(-1))


@pytest.mark.parametrize("split", [None, 3])
@pytest.mark.parametrize("n", [1, 7, 300])
@pytest.mark.parametrize("name", ["argmax", "argmin"])
def test_argmax_of_a_row_holding_nan_is_the_first_nan_as_in_torch(name, n, split):
    x = nan_rows(max(n, 3))[:, :n]
    check(f"A[i] = {name}[k](X[i,k], k)", {"X": x}, getattr(torch, name)(x, -1), split=split)


# ---------------------------------------------------------------- 4. rows of huge logits
def huge_rows(dtype) -> torch.Tensor:
    limit = 2.0 ** 30 if dtype == torch.float32 else 2.0 ** 60
    gap = 64.0 if dtype == torch.float32 else 128.0       # the floats' spacing just below the limit
    x = randn(9, 37, seed=7, dtype=torch.float64)
    x[0, :3] = torch.tensor([1e30, -1e30, 0.0])
    x[1, :3] = torch.tensor([1e30, 1e30, 3.0])
    x[2] = -1e30
    x[3] = x[3] * 1e30
    x[4] = x[4] * 3e8 + 5e8                   # below the float32 limit, where r * log2(e) rounds by 32
    x[5], x[5, 20:] = limit - gap, limit      # the leader crosses the limit in a later tile
    x[6], x[6, 30] = -limit, -limit + gap     # ... and from above, in magnitude
    x[7] = -float("inf")                      # fully masked: NaN softmax, -inf logsumexp (docs/language.md)
    return x.to(dtype)


HUGE = {
    "softmax": ("P[i,k] = softmax[k](X[i,k])", lambda x: torch.softmax(x, -1)),
    "logsumexp": ("L[i] = logsumexp[k](X[i,k])", lambda x: torch.logsumexp(x, -1)),
    # a positive scalar factor: the leader is kept as the max of X, the weights take s
    "scaled_logsumexp": ("L[i] = logsumexp[k](X[i,k] * s)", lambda x: torch.logsumexp(x * 0.75, -1)),
    "scaled_attention": ("O[i,j] = softmax[k](X[i,k] * s) * V[k,j]",
                         lambda x: torch.softmax(x * 0.75, -1) @ randn(37, 3, seed=8, dtype=torch.float64)),
}


@pytest.mark.parametrize("split", [None, 2])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("name", sorted(HUGE))
def test_rows_of_huge_logits_stay_finite_as_in_torch(name, dtype, split):
    source, torch_code = HUGE[name]
    x = huge_rows(dtype)
    inputs = {"X": x, "s": 0.75, "V": randn(37, 3, seed=8, dtype=dtype)}
    inputs = {k: v for k, v in inputs.items() if re.search(rf"\b{k}\[|\b{k}\)", source)}
    check(source, inputs, torch_code(x.double()), split=split)


# ---------------------------------------------------------------- 5. a leader streamed one value at a time
@pytest.mark.parametrize("sizes", [(5, 3, 7), (1, 1, 1), (4, 11, 2)])
def test_gaussian_mixture_log_likelihood(sizes):
    n, c, d = sizes
    x = {"X": randn(n, d, seed=9), "MU": randn(c, d, seed=10), "IV": randn(c, d, seed=11).abs()}
    w = {k: v.double() for k, v in x.items()}
    quadratic = ((w["X"][:, None, :] - w["MU"][None]) ** 2 * w["IV"][None]).sum(-1)
    check("L[n] = logsumexp[c](-sum[d](IV[c,d] * (X[n,d] - MU[c,d]) ** 2))", x,
          torch.logsumexp(-quadratic, -1))
    posterior = torch.softmax(-quadratic, -1) @ w["MU"]
    check("M[n,e] = softmax[c](-sum[d](IV[c,d] * (X[n,d] - MU[c,d]) ** 2)) * MU[c,e]", x, posterior)


# ---------------------------------------------------------------- 6. argmax beside every summary kind
BESIDE = {
    "welford": ("SD[i] = sum[j]((X[i,j] - mean[j](X[i,j])) ** 2)",
                lambda x: ((x - x.mean(-1, keepdim=True)) ** 2).sum(-1)),
    "sum": ("S[i] = sum[j](X[i,j])", lambda x: x.sum(-1)),
    "max": ("M[i] = max[j](X[i,j])", lambda x: x.amax(-1)),
    "logsumexp": ("L[i] = logsumexp[j](X[i,j])", lambda x: torch.logsumexp(x, -1)),
    "prod": ("P[i] = prod[j](X[i,j])", lambda x: x.prod(-1)),
    "softmax_mean": ("W[i] = sum[j](softmax[j](X[i,j]) * X[i,j])",
                     lambda x: (torch.softmax(x, -1) * x).sum(-1)),
    "argmin": ("B[i] = argmin[j](X[i,j], j)", lambda x: x.argmin(-1)),
}


@pytest.mark.parametrize("split", [None, 3])
@pytest.mark.parametrize("kind, arg", [(kind, arg) for kind in sorted(BESIDE) for arg in ("argmax", "argmin")
                                       if kind != arg])
def test_argmax_beside_another_summary_over_the_same_index(kind, arg, split):
    source, torch_code = BESIDE[kind]
    x = randn(3, 41, seed=12) * 0.6 + 1.0
    check(f"{source}\nAM[i] = {arg}[j](X[i,j], j)", {"X": x},
          torch_code(x.double()), getattr(torch, arg)(x, -1), split=split)


def test_argmax_beside_its_row_logsumexp_over_a_renamed_index():
    x = randn(5, 13, seed=13)
    check("A[t] = argmax[e](X[t,e], e)\nL[t] = logsumexp[e](X[t,e])", {"X": x},
          x.argmax(-1), torch.logsumexp(x.double(), -1))


# ---------------------------------------------------------------- 7. predicates of a scalar and a tensor
PREDICATES = {
    "X[i] > 0 and s < 1": lambda x, s: (x > 0) & (s < 1),
    "s < 1 or X[i] > 0": lambda x, s: (x > 0) | (s < 1),
    "not (s < 1) or X[i] > 0": lambda x, s: (x > 0) | (s >= 1),
    "not (X[i] > 0) and not (s > 1)": lambda x, s: (x <= 0) & (s <= 1),
}


@pytest.mark.parametrize("s", [0.5, 2.0])
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize("predicate", sorted(PREDICATES))
def test_predicates_mixing_a_scalar_and_a_tensor(predicate, dtype, s):
    x = randn(7, seed=14, dtype=dtype)
    check(f"Y[i] = where({predicate}, X[i], 0.0)", {"X": x, "s": s},
          torch.where(PREDICATES[predicate](x, s), x, 0.0).double())


# ---------------------------------------------------------------- 8. user names equal to generated ones
# one statement reading every helper: base 2 (logsumexp), NaN-keeping max and min, tanh, pow
EVERY_HELPER = ("logsumexp[k]({x}[i,k]) + max[k]({x}[i,k]) - min[k]({x}[i,k])"
                " + sum[k](tanh({x}[i,k]) + abs({x}[i,k]) ** 2.5)")


def every_helper(x: torch.Tensor) -> torch.Tensor:
    return (torch.logsumexp(x, -1) + x.amax(-1) - x.amin(-1) + (torch.tanh(x) + x.abs() ** 2.5).sum(-1))


@pytest.mark.parametrize("split", [None, 2])
@pytest.mark.parametrize("name", sorted(HELPER_FUNCTIONS))
def test_statements_and_inputs_named_like_helper_functions(name, split):
    x = randn(3, 37, seed=15)
    check(f"{name}[i] = {EVERY_HELPER.format(x='X')}", {"X": x}, every_helper(x.double()), split=split)
    check(f"Y[i] = {EVERY_HELPER.format(x=name)}", {name: x}, every_helper(x.double()), split=split)
