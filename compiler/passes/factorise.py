"""factorise: turn the reductions over one index into a single pass in one
derived summary.

Reductions over the same indices in a statement form a group.  Inside a group:
- a reduction that uses no other member is a base member (its own monoid);
- a sum whose body uses a max (min) member L is a dependent reduction.  With
  r standing for L, write its body as w(x, r) * v(x).  If the ratio
  h(r, r') = w(x, r') / w(x, r) is free of the element x (sympy), the sum can
  be kept relative to the running leader and repaired when it moves:
      t = t_a * h(r_a, r) + t_b * h(r_b, r),   r = max(r_a, r_b).
  Dependents with one leader and one weight share it (the pullback: the
  weights are computed once for every value v_k);
- a sum whose body uses a sum member S = sum x is separable: if the body is a
  polynomial of degree <= 2 in (x - S / count), the centred moments merge
  stably with Chan's formula (Welford); otherwise the body is expanded in
  powers of S into independent sums (one pass, not numerically guarded).
All members of the group then form one product summary; each original
reduction becomes a projection (a field, or a formula of fields) of its fold.
"""
from __future__ import annotations

import math
from functools import lru_cache
from itertools import chain, count
from dataclasses import dataclass, field, replace

import sympy

from ..algebra import BUILTINS, Field, Rescaled, Summary
from ..algebra.laws import require_laws
from ..algebra.moments import centred_moments
from ..ir import (Access, Call, Const, Expr, Extent, Program, Reduce, Var, children, free_indices, walk,
                  with_children)
from .symbolic import SymbolTable, from_sympy, to_sympy
from .stabilise import factors, product, simplify

_LEADERS = {"max": ("maximum", -math.inf), "min": ("minimum", math.inf)}


@dataclass
class _Component:
    fields: list[Field]
    identity: list[Const]
    lift: list[Expr]
    combine: list[Expr]
    commutative: bool = True
    rescaled: Rescaled | None = None
    notes: list[str] = field(default_factory=list)


class _Args:
    """Element expressions of a group, abstracted as Vars x0, x1, ..."""

    def __init__(self):
        self.exprs: list[Expr] = []

    def var(self, e: Expr) -> Var:
        if e not in self.exprs:
            self.exprs.append(e)
        return Var(f"x{self.exprs.index(e)}")

    def abstract(self, e: Expr, named: dict[Expr, Var]) -> Expr:
        """Replace group members by their Vars and maximal member-free parts by args."""
        if e in named:
            return named[e]
        if not any(n in named for n in walk(e)) or not children(e):
            return self.var(e) if not isinstance(e, Const) else e
        return with_children(e, tuple(self.abstract(c, named) for c in children(e)))


def _substitute(e: Expr, mapping: dict[Expr, Expr]) -> Expr:
    if e in mapping:
        return mapping[e]
    return with_children(e, tuple(_substitute(c, mapping) for c in children(e)))


def _replace_vars(e: Expr, mapping: dict[str, Expr]) -> Expr:
    if isinstance(e, Var):
        return mapping.get(e.name, e)
    return with_children(e, tuple(_replace_vars(c, mapping) for c in children(e)))


def _sym(e: Expr, table: SymbolTable) -> sympy.Expr:
    return to_sympy(e, table)


def _stand_in(r: Expr, identity: float) -> Expr:
    """A leader still at its infinite identity is no usable reference point;
    every field summed against it is 0, so any finite stand-in (0) is exact."""
    return Call("where", (Call("eq", (r, Const(identity))), Const(0.0), r))


# ---------------------------------------------------------------- derivations
def derive_repair(weight: Expr) -> Expr | None:
    """h(r, r_new) with weight(x, r_new) = h * weight(x, r), or None if h depends on x."""
    table = SymbolTable()
    r, r_new = Var("r"), Var("r_new")
    w_old = _sym(weight, table)
    w_new = w_old.subs(table.symbol(r, real=True), table.symbol(r_new, real=True))
    ratio = sympy.simplify(sympy.powsimp(w_new / w_old))
    allowed = {table.symbol(r, real=True), table.symbol(r_new, real=True)}
    if not ratio.free_symbols <= allowed:
        return None
    return from_sympy(ratio, table)


