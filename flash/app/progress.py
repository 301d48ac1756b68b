"""What a run says while it runs: the progress bar on a terminal, the heartbeat line in a log file.

Both show the same figures, made by the small pure functions below:

- the step and its total (a resumed run's bar starts at its resumed step), the last reward;
- the held-out accuracy marked with the step it was measured at (``accuracy 0.284@0``), only when
  the run evaluates periodically (``eval.every_steps`` > 0; otherwise the before/after lines say it);
- the run's training time so far (a resumed run's time before its checkpoint included) and the time
  left (``TrainEta``): ``ETA settling`` until the rollout's head start is used up, then the median
  of the recent steps' seconds times the steps left, plus the evaluations still to come;
- during an evaluation its samples done, total and time left (``eval_note``), then while a set's
  samples are scored, their count and the scoring's time left (``scoring_note``);
- ``no update: all groups had equal reward`` when a step's advantages were all 0 (``no_update_note``:
  the first step of such a streak, then at 10, 100, ... steps in a row; a resumed run's streak goes
  on from the steps its ``metrics.jsonl`` holds, ``no_update_streak``).
"""

from __future__ import annotations

import math
import statistics
import sys
import threading
import time
from typing import Any, Iterable

ETA_WINDOW = 10  # recent steps the rate is the median of


def duration(seconds: float) -> str:
    """``45s``, ``12m05s``, ``1h02m``."""
    s = int(round(seconds))
    if s < 60:
        return f"{s}s"
    if s < 3600:
        return f"{s // 60}m{s % 60:02d}s"
    return f"{s // 3600}h{s % 3600 // 60:02d}m"


def step_eta(done: int, total: int, elapsed_s: float, since_step_s: float = 0.0) -> str:
    """``(elapsed 95s, ~12m left)``: the phase's time so far and its time left at the rate it had
    when its last step ended, ``since_step_s`` ago, less the time since (``?`` before the first
    step): between two steps it counts down, never up. The warm start's steps take equal time, so
    its rate is its mean."""
    at_step = elapsed_s - since_step_s
    left = "?" if done <= 0 else duration(max(0.0, at_step / done * max(0, total - done) - since_step_s))
    return f"(elapsed {duration(elapsed_s)}, ~{left} left)"


def settle_steps(async_ratio: float) -> int:
    """Steps before the train ETA is given: at version 0 rollout may run ``1 + async_ratio`` steps
    ahead (during the initial evaluation, too), so those steps find their batch ready and are
    faster than the rest; one steady step after them."""
    return math.ceil(1 + async_ratio) + 1


def evals_left(step: int, total: int, every: int) -> int:
    """Evaluations still to run after ``step``: the periodic ones before ``total``, and the final."""
    periodic = (total - 1) // every - step // every if every > 0 and step < total else 0
    return max(0, periodic) + (1 if step < total else 0)


class TrainEta:
    """The time left of the training from the steps this process measured.

    A step's seconds are the interval between two steps' ``time/elapsed`` less the evaluation that ran
    in it (``time/eval``). The first ``settle`` steps give no ETA (``left`` is None: their batches had a
    head start, ``settle_steps``); after them the rate is the median of the last ``ETA_WINDOW`` steady
    steps, so one slow step (a checkpoint, a restart) does not swing it, and the time left adds the
    evaluations still due at the last evaluation's seconds."""

    def __init__(self, total: int, settle: int, every: int = 0, eval_s: float = 0.0, elapsed0: float = 0.0):
        self.total, self.settle, self.every, self.eval_s = total, settle, every, eval_s
        self.seconds: list[float] = []
        self._prev = elapsed0

    def observe(self, metrics: dict[str, float]) -> None:
        """One step's logged metrics (``time/elapsed``, and ``time/eval`` on an evaluation's step)."""
        elapsed = metrics.get("time/elapsed", self._prev)
        eval_s = metrics.get("time/eval", 0.0)
        if "time/eval" in metrics:
            self.eval_s = eval_s
        self.seconds.append(max(0.0, elapsed - self._prev - eval_s))
        self._prev = elapsed

    def left(self, step: int) -> float | None:
        """Seconds left after ``step`` (None while settling)."""
        steady = self.seconds[self.settle - 1 :]
        if len(self.seconds) < self.settle or not steady:
            return None
        rate = statistics.median(steady[-ETA_WINDOW:])
        return rate * max(0, self.total - step) + self.eval_s * evals_left(step, self.total, self.every)


