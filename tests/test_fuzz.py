"""Property fuzzing (docs/reliability.md).

Valid programs (attention-like scores with causal masks, biases and soft caps,
losses, norms, elementwise chains, chains of statements with renamed indices,
several outputs) run on the oracle and on the Triton backend (compiled kernels on
a GPU, the interpreter on CPU; tiny ragged sizes, float32) and must agree.  Mutations of them (characters
inserted, deleted or replaced, truncation, swapped brackets, unknown names) must
compile and run or raise an einfold error -- never another exception.

Examples per property: EINFOLD_FUZZ_EXAMPLES (default 30 valid programs and five
times as many mutations, about a minute on two cores).  The long run:

    EINFOLD_FUZZ_EXAMPLES=5000 python3 -m pytest tests/test_fuzz.py

Nothing is excluded: sizes start at 0 (empty outputs and empty reductions).
"""
import math
import os
import warnings

import pytest
import torch

hypothesis = pytest.importorskip("hypothesis")
from hypothesis import HealthCheck, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

import compiler  # noqa: E402
from compiler.random_inputs import random_inputs, relative_error  # noqa: E402

warnings.filterwarnings("ignore", message="einfold: no CUDA tensors")
pytestmark = [pytest.mark.filterwarnings("ignore:einfold. no CUDA tensors"),
              pytest.mark.usefixtures("private_cache")]

EXAMPLES = int(os.environ.get("EINFOLD_FUZZ_EXAMPLES", "30"))
TOLERANCE = 2e-3          # float32 against the float64 oracle, relative to the largest value
MIN_EXTENT = 0            # extents from 0 (empty outputs and empty reductions) to 7

SETTINGS = dict(deadline=None, database=None, derandomize=False,
                suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large,
                                       HealthCheck.filter_too_much])

NAMES = ["i", "j", "k", "m", "n", "p", "q", "r"]
UNARY = ["exp", "tanh", "sigmoid", "abs", "relu", "silu", "gelu", "softplus", "erf"]


# ---------------------------------------------------------------- valid programs
@st.composite
def leaf(draw, x: str):
    """A number-valued term over the access `x`."""
    kind = draw(st.sampled_from(["x", "x", "const", "scaled"]))
    if kind == "x":
        return x
    if kind == "const":
        return draw(st.sampled_from(["0.5", "2", "1.5", "len(k)", "3.0"]))
    return f"{x} * {draw(st.sampled_from(['0.5', '2.0', '0.25']))}"


@st.composite
def elementwise(draw, x: str, depth: int = 3):
    """A small elementwise expression over the access `x`."""
    if depth == 0 or draw(st.integers(0, 3)) == 0:
        return draw(leaf(x))
    form = draw(st.sampled_from(["unary", "binary", "where", "maxmin", "cap"]))
    a = draw(elementwise(x, depth - 1))
    if form == "unary":
        return f"{draw(st.sampled_from(UNARY))}({a})"
    if form == "binary":
        b = draw(elementwise(x, depth - 1))
        return f"({a} {draw(st.sampled_from(['+', '-', '*']))} {b})"
    if form == "where":
        b = draw(elementwise(x, depth - 1))
        cmp = draw(st.sampled_from(["<", "<=", ">", ">="]))
        logic = draw(st.sampled_from(["", f" and {x} < 1.5", f" or {x} > 2.0"]))
        return f"where({x} {cmp} 0.0{logic}, {a}, {b})"
    if form == "maxmin":
        return f"{draw(st.sampled_from(['max', 'min']))}({a}, {draw(leaf(x))})"
    return f"tanh({a} / 3.0) * 3.0"


def _using(x: str, e: str) -> str:
    """`e`, made to read `x` (a constant alone would leave the left's indices undefined)."""
    return e if x in e else f"({e}) * {x}"


