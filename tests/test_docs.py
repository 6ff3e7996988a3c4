"""The documentation is current: what it pastes is what the code prints, and the site builds.

The pages are docs/**/*.md and README.md.  Conventions, which this test enforces:

- ```python blocks are complete scripts.  Each runs on its own, in a fresh
  Python subprocess, in an empty temporary directory, with EINFOLD_CACHE_DIR
  set to a temporary folder; on a machine without a GPU its Triton kernels run
  under the interpreter, so keep shapes tiny.  It must exit 0.  If the block
  is followed (with only blank lines between) by a plain ``` block, without a
  language, that block is the script's output: stdout must equal it exactly
  (trailing newlines aside).  A ```python block that only includes a file
  (`--8<-- "examples/attention.py"`, the pymdownx.snippets syntax) *is* that
  file: tests/test_examples.py runs it.
- In ```console, ```sh, ```bash, ```shell and plain ``` blocks, a line that
  starts with `$ ` is a command: it runs in a shell from the repository root
  (`python`/`python3` at its start is this interpreter, `einfold` the command
  installed beside it), must exit 0, and its stdout must equal the lines below
  it, up to the next `$ ` line or the end of the block.  To show stderr or an
  exit status, say so in the command (`... 2>&1; echo "exit status $?"`).
- Lines without `$ ` never run: install commands (`pip install ...`,
  `python3 -m pip install ...`), commands that need a GPU or are slow, and
  commands shown for copying are written that way.  An install command marked
  with `$ ` is an error.
- The site builds: `mkdocs build --strict` (mkdocs.yml), every page of the nav
  is in it, the API page carries the docstrings of compile and Program, each
  script in examples/ has its page that includes it, and the plots of
  docs/performance.md are shown.

After a deliberate change of what the code prints, refresh the pasted outputs
with `python3 tests/test_docs.py --update docs/PAGE.md` and review the diff.
"""
from __future__ import annotations

import html
import inspect
import os
import re
import subprocess
import sys
import tempfile
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
DOCS = ROOT / "docs"
PAGES = sorted(DOCS.rglob("*.md")) + [ROOT / "README.md"]
SHELL_LANGS = ("", "console", "sh", "bash", "shell")
FENCE = re.compile(r"^(`{3,})\s*([\w+-]*)")
TIMEOUT = 300


@dataclass(frozen=True)
class Block:
    page: Path
    line: int            # 1-based line of the opening fence
    end: int             # 1-based line of the closing fence
    lang: str
    text: str


def fenced_blocks(page: Path) -> list[Block]:
    """Every fenced code block of a Markdown page, in order (top-level fences only)."""
    lines = page.read_text().split("\n")
    blocks, k = [], 0
    while k < len(lines):
        m = FENCE.match(lines[k])
        if not m:
            k += 1
            continue
        fence, lang, start = m.group(1), m.group(2).lower(), k
        k += 1
        while k < len(lines) and not lines[k].startswith(fence):
            k += 1
        blocks.append(Block(page, start + 1, k + 1, lang, "\n".join(lines[start + 1:k])))
        k += 1
    return blocks


def _between_is_blank(page_lines: list[str], first: Block, second: Block) -> bool:
    return all(not s.strip() for s in page_lines[first.end:second.line - 1])


def python_blocks() -> list[tuple[Block, str | None]]:
    """(a ```python block, its pasted output or None) for every page."""
    found = []
    for page in PAGES:
        blocks, lines = fenced_blocks(page), page.read_text().split("\n")
        for b, after in zip(blocks, blocks[1:] + [None]):
            if b.lang not in ("python", "py"):
                continue
            if all(s.strip().startswith("--8<--") for s in b.text.strip().split("\n")):
                continue                         # a snippet include: the file itself (test_examples)
            pasted = (after.text if after is not None and after.lang == "" and _between_is_blank(lines, b, after)
                      else None)
            found.append((b, pasted))
    return found


def command_blocks() -> list[tuple[Block, str, str]]:
    """(block, command, its pasted output) for every `$ command` line in shell and plain blocks."""
    found = []
    for page in PAGES:
        for b in fenced_blocks(page):
            if b.lang not in SHELL_LANGS:
                continue
            lines = b.text.split("\n")
            for k, line in enumerate(lines):
                if line.startswith("$ "):
                    end = k + 1
                    while end < len(lines) and not lines[end].startswith("$ "):
                        end += 1
                    found.append((b, line[2:], "\n".join(lines[k + 1:end])))
    return found


PYTHON = python_blocks()
COMMANDS = command_blocks()


def _where(b: Block) -> str:
    return f"{b.page.relative_to(ROOT)}:{b.line}"


def _env(cache: str) -> dict[str, str]:
    env = dict(os.environ)
    env["EINFOLD_CACHE_DIR"] = cache
    env["PATH"] = os.pathsep.join([str(Path(sys.executable).parent), env.get("PATH", "")])
    env["PYTHONPATH"] = os.pathsep.join(p for p in [str(ROOT), env.get("PYTHONPATH")] if p)
    env.setdefault("NO_MKDOCS_2_WARNING", "1")
    return env


