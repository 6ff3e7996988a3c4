"""Syntax tree -> checked IR.

Resolves every name (tensor, scalar input, index, constant, function,
reduction), makes the Einstein convention explicit, types every node, unifies
index extents through tensor dimensions, and reports each problem as a
CheckError pointing at the source.
"""
from __future__ import annotations

import difflib
import warnings
from collections import Counter
from dataclasses import dataclass, field, replace
from typing import Callable, Mapping

import sympy

from . import parse as syn
from .algebra import BUILTINS, COMPOSITES, Summary
from . import config
from .config import deep
from .errors import CheckError, ImplicitSumWarning, LimitError, Span
from .ir import (Access, Assign, Call, Composite, Const, DerivedExtent, Expr, Extent, Index, Input, Program,
                 Reduce, accesses, affine_access, bound_indices, children, free_indices, postorder, walk, with_children)
from .ops import BOOL, CONSTANTS, FLOAT, FUNCTIONS, INT, OPS


def check(syntax: syn.Syntax, *, outputs: tuple[str, ...] | None = None,
          summaries: Mapping[str, Summary] | None = None) -> Program:
    """Check a parsed program and build its IR.  `summaries` adds user summaries
    usable as `name[t](args...)`.  Deep expressions are checked on a large stack
    (config.deep); past config's limits, a LimitError.  An implicit sum over several
    sibling terms warns (ImplicitSumWarning), once the whole program has checked."""
    def run() -> tuple[Program, list[ImplicitSumWarning]]:
        checker = _Checker(syntax, dict(summaries or {}))
        return checker.run(outputs), checker.notes

    program, notes = deep(run, what="the program", source=syntax.source)
    for note in notes:
        warnings.warn(note, stacklevel=2)
    return program


