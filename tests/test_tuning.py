"""Tuning that ships (compiler/backend/triton/records.py, compiler/tuning.py): the
tuning records of a process written to a file and read back; a malformed file is a
TuningError naming it; which candidate a record chooses; a tuned kernel's first
launch with a matching record times nothing (stand-ins for Triton's objects on the
CPU, the real thing on the GPU, in a fresh process with an empty Triton cache);
`einfold tune` and `einfold cache`."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from dataclasses import replace
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
import triton

import compiler
from compiler.backend.triton import records
from compiler.backend.triton.launch import DirectLaunch
from compiler.backend.triton.records import TunedConfig, TuningKey
from compiler.cli import main
from compiler.errors import TuningError

GPU = "NVIDIA Stand-in 80GB"
CONFIGS = [triton.Config({"BLOCK_i": 64, "BLOCK_k": 32}, num_warps=4, num_stages=3),
           triton.Config({"BLOCK_i": 128, "BLOCK_k": 32}, num_warps=8, num_stages=3),
           triton.Config({"BLOCK_i": 128, "BLOCK_k": 32}, num_warps=8, num_stages=3, maxnreg=128)]
KEY = TuningKey(GPU, "0123456789abcdef01234567", "einfold_Y", (("class_i", 8),), ("float32",))


@pytest.fixture(autouse=True)
def table(monkeypatch):
    """An empty table of records for each test, EINFOLD_TUNING unset and not read yet."""
    monkeypatch.setattr(records, "_loaded", {})
    monkeypatch.setattr(records, "_used", {})
    monkeypatch.setattr(records, "_environment_read", False)
    monkeypatch.delenv(records.TUNING_ENV, raising=False)


def _forget_this_process():
    records._loaded.clear()
    records._used.clear()


# ---------------------------------------------------------------- the file
def test_records_round_trip_through_a_file(tmp_path):
    path = tmp_path / "tuning.json"
    other = replace(KEY, kernel="einfold_Z", classes=(("class_i", 8), ("class_k", 12)),
                    dtypes=("bfloat16",) * 2)
    records.note(KEY, CONFIGS[1])
    records.note(other, CONFIGS[2])
    assert compiler.save_tuning(path) == 2
    assert path.stat().st_mode & 0o777 == 0o644          # a file to share, not a private temporary one
    data = json.loads(path.read_text())
    assert data["format"] == "einfold tuning" and data["version"] == 1
    assert data["records"][0] == {
        "gpu": GPU, "module": KEY.module, "kernel": "einfold_Y", "classes": {"class_i": 8},
        "dtypes": ["float32"], "config": {"constexprs": {"BLOCK_i": 128, "BLOCK_k": 32},
                                          "num_warps": 8, "num_stages": 3, "maxnreg": None}}
    lines = path.read_text().splitlines()
    assert sum(line.lstrip().startswith('{"gpu"') for line in lines) == 2      # a line each
    _forget_this_process()
    assert records.choice(KEY, CONFIGS) is None
    assert compiler.load_tuning(path) == 2
    assert records.choice(KEY, CONFIGS) is CONFIGS[1]
    assert records.choice(other, CONFIGS) is CONFIGS[2]


def test_saving_keeps_the_records_of_the_file(tmp_path):
    """A file gathers the choices of several GPU models: saving merges into it, and a
    record of this process replaces the file's record of the same key."""
    path = tmp_path / "tuning.json"
    elsewhere = replace(KEY, gpu="NVIDIA Other")
    records.note(elsewhere, CONFIGS[0])
    records.note(KEY, CONFIGS[0])
    compiler.save_tuning(path)
    _forget_this_process()
    records.note(KEY, CONFIGS[1])
    assert compiler.save_tuning(path) == 1
    assert records.read_records(path) == {elsewhere: TunedConfig.of(CONFIGS[0]),
                                          KEY: TunedConfig.of(CONFIGS[1])}


def test_records_of_other_gpu_models_are_kept_and_ignored(tmp_path):
    path = tmp_path / "tuning.json"
    records.note(replace(KEY, gpu="NVIDIA Other"), CONFIGS[1])
    compiler.save_tuning(path)
    _forget_this_process()
    assert compiler.load_tuning(path) == 1
    assert records.choice(KEY, CONFIGS) is None


