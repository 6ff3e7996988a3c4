"""differentiate: reverse-mode derivatives of a checked program, in index notation.

`differentiate(program, wrt, outputs)` returns an ordinary program: its inputs
are the forward inputs plus one upstream gradient `d<Output>` per output
(indexed like the output), its outputs the gradients `d<Input>` of the names in
`wrt`, in that order.  Where the program already uses such a name, the name
takes the first free suffix: `dO_1`, `dO_2`, ...  It runs on the checked IR, before `lower`, so softmax,
logsumexp and mean keep their own adjoints (the max-shift of softmax
contributes nothing) and every sum is explicit.

The rules, one place each:

- statements are visited last to first; the adjoint of a statement is the sum
  of its upstream gradient (an output) and of what later statements
  contribute; the forward statements the adjoints read are recomputed (the
  passes inline them as they inline any statement);
- an elementwise call: the ops table's `adjoint` column (ops.py);
- a composite: the composites table's `adjoint` column (algebra/composites.py);
- a built-in reduction: REDUCTIONS below; a user summary has no derivative;
- every child receives its adjoint summed over the indices it does not vary
  over: that one rule makes the reductions of Einstein sums and broadcasts (the
  gradient of a key shared by grouped query heads sums over the heads);
- a read `T[idx]` contributes its adjoint to `dT`, renamed to dT's indices; a
  repeated index (`T[i, i]`) contributes on the diagonal only;
- predicates, index values, sizes and constants carry no gradient.

An index needs its extent from a tensor read in the program that uses it: a
gradient that only broadcasts over an index (`dX[i, k] = dY[i]` for
`Y[i] = sum[k](X[i, k])`) reads the shape with `X[i, k] ** 0`, which is 1
everywhere (also at inf and NaN) and costs nothing once compiled.
"""
from __future__ import annotations

import difflib
import math
import operator
from dataclasses import dataclass, field, replace
from typing import Callable

import sympy

from ..algebra import BUILTINS, COMPOSITES
from ..algebra.user import Sym, fn
from ..check import expression_type
from ..config import deep
from ..errors import CheckError
from ..ir import (
    Access,
    Assign,
    Call,
    Composite,
    Const,
    Expr,
    Extent,
    Index,
    Input,
    Program,
    Reduce,
    Var,
    alpha_key,
    bound_indices,
    children,
    free_indices,
    reads,
    transform,
    walk,
    with_children,
)
from ..ops import BOOL, EXPONENTIAL, FLOAT, OPS
from .canonicalise import order_operands
from .fuse import FreshNames, affine_position, rename_indices, substitute_affine, substituted_affine
from .stabilise import factors, product, signed_sum

SUM = BUILTINS["sum"]


def differentiate(program: Program, wrt: tuple[str, ...], outputs: tuple[str, ...] | None = None) -> Program:
    """The gradient program of `program` (checked IR): inputs are the forward
    inputs and `d<O>` for each name O in `outputs` (default: the program's float
    outputs), outputs `d<X>` for each input X in `wrt`, in `wrt` order (with a
    suffix `_1`, `_2`, ... where the name is taken).

    Raises:
        CheckError: a name in `wrt` is not an input, an output has no gradient
            (an int or predicate), or a summary on a gradient's path has no
            derivative."""
    return deep(lambda: _Differentiator(program, tuple(wrt), outputs).run(), what="the program",
                source=program.source or None)


# ---------------------------------------------------------------- built-in reductions
# One row per built-in summary: (g, out, node) -> the adjoint of each argument of
# `node` (None: none flows), where g is the adjoint of the result and `out` the
# result itself or a read of the statement that holds it.
def _sum_adjoint(g: Expr, out: Expr, node: Reduce) -> tuple[Expr | None, ...]:
    return (g,)


def _extremum_adjoint(g: Expr, out: Expr, node: Reduce) -> tuple[Expr | None, ...]:
    # Ties share the gradient equally (as torch.amax / amin): each element equal
    # to the extreme gets g / (how many are equal to it).  That compares each
    # element, recomputed, with the extreme the forward found, so it needs the
    # element to round as it did there: true of a value read or computed
    # elementwise, not of one that folds (a distance sum[k]((x - y) ** 2)), whose
    # rounding follows the tiles and the reduction tree of the kernel that
    # computes it.  On the GPU the forward's minimum matched no recomputed
    # distance in most rows of a Chamfer distance: zero gradients, and NaN where
    # the count and the comparison disagreed.  Such a value's gradient goes to
    # the first extreme element, found by one fold of the gradient program
    # (argmin / argmax of the position), as torch.min(dim) gives it.
    x, = node.args
    if any(isinstance(n, Reduce | Composite) for n in walk(x)):
        return (Call("where", (_at_first_extreme(x, node.indices, node.summary.name), g, Const(0.0))),)
    hit = Call("eq", (x, out))
    count = Reduce(SUM, node.indices, (Call("where", (hit, Const(1.0), Const(0.0))),))
    return (Call("where", (hit, Call("div", (g, count)), Const(0.0))),)


def _at_first_extreme(x: Expr, indices: tuple[str, ...], extreme: str) -> Expr:
    """Whether this element of `indices` is the first (row-major) at which `x` takes its
    `extreme` ("max" or "min") over them: its position compared with the position the
    arg-fold keeps, which compares each x once (no recomputed value is compared with
    another evaluation of it)."""
    position: Expr = Index(indices[0])
    for i in indices[1:]:
        position = Call("add", (Call("mul", (position, Extent(i))), Index(i)))
    return Call("eq", (position, Reduce(BUILTINS[f"arg{extreme}"], indices, (x, position))))


def _prod_adjoint(g: Expr, out: Expr, node: Reduce) -> tuple[Expr | None, ...]:
    # out / x is 0/0 at a zero: an element that is the only zero gets the product of
    # the others, an element beside another zero gets 0; exact at zeros, as torch.prod
    x, = node.args
    zero = Call("eq", (x, Const(0.0)))
    zeros = Reduce(SUM, node.indices, (Call("where", (zero, Const(1.0), Const(0.0))),))
    others = Reduce(BUILTINS["prod"], node.indices, (Call("where", (zero, Const(1.0), x)),))
    at_zero = Call("where", (Call("eq", (zeros, Const(1.0))), others, Const(0.0)))
    return (Call("mul", (g, Call("where", (zero, at_zero, Call("div", (out, x)))))),)