@dataclass
class _Checker:
    syntax: syn.Syntax
    summaries: dict[str, Summary]
    inputs: dict[str, Input] = field(default_factory=dict)
    ranks: dict[str, int] = field(default_factory=dict)      # statement results
    types: dict[str, str] = field(default_factory=dict)      # statement results
    index_names: set[str] = field(default_factory=set)
    parent: dict[str, str] = field(default_factory=dict)     # union-find over indices and tensor dims
    first_use: dict[str, Span] = field(default_factory=dict)
    conditions: set[str] = field(default_factory=set)        # names read directly as conditions
    positions: set[str] = field(default_factory=set)         # names read as a subscript (a gather)
    notes: list[ImplicitSumWarning] = field(default_factory=list)   # warnings, given once the program checks
    # dimensions read at an affine subscript: (the dimension, its ({index: coefficient}, constant), span)
    affine: list[tuple[str, tuple[dict[str, int], int], Span]] = field(default_factory=list)
    gathered: list[str] = field(default_factory=list)        # dimensions read at a gathered subscript
    length_only: set[str] = field(default_factory=set)       # indices named in len(...) alone

    @property
    def source(self) -> str:
        return self.syntax.source

    def error(self, message: str, span: Span | None) -> CheckError:
        return CheckError(message, self.source, span)

    # ------------------------------------------------------------ driver
    def run(self, outputs: tuple[str, ...] | None) -> Program:
        statements = self.syntax.statements
        if not statements:
            raise CheckError("the program has no statements", self.source, Span(0, max(1, len(self.source))))
        self._collect_index_names()
        self.conditions = _condition_reads(statements, self.index_names)
        self.positions = _position_reads(statements)
        names = [s.name for s in statements]
        defined: dict[str, syn.Statement] = {}
        for st in statements:       # before reading: a reread of a twice-assigned name is no forward read
            if st.name in defined:
                raise self.error(f"'{st.name}' is assigned twice (first on line "
                                 f"{defined[st.name].name_span.line_col(self.source)[0]})", st.name_span)
            defined[st.name] = st
        checked: list[Assign] = []
        for position, st in enumerate(statements):
            if st.name in self.index_names:
                raise self.error(f"'{st.name}' is used both as an index and as a tensor", st.name_span)
            if st.name in CONSTANTS:
                raise self.error(f"'{st.name}' is a constant of the language and cannot be assigned",
                                 st.name_span)
            later = set(names[position:])
            checked.append(self._statement(st, later))
        read = {a.tensor for s in checked for a in accesses(s.expr)}
        program_outputs = tuple(s.name for s in checked if s.name not in read)
        if outputs is not None:
            for name in outputs:
                if name not in defined:
                    raise CheckError(f"unknown output '{name}'; the statements are {', '.join(names)}")
            program_outputs = tuple(n for n in names if n in set(outputs))
        derived = self._check_extents_known(checked)
        self._check_fused_size(checked)
        extents = tuple((i, self._extent_symbol(i)) for i in sorted(self.index_names))
        dimensions = tuple(sorted({(dim, self._extent_symbol(dim))
                                   for dim in [*(dim for dim, _, _ in self.affine), *self.gathered]}, key=str))
        return Program(tuple(checked), tuple(self.inputs.values()), program_outputs, extents, self.source,
                       derived=derived, dimensions=dimensions)

    def _check_fused_size(self, statements: list[Assign]) -> None:
        """The fuse pass inlines every statement into its readers: a chain of
        statements that each read the previous one twice doubles at every step.
        Refuse a program whose inlined expressions exceed config.MAX_FUSED_NODES."""
        cap = config.MAX_FUSED_NODES
        size: dict[str, int] = {}
        for st in statements:
            total = 0
            for node in walk(st.expr):
                total += size.get(node.tensor, 1) if isinstance(node, Access) else 1
                if total > cap:
                    raise LimitError(f"statement '{st.name}' grows to more than {cap:,} operations once "
                                     f"the statements it reads are inlined (compiler.config.MAX_FUSED_NODES); "
                                     f"each read of an earlier statement copies its whole expression",
                                     self.source, st.span)
            size[st.name] = total

    def _collect_index_names(self) -> None:
        lengths, named = [], set()

        def visit(node):
            if isinstance(node, syn.Access):
                named.add(node.name)
                for sub in node.subscripts:
                    for name in _subscript_names(sub, self.error):
                        self._note_index(name)
                    named.update(read.name for read in _gathers(sub))
                return
            if isinstance(node, syn.Call) and node.name == "len" and len(node.args) == 1 \
                    and isinstance(node.args[0], syn.Name):
                lengths.append(node.args[0])
                return
            if isinstance(node, syn.Name):
                named.add(node.name)
            if isinstance(node, syn.Reduction):
                for ix in node.indices:
                    if not isinstance(ix, syn.Name):
                        raise self.error(f"'{node.name}[...]' binds index names only", ix.span)
                    self._note_index(ix)
            for child in _syntax_children(node):
                visit(child)

        for st in self.syntax.statements:
            for ix in st.indices:
                self._note_index(ix)
            visit(st.expr)
        # len(n) of a name read nowhere else (a gradient's count of a pooling window that its
        # tensors no longer index): an index whose extent the call passes, as a size input
        others = (named - self.index_names) | {st.name for st in self.syntax.statements} | set(CONSTANTS)
        for name in lengths:
            if name.name not in self.index_names and name.name not in others:
                self.length_only.add(name.name)
                self._note_index(name)

    def _note_index(self, name: syn.Name) -> None:
        self.index_names.add(name.name)
        self.first_use.setdefault(name.name, name.span)

    # ------------------------------------------------------------ statements
    def _statement(self, st: syn.Statement, later: set[str]) -> Assign:
        lhs = [ix.name for ix in st.indices]
        for k, ix in enumerate(st.indices):
            if ix.name in lhs[:k]:
                raise self.error(f"index '{ix.name}' appears twice on the left", ix.span)
        expr = self._expr(st.expr, st.name, later)
        self._type(expr)        # type errors first, as written; then no implicit sum may fall on a predicate
        expr = _make_einstein_sums(expr, set(lhs), lambda e, ix: self._implicit_sum(st, e, ix))
        free = set(free_indices(expr))
        for ix in st.indices:
            if ix.name not in free:
                raise self.error(f"index '{ix.name}' on the left is not defined by the right side "
                                 f"(no access or index value there varies over it)", ix.span)
        self._check_reductions_use_indices(expr)
        dtype = self._type(expr)
        self.ranks[st.name] = len(lhs)
        self.types[st.name] = dtype
        for d, ix in enumerate(lhs):
            self._union(f"{st.name}#{d}", ix)
        return Assign(st.name, tuple(lhs), expr, dtype, st.span)

    # ------------------------------------------------------------ expressions
    def _expr(self, node, statement: str, later: set[str]) -> Expr:
        rec = lambda n: self._expr(n, statement, later)  # noqa: E731
        if isinstance(node, syn.Number):
            text = node.text
            value = int(text) if text.isdigit() else float(text)
            if isinstance(value, int) and value >= 2 ** 63:
                raise self.error(f"integer literal {text} does not fit in 64 bits; "
                                 f"write it as a float ({text}.0)", node.span)
            return Const(value, node.span)
        if isinstance(node, syn.Name):
            return self._name(node, statement, later)
        if isinstance(node, syn.Access):
            subscripts = tuple(_affine(sub, self.error) for sub in node.subscripts)
            return self._access(node, subscripts, statement, later)
        if isinstance(node, syn.Operator):
            return Call(node.op, tuple(map(rec, node.operands)), node.span)
        if isinstance(node, syn.Call):
            return self._call(node, rec)
        if isinstance(node, syn.Reduction):
            return self._reduction(node, rec)
        raise TypeError(node)

    def _name(self, node: syn.Name, statement: str, later: set[str]) -> Expr:
        if node.name in self.index_names:
            return Index(node.name, node.span)
        if node.name in CONSTANTS:
            return Const(CONSTANTS[node.name], node.span)
        return self._access(node, (), statement, later)

    def _access(self, node, subscripts: tuple[tuple[dict[str, int], int], ...], statement: str,
                later: set[str]) -> Access:
        """The read of `node` at `subscripts` (per dimension, ({index: coefficient},
        constant)).  A dimension read at one index unifies its extent with the index's;
        one read at an affine subscript measures its own (self.affine)."""
        name = node.name
        span = getattr(node, "name_span", node.span)
        if name == statement:
            raise self.error(f"statement '{name}' reads itself; a statement may only read "
                             f"earlier results", span)
        if name in later:
            raise self.error(f"'{name}' is defined by a later statement; a statement may only "
                             f"read earlier results", span)
        if name in self.index_names:
            raise self.error(f"'{name}' is used both as an index and as a tensor", span)
        if name in self.ranks:
            rank = self.ranks[name]
            if rank != len(subscripts):
                raise self.error(f"'{name}' has rank {rank} but is accessed with {len(subscripts)} "
                                 f"ind{'ex' if len(subscripts) == 1 else 'ices'}", node.span)
        elif name in self.inputs:
            rank = self.inputs[name].rank
            if rank != len(subscripts):
                first = self.inputs[name].span.line_col(self.source)
                raise self.error(f"input '{name}' is accessed with {len(subscripts)} "
                                 f"ind{'ex' if len(subscripts) == 1 else 'ices'} here but with {rank} "
                                 f"at line {first[0]}, column {first[1]}", node.span)
        else:
            # an input read as a condition holds bools, one read as a subscript integer positions;
            # any other, numbers (float until a call passes an integer tensor: Program._specialised)
            if name in self.conditions and name in self.positions:
                raise self.error(f"input '{name}' is read both as a condition and as a subscript (integer "
                                 f"positions)", span)
            dtype = BOOL if name in self.conditions else INT if name in self.positions else FLOAT
            self.inputs[name] = Input(name, len(subscripts), node.span, dtype)
        # (a bare name, read at no subscript, is a syntax Name without subscripts)
        gathers = tuple(self._gather(sub, terms, statement, later)
                        for sub, (terms, _) in zip(node.subscripts if subscripts else (), subscripts))
        subscripts = tuple(({n: c for n, c in terms.items() if isinstance(n, str)}, constant)
                           for terms, constant in subscripts)
        access = affine_access(name, subscripts, node.span, gathers)
        for d in range(access.rank):
            ix = access.dimension_index(d)
            if ix is not None:
                self._union(f"{name}#{d}", ix)
            elif gathers[d] is not None:
                self.gathered.append(f"{name}#{d}")
            else:
                self.affine.append((f"{name}#{d}", subscripts[d], node.subscripts[d].span))
        return access

    def _gather(self, sub, terms: dict, statement: str, later: set[str]) -> tuple[Access, int] | None:
        """The integer read a subscript adds (`T[i]` of `E[T[i], d]`) and its factor, or
        None.  It reads an integer input at affine subscripts."""
        reads = [n for n in terms if isinstance(n, syn.Access)]
        if not reads:
            return None
        if len(reads) > 1:
            raise self.error(f"{_AFFINE_HELP}; this one adds {len(reads)} tensor reads", sub.span)
        inner = reads[0]
        if inner.name in self.ranks or inner.name == statement or inner.name in later:
            raise self.error(f"a gathered subscript reads an integer input, and '{inner.name}' is a statement; "
                             f"pass its positions as an input (compute them in a program of their own)",
                             inner.name_span)
        subscripts = tuple(_affine(s, self.error) for s in inner.subscripts)
        nested = next((s for s, (t, _) in zip(inner.subscripts, subscripts) if any(not isinstance(n, str) for n in t)),
                      None)
        if nested is not None:
            raise self.error(f"a gathered subscript's own subscripts are affine combinations of indices, "
                             f"not another gather", nested.span)
        return self._access(inner, subscripts, statement, later), terms[inner]

    def _call(self, node: syn.Call, rec) -> Expr:
        if node.name == "len":
            if len(node.args) != 1 or not isinstance(node.args[0], syn.Name) \
                    or node.args[0].name not in self.index_names:
                raise self.error("len(...) takes one index name", node.span)
            return Extent(node.args[0].name, node.span)
        op = FUNCTIONS.get(node.name)
        if op is None:
            if node.name in BUILTINS or node.name in COMPOSITES or node.name in self.summaries:
                raise self.error(f"'{node.name}' is a reduction; write {node.name}[index](...)",
                                 node.name_span)
            raise self.error(f"unknown function '{node.name}'{_suggest(node.name, FUNCTIONS)}",
                             node.name_span)
        if len(node.args) != op.arity:
            raise self.error(f"{node.name}(...) takes {op.arity} argument{'s' * (op.arity != 1)}, "
                             f"got {len(node.args)}", node.span)
        return Call(op.name, tuple(map(rec, node.args)), node.span)

    def _reduction(self, node: syn.Reduction, rec) -> Expr:
        indices = tuple(ix.name for ix in node.indices)
        if not indices:
            raise self.error(f"'{node.name}[...]' needs at least one index", node.span)
        for k, ix in enumerate(node.indices):
            if ix.name in indices[:k]:
                raise self.error(f"index '{ix.name}' is bound twice", ix.span)
        args = tuple(map(rec, node.args))
        summary = self.summaries.get(node.name) or BUILTINS.get(node.name)
        if summary is not None:
            if len(args) != summary.arity:
                raise self.error(f"{node.name}[...] takes {summary.arity} argument"
                                 f"{'s' * (summary.arity != 1)}, got {len(args)}", node.span)
            return Reduce(summary, indices, args, span=node.span)
        if node.name in COMPOSITES:
            if len(args) != 1:
                raise self.error(f"{node.name}[...] takes 1 argument, got {len(args)}", node.span)
            return Composite(node.name, indices, args[0], node.span)
        known = {**BUILTINS, **COMPOSITES, **self.summaries}
        if node.name in FUNCTIONS:
            raise self.error(f"'{node.name}' is a function, not a reduction; "
                             f"write {node.name}(...)", node.name_span)
        raise self.error(f"unknown reduction '{node.name}'{_suggest(node.name, known)}",
                         node.name_span)

    # ------------------------------------------------------------ checks on the IR
    def _implicit_sum(self, st: syn.Statement, e: Expr, indices: tuple[str, ...]) -> None:
        """The Einstein convention sums `indices` over `e`: a predicate is an error,
        a sum over several sibling terms a warning."""
        self._check_summable(e, indices)
        for i in indices:
            term = _second_term(e, i)
            if term is None:
                continue
            where = ("right-hand side" if e.span == st.expr.span
                     else f"subexpression '{_excerpt(self.source, e.span)}'")
            self.notes.append(ImplicitSumWarning(
                f"index '{i}' is free in more than one term, so the Einstein convention sums it over the "
                f"whole {where}, not within each term; write the sum explicitly, e.g. sum[{i}](...) around "
                f"the part meant, to say which", self.source, _index_span(st.expr, i, term.span)))

    def _check_summable(self, e: Expr, indices: tuple[str, ...]) -> None:
        """An implicit (Einstein) sum over `e`: a predicate is not a number."""
        if self._type(e) == BOOL:
            names = ", ".join(f"'{i}'" for i in indices)
            which = f"index {names} is" if len(indices) == 1 else f"indices {names} are"
            raise self.error(f"{which} neither on the left nor bound, so the Einstein convention sums "
                             f"over this predicate, which is not a number; put {names} on the left or "
                             f"sum a number, e.g. where(cond, 1.0, 0.0)", e.span)

    def _check_reductions_use_indices(self, e: Expr) -> None:
        for node in walk(e):
            if isinstance(node, Reduce | Composite):
                body = node.args if isinstance(node, Reduce) else (node.arg,)
                used = {i for a in body for i in free_indices(a)}
                for ix in node.indices:
                    if ix not in used:
                        raise self.error(f"{_reduction_name(node)}[...] reduces over '{ix}' but its "
                                         f"body does not use '{ix}'", node.span)

    def _type(self, e: Expr) -> str:
        def tensor_type(name: str) -> str:
            return self.inputs[name].dtype if name in self.inputs else self.types[name]
        return expression_type(e, tensor_type, self.source)

    # ------------------------------------------------------------ extents
    def _find(self, x: str) -> str:
        self.parent.setdefault(x, x)
        while self.parent[x] != x:
            self.parent[x] = self.parent[self.parent[x]]
            x = self.parent[x]
        return x

    def _union(self, a: str, b: str) -> None:
        ra, rb = self._find(a), self._find(b)
        if ra != rb:
            # Keep an index name as the representative: it names the extent symbol.
            if "#" in ra:
                ra, rb = rb, ra
            self.parent[rb] = ra

    def _extent_symbol(self, index: str) -> sympy.Symbol:
        return sympy.Symbol(f"len_{self._find(index)}", integer=True, positive=True)

    def _check_extents_known(self, statements: list[Assign]) -> tuple[DerivedExtent, ...]:
        """Every index has an extent: a dimension of an input it indexes; or, where it
        is read in affine subscripts only (`t` of `X[t + r]`), the positions at which
        every such read stays inside its dimension (DerivedExtent); or a size the call
        passes under its name (`t=16`: a size input, an integer of rank 0 that no
        expression reads), for an index on a left-hand side that no input measures (a
        prefix's position t in `L[t] = logsumexp[s](where(s <= t, X[s], -inf))`) and
        for a window's index that only affine subscripts read (`r` of
        `P[t] = max[r](X[2*t + r])`, the pooling window)."""
        measured = {self._find(f"{i.name}#{d}") for i in self.inputs.values() for d in range(i.rank)}
        on_left = {ix for st in statements for ix in st.indices}
        in_windows = {ix for _, (terms, _), _ in self.affine for ix in terms}
        by_use = sorted(self.index_names, key=lambda n: self.first_use[n].start)
        while True:
            derived = self._derive_extents(measured, on_left)
            known = measured | {d.symbol for d in derived}
            window = next((ix for ix in by_use if ix in in_windows and ix not in on_left
                           and self._find(ix) not in known and self._extent_symbol(ix) not in known), None)
            if window is None:
                break
            self._size_input(window, measured)          # then derive again: others may follow from it
        for ix in by_use:
            if self._find(ix) in measured or self._extent_symbol(ix) in known:
                continue
            if ix not in on_left and ix not in self.length_only:
                raise self.error(f"index '{ix}' has no extent: no input tensor is indexed by it "
                                 f"(directly or through a statement's result), and it is on no left-hand "
                                 f"side, where a size passed at the call ({ix}=...) could give it one",
                                 self.first_use[ix])
            self._size_input(ix, measured)
        return derived

    def _size_input(self, ix: str, measured: set[str]) -> None:
        self.inputs[ix] = Input(ix, 0, self.first_use[ix], INT)
        measured.add(self._find(ix))

    def _derive_extents(self, measured: set[str], positions: set[str]) -> tuple[DerivedExtent, ...]:
        """The extents of the output positions `positions` (indices on a left-hand side)
        that only affine subscripts read, in an order where each reads
        extents known before it: `t` of `X[2*t + r]` once `r` has one, `u` of
        `H[u + q]` once `H`'s own position has one.  An index takes its bound from every
        read where its coefficient is positive and the dimension and the other indices
        of the subscript have extents by then.  An index on no left-hand side is never
        derived: a window `r` in `max[r](X[2*t + r])` is a size of the call."""
        def reads(root: str, known: set[str]) -> tuple:
            """The reads that bound `root` once the roots in `known` have extents."""
            return tuple((self._extent_symbol(dim), c,
                          tuple((self._extent_symbol(n), k) for n, k in terms.items() if n != ix), constant)
                         for dim, (terms, constant), _ in self.affine for ix, c in terms.items()
                         if self._find(ix) == root and c > 0 and self._find(dim) in known
                         and all(self._find(n) in known for n in terms if n != ix))

        roots = {self._find(ix) for ix in positions}
        known, derived = set(measured), []
        while True:
            ready = sorted(root for root in roots - known if reads(root, known))
            if not ready:
                return tuple(derived)
            for root in ready:          # in order: a later one may read an earlier one's extent
                derived.append(DerivedExtent(self._extent_symbol(root), reads(root, known)))
                known.add(root)


