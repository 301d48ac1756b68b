"""A sweep's results (``flash.app.sweep``): one row per finished run (``collect``: its summary,
metrics and evaluations), each run's speed-up over the synchronous run of its replicate, the
recommendation over the settings (``flash.app.replicates.choose``) and the files ``results.csv``
(one row per run) and ``results.md`` (one row per setting: n and mean ± standard error of every
metric; then the runs).
"""

from __future__ import annotations

import csv
from dataclasses import dataclass, field
from pathlib import Path

from flash.app.replicates import Group, Stat, choose, fmt_stat
from flash.run_files import open_run_file, write_run_text


@dataclass
class Point:
    """One run of a sweep: its swept settings, all its overrides, its run dir's name, its results row."""

    settings: dict[str, str]  # swept key -> value, as written on the command line
    overrides: list[str]  # every override of this run: fixed ones, then the swept ones
    slug: str = ""
    row: dict = field(default_factory=dict)


ROLES = ("rollout", "train")
COLUMNS = [
    "status",
    "wall_s",
    "s_per_step",
    "speedup",
    "samples_per_s",
    "tokens_per_s",
    "acc_initial",
    "acc_final",
    "acc_best",
    "acc_best_step",
    "staleness_max",
    "staleness_mean",
    "idle_rollout",
    "idle_train",
]
METRICS = COLUMNS[1:]  # what a setting reports as mean ± SE over its replicates


def collect(p: Point, run_dir: Path) -> dict:
    """One results row from a finished run dir (summary, metrics, evaluations)."""
    from flash.app.plot import load_run, throughput

    run = load_run(run_dir)
    s, steps = run.summary, run.metrics
    if not s:
        return {**p.settings, "status": "failed"}
    train_s = s["train_seconds"] or 1e-9
    # simulated roles (train.backend sim): rates and seconds per step in simulated seconds
    scale = s["seconds_per_step"] / s["sim_seconds_per_step"] if s.get("sim_seconds_per_step") else 1.0
    weights = [m.get("time/step", 0.0) for m in steps]
    idle = {
        role: sum(m.get(f"{role}/idle_ratio", 0.0) * w for m, w in zip(steps, weights)) / (sum(weights) or 1)
        for role in ROLES
    }
    # the best of the trained evaluations (eval.every_steps gives the curve), earliest of equals
    later = [(e["accuracy"], -e["step"]) for e in run.evals if e["step"] > 0] or [
        (s["eval_accuracy_final"], -s["steps"])
    ]
    best, best_step = max(later)
    return {
        **p.settings,
        "status": "ok",
        "async_ratio_value": float(s["async_ratio"]),
        "wall_s": s["wall_seconds"],
        "s_per_step": s["seconds_per_step"] / scale,
        "samples_per_s": s["samples_trained"] / train_s * scale,
        "tokens_per_s": throughput(run)[1] * scale,
        "acc_initial": s["eval_accuracy_initial"],
        "acc_final": s["eval_accuracy_final"],
        "acc_best": best,
        "acc_best_step": -best_step,
        "staleness_max": s["max_staleness_observed"],
        "staleness_mean": sum(m.get("staleness/mean", 0.0) for m in steps) / max(len(steps), 1),
        "idle_rollout": idle["rollout"],
        "idle_train": idle["train"],
    }


def add_speedups(points: list[Point]) -> None:
    """Each finished run's speed-up over the synchronous run of the same other settings and the same
    replicate (seed, repeat): the run that ran beside it."""
    base = {
        _other(p.settings): p.row for p in points if p.row.get("status") == "ok" and p.row["async_ratio_value"] == 0
    }
    for p in points:
        b = base.get(_other(p.settings))
        if b and p.row.get("status") == "ok":
            p.row["speedup"] = b["s_per_step"] / p.row["s_per_step"]


def _other(settings: dict[str, str]) -> tuple:
    return tuple((k, v) for k, v in settings.items() if k != "async_ratio")


def sync_pairs(groups: list[Group]) -> list[tuple[Group, Group]]:
    """(setting, its synchronous setting) for every setting that has one with finished runs."""
    sync = {_other(g.settings): g for g in groups if g.rows and all(r["async_ratio_value"] == 0 for r in g.rows)}
    return [(g, sync[_other(g.settings)]) for g in groups if _other(g.settings) in sync]


