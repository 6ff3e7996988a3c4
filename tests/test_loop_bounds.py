"""Loop bounds read off index predicates: a fold's loop starts at the first tile
and stops after the last tile where every masking relation `m op sign * i +
offset` can hold (offset: scalars, extents, constants), and a single loop bounded
above skips the predicate on the interior tiles where it holds everywhere.  The
kernels run under Triton's interpreter against the float64 oracle at ragged sizes
with small tiles, so that several tiles fall on each side of every boundary."""
import math
import re

import pytest
import torch

import compiler
from compiler.backend.triton import TritonBackend, outline
from compiler.schedule import schedule
from compiler.bind import Binder
from compiler.random_inputs import random_inputs

pytestmark = pytest.mark.filterwarnings("ignore:einfold. no CUDA tensors")

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def attention(predicate: str) -> str:
    return f"O[i,j] = softmax[m](where({predicate}, Q[i,c] * K[m,c] * 0.5, -inf)) * V[m,j]"


# predicate -> the bounds the schedule prints for the loop over m
CASES = {
    "m <= i": ["m <= i"],
    "i >= m": ["m <= i"],
    "m <= i and i - m < 6": ["m <= i", "m > i - 6"],                  # a sliding window
    "i - m < 6": ["m > i - 6"],                                       # only a lower bound
    "m <= i + len(m) - len(i)": ["m <= i + (len(m) - len(i))"],       # bottom-right causal
    "m + start <= i": ["m <= i - start"],                             # a scalar offset (float)
    "m < i + start": ["m < i + start"],                               # strict, rounded down: ceil - 1
    "m >= start": ["m >= start"],                                     # no other index
    "m + i < len(m)": ["m < -i + len(m)"],                            # the other index negated
    "2 * m <= i": ["2 * m <= i"],                                     # a coefficient: floor(i / 2)
    "i - 2 * m < 6": ["2 * m > i - 6"],                               # a stride's window, from below
    "3 * m >= i and 3 * m < i + 5": ["3 * m >= i", "3 * m < i + 5"],  # both sides, ceil and floor
    "2 * m + start <= i": ["2 * m <= i - start"],                     # a float offset, halved
    "m <= 2 * i - i": ["m <= i"],                                     # integer multiples that sum to +-1
}


@pytest.fixture(autouse=True)
def _cache_dir(tmp_path_factory, monkeypatch):
    monkeypatch.setenv("EINFOLD_CACHE_DIR", str(tmp_path_factory.getbasetemp() / "einfold-cache"))


def run(source: str, sizes: dict, start: float | None = None):
    ref = compiler.compile(source, backend="reference")
    backend = TritonBackend(schedule(ref.factorised, ref.outputs))
    inputs = random_inputs(ref.checked, {ix: sizes.get(ix, 4) for ix, _ in ref.checked.extents},
                           dtype=torch.float32, device=DEVICE)
    if start is not None:
        inputs["start"] = start
    got = backend.run(Binder(ref.checked, extents_of=backend.program)(inputs))["O"]
    want = ref(**{k: v.double() if isinstance(v, torch.Tensor) else v for k, v in inputs.items()})
    return got, want.cpu(), backend     # the oracle answers on the inputs' device


@pytest.mark.parametrize("predicate", list(CASES))
def test_the_schedule_prints_the_bounds_it_derives(predicate):
    program = compiler.compile(attention(predicate), backend="triton")
    (loop,) = outline(program.factorised, program.outputs).kernels[0].loops
    assert sorted(loop.bounds) == sorted(CASES[predicate])


@pytest.mark.parametrize("predicate", list(CASES))
@pytest.mark.parametrize("sizes", [{"i": 37, "m": 53}, {"i": 53, "m": 37}, {"i": 1, "m": 29}])
def test_bounded_loops_match_the_oracle(predicate, sizes):
    got, want, backend = run(attention(predicate), sizes, start=7.0 if "start" in predicate else None)
    # rows that see no key are NaN in both (a softmax of nothing)
    torch.testing.assert_close(got.double().cpu(), want, rtol=1e-4, atol=1e-5, equal_nan=True)
    if CASES[predicate]:
        assert "contribute the identity" in backend.source


@pytest.mark.parametrize("start", [2.5, -3.0, 1e30, -1e30, math.nan, 0.0, 40.0])
def test_a_float_offset_is_rounded_outwards_and_nan_selects_nothing(start):
    # m + start <= i with a non-integer, huge or NaN start: the bound is computed in
    # float and rounded outwards; NaN fails every comparison, so every row is empty
    got, want, backend = run(attention("m + start <= i"), {"i": 37, "m": 53}, start=start)
    torch.testing.assert_close(got.double().cpu(), want, rtol=1e-4, atol=1e-5, equal_nan=True)
    assert "tl.floor" in backend.source


