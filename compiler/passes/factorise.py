"""factorise: turn the reductions over one index into a single pass in one
derived summary.

Reductions over the same indices, in the same loop context, form a group.
Inside a group, the rules of RULES are tried in order, each on every member
that reads no other member (its anchor) together with the members that read
only the anchor.  Their preconditions are algebraic properties of the
summaries (compiler.algebra.properties), not names:
- repair: the anchor is an extremum (its merge selects one of two states, its
  identity is infinite) and its readers add their states.  With r standing for
  the anchor, a reader's body is w(x, r) * v(x); if h(r, r') = w(x, r') /
  w(x, r) is free of the element x (sympy), the reader is kept relative to the
  running leader and repaired when it moves:
      t = t_a * h(r_a, r) + t_b * h(r_b, r),   r = max(r_a, r_b).
  Readers with one weight share it (the pullback: the weights are computed once
  for every value v_k); each further weight gets its own component.  A value of
  degree 1 in the leader's own argument is held centred on the leader,
  v - c r, repaired with its x-free shift through the weight sum l:
      t = h(r_a, r) (t_a + s(r_a, r) l_a) + h(r_b, r) (t_b + s(r_b, r) l_b),
  and read as t + c r l (the leader then cancels: entropy is log l - u_c / l);
- centred moments: the anchor adds its states and every reader is a
  polynomial of any degree p in (x - S / count) with x-free coefficients:
  the moments (count, mean, err, M2..Mp) with Pébay's stable pairwise merge
  (Chan's, i.e. Welford's, for p = 2), the mean compensated (mean + err);
- separable: the readers are polynomials in the anchor S: expanded in powers
  of S into independent sums (one pass, not numerically guarded).
Every other member folds alongside.  All of them form one product summary;
each original reduction becomes a projection (a field, or a formula of
fields) of its fold.  Which rule applied to which anchor, and why the others
did not, is kept in the summary's notes (explain prints them).
"""
from __future__ import annotations

import math
from functools import lru_cache
from dataclasses import dataclass, field, replace

import sympy

from ..algebra import BUILTINS, Block, Field, Rescaled, Summary
from ..algebra.laws import identity_combined, require_laws
from ..algebra.moments import centred_moments, tile_sums
from ..algebra.properties import additive, extremum
from ..errors import LawError
from ..ir import (Access, Call, Const, Expr, Extent, Program, Reduce, Var, children, format_expr,
                  free_indices, nodes, postorder, substitute, unused_name, with_children)
from .symbolic import SymbolTable, from_sympy, to_sympy
from .stabilise import cancel_in_branches, factors, product, simplify

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
    blocks: tuple[Block, ...] = ()
    # a dependent's value as a formula of the fields where it is not one field (a centred sum)
    reads: dict[str, Expr] = field(default_factory=dict)


class _Args:
    """Element expressions of a group, abstracted as Vars x0, x1, ..."""

    def __init__(self):
        self.exprs: list[Expr] = []

    def var(self, e: Expr) -> Var:
        if e not in self.exprs:
            self.exprs.append(e)
        return Var(f"x{self.exprs.index(e)}")

    def abstract(self, e: Expr, named: dict[Expr, Var]) -> Expr:
        """Replace group members by their Vars and maximal member-free parts by args
        (each shared subtree once)."""
        holding: dict[int, bool] = {}           # id of a node -> whether it holds a member
        for n in postorder(e, unique=True):
            holding[id(n)] = n in named or any(holding[id(c)] for c in children(n))
        done: dict[int, Expr] = {}

        def visit(n: Expr) -> Expr:
            if id(n) not in done:
                if n in named:
                    done[id(n)] = named[n]
                elif not holding[id(n)] or not children(n):
                    done[id(n)] = self.var(n) if not isinstance(n, Const) else n
                else:
                    done[id(n)] = with_children(n, tuple(visit(c) for c in children(n)))
            return done[id(n)]
        return visit(e)


def _around_reductions(e: Expr, fn) -> Expr:
    """`fn` applied bottom-up outside every reduction: a body stays as written, so
    the groups found before any was factorised still match it (and so does the
    masked form where(m <= i, x, -inf) that the schedule reads loop bounds from)."""
    if isinstance(e, Reduce):
        return e
    return fn(with_children(e, tuple(_around_reductions(c, fn) for c in children(e))))


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
    # a weight that is identically 0 (x - r - (x - r)) has no ratio: 0/0 is NaN
    if not ratio.free_symbols <= allowed or ratio.has(sympy.nan, sympy.zoo):
        return None
    return from_sympy(ratio, table)