@st.composite
def attention(draw):
    """Scores with optional bias, soft cap and causal mask; one statement, or the
    scores in a statement of their own with renamed indices."""
    i, m, k, j, a, b = draw(st.permutations(NAMES))[:6]
    bias, cap, mask = draw(st.booleans()), draw(st.booleans()), draw(st.booleans())

    def scores(x, y):
        s = f"sum[{k}](Q[{x},{k}] * K[{y},{k}]) * 0.5"
        if bias:
            s = f"{s} + Bias[{x},{y}]"
        return f"tanh(({s}) / 5.0) * 5.0" if cap else s

    def masked(s):
        return f"where({m} <= {i}, {s}, -inf)" if mask else s

    if draw(st.booleans()):
        return f"O[{i},{j}] = softmax[{m}]({masked(scores(i, m))}) * V[{m},{j}]"
    x, y = draw(st.sampled_from([(i, m), (a, b)]))
    return f"S[{x},{y}] = {scores(x, y)}\nO[{i},{j}] = softmax[{m}]({masked(f'S[{i},{m}]')}) * V[{m},{j}]"


@st.composite
def loss(draw):
    form = draw(st.sampled_from(["lse", "ce", "mse"]))
    if form == "lse":
        return "L[i] = logsumexp[k](X[i,k]) - X[i,k]" if draw(st.booleans()) else \
               "L[i,k] = logsumexp[m](X[i,m]) - X[i,k]"
    if form == "ce":
        return "L[] = sum[i](logsumexp[k](X[i,k]) - sum[k](T[i,k] * X[i,k]))"
    return "L[] = mean[i, k]((X[i,k] - T[i,k]) ** 2)"


@st.composite
def norm(draw):
    form = draw(st.sampled_from(["layer", "rms", "softmax", "l2"]))
    if form == "layer":
        return ("mu[i] = mean[k](X[i,k])\nvar[i] = mean[k]((X[i,k] - mu[i]) ** 2)\n"
                "Y[i,k] = (X[i,k] - mu[i]) * rsqrt(var[i] + 1e-5) * G[k]")
    if form == "rms":
        return "Y[i,k] = X[i,k] * rsqrt(mean[j](X[i,j] ** 2) + 1e-6)"
    if form == "softmax":
        return "Y[i,k] = softmax[k](X[i,k] * 2.0)"
    return "Y[i,k] = X[i,k] / sqrt(sum[k](X[i,k] * X[i,k]) + 1e-6)"


@st.composite
def chain(draw):
    """Statements with renamed indices, reductions between them, several outputs."""
    lines = [f"A[i,k] = {_using('X[i,k]', draw(elementwise('X[i,k]', 2)))}"]
    prev, names = "A", ["A"]
    for n in range(draw(st.integers(1, 3))):
        a, b = draw(st.sampled_from([("i", "k"), ("p", "q"), ("r", "s")]))
        body = _using(f"{prev}[{a},{b}]", draw(elementwise(f"{prev}[{a},{b}]", 2)))
        if draw(st.booleans()):
            red = draw(st.sampled_from(["sum", "max", "min", "mean"]))
            name = f"R{n}"
            lines.append(f"{name}[{a}] = {red}[{b}]({body})")
            lines.append(f"B{n}[{a},{b}] = {prev}[{a},{b}] - {name}[{a}]")
            prev = f"B{n}"
        else:
            lines.append(f"B{n}[{a},{b}] = {body}")
            prev = f"B{n}"
        names.append(prev)
    return "\n".join(lines)


@st.composite
def several_outputs(draw):
    x = "X[i,k]"
    return "\n".join(f"Y{n}[i,k] = {_using(x, draw(elementwise(x, 2)))}" for n in range(draw(st.integers(2, 3)))) + \
        "\nZ[i] = sum[k](X[i,k] * W[k])"


def valid_program():
    return st.one_of(attention(), loss(), norm(), chain(), several_outputs(),
                     elementwise("X[i,k]").map(lambda e: f"Y[i,k] = {_using('X[i,k]', e)}"))


DEVICE = "cuda" if torch.cuda.is_available() else "cpu"   # the GPU machine runs real kernels


def _inputs(program, sizes, seed):
    return random_inputs(program, sizes, dtype=torch.float32, seed=seed, device=DEVICE)


