"""Resume: find the run and its newest valid checkpoint, check the settings match, cut the logs back.

``flash run RECIPE resume=RUN_DIR`` (or ``resume=latest``: the newest run dir of this recipe under
``runs/``) continues in the same run dir. The run's logs (ledger, metrics, timeline, eval) are cut
back to their length at the checkpoint, so lines the killed run wrote after it -- steps it will
now redo -- are not there twice; TensorBoard drops them by ``purge_step``. ``events.jsonl`` is never
cut: it records every start, resume, fallback and fault, including the ones of killed runs.

Settings that shape what is trained (seed, task, async ratio, batch shape, loss, ...) must match the
checkpointed run, or resuming would silently mix two experiments. What may change is listed in
``MAY_CHANGE`` (more steps, checkpoint and tracking knobs, resources, timeouts, and an FSDP2
group's worker count and devices -- ``train.workers`` with ``placement.roles.actor_train``, which
it implies: its torch distributed checkpoint reshards to the new size on load).
"""

from __future__ import annotations

import json
import logging
import os
import time
from datetime import datetime
from pathlib import Path
from typing import NamedTuple

from flash.app.config import flat_settings
from flash.app.resume_dir import resolve_resume, saved_config  # noqa: F401 -- read through this module too
from flash.errors import ConfigError, FlashError
from flash.run_files import STATE_BOUNDS, RunFileError, open_run_file, parse_json, refuse_links

log = logging.getLogger(__name__)

LOGS = ("ledger", "metrics", "timeline", "eval", "schedule", "samples")  # RUN_DIR/<name>.jsonl, cut back on resume
MAY_CHANGE = (
    "train.steps",
    "train.max_consecutive_skips",
    "train.workers",
    "train.entropy_every_steps",
    "placement.roles.actor_train.",
    "checkpoint.",
    "tracking.",
    "resume",
    "run_dir",
    "overwrite",
    "trust_checkpoint",
    "cache_dir",
    "description",
    "eval.every_steps",
    "rollout.hang_timeout_s",
    "rollout.max_engine_restarts",
    "rollout.max_worker_restarts",
    "resources.",
    "ray.",
    "data.strict",
    "reward.max_consecutive_errors",
)


def config_differences(saved: dict, now: dict) -> list[str]:
    """``key: saved -> now`` for every setting that differs and may not change on resume."""
    a, b = flat_settings(saved), flat_settings(now)
    diffs = []
    for key in sorted(set(a) | set(b)):
        if any(key == m or key.startswith(m) for m in MAY_CHANGE):
            continue
        if a.get(key) != b.get(key):
            diffs.append(f"{key}: {a.get(key)!r} -> {b.get(key)!r}")
    return diffs


def check_same_run(now: dict, run_dir: Path) -> None:
    saved = saved_config(run_dir)
    diffs = config_differences(saved, now)
    if diffs:
        raise ConfigError(
            f"resume={run_dir}: settings differ from the checkpointed run ({'; '.join(diffs[:3])}"
            f"{'; ...' if len(diffs) > 3 else ''}); pass the same recipe and overrides (only "
            f"{', '.join(MAY_CHANGE[:4])}, ... may change), or start a new run without resume"
        )


STATE_KEYS = ("step", "version", "logs", "buffer", "scheduler", "skips", "data_skipped", "faults")


class ResumePoint(NamedTuple):
    """The checkpoint a resume starts from: its directory, the driver's state in it, and its
    verified manifest (whose file table every loader checks the bytes it reads against)."""

    path: Path
    state: dict
    manifest: dict


def load_state(ckpt: Path, manifest: dict) -> dict:
    """The driver's state of a verified checkpoint (its bytes checked against ``manifest``); one
    with parts missing, or of another step than its manifest's, is named, not a KeyError."""
    from flash.checkpoint import STATE
    from flash.checkpoint_trust import read_verified

    size = manifest["files"].get(STATE, {}).get("bytes", 0)
    if size > STATE_BOUNDS.file_bytes:
        raise ConfigError(
            f"checkpoint {ckpt}: {STATE} is {size} bytes, over the {STATE_BOUNDS.file_bytes >> 30} GiB "
            "limit of a checkpoint's state; resume from another checkpoint or start a new run"
        )
    try:
        state = parse_json(
            read_verified(ckpt, STATE, manifest["files"]), f"checkpoint {ckpt}: {STATE}", STATE_BOUNDS.depth
        )
    except RunFileError as exc:
        raise ConfigError(f"{exc}; resume from another checkpoint or start a new run") from None
    missing = [k for k in STATE_KEYS if k not in state]
    if missing:
        raise ConfigError(
            f"checkpoint {ckpt}: state.json lacks {missing[0]!r} (edited, or written by another "
            "flash version); resume from another checkpoint or start a new run"
        )
    if state["step"] != manifest["step"]:
        raise ConfigError(
            f"checkpoint {ckpt}: state.json is of step {state['step']!r}, its manifest of step "
            f"{manifest['step']}; resume from another checkpoint or start a new run"
        )
    return state


