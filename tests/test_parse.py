"""Parser and checker golden cases: source text -> canonical printed IR.

Every case goes through parse -> check -> ir.format_program, so it pins the
grammar, the Einstein convention and the printer at once.  Precedence cases
also pin the tree itself (IR equality ignores spans)."""
import math
import textwrap

import pytest

from compiler.algebra import BUILTINS
from compiler.check import check
from compiler.errors import ParseError
from compiler.ir import Access, Call, Composite, Const, Extent, Index, Reduce, format_program
from compiler.parse import parse


def canonical(src: str) -> str:
    return format_program(check(parse(src)))


def expr_of(src: str, statement: int = 0):
    return check(parse(src)).statements[statement].expr


def a(name, *indices):
    return Access(name, tuple(indices))


def call(op, *args):
    return Call(op, tuple(args))


GOLDEN = [
    # --- statements, accesses, scalars, literals
    ("copy", "B[i] = A[i]", "B[i] = A[i]"),
    ("spaces are free", "B[ i ,j ]=A[ i,j ]", "B[i, j] = A[i, j]"),
    ("trailing comma", "B[i, j,] = A[i, j,]", "B[i, j] = A[i, j]"),
    ("scalar parameters", "Y[i] = A[i] * scale + eps", "Y[i] = A[i] * scale + eps"),
    ("0-d output with brackets", "X[] = sum[i](A[i])", "X[] = sum[i](A[i])"),
    ("0-d output without brackets", "X = sum[i](A[i])", "X[] = sum[i](A[i])"),
    ("0-d input tensor", "Y[i] = A[i] * t", "Y[i] = A[i] * t"),
    ("integer literal", "Y[i] = A[i] * 2", "Y[i] = A[i] * 2"),
    ("float literals", "Y[i] = A[i] * 2.5 + 2. + .5 + 1e-3 + 1E3",
     "Y[i] = A[i] * 2.5 + 2.0 + 0.5 + 0.001 + 1000.0"),
    ("constants", "Y[i] = A[i] * pi + inf", "Y[i] = A[i] * pi + inf"),
    ("negative infinity", "Y[i] = max(A[i], -inf)", "Y[i] = max(A[i], -inf)"),
    # --- separators, comments, continuation
    ("semicolons", "B[i] = A[i]; C[i] = B[i] * 2", "B[i] = A[i]\nC[i] = B[i] * 2"),
    ("comments and blank lines",
     "# leading comment\n\nB[i] = A[i]  # trailing comment\n# between\n\nC[i] = B[i]\n\n",
     "B[i] = A[i]\nC[i] = B[i]"),
    ("newlines inside brackets",
     "C[i, j] = sum[k](\n    A[i, k]\n    * B[k,\n        j]\n)\n",
     "C[i, j] = sum[k](A[i, k] * B[k, j])"),
    ("comment inside brackets", "Y[i] = (A[i]  # first\n  + B[i])", "Y[i] = A[i] + B[i]"),
    ("backslash continuation", "Y[i] = A[i] \\\n    + B[i]", "Y[i] = A[i] + B[i]"),
    ("crlf line endings", "B[i] = A[i]\r\nC[i] = B[i]\r\n", "B[i] = A[i]\nC[i] = B[i]"),
    ("leading and trailing semicolons", ";B[i] = A[i];;", "B[i] = A[i]"),
    # --- arithmetic and printing of parentheses
    ("redundant parentheses vanish", "Y[i] = ((A[i] * B[i])) + (C[i])", "Y[i] = A[i] * B[i] + C[i]"),
    ("left-associative minus", "Y[i] = (a - b) - A[i]", "Y[i] = a - b - A[i]"),
    ("right operand of minus keeps parentheses", "Y[i] = a - (b - A[i])", "Y[i] = a - (b - A[i])"),
    ("right operand of division", "Y[i] = a / (b * A[i])", "Y[i] = a / (b * A[i])"),
    ("sum inside product", "Y[i] = (a + b) * A[i]", "Y[i] = (a + b) * A[i]"),
    ("unary minus binds looser than power", "Y[i] = -a ** 2 * A[i]", "Y[i] = -a ** 2 * A[i]"),
    ("negated base keeps parentheses", "Y[i] = (-a) ** 2 * A[i]", "Y[i] = (-a) ** 2 * A[i]"),
    ("power is right-associative", "Y[i] = a ** b ** A[i]", "Y[i] = a ** b ** A[i]"),
    ("left-nested power keeps parentheses", "Y[i] = (a ** b) ** A[i]", "Y[i] = (a ** b) ** A[i]"),
    ("negative exponent", "Y[i] = A[i] ** -2", "Y[i] = A[i] ** -2"),
    ("double negation", "Y[i] = - -A[i]", "Y[i] = --A[i]"),
    ("negated product", "Y[i] = -(a * A[i])", "Y[i] = -(a * A[i])"),
    ("times negative", "Y[i] = A[i] * -b", "Y[i] = A[i] * -b"),
    # --- comparisons, logic, where
    ("every comparison",
     "Y[i] = where(A[i] < 1 and A[i] <= 2 and A[i] > 3 and A[i] >= 4 and A[i] == 5 and A[i] != 6, 1.0, 0.0)",
     "Y[i] = where(A[i] < 1 and A[i] <= 2 and A[i] > 3 and A[i] >= 4 and A[i] == 5 and A[i] != 6, "
     "1.0, 0.0)"),
    ("not binds looser than comparisons", "Y[i] = where(not a < b and c > d, A[i], 0)",
     "Y[i] = where(not a < b and c > d, A[i], 0)"),
    ("or binds looser than and", "Y[i] = where(a < b or c < d and A[i] > 0, 1, 0)",
     "Y[i] = where(a < b or c < d and A[i] > 0, 1, 0)"),
    ("or under and keeps parentheses", "Y[i] = where((a < b or c < d) and A[i] > 0, 1, 0)",
     "Y[i] = where((a < b or c < d) and A[i] > 0, 1, 0)"),
    ("not of a conjunction", "Y[i] = where(not (a < b and A[i] > 0), 1, 0)",
     "Y[i] = where(not (a < b and A[i] > 0), 1, 0)"),
    ("arithmetic inside comparisons", "Y[i] = where(A[i] + 1 < 2 * b, A[i], -A[i])",
     "Y[i] = where(A[i] + 1 < 2 * b, A[i], -A[i])"),
    ("a predicate statement", "Y[i] = A[i] > 0", "Y[i] = A[i] > 0"),
    # --- functions
    ("every one-argument function",
     "Y[i] = exp(A[i]) + exp2(A[i]) + log(A[i]) + log2(A[i]) + sqrt(A[i]) + rsqrt(A[i]) + abs(A[i]) "
     "+ tanh(A[i]) + sigmoid(A[i]) + erf(A[i]) + gelu(A[i]) + silu(A[i]) + relu(A[i]) + softplus(A[i])",
     "Y[i] = exp(A[i]) + exp2(A[i]) + log(A[i]) + log2(A[i]) + sqrt(A[i]) + rsqrt(A[i]) + abs(A[i]) "
     "+ tanh(A[i]) + sigmoid(A[i]) + erf(A[i]) + gelu(A[i]) + silu(A[i]) + relu(A[i]) + softplus(A[i])"),
    ("two-argument max and min", "Y[i] = max(A[i], 0) + min(A[i], B[i])",
     "Y[i] = max(A[i], 0) + min(A[i], B[i])"),
    ("len of an index", "Y[i] = sum[k](A[i, k]) / len(k)", "Y[i] = sum[k](A[i, k]) / len(k)"),
    # --- reductions
    ("every reduction",
     "Y[i] = sum[k](A[i,k]) + max[k](A[i,k]) + min[k](A[i,k]) + prod[k](A[i,k]) + mean[k](A[i,k]) "
     "+ logsumexp[k](A[i,k])",
     "Y[i] = sum[k](A[i, k]) + max[k](A[i, k]) + min[k](A[i, k]) + prod[k](A[i, k]) "
     "+ mean[k](A[i, k]) + logsumexp[k](A[i, k])"),
    ("several indices", "X[] = sum[m, n](A[m, n])", "X[] = sum[m, n](A[m, n])"),
    ("softmax keeps its index", "P[i, m] = softmax[m](S[i, m])", "P[i, m] = softmax[m](S[i, m])"),
    ("nested reductions", "Y[] = max[i](sum[k](A[i, k]))", "Y[] = max[i](sum[k](A[i, k]))"),
    # --- Einstein convention
    ("matmul", "C[i,j] = A[i,k]*B[k,j]", "C[i, j] = sum[k](A[i, k] * B[k, j])"),
    ("added after the sum", "C[i,j] = A[i,k]*B[k,j] + D[i,j]",
     "C[i, j] = sum[k](A[i, k] * B[k, j]) + D[i, j]"),
    ("attention", "O[i,j] = softmax[m](Q[i,k]*K[m,k] / sqrt(len(k))) * V[m,j]",
     "O[i, j] = sum[m](softmax[m](sum[k](Q[i, k] * K[m, k]) / sqrt(len(k))) * V[m, j])"),
    ("batch matmul", "C[b,i,j] = A[b,i,k]*B[b,k,j]", "C[b, i, j] = sum[k](A[b, i, k] * B[b, k, j])"),
    ("full contraction", "X[] = A[i,k]*B[k,i]", "X[] = sum[i, k](A[i, k] * B[k, i])"),
    ("trace", "X[] = A[i,i]", "X[] = sum[i](A[i, i])"),
    ("diagonal", "d[i] = A[i,i]", "d[i] = A[i, i]"),
    ("row sum of one access", "r[i] = A[i,k]", "r[i] = sum[k](A[i, k])"),
    ("two separate sums", "Y[] = x[k] * sum[k](A[k]) + y[m]",
     "Y[] = sum[k](x[k]) * sum[k](A[k]) + sum[m](y[m])"),
    ("sum stays inside a function", "Y[i] = exp(A[i,k] * x[k])", "Y[i] = exp(sum[k](A[i, k] * x[k]))"),
    ("sum spans a function when needed", "Y[i] = exp(A[i,k]) * x[k]", "Y[i] = sum[k](exp(A[i, k]) * x[k])"),
    ("smallest subexpression with every occurrence", "Y[i] = x[i] + A[i,k] * (B[k,j] + 1) * y[j]",
     "Y[i] = x[i] + sum[j](sum[k](A[i, k] * (B[k, j] + 1)) * y[j])"),
    ("indices with the same smallest subexpression share one sum", "Y[i] = x[i] + A[i,k] * y[j] * B[k,j]",
     "Y[i] = x[i] + sum[k, j](A[i, k] * y[j] * B[k, j])"),
    ("inner sum first", "Y[i] = x[i] + A[i,k] * (B[k,j] * y[j])",
     "Y[i] = x[i] + sum[k](A[i, k] * sum[j](B[k, j] * y[j]))"),
    ("index value counts as an occurrence", "Y[i] = where(i - m < 128, A[i] * B[m], 0)",
     "Y[i] = sum[m](where(i - m < 128, A[i] * B[m], 0))"),
    # --- index values
    ("causal mask", "S[i, m] = where(m <= i, X[i, m], -inf)", "S[i, m] = where(m <= i, X[i, m], -inf)"),
    ("alibi bias", "S[i, m] = X[i, m] - slope * abs(i - m)", "S[i, m] = X[i, m] - slope * abs(i - m)"),
    ("window", "S[i, m] = where(i - m < 128 and m <= i, X[i, m], -inf)",
     "S[i, m] = where(i - m < 128 and m <= i, X[i, m], -inf)"),
    ("index as a value", "Y[i] = A[i] * i", "Y[i] = A[i] * i"),
    # --- several statements
    ("later statements read earlier ones",
     "S[i, m] = Q[i, k] * K[m, k]\nP[i, m] = softmax[m](S[i, m])\nO[i, j] = P[i, m] * V[m, j]",
     "S[i, m] = sum[k](Q[i, k] * K[m, k])\nP[i, m] = softmax[m](S[i, m])\n"
     "O[i, j] = sum[m](P[i, m] * V[m, j])"),
]


