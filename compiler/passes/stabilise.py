"""stabilise: make every sum of exponentials max-rescaled.

Rewrites of sum[I](body), then one symbolic simplification:
0. expand: a body weighted by an exponential that varies over I has its logs
   of positive products expanded and is multiplied out, and a sum of terms
   each holding such an exponential is split into one sum per term;
1. pull out: factors of the body that do not vary over I leave the sum
   (sum_m c * f(m) = c * sum_m f(m)); this exposes the m-invariant
   normaliser of a softmax that the Einstein sum put inside;
2. shift: if the body has factors exp(x) with x varying over I (and not
   clamped to at most 0, exp(min(x, c <= 0)): nothing to overflow there), with
   M = max[I](x):  sum_I exp(x) * f  =  exp(M) * sum_I exp(x - M) * f,
   so no exponential inside the sum exceeds 1 (no overflow at logits of 1e4);
3. simplify with sympy, reductions kept as opaque symbols (sums of exponentials
   known positive): exp(M) cancels in ratios, log(exp(M) * l) = M + log(l);
   logs of products with exponentials first wherever they sit (a cross-entropy
   summed over rows holds its log-sum-exp inside sum[i]), then the statement;
4. rescale: what remains as a sum of exponential terms in a denominator or a
   logarithm (a sink logit beside the softmax sum) is rescaled by its largest
   exponent;
5. guard: M + log(sum_I exp(x - M)) is log(sum_I exp(x)) only for a finite M;
   at M = +inf or -inf the log-sum-exp is M itself (torch's convention), so
   the shifted form is selected only where |M| < inf.
"""
from __future__ import annotations

import math
from dataclasses import replace
from functools import lru_cache

import sympy

from ..algebra import BUILTINS
from ..algebra.properties import extremum
from ..ir import Call, Const, Expr, Extent, Program, Reduce, children, free_indices, nodes, transform
from .symbolic import SymbolTable, from_sympy, to_sympy


def factors(e: Expr) -> tuple[list[Expr], list[Expr]]:
    """Flatten a product/quotient into (numerator factors, denominator factors)."""
    if isinstance(e, Call) and e.op == "mul":
        (n1, d1), (n2, d2) = factors(e.args[0]), factors(e.args[1])
        return n1 + n2, d1 + d2
    if isinstance(e, Call) and e.op == "div":
        (n1, d1), (n2, d2) = factors(e.args[0]), factors(e.args[1])
        return n1 + d2, d1 + n2
    return [e], []


def product(numerator: list[Expr], denominator: list[Expr]) -> Expr:
    out = numerator[0] if numerator else Const(1)
    for f in numerator[1:]:
        out = Call("mul", (out, f))
    for f in denominator:
        out = Call("div", (out, f))
    return out


def is_sum(e: Expr) -> bool:
    """A plain sum (not a projection of a fold)."""
    return isinstance(e, Reduce) and e.summary == BUILTINS["sum"] and e.result is None


def _varies(e: Expr, indices) -> bool:
    return bool(set(free_indices(e)) & set(indices))


def pull_out_invariants(e: Expr) -> Expr:
    """sum_I c f = c sum_I f for c free of I; the indices of I that f does not read
    count: sum_{k,j} f(j) = len(k) sum_j f(j), and sum_k c = c len(k)."""
    if not is_sum(e):
        return e
    num, den = factors(e.args[0])
    inside = [f for f in num if _varies(f, e.indices)], [f for f in den if _varies(f, e.indices)]
    outside = [f for f in num if not _varies(f, e.indices)], [f for f in den if not _varies(f, e.indices)]
    if not outside[0] and not outside[1]:
        return e
    body = product(*inside)
    read = tuple(i for i in e.indices if i in free_indices(body))
    counts = [Extent(i) for i in e.indices if i not in read]
    inner = [replace(e, indices=read, args=(body,))] if read else []
    return product([*outside[0], *counts, *inner], outside[1])


