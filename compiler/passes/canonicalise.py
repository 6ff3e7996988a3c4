"""canonicalise: one spelling for programs that mean the same thing.

1. Bound indices get canonical names (alpha-equivalence).  A reduction's index
   is named after its extent class (`len_m` -> `m`), numbered (`m_2`, ...) only
   where the reduction reads an outer index of that name.  A size `len(n)`
   names the class the same way.  Reductions over one axis then carry
   one index name however they were written (`sum[n](P[i,n])` beside
   `sum[m](P[i,m])`), so equal reductions are equal values and the reductions
   of one axis fall into one group for `factorise`.
2. Base-2 exponentials and logarithms are written in the natural base
   (exp2(x) = exp(x * ln 2), log2(x) = log(x) / ln 2), so one stabiliser covers
   the exponential family; a backend may rewrite back to base 2.
3. Operands of commutative operators are put in one order (their printed form),
   after flattening chains of an associative one: Q*K and K*Q, (a+b)+c and
   a+(c+b) are one expression, so equal reductions are equal values.  Sums and
   differences are one chain of signed terms (the added ones, then the
   subtracted ones), products and quotients one chain of factors over divisors,
   so the identities of arithmetic give one spelling: a + (-1) * b = a - b,
   -(-x) = x, x + 0 = x, x * 1 = x, a * (1 / b) = a / b, (a - b) + c = a + c - b.
   A product's sign sits on its first factor (-a * b), where `factors` sees the
   others; exponentials multiplied or divided are one, exp(a) / exp(b) =
   exp(a - b), so stabilise shifts one exponent.  Equal terms added and
   subtracted in one chain cancel (x + y - x = y): the chain's terms are
   reordered, so without it (X + 2) - (X + 2) would round to 2 + X - 2 - X,
   a few ulps, not 0, and a comparison with 0 would flip.  The normal form
   computes in the reals here.  A chain keeps the indices it varies over (a
   reduction's body its index): where every term cancels one pair t - t stays,
   exactly 0 for a finite t (NaN for an infinite one, as written), and no
   term cancels where the rest would lose an index.  A chain that loses every
   float term keeps its type with + 0.0.

4. Sums over the same indices, with the same free indices, that are added or
   subtracted anywhere in one chain are one sum (linearity), with the factors
   their terms share (up to sign) pulled out:
   sum[v](a * W) + sum[v](b * W * Y) = sum[v]((a + b * Y) * W).  A gradient
   accumulates one such term per use of an input; as one product the sum is
   one contraction (one tl.dot) instead of a fold of a pair of sums.

5. A sum over several indices keeps inside each index's sum only the factors
   that vary over it: sum[v, k](Y[i,v] * H[i,k] * W[v,k]) =
   sum[v](Y[i,v] * sum[k](H[i,k] * W[v,k])), a contraction (the logits a
   cross-entropy's logsumexp already folds) rather than a fold one v at a time.

6. Inside `where(p, x, y)`, x is read only where p holds (y where it fails, for
   one comparison p): an absolute value, max or min of integer index
   expressions whose sign a comparison of p decides is the expression it
   selects there: where(m <= i, A[h] * abs(i - m), -inf) = where(m <= i,
   A[h] * (i - m), -inf), as a program that knows the sign would write it.
   Comparisons are read as integer linear forms (i - m >= 0); a reduction
   or composite inside binds its own indices, about which the comparisons
   outside say nothing.

7. A mask has one orientation: `where(p, c, x)` with a constant c and a
   non-constant x is where(not p, x, c), the constant last, as a bound reads
   it; between two constants the one a mask sets where it excludes goes last
   (a non-finite one, else 0: where(m > i, inf, 0) is where(m <= i, 0, inf));
   and `not` is pushed inward: not (a and b) = not a or not b (and dually),
   not not p = p, not (a == b) = a != b (and back), and the complement of an
   ordered comparison of integers, not (m > i) = m <= i.  An ordered comparison
   of floats keeps its `not`: NaN fails both x < y and x >= y.  So
   where(m > i or i - m >= W, -inf, s) is where(m <= i and i - m < W, s, -inf),
   whose loop the bounds of the window cut.

Free (left-hand) indices keep the names the program gives them."""
from __future__ import annotations

