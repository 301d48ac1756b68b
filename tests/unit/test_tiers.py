"""The extended tier's list (tests/extended.txt) names tests that exist, each once."""

import ast
from pathlib import Path

from tests.helpers.tiers import EXTENDED_LIST, extended_ids

ROOT = EXTENDED_LIST.parents[1]


def _functions(path: Path) -> set[str]:
    """The test functions a module defines."""
    return {
        node.name
        for node in ast.walk(ast.parse(path.read_text()))
        if isinstance(node, ast.FunctionDef) and node.name.startswith("test_")
    }


def test_every_listed_test_exists_once_outside_the_unit_tier():
    ids = extended_ids()
    assert len(ids) == len(set(ids)), "a test listed twice"
    modules: dict[str, set[str]] = {}
    for nodeid in ids:
        file, _, name = nodeid.partition("::")
        assert not file.startswith("tests/unit/"), f"{nodeid}: the unit tier is all in the default run"
        assert (ROOT / file).is_file(), f"{nodeid}: no such file"
        assert name.partition("[")[0] in modules.setdefault(file, _functions(ROOT / file)), (
            f"{nodeid}: no such test in {file}"
        )


def test_the_list_reads_ids_and_skips_comments(tmp_path):
    listed = tmp_path / "extended.txt"
    listed.write_text("# a header\n\ntests/e2e/test_a.py::test_b[1-x]  # 12 s\n  tests/e2e/test_c.py::test_d\n")
    assert extended_ids(listed) == ["tests/e2e/test_a.py::test_b[1-x]", "tests/e2e/test_c.py::test_d"]
