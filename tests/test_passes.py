"""The pass library: every factorisation is proved by the chunked executor
(random chunks, random merge orders) against the float64 oracle."""
import math
import random
from dataclasses import replace

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import compiler
from compiler import reference
from compiler.bind import Binder, bind
from compiler.ir import Reduce, format_program, free_indices, walk
from compiler.random_inputs import random_inputs

ATTENTION_FORMS = {
    "one_liner": "O[i,j] = softmax[m](Q[i,k]*K[m,k]) * V[m,j]",
    "max_subtracted": "S[i,m] = Q[i,k]*K[m,k]; M[i] = max[m](S[i,m]); P[i,m] = exp(S[i,m] - M[i])\n"
                      "O[i,j] = sum[m](P[i,m]*V[m,j]) / sum[m](P[i,m])",
    "unsafe": "S[i,m] = Q[i,k]*K[m,k]; P[i,m] = exp(S[i,m]) / sum[m](exp(S[i,m])); O[i,j] = P[i,m]*V[m,j]",
}

PROGRAMS = {
    **ATTENTION_FORMS,
    "scaled": "O[b,h,i,j] = softmax[m](Q[b,h,i,k] * K[b,h,m,k] * scale) * V[b,h,m,j]",
    "causal": "O[i,j] = softmax[m](where(m <= i, Q[i,k]*K[m,k], -inf)) * V[m,j]",
    "window": "O[i,j] = softmax[m](where(i - m < 3 and m <= i, Q[i,k]*K[m,k], -inf)) * V[m,j]",
    "alibi": "O[i,j] = softmax[m](Q[i,k]*K[m,k] - slope * abs(i - m)) * V[m,j]",
    "bias": "O[i,j] = softmax[m](Q[i,k]*K[m,k] + B[i,m]) * V[m,j]",
    "softcap": "O[i,j] = softmax[m](30 * tanh(Q[i,k]*K[m,k] / 30)) * V[m,j]",
    "two_outputs": "O[i,j] = softmax[m](Q[i,k]*K[m,k]) * V[m,j]; O2[i,j] = softmax[m](Q[i,k]*K[m,k]) * W[m,j]",
    "weighted_mean_of_f": "O[i,j] = softmax[m](Q[i,k]*K[m,k]) * tanh(V[m,j])",
    "cross_entropy": "L[i] = logsumexp[v](H[i,k]*W[v,k]) - T[i]",
    "layernorm": "mu[i] = sum[j](X[i,j]) / len(j); var[i] = sum[j]((X[i,j] - mu[i])**2) / len(j)\n"
                 "Y[i,j] = (X[i,j] - mu[i]) * rsqrt(var[i] + eps)",
    "softmax": "P[i,j] = softmax[j](X[i,j])",
    "logsumexp": "L[i] = logsumexp[j](X[i,j])",
    "mean_variance": "mu[i] = mean[j](X[i,j]); v[i] = mean[j]((X[i,j] - mu[i])**2)",
    "third_moment": "Z[i] = sum[j](X[i,j]); Z3[i] = sum[j]((X[i,j] - Z[i] / len(j))**3)",
    "sum_of_exp": "Z[i] = sum[j](exp(X[i,j]))",
    # affine subscripts: a convolution and a padded depthwise one (a pooled convolution's
    # positions follow from its window's size, which the corpus's size sets do not choose:
    # test_grad's corpus has it at sizes of its own)
    "convolution": "Y[b,o,t] = sum[c,r](W[o,c,r] * X[b,c,t+r])",
    "padded_depthwise": "Y[c,t] = sum[r](W[c,r] * X[c,t+r-2])",
    # gathered subscripts: an embedding row's projection, a label's logit
    "embedding_projection": "Y[i,d] = sum[k](E[T[i],k] * W[d,k])",
    "labelled_cross_entropy": "L[i] = logsumexp[c](X[i,c]) - X[i,Y[i]]",
    # prefix results: scans along t (a suffix too), beside a fold over the whole row
    "cumsum_share": "C[b,t] = sum[s](where(s <= t, X[b,s], 0.0)) / sum[s](X[b,s] ** 2)",
    "logcumsumexp_suffix": "L[b,t] = logsumexp[s](where(s >= t, X[b,s], -inf))",
}