def _arg_adjoint(extreme: str) -> Callable[[Expr, Expr, Reduce], tuple[Expr | None, ...]]:
    """argmax / argmin: the payload at the first extreme element (in index order,
    row-major over several indices, as the fold keeps it) gets g; the compared
    value carries none (the result is piecewise constant in it)."""
    def adjoint(g: Expr, out: Expr, node: Reduce) -> tuple[Expr | None, ...]:
        x, _ = node.args
        return None, Call("where", (_at_first_extreme(x, node.indices, extreme), g, Const(0.0)))
    return adjoint


REDUCTIONS: dict[str, Callable[[Expr, Expr, Reduce], tuple[Expr | None, ...]]] = {
    "sum": _sum_adjoint,
    "max": _extremum_adjoint,
    "min": _extremum_adjoint,
    "prod": _prod_adjoint,
    "argmax": _arg_adjoint("max"),
    "argmin": _arg_adjoint("min"),
}


def _differentiable_arguments(op: str) -> frozenset[int]:
    """Positions of an operator's arguments that its adjoint rule gives a gradient."""
    rule = OPS[op].adjoint
    if rule is None:
        return frozenset()
    traced = rule(fn, Sym(Var("g")), Sym(Var("out")), *(Sym(Var(f"x{k}")) for k in range(OPS[op].arity)))
    return frozenset(k for k, a in enumerate(traced) if a is not None)


_DIFFERENTIABLE = {op: _differentiable_arguments(op) for op in OPS}


# ---------------------------------------------------------------- constant folding
# Rules instantiated with literal arguments (x ** 2 gives 2 * x ** (2 - 1)) are
# folded where that is exact: integer and float arithmetic, and predicates
# deciding a where().
_FOLD: dict[str, Callable] = {
    "add": operator.add, "sub": operator.sub, "mul": operator.mul, "neg": operator.neg,
    "lt": operator.lt, "le": operator.le, "gt": operator.gt, "ge": operator.ge, "eq": operator.eq,
    "ne": operator.ne, "and": lambda a, b: a and b, "or": lambda a, b: a or b, "not": operator.not_,
}


def _constant(e: Expr) -> int | float | bool | None:
    if isinstance(e, Const):
        return e.value
    if isinstance(e, Call) and e.op in _FOLD:
        args = [_constant(a) for a in e.args]
        if None not in args:
            return _FOLD[e.op](*args)
    return None


def _is_one(e: Expr) -> bool:
    # the integer 1 only: dropping a float 1.0 could turn a float product into an int
    return isinstance(e, Const) and type(e.value) is int and e.value == 1


def _fold(e: Expr) -> Expr:
    """One rebuilt node, simplified where exact (its children are simplified)."""
    if not isinstance(e, Call):
        return e
    if e.op == "where":
        decided = _constant(e.args[0])
        if decided is not None:
            return e.args[1] if decided else e.args[2]
        return e
    value = _constant(e)
    if value is not None and not isinstance(value, bool) and not math.isnan(value):
        return Const(value)
    if e.op == "mul" and _is_one(e.args[0]):
        return e.args[1]
    if e.op in ("mul", "pow") and _is_one(e.args[1]):
        return e.args[0]
    if e.op == "neg" and isinstance(e.args[0], Call) and e.args[0].op == "neg":
        return e.args[0].args[0]
    return e


def _simplify(e: Expr, given: set[int]) -> Expr:
    """Fold the nodes a rule built around its operands; the operands themselves
    (ids in `given`: the adjoint, the result, the arguments) are left as they are,
    so simplifying costs the size of the rule, not of the program."""
    if id(e) in given or not isinstance(e, Call):
        return e
    return _fold(with_children(e, tuple(_simplify(c, given) for c in children(e))))


# ---------------------------------------------------------------- the driver
def _add(terms: list[Expr]) -> Expr:
    return signed_sum([(1, t) for t in terms])


def _subscripts(e: Expr) -> set[str]:
    """The indices some tensor dimension is read at alone (its extent measures them)."""
    return {n.dimension_index(d) for n in walk(e) if isinstance(n, Access) for d in range(n.rank)} - {None}


@dataclass
class _Names:
    """Fresh tensor and index names, none of them taken in the program."""

    taken: set[str]
    extents: dict[str, sympy.Symbol]

    def fresh(self, name: str) -> str:
        """A new index name for the extent of `name`."""
        n = 1
        while f"{name}_{n}" in self.taken:
            n += 1
        new = f"{name}_{n}"
        self.taken.add(new)
        self.extents[new] = self.extents[name]
        return new

    def fresh_of(self, name: str, extent: sympy.Symbol) -> str:
        """A new index name like `name` (an index or not), of extent `extent`."""
        n = 1
        while f"{name}_{n}" in self.taken:
            n += 1
        new = f"{name}_{n}"
        self.taken.add(new)
        self.extents[new] = extent
        return new

    def tensor(self, name: str) -> str:
        new, n = name, 0
        while new in self.taken:
            n += 1
            new = f"{name}_{n}"
        self.taken.add(new)
        return new


