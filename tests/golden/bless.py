"""``python -m tests.golden bless RECIPE [...]``: new golden values, only behind a learning run.

For each recipe: run its learning test (``LEARNING``: the pytest node ids and the gain each asserts)
in a pytest process of its own; only if it passes, run the recipe's golden shape, rewrite
``tests/golden/RECIPE.json`` and append one row per learning run to the table "Learning results
behind the golden values" in BENCHMARKS.md (commit, date, recipe, held-out before -> after, bar),
so the golden change and its learning record land together. A recipe without a learning test is
blessed with a warning that says so, and its row says so too.
"""

from __future__ import annotations

import datetime
import json
import os
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from tests import golden

BENCHMARKS = golden.ROOT / "BENCHMARKS.md"
SECTION = "## Learning results behind the golden values"
HEADER = [
    "| commit | date | recipe | learning test | held-out before → after | bar (least gain) |",
    "|---|---|---|---|---|---|",
]


@dataclass(frozen=True)
class Learning:
    """A learning test of a recipe: its pytest node id and the least held-out gain it asserts."""

    node: str
    bar: float


LEARNING: dict[str, list[Learning]] = {
    "stutter": [
        Learning("tests/e2e/test_default_recipe.py::test_default_recipe_learns[0-0]", 0.20),
        Learning("tests/e2e/test_default_recipe.py::test_default_recipe_learns[2-0]", 0.15),
    ],
    "math": [Learning("tests/integration/test_wordproblems.py::test_math_recipe_learns", 0.10)],
    "reasoning_gym": [Learning("tests/integration/test_reasoning_gym.py::test_the_reasoning_gym_recipe_learns", 0.04)],
    "code": [
        Learning(
            "tests/learning/test_recipes_learn.py::test_code_recipe_learns_with_the_adaptive_sandbox_timeout", 0.25
        )
    ],
    "frozenlake": [Learning("tests/learning/test_recipes_learn.py::test_frozenlake_recipe_learns", 0.10)],
    "calculator": [
        Learning("tests/learning/test_recipes_learn.py::test_calculator_agent_learns_to_call_its_tool", 0.20)
    ],
    "verifiers_tool": [
        Learning("tests/learning/test_verifiers_learns.py::test_a_verifiers_tool_env_learns_to_call_its_tool", 0.40)
    ],
}


@dataclass(frozen=True)
class LearningResult:
    """One learning test's outcome: passed or not, and its runs' held-out accuracy before and after."""

    learning: Learning
    passed: bool
    accuracies: list[tuple[float, float]]


def run_learning(learning: Learning) -> LearningResult:
    """The learning test in a pytest process of its own (every marker selected); the held-out
    accuracies of the runs it made, read from the summary.json files under its temporary dir."""
    with tempfile.TemporaryDirectory(prefix="flash-bless-") as tmp:
        cmd = [
            sys.executable,
            "-m",
            "pytest",
            "-q",
            "-p",
            "no:cacheprovider",
            "-m",
            "",
            f"--basetemp={tmp}/t",
            learning.node,
        ]
        env = {**os.environ, "PYTHONPATH": str(golden.ROOT)}
        print(f"bless: running the learning test {learning.node} (minutes)", flush=True)
        done = subprocess.run(cmd, cwd=golden.ROOT, env=env, check=False)
        accuracies = [summary_accuracies(json.loads(p.read_text())) for p in sorted(Path(tmp).rglob("summary.json"))]
    return LearningResult(learning, done.returncode == 0, accuracies)


def summary_accuracies(summary: dict) -> tuple[float, float]:
    return float(summary["eval_accuracy_initial"]), float(summary["eval_accuracy_final"])


def commit_id(root: Path = golden.ROOT) -> str:
    """The checkout's short commit, ``+changes`` when its tracked files differ from it."""

    def git(*args: str) -> str:
        return subprocess.run(["git", *args], cwd=root, capture_output=True, text=True, check=False).stdout.strip()

    head = git("rev-parse", "--short", "HEAD") or "unknown"
    return head + ("+changes" if git("status", "--porcelain", "--untracked-files=no") else "")


