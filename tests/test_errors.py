"""Every error of the language: its class in the project's hierarchy, the key
words of its message, and the source text the caret points at."""
import re

import pytest
import torch

import compiler
from compiler import BindError, CheckError, EinfoldError, ParseError
from compiler.check import check
from compiler.parse import parse


def pointed(message: str) -> str:
    """The source text under the carets of a rendered error."""
    source_line, caret_line = message.splitlines()[-2:]
    text = source_line.split(" | ", 1)[1]
    marks = caret_line.split(" | ", 1)[1]
    start = marks.index("^")
    return text[start:start + marks.count("^")]


def location(message: str) -> tuple[int, int]:
    line, column = re.search(r"--> line (\d+), column (\d+)", message).groups()
    return int(line), int(column)


def check_error(src: str) -> str:
    with pytest.raises(CheckError) as excinfo:
        check(parse(src))
    return str(excinfo.value)


def bind_error(src: str, **inputs) -> str:
    program = compiler.compile(src, backend="reference")
    with pytest.raises(BindError) as excinfo:
        program(**inputs)
    return str(excinfo.value)


def test_hierarchy():
    for cls in (ParseError, CheckError, BindError):
        assert issubclass(cls, EinfoldError)


# ---------------------------------------------------------------- syntax
def test_syntax_error():
    with pytest.raises(ParseError) as excinfo:
        compiler.compile("C[i] = A[i]\nD[i] = (C[i] * ) 2")
    msg = str(excinfo.value)
    assert msg.startswith("syntax error: unexpected ')'")
    assert location(msg) == (2, 16)
    assert pointed(msg) == ")"
    assert "2 | D[i] = (C[i] * ) 2" in msg


def test_syntax_error_spans_are_on_the_error():
    with pytest.raises(ParseError) as excinfo:
        parse("C[i] = A[i] ? 1")
    assert excinfo.value.span.start == 12
    assert excinfo.value.source == "C[i] = A[i] ? 1"


# ---------------------------------------------------------------- check time
def test_unknown_function():
    msg = check_error("C[i] = A[i]\nD[i] = expp(C[i])")
    assert msg.startswith("error: unknown function 'expp'; did you mean 'exp'?")
    assert location(msg) == (2, 8)
    assert pointed(msg) == "expp"


def test_unknown_function_without_a_suggestion():
    msg = check_error("C[i] = frobnicate(A[i])")
    assert "unknown function 'frobnicate'" in msg and "did you mean" not in msg
    assert pointed(msg) == "frobnicate"


def test_unknown_reduction():
    msg = check_error("C[i] = summ[k](A[i, k])")
    assert "unknown reduction 'summ'; did you mean 'sum'?" in msg
    assert pointed(msg) == "summ"


def test_reduction_called_as_a_function():
    msg = check_error("C[] = sum(A[i])")
    assert "'sum' is a reduction; write sum[index](...)" in msg
    assert pointed(msg) == "sum"


def test_function_used_as_a_reduction():
    msg = check_error("C[] = exp[i](A[i])")
    assert "'exp' is a function, not a reduction" in msg
    assert pointed(msg) == "exp"


def test_wrong_number_of_arguments():
    msg = check_error("C[i] = where(A[i] > 0, A[i])")
    assert "where(...) takes 3 arguments, got 2" in msg
    assert pointed(msg) == "where(A[i] > 0, A[i])"


def test_left_index_not_defined_by_the_right():
    msg = check_error("C[i, j] = A[i, k]")
    assert "index 'j' on the left is not defined by the right side" in msg
    assert location(msg) == (1, 6)
    assert pointed(msg) == "j"


def test_left_index_only_inside_a_reduction_is_not_defined():
    msg = check_error("C[i, k] = sum[k](A[i, k])")
    assert "index 'k' on the left is not defined" in msg
    assert pointed(msg) == "k"


def test_reduction_over_an_unused_index():
    msg = check_error("C[i] = A[i] + max[k](B[i])")
    assert "max[...] reduces over 'k' but its body does not use 'k'" in msg
    assert pointed(msg) == "max[k](B[i])"


def test_composite_over_an_unused_index():
    msg = check_error("C[i, k] = A[i, k] * softmax[m](B[i])")
    assert "softmax[...] reduces over 'm' but its body does not use 'm'" in msg
    assert pointed(msg) == "softmax[m](B[i])"


def test_name_assigned_twice():
    msg = check_error("C[i] = A[i]\nD[i] = C[i]\nC[i] = B[i]")
    assert "'C' is assigned twice (first on line 1)" in msg
    assert location(msg) == (3, 1)
    assert pointed(msg) == "C"


def test_statement_reads_itself():
    msg = check_error("C[i] = A[i] + C[i]")
    assert "statement 'C' reads itself" in msg
    assert location(msg) == (1, 15)
    assert pointed(msg) == "C"


