"""`flash sweep RECIPE key=v1,v2 ... [--out DIR] [--tolerance X] [--parallel N]`: which ratio to pick.

Runs the cartesian product of the swept values (``async_ratio=0,1,2,4 algo.loss.name=ppo,tis``),
each as its own ``python -m flash.app.cli run ... run_dir=SWEEP_DIR/<slug>`` subprocess: a clean Ray,
clean torch threads and a crash that cannot take the sweep down with it. Runs go one after another
(timings stay comparable) or ``--parallel N`` at a time, the cores split between them.

Resuming is the default: a run whose ``summary.json`` exists is not run again, so re-issuing the
same command (the default ``--out`` is derived from it) finishes a half-done sweep. Each run dir
holds ``sweep_point.json`` (its settings and overrides); a run dir made with other overrides is an
error rather than a silently reused result.

Writes ``results.csv``, ``results.md`` and ``plots/{runs,sweep}.png`` in SWEEP_DIR and prints the
table and a **recommendation**: the fastest setting (seconds per train step) whose final held-out
accuracy is at most ``--tolerance`` below the synchronous run's (``async_ratio = 0``, same other
settings), or a line saying why none qualifies.
"""

from __future__ import annotations

import csv
import hashlib
import itertools
import json
import os
import re
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

from flash.errors import ConfigError

ROLES = ("rollout", "train")
COLUMNS = ["status", "wall_s", "s_per_step", "speedup", "samples_per_s", "tokens_per_s", "acc_initial",
           "acc_final", "acc_best", "staleness_max", "staleness_mean", "idle_rollout", "idle_train"]


@dataclass
class Point:
    settings: dict[str, str]  # swept key -> value, as written on the command line
    overrides: list[str]  # every override of this run: fixed ones, then the swept ones
    slug: str = ""
    row: dict = field(default_factory=dict)


def split_values(text: str) -> list[str]:
    """Split on commas outside brackets and quotes: ``[0.9,0.99],[0.9,0.999]`` is two values."""
    values, depth, quote, cur = [], 0, "", ""
    for ch in text:
        if quote:
            quote = "" if ch == quote else quote
        elif ch in "'\"":
            quote = ch
        elif ch in "[{(":
            depth += 1
        elif ch in "]})":
            depth -= 1
        elif ch == "," and depth == 0:
            values.append(cur)
            cur = ""
            continue
        cur += ch
    return values + [cur]


def parse_grid(items: list[str]) -> tuple[list[str], dict[str, list[str]]]:
    """``key=v`` items → (fixed overrides, swept key → values), in command-line order."""
    fixed, swept = [], {}
    for item in items:
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise ConfigError(f"sweep argument '{item}' is not of the form key=v1,v2,...")
        if key == "run_dir":
            raise ConfigError("run_dir is set by the sweep (SWEEP_DIR/<slug>); use --out for the sweep dir")
        if key in swept or any(f.startswith(key + "=") for f in fixed):
            raise ConfigError(f"'{key}' is given twice")
        values = split_values(value)
        if len(values) > 1:
            swept[key] = values
        else:
            fixed.append(item)
    return fixed, swept


def slugify(settings: dict[str, str]) -> str:
    text = "__".join(f"{k}-{v}" for k, v in settings.items()) or "base"
    return re.sub(r"[^A-Za-z0-9._-]+", "_", text).strip("_") or "base"


def make_points(fixed: list[str], swept: dict[str, list[str]]) -> list[Point]:
    points = []
    for combo in itertools.product(*swept.values()):
        settings = dict(zip(swept, combo))
        points.append(Point(settings, [*fixed, *(f"{k}={v}" for k, v in settings.items())], slugify(settings)))
    slugs = [p.slug for p in points]
    for p in points:  # two settings that sanitise alike get a hash to tell them apart
        if slugs.count(p.slug) > 1:
            p.slug += "-" + hashlib.sha1(json.dumps(p.settings).encode()).hexdigest()[:6]
    return points


def default_out(recipe: Path, items: list[str]) -> Path:
    """Same command, same dir: what makes re-running it resume."""
    digest = hashlib.sha1(json.dumps([str(recipe), *items]).encode()).hexdigest()[:8]
    return Path("sweeps") / f"{recipe.stem}-{digest}"


def prepare(recipe: Path, points: list[Point], out: Path) -> None:
    """Validate every point's config before the first run; claim (or check) each run dir."""
    from flash.app.config import load_config

    for p in points:
        try:
            load_config(recipe, [*p.overrides, f"run_dir={out / p.slug}"])
        except ConfigError as exc:
            raise ConfigError(f"sweep point {p.slug}: {exc}") from None
        marker = out / p.slug / "sweep_point.json"
        mine = {"recipe": str(recipe), "settings": p.settings, "overrides": p.overrides}
        if marker.is_file() and json.loads(marker.read_text())["overrides"] != p.overrides:
            raise ConfigError(f"{marker.parent} was made by a sweep with other overrides; pick another --out")
        marker.parent.mkdir(parents=True, exist_ok=True)
        marker.write_text(json.dumps(mine, indent=2))


