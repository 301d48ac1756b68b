"""`flash sweep RECIPE key=v1,v2 ... [--out DIR] [--tolerance X] [--parallel N] [--repeats N]`: which ratio to pick.

Runs the cartesian product of the swept values (``async_ratio=0,1,2,4 algo.loss.name=ppo,tis``),
each as its own ``python -m flash.app.cli run ... run_dir=SWEEP_DIR/<slug>`` subprocess: a clean Ray,
clean torch threads and a crash that cannot take the sweep down with it. Runs go one after another
(timings stay comparable) or ``--parallel N`` at a time, the cores split between them.

Seeds and repeats are replicates, not settings (`flash.app.replicates`): ``seed=0,1,2`` or
``--repeats 3`` (each setting run 3 times, same config; repeat 0 is the run without ``--repeats``)
measure each setting n times. Replicates run outermost -- every setting once, then every setting
again -- so machine drift hits all settings alike, and each run's speed-up is paired with the
synchronous run of the same replicate.

Resuming is the default: a run whose ``summary.json`` exists is not run again, so re-issuing the
same command (the default ``--out`` is derived from it, ``--repeats`` aside: raising it reuses the
runs made) finishes a half-done sweep. Each run dir holds ``sweep_point.json`` (its settings and
overrides); a run dir made with other overrides is an error rather than a silently reused result.

A recipe with simulated roles (``rollout.engine: sim``, ``train.backend: sim``; flash.sim) gives the
same files, its seconds per step and rates in simulated seconds (``wall_s`` stays real).

Writes ``results.csv`` (one row per run, its seed / repeat included), ``results.md`` (one row per
setting: n and mean ± standard error of every metric; then the runs; ``flash.app.sweep_results``)
and ``plots/{runs,sweep}.png`` (the sweep plot with error bars) in SWEEP_DIR and prints the table
and a **recommendation**: the setting with the lowest mean seconds per train step whose mean final
held-out accuracy is at most ``--tolerance`` below its synchronous setting's (``async_ratio = 0``,
same other settings) even after one standard error of the gap against it, or a line saying why
none qualifies; faster settings that miss only by their error are named as undecided.
"""

from __future__ import annotations

import hashlib
import itertools
import json
import math
import os
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

from flash.app.interpolation import ALLOW_ENV
from flash.app.replicates import REPLICATE_KEYS, group_runs
from flash.app.sweep_results import METRICS, Point, add_speedups, collect, recommend, write_results
from flash.errors import ConfigError, raise_terminated
from flash.run_files import open_run_file, read_json, refuse_links, run_subdir, write_run_text


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
        if key == "repeat":
            raise ConfigError("'repeat' is not a config key; use --repeats N to run each setting N times")
        if key in swept or any(f.startswith(key + "=") for f in fixed):
            raise ConfigError(f"'{key}' is given twice")
        values = split_values(value)
        if len(values) > 1 and key != ALLOW_ENV:  # the variables every run may read, not a setting
            swept[key] = values
        else:
            fixed.append(item)
    return fixed, swept


def slugify(settings: dict[str, str]) -> str:
    text = "__".join(f"{k}-{v}" for k, v in settings.items()) or "base"
    return re.sub(r"[^A-Za-z0-9._-]+", "_", text).strip("_") or "base"


def make_points(fixed: list[str], swept: dict[str, list[str]], repeats: int = 1) -> list[Point]:
    """One point per combination; replicate keys (seed, repeat) vary slowest, so each replicate
    runs every setting back to back. ``repeat`` is the sweep's own key: never an override, and
    repeat 0 keeps the slug the run has without ``--repeats``."""
    if repeats > 1:
        swept = {**swept, "repeat": [str(i) for i in range(repeats)]}
    order = sorted(swept, key=lambda k: k not in REPLICATE_KEYS)  # stable: replicate keys first
    points = []
    for combo in itertools.product(*(swept[k] for k in order)):
        chosen = dict(zip(order, combo))
        settings = {k: chosen[k] for k in swept}
        overrides = [*fixed, *(f"{k}={v}" for k, v in settings.items() if k != "repeat")]
        named = {k: v for k, v in settings.items() if (k, v) != ("repeat", "0")}
        points.append(Point(settings, overrides, slugify(named)))
    slugs = [p.slug for p in points]
    for p in points:  # two settings that sanitise alike get a hash to tell them apart
        if slugs.count(p.slug) > 1:
            p.slug += "-" + hashlib.sha1(json.dumps(p.settings).encode()).hexdigest()[:6]
    return points


