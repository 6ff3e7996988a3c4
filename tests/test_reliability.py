"""Reliability (docs/reliability.md): long and deep programs, the module cache
(runs only what einfold wrote), and every user mistake at the API an einfold error.
Each test is the regression test of a measured failure."""
import importlib.util
import marshal
import os
import sys
import warnings

import pytest
import torch

import compiler
from compiler import BackendError, BindError, CheckError, EinfoldError, ParseError, config
from compiler.errors import LimitError
from compiler.ir import format_program
from compiler.parse import parse
from test_errors import pointed

warnings.filterwarnings("ignore", message="einfold: no CUDA tensors")
pytestmark = [pytest.mark.filterwarnings("ignore:einfold. no CUDA tensors"),
              pytest.mark.usefixtures("private_cache")]


def oracle(src: str, **inputs):
    return compiler.compile(src, backend="reference")(**inputs)


# ---------------------------------------------------------------- size and depth
def test_sum_of_10000_terms_parses_checks_prints_and_runs():
    x = torch.randn(3, dtype=torch.float64)
    src = "Y[i] = " + " + ".join(["X[i]"] * 9_999 + ["3"])
    program = compiler.compile(src, backend="reference")
    assert format_program(program.checked).count("X[i]") == 9_999
    torch.testing.assert_close(program(X=x), x * 9_999 + 3)


@pytest.mark.parametrize("make", [lambda n: "-" * n + "X[i]",
                                  lambda n: "exp(" * n + "X[i] * 0.0" + ")" * n,
                                  lambda n: "(" * n + "X[i]" + ")" * n,
                                  lambda n: "max(" * n + "X[i]" + ", -1.0)" * n],
                         ids=["neg", "exp", "parens", "max"])
def test_nesting_1000_deep(make):
    x = torch.randn(4, dtype=torch.float64)
    src = "Y[i] = " + make(1000)
    out = oracle(src, X=x)
    assert out.shape == (4,) and not torch.isnan(out).any()
    reparsed = compiler.compile(format_program(compiler.compile(src, backend="reference").checked),
                                backend="reference")
    torch.testing.assert_close(reparsed(X=x), out)


def test_1000_statements():
    src = "\n".join(f"A{k}[i] = X[i] + {k}" for k in range(1000))
    program = compiler.compile(src, backend="reference")
    assert len(program.outputs) == 1000
    outs = program(X=torch.zeros(2))
    assert float(outs[-1][0]) == 999


def test_chain_of_1000_statements_on_the_oracle():
    # fuse inlines without renaming where a reader uses the statement's own index names
    # (this took 12 s at 1,000 statements when every inlining copied the chain so far)
    src = "A0[i] = X[i]\n" + "\n".join(f"A{k}[i] = A{k - 1}[i] + 1" for k in range(1, 1000))
    program = compiler.compile(src, backend="reference", outputs=["A999"])
    assert float(program(X=torch.zeros(2))[1]) == 999


def test_deep_program_on_the_triton_backend():
    src = "Y[i] = " + "-" * 300 + "X[i] + " + " + ".join(["X[i]"] * 300)
    x = torch.randn(5)
    torch.testing.assert_close(compiler.compile(src, backend="triton")(X=x), x * 301, rtol=1e-4, atol=1e-4)


def test_a_deep_program_backend_plan_and_source_do_not_recurse_out():
    program = compiler.compile("Y[i] = " + "-" * 3000 + "X[i]", backend="triton")
    assert type(program.backend).__name__ == "TritonBackend"         # made under deep()
    assert "def launch" in program.source
    assert program.plan(X=torch.ones(2)).kernels


def test_sum_of_10000_terms_on_the_triton_backend():
    # emission is linear: free indices and hashes are computed once per node (this took
    # over 6 minutes when each lookup walked the whole subtree)
    src = "Y[i] = " + " + ".join(f"X[i] * {k % 7 + 1}" for k in range(10_000))
    torch.testing.assert_close(compiler.compile(src, backend="triton")(X=torch.ones(3)),
                               torch.full((3,), 39_994.0))


def test_deep_work_restores_the_recursion_limit():
    before = sys.getrecursionlimit()
    oracle("Y[i] = " + "-" * 1500 + "X[i]", X=torch.randn(2))
    assert sys.getrecursionlimit() == before


def test_depth_limit_is_an_einfold_error_pointing_at_the_source(monkeypatch):
    monkeypatch.setattr(config, "MAX_DEPTH", 50)
    with pytest.raises(LimitError) as excinfo:
        compiler.compile("Y[i] = X[i]\nZ[i] = " + "-" * 60 + "X[i]", backend="reference")
    msg = str(excinfo.value)
    assert "nested more than 50 levels" in msg and "MAX_DEPTH" in msg and "--> line 2" in msg
    assert isinstance(excinfo.value, EinfoldError)


