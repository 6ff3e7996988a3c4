"""fuse: inline every statement into the statements that read it, so that no
result is read back from memory: intermediates are never materialised, and an
intermediate asked for as an output is stored but not re-read.  Equal subexpressions are
equal values (frozen nodes hash structurally), so a repeated inlined reduction
is still one computation for the later stages; bound indices renamed to avoid
capture get their names back where possible, so that alpha-equivalent
reductions compare equal."""
from __future__ import annotations

from dataclasses import replace

from ..errors import CheckError
from ..ir import (Access, Call, Composite, Const, Expr, Extent, Index, Program, Reduce, affine_access, bound_indices,
                  children, free_indices, transform, with_children)
from ..ops import FLOAT


def rename_indices(e: Expr, mapping: dict[str, str], fresh) -> Expr:
    """Capture-avoiding renaming of free indices; `fresh(name)` makes a new index
    name (same extent) for a bound index that would capture a target name.  Each
    subtree shared by several parents is renamed once per mapping."""
    done: dict[tuple[int, tuple], Expr] = {}

    def visit(e: Expr, mapping: dict[str, str]) -> Expr:
        if not mapping:                       # nothing to rename below
            return e
        key = (id(e), tuple(mapping.items()))
        if key not in done:
            done[key] = _renamed(e, mapping, fresh, visit)
        return done[key]
    return visit(e, mapping)


def _renamed(e: Expr, mapping: dict[str, str], fresh, visit) -> Expr:
    if isinstance(e, Access):
        return replace(e, indices=tuple(mapping.get(i, i) for i in e.indices))
    if isinstance(e, Index | Extent):
        return replace(e, name=mapping.get(e.name, e.name))
    if isinstance(e, Composite) and not bound_indices(e):
        # softmax[m] keeps its index: the m inside is the m of its result
        e = replace(e, indices=tuple(mapping.get(i, i) for i in e.indices))
        return with_children(e, tuple(visit(c, mapping) for c in children(e)))
    if isinstance(e, Reduce | Composite):
        inner = {k: v for k, v in mapping.items() if k not in e.indices}
        targets = set(inner.values())
        bound = tuple(fresh(i) if i in targets else i for i in e.indices)
        inner.update({i: b for i, b in zip(e.indices, bound) if i != b})
        e = replace(e, indices=bound)
        return with_children(e, tuple(visit(c, inner) for c in children(e)))
    return with_children(e, tuple(visit(c, mapping) for c in children(e)))


def _at_affine_subscripts(body: Expr, params: tuple[str, ...], dtype: str, read: Access, fresh) -> Expr:
    """`body`, a statement's right side over `params`, read at `read`'s affine or
    gathered subscripts (`S[t + r]`, `S[T[i], d]`): each parameter replaced by its
    subscript, and 0 where a subscript falls outside the statement's extent, as a read
    outside a tensor is."""
    subscripts = {p: (*read.affine(d), read.gathered(d)) for d, p in enumerate(params)}
    out = substitute_affine(body, subscripts, fresh, read)
    zero = Const(0.0 if dtype == FLOAT else 0)
    for d, p in enumerate(params):
        if read.dimension_index(d) is None:
            position = affine_position(*subscripts[p])
            inside = Call("and", (Call("ge", (position, Const(0))), Call("lt", (position, Extent(p)))))
            out = Call("where", (inside, out, zero))
    return out


def substitute_affine(e: Expr, table: dict[str, tuple], fresh, read: Access) -> Expr:
    """`e` with each free index of `table` replaced, all at once, by its affine value
    ({index: coefficient}, constant), plus, where a value has a third part (an integer
    read and its factor, or None), that gathered value: a tensor read composes its
    subscripts, an index value becomes integer arithmetic, len(...) keeps the index's
    extent.  A binder that would capture an index of a value takes a fresh name.  A
    normaliser whose kept index is replaced (softmax[m] at m + 1), and a subscript
    that would gather twice, are CheckErrors pointing at `read`, the read that asks
    for it."""
    table = {n: v if len(v) == 3 else (*v, None) for n, v in table.items()}
    # by node object and the names replaced below it; the node is kept beside its result, so that
    # its id is not reused by a node made later (a renamed binder's body is made here, then dropped)
    done: dict[tuple[int, frozenset], tuple[Expr, Expr]] = {}

    def visit(n: Expr, table: dict) -> Expr:
        if not table:
            return n
        key = (id(n), frozenset(table))
        if key not in done:
            done[key] = (n, replaced(n, table))
        return done[key][1]

    def replaced(n: Expr, table: dict) -> Expr:
        if isinstance(n, Access):
            if not set(n.indices) & table.keys():
                return n
            subscripts = tuple(_substituted_subscript(n, d, table, read, visit) for d in range(n.rank))
            return affine_access(n.tensor, tuple(s[:2] for s in subscripts), n.span, tuple(s[2] for s in subscripts))
        if isinstance(n, Index):
            return affine_position(*table[n.name]) if n.name in table else n
        if isinstance(n, Composite) and not bound_indices(n):
            if set(n.indices) & table.keys():
                raise CheckError(f"{n.op}[{', '.join(n.indices)}]'s result would be read at an affine subscript "
                                 f"({', '.join(read.subscripts())}); a normaliser keeps its index whole: read "
                                 f"it at an index", None, read.span)
        elif isinstance(n, Reduce | Composite):
            inner = {k: v for k, v in table.items() if k not in n.indices}
            written = {m for terms, _, gathered in inner.values()
                       for m in [*terms, *(gathered[0].indices if gathered else ())]}
            for bound in [i for i in n.indices if i in written]:
                new = fresh(bound)
                n = with_children(replace(n, indices=tuple(new if i == bound else i for i in n.indices)),
                                  tuple(rename_indices(c, {bound: new}, fresh) for c in children(n)))
            return with_children(n, tuple(visit(c, inner) for c in children(n)))
        return with_children(n, tuple(visit(c, table) for c in children(n)))

    return visit(e, table)


