"""Differential corpus: every program the oracle runs also runs, correctly, on
the Triton backend (issue 9's acceptance test).

Programs: the pass library's corpus (test_passes.PROGRAMS), the equivalent
spellings and the discovery table's rows (test_discovery), the programs that
crashed on the GPU, the extent-0 cases and the launch cases
(test_backend_regressions), each once, and programs drawn by test_fuzz's
generator.  Each runs in float32, float16 and bfloat16 at ragged sizes: every
extent 1, extents 0 (an empty output, or an empty reduction, which must give the
identity), distinct primes, and a streamed index longer than one tile.

The oracle: inputs are drawn in float64 and rounded to the dtype; the Triton
backend runs the rounded inputs, the float64 oracle (the reference backend) runs
the same rounded values in float64, so only the computation's error is measured.
The bar is the project's numerical standard (tests/test_numerics.py): at least as
accurate as the same code in the same precision -- the error relative to the
largest value at most twice what rounding in the dtype costs (the reference
backend on the rounded inputs, the oracle on inputs moved by half an ulp), plus
a floor of a few eps (FLOOR, reasons there).  NaN and infinities must sit where
the oracle's are.

On a CPU machine the kernels run under Triton's interpreter: every program in
every dtype at small sizes (in float32 each extent 0 in turn, in the other dtypes
one), and 150 generated programs (derandomized): about 50 seconds on two cores.
The `gpu` tests run the full matrix on CUDA tensors (each extent 0 in every dtype,
larger size sets: 67 to 257 on the streamed indices, a streamed index of 8209)
and 300 generated programs, and print one summary line.  EINFOLD_DIFF_EXAMPLES
and EINFOLD_DIFF_GPU_EXAMPLES set the numbers of generated programs."""
from __future__ import annotations

import itertools
import math
import os
import random
import re
import warnings
import zlib
from dataclasses import dataclass
from functools import cache

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import compiler
from compiler import reference
from compiler.bind import Binder, bind
from compiler.ir import Composite, Reduce, children
from compiler.ops import FLOAT
from compiler.random_inputs import random_inputs, relative_error
from test_backend_regressions import AUTO_SPLIT, EMPTY_CASES, GPU_CRASHES, SOURCE_CASES
from test_discovery import DISCOVERY_TABLE_ROWS, EQUIVALENT
from test_fuzz import valid_program
from test_passes import PROGRAMS

warnings.filterwarnings("ignore", message="einfold: no CUDA tensors")
pytestmark = [pytest.mark.filterwarnings("ignore:einfold. no CUDA tensors"),
              pytest.mark.usefixtures("private_cache")]

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"   # the GPU machine runs real kernels
DTYPES = (torch.float32, torch.float16, torch.bfloat16)

# The bar: err <= 2 * err_same + floor, errors relative to the largest value.
# err_same stands for the error of the same code in the same precision, which is
# at least the larger of
# - the error of the reference backend on the rounded inputs: it computes in
#   float64 and rounds only its result, so this is the result's own rounding;
# - the effect of rounding in the inputs' precision: the oracle on the rounded
#   inputs each moved by up to half an ulp (a backward-stable computation's error;
#   it grows with the conditioning: softmax weights of large logits, cancellation).
# The floor stands for the roundings the code itself adds, in two parts:
# - FLOOR eps of the dtype.  float16, bfloat16: kernels compute in float32 and round
#   once when storing, at most an ulp of the largest value (1 eps) from the
#   correctly rounded result; the operands a tensor-core dot computes (softmax
#   weights, rotated queries) are rounded to the dtype first, as torch's flash
#   kernels do: up to an eps or two more; 4 eps in all.  float32: every operation
#   rounds: each transcendental an ulp or two (the GPU's exp2, division and rsqrt
#   are approximate), a chain of them a few: 16 eps.
# - ACCUMULATION * sqrt(n) eps of float32, the accumulators' precision, for each
#   reduction of n terms (chained contractions each add their own): a sum folded
#   tile by tile takes roundings of partial sums that grow like sqrt(n) for terms
#   of random sign, and up to three times the typical error at the worst of many
#   outputs.  Calibrated against torch itself in float32 (TF32 off) on an H100 and
#   the CPU, softmax(Q K^T) V against float64, three seeds: k = 257, m = 131:
#   5.6 to 55 eps; k = 128, m = 1024: 24 to 45 eps; k = 257, m = 8209: 60 to 72
#   eps (relative to the largest value).  Negligible for 16-bit dtypes.
FLOOR = {torch.float32: 16, torch.float16: 4, torch.bfloat16: 4}
ACCUMULATION = 1.0