@dataclass
class _Differentiator:
    program: Program
    wrt: tuple[str, ...]
    outputs: tuple[str, ...] | None
    live: set[str] = field(default_factory=set)                  # tensors a gradient flows through
    adjoints: dict[str, list[Expr]] = field(default_factory=dict)  # tensor -> contributions, on its targets
    targets: dict[str, tuple[str, ...]] = field(default_factory=dict)  # tensor -> indices of its adjoint
    emitted: list[Assign] = field(default_factory=list)           # adjoint statements, in order
    relevance: dict[int, tuple[Expr, bool]] = field(default_factory=dict)
    names: _Names | None = None                                   # made once the names are checked
    current: str = ""                                             # the statement being differentiated

    def error(self, message: str, span=None) -> CheckError:
        return CheckError(message, self.program.source or None, span)

    # ------------------------------------------------------------ arguments
    def _checked_arguments(self) -> tuple[tuple[str, ...], dict[str, Assign]]:
        p = self.program
        statements = {s.name: s for s in p.statements}
        inputs = {i.name: i for i in p.inputs}
        if not self.wrt:
            raise self.error("nothing to differentiate: give at least one input in wrt")
        for name in self.wrt:
            if not isinstance(name, str):
                raise self.error(f"wrt= takes input names (str), not {type(name).__name__} {name!r}")
            if name in statements:
                raise self.error(f"'{name}' is a statement, not an input; gradients are taken with respect "
                                 f"to inputs (the program's inputs are: {', '.join(inputs) or 'none'})")
            if name not in inputs:
                close = ([i for i in inputs if i.lower() == name.lower()]
                         or difflib.get_close_matches(name, list(inputs), n=1))
                hint = f"; did you mean '{close[0]}'?" if close else ""
                raise self.error(f"cannot differentiate with respect to '{name}': it is not an input of the "
                                 f"program{hint} (the program's inputs are: {', '.join(inputs) or 'none'})")
            if inputs[name].dtype != FLOAT:
                what = "holds bools (the program reads it as a condition)" if inputs[name].dtype == BOOL \
                    else "is an integer tensor"
                raise self.error(f"cannot differentiate with respect to '{name}': it {what}, which has no "
                                 f"gradient", inputs[name].span)
        if len(set(self.wrt)) != len(self.wrt):
            twice = next(n for n in self.wrt if self.wrt.count(n) > 1)
            raise self.error(f"wrt names '{twice}' twice")
        if self.outputs is None:
            outputs = tuple(o for o in p.outputs if statements[o].dtype == FLOAT)
        else:
            outputs = tuple(self.outputs)
        for name in outputs:
            if name not in statements:
                raise self.error(f"unknown output '{name}'; the statements are {', '.join(statements)}")
            if statements[name].dtype != FLOAT:
                kind = "a predicate" if statements[name].dtype == BOOL else "an integer"
                raise self.error(f"output '{name}' is {kind}, which has no gradient", statements[name].span)
        if not outputs:
            raise self.error("the program has no float output to differentiate")
        return outputs, statements

    # ------------------------------------------------------------ relevance
    def relevant(self, e: Expr) -> bool:
        """Whether a gradient can flow from `e` into a live tensor (memoised by node)."""
        known = self.relevance.get(id(e))
        if known is not None:
            return known[1]
        if isinstance(e, Access):
            value = e.tensor in self.live
        elif isinstance(e, Call):
            value = any(self.relevant(e.args[k]) for k in _DIFFERENTIABLE[e.op])
        else:
            value = any(self.relevant(c) for c in children(e))
        self.relevance[id(e)] = (e, value)          # the node is kept so that its id stays its own
        return value

    # ------------------------------------------------------------ propagation
    def propagate(self, e: Expr, g: Expr, out: Expr) -> None:
        """Send the adjoint `g` of `e` (varying over no index `e` lacks) to its
        children; `out` is the value of `e` (e itself, or a statement's read)."""
        if isinstance(e, Access):
            self.contribute(e, g)
            return
        if isinstance(e, Call):
            op = OPS[e.op]
            traced = op.adjoint(fn, Sym(g), Sym(out), *(Sym(a) for a in e.args))
            adjoints = tuple(None if t is None else t.expr for t in traced)
        elif isinstance(e, Composite):
            adjoints = (COMPOSITES[e.op].adjoint(g, out, e),)
        elif isinstance(e, Reduce):
            rule = REDUCTIONS.get(e.summary.name)
            if rule is None or BUILTINS.get(e.summary.name) != e.summary:
                raise self.error(f"'{e.summary.name}[...]' has no derivative: gradients flow through sum, "
                                 f"max, min, prod, argmax, argmin, mean, softmax and logsumexp, not through "
                                 f"a user summary", e.span)
            adjoints = rule(g, out, e)
        else:
            return
        given = {id(g), id(out), *map(id, children(e))}
        adjoints = tuple(None if a is None or not self.relevant(c) else _simplify(a, given)
                         for c, a in zip(children(e), adjoints))
        if not isinstance(g, Access | Const) and self._uses(adjoints, g) > 1:
            # the rule reads g twice (softmax): give it a name, so that the program
            # text does not grow with every such rule it passes through
            g = self.bind(g)
            self.propagate(e, g, out)
            return
        for child, adjoint in zip(children(e), adjoints):
            if adjoint is not None:
                self.edge(child, adjoint)

    @staticmethod
    def _uses(adjoints: tuple[Expr | None, ...], g: Expr) -> int:
        count = 0
        for a in adjoints:
            stack = [a] if a is not None else []
            while stack:
                node = stack.pop()
                if node is g:
                    count += 1
                else:
                    stack.extend(children(node))
        return count

    def bind(self, g: Expr) -> Access:
        """A statement holding the adjoint `g`; a read of it."""
        lhs = self.targets[self.current]
        indices = tuple(sorted(free_indices(g), key=lambda i: lhs.index(i) if i in lhs else len(lhs)))
        name = self.names.tensor(f"d{self.current}")
        self.emitted.append(Assign(name, indices, g, FLOAT))
        return Access(name, indices)

    def edge(self, child: Expr, adjoint: Expr) -> None:
        """The child's adjoint is summed over the indices the child does not vary over."""
        own = set(free_indices(child))
        extra = tuple(i for i in free_indices(adjoint) if i not in own)
        if extra:
            adjoint = Reduce(SUM, extra, (adjoint,))
        self.propagate(child, adjoint, child)

    def contribute(self, access: Access, g: Expr) -> None:
        """`g`, the adjoint of a read T[idx], renamed to the indices of dT."""
        if access.tensor not in self.live:
            return
        targets = self.targets[access.tensor]
        if access.layout is not None:
            g = _scattered(g, access, targets, self.names)
            self.adjoints.setdefault(access.tensor, []).append(g)
            return
        mapping: dict[str, str] = {}
        diagonal: list[Expr] = []
        for target, ix in zip(targets, access.indices):
            if ix in mapping:
                diagonal.append(Call("eq", (Index(target), Index(mapping[ix]))))
            else:
                mapping[ix] = target
        g = rename_indices(g, {k: v for k, v in mapping.items() if k != v}, self.names.fresh)
        if diagonal:
            g = Call("where", (_conjunction(diagonal), g, Const(0.0)))
        self.adjoints.setdefault(access.tensor, []).append(g)

    # ------------------------------------------------------------ the program
    def run(self) -> Program:
        p = self.program
        outputs, statements = self._checked_arguments()
        self.names = _Names({i for i, _ in p.extents} | {i.name for i in p.inputs} | set(statements),
                            dict(p.extents))
        # d<Name>, or d<Name>_1, _2, ... where the program uses d<Name> already
        upstream = {o: self.names.tensor(f"d{o}") for o in outputs}
        gradient = {x: self.names.tensor(f"d{x}") for x in self.wrt}
        self.live = set(self.wrt)
        for s in p.statements:
            if self.relevant(s.expr):
                self.live.add(s.name)
            self.targets[s.name] = s.indices
        for x in self.wrt:
            self.targets[x] = self._input_indices(x)
        for o in outputs:
            self.adjoints[o] = [Access(upstream[o], statements[o].indices)]
        for s in reversed(p.statements):
            contributions = self.adjoints.pop(s.name, [])
            if not contributions or s.name not in self.live:
                continue
            self.current = s.name
            if len(contributions) == 1 and isinstance(contributions[0], Access):
                g = contributions[0]
            else:
                name = self.names.tensor(f"d{s.name}")
                adjoint = Assign(name, s.indices, _add(contributions), FLOAT)
                self.emitted.append(self._anchored(adjoint, s.name))
                g = Access(name, s.indices)
            self.propagate(s.expr, g, Access(s.name, s.indices))
        gradients = [self._anchored(Assign(gradient[x], self.targets[x],
                                           _add(self.adjoints.get(x, [Const(0.0)])), FLOAT), x)
                     for x in self.wrt]
        kept = _needed([*p.statements, *self.emitted, *gradients], {g.name for g in gradients})
        decls = {i.name: i for i in p.inputs}
        given = tuple(Input(upstream[o], len(statements[o].indices)) for o in outputs)
        result = Program(kept, (*decls.values(), *given), tuple(g.name for g in gradients),
                         tuple(sorted(self.names.extents.items())), p.source, derived=p.derived)
        result = _anchor_unmeasured(result, p, self.names)
        return replace(result, dimensions=_affine_dimensions(result, p, upstream))

    def _input_indices(self, name: str) -> tuple[str, ...]:
        """Index names for d<name>: those of its first read, a repeated one renamed."""
        first = next(n for s in self.program.statements for n in walk(s.expr)
                     if isinstance(n, Access) and n.tensor == name)
        return _dimension_names(first, self.names, dict(self.program.dimensions), distinct=True)

    def _anchored(self, st: Assign, shape_of: str) -> Assign:
        """Read the shape where the right side does not vary over one of the statement's
        indices, or reads no tensor indexed by it (a broadcast): from a forward input of
        exactly that shape where there is one (a cross-entropy's labels Y[t] beside its
        row losses L[t]: reading L would recompute each row's logsumexp), else from
        `shape_of`."""
        if set(st.indices) <= set(free_indices(st.expr)) & _subscripts(st.expr):
            return st
        inputs = {i.name for i in self.program.inputs}
        carrier = shape_of if shape_of in inputs else self._shaped_input(st.indices) or shape_of
        ones = Call("pow", (Access(carrier, st.indices), Const(0)))
        return replace(st, expr=Call("mul", (st.expr, ones)))

    def _shaped_input(self, indices: tuple[str, ...]) -> str | None:
        """A forward input read as a number whose dimensions have the extents of
        `indices` (fresh names included), in order (None: none)."""
        symbols = self.names.extents
        shape = tuple(symbols[i] for i in indices)
        for decl in self.program.inputs:
            if decl.rank != len(indices) or decl.dtype == BOOL:
                continue
            first = next(n for st in self.program.statements for n in walk(st.expr)
                         if isinstance(n, Access) and n.tensor == decl.name)
            if tuple(symbols[i] for i in first.indices) == shape:
                return decl.name
        return None


