"""The size budgets and comment rules of docs/design.md's style section, over every Python file of the
project (packages, benchmarks and tests): files under 500 lines, functions under 60, and comments
that say what and why, never where the code came from (no issue or session numbers)."""

from __future__ import annotations

import ast
import io
import re
import tokenize
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
DIRS = ("flash", "controllers", "buffers", "algos", "recipes", "bench", "tests")
MAX_FILE, MAX_FUNC = 500, 60
HISTORY = re.compile(r"\b(issue|session)[\s-]*#?\d+|\bthe skeleton'?s?\b", re.IGNORECASE)


def python_files() -> list[Path]:
    return sorted(p for d in DIRS for p in (ROOT / d).rglob("*.py"))


def statements(nodes: list[ast.stmt]):
    """Every statement in ``nodes`` and in the blocks nested in them (a ``def`` is a statement, so
    expressions need no visit)."""
    for node in nodes:
        yield node
        for block in ("body", "orelse", "finalbody", "handlers", "cases"):
            inner = getattr(node, block, None)
            if isinstance(inner, list):
                yield from statements(inner)


def long_functions(source: str, limit: int = MAX_FUNC) -> list[tuple[str, int]]:
    """(name, lines) of every function or method longer than ``limit`` lines."""
    return [
        (n.name, n.end_lineno - n.lineno + 1)
        for n in statements(ast.parse(source).body)
        if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef)) and n.end_lineno - n.lineno + 1 > limit
    ]


def history_mentions(source: str) -> list[str]:
    """Comments and docstrings (any string token) that cite an issue, a session or the skeleton."""
    if not HISTORY.search(source):  # no match anywhere, so none in a comment or string: skip tokenizing
        return []
    tokens = tokenize.generate_tokens(io.StringIO(source).readline)
    return [
        t.string.strip()[:80]
        for t in tokens
        if t.type in (tokenize.COMMENT, tokenize.STRING) and HISTORY.search(t.string)
    ]


def test_files_stay_under_the_line_budget():
    big = {str(p.relative_to(ROOT)): n for p in python_files() if (n := len(p.read_text().splitlines())) > MAX_FILE}
    assert big == {}


@pytest.mark.cpu_budget(6)  # parses every Python file of the project: ~1.2 s of CPU on a quiet machine
def test_functions_stay_under_the_line_budget():
    long = {str(p.relative_to(ROOT)): fns for p in python_files() if (fns := long_functions(p.read_text()))}
    assert long == {}


def test_comments_describe_the_code_not_its_history():
    found = {
        str(p.relative_to(ROOT)): hits
        for p in python_files()
        if p.name != "test_style.py" and (hits := history_mentions(p.read_text()))
    }
    assert found == {}


def test_the_checks_can_fail():
    body = "\n".join(f"    x{i} = {i}" for i in range(61))
    assert long_functions(f"def f():\n{body}\n") == [("f", 62)]
    assert long_functions("def g():\n    return 1\n") == []
    assert history_mentions("# from the issue-2 sweep\n") == ["# from the issue-2 sweep"]
    nested = f"class C:\n    def m(self):\n        if x:\n            def inner():\n{body}\n"
    assert [name for name, _ in long_functions(nested.replace("\n    x", "\n                x"))] == ["m", "inner"]
    assert history_mentions("x = 1  # see issue 6\n") == ["# see issue 6"]
    assert history_mentions('"""Kept from the skeleton."""\n') != []
    assert history_mentions("y = 2  # the issuer signs it\n") == []