def floor_of(dtype, lengths: list[int]) -> float:
    """The floor, relative to the largest value, for reductions of these lengths."""
    accumulator = torch.finfo(torch.float32).eps
    return FLOOR[dtype] * torch.finfo(dtype).eps + ACCUMULATION * sum(map(math.sqrt, lengths)) * accumulator


# ---------------------------------------------------------------- the corpus
def _slug(name: str) -> str:
    return re.sub(r"\W+", "_", name).strip("_")


def _corpus() -> dict[str, str]:
    """name -> source: every program of the tables, each source once (first name)."""
    tables = [("passes", PROGRAMS.items()),
              ("equivalent", [(f"{n}_{k}", s) for n, pair in EQUIVALENT.items() for k, s in enumerate(pair)]),
              ("discovery", DISCOVERY_TABLE_ROWS),
              ("crash", GPU_CRASHES.items()),
              ("empty", [(n, s) for n, (s, _) in EMPTY_CASES.items()]),
              ("launch", [(n, s) for n, s, _ in SOURCE_CASES + AUTO_SPLIT])]
    seen, corpus = set(), {}
    for table, rows in tables:
        for name, source in rows:
            key = re.sub(r"\s+", "", source.replace("\n", ";"))
            if key not in seen:
                seen.add(key)
                corpus[f"{table}-{_slug(name)}"] = source
    return corpus


CORPUS = _corpus()


@dataclass(frozen=True)
class Case:
    source: str
    reference: compiler.Program
    triton: compiler.Program
    symbols: tuple            # extent symbols (unified indices share one), in order
    streamed: frozenset       # symbols of the indices an outermost reduction or softmax streams
    inner: frozenset          # symbols reduced only inside another reduction (contractions)
    reductions: tuple         # the symbols each reduction or softmax folds over

    def extents(self, by_symbol: dict) -> dict[str, int]:
        """Sizes by index (unified indices share their symbol's size)."""
        return {ix: by_symbol[s] for ix, s in self.reference.checked.extents}


def _reductions(e, inside: bool = False):
    """(indices, whether inside another reduction) of every reduction and softmax in `e`."""
    binds = isinstance(e, Reduce | Composite)
    if binds:
        yield e.indices, inside
    for child in children(e):
        yield from _reductions(child, inside or binds)


@cache
def case_of(source: str) -> Case:
    ref = compiler.compile(source, backend="reference")
    symbols = dict(ref.checked.extents)
    found = [(symbols[i], inside) for st in ref.checked.statements for ixs, inside in _reductions(st.expr)
             for i in ixs]
    streamed = frozenset(s for s, inside in found if not inside)
    groups = tuple(dict.fromkeys(tuple(symbols[i] for i in ixs) for st in ref.checked.statements
                                 for ixs, _ in _reductions(st.expr)))
    inner = frozenset(s for s, _ in found) - streamed
    order = tuple(dict.fromkeys(symbols.values()))
    return Case(source, ref, compiler.compile(source, backend="triton"), order, streamed, inner, groups)