def derive_shift(value: Expr) -> Expr | None:
    """s(r, r_new) with value(x, r_new) = value(x, r) + s; None if s depends on x,
    or if the value does not read the leader (s = 0)."""
    table = SymbolTable()
    r, r_new = table.symbol(Var("r"), real=True), table.symbol(Var("r_new"), real=True)
    v_old = _sym(value, table)
    shift = sympy.simplify(v_old.subs(r, r_new) - v_old)
    if shift == 0 or not shift.free_symbols <= {r, r_new}:
        return None
    return from_sympy(shift, table)


def _centring(value: Expr, lead_arg: Expr) -> Expr | None:
    """c when `value` is c * x_lead + c0(x), of degree 1 in the leader's own argument
    with c free of the element; else None.  Such a value is held centred, v - c r:
    near the leader, where the weights are largest, x_lead - r is small and exact,
    and the result's c r (times the weight sum) can cancel against the leader
    symbolically instead of in floating point (entropy: log l - u_c / l)."""
    if not isinstance(lead_arg, Var):
        return None
    table = SymbolTable()
    x, v = _sym(lead_arg, table), _sym(value, table)
    if x not in v.free_symbols or not v.is_polynomial(x):
        return None
    poly = sympy.Poly(v, x)
    c = poly.coeff_monomial(x)
    if poly.degree() != 1 or c.free_symbols:
        return None
    return from_sympy(c, table)


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
        has_r = lambda f: any(n == r for n in nodes(f))  # noqa: E731
        w = product([f for f in num if has_r(f)], [f for f in den if has_r(f)])
        v = product([f for f in num if not has_r(f)], [f for f in den if not has_r(f)])
        by_weight.setdefault(w, []).append((names[d], v))
    components = []
    taken = set(names.values())
    for k, (weight, values) in enumerate(by_weight.items()):
        lf = names[leader] if k == 0 else unused_name("r", taken)
        taken.add(lf)
        component = _rescaled_component(leader, lf, weight, values, args, taken)
        if component is None:
            return None
        components.append(component)
    if len(components) > 1:
        components[0].notes.append(f"{len(components)} weights on the {extremum(leader.summary)} over "
                                   f"{', '.join(leader.indices)}: each has its own repair and leader copy")
    return components


def _rescaled_component(leader: Reduce, lf: str, weight: Expr, values: list[tuple[str, Expr]],
                        args: _Args, taken: set[str]) -> _Component | None:
    op, identity = _LEADERS[extremum(leader.summary)]
    lead_arg = args.abstract(leader.args[0], {})
    repair = derive_repair(weight)
    if repair is None:
        return None
    notes = [f"dependent reductions over {', '.join(leader.indices)}: "
             f"{', '.join(n for n, _ in values)} use{'s' * (len(values) == 1)} the "
             f"{extremum(leader.summary)} {lf}",
             f"weight w(x, r) = {format_expr(weight)}; repair h(r, r') = w(x, r') / w(x, r) = "
             f"{format_expr(repair)} (free of x: sympy)"]
    # Centring lives here, not in stabilise: only once the group is factorised is the
    # running leader r a field beside the dependent sums, so that a read of u can be
    # written through the fields as u_c + c r l and the results simplify around r.
    values, reads, shifts = _centred_values(lf, lead_arg, values, taken, notes)
    a_r, b_r = Var(f"a.{lf}"), Var(f"b.{lf}")
    new_leader = Call(op, (a_r, b_r))
    reference = _stand_in(new_leader, identity)

    def h(old: Expr) -> Expr:
        return _replace_vars(repair, {"r": old, "r_new": reference})

    def repaired(side: str, n: str, old: Expr) -> Expr:
        """side.n moved to the common leader: h * (t + s * t_w) for a value that reads r."""
        if n not in shifts:
            return Call("mul", (Var(f"{side}.{n}"), h(old)))
        s, total = shifts[n]
        moved = _replace_vars(s, {"r": _stand_in(old, identity), "r_new": reference})
        moved_total = Call("mul", (moved, Var(f"{side}.{total}")))
        return Call("mul", (h(old), Call("add", (Var(f"{side}.{n}"), moved_total))))

    at_lead = {"r": _stand_in(lead_arg, identity)}
    fields = [Field(lf)] + [Field(n) for n, _ in values]
    lift = [lead_arg] + [Call("mul", (_replace_vars(weight, at_lead), _replace_vars(v, at_lead)))
                         if v != Const(1) else _replace_vars(weight, at_lead)
                         for _, v in values]
    combine = [new_leader] + [Call("add", (repaired("a", n, a_r), repaired("b", n, b_r))) for n, _ in values]
    structure = Rescaled(lf, extremum(leader.summary), lead_arg, weight, repair, tuple(values),
                         tuple((n, s, total) for n, (s, total) in shifts.items()))
    if len(values) > 1:
        notes.append(f"pullback: {', '.join(n for n, _ in values)} share the weight w, computed once")
    return _Component(fields, [Const(identity)] + [Const(0.0)] * len(values), lift, combine,
                      True, structure, notes, reads=reads)