# ---------------------------------------------------------------- types
def expression_type(e: Expr, tensor_type: Callable[[str], str], source: str) -> str:
    """The type (ops.FLOAT, INT or BOOL) of `e`, whose accesses read tensors of
    `tensor_type(name)`; a CheckError at the first ill-typed node, operands first.
    Each node object once (a lowered softmax shares its argument)."""
    types: dict[int, str] = {}
    for node in postorder(e, unique=True):
        types[id(node)] = _node_type(node, tuple(types[id(c)] for c in children(node)), tensor_type, source)
    return types[id(e)]


def _node_type(e: Expr, arg_types: tuple[str, ...], tensor_type: Callable[[str], str], source: str) -> str:
    if isinstance(e, Const):
        return INT if isinstance(e.value, int) else FLOAT
    if isinstance(e, Index | Extent):
        return INT
    if isinstance(e, Access):
        return tensor_type(e.tensor)
    if isinstance(e, Call):
        op = OPS[e.op]
        result = op.result(arg_types)
        what = f"'{op.symbol}'" if op.syntax != "function" else f"{op.symbol}(...)"
    elif isinstance(e, Reduce):
        result = e.summary.result_type(arg_types)
        if result is not None and e.result is not None:     # a field projected (factorised IR)
            result = e.summary.field_types(arg_types)[e.result]
        what = f"{e.summary.name}[...]"
    else:
        result = FLOAT if arg_types[0] in (INT, FLOAT) else None
        what = f"{e.op}[...]"
    if result is None and isinstance(e, Call) and e.op == "where" and arg_types[0] != BOOL:
        article = "an" if arg_types[0] == INT else "a"
        raise CheckError(f"where(...) takes a predicate (a comparison) as its condition, "
                         f"not {article} {arg_types[0]} value", source, e.args[0].span)
    if result is None:
        logical = isinstance(e, Call) and OPS[e.op].result((BOOL,) * OPS[e.op].arity) == BOOL
        hint = ("; a predicate selects with where(cond, x, y)"
                if BOOL in arg_types and not logical else "")
        raise CheckError(f"{what} cannot take {' and '.join(dict.fromkeys(arg_types))} "
                         f"operands{hint}", source, e.span)
    return result