# ---------------------------------------------------------------- size sets
def _assign(case: Case, free: tuple, streamed: tuple, inner: tuple) -> dict:
    """Sizes by symbol, in order of first appearance: streamed symbols from `streamed`,
    contracted ones from `inner`, the others from `free` (distinct, so that a
    transposed index shows)."""
    pools = {"streamed": itertools.cycle(streamed), "inner": itertools.cycle(inner),
             "free": itertools.cycle(free)}
    return {sym: next(pools["streamed" if sym in case.streamed else "inner" if sym in case.inner else "free"])
            for sym in case.symbols}


LADDER = (8209, 257, 131, 67, 37, 31, 19, 17, 13, 11, 7, 5, 3, 2, 1)


def _capped(case: Case, by_symbol: dict, cap: int) -> dict:
    """Step the largest sizes down the ladder (streamed ones last) until the product
    of all extents (the oracle's largest broadcast) is at most `cap`."""
    by_symbol = dict(by_symbol)
    while math.prod(by_symbol.values()) > cap:
        others = [s for s in by_symbol if s not in case.streamed and by_symbol[s] > 2]
        pick = max(others or by_symbol, key=lambda s: by_symbol[s])
        by_symbol[pick] = next(n for n in LADDER if n < by_symbol[pick])
    return by_symbol


PRIMES = ((5, 3, 7, 2, 11), (13, 17, 11, 7), (11, 13, 5, 7))        # free, streamed, contracted


def _zero(sets: dict, primes: dict, symbols) -> dict:
    """`primes` with one symbol's extent 0, for each of `symbols`: an empty output, or
    an empty reduction (the identity), or both."""
    for sym in symbols:
        sets[f"zero {str(sym).removeprefix('len_')}"] = {**primes, sym: 0}
    return sets


def cpu_size_sets(case: Case, number: int, dtype_number: int) -> dict[str, dict]:
    """Every extent 1, primes, a streamed loop of two tiles, and extents 0: each
    symbol in float32, one (moving with the program and the dtype) in the others."""
    primes = _assign(case, *PRIMES)
    # 67 > the 64 of a dot's tile: a streamed loop of two tiles, the second ragged
    streamed = _capped(case, _assign(case, (3, 2, 5), (67, 5), (5, 3)), 1 << 12)
    zeros = case.symbols if dtype_number == 0 else \
        [case.symbols[(number + dtype_number) % len(case.symbols)]]
    sets = {"ones": dict.fromkeys(case.symbols, 1), "primes": primes, "streamed": streamed}
    return _zero(sets, primes, zeros)


def gpu_size_sets(case: Case) -> dict[str, dict]:
    """Every extent 1, primes, each symbol's extent 0 in turn, large primes, and one
    streamed index longer than a streamed tile (8192)."""
    primes = _assign(case, *PRIMES)
    sets = _zero({"ones": dict.fromkeys(case.symbols, 1), "primes": primes}, primes, case.symbols)
    sets["large"] = _capped(case, _assign(case, (37, 19, 5, 3, 2, 7), (257, 131, 67), (67, 37, 19)), 1 << 22)
    if case.streamed:
        sets["long"] = _capped(case, _assign(case, (3, 2, 5), (8209, 3), (5, 3)), 1 << 20)
    return sets


# ---------------------------------------------------------------- one run
def _tuple(x):
    return x if isinstance(x, tuple) else (x,)