def default_out(recipe: Path, items: list[str]) -> Path:
    """Same command, same dir: what makes re-running it resume."""
    digest = hashlib.sha1(json.dumps([str(recipe), *items]).encode()).hexdigest()[:8]
    return Path("sweeps") / f"{recipe.stem}-{digest}"


POINT_FILE = "sweep_point.json"  # a point's settings, in its run dir


def prepare(recipe: Path, points: list[Point], out: Path) -> None:
    """Validate every point's config before the first run; claim (or check) each run dir. A sweep
    dir that is or holds a link is refused before anything is read or written there."""
    from flash.app.config import load_config

    refuse_links(out, "sweep dir")
    for p in points:
        try:
            load_config(recipe, [*p.overrides, f"run_dir={out / p.slug}"])
        except ConfigError as exc:
            raise ConfigError(f"sweep point {p.slug}: {exc}") from None
        marker = out / p.slug / POINT_FILE
        mine = {"recipe": str(recipe), "settings": p.settings, "overrides": p.overrides}
        if os.path.lexists(marker) and read_json(marker).get("overrides") != p.overrides:
            raise ConfigError(f"{marker.parent} was made by a sweep with other overrides; pick another --out")
        run_subdir(out, p.slug)
        write_run_text(marker, json.dumps(mine, indent=2))


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
    """Run every unfinished point, ``parallel`` at a time, each in its own process. Stopped
    (ctrl-C, SIGTERM), the sweep stops its running points too, each at a safe point as a run
    stopped by hand does (the next sweep starts them afresh), before it exits."""
    todo = [(i, p) for i, p in enumerate(points, 1) if not (out / p.slug / "summary.json").is_file()]
    for i, p in enumerate(points, 1):
        if (out / p.slug / "summary.json").is_file():
            reporter.line(i, f"{p.slug}: finished earlier, skipped")
    extra = _core_split(points, parallel)
    running: dict[str, tuple[int, Point, subprocess.Popen, float]] = {}
    previous = _stop_on_sigterm()
    try:
        while todo or running:
            while todo and len(running) < parallel:
                i, p = todo.pop(0)
                running[p.slug] = (i, p, _launch(recipe, p, out, extra), time.monotonic())
            time.sleep(0.5)
            reporter.tick({slug: v[3] for slug, v in running.items()})
            _reap(running, out, reporter)
    finally:
        _stop_runs([v[2] for v in running.values()])
        if previous is not None:
            signal.signal(signal.SIGTERM, previous)


def _reap(running: dict, out: Path, reporter: Reporter) -> None:
    """Report and forget the points whose process has ended."""
    for slug, (i, _point, proc, t0) in list(running.items()):
        if proc.poll() is not None:
            del running[slug]
            ok = proc.returncode == 0 and (out / slug / "summary.json").is_file()
            status = (
                f"done in {time.monotonic() - t0:.0f}s"
                if ok
                else f"FAILED (exit {proc.returncode}; see {out / slug / 'run.log'})"
            )
            reporter.line(i, f"{slug}: {status}")


STOP_WAIT_S = 60.0  # a stopped run gets this long to close its roles before it is killed