def specialised(program: Program, dtypes: Mapping[str, str]) -> Program:
    """`program` (IR of any stage) with the inputs named in `dtypes` of those types
    (ops.INT for an integer tensor) and every statement typed again: an integer
    input's exact arithmetic stays integral (Y[i] + 1 is an int statement).  A
    CheckError where a statement cannot take them."""
    inputs = tuple(replace(i, dtype=dtypes.get(i.name, i.dtype)) for i in program.inputs)
    types = {i.name: i.dtype for i in inputs}
    statements = []
    for st in program.statements:
        types[st.name] = expression_type(st.expr, types.__getitem__, program.source)
        statements.append(replace(st, dtype=types[st.name]))
    return replace(program, inputs=inputs, statements=tuple(statements))


def _condition_reads(statements, index_names: set[str]) -> set[str]:
    """The tensor names read directly as a condition: where's first argument, an
    operand of and, or, not (`where(M[i,m], x, y)`): such an input holds bools."""
    found = set()
    stack = [st.expr for st in statements]
    while stack:
        node = stack.pop()
        if isinstance(node, syn.Call) and node.name == "where":
            conditions = node.args[:1]
        elif isinstance(node, syn.Operator) and node.op in ("and", "or", "not"):
            conditions = node.operands
        else:
            conditions = ()
        found |= {c.name for c in conditions if isinstance(c, syn.Access | syn.Name) and c.name not in index_names}
        stack.extend(_syntax_children(node))
    return found