def _rescaled_components(leader: Reduce, dependents: list[Reduce], args: _Args,
                         names: dict[Reduce, str]) -> list[_Component] | None:
    """One rescaled component per distinct weight of the dependents (each with
    its own repair and its own copy of the leader), or None if a weight has no
    x-free repair."""
    r = Var("r")
    by_weight: dict[Expr, list[tuple[str, Expr]]] = {}
    for d in dependents:
        body = args.abstract(d.args[0], {leader: r})
        num, den = factors(body)
        has_r = lambda f: any(n == r for n in walk(f))  # noqa: E731
        w = product([f for f in num if has_r(f)], [f for f in den if has_r(f)])
        v = product([f for f in num if not has_r(f)], [f for f in den if not has_r(f)])
        by_weight.setdefault(w, []).append((names[d], v))
    components = []
    taken = set(names.values())
    for k, (weight, values) in enumerate(by_weight.items()):
        lf = names[leader] if k == 0 else _unused("r", taken)
        taken.add(lf)
        component = _rescaled_component(leader, lf, weight, values, args)
        if component is None:
            return None
        components.append(component)
    if len(components) > 1:
        components[0].notes.append(f"{len(components)} weights on the {leader.summary.name} over "
                                   f"{', '.join(leader.indices)}: each has its own repair and leader copy")
    return components


def _rescaled_component(leader: Reduce, lf: str, weight: Expr, values: list[tuple[str, Expr]],
                        args: _Args) -> _Component | None:
    op, identity = _LEADERS[leader.summary.name]
    lead_arg = args.abstract(leader.args[0], {})
    repair = derive_repair(weight)
    if repair is None:
        return None
    a_r, b_r = Var(f"a.{lf}"), Var(f"b.{lf}")
    new_leader = Call(op, (a_r, b_r))
    reference = _stand_in(new_leader, identity)

    def h(old: Expr) -> Expr:
        return _replace_vars(repair, {"r": old, "r_new": reference})

    fields = [Field(lf)] + [Field(n) for n, _ in values]
    lift = [lead_arg] + [Call("mul", (_replace_vars(weight, {"r": _stand_in(lead_arg, identity)}), v))
                         if v != Const(1) else _replace_vars(weight, {"r": _stand_in(lead_arg, identity)})
                         for _, v in values]
    combine = [new_leader] + [
        Call("add", (Call("mul", (Var(f"a.{n}"), h(a_r))), Call("mul", (Var(f"b.{n}"), h(b_r)))))
        for n, _ in values]
    structure = Rescaled(lf, leader.summary.name, lead_arg, weight, repair, tuple(values))
    from ..ir import format_expr
    notes = [f"dependent reductions over {', '.join(leader.indices)}: "
             f"{', '.join(n for n, _ in values)} use{'s' * (len(values) == 1)} the "
             f"{leader.summary.name} {lf}",
             f"weight w(x, r) = {format_expr(weight)}; repair h(r, r') = w(x, r') / w(x, r) = "
             f"{format_expr(repair)} (free of x: sympy)"]
    if len(values) > 1:
        notes.append(f"pullback: {', '.join(n for n, _ in values)} share the weight w, computed once")
    return _Component(fields, [Const(identity)] + [Const(0.0)] * len(values), lift, combine,
                      True, structure, notes)


def _base_component(member: Reduce, name: str, args: _Args) -> _Component:
    s = member.summary
    lifts = [_replace_vars(f, {f"x{k}": args.abstract(a, {}) for k, a in enumerate(member.args)})
             for f in s.lift]
    rename = {f"{side}.{f}": Var(f"{side}.{_component_field(s, name, f)}")
              for side in "ab" for f in s.field_names}
    fields = [Field(_component_field(s, name, f.name), f.dtype) for f in s.fields]
    return _Component(fields, list(s.identity), lifts, [_replace_vars(c, rename) for c in s.combine],
                      s.commutative)


def _component_field(summary: Summary, name: str, field_name: str) -> str:
    """A member's fields inside the product summary: `name`, or `name_field`."""
    return name if len(summary.fields) == 1 else f"{name}_{field_name}"


def _finalize_from(summary: Summary, name: str, projection) -> Expr:
    """The member's value: its finalize over its (renamed) fields in the fold."""
    return _replace_vars(summary.finalize, {f: projection(_component_field(summary, name, f))
                                            for f in summary.field_names})


def _welford(name: str, x: Expr) -> _Component:
    fields, identity, lift, combine = centred_moments(name, x)
    return _Component(fields, identity, lift, combine, True, None,
                      ["centred moments: Chan/Welford merge (count, mean, M2) chosen for numerical "
                       "stability"])


# ---------------------------------------------------------------- one group
@dataclass
class _Group:
    indices: tuple[str, ...]
    members: list[Reduce]


def _count(indices) -> Expr:
    out: Expr = Extent(indices[0])
    for i in indices[1:]:
        out = Call("mul", (out, Extent(i)))
    return out


