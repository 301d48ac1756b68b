"""`flash plan` out of sample across scale: predict from a simulated trace at one scale, run the
other scales, compare (recipes/sim_rlvr.yaml).

    python -m bench.sim_plan [--base 64:0] [--targets 64:2,128:0,128:2,256:0,256:2] [--steps 6]
                             [--async-steps 9] [--time-scale 0.05] [--out DIR] [--save-traces DIR]
                             [key=value ...]

A setting ``G:r[:P]`` is ``G`` simulated GPUs split half rollout, half training, async ratio ``r``,
and ``P`` prompts per step (default ``G``: each engine instance holds the same load at every
scale, as bench/sim.py scales it). Each is one ``flash run`` (a re-run reuses a finished run dir
under ``--out``). The planner reads only the base run's trace (``flash.app.plan_sim``) and
predicts every target's mean simulated seconds per step over the same window the measurement
takes: the steps after the first ``1 + ceil(r)`` of a run as long as the target's. Reports
predicted, measured (the mean of ``sim/step_s``) and the relative error; the measured time counted
over one contiguous interval instead (``contiguous_sim_step_s``: an async engine's work between
two steps' phase windows, which ``sim/step_s`` leaves out); the run's unscaled driver share and
the load average. ``--save-traces`` writes the trimmed traces of the base run and of the targets
at its scale (``base-r<r>``) and the targets' measured values (tests/unit/test_plan_sim.py reads them).
The last line is JSON.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

from flash.app import plan_sim
from flash.app.plan import trim_trace


def parse_setting(text: str) -> tuple[int, float, int]:
    """``G:r[:P]`` → (GPUs, async ratio, prompts per step)."""
    parts = text.split(":")
    gpus, ratio = int(parts[0]), float(parts[1])
    return gpus, ratio, int(parts[2]) if len(parts) > 2 else gpus


def overrides(gpus: int, ratio: float, prompts: int) -> list[str]:
    """The ``flash run`` keys of one setting (what the planner's candidates name too)."""
    return [
        f"sim.rollout_gpus={gpus // 2}",
        f"sim.train_gpus={gpus - gpus // 2}",
        f"train.prompts_per_step={prompts}",
        f"async_ratio={ratio:g}",
    ]


def run_once(setting: tuple[int, float, int], steps: int, time_scale: float, out: Path, extra: list[str]) -> Path:
    gpus, ratio, prompts = setting
    run_dir = out / f"g{gpus}-p{prompts}-r{ratio:g}-s{steps}"
    if not (run_dir / "summary.json").is_file():
        cmd = [
            sys.executable,
            "-m",
            "flash.app.cli",
            "run",
            "sim_rlvr",
            f"train.steps={steps}",
            f"sim.time_scale={time_scale}",
            "checkpoint.enabled=false",
            "tracking.progress=false",
            f"run_dir={run_dir}",
            *overrides(gpus, ratio, prompts),
            *extra,
        ]
        subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL)
    return run_dir


def contiguous_sim_step_s(run_dir: Path) -> float:
    """Simulated seconds per steady step counted over one contiguous interval, from the end of the
    last warm-up step's phases to the end of the last step's (``timeline.jsonl``): the GPU spans'
    union over ``sim.time_scale`` plus the rest unscaled (``flash.sim.accounting``'s split). Unlike
    the mean of ``sim/step_s``, it keeps the engine work that falls between two steps' phase
    windows (while the driver logs a step, an async engine decodes on)."""
    from omegaconf import OmegaConf

    from flash.sim.accounting import gpu_spans, union_s

    cfg = OmegaConf.load(run_dir / "config.yaml")
    skip = plan_sim.sim_skip(float(cfg.async_ratio))
    rows = [json.loads(x) for x in (run_dir / "timeline.jsonl").read_text().splitlines() if x.strip()]
    ends = {r["step"]: max(b for _, b in r["phases"].values()) for r in rows}
    lo, hi = ends[skip], ends[max(ends)]
    gpu = union_s([span for r in rows for span in gpu_spans(r)], lo, hi)
    return (gpu / float(cfg.sim.time_scale) + (hi - lo - gpu)) / (max(ends) - skip)


