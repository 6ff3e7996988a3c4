"""Kernel plans: what would launch, in order, and which intermediates would be
materialised in global memory."""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Kernel:
    name: str
    writes: tuple[str, ...]     # statement results it stores
    why: str                    # one line: why this is a separate kernel / what it does


@dataclass(frozen=True)
class Plan:
    backend: str
    kernels: tuple[Kernel, ...]
    buffers: tuple[str, ...]    # intermediates stored in global memory

    def __str__(self) -> str:
        lines = [f"backend {self.backend}: {len(self.kernels)} kernel(s)"]
        lines += [f"  {k.name}: writes {', '.join(k.writes)}  # {k.why}" for k in self.kernels]
        lines.append(f"  intermediate buffers: {', '.join(self.buffers) or 'none'}")
        return "\n".join(lines)
