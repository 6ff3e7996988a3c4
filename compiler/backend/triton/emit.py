"""Triton source generation: one kernel per KernelSchedule (two when split), built
from small templates with holes.

A kernel is a tree of *scopes*: the program (root, level 0: grid tiles), the
epilogue loop, and one body per fold loop.  Every value is a tile over *axes*
(a grid tile, an epilogue tile, a loop tile, a whole small index, or a scalar
grid coordinate); a value is emitted in the outermost scope whose axes it
uses, so loop-invariant loads and folds are hoisted out of loops and computed
once (Q's tile is loaded once per program; the max of a softmax is folded once
per row before the loops that read it).  Equal IR nodes over equal axes are
one value (a fold read through several projections is computed once).

Folds follow the summary's algebra, never the operator's name:

- sum of a product over one index: a contraction, `tl.dot` when both operands
  are 2-D tiles at least 16 wide, else a broadcast product and `tl.sum`;
- max / min: a NaN-keeping max / min (ops.EXTREMA) of the identity-padded tile;
- a summary with `rescaled` structure streams FlashAttention-style: running
  leader r, repair factor h(r, r_new) on the carried fields (a field held
  centred on the leader first moves by its shift times the weight sum),
  weights w(x, r_new) on the tile, fields += sum(w * v) (a `tl.dot` for
  attention);
- any other summary: the lifted fields, padded with the identity, are reduced
  within the tile with `tl.reduce` and a combine function generated from the
  summary's combine formulas (non-commutative summaries: `tl.associative_scan`,
  which keeps order, and its last element), then merged into the running state
  with the same combine.
"""
from __future__ import annotations

import itertools
import keyword
import math
import re
from dataclasses import dataclass, field, replace

import torch

from ...arguments import positive_number
from ...errors import BackendError
from ...ir import (Access, Call, Const, Expr, Extent, Index, Reduce, Var, constant, format_expr, transform,
                  walk)
from . import ops as emission
from ...algebra.properties import additive, exact_identity, extremum, selecting_combine
from ...algebra.summary import independent_fields
from ...schedule import KernelSchedule
from ...specialise import POSITIVE, ConcreteKernel, Signature
from ...specialise.ir import WHOLE, FoldLoops, Tile
from ...schedule.bounds import assume_relation
from ...schedule.folds import (
    contraction_sides,
    fold_parts,
    free,
    restrict,
    restrict_fields,
    summed_factors,
)

TL_DTYPES = {torch.float16: "tl.float16", torch.bfloat16: "tl.bfloat16", torch.float32: "tl.float32",
             torch.float64: "tl.float64"}


def ident(name: str) -> str:
    return re.sub(r"\W", "_", name)


# Generated names.  User names (tensors, scalars, indices, summary fields) reach a
# kernel only inside generated spellings (`X_ptr`, `n_k`, `offs_k`, `f0_r`), so two
# meanings could share a spelling (a scalar `n` and the extent of an index `val` are
# both `n_val`).  Every identifier of a kernel is therefore allocated through one
# table (KernelEmitter.local): a spelling is taken once, a second meaning gets the
# next free `<spelling>_<k>`, and the fixed names below and the module's globals
# (kernels, combines, helpers) are never given out.
FIXED_NAMES = frozenset({"pid", "split_id", "split", "n_split", "in_group", "first_row", "group_rows",
                         "tl", "triton", "torch", "launch", "range", "float", "int", "min", "max", "abs",
                         "len", "print", "True", "False", "None", *keyword.kwlist})
NUMBERED = re.compile(r"t\d+")     # an anonymous temporary
# a load's eviction hint, written once the kernel's lines are final (with_eviction_hints)
EVICTION_MARK = "eviction_policy=EVICT_"
_EVICTION = re.compile(rf", {EVICTION_MARK}(\w+)")
# the generated names of one axis: <prefix>_<var>
AXIS_PREFIXES = ("offs", "idx", "mask", "BLOCK", "start", "pid", "lo", "hi", "mid", "chunk", "inner", "far",
                 "step")


# A comparison a <op> b holds nowhere in a tile when the ranges of its sides over the
# tile ([lo_a, hi_a], [lo_b, hi_b]) forbid it.  Written so that NaN, which fails every
# comparison, keeps the tile: its elements are still masked one by one.
DEAD_WHEN = {          # one row per comparison of specialise.ir.RANGED
    "lt": "{lo_a} >= {hi_b}",
    "le": "{lo_a} > {hi_b}",
    "gt": "{hi_a} <= {lo_b}",
    "ge": "{hi_a} < {lo_b}",
    "eq": "({hi_a} < {lo_b}) | ({lo_a} > {hi_b})",
}


# A live-span scan (KernelEmitter.live_span) reads this many elements of a loop's index
# a step, whole tiles of the loop (at least one): 16 tiles of 128 keys, 32 of 64.  Probe
# (document mask B4 H16 S4096, H100): 1, 8, 16 tiles a step: 0.428, 0.368, 0.360 ms, from
# 0.493 ms without the scan.
SCAN_ELEMENTS = 2048
PROGRAMS = "programs"        # a buffer's length: one per program of grid axis 0 (module.program_count)


# ---------------------------------------------------------------- axes, values, scopes
@dataclass(eq=False)
class Axis:
    id: int
    name: str          # IR index name
    var: str           # suffix of its generated names
    level: int         # scope level that introduces it
    kind: str          # "grid", "epilogue", "loop", "whole" or "scan" (live_span's)
    block: int         # tile size; 0 for a scalar grid coordinate
    block_expr: str | None = None      # a tile that is a multiple of another axis's (a scan's)

    @property
    def scalar(self) -> bool:
        return self.block == 0

    @property
    def offs(self) -> str:
        return f"idx_{self.var}" if self.scalar else f"offs_{self.var}"

    @property
    def mask(self) -> str:
        return f"mask_{self.var}"

    @property
    def block_name(self) -> str:
        return self.block_expr or f"BLOCK_{self.var}"


def sort_axes(axes) -> tuple[Axis, ...]:
    return tuple(sorted(set(axes), key=lambda a: a.id))


def without_reduced(axes, reduced, keep=()) -> tuple[Axis, ...]:
    """The axes of a tile reduced over `reduced` but `keep`: an index a loop folds one value at a
    time (a scalar axis) is reduced by the loop, so the tile's reduction does not vary over it
    (the state it joins exists outside the loop)."""
    return sort_axes(a for a in axes if a not in reduced or a in keep)


def dims(axes) -> tuple[Axis, ...]:
    return tuple(a for a in sort_axes(axes) if not a.scalar)


@dataclass(frozen=True)
class Load:
    """What the eviction hints need of one load (with_eviction_hints)."""
    tensor: str
    indices: tuple[str, ...]
    read_once: bool          # no other program or kernel reads its elements (ConcreteKernel.past_cache)
    beyond_cache: bool       # more elements than the GPU's L2 cache holds


@dataclass(frozen=True)
class Value:
    code: str
    axes: tuple[Axis, ...]             # sorted; scalar grid axes included
    kind: str = "float"                # "float", "int" or "bool"
    const: object = None               # Python value of a literal
    raw: str | None = None             # a load in its stored dtype (for tl.dot)
    raw_dtype: object = None
    user_tensor: bool = False          # raw reads a program input (not a buffer of this module)
    tensor: str | None = None          # the tensor raw reads
    zero: frozenset = frozenset()      # axes outside whose extent the value is exactly 0
    level: int = 0                     # the scope level it is defined at (at least its axes' levels)
    bounds: tuple[int, int] | None = None  # an int value's range (decides when it needs 64 bits)
    origin: tuple | None = None        # (op, operand Values) of the operation that made it
    positive: bool = False             # a number input the signature holds positive (literals: their const)


class Scope:
    def __init__(self, parent: Scope | None, level: int, env: dict, kind: str, lines=None, memo=None):
        self.parent = parent
        self.level = level
        self.env = env
        self.kind = kind               # "root", "epilogue", "body", "merge"
        self.lines: list[str] = [] if lines is None else lines
        self.memo: dict = {} if memo is None else memo

    def chain(self):
        s = self
        while s is not None:
            yield s
            s = s.parent


def indent(lines: list[str], depth: int = 1) -> list[str]:
    pad = "    " * depth
    return [pad + line if line else line for line in lines]


# ---------------------------------------------------------------- module-level facts
@dataclass
class TensorInfo:
    kind: str            # "tensor" or "number"
    rank: int
    dtype: object        # torch dtype, or None for numbers


@dataclass(frozen=True)
class Arg:
    """What the launcher passes a kernel parameter: an index's extent or its shape class
    (the extent's bit length: tiles.size_class), a tensor, one of its strides, a float
    number (by value, or in memory for a float64 program), or the split count.  Its
    text is the launcher's expression."""
    kind: str            # "extent", "size_class", "tensor", "stride", "dimension" (a tensor's extent
    #                      along `dim`), "number", "number64", "split",
    #                      or in a chunked run "start" (its chunk's first value) and "whole extent"
    name: str = ""       # the index or tensor it is of
    dim: int = 0         # a stride's dimension; the offset of a sorted loop's values ("starts")
    by: str = ""         # "order", "starts": the grid index whose values a sorted loop's starts are of

    @property
    def prepared(self) -> tuple[str, str] | None:
        """(its key in the launcher's `t`, the expression the launcher computes it by) for
        what the launcher prepares: a sorted loop's stable order of an integer input and
        the start of each value of `by` (minus the offset) in it."""
        if self.kind == "order":
            return f"{self.name} sorted", f'torch.sort(t["{self.name}"].long(), stable=True)'
        if self.kind == "starts":
            # each row's starts (the sort is along the last dimension)
            shift = f" - {self.dim}" if self.dim > 0 else f" + {-self.dim}" if self.dim < 0 else ""
            values = f't["{self.name} sorted"].values'
            return (f"{self.name} starts of {self.by}{shift}",
                    f'torch.searchsorted({values}, (torch.arange(n["{self.by}"] + 1, device=device){shift})'
                    f'.expand(*{values}.shape[:-1], -1).contiguous())')
        return None

    def __str__(self) -> str:
        if self.kind == "order":
            return f't["{self.name} sorted"].indices'
        if self.kind == "starts":
            return f't["{self.prepared[0]}"]'
        return {"extent": f'n["{self.name}"]', "size_class": f'n["{self.name}"].bit_length()',
                "start": "start", "whole extent": f'whole["{self.name}"]',
                "tensor": f't["{self.name}"]',
                "stride": f't["{self.name}"].stride({self.dim})', "dimension": f't["{self.name}"].shape[{self.dim}]',
                "number": f'float(t["{self.name}"])',
                "number64": f'torch.full((), float(t["{self.name}"]), dtype=torch.float64, device=device)',
                "split": "n_split"}[self.kind]


SPLIT = Arg("split")


@dataclass
class KernelCode:
    name: str
    source: str
    params: list[tuple[str, Arg]]        # (parameter, what the launcher passes)
    constexprs: dict[str, int]
    split_axis: bool                     # a second grid dimension of n_split programs
    why: str
    writes: tuple[str, ...]
    # (name, shape exprs, dtype); the shape PROGRAMS: one per program of grid axis 0
    buffers: list[tuple[str, list[str], str]] = field(default_factory=list)
    # autotuning: tile constexprs that may change (block name -> ("grid" | "loop", index)) and,
    # for each grid factor, its index name and block name (None: one program per value)
    tunable: dict[str, tuple[str, str]] = field(default_factory=dict)
    grid_blocks: list[tuple[str, str | None]] = field(default_factory=list)
    tiles: frozenset[tuple[str, ...]] = frozenset()   # block names of every tile shape it holds
    # grid indices that some statement it stores lacks (attention's j beside its row
    # logsumexp L[i]): at extent 0 they still launch one tile, so L is written
    optional: frozenset[str] = frozenset()
    functions: tuple = ()        # the jit functions it calls (a one-launch split's merge), defined before it
    zeroed: frozenset[str] = frozenset()      # buffers the launcher fills with zeros (arrival counters)
    # pointer parameters whose tensors its stores add to (a chunked run's sums): not idempotent,
    # so the autotuner restores them after timing each candidate
    accumulates: tuple[str, ...] = ()


class ModuleContext:
    """Facts shared by the kernels of one module."""

    def __init__(self, signature: Signature, fresh_names: dict[str, str]):
        self.sig = signature
        self.fresh_names = fresh_names
        self.cdt = "tl.float64" if signature.dtype == torch.float64 else "tl.float32"
        # the operand dtype of a tl.dot none of whose matrices is read from memory (None: no tl.dot)
        self.dot_dtype = None if signature.dtype == torch.float64 else signature.dtype
        self.input_names = {name for name, *_ in signature.inputs}
        self.tensors: dict[str, TensorInfo] = {
            name: TensorInfo(kind, rank, dtype if kind == "tensor" else None)
            for name, kind, rank, dtype in signature.inputs}
        self.positive = {name for name, kind, _, sign in signature.inputs if kind == "number" and sign == POSITIVE}
        self.helpers: set[str] = set()
        self.combines: dict[tuple, tuple[str, str]] = {}      # (summary, fields) -> (name, source)
        self.split_layouts: dict = {}
        # (kernel, prefix fold) -> {field: (buffer, its indices after the chunk, kind)}: a chunked
        # scan's totals, which ScanTotalsEmitter stores and the scan's kernel reads
        self.scan_totals: dict = {}
        self.chunking = None                     # the schedule's chunked run (schedule/chunks.py), if any
        self.chunked_kernels: frozenset[str] = frozenset()
        # names of the module's globals (kernels, combine functions, helpers), every kernel-local
        # name given out so far, and the names of the program (tensors, statements, buffers)
        self.module_names: set[str] = ({"launch", "torch", "triton", "tl", "_time_candidate"}
                                       | emission.HELPER_FUNCTIONS)
        self.local_names: set[str] = set()
        self.reserved: set[str] = set()

    def buffer_name(self, preferred: str) -> str:
        """A name for a generated buffer (a key of the launcher's tensor table) that no
        tensor, statement or other buffer has."""
        name, k = preferred, 1
        while name in self.reserved or name in self.tensors:
            k += 1
            name = f"{preferred}_{k}"
        self.reserved.add(name)
        return name

    def extent(self, name: str) -> int:
        extents = dict(self.sig.extents)
        while name not in extents and name in self.fresh_names:
            name = self.fresh_names[name]
        return extents[name]

    def combine_fn(self, summary, fields: tuple[str, ...], flipped: bool = False) -> str:
        """The name of a jit function of the summary's combine on `fields` (a's, then
        b's); `flipped`: of combine(b, a), for a scan from the last element down
        (tl.associative_scan(..., reverse=True) passes the later segment first)."""
        key = (summary, fields, flipped)
        if key not in self.combines:
            guarded = not exact_identity(summary, fields)
            base = f"combine_{ident(summary.name)}" + "_later_first" * flipped
            taken = self.module_names | self.local_names
            name, k = base, 1
            while name in taken:
                k += 1
                name = f"{base}_{k}"
            self.module_names.add(name)
            index = {f: summary.field_names.index(f) for f in fields}
            a = {f: f"a_{ident(f)}" for f in fields}
            b = {f: f"b_{ident(f)}" for f in fields}
            names = {f"a.{f}": a[f] for f in fields} | {f"b.{f}": b[f] for f in fields}
            params = ", ".join([a[f] for f in fields] + [b[f] for f in fields])
            if flipped:
                names = {f"a.{f}": b[f] for f in fields} | {f"b.{f}": a[f] for f in fields}
            combine = selecting_combine(summary)
            results = [inline_formula(combine[index[f]], names, self.helpers) for f in fields]
            lines = ["@triton.jit", f"def {name}({params}):",
                     f"    # the combine of summary '{summary.name}' on fields ({', '.join(fields)})"
                     + (", of b then a" if flipped else "")]
            if guarded:
                ids = {f: emission.literal(summary.identity[index[f]].value) for f in fields}
                a_empty, b_empty = "a_empty", "b_empty"
                while a_empty in names.values() or b_empty in names.values():    # a field named `empty`
                    a_empty, b_empty = a_empty + "_", b_empty + "_"
                lines.append("    # its formulas are not exact at the identity (a tree reduction meets two "
                             "padding elements): the identity is passed through")
                lines.append(f"    {a_empty} = " + " & ".join(f"({a[f]} == {ids[f]})" for f in fields))
                lines.append(f"    {b_empty} = " + " & ".join(f"({b[f]} == {ids[f]})" for f in fields))
                results = [f"tl.where({b_empty}, {a[f]}, tl.where({a_empty}, {b[f]}, {r}))"
                           for f, r in zip(fields, results)]
            lines.append(f"    return {', '.join(results)}")
            source = "\n".join(lines) + "\n"
            self.combines[key] = (name, source)
        return self.combines[key][0]


def inline_formula(e: Expr, names: dict[str, str], helpers: set[str]) -> str:
    """A summary formula as one Triton expression over parameter names."""
    if isinstance(e, Var):
        return names[e.name]
    if isinstance(e, Const):
        return emission.literal(e.value)
    if isinstance(e, Call):
        args = [inline_formula(a, names, helpers) for a in e.args]
        if e.op == "pow" and isinstance(e.args[1], Const):
            n = emission.small_integer_power(e.args[1].value)
            if n is not None and n > 0:
                return "(" + " * ".join([args[0]] * n) + ")"
        return emission.emit(e.op, args, helpers)
    raise TypeError(f"cannot emit {type(e).__name__} inside a summary formula")


# ---------------------------------------------------------------- the kernel emitter
# values named after their role in a fold (see temp)
ROLE_STEMS = frozenset({"r_new", "r_use", "r_old", "a", "r2", "alpha", "w", "p", "a_empty", "b_empty", "term", "acc_new"})
# a generic fold's tiles: lift_<field>, ...; a tile formula's sums: sum_<name>; a scan's state
# at each position of its tile: prefix_<field> (suffix_<field>)
ROLE_PREFIXES = ("lift_", "tile_", "scan_", "sum_", "prefix_", "suffix_")