def test_a_record_chooses_the_candidate_it_names_or_none():
    assert records.candidate(CONFIGS, TunedConfig.of(CONFIGS[2])) is CONFIGS[2]
    assert records.candidate(CONFIGS, TunedConfig.of(CONFIGS[1])) is CONFIGS[1]     # maxnreg tells them apart
    gone = triton.Config({"BLOCK_i": 256, "BLOCK_k": 32}, num_warps=8, num_stages=3)
    assert records.candidate(CONFIGS, TunedConfig.of(gone)) is None
    records._loaded[KEY] = TunedConfig.of(gone)       # the kernel's candidates changed since: tune
    assert records.choice(KEY, CONFIGS) is None


def _valid() -> dict:
    return {"format": "einfold tuning", "version": 1, "records": [
        {"gpu": GPU, "module": KEY.module, "kernel": "einfold_Y", "classes": {"class_i": 8},
         "dtypes": ["float32"],
         "config": {"constexprs": {"BLOCK_i": 64}, "num_warps": 4, "num_stages": 3, "maxnreg": None}}]}


def _with(change) -> str:
    data = _valid()
    change(data)
    return json.dumps(data)


def _deep(levels: int) -> str:
    return "[" * levels + "]" * levels


@pytest.mark.parametrize("text, message", [
    ("{", "is not JSON: Expecting property name enclosed in double quotes (line 1, column 2)"),
    ("", "is not JSON"),
    ("[]", 'top level is no object with "format": "einfold tuning"'),
    (_with(lambda d: d.pop("format")), 'top level is no object with "format": "einfold tuning"'),
    (_with(lambda d: d.update(version=2)), "format version 2; this einfold reads version 1"),
    (_with(lambda d: d.update(version="1")), 'format version "1"; this einfold reads version 1'),
    (_with(lambda d: d.update(version=True)), "format version true"),
    (_with(lambda d: d.pop("version")), "it has no version"),
    (_with(lambda d: d.update(extra=1)), "the top level has an unknown field 'extra'"),
    (_with(lambda d: d.update(records={})), "records is an object, not a list"),
    (_with(lambda d: d["records"].append(3)), "records[1] is 3, not an object"),
    (_with(lambda d: d["records"][0].pop("dtypes")), "records[0] has no field dtypes"),
    (_with(lambda d: d["records"][0].update(config=[4, 3])), "records[0].config is a list, not an object"),
    (_with(lambda d: d["records"][0]["config"].update(num_warps="4")),
     'records[0].config.num_warps is "4", not an integer of at least 1'),
    (_with(lambda d: d["records"][0]["config"].update(num_warps=0)),
     "num_warps is 0, not an integer of at least 1"),
    (_with(lambda d: d["records"][0]["config"].update(num_stages=2.5)), "num_stages is 2.5, not an integer"),
    (_with(lambda d: d["records"][0]["config"].update(maxnreg=False)), "maxnreg is false, not an integer"),
    (_with(lambda d: d["records"][0]["config"]["constexprs"].update(BLOCK_i="64")),
     'records[0].config.constexprs.BLOCK_i is "64", not an integer'),
    (_with(lambda d: d["records"][0]["classes"].update(class_i=-1)), "records[0].classes.class_i is -1"),
    (_with(lambda d: d["records"][0].update(gpu="")), 'records[0].gpu is "", not a non-empty string'),
    (_with(lambda d: d["records"][0].update(dtypes=["float32", 7])), "records[0].dtypes[1] is 7"),
    (_with(lambda d: d["records"][0].update(kernel=None)), "records[0].kernel is null"),
    (_with(lambda d: d["records"].append(d["records"][0])),
     "records[1] repeats the key of an earlier record"),
    (_deep(100_000), "its JSON is nested too deeply"),
], ids=lambda value: value[:40] if isinstance(value, str) else None)
def test_a_malformed_file_is_a_tuning_error_naming_it(tmp_path, text, message):
    path = tmp_path / "tuning.json"
    path.write_text(text)
    with pytest.raises(TuningError) as caught:
        compiler.load_tuning(path)
    assert str(path) in str(caught.value) and message in str(caught.value)
    assert str(caught.value).startswith("tuning error: ") and "\n" not in str(caught.value)
    assert records._loaded == {}