def _stop_runs(procs: list[subprocess.Popen]) -> None:
    """SIGTERM each run still going (it stops at a safe point and closes its Ray), then wait; one
    that does not end in ``STOP_WAIT_S`` is killed."""
    live = [p for p in procs if p.poll() is None]
    for proc in live:
        proc.terminate()
    deadline = time.monotonic() + STOP_WAIT_S
    for proc in live:
        try:
            proc.wait(max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def _stop_on_sigterm():
    """SIGTERM raises in the main thread as ctrl-C does (the previous handler is returned), so a
    sweep stopped by a scheduler or ``timeout`` stops its runs instead of leaving them orphaned."""
    if threading.current_thread() is not threading.main_thread():
        return None
    return signal.signal(signal.SIGTERM, raise_terminated)


def _core_split(points: list[Point], parallel: int) -> list[str]:
    """Side by side, each run gets its share of the cores (unless the user placed them)."""
    cores = os.cpu_count() or 1
    if parallel > cores:
        raise ConfigError(f"--parallel {parallel}: no room, this machine has {cores} cores")
    placed = any(o.startswith(("ray.num_cpus=", "ray.address=")) for o in points[0].overrides) if points else True
    return [] if parallel <= 1 or placed else [f"ray.num_cpus={cores // parallel}"]


def _set_aside_partial(run_dir: Path) -> None:
    """A run killed before its summary is run again from scratch: its files go to
    ``partial-<time>/`` inside the point's dir (kept, never deleted), its settings stay."""
    from flash.app.resume import RUN_FILES

    if not any((run_dir / name).exists() for name in RUN_FILES):
        return
    aside = run_dir / time.strftime("partial-%Y%m%d-%H%M%S")
    aside.mkdir()
    for entry in list(run_dir.iterdir()):
        if entry.name != POINT_FILE and not entry.name.startswith("partial-"):
            entry.rename(aside / entry.name)


def _launch(recipe: Path, p: Point, out: Path, extra: list[str]) -> subprocess.Popen:
    run_dir = out / p.slug
    _set_aside_partial(run_dir)
    cmd = [
        sys.executable,
        "-m",
        "flash.app.cli",
        "run",
        str(recipe),
        *p.overrides,
        *extra,
        f"run_dir={run_dir}",
        "tracking.progress=false",
    ]
    root = str(Path(__file__).resolve().parent.parent)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [root, os.environ.get("PYTHONPATH")]))}
    with open_run_file(run_dir / "run.log", "w") as log:
        return subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env)


def check_options(tolerance: float, parallel: int, repeats: int) -> None:
    """Refused before any run starts: a NaN or negative tolerance recommends nothing, and only after
    the whole grid has run; ``--parallel 0`` names no number of runs side by side."""
    if not (math.isfinite(tolerance) and tolerance >= 0):
        raise ConfigError(f"--tolerance {tolerance}: must be a finite number >= 0 (absolute accuracy, e.g. 0.02)")
    if parallel < 1:
        raise ConfigError(f"--parallel {parallel}: must be at least 1 (runs side by side)")
    if repeats < 1:
        raise ConfigError(f"--repeats {repeats}: must be at least 1")


def sweep(
    recipe: str,
    items: list[str],
    out: str | None = None,
    tolerance: float = 0.02,
    parallel: int = 1,
    stream=None,
    repeats: int = 1,
) -> tuple[list[Point], str]:
    """Run (or resume) the sweep, write results and plots; returns the points and recommendation."""
    from flash.app.recipe_files import resolve_recipe
    from flash.app.plot import load_run, plot_runs, plot_sweep

    check_options(tolerance, parallel, repeats)
    path = resolve_recipe(recipe)
    fixed, swept = parse_grid(items)
    points = make_points(fixed, swept, repeats)
    sweep_dir = Path(out) if out else default_out(path, items)
    prepare(path, points, sweep_dir)
    stream = stream or sys.stdout
    print(f"flash: sweep of {len(points)} runs in {sweep_dir}", file=stream, flush=True)
    run_all(path, points, sweep_dir, parallel, Reporter(len(points), stream))
    for p in points:
        p.row = collect(p, sweep_dir / p.slug)
    add_speedups(points)
    groups = group_runs([(p.settings, p.row) for p in points], METRICS)
    recommendation = recommend(groups, tolerance)
    header = (
        f"# sweep: flash sweep {recipe} {' '.join(items)}{f' --repeats {repeats}' * (repeats > 1)}\n\n"
        f"tolerance {tolerance}; dir {sweep_dir}"
    )
    table = write_results(points, groups, sweep_dir, header, recommendation)
    done = [p for p in points if p.row.get("status") == "ok"]
    if done:
        run_subdir(sweep_dir, "plots")
        plot_runs([load_run(sweep_dir / p.slug) for p in done], sweep_dir / "plots" / "runs.png")
        plot_sweep([g for g in groups if g.n], sweep_dir / "plots" / "sweep.png", tolerance)
    print(
        f"{table}\n\n{recommendation}\nflash: results in {sweep_dir}/results.md, plots in {sweep_dir}/plots",
        file=stream,
        flush=True,
    )
    return points, recommendation