def _centred_values(lf: str, lead_arg: Expr, values: list[tuple[str, Expr]], taken: set[str],
                    notes: list[str]
                    ) -> tuple[list[tuple[str, Expr]], dict[str, Expr], dict[str, tuple[Expr, str]]]:
    """The values with those of degree 1 in the leader's argument held centred on
    the leader (`_centring`): (the component's values, the reads of the centred
    dependents as formulas of fields, {field: (shift s(r, r_new), weight-sum field)}).
    A centred value needs the weight sum (value 1) among the fields to be repaired
    and read back; it is added where no dependent is the pure weight."""
    r = Var("r")
    centres = {n: c for n, v in values if (c := _centring(v, lead_arg)) is not None}
    if not centres:
        return values, {}, {}
    total = next((n for n, v in values if v == Const(1)), None)
    if total is None:
        total = unused_name("l", taken)
        taken.add(total)
        values = [(total, Const(1)), *values]
        notes.append(f"{total} = sum of the weight alone, added to repair and read the centred sums")
    out, reads, shifts = [], {}, {}
    for n, v in values:
        if n not in centres:
            out.append((n, v))
            continue
        c = centres[n]
        held = unused_name(f"{n}_c", taken)
        taken.add(held)
        centred = simplify(Call("sub", (v, r if c == Const(1) else Call("mul", (c, r)))))
        shift = derive_shift(centred)
        out.append((held, centred))
        shifts[held] = (shift, total)
        lead = Var(lf) if c == Const(1) else Call("mul", (c, Var(lf)))
        reads[n] = Call("add", (Var(held), Call("mul", (lead, Var(total)))))
        notes.append(f"centred on {lf}: {n} held as {held}, v = {format_expr(centred)}, shift s(r, r') = "
                     f"v(x, r') - v(x, r) = {format_expr(shift)} (free of x: sympy); repaired as h(r, r') * "
                     f"({held} + s(r, r') * {total}); read as {n} = {format_expr(reads[n])}")
    return out, reads, shifts


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


def _centred(name: str, x: Expr, degree: int) -> _Component:
    fields, identity, lift, combine = centred_moments(name, x, degree)
    merge = "Chan/Welford merge (count, mean, M2)" if degree == 2 else \
        f"Pébay's pairwise merge (count, mean, M2..M{degree})"
    return _Component(fields, identity, lift, combine, True, None,
                      [f"centred moments: {merge}, the mean compensated (mean + err), "
                       f"chosen for numerical stability; a tile's state from sums over it "
                       f"(corrected two-pass)"], (tile_sums(name, x, degree),))


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


@dataclass
class _State:
    """What the rules of one group build: components of the product summary and,
    per original reduction, its value as a formula of the fold's fields."""

    group: _Group
    inside: dict[Reduce, list[Reduce]]
    args: _Args = field(default_factory=_Args)
    names: dict = field(default_factory=dict)
    components: list[_Component] = field(default_factory=list)
    replacement: dict[Reduce, Expr] = field(default_factory=dict)
    handled: set = field(default_factory=set)
    report: list[str] = field(default_factory=list)

    def reading(self, anchor: Reduce) -> list[Reduce]:
        """Unhandled members whose only member-read is `anchor`."""
        return [m for m in self.group.members if self.inside[m] == [anchor] and m not in self.handled]

    @staticmethod
    def projection(field_name: str) -> Expr:
        return Var(f"@{field_name}")   # patched into Reduce projections once the fold exists


