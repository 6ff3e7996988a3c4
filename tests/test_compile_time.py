"""Compile time of the front end, the passes and the schedule (not the Triton
build): the slowest programs of the differential corpus and nested softmaxes,
each under a generous bound on two cores, so that an exponential regression
fails here rather than as a first call that never returns.

The stages walk expressions as DAGs: a lowered softmax repeats its argument
three times, so the tree of eight nested softmaxes holds 3^8 copies of X and a
walk of the tree (or sympy on it) is exponential in the depth.  They took, on
two cores: five nested softmaxes over one index 31 s (stabilise), eight more
than ten minutes; argmax beside a max 9 s (the law check of the product).

The corpus programs listed are the slowest of tests/test_differential.py's
CORPUS, measured all once (0.5 s to 0.8 s each, the law checks of centred
moments; the rest under 0.2 s)."""
from __future__ import annotations

import time

import pytest

from compiler.check import check
from compiler.parse import parse
from compiler.passes import PIPELINE
from compiler.schedule import schedule
from test_differential import CORPUS

BOUND = 10.0          # seconds for one program's front end, passes and schedule


def nested_softmaxes(depth: int, indices: str) -> str:
    """softmax of softmax of ... of X, over the indices in turn."""
    e = "X[i,j]"
    for k in range(depth):
        e = f"softmax[{indices[k % len(indices)]}]({e})"
    return f"Y[i,j] = {e}"


PROGRAMS = {
    "eight nested softmaxes over one index": nested_softmaxes(8, "j"),
    "eight nested softmaxes over alternating indices": nested_softmaxes(8, "ji"),
    "sixteen nested softmaxes over alternating indices": nested_softmaxes(16, "ji"),
    "argmax beside logsumexp and a max": "A[t] = argmax[e](X[t,e], e); L[t] = logsumexp[e](X[t,e]); "
                                         "M[t] = max[e](X[t,e] * 2.0)",
    **{name: CORPUS[name] for name in ("discovery-a_seventh_central_moment", "passes-layernorm",
                                       "discovery-kurtosis", "passes-third_moment", "passes-one_liner")},
}


def stage_times(source: str) -> dict[str, float]:
    """Seconds spent in each stage from the text to the schedule."""
    times = {}
    start = time.perf_counter()
    syntax = parse(source)
    times["parse"] = time.perf_counter() - start
    start = time.perf_counter()
    program = check(syntax)
    times["check"] = time.perf_counter() - start
    for name, stage in PIPELINE:
        start = time.perf_counter()
        program = stage(program)
        times[name] = time.perf_counter() - start
    start = time.perf_counter()
    schedule(program, program.outputs)
    times["schedule"] = time.perf_counter() - start
    return times


@pytest.mark.parametrize("name", list(PROGRAMS))
def test_compiling_takes_seconds_not_minutes(name):
    times = stage_times(PROGRAMS[name])
    shown = ", ".join(f"{stage} {seconds:.2f} s" for stage, seconds in times.items())
    assert sum(times.values()) < BOUND, f"{name}: {shown}"