def recommend(groups: list[Group], tolerance: float) -> str:
    """The rule of `flash.app.replicates.choose` over the settings, said in one line, or why none."""
    pairs = sync_pairs(groups)
    best, undecided = choose(pairs, tolerance)
    if best is None:
        return (
            "recommendation: none qualifies -- the sweep has no finished synchronous run "
            "(async_ratio=0) to compare with; add 0 to the async_ratio values"
        )
    b = next(sync for g, sync in pairs if g is best)
    st, bs = best.stats, b.stats
    if best is b:
        text = (
            f"recommendation: {best.label()} (synchronous, n={best.n}) -- no asynchronous setting was both "
            f"faster and within {tolerance} of its final held-out accuracy {fmt_stat(st['acc_final'], '.3f')} "
            f"after one standard error"
        )
    else:
        text = (
            f"recommendation: {best.label()} (n={best.n}) -- {_times(st.get('speedup'))} the "
            f"synchronous speed ({fmt_stat(st['s_per_step'], '.2f')} vs {fmt_stat(bs['s_per_step'], '.2f')} "
            f"s/step), final held-out accuracy {fmt_stat(st['acc_final'], '.3f')} vs "
            f"{fmt_stat(bs['acc_final'], '.3f')} (synchronous n={b.n}; tolerance {tolerance}, "
            f"gap + SE within it)"
        )
    for g, v in undecided:
        text += (
            f"; undecided: {g.label()} (n={g.n}) is faster ({fmt_stat(g.stats['s_per_step'], '.2f')} s/step) "
            f"and its mean accuracy is within the tolerance, but not after its standard error "
            f"(gap {v.gap:.3f} ± {v.se:.3f}): more seeds would tell"
        )
    return text


def _times(stat: Stat | None) -> str:
    if stat is None:  # its runs and the synchronous ones finished for different seeds / repeats
        return "an unpaired speed (no synchronous run of the same replicate finished), not"
    return f"{stat.mean:.2f}x ± {'—' if stat.se is None else f'{stat.se:.2f}'}"


def _fmt(value) -> str:
    if isinstance(value, float):
        return f"{value:.3g}" if abs(value) < 10 else f"{value:.0f}"
    return "" if value is None else str(value)


def _md(cols: list[str], rows: list[list[str]]) -> str:
    return "\n".join(
        ["| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)] + ["| " + " | ".join(r) + " |" for r in rows]
    )


def settings_table(groups: list[Group]) -> str:
    """One row per setting: its n (finished runs, and failed ones) and mean ± SE of every metric."""
    keys = list(groups[0].settings) if groups else []
    rows = [
        [
            *g.settings.values(),
            f"{g.n}" + (f" (+{g.failed} failed)" if g.failed else ""),
            *(fmt_stat(g.stats.get(m)) for m in METRICS),
        ]
        for g in groups
    ]
    return _md([*keys, "n", *METRICS], rows)


def write_results(points: list[Point], groups: list[Group], out: Path, header: str, recommendation: str) -> str:
    """``results.csv`` (one row per run, full precision) and ``results.md`` (per setting, then per
    run when a setting ran more than once); returns the per-setting markdown table."""
    keys = list(points[0].settings) if points else []
    with open_run_file(out / "results.csv", "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["run", *keys, *COLUMNS])
        for p in points:
            w.writerow([p.slug, *(p.settings[k] for k in keys), *(p.row.get(c, "") for c in COLUMNS)])
    table = settings_table(groups)
    runs = ""
    if any(g.n + g.failed > 1 for g in groups):
        runs = "\n\n## runs\n\n" + _md(
            [*keys, *COLUMNS], [[_fmt({**p.settings, **p.row}.get(c)) for c in [*keys, *COLUMNS]] for p in points]
        )
    legend = (
        "n: finished runs of the setting (seeds / repeats); each metric is mean ± standard error "
        "(sample std / sqrt(n); — when n = 1). wall_s: the whole run, setup included (a run that "
        "builds the warm-start cache pays for it); s_per_step: training wall seconds per step (periodic "
        "evals included); speedup: vs the synchronous run of the same seed / repeat; tokens_per_s: "
        "trained tokens; acc_*: held-out accuracy (the first evaluation set's mean@n; acc_best and acc_best_step: the best "
        "periodic evaluation, eval.every_steps); idle_*: fraction of wall time the role had no work"
    )
    write_run_text(out / "results.md", f"{header}\n\n{table}\n\n{legend}\n\n{recommendation}{runs}\n")
    return table
