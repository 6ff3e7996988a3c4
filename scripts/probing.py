"""The harness of the GPU probes (conv_probe.py, gather_probe.py): each case under its own
time limit, so that one slow compile costs that case only, a failure a row of the table,
not the end of the run; timings are medians of triton.testing.do_bench."""
from __future__ import annotations

import signal
import traceback

import torch
import triton.testing


class Timeout(Exception):
    pass


def _alarm(signum, frame):
    raise Timeout()


def timed(fn) -> float:
    return triton.testing.do_bench(fn, warmup=25, rep=100)


def step(fn, inputs: dict, upstream: torch.Tensor):
    """One forward + backward of `fn` on `inputs` (their gradients cleared first)."""
    def run():
        for t in inputs.values():
            if isinstance(t, torch.Tensor):
                t.grad = None
        fn(**inputs).backward(upstream)
    return run


def run_cases(cases, case, limit_s: int) -> list[dict]:
    """The row `case(*spec)` of each spec of `cases`, each under `limit_s` seconds; a case
    past it or failing is a row {"case": its name, "failed": why}.  Each row prints as it ends."""
    rows = []
    signal.signal(signal.SIGALRM, _alarm)
    for spec in cases:
        signal.alarm(limit_s)
        try:
            rows.append(case(*spec))
        except Timeout:
            rows.append({"case": spec[0], "failed": f"over {limit_s} s"})
        except Exception as e:          # a failure is a row of the table, not the end of the run
            traceback.print_exc()
            rows.append({"case": spec[0], "failed": f"{type(e).__name__}: {str(e).splitlines()[0][:120]}"})
        finally:
            signal.alarm(0)
        print(rows[-1], flush=True)
    return rows
