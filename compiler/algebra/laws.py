"""The law checker: a summary's laws are checked, never assumed.

For associativity, left and right identity and commutativity (checked where
claimed; probed, but not required, where not) each law gets one status:

- "proved": sympy shows both sides equal over the reals (field values are real,
  hence finite, symbols; identities may be +-oo).  Combines built from max/min
  or comparisons (where(b.m > a.m, ...)) are proved *by cases*: for every
  ordering of the symbols that appear as arguments of Max/Min or of a
  comparison -- ties included, i.e. every weak order -- the symbols are replaced
  by u, u + d1, u + d1 + d2, ... (d_k > 0), which lets sympy resolve every
  Max/Min/comparison, and each case is simplified on its own.  General: no
  per-summary code.
- "tested": sympy could not decide; a seeded sampler drew float64 states and
  found no counterexample.  The states are the ones a fold can actually reach:
  the identity, or the fold of 1-3 lifted random elements (moderate floats,
  |x| <= 1e3, and small exact integers so that ties occur).  Both sides agree
  when they are within a relative tolerance of 1e-9 of the largest magnitude
  involved, equal infinities, or NaN on both sides.
- "failed": the sampler found (and shrank) a counterexample, kept in the report
  with the field values of a, b (, c) and both sides.

A product of independent parts (no part's combine reads another's fields) is
checked part by part (`independent_parts`): its laws are theirs.  The sampler
evaluates formulas over every float64, the identity's infinities included
(IEEE semantics, as the kernels and the oracle do).

`check_laws(summary)` returns a LawReport; `require_laws(summary)` returns the
summary with the report attached, or raises LawError naming the summary, the
law and the counterexample.
"""
from __future__ import annotations

import math
import random
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, replace

import sympy

from ..errors import LawError
from ..ir import Var, transform, walk
from ..ops import INT
from .formula import evaluate, to_sympy
from .summary import Summary, independent_fields

ASSOCIATIVE, LEFT_IDENTITY, RIGHT_IDENTITY, COMMUTATIVE = (
    "associative", "left identity", "right identity", "commutative")
TILE_FORMULA = "tile formula"     # a Block's fields equal the fold of the tile's lifted elements
PROVED, TESTED, FAILED = "proved", "tested", "failed"

DEFAULT_EXAMPLES = 100
RTOL = 1e-9
MAX_ORDERED = 4         # case split over at most 4 ordered things: 75 weak orders
MAX_OPS = 2000          # larger differences go to testing rather than simplify


# ---------------------------------------------------------------- the report
@dataclass(frozen=True)
class Counterexample:
    """Concrete field values on which the two sides of a law differ."""

    fields: tuple[str, ...]
    states: tuple[tuple[str, tuple[float, ...]], ...]    # ("a", values), ("b", values), ...
    lhs_text: str
    lhs: tuple[float, ...]
    rhs_text: str
    rhs: tuple[float, ...]

    def _state(self, values: Sequence[float]) -> str:
        return "(" + ", ".join(f"{n}={_num(v)}" for n, v in zip(self.fields, values)) + ")"

    def __str__(self) -> str:
        given = ", ".join(f"{name} = {self._state(v)}" for name, v in self.states)
        given = f"{given}: " if given else ""
        return (f"{given}{self.lhs_text} = {self._state(self.lhs)} but "
                f"{self.rhs_text} = {self._state(self.rhs)}")


@dataclass(frozen=True)
class LawResult:
    law: str
    status: str                    # PROVED, TESTED or FAILED
    method: str                    # "sympy", "sympy, by cases on max order", "sampled, 100 examples"
    claimed: bool = True           # False: commutativity probed for information only
    counterexample: Counterexample | None = None

    @property
    def holds(self) -> bool:
        return self.status != FAILED

    def describe(self) -> str:
        if self.status == FAILED:
            text = f"failed ({self.method}): {self.counterexample}"
        else:
            text = f"{self.status} ({self.method})"
        if self.claimed:
            return text
        if self.holds:
            return f"not claimed, though it holds: {text}; it could be declared commutative"
        return f"not claimed, and it does not hold ({self.method}): {self.counterexample}"