import math
from dataclasses import replace

from ..algebra import BUILTINS
from ..ir import (
    Access,
    Call,
    Composite,
    Const,
    Expr,
    Extent,
    Index,
    Program,
    Reduce,
    bound_indices,
    children,
    constant,
    format_expr,
    free_indices,
    linear_form,
    nodes,
    transform,
    with_children,
)
from ..ops import ASSOCIATIVE, COMMUTATIVE, FLOAT, INT, OPS
from .fuse import FreshNames, rename_indices
from .stabilise import factors, is_sum, product, signed_sum

LN2 = Const(math.log(2.0))

# One row per base-2 function: its natural-base form.
NATURAL_BASE = {
    "exp2": lambda x: Call("exp", (Call("mul", (x, LN2)),)),
    "log2": lambda x: Call("div", (Call("log", (x,)), LN2)),
}


def natural_base(e: Expr) -> Expr:
    if isinstance(e, Call) and e.op in NATURAL_BASE:
        return NATURAL_BASE[e.op](e.args[0])
    return e


# One row per operator that chains: the chain it belongs to and the sign each of
# its operands enters with (a sum's terms added or subtracted, a product's factors
# multiplied or divided).  Associative commutative operators of their own chain
# (max, min, and, or) enter with +1.
CHAINS: dict[str, tuple[str, tuple[int, ...]]] = {
    "add": ("sum", (1, 1)), "sub": ("sum", (1, -1)), "neg": ("sum", (-1,)),
    "mul": ("product", (1, 1)), "div": ("product", (1, -1)),
    **{op: (op, (1, 1)) for op in ASSOCIATIVE - {"add", "mul"}},
}


def order_operands(e: Expr, types: ExpressionTypes | None = None) -> Expr:
    """`e` with every chain in its normal form (rule 3): sums and differences as one
    chain of signed terms, products and quotients as one chain of factors over
    divisors, other associative calls flattened; operands sorted by printed form.
    With the program's `types`, equal terms added and subtracted cancel.
    Iterative, and each chain is flattened once at its top: linear in its length."""
    done: dict[int, Expr] = {}
    stack: list[tuple[Expr, list[tuple[int, Expr]] | None]] = [(e, None)]
    while stack:
        node, operands = stack.pop()
        if id(node) in done:
            continue
        if operands is None:
            operands = _signed_operands(node)
            pending = [a for _, a in operands if id(a) not in done]
            if pending:
                stack.append((node, operands))
                stack.extend((a, None) for a in pending)
                continue
        new = [(sign, done[id(a)]) for sign, a in operands]
        chain = _chain(node)
        if chain == "sum":
            done[id(node)] = _normal_sum(new, types)
        elif chain == "product":
            done[id(node)] = _normal_product(new)
        elif isinstance(node, Call) and node.op in COMMUTATIVE:
            # an operand may have become a chain of this operator (max(a, b) * 1): joined in
            flat = [b for _, a in new for _, b in (_signed_operands(a) if chain and _chain(a) == chain else [(1, a)])]
            done[id(node)] = _left_chain(node.op, sorted(flat, key=format_expr))
        else:
            done[id(node)] = with_children(node, tuple(a for _, a in new))
    return done[id(e)]


def _chain(node: Expr) -> str | None:
    return CHAINS[node.op][0] if isinstance(node, Call) and node.op in CHAINS else None


def _signed_operands(node: Expr) -> list[tuple[int, Expr]]:
    """A node's children (sign +1); for the top of a chain, the operands of the whole
    chain with the sign each enters with."""
    chain = _chain(node)
    if chain is None:
        return [(1, c) for c in children(node)]
    operands, pending = [], [(1, node)]
    while pending:
        sign, n = pending.pop()
        if _chain(n) == chain:
            pending.extend(reversed([(sign * s, a) for s, a in zip(CHAINS[n.op][1], n.args)]))
        else:
            operands.append((sign, n))
    return operands