@pytest.mark.parametrize("src, want", [(s, w) for _, s, w in GOLDEN], ids=[n for n, _, _ in GOLDEN])
def test_golden(src, want):
    assert canonical(src) == want + "\n"


@pytest.mark.parametrize("src, want", [(s, w) for _, s, w in GOLDEN], ids=[n for n, _, _ in GOLDEN])
def test_canonical_form_is_a_fixed_point(src, want):
    assert canonical(want) == want + "\n"


# ---------------------------------------------------------------- trees
def test_unary_minus_of_power():
    # -a ** 2 is -(a ** 2), as in Python
    assert expr_of("Y[i] = -a ** 2 + A[i]") == call(
        "add", call("neg", call("pow", a("a"), Const(2))), a("A", "i"))


def test_minus_is_left_associative():
    assert expr_of("Y[i] = a - b - A[i]") == call("sub", call("sub", a("a"), a("b")), a("A", "i"))
    assert expr_of("Y[i] = a - (b - A[i])") == call("sub", a("a"), call("sub", a("b"), a("A", "i")))


def test_power_is_right_associative():
    assert expr_of("Y[i] = a ** b ** A[i]") == call("pow", a("a"), call("pow", a("b"), a("A", "i")))


def test_not_and_comparisons():
    # not a < b and c > d  ==  (not (a < b)) and (c > d)
    cond = expr_of("Y[i] = where(not a < b and c > d, A[i], 0)").args[0]
    assert cond == call("and", call("not", call("lt", a("a"), a("b"))), call("gt", a("c"), a("d")))


