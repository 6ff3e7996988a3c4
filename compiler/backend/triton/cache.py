"""The module cache: generated source is written to a file named by a hash of
everything it depends on and imported from there (Triton reads kernel source
from files).  Writes are atomic (temporary file + os.replace), so processes
compiling the same module at once are safe; an existing file is reused."""
from __future__ import annotations

import hashlib
import importlib.util
import os
import sys
import tempfile
from contextlib import contextmanager
from pathlib import Path
from types import ModuleType

import triton

CACHE_ENV = "EINFOLD_CACHE_DIR"


def cache_dir() -> Path:
    """EINFOLD_CACHE_DIR, or ~/.cache/einfold."""
    path = Path(os.environ.get(CACHE_ENV) or Path.home() / ".cache" / "einfold")
    path.mkdir(parents=True, exist_ok=True)
    return path


def digest(source: str, key: str) -> str:
    from ... import __version__
    h = hashlib.sha256()
    for part in (source, key, triton.__version__, __version__):
        h.update(part.encode())
        h.update(b"\0")
    return h.hexdigest()[:24]


def write(source: str, key: str) -> Path:
    name = f"einfold_{digest(source, key)}"
    folder = cache_dir()
    path = folder / f"{name}.py"
    if path.exists() and path.read_text() == source:
        return path
    fd, tmp = tempfile.mkstemp(prefix=f".{name}.", suffix=".tmp", dir=folder)
    try:
        with os.fdopen(fd, "w") as f:
            f.write(source)
        os.replace(tmp, path)
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


def load(source: str, key: str, interpret: bool) -> ModuleType:
    """Write (once) and import the module; interpreted and compiled instances of
    one source are separate modules."""
    name = f"einfold_{digest(source, key)}" + ("_interpreted" if interpret else "")
    if name in sys.modules:                     # imported before by this process: no file system work
        return sys.modules[name]
    path = write(source, key)
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    try:
        with _interpreter(interpret):
            spec.loader.exec_module(module)
    except BaseException:
        del sys.modules[name]
        raise
    return module