def _left_chain(op: str, operands: list[Expr]) -> Expr:
    out = operands[0]
    for a in operands[1:]:
        out = Call(op, (out, a))
    return out


def _is_number(e: Expr, value: int) -> bool:
    """Whether `e` is the integer literal `value`: only an integer 1, 0 or -1 is
    dropped or taken as a sign, since a float one also converts an integer
    operand (`i * 1.0` is a float)."""
    return isinstance(e, Const) and type(e.value) is int and e.value == value


def _normal_sum(operands: list[tuple[int, Expr]], types: ExpressionTypes | None = None) -> Expr:
    """Signed terms (already normal) as one chain: added terms sorted, then the
    subtracted ones sorted; terms that are sums themselves joined in (-(-x) = x),
    a product's sign read off its first factor (a + (-1) * b = a - b), zeros
    dropped (x + 0 = x); with `types`, equal terms added and subtracted cancelled
    (x + y - x = y), a chain left without its float terms keeping its type (+ 0.0)."""
    added, subtracted = [], []
    for sign, term in operands:
        for s, t in (_signed_operands(term) if _chain(term) == "sum" else [(1, term)]):
            s, t = _sign_of_product(s, t)
            if not _is_number(t, 0):
                (added if sign * s > 0 else subtracted).append(t)
    if types is not None and added and subtracted:
        added, subtracted = _cancelled(added, subtracted, types)
    added.sort(key=format_expr)
    subtracted.sort(key=format_expr)
    if not added:
        if not subtracted:
            return Const(0)
        added, subtracted = [_negated(subtracted[0])], subtracted[1:]
    out = _left_chain("add", added)
    for t in subtracted:
        out = Call("sub", (out, t))
    return out


def _cancelled(added: list[Expr], subtracted: list[Expr], types: ExpressionTypes) -> tuple[list, list]:
    """The terms left when equal terms added and subtracted cancel in pairs.  The
    chain keeps the indices it varies over (a reduction's body keeps its index):
    where every term cancels, one pair t - t stays (exactly 0 for a finite t),
    and nothing cancels where the rest would lose an index."""
    pending: dict[Expr, int] = {}
    for t in subtracted:
        pending[t] = pending.get(t, 0) + 1
    kept, cancelled = [], []
    for t in added:
        if pending.get(t):
            pending[t] -= 1
            cancelled.append(t)
        else:
            kept.append(t)
    if not cancelled:
        return added, subtracted
    left = []
    for t in subtracted:            # each subtracted term as often as it was not cancelled
        if pending[t]:
            pending[t] -= 1
            left.append(t)
    if not kept and not left:
        pair = max(cancelled, key=lambda t: (len(free_indices(t)), types(t) == FLOAT))
        kept, left = [pair], [pair]
    varies = {i for t in added + subtracted for i in free_indices(t)}
    if {i for t in kept + left for i in free_indices(t)} != varies:
        return added, subtracted
    if any(types(t) == FLOAT for t in cancelled) and all(types(t) != FLOAT for t in kept + left):
        kept.append(Const(0.0))
    return kept, left


def _sign_of_product(sign: int, term: Expr) -> tuple[int, Expr]:
    """A term -a * b as the sign -1 and the term a * b."""
    if _chain(term) != "product":
        return sign, term
    numerator, denominator = factors(term)
    first = numerator[0]
    if not (isinstance(first, Call) and first.op == "neg"):
        return sign, term
    return -sign, product([first.args[0], *numerator[1:]], denominator)


def _negated(term: Expr) -> Expr:
    """-term in normal form: a product carries the sign on its first factor, where
    `factors` (stabilise's pull out, factorise) still sees every other factor."""
    if _chain(term) != "product":
        return Call("neg", (term,))
    numerator, denominator = factors(term)
    return product([Call("neg", (numerator[0],)), *numerator[1:]], denominator)


