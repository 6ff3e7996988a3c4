"""Text -> syntax tree.  The tree keeps a span for every construct so that later
stages can point at the source; it resolves nothing (that is check.py's job)."""
from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path

import lark
from lark import Lark, Transformer_NonRecursive

from . import config
from .errors import LimitError, ParseError, Span
from .ops import INFIX


# ---------------------------------------------------------------- syntax tree
@dataclass(frozen=True, slots=True)
class Number:
    text: str
    span: Span


@dataclass(frozen=True, slots=True)
class Name:
    name: str
    span: Span


@dataclass(frozen=True, slots=True)
class Access:
    """`A[i, k]`: a tensor read."""

    name: str
    subscripts: tuple
    name_span: Span
    span: Span


@dataclass(frozen=True, slots=True)
class Call:
    """`exp(x)`, `max(a, b)`, `len(k)`, `where(c, a, b)`."""

    name: str
    args: tuple
    name_span: Span
    span: Span


@dataclass(frozen=True, slots=True)
class Reduction:
    """`sum[k](e)`, `softmax[m](e)`, `user_summary[t](a, b)`."""

    name: str
    indices: tuple
    args: tuple
    name_span: Span
    span: Span


@dataclass(frozen=True, slots=True)
class Operator:
    """Infix or prefix operator; `op` is the IR op name (see ops.OPS)."""

    op: str
    operands: tuple
    span: Span


@dataclass(frozen=True, slots=True)
class Statement:
    name: str
    indices: tuple[Name, ...]
    expr: object
    name_span: Span
    span: Span


@dataclass(frozen=True, slots=True)
class Syntax:
    statements: tuple[Statement, ...]
    source: str


# ---------------------------------------------------------------- parser
class _BracketNewlines:
    """Post-lexer: a newline inside brackets continues the expression."""

    always_accept = ("_SEP",)
    _open = {"LPAR", "LSQB"}
    _close = {"RPAR", "RSQB"}

    def process(self, stream):
        depth = 0
        for token in stream:
            if token.type in self._open:
                depth += 1
            elif token.type in self._close:
                depth = max(0, depth - 1)
            elif token.type == "_SEP" and depth > 0:
                if token.value == ";":
                    yield token  # a `;` inside brackets is an error the parser reports
                continue
            yield token


@lru_cache(maxsize=1)
def _parser() -> Lark:
    grammar = (Path(__file__).parent / "grammar.lark").read_text()
    return Lark(grammar, parser="lalr", propagate_positions=True,
                postlex=_BracketNewlines(), maybe_placeholders=True)


def _span(meta) -> Span:
    return Span(meta.start_pos, meta.end_pos)


def _token_span(token) -> Span:
    return Span(token.start_pos, token.end_pos)


class _ToSyntax(Transformer_NonRecursive):
    """Tree -> syntax, bottom up without recursion (any nesting).  Each rule method
    takes (meta, children); unlike lark's v_args(meta=True), the dispatch below
    builds no wrapper per node (a third of the parse time on long programs)."""

    def __init__(self, source: str):
        super().__init__()
        self.source = source

    def _call_userfunc(self, tree, new_children=None):
        children = new_children if new_children is not None else tree.children
        method = getattr(self, tree.data, None)
        if method is None:
            return self.__default__(tree.data, children, tree.meta)
        return method(tree.meta, children)

    def start(self, meta, children):
        return Syntax(tuple(children), self.source)

    def assign(self, meta, children):
        name, names, expr = children
        return Statement(str(name), tuple(names or ()), expr, _token_span(name), _span(meta))

    def assign_scalar(self, meta, children):
        name, expr = children
        return Statement(str(name), (), expr, _token_span(name), _span(meta))

    def names(self, meta, children):
        return [Name(str(t), _token_span(t)) for t in children]

    def args(self, meta, children):
        return tuple(children)

    def number(self, meta, children):
        return Number(str(children[0]), _span(meta))

    def name(self, meta, children):
        return Name(str(children[0]), _span(meta))

    def access(self, meta, children):
        name, subscripts = children
        return Access(str(name), subscripts or (), _token_span(name), _span(meta))

    def call(self, meta, children):
        name, args = children
        return Call(str(name), args or (), _token_span(name), _span(meta))

    def reduction(self, meta, children):
        name, indices, args = children
        return Reduction(str(name), indices or (), args or (), _token_span(name), _span(meta))

    def compare(self, meta, children):
        left, symbol, right = children
        return Operator(INFIX[str(symbol)].name, (left, right), _span(meta))

    def __default__(self, data, children, meta):
        # Every remaining rule is an operator aliased by its IR op name (grammar.lark).
        return Operator(str(data).rstrip("_"), tuple(children), _span(meta))


