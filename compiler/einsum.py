"""numpy-style einsum strings as sugar over the index-notation language."""
from __future__ import annotations

from collections import Counter
from functools import lru_cache

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

from .errors import CheckError


def einsum_source(equation: str, ranks: tuple[int, ...]) -> str:
    """Translate an einsum equation for operands of the given ranks into a program
    `out[...] = t0[...] * t1[...] * ...`; numpy's implicit-output rule and `...`."""
    eq = equation.replace(" ", "")
    if eq.count("->") > 1:
        raise CheckError(f"einsum '{equation}' has more than one '->'")
    if "->" in eq:
        lhs, out = eq.split("->")
        explicit = True
    else:
        lhs, out, explicit = eq, "", False
    terms = lhs.split(",")
    if len(terms) != len(ranks):
        raise CheckError(f"einsum '{equation}' names {_count(len(terms), 'operand')} but "
                         f"{len(ranks)} {'was' if len(ranks) == 1 else 'were'} given")
    ellipsis_rank = 0
    for term, rank in zip(terms, ranks):
        letters = term.replace("...", "")
        if not _well_formed(term):
            raise CheckError(f"einsum term '{term}' must be letters with at most one '...'")
        if "..." in term:
            ellipsis_rank = max(ellipsis_rank, rank - len(letters))
            if rank < len(letters):
                raise CheckError(f"einsum term '{term}' needs at least {_count(len(letters), 'dimension')}, "
                                 f"the operand has {rank}")
        elif len(letters) != rank:
            raise CheckError(f"einsum term '{term}' has {_count(len(letters), 'index')} but the operand "
                             f"has rank {rank}")
    # Ellipsis dimensions align from the right, as numpy's broadcasting does.
    ell = [f"ell{k}" for k in range(ellipsis_rank)]

    def expand(term: str, rank: int) -> list[str]:
        if "..." not in term:
            return list(term)
        head, tail = term.split("...")
        n = rank - len(head) - len(tail)
        return list(head) + ell[ellipsis_rank - n:] + list(tail)

    operands = [expand(t, r) for t, r in zip(terms, ranks)]
    if explicit:
        if not _well_formed(out):
            raise CheckError(f"einsum output '{out}' must be letters with at most one '...'")
        repeated = [c for c, n in Counter(out.replace("...", "")).items() if n > 1]
        if repeated:
            raise CheckError(f"einsum output '{out}' repeats index '{repeated[0]}'")
        result = expand(out, len(out.replace("...", "")) + ellipsis_rank) if "..." in out else list(out)
    else:
        counts = Counter(c for t in terms for c in t.replace("...", ""))
        result = ell + sorted(c for c, n in counts.items() if n == 1)
    used = {i for op in operands for i in op}
    for i in result:
        if i not in used:
            raise CheckError(f"einsum output index '{i}' does not appear in any operand")
    body = " * ".join(f"t{k}[{', '.join(op)}]" if op else f"t{k}" for k, op in enumerate(operands))
    return f"out[{', '.join(result)}] = {body}"


def _well_formed(term: str) -> bool:
    """ASCII letters (the language's index names) with at most one '...'."""
    letters = term.replace("...", "", 1)
    return all(c.isascii() and c.isalpha() for c in letters)


def _count(n: int, noun: str) -> str:
    plural = {"index": "indices"}.get(noun, noun + "s")
    return f"{n} {noun if n == 1 else plural}"


@lru_cache(maxsize=256)
def _compiled(equation: str, ranks: tuple[int, ...], backend: str):
    from .program import compile
    return compile(einsum_source(equation, ranks), backend=backend)


def einsum(equation: str, *operands: torch.Tensor, backend: str = "auto") -> torch.Tensor:
    """numpy-style einsum: `compiler.einsum("bik,bkj->bij", x, y)`.

    The equation becomes the program `out[...] = t0[...] * t1[...] * ...`,
    compiled once per equation, operand ranks and backend.

    Args:
        equation: ASCII letters, one term per operand separated by `,`, at most
            one `->` and one `...` (the leading dimensions, aligned from the
            right). Without `->` the output is `...` followed by the letters
            that occur once, in alphabetical order.
        *operands: the tensors (or numbers, for empty terms), one per term.
        backend: as for `compile`.

    Returns:
        The result tensor.

    Raises:
        CheckError: a malformed equation, or one that does not fit the
            operands' ranks.
        BindError: operands whose extents disagree.
    """
    import torch
    ranks = tuple(t.dim() if isinstance(t, torch.Tensor) else 0 for t in operands)
    program = _compiled(equation, ranks, backend)
    return program(**{f"t{k}": t for k, t in enumerate(operands)})
