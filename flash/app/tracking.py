"""Trackers: where metrics go. Small on purpose: ``log(metrics, step)`` and ``close()``.

Chosen by ``tracking.backends``: ``tensorboard`` (default, in ``RUN_DIR/tb``), ``console`` (a line
every ``tracking.console_every`` steps, for logs that are not a terminal -- CI -- where the progress
bar stays quiet), and the optional extras ``wandb`` and ``swanlab``. An extra whose package is
missing is a ``ConfigError`` at validation time naming the ``pip install`` that fixes it, not an
ImportError an hour into a run.
"""

from __future__ import annotations

import importlib.util
import sys
from typing import Any, Protocol

from flash.app.evaluation import OWN_SET
from flash.errors import ConfigError
from flash.run_files import run_subdir

# backend name -> (python package, pip extra); None: ships with flash's own requirements
BACKENDS: dict[str, tuple[str, str] | None] = {
    "tensorboard": None,
    "console": None,
    "wandb": ("wandb", "wandb"),
    "swanlab": ("swanlab", "swanlab"),
}


class Tracker(Protocol):
    def log(self, metrics: dict[str, float], step: int) -> None: ...
    def close(self) -> None: ...


class TensorBoardTracker:
    def __init__(self, log_dir: str, purge_step: int | None = None):
        from torch.utils.tensorboard import SummaryWriter

        # purge_step (a resumed run): TensorBoard drops points at steps >= it that the killed run
        # logged after its checkpoint, so the curves continue instead of doubling back
        self.writer = SummaryWriter(log_dir=log_dir, purge_step=purge_step)

    def log(self, metrics: dict[str, float], step: int) -> None:
        for key, value in metrics.items():
            self.writer.add_scalar(key, value, step)
        self.writer.flush()

    def text(self, tag: str, text: str, step: int) -> None:
        """Markdown text at ``step`` (TensorBoard's Text tab): the samples a step trained on."""
        self.writer.add_text(tag, text, step)
        self.writer.flush()

    def close(self) -> None:
        self.writer.close()


class ConsoleTracker:
    KEYS = ("reward/mean", "staleness/max", "train/loss", "time/step", "eval/accuracy")

    def __init__(self, every: int, stream=None):
        self.every = every
        self.stream = stream or sys.stdout

    def log(self, metrics: dict[str, float], step: int) -> None:
        if self.every <= 0 or (step % self.every and "eval/accuracy" not in metrics):
            return
        parts = [f"{k}={metrics[k]:.4g}" for k in self.KEYS if k in metrics]
        print(f"step {step}: " + " ".join(parts), file=self.stream, flush=True)

    def close(self) -> None:
        pass


class WandbTracker:
    """Weights & Biases (optional extra). ``WANDB_MODE=offline`` works without an account."""

    def __init__(self, project: str, name: str, run_dir: str, config: dict[str, Any]):
        import wandb

        self.wandb = wandb
        self.run = wandb.init(project=project, name=name, dir=run_dir, config=config)

    def log(self, metrics: dict[str, float], step: int) -> None:
        self.run.log(dict(metrics), step=step)

    def samples(self, tag: str, rows: list[dict], step: int) -> None:
        """A step's samples as a W&B table (one row per sample, the columns of samples.jsonl)."""
        if rows:
            columns = list(rows[0])
            table = self.wandb.Table(columns=columns, data=[[r.get(c) for c in columns] for r in rows])
            self.run.log({tag: table}, step=step)

    def close(self) -> None:
        self.run.finish()


class SwanLabTracker:
    """SwanLab (optional extra)."""

    def __init__(self, project: str, name: str, run_dir: str, config: dict[str, Any]):
        import swanlab

        self.swanlab = swanlab
        swanlab.init(project=project, experiment_name=name, logdir=run_dir, config=config)

    def log(self, metrics: dict[str, float], step: int) -> None:
        self.swanlab.log(dict(metrics), step=step)

    def close(self) -> None:
        self.swanlab.finish()


def _installed(package: str) -> bool:
    if package in sys.modules:  # None there means "import blocked" (tests use that)
        return sys.modules[package] is not None
    return importlib.util.find_spec(package) is not None


