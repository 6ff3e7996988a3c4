"""Round trip of the canonical printed form, on generated programs.

Hypothesis builds random well-formed programs: expression trees over a few
inputs of given ranks with infix operators, functions, `where` on comparisons
and logic, reductions (composites included), Einstein implicit sums, index
values, scalars, and several statements that read earlier ones.  Parentheses
are dropped at random, so the parser's precedence decides the grouping.

Properties: print -> parse -> check -> print is a fixed point (same text, same
IR), and the printed form means what the original means (the float64 oracle
agrees on random inputs)."""
from __future__ import annotations

import re

import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from compiler import reference
from compiler.bind import bind
from compiler.check import check
from compiler.ir import format_program
from compiler.ops import FUNCTIONS
from compiler.parse import parse

INDICES = ("i", "j", "k", "m")
# Input tensors and the index whose extent each dimension has.
CATALOGUE = {"A": ("i", "k"), "B": ("k", "j"), "C": ("i", "j"), "K": ("m", "k"),
             "x": ("i",), "y": ("m",), "T": ("i", "k", "m"), "z": ()}
SCALARS = ("s", "t")
ONE_ARG = sorted(name for name, op in FUNCTIONS.items() if op.arity == 1)
REDUCTIONS = ("sum", "max", "min", "prod", "mean", "logsumexp", "softmax", "softmax")
INFIX = ("+", "-", "*", "/", "**", "**")
COMPARE = ("<", "<=", ">", ">=", "==", "!=")
FLOATS = ("0.5", "2.0", "1e-3", "1.5e3", "2.", ".25", "pi")


class _Node:
    """Generated text, whether it needs parentheses to be an operand, and the
    indices its value varies over."""

    def __init__(self, text: str, free: frozenset, compound: bool):
        self.text, self.free, self.compound = text, free, compound


class _Generator:
    def __init__(self, draw, extents: dict[str, int]):
        self.draw = draw
        self.extents = extents
        self.statements: list[tuple[str, tuple[str, ...]]] = []

    def choice(self, options):
        return self.draw(st.sampled_from(list(options)))

    def chance(self, p: float = 0.5) -> bool:
        # The simplest draw (0, which hypothesis favours) means "no".
        return self.draw(st.integers(0, 19)) >= round(20 * (1 - p))

    def operand(self, node: _Node) -> str:
        # Parenthesise compound operands at random; without parentheses the
        # parser's precedence regroups them, which is still a valid program.
        return f"({node.text})" if node.compound and self.chance(0.7) else node.text

    # -------------------------------------------------------------- leaves
    def indices_like(self, dims: tuple[str, ...]) -> tuple[str, ...]:
        """Index names for an access whose dimensions have these extents."""
        return tuple(self.choice([n for n in INDICES if self.extents[n] == self.extents[d]]) for d in dims)

    def access(self) -> _Node:
        if self.statements and self.chance(0.4):
            name, lhs = self.choice(self.statements)
        else:
            name = self.choice(sorted(CATALOGUE))
            lhs = CATALOGUE[name]
        indices = self.indices_like(lhs)
        text = f"{name}[{', '.join(indices)}]" if indices or self.chance() else name
        return _Node(text, frozenset(indices), False)

    def leaf(self) -> _Node:
        kind = self.choice(["access", "access", "access", "scalar", "int", "float", "index", "len"])
        if kind == "access":
            return self.access()
        if kind == "scalar":
            return _Node(self.choice(SCALARS), frozenset(), False)
        if kind == "int":
            return _Node(str(self.draw(st.integers(0, 3))), frozenset(), False)
        if kind == "float":
            return _Node(self.choice(FLOATS), frozenset(), False)
        ix = self.choice(INDICES)
        if kind == "len":
            return _Node(f"len({ix})", frozenset(), False)
        return _Node(ix, frozenset([ix]), False)

    # -------------------------------------------------------------- numbers
    def number(self, depth: int) -> _Node:
        if depth <= 0 or self.chance(0.15):
            return self.leaf()
        kind = self.choice(["infix", "infix", "neg", "function", "minmax", "where", "reduce", "reduce"])
        if kind == "infix":
            left, right = self.number(depth - 1), self.number(depth - 1)
            return _Node(f"{self.operand(left)} {self.choice(INFIX)} {self.operand(right)}",
                         left.free | right.free, True)
        if kind == "neg":
            arg = self.number(depth - 1)
            return _Node(f"-{self.operand(arg)}", arg.free, True)
        if kind == "function":
            arg = self.number(depth - 1)
            return _Node(f"{self.choice(ONE_ARG)}({arg.text})", arg.free, False)
        if kind == "minmax":
            a, b = self.number(depth - 1), self.number(depth - 1)
            return _Node(f"{self.choice(['max', 'min'])}({a.text}, {b.text})", a.free | b.free, False)
        if kind == "where":
            a, b = self.number(depth - 1), self.number(depth - 1)
            # An index only in the condition could be summed over the predicate: an error
            # (tests/test_errors.py), not a program.  Every condition index is in a branch.
            for _ in range(3):
                cond = self.predicate(depth - 1)
                if cond.free <= a.free | b.free:
                    break
            else:
                return a
            return _Node(f"where({cond.text}, {a.text}, {b.text})", cond.free | a.free | b.free, False)
        body = self.number(depth - 1)
        if not body.free:
            return body
        over = self.draw(st.lists(st.sampled_from(sorted(body.free)), min_size=1, max_size=2, unique=True))
        name = self.choice(REDUCTIONS)
        free = body.free if name == "softmax" else body.free - set(over)
        return _Node(f"{name}[{', '.join(over)}]({body.text})", frozenset(free), False)

    def predicate(self, depth: int) -> _Node:
        kind = self.choice(["compare", "compare", "not", "and", "or"]) if depth > 0 else "compare"
        if kind == "compare":
            a, b = self.number(depth - 1), self.number(depth - 1)
            return _Node(f"{self.operand(a)} {self.choice(COMPARE)} {self.operand(b)}", a.free | b.free, True)
        if kind == "not":
            arg = self.predicate(depth - 1)
            return _Node(f"not {self.operand(arg)}", arg.free, True)
        a, b = self.predicate(depth - 1), self.predicate(depth - 1)
        return _Node(f"{self.operand(a)} {kind} {self.operand(b)}", a.free | b.free, True)

    # -------------------------------------------------------------- statements
    def statement(self, name: str) -> str:
        expr = self.number(self.draw(st.integers(2, 4)))
        # Some free indices stay on the left; the others are summed (Einstein).
        lhs = tuple(self.draw(st.lists(st.sampled_from(sorted(expr.free)), unique=True))) if expr.free else ()
        self.statements.append((name, lhs))
        sep = self.choice(["", " "])
        return f"{name}[{(',' + sep).join(lhs)}] = {expr.text}"


