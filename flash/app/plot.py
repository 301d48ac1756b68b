"""`flash plot RUN_DIR... [-o FILE]`: one picture of how runs compare, drawn from their run dirs.

Panels (each overlaid for every run given): reward and held-out accuracy against the train step
and against wall-clock seconds since training began; throughput (tokens/s generated and trained);
the staleness histogram of trained samples; and a per-role timeline of busy and idle time for a
window of steps -- what shows whether rollout and training truly overlap, which a single idle ratio
can only summarise.

Reads ``metrics.jsonl``, ``eval.jsonl``, ``timeline.jsonl`` and ``summary.json`` within
``flash.run_files``' bounds (size, line length, nesting: one line naming the file and line past
one); runs that predate a file fall back to what the others hold. Figures are built with
``matplotlib.figure.Figure`` and saved by the Agg canvas: no pyplot global state, no display needed.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path

from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.container import ErrorbarContainer
from matplotlib.figure import Figure

from flash.app.replicates import Group
from flash.errors import FlashError
from flash.run_files import load_jsonl, open_run_file, read_json
from flash.usage import busy_fraction, clip_spans


@dataclass
class RunData:
    dir: Path
    label: str
    metrics: list[dict] = field(default_factory=list)
    evals: list[dict] = field(default_factory=list)  # {step, elapsed, accuracy}
    timeline: list[dict] = field(default_factory=list)
    summary: dict = field(default_factory=dict)


def run_label(path: Path) -> str:
    """The sweep settings of a run (``sweep_point.json``), else its directory name."""
    point = path / "sweep_point.json"
    if os.path.lexists(point):
        settings = read_json(point).get("settings")
        settings = settings if isinstance(settings, dict) else {}
        return " ".join(f"{k}={v}" for k, v in settings.items()) or path.name
    return path.name


def load_run(path: str | Path, label: str | None = None) -> RunData:
    path = Path(path)
    run = RunData(
        dir=path,
        label=label or run_label(path),
        metrics=load_jsonl(path / "metrics.jsonl"),
        timeline=load_jsonl(path / "timeline.jsonl"),
        summary=read_json(path / "summary.json", default={}),
    )
    run.evals = load_jsonl(path / "eval.jsonl") or _fallback_evals(run)
    return run


def _fallback_evals(run: RunData) -> list[dict]:
    """Evaluations of a run without ``eval.jsonl``: summary's initial/final plus periodic ones."""
    evals = []
    if "eval_accuracy_initial" in run.summary:
        evals.append({"step": 0, "elapsed": 0.0, "accuracy": run.summary["eval_accuracy_initial"]})
    for m in run.metrics:
        if "eval/accuracy" in m:
            evals.append({"step": m["step"], "elapsed": m.get("time/elapsed", 0.0), "accuracy": m["eval/accuracy"]})
    if "eval_accuracy_final" in run.summary:
        evals.append(
            {
                "step": run.summary.get("steps", len(run.metrics)),
                "elapsed": run.summary.get("train_seconds", 0.0),
                "accuracy": run.summary["eval_accuracy_final"],
            }
        )
    return evals


def elapsed(run: RunData) -> list[float]:
    """Seconds since training began at the end of each step (cumulative step time if not logged)."""
    out, total = [], 0.0
    for m in run.metrics:
        total += m.get("time/step", 0.0)
        out.append(m.get("time/elapsed", total))
    return out


def smooth(values: list[float], k: int) -> list[float]:
    """Trailing moving average over ``k`` points (RL rewards are noisy step to step)."""
    out, acc = [], 0.0
    for i, v in enumerate(values):
        acc += v - (values[i - k] if i >= k else 0.0)
        out.append(acc / min(i + 1, k))
    return out


def staleness_histogram(run: RunData) -> dict[int, float]:
    """Trained samples per staleness (steps behind the policy), summed over the run."""
    hist: dict[int, float] = {}
    for m in run.metrics:
        for key, value in m.items():
            if key.startswith("staleness/count_"):
                k = int(key.rsplit("_", 1)[1])
                hist[k] = hist.get(k, 0.0) + value
    return hist


def throughput(run: RunData) -> tuple[float, float]:
    """(generated, trained) tokens per second of training wall time."""
    seconds = run.summary.get("train_seconds") or (elapsed(run) or [0.0])[-1]
    if seconds <= 0:
        return 0.0, 0.0
    gen = sum(m.get("rollout/tokens_generated", 0.0) for m in run.metrics)
    trained = sum(m.get("train/batch_tokens", 0.0) for m in run.metrics)
    return gen / seconds, trained / seconds


