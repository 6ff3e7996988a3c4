"""Autotuning on a GPU: the specialised kernel's candidate tilings
(compiler.specialise: ConcreteKernel.candidates, by the shape of its contractions,
not by what the program computes) bound onto the constexprs of its kernel.

The candidates name the tuned tiles by index (the rows and columns of the
output tile, the streamed contraction index); here each becomes the block
constexprs the emitter declared for that index and role (`code.tunable`).
What the kernel holds decides which candidates survive: a register cap a thread
(two programs an SM) only where its float32 state fits, and no tile of more than
MAX_NUMEL elements (Triton refuses to compile one).
Triton's autotuner times every candidate once per specialisation and keeps the
fastest (in Triton's cache too, so another process reuses it: `cache_results`);
candidates that do not fit the chip (shared memory) are skipped by it.  The
candidates are compiled all at once before that (launch.DirectLaunch).
Under the interpreter nothing is tuned: one small configuration runs.

Every candidate is complete: it binds every constexpr the kernel declares (the
tiles that are not tuned at the values the emitter chose, `binding(code)`), so
that the launcher passes no tile itself and no tiling of several folds or
tiled indices can leave a BLOCK_* unbound.  The untuned path (the interpreter,
split kernels) launches with exactly `binding(code)`.

A kernel whose own tiling holds a tile past MAX_NUMEL is a BackendError, on the
CPU as on the GPU, not a compile error on the GPU only.
"""
from __future__ import annotations

import math

from ...errors import BackendError
from ...schedule.tiles import PAIRED_STATE
from ...specialise import Candidate
from .emit import KernelCode

MAX_NUMEL = 1 << 20     # Triton's largest tensor


def binding(code: KernelCode) -> dict[str, int]:
    """The constexprs of `code` as the emitter chose them: what an untuned launch
    passes, and what every candidate starts from."""
    blocks = dict(code.constexprs)
    if largest_tile(code, blocks) > MAX_NUMEL:
        shape = max(code.tiles, key=lambda t: math.prod(blocks[b] for b in t))
        raise BackendError(f"kernel {code.name} would hold a tile of {largest_tile(code, blocks)} elements "
                           f"[{', '.join(f'{b}={blocks[b]}' for b in shape)}], more than Triton's {MAX_NUMEL}: "
                           f"the schedule has no tiling of this program for these sizes")
    return blocks


def largest_tile(code: KernelCode, blocks: dict[str, int]) -> int:
    return max((math.prod(blocks[b] for b in shape) for shape in code.tiles), default=1)


Config = tuple[dict[str, int], int, int, "int | None"]   # (constexprs, warps, stages, registers a thread)


def candidates(code: KernelCode, tiling: tuple[Candidate, ...]) -> list[Config]:
    """[(constexprs, num_warps, num_stages, maxnreg or None)] to try for `code`: each of
    the specialised kernel's candidates bound onto its block constexprs, every constexpr
    bound; those its state or Triton's tensor limit rules out left out."""
    base = binding(code)
    out: list[Config] = []
    for c in tiling:
        sizes = dict(c.tiles)
        blocks = {**base, **{b: sizes[index] for b, (_, index) in code.tunable.items() if index in sizes}}
        if c.registers is not None:
            rows = [b for b, (role, _) in code.tunable.items() if role == "grid"]
            keys = [b for b, (role, _) in code.tunable.items() if role == "loop"]
            if len(rows) != 1 or len(keys) != 1 or \
                    float_state(code, blocks, rows[0], keys[0]) > PAIRED_STATE * 32 * c.warps:
                continue
        config = (blocks, c.warps, c.stages, c.registers)
        if config not in out and largest_tile(code, blocks) <= MAX_NUMEL:
            out.append(config)
    return out


def float_state(code: KernelCode, blocks: dict[str, int], rows: str, keys: str) -> int:
    """Elements of a streamed contraction's float32 state held across a step: the
    scores tile (rows x keys) and the widest tile of rows that is not over the keys
    (the accumulator of values)."""
    widest = max((math.prod(blocks[b] for b in shape) for shape in code.tiles if rows in shape and keys not in shape),
                 default=0)
    return blocks[rows] * blocks[keys] + widest


# How the autotuner times a candidate: a first call times every candidate once, and
# Triton's default (25 ms of warm-up, 100 ms timed) made that 1.3-1.5 s of an attention
# variant's first call on the H100 (scripts/first_call.py phases).  25 ms timed still
# picks what the long timing picks (13 of 15 cases of scripts/tuning_survey.py, the
# other two 1.6% and 1.0% behind); the warm-up stays at 25 ms: with 5 ms (two to five
# runs of a 1-2 ms kernel) the choice was worse in 4 of 15 cases, up to 11% behind.
TIMING = """def _time_candidate(kernel_call, quantiles):
    # the autotuner's timing of one candidate: the median of 25 ms of runs after 25 ms of warm-up
    import triton.testing
    return triton.testing.do_bench(kernel_call, warmup=25, rep=25, quantiles=quantiles)"""


def decorator(code: KernelCode, configs) -> str:
    """The @triton.autotune line for `code`, keyed on its extents' shape classes."""
    for blocks, *_ in configs:
        if set(blocks) != set(code.constexprs):
            raise AssertionError(f"{code.name}: a candidate binds {sorted(blocks)}, the kernel declares "
                                 f"{sorted(code.constexprs)}")
    items = ", ".join(f"triton.Config({blocks!r}, num_warps={w}, num_stages={st}"
                      + (f", maxnreg={registers})" if registers else ")") for blocks, w, st, registers in configs)
    keys = [p for p, arg in code.params if arg.kind == "size_class"]
    restored = (f", restore_value={list(code.accumulates)!r}" if code.accumulates else "")
    return ("# tuned once per shape class: class_<x> is n_<x>'s bit length, so the sizes of one power of two\n"
            "# share a choice (kept in Triton's cache, for other processes too)"
            + ("; the sums its stores add to are restored after each timing" if code.accumulates else "") + "\n"
            f"@triton.autotune(configs=[{items}], key={keys!r}{restored}, cache_results=True, "
            "do_bench=_time_candidate)")
