"""Call time: match the given inputs to the program and bind index extents.

Every mismatch is a BindError that points at the access in the source whose
shape disagrees."""
from __future__ import annotations

import difflib
from dataclasses import dataclass
from numbers import Real
from typing import Mapping

import torch

from .errors import BindError
from .ir import Access, Program, walk

SUPPORTED_DTYPES = frozenset((torch.float16, torch.bfloat16, torch.float32, torch.float64))
_CPU = torch.device("cpu")


@dataclass(frozen=True)
class Binding:
    values: dict[str, torch.Tensor | float]
    extents: dict[str, int]          # index name -> size
    dtype: torch.dtype               # dtype of float results
    device: torch.device

    def float_dtype(self, wide: bool = False) -> torch.dtype:
        """The dtype of a float result; at least float32 for a `wide` one (an
        output named in float32_outputs=)."""
        return torch.promote_types(self.dtype, torch.float32) if wide else self.dtype


def _dims(n: int) -> str:
    return f"{n} dimension{'s' * (n != 1)}"


class Binder:
    """Binds inputs to one program; everything that does not depend on the
    inputs (which dimension of which access fixes which extent) is worked out
    once here, so that a call costs a few checks per input."""

    def __init__(self, program: Program, extents_of: Program | None = None, statistics: frozenset = frozenset()):
        self.program = program
        # inputs that do not set the dtype of float results: a gradient program's saved
        # statistics, kept in float32 beside bf16 tensors, leave its results (and its
        # tensor-core operands) in bf16
        self.statistics = statistics
        self.declared = {i.name: i for i in program.inputs}
        symbols = dict(program.extents)
        # (tensor, dimension, extent symbol, index name, access) for every input access
        self.checks = [(node.tensor, d, symbols[ix], ix, node)
                       for st in program.statements for node in walk(st.expr)
                       if isinstance(node, Access) and node.tensor in self.declared
                       for d, ix in enumerate(node.indices)]
        # every index of `extents_of` (a later stage's program, whose passes may add
        # fresh indices sharing an extent symbol) -> the symbol that sizes it
        target = extents_of if extents_of is not None else program
        self.sized = [(ix, symbol) for ix, symbol in target.extents]

    def __call__(self, inputs: Mapping[str, object]) -> Binding:
        if inputs.keys() != self.declared.keys():
            self._names_error(inputs)
        src = self.program.source
        tensor_dtypes, devices = [], set()
        for name, decl in self.declared.items():
            value = inputs[name]
            if isinstance(value, torch.Tensor):
                if value.dtype not in SUPPORTED_DTYPES:
                    raise BindError(f"input '{name}' has dtype {value.dtype}; einfold takes "
                                    f"float16, bfloat16, float32 or float64 tensors", src, decl.span)
                if value.device.type == "meta":
                    raise BindError(f"input '{name}' is a meta tensor (a shape without data); pass a "
                                    f"tensor on the CPU or a GPU", src, decl.span)
                if value.dim() != decl.rank:
                    raise BindError(f"input '{name}' has {_dims(value.dim())} but the program "
                                    f"reads it with {decl.rank} ind{'ex' if decl.rank == 1 else 'ices'}",
                                    src, decl.span)
                if decl.rank and name not in self.statistics:   # nor do 0-d tensors, like numbers
                    tensor_dtypes.append(value.dtype)
                devices.add(value.device)
            elif isinstance(value, Real) and not isinstance(value, bool):
                if decl.rank != 0:
                    raise BindError(f"input '{name}' is a number but the program reads it with "
                                    f"{decl.rank} indices; pass a tensor", src, decl.span)
            else:
                raise BindError(f"input '{name}' must be a torch tensor or a number, "
                                f"not {type(value).__name__}", src, decl.span)
        if len(devices) > 1:
            raise BindError(f"inputs live on different devices: {', '.join(sorted(map(str, devices)))}")

        # Every index's extent comes from the tensor dimensions it indexes; indices
        # unified by the checker share one extent symbol.
        seen: dict[object, tuple[int, str, Access, int]] = {}
        for tensor, d, symbol, ix, node in self.checks:
            size = inputs[tensor].shape[d]
            first = seen.get(symbol)
            if first is None:
                seen[symbol] = (size, ix, node, d)
            elif first[0] != size:
                first_size, first_ix, first_node, first_dim = first
                which = (f"index '{ix}' has" if first_ix == ix
                         else f"indices '{first_ix}' and '{ix}' (they index one dimension, so share "
                              f"one extent) have")
                raise BindError(f"{which} extent {first_size} in {first_node.tensor} (dimension "
                                f"{first_dim}) but {size} in {tensor} (dimension {d})", src, node.span)
        extents = {ix: seen[symbol][0] for ix, symbol in self.sized}
        # Float results take the promoted dtype of the tensor inputs (float32 if none).
        dtype = tensor_dtypes[0] if tensor_dtypes else torch.float32
        for t in tensor_dtypes[1:]:
            if t is not dtype:
                dtype = torch.promote_types(dtype, t)
        device = devices.pop() if devices else _CPU
        return Binding(dict(inputs), extents, dtype, device)

    def _names_error(self, inputs: Mapping[str, object]) -> None:
        declared = self.declared
        for name in inputs:
            if name not in declared:
                known = ", ".join(declared) or "none"
                close = ([d for d in declared if d.lower() == name.lower()]
                         or difflib.get_close_matches(name, list(declared), n=1))
                hint = f"; did you mean '{close[0]}'?" if close else ""
                raise BindError(f"unexpected input '{name}'{hint} (the program's inputs are: {known})")
        for decl in declared.values():
            if decl.name not in inputs:
                raise BindError(f"missing input '{decl.name}'", self.program.source, decl.span)


def bind(program: Program, inputs: Mapping[str, object]) -> Binding:
    """Bind `inputs` to `program` (see Binder, which a Program keeps)."""
    return Binder(program)(inputs)
