"""`flash plan RUN_DIR... [key=v1,v2 ...] [--calibrate RUN_DIR2]`: predict seconds per train step
for other settings.

Reads a finished run's measurements (``metrics.jsonl``: per-step phase times, engine busy seconds,
decode iterations, tokens; ``ledger.jsonl``: every trained sample's response and prompt length;
``config.yaml`` and ``summary.json``: the settings and the thread split it ran with), fits the
costs of ``flash.app.plan_model`` to them (``fit_costs``), and predicts the candidate grid
(``flash.app.plan_candidates``): the cartesian product of the values given, every other setting as
in the run. Prints a table ranked fastest first and, last, one JSON line. Several run dirs of one
setting (repeats) are pooled; a run at another thread split (``--calibrate``) sets how threads
scale (``calibrate_p``), else the parallel fraction is ``DEFAULT_P``.

The costs are fitted on the steady steps (the first ``SKIP_STEPS`` are warm-up: compilation,
caches, the first admissions). What the model assumes, and where it departs from a real run, is
in ``flash.app.plan_model``'s docstring; ``bench/planner.py`` checks predictions against runs.
A run with simulated GPU roles (``train.backend: sim``) is planned by ``flash.app.plan_sim``
instead, in simulated seconds and across scale (the CLI picks it from the run's config).
"""

from __future__ import annotations

import gzip
import json
import os
import statistics
from pathlib import Path

from flash.app import plan_model as pm
from flash.app.plan_candidates import parse_candidates
from flash.errors import ConfigError
from flash.run_files import read_json, read_jsonl, read_text

SKIP_STEPS = 2

# Amdahl parallel fraction of both roles (flash.app.plan_model.amdahl) when no second run calibrates it:
# 0.35 from the async-ratio sweep of the default recipe (BENCHMARKS.md) on a lightly loaded machine (train 0.48 s at 2 threads vs about
# 0.58 s at 1); on a machine shared with other jobs it is lower, even negative (see
# ``calibrate_p`` and BENCHMARKS.md, planner section)
DEFAULT_P = {"engine": 0.35, "trainer": 0.35}
P_GRID = [round(-0.9 + 0.01 * i, 2) for i in range(186)]  # -0.9 .. 0.95


def _jsonl(path: Path) -> list[dict]:
    """A JSON-lines file, or its gzipped form ``<path>.gz`` (trimmed traces, ``trim_trace``), read
    within ``flash.run_files``' bounds."""
    gz = path.with_name(path.name + ".gz")
    return [line for _, line in read_jsonl(gz if not os.path.lexists(path) and os.path.lexists(gz) else path)]


def _lstsq2(x1: list[float], x2: list[float], y: list[float]) -> tuple[float, float]:
    """Non-negative least squares for ``y ≈ b1·x1 + b2·x2`` (two columns, no intercept): the
    unconstrained solution, or the better one-column fit when it has a negative coefficient."""
    s11, s22 = sum(a * a for a in x1), sum(b * b for b in x2)
    s12 = sum(a * b for a, b in zip(x1, x2))
    s1y, s2y = sum(a * c for a, c in zip(x1, y)), sum(b * c for b, c in zip(x2, y))
    det = s11 * s22 - s12 * s12
    if det > 1e-12 * max(s11 * s22, 1e-30):
        b1, b2 = (s1y * s22 - s2y * s12) / det, (s2y * s11 - s1y * s12) / det
        if b1 >= 0 and b2 >= 0:
            return b1, b2
    only1 = (s1y / s11 if s11 else 0.0, 0.0)
    only2 = (0.0, s2y / s22 if s22 else 0.0)

    def sse(b):
        return sum((c - b[0] * a - b[1] * d) ** 2 for a, d, c in zip(x1, x2, y))

    return min((max(0.0, only1[0]), 0.0), (0.0, max(0.0, only2[1])), key=sse)


def _phase(row: dict, *names: str) -> float:
    return sum(float(row.get(f"time/{n}", 0.0)) for n in names)