def check_backends(backends: list[str]) -> None:
    """Raise ConfigError for an unknown backend or an optional one whose package is missing."""
    from flash.app.keys import closest

    for name in backends:
        if name not in BACKENDS:
            raise ConfigError(
                f"unknown tracking backend '{name}'{closest(name, list(BACKENDS))}; valid: {', '.join(BACKENDS)}"
            )
        extra = BACKENDS[name]
        if extra is not None and not _installed(extra[0]):
            raise ConfigError(
                f"tracking backend '{name}' needs the '{extra[0]}' package, which is not "
                f"installed: pip install 'flash-rl[{extra[1]}]' (or pip install {extra[0]})"
            )


def make_tracker(
    cfg, run_dir: str, config: dict[str, Any] | None = None, purge_step: int | None = None
) -> MultiTracker:
    """The trackers ``cfg`` (a ``TrackingConfig``) selects, behind one ``MultiTracker``."""
    names = [b for b in cfg.backends if b != "tensorboard" or cfg.tensorboard]
    check_backends(names)
    name = cfg.run_name or run_dir.rstrip("/").rsplit("/", 1)[-1]
    make = {
        "tensorboard": lambda: TensorBoardTracker(str(run_subdir(run_dir, "tb")), purge_step),
        "console": lambda: ConsoleTracker(cfg.console_every),
        "wandb": lambda: WandbTracker(cfg.project, name, run_dir, config or {}),
        "swanlab": lambda: SwanLabTracker(cfg.project, name, run_dir, config or {}),
    }
    return MultiTracker([make[n]() for n in dict.fromkeys(names)])


def tag(key: str) -> str:
    """A metric's tag in the trackers: the task's own held-out set's metrics without its name
    doubled (``eval/eval/mean@4`` is ``eval/mean@4``; a named set keeps it: ``eval/dev/mean@4``)."""
    own = f"eval/{OWN_SET}/"
    return "eval/" + key[len(own) :] if key.startswith(own) else key


class MultiTracker:
    def __init__(self, trackers: list):
        self.trackers = trackers

    def log(self, metrics: dict[str, float], step: int) -> None:
        tagged = {tag(k): v for k, v in metrics.items()}
        for t in self.trackers:
            t.log(tagged, step)

    def text(self, tag: str, text: str, step: int) -> None:
        """To the backends that show text (TensorBoard); the others keep scalars only."""
        for t in self.trackers:
            if hasattr(t, "text"):
                t.text(tag, text, step)

    def samples(self, tag: str, rows: list[dict], step: int) -> None:
        """A step's samples: a table where the backend has one (W&B), else markdown text."""
        for t in self.trackers:
            if hasattr(t, "samples"):
                t.samples(tag, rows, step)
            elif hasattr(t, "text"):
                t.text(tag, samples_markdown(rows), step)

    def close(self) -> None:
        for t in self.trackers:
            t.close()


def pick_samples(step: int, groups: list, n: int, decode) -> list[dict]:
    """Up to ``n`` of a step's samples, decoded: alternately the highest and the lowest reward (a
    reward or format bug shows at the extremes), ties in trained order."""
    ranked = sorted((s for g in groups for s in g.samples), key=lambda s: -s.reward)
    picked = [ranked[i // 2] if i % 2 == 0 else ranked[-1 - i // 2] for i in range(min(n, len(ranked)))]
    return [
        {
            "step": step,
            "prompt_id": s.prompt_id,
            "sample": s.sample_index,
            "reward": s.reward,
            "finish_reason": s.finish_reason,
            "prompt": decode(list(s.prompt_ids)),
            "response": decode(list(s.response_ids)),
        }
        for s in picked
    ]


def samples_markdown(samples: list[dict]) -> str:
    """The picked samples as Markdown for a text panel (TensorBoard renders it)."""
    return "\n\n".join(
        f"**prompt {x['prompt_id']} sample {x['sample']}**: reward {x['reward']:.3g} "
        f"({x['finish_reason']})\n\n    {x['prompt']!r}\n\n    {x['response']!r}"
        for x in samples
    )