def _factorise_group(group: _Group, number: int) -> tuple[Summary, tuple[Expr, ...], dict] | None:
    members = group.members
    inside = {m: [o for o in members if o is not m and o in set(walk(m)) - {m}] for m in members}
    args = _Args()
    names: dict[Reduce, str] = {}
    components: list[_Component] = []
    replacement: dict[Reduce, Expr] = {}
    leaders = [m for m in members if m.summary.name in _LEADERS and not inside[m]]
    for m in leaders:
        names[m] = _unused("r", names.values())
    handled: set[Reduce] = set()

    def projection(fold_name: str) -> Expr:
        return Var(f"@{fold_name}")   # patched into Reduce projections below

    # dependent sums on a leader: the repair-factor derivation (and the pullback)
    for leader in leaders:
        deps = [m for m in members if inside[m] == [leader] and m.summary.name == "sum"]
        if not deps:
            continue
        # the pure weight (the normaliser) first: fields read (r, l, u, ...)
        deps.sort(key=lambda d: d.args[0] != _weight_only(d, leader))
        for d in deps:
            names[d] = _unused("l" if d.args[0] == _weight_only(d, leader) else "u", names.values())
        comps = _rescaled_components(leader, deps, args, names)
        if comps is None:
            continue
        components.extend(comps)
        handled.update([leader, *deps])
        for m in (leader, *deps):
            replacement[m] = projection(names[m])

    # dependent sums on a sum: centred moments, or the separable expansion
    sums = [m for m in members if m.summary.name == "sum" and not inside[m]]
    for base in sums:
        deps = [m for m in members if inside[m] == [base] and m not in handled]
        if not deps:
            continue
        table = SymbolTable()
        S = Var("S")
        xs, Ss, y = to_sympy(base.args[0], table), table.symbol(S, real=True), sympy.Symbol("_y", real=True)
        count = to_sympy(_count(group.indices), table)
        bodies = {d: to_sympy(_substitute(d.args[0], {base: S}), table) for d in deps}

        def varies(c: sympy.Expr) -> bool:
            """Does a coefficient vary over the group's indices (so must be summed)?"""
            return any(set(free_indices(table.to_expr[v])) & set(group.indices)
                       for v in c.free_symbols if v in table.to_expr)

        centred = {}
        for d, body in bodies.items():
            shifted = sympy.expand(body.subs(xs, y + Ss / count))
            if Ss in shifted.free_symbols or not shifted.is_polynomial(y):
                break
            poly = sympy.Poly(shifted, y)
            if poly.degree() > 2 or any(varies(c) for c in poly.all_coeffs()):
                break
            centred[d] = dict((deg, c) for (deg,), c in poly.terms())
        else:
            name = _unused("s", names.values(), first_plain=False)
            names[base] = name
            comp = _welford(name, args.abstract(base.args[0], {}))
            components.append(comp)
            handled.update([base, *deps])
            n, mean, m2 = (projection(f.name) for f in comp.fields)
            # sum x = count * mean (every element counts once)
            replacement[base] = Call("mul", (mean, _count(group.indices)))
            for d, coeffs in centred.items():
                total = coeffs.get(0, 0) * table.symbol(n, real=True) \
                    + coeffs.get(2, 0) * table.symbol(m2, real=True)
                replacement[d] = from_sympy(total, table)
                comp.notes.append(f"{_fmt(d)} is a polynomial in (x - mean): through count and M2")
            continue
        if not all(body.is_polynomial(Ss) for body in bodies.values()):
            continue
        # separable expansion in powers of the base sum
        name = _unused("s", names.values(), first_plain=False)
        names[base] = name
        components.append(_base_component(base, name, args))
        handled.add(base)
        replacement[base] = _finalize_from(base.summary, name, projection)
        for d, body in bodies.items():
            total = sympy.Integer(0)
            for (deg,), coeff in sympy.Poly(sympy.expand(body), Ss).terms():
                if not varies(coeff):
                    term = coeff * count          # the same value at every position: times the count
                else:
                    term_name = _unused(f"{name}_p{deg}", names.values())
                    names[term_name] = term_name
                    term_sum = Reduce(BUILTINS["sum"], group.indices, (from_sympy(coeff, table),))
                    components.append(_base_component(term_sum, term_name, args))
                    term = table.symbol(projection(term_name), real=True)
                total += term * table.symbol(projection(name), real=True) ** deg
            components[-1].notes.append(f"separable: {_fmt(d)} expanded in powers of {name} into "
                                        f"independent sums; no stable merge is known for this form")
            replacement[d] = from_sympy(total, table)
            handled.add(d)

    # everything else in the group folds alongside in the same pass
    for m in members:
        if m in handled:
            continue
        if inside[m]:
            return None          # a dependency no rule resolves: leave the group as it is
        name = names.get(m) or _unused("s", names.values(), first_plain=False)
        names[m] = name
        components.append(_base_component(m, name, args))
        replacement[m] = _finalize_from(m.summary, name, projection)
        handled.add(m)

    fields = [f for c in components for f in c.fields]
    summary = Summary(
        name=f"fold{number}_{'_'.join(f.name for f in fields)}",
        fields=tuple(fields),
        arity=len(args.exprs),
        identity=tuple(i for c in components for i in c.identity),
        lift=tuple(e for c in components for e in c.lift),
        combine=tuple(e for c in components for e in c.combine),
        finalize=Var(fields[0].name),
        commutative=all(c.commutative for c in components),
        rescaled=tuple(c.rescaled for c in components if c.rescaled is not None),
        notes=tuple(n for c in components for n in c.notes),
    )
    summary = _with_laws(summary)
    fold = Reduce(summary, group.indices, tuple(args.exprs))
    patch = {f"@{f.name}": replace(fold, result=f.name) for f in fields}
    return summary, tuple(args.exprs), {m: _replace_vars(e, patch) for m, e in replacement.items()}


