"""`flash sweep` over the simulated recipe writes the same results a real sweep does: results.csv
(one ok row per setting, seconds per step in simulated seconds), results.md and the plots; async
reads faster than sync there. Margin: two simulated runs of a few steps, ~2 minutes."""

from __future__ import annotations

import csv
import io

import pytest


@pytest.mark.slow
@pytest.mark.margin
def test_sweep_of_the_simulated_recipe_writes_results_and_plots(tmp_path):
    from flash.app.sweep import sweep

    points, _ = sweep(
        "recipes/sim_rlvr.yaml",
        ["async_ratio=0,2", "train.steps=3", "task.eval_size=8", "checkpoint.enabled=false"],
        out=str(tmp_path),
        stream=io.StringIO(),
    )
    rows = list(csv.DictReader(open(tmp_path / "results.csv")))
    assert [r["status"] for r in rows] == ["ok", "ok"], rows
    s_per_step = {float(r["async_ratio"]): float(r["s_per_step"]) for r in rows}
    assert s_per_step[2.0] < s_per_step[0.0]  # simulated seconds, as the runs' summaries say
    assert s_per_step[0.0] > 20  # simulated (tens of seconds per 7B step), not the few wall seconds
    assert (tmp_path / "results.md").read_text().count("|") > 10
    assert (tmp_path / "plots" / "runs.png").exists() and (tmp_path / "plots" / "sweep.png").exists()
    assert len(points) == 2
