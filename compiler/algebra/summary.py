"""Summaries are values: a carrier of named fields, an identity, and lift /
combine / finalize written as IR formulas over Vars.

- lift:     one formula per field, over the element arguments `x0, x1, ...`
- combine:  one formula per field, over `a.<field>` (left) and `b.<field>` (right)
- finalize: one formula over the field names

Because the formulas are data, the same summary drives the oracle, the chunked
executor, the law checker (sympy) and code generation.
"""
from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from functools import lru_cache

from ..ir import Call, Const, Expr, Var, transform, walk
from ..ops import FLOAT, INT, OPS


@dataclass(frozen=True, slots=True)
class Field:
    """One field of a summary's state: a name and a dtype ("float" or "int")."""

    name: str
    dtype: str = FLOAT


@dataclass(frozen=True, slots=True)
class Rescaled:
    """Structure of the fields that the repair-factor derivation produces.

    leader r = max (or min) over `leader_arg`, and fields
        t_k = sum w(x, r) * v_k(x, r)
    whose weight obeys w(x, r') = h(r, r') * w(x, r), h free of the element x.
    A value may read the leader by an x-free shift, v_k(x, r') = v_k(x, r) +
    s_k(r, r') (a value held centred on the leader, x - r: factorise); it is
    repaired through the component's weight sum t_w = sum w(x, r):
        t_k' = h(r, r') * (t_k + s_k(r, r') * t_w).
    A streaming fold keeps (r, t_1..t_k):
        r' = max(r, max over the tile of leader_arg)
        t_k' = (t_k + s_k(r, r') * t_w) * h(r, r') + sum over the tile of w(x, r') * v_k(x, r')
    (the last sum is a matrix product when v_k carries another free index).
    Formulas use Vars x0, x1, ... for the element arguments, `r` and `r_new`."""

    leader: str                            # field name of r
    leader_monoid: str                     # "max" or "min"
    leader_arg: Expr                       # over x-vars
    weight: Expr                           # w, over x-vars and Var("r")
    repair: Expr                           # h, over Var("r") and Var("r_new")
    values: tuple[tuple[str, Expr], ...]   # (field name, v_k over x-vars and Var("r"))
    # (field name, s_k over Var("r") and Var("r_new"), the weight-sum field t_w) for the
    # values that read the leader; every other value is free of r
    shifts: tuple[tuple[str, Expr, str], ...] = ()
    base2: bool = False                    # weights evaluated as exp2(x log2 e - r log2 e) (passes/base2.py)

    def shift_of(self, field_name: str) -> tuple[Expr, str] | None:
        """(s(r, r_new), weight-sum field) of a value that reads the leader, else None."""
        return next(((s, w) for f, s, w in self.shifts if f == field_name), None)


@dataclass(frozen=True, slots=True)
class Block:
    """Some fields of a tile's state computed at once from sums over the tile's
    elements, where folding the tile with the combine costs more (the centred
    moments divide once per merge, and a tile's tree of merges has a merge per
    element; the sums are plain tl.sum reductions).

    `sums`: (name, summand) in order; a summand is a formula over the element
    arguments x0, x1, ... and the names of earlier sums, summed over the tile (an
    empty tile sums to 0).  `fields`: (field, formula over the sums' names).  In
    exact arithmetic the fields equal the fold of the lifted elements by the
    combine; the law checker samples that ("tile formula")."""

    sums: tuple[tuple[str, Expr], ...]
    fields: tuple[tuple[str, Expr], ...]

    def needed(self, fields) -> tuple[tuple[str, Expr], ...]:
        """The sums that the formulas of `fields` read, directly or through other sums."""
        want = {n.name for f, e in self.fields if f in fields for n in walk(e) if isinstance(n, Var)}
        for name, summand in reversed(self.sums):
            if name in want:
                want |= {n.name for n in walk(summand) if isinstance(n, Var)}
        return tuple((name, summand) for name, summand in self.sums if name in want)