def test_product_binds_tighter_than_sum():
    assert expr_of("Y[i] = a + b * A[i]") == call("add", a("a"), call("mul", a("b"), a("A", "i")))


def test_names_resolve_to_indices_constants_and_scalars():
    e = expr_of("Y[i] = A[i] * i + pi * s + len(i)")
    assert e == call("add", call("add", call("mul", a("A", "i"), Index("i")), call("mul", Const(math.pi), a("s"))),
                     Extent("i"))


def test_keywords_do_not_swallow_names_that_start_with_them():
    e = expr_of("Y[i] = android[i] + notes[i] + order[i] + inf_mask[i] + pie")
    names = {n.tensor for n in _walk(e) if isinstance(n, Access)}
    assert names == {"android", "notes", "order", "inf_mask", "pie"}


def test_einstein_sum_is_a_builtin_sum_reduce():
    e = expr_of("C[i,j] = A[i,k]*B[k,j] + D[i,j]")
    assert e == call("add", Reduce(BUILTINS["sum"], ("k",), (call("mul", a("A", "i", "k"), a("B", "k", "j")),)),
                     a("D", "i", "j"))


def test_softmax_is_a_composite_and_the_sum_wraps_it():
    e = expr_of("O[i,j] = softmax[m](S[i,m]) * V[m,j]")
    assert e == Reduce(BUILTINS["sum"], ("m",),
                       (call("mul", Composite("softmax", ("m",), a("S", "i", "m")), a("V", "m", "j")),))


