"""Call time: match the given inputs to the program and bind index extents.

Every mismatch is a BindError that points at the access in the source whose
shape disagrees."""
from __future__ import annotations

import difflib
import functools
import math
import os
from dataclasses import dataclass
from numbers import Real
from typing import Mapping

import torch

from . import config
from .errors import BindError
from .ir import Access, Program, accesses, walk
from .ops import BOOL, FLOAT, INT

# each dtype einfold reads -> the language's type of its values (ops.FLOAT, INT, BOOL)
DTYPE_TYPES = {**dict.fromkeys((torch.float16, torch.bfloat16, torch.float32, torch.float64), FLOAT),
               **dict.fromkeys((torch.uint8, torch.int8, torch.int16, torch.int32, torch.int64), INT),
               torch.bool: BOOL}
_CPU = torch.device("cpu")
_BYTES = {INT: 8, BOOL: 1}          # an output's bytes per element, where its dtype is not the float one


def readable(value: torch.Tensor) -> torch.Tensor:
    """`value` with its memory holding its values.  torch keeps a negation lazily, as
    a bit beside the memory (`x.conj().imag`, `torch._neg_view(x)`); kernels read the
    memory, so such a view is materialised (a conjugate bit needs a complex tensor,
    which the binder refuses).  A call resolves each of its tensors the same way
    (Program._key_of): a runner is reused for any later tensor of the same shape."""
    return value.resolve_neg() if value.is_neg() else value


@functools.lru_cache(maxsize=None)
def _memory_of(device: torch.device) -> int | None:
    """The bytes of memory `device` has (None where unknown): no output larger fits."""
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).total_memory
    if device.type == "cpu" and hasattr(os, "sysconf"):
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    return None


_UNITS = (("EiB", 2 ** 60), ("PiB", 2 ** 50), ("TiB", 2 ** 40), ("GiB", 2 ** 30), ("MiB", 2 ** 20),
          ("KiB", 2 ** 10))


def _bytes_text(n: int) -> str:
    unit, size = next(((u, size) for u, size in _UNITS if n >= size), ("bytes", 1))
    return f"{n / size:.1f} {unit}" if size > 1 else f"{n} bytes"


