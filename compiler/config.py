"""Environment knobs and resource limits, in one place.

Environment variables read by einfold:

    EINFOLD_CACHE_DIR   the folder of generated Triton modules (backend/triton/cache.py);
                        default ~/.cache/einfold
    EINFOLD_STACK_MB    the stack of the worker thread that runs deep programs (below);
                        default 256
    EINFOLD_CHECK_POSITIONS  1: every call tests that the positions its gathered subscripts
                        read (`T[i]` of `E[T[i], d]`) lie inside their dimensions, a
                        BindError where one does not (a device sync per gather); unset
                        or 0: a position outside reads 0, as docs/language.md says

Deep programs.  Parsing is iterative, but checking, the passes, the backends'
analysis and the oracle walk expressions recursively, and CPython's default
recursion limit (1000) stops them at a few hundred levels of nesting (a sum of
500 terms is 500 levels deep: `+` is left-associative).  `deep(fn, ...)` first
calls `fn` as is; only if that raises RecursionError does it run `fn` again in a
worker thread with a large stack (EINFOLD_STACK_MB) and a recursion limit sized
to that stack (RECURSION_LIMIT), and restores the previous limit when the last
such thread ends.  The limit is process-wide in CPython, so it is raised only
while a deep program is being worked on.  If even that runs out, the caller gets
a LimitError that names the limit (never a RecursionError).  The sizes measured
are in docs/reliability.md.
"""
from __future__ import annotations

import os
import sys
import threading
from typing import Callable, TypeVar

from .errors import LimitError, Span

T = TypeVar("T")

CACHE_ENV = "EINFOLD_CACHE_DIR"
STACK_ENV = "EINFOLD_STACK_MB"
CHECK_POSITIONS_ENV = "EINFOLD_CHECK_POSITIONS"

# Hard limits, checked on the syntax tree before anything recursive runs
# (parse.check_limits); past them a program is a LimitError pointing at the source.
MAX_SOURCE_CHARS = 2_000_000        # program text
MAX_STATEMENTS = 10_000             # statements in one program
MAX_DEPTH = 20_000                  # nesting of one expression (a sum of n terms is n deep)
# checked on the IR (check.py): the fuse pass inlines every statement into its readers,
# so a chain of statements that each read the previous one twice doubles each time
MAX_FUSED_NODES = 200_000           # nodes of one statement with earlier statements inlined

DEFAULT_STACK_MB = 256
# Python frames allowed per MiB of worker stack (2 KiB each).  Measured on CPython
# 3.11: the passes and the oracle on expressions 19,000 deep ran on a 16 MiB stack,
# i.e. under 900 bytes of C stack per level of nesting, which costs 3 to 5 Python
# frames; 2 KiB per frame leaves a factor of about ten.  The default 256 MiB stack
# thus allows 131,072 frames: MAX_DEPTH (20,000) with room to spare.
LEVELS_PER_MB = 512


def check_positions() -> bool:
    """Whether calls test their gathered positions (EINFOLD_CHECK_POSITIONS)."""
    return os.environ.get(CHECK_POSITIONS_ENV, "0") not in ("", "0")


def stack_mb() -> int:
    text = os.environ.get(STACK_ENV, "")
    try:
        value = int(text) if text else DEFAULT_STACK_MB
    except ValueError:
        raise LimitError(f"{STACK_ENV}={text!r} is not a whole number of MiB") from None
    return max(16, min(value, 4096))


_lock = threading.Lock()
_active = 0                     # worker threads running now
_saved_limit: int | None = None  # the recursion limit before the first of them
_local = threading.local()


def in_deep_thread() -> bool:
    return getattr(_local, "deep", False)


def deep(fn: Callable[..., T], *args, what: str = "the program", source: str | None = None,
         span: Span | None = None, **kwargs) -> T:
    """`fn(*args, **kwargs)`, retried on a large stack if it recurses too deep for
    the default one; a LimitError naming `what` if it recurses too deep for that too."""
    if in_deep_thread():
        return fn(*args, **kwargs)
    try:
        return fn(*args, **kwargs)
    except RecursionError:
        pass
    return _in_worker(fn, args, kwargs, what, source, span)


def _in_worker(fn, args, kwargs, what, source, span):
    global _active, _saved_limit
    mb = stack_mb()
    outcome: dict[str, object] = {}

    def body():
        _local.deep = True
        try:
            outcome["value"] = fn(*args, **kwargs)
        except BaseException as e:      # handed to the calling thread below
            outcome["error"] = e

    with _lock:
        if _active == 0:
            _saved_limit = sys.getrecursionlimit()
        _active += 1
        sys.setrecursionlimit(max(_saved_limit, mb * LEVELS_PER_MB))
        previous = threading.stack_size()
        try:
            threading.stack_size(mb << 20)
            worker = threading.Thread(target=body, name="einfold-deep", daemon=True)
            started = True
            try:
                worker.start()
            except RuntimeError:        # the stack could not be allocated
                started = False
        finally:
            threading.stack_size(previous)
    try:
        if started:
            worker.join()
        else:
            outcome["error"] = RecursionError("no thread with a large stack could be started")
    finally:
        with _lock:
            _active -= 1
            if _active == 0 and _saved_limit is not None:
                sys.setrecursionlimit(_saved_limit)
                _saved_limit = None
    error = outcome.get("error")
    if isinstance(error, RecursionError):
        raise LimitError(f"{what} is nested too deeply to process even with a "
                         f"{mb} MiB stack ({mb * LEVELS_PER_MB} levels); split long expressions into "
                         f"statements or raise {STACK_ENV}", source, span) from None
    if error is not None:
        raise error
    return outcome["value"]  # type: ignore[return-value]
