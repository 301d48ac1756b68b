"""The package layers hold: every import in the project (function-local ones included, annotation
-only ``TYPE_CHECKING`` blocks excepted) goes down the layers, and no two files or packages import
each other, directly or round a loop.

Layers, top to bottom: app (``flash.app``) → controllers → content (``flash.recipes``) → components
(the rest of ``flash``: engine, train, weights, rewards, envs, tasks, and the shared modules at
``flash/``'s top) → leaves (``flash.buffers``, ``flash.algos``, which import nothing of each other either).
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
# folder -> the package it is: flash/, and the folders that flash/'s links name (flash/algos -> ../algos)
TOP = {"flash": "flash", **{p.name: f"flash.{p.name}" for p in sorted((ROOT / "flash").iterdir()) if p.is_symlink()}}
LEAVES = ("flash.buffers", "flash.algos")


def project_modules() -> dict[str, Path]:
    """Dotted name -> file for every module of the project's packages."""
    mods = {}
    for top, package in TOP.items():
        for path in sorted((ROOT / top).rglob("*.py")):
            parts = [package, *path.relative_to(ROOT / top).with_suffix("").parts]
            if parts[-1] == "__init__":
                parts.pop()
            mods[".".join(parts)] = path
    return mods


def _type_checking(node: ast.AST) -> bool:
    test = getattr(node, "test", None)
    return isinstance(node, ast.If) and (
        (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING")
        or (isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")
    )


def _imports(tree: ast.AST):
    """Every Import / ImportFrom node outside ``if TYPE_CHECKING:`` blocks."""
    stack = [tree]
    while stack:
        node = stack.pop()
        if _type_checking(node):
            stack.extend(node.orelse)
            continue
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            yield node
        stack.extend(ast.iter_child_nodes(node))


def _package(module: str, is_pkg: bool) -> str:
    return module if is_pkg else module.rpartition(".")[0] or module


def import_edges(mods: dict[str, Path]) -> dict[str, set[str]]:
    """module -> the project modules it imports (``from pkg import sub`` names the submodule)."""
    edges: dict[str, set[str]] = {m: set() for m in mods}
    for mod, path in mods.items():
        here = _package(mod, path.name == "__init__.py")
        for node in _imports(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            else:
                base = node.module or ""
                if node.level:
                    up = here.split(".")[: len(here.split(".")) - (node.level - 1)]
                    base = ".".join(up + ([base] if base else []))
                targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in mods else base for a in node.names]
            edges[mod].update(t for t in targets if t in mods and t != mod)
    return edges


def top_package(module: str) -> str:
    """``flash.app``, ``flash.controllers``, ... for the layered packages; ``flash`` for the rest."""
    head = ".".join(module.split(".")[:2])
    return head if head in ("flash.app", "flash.controllers", "flash.recipes", *LEAVES) else "flash"


def layer(module: str) -> int:
    return {"flash.app": 4, "flash.controllers": 3, "flash.recipes": 2, "flash": 1}.get(top_package(module), 0)


def cycles(edges: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one node (Tarjan), each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in edges.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                found.append(sorted(comp))

    for v in sorted(edges):
        if v not in index:
            visit(v)
    return found


def package_edges(mods: dict[str, Path], edges: dict[str, set[str]]) -> dict[str, set[str]]:
    """Package -> packages it imports (a module belongs to the package whose directory holds it)."""
    pkg = {m: _package(m, p.name == "__init__.py") for m, p in mods.items()}
    out: dict[str, set[str]] = {}
    for m, targets in edges.items():
        out.setdefault(pkg[m], set()).update(pkg[t] for t in targets if pkg[t] != pkg[m])
    return out


@pytest.mark.cpu_budget(6)  # parses every Python file of the project
def test_imports_go_down_the_layers():
    mods = project_modules()
    bad = [
        f"{m} -> {t}"
        for m, ts in import_edges(mods).items()
        for t in sorted(ts)
        if layer(t) > layer(m) or (layer(m) == layer(t) == 0 and top_package(t) != top_package(m))
    ]
    assert bad == [], "imports against the layer order:\n" + "\n".join(bad)


@pytest.mark.cpu_budget(6)  # parses every Python file of the project
def test_no_import_cycle_between_files():
    assert cycles(import_edges(project_modules())) == []


@pytest.mark.cpu_budget(6)  # parses every Python file of the project
def test_no_import_cycle_between_packages():
    mods = project_modules()
    assert cycles(package_edges(mods, import_edges(mods))) == []


def test_the_checks_can_fail():
    """The walker sees a cycle, a function-local import, and an upward import when there is one."""
    edges = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": set()}
    assert cycles(edges) == [["a", "b", "c"]]
    tree = ast.parse("def f():\n    import flash.controllers.x\nif TYPE_CHECKING:\n    import flash.app.y\n")
    assert [a.name for n in _imports(tree) for a in n.names] == ["flash.controllers.x"]
    assert layer("flash.engine.client") < layer("flash.controllers.scheduler") < layer("flash.app.runner")
    assert layer("flash.buffers.wire") == layer("flash.algos") == 0 < layer("flash.recipes.tasks") == 2
    assert top_package("flash.buffers.wire") != top_package("flash.algos.policy")
    assert is_test_module("tests.unit.test_x") and is_test_module("tests.test_y")
    assert not is_test_module("tests.helpers.engine") and not is_test_module("flash.test_like")


def is_test_module(name: str) -> bool:
    """``tests.test_x`` or ``tests.<tier>.test_x``: a module of tests, never scaffolding."""
    parts = name.split(".")
    return parts[0] == "tests" and any(p.startswith("test_") for p in parts[1:])


@pytest.mark.cpu_budget(6)  # parses every Python file of the project
def test_no_test_module_imports_another():
    """Shared scaffolding lives in tests/helpers/ and tests/conftest.py, never in a test module."""
    tests = Path(__file__).resolve().parents[1]
    bad = [
        f"{p.name} -> {a.name if isinstance(n, ast.Import) else n.module}"
        for p in sorted(tests.rglob("*.py"))
        for n in _imports(ast.parse(p.read_text()))
        for a in (n.names if isinstance(n, ast.Import) else [n])
        if is_test_module((a.name if isinstance(n, ast.Import) else n.module) or "")
    ]
    assert bad == []