def test_integer_and_float_literals_differ():
    assert expr_of("Y[i] = A[i] * 2").args[1] == Const(2)
    assert isinstance(expr_of("Y[i] = A[i] * 2.0").args[1].value, float)
    assert expr_of("Y[i] = A[i] * 1e2").args[1] == Const(100.0)


def test_outputs_are_the_statements_no_later_one_reads():
    p = check(parse("S[i] = A[i]\nT[i] = S[i] * 2\nU[i] = S[i] + 1"))
    assert p.outputs == ("T", "U")
    assert [i.name for i in p.inputs] == ["A"]


def test_outputs_can_ask_for_intermediates_in_statement_order():
    p = check(parse("S[i] = A[i]\nT[i] = S[i] * 2"), outputs=("T", "S"))
    assert p.outputs == ("S", "T")


def test_one_extent_per_index_name():
    # i and j index the same dimension of S, so they share one extent symbol
    p = check(parse("S[i] = A[i]\nT[j] = S[j] * B[j]"))
    assert p.extent("i") == p.extent("j")
    assert check(parse("C[i,j] = A[i,k]*B[k,j]")).extent("i") != check(parse("C[i,j] = A[i,k]*B[k,j]")).extent("j")


def _walk(e):
    from compiler.ir import walk
    return walk(e)


