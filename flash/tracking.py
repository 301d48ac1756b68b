"""Trackers: where metrics go. Small on purpose: ``log(metrics, step)`` and ``close()``.

TensorBoard is the default; a console tracker prints a line every k steps for logs that are not a
terminal (CI), where the progress bar stays quiet.
"""

from __future__ import annotations

import sys
from typing import Protocol


class Tracker(Protocol):
    def log(self, metrics: dict[str, float], step: int) -> None: ...
    def close(self) -> None: ...


class TensorBoardTracker:
    def __init__(self, log_dir: str):
        from torch.utils.tensorboard import SummaryWriter

        self.writer = SummaryWriter(log_dir=log_dir)

    def log(self, metrics: dict[str, float], step: int) -> None:
        for key, value in metrics.items():
            self.writer.add_scalar(key, value, step)
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


class MultiTracker:
    def __init__(self, trackers: list):
        self.trackers = trackers

    def log(self, metrics: dict[str, float], step: int) -> None:
        for t in self.trackers:
            t.log(metrics, step)

    def close(self) -> None:
        for t in self.trackers:
            t.close()


class Progress:
    """A live bar (step, reward, staleness, ETA) on a terminal; silent otherwise."""

    def __init__(self, total: int, enabled: bool):
        self.bar = None
        if enabled and sys.stderr.isatty():
            from tqdm import tqdm

            self.bar = tqdm(total=total, unit="step", dynamic_ncols=True)

    def update(self, metrics: dict[str, float]) -> None:
        if self.bar is None:
            return
        self.bar.set_postfix(reward=f"{metrics.get('reward/mean', 0):.3f}",
                             stale=int(metrics.get("staleness/max", 0)), refresh=False)
        self.bar.update(1)

    def write(self, line: str) -> None:
        if self.bar is not None:
            self.bar.write(line)
        else:
            print(line, flush=True)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
