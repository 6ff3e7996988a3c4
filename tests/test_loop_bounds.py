"""Loop bounds read off index predicates: a fold's loop starts at the first tile
and stops after the last tile where every masking relation `m op sign * i +
offset` can hold (offset: scalars, extents, constants), and a single loop bounded
above skips the predicate on the interior tiles where it holds everywhere.  The
kernels run under Triton's interpreter against the float64 oracle at ragged sizes
with small tiles, so that several tiles fall on each side of every boundary."""
import math

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
    "m >= start": ["m >= start"],                                     # no other index
    "m + i < len(m)": ["m < -i + len(m)"],                            # the other index negated
    "2 * m <= i": [],                                                 # not +-1: no bound, still right
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
    return got, want, backend


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


def test_the_interior_of_a_window_drops_the_predicate_the_far_past_is_skipped():
    backend = compiler.compile(attention("m <= i and i - m < 6"), backend="triton").backend
    ref = compiler.compile(attention("m <= i and i - m < 6"), backend="reference")
    inputs = random_inputs(ref.checked, {"i": 64, "m": 64, "c": 4, "j": 4}, dtype=torch.float32, device=DEVICE)
    code = backend.source_for(Binder(ref.checked, extents_of=backend.program)(inputs), sm_count=None)
    # the far past: the loop starts at the first tile a key of the window can be in
    assert "lo_m = tl.maximum(0, (tl.maximum(tl.min(offs_i, 0) - 5, 0)) // BLOCK_m * BLOCK_m)" in code
    assert "hi_m = tl.minimum(n_m, tl.max(offs_i, 0) + 1)" in code
    # the interior tiles evaluate the window's conjunct but not the causal one; the boundary tiles both
    interior = code[code.index("for start_m in range(lo_m, mid_m"):code.index("# the boundary tiles")]
    boundary = code[code.index("# the boundary tiles"):]
    causal = "(offs_m[None, :] <= offs_i[:, None])"
    window = "(offs_i[:, None] - offs_m[None, :])"
    assert window in interior and causal not in interior
    assert window in boundary and causal in boundary