def _normal_product(operands: list[tuple[int, Expr]]) -> Expr:
    """Factors (already normal; +1 multiplied, -1 divided) as one chain: the sorted
    factors over the sorted divisors; factors that are products themselves joined
    in (a * (1 / b) = a / b), ones dropped (x * 1 = x), the signs of negated
    factors and of -1 collected onto the first factor (a * -b = -a * b), and
    exponentials multiplied or divided as one (exp(a) / exp(b) = exp(a - b): one
    exponent for stabilise to shift)."""
    numerator, denominator, negated = [], [], False
    pending = list(reversed(operands))
    while pending:
        power, f = pending.pop()
        if _chain(f) == "product":
            pending.extend(reversed([(power * p, g) for p, g in _signed_operands(f)]))
        elif isinstance(f, Call) and f.op == "neg":
            negated = not negated
            pending.append((power, f.args[0]))
        elif _is_number(f, -1):
            negated = not negated
        elif not _is_number(f, 1):
            (numerator if power > 0 else denominator).append(f)
    exponentials = [(1, f) for f in numerator if _is_exp(f)] + [(-1, f) for f in denominator if _is_exp(f)]
    if len(exponentials) > 1 or any(power < 0 for power, _ in exponentials):
        numerator = [f for f in numerator if not _is_exp(f)]
        denominator = [f for f in denominator if not _is_exp(f)]
        numerator.append(Call("exp", (_normal_sum([(power, f.args[0]) for power, f in exponentials]),)))
    out = product(sorted(numerator, key=format_expr), sorted(denominator, key=format_expr))
    return _negated(out) if negated else out


def _is_exp(e: Expr) -> bool:
    return isinstance(e, Call) and e.op == "exp"


def merge_sums(e: Expr) -> Expr:
    """sum[I](a) +/- sum[I](b) -> sum[I]((a' +/- b') * common), `common` the factors
    of the numerators a and b share (structurally, with canonical bound names, up
    to their signs), for any two terms of one chain of sums and differences (its
    normal form orders terms by sign, so such sums need not stand side by side).
    Only sums with the same free indices: dP[i,m] - D[i] = sum[j](dO V) -
    sum[j](dO O) as one sum would compute D once per (i, m), and would make
    (V[m,j] - O[i,j]) one factor, not a matrix product."""
    if not (_chain(e) == "sum" and any(is_sum(a) for a in e.args)):
        return e                # (a chain's sums are joined as each is added: linear without sums)
    operands = _signed_operands(e)
    merged: list[tuple[int, Expr]] = []
    for sign, term in operands:
        partner = next((k for k, (_, t) in enumerate(merged) if is_sum(term) and is_sum(t)
                        and t.indices == term.indices and set(free_indices(t)) == set(free_indices(term))), None)
        if partner is None:
            merged.append((sign, term))
        else:
            first_sign, first = merged[partner]
            merged[partner] = (first_sign, _merged_sum(first, term, sign * first_sign))
    return e if len(merged) == len(operands) else signed_sum(merged)


def _merged_sum(left_sum: Reduce, right_sum: Reduce, sign: int) -> Reduce:
    """sum[I](a) + sign * sum[I](b) as one sum, the factors a and b share outside."""
    (left, left_den), (right, right_den) = factors(left_sum.args[0]), factors(right_sum.args[0])
    left_sign, left = _unsigned(left)
    right_sign, right = _unsigned(right)
    common = []
    for f in list(left):
        if f in right:
            common.append(f)
            left.remove(f)
            right.remove(f)
    body = signed_sum([(left_sign, product(left, left_den)), (sign * right_sign, product(right, right_den))])
    return Reduce(BUILTINS["sum"], left_sum.indices, (product([body, *common], []),))


def _unsigned(numerator: list[Expr]) -> tuple[int, list[Expr]]:
    """Factors with their negations taken off, and the sign of their product."""
    sign, out = 1, []
    for f in numerator:
        while isinstance(f, Call) and f.op == "neg":
            sign, f = -sign, f.args[0]
        out.append(f)
    return sign, out