def time_note(elapsed_s: float, left_s: float | None) -> str:
    """``(elapsed 3m10s, ~8m00s left)``, or ``(elapsed 20s, ETA settling)`` while none is given."""
    return f"(elapsed {duration(elapsed_s)}, {'ETA settling' if left_s is None else f'~{duration(left_s)} left'})"


def accuracy_mark(accuracy: float, step: int) -> str:
    """``0.284@0``: a held-out accuracy and the step it was measured at."""
    return f"{accuracy:.3f}@{step}"


def _left(done: int, total: int, elapsed_s: float) -> str:
    """The time left at the rate so far (``?`` before the first is done)."""
    return "?" if done <= 0 else duration(elapsed_s / done * max(0, total - done))


def eval_note(done: int, total: int, elapsed_s: float) -> str:
    """``eval 24/64 samples, ~40s left``: the samples generated of all sets' and the time left
    (``?`` before the first sample is done)."""
    return f"eval {done}/{total} samples, ~{_left(done, total, elapsed_s)} left"


def scoring_note(generated: int, total: int, scored: int, of: int, elapsed_s: float) -> str:
    """``eval 64/64 samples, scoring 10/64, ~12s left``: ``generated`` of all sets' ``total``
    samples are generated and a set's ``of`` samples are being scored, ``scored`` of them in
    ``elapsed_s``; the time left is that scoring's at its rate so far."""
    return f"eval {generated}/{total} samples, scoring {scored}/{of}, ~{_left(scored, of, elapsed_s)} left"


def streak_after(streak: int, metrics: dict) -> int:
    """The no-update streak after a step of ``metrics``: one longer when its advantages were all 0
    (``train/no_update`` > 0), else 0."""
    flag = metrics.get("train/no_update", 0.0)
    return streak + 1 if isinstance(flag, (int, float)) and flag > 0 else 0


def no_update_streak(lines: Iterable[dict]) -> int:
    """The no-update steps in a row at the end of a run's logged steps (``metrics.jsonl``'s lines)."""
    streak = 0
    for metrics in lines:
        streak = streak_after(streak, metrics)
    return streak


def no_update_note(step: int, streak: int, grad_norm: float) -> str | None:
    """The line for a step whose advantages were all 0, ``streak`` such steps in a row: the first
    of a streak, then at 10, 100, ... in a row (None between). A nonzero gradient means the loss's
    KL or entropy term trained; the line says so."""
    if streak > 1 and streak != 10 ** round(math.log10(streak)):
        return None
    run = f" ({streak} steps in a row)" if streak > 1 else ""
    rest = "; only the loss's KL/entropy terms trained" if grad_norm > 0 else ""
    return f"flash: step {step}: no update: all groups had equal reward (every advantage 0){run}{rest}"


class Heartbeat:
    """Progress for a log file: when output is not a terminal (a job scheduler, ``nohup``, CI), a
    daemon thread prints one line every ``interval_s`` seconds from the start of the run -- phase
    (warm start, roles, evaluation, train), step, times, last reward and accuracy, an evaluation's
    count -- so a log shows the run is alive and where it is before the first step ends. The train
    phase's ``time`` is (elapsed, left or None) as of its last step, a phase that counts steps toward
    a total without one (the warm start) shows ``step_eta``; both go on from the last step by the
    time since it (elapsed up, left down). Silent on a terminal (the bar is there) and with
    ``interval_s`` 0."""

    PHASE_FIELDS = ("step", "total", "reward", "accuracy", "time", "detail")

    def __init__(self, interval_s: float, enabled: bool = True, stream=None):
        self.stream = stream or sys.stdout
        self.fields: dict[str, Any] = {"phase": "start"}
        self._start = self._phase_start = self._step_at = time.monotonic()
        self._stop = threading.Event()
        self._thread = None
        if enabled and interval_s > 0 and not self.stream.isatty():
            self._thread = threading.Thread(target=self._loop, args=(interval_s,), name="flash-heartbeat", daemon=True)
            self._thread.start()

    def set(self, **fields) -> None:
        """Update what the next line says; a new phase drops the old phase's figures (step count,
        times, reward, accuracy, detail), so a line never shows a value from before the phase."""
        old = self.fields
        if fields.get("phase", old["phase"]) != old["phase"]:
            old = {k: v for k, v in old.items() if k not in self.PHASE_FIELDS}
            self._phase_start = time.monotonic()
        if "step" in fields or "time" in fields:
            self._step_at = time.monotonic()
        self.fields = {**old, **fields}

    def line(self) -> str:
        f, now = self.fields, time.monotonic()
        since = now - self._step_at
        parts = [f"flash: [{now - self._start:.0f}s] {f['phase']}"]
        if f.get("step") is not None:
            parts.append(f"step {f['step']}" + (f"/{f['total']}" if "total" in f else ""))
            if f.get("time"):
                elapsed, left = f["time"]
                parts.append(time_note(elapsed + since, None if left is None else max(0.0, left - since)))
            elif f.get("total"):
                parts.append(step_eta(f["step"], f["total"], now - self._phase_start, since))
        if f.get("reward") is not None:
            parts.append(f"reward {f['reward']:.3f}")
        parts += [f"{k} {f[k]}" for k in ("accuracy",) if f.get(k) is not None]
        if f.get("detail"):
            parts.append(f["detail"])
        return " ".join(parts)

    def _loop(self, interval_s: float) -> None:
        while not self._stop.wait(interval_s):
            print(self.line(), file=self.stream, flush=True)

    def close(self) -> None:
        self._stop.set()


