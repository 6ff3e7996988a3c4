"""The checks of what a user hands the runtime: the arguments of compile() and
grad(), and the number inputs of a call (the float64 value each runs as, and
whether a kernel takes it as a positive factor).  Program (program.py), its gradient
(grad.py), its torch op (autograd.py) and the Triton backend all read them, so they
sit below all of those.
"""
from __future__ import annotations

from collections.abc import Iterable
from numbers import Real

from .algebra import Summary
from .errors import BindError, CheckError, EinfoldError, ParseError
from .ir import Program as IRProgram
from .ops import FLOAT

# summaries: user summaries usable by name; split: force a split count for every
# reduction (a schedule option: the Triton backend splits, the oracle has no schedule);
# float32_outputs: float outputs stored in float32 whatever the inputs' dtype (the
# saving forward's statistics: a bf16 logsumexp would be off by up to 1/256 of itself)
SCHEDULE_OPTIONS = ("split", "float32_outputs")
KNOWN_OPTIONS = ("summaries", *SCHEDULE_OPTIONS)


def check_options(options: dict) -> None:
    unknown = sorted(set(options) - set(KNOWN_OPTIONS))
    if unknown:
        raise EinfoldError(f"unknown option{'s' * (len(unknown) > 1)} {', '.join(unknown)}; "
                           f"known: {', '.join(KNOWN_OPTIONS)}")


def check_source(source) -> None:
    if not isinstance(source, str):
        hint = "; decode it first, e.g. source.decode()" if isinstance(source, bytes | bytearray) else ""
        raise ParseError(f"a program is a str, not {type(source).__name__}{hint}")


def checked_user_summaries(given) -> dict[str, Summary]:
    """summaries=: an iterable of compiler.summary(...) values (or one of them)."""
    if isinstance(given, Summary):
        given = (given,)
    elif isinstance(given, str | bytes) or not isinstance(given, Iterable):
        raise EinfoldError(f"summaries= takes a list of compiler.summary(...) values, "
                           f"not {type(given).__name__}")
    out: dict[str, Summary] = {}
    for s in given:
        checked = _checked_user_summary(s)
        if checked.name in out:
            raise EinfoldError(f"summaries= names '{checked.name}' twice")
        out[checked.name] = checked
    return out


def _checked_user_summary(s: Summary) -> Summary:
    """A summary given to compile(): no builtin's name, laws checked (never assumed)."""
    from .algebra import BUILTINS, COMPOSITES
    from .algebra.laws import require_laws
    from .ops import FUNCTIONS
    if not isinstance(s, Summary):
        raise EinfoldError(f"summaries= takes compiler.summary(...) values, not {type(s).__name__}")
    if s.name in BUILTINS or s.name in COMPOSITES or s.name in FUNCTIONS:
        raise EinfoldError(f"a user summary cannot take the builtin name '{s.name}'")
    return s if s.laws is not None else require_laws(s)


def checked_outputs(outputs) -> tuple[str, ...] | None:
    """outputs=: statement names (a list of them, or one name)."""
    if outputs is None:
        return None
    if isinstance(outputs, str):
        outputs = (outputs,)
    elif not isinstance(outputs, Iterable):
        raise CheckError(f"outputs= takes a list of statement names, not {type(outputs).__name__}")
    names = tuple(outputs)
    for name in names:
        if not isinstance(name, str):
            raise CheckError(f"outputs= takes statement names (str), not {type(name).__name__} {name!r}")
    return names or None


def checked_wrt(wrt, forward: IRProgram) -> tuple[str, ...]:
    """wrt=: input names (a list of them, or one name); None: every tensor input of
    numbers, not those read as conditions or as subscripts (bools and positions have no
    gradient)."""
    if wrt is None:
        names = tuple(i.name for i in forward.inputs if i.rank > 0 and i.dtype == FLOAT)
        if not names:
            raise CheckError("the program has no tensor input to differentiate with respect to; name the "
                             "0-d inputs to differentiate (wrt=, or --wrt on the command line)")
        return names
    if isinstance(wrt, str):
        return (wrt,)
    if not isinstance(wrt, Iterable):
        raise CheckError(f"wrt= takes a list of input names, not {type(wrt).__name__}")
    return tuple(wrt)


# The numbers a kernel may take as positive factors (Signature's sign class): the normal
# positive float32 values, which stay finite and > 0 in a kernel's float32 arithmetic.
# Program._key_of tests the range inline (a call's host time).
LEAST_POSITIVE, MOST_POSITIVE = 2.0 ** -126, 3.4028234663852886e38


def positive_number(value) -> bool:
    """Whether a number input runs as a positive factor (KernelEmitter.positive_factor)."""
    return type(value) is float and LEAST_POSITIVE <= value <= MOST_POSITIVE


def number_input(program: IRProgram, name: str, value):
    """A scalar input as the float64 value it runs as; anything else is left to the
    binder, which names what is wrong with it."""
    if isinstance(value, Real) and not isinstance(value, bool):
        try:
            return float(value)
        except (OverflowError, ValueError, TypeError):
            decl = next((i for i in program.inputs if i.name == name), None)
            shown = repr(value) if len(repr(value)) <= 40 else repr(value)[:37] + "..."
            raise BindError(f"input '{name}' = {shown} does not fit in a float64 (at most about 1.8e308)",
                            program.source, decl.span if decl is not None else None) from None
    return value