@dataclass(frozen=True)
class LawReport:
    summary: str
    results: tuple[LawResult, ...]

    def __getitem__(self, law: str) -> LawResult:
        for r in self.results:
            if r.law == law:
                return r
        raise KeyError(law)

    def __contains__(self, law: str) -> bool:
        return any(r.law == law for r in self.results)

    def status(self, law: str) -> str:
        return self[law].status

    @property
    def failures(self) -> tuple[LawResult, ...]:
        """Failed laws the summary claims (an unclaimed commutativity never fails)."""
        return tuple(r for r in self.results if r.claimed and not r.holds)

    @property
    def ok(self) -> bool:
        return not self.failures

    def __str__(self) -> str:
        parts = []
        results = list(self.results)
        left, right = self[LEFT_IDENTITY], self[RIGHT_IDENTITY]
        for r in results:
            if r.law == RIGHT_IDENTITY and _same(left, right):
                continue
            if r.law == LEFT_IDENTITY and _same(left, right):
                parts.append(f"identity: {r.describe()}")
                continue
            parts.append(f"{r.law}: {r.describe()}")
        return "; ".join(parts)


def _same(x: LawResult, y: LawResult) -> bool:
    return x.status == y.status and x.method == y.method and x.holds


def _num(v: float) -> str:
    if math.isnan(v) or math.isinf(v):
        return str(v)
    return repr(int(v)) if v == int(v) and abs(v) < 1e15 else repr(v)


# ---------------------------------------------------------------- entry points
_CACHE: dict[tuple[Summary, int], LawReport] = {}


def check_laws(summary: Summary, *, examples: int = DEFAULT_EXAMPLES) -> LawReport:
    """Check associativity, left/right identity and commutativity of `summary`.
    Commutativity must hold where claimed; otherwise it is probed and reported
    (claimed=False) so that an honest `commutative=False` is visible.

    A product of independent parts (fields whose combines read no field of another
    part: an argmax folded beside a logsumexp) obeys a law exactly when every part
    does, so each part is checked on its own: a small proof instead of a case split
    over the order of every part's leaders at once, and one check per part however
    many programs fold it beside others."""
    try:
        key = (summary, examples)
        if key in _CACHE:
            return _CACHE[key]
    except TypeError:           # an unhashable formula: check without caching
        key = None
    parts = independent_parts(summary)
    if len(parts) == 1:
        report = _check_whole(summary, examples)
    else:
        report = _merged(summary, [(names, check_laws(part, examples=examples)) for part, names in parts])
    if key is not None:
        _CACHE[key] = report
    return report


def _check_whole(summary: Summary, examples: int) -> LawReport:
    laws = _Laws(summary)
    results = []
    for law in (ASSOCIATIVE, LEFT_IDENTITY, RIGHT_IDENTITY, COMMUTATIVE):
        proof = laws.prove(law)
        if proof is not None:
            results.append(LawResult(law, PROVED, proof))
            continue
        counterexample = laws.search(law, examples)
        status = FAILED if counterexample is not None else TESTED
        results.append(LawResult(law, status, f"sampled, {examples} examples",
                                 counterexample=counterexample))
    claimed = summary.commutative
    results[-1] = replace(results[-1], claimed=claimed)
    if summary.blocks:
        counterexample = laws.search_blocks(examples)
        results.append(LawResult(TILE_FORMULA, FAILED if counterexample is not None else TESTED,
                                 f"sampled, {examples} tiles", counterexample=counterexample))
    return LawReport(summary.name, tuple(results))


def independent_parts(summary: Summary) -> tuple[tuple[Summary, tuple[str, ...]], ...]:
    """The parts of `summary` that combine independently (independent_fields), each
    as a summary with fields f0, f1, ... and element arguments x0, x1, ... in order
    of use (equal parts of different products compare equal), with its fields' names
    in `summary`.  One part: the summary itself."""
    groups = independent_fields(summary)
    if len(groups) == 1:
        return ((summary, summary.field_names),)
    return tuple((_part(summary, fields), fields) for fields in groups)


