"""The float64 oracle: evaluates any IR program with torch, directly from the
definitions (no factorisation), as the ground truth for every later test.

Values are *labelled tensors*: a torch tensor plus the index name of each of its
dimensions.  Elementwise operators align labels (broadcasting); reductions fold
labelled dimensions with the summary's own combine, pairwise, so one mechanism
serves every summary, user-defined and non-commutative ones included.

Semantics are torch's: integers are int64 and wrap around (an integral field of a
fold stays int64, never a float64 that would round past 2**53 and saturate past
2**63), and a NaN is the extreme of an extremum (max propagates it, argmax gives
the first NaN's position).
"""
from __future__ import annotations

import math
import random
from dataclasses import dataclass, replace
from typing import Mapping

import torch

from .algebra import COMPOSITES
from .algebra.properties import selecting_combine
from .config import deep
from .algebra.formula import evaluate as evaluate_formula
from .ir import Access, Call, Composite, Const, Expr, Extent, Index, Program, Reduce, free_indices
from .ops import BOOL, FLOAT, INT, OPS


@dataclass(frozen=True)
class Labelled:
    tensor: torch.Tensor
    dims: tuple[str, ...]

    def aligned(self, dims: tuple[str, ...]) -> torch.Tensor:
        """View with dimensions in `dims` order, size 1 where absent (broadcastable)."""
        order = [self.dims.index(d) for d in dims if d in self.dims]
        t = self.tensor.permute(order) if order else self.tensor
        shape = [t.shape[order.index(self.dims.index(d))] if d in self.dims else 1 for d in dims]
        return t.reshape(shape)


def _union(values: list[Labelled]) -> tuple[str, ...]:
    return tuple(dict.fromkeys(d for v in values for d in v.dims))


def _diagonal(t: torch.Tensor, indices: tuple[str, ...]) -> Labelled:
    """A[i, i] reads the diagonal: merge repeated labels."""
    dims = list(indices)
    while len(set(dims)) < len(dims):
        for a in range(len(dims)):
            b = dims.index(dims[a], a + 1) if dims[a] in dims[a + 1:] else -1
            if b >= 0:
                t = torch.diagonal(t, dim1=a, dim2=b).movedim(-1, a)
                del dims[b]
                break
    return Labelled(t, tuple(dims))


