"""The `general` bench group's programs and baselines at tiny ragged sizes: each
family's einfold source (the reference backend, and the Triton backend, under its
interpreter on CPU) against the family's own torch function and other torch
spellings in float64, the same callables the bench times; run_case's float64
oracle, several-output errors and table; the group on the command line."""
import math

import pytest
import torch

import compiler
from compiler import bench, bench_general
from compiler.bench_general import FAMILIES
from compiler.cli import BENCH_GROUPS, build_parser

# einfold's "no CUDA tensors"
pytestmark = pytest.mark.filterwarnings("ignore::RuntimeWarning")

# every index of each family at a tiny extent, each extent of a family distinct where it can be
TINY = {
    "swiglu": {"i": 5, "d": 7, "f": 3},
    "swiglu mlp": {"i": 5, "d": 7, "f": 3, "e": 4},
    "gelu mlp": {"i": 5, "d": 7, "f": 3, "e": 4},
    "chamfer": {"b": 2, "i": 5, "m": 7, "k": 3},
    "k-means assign": {"i": 7, "c": 5, "k": 3},
    "linear cross-entropy": {"i": 5, "k": 3, "v": 7},
    "linear cross-entropy, int labels": {"i": 5, "k": 3, "v": 7},
    "embedding": {"i": 5, "v": 7, "d": 3},
    "sinkhorn step": {"i": 5, "j": 7},
    "residual + rmsnorm": {"i": 5, "k": 7},
    "rmsnorm": {"i": 5, "k": 7},
    "layernorm": {"i": 5, "k": 7},
    "groupnorm": {"b": 2, "g": 3, "c": 5, "s": 7},
    "masked cross-entropy": {"i": 40, "v": 7},        # 40 rows: some of them ignored
    "label-id cross-entropy": {"i": 40, "v": 7},
    "labelled cross-entropy": {"i": 40, "v": 7},
    "mean cross-entropy": {"t": 5, "v": 7},
    "row statistics": {"i": 5, "k": 7},
    "column statistics": {"n": 7, "k": 5},
    "retention": {"b": 2, "h": 3, "i": 5, "m": 7, "k": 3, "j": 4},
    "gaussian mixture": {"n": 5, "c": 7, "d": 3},
    "mla decode": {"b": 2, "h": 3, "m": 7, "c": 5},
    "linear attention": {"b": 2, "h": 3, "i": 5, "m": 7, "k": 3, "j": 4},
    "cumsum": {"b": 3, "t": 7},
    "logcumsumexp": {"b": 3, "t": 7},
    "cdf": {"b": 3, "t": 7},
    "selective scan": {"b": 2, "d": 3, "n": 5, "t": 7},
}
BY_NAME = {family.name: family for family in FAMILIES}
# the Triton backend runs CUDA tensors, or CPU tensors under its interpreter where there is no GPU
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


@pytest.fixture(autouse=True)
def _cache(private_cache):
    """Generated modules go to a temporary folder."""


def tiny_inputs(family, dtype=torch.float64, device="cpu"):
    return family.make(TINY[family.name], dtype, torch.Generator(device=device).manual_seed(0))


def assert_same(got, want, rtol=1e-9, atol=1e-9):
    """One output or several (a tuple), value by value."""
    if isinstance(want, tuple):
        assert isinstance(got, tuple) and len(got) == len(want)
        for g, w in zip(got, want):
            assert_same(g, w, rtol, atol)
        return
    assert got.shape == want.shape
    torch.testing.assert_close(got.double(), want.double(), rtol=rtol, atol=atol)


def test_every_family_is_checked_here_and_its_sizes_name_its_indices():
    assert len(FAMILIES) >= 16 and len(BY_NAME) == len(FAMILIES)
    assert set(BY_NAME) == set(TINY)
    for family in FAMILIES:
        for extents in (*family.sizes, family.quick):
            assert extents.keys() == TINY[family.name].keys(), family.name


@pytest.mark.parametrize("name", list(TINY))
def test_the_source_computes_the_torch_function(name):
    family = BY_NAME[name]
    x = tiny_inputs(family)
    want = family.torch_fn(x)
    program = compiler.compile(family.source, backend="reference", outputs=family.outputs,
                               summaries=[make() for make in family.summaries])
    assert_same(bench._inputs_of(program)(x), want)
    for spelling in family.spellings.values():
        assert_same(spelling(x), want)
    if family.compiled is not None:         # a baseline of its own (a compiled step in a loop)
        assert_same(family.compiled(x), want)


@pytest.mark.parametrize("name", list(TINY))
def test_the_generated_kernels_compute_the_torch_function(name):
    """The Triton backend in float32 against the torch function in float64."""
    family = BY_NAME[name]
    x = tiny_inputs(family, torch.float32, DEVICE)
    program = compiler.compile(family.source, backend="triton", outputs=family.outputs,
                               summaries=[make() for make in family.summaries])
    assert bench._error(bench._inputs_of(program)(x), bench.float64_oracle(family.torch_fn)(x)) < 1e-6


