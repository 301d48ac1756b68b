"""The planner's live check: run, plan, run the predicted settings, compare.

    python -m bench.planner [--steps 20] [--repeats 1] [--settings "async_ratio=0;async_ratio=1;async_ratio=2"]
                            [--calibrate "async_ratio=1"] [--out DIR] [--save-traces DIR] [key=value ...]

Each repeat runs every setting (``;``-separated, each a space-separated list of overrides; the
first is the base whose trace the planner reads) back to back as a fresh ``flash run`` of the
default recipe, so machine noise hits them alike. Then ``flash plan`` predicts every setting from
the base setting's runs (every repeat, pooled): with the default parallel fraction, and with it
calibrated (``flash.app.plan.calibrate_p``) on the ``--calibrate`` setting's measured mean. Reports predicted and
measured seconds per steady step (mean over the repeats) and the relative error; ``--save-traces``
writes the trimmed traces (``flash.app.plan.trim_trace``) that tests/unit/test_planner.py reads. The last
line is JSON.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from flash.app import plan_model as pm
from flash.app import plan as planner


def run_once(recipe: str, overrides: list[str], run_dir: Path, steps: int) -> Path:
    """One ``flash run`` (short: ``steps`` steps, a small held-out set, no checkpoint)."""
    if not (run_dir / "summary.json").is_file():
        cmd = [
            sys.executable,
            "-m",
            "flash.app.cli",
            "run",
            recipe,
            f"train.steps={steps}",
            "task.eval_size=32",
            "checkpoint.enabled=false",
            "tracking.progress=false",
            "tracking.backends=[console]",
            f"run_dir={run_dir}",
            *overrides,
        ]
        subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL)
    return run_dir


def setting_of(overrides: list[str], trace: pm.Trace) -> pm.Setting:
    """The planner's Setting for a list of ``key=value`` overrides (its strict keys only)."""
    return planner.parse_candidates(overrides, trace)[0][1]


def parser() -> argparse.ArgumentParser:
    """The benchmark's options."""
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--recipe", default="stutter")
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--repeats", type=int, default=1)
    ap.add_argument("--settings", default="async_ratio=0;async_ratio=1;async_ratio=2")
    ap.add_argument("--calibrate", default="async_ratio=1", help="the setting whose run calibrates p ('' = none)")
    ap.add_argument("--out", help="run dirs here (a re-run reuses finished runs)")
    ap.add_argument("--save-traces", help="write trimmed traces of the first repeat here")
    ap.add_argument("overrides", nargs="*", help="key=value for every run")
    return ap


def main(argv: list[str] | None = None) -> dict:
    args = parser().parse_args(argv)
    settings = [s.split() for s in args.settings.split(";")]
    out = Path(args.out or tempfile.mkdtemp(prefix="flash-bench-planner-"))
    dirs: dict[int, list[Path]] = {i: [] for i in range(len(settings))}
    for rep in range(args.repeats):
        for i, ov in enumerate(settings):
            load = os.getloadavg()[0]
            d = run_once(args.recipe, [*args.overrides, *ov], out / f"s{i}-{rep}", args.steps)
            dirs[i].append(d)
            print(
                f"repeat {rep} {' '.join(ov)}: {planner.measured_step_s(d):.3f} s/step "
                f"(load average {load:.1f} -> {os.getloadavg()[0]:.1f})",
                flush=True,
            )
    measured = {i: [planner.measured_step_s(d) for d in dirs[i]] for i in dirs}
    base = planner.load_trace(dirs[0])  # every repeat of the first setting, pooled
    ps = {"default": planner.DEFAULT_P}
    if args.calibrate:
        i = settings.index(args.calibrate.split())
        q = planner.calibrate_p(base, setting_of(settings[i], base), statistics.fmean(measured[i]))
        ps["calibrated"] = {"engine": q, "trainer": q}
    rows = []
    for i, ov in enumerate(settings):
        mean = statistics.fmean(measured[i])
        row = {
            "setting": " ".join(ov),
            "measured_s_per_step": round(mean, 4),
            "measured_repeats": [round(m, 4) for m in measured[i]],
        }
        for name, p in ps.items():
            pred = planner.predict(base, setting_of(ov, base), p).step_s
            row[f"predicted_{name}"] = round(pred, 4)
            row[f"error_{name}"] = round(pred / mean - 1, 4)
        rows.append(row)
        print("  ".join(f"{k}={v}" for k, v in row.items()), flush=True)
    if args.save_traces:
        save_traces(Path(args.save_traces), dirs[0], settings, rows, args)
    result = {
        "recipe": args.recipe,
        "steps": args.steps,
        "repeats": args.repeats,
        "out": str(out),
        "parallel_fraction": ps,
        "rows": rows,
    }
    print(json.dumps(result))
    return result


def save_traces(save: Path, base_dirs: list[Path], settings: list[list[str]], rows: list[dict], args) -> None:
    """The base setting's traces (trimmed) and every setting's measured repeats (``traces.json``)."""
    for rep, d in enumerate(base_dirs):
        planner.trim_trace(d, save / f"base-{rep}")
    manifest = {
        "base": [f"base-{rep}" for rep in range(len(base_dirs))],
        "steps": args.steps,
        "settings": [
            {
                "overrides": ov,
                "measured_s_per_step": r["measured_repeats"],
                "calibrates": " ".join(ov) == args.calibrate,
            }
            for ov, r in zip(settings, rows)
        ],
    }
    (save / "traces.json").write_text(json.dumps(manifest, indent=1) + "\n")


if __name__ == "__main__":
    main()
