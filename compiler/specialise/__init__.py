"""The specialisation stage: Schedule + Signature -> ConcreteSchedule.

    ir.py       Signature (a call's extents, dtypes and GPU) and the concrete
                schedule: every kernel's grid tiles and program order, each fold's
                loops and tiles, the split, the autotune table (printable)
    stage.py    specialise(): the schedule's tile rules evaluated for one signature
    forms.py    kernel forms beside the tl kernel, as rows (the sm_90 warp-specialised one)

A backend builds its kernels from the concrete schedule; `einfold ir
--print-after specialise --size i=1024 ...` prints it."""
from .ir import POSITIVE, Candidate, ConcreteKernel, ConcreteSchedule, FoldLoops, Signature, Tile
from .stage import specialise

__all__ = ["POSITIVE", "Candidate", "ConcreteKernel", "ConcreteSchedule", "FoldLoops", "Signature", "Tile",
           "specialise"]
