"""User summaries traced from Python callables, through the law checker and the
float64 oracle; argmax/argmin with a payload through the oracle."""
import math

import pytest
import torch

import compiler
from compiler.algebra.laws import ASSOCIATIVE, COMMUTATIVE, PROVED, TESTED
from compiler.algebra.user import Sym, fn
from compiler.errors import CheckError, LawError
from compiler.ir import Call, Const, Var

EXAMPLES = 30


def affine_summary():
    return compiler.summary(
        "affine", fields=("A", "B"), identity=(1.0, 0.0),
        lift=lambda a, b: (a, b),
        combine=lambda l, r: (r.A * l.A, r.A * l.B + r.B),
        finalize=lambda s: s.B, examples=EXAMPLES)


def chan(a, b):
    n = a.n + b.n
    empty = n == 0
    safe = fn.where(empty, 1.0, n)
    d = b.mean - a.mean
    return (n,
            fn.where(empty, 0.0, a.mean + d * b.n / safe),
            a.m2 + b.m2 + fn.where(empty, 0.0, d * d * a.n * b.n / safe))


# ---------------------------------------------------------------- tracing
def test_tracing_builds_ir_from_operators_and_fn():
    x, y = Sym(Var("x")), Sym(Var("y"))
    assert (x + 1).expr == Call("add", (Var("x"), Const(1)))
    assert (1 - x).expr == Call("sub", (Const(1), Var("x")))
    assert (2 ** x).expr == Call("pow", (Const(2), Var("x")))
    assert (-x).expr == Call("neg", (Var("x"),))
    assert (x / y).expr == Call("div", (Var("x"), Var("y")))
    assert (0 < x).expr == Call("gt", (Var("x"), Const(0)))
    assert (x == y).expr == Call("eq", (Var("x"), Var("y")))
    assert ((x < y) & ~(x > 2)).expr == Call("and", (Call("lt", (Var("x"), Var("y"))),
                                                    Call("not", (Call("gt", (Var("x"), Const(2))),))))
    assert fn.max(x, y).expr == Call("maximum", (Var("x"), Var("y")))
    assert fn.where(x > y, x, 0.5).expr == Call("where", (Call("gt", (Var("x"), Var("y"))), Var("x"), Const(0.5)))
    assert fn.exp(x).expr == Call("exp", (Var("x"),)) and abs(x).expr == Call("abs", (Var("x"),))
    assert fn.inf == math.inf


def test_summary_fields_identity_and_arity():
    s = compiler.summary("logaddexp_", fields=(("m", "float"), ("l", "float")), identity=(-math.inf, 0.0),
                         lift=lambda x: (x, 1.0),
                         combine=lambda a, b: (fn.max(a.m, b.m),
                                               a.l * fn.exp(a.m - fn.max(a.m, b.m))
                                               + b.l * fn.exp(b.m - fn.max(a.m, b.m))),
                         finalize=lambda s: s.m + fn.log(s.l), commutative=True, examples=EXAMPLES)
    assert s.field_names == ("m", "l") and s.arity == 1 and s.commutative
    assert s.identity == (Const(-math.inf), Const(0.0))
    assert s.lift == (Var("x0"), Const(1.0))
    assert s.combine[0] == Call("maximum", (Var("a.m"), Var("b.m")))
    assert s.laws.ok and s.laws[ASSOCIATIVE].status == PROVED and s.laws[COMMUTATIVE].status == PROVED
    assert "user summary" in s.notes[0]
    x = torch.randn(3, 9, dtype=torch.float64)
    out = compiler.compile("L[i] = logaddexp_[k](X[i,k])", summaries=[s], backend="reference")(X=x)
    torch.testing.assert_close(out, torch.logsumexp(x, dim=1))


@pytest.mark.parametrize("name, what", [("max", "built-in reduction"), ("argmax", "built-in reduction"),
                                        ("softmax", "composite"), ("exp", "function"),
                                        ("inf", "reserved"), ("not", "reserved"), ("2x", "not a name")])
def test_name_clashes_are_refused(name, what):
    with pytest.raises(CheckError, match=what):
        compiler.summary(name, fields=("h",), identity=(0.0,), lift=lambda x: x,
                         combine=lambda a, b: a.h + b.h, finalize=lambda s: s.h)


def test_definition_errors_are_clear():
    ok = {"fields": ("h",), "identity": (0.0,), "lift": lambda x: x, "finalize": lambda s: s.h}
    with pytest.raises(CheckError, match="has no truth value"):
        compiler.summary("bad_if", combine=lambda a, b: a.h if a.h > b.h else b.h, **ok)  # noqa: FURB136
    with pytest.raises(CheckError, match="use compiler.algebra.user.fn"):
        compiler.summary("bad_math", combine=lambda a, b: math.exp(a.h) + b.h, **ok)
    with pytest.raises(CheckError, match="no field 'g'"):
        compiler.summary("bad_field", combine=lambda a, b: a.g + b.h, **ok)
    with pytest.raises(CheckError, match="returned 2 value"):
        compiler.summary("bad_count", combine=lambda a, b: (a.h, b.h), **ok)
    with pytest.raises(CheckError, match="identity has 2"):
        compiler.summary("bad_identity", fields=("h",), identity=(0.0, 1.0), lift=lambda x: x,
                         combine=lambda a, b: a.h + b.h, finalize=lambda s: s.h)
    with pytest.raises(CheckError, match="not a number"):
        compiler.summary("bad_bool", combine=lambda a, b: a.h > b.h, **ok)


