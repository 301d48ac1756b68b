"""One top-level name: the folders algos/, buffers/, controllers/ and recipes/ are flash.algos,
flash.buffers, flash.controllers and flash.recipes (through the links in flash/), a wheel installs
only ``flash``, and no module of the project imports, or leaves in ``sys.modules``, a bare name
(one module under two names would hold two copies of every registry)."""

from __future__ import annotations

import ast
import importlib
import os
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
FOLDERS = ("algos", "buffers", "controllers", "recipes")
# every Python file of the project, the four folders by their own paths (flash/'s links not followed)
SOURCES = ("flash", *FOLDERS, "tests", "bench")
# what the CLI, the runner and Ray's workers import: the app, the controllers, the tasks, the roles
ENTRY_POINTS = (
    "flash.app.cli",
    "flash.app.runner",
    "flash.app.replay",
    "flash.recipes.tasks",
    "flash.controllers.async_controller",
    "flash.controllers.episode_runtime",
    "flash.controllers.tail_batching",
    "flash.train.worker",
    "flash.buffers.service",
    "flash.buffers.factory",
)


def bare_imports(tree: ast.AST) -> list[str]:
    """Absolute imports in ``tree`` whose top-level name is one of the four folders."""
    names = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names += [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names.append(node.module)
    return [n for n in names if n.split(".")[0] in FOLDERS]


def test_flash_links_each_folder_by_a_relative_link():
    for name in FOLDERS:
        link = ROOT / "flash" / name
        assert link.is_symlink() and os.readlink(link) == f"../{name}", link
        assert link.resolve() == (ROOT / name).resolve() and (ROOT / name / "__init__.py").is_file()


def test_the_wheel_holds_only_flash():
    from setuptools.config.setupcfg import read_configuration

    options = read_configuration(ROOT / "setup.cfg")["options"]
    packages = set(options["packages"])
    on_disk = {".".join(p.parent.relative_to(ROOT).parts) for p in (ROOT / "flash").glob("**/__init__.py")}
    on_disk |= {
        f"flash.{'.'.join(p.parent.relative_to(ROOT).parts)}"
        for name in FOLDERS
        for p in (ROOT / name).glob("**/__init__.py")
    }
    assert packages == on_disk
    assert {p.split(".")[0] for p in packages} == {"flash"}
    assert {
        "flash.algos",
        "flash.buffers",
        "flash.controllers",
        "flash.controllers.workflows",
        "flash.recipes",
        "flash.recipes.tasks",
    } <= packages
    assert not options.get("py_modules") and not options.get("package_dir")
    assert set(options["package_data"]) == {"flash.recipes"}


@pytest.mark.cpu_budget(6)  # parses every Python file of the project
def test_no_module_imports_a_bare_name():
    found = [
        f"{p.relative_to(ROOT)}: {name}"
        for top in SOURCES
        for p in sorted((ROOT / top).rglob("*.py"))
        for name in bare_imports(ast.parse(p.read_text(), str(p)))
    ]
    assert found == []


def test_the_scan_sees_every_form_of_a_bare_import():
    a, b, c, r = FOLDERS
    tree = ast.parse(
        f"import {a}\nimport {b}.wire as w\nfrom {c}.x import y\nfrom {r} import t\n"
        f"def f():\n    import {a}.metrics\nfrom flash import {a}\nfrom .types import Sample\n"
        f"import flash.{b}.wire\nimport {a}x\n"
    )
    assert bare_imports(tree) == [a, f"{b}.wire", f"{c}.x", r, f"{a}.metrics"]


def test_importing_the_entry_points_leaves_no_bare_module():
    for name in ENTRY_POINTS:
        importlib.import_module(name)
    assert sorted(k for k in sys.modules if k.split(".")[0] in FOLDERS) == []
    assert sys.modules["flash.algos"].__file__ == str(ROOT / "flash" / "algos" / "__init__.py")