def _position_reads(statements) -> set[str]:
    """The tensor names read in a subscript (`T` of `E[T[i], d]`): integer inputs."""
    found = set()
    stack = [st.expr for st in statements]
    while stack:
        node = stack.pop()
        if isinstance(node, syn.Access):
            found |= {read.name for sub in node.subscripts for read in _gathers(sub)}
        stack.extend(_syntax_children(node))
    return found


# ---------------------------------------------------------------- Einstein convention
def _binders(e: Expr) -> tuple[str, ...]:
    """Indices bound inside the arguments of `e` (softmax binds its index there
    although its result keeps it)."""
    return e.indices if isinstance(e, Reduce | Composite) else ()


def _count_free(e: Expr, counts: Counter) -> Counter:
    """Free occurrences of each index in `e`, given the counts of its children."""
    if isinstance(e, Access):
        rows = [] if e.layout is None else [*e.layout, *(r for g in e.gathers or () if g for r in g.layout)]
        return Counter(e.indices if e.layout is None else
                       [ix for j, ix in enumerate(e.indices) for coeffs, _ in rows if coeffs[j]])
    if isinstance(e, Index):
        return Counter([e.name])
    counts = Counter(counts)
    for i in _binders(e):
        counts.pop(i, None)
    for i in set(_binders(e)) - set(bound_indices(e)):
        counts[i] = 1          # a normaliser's result varies over the index it keeps
    return counts