class _Evaluator:
    def __init__(self, values: Mapping[str, Labelled], extents: Mapping[str, int],
                 chunking: random.Random | None = None):
        self.values = dict(values)
        self.extents = extents
        self.chunking = chunking
        self.folds: dict[Reduce, tuple] = {}

    def __call__(self, e: Expr) -> Labelled:
        if isinstance(e, Const):
            return Labelled(torch.tensor(e.value, dtype=torch.float64 if isinstance(e.value, float)
                                         else torch.int64), ())
        if isinstance(e, Index):
            return Labelled(torch.arange(self.extents[e.name], dtype=torch.int64), (e.name,))
        if isinstance(e, Extent):
            return Labelled(torch.tensor(self.extents[e.name], dtype=torch.int64), ())
        if isinstance(e, Access):
            stored = self.values[e.tensor]
            if e.layout is not None:
                return self._affine_read(stored.tensor, e)
            return _diagonal(stored.tensor, e.indices)
        if isinstance(e, Call):
            op = OPS[e.op]
            args = [self(a) for a in e.args]
            dims = _union(args)
            tensors = [a.aligned(dims) for a in args]
            if op.result((INT,) * op.arity) == FLOAT:   # int operands of a float op: compute in float64
                tensors = [t.double() for t in tensors]
            return Labelled(op.torch(*tensors), dims)
        if isinstance(e, Reduce):
            return self._reduce(e)
        if isinstance(e, Composite):
            arg = self(e.arg)
            axes = tuple(arg.dims.index(i) for i in e.indices)
            rule = COMPOSITES[e.op]
            out = rule.torch(arg.tensor.double(), axes)
            dims = arg.dims if rule.keeps_index else tuple(d for d in arg.dims if d not in e.indices)
            return Labelled(out, dims)
        raise TypeError(f"the oracle cannot evaluate {type(e).__name__}")

    def _affine_read(self, t: torch.Tensor, e: Access) -> Labelled:
        """`t` read at affine subscripts over the grid of `e.indices`; 0 outside it."""
        grid = [self.extents[i] for i in e.indices]
        ranges = torch.meshgrid(*(torch.arange(n) for n in grid), indexing="ij") if grid else ()
        positions = [sum((c * r for c, r in zip(coeffs, ranges) if c), torch.zeros(grid, dtype=torch.int64))
                     + constant for coeffs, constant in e.layout]
        for d in range(e.rank):
            found = e.gathered(d)
            if found is not None:                   # the integer read's values, over the same grid
                read, scale = found
                positions[d] = positions[d] + scale * self(read).aligned(e.indices).to(torch.int64)
        inside = torch.ones(grid, dtype=torch.bool)
        for p, n in zip(positions, t.shape):
            inside &= (p >= 0) & (p < n)
        if 0 in t.shape:
            return Labelled(torch.zeros(grid, dtype=t.dtype), e.indices)
        read = t[tuple(p.clamp(0, n - 1) for p, n in zip(positions, t.shape))]
        return Labelled(torch.where(inside, read, torch.zeros((), dtype=t.dtype)), e.indices)

    def _reduce(self, e: Reduce) -> Labelled:
        kept, state = self._fold(e.fold)
        s = e.summary
        result = state[e.result] if e.result is not None else evaluate_formula(s.finalize, state)
        result = result.expand([self.extents[d] for d in kept]) if kept else result
        # A projected field varies only over its own arguments' indices: it is
        # constant along the others, so take their first position.
        dims = free_indices(e)
        if any(d not in dims and self.extents[d] == 0 for d in kept):
            # an empty dimension has no first position: fold this field's own
            # arguments alone (its value does not depend on the others)
            used = s.arguments_of(e.result)
            own = replace(e.fold, args=tuple(a if k in used else Const(0.0) for k, a in enumerate(e.args)))
            kept, state = self._fold(own)
            result = state[e.result].expand([self.extents[d] for d in kept]) if kept else state[e.result]
        for axis in reversed(range(len(kept))):
            if kept[axis] not in dims:
                result = result.select(axis, 0)
        return Labelled(result, tuple(d for d in kept if d in dims))

    def _fold(self, e: Reduce) -> tuple[tuple[str, ...], dict[str, torch.Tensor]]:
        """The folded state of `e` (memoised: projections of one fold share it)."""
        if e in self.folds:
            return self.folds[e]
        s = e.summary
        args = [self(a) for a in e.args]
        # a reduced index the body does not read still counts its positions (sum[k](1) = len(k))
        dims = tuple(dict.fromkeys((*_union(args), *e.indices)))
        kept = tuple(d for d in dims if d not in e.indices)
        shape = [self.extents[d] for d in dims]
        arg_types = tuple(FLOAT if a.tensor.is_floating_point() else INT for a in args)
        env = {f"x{k}": _as_type(a.aligned(dims), t).expand(shape)
               for k, (a, t) in enumerate(zip(args, arg_types))}
        types = s.field_types(arg_types)        # integral fields fold in int64, as the kernels do
        fields = [_as_type(evaluate_formula(f, env), types[n]).expand(shape)
                  for f, n in zip(s.lift, s.field_names)]
        # Bring the reduced dimensions last and flatten them into one, in index order
        # (row-major), so that a non-commutative summary folds in that order.
        perm = [dims.index(d) for d in kept] + [dims.index(i) for i in e.indices]
        n = 1
        for i in e.indices:
            n *= self.extents[i]
        fields = [f.permute(perm).reshape(*[self.extents[d] for d in kept], n) for f in fields]
        folded = fold(s, fields) if self.chunking is None else fold_in_chunks(s, fields, self.chunking)
        self.folds[e] = kept, dict(zip(s.field_names, folded))
        return self.folds[e]


def fold(summary, fields: list[torch.Tensor]) -> list[torch.Tensor]:
    """Fold the last dimension of each field tensor with `summary.combine`,
    pairing neighbours so that order is kept; an odd tail is padded with the
    identity.  Returns field tensors without that dimension, each in its own
    dtype (float64, or int64 for an integral field)."""
    names = summary.field_names
    while fields[0].shape[-1] > 1:
        if fields[0].shape[-1] % 2:
            fields = [torch.cat([f, torch.full_like(f[..., :1], _identity(c, f.dtype))], dim=-1)
                      for f, c in zip(fields, summary.identity)]
        env = {**{f"a.{n}": f[..., 0::2] for n, f in zip(names, fields)},
               **{f"b.{n}": f[..., 1::2] for n, f in zip(names, fields)}}
        shape = fields[0][..., 0::2].shape
        fields = [evaluate_formula(c, env).to(f.dtype).expand(shape)
                  for c, f in zip(selecting_combine(summary), fields)]
    if fields[0].shape[-1] == 0:
        return [torch.full(f.shape[:-1], _identity(c, f.dtype), dtype=f.dtype)
                for f, c in zip(fields, summary.identity)]
    return [f[..., 0] for f in fields]


def merge(summary, a: list[torch.Tensor], b: list[torch.Tensor]) -> list[torch.Tensor]:
    """Combine two states (left a, right b) field by field."""
    env = {**{f"a.{n}": t for n, t in zip(summary.field_names, a)},
           **{f"b.{n}": t for n, t in zip(summary.field_names, b)}}
    shape = torch.broadcast_shapes(a[0].shape, b[0].shape)
    return [evaluate_formula(c, env).to(t.dtype).expand(shape) for c, t in zip(selecting_combine(summary), a)]


_INT64 = torch.iinfo(torch.int64)
_SATURATED = {math.inf: _INT64.max, -math.inf: _INT64.min}
_RESULT_DTYPES = {BOOL: torch.bool, INT: torch.int64}