def test_statement_and_size_limits(monkeypatch):
    monkeypatch.setattr(config, "MAX_STATEMENTS", 5)
    with pytest.raises(LimitError, match="6 statements; the limit is 5") as excinfo:
        parse("\n".join(f"A{k}[i] = X[i]" for k in range(6)))
    assert pointed(str(excinfo.value)) == "A5"
    monkeypatch.setattr(config, "MAX_SOURCE_CHARS", 10)
    with pytest.raises(LimitError, match="MAX_SOURCE_CHARS"):
        parse("Y[i] = X[i] + X[i]")


def test_doubling_chain_is_refused_before_it_explodes():
    # each statement reads the previous one twice: inlined, 2**40 operations
    src = "A0[i] = X[i]\n" + "\n".join(f"A{k}[i] = A{k - 1}[i] * A{k - 1}[i] + 1" for k in range(1, 40))
    with pytest.raises(LimitError, match="MAX_FUSED_NODES") as excinfo:
        compiler.compile(src, backend="reference")
    assert "--> line" in str(excinfo.value)


def test_too_deep_for_the_worker_stack_is_a_limit_error(monkeypatch):
    monkeypatch.setenv(config.STACK_ENV, "16")
    monkeypatch.setattr(config, "LEVELS_PER_MB", 64)       # 1024 frames: too few for 3000 levels
    with pytest.raises(LimitError, match="nested too deeply to process even with a 16 MiB stack"):
        compiler.compile("Y[i] = " + "-" * 3000 + "X[i]", backend="reference")


# ---------------------------------------------------------------- module cache
@pytest.fixture
def cache_dir(tmp_path, monkeypatch):
    monkeypatch.setenv("EINFOLD_CACHE_DIR", str(tmp_path))
    return tmp_path


def _forget_modules():
    for name in [n for n in sys.modules if n.startswith("einfold_")]:
        del sys.modules[name]


def _run_fresh(src="Y[i] = X[i] * 2"):
    """Compile and run in a fresh Program, with no module of this process reused."""
    _forget_modules()
    x = torch.randn(5)
    torch.testing.assert_close(compiler.compile(src, backend="triton")(X=x), x * 2)


def test_planted_bytecode_is_never_run(cache_dir, monkeypatch):
    _run_fresh()
    (py,) = cache_dir.glob("einfold_*.py")
    # a .pyc whose header matches the .py, as the import system would accept it
    evil = compile("import os\nos.environ['EINFOLD_PWNED'] = '1'\ndef launch(*a): pass\n", str(py), "exec")
    header = importlib.util.MAGIC_NUMBER + (0).to_bytes(4, "little")
    st = py.stat()
    header += (int(st.st_mtime) & 0xFFFFFFFF).to_bytes(4, "little") + (st.st_size & 0xFFFFFFFF).to_bytes(4, "little")
    pyc = importlib.util.cache_from_source(str(py))
    os.makedirs(os.path.dirname(pyc), exist_ok=True)
    with open(pyc, "wb") as f:
        f.write(header + marshal.dumps(evil))
    monkeypatch.delenv("EINFOLD_PWNED", raising=False)
    _run_fresh()
    assert "EINFOLD_PWNED" not in os.environ


def test_tampered_source_is_regenerated_and_not_run(cache_dir, monkeypatch):
    _run_fresh()
    (py,) = cache_dir.glob("einfold_*.py")
    good = py.read_text()
    py.write_text(good.replace("def launch(t, n, device):",
                               "import os\nos.environ['EINFOLD_PWNED'] = '1'\ndef launch(t, n, device):"))
    monkeypatch.delenv("EINFOLD_PWNED", raising=False)
    _run_fresh()
    assert "EINFOLD_PWNED" not in os.environ and py.read_text() == good


@pytest.mark.parametrize("corruption", ["binary", "folder", "empty", "garbage_pyc"])
def test_corrupt_cache_entries_regenerate(cache_dir, corruption):
    _run_fresh()
    (py,) = cache_dir.glob("einfold_*.py")
    good = py.read_text()
    if corruption == "binary":
        py.write_bytes(b"\xff\xfe\x00garbage\x80")
    elif corruption == "folder":
        py.unlink()
        py.mkdir()
    elif corruption == "empty":
        py.write_bytes(b"")
    else:
        pyc = importlib.util.cache_from_source(str(py))
        os.makedirs(os.path.dirname(pyc), exist_ok=True)
        with open(pyc, "wb") as f:
            f.write(b"garbage" * 10)
    _run_fresh()
    if corruption != "folder":
        assert py.read_text() == good


def test_missing_cache_folder_is_created(tmp_path, monkeypatch):
    monkeypatch.setenv("EINFOLD_CACHE_DIR", str(tmp_path / "a" / "b"))
    _run_fresh()
    assert list((tmp_path / "a" / "b").glob("einfold_*.py"))


def test_cache_folder_that_is_a_file_is_an_einfold_error(tmp_path, monkeypatch):
    target = tmp_path / "file"
    target.write_text("x")
    monkeypatch.setenv("EINFOLD_CACHE_DIR", str(target))
    with pytest.raises(BackendError, match="EINFOLD_CACHE_DIR=.* it is a file"):
        _run_fresh()