class Reporter:
    """One line per finished run; on a terminal also a live line for the runs in flight."""

    def __init__(self, total: int, stream=None):
        self.total, self.stream = total, stream or sys.stdout
        self.live = self.stream.isatty()

    def tick(self, running: dict[str, float]) -> None:
        if self.live and running:
            now = time.monotonic()
            text = ", ".join(f"{slug} {now - t0:.0f}s" for slug, t0 in running.items())
            self.stream.write(f"\r\033[Krunning: {text}")
            self.stream.flush()

    def line(self, i: int, text: str) -> None:
        prefix = "\r\033[K" if self.live else ""
        print(f"{prefix}[{i}/{self.total}] {text}", file=self.stream, flush=True)


def run_all(recipe: Path, points: list[Point], out: Path, parallel: int, reporter: Reporter) -> None:
    """Run every unfinished point, ``parallel`` at a time, each in its own process."""
    todo = [(i, p) for i, p in enumerate(points, 1) if not (out / p.slug / "summary.json").is_file()]
    for i, p in enumerate(points, 1):
        if (out / p.slug / "summary.json").is_file():
            reporter.line(i, f"{p.slug}: finished earlier, skipped")
    extra = _core_split(points, parallel)
    running: dict[str, tuple[int, Point, subprocess.Popen, float]] = {}
    while todo or running:
        while todo and len(running) < parallel:
            i, p = todo.pop(0)
            running[p.slug] = (i, p, _launch(recipe, p, out, extra), time.monotonic())
        time.sleep(0.5)
        reporter.tick({slug: v[3] for slug, v in running.items()})
        for slug, (i, p, proc, t0) in list(running.items()):
            if proc.poll() is not None:
                del running[slug]
                ok = proc.returncode == 0 and (out / slug / "summary.json").is_file()
                status = f"done in {time.monotonic() - t0:.0f}s" if ok else \
                    f"FAILED (exit {proc.returncode}; see {out / slug / 'run.log'})"
                reporter.line(i, f"{slug}: {status}")


def _core_split(points: list[Point], parallel: int) -> list[str]:
    """Side by side, each run gets its share of the cores (unless the user placed them)."""
    cores = os.cpu_count() or 1
    if parallel > cores:
        raise ConfigError(f"--parallel {parallel}: no room, this machine has {cores} cores")
    placed = any(o.startswith(("ray.num_cpus=", "ray.address=")) for o in points[0].overrides) if points else True
    return [] if parallel <= 1 or placed else [f"ray.num_cpus={cores // parallel}"]


def _launch(recipe: Path, p: Point, out: Path, extra: list[str]) -> subprocess.Popen:
    run_dir = out / p.slug
    cmd = [sys.executable, "-m", "flash.app.cli", "run", str(recipe), *p.overrides, *extra,
           f"run_dir={run_dir}", "tracking.progress=false"]
    root = str(Path(__file__).resolve().parent.parent)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [root, os.environ.get("PYTHONPATH")]))}
    with open(run_dir / "run.log", "w") as log:
        return subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env)


def collect(p: Point, run_dir: Path) -> dict:
    """One results row from a finished run dir (summary, metrics, evaluations)."""
    from flash.app.plot import load_run, throughput

    run = load_run(run_dir)
    s, steps = run.summary, run.metrics
    if not s:
        return {**p.settings, "status": "failed"}
    train_s = s["train_seconds"] or 1e-9
    weights = [m.get("time/step", 0.0) for m in steps]
    idle = {role: sum(m.get(f"{role}/idle_ratio", 0.0) * w for m, w in zip(steps, weights)) / (sum(weights) or 1)
            for role in ROLES}
    later = [e["accuracy"] for e in run.evals if e["step"] > 0] or [s["eval_accuracy_final"]]
    return {
        **p.settings, "status": "ok", "async_ratio_value": float(s["async_ratio"]),
        "wall_s": s["wall_seconds"], "s_per_step": s["seconds_per_step"],
        "samples_per_s": s["samples_trained"] / train_s, "tokens_per_s": throughput(run)[1],
        "acc_initial": s["eval_accuracy_initial"], "acc_final": s["eval_accuracy_final"], "acc_best": max(later),
        "staleness_max": s["max_staleness_observed"],
        "staleness_mean": sum(m.get("staleness/mean", 0.0) for m in steps) / max(len(steps), 1),
        "idle_rollout": idle["rollout"], "idle_train": idle["train"],
    }