def fit_costs(
    rows: list[dict], steps: list[list[list[int]]], prompt_len: float, threads: tuple[int, int], cores: int
) -> pm.Costs:
    """Costs from the steady steps' metrics rows and their groups' lengths (same order).

    engine: ``busy_s ≈ a·decode_steps + c·tokens`` (non-negative least squares); trainer:
    ``train ≈ u1·rows·width`` (width = prompt + the step's longest response): total train seconds
    over total padded tokens; update, other and g0: means. Means, not medians, because the
    planner predicts seconds per step as a run reports them: total time over steps."""
    a, c = _lstsq2(
        [float(r.get("rollout/decode_steps", 0.0)) for r in rows],
        [float(r.get("rollout/tokens_generated", 0.0)) for r in rows],
        [float(r.get("rollout/busy_s", 0.0)) for r in rows],
    )
    padded = [sum(len(g) for g in st) * (prompt_len + max((max(g) for g in st), default=0)) for st in steps]
    u1 = sum(_phase(r, "train", "recompute_prox") for r in rows) / max(sum(padded), 1e-9)
    update = statistics.fmean(_phase(r, "suspend", "push_weights", "resume", "sleep", "wake_up") for r in rows)
    other = statistics.fmean(
        max(
            0.0,
            float(r["time/step"])
            - _phase(
                r, "get_batch", "train", "recompute_prox", "suspend", "push_weights", "resume", "sleep", "wake_up"
            ),
        )
        for r in rows
    )
    g0 = statistics.fmean(max(0.0, _phase(r, "get_batch") - float(r.get("rollout/busy_s", 0.0))) for r in rows)
    return pm.Costs(
        a=a,
        c=c,
        u0=0.0,
        u1=u1,
        update_s=update,
        other_s=other,
        g0=g0,
        engine_threads=threads[0],
        trainer_threads=threads[1],
        cores=cores,
        prompt_len=prompt_len,
        **_cpu_rates(rows),
    )


def _cpu_rates(rows: list[dict]) -> dict[str, float]:
    """CPU per busy second of engine and trainer, and the driver's CPU per step (``Costs``), from
    the runs' ``*/cpu_s`` counts; zeros when the run predates them (no CPU bound then)."""
    if not all("rollout/cpu_s" in r and "train/cpu_s" in r for r in rows):
        return {}
    busy_e = sum(float(r.get("rollout/busy_s", 0.0)) for r in rows)
    busy_t = sum(_phase(r, "train", "recompute_prox") for r in rows)
    return {
        "cpu_engine": sum(r["rollout/cpu_s"] for r in rows) / max(busy_e, 1e-9),
        "cpu_train": sum(r["train/cpu_s"] for r in rows) / max(busy_t, 1e-9),
        # the driver and the reward pool (its workers and their sandbox runs): per step
        "cpu_driver_s": statistics.fmean(
            float(r.get("driver/cpu_s", 0.0)) + float(r.get("reward/cpu_s", 0.0)) for r in rows
        ),
    }


def measured_step_s(run_dir: str | Path, skip: int = SKIP_STEPS) -> float:
    """A run's seconds per step as the planner predicts it: the mean over its steady steps."""
    rows = [r for r in _jsonl(Path(run_dir) / "metrics.jsonl") if "time/step" in r and r["step"] > skip]
    if not rows:
        raise ConfigError(f"{run_dir}: no steps after the first {skip} in metrics.jsonl")
    return statistics.fmean(r["time/step"] for r in rows)


def _read_run(d: Path, skip: int) -> tuple:
    """One run dir: (config, summary, steady metrics rows, their steps' groups, prompt lengths)."""
    from omegaconf import OmegaConf

    from flash.app.config import read_recipe

    for name in ("metrics.jsonl", "ledger.jsonl", "config.yaml", "summary.json"):
        if not (d / name).is_file() and not (d / f"{name}.gz").is_file():
            raise ConfigError(f"{d} is not a finished run dir: {name} is missing")
    cfg = read_recipe(d / "config.yaml")  # the run's file is data: a bad one is one line, not a traceback
    if OmegaConf.select(cfg, "rollout.scheduler", default="plain") != "plain":
        raise ConfigError(
            f"{d}: plan from a run with rollout.scheduler=plain (a tail-batching run's "
            f"response lengths are cut at its threshold, so they understate the tail)"
        )
    by_step: dict[int, dict[int, list[int]]] = {}
    plens = []
    for e in _jsonl(d / "ledger.jsonl"):
        if e.get("outcome") == "trained":
            if "len" not in e:
                raise ConfigError(
                    f"{d}/ledger.jsonl has no response lengths ('len'): the run predates `flash plan`; record a new run"
                )
            by_step.setdefault(int(e["step"]) + 1, {}).setdefault(int(e["prompt_id"]), []).append(int(e["len"]))
            plens.append(int(e.get("plen", 0)))
    rows = [r for r in _jsonl(d / "metrics.jsonl") if "time/step" in r and r["step"] > skip and r["step"] in by_step]
    if len(rows) < 3:
        raise ConfigError(f"{d}: {len(rows)} steady steps after skipping {skip}; need at least 3")
    steps = [list(by_step[r["step"]].values()) for r in rows]
    return cfg, read_json(d / "summary.json"), rows, steps, plens