def test_a_file_that_cannot_be_read_or_written_is_a_tuning_error(tmp_path):
    (tmp_path / "bytes.json").write_bytes(b'{"format": "\xff"}')
    for path, message in [(tmp_path / "missing.json", "cannot read the tuning file"),
                          (tmp_path, "it is a folder"),
                          (tmp_path / "bytes.json", "is not UTF-8 text (byte 12)")]:
        with pytest.raises(TuningError, match="tuning file") as caught:
            compiler.load_tuning(path)
        assert str(path) in str(caught.value) and message in str(caught.value)
    with pytest.raises(TuningError, match=f"cannot write the tuning file {tmp_path}/no/such/folder"):
        compiler.save_tuning(tmp_path / "no" / "such" / "folder" / "tuning.json")
    (tmp_path / "bad.json").write_text("{")           # saving merges: a file it cannot read is not replaced
    with pytest.raises(TuningError, match="is not JSON"):
        compiler.save_tuning(tmp_path / "bad.json")
    assert (tmp_path / "bad.json").read_text() == "{"


def test_the_environment_variable_is_read_at_the_first_choice(tmp_path, monkeypatch):
    first, second = tmp_path / "first.json", tmp_path / "second.json"
    records.note(KEY, CONFIGS[0])
    compiler.save_tuning(first)
    _forget_this_process()
    records.note(KEY, CONFIGS[1])           # the later file's record of a key replaces the earlier's
    compiler.save_tuning(second)
    _forget_this_process()
    monkeypatch.setenv(records.TUNING_ENV, os.pathsep.join([str(first), "", str(second)]))
    assert records._loaded == {}
    assert records.choice(KEY, CONFIGS) is CONFIGS[1]


def test_a_malformed_file_of_the_environment_variable_fails_the_launch_that_reads_it(tmp_path, monkeypatch):
    path = tmp_path / "tuning.json"
    path.write_text('{"format": "einfold tuning", "version": 7, "records": []}')
    monkeypatch.setenv(records.TUNING_ENV, str(path))
    wrong = f"{path} is not a tuning file of this einfold: format version 7"
    for _ in range(2):          # every time: the user named the file
        with pytest.raises(TuningError, match=wrong):
            records.choice(KEY, CONFIGS)


def test_the_module_identity_names_its_cache_file(tmp_path, monkeypatch):
    from compiler.backend.triton.cache import module_digest, write
    monkeypatch.setenv("EINFOLD_CACHE_DIR", str(tmp_path))
    source = "# a module\x00 with a NUL\nX = 1\n"
    assert write(source, "options").name == f"einfold_{module_digest(source, 'options')}.py"
    assert module_digest(source, "options") != module_digest(source, "other options")


# ---------------------------------------------------------------- the first launch
class Compiled:
    function, packed_metadata = "function", "metadata"

    def __init__(self):
        self.runs = []

    def _init_handles(self):
        pass

    def run(self, *args):
        self.runs.append(args)


class Jit:
    """A JITFunction: compiles (`warmup`) and launches through Triton's path (`[grid]`)."""
    arg_names = ["X_ptr", "n_i", "class_i", "BLOCK_i", "BLOCK_k"]

    def __init__(self, fail_with=None):
        self.__name__ = "einfold_Y"
        self.compiled, self.compiles, self.launches, self.fail_with = Compiled(), [], [], fail_with

    def warmup(self, *args, grid, **options):
        self.compiles.append(options)
        return self.compiled

    def __getitem__(self, grid):
        def launch(*args, **options):
            if self.fail_with is not None:
                raise self.fail_with
            self.launches.append(options)
        return launch


class Autotuner:
    """Triton's Autotuner over `jit`: its launch times every candidate and chooses `best`."""
    keys = ["class_i"]

    def __init__(self, jit, best: int):
        self.fn, self.configs, self.best, self.timed = jit, CONFIGS, best, 0

    def __getitem__(self, grid):
        def launch(*args, **constexprs):
            self.timed += 1
            self.best_config = self.configs[self.best]
        return launch


@pytest.fixture
def stand_in_gpu(monkeypatch):
    from triton.runtime.driver import driver
    monkeypatch.setattr(driver, "_active", SimpleNamespace(get_current_device=lambda: 0,
                                                          get_current_stream=lambda device: 7))
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device: GPU)


