"""Call time: match the given inputs to the program and bind index extents.

Every mismatch is a BindError that points at the access in the source whose
shape disagrees."""
from __future__ import annotations

import difflib
from dataclasses import dataclass, replace
from numbers import Real
from typing import Mapping

import torch

from .errors import BindError
from .ir import Access, Program, walk

SUPPORTED_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


@dataclass(frozen=True)
class Binding:
    values: dict[str, torch.Tensor | float]
    extents: dict[str, int]          # index name -> size
    dtype: torch.dtype               # dtype of float results
    device: torch.device

    def for_program(self, program: Program) -> "Binding":
        """The same binding with extents for every index of `program`, whose passes
        may have introduced fresh indices that share an extent symbol."""
        symbols = dict(program.extents)
        sizes = dict(self.extents)
        known = {symbols[ix]: n for ix, n in self.extents.items() if ix in symbols}
        for ix, symbol in program.extents:
            sizes.setdefault(ix, known[symbol])
        return replace(self, extents=sizes)


def _dims(n: int) -> str:
    return f"{n} dimension{'s' * (n != 1)}"


def bind(program: Program, inputs: Mapping[str, object]) -> Binding:
    src = program.source
    declared = {i.name: i for i in program.inputs}
    for name in inputs:
        if name not in declared:
            known = ", ".join(declared) or "none"
            close = ([d for d in declared if d.lower() == name.lower()]
                     or difflib.get_close_matches(name, list(declared), n=1))
            hint = f"; did you mean '{close[0]}'?" if close else ""
            raise BindError(f"unexpected input '{name}'{hint} (the program's inputs are: {known})")
    for decl in program.inputs:
        if decl.name not in inputs:
            raise BindError(f"missing input '{decl.name}'", src, decl.span)

    tensor_dtypes, devices = [], set()
    for decl in program.inputs:
        value = inputs[decl.name]
        if isinstance(value, torch.Tensor):
            if value.dtype not in SUPPORTED_DTYPES:
                raise BindError(f"input '{decl.name}' has dtype {value.dtype}; einfold takes "
                                f"float16, bfloat16, float32 or float64 tensors", src, decl.span)
            if value.dim() != decl.rank:
                raise BindError(f"input '{decl.name}' has {_dims(value.dim())} but the program "
                                f"reads it with {decl.rank} ind{'ex' if decl.rank == 1 else 'ices'}",
                                src, decl.span)
            tensor_dtypes.append(value.dtype)
            devices.add(value.device)
        elif isinstance(value, Real) and not isinstance(value, bool):
            if decl.rank != 0:
                raise BindError(f"input '{decl.name}' is a number but the program reads it with "
                                f"{decl.rank} indices; pass a tensor", src, decl.span)
        else:
            raise BindError(f"input '{decl.name}' must be a torch tensor or a number, "
                            f"not {type(value).__name__}", src, decl.span)
    if len(devices) > 1:
        raise BindError(f"inputs live on different devices: {', '.join(sorted(map(str, devices)))}")

    # Every index's extent comes from the tensor dimensions it indexes; indices
    # unified by the checker share one extent symbol.
    seen: dict[object, tuple[int, str, Access, int]] = {}
    for st in program.statements:
        for node in walk(st.expr):
            if not isinstance(node, Access) or node.tensor not in declared:
                continue
            value = inputs[node.tensor]
            for d, ix in enumerate(node.indices):
                size = int(value.shape[d])
                symbol = program.extent(ix)
                if symbol in seen and seen[symbol][0] != size:
                    first_size, first_ix, first, first_dim = seen[symbol]
                    which = (f"index '{ix}' has" if first_ix == ix
                             else f"indices '{first_ix}' and '{ix}' (they index one dimension, so share "
                                  f"one extent) have")
                    raise BindError(
                        f"{which} extent {first_size} in {first.tensor} (dimension "
                        f"{first_dim}) but {size} in {node.tensor} (dimension {d})", src, node.span)
                seen.setdefault(symbol, (size, ix, node, d))
    extents = {ix: seen[symbol][0] for ix, symbol in program.extents}
    # Float results take the promoted dtype of the tensor inputs (float32 if none).
    dtype = tensor_dtypes[0] if tensor_dtypes else torch.float32
    for t in tensor_dtypes[1:]:
        dtype = torch.promote_types(dtype, t)
    device = devices.pop() if devices else torch.device("cpu")
    return Binding(dict(inputs), extents, dtype, device)