def _judge(got: torch.Tensor, want: torch.Tensor, same: torch.Tensor, nudged: torch.Tensor, dtype, kind: str,
           scale: float, floor: float) -> str | None:
    """None if `got` (Triton) meets the bar against `want` (the oracle on the rounded
    inputs); else what is wrong.  `same`: the reference backend on the rounded inputs
    (the oracle's result rounded to the dtype); `nudged`: the oracle on the rounded
    inputs each moved by up to half an ulp of the dtype."""
    got = got.detach().cpu()
    if list(got.shape) != list(want.shape):
        return f"shape {list(got.shape)}, the oracle's {list(want.shape)}"
    if kind != FLOAT:       # argmax and the like: the same rounded inputs, ties go to the first
        differ = int((got.to(want.dtype) != want).sum())
        return f"{differ} of {want.numel()} values differ from the oracle's" if differ else None
    if got.dtype != dtype:
        return f"dtype {got.dtype}, not {dtype}"
    got, same = got.double(), same.double()
    nan = torch.isnan(got)
    if not torch.equal(nan, torch.isnan(want)):
        return f"NaN at {int(nan.sum())} positions, the oracle at {int(torch.isnan(want).sum())} " \
               f"(not the same)"
    inf = torch.isinf(got)      # overflow of the dtype included: against the oracle's result in the dtype
    if not (torch.equal(inf, torch.isinf(same)) and torch.equal(got[inf], same[inf])):
        return f"infinities at {int(inf.sum())} positions, the oracle's at {int(torch.isinf(same).sum())} " \
               f"(not the same)"
    finite = ~(nan | inf)
    got, want, same = got[finite], want[finite], same[finite]
    nudged = nudged[finite]
    steady = torch.isfinite(nudged)
    eps = torch.finfo(dtype).eps
    err = relative_error(got, want)
    err_same = max(relative_error(same, want), relative_error(nudged[steady], want[steady]))
    bar = 2 * err_same + floor
    if err <= bar:
        return None
    if want.numel() and float(want.abs().max()) <= eps * scale:
        # every value is below one rounding of the inputs' size (cancellation: log-softmax
        # or a central moment over one element): relative to the inputs instead
        absolute = float((got - want).abs().max()) / scale
        if absolute <= floor:
            return None
        return f"error {absolute / eps:.1f} eps of the largest input ({scale:.3g}) on a result below " \
               f"its rounding (> the floor of {floor / eps:.1f} eps)"
    return f"relative error {err:.3g} = {err / eps:.1f} eps > bar {bar / eps:.1f} eps " \
           f"(2 x {err_same / eps:.2f} eps of the same precision + a floor of {floor / eps:.1f} eps)"


def _nudge(inputs: dict, dtype, seed: int) -> dict:
    """The inputs in float64, each value (numbers too) moved by a random fraction of
    half an ulp of the dtype, up or down."""
    g = torch.Generator().manual_seed(seed)
    u = torch.finfo(dtype).eps / 2
    return {k: v.double() * (1 + u * (2 * torch.rand(v.shape, generator=g, dtype=torch.float64) - 1))
            if isinstance(v, torch.Tensor) and v.is_floating_point()
            else v * (1 + u * (2 * float(torch.rand((), generator=g)) - 1)) if isinstance(v, float) else v
            for k, v in inputs.items()}


def run_one(case: Case, dtype, by_symbol: dict, seed: int, device: str) -> str | None:
    """None when the Triton backend agrees with the oracle; else the reasons, per output."""
    ref = case.reference
    raw = random_inputs(ref.checked, case.extents(by_symbol), dtype=torch.float64, seed=seed)
    floating = {k for k, v in raw.items() if isinstance(v, torch.Tensor) and v.is_floating_point()}
    low = {k: v.to(dtype) if k in floating else v for k, v in raw.items()}      # scalars stay numbers
    want = _tuple(ref(**{k: v.double() if k in floating else v for k, v in low.items()}))
    same = _tuple(ref(**low))
    nudged = _tuple(ref(**_nudge(low, dtype, seed)))
    try:
        got = _tuple(case.triton(**{k: v.to(device) if isinstance(v, torch.Tensor) else v
                                    for k, v in low.items()}))
    except Exception as e:  # noqa: BLE001 -- the property: a program the oracle runs
        return f"{type(e).__name__}: {str(e)[:400]}"
    scale = max([float(low[k].abs().max()) for k in floating if low[k].numel()] +
                [abs(v) for v in low.values() if isinstance(v, float)] + [1e-30])
    lengths = [math.prod(by_symbol[s] for s in group) for group in case.reductions]
    floor, problems = floor_of(dtype, lengths), []
    for name, g, w, s, n in zip(ref.outputs, got, want, same, nudged):
        problem = _judge(g, w, s, n, dtype, ref.checked.statement(name).dtype, scale, floor)
        if problem:
            problems.append(f"{name}: {problem}")
    return "; ".join(problems) or None