@dataclass(frozen=True, slots=True)
class Summary:
    """An associative mergeable summary (a monoid) as a value.

    The formulas are IR expressions over variables, so the same value drives
    the float64 oracle, the chunked executor, the law checker (sympy) and code
    generation. Built-in summaries are `compiler.algebra.BUILTINS`; users make
    theirs with `compiler.summary`; `factorise` derives the rest.

    Attributes:
        name: the name a program uses (`sum`, `fold1_r_l_u`, ...).
        fields: the carrier: one `Field` per component of a state.
        arity: how many element arguments one element lifts from (`x0, x1, ...`).
        identity: one constant per field: the state of an empty fold.
        lift: one formula per field over `x0, x1, ...`: element -> state.
        combine: one formula per field over `a.<field>` (the earlier state) and
            `b.<field>` (the later one).
        finalize: one formula over the field names: state -> result.
        commutative: whether `combine(a, b) == combine(b, a)`; if not, merges
            keep index order.
        rescaled: for derived summaries, the leader / weight / repair structure
            a backend may stream with a running leader.
        blocks: fields a backend may compute for a whole tile from sums over it
            (`Block`), instead of folding the tile's lifted elements.
        notes: how the summary was derived (printed by `explain`); not compared.
        laws: the law report once checked; not compared.
    """

    name: str
    fields: tuple[Field, ...]
    arity: int                     # number of element arguments
    identity: tuple[Const, ...]
    lift: tuple[Expr, ...]
    combine: tuple[Expr, ...]
    finalize: Expr
    commutative: bool
    # Fields that follow the rescaling pattern (a backend may stream them with a
    # running leader and tl.dot); every other field is folded generically.
    rescaled: tuple[Rescaled, ...] = ()
    blocks: tuple[Block, ...] = ()
    # How the summary came to be and which laws were checked (shown by explain);
    # excluded from equality so that two derivations of one monoid compare equal.
    notes: tuple[str, ...] = field(default=(), compare=False)
    laws: object = field(default=None, compare=False)   # algebra.laws.LawReport once checked

    @property
    def field_names(self) -> tuple[str, ...]:
        return tuple(f.name for f in self.fields)

    def arguments_of(self, field_name: str) -> frozenset[int]:
        """Positions of the element arguments a field depends on (through its
        lift and, transitively, the fields its combine reads): the field varies
        only over those arguments' indices."""
        return _field_arguments(self)[field_name]

    def restricted(self, fields: tuple[str, ...]) -> tuple["Summary", tuple[int, ...]]:
        """This summary on `fields` alone (closed under what their combines read: a
        union of independent parts, or the fields one projection needs), with just the
        element arguments those fields read, renumbered x0, x1, ... in order, and which
        of this summary's arguments they are.  The fields keep their names; the rescaled
        structures and tile blocks over them are kept, and so is the finalize where it
        reads only kept fields (else the first field's: every use projects a field)."""
        if tuple(fields) == self.field_names:
            return self, tuple(range(self.arity))
        index = {f: self.field_names.index(f) for f in fields}
        used = tuple(sorted(set().union(*(self.arguments_of(f) for f in fields))))
        names = {f"x{k}": f"x{j}" for j, k in enumerate(used)}

        def renumbered(e: Expr) -> Expr:
            return transform(e, lambda n: Var(names.get(n.name, n.name)) if isinstance(n, Var) else n)
        finalize = self.finalize
        if not {v.name for v in walk(finalize) if isinstance(v, Var)} <= set(fields):
            finalize = Var(fields[0])
        rescaled = tuple(
            replace(rs, leader_arg=renumbered(rs.leader_arg), weight=renumbered(rs.weight),
                    values=tuple((f, renumbered(v)) for f, v in rs.values if f in index),
                    shifts=tuple(sh for sh in rs.shifts if sh[0] in index))
            for rs in self.rescaled if rs.leader in index)
        # a tile formula stays where its fields all stay (its sums read only their arguments)
        blocks = tuple(replace(b, sums=tuple((n, renumbered(x)) for n, x in b.sums))
                       for b in self.blocks if all(f in index for f, _ in b.fields))
        part = replace(
            self, fields=tuple(self.fields[index[f]] for f in fields), arity=len(used),
            identity=tuple(self.identity[index[f]] for f in fields),
            lift=tuple(renumbered(self.lift[index[f]]) for f in fields),
            combine=tuple(self.combine[index[f]] for f in fields), finalize=finalize, rescaled=rescaled,
            blocks=blocks)
        return part, used

    def result_type(self, arg_types: tuple[str, ...]) -> str | None:
        """The type of finalize over the fields' types (field_types): an integer sum
        stays integral, argmax's position is an int; None for non-number arguments."""
        if any(t not in (INT, FLOAT) for t in arg_types):
            return None
        return formula_type(self.finalize, self.field_types(arg_types))

    def field_types(self, arg_types: tuple[str, ...]) -> dict[str, str]:
        """The type each field holds when the elements have `arg_types`: a field is
        integral while its lift and its combine keep integers integral (an integer
        sum, max or min folds exactly, in 64 bits), widened to float where either
        reaches a float (a Welford mean divides); a field declared int stays int."""
        types = {f.name: INT for f in self.fields}
        changed = True
        while changed:
            changed = False
            env = {f"x{k}": t for k, t in enumerate(arg_types)}
            env.update({f"{side}{n}": t for n, t in types.items() for side in ("a.", "b.")})
            for f, lift, combine in zip(self.fields, self.lift, self.combine):
                if types[f.name] == INT and f.dtype != INT and \
                        any(formula_type(e, env) != INT for e in (lift, combine)):
                    types[f.name], changed = FLOAT, True
        return types