def test_statement_reads_a_later_one():
    msg = check_error("C[i] = D[i] * 2\nD[i] = A[i]")
    assert "'D' is defined by a later statement; a statement may only read earlier results" in msg
    assert location(msg) == (1, 8)
    assert pointed(msg) == "D"


def test_statement_result_read_with_the_wrong_rank():
    msg = check_error("C[i, j] = A[i, j]\nD[i] = C[i]")
    assert "'C' has rank 2 but is accessed with 1 index" in msg
    assert pointed(msg) == "C[i]"


def test_input_read_with_two_ranks():
    msg = check_error("C[i] = A[i] * A[i, j]")
    assert "input 'A' is accessed with 2 indices here but with 1 at line 1, column 8" in msg
    assert pointed(msg) == "A[i, j]"


def test_index_used_as_a_tensor():
    msg = check_error("C[i] = A[i] * i[j]")
    assert "'i' is used both as an index and as a tensor" in msg
    assert pointed(msg) == "i"


def test_index_on_the_left_twice():
    msg = check_error("C[i, i] = A[i]")
    assert "index 'i' appears twice on the left" in msg
    assert location(msg) == (1, 6)


def test_constant_cannot_be_assigned():
    msg = check_error("pi[i] = A[i]\nB[i] = pi * A[i]")
    assert "'pi' is a constant of the language and cannot be assigned" in msg
    assert pointed(msg) == "pi"


def test_implicit_sum_over_a_predicate():
    msg = check_error("Y[] = where(A[i] < B[i], 1.0, 0.0)")
    assert "index 'i' is neither on the left nor bound, so the Einstein convention sums over this predicate" in msg
    assert pointed(msg) == "A[i] < B[i]"


def test_predicate_used_as_a_number():
    msg = check_error("C[i] = A[i] + (A[i] > 0)")
    assert "'+' cannot take float and bool operands; a predicate selects with where(cond, x, y)" in msg
    assert pointed(msg) == "A[i] + (A[i] > 0)"


def test_number_used_as_a_predicate():
    msg = check_error("C[i] = where(A[i] * 2.0, 1.0, 0.0)")
    assert "where(...) takes a predicate (a comparison) as its condition, not a float value" in msg
    assert pointed(msg) == "A[i] * 2.0"


def test_float_tensor_for_an_input_read_as_a_condition():
    msg = bind_error("C[i] = where(A[i], 1.0, 0.0)", A=torch.randn(3))
    assert "input 'A' is read as a condition" in msg and "takes a bool tensor, not a torch.float32 tensor" in msg
    assert pointed(msg) == "A[i]"


def test_logic_on_numbers():
    msg = check_error("C[i] = where(A[i] + 1.0 and B[i] - 1.0, 1.0, 0.0)")
    assert "'and' cannot take float operands" in msg
    assert pointed(msg) == "A[i] + 1.0 and B[i] - 1.0"


def test_reduction_of_a_predicate():
    msg = check_error("C[] = sum[i](A[i] > 0)")
    assert "sum[...] cannot take bool operands" in msg


def test_index_without_an_extent():
    msg = check_error("C[j] = sum[i](A[j] * where(i < 3, 1, 0))")
    assert "index 'i' has no extent: no input tensor is indexed by it" in msg
    assert "it is on no left-hand side, where a size passed at the call (i=...) could give it one" in msg
    assert pointed(msg) == "i"


def test_an_index_only_on_the_left_takes_its_size_from_the_call():
    program = compiler.compile("C[i, j] = A[j] * where(i < 3, 1, 0)", backend="reference")
    a = torch.arange(4.0)
    assert program(A=a, i=5).tolist() == [a.tolist()] * 3 + [[0.0] * 4] * 2
    with pytest.raises(compiler.BindError, match=r"missing size 'i': index 'i' takes its extent from the call"):
        program(A=a)
    for bad in (2.5, -1, True, torch.tensor(3)):
        with pytest.raises(compiler.BindError, match=r"i= must be a whole number >= 0"):
            program(A=a, i=bad)


def test_bare_name_that_is_no_index_is_a_scalar_parameter():
    # `m` is never a subscript, so it is a 0-d input, not an index value
    program = check(parse("C[i] = A[i] * where(i < m, 1, 0)"))
    assert [(i.name, i.rank) for i in program.inputs] == [("A", 1), ("m", 0)]


def test_len_of_a_non_index():
    msg = check_error("C[i] = A[i] / len(A)")
    assert "len(...) takes one index name" in msg
    assert pointed(msg) == "len(A)"


@pytest.mark.parametrize("src, construct, why", [
    ("C[i] = A[i * i]", "i * i", "a product needs one integer factor"),
    ("C[i] = A[i / 2]", "i / 2", "integer coefficients"),
    ("C[i] = A[B[i] * B[i]]", "B[i] * B[i]", "a product needs one integer factor"),
    ("C[i] = A[B[i] + B[i + 1]]", "B[i] + B[i + 1]", "adds 2 tensor reads"),
    ("C[i] = A[i + 0.5] * B[i]", "0.5", "0.5 is not an integer"),
    ("C[i] = A[exp(i)]", "exp(i)", "integer coefficients"),
])
def test_a_subscript_beyond_affine(src, construct, why):
    msg = check_error(src)
    assert "a subscript is an index, an affine combination of indices" in msg and why in msg
    assert pointed(msg) == construct