def nest_sums(e: Expr, elsewhere: frozenset = frozenset()) -> Expr:
    """sum[v, k](Y[i,v] * H[i,k] * W[v,k]) -> sum[v](Y[i,v] * sum[k](H[i,k] * W[v,k])):
    the factors that do not vary over one reduced index leave its sum
    (distributivity), so the product over all indices at once (a fold one v at a
    time, or an n^4 matrix chain) becomes nested contractions.  The inner index is
    chosen whatever the order the indices are written in: first one whose inner
    sum is a reduction found `elsewhere` in the statement (the logits a
    logsumexp beside it folds: one value for both), then the one that leaves most
    factors over the other reduced indices outside, then the first by (canonical)
    name."""
    if not (is_sum(e) and len(e.indices) > 1):
        return e
    num, den = factors(e.args[0])
    best = None
    for x in sorted(e.indices):
        inside = ([f for f in num if x in free_indices(f)], [f for f in den if x in free_indices(f)])
        outside = ([f for f in num if x not in free_indices(f)], [f for f in den if x not in free_indices(f)])
        # only a factor over another reduced index separates x (one over none of them,
        # a softmax's normaliser, leaves the whole sum alike: no nesting for it)
        separating = sum(bool(set(free_indices(f)) & set(e.indices)) for f in outside[0] + outside[1])
        if not any(inside) or not separating:
            continue
        inner = order_operands(Reduce(BUILTINS["sum"], (x,), (product(*inside),)))
        rank = (inner in elsewhere, separating)
        if best is None or rank > best[0]:
            best = (rank, x, inner, outside)
    if best is None:
        return e
    _, x, inner, (out_num, out_den) = best
    rest = tuple(i for i in e.indices if i != x)
    return nest_sums(Reduce(BUILTINS["sum"], rest, (product([*out_num, inner], out_den),)), elsewhere)


# Rule 6: one row per operator a sign decides: (the integer index expression d whose
# sign decides it, what it is where d >= 0, what it is where d <= 0).
DECIDED_BY_SIGN: dict[str, tuple] = {
    "abs": (lambda a: a[0], lambda a: a[0], lambda a: Call("neg", (a[0],))),
    "maximum": (lambda a: Call("sub", (a[0], a[1])), lambda a: a[0], lambda a: a[1]),
    "minimum": (lambda a: Call("sub", (a[0], a[1])), lambda a: a[1], lambda a: a[0]),
}

# A fact: an integer linear form of indices, sum(c * index) + constant >= 0, as
# (coefficients sorted by index, constant).
Fact = tuple[tuple[tuple[str, int], ...], int]


def _index_form(e: Expr) -> tuple[dict[str, int], int] | None:
    """`e` as sum(c * index) + constant with integers c and an integral constant (the
    index-free terms of its `linear_form` evaluated), or None."""
    form = linear_form(e)
    if form is None:
        return None
    coeffs, terms = form
    total = 0
    for sign, term in terms:
        value = constant(term)
        if value is None or not math.isfinite(value) or value != int(value):
            return None
        total += sign * int(value)
    return coeffs, total


# the comparison that holds exactly where one fails (for an ordered one, where no side is NaN)
COMPLEMENT = {"le": "gt", "lt": "ge", "ge": "lt", "gt": "le", "eq": "ne", "ne": "eq"}
ORDERED = frozenset({"le", "lt", "ge", "gt"})


def _fact(coeffs: dict[str, int], constant: int) -> Fact:
    return tuple(sorted(coeffs.items())), constant


def _facts(condition: Expr, holds: bool) -> list[Fact]:
    """What `condition` says where it holds (each comparison conjunct), or where it
    fails (a single comparison), as facts d >= 0."""
    comparisons = {"le": (1, 0), "lt": (1, 1), "ge": (-1, 0), "gt": (-1, 1)}
    if holds and isinstance(condition, Call) and condition.op == "and":
        return _facts(condition.args[0], True) + _facts(condition.args[1], True)
    if not (isinstance(condition, Call) and condition.op in comparisons):
        return []
    op = condition.op if holds else COMPLEMENT[condition.op]
    left, right = (_index_form(a) for a in condition.args)
    if left is None or right is None:
        return []
    sign, strict = comparisons[op]          # le: right - left >= 0; lt: right - left - 1 >= 0
    coeffs = dict(right[0])
    for n, v in left[0].items():
        coeffs[n] = coeffs.get(n, 0) - v
    return [_fact({n: sign * v for n, v in coeffs.items() if v}, sign * (right[1] - left[1]) - strict)]