def substituted_affine(affine: tuple[dict[str, int], int], table: dict) -> tuple[dict[str, int], int]:
    """`affine` ({index: coefficient}, constant) with the indices of `table` replaced by
    their own affine values."""
    terms, constant = affine
    out: dict[str, int] = {}
    for n, c in terms.items():
        inner, shift = table.get(n, ({n: 1}, 0))
        for m, k in inner.items():
            out[m] = out.get(m, 0) + c * k
        constant += c * shift
    return {n: c for n, c in out.items() if c}, constant


def _substituted_subscript(n: Access, d: int, table: dict, read: Access, visit) -> tuple:
    """Dimension d of `n` with the indices of `table` replaced (substitute_affine):
    ({index: coefficient}, constant, the gathered read and its factor or None)."""
    terms, constant = substituted_affine(n.affine(d), {k: v[:2] for k, v in table.items()})
    found = n.gathered(d)
    if found is not None:
        found = (visit(found[0], table), found[1])
        if not isinstance(found[0], Access) or found[0].gathers is not None:
            raise CheckError(f"reading {read.tensor} at {', '.join(read.subscripts())} would make a gathered "
                             f"subscript read through another gather; read it at an index", None, read.span)
    for name, c in n.affine(d)[0].items():
        gathered = table.get(name, (None, None, None))[2]
        if gathered is None:
            continue
        if found is not None:
            raise CheckError(f"reading {read.tensor} at {', '.join(read.subscripts())} would gather twice in one "
                             f"subscript ({n.tensor}'s dimension {d}); read it at an index", None, read.span)
        found = (gathered[0], c * gathered[1])
    return terms, constant, found


def affine_position(terms: dict[str, int], constant: int, gathered: tuple[Access, int] | None = None) -> Expr:
    """An affine subscript (plus a gathered read times its factor) as an integer
    expression of index values."""
    if gathered is not None:
        read, scale = gathered
        value: Expr = read if scale == 1 else Call("mul", (Const(scale), read))
        rest = affine_position(terms, constant)
        return value if rest == Const(0) else Call("add", (value, rest))
    out: Expr | None = None
    for name, c in terms.items():
        term: Expr = Index(name) if abs(c) == 1 else Call("mul", (Const(abs(c)), Index(name)))
        out = (Call("neg", (term,)) if c < 0 else term) if out is None else Call("sub" if c < 0 else "add", (out, term))
    if out is None:
        return Const(constant)
    return out if constant == 0 else Call("add" if constant > 0 else "sub", (out, Const(abs(constant))))


class FreshNames:
    """Fresh index names sharing the extent of the index they stand for."""

    def __init__(self, extents: dict):
        self.extents = extents
        self.origin: dict[str, str] = {}

    def fresh(self, name: str) -> str:
        base = self.origin.get(name, name)
        n = 1
        while f"{base}_{n}" in self.extents:
            n += 1
        new = f"{base}_{n}"
        self.extents[new] = self.extents[base]
        self.origin[new] = base
        return new

    def restore(self, e: Expr) -> Expr:
        """Rename a binder's fresh index back to its origin where nothing is captured."""
        if not isinstance(e, Reduce | Composite):
            return e
        free_inside = {i for c in children(e) for i in free_indices(c)}
        for bound in e.indices:
            base = self.origin.get(bound)
            if base is None or base in free_inside or base in e.indices:
                continue
            renamed = tuple(rename_indices(c, {bound: base}, self.fresh) for c in children(e))
            e = with_children(replace(e, indices=tuple(base if i == bound else i for i in e.indices)),
                              renamed)
        return e


def fuse(program: Program) -> Program:
    names = FreshNames(dict(program.extents))
    inlined: dict[str, tuple[tuple[str, ...], Expr, str]] = {}

    def substitute(e: Expr) -> Expr:
        if isinstance(e, Access) and e.tensor in inlined:
            params, body, dtype = inlined[e.tensor]
            if e.layout is not None:
                return _at_affine_subscripts(body, params, dtype, e, names.fresh)
            mapping = {p: i for p, i in zip(params, e.indices) if p != i}
            return rename_indices(body, mapping, names.fresh) if mapping else body
        return e

    kept = []
    for s in program.statements:
        renamed_before = len(names.origin)
        try:
            expr = transform(s.expr, substitute)
        except CheckError as e:         # a read this pass cannot inline, pointed at in the program's text
            raise CheckError(e.message, e.source or program.source or None, e.span) from None
        if len(names.origin) != renamed_before:      # fresh names were made: give them back where possible
            expr = transform(expr, names.restore)
        s = replace(s, expr=expr)
        inlined[s.name] = (s.indices, s.expr, s.dtype)      # readers recompute it, outputs or not
        if s.name in program.outputs:
            kept.append(s)
    return replace(program, statements=tuple(kept), extents=tuple(sorted(names.extents.items())))
