"""The law checker: every builtin's laws, proofs by cases on max/min order,
numeric testing where sympy cannot decide, and refusals with counterexamples."""
import dataclasses
import math

import pytest

from compiler.algebra import BUILTINS, Field, Summary
from compiler.algebra.laws import (
    ASSOCIATIVE,
    COMMUTATIVE,
    FAILED,
    LEFT_IDENTITY,
    PROVED,
    RIGHT_IDENTITY,
    TESTED,
    LawReport,
    _Laws,
    _weak_orders,
    check_laws,
    identity_combined,
    independent_parts,
    require_laws,
)
from compiler.errors import LawError
from compiler.ir import Call, Const, Reduce, Var

A, B = Var("a.acc"), Var("b.acc")


def one_field(name, combine, identity, commutative=True):
    return Summary(name=name, fields=(Field("acc"),), arity=1, identity=(Const(identity),),
                   lift=(Var("x0"),), combine=(combine,), finalize=Var("acc"), commutative=commutative)


@pytest.mark.parametrize("name", ["sum", "max", "min", "prod"])
def test_commutative_builtins_prove_every_law(name):
    report = check_laws(BUILTINS[name])
    for law in (ASSOCIATIVE, LEFT_IDENTITY, RIGHT_IDENTITY, COMMUTATIVE):
        assert report[law].status == PROVED, str(report)
        assert report[law].method.startswith("sympy")
        assert report[law].claimed
    assert report.ok
    assert str(report).startswith("associative: proved (sympy")
    assert "identity: proved" in str(report) and "commutative: proved" in str(report)


@pytest.mark.parametrize("name", ["argmax", "argmin"])
def test_argmax_argmin_are_ordered_monoids(name):
    s = BUILTINS[name]
    assert s.field_names == ("m", "p") and s.arity == 2 and not s.commutative
    report = check_laws(s)
    assert report[ASSOCIATIVE].status == PROVED
    assert "by cases" in report[ASSOCIATIVE].method           # where(b.m > a.m, ...) needs the order
    assert report[LEFT_IDENTITY].status == PROVED             # -inf / +inf identity through sympy oo
    assert report[RIGHT_IDENTITY].status == PROVED
    # Commutativity is not claimed, and the probe confirms it would be false: a tie
    # between equal values with different payloads.
    probe = report[COMMUTATIVE]
    assert not probe.claimed and probe.status == FAILED and report.ok
    a, b = dict(probe.counterexample.states)["a"], dict(probe.counterexample.states)["b"]
    assert a[0] == b[0] and a[1] != b[1]
    assert "not claimed, and it does not hold" in str(report)


def test_argmax_declared_commutative_is_refused():
    liar = dataclasses.replace(BUILTINS["argmax"], name="argmax_c", commutative=True)
    with pytest.raises(LawError) as err:
        require_laws(liar)
    text = str(err.value)
    assert "'argmax_c'" in text and "commutative" in text and "combine(b, a)" in text


def test_require_laws_attaches_the_report():
    s = require_laws(BUILTINS["max"])
    assert isinstance(s.laws, LawReport) and s == BUILTINS["max"] and s.laws.ok


def test_subtraction_is_refused_with_a_counterexample():
    diff = one_field("diff", Call("sub", (A, B)), 0.0, commutative=False)
    report = check_laws(diff, examples=50)
    bad = report[ASSOCIATIVE]
    assert bad.status == FAILED
    ce = bad.counterexample
    assert [n for n, _ in ce.states] == ["a", "b", "c"]
    (a,), (b,), (c,) = (v for _, v in ce.states)
    assert ce.lhs == ((a - b) - c,) and ce.rhs == (a - (b - c),) and ce.lhs != ce.rhs
    assert report[LEFT_IDENTITY].status == FAILED            # 0 - a != a
    assert report[RIGHT_IDENTITY].status == PROVED           # a - 0 == a
    with pytest.raises(LawError) as err:
        require_laws(diff, examples=50)
    text = str(err.value)
    assert "'diff'" in text and "not associative" in text and "a = (acc=" in text and "c = (acc=" in text
    assert "combine(combine(a, b), c)" in text and "combine(a, combine(b, c))" in text


def test_wrong_identity_is_refused():
    report = check_laws(one_field("sum1", Call("add", (A, B)), 1.0), examples=30)
    assert report[ASSOCIATIVE].status == PROVED
    assert report[LEFT_IDENTITY].status == FAILED and report[RIGHT_IDENTITY].status == FAILED
    assert not report.ok and "combine(identity, a)" in str(report)


def test_max_by_cases_when_sympy_cannot_flatten():
    # max written with where: no Max node for sympy to flatten; provable only by cases.
    c = Call("where", (Call("gt", (B, A)), B, A))
    report = check_laws(one_field("max_where", c, -math.inf))
    assert report[ASSOCIATIVE].status == PROVED and "by cases on comparison order" in report[ASSOCIATIVE].method
    assert report[COMMUTATIVE].status == PROVED and report[LEFT_IDENTITY].status == PROVED


