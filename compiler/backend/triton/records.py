"""Tuning records: the autotuner's choices, kept so that they can ship.

A tuned kernel (tuning.py) is timed on its first launch of each shape class on
every machine, and Triton keeps the result in its own cache folder only.  A
record is one such choice, keyed by everything that decided it:

    the GPU model (torch.cuda.get_device_name), the generated module (the digest
    that names its cache file, cache.module_digest, which covers einfold's and
    Triton's versions), the kernel, its shape classes (the autotuner's key) and
    the dtypes of its tensor arguments
        -> the chosen candidate: its constexprs, num_warps, num_stages, maxnreg

launch.DirectLaunch asks `choice` at a tuned kernel's first launch of a guard: a
record of its key whose config is still one of the kernel's candidates is
launched as it is (that candidate alone compiled, none timed); otherwise the
autotuner tunes.  Either way `note` keeps the choice launched: the choices a
process used, tuned here or taken from a record, are what `save_tuning` writes.

The file (save_tuning, load_tuning; EINFOLD_TUNING names files separated by
os.pathsep, loaded at the first tuned launch) is JSON, one record a line:

    {
      "format": "einfold tuning",
      "version": 1,
      "records": [
        {"gpu": "NVIDIA H100 80GB HBM3", "module": "<digest>", "kernel": "einfold_C",
         "classes": {"class_i": 13, ...}, "dtypes": ["bfloat16", ...],
         "config": {"constexprs": {"BLOCK_i": 128, ...}, "num_warps": 8, "num_stages": 3, "maxnreg": null}}
      ]
    }

It is untrusted input: anything else is a TuningError naming the file and the
first thing wrong.  Records of other GPU models are kept (saving merges into
the file) and never match here.  Nothing here imports torch or Triton."""
from __future__ import annotations

import json
import os
import tempfile
import threading
from dataclasses import astuple, dataclass
from pathlib import Path

from ...errors import TuningError

TUNING_ENV = "EINFOLD_TUNING"
FORMAT = "einfold tuning"
VERSION = 1


@dataclass(frozen=True)
class TuningKey:
    """What decided a tuned kernel's choice."""

    gpu: str                                # torch.cuda.get_device_name
    module: str                             # the generated module's digest
    kernel: str
    classes: tuple[tuple[str, int], ...]    # (autotune key argument, its value), in the kernel's key order
    dtypes: tuple[str, ...]                 # of the tensor arguments, in order ("bfloat16")


@dataclass(frozen=True)
class TunedConfig:
    """A candidate as a record holds it: a triton.Config's fields that einfold's
    candidates set (tuning.decorator)."""

    constexprs: tuple[tuple[str, int], ...]     # sorted by name
    num_warps: int
    num_stages: int
    maxnreg: int | None

    @classmethod
    def of(cls, config) -> TunedConfig:
        """The record of a triton.Config."""
        return cls(tuple(sorted(config.kwargs.items())), config.num_warps, config.num_stages, config.maxnreg)


def candidate(configs, tuned: TunedConfig):
    """The candidate of `configs` (triton.Configs) that `tuned` records, or None where
    none is (the kernel's candidates changed since it was recorded): then it is tuned."""
    return next((config for config in configs if TunedConfig.of(config) == tuned), None)


# ---------------------------------------------------------------- the table of this process
_lock = threading.Lock()
_loaded: dict[TuningKey, TunedConfig] = {}      # read from files
_used: dict[TuningKey, TunedConfig] = {}        # the choices this process launched: what save_tuning writes
_environment_read = False


def choice(key: TuningKey, configs):
    """The candidate of `configs` to launch for `key` without tuning (a choice this
    process made or loaded for it), or None: tune.  EINFOLD_TUNING's files are
    read at the first call."""
    _read_environment()
    with _lock:
        tuned = _used.get(key) or _loaded.get(key)
    return candidate(configs, tuned) if tuned is not None else None


def note(key: TuningKey, config) -> None:
    """Keep the choice (a triton.Config) launched for `key`: tuned, or a record's."""
    with _lock:
        _used[key] = TunedConfig.of(config)


def environment_paths() -> list[str]:
    """The files EINFOLD_TUNING names (empty entries skipped)."""
    return [path for path in os.environ.get(TUNING_ENV, "").split(os.pathsep) if path]


