"""The schedule stage: factorised IR -> Schedule IR, for any sizes.

    ir.py            the Schedule IR: kernels, grids, loops, buffers (printable)
    form.py          kernel formation: which statements share a kernel, grids,
                     materialised and reused folds (the stage's one pass)
    folds.py         facts about folds: top folds, contractions, inlining
    bounds.py        loop bounds from index predicates (causal, windows)
    tiles.py         tiles as symbols with candidate sets; the split policy
    plan.py          Plan: what a backend launches for one call's sizes

`schedule(program, outputs, split)` runs the stage; `einfold ir --print-after
schedule` prints its result."""
from .form import schedule
from .ir import KernelSchedule, Schedule
from .plan import Kernel, Loop, Plan

__all__ = ["Kernel", "KernelSchedule", "Loop", "Plan", "Schedule", "schedule"]