@pytest.mark.parametrize("width", [6, 40])
def test_the_interior_of_a_window_drops_the_predicate_the_far_past_is_skipped(width):
    source = attention(f"m <= i and i - m < {width}")
    program, ref = compiler.compile(source, backend="triton"), compiler.compile(source, backend="reference")
    inputs = random_inputs(ref.checked, {"i": 150, "m": 150, "c": 4, "j": 4}, dtype=torch.float32, device=DEVICE)
    code = program.backend.source_for(Binder(ref.checked, extents_of=program.backend.program)(inputs),
                                      sm_count=None)
    # the far past: the loop starts at the first tile a key of the window can be in
    assert f"lo_m = tl.maximum(0, (tl.maximum(tl.min(offs_i, 0) - {width - 1}, 0)) // BLOCK_m * BLOCK_m)" in code
    assert "hi_m = tl.minimum(n_m, tl.max(offs_i, 0) + 1)" in code
    # two loops: the tiles between the window's far edge and the diagonal (where the window is
    # wider than a tile) evaluate neither conjunct; the tiles of both edges, in one loop, both
    interior = code[code.index("for start_m in range(inner_m, mid_m"):code.index("# the boundary tiles, where")]
    edges = code[code.index("for step_m in range(0, far_m + tl.maximum(tl.cdiv(hi_m - mid_m, BLOCK_m), 0)):"):]
    assert "far_m = tl.cdiv(inner_m - lo_m, BLOCK_m)" in code
    causal = "(offs_m[None, :] <= offs_i[:, None])"
    window = "(offs_i[:, None] - offs_m[None, :])"
    assert window not in interior and causal not in interior
    assert window in edges and causal in edges
    got = program(**inputs)
    want = ref(**{k: v.double().cpu() if isinstance(v, torch.Tensor) else v for k, v in inputs.items()})
    torch.testing.assert_close(got.double().cpu(), want, rtol=1e-4, atol=1e-5)


# ---------------------------------------------------------------- predicates on data
DOCUMENT = "O[i,j] = softmax[m](where(D[i] == D[m] and m <= i, Q[i,c] * K[m,c] * 0.5, -inf)) * V[m,j]"
PADDING = "O[i,j] = softmax[m](where(P[m] > 0, Q[i,c] * K[m,c] * 0.5, -inf)) * V[m,j]"
DATA_CASES = {
    DOCUMENT: "D[i] == D[i_2]",          # m reads D as i does: one extent class, named after i
    PADDING: "P[m] > 0",
    # a gradient's mask under a sum: the elements failing it are 0
    "G[i,c] = sum[m](where(P[m] > 0, S[i,m], 0.0) * K[m,c])": "P[m] > 0",
}


@pytest.mark.parametrize("source", list(DATA_CASES))
def test_a_predicate_on_data_is_tested_per_tile(source):
    program = compiler.compile(source, backend="triton")
    (loop,) = outline(program.factorised, program.outputs).kernels[0].loops
    assert loop.skips == (DATA_CASES[source],)
    assert f"[skips tiles where {DATA_CASES[source]} fails]" in str(loop)


def test_a_predicate_on_the_updates_own_data_is_not_tested_per_tile():
    # the test would load X to save nothing: X is read by the update anyway
    program = compiler.compile("R[i] = sum[m](where(X[i,m] > 0, X[i,m], 0.0) * K[m])", backend="triton")
    (loop,) = outline(program.factorised, program.outputs).kernels[0].loops
    assert loop.skips == ()


def test_a_predicate_on_data_that_does_not_mask_to_the_identity_skips_nothing():
    # where it fails the element is 1, not the sum's identity: every tile counts
    program = compiler.compile("G[i] = sum[m](where(P[m] > 0, S[i,m], 1.0))", backend="triton")
    (loop,) = outline(program.factorised, program.outputs).kernels[0].loops
    assert loop.skips == ()