def _dimension_names(read: Access, names: _Names, dimensions: dict, distinct: bool = False) -> tuple[str, ...]:
    """An index name for each dimension of the tensor `read` reads: the index a dimension
    is read at alone, else (an affine subscript) a fresh one of that dimension's extent;
    `distinct`: a name repeated (`T[i, i]`) fresh the second time."""
    out: list[str] = []
    for d in range(read.rank):
        ix = read.dimension_index(d)
        if ix is None:
            coeffs, _ = read.layout[d]
            base = next(n for n, c in zip(read.indices, coeffs) if c) if any(coeffs) else "s"    # a position
            ix = names.fresh_of(base, dimensions[f"{read.tensor}#{d}"])
        elif distinct and ix in out:
            ix = names.fresh(ix)
        out.append(ix)
    return tuple(out)


def _scattered(g: Expr, read: Access, targets: tuple[str, ...], names: _Names) -> Expr:
    """The contribution to dT[targets] of the adjoint `g` of a read of T at affine
    subscripts: g summed over every position of the read's indices that reads
    T[targets].  Each dimension solves for one index of coefficient +-1 (`t + r`
    read at s: t = s - r, kept where 0 <= s - r < len(t)); the others are summed over
    (r), and a dimension with no such index keeps the positions equal to its target
    (`2*t` read at s: where(2*t == s)), a sum over all of them."""
    # a read index named like a target of another dimension is renamed first
    own = {targets[d] for d in range(read.rank) if read.dimension_index(d) == targets[d]}
    renamed = {n: names.fresh(n) for n in read.indices if n in targets and n not in own}
    if renamed:
        g = rename_indices(g, renamed, names.fresh)
        read = replace(read, indices=tuple(renamed.get(n, n) for n in read.indices))
    solved: dict[str, tuple[dict[str, int], int]] = {}
    unknown = set(read.indices)
    equal: list[Expr] = []
    # plain dimensions first, gathered ones last (their positions are integer reads, never solved for)
    for d in sorted(range(read.rank), key=lambda d: (read.dimension_index(d) is None, read.gathered(d) is not None)):
        terms, constant = substituted_affine(read.affine(d), solved)
        found = read.gathered(d)
        if found is not None:
            # a gathered position (`E[T[i], d]` read at v): the positions where T[i] == v, summed over
            value = substitute_affine(found[0], {n: v for n, v in solved.items() if v != ({n: 1}, 0)},
                                      names.fresh, read)
            equal.append(Call("eq", (affine_position(terms, constant, (value, found[1])), Index(targets[d]))))
            continue
        pivot = next((n for n, c in terms.items() if abs(c) == 1 and n in unknown), None)
        if pivot is None:
            equal.append(Call("eq", (affine_position(terms, constant), Index(targets[d]))))
            continue
        c = terms[pivot]
        # pivot = c * (target - constant - the other terms)
        rest = {targets[d]: c}
        for n, k in terms.items():
            if n != pivot:
                rest[n] = rest.get(n, 0) - c * k
        value = ({n: k for n, k in rest.items() if k}, -c * constant)
        solved = {n: substituted_affine(v, {pivot: value}) for n, v in solved.items()}
        solved[pivot] = value
        unknown.discard(pivot)
    out = substitute_affine(g, {n: v for n, v in solved.items() if v != ({n: 1}, 0)}, names.fresh, read)
    conditions = list(equal)
    for n, value in solved.items():
        position = affine_position(*value)
        if not (isinstance(position, Index) and position.name in targets):
            conditions += [Call("ge", (position, Const(0))), Call("lt", (position, Extent(n)))]
    if conditions:
        out = Call("where", (_conjunction(conditions), out, Const(0.0)))
    summed = tuple(n for n in read.indices if n in unknown and n in free_indices(out))
    return Reduce(SUM, summed, (out,)) if summed else out