def _part(summary: Summary, fields: tuple[str, ...]) -> Summary:
    part, _ = summary.restricted(fields)
    rename = {f"{side}{f}": f"{side}f{j}" for j, f in enumerate(fields) for side in ("", "a.", "b.")}

    def renamed(e):
        return transform(e, lambda n: Var(rename.get(n.name, n.name)) if isinstance(n, Var) else n)
    return replace(
        part, name="part", fields=tuple(replace(f, name=f"f{j}") for j, f in enumerate(part.fields)),
        combine=tuple(renamed(c) for c in part.combine), finalize=Var("f0"), rescaled=(),
        blocks=tuple(replace(b, fields=tuple((rename[f], x) for f, x in b.fields)) for b in part.blocks))


def _merged(summary: Summary, parts: list[tuple[tuple[str, ...], LawReport]]) -> LawReport:
    """The report of a product from those of its independent parts: a law fails
    where a part's fails (its counterexample named by the product's fields), is
    tested where a part's is only tested, and is proved where every part's is."""
    results = []
    for law in dict.fromkeys(r.law for _, report in parts for r in report.results):
        each = [(names, report[law]) for names, report in parts if law in report]
        statuses = {r.status for _, r in each}
        status = FAILED if FAILED in statuses else TESTED if TESTED in statuses else PROVED
        methods = dict.fromkeys(r.method for _, r in each)
        method = next(iter(methods)) if len(methods) == 1 else \
            "; ".join(f"({', '.join(names)}) {r.method}" for names, r in each)
        failed = next(((names, r.counterexample) for names, r in each if r.status == FAILED), None)
        counterexample = None if failed is None else replace(failed[1], fields=failed[0])
        results.append(LawResult(law, status, method, each[0][1].claimed, counterexample))
    return LawReport(summary.name, tuple(results))


def require_laws(summary: Summary, *, examples: int = DEFAULT_EXAMPLES) -> Summary:
    """The summary with its law report attached; LawError if a claimed law fails."""
    report = check_laws(summary, examples=examples)
    if not report.ok:
        lines = []
        for r in report.failures:
            if r.law == COMMUTATIVE:
                lines.append(f"it is declared commutative but is not: {r.counterexample}; "
                             f"declare it commutative=False and its merge order is kept")
            else:
                lines.append(f"it is not {_adjective(r.law)}: {r.counterexample}")
        raise LawError(f"summary '{summary.name}' breaks the monoid laws: " + "; ".join(lines))
    return replace(summary, laws=report)


def identity_combined(summary: Summary) -> Counterexample | None:
    """combine(identity, identity) where it is not exactly the identity (NaN
    included), else None.  The oracle pads a ragged fold with the identity and a
    masked element lifts to it, unguarded, so a derived summary must be exact
    there: its infinite leader's repair takes a finite stand-in (factorise)."""
    laws = _Laws(summary)
    e = laws.identity
    got = laws._combine(e, e)
    if all(g == want for g, want in zip(got, e)):          # a NaN equals nothing
        return None
    return Counterexample(summary.field_names, (), "combine(identity, identity)", got, "identity", e)


def _adjective(law: str) -> str:
    return {ASSOCIATIVE: "associative", LEFT_IDENTITY: "unital on the left (its identity is not a left identity)",
            RIGHT_IDENTITY: "unital on the right (its identity is not a right identity)"}.get(law, law)


# ---------------------------------------------------------------- the laws of one summary
@dataclass(frozen=True)
class _Side:
    """One law as two expressions over states named 'a', 'b', 'c' or 'e' (the identity)."""

    states: tuple[str, ...]            # free states of the law
    lhs_text: str
    rhs_text: str
    lhs: Callable                      # (combine, state lookup) -> state
    rhs: Callable