def folds(program):
    return {n.fold for st in program.factorised.statements for n in walk(st.expr)
            if isinstance(n, Reduce) and n.result is not None}


def outer_reductions(program):
    """Reductions that are not inside an argument of a derived fold."""
    inner = {m for f in folds(program) for a in f.args for m in walk(a)}
    return [n for st in program.factorised.statements for n in walk(st.expr)
            if isinstance(n, Reduce) and n.result is None and n not in inner]


def chunked_matches_oracle(program, inputs, seeds=range(4), rtol=1e-9):
    binding = bind(program.checked, inputs)
    want = reference.run(program.checked, inputs, binding.extents, program.outputs)
    extents = Binder(program.checked, extents_of=program.factorised)(inputs).extents
    for seed in seeds:
        got = reference.run(program.factorised, inputs, extents, program.outputs,
                            chunking=random.Random(seed))
        for name in program.outputs:
            torch.testing.assert_close(got[name], want[name], rtol=rtol, atol=rtol, equal_nan=True)


@pytest.mark.parametrize("name", sorted(PROGRAMS))
def test_chunked_executor_matches_oracle(name):
    program = compiler.compile(PROGRAMS[name], backend="reference")
    for size, seed in [(1, 0), (7, 1), (13, 2)]:          # chunks of size 1 up to ragged sizes
        sizes = {i: size + (n % 3) for n, i in enumerate(dict(program.checked.extents))}
        inputs = random_inputs(program.checked, sizes, dtype=torch.float64, seed=seed)
        chunked_matches_oracle(program, inputs)


@pytest.mark.parametrize("name", sorted(PROGRAMS))
def test_every_reduction_becomes_one_pass(name):
    """After factorise no reduction reads another reduction over the same index."""
    program = compiler.compile(PROGRAMS[name], backend="reference")
    for fold in folds(program):
        for arg in fold.args:
            assert all(not (isinstance(n, Reduce) and n.indices == fold.indices) for n in walk(arg))
    for r in outer_reductions(program):
        assert all(not (isinstance(n, Reduce) and n.indices == r.indices) for a in r.args for n in walk(a))


def test_three_attention_forms_share_one_summary():
    summaries = [next(iter(folds(compiler.compile(src, backend="reference")))).summary
                 for src in ATTENTION_FORMS.values()]
    assert summaries[0] == summaries[1] == summaries[2]
    s = summaries[0]
    assert s.field_names == ("r", "l", "u")
    assert [c.value for c in s.identity] == [-math.inf, 0.0, 0.0]
    (rescaled,) = s.rescaled
    assert rescaled.leader_monoid == "max"
    assert compiler.ir.format_expr(rescaled.repair) == "exp(r - r_new)"


def test_layernorm_is_one_welford_pass():
    program = compiler.compile(PROGRAMS["layernorm"], backend="reference")
    (fold,) = folds(program)
    assert [f.name.split("_")[-1] for f in fold.summary.fields] == ["n", "mean", "err", "m2"]
    assert any("Welford" in n for n in fold.summary.notes)
    assert outer_reductions(program) == []