def _make_einstein_sums(expr: Expr, lhs: set[str],
                        check_summable: Callable[[Expr, tuple[str, ...]], None] = lambda e, ix: None) -> Expr:
    """Sum every index that is neither on the left nor bound over the smallest
    subexpression that contains all its free occurrences (`check_summable` may
    reject that subexpression)."""

    def count(e: Expr) -> Counter:
        total = Counter()
        for c in children(e):
            total.update(count(c))
        return _count_free(e, total)

    implicit = {i: n for i, n in count(expr).items() if i not in lhs}

    def visit(e: Expr, bound: frozenset[str]) -> tuple[Expr, Counter]:
        inner = bound | set(_binders(e))
        visited = [visit(c, inner) for c in children(e)]
        e = with_children(e, tuple(c for c, _ in visited))
        counts = _count_free(e, sum((n for _, n in visited), Counter()))
        done = tuple(i for i in indices_in_order(e)
                     if i in implicit and i not in bound and counts[i] == implicit[i])
        if done:
            check_summable(e, done)
            e = Reduce(BUILTINS["sum"], done, (e,), span=e.span)
            for i in done:
                del counts[i]
        return e, counts

    return visit(expr, frozenset())[0] if implicit else expr


# Operators whose operands multiply: an index free in several of them is a contraction.
_PRODUCTS = frozenset({"mul", "div"})
# Operators a sum distributes over: sum[k](a + b) is sum[k](a) + sum[k](b), and a where's
# condition free of k selects between sums alike.
_LINEAR = _PRODUCTS | {"add", "sub", "neg", "where"}