_LAWS = {
    ASSOCIATIVE: _Side(("a", "b", "c"), "combine(combine(a, b), c)", "combine(a, combine(b, c))",
                       lambda op, s: op(op(s["a"], s["b"]), s["c"]),
                       lambda op, s: op(s["a"], op(s["b"], s["c"]))),
    LEFT_IDENTITY: _Side(("a",), "combine(identity, a)", "a",
                         lambda op, s: op(s["e"], s["a"]), lambda op, s: s["a"]),
    RIGHT_IDENTITY: _Side(("a",), "combine(a, identity)", "a",
                          lambda op, s: op(s["a"], s["e"]), lambda op, s: s["a"]),
    COMMUTATIVE: _Side(("a", "b"), "combine(a, b)", "combine(b, a)",
                       lambda op, s: op(s["a"], s["b"]), lambda op, s: op(s["b"], s["a"])),
}


class _Laws:
    def __init__(self, summary: Summary):
        self.s = summary
        self.names = summary.field_names
        self._compiled: dict[str, Callable] = {}

    # ------------------------------------------------------------ symbolic
    def _symbols(self, state: str) -> tuple[sympy.Symbol, ...]:
        return tuple(sympy.Symbol(f"{state}.{f.name}", integer=True) if f.dtype == INT
                     else sympy.Symbol(f"{state}.{f.name}", real=True) for f in self.s.fields)

    def _sym_combine(self, a: tuple, b: tuple) -> tuple:
        env = {**{f"a.{n}": v for n, v in zip(self.names, a)},
               **{f"b.{n}": v for n, v in zip(self.names, b)}}
        return tuple(to_sympy(c, env) for c in self.s.combine)

    def _sym_sides(self, law: str, values: dict) -> tuple[tuple, tuple]:
        side = _LAWS[law]
        states = {**values, "e": tuple(to_sympy(c, {}) for c in self.s.identity)}
        return side.lhs(self._sym_combine, states), side.rhs(self._sym_combine, states)

    def prove(self, law: str) -> str | None:
        """The method that proved `law`, or None if sympy cannot decide."""
        try:
            return self._prove(law)
        except Exception:  # noqa: BLE001 -- sympy may refuse a comparison: fall back to testing
            return None

    def _prove(self, law: str) -> str | None:
        symbols = {st: self._symbols(st) for st in _LAWS[law].states}
        lhs, rhs = self._sym_sides(law, symbols)
        if all(_cheap_zero(l, r) for l, r in zip(lhs, rhs)):
            return "sympy"
        if all(_cheap_zero(l, r) or _cheap_zero(sympy.exp(l), sympy.exp(r)) for l, r in zip(lhs, rhs)):
            return "sympy, in the exponential domain"
        atoms, kinds, numbers = _order_atoms(lhs + rhs)
        all_symbols = {x for xs in symbols.values() for x in xs}
        atoms = [a for a in atoms if a in all_symbols]
        pinned = numbers if len(numbers) == 1 else set()    # one constant (0) may join the order
        if atoms and len(atoms) + len(pinned) <= MAX_ORDERED:
            cases = [c for c in _weak_orders(atoms + sorted(pinned, key=float)) if _numbers_apart(c, pinned)]
            if all(self._case_holds(law, symbols, c, pinned) for c in cases):
                return f"sympy, by cases on {'/'.join(kinds)} order"
        diffs = [l - r for l, r in zip(lhs, rhs)]
        if any(_clearly_nonzero(d) for d in diffs):
            return None
        if all(_zero(d) for d in diffs):
            return "sympy"
        return None

    def _case_holds(self, law: str, symbols: dict, blocks: list[list], numbers: set) -> bool:
        value = _block_values(blocks, numbers)
        env = {st: tuple(value.get(x, x) for x in xs) for st, xs in symbols.items()}
        lhs, rhs = self._sym_sides(law, env)
        return all(_cheap_zero(l, r) or (not _clearly_nonzero(l - r) and _zero(l - r))
                   for l, r in zip(lhs, rhs))

    # ------------------------------------------------------------ numeric
    def _lift(self, element: Sequence[float]) -> tuple[float, ...]:
        return self._numeric("lift")(*element)

    def _combine(self, a: Sequence[float], b: Sequence[float]) -> tuple[float, ...]:
        return self._numeric("combine")(*a, *b)

    def _numeric(self, which: str) -> Callable:
        """lift or combine as a float64 function of its variables, compiled once with
        sympy's numpy printer (IEEE semantics like torch's, and no torch import);
        formulas numpy cannot take are evaluated by the oracle's torch column."""
        cached = self._compiled.get(which)
        if cached is None:
            formulas = self.s.lift if which == "lift" else self.s.combine
            names = ([f"x{k}" for k in range(self.s.arity)] if which == "lift" else
                     [f"{side}.{n}" for side in "ab" for n in self.names])
            cached = self._compiled[which] = _float64_function(formulas, names)
        return cached

    def _state(self, elements) -> tuple[float, ...]:
        """A reachable state: the identity, or the ordered fold of lifted elements."""
        if not elements:
            return self.identity
        state = self._lift(elements[0])
        for x in elements[1:]:
            state = self._combine(state, self._lift(x))
        return state

    @property
    def identity(self) -> tuple[float, ...]:
        return tuple(float(c.value) for c in self.s.identity)

    def _violation(self, law: str, draws) -> Counterexample | None:
        side = _LAWS[law]
        states = {name: self._state(d) for name, d in zip(side.states, draws)}
        states["e"] = self.identity
        seen: list[tuple[float, ...]] = []

        def op(a, b):
            out = self._combine(a, b)
            seen.append(out)
            return out

        lhs, rhs = side.lhs(op, states), side.rhs(op, states)
        scale = max((abs(v) for st in [*states.values(), *seen] for v in st if math.isfinite(v)),
                    default=0.0)
        if all(_close(l, r, scale) for l, r in zip(lhs, rhs)):
            return None
        return Counterexample(self.names, tuple((n, states[n]) for n in side.states),
                              side.lhs_text, lhs, side.rhs_text, rhs)

    def search(self, law: str, examples: int) -> Counterexample | None:
        """Look for a counterexample among `examples` seeded draws of reachable
        states, then shrink it.  Deterministic, and nothing is written anywhere."""
        rng = random.Random(f"{self.s.name}/{law}")
        n_states = len(_LAWS[law].states)
        for _ in range(examples):
            draws = tuple(tuple(tuple(_element(rng) for _ in range(self.s.arity))
                                for _ in range(rng.randint(0, 3)))
                          for _ in range(n_states))
            if self._violation(law, draws) is not None:
                return self._violation(law, self._shrink(law, draws))
        return None

    def search_blocks(self, examples: int) -> Counterexample | None:
        """A tile (0 to 6 drawn elements) on which a Block's fields differ from the
        fold of the lifted elements by the combine; None if none is found."""
        rng = random.Random(f"{self.s.name}/{TILE_FORMULA}")
        formulas = [_block_function(block, self.s.arity) for block in self.s.blocks]
        for _ in range(examples):
            tile = tuple(tuple(_element(rng) for _ in range(self.s.arity)) for _ in range(rng.randint(0, 6)))
            want = self._state(tile)
            for block, fields_of in zip(self.s.blocks, formulas):
                names = tuple(f for f, _ in block.fields)
                got = fields_of(tile)
                expected = tuple(want[self.names.index(f)] for f in names)
                scale = max((abs(v) for v in (*got, *expected, *(x for e in tile for x in e)) if math.isfinite(v)),
                            default=0.0)
                if not all(_close(g, e, scale) for g, e in zip(got, expected)):
                    shown = ", ".join("(" + ", ".join(map(_num, e)) + ")" for e in tile)
                    return Counterexample(names, (), f"the tile formula on the elements [{shown}]", got,
                                          "the fold of their lifts", expected)
        return None

    def _shrink(self, law: str, draws: tuple) -> tuple:
        """Greedily simplify a failing draw while it still fails: fewer elements,
        then values moved to 0, to an integer, or one step towards 0."""
        def simpler(d):
            for s, elements in enumerate(d):
                for k in range(len(elements)):
                    yield d[:s] + (elements[:k] + elements[k + 1:],) + d[s + 1:]
            for s, elements in enumerate(d):
                for k, item in enumerate(elements):
                    for j, v in enumerate(item):
                        for w in (0.0, float(math.trunc(v)), v - math.copysign(1.0, v)):
                            if abs(w) < abs(v):
                                new_item = item[:j] + (w,) + item[j + 1:]
                                yield d[:s] + (elements[:k] + (new_item,) + elements[k + 1:],) + d[s + 1:]

        for _ in range(1000):
            smaller = next((c for c in simpler(draws) if self._violation(law, c) is not None), None)
            if smaller is None:
                break
            draws = smaller
        return draws