def benchmarks_rows(commit: str, date: str, recipe: str, results: list[LearningResult]) -> list[str]:
    """The table rows of one bless: one per learning run; one saying there is none without a test."""
    if not results:
        return [f"| {commit} | {date} | {recipe} | none (blessed without a learning test) | — | — |"]
    rows = []
    for r in results:
        figures = ", ".join(f"{a:.3f} → {b:.3f} ({b - a:+.3f})" for a, b in r.accuracies) or "no summary found"
        rows.append(f"| {commit} | {date} | {recipe} | `{r.learning.node}` | {figures} | +{r.learning.bar:.2f} |")
    return rows


def append_rows(text: str, rows: list[str]) -> str:
    """BENCHMARKS.md's text with ``rows`` at the end of the golden values' table (the section and its
    header made before "## History", or at the end, when absent)."""
    lines = text.splitlines()
    if SECTION not in lines:
        block = [SECTION, "", *HEADER, ""]
        at = lines.index("## History") if "## History" in lines else len(lines)
        lines[at:at] = block
    i = lines.index(SECTION) + 1
    while i < len(lines) and not lines[i].startswith("|"):
        i += 1
    while i < len(lines) and lines[i].startswith("|"):
        i += 1
    lines[i:i] = rows
    return "\n".join(lines) + "\n"


def bless(
    recipe: str,
    learn: Callable[[Learning], LearningResult],
    measure: Callable[[str], dict],
    golden_dir: Path = golden.GOLDEN_DIR,
    benchmarks: Path = BENCHMARKS,
    commit: str | None = None,
    date: str | None = None,
) -> bool:
    """Bless one recipe: its learning tests, then (only if all pass) its golden file and its rows."""
    if recipe not in golden.SHAPES:
        known = ", ".join(sorted(golden.SHAPES))
        print(
            f"bless: no golden values for recipe {recipe!r}: {golden.NOT_PINNED.get(recipe, 'not a shipped recipe')}"
            f" (recipes with golden values: {known})",
            flush=True,
        )
        return False
    results = []
    for learning in LEARNING.get(recipe, []):
        result = learn(learning)
        if not result.passed:
            print(
                f"bless: {recipe}: the learning test {learning.node} failed; the golden values stay as they are",
                flush=True,
            )
            return False
        results.append(result)
    if not results:
        print(
            f"bless: WARNING: recipe {recipe!r} has no learning test; its golden values are blessed without a "
            f"learning record",
            flush=True,
        )
    path = golden.write_golden(measure(recipe), golden_dir)
    rows = benchmarks_rows(commit or commit_id(), date or datetime.date.today().isoformat(), recipe, results)
    benchmarks.write_text(append_rows(benchmarks.read_text(), rows))
    print(f"bless: {recipe}: wrote {path} and {len(rows)} row(s) in {benchmarks.name}", flush=True)
    return True


def measure_in_process(recipe: str) -> dict:
    """The recipe's golden run here, on a local Ray, warm starts in ``$FLASH_TEST_CACHE`` if set."""
    from flash.cluster import init_ray

    init_ray(None, num_cpus=2)
    with tempfile.TemporaryDirectory(prefix="flash-golden-") as tmp:
        return golden.run_golden(recipe, Path(tmp) / "run", os.environ.get("FLASH_TEST_CACHE") or f"{tmp}/cache")


USAGE = "usage: python -m tests.golden bless RECIPE [RECIPE ...]"


def main(argv: list[str]) -> int:
    if len(argv) < 2 or argv[0] != "bless":
        print(USAGE, file=sys.stderr)
        return 2
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    ok = [bless(recipe, run_learning, measure_in_process) for recipe in argv[1:]]
    return 0 if all(ok) else 1
