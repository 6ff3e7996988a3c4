"""fuse: inline every statement into the statements that read it, so that no
result is read back from memory: intermediates are never materialised, and an
intermediate asked for as an output is stored but not re-read.  Equal subexpressions are
equal values (frozen nodes hash structurally), so a repeated inlined reduction
is still one computation for the later stages; bound indices renamed to avoid
capture get their names back where possible, so that alpha-equivalent
reductions compare equal."""
from __future__ import annotations

from dataclasses import replace

from ..ir import (Access, Composite, Expr, Extent, Index, Program, Reduce, bound_indices, children, free_indices,
                  transform, with_children)


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
    inlined: dict[str, tuple[tuple[str, ...], Expr]] = {}

    def substitute(e: Expr) -> Expr:
        if isinstance(e, Access) and e.tensor in inlined:
            params, body = inlined[e.tensor]
            mapping = {p: i for p, i in zip(params, e.indices) if p != i}
            return rename_indices(body, mapping, names.fresh) if mapping else body
        return e

    kept = []
    for s in program.statements:
        renamed_before = len(names.origin)
        expr = transform(s.expr, substitute)
        if len(names.origin) != renamed_before:      # fresh names were made: give them back where possible
            expr = transform(expr, names.restore)
        s = replace(s, expr=expr)
        inlined[s.name] = (s.indices, s.expr)      # readers recompute it, outputs or not
        if s.name in program.outputs:
            kept.append(s)
    return replace(program, statements=tuple(kept), extents=tuple(sorted(names.extents.items())))