@pytest.mark.parametrize("name", ["masked cross-entropy", "label-id cross-entropy", "labelled cross-entropy"])
def test_the_masked_losses_are_zero_exactly_on_the_ignored_rows(name):
    family = BY_NAME[name]
    x = tiny_inputs(family)
    ignored = x["labels"] < 0
    assert ignored.any() and not ignored.all()
    loss = bench._inputs_of(compiler.compile(family.source, backend="reference"))(x)
    assert (loss[ignored] == 0).all() and (loss[~ignored] > 0).all()


def test_the_oracle_reads_float64_copies_and_leaves_the_labels_alone():
    family = BY_NAME["masked cross-entropy"]
    x = tiny_inputs(family, torch.bfloat16)
    want = family.torch_fn({**x, "Z": x["Z"].double()})
    got = bench.float64_oracle(family.torch_fn)(x)
    assert got.dtype == torch.float64 and x["Z"].dtype == torch.bfloat16
    torch.testing.assert_close(got, want, rtol=0, atol=0)


def test_the_error_of_several_outputs_is_the_largest_and_shapes_must_match():
    want = (torch.ones(4), 100 * torch.ones(3))
    got = (torch.ones(4) * 1.01, 100 * torch.ones(3) * 1.5)
    assert bench._error(got, want) == pytest.approx(0.5)
    # a missing output, or one of another shape, is not broadcast into a small error
    assert bench._error(got[:1], want) == bench._error(got[0], want) == math.inf
    assert bench._error(torch.ones(4, 1), torch.ones(4)) == math.inf


def test_run_case_measures_errors_against_the_oracle(monkeypatch):
    """run_case's bookkeeping, its timing and memory stubbed out (they need a GPU): every error
    against the oracle, the first baseline's too; a wrong result flagged; a program the
    compiler rejects a FAILED row; the case's note on ours' row."""
    import triton.testing
    monkeypatch.setattr(triton.testing, "do_bench", lambda fn, **options: (fn(), 1.0)[1])
    monkeypatch.setattr(torch.cuda, "synchronize", lambda: None)
    monkeypatch.setattr(bench, "_peak_mib", lambda fn, x: 3.0)
    family = BY_NAME["row statistics"]
    x = tiny_inputs(family, torch.float32)
    ours = bench._inputs_of(compiler.compile(family.source, backend="reference", outputs=family.outputs))

    def case(ours):
        return bench.Case("general", "row statistics", 1e9, "GB/s", lambda: x, ours,
                          {"torch eager": family.torch_fn, "three outputs": lambda x: family.torch_fn(x)[:3]},
                          reference=bench.float64_oracle(family.torch_fn), note="a note")
    rows = {row.contender: row for row in bench.run_case(case(ours))}
    assert rows["einfold"].error < 1e-6 and rows["einfold"].note == "a note" and rows["einfold"].peak_mib == 3.0
    assert 0 < rows["torch eager"].error < 1e-6 and rows["three outputs"].error == math.inf
    assert rows["einfold"].ratio_ours_over_this == 1.0

    scaled = bench.run_case(case(lambda x: tuple(1.1 * t for t in ours(x))))[0]
    assert scaled.note.startswith("MISMATCH vs float64 oracle: rel err 1.00e-01")
    rejected = bench.run_case(case(lambda x: compiler.compile("Y[i] = nope(X[i,k])")(X=x["X"])))[0]
    assert rejected.note.startswith("FAILED: CheckError") and rejected.note.endswith("; a note")


def test_the_table_shows_the_error_and_the_peak_memory():
    meta = {"device": "cpu", "torch": "x", "triton": "y", "date": "today", "copy_bandwidth_GBps": 1.0}
    rows = [bench.Row("general", "rmsnorm i5 k7", "einfold", 1.0, 2.0, "GB/s", 1.0, 3e-3, peak_mib=12.0),
            bench.Row("general", "rmsnorm i5 k7", "torch eager", 2.0, 1.0, "GB/s", 2.0, 5e-3, peak_mib=40.0)]
    table = bench.format_table(rows, meta).splitlines()
    assert "rel err" in table[1] and "peak MiB" in table[1]
    assert "3.0e-03" in table[2] and " 12 " in table[2] and "5.0e-03" in table[3] and " 40 " in table[3]


@pytest.mark.parametrize("quick", [True, False])
def test_the_group_makes_a_case_per_size_each_with_its_oracle(quick):
    compiled = []

    def compile_(source, **options):
        compiled.append(source)
        return compiler.compile(source, backend="reference", **options)
    cases = bench_general.GROUPS["general"](compile_, quick)
    assert len(cases) == (len(FAMILIES) if quick else sum(len(f.sizes) for f in FAMILIES))
    assert len({case.name for case in cases}) == len(cases)
    assert all(case.reference is not None and list(case.baselines)[:2] == ["torch.compile", "torch eager"]
               for case in cases)
    assert compiled == []          # nothing compiles before a case runs: a rejected program is a FAILED row
    # ours, called, compiles the family's program with its outputs
    case = next(case for case in cases if case.name.startswith("row statistics"))
    x = tiny_inputs(BY_NAME["row statistics"])
    assert_same(case.ours(x), case.reference(x))
    assert compiled == [bench_general.ROW_STATISTICS]


def test_the_group_is_registered_and_on_the_command_line():
    assert "general" in bench_general.GROUPS and "general" in BENCH_GROUPS
    args = build_parser().parse_args(["bench", "--group", "general", "--quick"])
    assert args.group == ["general"] and args.quick
