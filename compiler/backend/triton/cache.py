"""The module cache: generated source is written to a file named by a hash of
everything it depends on, and run from the source einfold generated -- never
from what a cache folder holds.

Trust.  The cache folder may be shared (EINFOLD_CACHE_DIR), so nothing read from
it is trusted.  `load` compiles the source text it was given (in memory) with
`compile(source, path, "exec")` and executes it in a fresh module: no import
machinery runs, so no `__pycache__/*.pyc` is read or written.  The file is
there for Triton, which reads kernel source through `inspect` (linecache): it is
checked byte for byte against the source before use and rewritten on any
difference (other bytes, a folder in its place, a truncated write), and
linecache is primed with the verified text under that path (an entry linecache
never revalidates against the disk), so a file swapped after the check is not
what Triton compiles either.

Writes are atomic (temporary file + os.replace), so processes compiling the
same module at once are safe; an existing file with the right bytes is reused.
Within a process, loads (write, run) take one lock, so threads are safe too.

The folder.  EINFOLD_CACHE_DIR is created if missing; if it is set but cannot be
used (a file, no permission), that is a BackendError naming it.  The default
folder (~/.cache/einfold) falls back to a private temporary folder, with one
warning, when it cannot be used (a read-only home)."""
from __future__ import annotations

import hashlib
import linecache
import os
import sys
import tempfile
import threading
import warnings
from contextlib import contextmanager
from pathlib import Path
from types import ModuleType

import triton

from ...errors import BackendError
from ...version import __version__

CACHE_ENV = "EINFOLD_CACHE_DIR"

_fallback: Path | None = None
_fallback_lock = threading.Lock()


def cache_dir() -> Path:
    """EINFOLD_CACHE_DIR (created if missing), or ~/.cache/einfold (or, if that
    cannot be used, a private temporary folder for this process)."""
    configured = os.environ.get(CACHE_ENV)
    if configured:
        path = Path(configured).expanduser()
        problem = _unusable(path)
        if problem:
            raise BackendError(f"{CACHE_ENV}={configured!r} cannot hold einfold's generated modules: "
                               f"{problem}; point it at a writable folder (or unset it)")
        return path
    path = Path.home() / ".cache" / "einfold"
    problem = _unusable(path)
    return path if not problem else _private_folder(path, problem)


def _unusable(path: Path) -> str | None:
    """Why `path` cannot be the cache folder (None: it can; created if missing)."""
    try:
        path.mkdir(parents=True, exist_ok=True)
    except FileExistsError:
        return "it is a file, not a folder"
    except OSError as e:
        return f"it cannot be created ({e.strerror or e})"
    if not path.is_dir():
        return "it is not a folder"
    if not os.access(path, os.W_OK | os.X_OK):
        return "it is not writable"
    return None


def _private_folder(default: Path, problem: str) -> Path:
    global _fallback
    with _fallback_lock:
        if _fallback is None or not _fallback.is_dir():
            _fallback = Path(tempfile.mkdtemp(prefix="einfold-cache-"))
            warnings.warn(f"einfold: the module cache {default} cannot be used ({problem}); using "
                          f"{_fallback} for this process (set {CACHE_ENV} to choose a folder)",
                          RuntimeWarning, stacklevel=2)
        return _fallback


def safe_source(source: str) -> str:
    """`source` with the characters a Python source file cannot hold (NUL, lone
    surrogates) written as escapes: the same value inside a string literal, harmless
    text in a comment (where program text copied into the module header puts them)."""
    if "\0" in source:
        source = source.replace("\0", "\\x00")
    try:
        source.encode("utf-8")
    except UnicodeEncodeError:
        source = source.encode("utf-8", "backslashreplace").decode("utf-8")
    return source


def module_digest(source: str, key: str) -> str:
    """The digest that names the module of `source` (its cache file and module name):
    its identity, which tuning records key on (records.py)."""
    return digest(safe_source(source), key)


def digest(source: str, key: str) -> str:
    h = hashlib.sha256()
    for part in (source, key, triton.__version__, __version__):
        h.update(part.encode("utf-8", "backslashreplace"))
        h.update(b"\0")
    return h.hexdigest()[:24]


def _holds(path: Path, data: bytes) -> bool:
    """Whether `path` is a regular file holding exactly `data` (never raises)."""
    try:
        if not path.is_file() or path.stat().st_size != len(data):
            return False
        with open(path, "rb") as f:
            return f.read(len(data) + 1) == data
    except OSError:
        return False


def write(source: str, key: str) -> Path:
    """The cache file holding exactly `source` (written atomically if missing or
    different; a path that cannot be replaced, e.g. a folder, leaves the module in
    a private file of the same folder instead)."""
    source = safe_source(source)
    name = f"einfold_{module_digest(source, key)}"
    folder = cache_dir()
    path = folder / f"{name}.py"
    data = source.encode("utf-8")
    if _holds(path, data):
        return path
    try:
        fd, tmp = tempfile.mkstemp(prefix=f".{name}.", suffix=".tmp", dir=folder)
    except OSError as e:
        raise BackendError(f"cannot write a generated module into the cache folder {folder} "
                           f"({e.strerror or e}); set {CACHE_ENV} to a writable folder") from None
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
        try:
            os.replace(tmp, path)
        except OSError:
            # something that is no file of ours holds the name (a folder): keep the
            # module under the temporary name, which only this write created
            kept = folder / f"{name}.{Path(tmp).name.rsplit('.', 2)[-2]}.py"
            os.replace(tmp, kept)
            return kept
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise
    return path


@contextmanager
def _interpreter(on: bool):
    """Triton picks the interpreter when a @triton.jit function is created."""
    before = os.environ.get("TRITON_INTERPRET")
    if on:
        os.environ["TRITON_INTERPRET"] = "1"
    try:
        yield
    finally:
        if before is None:
            os.environ.pop("TRITON_INTERPRET", None)
        else:
            os.environ["TRITON_INTERPRET"] = before


# Loads run one at a time: a module is in sys.modules (where Triton looks its kernels'
# source up) from before it runs, and TRITON_INTERPRET is set around it; under the lock
# a module found there has run to the end.
_loading = threading.Lock()


def load(source: str, key: str, interpret: bool) -> ModuleType:
    """Write (once) and run the module from `source` itself; interpreted and
    compiled instances of one source are separate modules.  Safe from several threads."""
    source = safe_source(source)
    name = f"einfold_{module_digest(source, key)}" + ("_interpreted" if interpret else "")
    with _loading:
        # run before by this process: no file system work
        return sys.modules.get(name) or _run(source, key, name, interpret)


def _run(source: str, key: str, name: str, interpret: bool) -> ModuleType:
    """Write `source` to the cache and run it as the module `name`."""
    path = str(write(source, key))
    code = compile(source, path, "exec", dont_inherit=True)
    # What inspect (and so Triton) reads for this path: the verified text, in an
    # entry that linecache.checkcache never drops (mtime None).
    linecache.cache[path] = (len(source), None, source.splitlines(True), path)
    module = ModuleType(name)
    module.__file__ = path
    sys.modules[name] = module
    try:
        with _interpreter(interpret):
            exec(code, module.__dict__)
    except BaseException:
        sys.modules.pop(name, None)
        raise
    return module