def _sign(d: Expr, facts: frozenset[Fact]) -> bool | None:
    """True where the facts imply d >= 0, False where they imply d <= 0, else None:
    d >= 0 where d = F + c for a fact F >= 0 and a constant c >= 0; d <= 0 where -d is so."""
    form = _index_form(d)
    if form is None or not facts:
        return None
    coeffs, constant = form
    for sign in (1, -1):
        key = tuple(sorted((n, sign * v) for n, v in coeffs.items()))
        for fact_coeffs, fact_constant in facts:
            if fact_coeffs == key and sign * constant >= fact_constant:
                return sign > 0
    return None


def decide_signs(e: Expr) -> Expr:
    """Rule 6 on `e`: every operator of DECIDED_BY_SIGN whose deciding expression the
    comparisons of an enclosing where's condition decide, replaced by what it selects."""
    if not any(isinstance(n, Call) and n.op == "where" for n in nodes(e)) or \
            not any(isinstance(n, Call) and n.op in DECIDED_BY_SIGN for n in nodes(e)):
        return e
    done: list[Expr] = []
    stack: list[tuple[Expr, frozenset[Fact], bool]] = [(e, frozenset(), False)]
    while stack:
        node, facts, expanded = stack.pop()
        kids = children(node)
        if not expanded and kids:
            stack.append((node, facts, True))
            binds = set(bound_indices(node))
            inner = frozenset(f for f in facts if not binds & {n for n, _ in f[0]}) if binds else facts
            if isinstance(node, Call) and node.op == "where":
                branches = [inner, inner | set(_facts(node.args[0], True)), inner | set(_facts(node.args[0], False))]
            else:
                branches = [inner] * len(kids)
            stack.extend((k, f, False) for k, f in reversed(list(zip(kids, branches))))
            continue
        if kids:
            new = tuple(done[-len(kids):])
            del done[-len(kids):]
            node = with_children(node, new)
        if isinstance(node, Call) and node.op in DECIDED_BY_SIGN:
            deciding, where_nonneg, where_nonpos = DECIDED_BY_SIGN[node.op]
            sign = _sign(deciding(node.args), facts)
            if sign is not None:
                node = (where_nonneg if sign else where_nonpos)(node.args)
        done.append(node)
    return done[0]


def negation(p: Expr, types: ExpressionTypes) -> Expr:
    """`not p` with the `not` pushed inward (rule 7)."""
    if isinstance(p, Const) and isinstance(p.value, bool):
        return Const(not p.value)
    if isinstance(p, Call):
        if p.op == "not":
            return p.args[0]
        if p.op in ("and", "or"):
            return Call("or" if p.op == "and" else "and", tuple(negation(a, types) for a in p.args))
        if p.op in COMPLEMENT and (p.op not in ORDERED or all(types(a) == INT for a in p.args)):
            return Call(COMPLEMENT[p.op], p.args)
    return Call("not", (p,))


def _excluding(first: Expr, second: Expr) -> bool:
    """Whether `first` reads as the value a mask sets where it excludes, and `second` does
    not: a constant beside a non-constant; between constants, a non-finite one (a logit's
    -inf, a subtracted inf) before a finite one, and 0 (a factor's) before a non-zero."""
    a, b = constant(first), constant(second)
    if a is None:
        return False
    if b is None:
        return True
    rank = [2 if not math.isfinite(v) else 1 if v == 0 else 0 for v in (a, b)]
    return rank[0] > rank[1]


def orient_masks(e: Expr, types: ExpressionTypes) -> Expr:
    """Rule 7 on `e`: constant branches of a where last, `not` pushed inward."""
    def orient(n: Expr) -> Expr:
        if isinstance(n, Call) and n.op == "not":
            return negation(n.args[0], types)
        if isinstance(n, Call) and n.op == "where" and _excluding(n.args[1], n.args[2]):
            return Call("where", (negation(n.args[0], types), n.args[2], n.args[1]))
        return n
    if not any(isinstance(n, Call) and n.op in ("not", "where") for n in nodes(e)):
        return e
    return transform(e, orient)