def _second_term(e: Expr, i: str) -> Expr | None:
    """Where the implicit sum of `i` wraps `e`, `i` is free in two or more sibling
    subexpressions of `e` that are terms rather than factors (operands of `+`, `-`,
    a function; a where's branches, its condition being a factor), and the sum
    means something else than each term summed on its own: `e` is a function the
    sum does not distribute over, or in some term `i` lies inside one (there,
    alone, the sum would have gone inside: logsumexp[v](sum[k](H[i,k]*W[v,k]))).
    Returns the second such term; None for a contraction or a linear combination
    of sums, whose meaning is the same either way."""
    if isinstance(e, Call) and e.op in _PRODUCTS:
        return None
    terms = e.args[1:] if isinstance(e, Call) and e.op == "where" else children(e)
    holding = [c for c in terms if i in free_indices(c)]
    if len(holding) < 2:
        return None
    moved = not (isinstance(e, Call) and e.op in _LINEAR) or any(_behind_nonlinear(t, i) for t in holding)
    return holding[1] if moved else None


def _behind_nonlinear(e: Expr, i: str) -> bool:
    """Whether a free occurrence of `i` in `e` lies inside an operation a sum over
    `i` does not distribute over: a function other than _LINEAR's, or a reduction
    over other indices."""
    if i not in free_indices(e) or isinstance(e, Access):
        return False
    if isinstance(e, (Reduce, Composite)):
        return i not in e.indices
    if isinstance(e, Call) and e.op not in _LINEAR:
        return True
    return any(_behind_nonlinear(c, i) for c in children(e))