def test_index_bound_twice():
    msg = check_error("C[] = sum[k, k](A[k])")
    assert "index 'k' is bound twice" in msg


def test_integer_literal_too_large():
    msg = check_error("C[i] = A[i] * 123456789012345678901234567890")
    assert "integer literal 123456789012345678901234567890 does not fit in 64 bits" in msg
    assert pointed(msg) == "123456789012345678901234567890"


def test_empty_program():
    with pytest.raises(CheckError, match="the program has no statements"):
        check(parse("# nothing here\n"))


def test_unknown_output():
    with pytest.raises(CheckError, match="unknown output 'Z'; the statements are C, D"):
        compiler.compile("C[i] = A[i]\nD[i] = C[i]", outputs=["Z"])


def test_error_in_a_later_line_shows_that_line():
    msg = check_error("# comment\nC[i] = A[i]\n\n  D[i] = C[i] + foo(A[i])\n")
    assert location(msg) == (4, 17)
    assert "4 |   D[i] = C[i] + foo(A[i])" in msg
    assert pointed(msg) == "foo"


# ---------------------------------------------------------------- call time
MATMUL = "C[i, j] = A[i, k] * B[k, j]"


def test_unexpected_keyword_input():
    msg = bind_error(MATMUL, A=torch.randn(2, 3), B=torch.randn(3, 4), X=torch.randn(2))
    assert msg == "input error: unexpected input 'X' (the program's inputs are: A, B)"


def test_unexpected_keyword_input_suggests_a_name():
    msg = bind_error(MATMUL, A=torch.randn(2, 3), b=torch.randn(3, 4))
    assert "unexpected input 'b'; did you mean 'B'?" in msg


def test_missing_keyword_input():
    msg = bind_error(MATMUL, A=torch.randn(2, 3))
    assert msg.startswith("input error: missing input 'B'")
    assert location(msg) == (1, 21)
    assert pointed(msg) == "B[k, j]"


def test_index_with_two_extents():
    msg = bind_error(MATMUL, A=torch.randn(2, 3), B=torch.randn(5, 4))
    assert "index 'k' has extent 3 in A (dimension 1) but 5 in B (dimension 0)" in msg
    assert pointed(msg) == "B[k, j]"


def test_index_with_two_extents_across_statements():
    msg = bind_error("C[i] = A[i] * 2\nD[i] = C[i] + E[i]", A=torch.randn(3), E=torch.randn(4))
    assert "index 'i' has extent 3 in A (dimension 0) but 4 in E (dimension 0)" in msg
    assert location(msg) == (2, 15)


def test_indices_linked_through_a_statement_result():
    msg = bind_error("C[i] = A[i] * 2\nD[j] = C[j] * E[j]", A=torch.randn(3), E=torch.randn(4))
    assert "indices 'i' and 'j'" in msg and "extent 3 in A (dimension 0) but 4 in E (dimension 0)" in msg


def test_non_square_diagonal():
    msg = bind_error("d[i] = S[i, i]", S=torch.randn(3, 4))
    assert "index 'i' has extent 3 in S (dimension 0) but 4 in S (dimension 1)" in msg


def test_wrong_rank_of_an_input():
    msg = bind_error(MATMUL, A=torch.randn(2, 3, 1), B=torch.randn(3, 4))
    assert "input 'A' has 3 dimensions but the program reads it with 2 indices" in msg
    assert pointed(msg) == "A[i, k]"


def test_tensor_for_a_scalar_parameter():
    msg = bind_error("C[i] = A[i] * s", A=torch.randn(3), s=torch.randn(3))
    assert "input 's' has 1 dimension but the program reads it with 0 indices" in msg
    assert pointed(msg) == "s"


def test_number_for_a_tensor():
    msg = bind_error("C[i] = A[i] * s", A=2.0, s=1.0)
    assert "input 'A' is a number but the program reads it with 1 indices; pass a tensor" in msg


@pytest.mark.parametrize("dtype", [torch.complex64, torch.float8_e5m2])
def test_unsupported_dtype(dtype):
    msg = bind_error(MATMUL, A=torch.zeros(2, 3, dtype=dtype), B=torch.randn(3, 4))
    assert (f"input 'A' has dtype {dtype}; einfold takes float16, bfloat16, float32, float64, integer "
            f"(int8, int16, int32, int64, uint8) or bool tensors") in msg
    assert pointed(msg) == "A[i, k]"


@pytest.mark.parametrize("value", [True, "1.0", [1.0, 2.0], None])
def test_input_of_the_wrong_kind(value):
    msg = bind_error("C[i] = A[i] * s", A=torch.randn(3), s=value)
    assert f"input 's' must be a torch tensor or a number, not {type(value).__name__}" in msg
