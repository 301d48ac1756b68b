"""A finished run's ``summary.json``: held-out accuracy before and after training, the steps and
their seconds, what rollout admitted, trained, filtered and aborted, faults and skips, and what a
result depends on besides the config (the torch threads each stage ran with, the cores, the
library versions, how the reward sandbox isolated model-written code on this host).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from flash.app.config import FlashConfig
from flash.app.progress import no_update_streak
from flash.app.settings import resolve_threads, run_cores
from flash.run_files import load_jsonl, read_jsonl


def summary(cfg: FlashConfig, r: Any, records, acc0, acc1, train_s, left) -> dict:
    """The run's summary (``summary.json``) of ``r``, the runner's ``Run``: ``records`` are the controller's steps, ``left`` the prompts
    rollout left unfinished; accuracies before and after training, training seconds."""
    steps = r.clock.start_step + len(records)  # a resumed run: all of its steps (train_s spans them too)
    phase_keys = sorted({k for rec in records for k in rec.metrics if k.startswith("time/")})
    totals = run_totals(_read_jsonl(Path(r.dir) / "metrics.jsonl"), phase_keys)
    return {
        "eval_accuracy_initial": acc0,
        "eval_accuracy_final": acc1,
        **eval_record(_read_jsonl(Path(r.dir) / "eval.jsonl")),
        "steps": steps,
        "wall_seconds": r.clock.wall(),  # a resumed run's time up to its checkpoint included
        "train_seconds": train_s,
        "seconds_per_step": train_s / max(steps, 1),
        "samples_trained": totals["samples_trained"],
        "max_staleness_observed": totals["max_staleness_observed"],
        "async_ratio": cfg.async_ratio,
        "interrupt": cfg.rollout.interrupt,
        "loss": cfg.algo.loss["name"],
        "prompts_admitted": r.scheduler.admitted,
        "prompts_unfinished": {k: len(v) for k, v in left.items()},
        "reward_errors": r.scheduler.counters["reward_errors"],
        "reward_deadline": r.scheduler.counters["reward_deadline"],  # scored 0: past reward.response_deadline_s
        "resumed_from_step": r.clock.start_step if r.resume_point else None,
        "faults_engine": r.roles.client.faults,
        "faults_reward": r.reward_pool.faults if r.reward_pool is not None else 0,
        "faults_env": r.scheduler.counters.get("faults_env", 0),
        "train_skipped_nonfinite": r.guards.steps.total,
        "data_skipped": dict(r.guards.inputs.counts),
        "checkpoint": dict(r.checkpointer.last),
        "request_errors": r.scheduler.counters["request_errors"],
        "rollout_counters": dict(r.scheduler.counters),
        "reward_seconds": r.scheduler.counters.get("reward_seconds", 0.0),
        "filtered_groups": dict(r.scheduler.lifecycle.filtered),
        "aborted_samples": dict(r.scheduler.lifecycle.aborted),
        "lifecycle": r.scheduler.lifecycle.snapshot(),
        "phase_seconds_mean": totals["phase_seconds_mean"],
        "run_dir": str(r.dir),
        "sim_seconds_per_step": r.sim_steps.seconds_per_step(train_s) if cfg.train.backend == "sim" else None,
        # the CPU split the roles ran with (flash plan scales costs measured here to other splits)
        "threads": threads_record(cfg),
        "cores": run_cores(cfg),
        "seed": cfg.seed,
        "versions": versions_record(),
        # what held model-written code on this host (flash.rewards.sandbox): namespaces|audit-hook,
        # and whether each call had its own memory and pids cgroups (else per-process rlimits)
        "sandbox_isolation": _sandbox_isolation(),
        "sandbox_cgroups": _sandbox_cgroups(),
    }


def _read_jsonl(path: Path) -> list[dict]:
    return load_jsonl(path)


def run_totals(lines: list[dict], phase_keys: list[str]) -> dict[str, Any]:
    """Totals over every step of the run from its ``metrics.jsonl`` lines (a resumed run's file is cut
    back to its checkpoint and continued, so it holds each step once): the samples trained (each
    step's ``staleness/count_k`` count every trained sample once), the largest staleness, and each
    ``time/<phase>`` of ``phase_keys`` as a mean over the steps (0 where a step lacks it)."""
    steps = [m for m in lines if isinstance(m, dict) and "staleness/max" in m]
    samples = sum(v for m in steps for k, v in m.items() if k.startswith("staleness/count_"))
    return {
        "samples_trained": int(samples),
        "max_staleness_observed": max((float(m["staleness/max"]) for m in steps), default=0.0),
        "phase_seconds_mean": {k[5:]: sum(m.get(k, 0.0) for m in steps) / max(len(steps), 1) for k in phase_keys},
    }


def last_eval(run_dir: Path | str) -> dict | None:
    """The run's latest evaluation (the last ``eval.jsonl`` line: step, accuracy, seconds), None
    before any; a resumed run's file is cut back to its checkpoint, so it is the checkpoint's."""
    try:
        evals = _read_jsonl(Path(run_dir) / "eval.jsonl")
    except (OSError, ValueError):  # a log edited by hand: no figure, not a traceback
        return None
    last = evals[-1] if evals else None
    fields = ("step", "accuracy", "seconds")
    ok = isinstance(last, dict) and all(isinstance(last.get(k), (int, float)) for k in fields)
    return {k: last[k] for k in fields} if ok else None


def logged_no_update_streak(run_dir: Path | str) -> int:
    """The no-update steps in a row that the run's ``metrics.jsonl`` ends with (a resumed run's file
    is cut back to its checkpoint, so the streak as of the checkpoint); 0 without the file or for a
    log edited by hand."""
    path = Path(run_dir) / "metrics.jsonl"
    try:
        return no_update_streak(line for _, line in read_jsonl(path)) if path.is_file() else 0
    except (OSError, ValueError):
        return 0


def eval_record(evals: list[dict]) -> dict:
    """From the run's evaluations (``eval.jsonl`` lines: step, accuracy, sets): every set's metrics
    at the first and the last (``eval_sets_initial`` / ``_final``: ``{set: {mean@n, pass@k, ...}}``)
    and the best headline accuracy of the trained ones with its step (``eval_accuracy_best``,
    ``eval_best_step``; the earliest of equals; None before any)."""

    def by_set(line: dict) -> dict[str, dict[str, float]]:
        out: dict[str, dict[str, float]] = {}
        for key, value in line.get("sets", {}).items():
            _, name, metric = key.split("/", 2)
            out.setdefault(name, {})[metric] = value
        return out

    trained = [e for e in evals if e.get("step", 0) > 0]
    best = max(trained, key=lambda e: (e["accuracy"], -e["step"]), default=None)
    return {
        "eval_sets_initial": by_set(evals[0]) if evals else {},
        "eval_sets_final": by_set(evals[-1]) if trained else {},
        "eval_accuracy_best": best["accuracy"] if best else None,
        "eval_best_step": best["step"] if best else None,
    }


def _sandbox_isolation() -> str:
    from flash.rewards.sandbox import isolation_level

    return isolation_level()


def _sandbox_cgroups() -> bool:
    from flash.rewards.cgroups import available

    return available()


def threads_record(cfg: FlashConfig) -> dict[str, int | None]:
    """The torch threads each numeric stage ran with: what a result depends on besides the config
    (``warm_start`` is None when the model is the user's own)."""
    engine, trainer = resolve_threads(cfg)
    warm = cfg.sft.threads if not (cfg.model.path or cfg.model.gguf) else None
    return {"engine": engine, "trainer": trainer, "driver": cfg.resources.driver_threads, "warm_start": warm}


def versions_record() -> dict[str, str]:
    """Versions of the numeric libraries a result was computed with."""
    import platform

    import torch
    import transformers

    return {"torch": torch.__version__, "transformers": transformers.__version__, "python": platform.python_version()}