def _index_span(node, name: str, within: Span | None) -> Span | None:
    """The span of the first occurrence of index `name` in syntax `node` inside `within`."""
    if within is None:
        return None
    stack = [node]
    found: Span | None = None
    while stack:
        n = stack.pop()
        if isinstance(n, syn.Name) and n.name == name and within.start <= n.span.start < within.end:
            if found is None or n.span.start < found.start:
                found = n.span
        stack.extend(_syntax_children(n))
    return found or within


def _excerpt(source: str, span: Span | None, width: int = 40) -> str:
    text = " ".join(source[span.start:span.end].split()) if span else "..."
    return text if len(text) <= width else text[:width - 3] + "..."


def indices_in_order(e: Expr) -> tuple[str, ...]:
    """Indices occurring in `e` (bound or not), in order of first occurrence."""
    out: dict[str, None] = {}
    if isinstance(e, Access):
        out.update(dict.fromkeys(e.indices))
    elif isinstance(e, Index):
        out[e.name] = None
    for c in children(e):
        out.update(dict.fromkeys(indices_in_order(c)))
    return tuple(out)


# ---------------------------------------------------------------- subscripts
_AFFINE_HELP = ("a subscript is an index, an affine combination of indices with integer "
                "coefficients (t, t + r, 2*t + r - 1), or one that adds an integer input's value "
                "(T[i], Y[i] + 1)")


def _subscript_names(sub, error) -> list:
    """The index names (syntax Names) of subscript `sub`; a CheckError where it is
    more than an affine combination of them."""
    if isinstance(sub, syn.Name):
        return [sub]
    if isinstance(sub, syn.Number):
        return []
    if isinstance(sub, syn.Access):         # a gather: the indices of its own subscripts
        return [n for s in sub.subscripts for n in _subscript_names(s, error)]
    if isinstance(sub, syn.Operator) and sub.op in ("add", "sub", "neg", "mul"):
        return [n for o in sub.operands for n in _subscript_names(o, error)]      # _affine checks products
    raise error(_AFFINE_HELP, sub.span)


def _affine(sub, error) -> tuple[dict[str, int], int]:
    """Subscript `sub` as ({index: coefficient}, constant), zero coefficients dropped; a
    gathered read (`T[i]`) is a term keyed by its syntax node."""
    if isinstance(sub, syn.Name):
        return {sub.name: 1}, 0
    if isinstance(sub, syn.Access):
        return {sub: 1}, 0
    if isinstance(sub, syn.Number):
        if not sub.text.isdigit():
            raise error(f"{_AFFINE_HELP}; {sub.text} is not an integer", sub.span)
        return {}, int(sub.text)
    parts = [_affine(o, error) for o in sub.operands]
    if sub.op == "neg":
        (terms, constant), = parts
        return {n: -c for n, c in terms.items()}, -constant
    if sub.op == "mul":
        (a, ka), (b, kb) = parts
        if a and b:
            raise error(f"{_AFFINE_HELP}; a product needs one integer factor", sub.span)
        k = kb if a else ka                     # the constant factor
        return {n: c * k for n, c in (a or b).items() if c * k}, ka * kb
    (a, ka), (b, kb) = parts
    k = 1 if sub.op == "add" else -1
    terms = dict(a)
    for n, c in b.items():
        terms[n] = terms.get(n, 0) + k * c
    return {n: c for n, c in terms.items() if c}, ka + k * kb


def _gathers(sub) -> list:
    """The tensor reads (syntax Access nodes) an affine subscript adds."""
    if isinstance(sub, syn.Access):
        return [sub]
    if isinstance(sub, syn.Operator):
        return [read for o in sub.operands for read in _gathers(o)]
    return []


# ---------------------------------------------------------------- helpers
def _reduction_name(e: Expr) -> str:
    return e.summary.name if isinstance(e, Reduce) else e.op


def _syntax_children(node) -> tuple:
    if isinstance(node, syn.Access):
        return node.subscripts
    if isinstance(node, syn.Call | syn.Operator):
        return getattr(node, "args", None) or getattr(node, "operands", ())
    if isinstance(node, syn.Reduction):
        return node.args
    return ()


def _suggest(name: str, known) -> str:
    close = difflib.get_close_matches(name, list(known), n=1)
    return f"; did you mean '{close[0]}'?" if close else ""
