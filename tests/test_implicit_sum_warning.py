"""Issue 42, item 5: an index free in two sibling terms (operands of `+`, `-`, a
function, a where's branches) is summed by the Einstein convention over all of
them at once.  Where that means something else than each term summed where its
own occurrences are (a sum moved out of a function it does not distribute over),
it warns, with a caret under the index.  Contractions (a product's factors) and
linear combinations of sums, whose meaning is the same either way, do not."""
import sys
import warnings
from pathlib import Path

import pytest

import compiler
from compiler import ImplicitSumWarning
from compiler.check import check
from compiler.parse import parse

sys.path.insert(0, str(Path(__file__).resolve().parent))
from test_errors import location, pointed  # noqa: E402


def implicit_sum_warnings(src: str) -> list[str]:
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        check(parse(src))
    return [str(w.message) for w in caught if issubclass(w.category, ImplicitSumWarning)]


def test_the_issue_example_warns_with_a_caret_under_k():
    src = "L[i] = logsumexp[v](H[i,k]*W[v,k]) - sum[v](where(v == 3, H[i,k]*W[v,k], 0))"
    [message] = implicit_sum_warnings(src)
    head = message.splitlines()[0]
    assert head.startswith("einfold: index 'k' ")
    assert "whole right-hand side" in head and "sum[k](...)" in head
    assert pointed(message) == "k"
    assert location(message) == (1, src.index("H[i,k]*W[v,k], 0") + 5)     # the k of the second term


def test_a_sum_moved_out_of_a_function_warns():
    src = "Y[i] = A[i,k] + exp(B[i,k])"          # alone, exp(B[i,k]) would be exp(sum[k](B[i,k]))
    [message] = implicit_sum_warnings(src)
    assert pointed(message) == "k" and location(message) == (1, src.rindex("k") + 1)
    # what the convention does: one sum over both terms
    with pytest.warns(ImplicitSumWarning):
        program = check(parse(src))
    assert "sum[k](A[i, k] + exp(B[i, k]))" in compiler.ir.format_program(program)


@pytest.mark.parametrize("src", [
    "Y[i] = max(A[i,k], B[i,k])",                          # a function's arguments
    "Y[i] = A[i,k] - log(sum[v](W[v,k]))",                 # inside a reduction over another index
    "Y[i] = exp(A[i,k] - tanh(B[i,k])) * 2",               # a subexpression, not the whole side
])
def test_other_moved_sums_warn(src):
    [message] = implicit_sum_warnings(src)
    assert pointed(message) == "k"


def test_a_subexpression_is_named():
    [message] = implicit_sum_warnings("Y[i] = exp(A[i,k] - tanh(B[i,k])) * 2")
    assert "whole subexpression 'A[i,k] - tanh(B[i,k])'" in message


def test_the_warning_comes_through_compile():
    with pytest.warns(ImplicitSumWarning, match="index 'k'"):
        compiler.compile("Y[i] = max(A[i,k], B[i,k])", backend="reference")


@pytest.mark.parametrize("src", [
    "C[i,j] = A[i,k] * B[k,j]",                                          # matmul
    "O[i,j] = softmax[m](Q[i,k]*K[m,k]) * V[m,j]",                       # attention
    "O[i,j] = softmax[m](Q[i,k]*K[m,k] / sqrt(len(k))) * V[m,j]",
    "Y[i] = sum[k](A[i,k] + B[i,k])",                                    # explicit sum
    "L[i] = logsumexp[v](sum[k](H[i,k]*W[v,k])) - sum[v](where(v == 3, sum[k](H[i,k]*W[v,k]), 0))",
    "C[i,j] = A[i,k] * B[k,j] + D[i,j]",                                 # k in one term only
    "C[i,j] = (A[i,k] + B[i,k]) * D[k,j]",                               # a product of factors
    "Y[i] = A[i,k] / B[k]",
    "Y[i] = where(M[i,k] > 0, A[i,k], 0.0)",                             # a mask is a factor
    "t[] = S[i,i]",                                                      # trace
    # linear combinations: the sum distributes, so either placement means the same
    "Y[i] = A[i,k] + B[i,k]",
    "Y[i] = where(C[i] > 0, A[i,k], B[i,k])",
    "Y[i] = exp(A[i,k] - B[i,k]) * 2",
    "O[h,i,j] = softmax[m](S1[h,i,m]) * V[h,m,j] - lam * softmax[m](S2[h,i,m]) * V[h,m,j]",
])
def test_contractions_do_not_warn(src):
    assert implicit_sum_warnings(src) == []


def test_no_program_of_the_differential_corpus_warns():
    from test_differential import CORPUS
    warned = [name for name, src in CORPUS.items() if implicit_sum_warnings(src)]
    assert warned == []