def terms(e: Expr, sign: int = 1) -> list[tuple[int, Expr]]:
    """Flatten a sum/difference into signed terms."""
    if isinstance(e, Call) and e.op in ("add", "sub"):
        return terms(e.args[0], sign) + terms(e.args[1], sign if e.op == "add" else -sign)
    if isinstance(e, Call) and e.op == "neg":
        return terms(e.args[0], -sign)
    return [(sign, e)]


def signed_sum(parts: list[tuple[int, Expr]]) -> Expr:
    if not parts:
        return Const(0)
    sign, out = parts[0]
    out = out if sign > 0 else Call("neg", (out,))
    for sign, t in parts[1:]:
        out = Call("add" if sign > 0 else "sub", (out, t))
    return out


def split_sums_of_exponentials(e: Expr) -> Expr:
    """sum_I (a + b) = sum_I a + sum_I b, where a term holds an exponential that
    varies over I (each term then gets its own max shift), or a sum of
    exponentials that does not (sum_v T (Z - lse) = sum_v T Z - lse sum_v T:
    lse leaves the sum).  Otherwise the sum stays whole: a cross-entropy summed
    over rows, sum_i (lse_i - s_i), would cancel as sum_i lse_i - sum_i s_i."""
    if not is_sum(e):
        return e
    parts = terms(e.args[0])
    if len(parts) < 2 or not any(_has_varying_exp(t, e.indices) or _holds_invariant_exp_sum(t, e.indices)
                                 for _, t in parts):
        return e
    return signed_sum([(sign, replace(e, args=(t,))) for sign, t in parts])


def _has_varying_exp(e: Expr, indices) -> bool:
    """Whether `e` holds an exponential varying over `indices` outside any nested
    reduction: one inside sum[j](exp(x)) gets that sum's own shift, and splitting
    the outer sum for it would only make sum_i(lse_i - s_i) cancel as
    sum_i lse_i - sum_i s_i."""
    stack = [e]
    while stack:
        node = stack.pop()
        if _unbounded_exp(node, indices):
            return True
        if not isinstance(node, Reduce):
            stack.extend(children(node))
    return False


def _holds_invariant_exp_sum(e: Expr, indices) -> bool:
    """Whether `e` holds a reduction over an exponential that does not vary over
    `indices` (a log-sum-exp inside a sum over its own index)."""
    return any(isinstance(n, Reduce) and not _varies(n, indices)
               and any(isinstance(x, Call) and x.op == "exp" for a in n.args for x in nodes(a)) for n in nodes(e))


def _unbounded_exp(e: Expr, indices) -> bool:
    """An exponential varying over `indices` that could overflow: its exponent is
    not clamped to at most 0 (exp(min(x, c)) with a constant c <= 0 is at most 1,
    as the saved backward writes the softmax, exp(min(x - lse, 0)))."""
    return isinstance(e, Call) and e.op == "exp" and _varies(e, indices) and not _clamped(e.args[0])


def _clamped(x: Expr) -> bool:
    return (isinstance(x, Call) and x.op == "minimum"
            and any(isinstance(a, Const) and a.value <= 0 for a in x.args))


def shift_exponentials(e: Expr) -> Expr:
    if not is_sum(e):
        return e
    num, den = factors(e.args[0])
    exps = [f for f in num if _unbounded_exp(f, e.indices)]
    if not exps:
        return e
    rest = [f for f in num if not any(f is x for x in exps)]
    parts = [t for x in exps for t in terms(x.args[0])]
    varying = signed_sum([t for t in parts if _varies(t[1], e.indices)])
    invariant = [t for t in parts if not _varies(t[1], e.indices)]
    leader = Reduce(BUILTINS["max"], e.indices, (varying,))
    if invariant == [(-1, leader)] or _bounded(parts, e.indices):
        return e                              # already c * (x - max x): nothing can overflow
    shifted = Call("exp", (Call("sub", (varying, leader)),))
    inner = replace(e, args=(product([shifted, *rest], den),))
    return Call("mul", (Call("exp", (signed_sum([*invariant, (1, leader)]),)), inner))


