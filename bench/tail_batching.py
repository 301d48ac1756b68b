"""Tail batching (RollPacker) with and without asynchrony: time per step and held-out accuracy.

    python -m bench.tail_batching [--repeats 2] [--seeds 0,1] [--settings sync,sync_tail,async2,async2_tail]
                                  [--tail threshold=p90,over_provision=1.25] [key=value ...]

Each repeat (with ``--seeds``: each repeat of each seed; a *pair*) runs every setting back to back
(interleaved, so machine noise hits all alike) as a fresh `flash run` process on the same recipe
with the same number of steps and the same seed, so the same number of samples is trained in each;
the runner's automatic thread split keeps the cores equal (sync: each phase uses all cores; async:
engine and trainer share them). Reports per setting, over the pairs, the median of the seconds per
train step (a run's mean, and its median step), the per-pair ratio to the first setting (its median
and its mean ± standard error, SE = sample std / √n, none for n = 1), the held-out accuracy at the
end (median, mean ± SE), and tail
batching's own counts (groups cut, long rounds, tokens the engine decoded in all -- cut work
included), and beside each the planner's prediction (``flash plan`` on the first setting's runs,
pooled; it must be a plain-scheduler setting) against the planner's own measured figure (mean
seconds per step after the warm-up steps). The last line is JSON.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from flash.app import plan as planner
from flash.app.replicates import spread

SETTINGS = {
    "sync": ["async_ratio=0"],
    "sync_tail": ["async_ratio=0", "rollout.scheduler=tail_batching"],
    "async2": ["async_ratio=2"],
    "async2_tail": ["async_ratio=2", "rollout.scheduler=tail_batching"],
}
TAIL_KEYS = (
    "rollout/tail/cut_groups",
    "rollout/tail/long_rounds",
    "rollout/tail/swaps",
    "rollout/aborted/tail_cut",
    "rollout/tail/long_queue",
)


def run_once(recipe: str, setting: list[str], run_dir: Path, overrides: list[str]) -> dict:
    if not (run_dir / "summary.json").is_file():  # a re-run with the same --out reuses finished runs
        cmd = [
            sys.executable,
            "-m",
            "flash.app.cli",
            "run",
            recipe,
            *setting,
            f"run_dir={run_dir}",
            "tracking.progress=false",
            *overrides,
        ]
        subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL)
    summary = json.loads((run_dir / "summary.json").read_text())
    summary["run_dir"] = str(run_dir)
    summary["planner_measured_s"] = planner.measured_step_s(run_dir)
    steps = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    summary["tail"] = {k.split("/")[-1]: steps[-1][k] for k in TAIL_KEYS if k in steps[-1]}
    # every token the engine decoded, cut and aborted work included (the engine's own counter)
    summary["engine_tokens"] = sum(m.get("rollout/tokens_generated", 0.0) for m in steps)
    # the median step resists a neighbour's load spike better than the mean (train_s / steps)
    summary["step_median_s"] = statistics.median(m["time/step"] for m in steps)
    return summary


def summarize_setting(rs: list[dict], base: list[dict]) -> dict:
    """One setting's runs against the first setting's: the ``i``-th run of each is the same pair."""
    speedup = spread([a["seconds_per_step"] / b["seconds_per_step"] for a, b in zip(base, rs)])
    acc = spread([s["eval_accuracy_final"] for s in rs])
    return {
        "n_pairs": len(rs),
        "seconds_per_step_median": statistics.median(s["seconds_per_step"] for s in rs),
        "step_median_s_median": statistics.median(s["step_median_s"] for s in rs),
        **{f"speedup_vs_first_{k}": speedup[k] for k in ("median", "mean", "se")},
        **{f"eval_accuracy_final_{k}": acc[k] for k in ("median", "mean", "se")},
        "eval_accuracy_initial": rs[0]["eval_accuracy_initial"],
        "samples_trained": rs[0]["samples_trained"],
        "engine_tokens_median": statistics.median(s["engine_tokens"] for s in rs),
        "max_staleness": max(s["max_staleness_observed"] for s in rs),
        **(
            {"tail_median": {k: statistics.median(s["tail"][k] for s in rs) for k in rs[0]["tail"]}}
            if rs[0]["tail"]
            else {}
        ),
    }


def summary_line(name: str, base: str, row: dict) -> str:
    def pm(key: str, spec: str) -> str:
        se = row[f"{key}_se"]
        return f"{row[f'{key}_mean']:{spec}} ± {'—' if se is None else format(se, spec)}"

    return (
        f"{name} (n={row['n_pairs']}): speed-up vs {base} {pm('speedup_vs_first', '.2f')}x (median "
        f"{row['speedup_vs_first_median']:.2f}x), final acc {pm('eval_accuracy_final', '.3f')}"
    )


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--recipe", default="stutter")
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--seeds", default="", help="seeds to run each repeat with, e.g. 0,1 (default: the recipe's)")
    ap.add_argument("--settings", default=",".join(SETTINGS))
    ap.add_argument("--tail", default="", help="tail-batching knobs for the *_tail settings: k=v,k=v")
    ap.add_argument("--out", help="run dirs here (a re-run reuses finished runs)")
    ap.add_argument("overrides", nargs="*")
    args = ap.parse_args(argv)
    names = args.settings.split(",")
    tail = [f"rollout.tail_batching.{kv}" for kv in args.tail.split(",") if kv]
    seeds = [int(s) for s in args.seeds.split(",") if s] or [None]
    out = Path(args.out or tempfile.mkdtemp(prefix="flash-bench-tail-"))
    runs: dict[str, list[dict]] = {n: [] for n in names}
    for rep in range(args.repeats):
        for seed in seeds:
            extra, tag = ([], f"{rep}") if seed is None else ([f"seed={seed}"], f"{rep}-s{seed}")
            for name in names:
                setting = SETTINGS[name] + (tail if name.endswith("_tail") else [])
                s = run_once(args.recipe, setting, out / f"{name}-{tag}", [*args.overrides, *extra])
                runs[name].append(s)
                print(
                    f"repeat {rep} seed {seed} {name}: {s['seconds_per_step']:.3f} s/step (median "
                    f"{s['step_median_s']:.3f}), acc {s['eval_accuracy_initial']:.3f}->{s['eval_accuracy_final']:.3f}, "
                    f"engine tokens {s['engine_tokens']:.0f}, {s['tail']}",
                    flush=True,
                )
    result = {
        "recipe": args.recipe,
        "repeats": args.repeats,
        "seeds": seeds,
        "overrides": args.overrides,
        "tail": tail,
        "per_setting": {name: summarize_setting(runs[name], runs[names[0]]) for name in names},
    }
    for name, row in result["per_setting"].items():
        print(summary_line(name, names[0], row), flush=True)
    add_predictions(result, runs, names, tail)
    print(json.dumps(result))
    return result


def add_predictions(result: dict, runs: dict[str, list[dict]], names: list[str], tail: list[str]) -> None:
    """The planner's seconds per step for every setting, predicted from the first setting's runs
    (pooled), beside the planner's measured figure for that setting (median over repeats)."""
    trace = planner.load_trace([s["run_dir"] for s in runs[names[0]]])
    for name in names:
        setting = SETTINGS[name] + (tail if name.endswith("_tail") else [])
        pred = planner.predict(trace, planner.parse_candidates(setting, trace)[0][1]).step_s
        measured = statistics.median(s["planner_measured_s"] for s in runs[name])
        row = result["per_setting"][name]
        row.update(
            planner_predicted_s=round(pred, 4),
            planner_measured_s=round(measured, 4),
            planner_error=round(pred / measured - 1, 4),
        )
        print(
            f"{name}: planner predicts {pred:.3f} s/step, measured {measured:.3f} ({pred / measured - 1:+.1%})",
            flush=True,
        )


if __name__ == "__main__":
    main()
