"""Generated programs whose folds hold several summaries over one index, checked
against torch in float64 written here, independently of the compiler.

A program is drawn (seeded, so every run draws the same ones) as a few
statements over the reduced index e, each a row of KINDS: its source line and its
meaning as a torch expression, built side by side.  The draws cover:
- argmax and argmin beside every other kind (sum, max, min, mean, variance,
  logsumexp, softmax, a softmax-weighted sum), over the same index and scores;
- folds with several rescaled structures: two softmax-weighted sums with
  different scores, a logsumexp beside a softmax, beside a weighted sum;
- every kind on a score read through a gathered subscript (`X[t,P[e]]`, P a
  permutation of the columns: integer positions);
- prefix results (scans along u over e <= u, a suffix over e >= u) beside folds
  over the whole of e, on plain and gathered scores;
- more statements drawn at random from the rows, on scores drawn from SCORES.
The inputs hold, besides ordinary rows, a row with a NaN, with +inf, with -inf,
a row all -inf, rows with +1e30 and -1e30, and rows of ties.

The reference backend runs each drawn program in float64 and must give what
torch gives (NaN where torch has NaN, the same infinities, the first extreme's
position); the Triton backend runs the same programs in float32 (the interpreter
on a CPU) and must give torch's float64 result on the same float32 inputs,
rounded to float32, within float32's accuracy."""
from __future__ import annotations

import math
import random
import warnings
from dataclasses import dataclass
from typing import Callable

import pytest
import torch

import compiler

warnings.filterwarnings("ignore", message="einfold: no CUDA tensors")
pytestmark = [pytest.mark.filterwarnings("ignore:einfold. no CUDA tensors"),
              pytest.mark.usefixtures("private_cache")]

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
ROWS, LENGTH, VALUES = 10, 13, 3            # t, e (the reduced index), j (a weighted sum's values)
Tensors = dict[str, torch.Tensor]


@dataclass(frozen=True)
class Score:
    """A score over (t, e): its source and its torch meaning."""
    source: str
    torch: Callable[[Tensors], torch.Tensor]


# the scores a statement reduces (the edge rows of X reach every one of them)
SCORES = (
    Score("X[t,e]", lambda x: x["X"]),
    Score("Y[t,e]", lambda x: x["Y"]),
    Score("X[t,e] * 0.5", lambda x: x["X"] * 0.5),
    Score("X[t,e] + Y[t,e]", lambda x: x["X"] + x["Y"]),
)
# X's columns read through the integer positions P (a gathered subscript)
GATHERED = Score("X[t,P[e]]", lambda x: x["X"][:, x["P"]])


def _variance(s: torch.Tensor) -> torch.Tensor:
    return ((s - s.mean(1, keepdim=True)) ** 2).mean(1)


@dataclass(frozen=True)
class Kind:
    """One statement kind over e: its source lines (given the statement's name o and
    its score's source s) and the statement's value in torch (given the score)."""
    name: str
    lines: Callable[[str, str], list[str]]
    torch: Callable[[torch.Tensor, Tensors], torch.Tensor]


KINDS = {k.name: k for k in (
    Kind("sum", lambda o, s: [f"{o}[t] = sum[e]({s})"], lambda s, x: s.sum(1)),
    Kind("max", lambda o, s: [f"{o}[t] = max[e]({s})"], lambda s, x: s.amax(1)),
    Kind("min", lambda o, s: [f"{o}[t] = min[e]({s})"], lambda s, x: s.amin(1)),
    Kind("mean", lambda o, s: [f"{o}[t] = mean[e]({s})"], lambda s, x: s.mean(1)),
    Kind("variance", lambda o, s: [f"{o}_mean[t] = mean[e]({s})", f"{o}[t] = mean[e](({s} - {o}_mean[t]) ** 2)"],
         lambda s, x: _variance(s)),
    Kind("logsumexp", lambda o, s: [f"{o}[t] = logsumexp[e]({s})"], lambda s, x: torch.logsumexp(s, 1)),
    Kind("softmax", lambda o, s: [f"{o}[t,e] = softmax[e]({s})"], lambda s, x: torch.softmax(s, 1)),
    Kind("weighted", lambda o, s: [f"{o}[t,j] = softmax[e]({s}) * V[e,j]"],
         lambda s, x: torch.softmax(s, 1) @ x["V"]),
    Kind("argmax", lambda o, s: [f"{o}[t] = argmax[e]({s}, e)"], lambda s, x: s.argmax(1)),
    Kind("argmin", lambda o, s: [f"{o}[t] = argmin[e]({s}, e)"], lambda s, x: s.argmin(1)),
)}
# prefix results over e at every position u (a scan), and a suffix; u's extent is a size input
PREFIX_KINDS = {k.name: k for k in (
    Kind("cumsum", lambda o, s: [f"{o}[t,u] = sum[e](where(e <= u, {s}, 0.0))"], lambda s, x: s.cumsum(1)),
    Kind("cummax", lambda o, s: [f"{o}[t,u] = max[e](where(e <= u, {s}, -inf))"], lambda s, x: _cummax(s)),
    Kind("logcumsumexp", lambda o, s: [f"{o}[t,u] = logsumexp[e](where(e <= u, {s}, -inf))"],
         lambda s, x: s.logcumsumexp(1)),
    Kind("suffix sum", lambda o, s: [f"{o}[t,u] = sum[e](where(e >= u, {s}, 0.0))"],
         lambda s, x: s.flip(1).cumsum(1).flip(1)),
)}