# ---------------------------------------------------------------- laws at definition
def test_subtraction_is_refused_with_its_counterexample():
    with pytest.raises(LawError) as err:
        compiler.summary("difference", fields=("h",), identity=(0.0,), lift=lambda x: x,
                         combine=lambda a, b: a.h - b.h, finalize=lambda s: s.h, examples=EXAMPLES)
    text = str(err.value)
    assert "'difference'" in text and "not associative" in text
    assert "a = (h=" in text and "b = (h=" in text and "c = (h=" in text
    assert "combine(combine(a, b), c) = (h=" in text and "but combine(a, combine(b, c)) = (h=" in text


def test_ordered_matrix_product_claiming_commutativity_is_refused():
    spec = {"fields": tuple("pqrs"), "identity": (1, 0, 0, 1), "lift": lambda p, q, r, s: (p, q, r, s),
            "combine": lambda a, b: (a.p * b.p + a.q * b.r, a.p * b.q + a.q * b.s,
                                     a.r * b.p + a.s * b.r, a.r * b.q + a.s * b.s),
            "finalize": lambda s: s.p, "examples": EXAMPLES}
    with pytest.raises(LawError, match="declared commutative"):
        compiler.summary("mat2c", commutative=True, **spec)
    mat = compiler.summary("mat2", **spec)
    assert mat.laws[ASSOCIATIVE].status == PROVED and not mat.commutative
    # an ordered product of 2x2 matrices over t (ragged: 11 steps), vs torch in order
    g = torch.Generator().manual_seed(1)
    e = {n: torch.randn(3, 11, dtype=torch.float64, generator=g) for n in "PQRS"}
    src = "\n".join(f"{o}[i] = mat2[t](P[i,t], Q[i,t], R[i,t], S[i,t])" for o in ["M"])
    out = compiler.compile(src, summaries=[mat], backend="reference")(**e)
    for i in range(3):
        prod = torch.eye(2, dtype=torch.float64)
        for t in range(11):
            prod = prod @ torch.tensor([[e["P"][i, t], e["Q"][i, t]], [e["R"][i, t], e["S"][i, t]]])
        torch.testing.assert_close(out[i], prod[0, 0])


def test_welford_chan_summary():
    w = compiler.summary("welford", fields=("n", "mean", "m2"), identity=(0, 0, 0),
                         lift=lambda x: (1.0, x, 0.0), combine=chan, finalize=lambda s: s.m2 / s.n,
                         commutative=True, examples=EXAMPLES)
    assert w.laws[ASSOCIATIVE].status in (PROVED, TESTED) and w.laws.ok
    x = torch.randn(4, 13, dtype=torch.float64) * 3 + 100.0
    out = compiler.compile("V[i] = welford[k](X[i,k])", summaries=[w], backend="reference")(X=x)
    torch.testing.assert_close(out, x.var(dim=1, unbiased=False))


# ---------------------------------------------------------------- through the oracle
@pytest.mark.parametrize("steps", [1, 2, 13])
def test_affine_recurrence_matches_a_sequential_loop(steps):
    affine = affine_summary()
    assert affine.laws[ASSOCIATIVE].status == PROVED and not affine.laws[COMMUTATIVE].claimed
    assert not affine.laws[COMMUTATIVE].holds          # order matters, and the checker shows it
    g = torch.Generator().manual_seed(steps)
    a = torch.rand(5, steps, dtype=torch.float64, generator=g) * 1.5
    b = torch.randn(5, steps, dtype=torch.float64, generator=g)
    program = compiler.compile("H[i] = affine[t](A[i,t], Bv[i,t])", summaries=[affine], backend="reference")
    got = program(A=a, Bv=b)
    h = torch.zeros(5, dtype=torch.float64)
    for t in range(steps):
        h = a[:, t] * h + b[:, t]
    torch.testing.assert_close(got, h, rtol=1e-12, atol=1e-12)
    # the same data reversed in time gives another answer: order is kept, not assumed away
    if steps > 2:
        rev = program(A=a.flip(1), Bv=b.flip(1))
        assert not torch.allclose(rev, h)


@pytest.mark.parametrize("name, torch_fn", [("argmax", torch.argmax), ("argmin", torch.argmin)])
def test_argmax_with_index_payload_matches_torch(name, torch_fn):
    g = torch.Generator().manual_seed(0)
    x = torch.randint(-3, 4, (6, 13), generator=g).float()     # small integers: many ties
    x[2] = 1.0                                                   # a row that is all ties
    out = compiler.compile(f"I[i] = {name}[k](X[i,k], k)", backend="reference")(X=x)
    assert out.dtype == torch.int64                              # a position, as torch gives it
    assert torch.equal(out, torch_fn(x, dim=1))                  # ties: the first position wins


def test_argmax_carries_any_payload():
    g = torch.Generator().manual_seed(2)
    x, y = torch.randn(4, 9, generator=g), torch.randn(4, 9, generator=g)
    out = compiler.compile("J[i] = argmax[k](X[i,k], Y[i,k])", backend="reference")(X=x, Y=y)
    want = y.gather(1, torch.argmax(x, dim=1, keepdim=True)).squeeze(1)
    torch.testing.assert_close(out, want)
