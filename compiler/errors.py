"""One error hierarchy: every error carries the source and a span, and renders
the offending line with a caret under the construct it names."""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class Span:
    """A half-open character range [start, end) in the program source."""

    start: int
    end: int

    def line_col(self, source: str) -> tuple[int, int]:
        line = source.count("\n", 0, self.start) + 1
        column = self.start - (source.rfind("\n", 0, self.start) + 1) + 1
        return line, column


def render(source: str, span: Span) -> str:
    """Show the source line of `span` with carets under it (first line only)."""
    line_no, column = span.line_col(source)
    line_start = source.rfind("\n", 0, span.start) + 1
    line_end = source.find("\n", span.start)
    if line_end == -1:
        line_end = len(source)
    text = source[line_start:line_end].rstrip("\r")
    width = max(1, min(span.end, line_end) - span.start)
    gutter = str(line_no)
    pad = " " * len(gutter)
    # Keep the line's tabs in the indent so that the carets line up under the text.
    indent = "".join(c if c == "\t" else " " for c in text[:column - 1])
    return (
        f"{pad}--> line {line_no}, column {column}\n"
        f"{pad} |\n"
        f"{gutter} | {text}\n"
        f"{pad} | {indent}{'^' * width}"
    )


class Located:
    """A message that may point into the program's source: its line with carets
    under the span, after a heading (`kind`)."""

    kind = "error"

    def __init__(self, message: str, source: str | None = None, span: Span | None = None):
        self.message = message
        self.source = source
        self.span = span
        super().__init__(self.__str__())

    def __str__(self) -> str:
        head = f"{self.kind}: {self.message}"
        if self.source is None or self.span is None:
            return head
        return f"{head}\n{render(self.source, self.span)}"


class ImplicitSumWarning(Located, UserWarning):
    """The Einstein convention sums an index over several terms at once (it is
    free in sibling subexpressions of an operator other than a product): correct
    by the convention, rarely what was meant.  Renders like an error, with the
    offending line and a caret under the index."""

    kind = "einfold"


class EinfoldError(Located, Exception):
    """Base of every error einfold raises on purpose."""


class ParseError(EinfoldError):
    """The text is not a program of the language."""

    kind = "syntax error"


class CheckError(EinfoldError):
    """The program parses but means nothing (unknown names, bad indices...)."""

    kind = "error"


class BindError(EinfoldError):
    """The inputs given at call time do not fit the program."""

    kind = "input error"


class LawError(EinfoldError):
    """A summary breaks one of the monoid laws it claims."""

    kind = "law error"


class BackendError(EinfoldError):
    """A backend cannot run the program as asked."""

    kind = "backend error"


class TuningError(BackendError):
    """Tuning cannot be saved, loaded or done as asked: a tuning file that cannot be
    read or is not one (the message names the file and what is wrong), a shape to
    tune that does not fit the program, tuning without a CUDA GPU."""

    kind = "tuning error"


class ShardError(EinfoldError):
    """A program cannot be sharded across processes as asked."""

    kind = "shard error"


class LimitError(EinfoldError):
    """The program is too large or too deeply nested for einfold's limits
    (compiler/config.py: the limit is named in the message)."""

    kind = "limit error"


class TransformError(EinfoldError):
    """A torch transform or tracer that einfold does not support was applied to a
    program (forward-mode AD, TorchScript); the message names it."""

    kind = "unsupported transform"