def _compare(src: str, sizes: dict, seed: int) -> None:
    ref = compiler.compile(src, backend="reference")
    inputs = _inputs(ref.checked, sizes, seed)
    want = ref(**inputs)
    want = want if isinstance(want, tuple) else (want,)
    try:
        tri = compiler.compile(src, backend="triton")
        got = tri(**inputs)
    except Exception as e:  # noqa: BLE001 -- the property: report the program
        pytest.fail(f"the Triton backend failed ({type(e).__name__}: {str(e)[:300]}) on a program the "
                    f"oracle runs; sizes {sizes}:\n{src}")
    got = got if isinstance(got, tuple) else (got,)
    for name, g, w in zip(ref.outputs, got, want):
        err = relative_error(g, w)
        # near-zero results (cancellation: logsumexp over one element minus that element)
        # are judged by absolute error: the relative one divides by ~0
        close = torch.allclose(g.double().cpu(), w.double().cpu(), rtol=TOLERANCE, atol=1e-5, equal_nan=True)
        if not (err <= TOLERANCE or close):
            pytest.fail(f"output {name}: relative error {err:.2e} > {TOLERANCE}; sizes {sizes}:\n{src}")


@settings(max_examples=EXAMPLES, **SETTINGS)
@given(data=st.data())
def test_valid_programs_agree_with_the_oracle(data):
    src = data.draw(valid_program(), label="program")
    program = compiler.compile(src, backend="reference")
    sizes = {ix: data.draw(st.integers(MIN_EXTENT, 7), label=f"len({ix})") for ix, _ in program.checked.extents}
    _compare(src, sizes, data.draw(st.integers(0, 2 ** 16), label="seed"))


# ---------------------------------------------------------------- invalid programs
ALPHABET = "[](),;=+-*/<>#.!?:\n\t 0123456789abcdefijkmxyzAXQK_\\\"'"


@st.composite
def mutated(draw):
    src = draw(valid_program())
    for _ in range(draw(st.integers(1, 3))):
        how = draw(st.sampled_from(["insert", "delete", "replace", "truncate", "swap", "rename", "dup"]))
        n = len(src)
        at = draw(st.integers(0, max(0, n - 1)))
        if how == "insert":
            src = src[:at] + draw(st.sampled_from(ALPHABET)) + src[at:]
        elif how == "delete":
            src = src[:at] + src[at + 1:]
        elif how == "replace":
            src = src[:at] + draw(st.sampled_from(ALPHABET)) + src[at + 1:]
        elif how == "truncate":
            src = src[:at]
        elif how == "swap":
            pairs = draw(st.sampled_from([("[", "("), ("]", ")"), ("(", "["), (")", "]")]))
            src = src.replace(*pairs, 1) if draw(st.booleans()) else src.replace(*pairs)
        elif how == "rename":
            old = draw(st.sampled_from(["X", "sum", "softmax", "exp", "tanh", "where", "mean", "i", "k"]))
            new = draw(st.sampled_from(["Xx", "summ", "softmaxx", "foo", "len", "inf", "pi", "k", "i",
                                        "sum", "where", "and", "not"]))
            src = src.replace(old, new, 1)
        else:
            src = src[:at] + src[at:at + 5] + src[at:]
    return src


@settings(max_examples=EXAMPLES * 5, **SETTINGS)
@given(src=mutated(), seed=st.integers(0, 100))
def test_mutations_raise_einfold_errors_only(src, seed):
    try:
        program = compiler.compile(src, backend="reference")
        sizes = {ix: 1 + (seed + n) % 4 for n, (ix, _) in enumerate(program.checked.extents)}
        program(**random_inputs(program.checked, sizes, seed=seed))
    except compiler.EinfoldError as e:
        text = str(e)           # renders (caret and all) without failing
        assert text
        if e.span is not None and e.source is not None:
            assert 0 <= e.span.start <= len(e.source)
    except Exception as e:  # noqa: BLE001
        pytest.fail(f"{type(e).__name__} (not an einfold error): {str(e)[:300]}\nprogram: {src!r}")


@settings(max_examples=EXAMPLES * 2, **SETTINGS)
@given(src=st.text(alphabet=ALPHABET, max_size=60))
def test_random_text_raises_einfold_errors_only(src):
    try:
        compiler.compile(src, backend="reference")
    except compiler.EinfoldError:
        pass
    except Exception as e:  # noqa: BLE001
        pytest.fail(f"{type(e).__name__} (not an einfold error): {str(e)[:300]}\nprogram: {src!r}")


def test_examples_count_is_read_from_the_environment():
    assert EXAMPLES >= 1 and math.isfinite(TOLERANCE)