def _affine_dimensions(program: Program, forward: Program, upstream: dict[str, str]) -> tuple:
    """The extent symbol of every tensor dimension `program` reads at an affine
    subscript (Program.dimensions): a forward input's as the forward knows it, a
    statement's (an upstream gradient's: its output's) from its left side."""
    symbols = dict(program.extents)
    known = dict(forward.dimensions)
    lhs = {s.name: s.indices for s in (*forward.statements, *program.statements)}
    lhs |= {d: lhs[o] for o, d in upstream.items()}
    for s in forward.statements:
        for n in walk(s.expr):
            if isinstance(n, Access) and n.tensor not in lhs:
                for d in range(n.rank):
                    if n.dimension_index(d) is not None:
                        known.setdefault(f"{n.tensor}#{d}", symbols[n.dimension_index(d)])
    out = {}
    for s in program.statements:
        for n in walk(s.expr):
            if isinstance(n, Access) and n.layout is not None:
                for d in range(n.rank):
                    if n.dimension_index(d) is None:
                        key = f"{n.tensor}#{d}"
                        out[key] = symbols[lhs[n.tensor][d]] if n.tensor in lhs else known[key]
    return tuple(sorted(out.items(), key=str))


def _conjunction(terms: list[Expr]) -> Expr:
    out = terms[0]
    for t in terms[1:]:
        out = Call("and", (out, t))
    return out


def _needed(statements: list[Assign], wanted: set[str]) -> tuple[Assign, ...]:
    """The statements the wanted ones read, transitively, in order."""
    kept = []
    for s in reversed(statements):
        if s.name in wanted:
            kept.append(s)
            wanted |= reads(s.expr)
    return tuple(reversed(kept))


# ---------------------------------------------------------------- extents
def _measured(program: Program) -> set[str]:
    """Index names whose extent some input dimension gives, through the accesses
    and the statements' left sides (the checker's rule)."""
    parent: dict[str, str] = {}

    def find(x: str) -> str:
        parent.setdefault(x, x)
        while parent[x] != x:
            parent[x] = parent[parent[x]]
            x = parent[x]
        return x

    for s in program.statements:
        for d, ix in enumerate(s.indices):
            parent[find(f"{s.name}#{d}")] = find(ix)
        for n in walk(s.expr):
            if isinstance(n, Access):
                for d in range(n.rank):
                    if n.dimension_index(d) is not None:
                        parent[find(f"{n.tensor}#{d}")] = find(n.dimension_index(d))
    statements = {s.name for s in program.statements}
    roots = {find(f"{n.tensor}#{d}") for s in program.statements for n in walk(s.expr)
             if isinstance(n, Access) and n.tensor not in statements for d in range(n.rank)}
    # an extent that affine subscripts derive is known where its reads' extents are; a size
    # input's is the call's
    given = {rule.symbol for rule in program.derived} | set(program.sizes.values())
    return {ix for ix, symbol in program.extents if (ix in parent and find(ix) in roots) or symbol in given}