def _run_setting(cfg, summary) -> tuple[pm.Setting, tuple[int, int], int, int]:
    """(the run's Setting with its configured threads, the threads it resolved, cores, B)."""
    from omegaconf import OmegaConf

    r = float(cfg.async_ratio)
    cores = int(summary.get("cores") or cfg.ray.num_cpus or 2)
    threads = summary.get("threads") or {}
    resolved = pm.auto_threads(
        cores,
        r,
        int(threads.get("engine", cfg.resources.engine_threads)),
        int(threads.get("trainer", cfg.resources.trainer_threads)),
    )
    replicas = int(OmegaConf.select(cfg, "placement.roles.actor_infer.num_workers", default=1) or 1)
    # the config's own thread settings (0 = auto): a candidate keeps them unless it sets its own
    setting = pm.Setting(
        async_ratio=r,
        engine_threads=int(cfg.resources.engine_threads),
        trainer_threads=int(cfg.resources.trainer_threads),
        replicas=replicas,
    )
    return setting, resolved, cores, int(cfg.train.prompts_per_step)


def load_trace(run_dirs: str | Path | list, skip: int = SKIP_STEPS) -> pm.Trace:
    """Read and fit one finished run dir, or several runs of one setting (repeats: their steady
    steps are pooled, which halves the machine's noise in the fit twice as fast)."""
    dirs = [Path(d) for d in (run_dirs if isinstance(run_dirs, (list, tuple)) else [run_dirs])]
    rows, steps, plens, first = [], [], [], None
    for d in dirs:
        cfg, summary, r, st, pl = _read_run(d, skip)
        here = _run_setting(cfg, summary)
        if first is not None and here != first:
            raise ConfigError(
                f"{d} ran another setting than {dirs[0]} ({here[0]} vs {first[0]}); pool only repeats of one setting"
            )
        first = first or here
        rows, steps, plens = rows + r, steps + st, plens + pl
    setting, resolved, cores, B = first
    costs = fit_costs(rows, steps, statistics.fmean(plens) if plens else 0.0, resolved, cores)
    return pm.Trace(
        costs=costs,
        groups=[g for st in steps for g in st],
        steps=steps,
        setting=setting,
        B=B,
        measured_step_s=statistics.fmean(x["time/step"] for x in rows),
    )