def expand_weighted_sums(e: Expr) -> Expr:
    """In a sum whose body holds an exponential varying over its indices: logs of
    positive products and quotients become sums of logs (log(exp(x) / S) =
    x - log(S), so log-softmax keeps no bare exp), and the body is multiplied
    out over its top-level sums, so that `split_sums_of_exponentials` gives
    every term its own sum: sum_m p (x - log S) = sum_m p x - log(S) sum_m p."""
    if not is_sum(e) or not _has_varying_exp(e.args[0], e.indices):
        return e
    table = SymbolTable()
    body = to_sympy(e.args[0], table, _positive_sums(e.args[0]))
    expanded = sympy.expand(sympy.expand_log(body, force=False), deep=False, mul=True, multinomial=False,
                            power_exp=False, power_base=False, log=False)
    return replace(e, args=(from_sympy(expanded, table),)) if expanded != body else e


def _bounded(parts: list[tuple[int, Expr]], indices) -> bool:
    """Is the exponent c * (g - max[I](g)) for a constant c > 0 and some g, so at
    most 0?  Any summary whose merge selects the larger state counts as a max."""
    return _at_most_zero(signed_sum(parts), tuple(indices))


@lru_cache(maxsize=4096)
def _at_most_zero(exponent: Expr, indices: tuple[str, ...]) -> bool:
    """_bounded's question on one exponent E: a max M over `indices` is a leaf of E
    (reductions are opaque symbols), E is linear in M with coefficient -c, c > 0 a
    number, and E - c (g - M) multiplies out to 0.  Linear algebra, not simplify:
    the exponent of a nested softmax holds the whole inner one."""
    table = SymbolTable()
    e = sympy.expand(to_sympy(exponent, table), deep=False)
    for symbol in e.free_symbols:
        leader = table.to_expr.get(symbol)
        if not (isinstance(leader, Reduce) and extremum(leader.summary) == "max" and leader.indices == indices):
            continue
        c = -e.diff(symbol)
        if not (c.is_number and c.is_positive):
            continue
        if sympy.expand(e - c * (to_sympy(leader.args[0], table) - symbol), deep=False) == 0:
            return True
    return False


def _positive_sums(e: Expr) -> frozenset:
    """Sums whose body is a single exponential (times nothing): positive."""
    return frozenset(n for n in nodes(e) if is_sum(n) and isinstance(n.args[0], Call)
                     and n.args[0].op == "exp")


def simplify(e: Expr) -> Expr:
    table = SymbolTable()
    s = to_sympy(e, table, _positive_sums(e))
    s = sympy.expand_log(sympy.powsimp(s), force=False)
    return from_sympy(s, table)


def cancel_in_branches(e: Expr) -> Expr:
    """A sum multiplied out, or a + where(c, p, q) as where(c, a + p, a + q): the
    terms beside a where go into both branches and cancel there (a leader added
    in a branch and subtracted outside it: where(|r| < inf, r + log(l), r) - r);
    the smallest of these, where it is smaller than the sum as written."""
    if not (isinstance(e, Call) and e.op in ("add", "sub")):
        return e
    parts = terms(e)
    candidates = [_expanded(e)]
    for k, (sign, t) in enumerate(parts):
        if isinstance(t, Call) and t.op == "where":
            rest = parts[:k] + parts[k + 1:]
            condition, *branches = t.args
            candidates.append(Call("where", (condition, *(_expanded(signed_sum([(sign, b), *rest]))
                                                          for b in branches))))
    best = min(candidates, key=_size)
    return best if _size(best) < _size(e) else e


def _expanded(e: Expr) -> Expr:
    """e multiplied out (logs, powers and exponentials kept whole), so terms cancel."""
    table = SymbolTable()
    s = sympy.expand(to_sympy(e, table, _positive_sums(e)), mul=True, multinomial=False, power_exp=False,
                     power_base=False, log=False)
    return from_sympy(s, table)


def _size(e: Expr) -> int:
    """Nodes of e, a reduction counting as one (sympy sees it as one symbol)."""
    stack, n = [e], 0
    while stack:
        node = stack.pop()
        n += 1
        if not isinstance(node, Reduce):
            stack.extend(children(node))
    return n