def driver_share(run_dir: Path) -> float:
    """Mean unscaled driver seconds per steady step (``sim/driver_s``)."""
    rows = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines() if x.strip()]
    cfg_r = plan_sim.sim_skip(float(json.loads((run_dir / "summary.json").read_text())["async_ratio"]))
    later = [r["sim/driver_s"] for r in rows if r["step"] > cfg_r] or [0.0]
    return sum(later) / len(later)


def parser() -> argparse.ArgumentParser:
    """The benchmark's options."""
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--base", default="64:0")
    ap.add_argument("--targets", default="64:2,128:0,128:2,256:0,256:2")
    ap.add_argument("--steps", type=int, default=6, help="steps of a synchronous run")
    ap.add_argument("--async-steps", type=int, default=9, help="steps of an async run (its cycle is longer)")
    ap.add_argument("--time-scale", type=float, default=0.05)
    ap.add_argument("--out", help="run dirs here (a re-run reuses finished runs)")
    ap.add_argument("--save-traces", help="write the base's trimmed trace and the measured targets here")
    ap.add_argument("overrides", nargs="*", help="key=value for every run")
    return ap


def main(argv: list[str] | None = None) -> dict:
    args = parser().parse_args(argv)
    out = Path(args.out or tempfile.mkdtemp(prefix="flash-bench-sim-plan-"))
    steps_of = lambda s: args.steps if s[1] == 0 else args.async_steps
    base = parse_setting(args.base)
    load_before = os.getloadavg()
    base_dir = run_once(base, steps_of(base), args.time_scale, out, args.overrides)
    trace = plan_sim.load_sim_trace(base_dir)
    rows = []
    for text in args.targets.split(","):
        setting = parse_setting(text)
        load = os.getloadavg()[0]
        d = run_once(setting, steps_of(setting), args.time_scale, out, args.overrides)
        scale = plan_sim.parse_scales(overrides(*setting), trace)[0][1]
        pred = plan_sim.predict_sim(trace, scale, steps_of(setting))
        measured = plan_sim.measured_sim_step_s(d)
        row = {
            "setting": text,
            "gpus": setting[0],
            "async_ratio": setting[1],
            "prompts": setting[2],
            "steps": steps_of(setting),
            "predicted_sim_s": round(pred["step_s"], 2),
            "measured_sim_s": round(measured, 2),
            "error": round(pred["step_s"] / measured - 1, 4),
            "measured_contiguous_sim_s": round(contiguous_sim_step_s(d), 2),
            "driver_s": round(driver_share(d), 3),
            "load": [round(load, 1), round(os.getloadavg()[0], 1)],
        }
        rows.append(row)
        print("  ".join(f"{k}={v}" for k, v in row.items()), flush=True)
    if args.save_traces:
        save_traces(Path(args.save_traces), base_dir, base, rows, out, args, steps_of)
    result = {
        "base": args.base,
        "base_measured_sim_s": round(trace.measured_step_s, 2),
        "fit": vars(trace.costs),
        "time_scale": args.time_scale,
        "out": str(out),
        "load_before": [round(x, 1) for x in load_before],
        "rows": rows,
    }
    print(json.dumps(result))
    return result


def save_traces(save: Path, base_dir: Path, base: tuple, rows: list[dict], out: Path, args, steps_of) -> None:
    """The base's trimmed trace, the base's scale at the targets' other ratios (async bases, run
    here) and the measured targets (``targets.json``)."""
    trim_trace(base_dir, save / "base")
    for text in args.targets.split(","):  # the base's scale at other ratios: async bases
        gpus, ratio, prompts = parse_setting(text)
        if (gpus, prompts) == (base[0], base[2]):
            trim_trace(
                run_once(
                    (gpus, ratio, prompts), steps_of((gpus, ratio, prompts)), args.time_scale, out, args.overrides
                ),
                save / f"base-r{ratio:g}",
            )
    manifest = {
        "base": args.base,
        "time_scale": args.time_scale,
        "targets": [
            {k: r[k] for k in ("setting", "steps", "measured_sim_s", "measured_contiguous_sim_s", "predicted_sim_s")}
            for r in rows
        ],
    }
    (save / "targets.json").write_text(json.dumps(manifest, indent=1) + "\n")


if __name__ == "__main__":
    main()