def describe(case: Case, dtype, by_symbol: dict, problem: str) -> str:
    sizes = ", ".join(f"{ix}={n}" for ix, n in case.extents(by_symbol).items())
    return f"{str(dtype).removeprefix('torch.')} at {sizes}: {problem}\n    {case.source!r}"


def _seed(*parts) -> int:
    return zlib.crc32("/".join(map(str, parts)).encode())


def run_matrix(name: str, sets_of, device: str) -> tuple[int, list[str]]:
    """Every dtype at every size set `sets_of(case, dtype_number)` gives: (runs, failures)."""
    case = case_of(CORPUS[name])
    runs, failures = 0, []
    for d, dtype in enumerate(DTYPES):
        for label, by_symbol in sets_of(case, d).items():
            runs += 1
            problem = run_one(case, dtype, by_symbol, _seed(name, dtype, label), device)
            if problem:
                failures.append(f"[{label}] {describe(case, dtype, by_symbol, problem)}")
    return runs, failures


# ---------------------------------------------------------------- the oracle itself
NAMES = list(CORPUS)


def definitions_disagree(case: Case, by_symbol: dict, seed: int) -> str | None:
    """None when the factorised program the oracle runs (float64, folded in random
    chunks merged in random orders) agrees with the program as checked, before any
    pass: every reduction and softmax from its definition (composites by torch's own
    functions).  This makes the oracle independent of the passes it checks: a
    factorisation bug would otherwise be in both sides of every comparison.

    One documented difference is allowed: at an empty extent a result normalised by
    a sum over that index has no mass and is NaN, like a fully masked row
    (docs/language.md), where the definitions sum nothing and give 0."""
    ref = case.reference
    inputs = random_inputs(ref.checked, case.extents(by_symbol), dtype=torch.float64, seed=seed)
    want = reference.run(ref.checked, inputs, bind(ref.checked, inputs).extents, ref.outputs)
    extents = Binder(ref.checked, extents_of=ref.factorised)(inputs).extents
    got = reference.run(ref.factorised, inputs, extents, ref.outputs, chunking=random.Random(seed))
    empty = 0 in by_symbol.values()
    problems = []
    for name in ref.outputs:
        g, w = got[name].double(), want[name].double()
        no_mass = torch.isnan(g) & ~torch.isnan(w) if empty else torch.zeros_like(g, dtype=torch.bool)
        try:
            torch.testing.assert_close(torch.where(no_mass, w, g), w, rtol=1e-9, atol=1e-9, equal_nan=True)
        except AssertionError as e:
            problems.append(f"{name}: " + " ".join(str(e).split())[:300])
    return "; ".join(problems) or None


@pytest.mark.parametrize("name", NAMES)
def test_the_factorised_corpus_agrees_with_its_definitions(name):
    """The oracle of the tests below runs the factorised program: here it is checked
    against the definitions at every CPU size set (each extent 0 in turn included)."""
    number = NAMES.index(name)
    case = case_of(CORPUS[name])
    failures = [f"[{label}] {problem}" for label, by_symbol in cpu_size_sets(case, number, 0).items()
                if (problem := definitions_disagree(case, by_symbol, _seed(name, label)))]
    assert not failures, "\n".join(failures)


# ---------------------------------------------------------------- the corpus, CPU (interpreter) or GPU


@pytest.fixture(autouse=True)
def ieee_float32():
    """float32 means IEEE float32 (torch's default): float32 dots on TF32 tensor
    cores would be another precision, with another bar."""
    matmul = torch.backends.cuda.matmul
    if hasattr(matmul, "fp32_precision"):
        before, matmul.fp32_precision = matmul.fp32_precision, "ieee"
        yield
        matmul.fp32_precision = before
    else:
        before = torch.get_float32_matmul_precision()
        torch.set_float32_matmul_precision("highest")
        yield
        torch.set_float32_matmul_precision(before)