def test_the_moments_mean_is_compensated_in_float32():
    """Folded element by element in float32 (as the Triton interpreter's tl.reduce
    does), rows at mean 1e3 with spread 3: mean + err is the mean to within one
    ulp, and M2 keeps digits (an uncompensated mean drifts by about sqrt(n) ulp,
    and its drift enters M2 through every delta)."""
    from compiler.algebra.formula import evaluate
    program = compiler.compile(PROGRAMS["layernorm"], backend="reference")
    (fold,) = folds(program)
    s = fold.summary
    x = (1e3 + 3 * torch.randn(4, 1000, dtype=torch.float64, generator=torch.Generator().manual_seed(4))).float()
    lifts = [evaluate(f, {"x0": x}).to(torch.float32).expand(x.shape) for f in s.lift]
    state = [t[:, 0] for t in lifts]
    for j in range(1, x.shape[1]):
        env = {**{f"a.{n}": t for n, t in zip(s.field_names, state)},
               **{f"b.{n}": t[:, j] for n, t in zip(s.field_names, lifts)}}
        state = [evaluate(c, env).expand(4) for c in s.combine]
    fields = dict(zip((n.split("_")[-1] for n in s.field_names), state))
    assert all(t.dtype == torch.float32 for t in state)
    exact = x.double().mean(1)
    m2 = ((x.double() - exact[:, None]) ** 2).sum(1)
    ulp = torch.finfo(torch.float32).eps * 1024 / 2              # float32 spacing in [512, 1024)
    assert ((fields["mean"] + fields["err"]).double() - exact).abs().max() <= ulp
    assert ((fields["m2"].double() - m2).abs() / m2).max() < 1e-6


def test_third_and_seventh_moments_merge_stably():
    for source, degree in ((PROGRAMS["third_moment"], 3),
                           ("mu[i] = mean[j](X[i,j]); Z[i] = sum[j]((X[i,j] - mu[i])**7)", 7)):
        program = compiler.compile(source, backend="reference")
        (fold,) = folds(program)
        assert any("Pébay's pairwise merge" in n for n in fold.summary.notes)
        assert fold.summary.field_names[-1] == f"s1_m{degree}"
        # never the separable expansion in powers of the mean, which cancels
        assert not any("separable:" in n for n in fold.summary.notes)


def test_large_logits_do_not_overflow():
    for name in ("logsumexp", "softmax", "one_liner", "sum_of_exp"):
        program = compiler.compile(PROGRAMS[name], backend="reference")
        inputs = random_inputs(program.checked, {}, dtype=torch.float64, seed=3)
        inputs = {k: v * 1e4 if k in ("X", "Q") else v for k, v in inputs.items()}
        binding = Binder(program.checked, extents_of=program.factorised)(inputs)
        got = reference.run(program.factorised, inputs, binding.extents, chunking=random.Random(0))
        for value in got.values():
            if name == "sum_of_exp":     # the true value overflows float64: inf, never NaN
                assert not torch.isnan(value).any()
            else:
                assert torch.isfinite(value).all(), name
    x = torch.randn(5, 9, dtype=torch.float64) * 1e4
    lse = compiler.compile(PROGRAMS["logsumexp"], backend="reference")
    binding = Binder(lse.checked, extents_of=lse.factorised)({"X": x})
    got = reference.run(lse.factorised, {"X": x}, binding.extents)["L"]
    torch.testing.assert_close(got, torch.logsumexp(x, 1), rtol=1e-12, atol=0)


def test_fully_masked_rows_are_nan_and_other_rows_exact():
    src = "O[i,j] = softmax[m](where(m < i, Q[i,k]*K[m,k], -inf)) * V[m,j]"   # row 0 has no m < 0
    program = compiler.compile(src, backend="reference")
    inputs = random_inputs(program.checked, {"i": 5, "m": 6}, dtype=torch.float64, seed=4)
    chunked_matches_oracle(program, inputs)
    binding = Binder(program.checked, extents_of=program.factorised)(inputs)
    out = reference.run(program.factorised, inputs, binding.extents, chunking=random.Random(1))["O"]
    assert torch.isnan(out[0]).all() and torch.isfinite(out[1:]).all()
    lse = compiler.compile("L[i] = logsumexp[m](where(m < i, X[i,m], -inf))", backend="reference")
    x = torch.randn(4, 5, dtype=torch.float64)
    assert lse(X=x)[0] == -math.inf and torch.isfinite(lse(X=x)[1:]).all()