def test_non_associative_max_variant_fails():
    # max(a, b) + 1 is commutative but not associative
    c = Call("add", (Call("maximum", (A, B)), Const(1.0)))
    report = check_laws(one_field("maxplus1", c, -math.inf), examples=50)
    assert report[ASSOCIATIVE].status == FAILED and report[COMMUTATIVE].status == PROVED


def _matrix(commutative):
    m = {f: (Var(f"a.{f}"), Var(f"b.{f}")) for f in "pqrs"}
    (ap, bp), (aq, bq), (ar, br), (as_, bs) = m["p"], m["q"], m["r"], m["s"]
    mul, add = (lambda x, y: Call("mul", (x, y))), (lambda x, y: Call("add", (x, y)))
    return Summary(name="mat2", fields=tuple(Field(f) for f in "pqrs"), arity=4,
                   identity=tuple(Const(v) for v in (1.0, 0.0, 0.0, 1.0)),
                   lift=tuple(Var(f"x{k}") for k in range(4)),
                   combine=(add(mul(ap, bp), mul(aq, br)), add(mul(ap, bq), mul(aq, bs)),
                            add(mul(ar, bp), mul(as_, br)), add(mul(ar, bq), mul(as_, bs))),
                   finalize=Var("p"), commutative=commutative)


def test_ordered_matrix_product():
    report = check_laws(_matrix(False), examples=50)
    assert report[ASSOCIATIVE].status == PROVED
    assert report[LEFT_IDENTITY].status == PROVED and report[RIGHT_IDENTITY].status == PROVED
    assert report.ok and not report[COMMUTATIVE].claimed and report[COMMUTATIVE].status == FAILED
    with pytest.raises(LawError, match="declared commutative but is not"):
        require_laws(_matrix(True), examples=50)


def _chan(mean_merge):
    a = {f: Var(f"a.{f}") for f in ("n", "mean", "m2")}
    b = {f: Var(f"b.{f}") for f in ("n", "mean", "m2")}
    n = Call("add", (a["n"], b["n"]))
    empty = Call("eq", (n, Const(0.0)))
    safe = Call("where", (empty, Const(1.0), n))
    d = Call("sub", (b["mean"], a["mean"]))
    means = {
        "chan": Call("where", (empty, Const(0.0),
                               Call("add", (a["mean"], Call("div", (Call("mul", (d, b["n"])), safe)))))),
        "naive": Call("div", (Call("add", (a["mean"], b["mean"])), Const(2.0))),
    }
    m2 = Call("add", (Call("add", (a["m2"], b["m2"])), Call("where", (
        empty, Const(0.0), Call("div", (Call("mul", (Call("mul", (Call("mul", (d, d)), a["n"])), b["n"])),
                                        safe))))))
    return Summary(name=f"welford_{mean_merge}", fields=(Field("n"), Field("mean"), Field("m2")), arity=1,
                   identity=(Const(0.0),) * 3, lift=(Const(1.0), Var("x0"), Const(0.0)),
                   combine=(n, means[mean_merge], m2),
                   finalize=Call("div", (Var("m2"), Var("n"))), commutative=True)


def test_welford_chan_merge():
    report = check_laws(_chan("chan"), examples=60)
    assert report[ASSOCIATIVE].status in (PROVED, TESTED)
    assert report[LEFT_IDENTITY].holds and report[RIGHT_IDENTITY].holds and report[COMMUTATIVE].holds
    assert report.ok
    if report[ASSOCIATIVE].status == TESTED:
        assert report[ASSOCIATIVE].method == "sampled, 60 examples"


def test_welford_with_a_naive_mean_merge_fails():
    report = check_laws(_chan("naive"), examples=60)
    assert report[ASSOCIATIVE].status == FAILED and not report.ok


def test_numeric_testing_tolerates_reassociation_rounding():
    # The sampling path alone, on a law that holds: float64 sums reassociated
    # (cancellation included) must not be reported as counterexamples.
    laws = _Laws(BUILTINS["sum"])
    assert laws.search(ASSOCIATIVE, 200) is None
    assert _Laws(_matrix(False)).search(ASSOCIATIVE, 100) is None


def test_weak_orders_enumerate_ties():
    assert [len(list(_weak_orders(list(range(n))))) for n in range(5)] == [1, 1, 3, 13, 75]
    orders = {tuple(tuple(b) for b in o) for o in _weak_orders(["x", "y"])}
    assert orders == {(("x",), ("y",)), (("y",), ("x",)), (("y", "x"),)}