@pytest.mark.parametrize("name", NAMES)
def test_corpus_program_agrees_with_the_oracle(name):
    """Small sizes (the interpreter on CPU): 3 dtypes x 4 or more size sets."""
    number = NAMES.index(name)
    runs, failures = run_matrix(name, lambda case, d: cpu_size_sets(case, number, d), DEVICE)
    if failures:
        pytest.fail(f"{len(failures)} of {runs} runs of {name} disagree with the oracle:\n"
                    + "\n".join(failures))


class _Summary:
    """A plugin for the session: one line in pytest's terminal summary."""
    line = ""

    def pytest_terminal_summary(self, terminalreporter):
        if self.line:
            terminalreporter.write_line(self.line)


@pytest.fixture(scope="session")
def gpu_tally(request):
    """Counts of the GPU corpus runs, summed up in one line at the end of the session."""
    tally = {"programs": 0, "runs": 0, "agree": 0, "sets": set()}
    summary = _Summary()
    request.config.pluginmanager.register(summary)
    yield tally
    summary.line = (f"differential corpus (GPU): {tally['programs']} programs x {len(DTYPES)} dtypes x "
                    f"up to {len(tally['sets'])} size sets: {tally['runs']} runs, {tally['agree']} agree")


@pytest.mark.gpu
@pytest.mark.parametrize("name", NAMES)
def test_gpu_corpus_program_agrees_with_the_oracle(name, gpu_tally):
    """Compiled (autotuned) kernels on CUDA tensors: 3 dtypes x every GPU size set."""
    runs, failures = run_matrix(name, lambda case, d: gpu_size_sets(case), "cuda")
    gpu_tally["programs"] += 1
    gpu_tally["runs"] += runs
    gpu_tally["agree"] += runs - len(failures)
    gpu_tally["sets"] |= set(gpu_size_sets(case_of(CORPUS[name])))
    if failures:
        pytest.fail(f"{len(failures)} of {runs} runs of {name} disagree with the oracle:\n"
                    + "\n".join(failures))


# ---------------------------------------------------------------- generated programs
EXAMPLES = int(os.environ.get("EINFOLD_DIFF_EXAMPLES", "150"))             # CPU
GPU_EXAMPLES = int(os.environ.get("EINFOLD_DIFF_GPU_EXAMPLES", "300"))
SETTINGS = dict(deadline=None, database=None,
                suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large,
                                       HealthCheck.filter_too_much])


def _generated(data, sizes: tuple, cap: int, device: str) -> None:
    source = data.draw(valid_program(), label="program")
    dtype = data.draw(st.sampled_from(DTYPES), label="dtype")
    case = case_of(source)
    drawn = {s: data.draw(st.sampled_from(sizes), label=f"len({str(s).removeprefix('len_')})")
             for s in case.symbols}
    by_symbol = _capped(case, drawn, cap)
    seed = data.draw(st.integers(0, 2 ** 16), label="seed")
    problem = definitions_disagree(case, _capped(case, by_symbol, 1 << 12), seed) or \
        run_one(case, dtype, by_symbol, seed, device)
    if problem:
        pytest.fail(describe(case, dtype, by_symbol, problem))


@settings(max_examples=EXAMPLES, derandomize=True, **SETTINGS)
@given(data=st.data())
def test_generated_programs_agree_with_the_oracle(data):
    _generated(data, (0, 1, 2, 3, 5, 7, 13, 67), 1 << 12, DEVICE)


@pytest.mark.gpu
@settings(max_examples=GPU_EXAMPLES, derandomize=False, **SETTINGS)
@given(data=st.data())
def test_gpu_generated_programs_agree_with_the_oracle(data):
    _generated(data, (0, 1, 2, 3, 5, 13, 31, 67, 131, 257, 8209), 1 << 20, "cuda")