def formula_type(e: Expr, types: Mapping[str, str]) -> str | None:
    """The type of a summary formula over Vars of the given types (None: ill-typed)."""
    if isinstance(e, Var):
        return types[e.name]
    if isinstance(e, Const):
        return INT if isinstance(e.value, int) and not isinstance(e.value, bool) else FLOAT
    if isinstance(e, Call):
        args = tuple(formula_type(a, types) for a in e.args)
        return None if None in args else OPS[e.op].result(args)
    return None


@lru_cache(maxsize=1024)
def independent_fields(summary: Summary) -> tuple[tuple[str, ...], ...]:
    """The fields of `summary` in groups that combine independently: no combine reads
    a field of another group, and a tile block keeps its fields in one (an argmax
    folded beside a logsumexp: two groups; a sum beside a sum: two)."""
    names = summary.field_names
    part = {f: f for f in names}

    def find(f: str) -> str:
        while part[f] != f:
            f = part[f]
        return f

    links = [(f, v.name.split(".", 1)[1]) for f, c in zip(names, summary.combine)
             for v in walk(c) if isinstance(v, Var) and "." in v.name]
    links += [(b.fields[0][0], f) for b in summary.blocks for f, _ in b.fields]
    links += [(rs.leader, f) for rs in summary.rescaled for f, _ in rs.values]
    for f, g in links:
        part[find(f)] = find(g)
    groups: dict[str, list[str]] = {}
    for f in names:
        groups.setdefault(find(f), []).append(f)
    return tuple(tuple(fields) for fields in groups.values())