class Progress:
    """The train steps' progress: a live bar on a terminal (from ``start``: a resumed run's bar
    starts at its step), the heartbeat's fields, and the lines a step says (``no_update_note``;
    ``streak``: the no-update steps in a row before ``start``, a resumed run's).
    ``eta`` gives the time left; ``accuracy`` is the last held-out accuracy and its step, None when
    the run does not evaluate periodically (then train lines leave it out)."""

    def __init__(
        self,
        total: int,
        enabled: bool,
        heartbeat: Heartbeat | None = None,
        start: int = 0,
        eta: TrainEta | None = None,
        accuracy: tuple[float, int] | None = None,
        streak: int = 0,
    ):
        self.bar, self.heartbeat, self.total, self.done = None, heartbeat, total, start
        self.eta, self.accuracy, self.streak = eta, accuracy, streak
        if enabled and sys.stderr.isatty():
            from tqdm import tqdm

            self.bar = tqdm(
                total=total,
                initial=start,
                unit="step",
                dynamic_ncols=True,
                bar_format="{l_bar}{bar}| {n_fmt}/{total_fmt}{postfix}",
            )

    def update(self, metrics: dict[str, float]) -> None:
        self.done = int(metrics.get("step", self.done + 1))
        if "eval/accuracy" in metrics and self.accuracy is not None:
            self.accuracy = (metrics["eval/accuracy"], self.done)
        self._note_no_update(metrics)
        if self.eta is not None:
            self.eta.observe(metrics)
        left = self.eta.left(self.done) if self.eta is not None else None
        elapsed = metrics.get("time/elapsed", 0.0)
        acc = accuracy_mark(*self.accuracy) if self.accuracy is not None else None
        if self.heartbeat is not None:
            self.heartbeat.set(
                phase="train",
                step=self.done,
                total=self.total,
                reward=metrics.get("reward/mean"),
                accuracy=acc,
                time=(elapsed, left),
                detail=None,
            )
        if self.bar is not None:
            shown = [f"reward={metrics.get('reward/mean', 0):.3f}", f"stale={int(metrics.get('staleness/max', 0))}"]
            self.bar.set_postfix_str(
                ", ".join(shown + ([f"acc={acc}"] if acc else []) + [time_note(elapsed, left)[1:-1]]), refresh=False
            )
            self.bar.update(self.done - self.bar.n)

    def _note_no_update(self, metrics: dict[str, float]) -> None:
        self.streak = streak_after(self.streak, metrics)
        note = no_update_note(self.done, self.streak, metrics.get("train/grad_norm", 0.0)) if self.streak else None
        if note is not None:
            self.write(note)

    def evaluating(self, note: str | None) -> None:
        """An evaluation's count (``eval_note``), or None when it ended: on the bar and the heartbeat."""
        if self.heartbeat is not None:
            self.heartbeat.set(detail=note)
        if self.bar is not None:
            self.bar.set_description_str(note or "", refresh=True)

    def write(self, line: str) -> None:
        if self.bar is not None:
            self.bar.write(line)
        else:
            print(line, flush=True)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