# ---------------------------------------------------------------- the rules
def _repair_rule(st: _State, leader: Reduce) -> str | None:
    """Dependent sums on an extremum leader: w(x, r) v(x) with an x-free repair
    h(r, r') = w(x, r') / w(x, r); one weight shared by several values is the
    pullback.  Returns None when it applied, else why not."""
    if extremum(leader.summary) is None:
        return "its merge does not select one of two states (not an extremum with an infinite identity)"
    deps = [d for d in st.reading(leader) if additive(d.summary)]
    if not deps:
        return "no additive reduction reads it"
    deps.sort(key=lambda d: d.args[0] != _weight_only(d, leader))     # the normaliser first: (r, l, u)
    names = dict(st.names)
    for d in deps:
        names[d] = unused_name("l" if d.args[0] == _weight_only(d, leader) else "u", names.values())
    comps = _rescaled_components(leader, deps, st.args, names)
    if comps is None:
        return "a weight has no repair factor free of the element (sympy)"
    st.names.update(names)
    st.components.extend(comps)
    st.handled.update([leader, *deps])
    reads = {n: e for c in comps for n, e in c.reads.items()}
    projections = {f.name: st.projection(f.name) for c in comps for f in c.fields}
    for m in (leader, *deps):
        st.replacement[m] = _replace_vars(reads.get(names[m], Var(names[m])), projections)
    return None


def _moments_rule(st: _State, base: Reduce) -> str | None:
    """Sums that read a sum S and are polynomials in x - S / n: the centred
    moments (count, mean, err, M2, ..., Mp) with Pébay's stable pairwise merge,
    the mean compensated (algebra.moments)."""
    deps = _additive_readers(st, base)
    if isinstance(deps, str):
        return deps
    table, Ss, bodies, varies = _in_powers_of(st, base, deps)
    xs, y = to_sympy(base.args[0], table), sympy.Symbol("_y", real=True)
    count = to_sympy(_count(st.group.indices), table)
    centred = {}
    for d, body in bodies.items():
        shifted = sympy.expand(body.subs(xs, y + Ss / count))
        if Ss in shifted.free_symbols or not shifted.is_polynomial(y):
            return f"{format_expr(d)} is not a polynomial in (x - mean)"
        poly = sympy.Poly(shifted, y)
        if any(varies(c) for c in poly.all_coeffs()):
            return f"{format_expr(d)} has coefficients that vary over {', '.join(st.group.indices)}"
        centred[d] = dict((deg, c) for (deg,), c in poly.terms())
    degree = max(2, *(max(c) for c in centred.values()))
    name = unused_name("s", st.names.values(), first_plain=False)
    st.names[base] = name
    comp = _centred(name, st.args.abstract(base.args[0], {}), degree)
    st.components.append(comp)
    st.handled.update([base, *deps])
    n, mean, err, *moments = (st.projection(f.name) for f in comp.fields)
    # sum x = count * mean, the mean compensated (mean + err: algebra.moments)
    st.replacement[base] = Call("mul", (Call("add", (mean, err)), _count(st.group.indices)))
    # sum (x - mean)^k is M_k; M_0 = count and M_1 = 0
    sums = {0: n, **{k: m for k, m in enumerate(moments, start=2)}}
    for d, coeffs in centred.items():
        total = sum((c * table.symbol(sums[k], real=True) for k, c in coeffs.items() if k != 1), sympy.Integer(0))
        st.replacement[d] = from_sympy(total, table)
        comp.notes.append(f"{format_expr(d)} is a polynomial of degree {max(coeffs)} in (x - mean): "
                          f"through the centred moments")
    return None


def _separable_rule(st: _State, base: Reduce) -> str | None:
    """Sums that read a sum S polynomially: expanded in powers of S into
    independent sums (one pass; no stable merge is known for the form)."""
    deps = _additive_readers(st, base)
    if isinstance(deps, str):
        return deps
    table, Ss, bodies, varies = _in_powers_of(st, base, deps)
    if not all(body.is_polynomial(Ss) for body in bodies.values()):
        return "a reader is not a polynomial in it"
    count = to_sympy(_count(st.group.indices), table)
    xs, y = to_sympy(base.args[0], table), sympy.Symbol("_y", real=True)
    for d, body in bodies.items():
        centred = sympy.expand(body.subs(xs, y + Ss / count))
        if Ss not in centred.free_symbols and centred.is_polynomial(y) and sympy.Poly(centred, y).degree() >= 2:
            # sum (x - mean)^p expanded in powers of the mean cancels catastrophically once
            # the mean is large against the spread: left as two passes (the mean, then the sum)
            return (f"{format_expr(d)} is a power of (x - mean) of degree {sympy.Poly(centred, y).degree()}: "
                    f"its expansion in powers of the mean cancels; it folds after the mean, in a second pass")
    name = unused_name("s", st.names.values(), first_plain=False)
    st.names[base] = name
    st.components.append(_base_component(base, name, st.args))
    st.handled.add(base)
    st.replacement[base] = _finalize_from(base.summary, name, st.projection)
    for d, body in bodies.items():
        total = sympy.Integer(0)
        for (deg,), coeff in sympy.Poly(sympy.expand(body), Ss).terms():
            if not varies(coeff):
                term = coeff * count          # the same value at every position: times the count
            else:
                term_name = unused_name(f"{name}_p{deg}", st.names.values())
                st.names[term_name] = term_name
                term_sum = Reduce(BUILTINS["sum"], st.group.indices, (from_sympy(coeff, table),))
                st.components.append(_base_component(term_sum, term_name, st.args))
                term = table.symbol(st.projection(term_name), real=True)
            total += term * table.symbol(st.projection(name), real=True) ** deg
        st.components[-1].notes.append(f"separable: {format_expr(d)} expanded in powers of {name} into "
                                       f"independent sums; no stable merge is known for this form")
        st.replacement[d] = from_sympy(total, table)
        st.handled.add(d)
    return None