def _block_function(block, arity: int) -> Callable:
    """A Block as a float64 function: tile of elements -> its fields (each sum taken
    exactly, element by element)."""
    elements = [f"x{k}" for k in range(arity)]
    names = [name for name, _ in block.sums]
    terms = [_float64_function([summand], [*elements, *names[:k]]) for k, (_, summand) in enumerate(block.sums)]
    fields = _float64_function([e for _, e in block.fields], names)

    def fields_of(tile) -> tuple[float, ...]:
        sums: list[float] = []
        for term in terms:
            sums.append(math.fsum(term(*e, *sums)[0] for e in tile))
        return fields(*sums)
    return fields_of


def _element(rng: random.Random) -> float:
    """A lifted element's coordinate: small exact integers half the time (so that
    ties occur), otherwise a moderate float, |x| <= 1e3."""
    return float(rng.randint(-3, 3)) if rng.random() < 0.5 else rng.uniform(-1e3, 1e3)


def _float64_function(formulas, names: list[str]) -> Callable:
    # extended_real, not real: a field takes every float64, the identity's +-inf
    # included; a real (hence finite) symbol lets sympy fold the infinite leader's
    # stand-in where(max(a.r, b.r) == -inf, 0, ...) to its finite branch, and
    # combine(identity, identity) then evaluates exp(-inf + inf) = NaN
    symbols = [sympy.Symbol(f"v{k}", extended_real=True) for k in range(len(names))]
    env = dict(zip(names, symbols))
    try:
        import numpy
        compiled = sympy.lambdify(symbols, [to_sympy(f, env) for f in formulas], modules="numpy")
    except Exception:           # a formula numpy's printer cannot take: the torch column evaluates it
        compiled = None

    def by_numpy(*values):
        with numpy.errstate(all="ignore"):
            return tuple(float(v) for v in compiled(*(numpy.float64(v) for v in values)))

    def by_torch(*values):
        import torch
        frame = {n: torch.tensor(float(v), dtype=torch.float64) for n, v in zip(names, values)}
        return tuple(float(evaluate(f, frame)) for f in formulas)

    if compiled is None:
        return by_torch

    def evaluate_values(*values):
        try:
            return by_numpy(*values)
        except (TypeError, ValueError, ZeroDivisionError, OverflowError):
            return by_torch(*values)
    return evaluate_values


