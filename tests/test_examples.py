"""Every script in examples/ runs to completion and reports "ok".

Each example compiles its program, checks it against an independent torch
float64 computation and exits non-zero on a mismatch.  New examples are picked
up by the glob; none is skipped."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
EXAMPLES = sorted((ROOT / "examples").glob("*.py"))


def test_examples_exist():
    assert EXAMPLES, "no examples/*.py found"


@pytest.mark.parametrize("script", EXAMPLES, ids=[p.name for p in EXAMPLES])
def test_example_runs(script: Path):
    result = subprocess.run([sys.executable, str(script)], cwd=ROOT, capture_output=True, text=True,
                            timeout=300, check=False)
    output = f"--- stdout\n{result.stdout[-4000:]}\n--- stderr\n{result.stderr[-4000:]}"
    assert result.returncode == 0, f"{script.name} exited with {result.returncode}\n{output}"
    assert "ok" in result.stdout, f"{script.name} did not print 'ok'\n{output}"