def default_window(steps: int, width: int = 3) -> tuple[int, int]:
    """A few steps just past the middle of the run: warmed up, not yet winding down."""
    lo = max(1, min(steps // 2, steps - width + 1))
    return lo, min(steps, lo + width - 1)


def _series(ax) -> int:
    return len(ax.get_lines()) + len(ax.containers)


def save_png(fig, out: str | Path) -> None:
    """``fig`` as a PNG at ``out``, opened by ``flash.run_files`` (never through a link)."""
    with open_run_file(out, "wb") as f:
        fig.savefig(f, dpi=100, format="png")


def plot_runs(runs: list[RunData], out: str | Path, window: tuple[int, int] | None = None) -> dict[str, int]:
    """Draw every panel for ``runs`` into one PNG; returns series drawn per panel (for tests)."""
    fig = Figure(figsize=(16, 12), layout="constrained")
    FigureCanvasAgg(fig)
    grid = fig.add_gridspec(3, 3, height_ratios=[1, 1, 1.2])
    ax = {
        name: fig.add_subplot(grid[r, c])
        for name, (r, c) in {
            "reward_vs_step": (0, 0),
            "reward_vs_time": (0, 1),
            "throughput": (0, 2),
            "eval_vs_step": (1, 0),
            "eval_vs_time": (1, 1),
            "staleness": (1, 2),
        }.items()
    }
    ax["timeline"] = fig.add_subplot(grid[2, :])
    _reward_panels(ax["reward_vs_step"], ax["reward_vs_time"], runs)
    _eval_panels(ax["eval_vs_step"], ax["eval_vs_time"], runs)
    _throughput_panel(ax["throughput"], runs)
    _staleness_panel(ax["staleness"], runs)
    drawn = _timeline_panel(ax["timeline"], runs, window)
    save_png(fig, out)
    return {**{name: _series(a) for name, a in ax.items()}, "timeline": drawn}


def _reward_panels(by_step, by_time, runs: list[RunData]) -> None:
    for run in runs:
        steps = [m["step"] for m in run.metrics]
        rewards = smooth([m.get("reward/mean", 0.0) for m in run.metrics], max(1, len(steps) // 12))
        by_step.plot(steps, rewards, label=run.label)
        by_time.plot(elapsed(run), rewards, label=run.label)
    by_step.set(title="training reward (moving average)", xlabel="train step", ylabel="reward/mean")
    by_time.set(title="training reward vs wall-clock", xlabel="seconds since training began", ylabel="reward/mean")
    by_step.legend(fontsize=8)


def _eval_panels(by_step, by_time, runs: list[RunData]) -> None:
    for run in runs:
        evals = sorted(run.evals, key=lambda e: e["step"])
        acc = [e["accuracy"] for e in evals]
        by_step.plot([e["step"] for e in evals], acc, marker="o", label=run.label)
        by_time.plot([e["elapsed"] for e in evals], acc, marker="o", label=run.label)
    by_step.set(title="held-out accuracy", xlabel="train step", ylabel="accuracy")
    by_time.set(title="held-out accuracy vs wall-clock", xlabel="seconds since training began", ylabel="accuracy")
    by_step.legend(fontsize=8)


def _throughput_panel(ax, runs: list[RunData]) -> None:
    xs = range(len(runs))
    rates = [throughput(r) for r in runs]
    ax.bar([x - 0.2 for x in xs], [g for g, _ in rates], width=0.4, label="generated")
    ax.bar([x + 0.2 for x in xs], [t for _, t in rates], width=0.4, label="trained")
    ax.set_xticks(list(xs), [r.label for r in runs], rotation=20, ha="right", fontsize=8)
    ax.set(title="throughput", ylabel="tokens / s of training time")
    ax.legend(fontsize=8)


def _staleness_panel(ax, runs: list[RunData]) -> None:
    hists = [staleness_histogram(r) for r in runs]
    ks = sorted({k for h in hists for k in h}) or [0]
    width = 0.8 / max(len(runs), 1)
    for i, (run, hist) in enumerate(zip(runs, hists)):
        total = sum(hist.values()) or 1.0
        ax.bar(
            [k - 0.4 + width * (i + 0.5) for k in ks],
            [hist.get(k, 0.0) / total for k in ks],
            width=width,
            label=run.label,
        )
    ax.set_xticks(ks)
    ax.set(title="staleness of trained samples", xlabel="policy versions behind", ylabel="fraction of samples")
    ax.legend(fontsize=8)


def _timeline_panel(ax, runs: list[RunData], window: tuple[int, int] | None) -> int:
    """Per run, two lanes (engine, trainer): busy spans coloured, idle blank, weight sync in red.

    Returns how many runs had timeline data in the window.
    """
    ticks, labels, drawn = [], [], 0
    for i, run in enumerate(runs):
        steps = len(run.timeline)
        lo, hi = window or default_window(steps)
        rows = [t for t in run.timeline if lo <= t["step"] <= hi and t.get("phases")]
        base = (len(runs) - 1 - i) * 3
        ticks += [base + 1.5, base + 0.5]
        labels += [f"{run.label}  engine", f"{run.label}  trainer"]
        if not rows:
            continue
        drawn += 1
        t0 = min(min(s[0] for s in t["phases"].values()) for t in rows)
        t1 = max(max(s[1] for s in t["phases"].values()) for t in rows)
        engine = [s for t in run.timeline for s in t.get("engine_busy", [])]
        trainer = [s for t in rows for s in t.get("trainer_busy", [])]
        sync = [t["phases"][p] for t in rows for p in ("suspend", "push_weights", "resume") if p in t["phases"]]
        for lane, spans, color in ((base + 1.1, engine, "tab:blue"), (base + 0.1, trainer, "tab:orange")):
            ax.broken_barh([(a - t0, b - a) for a, b in clip_spans(spans, t0, t1)], (lane, 0.8), color=color)
            ax.broken_barh([(a - t0, b - a) for a, b in sync], (lane, 0.8), color="tab:red", alpha=0.6)
            ax.text(t1 - t0, lane + 0.4, f" idle {1 - busy_fraction(spans, t0, t1):.0%}", va="center", fontsize=8)
        ends = [t["phases"].get("resume", [t1, t1])[1] - t0 for t in rows]
        ax.vlines(ends, base, base + 2, color="grey", lw=0.5, linestyles="dotted")  # step ends
    ax.set_yticks(ticks, labels, fontsize=8)
    ax.set(
        title="busy (colour) and idle (blank) per role, weight sync in red, one window of steps per run",
        xlabel="seconds from the window's first step",
    )
    return drawn


def plot_sweep(groups: list[Group], out: str | Path, tolerance: float) -> dict[str, int]:
    """Seconds per step (bars, speed-up on top) and final held-out accuracy (line) per setting, each
    a mean over its runs (seeds, repeats) with ± one standard error as error bars.

    ``groups`` are the settings of ``flash.app.sweep`` with finished runs; the band is the synchronous
    setting's mean accuracy minus the tolerance, what a setting must stay above to be recommended.
    """
    fig = Figure(figsize=(max(6, 1.4 * len(groups) + 3), 4.5), layout="constrained")
    FigureCanvasAgg(fig)
    ax = fig.add_subplot()
    xs = list(range(len(groups)))
    speed = [g.stats["s_per_step"] for g in groups]
    bars = ax.bar(
        xs,
        [s.mean for s in speed],
        yerr=[s.se or 0.0 for s in speed],
        capsize=4,
        color="tab:blue",
        alpha=0.7,
        label="s / step",
    )
    for bar, g, s in zip(bars, groups, speed):
        if "speedup" in g.stats:  # above the error bar, offset to clear its cap
            ax.annotate(
                f"{g.stats['speedup'].mean:.2f}x",
                (bar.get_x() + bar.get_width() / 2, s.mean + (s.se or 0.0)),
                xytext=(0, 3),
                textcoords="offset points",
                ha="center",
                va="bottom",
                fontsize=9,
            )
    ax.set_xticks(xs, [f"{g.label()}\nn={g.n}" for g in groups], rotation=15, ha="right", fontsize=9)
    ax.set_ylim(0, 1.15 * max(s.mean + (s.se or 0.0) for s in speed))  # room for the speed-up labels
    ax.set(
        ylabel="training seconds per step (mean ± SE)", title="sweep: speed (bars), held-out accuracy (line); mean ± SE"
    )
    acc = ax.twinx()
    final = [g.stats["acc_final"] for g in groups]
    acc.errorbar(
        xs,
        [a.mean for a in final],
        yerr=[a.se or 0.0 for a in final],
        capsize=4,
        color="tab:green",
        marker="o",
        label="final accuracy",
    )
    sync = [g for g in groups if all(r.get("async_ratio_value") == 0 for r in g.rows)]
    if len(sync) == 1:
        top = sync[0].stats["acc_final"].mean
        acc.axhspan(top - tolerance, top, color="tab:green", alpha=0.12)
    acc.set_ylim(0, max(0.05, 1.15 * max(a.mean + (a.se or 0.0) for a in final)))
    acc.set_ylabel("final held-out accuracy (mean ± SE)", color="tab:green")
    save_png(fig, out)
    return {
        "seconds_per_step": len(bars),
        "accuracy": len(acc.containers),
        "error_bars": sum(isinstance(c, ErrorbarContainer) for a in (ax, acc) for c in a.containers),
    }


def main(run_dirs: list[str], out: str, window: str | None = None) -> dict[str, int]:
    """The `flash plot` verb: load, draw, say where the PNG went."""
    runs = [load_run(d) for d in run_dirs]
    missing = [str(r.dir) for r in runs if not r.metrics]
    if missing:
        raise FlashError(f"no metrics.jsonl in {', '.join(missing)} (is it a flash run dir?)")
    counts = plot_runs(runs, out, parse_window(window))
    print(f"flash: wrote {out} ({len(runs)} run{'s' * (len(runs) != 1)})")
    return counts


def parse_window(text: str | None) -> tuple[int, int] | None:
    """``A:B`` (inclusive train steps) or ``A`` → a window; None → the default one per run."""
    if not text:
        return None
    lo, _, hi = text.partition(":")
    try:
        window = int(lo), int(hi or lo)
    except ValueError:
        raise FlashError(f"--steps {text}: expected A:B (train steps, e.g. 10:12) or one step A") from None
    if not 1 <= window[0] <= window[1]:
        raise FlashError(f"--steps {text}: expected 1 <= A <= B (train steps count from 1)")
    return window