def product_of(parts: tuple[Summary, ...]) -> tuple[Summary, tuple[dict[str, str], ...]]:
    """The product of independent summaries: one state holding every part's fields
    (renamed apart where two parts share a name: acc, acc_2), the parts' element
    arguments one after the other, each part's combine on its own fields.  A product
    of monoids is a monoid, so each part's law report stands for it (checked where
    the part was made).  Returns it and, per part, its field names in the product."""
    taken: set[str] = set()
    renames: list[dict[str, str]] = []
    for part in parts:
        names = {}
        for f in part.field_names:
            new, n = f, 1
            while new in taken:
                n += 1
                new = f"{f}_{n}"
            taken.add(new)
            names[f] = new
        renames.append(names)
    fields, identity, lift, combine, rescaled, blocks, notes = [], [], [], [], [], [], []
    offset = 0
    for part, names in zip(parts, renames):
        arguments = {f"x{k}": f"x{k + offset}" for k in range(part.arity)}
        states = {f"{side}.{f}": f"{side}.{g}" for f, g in names.items() for side in "ab"}

        def moved(e: Expr, table=arguments) -> Expr:
            return transform(e, lambda n: Var(table.get(n.name, n.name)) if isinstance(n, Var) else n)
        fields += [replace(f, name=names[f.name]) for f in part.fields]
        identity += part.identity
        lift += [moved(e) for e in part.lift]
        combine += [moved(e, states) for e in part.combine]
        # a rescaled structure's and a block's formulas read x-vars and their own names
        # (r, r_new, the block's sums), never a field
        rescaled += [replace(rs, leader=names[rs.leader], leader_arg=moved(rs.leader_arg), weight=moved(rs.weight),
                             values=tuple((names[f], moved(v)) for f, v in rs.values),
                             shifts=tuple((names[f], s, names[w]) for f, s, w in rs.shifts))
                     for rs in part.rescaled]
        blocks += [replace(b, sums=tuple((n, moved(x)) for n, x in b.sums),
                           fields=tuple((names[f], x) for f, x in b.fields)) for b in part.blocks]
        notes += part.notes
        offset += part.arity
    product = Summary(name="_".join(p.name for p in parts), fields=tuple(fields), arity=offset,
                      identity=tuple(identity), lift=tuple(lift), combine=tuple(combine),
                      finalize=Var(fields[0].name), commutative=all(p.commutative for p in parts),
                      rescaled=tuple(rescaled), blocks=tuple(blocks), notes=tuple(notes))
    return product, tuple(renames)


@lru_cache(maxsize=1024)
def _field_arguments(s: Summary) -> dict[str, frozenset[int]]:
    def vars_of(e: Expr) -> set[str]:
        return {n.name for n in walk(e) if isinstance(n, Var)}

    deps = {f: {int(v[1:]) for v in vars_of(lift) if v.startswith("x")}
            for f, lift in zip(s.field_names, s.lift)}
    reads = {f: {v.split(".", 1)[1] for v in vars_of(c) if "." in v} for f, c in zip(s.field_names, s.combine)}
    changed = True
    while changed:
        changed = False
        for f in s.field_names:
            merged = deps[f].union(*(deps[g] for g in reads[f]))
            if merged != deps[f]:
                deps[f], changed = merged, True
    return {f: frozenset(d) for f, d in deps.items()}


def _binary_monoid(name: str, op: str, identity: float, commutative: bool = True) -> Summary:
    """A one-field summary whose combine is an elementwise binary operator."""
    return Summary(
        name=name,
        fields=(Field("acc"),),
        arity=1,
        identity=(Const(identity),),
        lift=(Var("x0"),),
        combine=(Call(op, (Var("a.acc"), Var("b.acc"))),),
        finalize=Var("acc"),
        commutative=commutative,
    )


def _arg_monoid(name: str, better: str, identity: float) -> Summary:
    """argmax / argmin with a payload: fields m (the extreme value) and p (the
    payload at it).  `better(b.m, a.m)` says the right state wins; ties keep the
    left (first) state, so the payload is that of the first extreme element.
    That makes the summary ordered: swapping equal-valued states with different
    payloads changes the result, hence commutative=False (the law checker finds
    the tie)."""
    take_right = Call(better, (Var("b.m"), Var("a.m")))
    return Summary(
        name=name,
        fields=(Field("m"), Field("p")),
        arity=2,
        identity=(Const(identity), Const(0.0)),
        lift=(Var("x0"), Var("x1")),
        combine=(Call("where", (take_right, Var("b.m"), Var("a.m"))),
                 Call("where", (take_right, Var("b.p"), Var("a.p")))),
        finalize=Var("p"),
        commutative=False,
    )


BUILTINS: dict[str, Summary] = {
    s.name: s for s in [
        _binary_monoid("sum", "add", 0.0),
        _binary_monoid("max", "maximum", -math.inf),
        _binary_monoid("min", "minimum", math.inf),
        _binary_monoid("prod", "mul", 1.0),
        _arg_monoid("argmax", "gt", -math.inf),
        _arg_monoid("argmin", "lt", math.inf),
    ]
}