def _additive_readers(st: _State, base: Reduce) -> list[Reduce] | str:
    """The moments' and separable rules' precondition: the anchor and every reader
    add their states.  The readers, or why not."""
    if not additive(base.summary):
        return "it does not add its states"
    deps = st.reading(base)
    if not deps or not all(additive(d.summary) for d in deps):
        return "no additive reduction reads it"
    return deps


def _in_powers_of(st: _State, base: Reduce, deps: list[Reduce]):
    """The readers' bodies in sympy with the base sum as the symbol S, and a test
    of whether a coefficient varies over the group's indices (must be summed)."""
    table = SymbolTable()
    Ss = table.symbol(Var("S"), real=True)
    bodies = {d: to_sympy(substitute(d.args[0], {base: Var("S")}), table) for d in deps}

    def varies(c: sympy.Expr) -> bool:
        return any(set(free_indices(table.to_expr[v])) & set(st.group.indices)
                   for v in c.free_symbols if v in table.to_expr)
    return table, Ss, bodies, varies


# name, what it derives, the rule; tried in this order on every member that reads
# no other member (its anchor), for the members that read only the anchor
RULES = (
    ("repair", "dependent sums on a running extremum, rescaled by a derived repair factor", _repair_rule),
    ("centred moments", "Chan/Welford moments of the sums that read a sum", _moments_rule),
    ("separable", "polynomials in a sum, expanded into independent sums", _separable_rule),
)


def _factorise_group(group: _Group, number: int) -> tuple[Summary, tuple[Expr, ...], dict] | list[str]:
    """The group's derived summary, its arguments and the replacements of its members;
    or, where no rule resolves a dependency, why (the rules' reports)."""
    members = group.members
    inside = {id(m): set(nodes(m)) - {m} for m in members}
    st = _State(group, {m: [o for o in members if o is not m and o in inside[id(m)]] for m in members})
    for m in members:
        if extremum(m.summary) and not st.inside[m]:
            st.names[m] = unused_name("r", st.names.values())
    for rule, _, apply in RULES:
        for anchor in members:
            if anchor in st.handled or st.inside[anchor] or not st.reading(anchor):
                continue
            why_not = apply(st, anchor)
            st.report.append(f"rule {rule} on {format_expr(anchor)}: " + ("applied" if why_not is None
                                                                   else f"not applied: {why_not}"))

    # everything else in the group folds alongside in the same pass
    for m in members:
        if m in st.handled:
            continue
        if st.inside[m]:
            # a dependency no rule resolves: leave the group as it is, and say why
            return [f"reductions over {', '.join(group.indices)} left as they are (a pass per dependency):",
                    *(f"  {line}" for line in st.report)]
        name = st.names.get(m) or unused_name("s", st.names.values(), first_plain=False)
        st.names[m] = name
        st.components.append(_base_component(m, name, st.args))
        st.replacement[m] = _finalize_from(m.summary, name, st.projection)
        st.handled.add(m)
    components, args, replacement = st.components, st.args, st.replacement
    if st.report:
        components[0].notes[:0] = st.report

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
        blocks=tuple(b for c in components for b in c.blocks),
        notes=tuple(n for c in components for n in c.notes),
    )
    # equal summaries share one law check; the notes (excluded from equality) stay this derivation's
    summary = replace(summary, laws=_checked_laws(summary))
    fold = Reduce(summary, group.indices, tuple(args.exprs))
    patch = {f"@{f.name}": replace(fold, result=f.name) for f in fields}
    return summary, tuple(args.exprs), {m: _replace_vars(e, patch) for m, e in replacement.items()}