@dataclass(frozen=True)
class Binding:
    values: dict[str, torch.Tensor | float]
    extents: dict[str, int]          # index name -> size
    dtype: torch.dtype               # dtype of float results
    device: torch.device
    input_types: dict[str, str]      # input name -> the type of its values (DTYPE_TYPES; numbers FLOAT)

    def float_dtype(self, wide: bool = False) -> torch.dtype:
        """The dtype of a float result; at least float32 for a `wide` one (an
        output named in float32_outputs=)."""
        return torch.promote_types(self.dtype, torch.float32) if wide else self.dtype

    def result_dtype(self, kind: str, wide: bool = False) -> torch.dtype:
        """The dtype of a result of type `kind` (ops.FLOAT, INT or BOOL): a float one's
        is float_dtype(wide), an integer's int64."""
        return self.float_dtype(wide) if kind == FLOAT else torch.bool if kind == BOOL else torch.int64


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
        dimensions = dict(program.dimensions)
        # (tensor, dimension, extent symbol, index name or affine subscript, access) for every
        # dimension of an input access
        self.checks = [(node.tensor, d, symbols[ix] if ix is not None else dimensions[f"{node.tensor}#{d}"],
                        ix or node.subscripts()[d], node)
                       for st in program.statements for node in accesses(st.expr)
                       if node.tensor in self.declared
                       for d, ix in ((d, node.dimension_index(d)) for d in range(node.rank))]
        self.derived = program.derived
        # (read, dimension) of every gathered subscript of an input (`E[T[i], d]`: E's dimension 0)
        self.gathered = [(node, d) for st in program.statements for node in walk(st.expr)
                         if isinstance(node, Access) and node.tensor in self.declared and node.gathers is not None
                         for d in range(node.rank) if node.gathers[d] is not None]
        # every index of `extents_of` (a later stage's program, whose passes may add
        # fresh indices sharing an extent symbol) -> the symbol that sizes it
        self.target = extents_of if extents_of is not None else program
        self.sized = [(ix, symbol) for ix, symbol in self.target.extents]
        # size inputs: an index on a left-hand side that no input measures takes its extent
        # from the call, under its own name (check._check_extents_known)
        self.sizes = program.sizes

    def __call__(self, inputs: Mapping[str, object]) -> Binding:
        if inputs.keys() != self.declared.keys():
            self._names_error(inputs)
        src = self.program.source
        tensor_dtypes, devices, input_types = [], set(), {}
        for name, decl in self.declared.items():
            value = inputs[name]
            if name in self.sizes:
                input_types[name] = INT
                if not _is_size(value):
                    raise BindError(f"index '{name}' takes its extent from the call: {name}= must be a "
                                    f"whole number >= 0, not {value!r}", src, decl.span)
                continue
            if isinstance(value, torch.Tensor):
                if value.layout is not torch.strided:
                    raise BindError(f"input '{name}' is a {str(value.layout).removeprefix('torch.')} tensor; "
                                    f"einfold reads dense tensors: pass {name}.to_dense()", src, decl.span)
                if value.dtype not in DTYPE_TYPES:
                    raise BindError(_dtype_message(name, value.dtype), src, decl.span)
                input_types[name] = DTYPE_TYPES[value.dtype]
                if value.device.type == "meta":
                    raise BindError(f"input '{name}' is a meta tensor (a shape without data); pass a "
                                    f"tensor on the CPU or a GPU", src, decl.span)
                if value.dim() != decl.rank:
                    raise BindError(f"input '{name}' has {_dims(value.dim())} but the program "
                                    f"reads it with {decl.rank} ind{'ex' if decl.rank == 1 else 'ices'}",
                                    src, decl.span)
                # nor do 0-d tensors, like numbers, nor integer and bool tensors
                if decl.rank and name not in self.statistics and value.dtype.is_floating_point:
                    tensor_dtypes.append(value.dtype)
                devices.add(value.device)
            elif isinstance(value, Real) and not isinstance(value, bool):
                if decl.rank != 0:
                    raise BindError(f"input '{name}' is a number but the program reads it with "
                                    f"{decl.rank} indices; pass a tensor", src, decl.span)
                input_types[name] = FLOAT
            else:
                raise BindError(f"input '{name}' must be a torch tensor or a number, "
                                f"not {type(value).__name__}", src, decl.span)
            if (input_types[name] == BOOL) != (decl.dtype == BOOL):
                raise BindError(_condition_message(name, decl.dtype, value), src, decl.span)
            if decl.dtype == INT and input_types[name] != INT:
                given = f"a {value.dtype} tensor" if isinstance(value, torch.Tensor) else "a number"
                raise BindError(f"input '{name}' is read as a subscript, so holds integer positions, but the call "
                                f"passes {given}; pass an integer tensor ({name}.long())", src, decl.span)
        if len(devices) > 1:
            raise BindError(f"inputs live on different devices: {', '.join(sorted(map(str, devices)))}")

        # Every index's extent comes from the tensor dimensions it indexes; indices
        # unified by the checker share one extent symbol.
        seen: dict[object, tuple[int, str, Access, int]] = {symbol: (int(inputs[name]), name, None, None)
                                                         for name, symbol in self.sizes.items()}
        for tensor, d, symbol, ix, node in self.checks:
            size = inputs[tensor].shape[d]
            first = seen.get(symbol)
            if first is None:
                seen[symbol] = (size, ix, node, d)
            elif first[0] != size:
                first_size, first_ix, first_node, first_dim = first
                which = (f"index '{ix}' has" if first_ix == ix
                         else f"{'indices' if f'{first_ix}{ix}'.isidentifier() else 'subscripts'} "
                              f"'{first_ix}' and '{ix}' (they index one dimension, so share one extent) have")
                raise BindError(f"{which} extent {first_size} in {first_node.tensor} (dimension "
                                f"{first_dim}) but {size} in {tensor} (dimension {d})", src, node.span)
        for rule in self.derived:       # indices that only affine subscripts read, where no dimension measures them
            if rule.symbol not in seen and all(n in seen for read in rule.reads for n in rule.symbols(read)):
                seen[rule.symbol] = (rule.value(lambda symbol: seen[symbol][0]), None, None, None)
        unknown = next((ix for ix, symbol in self.sized if symbol not in seen), None)
        if unknown is not None:         # the checker orders every derived extent after what it reads
            raise BindError(f"index '{unknown}' has no extent at this call: no input measures it, and the "
                            f"reads its extent is derived from have none", src)
        extents = {ix: seen[symbol][0] for ix, symbol in self.sized}
        if self.gathered and config.check_positions():
            self._check_positions(inputs, extents)
        # Float results take the promoted dtype of the tensor inputs (float32 if none).
        dtype = tensor_dtypes[0] if tensor_dtypes else torch.float32
        for t in tensor_dtypes[1:]:
            if t is not dtype:
                dtype = torch.promote_types(dtype, t)
        device = devices.pop() if devices else _CPU
        self._check_output_sizes(extents, dtype, device)
        values = {name: readable(v) if isinstance(v, torch.Tensor) else v for name, v in inputs.items()}
        return Binding(values, extents, dtype, device, input_types)

    def _check_positions(self, inputs: Mapping[str, object], extents: dict[str, int]) -> None:
        """Checked mode (config.check_positions): every position a gathered subscript
        reads lies inside its dimension."""
        from .reference import gathered_positions
        for node, d in self.gathered:
            size = inputs[node.tensor].shape[d]
            positions = gathered_positions(node, d, inputs, extents)
            outside = positions[(positions < 0) | (positions >= size)]
            if outside.numel():
                raise BindError(f"subscript '{node.subscripts()[d]}' of {node.tensor} reads position "
                                f"{int(outside[0])}, outside its dimension {d} of extent {size} "
                                f"({config.CHECK_POSITIONS_ENV} is set; unset, such a read is 0)",
                                self.program.source, node.span)

    def _check_output_sizes(self, extents: dict, dtype: torch.dtype, device: torch.device) -> None:
        """Outputs that together need more memory than `device` has are refused before
        anything is allocated (torch would fail inside the backend, naming no tensor).
        Symbolic extents (torch.compile's dynamic shapes) allocate nothing: unchecked."""
        memory = _memory_of(device)
        if memory is None or not all(type(n) is int for n in extents.values()):
            return
        statements = {name: self.target.statement(name) for name in self.target.outputs}
        sizes = {name: math.prod(extents[i] for i in st.indices) * _BYTES.get(st.dtype, dtype.itemsize)
                 for name, st in statements.items()}
        if sum(sizes.values()) > memory:
            largest = max(sizes, key=sizes.get)
            shape = ", ".join(str(extents[i]) for i in statements[largest].indices)
            span = next((s.span for s in self.program.statements if s.name == largest), None)
            raise BindError(f"the outputs would take {_bytes_text(sum(sizes.values()))} but the {device.type} "
                            f"device has {_bytes_text(memory)} of memory: output '{largest}' alone has shape "
                            f"[{shape}] ({_bytes_text(sizes[largest])}); check the inputs' extents",
                            self.program.source, span)

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
            if decl.name in self.sizes and decl.name not in inputs:
                raise BindError(f"missing size '{decl.name}': index '{decl.name}' takes its extent from the call "
                                f"({decl.name}=...), since no input tensor is indexed by it", self.program.source,
                                decl.span)
            if decl.name not in inputs:
                raise BindError(f"missing input '{decl.name}'", self.program.source, decl.span)