def _documents(n: int, generator) -> torch.Tensor:
    """Sorted document ids of random lengths, as packed sequences have them."""
    return torch.sort(torch.randint(0, max(n // 9, 1), (n,), generator=generator)).values.double()


@pytest.mark.parametrize("sizes", [{"i": 53, "m": 53}, {"i": 1, "m": 1}, {"i": 70, "m": 70}])
def test_skipped_tiles_leave_the_documents_exact(sizes):
    """Several 16-wide tiles per document boundary: rows attend within their document only."""
    ref = compiler.compile(DOCUMENT, backend="reference")
    backend = TritonBackend(schedule(ref.factorised, ref.outputs))
    g = torch.Generator().manual_seed(sizes["i"])
    inputs = {"Q": torch.randn(sizes["i"], 8, generator=g), "K": torch.randn(sizes["m"], 8, generator=g),
              "V": torch.randn(sizes["m"], 4, generator=g), "D": _documents(sizes["i"], g).float()}
    inputs = {k: v.to(DEVICE) for k, v in inputs.items()}
    got = backend.run(Binder(ref.checked, extents_of=backend.program)(inputs))["O"]
    want = ref(**{k: v.double().cpu() for k, v in inputs.items()})
    torch.testing.assert_close(got.double().cpu(), want, rtol=1e-4, atol=1e-5)
    assert RANGE_TEST["=="].search(backend.source)


# the test of `a op b` on a tile, from the sides' least (lo) and greatest (hi) values
RANGE_TEST = {op: re.compile(r"if \(" + dead.replace("lo", r"\w+").replace("hi", r"\w+") + r"\) == 0:")
              for op, dead in (("<", "lo >= hi"), ("<=", "lo > hi"), (">", "hi <= lo"), (">=", "hi < lo"),
                               ("==", r"\(hi < lo\) \| \(lo > hi\)"))}


def _run_against_the_oracle(source: str, inputs: dict) -> str:
    ref = compiler.compile(source, backend="reference")
    backend = TritonBackend(schedule(ref.factorised, ref.outputs))
    inputs = {k: v.to(DEVICE) for k, v in inputs.items()}
    got = backend.run(Binder(ref.checked, extents_of=backend.program)(inputs))["O"]
    want = ref(**{k: v.double().cpu() for k, v in inputs.items()})
    torch.testing.assert_close(got.double().cpu(), want, rtol=1e-4, atol=1e-5, equal_nan=True)
    return backend.source


@pytest.mark.parametrize("op", ["<", "<=", ">", ">=", "=="])
def test_a_comparison_on_data_skips_tiles_by_the_ranges_of_its_sides(op):
    """Keys stamped T[m] against the queries' S[i], both sorted, so that tiles of
    either hold narrow ranges and many pairs of tiles are skipped (whole numbers: ties
    at every comparison; NaN in both, which fails every comparison)."""
    g = torch.Generator().manual_seed(7)
    t, s = (torch.randint(0, 40, (n,), generator=g).sort().values.float() for n in (300, 200))
    t[[5, 160]], s[3] = float("nan"), float("nan")
    inputs = {"Q": torch.randn(200, 8, generator=g), "K": torch.randn(300, 8, generator=g),
              "V": torch.randn(300, 4, generator=g), "T": t, "S": s}
    source = _run_against_the_oracle(attention(f"T[m] {op} S[i]"), inputs)
    assert RANGE_TEST[op].search(source) and "tl.min(" in source


def test_a_test_that_is_no_comparison_is_taken_element_by_element():
    g = torch.Generator().manual_seed(8)
    inputs = {"Q": torch.randn(37, 8, generator=g), "K": torch.randn(90, 8, generator=g),
              "V": torch.randn(90, 4, generator=g), "T": torch.randint(0, 3, (90,), generator=g).float(),
              "S": torch.randint(0, 3, (37,), generator=g).float()}
    source = _run_against_the_oracle(attention("T[m] != S[i]"), inputs)
    assert "if tl.max(" in source and "tl.min(" not in source


def test_nan_documents_keep_their_tiles():
    # a NaN id matches nothing (its row attends nothing: NaN, as the oracle's); the tiles
    # around it are still tested and kept where another id matches
    g = torch.Generator().manual_seed(9)
    docs = _documents(70, g).float()
    docs[[0, 33, 34]] = float("nan")
    _run_against_the_oracle(DOCUMENT, {"Q": torch.randn(70, 8, generator=g), "K": torch.randn(70, 8, generator=g),
                                       "V": torch.randn(70, 4, generator=g), "D": docs})


@pytest.mark.parametrize("kept", [0.0, 0.05, 1.0])
def test_skipped_tiles_of_a_padding_mask_match_the_oracle(kept):
    """No key kept (every row NaN: a softmax of nothing), a few, all."""
    ref = compiler.compile(PADDING, backend="reference")
    backend = TritonBackend(schedule(ref.factorised, ref.outputs))
    g = torch.Generator().manual_seed(3)
    inputs = {"Q": torch.randn(5, 8, generator=g), "K": torch.randn(200, 8, generator=g),
              "V": torch.randn(200, 4, generator=g), "P": (torch.rand(200, generator=g) < kept).float()}
    inputs = {k: v.to(DEVICE) for k, v in inputs.items()}
    got = backend.run(Binder(ref.checked, extents_of=backend.program)(inputs))["O"]
    want = ref(**{k: v.double().cpu() for k, v in inputs.items()})
    torch.testing.assert_close(got.double().cpu(), want, rtol=1e-4, atol=1e-5, equal_nan=True)


# ---------------------------------------------------------------- live spans
SPAN = "O[i] = sum[m](where(D[m] {op} E[i], X[m], 0.0))"


def _span_inputs(d: torch.Tensor, e: torch.Tensor, seed: int) -> dict:
    g = torch.Generator().manual_seed(seed)
    return {"D": d.float(), "E": e.float(), "X": torch.randn(d.numel(), generator=g)}


@pytest.mark.parametrize("case", ["sorted", "holes", "none live", "nan", "one key"])
def test_a_live_span_scan_bounds_the_loop_and_stays_exact(case):
    """Keys over several scan steps (thousands of keys): sorted stamps (each row's live
    keys one run: the span's tiles run untested), runs of two ids taking turns (the
    span of either holds the other's runs: its tiles are tested), no key matching,
    NaN keys and rows, a single key."""
    g = torch.Generator().manual_seed(11)
    n = 1 if case == "one key" else 4999
    d = torch.randint(0, 30, (n,), generator=g).sort().values.double()
    if case == "holes":
        d = (torch.arange(n) // 300 % 2).double()
    e = torch.randint(0, 30, (13,), generator=g).double()
    if case == "holes":
        e = torch.tensor([0.0, 1.0, 1.0, 0.0, 2.0])
    if case == "none live":
        e = e + 100
    if case == "nan":
        d[[0, 2000, 4998]] = float("nan")
        e[4] = float("nan")
    source = _run_against_the_oracle(SPAN.format(op="=="), _span_inputs(d, e, 12))
    assert "# the live span of m" in source and "for start_scan_m in range(" in source
    # the span's tiles untested where every one is live, else each tested in the loop after
    assert re.search(r"mid_m = tl.where\(dense_m, last_m, first_m\)\n +for start_m in range\(first_m, mid_m,.*"
                     r"for start_m in range\(mid_m, last_m,", source, re.S)


@pytest.mark.parametrize("op", ["<", "<=", ">", ">="])
def test_a_live_span_of_each_comparison_matches_the_oracle(op):
    g = torch.Generator().manual_seed(13)
    d = torch.randint(0, 50, (3001,), generator=g).sort().values.double()
    e = torch.randint(-5, 55, (9,), generator=g).double()
    assert "# the live span of m" in _run_against_the_oracle(SPAN.format(op=op), _span_inputs(d, e, 14))


def test_a_live_span_with_an_index_side_fills_past_the_range_with_integers():
    # D[m] <= m: both sides vary over m; the index side is an integer tile
    g = torch.Generator().manual_seed(15)
    d = torch.arange(2500).double() + torch.randint(-40, 3, (2500,), generator=g) + 1500
    inputs = {"D": d.float(), "X": torch.randn(2500, generator=g), "E": torch.zeros(3)}
    source = _run_against_the_oracle("O[i] = sum[m](where(D[m] <= m, X[m], 0.0)) + E[i]", inputs)
    assert "2147483647" in source


def test_a_side_over_the_loop_and_a_tile_of_rows_is_not_scanned():
    # M[i, m] varies over the program's rows too: its test stays per tile, no scan
    g = torch.Generator().manual_seed(16)
    inputs = {"M": (torch.rand(21, 300, generator=g) < 0.1).float(), "X": torch.randn(300, generator=g)}
    source = _run_against_the_oracle("O[i] = sum[m](where(M[i,m] > 0, X[m], 0.0))", inputs)
    assert "live span" not in source and "# skip the tile where M[i, m] > 0 fails everywhere" in source



@pytest.mark.parametrize("ids", ["sorted", "holes"])
def test_a_live_span_inside_a_window_matches_the_oracle(ids):
    """A document mask inside a sliding window: far boundary, interior (untested where
    the span has no holes) and near boundary around the span's ends."""
    g = torch.Generator().manual_seed(18)
    n = 300
    d = _documents(n, g) if ids == "sorted" else (torch.arange(n) // 20 % 2).double()
    inputs = {"Q": torch.randn(n, 8, generator=g), "K": torch.randn(n, 8, generator=g),
              "V": torch.randn(n, 4, generator=g), "D": d.float()}
    source = _run_against_the_oracle(attention("D[i] == D[m] and m <= i and i - m < 90"), inputs)
    assert "# the live span of" in source and "tl.where(dense_" in source


@pytest.mark.parametrize("predicate", ["m <= i and i - m < 300", "i - m < 300", "D[i] == D[m] and m <= i and i - m < 300"])
def test_a_window_wider_than_the_tiles_visits_each_edge_tile_once(predicate):
    """Windows several tiles wide: interior tiles between the two edges, whose tiles run in
    one loop (the far edge's, then the diagonal's): each tile folded exactly once."""
    g = torch.Generator().manual_seed(19)
    n = 700
    inputs = {"Q": torch.randn(n, 8, generator=g), "K": torch.randn(n, 8, generator=g),
              "V": torch.randn(n, 4, generator=g), "D": _documents(n, g).float()}
    if "D[" not in predicate:
        del inputs["D"]
    source = _run_against_the_oracle(attention(predicate), inputs)
    assert "for step_m in range(0, far_m" in source or "for step_i_2 in range(0, far_i_2" in source


# ---------------------------------------------------------------- masks that vanish, decided by algebra
# What a masked argument leaves where the relation fails must be one constant for any
# finite value of the rest (sympy's evaluation of the else branches, no sampling), and
# that constant must act as the fold's identity (its lift, or its leader and weight).
VANISHING = {
    # under a sum: exp(min(-inf - L, 0)) * dO = 0 * dO = 0 for finite dO
    "Y[i,c] = sum[m](exp(min(where(m <= i, X[i,m], -inf) - L[i], 0)) * D[m,c])": ["m <= i"],
    "Y[i] = sum[m](where(m <= i, X[i,m], 0) * Z[m])": ["m <= i"],           # 0 * z = 0
    # stabilised into a rescaled fold led by max(Z): a masked element still moves the leader
    "Y[i] = sum[m](where(m <= i, X[i,m], 0) * exp(Z[m]))": [],
    "Y[i] = max[m](where(m <= i, X[i,m], -inf))": ["m <= i"],
    "Y[i] = sum[m](where(m <= i, X[i,m], 1))": [],                          # 1 is not the sum's identity
    "Y[i] = sum[m](where(m <= i, X[i,m], -inf))": [],                       # nor is -inf
    "Y[i] = max[m](where(m <= i, X[i,m], -inf) * Z[m])": [],                # -inf * z: its sign is z's
    "Y[i] = sum[m](where(m <= i, X[i,m], 0) + Z[m])": [],                   # 0 + z: not one constant
    "Y[i] = sum[m](where(m <= i and Z[m] > 0, X[i,m], 0))": ["m <= i"],     # one conjunct suffices
}


@pytest.mark.parametrize("source", list(VANISHING))
def test_a_mask_bounds_the_loop_where_its_else_branch_is_the_identity(source):
    program = compiler.compile(source, backend="triton")
    loops = [loop for kernel in outline(program.factorised, program.outputs).kernels for loop in kernel.loops]
    assert sorted(b for loop in loops for b in loop.bounds) == VANISHING[source]


def test_the_identity_facts_are_derived_once_per_fold():
    from compiler.ir import Reduce, nodes
    from compiler.schedule.bounds import acts_as_identity, index_bounds
    program = compiler.compile(attention("m <= i and i - m < 6"), backend="triton")
    fold = next(n.fold for st in program.factorised.statements for n in nodes(st.expr)
                if isinstance(n, Reduce) and index_bounds(n.fold))
    assert index_bounds(fold) is index_bounds(fold)
    before = acts_as_identity.cache_info().misses
    index_bounds(fold.__class__(fold.summary, fold.indices, fold.args))     # an equal fold: cached
    assert acts_as_identity.cache_info().misses == before


@pytest.mark.parametrize("predicate", ["m + start <= i", "m < i + start", "m >= start"])
def test_a_bound_with_a_scalar_offset_is_not_also_tested_per_tile(predicate):
    # the loop's range decides it (a shard's start, a window's width as an input): a tile
    # test of it, and the live-span scan beside it, would be work the bounds already did,
    # and kept the kernel out of the forms that take per-tile tests for data only
    program = compiler.compile(attention(predicate), backend="triton")
    (loop,) = outline(program.factorised, program.outputs).kernels[0].loops
    assert loop.skips == () and loop.bounds
    assert "skips tiles" not in str(loop) and "live span" not in str(loop)