def _anchor_unmeasured(program: Program, forward: Program, names: _Names) -> Program:
    """Give every index the gradient program uses an extent: one that the
    forward program measured through statements the gradients no longer read
    (or a fresh name that renaming made) reads the shape of a forward input
    dimension of its extent, as 1 (`prod[a](W[a, m] ** 0)`), where it is in scope."""
    used = {i for s in program.statements for i in s.indices} | {
        i for s in program.statements for n in walk(s.expr) if isinstance(n, Reduce | Composite)
        for i in n.indices}
    missing = sorted(used - _measured(program))
    if not missing:
        return program
    symbols = dict(program.extents)
    inputs = {i.name for i in forward.inputs}
    by_symbol: dict[sympy.Symbol, tuple[Access, int]] = {}        # extent -> a read of an input dimension of it
    dimensions = dict(forward.dimensions)
    for s in forward.statements:
        for n in walk(s.expr):
            if isinstance(n, Access) and n.tensor in inputs:
                for d in range(n.rank):
                    ix = n.dimension_index(d)
                    by_symbol.setdefault(symbols[ix] if ix is not None else dimensions[f"{n.tensor}#{d}"], (n, d))
    statements = list(program.statements)
    for ix in missing:
        read, d = by_symbol[symbols[ix]]
        # the read's other dimensions at the indices of the statement that gets the anchor, where
        # one has their extent (dP[b, s] reads P[b, s] ** 0), else summed over (a fresh index)
        home = next((st.indices for st in statements if ix in st.indices), ())
        spare = [i for i in home if i != ix]
        indices = []
        for k, other in enumerate(_dimension_names(read, names, dimensions)):
            same = next((i for i in spare if symbols.get(i) == symbols.get(other)), None) if k != d else None
            if same is not None:
                spare.remove(same)
            indices.append(ix if k == d else same if same is not None else names.fresh(other))
        indices = tuple(indices)
        ones: Expr = Call("pow", (Access(read.tensor, indices), Const(0)))
        others = tuple(i for i in indices if i != ix and i not in home)
        if others:
            ones = Reduce(BUILTINS["prod"], others, (ones,))
        statements = _place_anchor(statements, ix, ones)
    return replace(program, statements=tuple(statements), extents=tuple(sorted(names.extents.items())))


def anchor_extents(program: Program, forward: Program) -> Program:
    """`program` (a gradient program of `forward`) with every index it uses given an
    extent again (_anchor_unmeasured): read_saved may replace the only read that
    measured one (a CDF's gradient at s, `sum[t](where(s <= t, dF[b, t] / sum[s](P[b, s]), 0))`,
    reads the saved row sum instead of P)."""
    taken = {i for i, _ in program.extents} | {i.name for i in program.inputs} | {s.name for s in program.statements}
    return _anchor_unmeasured(program, forward, _Names(taken, dict(program.extents)))


def _place_anchor(statements: list[Assign], ix: str, ones: Expr) -> list[Assign]:
    """Multiply by `ones` (1 that reads the shape of `ix`) where `ix` is in scope:
    the first statement with `ix` on its left, else the first reduction binding it."""
    for k, s in enumerate(statements):
        if ix in s.indices:
            expr = (Call("and", (s.expr, Call("eq", (ones, Const(1.0))))) if s.dtype == BOOL
                    else Call("mul", (s.expr, ones)))
            return [*statements[:k], replace(s, expr=expr), *statements[k + 1:]]
    for k, s in enumerate(statements):
        binder = next((n for n in walk(s.expr) if isinstance(n, Reduce | Composite) and ix in n.indices),
                      None)
        if binder is None:
            continue

        def anchor(e: Expr, binder: Expr = binder) -> Expr:
            if e is not binder:
                return with_children(e, tuple(anchor(c) for c in children(e)))
            first, *rest = children(e)
            return with_children(e, (Call("mul", (first, ones)), *rest))
        return [*statements[:k], replace(s, expr=anchor(s.expr)), *statements[k + 1:]]
    raise AssertionError(f"index '{ix}' is used but neither on a left side nor bound")


# ---------------------------------------------------------------- saved statistics
# The softmax rule (and the logsumexp rule, whose adjoint is g * softmax) reads the
# probabilities p = softmax[I](x), which the gradient program would recompute,
# normaliser and all, wherever it reads them: inside the kernels of dK and dV of
# attention that is one fold over m per (m tile, i), cubic work.  The forward
# already folds that normaliser: saving L = logsumexp[I](x) as an extra output of
# its kernel, the backward reads p = exp(x - L), an elementwise term.  What is
# left of the softmax rule's row term, sum[m](p * g), read_outputs (below) takes
# from a forward output.
STATISTIC = "logsumexp"
_SAVED_FROM = ("softmax", "logsumexp")      # composites whose statistic is logsumexp[I](x)


@dataclass(frozen=True)
class Statistics:
    """What the forward saves for the backward, and what it cannot save.

    Attributes:
        saved: one statement per statistic, in the forward's names: a softmax's
            (`lse_O[i] = logsumexp[m](x)`), or a row fold the backward would fold
            again (`mean_Y[i] = mean[n](X[i,n] ** 2)`, `mean_mu[i] = mean[k](X[i,k])`).
            Appended to the forward program, each is an extra output that shares
            the fold the forward makes anyway.
        unsaved: one line per softmax the backward recomputes although the
            forward has it, saying why."""

    saved: tuple[Assign, ...]
    unsaved: tuple[str, ...]


def _alpha(node: Composite) -> tuple[Expr, tuple[str, ...]]:
    """`node` (a softmax or logsumexp; or any expression wrapped as a composite
    over no index, see `_shape_of`) up to a consistent renaming of its indices
    (`ir.alpha_key`, its reduced indices first), as one Composite, and the
    original names of the free placeholders, in placeholder order."""
    arg, order = alpha_key(node.arg, first=node.indices)
    return Composite(STATISTIC, tuple(f"#{k}" for k in range(len(node.indices))), arg), order


def _candidates(program: Program) -> list[tuple[Composite, Assign, str | None]]:
    """Every softmax and logsumexp of the forward, with its statement and, where
    its statistic cannot be an output of that statement's kernel, why."""
    found: list[tuple[Composite, Assign, str | None]] = []

    def visit(e: Expr, st: Assign, enclosing: frozenset[str]) -> None:
        if isinstance(e, Composite) and e.op in _SAVED_FROM:
            rows = [i for i in free_indices(e) if i not in e.indices]
            folded = sorted(set(rows) & enclosing | set(rows) - set(st.indices))
            why = None
            if folded:
                why = (f"{e.op}[{', '.join(e.indices)}](...) in {st.name} varies over {', '.join(folded)}, "
                       f"which {st.name}[{', '.join(st.indices)}] folds over: its statistic would be a tensor "
                       f"the forward does not write")
            found.append((e, st, why))
        inner = enclosing | set(bound_indices(e)) if isinstance(e, Reduce | Composite) else enclosing
        for c in children(e):
            visit(c, st, inner)

    for st in program.statements:
        visit(st.expr, st, frozenset())
    return found