def _read_environment() -> None:
    """Load EINFOLD_TUNING's files, once per process (again after a failure, which
    raised: a file the user named must be readable)."""
    global _environment_read
    if _environment_read:
        return
    read = {}
    for path in environment_paths():
        read.update(read_records(path))
    with _lock:
        _loaded.update(read)
    _environment_read = True


# ---------------------------------------------------------------- the public API
def load_tuning(path: str | os.PathLike) -> int:
    """Read the tuning records of a file that `save_tuning` or `einfold tune` wrote
    into this process, and return how many it holds.  A tuned kernel whose first
    launch matches a record (the same GPU model, generated module, kernel, shape
    classes and dtypes) runs the recorded choice: only that candidate is compiled
    and none is timed.  Records of other GPU models are ignored; a record of the
    same key read later replaces an earlier one, and a choice this process already
    launched for a key stays.  The files that the environment
    variable `EINFOLD_TUNING` names (separated by `os.pathsep`) are loaded this way
    at the first tuned launch.  A file that cannot be read or is not a tuning file
    is a `TuningError` naming it."""
    read = read_records(path)
    with _lock:
        _loaded.update(read)
    return len(read)


def save_tuning(path: str | os.PathLike) -> int:
    """Write the tuning choices this process used (each tuned kernel's first launch
    of a shape class: timed here, or taken from a loaded record) into `path`, a JSON
    file to commit beside the code, and return how many it wrote.  The records the
    file held already are kept, unless one of this process has their key; so one
    file can gather the choices of several GPU models.  A file that cannot be read
    or written is a `TuningError` naming it."""
    kept = read_records(path) if Path(path).exists() else {}
    with _lock:
        used = dict(_used)
    _write(Path(path), {**kept, **used})
    return len(used)


# ---------------------------------------------------------------- the file
def _write(path: Path, records: dict[TuningKey, TunedConfig]) -> None:
    """Write `records` in the file format, sorted (a stable diff), atomically."""
    ordered = sorted(records.items(), key=lambda item: astuple(item[0]))
    lines = [json.dumps(_as_json(key, tuned)) for key, tuned in ordered]
    body = "[\n    " + ",\n    ".join(lines) + "\n  ]" if lines else "[]"
    text = f'{{\n  "format": {json.dumps(FORMAT)},\n  "version": {VERSION},\n  "records": {body}\n}}\n'
    try:
        fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    except OSError as e:
        raise TuningError(f"cannot write the tuning file {path}: {e.strerror or e}") from None
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(text)
        # a file to share: the mode it had, or readable by all (mkstemp's is private)
        os.chmod(tmp, path.stat().st_mode & 0o777 if path.exists() else 0o644)
        os.replace(tmp, path)
    except OSError as e:
        raise TuningError(f"cannot write the tuning file {path}: {e.strerror or e}") from None
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


def _as_json(key: TuningKey, tuned: TunedConfig) -> dict:
    return {"gpu": key.gpu, "module": key.module, "kernel": key.kernel, "classes": dict(key.classes),
            "dtypes": list(key.dtypes),
            "config": {"constexprs": dict(tuned.constexprs), "num_warps": tuned.num_warps,
                       "num_stages": tuned.num_stages, "maxnreg": tuned.maxnreg}}


RECORD_FIELDS = ("gpu", "module", "kernel", "classes", "dtypes", "config")
CONFIG_FIELDS = ("constexprs", "num_warps", "num_stages", "maxnreg")


class _Malformed(Exception):
    """What is wrong with a tuning file's content (TuningError adds the file)."""