# ---------------------------------------------------------------- sympy helpers
def _cheap_zero(lhs: sympy.Expr, rhs: sympy.Expr) -> bool:
    if lhs == rhs:
        return True
    try:
        return sympy.expand(lhs - rhs) == 0
    except Exception:  # noqa: BLE001 -- undecided, not an error
        return False


def _zero(diff: sympy.Expr) -> bool:
    """sympy's simplify says `diff` is 0 (skipped for very large expressions)."""
    if diff.has(sympy.nan, sympy.zoo) or sympy.count_ops(diff) > MAX_OPS:
        return False
    diff = sympy.piecewise_fold(diff)
    return sympy.simplify(diff) == 0


def _clearly_nonzero(diff: sympy.Expr) -> bool:
    """`diff` is a nonzero number at some real point: it is not identically 0, so
    simplify need not try (the counterexample then comes from the sampler)."""
    rng = random.Random(0)
    for _ in range(2):
        point = {}
        for x in diff.free_symbols:
            v = sympy.Integer(rng.randint(1, 9)) if x.is_integer else sympy.Rational(rng.randint(1, 97),
                                                                                       rng.randint(1, 13))
            point[x] = v if x.is_positive or rng.random() < 0.5 else -v
        try:
            value = complex(diff.xreplace(point).evalf(30))
        except (TypeError, ValueError):
            continue
        if math.isfinite(abs(value)) and abs(value) > 1e-12:
            return True
    return False