# ---------------------------------------------------------------- argmax beside every kind
BESIDE_AN_EXTREME = {
    "sum": ("S[t] = sum[e](X[t,e])", lambda x, v: x.sum(1)),
    "max": ("S[t] = max[e](X[t,e])", lambda x, v: x.amax(1)),
    "min": ("S[t] = min[e](X[t,e])", lambda x, v: x.amin(1)),
    "mean": ("S[t] = mean[e](X[t,e])", lambda x, v: x.mean(1)),
    "variance": ("M[t] = mean[e](X[t,e]); S[t] = mean[e]((X[t,e] - M[t]) ** 2)",
                 lambda x, v: x.var(1, unbiased=False)),
    "logsumexp": ("S[t] = logsumexp[e](X[t,e])", lambda x, v: torch.logsumexp(x, 1)),
    "weighted sum": ("S[t,j] = softmax[e](X[t,e]) * V[e,j]", lambda x, v: torch.softmax(x, 1) @ v),
}


@pytest.mark.parametrize("extreme", ["argmax", "argmin"])
@pytest.mark.parametrize("kind", sorted(BESIDE_AN_EXTREME))
def test_an_argmax_folds_beside_every_summary_kind(extreme, kind):
    """argmax or argmin over e beside another kind of summary over e, on the same
    scores: one derived fold holds both (the argmax's payload beside a rescaled
    field's), its laws hold (argmax beside logsumexp was refused: the law checker
    evaluated combine(identity, identity) as NaN), and it gives torch's results."""
    source, meaning = BESIDE_AN_EXTREME[kind]
    program = compiler.compile(f"A[t] = {extreme}[e](X[t,e], e); {source}", outputs=["A", "S"],
                               backend="reference")
    (fold,) = folds(program)
    assert outer_reductions(program) == []                                        # all in the one fold
    assert fold.summary.laws.ok
    g = torch.Generator().manual_seed(5)
    x = torch.randint(-3, 4, (6, 11), generator=g).double()                        # ties
    v = torch.randn(11, 3, generator=g, dtype=torch.float64)
    inputs = {"X": x, "V": v} if "V[" in source else {"X": x}
    chunked_matches_oracle(program, inputs)
    a, s = program(**inputs)
    assert torch.equal(a.long(), x.argmax(1) if extreme == "argmax" else x.argmin(1))
    torch.testing.assert_close(s, meaning(x, v), rtol=1e-12, atol=1e-12)


# ---------------------------------------------------------------- generated programs
_SCORES = ["Q[i,k]*K[m,k]", "A[i,m]", "tanh(A[i,m])", "A[i,m] * s", "Q[i,k]*K[m,k] + A[i,m]",
           "-abs(i - m) * s + A[i,m]"]
_MASKS = [None, "m <= i", "i - m < 2", "m != i"]
_VALUES = ["V[m,j]", "exp(V[m,j])", "V[m,j] * A[i,m]", "1.0"]


@st.composite
def attention_like(draw):
    score = draw(st.sampled_from(_SCORES))
    mask = draw(st.sampled_from(_MASKS))
    if mask:
        score = f"where({mask}, {score}, -inf)"
    value = draw(st.sampled_from(_VALUES))
    shape = draw(st.sampled_from(["softmax", "logsumexp", "moments", "explicit"]))
    if shape == "softmax":
        return f"O[i,j] = softmax[m]({score}) * {value}" if "j" in value else \
            f"O[i] = sum[m](softmax[m]({score}) * {value})"
    if shape == "logsumexp":
        return f"L[i] = logsumexp[m]({score}) + max[m]({score})"
    if shape == "moments":
        return f"mu[i] = mean[m]({score.replace('-inf', '0.0')}); " \
               f"v[i] = mean[m](({score.replace('-inf', '0.0')} - mu[i])**2)"
    return f"M[i] = max[m]({score}); Z[i] = sum[m](exp({score} - M[i])); " \
           f"O[i,j] = sum[m](exp({score} - M[i]) * V[m,j]) / Z[i]"


