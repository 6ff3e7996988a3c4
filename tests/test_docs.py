"""The outputs pasted into docs/algebra.md are what the commands print today."""
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


def command_blocks(path: Path) -> list[tuple[str, str]]:
    """(command, its pasted output) for every `$ command` line in the file's code blocks."""
    lines = path.read_text().split("\n")
    blocks = []
    for k, line in enumerate(lines):
        if line.startswith("$ "):
            end = k + 1
            while end < len(lines) and not lines[end].startswith(("```", "$ ")):
                end += 1
            blocks.append((line[2:], "\n".join(lines[k + 1:end])))
    return blocks


BLOCKS = command_blocks(ROOT / "docs" / "algebra.md")


def test_the_algebra_doc_has_commands():
    assert len(BLOCKS) >= 5


@pytest.mark.parametrize("command, pasted", BLOCKS, ids=[c[:60] for c, _ in BLOCKS])
def test_pasted_output_is_current(command, pasted):
    command = command.replace("python -c", f'"{sys.executable}" -c', 1)
    result = subprocess.run(command, shell=True, capture_output=True, text=True, cwd=ROOT, timeout=300)
    assert result.returncode == 0, result.stderr
    assert result.stdout.rstrip("\n") == pasted.rstrip("\n")