def read_records(path: str | os.PathLike) -> dict[TuningKey, TunedConfig]:
    """The records of a tuning file, every GPU model's; a TuningError naming the file
    where it cannot be read or is not a tuning file of this format."""
    try:
        text = Path(path).read_text(encoding="utf-8")
    except IsADirectoryError:
        raise TuningError(f"cannot read the tuning file {path}: it is a folder") from None
    except OSError as e:
        raise TuningError(f"cannot read the tuning file {path}: {e.strerror or e}") from None
    except UnicodeDecodeError as e:
        raise TuningError(f"the tuning file {path} is not UTF-8 text (byte {e.start})") from None
    try:
        data = json.loads(text)
    except json.JSONDecodeError as e:
        raise TuningError(f"the tuning file {path} is not JSON: {e.msg} "
                          f"(line {e.lineno}, column {e.colno})") from None
    except RecursionError:
        raise TuningError(f"the tuning file {path} is not a tuning file: "
                          f"its JSON is nested too deeply") from None
    try:
        return _records(data)
    except _Malformed as e:
        raise TuningError(f"the tuning file {path} is not a tuning file of this einfold: {e}") from None


def _records(data) -> dict[TuningKey, TunedConfig]:
    if not isinstance(data, dict) or data.get("format") != FORMAT:
        raise _Malformed(f'its top level is no object with "format": "{FORMAT}"')
    if "version" not in data:
        raise _Malformed("it has no version")
    if type(data["version"]) is not int or data["version"] != VERSION:
        raise _Malformed(f"format version {_shown(data['version'])}; this einfold reads version {VERSION}")
    _fields(data, ("format", "version", "records"), "the top level")
    records = data["records"]
    if not isinstance(records, list):
        raise _Malformed(f"records is {_shown(records)}, not a list")
    out: dict[TuningKey, TunedConfig] = {}
    for k, record in enumerate(records):
        key, tuned = _record(record, f"records[{k}]")
        if key in out:
            raise _Malformed(f"records[{k}] repeats the key of an earlier record")
        out[key] = tuned
    return out


def _record(record, where: str) -> tuple[TuningKey, TunedConfig]:
    _fields(record, RECORD_FIELDS, where)
    config = record["config"]
    _fields(config, CONFIG_FIELDS, f"{where}.config")
    key = TuningKey(_text(record["gpu"], f"{where}.gpu"), _text(record["module"], f"{where}.module"),
                    _text(record["kernel"], f"{where}.kernel"),
                    tuple(_integers(record["classes"], f"{where}.classes").items()),
                    tuple(_text(dtype, f"{where}.dtypes[{k}]") for k, dtype in
                          enumerate(_list(record["dtypes"], f"{where}.dtypes"))))
    maxnreg = config["maxnreg"]
    tuned = TunedConfig(tuple(sorted(_integers(config["constexprs"], f"{where}.config.constexprs").items())),
                        _integer(config["num_warps"], f"{where}.config.num_warps", least=1),
                        _integer(config["num_stages"], f"{where}.config.num_stages", least=0),
                        None if maxnreg is None else _integer(maxnreg, f"{where}.config.maxnreg", least=1))
    return key, tuned


def _fields(value, names: tuple[str, ...], where: str) -> None:
    """`value` is an object with exactly the fields `names`."""
    if not isinstance(value, dict):
        raise _Malformed(f"{where} is {_shown(value)}, not an object")
    missing = [name for name in names if name not in value]
    unknown = [name for name in value if name not in names]
    if missing:
        raise _Malformed(f"{where} has no field {', '.join(missing)}")
    if unknown:
        raise _Malformed(f"{where} has an unknown field {', '.join(map(repr, unknown))}")


def _text(value, where: str) -> str:
    if not isinstance(value, str) or not value:
        raise _Malformed(f"{where} is {_shown(value)}, not a non-empty string")
    return value


def _list(value, where: str) -> list:
    if not isinstance(value, list):
        raise _Malformed(f"{where} is {_shown(value)}, not a list")
    return value


def _integer(value, where: str, least: int = 0) -> int:
    if type(value) is not int or value < least:
        raise _Malformed(f"{where} is {_shown(value)}, not an integer of at least {least}")
    return value


def _integers(value, where: str) -> dict[str, int]:
    """An object of non-negative integers by name."""
    if not isinstance(value, dict):
        raise _Malformed(f"{where} is {_shown(value)}, not an object")
    return {name: _integer(v, f"{where}.{name}") for name, v in value.items()}


def _shown(value) -> str:
    """A JSON value as a message shows it: short, containers by kind."""
    if isinstance(value, dict):
        return "an object"
    if isinstance(value, list):
        return "a list"
    text = json.dumps(value)
    return text if len(text) <= 40 else text[:37] + "..."
