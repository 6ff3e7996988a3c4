"""compiler.einsum: numpy-style equations as sugar over the language, against torch.einsum."""
import pytest
import torch

import compiler
from compiler import CheckError
from compiler.einsum import einsum_source

torch.manual_seed(0)


def r(*shape):
    return torch.randn(*shape, dtype=torch.float64)


CASES = [
    ("ij,jk->ik", [(3, 4), (4, 5)]),          # matmul
    ("ij,jk", [(3, 4), (4, 5)]),              # implicit output
    ("bik,bkj->bij", [(2, 3, 4), (2, 4, 5)]),  # batch matmul
    ("ii", [(4, 4)]),                          # trace (implicit output is empty)
    ("ii->i", [(4, 4)]),                       # diagonal
    ("i,j->ij", [(3,), (5,)]),                 # outer product
    ("i,j", [(3,), (5,)]),                     # outer product, implicit output
    ("ij->ji", [(3, 4)]),                      # transpose
    ("ba", [(3, 4)]),                          # implicit output is sorted: a transpose
    ("ij->", [(3, 4)]),                        # sum of everything
    ("i,i->", [(6,), (6,)]),                   # dot product
    ("i,i", [(6,), (6,)]),                     # dot product, implicit output
    ("bhqd,bhkd->bhqk", [(2, 3, 4, 5), (2, 3, 6, 5)]),
    ("...ij,...jk->...ik", [(2, 3, 4), (2, 4, 5)]),
    ("...ij,...jk", [(2, 3, 4, 5), (2, 3, 5, 2)]),
    ("...ij,jk->...ik", [(2, 3, 4), (4, 5)]),   # ellipsis in one operand only
    ("i...->...", [(3, 2, 4)]),
    ("ij,jk,kl->il", [(2, 3), (3, 4), (4, 5)]),  # chain of three
    ("iij->j", [(3, 3, 4)]),                     # diagonal summed, two labels on one operand
    ("Ab,bC->AC", [(2, 3), (3, 4)]),            # upper-case labels
]


@pytest.mark.parametrize("equation, shapes", CASES, ids=[c[0] for c in CASES])
def test_matches_torch_einsum(equation, shapes):
    operands = [r(*s) for s in shapes]
    got = compiler.einsum(equation, *operands, backend="reference")
    want = torch.einsum(equation, *operands)
    assert got.shape == want.shape
    torch.testing.assert_close(got, want)


def test_float32_operands_give_float32():
    a, b = torch.randn(3, 4), torch.randn(4, 2)
    got = compiler.einsum("ij,jk->ik", a, b)
    assert got.dtype == torch.float32
    torch.testing.assert_close(got, a @ b, rtol=1e-5, atol=1e-5)


def test_spaces_are_ignored():
    a, b = r(3, 4), r(4, 2)
    torch.testing.assert_close(compiler.einsum(" ij , jk -> ik ", a, b), a @ b)


def test_source_is_the_language():
    assert einsum_source("bik,bkj->bij", (3, 3)) == "out[b, i, j] = t0[b, i, k] * t1[b, k, j]"
    assert einsum_source("ii", (2,)) == "out[] = t0[i, i]"
    assert einsum_source("...ij,jk", (4, 2)) == "out[ell0, ell1, i, k] = t0[ell0, ell1, i, j] * t1[j, k]"


BAD = [
    ("ij,jk->ik", [(3, 4)], "einsum 'ij,jk->ik' names 2 operands but 1 was given"),
    ("ij->ik", [(3, 4)], "einsum output index 'k' does not appear in any operand"),
    ("ijk->i", [(3, 4)], "einsum term 'ijk' has 3 indices but the operand has rank 2"),
    ("i->i", [(3, 4)], "einsum term 'i' has 1 index but the operand has rank 2"),
    ("i1->i", [(3, 4)], "einsum term 'i1' must be letters with at most one '...'"),
    ("...i...->i", [(3, 4)], "einsum term '...i...' must be letters with at most one '...'"),
    ("ij->i->j", [(3, 4)], "einsum 'ij->i->j' has more than one '->'"),
    ("ij->ii", [(3, 4)], "einsum output 'ii' repeats index 'i'"),
    ("ij->i2", [(3, 4)], "einsum output 'i2' must be letters with at most one '...'"),
    ("ijk...->i", [(3, 4)], "einsum term 'ijk...' needs at least 3 dimensions, the operand has 2"),
]


@pytest.mark.parametrize("equation, shapes, message", BAD, ids=[b[0] for b in BAD])
def test_bad_equations(equation, shapes, message):
    with pytest.raises(CheckError) as excinfo:
        compiler.einsum(equation, *[r(*s) for s in shapes])
    assert str(excinfo.value) == f"error: {message}"


def test_operand_shapes_that_disagree():
    with pytest.raises(compiler.BindError, match="index 'j' has extent 4 in t0 .* but 5 in t1"):
        compiler.einsum("ij,jk->ik", r(3, 4), r(5, 2))


def test_ellipsis_dimensions_do_not_broadcast():
    # one extent per index name: the ellipsis dimensions must agree (torch would broadcast 1 to 5)
    with pytest.raises(compiler.BindError, match="index 'ell0' has extent 1 in t0 .* but 5 in t1"):
        compiler.einsum("...ij,...jk", r(1, 3, 4), r(5, 4, 2))