def _is_size(value) -> bool:
    """A whole number >= 0 (a float from torch's custom op path included)."""
    return isinstance(value, Real) and not isinstance(value, bool) and value >= 0 and float(value).is_integer()


def _dtype_message(name: str, dtype: torch.dtype) -> str:
    hint = (f" (complex values are not supported: pass the real and imaginary parts, {name}.real and "
            f"{name}.imag, as two inputs)" if dtype.is_complex else "")
    return (f"input '{name}' has dtype {dtype}; einfold takes float16, bfloat16, float32, float64, integer "
            f"(int8, int16, int32, int64, uint8) or bool tensors{hint}")


def _condition_message(name: str, declared: str, value) -> str:
    """A bool tensor where the program reads a number, or the reverse."""
    given = f"a {value.dtype} tensor" if isinstance(value, torch.Tensor) else "a number"
    if declared == BOOL:
        return (f"input '{name}' is read as a condition (where's first argument, or an operand of and, or, not), "
                f"so it takes a bool tensor, not {given}; pass a comparison such as {name} != 0")
    return (f"input '{name}' is a bool tensor but the program reads it as a number; read it as a condition "
            f"(where({name}[...], 1, 0) counts) or pass {name}.float()")


def bind(program: Program, inputs: Mapping[str, object]) -> Binding:
    """Bind `inputs` to `program` (see Binder, which a Program keeps)."""
    return Binder(program)(inputs)