@lru_cache(maxsize=256)
def _checked_laws(summary: Summary):
    """Laws are checked, never assumed: a derived summary that failed one would
    be a bug in this pass, reported as a LawError with its counterexample.  Its
    identity combined with itself must be the identity exactly: the oracle pads
    with it and masked elements lift to it, unguarded."""
    inexact = identity_combined(summary)
    if inexact is not None:
        raise LawError(f"derived summary '{summary.name}' is not exact at its identity: {inexact}")
    return require_laws(summary).laws


def _weight_only(d: Reduce, leader: Reduce) -> Expr:
    """The body of d if it is a pure weight (no value factor): exp(x - r) alone."""
    num, den = factors(d.args[0])
    return d.args[0] if all(leader in set(nodes(f)) for f in num + den) else None


# ---------------------------------------------------------------- the pass
def _groups(statements) -> list[_Group]:
    """Reductions that can share one pass: the same indices, evaluated in the same
    loop context (a reduction that varies over an enclosing reduction's index is
    computed inside that loop, so it only joins reductions of that loop), and,
    when a member reads another statement's result, only within its statement.
    Several outputs under one softmax over inputs thus share one fold."""
    outputs = {st.name for st in statements}
    by_key: dict[tuple, list[Reduce]] = {}
    visited: set[tuple] = set()

    def visit(e: Expr, enclosing: frozenset, statement: str) -> None:
        if (id(e), enclosing, statement) in visited:       # a subtree shared by several parents
            return
        visited.add((id(e), enclosing, statement))
        if isinstance(e, Reduce) and e.result is None:
            reads_results = any(isinstance(n, Access) and n.tensor in outputs for n in nodes(e))
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
    reads the other (the normaliser l over i and the numerator u over i, j both
    read the running max), or when they vary over the same indices (a mean and a
    mean of squares).  Independent reductions over different index sets would
    only multiply each other's work: in one fold, a row sum D[i] beside a
    contraction G[i,m] is lifted to the [i, m] tile (and is no longer a tl.dot)."""
    parent = list(range(len(members)))
    inside = [set(nodes(m)) for m in members]

    def find(k: int) -> int:
        while parent[k] != k:
            parent[k] = parent[parent[k]]
            k = parent[k]
        return k

    for a, ma in enumerate(members):
        for b, mb in enumerate(members[:a]):
            fa, fb = set(free_indices(ma)), set(free_indices(mb))
            if ma in inside[b] or mb in inside[a] or fa == fb:
                parent[find(a)] = find(b)
    parts: dict[int, list[Reduce]] = {}
    for k, m in enumerate(members):
        parts.setdefault(find(k), []).append(m)
    return list(parts.values())


def _empty_safe(e: Expr) -> Expr:
    """`e` with the leader in a product with the weight sum of its centred reads
    (u = u_c + r l) read through its stand-in: on an empty fold r is at its
    infinite identity and l = 0, and u is 0, not inf * 0; everywhere else the
    stand-in is r.  (After the cancellation, which needs r itself.)"""
    num, den = factors(e)
    for k, f in enumerate(num):
        if isinstance(f, Reduce) and f.result is not None:
            for rs in f.summary.rescaled:
                totals = {total for _, _, total in rs.shifts}
                if f.result == rs.leader and any(replace(f, result=t) in num for t in totals):
                    return product([*num[:k], _stand_in(f, _LEADERS[rs.leader_monoid][1]), *num[k + 1:]], den)
    return e


def factorise(program: Program) -> Program:
    exprs = [st.expr for st in program.statements]
    notes: list[str] = []
    for number, group in enumerate(_groups(program.statements), start=1):
        result = _factorise_group(group, number)
        if isinstance(result, list):
            notes += result
            continue
        # the projections' formulas (sum x = count * mean, u = u_c + r l, ...) simplify in
        # context, the leader cancelling inside the branches of a where
        exprs = [e if (new := substitute(e, result[2])) == e
                 else _around_reductions(_around_reductions(simplify(new), cancel_in_branches), _empty_safe)
                 for e in exprs]
    return replace(program, statements=tuple(replace(st, expr=e) for st, e in zip(program.statements, exprs)),
                   notes=program.notes + tuple(notes))
