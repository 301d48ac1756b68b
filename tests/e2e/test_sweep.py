"""`flash sweep` and `flash plot`.

Fast tests replace the run subprocess with one that writes a made-up run dir, so the grid,
resume, tables, plots and recommendation are checked in seconds; the slow test runs a real
two-point sweep of the default recipe (tiny overrides) through `python -m flash.app.cli`.
"""

import csv
import io
import json
import subprocess
import sys
import time
from pathlib import Path

import pytest

import flash.app.sweep as sw
from flash.errors import ConfigError
from flash.app.plot import load_run, plot_runs, plot_sweep
from flash.app.replicates import group_runs

PNG = b"\x89PNG\r\n\x1a\n"
LINE_PANELS = ("reward_vs_step", "reward_vs_time", "eval_vs_step", "eval_vs_time")


def fake_run(run_dir: Path, ratio: float, acc: float, s_per_step: float, steps: int = 4) -> None:
    """A run dir as `flash run` writes it, with chosen speed and final accuracy."""
    stale = min(int(ratio), 1)
    t0 = 1000.0
    metrics, timeline = [], []
    for k in range(1, steps + 1):
        metrics.append(
            {
                "step": k,
                "reward/mean": 0.1 * k,
                "time/step": s_per_step,
                "time/elapsed": k * s_per_step,
                "staleness/mean": stale / 2,
                "staleness/max": float(stale),
                "staleness/count_0": 4.0,
                f"staleness/count_{stale}": 4.0,
                "rollout/idle_ratio": 0.5 - 0.1 * stale,
                "train/idle_ratio": 0.6,
                "rollout/tokens_generated": 100.0,
                "train/batch_tokens": 80.0,
            }
        )
        a = t0 + (k - 1) * s_per_step
        timeline.append(
            {
                "step": k,
                "phases": {
                    "get_batch": [a, a + 0.3 * s_per_step],
                    "train": [a + 0.3 * s_per_step, a + 0.9 * s_per_step],
                    "push_weights": [a + 0.9 * s_per_step, a + s_per_step],
                },
                "engine_busy": [[a, a + 0.5 * s_per_step]],
                "trainer_busy": [[a + 0.3 * s_per_step, a + 0.9 * s_per_step]],
            }
        )
    evals = [
        {"step": 0, "elapsed": 0.0, "accuracy": 0.1},
        {"step": steps, "elapsed": steps * s_per_step, "accuracy": acc},
    ]
    summary = {
        "eval_accuracy_initial": 0.1,
        "eval_accuracy_final": acc,
        "steps": steps,
        "wall_seconds": 10.0,
        "train_seconds": steps * s_per_step,
        "seconds_per_step": s_per_step,
        "samples_trained": 8 * steps,
        "max_staleness_observed": float(stale),
        "async_ratio": ratio,
    }
    for name, rows in (("metrics", metrics), ("timeline", timeline), ("eval", evals)):
        (run_dir / f"{name}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (run_dir / "summary.json").write_text(json.dumps(summary))


class Launches(list):
    """Slugs launched, in order; ``table[(ratio, seed)] = (accuracy, s_per_step)`` overrides the formula."""

    def __init__(self):
        super().__init__()
        self.table: dict[tuple[float, int], tuple[float, float]] = {}


@pytest.fixture
def fake_launch(monkeypatch):
    """Replace the `flash run` subprocess: async ratio r runs at 1/(1+r/2) s/step, accuracy 0.5 − 0.01·r
    (unless the test's table names the run's ratio and seed)."""
    launched = Launches()

    def launch(recipe, point, out, extra):
        given = dict(o.split("=", 1) for o in point.overrides)
        ratio, seed = float(given.get("async_ratio", 0)), int(given.get("seed", 0))
        acc, s_per_step = launched.table.get((ratio, seed), (0.5 - 0.01 * ratio, 1.0 / (1 + ratio / 2)))
        fake_run(out / point.slug, ratio, acc, s_per_step)
        launched.append(point.slug)
        return subprocess.Popen([sys.executable, "-c", "pass"])

    monkeypatch.setattr(sw, "_launch", launch)
    return launched


def test_split_values_keeps_lists_whole():
    assert sw.split_values("0,1,2.5") == ["0", "1", "2.5"]
    assert sw.split_values("[0.9,0.99],[0.9,0.999]") == ["[0.9,0.99]", "[0.9,0.999]"]
    assert sw.split_values("'a,b',c") == ["'a,b'", "c"]
    fixed, swept = sw.parse_grid(["async_ratio=0,2", "train.steps=3", "train.betas=[0.9,0.99],[0.9,0.999]"])
    assert fixed == ["train.steps=3"]
    assert swept == {"async_ratio": ["0", "2"], "train.betas": ["[0.9,0.99]", "[0.9,0.999]"]}
    points = sw.make_points(fixed, swept)
    assert len(points) == 4 and len({p.slug for p in points}) == 4
    assert points[1].overrides == ["train.steps=3", "async_ratio=0", "train.betas=[0.9,0.999]"]


def test_bad_grids_fail_before_any_run(tmp_path, fake_launch):
    with pytest.raises(ConfigError, match="did you mean 'async_ratio'"):
        sw.sweep("stutter", ["asyn_ratio=0,1"], out=str(tmp_path), stream=io.StringIO())
    with pytest.raises(ConfigError, match="run_dir is set by the sweep"):
        sw.parse_grid(["run_dir=x"])
    assert fake_launch == []


@pytest.mark.parametrize(
    "option, message",
    [
        ({"tolerance": float("nan")}, "--tolerance nan: must be a finite number >= 0"),
        ({"tolerance": -0.02}, "--tolerance -0.02: must be"),
        ({"tolerance": float("inf")}, "--tolerance inf: must be"),
        ({"parallel": 0}, "--parallel 0: must be at least 1"),
    ],
)
def test_options_that_mean_nothing_fail_before_any_run(tmp_path, fake_launch, option, message):
    """A NaN tolerance ran the whole grid, then recommended nothing; --parallel 0 quietly became 1."""
    with pytest.raises(ConfigError, match=message):
        sw.sweep("stutter", ["async_ratio=0,1"], out=str(tmp_path), stream=io.StringIO(), **option)
    assert fake_launch == []


def test_sweep_tables_plots_recommendation_and_resume(tmp_path, fake_launch):
    out = tmp_path / "sweep"
    log = io.StringIO()
    points, rec = sw.sweep(
        "stutter", ["async_ratio=0,1,2,4", "train.steps=4"], out=str(out), tolerance=0.025, stream=log
    )
    assert fake_launch == ["async_ratio-0", "async_ratio-1", "async_ratio-2", "async_ratio-4"]
    # r=4 is fastest but 0.04 below sync; r=2 is the fastest within 0.025 (one run each: no SE)
    assert rec.startswith(
        "recommendation: async_ratio=2 (n=1) -- 2.00x ± — the synchronous speed "
        "(0.50 ± — vs 1.00 ± — s/step), final held-out accuracy 0.480 ± — vs 0.500 ± —"
    )
    rows = list(csv.DictReader(open(out / "results.csv")))
    assert [r["async_ratio"] for r in rows] == ["0", "1", "2", "4"]
    assert float(rows[3]["speedup"]) == pytest.approx(3.0) and float(rows[0]["idle_rollout"]) == pytest.approx(0.5)
    md = (out / "results.md").read_text()
    assert "| async_ratio | n | wall_s | s_per_step | speedup |" in md and rec in md and rec in log.getvalue()
    assert "| 4 | 1 | 10 ± — | 0.333 ± — | 3 ± — |" in md
    assert "## runs" not in md  # one run per setting: the settings table is the runs table
    for png in ("runs.png", "sweep.png"):
        assert (out / "plots" / png).read_bytes()[:8] == PNG
    counts = plot_runs([load_run(out / p.slug) for p in points], tmp_path / "check.png")
    assert all(counts[k] == 4 for k in (*LINE_PANELS, "staleness", "timeline"))
    assert counts["throughput"] == 2  # generated and trained

    again = io.StringIO()
    _, rec2 = sw.sweep("stutter", ["async_ratio=0,1,2,4", "train.steps=4"], out=str(out), tolerance=0.025, stream=again)
    assert len(fake_launch) == 4 and rec2 == rec  # nothing re-run
    assert again.getvalue().count("finished earlier, skipped") == 4


def test_seeds_are_replicates_grouped_by_setting_with_mean_and_se(tmp_path, fake_launch):
    """Three seeds of three ratios: one row per setting with n = 3 and mean ± SE; the recommendation
    is made on the means and never names a seed (ratio 4's seed 0 alone would have passed)."""
    fake_launch.table = {
        (0, 0): (0.50, 1.0),
        (0, 1): (0.50, 1.2),
        (0, 2): (0.50, 1.1),
        (2, 0): (0.49, 0.5),
        (2, 1): (0.50, 0.5),
        (2, 2): (0.48, 0.55),
        (4, 0): (0.52, 0.35),
        (4, 1): (0.40, 0.30),
        (4, 2): (0.42, 0.40),
    }
    out = tmp_path / "sweep"
    points, rec = sw.sweep(
        "stutter",
        ["async_ratio=0,2,4", "seed=0,1,2", "train.steps=4"],
        out=str(out),
        tolerance=0.025,
        stream=io.StringIO(),
    )
    # replicates outermost: each seed runs every ratio back to back
    assert fake_launch == [f"async_ratio-{r}__seed-{s}" for s in (0, 1, 2) for r in (0, 2, 4)]
    # r=2: speed-ups paired by seed 1.0/0.5, 1.2/0.5, 1.1/0.55 = 2, 2.4, 2 → 2.133 ± 2/15;
    # s/step 0.5, 0.5, 0.55 → 0.517 ± 0.0167 vs 1.1 ± 0.1/√3; accuracy 0.49 ± 0.01/√3 vs 0.5 ± 0
    assert rec == (
        "recommendation: async_ratio=2 (n=3) -- 2.13x ± 0.13 the synchronous speed (0.52 ± 0.02 vs "
        "1.10 ± 0.06 s/step), final held-out accuracy 0.490 ± 0.006 vs 0.500 ± 0.000 (synchronous n=3; "
        "tolerance 0.025, gap + SE within it)"
    )
    rows = list(csv.DictReader(open(out / "results.csv")))  # one row per run, its seed kept
    assert [(r["async_ratio"], r["seed"]) for r in rows] == [(r, s) for s in "012" for r in "024"]
    assert float(rows[5]["speedup"]) == pytest.approx(1.2 / 0.3)  # ratio 4, seed 1: beside sync seed 1
    md = (out / "results.md").read_text()
    table = md.split("\n\n")[2].splitlines()
    assert table[0].startswith("| async_ratio | n | wall_s | s_per_step | speedup |") and len(table) == 5
    assert table[2].startswith("| 0 | 3 | 10 ± 0 | 1.1 ± 0.0577 | 1 ± 0 |")
    assert table[3].startswith("| 2 | 3 | 10 ± 0 | 0.517 ± 0.0167 | 2.13 ± 0.133 |")
    # ratio 4: speed-ups 2.857, 4, 2.75 → 3.20 ± 0.400; accuracy 0.52, 0.40, 0.42 → 0.447 ± 0.0371
    assert table[4].startswith("| 4 | 3 | 10 ± 0 | 0.35 ± 0.0289 | 3.2 ± 0.4 |")
    assert "| 0.447 ± 0.0371 | 0.447 ± 0.0371 |" in table[4] and "seed" not in table[0]
    assert "## runs" in md and "| async_ratio | seed | status |" in md
    groups = group_runs([(p.settings, p.row) for p in points], sw.METRICS)
    counts = plot_sweep(groups, tmp_path / "check.png", 0.025)
    assert counts == {"seconds_per_step": 3, "accuracy": 1, "error_bars": 2}
    assert (out / "plots" / "sweep.png").read_bytes()[:8] == PNG


def test_repeats_rerun_each_setting_and_reuse_the_first(tmp_path, fake_launch):
    out = tmp_path / "sweep"
    sw.sweep("stutter", ["async_ratio=0,2"], out=str(out), stream=io.StringIO())
    _, rec = sw.sweep("stutter", ["async_ratio=0,2"], out=str(out), stream=io.StringIO(), repeats=2)
    assert fake_launch == ["async_ratio-0", "async_ratio-2", "async_ratio-0__repeat-1", "async_ratio-2__repeat-1"]
    assert rec.startswith("recommendation: async_ratio=2 (n=2) -- 2.00x ± 0.00 the synchronous speed")
    point = json.loads((out / "async_ratio-2__repeat-1" / "sweep_point.json").read_text())
    assert point["overrides"] == ["async_ratio=2"]  # the repeat is the sweep's, not the run's
    assert "| 2 | 2 |" in (out / "results.md").read_text()
    with pytest.raises(ConfigError, match="--repeats"):
        sw.parse_grid(["repeat=0,1"])


def _point(ratio: str, seed: str, acc: float, s_per_step: float, status: str = "ok") -> sw.Point:
    row = {"status": status, "async_ratio_value": float(ratio), "acc_final": acc, "s_per_step": s_per_step}
    return sw.Point({"async_ratio": ratio, "seed": seed}, [], row=row if status == "ok" else {"status": status})


def test_recommendation_names_a_faster_setting_left_undecided_by_its_error():
    points = [_point("0", s, 0.50, 1.0) for s in "01"] + [_point("2", "0", 0.49, 0.5), _point("2", "1", 0.49, 0.5)]
    points += [_point("8", "0", 0.51, 0.25), _point("8", "1", 0.45, 0.25)]  # gap 0.02, SE 0.03
    sw.add_speedups(points)
    rec = sw.recommend(sw.group_runs([(p.settings, p.row) for p in points], sw.METRICS), 0.025)
    assert rec.startswith("recommendation: async_ratio=2 (n=2) -- 2.00x ± 0.00 the synchronous speed")
    assert rec.endswith(
        "; undecided: async_ratio=8 (n=2) is faster (0.25 ± 0.00 s/step) and its mean accuracy "
        "is within the tolerance, but not after its standard error (gap 0.020 ± 0.030): "
        "more seeds would tell"
    )
    # sync finished only for seed 0, ratio 2 only for seed 1: nothing to pair, said so
    points = [
        _point("0", "0", 0.5, 1.0),
        _point("0", "1", 0, 0, "failed"),
        _point("2", "0", 0, 0, "failed"),
        _point("2", "1", 0.5, 0.5),
    ]
    sw.add_speedups(points)
    rec = sw.recommend(sw.group_runs([(p.settings, p.row) for p in points], sw.METRICS), 0.025)
    assert rec.startswith("recommendation: async_ratio=2 (n=1) -- an unpaired speed")


def test_no_synchronous_run_means_no_recommendation(tmp_path, fake_launch):
    _, rec = sw.sweep("stutter", ["async_ratio=1,2"], out=str(tmp_path), stream=io.StringIO())
    assert rec.startswith("recommendation: none qualifies") and "async_ratio=0" in rec


def test_resume_refuses_a_dir_made_with_other_overrides(tmp_path, fake_launch):
    sw.sweep("stutter", ["async_ratio=0,1", "train.steps=4"], out=str(tmp_path), stream=io.StringIO())
    with pytest.raises(ConfigError, match="other overrides"):
        sw.sweep("stutter", ["async_ratio=0,1", "train.steps=5"], out=str(tmp_path), stream=io.StringIO())


def test_parallel_runs_split_the_cores_and_need_room(tmp_path, fake_launch, monkeypatch):
    monkeypatch.setattr(sw.os, "cpu_count", lambda: 4)
    points = sw.make_points([], {"async_ratio": ["0", "1"]})
    assert sw._core_split(points, 2) == ["ray.num_cpus=2"]
    assert sw._core_split(sw.make_points(["ray.num_cpus=1"], {}), 2) == []  # the user placed them
    with pytest.raises(ConfigError, match="no room"):
        sw._core_split(points, 5)
    _, rec = sw.sweep("stutter", ["async_ratio=0,1,2"], out=str(tmp_path), parallel=2, stream=io.StringIO())
    assert sorted(fake_launch) == ["async_ratio-0", "async_ratio-1", "async_ratio-2"]
    assert rec.startswith("recommendation: async_ratio=2")


def test_flash_plot_cli(tmp_path):
    from flash.app.cli import main

    for i, ratio in enumerate((0, 2)):
        (tmp_path / f"r{i}").mkdir()
        fake_run(tmp_path / f"r{i}", ratio, 0.4, 0.5)
    out = tmp_path / "p.png"
    assert main(["plot", str(tmp_path / "r0"), str(tmp_path / "r1"), "-o", str(out), "--steps", "2:3"]) == 0
    assert out.read_bytes()[:8] == PNG
    assert main(["plot", str(tmp_path), "-o", str(out)]) == 2  # not a run dir: one-line error


@pytest.mark.parametrize("steps", ["abc", "3:x", "0:2", "5:3"])
def test_flash_plot_a_bad_steps_window_is_one_line(tmp_path, capsys, steps):
    """--steps abc was a ValueError traceback; 5:3 or 0:2 drew an empty timeline."""
    from flash.app.cli import main

    (tmp_path / "r0").mkdir()
    fake_run(tmp_path / "r0", 0, 0.4, 0.5)
    assert main(["plot", str(tmp_path / "r0"), "-o", str(tmp_path / "p.png"), "--steps", steps]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and f"--steps {steps}" in err
    assert not (tmp_path / "p.png").exists()


SMALL = [
    "sft.steps=40",
    "sft.eval_after=false",
    "model.tiny.num_layers=2",
    "train.prompts_per_step=4",
    "rollout.n=4",
    "rollout.max_new_tokens=32",
    "task.eval_size=16",
    "resources.engine_threads=1",
    "resources.trainer_threads=1",
    "ray.num_cpus=2",
    "train.steps=3",
    "eval.every_steps=2",
]


@pytest.mark.slow
@pytest.mark.margin  # the suite keeps under 45 min: the sweep's tables, plots, replicates and resume are pinned above
def test_two_point_sweep_of_the_default_recipe(tmp_path, monkeypatch):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    out = tmp_path / "sweep"
    args = [
        sys.executable,
        "-m",
        "flash.app.cli",
        "sweep",
        "stutter",
        "async_ratio=0,1",
        *SMALL,
        f"cache_dir={tmp_path / 'cache'}",
        "--out",
        str(out),
    ]
    first = subprocess.run(args, capture_output=True, text=True, timeout=900)
    assert first.returncode == 0, first.stdout + first.stderr
    assert "recommendation: " in first.stdout
    rows = list(csv.DictReader(open(out / "results.csv")))
    assert [(r["async_ratio"], r["status"]) for r in rows] == [("0", "ok"), ("1", "ok")]
    assert float(rows[1]["staleness_max"]) <= 1 and 0 <= float(rows[0]["idle_rollout"]) <= 1
    assert "recommendation: " in (out / "results.md").read_text()
    for png in ("runs.png", "sweep.png"):
        assert (out / "plots" / png).read_bytes()[:8] == PNG
    runs = [load_run(out / slug) for slug in ("async_ratio-0", "async_ratio-1")]
    counts = plot_runs(runs, tmp_path / "check.png")
    assert all(counts[k] == 2 for k in LINE_PANELS)
    for run in runs:  # periodic eval at step 2 is timed and logged; every step has its timeline
        assert [e["step"] for e in run.evals] == [0, 2, 3]
        assert "time/eval" in run.metrics[1] and len(run.timeline) == 3
        events = EventAccumulator(str(run.dir / "tb"))
        events.Reload()
        assert {
            "rollout/idle_ratio",
            "train/idle_ratio",
            "time/push_weights",
            "time/eval",
            "staleness/max",
            "staleness/count_0",
            "buffer/depth",
            "rollout/update_bytes",
            "train/tokens_per_s",
            "eval/accuracy",
            "reward/mean",
        } <= set(events.Tags()["scalars"])
    mtimes = [(out / s / "summary.json").stat().st_mtime for s in ("async_ratio-0", "async_ratio-1")]
    second = subprocess.run(args, capture_output=True, text=True, timeout=300)
    assert second.returncode == 0 and second.stdout.count("finished earlier, skipped") == 2
    assert [(out / s / "summary.json").stat().st_mtime for s in ("async_ratio-0", "async_ratio-1")] == mtimes


def test_a_killed_point_is_run_again_with_its_partial_files_kept_aside(tmp_path):
    fresh = tmp_path / "fresh"
    fresh.mkdir()
    (fresh / sw.POINT_FILE).write_text("{}")
    sw._set_aside_partial(fresh)
    assert [p.name for p in fresh.iterdir()] == [sw.POINT_FILE]
    killed = tmp_path / "killed"
    killed.mkdir()
    for name in (sw.POINT_FILE, "config.yaml", "ledger.jsonl", "run.log"):
        (killed / name).write_text(name)
    sw._set_aside_partial(killed)
    [aside] = [p for p in killed.iterdir() if p.name.startswith("partial-")]
    assert sorted(p.name for p in killed.iterdir()) == sorted([sw.POINT_FILE, aside.name])
    assert sorted(p.name for p in aside.iterdir()) == ["config.yaml", "ledger.jsonl", "run.log"]
    assert (aside / "ledger.jsonl").read_text() == "ledger.jsonl"


def test_a_sweep_stopped_by_sigterm_stops_its_running_points(tmp_path, monkeypatch):
    """A scheduler's or ``timeout``'s SIGTERM reaches the sweep alone: its runs must not go on orphaned."""
    import os
    import signal
    import threading

    marks: list[Path] = []

    def launch(recipe, point, out, extra):
        mark = tmp_path / f"{point.slug}.stopped"
        marks.append(mark)
        code = (
            "import signal, sys, time\n"
            f"signal.signal(signal.SIGTERM, lambda *a: (open({str(mark)!r}, 'w').write('x'), sys.exit(0)))\n"
            f"open({str(mark) + '.up'!r}, 'w').write('x')\n"
            "time.sleep(120)\n"
        )
        return subprocess.Popen([sys.executable, "-c", code])

    monkeypatch.setattr(sw, "_launch", launch)
    points = sw.make_points([], {"async_ratio": ["0", "1"]}, 1)
    before = signal.getsignal(signal.SIGTERM)

    def stop_when_up():
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline and not (len(marks) == 2 and all(Path(f"{m}.up").exists() for m in marks)):
            time.sleep(0.1)
        os.kill(os.getpid(), signal.SIGTERM)

    threading.Thread(target=stop_when_up, daemon=True).start()
    with pytest.raises(KeyboardInterrupt, match="SIGTERM"):
        sw.run_all(Path("recipe.yaml"), points, tmp_path, parallel=2, reporter=sw.Reporter(2, io.StringIO()))
    assert len(marks) == 2 and all(m.read_text() == "x" for m in marks)  # each run told to stop, and it did
    assert signal.getsignal(signal.SIGTERM) == before