@settings(max_examples=40, deadline=None)
@given(src=attention_like(), size=st.integers(1, 6), seed=st.integers(0, 1000))
def test_generated_programs_factorise_correctly(src, size, seed):
    program = compiler.compile(src, backend="reference")
    sizes = {"i": size, "m": size + 2, "j": 3, "k": 2}
    inputs = random_inputs(program.checked, sizes, dtype=torch.float64, seed=seed)
    chunked_matches_oracle(program, inputs, seeds=[seed])
    for fold in folds(program):
        for arg in fold.args:
            assert all(not (isinstance(n, Reduce) and n.indices == fold.indices) for n in walk(arg))


def test_explain_attention_golden():
    """The derivation trace is a research tool: any change to it is reviewed here."""
    from pathlib import Path
    golden = Path(__file__).parent / "golden" / "explain_attention.txt"
    program = compiler.compile(PROGRAMS["scaled"])
    text = program.explain()
    for needle in ("dependent reductions over m", "exp(r - r_new)", "pullback: l, u share the weight",
                   "fields (r, l, u), identity (-inf, 0.0, 0.0)", "O[b, h, i, j] = u / l"):
        assert needle in text
    assert text == golden.read_text()


def test_a_program_keeps_the_trace_of_its_stages_and_explain_reads_it():
    import compiler
    from compiler import passes
    program = compiler.compile("P[i,m] = softmax[m](X[i,m])", backend="reference")
    assert [name for name, _ in program.trace] == ["check", *(name for name, _ in passes.PIPELINE)]
    assert program.trace[0][1] is program.checked and program.trace[-1][1] is program.factorised
    # explain prints each stage that changed the program, from the trace
    text = program.explain()
    for (_, before), (name, after) in zip(program.trace, program.trace[1:-1]):
        assert (f"after {name}:" in text) == (after != before), name


def test_a_constant_term_of_a_sum_counts_the_positions():
    """sum_k (exp(x) + 0.5) splits into sum_k exp(x) + 0.5 len(k): a sum whose body does
    not read its index is a count, never a sum[k](1) (found by the fuzzer: the oracle
    could not fold it, a foreign ValueError at every size)."""
    src = "R2[i] = sum[k](exp(X[i,k]) + 0.5); B2[i,k] = exp(X[i,k]) - R2[i]"
    program = compiler.compile(src, backend="reference")
    assert not any(isinstance(n, Reduce) and n.summary.name == "sum" and
                   not any(i in free_indices(a) for a in n.args for i in n.indices)
                   for st in program.factorised.statements for n in walk(st.expr))
    assert "0.5 * len(k)" in format_program(program.factorised)
    triton = compiler.compile(src)
    for shape in ((3, 5), (2, 0), (0, 4), (1, 1)):
        x = torch.randn(*shape, dtype=torch.float64)
        want = x.exp() - (x.exp() + 0.5).sum(1, keepdim=True)
        torch.testing.assert_close(program(X=x), want)
        chunked_matches_oracle(program, {"X": x})
        device = "cuda" if torch.cuda.is_available() else "cpu"
        torch.testing.assert_close(triton(X=x.float().to(device)).double().cpu(), want, rtol=1e-5, atol=1e-5)


def test_the_oracle_folds_a_sum_whose_body_does_not_read_its_index():
    # passes may write one; it counts the positions of its index
    from compiler.algebra import BUILTINS
    from compiler.ir import Call, Const
    program = compiler.compile("Y[i] = sum[k](X[i,k])", backend="reference")
    (st,) = program.factorised.statements
    count = Call("mul", (Const(0.5), Reduce(BUILTINS["sum"], ("k",), (Const(1.0),))))
    extra = replace(program.factorised, statements=(replace(st, expr=Call("add", (st.expr, count))),))
    x = torch.randn(2, 5, dtype=torch.float64)
    for chunking in (None, random.Random(0)):
        got = reference.run(extra, {"X": x}, {"i": 2, "k": 5}, chunking=chunking)["Y"]
        torch.testing.assert_close(got, x.sum(1) + 2.5)