def _identity(c: Const, dtype: torch.dtype) -> int | float:
    """An identity constant in a field's dtype: an integral max's -inf is the least
    int64 (the kernels' identity: an empty integral max saturates)."""
    if dtype.is_floating_point:
        return float(c.value)
    return _SATURATED[c.value] if c.value in _SATURATED else int(c.value)


def _as_type(t: torch.Tensor, kind: str) -> torch.Tensor:
    """`t` as the oracle holds values of `kind`: floats in float64; integers in int64,
    where a float's infinities saturate at the int64 extremes (an empty integral max
    or min is the kernels' identity) and finite values truncate."""
    if kind != INT or not t.is_floating_point():
        return t.to(_RESULT_DTYPES.get(kind, torch.float64))
    whole = torch.where(torch.isinf(t), 0.0, t).to(torch.int64)
    return torch.where(t == math.inf, _INT64.max, torch.where(t == -math.inf, _INT64.min, whole))


def fold_in_chunks(summary, fields: list[torch.Tensor], rng: random.Random) -> list[torch.Tensor]:
    """The chunked executor's fold: cut the last dimension at random boundaries
    (chunks of size 1 included), fold each chunk on its own, then merge the
    chunk states in a random order -- any order for a commutative summary,
    random bracketings of neighbours (order kept) otherwise."""
    n = fields[0].shape[-1]
    cuts = sorted(rng.sample(range(1, n), k=rng.randint(0, n - 1))) if n > 1 else []
    bounds = list(zip([0, *cuts], [*cuts, n]))
    states = [fold(summary, [f[..., lo:hi] for f in fields]) for lo, hi in bounds]
    if summary.commutative:
        rng.shuffle(states)
    while len(states) > 1:
        k = rng.randrange(len(states) - 1)
        states[k:k + 2] = [merge(summary, states[k], states[k + 1])]
    return states[0]


def run(program: Program, inputs: Mapping[str, torch.Tensor | float], extents: Mapping[str, int],
        outputs: tuple[str, ...] | None = None, chunking: random.Random | None = None
        ) -> dict[str, torch.Tensor]:
    """Evaluate `program` in float64 on already-checked inputs.  `extents` maps
    every index name to its size.  Returns every requested statement's result,
    with dimensions in the order of its left-hand side.  With `chunking`, every
    reduction runs as the chunked executor (fold_in_chunks) drawing from it.
    Deeply nested programs run on a large stack (config.deep)."""
    return deep(_run, program, inputs, extents, outputs, chunking, what="the program",
                source=program.source or None)


def gathered_positions(access: Access, d: int, inputs: Mapping[str, torch.Tensor],
                       extents: Mapping[str, int]) -> torch.Tensor:
    """The positions that dimension d of the gathered read `access` reads (`T[i] + 1` of
    `E[T[i] + 1, d]`), int64, over the indices its subscript varies over."""
    read, scale = access.gathered(d)
    value = _Evaluator({read.tensor: Labelled(inputs[read.tensor].detach().to("cpu", torch.int64), ())},
                       extents)(read)
    terms, constant = access.affine(d)
    parts = [Labelled(value.tensor * scale, value.dims), *(
        Labelled(c * torch.arange(extents[n], dtype=torch.int64), (n,)) for n, c in terms.items())]
    dims = _union(parts)
    return sum((p.aligned(dims) for p in parts), torch.tensor(constant, dtype=torch.int64))


def _run(program, inputs, extents, outputs, chunking):
    values = {}
    for decl in program.inputs:
        value = inputs[decl.name]
        t = value.detach() if isinstance(value, torch.Tensor) else torch.tensor(value, dtype=torch.float64)
        # integers as int64 (exact, as torch compares and adds them), bools as bools
        values[decl.name] = Labelled(t.to("cpu", _RESULT_DTYPES.get(decl.dtype, torch.float64)), ())
    evaluator = _Evaluator(values, extents, chunking)
    results = {}
    for st in program.statements:
        v = evaluator(st.expr)
        shape = [extents[i] for i in st.indices]
        t = _as_type(v.aligned(st.indices).expand(shape).contiguous(), st.dtype)
        evaluator.values[st.name] = Labelled(t, ())
        results[st.name] = t
    wanted = outputs if outputs is not None else program.outputs
    return _unshared({name: results[name] for name in wanted}, [v.tensor for v in values.values()])


def _unshared(results: dict[str, torch.Tensor], inputs: list[torch.Tensor]) -> dict[str, torch.Tensor]:
    """`results`, each in memory of its own: a statement that reads a float64 CPU
    input unchanged (Y[i,j] = X[i,j]) is that input's memory, and one that reads
    another statement unchanged is that one's; outputs are the caller's to change
    in place."""
    taken = {t.untyped_storage().data_ptr() for t in inputs if t.numel()}
    own = {}
    for name, t in results.items():
        if t.numel() and t.untyped_storage().data_ptr() in taken:
            t = t.clone()
        taken.add(t.untyped_storage().data_ptr())
        own[name] = t
    return own