# ---------------------------------------------------------------- tile formulas (Block)
def _moments_summary(degree, block):
    from compiler.algebra.moments import centred_moments
    fields, identity, lift, combine = centred_moments("s", Var("x0"), degree)
    return Summary(name=f"moments{degree}", fields=tuple(fields), arity=1, identity=tuple(identity),
                   lift=tuple(lift), combine=tuple(combine), finalize=Var("s_m2"), commutative=True,
                   blocks=(block,))


@pytest.mark.parametrize("degree", [2, 3, 4, 6, 7, 10])
def test_the_moments_tile_formula_is_the_fold_of_the_tile(degree):
    from compiler.algebra.moments import tile_sums
    report = check_laws(_moments_summary(degree, tile_sums("s", Var("x0"), degree)), examples=60)
    assert report["tile formula"].status == TESTED and report.ok
    assert "tile formula: tested (sampled, 60 tiles)" in str(report)


def test_a_wrong_tile_formula_is_refused_with_the_tile():
    from compiler.algebra.moments import tile_sums
    right = tile_sums("s", Var("x0"), 3)
    # M2 as the tile's variance (divided by the count), not its sum of squares: right on
    # tiles of one element and empty ones only
    wrong = dataclasses.replace(right, fields=tuple(
        (f, Call("div", (e, Var("count")))) if f == "s_m2" else (f, e) for f, e in right.fields))
    summary = _moments_summary(3, wrong)
    report = check_laws(summary, examples=60)
    assert report["tile formula"].status == FAILED and not report.ok
    with pytest.raises(LawError, match="tile formula on the elements"):
        require_laws(summary, examples=60)


# ---------------------------------------------------------------- derived summaries at their identity
DERIVED = {
    "logsumexp": "L[t] = logsumexp[e](X[t,e])",
    "weighted sum": "W[t,j] = softmax[e](X[t,e]) * V[e,j]",
    "argmax beside logsumexp": "A[t] = argmax[e](X[t,e], e)\nL[t] = logsumexp[e](X[t,e])",
    "argmin beside a weighted sum": "A[t] = argmin[e](X[t,e], e)\nW[t,j] = softmax[e](X[t,e]) * V[e,j]",
    "moments": "M[t] = mean[e](X[t,e])\nS[t] = mean[e]((X[t,e] - M[t]) ** 2)",
}


def _derived(source):
    import compiler
    from compiler.ir import nodes
    program = compiler.compile(source, backend="reference")
    found = {n.summary for st in program.factorised.statements for n in nodes(st.expr)
             if isinstance(n, Reduce) and n.summary.name not in BUILTINS}
    assert found, "nothing was derived"
    return found


@pytest.mark.parametrize("name", sorted(DERIVED))
def test_derived_summaries_combine_their_identity_to_itself(name):
    # The sampler draws identity states (empty folds) and evaluates the combine with
    # IEEE semantics: the rescaled combine's stand-in where(max(a.r, b.r) == -inf, 0, ...)
    # must not be folded away as if fields were finite (it was: combine(identity,
    # identity) gave l = exp(-inf + inf) = NaN, and argmax beside logsumexp was refused).
    for s in _derived(DERIVED[name]):
        assert identity_combined(s) is None
        laws = _Laws(s)
        assert laws._combine(laws.identity, laws.identity) == laws.identity
        for law in (ASSOCIATIVE, LEFT_IDENTITY, RIGHT_IDENTITY):
            assert laws.search(law, 100) is None, (s.name, law)
        assert check_laws(s).ok


def test_a_product_is_checked_part_by_part():
    # argmax beside logsumexp: two independent parts, each proved on its own (the whole
    # product had six leaders to order, past the case split, and took seconds to test)
    (s,) = _derived(DERIVED["argmax beside logsumexp"])
    parts = independent_parts(s)
    assert [names for _, names in parts] == [("r", "l"), ("s1_m", "s1_p")]
    # the argmax part of another product is the same part (one check for both)
    (other,) = _derived("S[t] = sum[e](Y[t,e] * 2.0)\nA[t] = argmax[e](X[t,e], e)")
    assert parts[1][0] in [part for part, _ in independent_parts(other)]
    report = check_laws(s)
    assert report[ASSOCIATIVE].status == PROVED and report.ok
    assert "(s1_m, s1_p) sympy, by cases on comparison order" in report[ASSOCIATIVE].method
    probe = report[COMMUTATIVE]                # argmax's tie: the product is ordered, and says why
    assert not probe.claimed and probe.status == FAILED
    assert probe.counterexample.fields == ("s1_m", "s1_p")