def _baselines(points: list[Point]) -> dict[tuple, dict]:
    """Synchronous run per combination of the other swept settings."""
    return {_group(p): p.row for p in points if p.row.get("status") == "ok" and p.row["async_ratio_value"] == 0}


def _label(p: Point) -> str:
    return " ".join(f"{k}={v}" for k, v in p.settings.items()) or p.slug


def _group(p: Point) -> tuple:
    return tuple((k, v) for k, v in p.settings.items() if k != "async_ratio")


def recommend(points: list[Point], tolerance: float) -> str:
    """The fastest setting within ``tolerance`` of its synchronous run's final accuracy, or why none."""
    base = _baselines(points)
    for p in points:
        b = base.get(_group(p))
        if b and p.row.get("status") == "ok":
            p.row["speedup"] = b["s_per_step"] / p.row["s_per_step"]
    if not base:
        return ("recommendation: none qualifies -- the sweep has no finished synchronous run "
                "(async_ratio=0) to compare with; add 0 to the async_ratio values")
    ok = [p for p in points if _group(p) in base and p.row.get("status") == "ok"
          and p.row["acc_final"] >= base[_group(p)]["acc_final"] - tolerance]
    best = min(ok, key=lambda p: p.row["s_per_step"])
    b = base[_group(best)]
    if best.row["async_ratio_value"] == 0:
        return (f"recommendation: {_label(best)} (synchronous) -- no asynchronous setting was both faster and "
                f"within {tolerance} of its final held-out accuracy {b['acc_final']:.3f}")
    return (f"recommendation: {_label(best)} -- "
            f"{best.row['speedup']:.2f}x the synchronous speed ({best.row['s_per_step']:.2f} vs "
            f"{b['s_per_step']:.2f} s/step), final held-out accuracy {best.row['acc_final']:.3f} vs "
            f"{b['acc_final']:.3f} (tolerance {tolerance})")


def _fmt(value) -> str:
    if isinstance(value, float):
        return f"{value:.3g}" if abs(value) < 10 else f"{value:.0f}"
    return "" if value is None else str(value)


def write_results(points: list[Point], out: Path, header: str, recommendation: str) -> str:
    """``results.csv`` (full precision) and ``results.md``; returns the markdown table."""
    keys = list(points[0].settings) if points else []
    with open(out / "results.csv", "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["run", *keys, *COLUMNS])
        for p in points:
            w.writerow([p.slug, *(p.settings[k] for k in keys), *(p.row.get(c, "") for c in COLUMNS)])
    cols = [*keys, *COLUMNS]
    table = "\n".join(["| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
                      + ["| " + " | ".join(_fmt({**p.settings, **p.row}.get(c)) for c in cols) + " |"
                         for p in points])
    legend = ("wall_s: the whole run, setup included (a run that builds the warm-start cache pays for it); "
              "s_per_step: training wall seconds per step (periodic evals included); speedup: vs the "
              "synchronous run; tokens_per_s: trained tokens; acc_*: held-out accuracy; "
              "idle_*: fraction of wall time the role had no work")
    (out / "results.md").write_text(f"{header}\n\n{table}\n\n{legend}\n\n{recommendation}\n")
    return table


def sweep(recipe: str, items: list[str], out: str | None = None, tolerance: float = 0.02,
          parallel: int = 1, stream=None) -> tuple[list[Point], str]:
    """Run (or resume) the sweep, write results and plots; returns the points and recommendation."""
    from flash.app.recipe_files import resolve_recipe
    from flash.app.plot import load_run, plot_runs, plot_sweep

    path = resolve_recipe(recipe)
    fixed, swept = parse_grid(items)
    points = make_points(fixed, swept)
    sweep_dir = Path(out) if out else default_out(path, items)
    prepare(path, points, sweep_dir)
    stream = stream or sys.stdout
    print(f"flash: sweep of {len(points)} runs in {sweep_dir}", file=stream, flush=True)
    run_all(path, points, sweep_dir, max(1, parallel), Reporter(len(points), stream))
    for p in points:
        p.row = collect(p, sweep_dir / p.slug)
    recommendation = recommend(points, tolerance)
    header = f"# sweep: flash sweep {recipe} {' '.join(items)}\n\ntolerance {tolerance}; dir {sweep_dir}"
    table = write_results(points, sweep_dir, header, recommendation)
    done = [p for p in points if p.row.get("status") == "ok"]
    if done:
        (sweep_dir / "plots").mkdir(exist_ok=True)
        plot_runs([load_run(sweep_dir / p.slug) for p in done], sweep_dir / "plots" / "runs.png")
        plot_sweep([(_label(p), p.row) for p in done],
                   sweep_dir / "plots" / "sweep.png", tolerance)
    print(f"{table}\n\n{recommendation}\nflash: results in {sweep_dir}/results.md, plots in {sweep_dir}/plots",
          file=stream, flush=True)
    return points, recommendation