def restore_logs(run_dir: Path, offsets: dict[str, int] | None) -> None:
    """Cut each run log back to its length at the checkpoint (``None``: no checkpoint, empty)."""
    for name in LOGS:
        path = run_dir / f"{name}.jsonl"
        if os.path.lexists(path):
            with open_run_file(path, "r+b") as f:
                f.truncate((offsets or {}).get(name, 0))


def append_event(run_dir: Path, event: str, **fields) -> None:
    """One line in ``events.jsonl``: starts, resumes, checkpoint fallbacks, faults."""
    with open_run_file(run_dir / "events.jsonl", "a") as f:
        f.write(json.dumps({"event": event, "time": time.time(), **fields}) + "\n")


# what makes a directory hold a run (a sweep's sweep_point.json or a test's log do not)
RUN_FILES = (
    "config.yaml",
    "run.json",
    "ledger.jsonl",
    "metrics.jsonl",
    "summary.json",
    "events.jsonl",
    "samples.jsonl",
    "checkpoints",
)


def held_run(path: Path) -> list[str]:
    """The files that make ``path`` hold a run (``RUN_FILES``), if any: a link of that name counts
    (dangling or not)."""
    return [name for name in RUN_FILES if os.path.lexists(path / name)]


def never_ran(path: Path) -> bool:
    """``path`` holds only what a start that failed before its first step leaves (``config.yaml``,
    ``run.json``, ``events.jsonl``, empty logs): no log line, summary or checkpoint. A new run may
    start in it (its events are kept, its logs begin again)."""
    written = [path / f"{name}.jsonl" for name in LOGS] + [path / "summary.json"]
    if any(os.path.lexists(f) and (f.is_symlink() or f.lstat().st_size > 0) for f in written):
        return False
    ckpts = path / "checkpoints"
    return not os.path.lexists(ckpts) or (ckpts.is_dir() and not ckpts.is_symlink() and not any(ckpts.iterdir()))


def check_run_dir(cfg, resuming: bool) -> None:
    """A ``run_dir`` that holds another run is refused, unless this run resumes it or
    ``overwrite`` moves it aside (a fresh ``runs/<recipe>-<time>`` never holds one) or that run
    never ran (``never_ran``: a failed start); one that is or holds a link anywhere is refused
    (``flash.run_files``)."""
    if cfg.run_dir:
        refuse_links(cfg.run_dir, "run_dir")
    held = held_run(Path(cfg.run_dir)) if cfg.run_dir and not never_ran(Path(cfg.run_dir)) else []
    if held and not resuming and not cfg.overwrite:
        raise FlashError(
            f"run_dir {cfg.run_dir} already holds a run ({', '.join(held)}): continue it "
            f"with resume={cfg.run_dir}, pick a new run_dir, or pass overwrite=true to "
            f"move it aside"
        )


def make_run_dir(cfg, recipe_name: str, resuming: bool = False) -> Path:
    """The run's directory: new or without a run in it, unless resuming; ``overwrite`` moves an
    earlier run aside (never deletes it): another run's logs are never truncated by mistake."""
    stamp = datetime.now().strftime("%Y%m%d-%H%M%S")
    check_run_dir(cfg, resuming)
    if cfg.run_dir:
        path = Path(cfg.run_dir)
    else:
        path = Path("runs") / f"{recipe_name}-{stamp}"
        for n in range(1, 1000):  # two runs started in the same second
            if not os.path.lexists(path):
                break
            path = Path("runs") / f"{recipe_name}-{stamp}-{n}"
    if held_run(path) and not resuming and not never_ran(path):  # overwrite (check_run_dir refused it otherwise)
        aside = path.with_name(f"{path.name}.old-{stamp}")
        path.rename(aside)
        log.warning("flash: moved the earlier run in %s aside to %s", path, aside)
    try:
        path.mkdir(parents=True, exist_ok=True)
    except OSError as exc:  # a file of that name, a folder that cannot be made, no permission
        raise FlashError(
            f"run_dir {path}: cannot make it a folder ({exc.strerror or exc}); pick a run_dir in a folder you can write"
        ) from None
    refuse_links(path, "run_dir")
    return path