# ---------------------------------------------------------------- syntax errors
def syntax_error(src: str) -> str:
    with pytest.raises(ParseError) as excinfo:
        parse(src)
    return str(excinfo.value)


def test_unexpected_character_message():
    assert syntax_error("C[i] = A[i] $ 2") == textwrap.dedent("""\
        syntax error: unexpected character '$'
         --> line 1, column 13
          |
        1 | C[i] = A[i] $ 2
          |             ^""")


def test_unexpected_token_on_a_later_line():
    assert syntax_error("B[i] = A[i]\nC[i] = B[i] B[i]") == textwrap.dedent("""\
        syntax error: unexpected 'B'; expected 'and', ',', a comparison, '(', '-', 'or', '+', ')', ']', '/', '*', a new statement, '**'
         --> line 2, column 13
          |
        2 | C[i] = B[i] B[i]
          |             ^""")


def test_unexpected_end_of_input_points_after_the_last_token():
    msg = syntax_error("C[i,j] = A[i,k]*")
    assert msg.startswith("syntax error: unexpected end of input; expected ")
    assert msg.endswith("1 | C[i,j] = A[i,k]*\n  |                 ^")
    assert "line 1, column 17" in msg


def test_end_of_input_after_a_trailing_comment():
    msg = syntax_error("C[i] = A[i] + # more to come")
    assert msg.endswith("1 | C[i] = A[i] + # more to come\n  |              ^")


def test_unclosed_bracket_reports_end_of_input():
    msg = syntax_error("C[i] = sum[k](A[i, k]\n")
    assert "unexpected end of input" in msg and "')'" in msg


def test_end_of_line_in_an_unfinished_statement():
    msg = syntax_error("C[i] = A[i] +\nD[i] = C[i]")
    assert msg.startswith("syntax error: unexpected end of line; expected ")
    assert "line 1, column 14" in msg


def test_comparisons_do_not_chain():
    msg = syntax_error("Y[i] = where(a < b < c, A[i], 0)")
    assert "unexpected '<'" in msg
    assert msg.endswith("1 | Y[i] = where(a < b < c, A[i], 0)\n  |                    ^")


def test_semicolon_inside_brackets():
    msg = syntax_error("C[i] = (A[i]; B[i])")
    assert "unexpected ';'; expected ')'" in msg
    assert "line 1, column 13" in msg


def test_missing_equals():
    msg = syntax_error("C[i] A[i]")
    assert "unexpected 'A'; expected '='" in msg


def test_caret_lines_up_after_tabs():
    msg = syntax_error("C[i] =\tA[i] $ 1")
    source_line, caret_line = msg.splitlines()[-2:]
    assert source_line == "1 | C[i] =\tA[i] $ 1"
    assert caret_line == "  |       \t     ^"