def simplify_logs(e: Expr) -> Expr:
    """log(exp(M) * l) = M + log(l) wherever the log sits (step 3 runs on the
    statement, where reductions are opaque: a cross-entropy summed over rows
    holds its log-sum-exp inside sum[i])."""
    if isinstance(e, Call) and e.op == "log":
        num, den = factors(e.args[0])
        if any(isinstance(f, Call) and f.op == "exp" for f in num + den):
            return simplify(e)
    return e


def _exponent(term: Expr) -> tuple[Expr, Expr] | None:
    """term = exp(a) * rest: (a, rest), the exp factors of the numerator combined;
    None if the term has no exp factor."""
    num, den = factors(term)
    exps = [f for f in num if isinstance(f, Call) and f.op == "exp"]
    if not exps:
        return None
    a = signed_sum([t for x in exps for t in terms(x.args[0])])
    return a, product([f for f in num if not any(f is x for x in exps)], den)


def _rescaled(parts: list[tuple[int, Expr]], exponents: list[tuple[Expr, Expr]], top: Expr) -> Expr:
    scaled = [(sign, Call("exp", (Call("sub", (a, top)),)), rest) for (sign, _), (a, rest) in zip(parts, exponents)]
    return signed_sum([(sign, w if rest == Const(1) else Call("mul", (w, rest))) for sign, w, rest in scaled])


def rescale_exponential_sums(e: Expr) -> Expr:
    """A sum of exponential terms outside any reduction (an attention sink or a
    learned logit joining a softmax denominator: l * exp(r) + exp(s)) is
    rescaled by the largest exponent R = max(r, s): log(D) = R + log(D * exp(-R))
    and N / D = (N * exp(-R)) / (D * exp(-R)), so no exponential overflows."""
    if isinstance(e, Call) and e.op in ("div", "log"):
        denominator = e.args[-1]
        parts = terms(denominator)
        exponents = [_exponent(t) for _, t in parts]
        if len(parts) < 2 or None in exponents:
            return e
        top = exponents[0][0]
        for a, _ in exponents[1:]:
            top = Call("maximum", (top, a))
        scaled = _rescaled(parts, exponents, top)
        if e.op == "log":
            return Call("add", (top, Call("log", (scaled,))))
        numerator = terms(e.args[0])
        num_exponents = [_exponent(t) for _, t in numerator]
        if None in num_exponents:
            return e
        return Call("div", (_rescaled(numerator, num_exponents, top), scaled))
    return e


def guard_infinite_shift(e: Expr) -> Expr:
    """M + log(sum_I exp(x - M)), M = max[I](x), as where(|M| < inf, that, M): the
    shifted sum is exp(inf - inf) = NaN at M = +inf, where the log-sum-exp is +inf."""
    if not (isinstance(e, Call) and e.op in ("add", "sub")):
        return e
    parts = terms(e)
    for k, (sign, t) in enumerate(parts):
        if sign < 0 or not (isinstance(t, Call) and t.op == "log" and is_sum(t.args[0])):
            continue
        body = t.args[0].args[0]
        if not (isinstance(body, Call) and body.op == "exp"):
            continue
        shift = [(-s, m) for s, m in terms(body.args[0]) if isinstance(m, Reduce) and extremum(m.summary) == "max"
                 and m.indices == t.args[0].indices]
        if len(shift) != 1 or shift[0] not in parts:
            continue
        leader = shift[0][1]
        rest = [p for j, p in enumerate(parts) if j != k and p != shift[0]]
        shifted = Call("add", (leader, t))
        finite = Call("lt", (Call("abs", (leader,)), Const(math.inf)))
        return signed_sum([*rest, (1, Call("where", (finite, shifted, leader)))])
    return e


def stabilise(program: Program) -> Program:
    statements = []
    for st in program.statements:
        expr = transform(st.expr, lambda n: split_sums_of_exponentials(expand_weighted_sums(n)))
        expr = transform(expr, pull_out_invariants)
        shifted = transform(expr, shift_exponentials)
        if shifted != expr:
            shifted = simplify(transform(shifted, simplify_logs))
            shifted = transform(transform(shifted, rescale_exponential_sums), guard_infinite_shift)
        statements.append(replace(st, expr=shifted))
    return replace(program, statements=tuple(statements))
