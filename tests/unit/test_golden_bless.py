"""``python -m tests.golden bless``: golden files change only behind a passing learning test, and
each bless leaves its learning record in BENCHMARKS.md (a fake learning result and a fake golden
run here; the learning tests themselves take minutes)."""

import json

import pytest

from tests import golden
from tests.golden import bless

BENCH = "# Benchmarks\n\n## Current\n\n| a | b |\n|---|---|\n| 1 | 2 |\n\n## History\n\n### old\n"


def record(recipe: str, loss: float = 0.5) -> dict:
    return {
        "recipe": recipe,
        "overrides": golden.overrides(recipe),
        "tokens": [[1, 2, 3], [4]],
        "step0_response_tokens": 4,
        "steps": [{"step": 1, "loss": loss, "grad_norm": 1.0, "reward_mean": 0.25}],
    }


@pytest.fixture
def place(tmp_path):
    (tmp_path / "BENCHMARKS.md").write_text(BENCH)
    golden.write_golden(record("math", loss=0.1), tmp_path)
    golden.write_golden(record("corridor", loss=0.1), tmp_path)
    return tmp_path


def fake_learning(passed: bool, accuracies=((0.708, 0.891),)):
    calls = []

    def learn(learning):
        calls.append(learning.node)
        return bless.LearningResult(learning, passed, list(accuracies))

    return learn, calls


def run_bless(place, recipe, learn):
    return bless.bless(
        recipe, learn, record, golden_dir=place, benchmarks=place / "BENCHMARKS.md", commit="abc1234", date="2026-12-01"
    )


def test_a_passing_learning_test_rewrites_the_golden_file_and_appends_its_row(place):
    learn, calls = fake_learning(True)
    assert run_bless(place, "math", learn)
    assert calls == ["tests/integration/test_wordproblems.py::test_math_recipe_learns"]
    assert golden.read_golden("math", place)["steps"][0]["loss"] == 0.5
    text = (place / "BENCHMARKS.md").read_text()
    row = (
        "| abc1234 | 2026-12-01 | math | `tests/integration/test_wordproblems.py::test_math_recipe_learns` | "
        "0.708 → 0.891 (+0.183) | +0.10 |"
    )
    assert text == BENCH.replace("## History", "\n".join([bless.SECTION, "", *bless.HEADER, row, "", "## History"]))
    assert run_bless(place, "math", learn)  # a second bless: its row after the first, in the same table
    lines = (place / "BENCHMARKS.md").read_text().splitlines()
    assert lines.count(row) == 2 and lines.index(row) + 1 == len(lines) - 1 - lines[::-1].index(row)
    assert lines.count(bless.SECTION) == 1


def test_a_failing_learning_test_leaves_the_golden_file_and_benchmarks_as_they_were(place, capsys):
    learn, _ = fake_learning(False)
    assert not run_bless(place, "math", learn)
    assert golden.read_golden("math", place)["steps"][0]["loss"] == 0.1
    assert (place / "BENCHMARKS.md").read_text() == BENCH
    assert (
        "learning test tests/integration/test_wordproblems.py::test_math_recipe_learns failed"
        in capsys.readouterr().out
    )


def test_every_learning_test_of_a_recipe_runs_and_each_gets_a_row(place):
    learn, calls = fake_learning(True, [(0.289, 0.586)])
    assert run_bless(place, "stutter", learn)
    assert calls == [x.node for x in bless.LEARNING["stutter"]]
    rows = [x for x in (place / "BENCHMARKS.md").read_text().splitlines() if "| stutter |" in x]
    assert [r.rsplit("|", 2)[1].strip() for r in rows] == ["+0.20", "+0.15"]
    assert golden.read_golden("stutter", place)["recipe"] == "stutter"


def test_a_recipe_without_a_learning_test_is_blessed_with_a_warning_and_a_row_that_says_so(place, capsys):
    learn, calls = fake_learning(True)
    assert "corridor" not in bless.LEARNING
    assert run_bless(place, "corridor", learn)
    assert calls == []
    assert "WARNING: recipe 'corridor' has no learning test" in capsys.readouterr().out
    assert (
        "| abc1234 | 2026-12-01 | corridor | none (blessed without a learning test) | — | — |"
        in (place / "BENCHMARKS.md").read_text()
    )
    assert json.loads((place / "corridor.json").read_text())["steps"][0]["loss"] == 0.5


def test_a_recipe_without_golden_values_is_refused_with_the_reason(place, capsys):
    learn, calls = fake_learning(True)
    assert not run_bless(place, "sim_rlvr", learn)
    assert calls == [] and "no model is trained" in capsys.readouterr().out
    assert bless.main(["bles", "math"]) == 2


def test_learning_figures_come_from_the_runs_summaries():
    assert bless.summary_accuracies({"eval_accuracy_initial": 0.25, "eval_accuracy_final": 0.5, "x": 1}) == (0.25, 0.5)
    result = bless.LearningResult(bless.Learning("t.py::x", 0.1), True, [])
    assert bless.benchmarks_rows("c", "d", "r", [result]) == ["| c | d | r | `t.py::x` | no summary found | +0.10 |"]


def test_every_learning_node_names_a_test_function_of_its_file():
    for learnings in bless.LEARNING.values():
        for learning in learnings:
            path, name = learning.node.split("::")
            assert f"def {name.split('[')[0]}(" in (golden.ROOT / path).read_text(), learning.node