def _launch_twice(tuner) -> DirectLaunch:
    kernel = DirectLaunch(tuner, KEY.module)
    grid = lambda META: (-(-META["n_i"] // META["BLOCK_i"]),)  # noqa: E731
    x, n_i = torch.zeros(64), 200
    for _ in range(2):
        kernel[grid](x, n_i, n_i.bit_length())     # the class of KEY; each candidate binds every constexpr
    return kernel


def test_a_first_launch_without_a_record_tunes_and_records_its_choice(stand_in_gpu):
    tuner = Autotuner(Jit(), best=1)
    _launch_twice(tuner)
    assert tuner.timed == 1
    assert len(tuner.fn.compiles) == len(CONFIGS) + 1          # every candidate, then the bound one
    assert records._used == {KEY: TunedConfig.of(CONFIGS[1])}
    (run,) = tuner.fn.compiled.runs
    assert run[-2:] == (128, 32)            # the bound launch: the chosen BLOCK_i, then BLOCK_k


def test_a_first_launch_with_a_record_times_and_compiles_nothing_else(stand_in_gpu):
    records._loaded[KEY] = TunedConfig.of(CONFIGS[2])
    tuner = Autotuner(Jit(), best=0)
    _launch_twice(tuner)
    assert tuner.timed == 0
    assert tuner.fn.launches == tuner.fn.compiles == [CONFIGS[2].all_kwargs()]     # the recorded one alone
    assert records._used == {KEY: TunedConfig.of(CONFIGS[2])}              # saved with this process's choices
    assert tuner.fn.compiled.runs[0][-2:] == (128, 32)


def test_a_record_of_a_candidate_the_chip_cannot_run_is_tuned_over(stand_in_gpu):
    from triton.runtime.errors import OutOfResources
    records._loaded[KEY] = TunedConfig.of(CONFIGS[2])
    tuner = Autotuner(Jit(fail_with=OutOfResources(300_000, 232_448, "shared memory")), best=0)
    _launch_twice(tuner)
    assert tuner.timed == 1 and records._used == {KEY: TunedConfig.of(CONFIGS[0])}


# ---------------------------------------------------------------- tune and the command line
MATMUL = "C[i,j] = A[i,k] * B[k,j]"


def test_shapes_to_tune_give_every_index_of_the_program():
    from compiler.tuning import shape_sizes
    program = compiler.compile(MATMUL)
    assert shape_sizes(program, {"i": 64, "j": 32, "k": 16}) == {"i": 64, "j": 32, "k": 16}
    for shape, message in [({"i": 64, "j": 32}, "the shape i=64, j=32 gives no extent for k"),
                           ({"i": 64, "j": 32, "k": 16, "q": 2}, "names no index of the program: q"),
                           ({"i": 64, "j": 0, "k": 16}, "gives j the extent 0, not a positive integer")]:
        with pytest.raises(TuningError, match=message):
            shape_sizes(program, shape)


def test_tuning_needs_a_cuda_gpu(monkeypatch, capsys):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(TuningError, match="tuning times each kernel's candidates on a CUDA GPU"):
        compiler.tune(compiler.compile(MATMUL), [{"i": 64, "j": 64, "k": 64}])
    assert main(["tune", "-e", MATMUL, "--shape", "i=64,j=64,k=64"]) == 2
    out, err = capsys.readouterr()
    assert out == ""
    assert err == "einfold: tune needs a CUDA GPU: tuning times each kernel's candidates on one\n"


@pytest.mark.parametrize("argv, message", [
    (["--shape", "i=64,j=64"], "einfold: tuning error: the shape i=64, j=64 gives no extent for k"),
    (["--shape", "i=64;j=64"], "einfold: --shape takes INDEX=N, got 'i=64;j=64'"),
    ([], "the following arguments are required: --shape")])
def test_einfold_tune_mistakes_are_one_line_with_status_2(capsys, argv, message):
    try:
        code = main(["tune", "-e", MATMUL, *argv])
    except SystemExit as stop:          # argparse's own errors
        code = stop.code
    out, err = capsys.readouterr()
    assert code == 2 and out == "" and err.count("\n") == 1 and message in err


def test_einfold_cache_shows_the_tuning_records_it_would_load(capsys, tmp_path, monkeypatch):
    monkeypatch.setenv("EINFOLD_CACHE_DIR", str(tmp_path))
    assert main(["cache"]) == 0
    assert "tuning records: none (EINFOLD_TUNING names files of them" in capsys.readouterr().out
    path = tmp_path / "tuning.json"
    records.note(KEY, CONFIGS[0])
    records.note(replace(KEY, gpu="NVIDIA Other", classes=(("class_i", 9),)), CONFIGS[0])
    records.note(replace(KEY, gpu="NVIDIA Other", classes=(("class_i", 10),)), CONFIGS[0])
    compiler.save_tuning(path)
    monkeypatch.setenv(records.TUNING_ENV, str(path))
    assert main(["cache"]) == 0
    assert capsys.readouterr().out.splitlines()[-1] == \
        f"tuning records: {path} (3 record(s), 2 of NVIDIA Other, 1 of {GPU}; from EINFOLD_TUNING)"
    path.write_text("[]")
    assert main(["cache"]) == 2
    assert f"{path} is not a tuning file" in capsys.readouterr().err


# ---------------------------------------------------------------- on the GPU
SHIPPED = textwrap.dedent("""
    import sys
    import torch
    import triton.runtime.autotuner as autotuner
    import compiler
    from compiler.backend.triton.launch import DirectLaunch

    timed = []          # the autotuner's timings of a candidate
    bench = autotuner.Autotuner._bench

    def counted(self, *args, **kwargs):
        timed.append(kwargs["config"])
        return bench(self, *args, **kwargs)
    autotuner.Autotuner._bench = counted
    program = compiler.compile(sys.argv[1])
    inputs = torch.load(sys.argv[2])
    if sys.argv[3] == "load":
        print(compiler.load_tuning(sys.argv[4]))
    out = program(**inputs)
    if sys.argv[3] == "save":
        print(compiler.save_tuning(sys.argv[4]))
    kernels = [k for name, module in list(sys.modules.items()) if name.startswith("einfold_")
               for k in vars(module).values() if isinstance(k, DirectLaunch) and k.tuned]
    print(len(kernels), len(timed))
    torch.save(out, sys.argv[5])
""")


@pytest.mark.gpu
def test_a_shipped_tuning_file_spares_a_fresh_process_the_timing(tmp_path):
    """Tune a matmul in one process and save its choices; in another, with empty
    einfold and Triton caches, load them: the first call times no candidate and
    gives the same result."""
    source = "C[i,j] = A[i,k] * B[k,j]"
    g = torch.Generator(device="cuda").manual_seed(0)
    # large enough not to split the contraction (a split kernel is not tuned)
    inputs = {"A": torch.randn(4096, 256, device="cuda", dtype=torch.bfloat16, generator=g),
              "B": torch.randn(256, 2048, device="cuda", dtype=torch.bfloat16, generator=g)}
    torch.save(inputs, tmp_path / "inputs.pt")
    tuning = tmp_path / "tuning.json"

    def run(step: str) -> tuple[str, torch.Tensor]:
        folder = tmp_path / step
        env = {**os.environ, "EINFOLD_CACHE_DIR": str(folder / "einfold"),
               "TRITON_CACHE_DIR": str(folder / "triton"),
               "PYTHONPATH": os.pathsep.join(filter(None, [str(Path(__file__).parent.parent),
                                                           os.environ.get("PYTHONPATH")]))}
        env.pop(records.TUNING_ENV, None)
        argv = [source, str(tmp_path / "inputs.pt"), step, str(tuning), str(tmp_path / f"{step}.pt")]
        done = subprocess.run([sys.executable, "-c", SHIPPED, *argv], env=env, capture_output=True, text=True,
                              timeout=600)
        assert done.returncode == 0, done.stderr
        return done.stdout, torch.load(tmp_path / f"{step}.pt")

    saved, tuned = run("save")
    written, counts = saved.split("\n")[:2]
    kernels, timed = map(int, counts.split())
    assert int(written) == kernels >= 1 and timed >= 2        # the tuned kernel timed its candidates
    (record,) = json.loads(tuning.read_text())["records"]
    assert record["gpu"] == torch.cuda.get_device_name()
    assert record["classes"] == {"class_i": 13, "class_j": 12, "class_k": 9}      # the extents' bit lengths
    loaded, shipped = run("load")
    assert loaded.split("\n")[:2] == ["1", f"{kernels} 0"]      # one record read; nothing timed
    assert torch.equal(shipped, tuned)