def _linear_forms(e: Expr, types: ExpressionTypes) -> Expr:
    elsewhere = frozenset(n for n in nodes(e) if is_sum(n))
    return order_operands(transform(e, lambda n: merge_sums(nest_sums(n, elsewhere))), types)


class ExpressionTypes:
    """The type (int or float) of an expression of a program, memoised: a chain whose
    float terms cancel keeps its type (rule 3)."""

    def __init__(self, tensor_types: dict[str, str]):
        self.tensor_types = tensor_types          # inputs and statements
        self.types: dict[Expr, str | None] = {}

    def __call__(self, e: Expr) -> str | None:
        if e not in self.types:
            if isinstance(e, Const):
                self.types[e] = INT if isinstance(e.value, int) else FLOAT
            elif isinstance(e, Index | Extent):
                self.types[e] = INT
            elif isinstance(e, Access):
                self.types[e] = self.tensor_types[e.tensor]
            elif isinstance(e, Composite):
                self.types[e] = FLOAT
            else:
                args = tuple(self(c) for c in children(e))
                self.types[e] = OPS[e.op].result(args) if isinstance(e, Call) else e.summary.result_type(args)
        return self.types[e]


class _Binders:
    """Canonical names for bound indices, with the extent table kept complete."""

    def __init__(self, extents: dict):
        self.extents = extents
        # a binder that a renaming would capture gets a fresh name (made canonical later)
        self.fresh = FreshNames(extents).fresh
        # id of a node -> (the node, kept alive so that its id is not reused; its renaming):
        # a subtree shared by several parents is renamed once
        self.renamed: dict[int, tuple[Expr, Expr]] = {}

    def canonical(self, index: str, taken: set[str]) -> str:
        base = str(self.extents[index]).removeprefix("len_")
        name, n = base, 1
        while name in taken:
            n += 1
            name = f"{base}_{n}"
        self.extents.setdefault(name, self.extents[index])
        return name

    def rename(self, e: Expr) -> Expr:
        if id(e) not in self.renamed:
            self.renamed[id(e)] = (e, self._rename(e))
        return self.renamed[id(e)][1]

    def _rename(self, e: Expr) -> Expr:
        if isinstance(e, Extent):           # a size, not a position: any index of the class names it
            return replace(e, name=self.canonical(e.name, set()))
        if isinstance(e, Reduce):
            # Any name but the reduction's own free indices is safe: an enclosing
            # binder's index that the body does not read may be shadowed.
            taken = set(free_indices(e))
            mapping = {}
            for bound in e.indices:
                mapping[bound] = self.canonical(bound, taken)
                taken.add(mapping[bound])
            renamed = replace(e, indices=tuple(mapping[b] for b in e.indices))
            body = tuple(rename_indices(c, {b: c_ for b, c_ in mapping.items() if b != c_}, self.fresh)
                         for c in children(e))
            return with_children(renamed, tuple(self.rename(c) for c in body))
        return with_children(e, tuple(self.rename(c) for c in children(e)))


def canonicalise(program: Program) -> Program:
    binders = _Binders(dict(program.extents))
    types = ExpressionTypes({t.name: t.dtype for t in (*program.inputs, *program.statements)})
    statements = tuple(
        replace(s, expr=_linear_forms(order_operands(decide_signs(orient_masks(
            binders.rename(transform(s.expr, natural_base)), types)), types), types))
        for s in program.statements)
    named = {i for s in statements for n in nodes(s.expr) if isinstance(n, Reduce) for i in n.indices} | {
        n.name for s in statements for n in nodes(s.expr) if isinstance(n, Extent)}
    extents = tuple(sorted((k, v) for k, v in binders.extents.items() if k in named or k in dict(program.extents)))
    return replace(program, statements=statements, extents=extents)