class KernelEmitter:
    """The kernel of a KernelSchedule.  A split kernel is two: PartialEmitter (each
    program folds a chunk of its program folds' tiles and stores the states) and
    MergeEmitter (folds the partial states with the combine and finishes)."""
    suffix = ""
    chunked = False         # each program folds one chunk of its folds' tiles (PartialEmitter)
    launched = True         # a kernel the launcher launches (not a function another kernel calls)
    totals = False          # a chunked scan's totals (ScanTotalsEmitter): each chunk from the identity

    def __init__(self, ctx: ModuleContext, kernel: ConcreteKernel):
        self.ctx = ctx
        self.kernel = kernel             # every size and tile decision (compiler.specialise)
        self.spec = spec = kernel.schedule
        self.name = spec.name + self.suffix
        self.params: dict[str, Arg] = {}
        self.accumulates: list[str] = []
        self.constexprs: dict[str, int] = {}
        self.tunable: dict[str, tuple[str, str]] = {}
        self.grid_blocks: list[tuple[str, str | None]] = []
        self.optional: frozenset[str] = frozenset()
        self.temp_ids = itertools.count()
        self.axis_ids = itertools.count()
        self.fold_ids = itertools.count()
        self.taken: set[str] = set(FIXED_NAMES)      # every identifier given out in this kernel
        # the program's names that look like numbered temporaries (comments quote them)
        self.taken |= {n for n in program_names(spec, ctx) if NUMBERED.fullmatch(n)}
        self.named: dict[tuple, str] = {}            # meaning (("extent", index), ...) -> its name
        self.role_names: dict[str, str] = {}         # numbered temporary -> the role it is written as
        ctx.module_names.add(self.name)
        self.whole: dict[tuple[str, bool], Axis] = {}     # (index, the grid's or the epilogue's) -> its axis
        # grid indices held whole: one program along each (its one tile holds the extent)
        self.whole_grid = {t.index for t in kernel.grid if t.how == WHOLE}
        self.tiles: set[tuple[str, ...]] = set()     # block names of every tile shape held
        self.tile_of: dict[str, str] = {}            # a load's variable -> the variable of its first tile
        self.loads: dict[str, Load] = {}             # a load's variable -> what its hint depends on
        self.sorted_axes: set[int] = set()           # the ids of loop axes over sorted positions
        # a scan's loop (ConcreteKernel.scan): where its header goes in the root's lines, and the
        # carried states' initial lines, which go before it
        self.scan_at: int | None = None
        self.scan_init: list[str] = []
        self.scan_after: list[str] = []              # lines after the scan's loop (ScanTotalsEmitter's stores)
        self.carried: dict[Reduce, tuple] = {}        # a prefix fold -> (its carried state, the state's axes)
        if kernel.scan_chunks > 1:
            self.chunked = True          # a second grid dimension: each program's chunk of the scanned index
        self.pending: dict[int, list[str]] = {}      # loop axis id -> tiles of addresses not yet written
        self.held: dict[str, tuple] = {}             # a running state's variable -> the axes it holds
        self.root = Scope(None, 0, {}, "root")
        self.buffers: list[tuple[str, list[str], str]] = []
        self.contraction = set(spec.dot_indices)        # the schedule's tile roles
        self.value_only = set(spec.value_only)
        # (tensor, indices) of the reads past the cache -> whether they outgrow L2 (eviction hints)
        self.past_cache = {(t, ix): big for t, ix, big in kernel.past_cache}

    # ------------------------------------------------------------ names
    def clashes(self, name: str) -> bool:
        return name in self.taken or name in self.ctx.module_names or keyword.iskeyword(name)

    def local(self, preferred: str, meaning: tuple | None = None) -> str:
        """A kernel-local identifier for `meaning` (the same one each time it is asked
        for): `preferred` if no other meaning has it, else `<preferred>_<k>`."""
        if meaning is not None and meaning in self.named:
            return self.named[meaning]
        name, k = preferred, 1
        while self.clashes(name):
            k += 1
            name = f"{preferred}_{k}"
        self.taken.add(name)
        self.ctx.local_names.add(name)
        if meaning is not None:
            self.named[meaning] = name
        return name

    def temp(self, stem: str = "t") -> str:
        """A fresh variable: a role's own name (`alpha`, `p`, `r_new`; `_2`, ... on a
        clash), or a numbered `t`, `op` or `x_<tensor>` for anonymous values."""
        if stem in ROLE_STEMS or stem.startswith(ROLE_PREFIXES):
            return self.local(stem)
        return self.local(f"{stem}{next(self.temp_ids)}")

    @staticmethod
    def _visible_lines(scope: Scope):
        """The line lists of `scope` and the scopes around it (each list once: a scope
        without loops shares its parent's)."""
        seen = set()
        for sc in scope.chain():
            if id(sc.lines) not in seen:
                seen.add(id(sc.lines))
                yield sc.lines

    def _sole_definition(self, variable: str, scope: Scope) -> tuple[list[str], int] | None:
        """(lines, position) of the line defining `variable` when no other line reads it yet."""
        name = re.compile(rf"\b{variable}\b")
        found = None
        for lines in self._visible_lines(scope):
            for k, line in enumerate(lines):
                uses = len(name.findall(line))
                if uses and (found is not None or uses != 1 or not line.startswith(f"{variable} = ")):
                    return None
                if uses:
                    found = (lines, k)
        return found

    @staticmethod
    def _numbered(v: Value) -> bool:
        return NUMBERED.fullmatch(v.code) is not None

    def renamed(self, v: Value, stem: str, scope: Scope) -> Value:
        """`v` under a role's name (`x0`, `o`, `alpha`) when it is a numbered temporary
        without one: the kernel's lines are written with that name (build)."""
        if self._numbered(v) and v.code not in self.role_names:
            self.role_names[v.code] = self.local(ident(stem))
        return v

    @staticmethod
    def _transpose_reads(scope: Scope, raw: str) -> None:
        """Values remembered in `scope` and around it that read the load `raw` read
        it transposed back."""
        pattern = re.compile(rf"\b{raw}\b")

        def recode(v: Value) -> Value:
            trans = f"tl.trans({raw})"
            return replace(v, code=pattern.sub(trans, v.code), raw=v.raw and pattern.sub(trans, v.raw))
        for sc in scope.chain():
            for key, m in sc.memo.items():
                if isinstance(m, Value):
                    sc.memo[key] = recode(m)
                elif isinstance(m, dict):
                    sc.memo[key] = {f: recode(x) for f, x in m.items()}

    def transposed_load(self, v: Value, scope: Scope) -> str | None:
        """The variable of `v`'s load, now loading the transposed tile, when `v` is a 2-D
        load that nothing reads yet (a tl.dot operand stored the other way round, V
        of attention: loaded as the dot needs it instead of transposed in registers);
        remembered values read it transposed back.  None: it cannot be."""
        if v.raw is None or len(dims(v.axes)) != 2:
            return None
        found = self._sole_definition(v.raw, scope)
        if found is None:
            return None
        lines, k = found
        swap = {"[:, None]": "[None, :]", "[None, :]": "[:, None]"}
        lines[k] = re.sub(r"\[:, None\]|\[None, :\]", lambda m: swap[m.group(0)], lines[k])
        tile = self.tile_of.get(v.raw)      # its first tile's addresses, made before the loop
        for block in [*self._visible_lines(scope), *self.pending.values()] if tile else []:
            for j, line in enumerate(block):
                if line.startswith(f"{tile} = "):
                    block[j] = re.sub(r"\[:, None\]|\[None, :\]", lambda m: swap[m.group(0)], line)
        self._transpose_reads(scope, v.raw)
        return v.raw

    def axis_var(self, name: str) -> str:
        """The suffix of an axis's names (offs_<var>, mask_<var>, BLOCK_<var>, ...): all free."""
        base = ident(name)
        var, k = base, 1
        while any(self.clashes(f"{p}_{var}") for p in AXIS_PREFIXES):
            k += 1
            var = f"{base}{k}"
        for p in AXIS_PREFIXES:
            self.taken.add(f"{p}_{var}")
            self.ctx.local_names.add(f"{p}_{var}")
        return var

    def state_dtype(self, kind: str) -> str:
        """A fold field's dtype: int64 for an integral field (an integer sum, max or min
        folds exactly), else the module's float state dtype."""
        return "tl.int64" if kind == "int" else self.ctx.cdt

    @staticmethod
    def identity_literal(s, field_name: str, kind: str = "float") -> str:
        """A field's identity as a literal of its kind: an integral max or min starts
        from the int64 extremes (its infinite identity has no integer)."""
        value = s.identity[s.field_names.index(field_name)].value
        if kind == "int":
            value = int(INT64_EXTREMES.get(value, value))
        return emission.literal(value)

    def state_var(self, prefix: str, field_name: str, role: str | None = None) -> str:
        """The variable of a fold's running field, named after the field (`r`, `l`) or
        its role (`acc`: a tl.dot accumulator); one name however often its update is
        emitted."""
        return self.local(role or ident(field_name), ("state", prefix, field_name))

    def new_axis(self, name: str, level: int, kind: str, block: int) -> Axis:
        ax = Axis(next(self.axis_ids), name, self.axis_var(name), level, kind, block)
        if block:
            self.constexprs[ax.block_name] = block
        return ax

    def extent_param(self, name: str) -> str:
        p = self.local(f"n_{ident(name)}", ("extent", name))
        self.params.setdefault(p, Arg("extent", name))
        return p

    def chunk_run(self):
        """The chunked run this kernel is launched in (schedule/chunks.py), or None."""
        return self.ctx.chunking if self.spec.name in self.ctx.chunked_kernels else None

    def in_chunks(self, index: str) -> bool:
        """Whether this kernel runs once per chunk of `index` (a view of each tensor)."""
        run = self.chunk_run()
        return run is not None and index in run.names

    def start_param(self) -> str:
        p = self.local("start", ("start",))
        self.params.setdefault(p, Arg("start"))
        return p

    def whole_extent_param(self, name: str) -> str:
        p = self.local(f"n_{ident(name)}_whole", ("whole extent", name))
        self.params.setdefault(p, Arg("whole extent", name))
        return p

    def tensor_params(self, name: str, rank: int) -> tuple[str, list[str]]:
        ptr = self.local(f"{ident(name)}_ptr", ("ptr", name))
        self.params.setdefault(ptr, Arg("tensor", name))
        strides = []
        for d in range(rank):
            s = self.local(f"{ident(name)}_s{d}", ("stride", name, d))
            self.params.setdefault(s, Arg("stride", name, d))
            strides.append(s)
        return ptr, strides

    # ------------------------------------------------------------ placement and memo
    def target(self, axes, scope: Scope, level: int = 0) -> Scope:
        """The outermost scope visible from `scope` where values over `axes` (and values
        defined at `level`) exist."""
        level = max([a.level for a in axes] + [level])
        for s in scope.chain():
            if s.level == level:
                return s
        raise AssertionError("an axis is not visible from this scope")

    def lookup(self, key, scope: Scope):
        for s in scope.chain():
            if key in s.memo:
                return s.memo[key]
        return None

    def tile(self, axes) -> None:
        """Record a tile shape the kernel holds (for the size check of its tilings); a
        scan's 1-D tile (SCAN_ELEMENTS at the emitter's tiles) is far below the limit."""
        self.tiles.add(tuple(a.block_name for a in dims(axes) if a.kind != "scan"))

    def assign(self, code: str, axes, scope: Scope, kind: str = "float", stem: str = "t", **extra) -> Value:
        self.tile(axes)
        name = self.temp(stem)
        scope.lines.append(f"{name} = {code}")
        return Value(name, sort_axes(axes), kind, level=scope.level, **extra)

    # ------------------------------------------------------------ broadcasting helpers
    @staticmethod
    def expand(v: Value, target) -> str:
        """`v`'s code with size-1 dimensions inserted so that it broadcasts over `target`."""
        target_dims = dims(target)
        own = dims(v.axes)
        if not own or own == target_dims:
            return v.code
        code = v.code if re.fullmatch(r"[A-Za-z_]\w*", v.code) else f"({v.code})"
        return code + "[" + ", ".join(":" if a in own else "None" for a in target_dims) + "]"

    @staticmethod
    def shape(axes) -> str:
        return "[" + ", ".join(a.block_name for a in dims(axes)) + "]"

    def mask_code(self, mask_axes, target) -> str | None:
        parts = [self.expand(Value(a.mask, (a,), "bool"), target) for a in dims(mask_axes) if self.ragged(a)]
        return " & ".join(parts) if parts else None

    def broadcast(self, code: str, axes, dtype: str | None = None) -> str:
        """A value broadcast to the tile of `axes` (float, or of `dtype`); works for
        constants too (tl.broadcast_to takes tensors only, and an unmasked lift may be
        a literal)."""
        return f"({code} + tl.zeros({self.shape(axes)}, {dtype or self.ctx.cdt}))"

    def masked(self, mask_axes, target, code: str, other: str) -> str:
        """`code` where the tile is inside every extent, `other` (the identity) outside."""
        mask = self.mask_code(mask_axes, target)
        return f"tl.where({mask}, {code}, {other})" if mask else code

    def ragged(self, a: Axis) -> bool:
        """Can a tile of `a` reach past its extent?  Not when the extent is a positive
        multiple of every tile the axis may take (tuned tiles are powers of two up to
        256) and tiles start at multiples of the tile: such tiles need no mask at all.
        An empty index (extent 0) is no multiple: every element of its tile is masked."""
        if a.kind == "scan" or a.id in self.sorted_axes:
            return True             # its steps start anywhere: a scan's at the loop's start, a sorted loop's range
        largest = 256 if a.block_name in self.tunable else a.block
        if self.in_chunks(a.name):
            return any(n % largest != 0 for n in self.ctx.chunking.lengths)
        n = self.ctx.extent(a.name)
        return n == 0 or n % largest != 0

    def as_float(self, v: Value) -> Value:
        if v.kind == "float":
            return v
        if v.const is not None:
            return Value(emission.literal(float(v.const)), (), "float", const=float(v.const))
        if not dims(v.axes):
            # a scalar int may be a constexpr (Triton specialises some integer arguments)
            return Value(f"({v.code} * 1.0)", v.axes, "float", level=v.level)
        return Value(f"{v.code}.to({self.ctx.cdt})", v.axes, "float", level=v.level, origin=("float", (v,)))

    # ------------------------------------------------------------ expressions
    def value(self, e: Expr, scope: Scope) -> Value:
        if isinstance(e, Const):
            kind = "bool" if isinstance(e.value, bool) else "int" if isinstance(e.value, int) else "float"
            return Value(emission.literal(e.value), (), kind, const=e.value)
        if isinstance(e, Index):
            ax = scope.env[e.name]
            bounds = (0, max(self.ctx.extent(e.name) + ax.block - 1, 0))
            if self.in_chunks(e.name):
                # a chunk's view starts at value `start` of the index (schedule/chunks.py)
                return Value(f"({ax.offs} + {self.start_param()})", (ax,), "int", bounds=bounds)
            return Value(ax.offs, (ax,), "int", bounds=bounds)
        if isinstance(e, Extent):
            n = self.ctx.extent(e.name)
            if self.in_chunks(e.name):
                return Value(self.whole_extent_param(e.name), (), "int", bounds=(n, n))
            return Value(self.extent_param(e.name), (), "int", bounds=(n, n))
        if isinstance(e, Var):
            raise TypeError(f"free summary variable '{e.name}' in a statement")
        key = (e, tuple((n, scope.env[n].id) for n in sorted(free(e))))
        found = self.lookup(key, scope)
        if found is not None:
            return found
        if isinstance(e, Access):
            v = self.load(e, scope)
        elif isinstance(e, Call):
            v = self.call(e.op, [self.value(a, scope) for a in e.args], None, scope)
        elif isinstance(e, Reduce):
            v = self.reduce(e, scope)
        else:
            raise TypeError(f"the triton backend cannot emit {type(e).__name__} (run the lower pass first)")
        self.target(v.axes, scope, v.level).memo[key] = v
        return v

    def call(self, op: str, args: list[Value], pin: Scope | None, scope: Scope, cse: dict | None = None) -> Value:
        """Apply an operator.  `pin`: emit into that scope (formulas over running
        state); otherwise into the outermost scope the operands allow.  `cse`: a
        table shared by formulas emitted together (equal code is computed once)."""
        from ...ops import OPS
        if all(a.const is not None for a in args):
            def tensor(c):
                dtype = torch.bool if isinstance(c, bool) else torch.int64 if isinstance(c, int) else torch.float64
                # an operator the language types as float (2 ** -1, 1 / 2) folds in floating point
                return torch.tensor(c, dtype=torch.float64 if op in emission.FLOAT_RESULT else dtype)
            result = OPS[op].torch(*(tensor(a.const) for a in args)).item()
            if isinstance(result, bool):
                return Value(emission.literal(result), (), "bool", const=result)
            kind = "int" if isinstance(result, int) else "float"
            return Value(emission.literal(result), (), kind, const=result)
        axes = sort_axes(a for v in args for a in v.axes)
        level = max((a.level for a in args), default=0)
        place = pin if pin is not None else self.target(axes, scope, level)
        kinds = [a.kind for a in args]
        if op == "pow" and args[1].const is not None:
            n = emission.small_integer_power(args[1].const)
            base = self.as_float(args[0])
            if n is not None:
                if n == 0:
                    return Value("1.0", (), "float", const=1.0)
                code = " * ".join([base.code] * abs(n))
                return self.assign(f"1.0 / ({code})" if n < 0 else code, base.axes, place)
            if args[1].const == 0.5:
                return self.assign(f"tl.sqrt({base.code})", base.axes, place)
            if args[1].const == -0.5:
                return self.assign(f"tl.rsqrt({base.code})", base.axes, place)
            # a float exponent: _pow's floor of an integer literal (x ** 9) does not compile on the GPU
            exponent = float(args[1].const)
            args = [args[0], Value(emission.literal(exponent), (), "float", const=exponent)]
        if op in emission.FLOAT_RESULT:
            kind = "float"
            args = [self.as_float(a) for a in args]
        elif op in emission.BOOL_RESULT:
            kind = "bool"
        elif op == "where":
            kind = "float" if "float" in kinds[1:] else kinds[1]
            if kind == "float":
                args = [args[0]] + [self.as_float(a) for a in args[1:]]
        else:
            kind = "float" if "float" in kinds else "int"
            if kind == "float":
                args = [self.as_float(a) for a in args]
        bounds = emission.int_bounds(op, [a.bounds if a.const is None else (a.const, a.const) for a in args]) \
            if kind == "int" else None
        # an integer literal past 32 bits is an int64 (Triton would take 3000000000 as uint32)
        codes = [self.expand(a, axes) if a.const is None else
                 f"tl.full([], {a.code}, tl.int64)" if a.kind == "int" and abs(a.const) >= 2 ** 31 else a.code
                 for a in args]
        if bounds is not None and max(map(abs, bounds)) >= 2 ** 31:
            # int32 index arithmetic would wrap: compute this operation in 64 bits
            codes = [f"{c}.to(tl.int64)" if a.kind == "int" and a.const is None and
                     (a.bounds is None or max(map(abs, a.bounds)) < 2 ** 31) else c
                     for c, a in zip(codes, args)]
        if op in emission.LOGICAL:
            # a scalar truth value (a comparison of a kernel argument or of a 0-d load) is compared
            # with 0 first: Triton's interpreter types it wrongly in & and | (a float64 & that numpy
            # rejects), and the comparison costs nothing compiled
            codes = [f"({c} != 0)" if a.const is None and not dims(a.axes) else c
                     for c, a in zip(codes, args)]
        code = emission.emit(op, codes, self.ctx.helpers)
        origin = (op, tuple(args))
        if cse is not None:
            if code not in cse:
                cse[code] = self.assign(code, axes, place, kind, bounds=bounds, origin=origin)
            return cse[code]
        return self.assign(code, axes, place, kind, bounds=bounds, origin=origin)

    def formula(self, e: Expr, env: dict[str, Value], scope: Scope, cse: dict | None = None) -> Value:
        """A summary formula (lift, combine, finalize, weight, repair) over Values, pinned to `scope`."""
        if isinstance(e, Var):
            return env[e.name]
        if isinstance(e, Const):
            return Value(emission.literal(e.value), (), "float", const=float(e.value))
        if isinstance(e, Call):
            return self.call(e.op, [self.formula(a, env, scope, cse) for a in e.args], scope, scope, cse)
        raise TypeError(f"cannot emit {type(e).__name__} inside a summary formula")

    # ------------------------------------------------------------ memory
    def flush_tiles(self, scope: Scope, loops) -> None:
        """Write the tiles of addresses made for `loops` (axes), which are about to be
        written into `scope`."""
        for ax in loops:
            scope.lines.extend(self.pending.pop(ax.id, []))

    def offsets(self, axes: list[Axis], strides: list[str], target, first=frozenset()) -> str:
        """The element offsets of the tile of `axes`; the axes in `first` at their
        loop's first tile (tl.arange from 0)."""
        terms = []
        for ax, st in zip(axes, strides):
            if ax.scalar:
                terms.append(f"{ax.offs}.to(tl.int64) * {st}")
                continue
            code = self.expand(Value(ax.offs, (ax,), "int"), target)
            if ax in first:
                code = f"tl.arange(0, {ax.block_name})" + code[len(ax.offs):]
            terms.append(f"{code}.to(tl.int64) * {st}")
        return " + ".join(terms)

    def address(self, tensor: str, ptr: str, axes: list[Axis], strides: list[str], target,
                scope: Scope) -> tuple[str, str | None]:
        """(the addresses of the tile of `tensor` over `axes`, read or written in
        `scope`; the variable of its first tile or None).  Inside loops over some of
        the axes, the addresses of the loops' first tile are made once before them
        (`<tensor>_tile`) and each step adds its start times the stride, a scalar: no
        tile of address arithmetic per step (matmul 633 -> 688 TFLOP/s on the H100,
        scripts/matmul_probe.py)."""
        if not axes:
            return ptr, None
        # a sorted loop's positions are gathered, not a range a start moves along
        stepped = {a for a in axes if a.kind in ("loop", "epilogue", "scan") and not a.scalar
                   and a.id not in self.sorted_axes}
        level = max((a.level for a in axes if a not in stepped), default=0)
        stepped = {a for a in stepped if a.level > level}
        if not stepped:
            return f"{ptr} + {self.offsets(axes, strides, target)}", None
        tile = self.local(f"{ident(tensor)}_tile")
        # written just before the outermost of the loops (flush_tiles), not where the scope's
        # lines end now: an epilogue's tiles would be live through the folds before it
        outermost = min(stepped, key=lambda a: (a.level, a.id))
        self.pending.setdefault(outermost.id, []).append(
            f"{tile} = {ptr} + {self.offsets(axes, strides, target, stepped)}")
        # tl.cast, not .to(): a loop's start is a Python int under the interpreter
        steps = [f"tl.cast(start_{a.var}, tl.int64) * {st}" for a, st in zip(axes, strides) if a in stepped]
        return " + ".join([tile, *steps]), tile

    def load(self, e: Access, scope: Scope) -> Value:
        info = self.ctx.tensors[e.tensor]
        if info.kind == "number" and self.ctx.cdt != "tl.float64":
            p = self.local(f"{ident(e.tensor)}_val", ("val", e.tensor))
            if p not in self.params:
                self.params[p] = Arg("number", e.tensor)
                # float32 whoever launches: Triton passes a Python float as one, inductor as a float64
                self.root.lines.append(f"{p} = tl.cast({p}, tl.float32)")
            return Value(p, (), "float", positive=e.tensor in self.ctx.positive)
        if info.kind == "number":
            # float arguments are float32 inside a kernel; a float64 program reads its numbers from memory
            p = self.local(f"{ident(e.tensor)}_ptr", ("ptr", e.tensor))
            self.params.setdefault(p, Arg("number64", e.tensor))
            raw = self.temp(f"x_{ident(e.tensor)}")
            self.root.lines.append(f"{raw} = tl.load({p})")
            return Value(raw, (), "float", positive=e.tensor in self.ctx.positive)
        axes = [scope.env[n] for n in e.indices]
        ptr, strides = self.tensor_params(e.tensor, info.rank)
        target = sort_axes(axes)
        place = self.target(target, scope)
        inside = None
        if e.layout is not None:
            ptr, strides, inside = self.affine_read(e, axes, ptr, strides, target, scope)
            # an index no dimension moves (i of E[T[i], d], read through T) adds no offsets
            axes, strides = [a for a, st in zip(axes, strides) if st], [st for st in strides if st]
        if e.gathers is not None:
            # the addresses of a gathered tile vary as its positions do: none stepped through a loop
            address, tile = f"{ptr} + {self.offsets(axes, strides, target)}" if axes else ptr, None
        else:
            address, tile = self.address(e.tensor, ptr, axes, strides, target, place)
        mask = " & ".join(filter(None, (self.mask_code(target, target), inside))) or None
        raw = self.temp(f"x_{ident(e.tensor)}")
        if tile is not None:
            self.tile_of[raw] = tile
        self.tile(target)
        read = (e.tensor, e.indices)
        self.loads[raw] = Load(e.tensor, e.indices, read in self.past_cache, self.past_cache.get(read, False))
        hint = f", {EVICTION_MARK}{raw}"
        if mask:
            place.lines.append(f"{raw} = tl.load({address}, mask={mask}, other=0.0{hint})")
        else:
            place.lines.append(f"{raw} = tl.load({address}{hint})")
        if info.dtype == torch.bool:
            return Value(raw, target, "bool", zero=frozenset(dims(target)), tensor=e.tensor)
        if not info.dtype.is_floating_point:
            # integers compute exactly, in 64 bits as the oracle does (a label compared with an
            # index never passes through a float)
            code = raw if info.dtype == torch.int64 else f"{raw}.to(tl.int64)"
            return Value(code, target, "int", zero=frozenset(dims(target)), tensor=e.tensor)
        stored = TL_DTYPES.get(info.dtype)
        code = raw if stored == self.ctx.cdt else f"{raw}.to({self.ctx.cdt})"
        return Value(code, target, "float", raw=raw, raw_dtype=info.dtype, zero=frozenset(dims(target)),
                     user_tensor=e.tensor in self.ctx.input_names, tensor=e.tensor)

    def affine_read(self, e: Access, axes: list[Axis], ptr: str, strides: list[str],
                    target, scope: Scope) -> tuple[str, list[str], str | None]:
        """A read at affine subscripts (`X[b, c, t + r]`) as one of a view over its indices:
        (its base, each index's stride, which is the sum of the strides of the dimensions
        it moves times its coefficients ("" where it moves none), and the mask of the
        positions inside the tensor: outside, the read is 0).  A gathered dimension
        (`E[T[i], d]`) adds its integer read's values, loaded first, times its stride to
        the base: a tile of addresses."""
        def times(c: int, code: str) -> str:
            return code if c == 1 else f"-{code}" if c == -1 else f"{c} * {code}"

        def total(terms: list[str]) -> str:
            return "" if not terms else terms[0] if len(terms) == 1 else f"({' + '.join(terms)})"

        index_strides = [total([times(coeffs[j], st) for (coeffs, _), st in zip(e.layout, strides) if coeffs[j]])
                         for j in range(len(e.indices))]
        shift = [times(k, st) for (_, k), st in zip(e.layout, strides) if k]
        inside = []
        for d, (coeffs, constant) in enumerate(e.layout):
            if e.dimension_index(d) is not None:
                continue            # read at one index, which its own mask keeps inside
            terms = [times(c, f"{ax.offs}" if ax.scalar else self.expand(Value(ax.offs, (ax,), "int"), target))
                     for c, ax in zip(coeffs, axes) if c]
            found, varies = e.gathered(d), any(not ax.scalar for c, ax in zip(coeffs, axes) if c)
            if found is not None:
                read, scale = found
                value = self.load(read, scope)
                varies = varies or bool(dims(value.axes))
                gathered = times(scale, self.expand(value, target) if dims(value.axes) else value.code)
                shift.append(f"{gathered}.to(tl.int64) * {strides[d]}")
                terms.insert(0, gathered)
            position = " + ".join(terms + ([str(constant)] if constant else [])) or "0"
            if dims(target) and not varies:
                # a tensor beside the tile: Triton's interpreter refuses a scalar test in a tile's mask
                # (the offsets, not a shape: a transposed load swaps their subscripts)
                tiled = dims(target)[0]
                position += f" + 0 * {self.expand(Value(tiled.offs, (tiled,), 'int'), target)}"
            n = self.local(f"{ident(e.tensor)}_n{d}", ("dimension", e.tensor, d))
            self.params.setdefault(n, Arg("dimension", e.tensor, d))
            low = "" if constant >= 0 and all(c >= 0 for c in coeffs) and found is None else f"({position} >= 0) & "
            inside.append(f"{low}({position} < {n})")
        return (f"({ptr} + ({' + '.join(shift)}))" if shift else ptr), index_strides, " & ".join(inside) or None

    def store(self, name: str, indices: tuple[str, ...], v: Value, scope: Scope) -> None:
        info = self.ctx.tensors[name]
        axes = [scope.env[n] for n in indices]
        ptr, strides = self.tensor_params(name, info.rank)
        target = sort_axes(axes)
        address, _ = self.address(name, ptr, axes, strides, target, scope)
        if v.const is not None:
            value = f"tl.full({self.shape(target)}, {v.code}, {self.ctx.cdt})"
        elif set(dims(v.axes)) - set(dims(target)):
            # a value kept over a tile it does not vary over (a fold's count beside its
            # row means): store its first element, selected exactly (x + 0 is x)
            code, current = v.code, list(dims(v.axes))
            for ax in reversed(dims(v.axes)):
                if ax not in dims(target):
                    first = self.expand(Value(f"(tl.arange(0, {ax.block_name}) == 0)", (ax,), "bool"),
                                        current)
                    code = f"tl.sum(tl.where({first}, {code}, 0.0), {current.index(ax)})"
                    current.remove(ax)
            value = self.full_shape(Value(code, sort_axes(current), "float"), target)
        elif dims(v.axes) != dims(target):
            value = f"tl.broadcast_to({self.expand(v, target)}, {self.shape(target)})"
        else:
            value = v.code
        mask = self.mask_code(target, target)
        run = self.chunk_run()
        summed = run is not None and name in run.accumulated
        if summed:
            # a sum over the chunked index: each chunk adds its sum to what the chunks before it
            # stored (zeros before the first; the chunks run one after another), in float32
            value = f"{value} + tl.load({address}" + (f", mask={mask}, other=0.0)" if mask else ")")
            self.accumulates.append(ptr)
        # tl.cast, not .to(): a scalar input stored as is may be a plain Python number
        line = f"tl.store({address}, tl.cast({value}, {ptr}.dtype.element_ty)" + (f", mask={mask})" if mask else ")")
        scope.lines.append(f"# {name}[{', '.join(indices)}]" + (": the chunks' sum so far" if summed else ""))
        # a statement over fewer indices than the grid (a row statistic beside a row
        # tile's output) is stored once: by the programs of the first tile of the others
        # (an index held whole has one)
        first = [f"pid_{scope.env[g].var} == 0" for g in self.spec.grid
                 if g not in indices and g not in self.whole_grid and g != self.kernel.scan]
        if first:
            scope.lines += [f"if {' and '.join(first)}:", f"    {line}"]
        else:
            scope.lines.append(line)

    # ------------------------------------------------------------ reductions
    def reduce(self, R: Reduce, scope: Scope) -> Value:
        state, key, T = self.fold_state(R, scope)
        if R.result is not None:
            return state[R.result]
        fkey = ("final", key)
        found = self.lookup(fkey, scope)
        if found is None:
            found = self.formula(R.summary.finalize, state, T)
            T.memo[fkey] = found
        return found

    def fold_state(self, R: Reduce, scope: Scope):
        fold = R.fold
        if R.result is not None and not free(fold) <= set(scope.env):
            # the projected field does not vary over every free index of the fold (the row
            # logsumexp of attention's fold, whose output field also varies over j): where
            # those indices do not exist, fold only the fields that do not vary over them
            narrowed = restrict(fold, frozenset(scope.env))
            if narrowed is not None and R.result in narrowed.summary.field_names:
                fold = narrowed
        missing = sorted(free(fold) - set(scope.env))
        if missing:
            raise BackendError(f"{self.spec.name}: the fold {fold.summary.name}[{', '.join(fold.indices)}] "
                               f"varies over {', '.join(missing)}, which this kernel does not loop over")
        names = sorted(free(fold))
        env0 = {n: scope.env[n] for n in names}
        T = self.target(env0.values(), scope)
        key = ("fold", fold, tuple((n, env0[n].id) for n in names))
        state = self.lookup(key, scope)
        if state is None:
            state = self.fold_at(fold, env0, T)
            # the state exists from T on: values computed from it are placed there or deeper,
            # even where a field varies over fewer indices than the fold (and so than T's axes)
            state = {f: v if v.level >= T.level else replace(v, level=T.level) for f, v in state.items()}
            T.memo[key] = state
        return state, key, T

    def fold_at(self, fold: Reduce, env0: dict[str, Axis], T: Scope) -> dict[str, Value]:
        """The state of `fold` computed in scope T."""
        return self.emit_fold(fold, env0, T)

    def emit_fold(self, fold: Reduce, env0: dict[str, Axis], T: Scope) -> dict[str, Value]:
        s = fold.summary
        k = next(self.fold_ids)
        prefix = f"f{k}"
        loops: list[Axis] = []
        bound: list[Axis] = []
        how = self.kernel.loops_of(fold, nested=T.kind in ("body", "merge"))
        if how.prefix is not None:
            return self.prefix_fold(fold, how.prefix, env0, T, k)
        shared = {index for index, _ in how.shared}
        for t in how.tiles:
            ax = self.whole_axis(t, t.index in shared) if t.how == WHOLE else \
                self.new_axis(t.index, T.level + 1, "loop", t.size)
            if t.tuned:
                self.tunable[ax.block_name] = ("loop", t.index)
            bound.append(ax)
            if ax.kind == "loop":
                loops.append(ax)
        env = {**env0, **{b: ax for b, ax in zip(fold.indices, bound)}}
        ordered = how.sorted
        if loops:
            body = Scope(T, T.level + 1, env, "body")
            for ax in loops:
                if ordered is not None and ax.name == ordered.index:
                    # the next positions in the order of the values: a tile of gathered offsets
                    self.sorted_axes.add(ax.id)
                    order = self.prepared_param(Arg("order", ordered.tensor))
                    row = self.sorted_row(ordered, bound, self.extent_param(ordered.index))
                    body.lines.append(f"rank_{ax.var} = start_{ax.var} + tl.arange(0, {ax.block_name})")
                    body.lines.append(f"{ax.mask} = rank_{ax.var} < hi_{ax.var}")
                    body.lines.append(f"{ax.offs} = tl.load({order} + {row}rank_{ax.var}, mask={ax.mask}, other=0)")
                    continue
                if ax.scalar:
                    body.lines.append(f"{ax.offs} = start_{ax.var}")
                    continue
                body.lines.append(f"{ax.offs} = start_{ax.var} + tl.arange(0, {ax.block_name})")
                body.lines.append(f"{ax.mask} = {ax.offs} < {self.extent_param(ax.name)}")
        else:
            body = Scope(T.parent, T.level, env, T.kind, lines=T.lines, memo=T.memo)
        RA = sort_axes(bound)
        init: list[str] = []
        finish: list[str] = []
        mark = len(T.lines)
        T.lines.append(f"# fold {k}: {s.name}[{', '.join(fold.indices)}]"
                       + (f" over tiles of {', '.join(a.name for a in loops)}" if loops else " (whole)"))
        state = self.skipping_dead_tiles(how, body, lambda: self.fold_tiles(
            fold, prefix, body, RA, bool(loops), init, finish))
        if loops:
            relations = dict(how.bounds)
            span = list(how.span)
            interior = self.interior_loop(how, loops, env, env0, prefix, RA, T, tested=not span)
            T.lines.extend(init)
            self.flush_tiles(T, loops)
            headers, depth = [], 0
            boundary_after = True          # tiles left past the interior, where the predicate is evaluated
            chunk = self.chunked and T is self.root
            for p, ax in enumerate(loops):
                n = self.extent_param(ax.name)
                lo, hi = "0", n
                if chunk and ax.name == how.chunked:
                    # flash-decoding: this program folds one contiguous chunk of the tiles
                    T.lines.append(f"chunk_{ax.var} = tl.cdiv(tl.cdiv({n}, {self.step(ax)}), n_split) "
                                   f"* {self.step(ax)}")
                    T.lines.append(f"lo_{ax.var} = split_id * chunk_{ax.var}")
                    T.lines.append(f"hi_{ax.var} = tl.minimum(lo_{ax.var} + chunk_{ax.var}, {n})")
                    lo, hi = f"lo_{ax.var}", f"hi_{ax.var}"
                lo, hi = self.predicate_bounds(ax, relations.get(ax.name, []), env0, lo, hi, T)
                if ordered is not None and ax.name == ordered.index:
                    lo, hi, lines = self.sorted_range(ordered, ax, env0, bound)
                    # inside the loops over the rows, whose starts they are
                    (T.lines.extend(lines) if p == 0 else headers.extend(indent(lines, depth)))
                dense = None
                if span:
                    lo, hi, dense = self.live_span(span, ax, env0, lo, hi, T)
                if dense is not None and interior is None:
                    # a span without holes runs untested, one with holes in the loop after, tested
                    plain = self.tile_body(fold, how, loops, env, prefix, RA, T, tested=False)
                    self.flush_tiles(T, loops)
                    T.lines += ["# a span without holes runs untested; one with holes in the loop after, "
                                "each tile tested",
                                f"mid_{ax.var} = tl.where({dense}, {hi}, {lo})",
                                f"for start_{ax.var} in range({lo}, mid_{ax.var}, {ax.block_name}):",
                                *indent(plain.lines, 1)]
                    lo = f"mid_{ax.var}"
                far = None           # the boundary tiles before the interior (a window's far edge)
                if interior is not None and p == 0:
                    # the tiles where the predicate holds everywhere run without it (the
                    # interior), then the boundary tiles on either side of it, evaluating it
                    first, last, inner_body = interior
                    if first is not None:
                        T.lines.append(f"inner_{ax.var} = tl.maximum({lo}, tl.minimum({hi}, {first}))")
                        far = (lo, f"inner_{ax.var}")
                        lo = f"inner_{ax.var}"
                    end = hi if last is None else f"mid_{ax.var}"
                    if last is not None:
                        T.lines.append(f"mid_{ax.var} = tl.maximum({lo}, tl.minimum({hi}, {last}))")
                    if dense is not None:
                        T.lines += ["# the interior runs untested where the span has no holes; otherwise "
                                    "every tile is tested, in the boundary loop",
                                    f"mid_{ax.var} = tl.where({dense}, {end}, {lo})"]
                        end = f"mid_{ax.var}"
                    T.lines.append(f"for start_{ax.var} in range({lo}, {end}, {ax.block_name}):")
                    T.lines.extend(indent(inner_body.lines, 1))
                    boundary_after = end != hi
                    if boundary_after or far:
                        T.lines.append("# the boundary tiles, where the predicate is evaluated")
                    lo = end
                if far is not None:
                    # the tiles before the interior and those after it in one loop: one copy of
                    # the boundary body to compile, not two
                    near = (lo, hi) if boundary_after else (hi, hi)
                    count = f"far_{ax.var}"
                    T.lines.append(f"{count} = tl.cdiv({far[1]} - {far[0]}, {ax.block_name})")
                    step, block = f"step_{ax.var}", ax.block_name
                    headers.append(f"for {step} in range(0, {count} + tl.maximum(tl.cdiv({near[1]} - {near[0]}, "
                                   f"{block}), 0)):")
                    body.lines.insert(0, f"start_{ax.var} = tl.where({step} < {count}, {far[0]} + {step} * {block}, "
                                         f"{near[0]} + ({step} - {count}) * {block})")
                    boundary_after = True
                else:
                    headers += indent([f"for start_{ax.var} in range({lo}, {hi}, {self.step(ax)}):"], depth)
                depth += 1
            if boundary_after:
                T.lines.extend(headers)
                T.lines.extend(indent(body.lines, depth))
            T.lines.extend(finish)
        else:
            T.lines[mark + 1:mark + 1] = init      # the state exists before the straight-line body
        return state

    def prefix_fold(self, fold: Reduce, p, env0: dict[str, Axis], T: Scope, k: int) -> dict[str, Value]:
        """The state of a prefix fold (schedule.bounds.Prefix) at every position of the
        scan's tile: the elements lifted (the identity where s = t + offset is before s's
        first position; the specialisation stage keeps it within the last), scanned along
        the tile with the summary's combine, each combined with the state of the tiles
        before (after, for a suffix), which then takes the tile's last (first) position's."""
        s = fold.summary
        ax = env0[p.over]
        T.lines.append(f"# fold {k}: {s.name}[{p.index}] as a {'suffix' if p.reverse else 'prefix'} scan along "
                       f"{p.over}: the element at {p.over} is the fold's at {p.index} = {p.position}")
        xs = {f"x{j}": self.renamed(self.value(a, T), f"x{j}", T) for j, a in enumerate(p.element)}
        xs = {x: v if v.kind == "int" else self.as_float(v) for x, v in xs.items()}
        kinds = self.field_kinds(s, xs)
        fields = s.field_names
        ids = {f: self.identity_literal(s, f, kinds[f]) for f in fields}
        lifted = {f: self.to_kind(self.formula(s.lift[i], xs, T), kinds[f]) for i, f in enumerate(fields)}
        U = sort_axes([a for v in lifted.values() for a in v.axes] + list(env0.values()))
        self.tile(U)
        inside = [self.expand(Value(ax.mask, (ax,), "bool"), U)] if self.ragged(ax) else []
        if p.offset < 0:
            inside.append(self.expand(Value(f"({ax.offs} >= {-p.offset})", (ax,), "bool"), U))
        tiles = []
        for f in fields:
            code = self.expand(lifted[f], U)
            if inside:
                code = f"tl.where({' & '.join(inside)}, {code}, {ids[f]})"
            if lifted[f].const is not None or dims(lifted[f].axes) != dims(U):
                code = self.broadcast(code, U, self.state_dtype(kinds[f]))     # a scan's operands are whole tiles
            tiles.append(self.assign(code, U, T, stem=f"lift_{ident(f)}").code)
        pos = dims(U).index(ax)
        combine = self.ctx.combine_fn(s, fields, flipped=p.reverse and not s.commutative)
        scans = [self.temp(f"scan_{ident(f)}") for f in fields]
        operands = tiles[0] if len(fields) == 1 else "(" + ", ".join(tiles) + ",)"
        T.lines.append(f"{', '.join(scans)} = tl.associative_scan({operands}, {pos}, {combine}"
                       f"{', reverse=True' * p.reverse})")
        # the state of the tiles before (after) this one: carried across the scan's loop
        FA = sort_axes(a for a in U if a is not ax)
        carry = {}
        for f in fields:
            var = self.state_var(f"f{k}", f, f"carry_{ident(f)}")
            self.scan_init.append(f"{var} = tl.full({self.shape(FA)}, {ids[f]}, {self.state_dtype(kinds[f])})")
            carry[f] = Value(var, FA, kinds[f])
        if self.kernel.scan_chunks > 1 and not self.totals:
            self.chunk_carry(fold, carry, FA, ids, p.reverse)
        scanned = {f: Value(v, U, kinds[f]) for f, v in zip(fields, scans)}
        earlier, later = (scanned, carry) if p.reverse else (carry, scanned)
        env = {f"a.{f}": earlier[f] for f in fields} | {f"b.{f}": later[f] for f in fields}
        T.lines.append(f"# each position's state: the carried state's and the scan's, by the combine of '{s.name}'")
        cse: dict = {}
        rule = selecting_combine(s)
        new = {f: self.formula(rule[i], env, T, cse) for i, f in enumerate(fields)}
        new = self.guard_identity(s, fields, earlier, later, new, T)
        state = {}
        for f in fields:
            stem = f"{'suffix' if p.reverse else 'prefix'}_{ident(f)}"
            v = self.to_kind(new[f], kinds[f])
            state[f] = (self.renamed(v, stem, T) if self._numbered(v) and dims(v.axes) == dims(U)
                        else self.assign(self.full_shape(v, U), U, T, kinds[f], stem=stem))
        self.carried[fold] = (carry, FA)
        T.lines.append(f"# carried on: the state at the tile's {'first' if p.reverse else 'last'} position")
        for f in fields:
            T.lines.append(f"{carry[f].code} = {self.at_edge(state[f].code, ax, U, kinds[f], first=p.reverse)}")
        return state

    def at_edge(self, code: str, ax: Axis, axes, kind: str, first: bool = False) -> str:
        """The element of the tile `code` (over `axes`) at the last (`first`: the first)
        position of `ax`, dropping that axis: a scan's total."""
        edge = "0" if first else f"{ax.block_name} - 1"
        at = self.expand(Value(f"(tl.arange(0, {ax.block_name}) == {edge})", (ax,), "bool"), axes)
        return f"tl.sum(tl.where({at}, {code}, {'0' if kind == 'int' else '0.0'}), {list(dims(axes)).index(ax)})"

    def chunk_carry(self, fold: Reduce, carry: dict[str, Value], FA, ids: dict[str, str], reverse: bool) -> None:
        """A scan across chunks: the state this program's chunk starts from, the totals of
        the chunks before it (after it, for a suffix) that the totals kernel stored,
        combined in order (ScanTotalsEmitter: it registers the buffers, and stores them)."""
        layout = self.ctx.scan_totals[self.spec.name, fold]
        fields = tuple(carry)
        names = {f: self.local(f"total_{ident(f)}") for f in fields}
        by_name = {a.name: a for a in FA}
        lines = []
        for f in fields:
            buf, indices, _ = layout[f]
            address, mask = self.state_address(buf, [by_name[i] for i in indices], "c")
            lines.append(f"{names[f]} = tl.load({address}" + (f", mask={mask}, other={ids[f]})" if mask else ")"))
        combine = self.ctx.combine_fn(fold.summary, fields)
        lines.append(f"{', '.join(carry[f].code for f in fields)} = "
                     f"{combine}({', '.join(carry[f].code for f in fields)}, {', '.join(names.values())})")
        chunks = "range(chunk_id + 1, n_chunks)" if reverse else "range(0, chunk_id)"
        self.scan_init += [f"# the totals of the chunks {'after' if reverse else 'before'} this one, in order",
                           f"for c in {chunks}:", *indent(lines)]

    def store_state(self, buf: str, v: Value, axes: list[Axis], row: str) -> str:
        """The line that stores a state field `v` (over `axes`) in row `row` of the buffer
        `buf`, [n_split, the axes' indices], which it declares: a split's partial state, a
        scan's chunk total."""
        names = tuple(a.name for a in axes)
        dtype = torch.int64 if v.kind == "int" else torch.float64 if self.ctx.cdt == "tl.float64" else torch.float32
        self.ctx.tensors[buf] = TensorInfo("tensor", 1 + len(names), dtype)
        self.buffers.append((buf, ["n_split"] + [f'n["{n}"]' for n in names], str(dtype)))
        address, mask = self.state_address(buf, axes, f"{row}.to(tl.int64)")
        return f"tl.store({address}, {self.full_shape(v, sort_axes(axes))}" + (f", mask={mask})" if mask else ")")

    def state_address(self, buf: str, axes: list[Axis], row: str) -> tuple[str, str | None]:
        """(the addresses of row `row` of a state buffer [n_split, the axes' indices] over the
        tile of `axes`, the tile's mask)."""
        ptr, strides = self.tensor_params(buf, 1 + len(axes))
        target = sort_axes(axes)
        address = f"{ptr} + {row} * {strides[0]}"
        if axes:
            address += " + " + self.offsets(axes, strides[1:], target)
        return address, self.mask_code(target, target)

    def fold_tiles(self, fold: Reduce, prefix: str, body: Scope, RA, looped: bool, init: list,
                   finish: list) -> dict[str, Value]:
        """Emit one tile's update of the fold's state into `body` (its initial state
        into `init`, what completes it after the loops into `finish`): the first
        lowering of FOLD_LOWERINGS whose algebraic precondition the summary meets."""
        return getattr(self, lowering(fold.summary))(fold, prefix, body, RA, looped, init, finish)

    def product_fold(self, fold, prefix, body, RA, looped, init, finish) -> dict[str, Value]:
        """A product of independent parts: each part a row above the generic one lowers
        on its own (its fields' names kept), the others together by tl.reduce."""
        state: dict[str, Value] = {}
        rest: list[str] = []
        for part in fold_parts(fold):
            method = lowering(part.summary)
            if method == "generic_fold":
                rest += part.summary.field_names
                continue
            row = next(text for text, _, m in FOLD_LOWERINGS if m == method)
            body.lines.append(f"# {', '.join(part.summary.field_names)}: {row}")
            state.update(getattr(self, method)(part, prefix, body, RA, looped, init, finish))
        if rest:
            others = restrict_fields(fold, [f for f in fold.summary.field_names if f in rest])
            state.update(self.generic_fold(others, prefix, body, RA, looped, init, finish))
        return state

    def interior_loop(self, how: FoldLoops, loops, env, env0, prefix, RA, T, tested: bool = True):
        """For a single loop bounded by index predicates (m <= i: causal; i - m < W: a
        window's far edge), the tiles between the boundaries satisfy them everywhere:
        emit their update without them (and without the tile test of a predicate on
        data unless `tested`: where a live span bounds the loop, the interior runs
        only when every tile of the span is live).  Returns (the first interior
        tile's start or None, the first upper boundary tile's start or None, the
        interior body), or None."""
        bounds = how.interior
        if not bounds:
            return None
        ax = loops[0]
        # a tile [start, start + B) holds an upper relation everywhere iff start + B <= the
        # first index past the smallest right-hand side over the program's tile, and a
        # lower one iff start >= the first index where it holds for the largest
        ends = [self.tile_start(self.side_limit(b, env0, T, holds_everywhere=True), ax, b) for b in bounds if b.upper]
        starts = [self.tile_end(self.side_limit(b, env0, T, holds_everywhere=True), ax)
                  for b in bounds if not b.upper]
        assumed = how.fold
        for b in bounds:
            assumed = assume_relation(assumed, b)
        inner = self.tile_body(assumed, how, loops, env, prefix, RA, T, tested)
        return nested("tl.maximum", starts), nested("tl.minimum", ends), inner

    def tile_body(self, fold: Reduce, how: FoldLoops, loops, env, prefix: str, RA, T: Scope, tested: bool) -> Scope:
        """A further copy of one tile's update of `fold` (the loop's first copy holds
        its initial and final lines), `tested`: under its tile test (skipping_dead_tiles)."""
        ax = loops[0]
        body = Scope(T, T.level + 1, env, "body")
        body.lines.append(f"{ax.offs} = start_{ax.var} + tl.arange(0, {ax.block_name})")
        body.lines.append(f"{ax.mask} = {ax.offs} < {self.extent_param(ax.name)}")
        update = lambda: self.fold_tiles(fold, prefix, body, RA, True, [], [])   # noqa: E731
        if tested:
            self.skipping_dead_tiles(how, body, update)
        else:
            update()
        return body

    def skipping_dead_tiles(self, how: FoldLoops, body: Scope, update):
        """`update()` writes one tile's update of the fold into `body`; where a predicate
        on data masks the fold (`how.skips`), under a test that some element of the tile
        passes it: a tile where it fails everywhere would leave the state as it was."""
        tests = [c for _, cs in how.skips for c in cs]
        if not tests:
            return update()
        conditions, elementwise = [], []
        for c in tests:
            ranged = self.range_test(c, body)
            if ranged is None:
                elementwise.append(c)
            else:
                conditions.append(ranged)
        if elementwise:
            live = self.value(elementwise[0] if len(elementwise) == 1 else Call("and", tuple(elementwise[:2])), body)
            for c in elementwise[2:]:
                live = self.call("and", [live, self.value(c, body)], None, body)
            conditions.append(f"tl.max({live.code}.to(tl.int32)) != 0")
        condition = conditions[0] if len(conditions) == 1 else " & ".join(f"({c})" for c in conditions)
        start = len(body.lines)
        state = update()
        how = [] if len(elementwise) == len(tests) else ["# (comparisons by the ranges of their sides over the tile)"]
        body.lines[start:] = [f"# skip the tile where {' and '.join(format_expr(c) for c in tests)} fails "
                              f"everywhere: its elements contribute nothing",
                              *how,
                              f"if {condition}:",
                              *indent(body.lines[start:], 1)]
        return state

    def range_test(self, c, body: Scope) -> str | None:
        """Whether comparison `c` may hold somewhere in the tile, from the least and
        greatest value of each side over the tile (DEAD_WHEN): two reductions of the
        sides instead of the comparison over the whole tile and its reduction.  None
        for a test that is no comparison."""
        if not (isinstance(c, Call) and c.op in DEAD_WHEN):
            return None
        # (the checker takes no comparison of truth values, so both sides are numbers)
        sides = [self.value(x, body) for x in c.args]
        return f"({self.dead_when(c.op, sides, lambda v, fn: self.extreme(v, fn, body))}) == 0"

    @staticmethod
    def dead_when(op: str, sides: list[Value], extreme) -> str:
        """DEAD_WHEN's row for comparison `op` of `sides`, each side's least and greatest
        value taken by `extreme(side, "tl.min" | "tl.max")`."""
        ends = {f"{end}_{name}": extreme(v, fn) for name, v in zip("ab", sides)
                for end, fn in (("lo", "tl.min"), ("hi", "tl.max"))}
        return DEAD_WHEN[op].format(**ends)

    def live_span(self, tests: list[Expr], ax: Axis, env0: dict[str, Axis], lo: str, hi: str,
                  T: Scope) -> tuple[str, str, str]:
        """Narrow loop `ax`'s range [lo, hi) to its live span: from the first to the
        last tile where every comparison on data masking the fold (FoldLoops.span) may
        hold, by the ranges of its sides over each tile (DEAD_WHEN), found by a scan
        of those sides many tiles a step before the loop.  Tiles outside the span
        would each be loaded, tested and skipped one after another (a document mask
        visits every key tile below the diagonal); tiles inside it are still tested
        one by one where the span has holes, so that it stays exact.  `tests`: the
        comparisons (FoldLoops.span).  Returns (first, last, whether every tile between
        them is live: then they need no test, and a loop without a branch in its
        body is software-pipelined, its loads issued ahead of the tiles that use
        them; document mask on the H100: 0.348 -> 0.248 ms)."""
        tiles = max(1, SCAN_ELEMENTS // ax.block)
        scan = Axis(next(self.axis_ids), ax.name, self.axis_var(f"scan_{ax.name}"), T.level + 1, "scan",
                    ax.block * tiles, block_expr=f"{tiles} * {ax.block_name}")
        body = Scope(T, scan.level, {**env0, ax.name: scan}, "body")
        body.lines += [f"{scan.offs} = start_{scan.var} + tl.arange(0, {scan.block_name})",
                       f"{scan.mask} = {scan.offs} < {hi}"]
        def per_tile(v: Value, fn: str) -> str:
            """`fn` of `v` over each tile of a scan step, or over the program's tile."""
            if scan not in v.axes:
                return self.extreme(v, fn, body)
            # elements past the range take the end's identity: they widen no range
            fill = ('float("inf")' if v.kind == "float" else "2147483647") if fn == "tl.min" else \
                   ('-float("inf")' if v.kind == "float" else "-2147483647")
            each = self.local(f"{'least' if fn == 'tl.min' else 'most'}_{ident(v.tensor or 'side')}")
            body.lines.append(f"{each} = {fn}(tl.reshape(tl.where({scan.mask}, {v.code}, {fill}), "
                              f"[{tiles}, {ax.block_name}]), 1)")
            return each
        # comparisons of numbers: the checker takes no truth values there
        dead = [self.dead_when(c.op, [self.value(x, body) for x in c.args], per_tile) for c in tests]
        first, last = self.local(f"first_{ax.var}"), self.local(f"last_{ax.var}")
        starts = self.local(f"starts_{ax.var}")
        live = self.local(f"live_{ax.var}")
        count, dense = self.local(f"count_{ax.var}"), self.local(f"dense_{ax.var}")
        body.lines += [f"{starts} = start_{scan.var} + tl.arange(0, {tiles}) * {ax.block_name}",
                       f"{live} = ({' | '.join(f'({d})' for d in dead) if len(dead) > 1 else dead[0]}) == 0",
                       f"{first} = tl.minimum({first}, tl.min(tl.where({live}, {starts}, {hi})))",
                       f"{last} = tl.maximum({last}, tl.max(tl.where({live}, {starts} + {ax.block_name}, "
                       f"{lo})))",
                       f"{count} += tl.sum({live}.to(tl.int32))"]
        T.lines.append(f"# the live span of {ax.name}: from the first to the last tile where "
                       f"{' and '.join(format_expr(c) for c in tests)} may hold, by the ranges of the sides "
                       f"over each tile, {tiles} tiles a step (inside it, tiles are tested one by one only "
                       f"where it has holes)")
        T.lines += [f"{first} = {hi}", f"{last} = {lo}", f"{count} = 0"]
        self.flush_tiles(T, [scan])
        T.lines.append(f"for start_{scan.var} in range({lo}, {hi}, {scan.block_name}):")
        T.lines.extend(indent(body.lines, 1))
        # no live tile, or an empty range: first == last, an empty loop (a step's tiles past
        # `hi` hold only filled ends, dead unless a side is NaN, and end at `hi`)
        T.lines.append(f"{last} = tl.maximum({first}, tl.minimum({last}, {hi}))")
        # every tile between first and last is live: their loop needs no test per tile (emit_fold)
        T.lines.append(f"{dense} = {count} == tl.cdiv({last} - {first}, {ax.block_name})")
        return first, last, dense

    def extreme(self, v: Value, fn: str, scope: Scope) -> str:
        """`fn` (tl.min or tl.max) of `v` over its whole tile, made once where `v` exists
        (a row tile's before the loop)."""
        if not dims(v.axes):
            return v.code
        key = (fn, v.code)
        found = self.lookup(key, scope)
        if found is None:
            place = self.target(v.axes, scope, v.level)
            found = self.local(f"{fn[3:]}_{ident(v.tensor) if v.tensor else 'side'}")
            place.lines.append(f"{found} = {fn}({v.code})")
            place.memo[key] = found
        return found

    def prepared_param(self, arg: Arg) -> str:
        """The parameter of what the launcher prepares for a sorted loop (Arg.prepared)."""
        p = self.local(f"{ident(arg.name)}_{arg.kind}", ("prepared", arg.prepared[0]))
        self.params.setdefault(p, arg)
        return p

    def sorted_range(self, ordered, ax: Axis, env0, bound: list[Axis]) -> tuple[str, str, list[str]]:
        """A sorted loop's range (lo, hi, the lines that compute them): the positions, in the
        order of the values of its row, whose value is one of the program's tile of
        `ordered.by` (minus the offset)."""
        by = env0[ordered.by]
        n_by = self.extent_param(ordered.by)
        first, past = (by.offs, f"{by.offs} + 1") if by.scalar else (
            f"tl.min({by.offs}, 0)", f"tl.minimum(tl.max({by.offs}, 0) + 1, {n_by})")
        starts = self.prepared_param(Arg("starts", ordered.tensor, ordered.offset, ordered.by))
        row = self.sorted_row(ordered, bound, f"({n_by} + 1)")
        lines = [f"# {ordered}: the range of the sorted order holding the tile's {ordered.by}",
                 f"lo_{ax.var} = tl.load({starts} + {row}{first})",
                 f"hi_{ax.var} = tl.load({starts} + {row}{past})"]
        return f"lo_{ax.var}", f"hi_{ax.var}", lines

    def sorted_row(self, ordered, bound: list[Axis], width: str) -> str:
        """The offset of a sorted loop's current row in a row-major tensor of rows `width`
        long, as a term ("" without rows): the rows run one value at a time, outside the
        sorted loop (`start_<row>`)."""
        if not ordered.rows:
            return ""
        axes = {ax.name: ax for ax in bound}
        flat = f"tl.cast(start_{axes[ordered.rows[0]].var}, tl.int64)"
        for r in ordered.rows[1:]:
            flat = f"({flat} * {self.extent_param(r)} + start_{axes[r].var})"
        return f"{flat} * {width} + "

    def predicate_bounds(self, ax: Axis, relations, env0, lo: str, hi: str, T: Scope) -> tuple[str, str]:
        """Tighten a loop's range to the tiles where an index predicate can hold."""
        for b in relations:
            if b.other is not None and b.other not in env0:
                continue
            limit = self.side_limit(b, env0, T, holds_everywhere=False)
            if b.upper:
                T.lines.append(f"# elements with {b} failing contribute the identity: "
                               f"stop after the last tile where it can hold")
                name = f"hi_{ax.var}"
                T.lines.append(f"{name} = tl.minimum({hi}, {limit})")
                hi = name
            else:
                T.lines.append(f"# elements with {b} failing contribute the identity: "
                               f"start at the first tile where it can hold")
                name = f"lo_{ax.var}"
                start = f"({limit})" if ax.scalar else self.tile_start(limit, ax, b)
                T.lines.append(f"{name} = tl.maximum({lo}, {start})")
                lo = name
        return lo, hi

    def side_limit(self, b, env0, T: Scope, holds_everywhere: bool) -> str:
        """Where the loop over `b.index` may stop (an upper bound: the first index
        past those where `b` can hold for some element of the program's tile, or,
        `holds_everywhere`, holds for every one) or start (a lower bound: the first
        index where it can hold).  A float right-hand side (a scalar input) is
        rounded outwards with one index to spare, and NaN, which fails every
        comparison, gives an empty range."""
        largest = b.upper != holds_everywhere          # the right-hand side's extreme that matters
        if b.other is None:
            side = None
        else:
            o = env0[b.other]
            least, most = (o.offs, o.offs) if o.scalar else (f"tl.min({o.offs}, 0)", f"tl.max({o.offs}, 0)")
            side = (most if largest else least) if b.sign > 0 else f"-{least if largest else most}"
        c = constant(b.offset)
        offset = self.value(b.offset, T) if c != 0 else None
        if offset is not None and offset.kind == "float":
            x = offset.code if side is None else self.assign(f"{side} + {offset.code}", (), T, stem="side").code
            if b.scale != 1:
                x = self.assign(f"{x} / {b.scale}", (), T, stem="side").code
            # tl.cast: an extent of 1 reaches the kernel as the constant 1 (Triton specialises it)
            n = f"tl.cast({self.extent_param(b.index)}, tl.float32)"
            empty = "-1.0" if b.upper else n
            clamped = self.assign(f"tl.where({x} != {x}, {empty}, tl.minimum(tl.maximum({x}, -1.0), {n}))",
                                  (), T, stem="side").code
            outward = largest == b.upper        # rounding that widens the range
            if b.upper:
                spare = "+ 2" if outward else "- 1"
                rounded = f"tl.floor({clamped})" if b.op == "le" or not outward else f"(tl.ceil({clamped}) - 1)"
                return f"({rounded}.to(tl.int32) {spare})"
            spare = "- 1" if outward else "+ 1"
            return f"(tl.ceil({clamped}).to(tl.int32) {spare})"
        past = 1 if b.op in ("le", "gt") else 0
        if b.scale != 1:
            # scale * index op x: the first index past those where it holds (le: floor(x / scale) + 1,
            # lt: ceil(x / scale)), or the first where it does (ge: ceil, gt: floor + 1), in floor
            # division, which Triton's // (truncating) gives for x >= 0 only
            x = side if offset is None else offset.code if side is None else f"{side} + {offset.code}"
            x = self.assign(f"tl.cast({x}, tl.int32)" if side is None else x, (), T, stem="side").code
            k = b.scale
            floor = f"tl.where({x} >= 0, {x} // {k}, -((-{x} + {k - 1}) // {k}))"
            ceil = f"tl.where({x} >= 0, ({x} + {k - 1}) // {k}, -(-{x} // {k}))"
            return f"({floor} + 1)" if past else f"({ceil})"
        if c is not None and side is not None:        # a constant offset: one integer
            total = int(c) + past
            return side if total == 0 else f"{side} {'+' if total > 0 else '-'} {abs(total)}"
        x = side if offset is None else offset.code if side is None else f"{side} + {offset.code}"
        return f"{x} + 1" if past else x

    @staticmethod
    def tile_start(limit: str, ax: Axis, b) -> str:
        """The start of the tile of `ax` holding index `limit` (clamped at 0 unless
        `limit` is an index of the program's tile plus a non-negative amount)."""
        if not (b.other is not None and b.sign > 0 and constant(b.offset) == 0 and b.scale == 1):
            limit = f"tl.maximum({limit}, 0)"
        return f"({limit}) // {ax.block_name} * {ax.block_name}"

    @staticmethod
    def tile_end(limit: str, ax: Axis) -> str:
        """The start of the first tile of `ax` at or past index `limit` (at least 0)."""
        return f"(tl.maximum({limit}, 0) + {ax.block_name} - 1) // {ax.block_name} * {ax.block_name}"

    @staticmethod
    def step(ax: Axis) -> str:
        """A loop's stride: its tile, or 1 for an index folded one value at a time."""
        return "1" if ax.scalar else ax.block_name

    def whole_axis(self, t: Tile, held: bool = False) -> Axis:
        """The one tile of an index held whole, made once per kernel: nested folds' own, or
        (`held`) the epilogue's or the grid's (declared with the grid), which nested folds
        that hold the index in a tile of that size share (FoldLoops.shared)."""
        key = (t.index, held)
        if key not in self.whole:
            ax = self.new_axis(t.index, 0, "whole", t.size)
            lines = [f"{ax.offs} = tl.arange(0, {ax.block_name})", f"{ax.mask} = {ax.offs} < {self.extent_param(t.index)}"]
            if self.scan_at is None:
                self.root.lines.extend(lines)
            else:           # before a scan's loop: the same every tile, and the carried state's axis
                self.root.lines[self.scan_at:self.scan_at] = lines
                self.scan_at += len(lines)
            self.whole[key] = ax
        return self.whole[key]

    def reduce_padded(self, v: Value, RA, fn: str, identity: str, body: Scope, stem: str = "t",
                      keep=()) -> Value:
        """`fn` (tl.sum, or a max / min of ops.EXTREMA) of `v` over the RA axes but `keep`, padding at
        `identity`; an int `v` is reduced in 64 bits."""
        U = sort_axes(list(v.axes) + list(RA))
        padded = self.masked(RA, U, self.expand(self.to_kind(v, "int") if v.kind == "int" else v, U), identity)
        if dims(U) != dims(v.axes) or v.const is not None:
            padded = self.broadcast(padded, U, self.state_dtype(v.kind))
        if not set(dims(RA)) - set(keep):
            return self.assign(padded, without_reduced(U, RA, keep), body, v.kind, stem=stem)
        return self.reduce_axes(padded, U, [a for a in RA if a not in keep], fn, body, stem, v.kind)

    def reduce_axes(self, code: str, axes, reduced, fn: str, body: Scope, stem: str = "t",
                    kind: str = "float") -> Value:
        """Reduce `code` (a tile over `axes`) over the `reduced` axes with `fn` (tl.sum, tl.max, ...)."""
        self.tile(axes)
        current = list(dims(axes))
        for ax in sorted(dims(reduced), key=lambda a: -current.index(a)):
            code = f"{fn}({code}, {current.index(ax)})"
            current.remove(ax)
        left = sort_axes(a for a in axes if a not in reduced)
        return self.assign(code, left, body, kind, stem=stem)

    def lanes(self, RA) -> tuple[Axis, ...]:
        """The streamed tile of a fold's loops: a sum, max or min keeps one running value
        per lane of it and reduces the lanes once, after the loops (as a hand-written
        Triton kernel does).  Besides saving a cross-thread reduction per tile, this
        keeps Triton 3.6's thread-locality rewrite away from a loop result that later
        loops read (it asserts the result has one use).  Not a sorted loop's: it runs a
        few tiles (the positions of a value), where lanes would zero and reduce a tile of
        state in every program for one or two updates."""
        return tuple(a for a in dims(RA) if a.kind == "loop" and a.id not in self.sorted_axes)

    def running(self, prefix: str, field_name: str, tile: Value, RA, start: str, update: str, fn: str,
                body: Scope, init: list[str], finish: list[str]) -> Value:
        """The running state of a sum, max or min folded from `tile`: one value per lane
        where the tile keeps the streamed axes (`fn` over the lanes after the loops),
        else the tile's own.  `start` is its initial value ({shape}), `update` how a
        tile joins it ({var}, {tile})."""
        acc = self.state_var(prefix, field_name)
        lanes = [a for a in self.lanes(RA) if a in tile.axes]
        var = self.local(f"{acc}_lanes", ("lanes", prefix, field_name)) if lanes else acc
        held = tile.axes if lanes else sort_axes(a for a in tile.axes if a not in RA)
        init.append(f"{var} = {start.format(shape=self.shape(held))}")
        # a further copy of the update (an interior band's, without the mask that made the tile
        # vary over the row index) joins the state as the first copy made it: broadcast to it
        held = self.held.setdefault(var, held)
        body.lines.append(update.format(var=var, tile=self.expand(tile, held)))
        if lanes:
            current = list(dims(held))
            code = var
            for ax in sorted(lanes, key=lambda a: -current.index(a)):
                code = f"{fn}({code}, {current.index(ax)})"
                current.remove(ax)
            finish.append(f"{acc} = {code}")
        return Value(acc, sort_axes(a for a in held if a not in RA), tile.kind)

    # sum: contraction-aware
    def sum_fold(self, fold, prefix, body, RA, looped, init, finish) -> dict[str, Value]:
        (field_name,) = fold.summary.field_names
        factors = [self.value(f, body) for f in summed_factors(fold.args[0], frozenset(fold.indices))]
        # an integer sum folds exactly: int64 products and state, never a float tl.dot
        exact = all(f.kind == "int" for f in factors)
        if not exact:
            factors = [self.as_float(f) for f in factors]
        dot = None if exact else self.dot_plan(factors, dims(RA))
        if looped and (FA := self.accumulator_axes(dot, RA)) is not None:
            # a matrix product accumulates in tl.dot's accumulator
            acc = self.state_var(prefix, field_name, role="acc")
            init.append(f"{acc} = tl.zeros({self.shape(FA)}, {self.ctx.cdt})")
            if self.ctx.sig.sums_in_order(dot[6]):
                self.compensated_dot(dot, acc, prefix, field_name, body, init)
            else:
                self.emit_dot(*dot, body, into=acc)
            return {field_name: Value(acc, FA)}
        contrib = self.contract(factors, RA, body, keep=self.lanes(RA) if looped else (), exact=exact)
        if not looped:
            return {field_name: contrib}
        # a tl.dot's tile is summed over its lanes already
        return {field_name: self.running(prefix, field_name, contrib, RA,
                                         f"tl.zeros({{shape}}, {self.state_dtype(contrib.kind)})",
                                         "{var} += {tile}", "tl.sum", body, init, finish)}

    def compensated_dot(self, dot, acc: str, prefix: str, field_name: str, body: Scope, init: list[str],
                        rescale: str | None = None) -> None:
        """acc += the tile's tl.dot, with Kahan's compensation: tl.dot sums a tile's
        float32 products in order (an error growing with the tile), so the tiles are
        summed compensated (err: what acc lost to rounding), as accurate as cuBLAS.
        `rescale`: a repair factor that multiplies acc first (and so its error)."""
        err = self.local("err", ("state", prefix, field_name, "err"))
        init.append(f"{err} = tl.zeros_like({acc})")
        if rescale is not None:
            body.lines += [f"{acc} = {acc} * {rescale}", f"{err} = {err} * {rescale}"]
        tile = self.emit_dot(*dot, body)
        body.lines.append(f"# float32 tiles summed with Kahan's compensation: {err} holds what {acc} lost")
        y, total = self.temp("term"), self.temp("acc_new")
        body.lines += [f"{y} = {tile.code} - {err}", f"{total} = {acc} + {y}",
                       f"{err} = ({total} - {acc}) - {y}", f"{acc} = {total}"]

    def contract(self, factors: list[Value], RA, body: Scope, keep=(), exact: bool = False) -> Value:
        """sum over the RA axes of the product of `factors`: tl.dot when it is a
        matrix product of two 2-D tiles at least 16 wide, else broadcast and tl.sum
        over the RA axes but `keep`; `exact`: integer factors, summed in int64."""
        ra_dims = dims(RA)
        dot = None if exact else self.dot_plan(factors, ra_dims)
        if dot is not None:
            v = self.emit_dot(*dot, body)
            # an index folded one value at a time (a scalar axis of RA) is summed by the loop
            return replace(v, axes=sort_axes(a for a in v.axes if a not in RA))
        U = sort_axes([a for f in factors for a in f.axes] + list(RA))
        self.tile(U)
        product = " * ".join(self.expand(f, U) for f in factors) if factors else "1" if exact else "1.0"
        kind = "int" if exact else "float"
        if exact:
            product = self.broadcast(f"({product}).to(tl.int64)", U, "tl.int64") if dims(U) \
                else f"({product}).to(tl.int64)"
        mask = self.mask_code(RA, U)
        padded = any(set(ra_dims) <= f.zero for f in factors) and \
            all(set(ra_dims) <= f.zero or f.raw is not None for f in factors)
        if mask and not padded:
            product = f"tl.where({mask}, {product}, {'0' if exact else '0.0'})"
        if not set(ra_dims) - set(keep):
            return self.assign(product, without_reduced(U, RA, keep), body, kind)
        return self.reduce_axes(product, U, [a for a in RA if a not in keep], "tl.sum", body, kind=kind)

    def dot_plan(self, factors, ra_dims):
        if self.ctx.dot_dtype is None or len(ra_dims) != 1:
            return None
        c = ra_dims[0]
        inner = [f for f in factors if c in f.axes]
        outer = [f for f in factors if c not in f.axes]
        sides: dict[Axis, list[Value]] = {}
        only_c = []
        for f in inner:
            other = [a for a in dims(f.axes) if a is not c]
            if len(other) > 1:
                return None
            if other:
                sides.setdefault(other[0], []).append(f)
            else:
                only_c.append(f)
        if len(sides) != 2:
            return None
        a, b = sorted(sides, key=lambda ax: ax.id)
        if min(a.block, b.block, c.block) < 16:
            return None
        dtype = self.operand_dtype(sides[a] + sides[b])
        if dtype is None:
            return None
        return a, sides[a] + only_c, b, sides[b], c, outer, dtype

    def operand_dtype(self, matrices: list[Value]) -> torch.dtype | None:
        """The dtype of a tl.dot's operands: the promoted storage dtype of its
        matrix factors read from memory, so that bf16 x bf16 stays a bf16 dot
        (float32 accumulation) whatever else joins the arithmetic (float32
        statistics, slopes, scales); computed operands (softmax probabilities,
        this module's float32 buffers) are cast to it, as FlashAttention casts
        P to V's dtype.  A product of computed matrices only takes the module's
        float dtype.  None: no tl.dot
        (float64)."""
        stored = [f.raw_dtype for f in matrices if f.raw is not None and f.user_tensor]
        dtype = stored[0] if stored else self.ctx.dot_dtype
        for other in stored[1:]:
            dtype = torch.promote_types(dtype, other)
        integers = [f.origin[1][0] if f.origin is not None and f.origin[0] == "float" else f for f in matrices]
        if any(f.kind == "int" and not _exact_in(f.bounds, dtype) for f in integers):
            dtype = torch.promote_types(dtype, torch.float32)   # integers past 256 round in bfloat16
        if dtype == torch.float64:
            return None
        if self.ctx.sig.interpret and dtype == torch.bfloat16:
            return torch.float32        # Triton's interpreter multiplies bfloat16 tiles wrongly
        return dtype

    def dot_operand(self, fs: list[Value], rows: Axis, cols: Axis, c: Axis, dtype, body: Scope) -> str:
        """One tl.dot operand laid out [rows, cols], zero outside c's extent, in `dtype`:
        a loaded tile as it is (transposed or converted where it must be), else a
        temporary named after the tensor it reads or numbered."""
        want = TL_DTYPES[dtype]
        target = sort_axes([rows, cols] + [a for f in fs for a in f.axes])
        if len(fs) == 1 and c in fs[0].zero:
            f = fs[0]
            if f.raw is not None and f.raw_dtype == dtype:
                code = f.raw
            elif want == self.ctx.cdt:                  # a float value's code is in cdt already
                code = self.expand(f, target)
            else:
                code = f"{self.expand(f, target)}.to({want})"
        else:
            product = " * ".join(self.expand(f, target) for f in fs)
            code = f"({self.masked([c], target, product, '0.0')}).to({want})"
        if dims(target)[0] is not rows:
            flipped = self.transposed_load(fs[0], body) if len(fs) == 1 and code == fs[0].raw else None
            # a load already laid out for another tl.dot reads as tl.trans(x): here it is x
            untrans = re.fullmatch(r"tl\.trans\(([A-Za-z_]\w*)\)", code)
            code = flipped or (untrans.group(1) if untrans else f"tl.trans({code})")
        if re.fullmatch(r"(tl\.trans\()?[A-Za-z_]\w*(\.to\(tl\.\w+\))?\)?", code):
            return code
        name = self.temp("op")
        body.lines.append(f"{name} = {code}")
        return name

    @staticmethod
    def dot_axes(a, A, b, B, c) -> tuple[Axis, ...]:
        return sort_axes([a, b] + [x for f in A + B for x in f.axes if x is not c])

    def accumulator_axes(self, dot, RA) -> tuple[Axis, ...] | None:
        """The axes of an accumulator that `dot` (a dot_plan) can add to in place, or
        None: no tl.dot, or outer factors that multiply its result."""
        if dot is None or dot[5]:
            return None
        return sort_axes(a for a in self.dot_axes(*dot[:5]) if a not in RA)

    def emit_dot(self, a, A, b, B, c, outer, dtype, body, into: str | None = None) -> Value:
        """tl.dot of the operands; `into`: the accumulator it adds to in place (no outer factors)."""
        left = self.dot_operand(A, a, c, c, dtype, body)
        right = self.dot_operand(B, c, b, c, dtype, body)
        # float32 operands multiply as the specialised kernel says (ConcreteKernel.dot_precision)
        assert dtype != torch.float32 or self.kernel.dot_precision, f"{self.kernel.name}: a float32 tl.dot unspecialised"
        precision = f', input_precision="{self.kernel.dot_precision}"' if dtype == torch.float32 else ""
        axes = self.dot_axes(a, A, b, B, c)
        if into is not None:
            body.lines.append(f"{into} = tl.dot({left}, {right}, {into}{precision})")
            return Value(into, axes)
        # the product of two loaded tensors is named after them (q and k: qk)
        stem = "t"
        if len(A) == 1 and len(B) == 1 and A[0].tensor and B[0].tensor and not outer:
            stem = ident(A[0].tensor.lower() + B[0].tensor.lower())
        name = self.local(stem) if stem != "t" else self.temp()
        body.lines.append(f"{name} = tl.dot({left}, {right}{precision})")
        self.tile(axes)
        v = Value(name, axes, level=body.level)
        for f in outer:
            axes = sort_axes(list(axes) + list(f.axes))
            v = self.assign(f"{self.expand(v, axes)} * {self.expand(f, axes)}", axes, body)
        return v

    # max / min
    def extremum_fold(self, fold, prefix, body, RA, looped, init, finish) -> dict[str, Value]:
        s = fold.summary
        (field_name,) = s.field_names
        x = self.value(fold.args[0], body)
        if x.kind != "int" or x.const is not None:
            x = self.as_float(x)
        helper, fn, op = emission.EXTREMA[extremum(s)]
        self.ctx.helpers.add(helper)          # NaN propagates, as in torch
        identity = self.identity_literal(s, field_name, x.kind)
        tile = self.reduce_padded(x, RA, fn, identity, body, keep=self.lanes(RA) if looped else ())
        if not looped:
            return {field_name: tile}
        join = emission.emit(op, ["{var}", "{tile}"], self.ctx.helpers)
        return {field_name: self.running(prefix, field_name, tile, RA,
                                         f"tl.full({{shape}}, {identity}, {self.state_dtype(x.kind)})",
                                         f"{{var}} = {join}", fn, body, init, finish)}

    # rescaled (FlashAttention-style)
    def rescaled_fold(self, fold, prefix, body, RA, looped, init, finish) -> dict[str, Value]:
        s = fold.summary
        cdt = self.ctx.cdt
        split, unread = self.split_values(fold)
        xs = self.fold_arguments(fold, body, skip=unread)

        def remembered(complete: bool) -> dict[str, Value]:
            # a tl.dot (of an earlier value or structure) may have laid an argument's load out anew
            # (transposed_load): the arguments as the scopes now remember them, and (complete) those
            # a split value left unread
            now = {x: self.as_float(self.value(fold.args[int(x[1:])], body)) for x in xs}
            return {**now, **self.fold_arguments(fold, body, skip=frozenset(now))} if complete else now
        state: dict[str, Value] = {}
        updates: list[str] = []
        for rs in s.rescaled:
            xs = remembered(complete=False)
            ident_r = s.identity[s.field_names.index(rs.leader)].value
            lit = emission.literal(ident_r)
            fn, comb = ("tl.max", "tl.maximum") if rs.leader_monoid == "max" else ("tl.min", "tl.minimum")
            header = len(body.lines)        # written once the fields' variables are named
            body.lines.append("")
            variables = {}
            base2 = rs.base2
            la = self.formula(rs.leader_arg, xs, body)
            # in base 2, a positive factor c of the leader's argument x = c y leaves the tile: the
            # running leader is the max of y, and c times it the max of x (exactly: rounding is
            # monotone); the weights take c into their factor (_base2)
            factor, y = self.positive_factor(la, body) if base2 else (None, la)
            tile = self.reduce_padded(y, RA, fn, lit, body)
            r = self.state_var(prefix, rs.leader)
            FR = tile.axes
            init.append(f"{r} = tl.full({self.shape(FR)}, {lit}, {cdt})")
            r_val = Value(r, FR) if factor is None else Value(f"{factor.code} * {r}", FR)   # the max of x
            with_factor = "" if factor is None else f", {factor.code}"
            r_new = self.assign(f"{comb}({r}, {tile.code})", FR, body, stem="r_new")
            body.lines.append("# a leader still at the identity has no mass yet: use the finite stand-in 0")
            r_use = self.stand_in(r_new, lit, body, "r_use")
            body.lines.append(f"# weight {format_expr(rs.weight)}, repair {format_expr(rs.repair)} "
                              f"(r_new: the moved leader)")
            if not base2:
                alpha = self.renamed(self.formula(rs.repair, {"r": r_val, "r_new": r_use}, body), "alpha", body)
                w = self.renamed(self.formula(rs.weight, {**xs, "r": r_use}, body), "w", body)
            else:
                # exp(x - r) in base 2 at one fma per element: w = exp2(fma(y, a, -r2)) for x = c y, with
                # a = c log2(e) and r2 = r a rounded (r: the max of y).  The product y a is not rounded,
                # so every weight of a row errs by the same factor exp2(r a - r2); _natural divides it
                # out of the final fields.  The leader stays the max of y itself (exact), so c r,
                # c r + log(l) and x - c r - log(l) are as exact as torch's.  r2 errs by up to half an
                # ulp of r a, so a row whose max is large (|c r| >= 2**30 in float32) takes a factor
                # a that keeps r a small (_base2): the floats there lie 64 or more apart, so the
                # weights are 1 at the max and below the dtype's precision elsewhere, in either base.
                self.ctx.helpers.add("base2")
                # The repair is exp2(r2_old - r2): the weights so far erred by exp2(r_old a - r2_old)
                # and from here by exp2(r_new a - r2), so both rounded r2 enter exactly (_repair;
                # 0 where a changed with the leader).
                a = self.assign(f"_base2({r_use.code}{with_factor})", FR, body, stem="a")
                r2 = self.assign(f"_scaled({r_use.code}{with_factor})", FR, body, stem="r2")
                alpha = self.assign(f"_repair({r}, {r_use.code}{with_factor})", FR, body, stem="alpha")
                WU = sort_axes(list(y.axes) + list(FR))
                # the weights are the p of the update unless padding must be masked out of them
                stem = "w" if self.mask_code(RA, sort_axes(list(WU) + list(RA))) else "p"
                w = self.assign(f"tl.exp2(tl.fma({self.expand(y, WU)}, {self.expand(a, WU)}, "
                                f"-{self.expand(r2, WU)}))", WU, body, stem=stem)
                x = la.code if la.code.isidentifier() else "x"
                if factor is None:
                    body.lines.insert(header + 1, f"# base 2: {w.code} = exp2({x} * a - r2), a = log2(e), "
                                                  f"r2 = {r} * a; {r} is the max of {x} itself")
                else:
                    c = factor.code
                    body.lines[header + 1:header + 1] = [
                        f"# base 2, {x} = {c} * {y.code}: {w.code} = exp2({y.code} * a - r2), "
                        f"a = {c} * log2(e), r2 = {r} * a;",
                        f"# {r} is the max of {y.code}, {c} * {r} the max of {x} ({c} > 0)"]
            PU = sort_axes(list(w.axes) + list(RA))
            p_code = self.masked(RA, PU, self.expand(w, PU), "0.0")
            if dims(PU) != dims(w.axes):
                p_code = self.broadcast(p_code, PU)
            if p_code == w.code:
                p = replace(w, zero=frozenset(dims(RA)))     # nothing to mask: the weights are the p
            else:
                p = self.assign(p_code, PU, body, stem="p", zero=frozenset(dims(RA)))
            shifts = self.shifts(rs, r_val, r_use, lit, body)
            shift_at = len(body.lines)          # the shifts read the weight sum before its update
            for fname, v_expr in rs.values:
                xs = remembered(complete=False)
                dot = None
                if fname in split:
                    # the value's own factors beside the weights: a matrix product where the value
                    # as a whole spans both sides of it (a 3-D broadcast product)
                    factors = [p] + [self.as_float(self.value(f, body)) for f in split[fname]]
                    dot = self.dot_plan(factors, dims(RA))
                    if dot is None:
                        xs = remembered(complete=True)
                if dot is None:
                    v = self.as_float(self.formula(v_expr, {**xs, "r": r_use}, body))
                    factors = [p] if v.const == 1.0 else [p, v]
                    dot = self.dot_plan(factors, dims(RA))
                FT = self.accumulator_axes(dot, RA)
                in_place = FT is not None and set(alpha.axes) <= set(FT)
                t = self.state_var(prefix, fname, role="acc" if in_place else None)
                variables[fname] = t
                if in_place:
                    # rescale the accumulator, then tl.dot adds the tile's weighted values to it
                    init.append(f"{t} = tl.zeros({self.shape(FT)}, {cdt})")
                    if self.ctx.sig.sums_in_order(dot[6]):
                        self.compensated_dot(dot, t, prefix, fname, body, init, self.expand(alpha, FT))
                    else:
                        body.lines.append(f"{t} = {t} * {self.expand(alpha, FT)}")
                        self.emit_dot(*dot, body, into=t)
                else:
                    contrib = self.contract(factors, RA, body)
                    FT = sort_axes(list(contrib.axes) + list(alpha.axes))
                    init.append(f"{t} = tl.zeros({self.shape(FT)}, {cdt})")
                    body.lines.append(f"{t} = {self.expand(Value(t, FT), FT)} * {self.expand(alpha, FT)} + "
                                      f"{self.expand(contrib, FT)}")
                if base2:
                    self.ctx.helpers.add("natural")
                    state[fname] = Value(f"_natural({self.expand(Value(t, FT), FT)}, "
                                         f"{self.expand(Value(r, FR), FT)}{with_factor})", FT)
                else:
                    state[fname] = Value(t, FT)
            body.lines[shift_at:shift_at] = [
                line for fname, (s_k, total) in shifts.items()
                for line in (f"# {fname} is held centred on the leader: move it to r_new by s(r, r_new) * {total}",
                             f"{variables[fname]} = {variables[fname]} + {s_k.code} * {variables[total]}")]
            variables[rs.leader] = r
            named = {f: f if v == f else f"{f} (in {v})" for f, v in variables.items()}
            repaired = [named[f] for f, _ in rs.values]
            body.lines[header] = f"# {named[rs.leader]}: running {rs.leader_monoid} (the leader)" + (
                f"; the fields {', '.join(repaired)} are repaired when it moves" if len(repaired) > 1 else
                f"; the field {repaired[0]} is repaired when it moves" if repaired else "")
            updates.append(f"{r} = {r_new.code}")
            state[rs.leader] = r_val
        body.lines.extend(updates)
        rest = tuple(f for f in s.field_names if f not in state)
        if rest:
            # generic_fold reads every argument's kind: those a split value left unread too
            xs = remembered(complete=bool(split))
            state.update(self.generic_fold(fold, prefix, body, RA, True, init, finish, fields=rest, xs=xs))
        return state

    def positive_factor(self, v: Value, scope: Scope) -> tuple[Value | None, Value]:
        """(c, y) where the tile `v` is the product c * y of a positive scalar c (a
        number input the signature holds positive, or a positive literal) and a float
        tile y, or such a product selected against -inf (a mask: c * -inf = -inf, so
        where(p, c y, -inf) = c where(p, y, -inf), y's select emitted into `scope`);
        (None, v) otherwise."""
        if v.origin is not None and v.origin[0] == "where":
            test, chosen, other = v.origin[1]
            if other.const == -math.inf:
                c, y = self.positive_factor(chosen, scope)
                if c is not None:
                    return c, self.call("where", [test, y, other], None, scope)
        if v.origin is None or v.origin[0] != "mul" or not dims(v.axes):
            return None, v
        for c, y in (v.origin[1], v.origin[1][::-1]):
            literal = (isinstance(c.const, (int, float)) and not isinstance(c.const, bool)
                       and positive_number(float(c.const)))
            if not dims(c.axes) and y.kind == "float" and (c.positive or literal):
                return c, y
        return None, v

    def stand_in(self, r: Value, lit: str, body: Scope, stem: str) -> Value:
        """The leader `r` as a reference point: the finite 0 while it is the identity `lit`."""
        return self.assign(f"tl.where({r.code} == {lit}, 0.0, {r.code})", r.axes, body, stem=stem)

    def shifts(self, rs, r: Value, r_new: Value, lit: str, body: Scope) -> dict[str, tuple[Value, str]]:
        """{field: (s(r, r_new), weight-sum field)} for the values that read the leader
        (Rescaled.shifts); the old leader at the identity takes the stand-in 0 too (its
        weight sum is 0, and -inf * 0 would be NaN)."""
        if not rs.shifts:
            return {}
        r_old = self.stand_in(r, lit, body, "r_old")
        return {f: (self.formula(s_k, {"r": r_old, "r_new": r_new}, body), total) for f, s_k, total in rs.shifts}

    def fold_arguments(self, fold: Reduce, body: Scope, exact: bool = False,
                       skip: frozenset = frozenset()) -> dict[str, Value]:
        """The fold's arguments on the tile, named as the derivation names them (x0, x1, ...);
        `exact`: integer arguments stay integers (for the fields that fold them exactly);
        `skip`: names not computed here (split_values')."""
        xs = {f"x{k}": self.renamed(self.value(a, body), f"x{k}", body) for k, a in enumerate(fold.args)
              if f"x{k}" not in skip}
        return {x: v if exact and v.kind == "int" else self.as_float(v) for x, v in xs.items()}

    def split_values(self, fold: Reduce) -> tuple[dict[str, list[Expr]], frozenset]:
        """({field: its value's factors over the fold's arguments} for the rescaled fields
        whose value spans two sides of a matrix product with the weights while none of its
        factors does (`K[m,k] * dP[i,m]` beside weights over (i, m): one tl.dot of P * dP
        and K; `V[m,j] / D[i]`: a tl.dot of P and V times 1 / D, where the whole value is a
        3-D tile), the arguments only those values read)."""
        s = fold.summary
        reduced = frozenset(fold.indices)
        args = {f"x{k}": a for k, a in enumerate(fold.args)}
        weights = frozenset(i for rs in s.rescaled for n in walk(rs.leader_arg)
                            if isinstance(n, Var) and n.name in args for i in free(args[n.name]))
        out: dict[str, Expr] = {}
        for rs in s.rescaled:
            for fname, v in rs.values:
                names = {n.name for n in walk(v) if isinstance(n, Var)}
                if not names or not names <= set(args):
                    continue
                value = transform(v, lambda n: args[n.name] if isinstance(n, Var) else n)
                parts = summed_factors(value, reduced, beside=(weights,))
                inner = [weights] + [free(f) for f in parts if free(f) & reduced]
                shared, _ = contraction_sides(inner, reduced)
                spans = len(free(value) - shared - reduced)
                if spans > 1 and all(len(f - shared - reduced) <= 1 for f in inner):
                    out[fname] = parts
        kept = [e for rs in s.rescaled
                for e in (rs.leader_arg, rs.weight, *(v for f, v in rs.values if f not in out))]
        valued = {f for rs in s.rescaled for f, _ in rs.values} | {rs.leader for rs in s.rescaled}
        kept += [lift for f, lift in zip(s.field_names, s.lift) if f not in valued]
        read = {n.name for e in kept for n in walk(e) if isinstance(n, Var)}
        return out, frozenset(args) - read

    def field_kinds(self, s, xs: dict[str, Value]) -> dict[str, str]:
        """Each field's kind on these arguments (Summary.field_types): int where it folds
        integers exactly."""
        return s.field_types(tuple(xs[f"x{k}"].kind for k in range(s.arity)))

    # any summary
    def generic_fold(self, fold, prefix, body, RA, looped, init, finish, fields=None, xs=None) -> dict[str, Value]:
        s = fold.summary
        fields = s.field_names if fields is None else fields
        if xs is None:
            xs = self.fold_arguments(fold, body, exact=True)
        kinds = self.field_kinds(s, xs)
        index = {f: s.field_names.index(f) for f in fields}
        ids = {f: self.identity_literal(s, f, kinds[f]) for f in fields}
        summed = {}
        for block in s.blocks:
            if any(f in fields for f, _ in block.fields):
                summed.update(self.tile_sums(block, fields, xs, RA, body))
        folded = [f for f in fields if f not in summed]
        lifted = {f: self.formula(s.lift[index[f]], xs, body) for f in folded}
        lifted = {f: self.to_kind(v, kinds[f]) for f, v in lifted.items()}
        U = sort_axes([a for v in (*lifted.values(), *summed.values()) for a in v.axes] + list(RA))
        self.tile(U)
        tiles = {}
        mask = self.mask_code(RA, U)
        for f in folded:
            code = self.expand(lifted[f], U)
            if mask:
                code = f"tl.where({mask}, {code}, {ids[f]})"
            if dims(U):
                code = self.broadcast(code, U, self.state_dtype(kinds[f]))
            tiles[f] = self.assign(code, U, body, stem=f"lift_{ident(f)}")
        current = list(dims(U))
        names = {f: tiles[f].code for f in folded}
        combine = self.ctx.combine_fn(s, tuple(folded)) if folded else None
        for ax in sorted(dims(RA), key=lambda a: -current.index(a)) if folded else ():
            pos = current.index(ax)
            args = ", ".join(names[f] for f in folded)
            outs = [self.temp(f"tile_{ident(f)}") for f in folded]
            tuple_in = f"({args},)" if len(folded) > 1 else args
            if s.commutative:
                body.lines.append(f"{', '.join(outs)} = tl.reduce({tuple_in}, {pos}, {combine})")
            else:
                # tl.reduce may reorder operands; a scan keeps order and its last element is the fold
                scans = [self.temp(f"scan_{ident(f)}") for f in folded]
                body.lines.append(f"{', '.join(scans)} = tl.associative_scan({tuple_in}, {pos}, {combine})")
                for f, o, sc in zip(folded, outs, scans):
                    body.lines.append(f"{o} = {self.at_edge(sc, ax, current, kinds[f])}")
            names = dict(zip(folded, outs))
            current.remove(ax)
        FA = sort_axes(a for a in U if a not in RA)
        tile_vals = {f: summed[f] if f in summed else Value(names[f], FA, kinds[f]) for f in fields}
        if not looped:
            return tile_vals
        state = {}
        for f in fields:
            var = self.state_var(prefix, f)
            init.append(f"{var} = tl.full({self.shape(FA)}, {ids[f]}, {self.state_dtype(kinds[f])})")
            state[f] = Value(var, FA, kinds[f])
        env = {f"a.{f}": state[f] for f in fields} | {f"b.{f}": tile_vals[f] for f in fields}
        env.update({f"a.{f}": Value(emission.literal(s.identity[i].value), (), const=s.identity[i].value)
                    for i, f in enumerate(s.field_names) if f not in fields})
        env.update({f"b.{f}": Value(emission.literal(s.identity[i].value), (), const=s.identity[i].value)
                    for i, f in enumerate(s.field_names) if f not in fields})
        body.lines.append(f"# merge the tile into the running state with the combine of '{s.name}'")
        cse: dict = {}
        combine = selecting_combine(s)
        new = {f: self.formula(combine[index[f]], env, body, cse) for f in fields}
        new = self.guard_identity(s, fields, state, tile_vals, new, body)
        for f in fields:
            # to_kind: int32 index arithmetic joins the int64 state
            body.lines.append(f"{state[f].code} = {self.full_shape(self.to_kind(new[f], kinds[f]), FA)}")
        return state

    def tile_sums(self, block, fields, xs, RA, body: Scope) -> dict[str, Value]:
        """The fields of `block` among `fields` for this tile: each sum a tl.sum over
        the RA axes (padding counts 0), then the fields' formulas on the sums."""
        body.lines.append("# the tile's state from sums over it: " + ", ".join(f for f, _ in block.fields))
        env, cse = dict(xs), {}
        for name, summand in block.needed(fields):
            v = self.as_float(self.formula(summand, env, body, cse))
            env[name] = self.reduce_padded(v, RA, "tl.sum", "0.0", body, stem=f"sum_{ident(name)}")
        return {f: self.formula(e, env, body, cse) for f, e in block.fields if f in fields}

    def guard_identity(self, s, fields, a: dict, b: dict, new: dict, body: Scope) -> dict:
        """combine(a, b) with the identity passed through exactly, for summaries whose
        formulas are not exact there (see algebra.properties.exact_identity)."""
        if exact_identity(s, tuple(fields)):
            return new
        ids = {f: self.identity_literal(s, f, a[f].kind) for f in fields}
        axes = sort_axes([x for f in fields for v in (a[f], b[f], new[f]) for x in v.axes])
        a_empty = self.assign(" & ".join(f"({self.expand(a[f], axes)} == {ids[f]})" for f in fields), axes, body,
                              "bool", stem="a_empty")
        b_empty = self.assign(" & ".join(f"({self.expand(b[f], axes)} == {ids[f]})" for f in fields), axes, body,
                              "bool", stem="b_empty")
        return {f: self.assign(f"tl.where({a_empty.code}, {self.expand(b[f], axes)}, tl.where({b_empty.code}, "
                               f"{self.expand(a[f], axes)}, {self.expand(new[f], axes)}))", axes, body)
                for f in fields}

    def to_kind(self, v: Value, kind: str) -> Value:
        """`v` as a field of `kind` holds it: int64 for an integral field, else float."""
        if kind != "int":
            return self.as_float(v)
        if v.const is not None:
            return v
        code = v.code if re.fullmatch(r"[A-Za-z_][\w.]*", v.code) else f"({v.code})"
        return replace(v, code=f"{code}.to(tl.int64)", kind="int", raw=None)

    def full_shape(self, v: Value, axes) -> str:
        if v.const is not None:
            return f"tl.full({self.shape(axes)}, {v.code}, {self.state_dtype(v.kind)})"
        if dims(v.axes) != dims(axes):
            return f"tl.broadcast_to({self.expand(v, axes)}, {self.shape(axes)})"
        return v.code

    # ------------------------------------------------------------ split: merge of partial states
    def grid_axes(self) -> None:
        """Declare the grid axes and each program's coordinates on them (the launcher
        counts the programs from grid_blocks: module.program_count)."""
        spec = self.spec
        lacking = {g for g in spec.grid if any(g not in st.indices for st in spec.statements)}
        axes = {}
        for t in self.kernel.grid:
            axes[t.index] = self.new_axis(t.index, 0, "grid", t.size)
            if t.how == WHOLE:
                self.whole[t.index, True] = axes[t.index]
            if t.tuned:
                self.tunable[axes[t.index].block_name] = ("grid", t.index)
        self.optional = frozenset(g for g in lacking if not axes[g].scalar)
        self.root.env.update(axes)
        lines = self.root.lines
        self.split_prologue(lines)
        if spec.grid:
            lines.append("pid = tl.program_id(0)")
        order = list(reversed(spec.grid))
        # programs whose loops run longest (the last rows under m <= i) start first, so that
        # short ones fill the tail; the index keeps its place in the order, so programs that
        # run together still share their key and value tiles in L2 (moving it outermost
        # cost 8-14% at S = 1024 on the H100)
        longest_first = self.kernel.longest_first
        grouped = self.grouped_order(order, axes) if self.kernel.grouped else None
        scan = self.kernel.scan if self.kernel.scan in spec.grid else ""
        if scan:
            order.remove(scan)
        for p, g in enumerate(order):
            ax = axes[g]
            n = self.extent_param(g)
            self.grid_blocks.append((g, None if ax.scalar else ax.block_name))
            if g in self.whole_grid:
                # one program along it (the launcher's count of its tiles is 1): no coordinate
                lines.append(f"{ax.offs} = tl.arange(0, {ax.block_name})")
                lines.append(f"{ax.mask} = {ax.offs} < {n}")
                continue
            count = self.tile_count(ax)
            coord = f"pid_{ax.var}"
            if grouped and p < 2:
                lines += grouped[p]
            elif p == len(order) - 1:
                lines.append(f"{coord} = {count} - 1 - pid" if g == longest_first else f"{coord} = pid")
            else:
                lines.append(f"{coord} = {count} - 1 - pid % {count}" if g == longest_first
                             else f"{coord} = pid % {count}")
                lines.append(f"pid = pid // {count}")
            if ax.scalar:
                lines.append(f"{ax.offs} = {coord}")
            else:
                # a tile start past 2**31 needs 64-bit arithmetic (program ids are 32-bit)
                wide = ".to(tl.int64)" if self.ctx.extent(g) + ax.block >= 2**31 else ""
                lines.append(f"{ax.offs} = {coord}{wide} * {ax.block_name} + tl.arange(0, {ax.block_name})")
                lines.append(f"{ax.mask} = {ax.offs} < {n}")
        if scan:
            # one program along it (or one a chunk): the rest of the kernel runs in a loop over its
            # tiles (build places the header here), the scans' state carried from tile to tile
            ax = axes[scan]
            if self.kernel.scan_chunks > 1:
                n = self.extent_param(scan)
                lines += [f"# this program's chunk of {scan}: a whole number of tiles",
                          f"chunk_{ax.var} = tl.cdiv(tl.cdiv({n}, {ax.block_name}), n_chunks) * {ax.block_name}",
                          f"lo_{ax.var} = chunk_id * chunk_{ax.var}",
                          f"hi_{ax.var} = tl.minimum(lo_{ax.var} + chunk_{ax.var}, {n})"]
            self.scan_at = len(lines)
            lines.append(f"{ax.offs} = start_{ax.var} + tl.arange(0, {ax.block_name})")
            lines.append(f"{ax.mask} = {ax.offs} < {self.extent_param(scan)}")

    def scan_loop(self, lines: list[str]) -> list[str]:
        """The root's lines with the scan's loop around those after its header's place:
        over the tiles of the scanned index, in order (from the last, for a suffix)."""
        if self.scan_at is None:
            return lines
        ax = self.root.env[self.kernel.scan]
        lo, hi = ("0", self.extent_param(ax.name)) if self.kernel.scan_chunks == 1 else (f"lo_{ax.var}", f"hi_{ax.var}")
        header, first = self.tiles_loop(ax, lo, hi, self.kernel.scan_reverse)
        where = "last tile first" if self.kernel.scan_reverse else "in order"
        return [*lines[:self.scan_at], *self.scan_init,
                f"# the tiles of {ax.name}, {where}: each carries the scans' state to the next",
                header, *indent(first + lines[self.scan_at:]), *self.scan_after]

    @staticmethod
    def tiles_loop(ax: Axis, lo: str, hi: str, reverse: bool) -> tuple[str, list[str]]:
        """(the header of a loop over the tiles of `ax` from `lo` to `hi`, the lines that
        begin its body): in order, or (`reverse`) from the last tile down."""
        if not reverse:
            return f"for start_{ax.var} in range({lo}, {hi}, {ax.block_name}):", []
        count = f"tl.cdiv({hi}{f' - {lo}' if lo != '0' else ''}, {ax.block_name})"
        return (f"for step_{ax.var} in range(0, {count}):",
                [f"start_{ax.var} = {f'{lo} + ' if lo != '0' else ''}({count} - 1 - step_{ax.var}) * {ax.block_name}"])

    GROUP = 8    # output tile rows that consecutive programs share (L2 reuse of their operands)

    def tile_count(self, ax: Axis) -> str:
        """The number of programs along a grid axis (an optional tiled index: at least one)."""
        n = self.extent_param(ax.name)
        if ax.scalar:
            return n
        count = f"tl.cdiv({n}, {ax.block_name})"
        return f"tl.maximum({count}, 1)" if ax.name in self.optional else count

    def grouped_order(self, order, axes) -> list[list[str]] | None:
        """Programs of a kernel whose grid is exactly two tuned matrix-product tiles
        (rows i, columns j) run in groups of GROUP tile rows, column by column, so
        that programs running together share operand tiles in L2 (the specialised
        kernel's `grouped`).  Returns the coordinate lines for the two axes (in `order`)."""
        cols, rows = axes[order[0]], axes[order[1]]
        n_rows, n_cols = self.tile_count(rows), self.tile_count(cols)
        r, c = f"pid_{rows.var}", f"pid_{cols.var}"
        return [[f"# grouped order: {self.GROUP} tile rows at a time, for L2 reuse",
                 f"in_group = {self.GROUP} * {n_cols}",
                 f"first_row = (pid // in_group) * {self.GROUP}",
                 f"group_rows = tl.minimum({n_rows} - first_row, {self.GROUP})",
                 f"{r} = first_row + (pid % in_group) % group_rows",
                 f"{c} = (pid % in_group) // group_rows"],
                []]

    def tiling_note(self) -> str:
        """The grid in words: which indices are one program each and which are tiled."""
        parts = []
        for g in self.spec.grid:
            ax = self.root.env[g]
            parts.append(g if ax.scalar else f"{g}/{ax.block}" + " in order" * (g == self.kernel.scan))
        return f"grid ({', '.join(parts)})" if parts else "one program"

    def split_prologue(self, lines: list[str]) -> None:
        """Lines before the program coordinates (a split kernel's split index; a scan's chunk)."""
        if self.kernel.scan_chunks > 1:
            lines.append("chunk_id = tl.program_id(1)")
            self.params.setdefault("n_chunks", SPLIT)

    def result(self, st, scope: Scope) -> Value:
        """A statement's value, named after it."""
        return self.renamed(self.value(st.expr, scope), st.name, scope)

    def store_results(self, root: Scope) -> list[str]:
        """Store the statements (in the program, then in the epilogue loop); their names."""
        spec = self.spec
        writes: list[str] = []
        full = set(spec.grid) | set(spec.epilogue)
        for st in spec.statements:
            if set(st.indices) <= set(spec.grid):
                self.store(st.name, st.indices, self.result(st, root), root)
                writes.append(st.name)
        if spec.epilogue:
            epi = Scope(root, 1, dict(root.env), "epilogue")
            loops = []
            for t in self.kernel.epilogue:
                if t.how == WHOLE:      # one tile, no loop: an axis of the kernel's, as the grid's are
                    epi.env[t.index] = self.whole_axis(t, held=True)
                    continue
                ax = self.new_axis(t.index, 1, "epilogue", t.size)
                epi.env[t.index] = ax
                loops.append(ax)
                epi.lines.append(f"{ax.offs} = start_{ax.var} + tl.arange(0, {ax.block_name})")
                epi.lines.append(f"{ax.mask} = {ax.offs} < {self.extent_param(t.index)}")
            for st in spec.statements:
                if set(st.indices) == full and set(st.indices) != set(spec.grid):
                    self.store(st.name, st.indices, self.result(st, epi), epi)
                    writes.append(st.name)
            self.flush_tiles(root, loops)
            if self.kernel.scan_epilogue:
                # the scans' carried state starts before the loop, which runs their index in order
                root.lines += self.scan_init
            if loops:
                root.lines.append(f"# epilogue: loop over tiles of {', '.join(ax.name for ax in loops)}")
            for depth, ax in enumerate(loops):
                reverse = self.kernel.scan_epilogue and self.kernel.scan_reverse and ax.name == self.kernel.scan
                header, first = self.tiles_loop(ax, "0", self.extent_param(ax.name), reverse)
                root.lines += indent([header, *indent(first)], depth)
            root.lines.extend(indent(epi.lines, len(loops)))
        return writes

    def build(self) -> KernelCode:
        spec = self.spec
        self.grid_axes()
        root = self.root
        writes = self.store_results(root)
        functions, zeroed = self.finish(root)
        assert not self.pending, "tiles of addresses made for a loop that was not written"
        if self.kernel.candidates and self.launched:
            # the autotuner's key: each extent's shape class, so that every size of a class
            # shares one tuned choice (the kernel itself reads the extents)
            for p, arg in list(self.params.items()):
                if arg.kind == "extent":
                    self.params[self.local(f"class_{arg.name}", ("class", arg.name))] = Arg("size_class", arg.name)
        params = list(self.params)
        signature = ", ".join(params + [f"{c}: tl.constexpr" for c in self.constexprs])
        body = with_eviction_hints(drop_unread(inline_single_uses(one_per_tile(
            with_role_names(self.scan_loop(root.lines), self.role_names), set(self.tile_of.values())))), self.loads)
        source = "\n".join(["@triton.jit", f"def {self.name}({signature}):", *indent(body)]) + "\n"
        return KernelCode(self.name, source, list(self.params.items()), dict(self.constexprs),
                          self.chunked, f"{self.why()} [{self.tiling_note()}]", tuple(writes), self.buffers,
                          dict(self.tunable), list(self.grid_blocks), frozenset(self.tiles), self.optional,
                          functions, zeroed, tuple(dict.fromkeys(self.accumulates)))

    def why(self) -> str:
        """What the kernel does, in a line: the schedule's words, or a scan's."""
        if not self.kernel.scan:
            return self.spec.why
        rows = [g for g in self.spec.grid if g != self.kernel.scan]
        folds = ", ".join(dict.fromkeys(f"{f.fold.summary.name}[{f.prefix.index}]" for f in self.kernel.folds
                                        if f.prefix is not None))
        return (f"one program per ({', '.join(rows)}) tile" if rows else "one program") + \
            f", running {self.kernel.scan} in order: the prefixes of {folds}, scanned tile by tile"

    def finish(self, root: Scope) -> tuple[tuple, frozenset]:
        """Lines after the results are stored: none for a whole kernel.  Returns (the jit
        functions the kernel calls, the buffers the launcher zeroes when it makes them)."""
        return (), frozenset()


def tensors_read(spec: KernelSchedule) -> set[str]:
    """The tensors (inputs, statements of earlier kernels) a kernel reads."""
    return {n.tensor for st in spec.statements for n in walk(st.expr) if isinstance(n, Access)}


def program_names(spec: KernelSchedule, ctx: ModuleContext) -> set[str]:
    """The names of the program a kernel's comments may quote: tensors, statements, indices."""
    names = {name for name, _ in ctx.sig.extents} | set(ctx.fresh_names) | ctx.input_names | tensors_read(spec)
    for st in spec.statements:
        names |= {st.name, *st.indices}
        names |= {i for n in walk(st.expr) if isinstance(n, Reduce) for i in n.indices}
    return names


def with_eviction_hints(lines: list[str], loads: dict[str, Load]) -> list[str]:
    """The kernel's lines with each load's eviction hint (`loads`: by the load's
    variable).  A tensor whose elements only this program reads, through one
    access, streams past the cache: its last load in the kernel is marked
    evict_first (bf16 logsumexp and RMS over rows of 8192 on the H100: 80% -> 88-89%
    of copy bandwidth, scripts/row_probe.py).
    An earlier load of it (softmax's fold, whose epilogue reads the row again) is
    marked evict_last where the tensor is larger than the L2 cache, so that the
    rows in flight stay for the second read (8192 x 8192 softmax and layernorm:
    1.03x in float32, 1.02x-1.03x in bf16); a tensor the cache holds keeps its rows
    without it, and the mark only crowds the cache (4096 x 4096 bf16: 0.94x).
    Other loads keep the default: other programs read their elements too
    (attention's K and V, a bias), and the cache serves them."""
    order: dict[str, list[str]] = {}          # tensor -> its loads' variables, in program order
    for line in lines:
        for raw in _EVICTION.findall(line):
            order.setdefault(loads[raw].tensor, []).append(raw)
    policy = {}
    for raws in order.values():
        if all(loads[raw].read_once for raw in raws) and len({loads[raw].indices for raw in raws}) == 1:
            policy.update({raw: "evict_last" for raw in raws[:-1] if loads[raw].beyond_cache})
            policy[raws[-1]] = "evict_first"
    why = {"evict_first": "no other program reads these elements of {}: read past the cache",
           "evict_last": "{} is read again below and is larger than the L2 cache: kept in it for that"}
    out = []
    for line in lines:
        hinted = [raw for raw in _EVICTION.findall(line) if raw in policy]
        pad = line[:len(line) - len(line.lstrip())]
        out += [f"{pad}# {why[policy[raw]].format(loads[raw].tensor)} ({policy[raw]})" for raw in hinted]
        out.append(_EVICTION.sub(lambda m: f', eviction_policy="{policy[m.group(1)]}"' if m.group(1) in policy
                                 else "", line))
    return out


def with_role_names(lines: list[str], names: dict[str, str]) -> list[str]:
    """The kernel's lines with each numbered temporary that took a role written
    under the role's name (comments too: no program name is a temporary's)."""
    if not names:
        return lines
    word = re.compile(r"\b(" + "|".join(names) + r")\b")
    return [word.sub(lambda m: names[m.group(1)], line) for line in lines]


INLINE_MAX = 60       # characters of an expression worth its own name when used once
_TEMPORARY = re.compile(rf"( *)({NUMBERED.pattern}) = (.*)")
_ASSIGNED = re.compile(r" *([\w, ]+?) *(?:=|\+=)(?!=)")


def inline_single_uses(lines: list[str]) -> list[str]:
    """The kernel's lines with each numbered temporary that is read once, later in
    the same block, written into its use (`r_new = tl.maximum(r, tl.max(x0, 1))`,
    not a `t4` for the tile's max), unless its expression is long or a name it reads
    is assigned in between (a running state updated before the use)."""
    lines = list(lines)
    changed = True
    while changed:
        changed = False
        for k, line in enumerate(lines):
            definition = _TEMPORARY.fullmatch(line)
            if definition is None or len(definition.group(3)) > INLINE_MAX:
                continue
            pad, name, expr = definition.groups()
            word = re.compile(rf"\b{name}\b")
            uses = [j for j, other in enumerate(lines) if j != k and word.search(other)]
            if len(uses) != 1 or uses[0] < k or len(word.findall(lines[uses[0]])) != 1:
                continue
            j = uses[0]
            between = lines[k + 1:j]
            reads = set(re.findall(r"[A-Za-z_]\w*", expr))
            if (not lines[j].startswith(pad) or lines[j][len(pad)] == " "
                    or any(other.strip() and not other.startswith(pad) for other in between)
                    or any((m := _ASSIGNED.match(other)) and reads & set(re.split(r"[, ]+", m.group(1)))
                           for other in between)):
                continue
            lines[j] = word.sub((expr if _atomic(expr) else f"({expr})").replace("\\", "\\\\"), lines[j])
            del lines[k]
            changed = True
            break
    return lines


def one_per_tile(lines: list[str], tiles: set[str]) -> list[str]:
    """The kernel's lines with one variable per tile of addresses: a loop's interior
    and boundary copies load the same tiles, and each copy made its own."""
    lines = list(lines)
    for k in range(len(lines)):
        definition = _DEFINITION.fullmatch(lines[k])
        if definition is None or definition.group(1) not in tiles:
            continue
        pad = lines[k][:len(lines[k]) - len(lines[k].lstrip())]
        for j in range(k + 1, len(lines)):
            if lines[j].strip() and not lines[j].startswith(pad):
                break               # the block ends: a later twin is out of this one's reach
            twin = _DEFINITION.fullmatch(lines[j])
            if (twin is not None and twin.group(1) in tiles and twin.group(2) == definition.group(2)
                    and lines[j].startswith(pad) and lines[j][len(pad)] != " "):
                word = re.compile(rf"\b{twin.group(1)}\b")
                lines[j] = ""
                lines[j + 1:] = [word.sub(definition.group(1), line) for line in lines[j + 1:]]
    return [line for line in lines if line]


_DEFINITION = re.compile(r" *([A-Za-z_]\w*) = (.*)")


def drop_unread(lines: list[str]) -> list[str]:
    """The kernel's lines without the definitions nothing reads (a loop's offsets
    and mask when its loads are unmasked and address its first tile plus a step).
    A definition is read if a later line of the loop body it is in (or of the
    kernel, outside loops) reads it, or if it updates a variable from outside its
    block (loop-carried); a definition with an effect (an atomic) stays."""
    def depth(line: str) -> int:
        return len(line) - len(line.lstrip())

    lines = list(lines)
    changed = True
    while changed:
        changed = False
        for k, line in enumerate(lines):
            definition = _DEFINITION.fullmatch(line)
            if definition is None or "atomic" in definition.group(2):
                continue
            name, pad = definition.group(1), depth(line)
            word = re.compile(rf"\b{name}\b")
            if any(depth(other) < pad and (outer := _DEFINITION.fullmatch(other)) and outer.group(1) == name
                   for other in lines[:k]):
                continue                      # carried from outside its block
            # the loop body it is in: from the nearest loop header above it, shallower than it
            headers = [depth(other) for other in lines[:k] if other.lstrip().startswith("for ")
                       and depth(other) < pad]
            end = len(lines)
            if headers:
                body = headers[-1] + 1
                end = next((j for j in range(k + 1, len(lines)) if lines[j].strip() and depth(lines[j]) < body),
                           len(lines))
            if not any(word.search(other) for other in lines[k + 1:end] if not other.lstrip().startswith("#")):
                del lines[k]
                changed = True
                break
    return lines


def _atomic(expr: str) -> bool:
    """Whether `expr` needs no parentheses as an operand: a name, a call, or one
    parenthesised whole."""
    if re.fullmatch(r"[\w.]+", expr):
        return True
    head = re.match(r"[\w.]*\(", expr)
    if head is None:
        return False
    depth = 0
    for pos in range(head.end() - 1, len(expr)):
        depth += {"(": 1, ")": -1}.get(expr[pos], 0)
        if depth == 0:
            return pos == len(expr) - 1
    return False


class PartialEmitter(KernelEmitter):
    """A split kernel: program (tile, split_id) folds chunk split_id of its program
    folds' tiles and stores every field of their states to buffers; the last
    program of each tile merges them (the MergeEmitter's kernel, called)."""
    suffix = "_partial"
    chunked = True

    def split_prologue(self, lines: list[str]) -> None:
        lines.append("split_id = tl.program_id(1)")
        self.params.setdefault("n_split", SPLIT)

    def result(self, st, scope: Scope) -> Value:
        """A statement's value, named after it."""
        return self.renamed(self.value(st.expr, scope), st.name, scope)

    def store_results(self, root: Scope) -> list[str]:
        spec = self.spec
        writes: list[str] = []
        for f in spec.program_folds:
            state, _, _ = self.fold_state(f, root)
            layout = {}
            for fname, v in state.items():
                buf = self.ctx.buffer_name(f"{spec.name}_state{list(spec.program_folds).index(f)}_"
                                           f"{ident(fname)}")
                layout[fname] = (buf, tuple(a.name for a in v.axes), v.kind)
                root.lines.append(self.store_state(buf, v, [root.env[a.name] for a in v.axes], "split_id"))
            self.ctx.split_layouts[(spec.name, f)] = layout
            writes += [b for b, _, _ in layout.values()]
        return writes

    def finish(self, root: Scope) -> tuple[tuple, frozenset]:
        """One launch for the split: each program counts itself in on its tile's arrival
        counter once its states are stored, and the last of the n_split merges them all
        (in split order, so the result does not depend on which one is last) by calling
        the merge kernel as a function.  The atomic's acquire-release order makes the
        others' stores visible to it; the merge reads them past L1."""
        merge = MergeEmitter(self.ctx, self.kernel).build()
        counter = self.ctx.buffer_name(f"{self.spec.name}_arrivals")
        self.ctx.tensors[counter] = TensorInfo("tensor", 1, torch.int32)
        self.buffers.append((counter, [PROGRAMS], str(torch.int32)))
        ptr, (stride,) = self.tensor_params(counter, 1)
        by_launcher = {arg: name for name, arg in self.params.items()}
        args = []
        for name, arg in merge.params:
            if arg not in by_launcher:
                by_launcher[arg] = self.local(name)
                self.params[by_launcher[arg]] = arg
            args.append(by_launcher[arg])
        # the merge's tiles are the partial's (an autotuned choice binds both)
        args += [f"{c}={c if c in self.constexprs else v}" for c, v in merge.constexprs.items()]
        arrived = self.local("arrived")
        root.lines += ["# one launch: the last of this tile's n_split programs to store its state merges them all",
                       f"{arrived} = tl.atomic_add({ptr} + tl.program_id(0) * {stride}, 1, sem=\"acq_rel\")",
                       f"if {arrived} == n_split - 1:",
                       f"    {merge.name}({', '.join(args)})",
                       "    # every program of the tile has counted itself in: back to 0 for the next launch "
                       "(the launcher keeps the counters)",
                       f"    tl.store({ptr} + tl.program_id(0) * {stride}, 0)"]
        return (merge,), frozenset({counter})


class ScanTotalsEmitter(KernelEmitter):
    """A scan across chunks' first kernel: program (rows, chunk_id) runs its chunk of the
    scanned index as the scan's kernel does, computing the prefix folds alone (nothing
    else is stored), and stores the state it carries out of the chunk: the chunk's total,
    one buffer per field, [chunk, the fold's other indices]."""
    suffix = "_totals"
    totals = True

    def store_results(self, root: Scope) -> list[str]:
        writes: list[str] = []
        for k, how in enumerate(f for f in self.kernel.folds if f.prefix is not None and not f.nested):
            fold = how.fold
            for index in sorted(free(fold) - set(root.env)):
                # an index a fold around it holds whole (a selective scan's state n)
                tile = next(t for f in self.kernel.folds for t in f.tiles if t.index == index and t.how == WHOLE)
                root.env[index] = self.whole_axis(tile)
            self.fold_state(fold, root)
            carry, FA = self.carried[fold]
            layout = {}
            for fname, v in carry.items():
                buf = self.ctx.buffer_name(f"{self.spec.name}_total{k}_{ident(fname)}")
                layout[fname] = (buf, tuple(a.name for a in FA), v.kind)
                self.scan_after.append(self.store_state(buf, v, list(FA), "chunk_id"))
                writes.append(buf)
            self.scan_after.insert(0, f"# the total of this chunk of {self.kernel.scan}: the state carried out of it")
            self.ctx.scan_totals[self.spec.name, fold] = layout
        return writes

    def why(self) -> str:
        return (f"the totals of each chunk of {self.kernel.scan} for the scan after it "
                f"({self.spec.name}: {super().why()})")


class MergeEmitter(KernelEmitter):
    """A split kernel's merge: folds the n_split partial states of each program fold
    in order with the summary's combine, then finishes like the whole kernel; a
    jit function the partial kernel's last program of a tile calls."""
    suffix = "_merge"
    launched = False

    def split_prologue(self, lines: list[str]) -> None:
        self.params.setdefault("n_split", SPLIT)

    def fold_at(self, fold: Reduce, env0: dict[str, Axis], T: Scope) -> dict[str, Value]:
        if T is self.root and (self.spec.name, fold) in self.ctx.split_layouts:
            return self.merge_fold(fold, env0)
        return self.emit_fold(fold, env0, T)

    def merge_fold(self, fold: Reduce, env0: dict[str, Axis]) -> dict[str, Value]:
        s = fold.summary
        layout = self.ctx.split_layouts[(self.spec.name, fold)]
        k = next(self.fold_ids)
        prefix = f"f{k}"
        root = self.root
        state = {}
        root.lines.append(f"# fold {k}: {s.name}[{', '.join(fold.indices)}], merged from n_split partial "
                          f"states in order")
        for f in s.field_names:
            _, names, kind = layout[f]
            axes = sort_axes(env0[n] for n in names)
            var = self.state_var(prefix, f)
            root.lines.append(f"{var} = tl.full({self.shape(axes)}, "
                              f"{self.identity_literal(s, f, kind)}, {self.state_dtype(kind)})")
            state[f] = Value(var, axes, kind)
        body = Scope(root, 1, dict(root.env), "merge")
        loaded = {}
        for f in s.field_names:
            buf, names, kind = layout[f]
            axes = [env0[n] for n in names]
            target = sort_axes(axes)
            address, mask = self.state_address(buf, axes, "tl.cast(split, tl.int64)")
            ident_lit = self.identity_literal(s, f, kind)
            # stored by other programs of the launch: read from L2, past this SM's L1
            load = (f"tl.load({address}, mask={mask}, other={ident_lit}, cache_modifier=\".cg\")" if mask
                    else f"tl.load({address}, cache_modifier=\".cg\")")
            loaded[f] = self.assign(load, target, body, kind, stem=f"part_{ident(f)}_")
        new: dict[str, Value] = {}
        covered = rescaled_fields(s) if rescaled_lowering(s) else set()
        for rs in (s.rescaled if covered else ()):
            lit = emission.literal(s.identity[s.field_names.index(rs.leader)].value)
            comb = "tl.maximum" if rs.leader_monoid == "max" else "tl.minimum"
            a, b = state[rs.leader], loaded[rs.leader]
            axes = sort_axes(list(a.axes) + list(b.axes))
            r_new = self.assign(f"{comb}({a.code}, {self.expand(b, axes)})", axes, body, stem="r_new")
            body.lines.append("# the derived merge: rescale both sides to the common leader (finite stand-in "
                              "0 while it is the identity)")
            r_use = self.stand_in(r_new, lit, body, "r_use")
            ha = self.formula(rs.repair, {"r": a, "r_new": r_use}, body)
            hb = self.formula(rs.repair, {"r": b, "r_new": r_use}, body)
            shifted = (self.shifts(rs, a, r_use, lit, body), self.shifts(rs, b, r_use, lit, body))
            for fname, _ in rs.values:
                FT = state[fname].axes
                sides = []
                for side, h, shifts in zip((state, loaded), (ha, hb), shifted):
                    t = self.expand(side[fname], FT)
                    if fname in shifts:     # h * (t + s * t_w), as the combine writes it
                        s_k, total = shifts[fname]
                        t = f"({t} + {self.expand(s_k, FT)} * {self.expand(side[total], FT)})"
                    sides.append(f"{t} * {self.expand(h, FT)}")
                new[fname] = self.assign(" + ".join(sides), FT, body)
            new[rs.leader] = r_new
        rest = [f for f in s.field_names if f not in new]
        if rest:
            env = {f"a.{f}": state[f] for f in s.field_names} | {f"b.{f}": loaded[f] for f in s.field_names}
            cse: dict = {}
            for f in rest:
                new[f] = self.formula(selecting_combine(s)[s.field_names.index(f)], env, body, cse)
            new.update(self.guard_identity(s, rest, state, loaded, {f: new[f] for f in rest}, body))
        for f in s.field_names:
            body.lines.append(f"{state[f].code} = {self.full_shape(new[f], state[f].axes)}")
        root.lines.append("for split in range(0, n_split):")
        root.lines.extend(indent(body.lines))
        return state

    # ------------------------------------------------------------ the kernel


# The identities of an integral max and min: the int64 extremes stand in for -inf and inf
INT64_EXTREMES = {-math.inf: -2 ** 63, math.inf: 2 ** 63 - 1}


def nested(fn: str, args: list[str]) -> str | None:
    """`fn` (tl.maximum, tl.minimum) of all `args` as nested calls; None for none."""
    if not args:
        return None
    out = args[0]
    for a in args[1:]:
        out = f"{fn}({out}, {a})"
    return out


def rescaled_fields(s) -> set[str]:
    return {r.leader for r in s.rescaled} | {f for r in s.rescaled for f, _ in r.values}


def rescaled_lowering(s) -> bool:
    """Whether a summary folds as running leaders with repaired fields: it has a
    rescaled structure (factorise's), and its other fields combine without
    reading the rescaled ones."""
    if not s.rescaled:
        return False
    covered = rescaled_fields(s)
    for f in s.field_names:
        if f not in covered:
            used = {v.name.split(".", 1)[1] for v in walk(s.combine[s.field_names.index(f)]) if isinstance(v, Var)}
            if used & covered:
                return False
    return True


# the largest integer magnitude up to which every integer is exact in a half-precision dtype
EXACT_INTEGERS = {torch.bfloat16: 1 << 8, torch.float16: 1 << 11}


def _exact_in(bounds: tuple[int, int] | None, dtype) -> bool:
    """Whether every integer in `bounds` (None: unknown) is exact in floating `dtype`."""
    limit = EXACT_INTEGERS.get(dtype)
    return limit is None or (bounds is not None and max(abs(b) for b in bounds) <= limit)


def parts_lower_apart(s) -> bool:
    """Whether a summary is a product of independent parts some of which a row above
    the generic one lowers (two sums fused over one index: two tl.dot, not a
    tl.reduce of pairs)."""
    groups = independent_fields(s)
    return len(groups) > 1 and any(lowering(s.restricted(g)[0]) != "generic_fold" for g in groups)


# How a fold's tile updates its state, by the summary's algebra (never its name); the
# first row whose precondition holds is used.  A user's sum or max lowers like the
# built-in one.
FOLD_LOWERINGS = (
    ("sum: a contraction (tl.dot) or tl.sum", additive, "sum_fold"),
    ("max / min: a NaN-keeping tile max / min", lambda s: extremum(s) is not None, "extremum_fold"),
    ("rescaled: running leader, repaired fields (FlashAttention)", rescaled_lowering, "rescaled_fold"),
    ("a product of independent parts: each part by its own row", parts_lower_apart, "product_fold"),
    ("any summary: tl.reduce with its combine (ordered: tl.associative_scan)", lambda s: True, "generic_fold"),
)


def lowering(s) -> str:
    """The method of the first row of FOLD_LOWERINGS whose precondition `s` meets."""
    return next(method for _, applies, method in FOLD_LOWERINGS if applies(s))
