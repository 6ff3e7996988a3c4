"""The import graph of compiler/ runs one way, down the pipeline.

parse -> check -> IR -> algebra/passes -> schedule -> backend, with the
runtime on top: compiled.py (the program as it runs), below the code that
wraps a program (autograd.py, distributed.py), below program.py, the entry
points.  Every import counts, including those inside functions: a lazy import
hides a circle, it does not remove it.
"""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parent.parent / "compiler"


def _module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


MODULES = {_module_name(path): path for path in sorted(PACKAGE.rglob("*.py"))}


def _imports(module: str) -> list[tuple[str, str | None, bool]]:
    """(imported module, imported name or None, whether inside a function) for
    every import in `module` of a module of compiler/."""
    path = MODULES[module]
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    found = []

    def visit(node: ast.AST, lazy: bool) -> None:
        if isinstance(node, ast.Import):
            found.extend((alias.name, None, lazy) for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = package
            for _ in range(node.level - 1):
                base = base.rpartition(".")[0]
            target = ".".join(filter(None, [base if node.level else "", node.module or ""]))
            for alias in node.names:
                # `from .pkg import submodule` imports the submodule itself.
                submodule = f"{target}.{alias.name}"
                found.append((submodule, None, lazy) if submodule in MODULES else (target, alias.name, lazy))
        lazy = lazy or isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef)
        for child in ast.iter_child_nodes(node):
            visit(child, lazy)

    visit(ast.parse(path.read_text(), str(path)), False)
    return [(target, name, lazy) for target, name, lazy in found if target in MODULES]


IMPORTS = {module: _imports(module) for module in MODULES}

GRAPH = {module: sorted({target for target, _, _ in IMPORTS[module]} - {module}) for module in MODULES}


def _strongly_connected_components(graph: dict[str, list[str]]) -> list[list[str]]:
    """Tarjan's algorithm, iterative so deep graphs cannot overflow the stack."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    components = []
    for root in graph:
        if root in index:
            continue
        work = [(root, iter(graph[root]))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            node, successors = work[-1]
            for successor in successors:
                if successor not in index:
                    index[successor] = low[successor] = len(index)
                    stack.append(successor)
                    on_stack.add(successor)
                    work.append((successor, iter(graph[successor])))
                    break
                if successor in on_stack:
                    low[node] = min(low[node], index[successor])
            else:
                work.pop()
                if work:
                    low[work[-1][0]] = min(low[work[-1][0]], low[node])
                if low[node] == index[node]:
                    component = []
                    while True:
                        member = stack.pop()
                        on_stack.discard(member)
                        component.append(member)
                        if member == node:
                            break
                    components.append(sorted(component))
    return components


def test_modules_are_found():
    assert {"compiler.ir", "compiler.program", "compiler.backend.triton.emit"} <= MODULES.keys()


def test_no_import_cycles():
    cycles = [component for component in _strongly_connected_components(GRAPH) if len(component) > 1]
    assert not cycles, "import cycles between modules:\n" + "\n".join(" <-> ".join(c) for c in cycles)


def test_backend_does_not_import_the_runtime():
    upward = [(module, target) for module in MODULES if module.startswith("compiler.backend")
              for target in GRAPH[module] if target == "compiler.program"]
    assert not upward, f"backend imports compiler.program: {upward}"


def test_no_private_names_cross_modules():
    private = [f"{module} imports {target}.{name}" for module in MODULES for target, name, _ in IMPORTS[module]
               if name is not None and name.startswith("_") and not name.startswith("__") and target != module]
    assert not private, "private names imported across modules:\n" + "\n".join(private)


def test_cycle_finder_sees_a_circle():
    graph = {"a": ["b"], "b": ["c"], "c": ["a"], "d": ["a"]}
    assert sorted(map(sorted, _strongly_connected_components(graph))) == [["a", "b", "c"], ["d"]]