@lru_cache(maxsize=256)
def _with_laws(summary: Summary) -> Summary:
    """Laws are checked, never assumed: a derived summary that failed one would
    be a bug in this pass, reported as a LawError with its counterexample."""
    return require_laws(summary)


def _unused(base: str, taken, first_plain: bool = True) -> str:
    """`base` (if first_plain), else base2, base3... (base1, base2... otherwise),
    the first not taken: field names stay unique in a product summary."""
    taken = set(taken)
    numbered = (f"{base}{n}" for n in count(2 if first_plain else 1))
    return next(c for c in chain([base] if first_plain else [], numbered) if c not in taken)


def _weight_only(d: Reduce, leader: Reduce) -> Expr:
    """The body of d if it is a pure weight (no value factor): exp(x - r) alone."""
    num, den = factors(d.args[0])
    return d.args[0] if all(leader in set(walk(f)) for f in num + den) else None


def _fmt(e: Expr) -> str:
    from ..ir import format_expr
    return format_expr(e)


# ---------------------------------------------------------------- the pass
def _groups(statements) -> list[_Group]:
    """Reductions that can share one pass: the same indices, evaluated in the same
    loop context (a reduction that varies over an enclosing reduction's index is
    computed inside that loop, so it only joins reductions of that loop), and,
    when a member reads another statement's result, only within its statement.
    Several outputs under one softmax over inputs thus share one fold."""
    outputs = {st.name for st in statements}
    by_key: dict[tuple, list[Reduce]] = {}

    def visit(e: Expr, enclosing: frozenset, statement: str) -> None:
        if isinstance(e, Reduce) and e.result is None:
            reads_results = any(isinstance(n, Access) and n.tensor in outputs for n in walk(e))
            context = frozenset(free_indices(e)) & enclosing
            key = (e.indices, context, statement if reads_results or context else None)
            if e not in by_key.setdefault(key, []):
                by_key[key].append(e)
        inner = enclosing | set(e.indices) if isinstance(e, Reduce) else enclosing
        for c in children(e):
            visit(c, inner, statement)

    for st in statements:
        visit(st.expr, frozenset(), st.name)
    groups = []
    for key, members in by_key.items():
        groups += [_Group(key[0], part) for part in _connected(members) if len(part) > 1]
    return groups


def _connected(members: list[Reduce]) -> list[list[Reduce]]:
    """Split reductions into parts worth one fold: two belong together when one
    reads the other, or when one varies over a subset of the other's indices
    (the normaliser l over i and the numerator u over i, j); reductions over
    unrelated index sets would only multiply each other's work."""
    parent = list(range(len(members)))

    def find(k: int) -> int:
        while parent[k] != k:
            parent[k] = parent[parent[k]]
            k = parent[k]
        return k

    for a, ma in enumerate(members):
        for b, mb in enumerate(members[:a]):
            fa, fb = set(free_indices(ma)), set(free_indices(mb))
            if ma in set(walk(mb)) or mb in set(walk(ma)) or fa <= fb or fb <= fa:
                parent[find(a)] = find(b)
    parts: dict[int, list[Reduce]] = {}
    for k, m in enumerate(members):
        parts.setdefault(find(k), []).append(m)
    return list(parts.values())


def factorise(program: Program) -> Program:
    exprs = [st.expr for st in program.statements]
    for number, group in enumerate(_groups(program.statements), start=1):
        result = _factorise_group(group, number)
        if result is not None:
            # the projections' formulas (sum x = count * mean, ...) simplify in context
            exprs = [e if (new := _substitute(e, result[2])) == e else simplify(new) for e in exprs]
    return replace(program, statements=tuple(
        replace(st, expr=e) for st, e in zip(program.statements, exprs)))