def statistics(program: Program, backward: Program) -> Statistics:
    """The statistics the forward `program` (checked IR) can save for the
    gradient program `backward` (from `differentiate`, recomputing): one
    `lse_<Statement>[rows] = logsumexp[I](x)` per distinct softmax[I](x) that
    the backward reads, up to a renaming of indices."""
    wanted = {_alpha(n)[0] for s in backward.statements for n in walk(s.expr)
              if isinstance(n, Composite) and n.op == "softmax"}
    taken = {i.name for i in program.inputs} | {s.name for s in program.statements}
    names = _Names(taken, dict(program.extents))
    saved: dict[Expr, Assign] = {}
    unsaved: dict[Expr, str] = {}
    for node, st, why in _candidates(program):
        key = _alpha(node)[0]
        if key in saved:
            continue
        if why is not None:
            unsaved.setdefault(key, why)
            continue
        unsaved.pop(key, None)
        # named whether or not this backward reads it, so that every gradient
        # program of `program` (any wrt) names a statistic alike
        rows = tuple(i for i in st.indices if i in free_indices(node) and i not in node.indices)
        saved[key] = Assign(names.tensor(f"lse_{st.name}"), rows, Composite(STATISTIC, node.indices, node.arg),
                            FLOAT)
    folds = _row_folds(program, backward, names)
    return Statistics(tuple(a for k, a in saved.items() if k in wanted) + folds,
                      tuple(why for k, why in unsaved.items() if k in wanted))


# Any other fold the backward folds again as the forward did (a norm's row mean and
# variance, an RMS): the rule of a function of a fold reads the fold (d rsqrt(v) =
# -rsqrt(v)**3 / 2), so the gradient program recomputes it from the inputs, one more
# pass over each row in each kernel that reads it.  Where the fold's value is a row
# statistic (fewer indices than a tensor the forward writes) the forward stores it
# from the kernel that folds it anyway, in float32, and the backward reads it.
def _is_fold(e: Expr) -> bool:
    return isinstance(e, Reduce) or (isinstance(e, Composite) and e.op not in _SAVED_FROM)


def _exponential(e: Expr) -> bool:
    """Whether `e` folds exponentials: the stabiliser rescales such a fold, whose value
    may overflow where the ratios the program computes from it do not (a softmax's
    normaliser with a sink); it is recomputed, or saved as its logarithm (lse_)."""
    return any(isinstance(n, Call) and n.op in EXPONENTIAL for n in walk(e))


def _row_folds(program: Program, backward: Program, names) -> tuple[Assign, ...]:
    """`<op>_<Statement>[rows] = fold` for each fold of the forward that the backward
    folds again, whose rows (free indices) are fewer than a statement's the forward
    writes, not folded by an enclosing fold, of float value (an argmax's position is
    recomputed), and not a fold of exponentials.  The forward folds it once: the fuse
    pass shares equal folds (`mu[i] = mean[k](X[i,k])` and `mean_mu[i]`)."""
    wanted = {alpha_key(n)[0] for s in backward.statements for n in walk(s.expr) if _is_fold(n)}
    widths = [frozenset(s.indices) for s in program.statements]
    dtypes = {**{i.name: i.dtype for i in program.inputs}, **{s.name: s.dtype for s in program.statements}}
    found: dict[Expr, Assign] = {}

    def visit(e: Expr, st: Assign, enclosing: frozenset[str]) -> None:
        if _is_fold(e):
            key = alpha_key(e)[0]
            rows = free_indices(e)
            if (key in wanted and key not in found and not set(rows) & enclosing
                    and any(set(rows) < w for w in widths) and not _exponential(e)
                    and expression_type(e, dtypes.__getitem__, program.source) == FLOAT):
                op = e.op if isinstance(e, Composite) else e.summary.name
                found[key] = Assign(names.tensor(f"{op}_{st.name}"), tuple(i for i in st.indices if i in rows), e,
                                    FLOAT)
            enclosing = enclosing | set(e.indices)
        for c in children(e):
            visit(c, st, enclosing)

    for st in program.statements:
        if st.dtype == FLOAT:
            visit(st.expr, st, frozenset())
    return tuple(found.values())


def read_saved(backward: Program, saved: tuple[Assign, ...]) -> Program:
    """`backward` reading exp(min(x - L[rows], 0)) wherever it would recompute a
    softmax whose statistic L is in `saved` (inputs of the result, after the others).

    exp(x - L) is the softmax: L >= x, so it never overflows.  The clamp at 0 says
    so to the stabiliser, which then adds no running max (it cannot know what L
    is), and absorbs L's rounding where x is the row's maximum.  At a row
    whose every logit is -inf (L = -inf) it is exp(-inf + inf) = NaN, as the
    recomputed softmax (0/0) is.  A row holding +inf has L = +inf: exp(x - L) is
    0 at its finite logits and NaN at the infinite ones, where the softmax is
    NaN throughout; its gradient is NaN either way."""
    by_key, folds = {}, {}
    for st in saved:
        if isinstance(st.expr, Composite) and st.expr.op == STATISTIC:       # a softmax's
            key, order = _alpha(Composite("softmax", st.expr.indices, st.expr.arg))
            by_key[key] = (st, order)
        else:
            key, order = alpha_key(st.expr)
            folds[key] = (st, order)

    def read(table: dict, key_and_order) -> Access | None:
        """The saved statistic `table` holds for this node (up to index names), read at
        the node's own indices; None: none."""
        key, order = key_and_order
        hit = table.get(key)
        if hit is None:
            return None
        st, theirs = hit
        to_ours = dict(zip(theirs, order))
        return Access(st.name, tuple(to_ours[i] for i in st.indices))

    def rewrite(e: Expr) -> Expr:
        if _is_fold(e) and folds and (saved_fold := read(folds, alpha_key(e))) is not None:
            return saved_fold
        if isinstance(e, Composite) and e.op == "softmax" and (lse := read(by_key, _alpha(e))) is not None:
            return Call("exp", (Call("minimum", (Call("sub", (rewrite(e.arg), lse)), Const(0))),))
        return with_children(e, tuple(rewrite(c) for c in children(e)))

    rewritten = tuple(replace(s, expr=rewrite(s.expr)) for s in backward.statements)
    # a saved fold's index may be left only in a len(...) beside it (sum[n](...) / len(n)):
    # that extent is read under another index of the same extent the program still names,
    # and where there is none the statement keeps its fold
    named = _index_names(rewritten)
    extents = dict(backward.extents)
    statements = []
    for old, new in zip(backward.statements, rewritten):
        expr = _extents_named(new.expr, named, extents)
        statements.append(old if expr is None else replace(new, expr=expr))
    reads = {n.tensor for s in statements for n in walk(s.expr) if isinstance(n, Access)}
    inputs = tuple(Input(st.name, len(st.indices)) for st in saved if st.name in reads)
    return replace(backward, statements=tuple(statements), inputs=(*backward.inputs, *inputs))