def predict(trace: pm.Trace, s: pm.Setting, p: dict[str, float] | None = None) -> pm.Prediction:
    """Seconds per step of setting ``s``: the trace's costs moved to ``s``'s threads, replicas and
    overlap (``flash.app.plan_model``), averaged over its rounds (the trace's steps, or simulated
    tail-batching rounds)."""
    p = p or DEFAULT_P
    k, ref = trace.costs, trace.setting  # k: at the threads the run resolved (k.engine_threads, ...)
    e, t = pm.auto_threads(k.cores, s.async_ratio, s.engine_threads, s.trainer_threads)
    e_rep, ref_rep = max(1, e // s.replicas), max(1, k.engine_threads // ref.replicas)
    over = pm.oversubscription(e, t, k.cores, s.async_ratio > 0) / pm.oversubscription(
        k.engine_threads, k.trainer_threads, k.cores, ref.async_ratio > 0
    )
    a = pm.scale(k.a, ref_rep, e_rep, p["engine"]) * over
    c = pm.scale(k.c, ref_rep, e_rep, p["engine"]) * over
    u1 = pm.scale(k.u1, k.trainer_threads, t, p["trainer"]) * over
    rounds = pm.simulate_tail(trace.groups, trace.B, s) if s.tail else [pm.sync_round(st) for st in trace.steps]
    parts = {"engine_s": 0.0, "train_s": 0.0, "cpu_bound_s": 0.0, "step_s": 0.0, "long_rounds": 0.0}
    for rnd in rounds:
        eng = pm.replica_engine_s(rnd.iterations, rnd.tokens, a, c, s.replicas)
        tr = pm.train_s(rnd.rows, k.prompt_len + rnd.max_len, k.u0, u1)
        parts["engine_s"] += eng
        parts["train_s"] += tr
        step = pm.step_time(eng, tr, k.update_s, k.other_s, k.g0, s.async_ratio)
        if s.async_ratio > 0:  # overlapped roles: no faster than the cores can do all of it
            bound = pm.cpu_bound_step(
                pm.round_engine_s(rnd.iterations, rnd.tokens, k.a, k.c),
                pm.train_s(rnd.rows, k.prompt_len + rnd.max_len, k.u0, k.u1),
                k.update_s,
                k.other_s,
                k,
            )
            parts["cpu_bound_s"] += bound
            step = max(step, bound)
        parts["step_s"] += step
        parts["long_rounds"] += rnd.long
    parts = {name: v / len(rounds) for name, v in parts.items()}
    parts.update(engine_threads=e, trainer_threads=t)
    return pm.Prediction(parts["step_s"], parts)


def calibrate_p(trace: pm.Trace, target: pm.Setting, measured_s: float) -> float:
    """The parallel fraction ``p`` (both roles) with which ``trace`` best predicts ``measured_s``,
    the seconds per step measured at ``target``: a run at another thread split (e.g. an async run
    beside a sync one) is what measures how the cores split on this machine under its present
    load. ``p < 0`` means a second thread costs more than it gives (an oversubscribed machine).
    A grid search over ``P_GRID``."""
    e, t = pm.auto_threads(trace.costs.cores, target.async_ratio, target.engine_threads, target.trainer_threads)
    if (e, t) == (trace.costs.engine_threads, trace.costs.trainer_threads):
        raise ConfigError(
            "calibration needs a run with another thread split than the planned run's (e.g. "
            f"async_ratio > 0 beside a synchronous run); both ran with {e}/{t} threads"
        )

    def err(p: float) -> float:
        return abs(predict(trace, target, {"engine": p, "trainer": p}).step_s - measured_s)

    return min(P_GRID, key=err)


def plan(
    run_dir: str | list,
    items: list[str],
    p: dict[str, float] | None = None,
    out=print,
    calibrate: str | list | None = None,
) -> list[dict]:
    """Predict every candidate, print the ranked table (fastest first) and a final JSON line;
    returns the rows (the JSON line's ``candidates``). ``run_dir``: one run dir or repeats of one
    setting; ``calibrate``: run dir(s) of another setting whose measured time sets the parallel
    fraction (``calibrate_p``); else ``p`` or ``DEFAULT_P``."""
    trace = load_trace(run_dir)
    dirs = [str(d) for d in (run_dir if isinstance(run_dir, (list, tuple)) else [run_dir])]
    p = {**DEFAULT_P, **(p or {})}
    if calibrate:
        other = load_trace(calibrate)
        q = calibrate_p(trace, other.setting, other.measured_step_s)
        p = {"engine": q, "trainer": q}
        out(
            f"flash plan: parallel fraction p = {q:.2f}, calibrated on {calibrate} "
            f"(measured {other.measured_step_s:.3f} s/step)"
        )
    rows = _ranked(trace, items, p)
    own = predict(trace, trace.setting, p).step_s
    k = trace.costs
    out(f"flash plan: {', '.join(dirs)}: {_fit_line(trace, own)}")
    for line in _table(trace, rows):
        out(line)
    out(
        json.dumps(
            {
                "run_dirs": dirs,
                "measured_s_per_step": round(trace.measured_step_s, 4),
                "model_s_per_step": round(own, 4),
                "parallel_fraction": p,
                "fit": {
                    f: round(getattr(k, f), 7)
                    for f in ("a", "c", "u1", "update_s", "other_s", "g0", "cpu_engine", "cpu_train", "cpu_driver_s")
                },
                "candidates": rows,
            }
        )
    )
    return rows


def _ranked(trace: pm.Trace, items: list[str], p: dict[str, float]) -> list[dict]:
    """The candidates' predictions as rows, fastest first."""
    rows = []
    for written, setting in parse_candidates(items, trace):
        pred = predict(trace, setting, p)
        rows.append(
            {
                "settings": written,
                "predicted_s_per_step": round(pred.step_s, 4),
                **{k: round(v, 4) for k, v in pred.parts.items() if k != "step_s"},
            }
        )
    rows.sort(key=lambda r: r["predicted_s_per_step"])
    return rows


def _fit_line(trace: pm.Trace, own: float) -> str:
    """The measured step, the model's own (``own``) and the fitted costs, in one line."""
    k = trace.costs
    return (
        f"measured {trace.measured_step_s:.3f} s/step over {len(trace.steps)} steady "
        f"steps (the model reproduces {own:.3f}); fit: a={k.a * 1e3:.2f} ms/iteration, c={k.c * 1e3:.3f} "
        f"ms/token, train {k.u1 * 1e6:.2f} us/padded token, update {k.update_s:.3f} s, other {k.other_s:.3f} s, "
        f"wait {k.g0:.3f} s, CPU per busy second engine {k.cpu_engine:.2f} trainer {k.cpu_train:.2f}, driver "
        f"{k.cpu_driver_s:.3f} CPU-s/step (threads engine {k.engine_threads}, trainer {k.trainer_threads}, "
        f"{k.cores} cores)"
    )


def _table(trace: pm.Trace, rows: list[dict]) -> list[str]:
    """The ranked table's lines, header first, columns padded to their widest cell."""
    keys = list(rows[0]["settings"]) if rows else []
    header = ["#", *keys, "s/step", "vs run", "engine s", "train s", "CPU bound s", "threads e/t", "long rounds"]
    table = [
        [
            str(i + 1),
            *(r["settings"][key] for key in keys),
            f"{r['predicted_s_per_step']:.3f}",
            f"{trace.measured_step_s / r['predicted_s_per_step']:.2f}x",
            f"{r['engine_s']:.3f}",
            f"{r['train_s']:.3f}",
            f"{r['cpu_bound_s']:.3f}" if r["cpu_bound_s"] else "-",
            f"{int(r['engine_threads'])}/{int(r['trainer_threads'])}",
            f"{r['long_rounds']:.2f}",
        ]
        for i, r in enumerate(rows)
    ]
    widths = [max(len(h), *(len(row[j]) for row in table)) if table else len(h) for j, h in enumerate(header)]
    return ["  ".join(cell.ljust(w) for cell, w in zip(line, widths)) for line in [header, *table]]


def trim_trace(src: str | Path, dst: str | Path) -> Path:
    """Copy what ``load_trace`` reads from run dir ``src`` to ``dst``, nothing else (small enough
    to commit as a test fixture): the step rows' timing keys (wall, and simulated for a simulated
    run: ``flash.app.plan_sim``), trained samples' lengths (gzipped),
    the config, the summary's thread split."""
    src, dst = Path(src), Path(dst)
    dst.mkdir(parents=True, exist_ok=True)
    keep = (
        "rollout/busy_s",
        "rollout/decode_steps",
        "rollout/tokens_generated",
        "rollout/cpu_s",
        "train/cpu_s",
        "driver/cpu_s",
        "reward/cpu_s",
    )
    rows = [
        {k: v for k, v in r.items() if k == "step" or k.startswith(("time/", "sim/")) or k in keep}
        for r in _jsonl(src / "metrics.jsonl")
    ]
    (dst / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    lines = [
        {k: e[k] for k in ("step", "prompt_id", "len", "plen") if k in e}
        for e in _jsonl(src / "ledger.jsonl")
        if e.get("outcome") == "trained"
    ]
    text = "".join(json.dumps({"outcome": "trained", **e}, separators=(",", ":")) + "\n" for e in lines)
    (dst / "ledger.jsonl.gz").write_bytes(gzip.compress(text.encode(), mtime=0))
    (dst / "config.yaml").write_text(read_text(src / "config.yaml"))
    summary = read_json(src / "summary.json")
    (dst / "summary.json").write_text(
        json.dumps({k: summary.get(k) for k in ("threads", "cores", "seconds_per_step", "steps", "async_ratio")})
    )
    return dst
