"""Every script in examples/ runs to completion and reports "ok", as a user of a
plain install would run it.

Each example compiles its program, checks it against an independent torch
float64 computation and exits non-zero on a mismatch.  New examples are picked
up by the glob; none is skipped.  Each runs from an empty folder, which must stay
empty, with the test extras made unimportable (a plain `pip install .` has no
pytest, hypothesis or mkdocs): what an example needs at run time is declared."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
EXAMPLES = sorted((ROOT / "examples").glob("*.py"))


def test_examples_exist():
    assert EXAMPLES, "no examples/*.py found"


# Runs the script as __main__ with the test-only packages unimportable: importing one raises
# ModuleNotFoundError; a probe of one (importlib.util.find_spec, as torch._dynamo makes of
# hypothesis when an example runs under autograd) finds a spec of no file, as of a module it
# cannot locate, instead of an exception no plain install raises.
PLAIN_INSTALL = """
import importlib.machinery, runpy, sys
class Absent:
    def create_module(self, spec):
        raise ModuleNotFoundError(f"No module named {spec.name!r} (not in a plain install)")
    def exec_module(self, module):
        pass
class TestExtras:
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in ("pytest", "hypothesis", "mkdocs", "mkdocstrings"):
            return importlib.machinery.ModuleSpec(name, Absent())
sys.meta_path.insert(0, TestExtras())
sys.argv = [sys.argv[1]]
runpy.run_path(sys.argv[0], run_name="__main__")
"""


@pytest.mark.parametrize("script", EXAMPLES, ids=[p.name for p in EXAMPLES])
def test_example_runs_on_a_plain_install_and_leaves_nothing_behind(script: Path, tmp_path: Path):
    cwd = tmp_path / "empty"
    cwd.mkdir()
    result = subprocess.run([sys.executable, "-c", PLAIN_INSTALL, str(script)], cwd=cwd, capture_output=True,
                            text=True, timeout=300, check=False)
    output = f"--- stdout\n{result.stdout[-4000:]}\n--- stderr\n{result.stderr[-4000:]}"
    assert result.returncode == 0, f"{script.name} exited with {result.returncode}\n{output}"
    assert "ok" in result.stdout, f"{script.name} did not print 'ok'\n{output}"
    assert sorted(p.name for p in cwd.iterdir()) == [], f"{script.name} wrote into the caller's folder"