def _index_names(statements) -> set[str]:
    """Every index the statements name outside len(...): on the left, in an access, as a
    value, or reduced over."""
    names = {i for s in statements for i in s.indices}
    for s in statements:
        for n in walk(s.expr):
            if isinstance(n, Access | Reduce | Composite):
                names |= set(n.indices)
            elif isinstance(n, Index):
                names.add(n.name)
    return names


def _extents_named(e: Expr, named: set[str], extents: dict) -> Expr | None:
    """`e` with each len(x) of an index x not in `named` written as len(y) of one that is,
    of the same extent symbol; None where some x has none."""
    if isinstance(e, Extent) and e.name not in named:
        same = sorted(i for i in named if extents.get(i) == extents.get(e.name))
        return Extent(same[0], e.span) if same else None
    args = tuple(_extents_named(c, named, extents) for c in children(e))
    return None if None in args else with_children(e, args)


def read_outputs(backward: Program, forward: Program) -> tuple[Program, tuple[str, ...]]:
    """`backward` reading a forward output where it would fold that output again.

    A sum sum_I(p * T) whose factor T is a statement T = sum_J(B * C), with B
    free of I, is sum_J(B * sum_I(p * C)) with the sums exchanged; where
    sum_I(p * C) is the expression of a forward output Y (up to index names),
    it is sum_J(B * Y).  In the softmax's adjoint p * (g - sum_m(p * g)), with
    g = sum_j(dO * V) and the output O = sum_m(p * V), that is FlashAttention's
    D = rowsum(dO * O): linearity of the expectation under p, for any output
    that is a p-weighted sum, found without refolding over m.  Returns the
    program and the outputs it now reads (inputs of the result, after the
    others).  A forward output the backward recomputes as a statement of its own
    (the adjoint of a normaliser that is not a softmax's reads O itself) is read
    too: the forward has it."""
    outputs = {st.name: st for st in forward.statements if st.name in forward.outputs and st.dtype == FLOAT}
    recomputed = tuple(s for s in backward.statements if outputs.get(s.name) == s)
    if recomputed:
        backward = replace(backward, statements=tuple(s for s in backward.statements if s not in recomputed),
                           inputs=(*backward.inputs, *(Input(s.name, len(s.indices)) for s in recomputed)))
    found: dict[Expr, tuple[Assign, tuple[str, ...]]] = {}
    for st in outputs.values():
        key, order = _shape_of(order_operands(st.expr))
        found.setdefault(key, (st, order))
    defs = {s.name: s for s in backward.statements}
    taken = {i.name for i in backward.inputs} | set(defs)
    used: dict[str, Assign] = {}
    names = FreshNames(dict(backward.extents))     # for a bound index the renaming would capture

    def exchanged(e: Expr) -> Expr:
        if not (isinstance(e, Reduce) and e.summary == SUM and e.result is None):
            return e
        numerator, denominator = factors(e.args[0])
        for k, f in enumerate(numerator):
            inner = defs[f.tensor].expr if isinstance(f, Access) and f.tensor in defs else None
            if not (isinstance(inner, Reduce) and inner.summary == SUM and inner.result is None):
                continue
            inner = rename_indices(inner, dict(zip(defs[f.tensor].indices, f.indices)), names.fresh)
            rest = numerator[:k] + numerator[k + 1:]
            outside = set(e.indices) | {i for g in (*rest, *denominator) for i in free_indices(g)}
            if set(inner.indices) & outside:
                continue                       # exchanging the sums would capture an index
            b_factors, b_denominator = factors(inner.args[0])
            weights = [g for g in b_factors if not set(free_indices(g)) & set(e.indices)]
            varying = [g for g in b_factors if set(free_indices(g)) & set(e.indices)]
            if b_denominator or not weights or not varying:
                continue
            candidate = Reduce(SUM, e.indices, (product(rest + varying, denominator),))
            key, order = _shape_of(order_operands(candidate))
            hit = found.get(key)
            if hit is None:
                continue
            st, theirs = hit
            to_ours = dict(zip(theirs, order))
            used[st.name] = st
            return Reduce(SUM, inner.indices, (product(weights + [Access(st.name, tuple(
                to_ours[i] for i in st.indices))], []),))
        return e

    statements = tuple(replace(s, expr=transform(s.expr, exchanged)) for s in backward.statements)
    inputs = tuple(Input(st.name, len(st.indices)) for name, st in used.items() if name not in taken)
    return replace(backward, statements=statements, inputs=(*backward.inputs, *inputs),
                   extents=tuple(sorted(names.extents.items()))), (*(s.name for s in recomputed), *used)


def _shape_of(e: Expr) -> tuple[Expr, tuple[str, ...]]:
    """`e` up to a consistent renaming of its indices, and the original names of
    its free indices in placeholder order."""
    return _alpha(Composite(STATISTIC, (), e))