def test_an_inexact_identity_is_shown():
    # exp(a.m - max(a.m, b.m)) without the stand-in: NaN for two identities
    a_m, b_m = Var("a.m"), Var("b.m")
    top = Call("maximum", (a_m, b_m))
    rescale = lambda side: Call("mul", (Var(f"{side}.l"), Call("exp", (Call("sub", (Var(f"{side}.m"), top)),))))  # noqa: E731
    raw = Summary(name="raw_lse", fields=(Field("m"), Field("l")), arity=1,
                  identity=(Const(-math.inf), Const(0.0)), lift=(Var("x0"), Const(1.0)),
                  combine=(top, Call("add", (rescale("a"), rescale("b")))),
                  finalize=Var("m"), commutative=True)
    shown = identity_combined(raw)
    assert shown is not None and math.isnan(shown.lhs[1])
    assert "combine(identity, identity) = (m=-inf, l=nan) but identity = (m=-inf, l=0)" in str(shown)




@pytest.mark.parametrize("degree", [2, 3, 4])
def test_a_moments_state_merges_with_the_empty_state_exactly(degree):
    # a float32 row holding 1e30 has mean 7.7e28 and d^2 = 6e57: merging its state with
    # the empty one must copy it (the tail d^2 * n_a was inf * 0 = NaN)
    import torch

    from compiler.algebra.formula import evaluate
    from compiler.algebra.moments import centred_moments
    fields, identity, _, combine = centred_moments("s", Var("x0"), degree)
    names = [f.name for f in fields]
    state = [torch.tensor([v], dtype=torch.float32) for v in (13.0, 7.7e28, 3.6e21, math.inf, *(1e30,) * (degree - 2))]
    empty = [torch.tensor([float(c.value)], dtype=torch.float32) for c in identity]
    for a, b in ((empty, state), (state, empty)):
        env = {**{f"a.{n}": v for n, v in zip(names, a)}, **{f"b.{n}": v for n, v in zip(names, b)}}
        merged = [evaluate(c, env) for c in combine]          # in float32: 1-element tensors
        assert all(torch.equal(m, t) for m, t in zip(merged, state)), merged


def test_a_tile_whose_squares_overflow_has_an_infinite_m2():
    # the tile formula's err terms correct a finite sum; beside sum d^2 = inf (float32,
    # a row holding 1e30) they overflow too and made M2 inf - inf = NaN
    import torch

    from compiler.algebra.formula import evaluate
    from compiler.algebra.moments import tile_sums
    block = tile_sums("s", Var("x0"), 2)
    row = torch.tensor([1e30] + [float(k) for k in range(12)], dtype=torch.float32)
    sums = {}
    for name, summand in block.sums:
        # a 1-element tensor, not a 0-d one, so that constants (float64 0-d) do not promote it
        sums[name] = evaluate(summand, {"x0": row, **sums}).expand(row.shape).sum().float().reshape(1)
    m2 = evaluate(dict(block.fields)["s_m2"], sums)
    assert m2.dtype == torch.float32 and m2.item() == math.inf


def test_a_log_semiring_matrix_product_is_proved_in_the_exponential_domain():
    # an HMM's forward step as a 2 x 2 matrix in the log semiring: max-shifted log-sum-exp of
    # products. exp of each side is a polynomial in exponentials where every max cancels, so
    # sympy decides it by expansion; simplify over the orders of the maxima took ~10 s before
    import time

    import compiler
    from compiler.algebra.user import fn

    def lse(a, b):
        m = fn.max(a, b)
        return m + fn.log(fn.exp(a - m) + fn.exp(b - m))
    start = time.perf_counter()
    semiring = compiler.summary(
        "hmm2", fields=("a", "b", "c", "d"), identity=(0.0, -math.inf, -math.inf, 0.0),
        lift=lambda a, b, c, d: (a, b, c, d), finalize=lambda s: lse(s.a, s.b),
        combine=lambda l, r: (lse(l.a + r.a, l.b + r.c), lse(l.a + r.b, l.b + r.d),
                              lse(l.c + r.a, l.d + r.c), lse(l.c + r.b, l.d + r.d)))
    report = semiring.laws
    assert report[ASSOCIATIVE].status == PROVED and "exponential domain" in str(report)
    assert report.ok and report[COMMUTATIVE].status == FAILED
    assert time.perf_counter() - start < 30      # seconds, on a shared 2-core CI machine


def test_the_exponential_domain_proves_no_false_associativity():
    # lse(a + 1, b) (max-shifted) is not associative: exp of its two groupings differ
    # (e^(a+2) + e^(b+1) + e^c against e^(a+1) + e^(b+1) + e^c), so the expansion does not
    # prove it and the sampler finds the counterexample
    import compiler
    from compiler.algebra.user import fn

    def lse(a, b):
        m = fn.max(a, b)
        return m + fn.log(fn.exp(a - m) + fn.exp(b - m))
    with pytest.raises(LawError, match="associative"):
        compiler.summary("shifted", fields=("h",), identity=(-math.inf,), lift=lambda x: x, finalize=None,
                         combine=lambda l, r: lse(l.h + 1.0, r.h))