def _cummax(s: torch.Tensor) -> torch.Tensor:
    """The running max with NaN propagated from where it first occurs (einfold's max, as
    torch.amax; torch.cummax keeps NaN too)."""
    return torch.stack([s[:, :u + 1].amax(1) for u in range(s.shape[1])], 1)


@dataclass(frozen=True)
class Drawn:
    """A drawn program: its statements as (name, kind, score)."""
    statements: tuple[tuple[str, Kind, Score], ...]

    @property
    def source(self) -> str:
        return "\n".join(line for name, kind, score in self.statements for line in kind.lines(name, score.source))

    @property
    def outputs(self) -> tuple[str, ...]:
        return tuple(name for name, _, _ in self.statements)

    def expected(self, inputs: Tensors) -> Tensors:
        return {name: kind.torch(score.torch(inputs), inputs) for name, kind, score in self.statements}

    def __str__(self) -> str:
        return self.source.replace("\n", "; ")


def _drawn(*parts: tuple[str, Score]) -> Drawn:
    kinds = KINDS | PREFIX_KINDS
    return Drawn(tuple((f"{kind.upper()[:1]}{k}", kinds[kind], score) for k, (kind, score) in enumerate(parts)))


def draw_programs(seed: int = 0, extra: int = 12) -> list[Drawn]:
    """The covering draws (argmax/argmin beside every kind on one score, several
    rescaled structures) and `extra` programs of 2 to 4 statements drawn at random."""
    rng = random.Random(seed)
    x, y = SCORES[0], SCORES[1]
    out = [_drawn((extreme, x), (kind, x)) for extreme in ("argmax", "argmin")
           for kind in KINDS if kind != extreme]
    out += [_drawn(("weighted", x), ("weighted", y)),
            _drawn(("logsumexp", x), ("softmax", x)),
            _drawn(("logsumexp", y), ("weighted", y), ("argmax", y)),
            _drawn(("weighted", x), ("weighted", SCORES[3]), ("logsumexp", x), ("argmin", x))]
    out += [_drawn(*((kind, GATHERED) for kind in kinds))
            for kinds in (("sum", "max", "min", "argmax"), ("mean", "logsumexp", "softmax"),
                          ("variance", "weighted", "argmin"))]
    # a mean beside a variance of one score: one moments summary, whose merge met inf - inf on
    # the rows holding an infinity (NaN where torch's mean is inf)
    out += [_drawn(("mean", x), ("variance", x)), _drawn(("variance", GATHERED), ("mean", GATHERED), ("sum", x))]
    out += [_drawn(("cumsum", x), ("logcumsumexp", x), ("max", x)),
            _drawn(("cummax", y), ("suffix sum", y), ("argmax", y)),
            _drawn(("logcumsumexp", GATHERED), ("cumsum", SCORES[3]), ("softmax", GATHERED)),
            _drawn(("suffix sum", GATHERED), ("cummax", x), ("variance", x))]
    for _ in range(extra):
        out.append(_drawn(*((rng.choice(list(KINDS)), rng.choice(SCORES)) for _ in range(rng.randint(2, 4)))))
    return out


PROGRAMS = draw_programs()