def _run_python(text: str) -> subprocess.CompletedProcess:
    with tempfile.TemporaryDirectory(prefix="einfold-doc-") as cwd, \
            tempfile.TemporaryDirectory(prefix="einfold-doc-cache-") as cache:
        script = Path(cwd) / "block.py"
        script.write_text(text + "\n")
        return subprocess.run([sys.executable, str(script)], cwd=cwd, env=_env(cache),
                              capture_output=True, text=True, timeout=TIMEOUT)


INTERPRETER = re.compile(r"^python3?(?=\s)")


def _run_command(command: str) -> subprocess.CompletedProcess:
    command = INTERPRETER.sub(lambda _: f'"{sys.executable}"', command)
    with tempfile.TemporaryDirectory(prefix="einfold-doc-cache-") as cache:
        return subprocess.run(command, shell=True, cwd=ROOT, env=_env(cache),
                              capture_output=True, text=True, timeout=TIMEOUT)


class _Runs(dict):
    """Futures of the block runs, keyed by block (python) or (block, command)."""

    def __init__(self, pool: ThreadPoolExecutor):
        super().__init__()
        self.pool = pool

    def start(self, key) -> None:
        if key not in self:
            self[key] = (self.pool.submit(_run_python, key.text) if isinstance(key, Block)
                         else self.pool.submit(_run_command, key[1]))

    def __missing__(self, key):
        self.start(key)
        return self[key]


@pytest.fixture(scope="module")
def runs(request):
    """Start every block this session selected at once (they are independent
    subprocesses), so that the module takes about as long as its slowest few."""
    pool = ThreadPoolExecutor(max_workers=max(2, min(8, os.cpu_count() or 2)))
    started = _Runs(pool)
    if not hasattr(request.config, "workerinput"):        # under pytest-xdist: one at a time
        for item in request.session.items:
            params = getattr(getattr(item, "callspec", None), "params", {})
            name = getattr(item, "originalname", None)
            if name == "test_python_block":
                started.start(params["block"])
            elif name == "test_command":
                started.start((params["block"], params["command"]))
    yield started
    pool.shutdown(wait=False, cancel_futures=True)


def _output(result: subprocess.CompletedProcess) -> str:
    return f"exit status {result.returncode}\n--- stdout\n{result.stdout}\n--- stderr\n{result.stderr[-4000:]}"


def test_the_docs_have_blocks_to_check():
    pages = {b.page.name for b, _ in PYTHON} | {b.page.name for b, _, _ in COMMANDS}
    assert {"algebra.md", "language.md", "cli.md", "index.md"} <= pages
    assert len(COMMANDS) >= 15 and len(PYTHON) >= 8


def test_no_install_command_is_run():
    """Install commands are shown for copying, never marked with `$ ` (which would run them)."""
    install = re.compile(r"^(sudo\s+)?(pip3?|python3?\s+-m\s+pip|uv\s+pip)\s")
    marked = [f"{_where(b)}: {c}" for b, c, _ in COMMANDS if install.match(c)]
    assert not marked, f"install commands must not start with '$ ': {marked}"


@pytest.mark.parametrize("block, pasted", PYTHON, ids=[_where(b) for b, _ in PYTHON])
def test_python_block(block: Block, pasted: str | None, runs):
    result = runs[block].result()
    assert result.returncode == 0, f"the python block at {_where(block)} failed\n{_output(result)}"
    if pasted is not None:
        assert result.stdout.rstrip("\n") == pasted.rstrip("\n"), \
            f"the output pasted under {_where(block)} is not what it prints\n{_output(result)}"


@pytest.mark.parametrize("block, command, pasted", COMMANDS,
                         ids=[f"{_where(b)} {c[:50]}" for b, c, _ in COMMANDS])
def test_command(block: Block, command: str, pasted: str, runs):
    result = runs[block, command].result()
    assert result.returncode == 0, f"`{command}` ({_where(block)}) failed\n{_output(result)}"
    assert result.stdout.rstrip("\n") == pasted.rstrip("\n"), \
        f"the output pasted under `{command}` ({_where(block)}) is not what it prints\n{_output(result)}"


# ---------------------------------------------------------------- the site

def _nav_pages(nav) -> list[str]:
    """The Markdown files of a mkdocs nav (nested lists of 'Title: file' or bare files)."""
    if isinstance(nav, str):
        return [nav]
    if isinstance(nav, list):
        return [p for entry in nav for p in _nav_pages(entry)]
    if isinstance(nav, dict):
        return [p for value in nav.values() for p in _nav_pages(value)]
    return []


def _built(site: Path, page: str) -> Path:
    stem = page[:-len(".md")]
    if stem == "index" or stem.endswith("/index"):
        return site / stem[:-len("index")] / "index.html"
    return site / stem / "index.html"