_TERMINAL_WORDS = {"NAME": "a name", "NUMBER": "a number", "COMPARE": "a comparison",
                   "_SEP": "a new statement", "$END": "end of input"}


def _describe(terminals) -> str:
    parser = _parser()
    words = []
    for name in sorted(terminals):
        if name in _TERMINAL_WORDS:
            words.append(_TERMINAL_WORDS[name])
            continue
        try:
            pattern = parser.get_terminal(name).pattern
        except KeyError:
            continue
        words.append(f"'{pattern.value}'" if pattern.type == "str" else name.lower())
    return ", ".join(dict.fromkeys(words))


def parse(source: str) -> Syntax:
    """Parse program text; raise ParseError with a caret on bad input, LimitError
    past the size limits of compiler/config.py.  Iterative: any nesting parses."""
    if not isinstance(source, str):
        hint = "; decode it first, e.g. source.decode()" if isinstance(source, bytes | bytearray) else ""
        raise ParseError(f"a program is a str, not {type(source).__name__}{hint}")
    if len(source) > config.MAX_SOURCE_CHARS:
        raise LimitError(f"the program has {len(source):,} characters; the limit is "
                         f"{config.MAX_SOURCE_CHARS:,} (compiler.config.MAX_SOURCE_CHARS)",
                         source, Span(config.MAX_SOURCE_CHARS, config.MAX_SOURCE_CHARS + 1))
    try:
        tree = _parser().parse(source)
    except lark.exceptions.UnexpectedCharacters as e:
        raise ParseError(f"unexpected character {source[e.pos_in_stream]!r}", source,
                         Span(e.pos_in_stream, e.pos_in_stream + 1)) from None
    except lark.exceptions.UnexpectedToken as e:
        token = e.token
        if token.type == "$END":
            # lark places $END at the last token; point just past it (not at a trailing comment).
            at = token.end_pos if token.end_pos is not None else len(source.rstrip())
            raise ParseError(f"unexpected end of input; expected {_describe(e.expected)}",
                             source, Span(at, at + 1)) from None
        shown = "end of line" if token.type == "_SEP" and token.value != ";" else repr(str(token))
        raise ParseError(f"unexpected {shown}; expected {_describe(e.expected)}", source,
                         Span(token.start_pos, max(token.end_pos, token.start_pos + 1))) from None
    except lark.exceptions.UnexpectedEOF as e:
        at = len(source.rstrip())
        raise ParseError(f"unexpected end of input; expected {_describe(e.expected)}",
                         source, Span(max(0, at - 1), max(1, at))) from None
    syntax = _ToSyntax(source).transform(tree)
    _check_limits(syntax)
    return syntax


def depth(node) -> int:
    """Nesting depth of a syntax expression (an atom is 1), computed without recursion."""
    deepest, stack = 0, [(node, 1)]
    while stack:
        node, d = stack.pop()
        deepest = max(deepest, d)
        stack.extend((c, d + 1) for c in _children(node))
    return deepest


def _children(node) -> tuple:
    if isinstance(node, Operator):
        return node.operands
    if isinstance(node, Call | Reduction):
        return node.args
    return ()


def deepest_statement(syntax: Syntax) -> Statement | None:
    """The statement with the most deeply nested expression (first of equals)."""
    best, best_depth = None, 0
    for st in syntax.statements:
        d = depth(st.expr)
        if d > best_depth:
            best, best_depth = st, d
    return best


def _check_limits(syntax: Syntax) -> None:
    statements = syntax.statements
    if len(statements) > config.MAX_STATEMENTS:
        raise LimitError(f"the program has {len(statements):,} statements; the limit is "
                         f"{config.MAX_STATEMENTS:,} (compiler.config.MAX_STATEMENTS)",
                         syntax.source, statements[config.MAX_STATEMENTS].name_span)
    for st in statements:
        stack = [(st.expr, 1)]
        while stack:
            node, d = stack.pop()
            if d > config.MAX_DEPTH:
                raise LimitError(f"this expression is nested more than {config.MAX_DEPTH:,} levels "
                                 f"deep (compiler.config.MAX_DEPTH; a sum of n terms is n levels); "
                                 f"split it into statements", syntax.source, node.span)
            stack.extend((c, d + 1) for c in _children(node))
