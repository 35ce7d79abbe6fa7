"""The import graph of ``qworker`` has no cycles and no arrow pointing up a layer.

Layers, top to bottom: ``worker`` -> ``engine`` -> ``model``; ``openai_batch`` sits beside the
worker but below it (the worker decodes OpenAI lines; the batch tool never reaches into the
worker). Shared pieces that both need (the producer-side client, the job-id rule) live below
both. Read from the source with ``ast`` (nothing is imported), counting imports inside
functions too (a lazy import still ties two modules together), but not ``TYPE_CHECKING`` ones.
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = "qworker"

# (importer prefix, forbidden imported prefix)
FORBIDDEN = [
    ("qworker.engine", "qworker.worker"),
    ("qworker.engine", "qworker.openai_batch"),
    ("qworker.openai_batch", "qworker.worker"),
    ("qworker.model", "qworker.engine"),
    ("qworker.model", "qworker.worker"),
]


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def _imports(tree: ast.AST, module: str, is_package: bool, known: set[str]) -> set[str]:
    """The ``qworker`` modules ``module`` imports: ``from a import b`` names ``a.b`` when that
    is a module, else ``a``."""
    out: set[str] = set()

    def visit(node: ast.AST) -> None:
        if isinstance(node, ast.If) and _is_type_checking(node.test):
            for child in node.orelse:
                visit(child)
            return
        if isinstance(node, ast.Import):
            out.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = module.split(".") if is_package else module.split(".")[:-1]
                base = base[: len(base) - (node.level - 1)]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            for a in node.names:
                sub = f"{target}.{a.name}"
                out.add(sub if sub in known else target)
        for child in ast.iter_child_nodes(node):
            visit(child)

    visit(tree)
    return {m for m in out if m == PACKAGE or m.startswith(PACKAGE + ".")}


def import_graph() -> dict[str, set[str]]:
    files = {_module_name(p): p for p in (ROOT / PACKAGE).rglob("*.py")}
    known = set(files)
    graph = {}
    for name, path in files.items():
        tree = ast.parse(path.read_text(encoding="utf-8"), str(path))
        graph[name] = {m for m in _imports(tree, name, path.name == "__init__.py", known) if m in known and m != name}
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components with more than one module (Tarjan, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    on_stack: set[str] = set()
    stack: list[str] = []
    found: list[list[str]] = []
    counter = 0
    for root in sorted(graph):
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = counter
        counter += 1
        stack.append(root)
        on_stack.add(root)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = counter
                    counter += 1
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph[child]))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                comp = []
                while True:
                    m = stack.pop()
                    on_stack.discard(m)
                    comp.append(m)
                    if m == node:
                        break
                if len(comp) > 1:
                    found.append(sorted(comp))
    return found


def _under(module: str, prefix: str) -> bool:
    return module == prefix or module.startswith(prefix + ".")


def upward(graph: dict[str, set[str]]) -> list[tuple[str, str]]:
    return sorted((a, b) for a, deps in graph.items() for b in deps for low, high in FORBIDDEN if _under(a, low) and _under(b, high))


def test_no_import_cycles() -> None:
    graph = import_graph()
    assert len(graph) > 50, "the scan found too few modules to mean anything"
    assert cycles(graph) == []


def test_no_upward_imports() -> None:
    assert upward(import_graph()) == []


def test_the_checks_see_a_cycle_and_an_upward_import() -> None:
    """The checks themselves: a planted circle and a planted upward arrow are both reported."""
    planted = {"qworker.engine.a": {"qworker.engine.b"}, "qworker.engine.b": {"qworker.worker.app"}, "qworker.worker.app": {"qworker.engine.a"}}
    assert cycles(planted) == [["qworker.engine.a", "qworker.engine.b", "qworker.worker.app"]]
    assert upward(planted) == [("qworker.engine.b", "qworker.worker.app")]
    source = "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from qworker.worker import app\ndef f():\n    from qworker.engine import llm\n"
    assert _imports(ast.parse(source), "qworker.x", False, {"qworker.worker.app", "qworker.engine.llm"}) == {"qworker.engine.llm"}