def _order_atoms(exprs: Sequence[sympy.Expr]) -> tuple[list, list[str], set]:
    """Arguments of Max/Min and sides of comparisons: the things whose order the
    value depends on.  Returns (symbols in first-seen order, kinds, numbers)."""
    atoms: dict = {}
    kinds: dict[str, None] = {}
    numbers: set = set()

    def visit(e):
        if isinstance(e, (sympy.Max, sympy.Min)):
            kinds["max" if isinstance(e, sympy.Max) else "min"] = None
            args = e.args
        elif isinstance(e, sympy.core.relational.Relational):
            kinds["comparison"] = None
            args = (e.lhs, e.rhs)
        else:
            args = ()
        for a in args:
            if isinstance(a, sympy.Symbol):
                atoms[a] = None
            elif a.is_Number and a.is_finite:
                numbers.add(a)
        for c in e.args:
            if isinstance(c, sympy.Basic):
                visit(c)

    for e in exprs:
        visit(e)
    return list(atoms), list(kinds), numbers


def _weak_orders(items: list) -> Iterator[list[list]]:
    """Every ordering of `items` with ties: ordered set partitions, lowest block first."""
    if not items:
        yield []
        return
    first, rest = items[0], items[1:]
    for order in _weak_orders(rest):
        for i in range(len(order)):
            yield order[:i] + [order[i] + [first]] + order[i + 1:]
        for i in range(len(order) + 1):
            yield order[:i] + [[first]] + order[i:]


def _numbers_apart(blocks: list[list], numbers: set) -> bool:
    return all(sum(1 for x in b if x in numbers) <= 1 for b in blocks)


def _block_values(blocks: list[list], numbers: set) -> dict:
    """Values realising one weak order: a block holding a number is that number;
    the others are spaced from it (or from a free base u) by positive symbols."""
    pivot = next((k for k, b in enumerate(blocks) if any(x in numbers for x in b)), 0)
    base = next((x for x in blocks[pivot] if x in numbers), sympy.Symbol("u", real=True))
    gaps = [sympy.Symbol(f"d{k}", positive=True) for k in range(len(blocks))]
    value = {}
    for k, block in enumerate(blocks):
        if k >= pivot:
            v = base + sum(gaps[pivot + 1:k + 1], sympy.Integer(0))
        else:
            v = base - sum(gaps[k + 1:pivot + 1], sympy.Integer(0))
        for x in block:
            if x not in numbers:
                value[x] = v
    return value


# ---------------------------------------------------------------- numeric helpers
def _close(x: float, y: float, scale: float) -> bool:
    if math.isnan(x) or math.isnan(y):
        return math.isnan(x) and math.isnan(y)
    if math.isinf(x) or math.isinf(y):
        return x == y
    return abs(x - y) <= RTOL * max(scale, abs(x), abs(y))


__all__ = [
    "ASSOCIATIVE",
    "COMMUTATIVE",
    "FAILED",
    "LEFT_IDENTITY",
    "PROVED",
    "RIGHT_IDENTITY",
    "TESTED",
    "Counterexample",
    "LawReport",
    "LawResult",
    "check_laws",
    "identity_combined",
    "require_laws",
]