def _text(page: Path) -> str:
    """The visible words of a built page: tags stripped, entities decoded, spaces collapsed."""
    raw = re.sub(r"<(script|style)\b.*?</\1>", " ", page.read_text(), flags=re.S)
    return " ".join(html.unescape(re.sub(r"<[^>]+>", " ", raw)).split())


def _words(text: str) -> list[str]:
    return re.findall(r"[A-Za-z0-9_]+", text)


def _contains_words(page_text: str, passage: str) -> bool:
    """Whether the words of `passage` occur in this order, together, in the page
    (markup such as backticks and line breaks aside)."""
    return f" {' '.join(_words(passage))} " in f" {' '.join(_words(page_text))} "


@pytest.fixture(scope="module")
def site(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("site")
    with tempfile.TemporaryDirectory(prefix="einfold-doc-cache-") as cache:
        result = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "-d", str(out)],
                                cwd=ROOT, env=_env(cache), capture_output=True, text=True, timeout=TIMEOUT)
    assert result.returncode == 0, f"mkdocs build --strict failed\n{_output(result)}"
    return out


def _config() -> dict:
    import yaml
    return yaml.safe_load((ROOT / "mkdocs.yml").read_text())


def test_every_page_is_in_the_nav():
    nav = set(_nav_pages(_config()["nav"]))
    pages = {p.relative_to(DOCS).as_posix() for p in DOCS.rglob("*.md")}
    assert pages - nav == set(), "pages missing from the nav of mkdocs.yml"
    assert nav - pages == set(), "nav entries without a page"


def test_the_site_builds_with_every_nav_page(site: Path):
    for page in _nav_pages(_config()["nav"]):
        assert _built(site, page).is_file(), f"{page} is not in the built site"


def test_the_api_page_renders_the_docstrings(site: Path):
    import compiler
    api = _text(_built(site, "api.md"))
    for obj in (compiler.compile, compiler.Program, compiler.einsum, compiler.summary, compiler.EinfoldError):
        doc = inspect.getdoc(obj)
        assert doc, f"{obj.__name__} has no docstring"
        first = doc.split("\n\n")[0]
        assert _contains_words(api, first), f"the API page lacks the docstring of {obj.__name__}: {first!r}"


def test_each_example_has_a_page_that_includes_it(site: Path):
    for script in sorted((ROOT / "examples").glob("*.py")):
        page = DOCS / "examples" / f"{script.stem}.md"
        assert page.is_file(), f"no page docs/examples/{page.name} for {script.name}"
        assert f'--8<-- "examples/{script.name}"' in page.read_text(), f"{page.name} does not include {script.name}"
        built = _text(_built(site, f"examples/{script.stem}.md"))
        docstring = script.read_text().split('"""')[1].strip().split("\n")[0]
        assert _contains_words(built, docstring), f"the built page of {script.name} lacks its source"
        assert _contains_words(built, "def main"), f"the built page of {script.name} lacks its source"


def test_the_performance_plots_are_shown(site: Path):
    built = _built(site, "performance.md")
    sources = set(re.findall(r'<img[^>]*\bsrc="([^"]+)"', built.read_text()))
    shown = {(built.parent / s).resolve() for s in sources}
    for plot in sorted((DOCS / "bench").rglob("*.png")):
        target = (site / plot.relative_to(DOCS)).resolve()
        assert target in shown, f"docs/performance.md does not show {plot.relative_to(ROOT)}"
        assert target.is_file()


# ---------------------------------------------------------------- refreshing pasted outputs

def update(pages: list[Path]) -> None:
    """Rewrite the pasted outputs of these pages from what the commands and blocks print
    now (review the diff: a changed output may be a regression, not a doc to refresh)."""
    for page in (p.resolve() for p in pages):
        lines = page.read_text().split("\n")
        blocks = fenced_blocks(page)
        edits = []                                   # (start, end, new lines): lines[start:end]
        for b, pasted in PYTHON:
            if b.page == page and pasted is not None:
                after = blocks[blocks.index(b) + 1]
                edits.append((after.line, after.end - 1, _run_python(b.text)))
        for b, command, pasted in COMMANDS:
            if b.page == page:
                start = b.line + b.text.split("\n").index("$ " + command) + 1
                edits.append((start, start + (pasted.count("\n") + 1 if pasted else 0), _run_command(command)))
        for start, end, result in sorted(edits, key=lambda e: e[0], reverse=True):
            if result.returncode != 0:
                print(f"{page.name}:{start}: failed, left as it was\n{_output(result)}")
                continue
            new = result.stdout.rstrip("\n").split("\n") if result.stdout.strip() else []
            if lines[start:end] != new:
                print(f"{page.name}:{start}: output updated")
                lines[start:end] = new
        page.write_text("\n".join(lines))


if __name__ == "__main__":
    # python3 tests/test_docs.py --update docs/algebra.md [more pages]
    if sys.argv[1:2] != ["--update"] or len(sys.argv) < 3:
        sys.exit("usage: python3 tests/test_docs.py --update PAGE.md [PAGE.md ...]")
    update([Path(p) for p in sys.argv[2:]])