@pytest.mark.skipif(hasattr(os, "geteuid") and os.geteuid() == 0, reason="root writes anywhere")
def test_unwritable_cache_folder_is_an_einfold_error(tmp_path, monkeypatch):
    locked = tmp_path / "locked"
    locked.mkdir()
    locked.chmod(0o500)
    monkeypatch.setenv("EINFOLD_CACHE_DIR", str(locked))
    try:
        with pytest.raises(BackendError, match="EINFOLD_CACHE_DIR"):
            _run_fresh()
    finally:
        locked.chmod(0o700)


def test_unusable_default_cache_falls_back_to_a_private_folder(tmp_path, monkeypatch):
    from compiler.backend.triton import cache
    home = tmp_path / "home"
    home.mkdir()
    (home / ".cache").write_text("not a folder")
    monkeypatch.delenv("EINFOLD_CACHE_DIR", raising=False)
    monkeypatch.setenv("HOME", str(home))
    monkeypatch.setattr(cache, "_fallback", None)
    with pytest.warns(RuntimeWarning, match="cannot be used"):
        folder = cache.cache_dir()
    assert folder.is_dir() and folder != home / ".cache" / "einfold"
    assert cache.cache_dir() == folder          # warned once, same folder after


def test_nul_and_surrogates_in_comments(cache_dir):
    from compiler.backend.triton import cache
    assert cache.safe_source("x = '\0'  # \udc80\n") == "x = '\\x00'  # \\udc80\n"
    for comment in ("# a\0b", "# a\udc80b", "# é€\u2028\x0cx"):
        _run_fresh(f"Y[i] = X[i] * 2  {comment}")


def test_module_source_is_what_triton_reads(cache_dir):
    import inspect
    _run_fresh()
    (py,) = cache_dir.glob("einfold_*.py")
    good = py.read_text()
    module = next(m for n, m in sys.modules.items() if n.startswith("einfold_"))
    py.write_text("# swapped after the check\n")
    assert inspect.getsource(module.launch) in good


# ---------------------------------------------------------------- the API
def test_positional_inputs_say_to_pass_them_by_name():
    program = compiler.compile("Y[i] = X[i] * s", backend="reference")
    with pytest.raises(BindError) as excinfo:
        program(torch.randn(3), 2.0)
    msg = str(excinfo.value)
    assert "passed by name" in msg and "X=..., s=..." in msg and "inputs are: X, s" in msg
    with pytest.raises(BindError, match="passed by name"):
        program.plan(torch.randn(3))


@pytest.mark.parametrize("backend", ["reference", "triton"])
@pytest.mark.parametrize("value", [10 ** 400, -(10 ** 400)])
def test_number_too_large_for_float64(backend, value):
    program = compiler.compile("Y[i] = X[i] * s", backend=backend)
    with pytest.raises(BindError, match="input 's' = .* does not fit in a float64") as excinfo:
        program(X=torch.randn(3), s=value)
    assert pointed(str(excinfo.value)) == "s"
    program(X=torch.randn(3), s=2)                  # an int that fits runs as a float


def test_source_that_is_not_text():
    for source in (b"Y[i] = X[i]", None, 3):
        with pytest.raises(ParseError, match="a program is a str"):
            compiler.compile(source)
    with pytest.raises(ParseError, match="decode it first"):
        compiler.compile(bytearray(b"Y[i] = X[i]"))


@pytest.mark.parametrize("summaries", [[1], 1, "abc", [None]])
def test_bad_summaries_entries(summaries):
    with pytest.raises(EinfoldError, match="summaries= takes"):
        compiler.compile("Y[i] = X[i]", summaries=summaries)


def test_outputs_argument():
    with pytest.raises(CheckError, match="outputs= takes a list"):
        compiler.compile("Y[i] = X[i]", outputs=1)
    with pytest.raises(CheckError, match="statement names"):
        compiler.compile("Y[i] = X[i]", outputs=[1])
    program = compiler.compile("Y[i] = X[i]\nZ[i] = Y[i] * 2", outputs="Y", backend="reference")
    assert program.outputs == ("Y",)


def test_copy_of_a_scalar_input_on_the_oracle_and_the_triton_backend():
    assert float(oracle("Y[] = s", s=2.5)) == 2.5
    assert float(oracle("Y[] = s", s=3)) == 3.0
    assert float(compiler.compile("Y[] = s", backend="triton")(s=2.5)) == 2.5


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("logic", ["and", "or"])
def test_float64_predicates_with_logic(dtype, logic):
    src = f"Y[i] = where(X[i] > 0 {logic} X[i] < 0.5, X[i], 0.0)"
    x = torch.randn(7, dtype=dtype)
    torch.testing.assert_close(compiler.compile(src, backend="triton")(X=x), oracle(src, X=x))


def test_meta_tensors_are_an_input_error():
    with pytest.raises(BindError, match="meta"):
        oracle("Y[i] = X[i]", X=torch.randn(3, device="meta"))