@st.composite
def programs(draw):
    extents = {ix: draw(st.integers(2, 4)) for ix in INDICES}
    gen = _Generator(draw, extents)
    lines = [gen.statement(f"S{n}") for n in range(draw(st.integers(1, 3)))]
    # An index needs an input dimension to give it an extent (one extent per name,
    # program-wide); when an index value or len(...) names one no input access
    # does, a last statement reads inputs over every index.
    accessed = {ix for line in lines
                for subs in re.findall(r"\b(?:%s)\[([^\]]*)\]" % "|".join(CATALOGUE), line.split(" = ", 1)[1])
                for ix in re.findall(r"\w+", subs)}
    used = {ix for line in lines for ix in re.findall(r"\b(%s)\b" % "|".join(INDICES), line)}
    if used - accessed:
        lines.append(f"S{len(lines)}[i, j, k, m] = T[i, k, m] * C[i, j]")
    separator = draw(st.sampled_from(["\n", "; ", "  # note\n"]))
    return separator.join(lines) + "\n", extents


def random_inputs(program, extents: dict[str, int], seed: int) -> dict:
    generator = torch.Generator().manual_seed(seed)
    inputs = {}
    for decl in program.inputs:
        if decl.name in SCALARS:
            inputs[decl.name] = float(torch.rand((), generator=generator, dtype=torch.float64)) + 0.5
        else:
            shape = [extents[d] for d in CATALOGUE[decl.name]]
            inputs[decl.name] = torch.randn(shape, generator=generator, dtype=torch.float64)
    return inputs


def oracle(src: str, inputs: dict) -> dict:
    """Every statement's value by the float64 oracle (compiler/reference.py) on the
    checked program itself, so that a round-trip failure is the foundation's and
    not a later pass's."""
    program = check(parse(src))
    binding = bind(program, inputs)
    return reference.run(program, binding.values, binding.extents,
                         tuple(s.name for s in program.statements))


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(programs(), st.integers(0, 2 ** 16))
def test_print_parse_print_is_stable_and_keeps_the_meaning(case, seed):
    source, extents = case
    original = check(parse(source))
    printed = format_program(original)
    again = check(parse(printed))
    assert format_program(again) == printed
    assert again.statements == original.statements
    assert again.inputs == original.inputs and again.outputs == original.outputs

    inputs = random_inputs(original, extents, seed)
    want, got = oracle(source, inputs), oracle(printed, inputs)
    assert list(got) == list(want)
    for name in want:
        assert got[name].dtype == want[name].dtype and got[name].shape == want[name].shape
        torch.testing.assert_close(got[name], want[name], equal_nan=True, rtol=0, atol=0)


def test_generator_covers_the_language():
    """The strategy reaches every kind of construct (a sample of programs)."""
    seen = set()

    @settings(max_examples=150, deadline=None, database=None, derandomize=True)
    @given(programs())
    def collect(case):
        text = format_program(check(parse(case[0])))
        for word in ["sum[", "softmax[", "mean[", "logsumexp[", "where(", " and ", " or ", "not ", " ** ",
                     "len(", " < ", "max("]:
            if word in text:
                seen.add(word)
        if "S1" in text and "S0" in text.split("S1", 1)[1]:
            seen.add("reads earlier")

    collect()
    assert seen >= {"sum[", "softmax[", "where(", "len(", "max(", " ** ", "reads earlier"}
    assert seen & {" and ", " or ", "not "}