def edge_rows(seed: int) -> Tensors:
    """X: ordinary rows and the edge rows; Y, V ordinary (Y with ties); P a permutation
    of X's columns (int64)."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(ROWS, LENGTH, generator=g, dtype=torch.float64) * 3
    x[1, 4] = math.nan
    x[2, 7] = math.inf
    x[3, 2] = -math.inf
    x[4] = -math.inf
    x[5, 9] = 1e30
    x[6, 0] = -1e30
    x[7] = torch.randint(-2, 3, (LENGTH,), generator=g).double()       # ties
    x[8, 3] = x[8, 11] = x[8].max() + 1.0                               # two equal extremes
    y = torch.randint(-3, 4, (ROWS, LENGTH), generator=g).double() * 0.75
    v = torch.randn(LENGTH, VALUES, generator=g, dtype=torch.float64)
    return {"X": x, "Y": y, "V": v, "P": torch.randperm(LENGTH, generator=g)}


def _agrees(got: torch.Tensor, want: torch.Tensor, rtol: float, atol: float) -> str | None:
    """None if `got` is `want` (NaN where it has NaN, the same infinities, integers
    equal), else where they differ."""
    got = got.cpu()
    if not want.is_floating_point():
        return None if torch.equal(got.to(want.dtype), want) else f"got {got.tolist()}, want {want.tolist()}"
    got = got.double()
    same_nan = torch.isnan(got) == torch.isnan(want)
    finite = torch.isfinite(want)
    close = torch.where(finite, (got - want).abs() <= atol + rtol * want.abs(), got == want)
    ok = same_nan & (close | torch.isnan(want))
    if bool(ok.all()):
        return None
    rows = sorted({int(r) for r in ok.logical_not().nonzero()[:, 0]})
    return "; ".join(f"row {r}: got {got[r].tolist()}, want {want[r].tolist()}" for r in rows)


def _check(program: Drawn, backend: str, dtype: torch.dtype) -> list[str]:
    inputs = {n: t.to(dtype) if t.is_floating_point() else t for n, t in edge_rows(len(program.source)).items()}
    want = program.expected({n: t.double() if t.is_floating_point() else t for n, t in inputs.items()})
    compiled = compiler.compile(program.source, outputs=program.outputs, backend=backend)
    inputs["u"] = LENGTH                      # a prefix's positions: as many as e's
    got = compiled(**{i.name: inputs[i.name].to(DEVICE) if isinstance(inputs[i.name], torch.Tensor) else inputs[i.name]
                      for i in compiled.checked.inputs})
    got = dict(zip(program.outputs, got if isinstance(got, tuple) else (got,)))
    if dtype == torch.float64:
        rtol, atol = 1e-9, 1e-12
    else:                               # float32 kernels against float64 rounded to float32
        want = {n: w.float().double() if w.is_floating_point() else w for n, w in want.items()}
        rtol, atol = 1e-4, 1e-5
    problems = []
    for name in program.outputs:
        wrong = _agrees(got[name], want[name], rtol, atol)
        if wrong is not None:
            problems.append(f"{name}: {wrong}")
    return problems


def test_the_draws_cover_what_they_promise():
    kinds = [{kind.name for _, kind, _ in p.statements} for p in PROGRAMS]
    for extreme in ("argmax", "argmin"):
        assert all(any({extreme, other} <= k for k in kinds) for other in KINDS if other != extreme)
    assert any(sum(kind.name == "weighted" for _, kind, _ in p.statements) == 2 for p in PROGRAMS)
    assert any({"logsumexp", "softmax"} <= k for k in kinds)
    assert {kind.name for p in PROGRAMS for _, kind, score in p.statements if score == GATHERED} >= set(KINDS)
    assert {kind.name for p in PROGRAMS for _, kind, _ in p.statements} >= set(PREFIX_KINDS)
    assert draw_programs() == PROGRAMS                           # deterministic
    x = edge_rows(0)["X"]
    assert x.isnan().any() and (x == math.inf).any() and (x == -math.inf).all(1).any()
    assert (x == 1e30).any() and (x == -1e30).any()


@pytest.mark.parametrize("program", PROGRAMS, ids=str)
def test_the_oracle_agrees_with_torch(program):
    assert _check(program, "reference", torch.float64) == []


@pytest.mark.parametrize("program", PROGRAMS, ids=str)
def test_triton_agrees_with_torch(program):
    assert _check(program, "triton", torch.float32) == []
