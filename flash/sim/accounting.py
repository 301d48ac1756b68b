"""A step's simulated seconds: GPU time scaled back, the driver's real time left as it is.

The simulated roles sleep ``simulated seconds × time_scale``, so dividing a step's wall time by
``time_scale`` recovers the GPU time -- and divides the driver's own real work (scoring,
collation, Ray transfers, admission) by it too, as if it were GPU work slowed down by the same
factor. At 1024 simulated GPUs a step carries ~5 s of such work on two loaded cores, which the
division turns into ~100 simulated seconds. Here instead a step's wall window is split in two:

    GPU time    the union of the spans in which a simulated GPU worked: engine steps (the engine
                loop's busy spans), the controller's waits on the trainer (``train``,
                ``recompute_prox``) and on the weight push (``push_weights``) -- and the spans in
                which an environment step was in flight (``env_busy``: its latency is simulated
                seconds too, slept scaled by the workers);
    driver time the rest of the window: no simulated GPU (or environment) was working, the cluster
                waited on the driver -- which on a cluster takes real time too, so it stays unscaled.

    simulated step = GPU time / time_scale + driver time

The windows are contiguous: a step's runs from the end of the previous step's phases to the end of
its own (the first step's, and the first after an evaluation, from its first phase), so the engine
work done while the driver logs between two steps -- an asynchronous engine decodes on -- is counted.

Departure from a cluster: driver work that overlaps GPU work costs nothing here, as it would on
a cluster with a driver fast enough; driver time is this machine's (two shared cores), so a
cluster's driver would likely take less -- the reading is an upper bound on its share.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

GPU_PHASES = ("recompute_prox", "train", "push_weights")  # controller phases that wait on a simulated GPU


def union_s(spans: Iterable[Sequence[float]], lo: float, hi: float) -> float:
    """Seconds of ``[lo, hi]`` covered by at least one of ``spans`` (they may overlap)."""
    clipped = sorted((max(a, lo), min(b, hi)) for a, b in spans if b > lo and a < hi)
    total, end = 0.0, lo
    for a, b in clipped:
        if b > end:
            total += b - max(a, end)
            end = b
    return total


def gpu_spans(timeline: dict) -> list[Sequence[float]]:
    """The wall spans of one step's timeline in which a simulated GPU or environment worked (module doc)."""
    phases = timeline.get("phases", {})
    return [
        *timeline.get("engine_busy", []),
        *timeline.get("env_busy", []),
        *(phases[p] for p in GPU_PHASES if p in phases),
    ]


def split_step(step_s: float, timeline: dict, start: float | None = None) -> tuple[float, float]:
    """(GPU seconds, driver seconds) of a step of ``step_s`` wall seconds. The window is the span of
    its phases, or, given ``start`` (where the previous step's window ended), from ``start`` to the
    end of its phases: between two steps the driver logs while an asynchronous engine decodes on,
    and that work is the cluster's time too -- counted in no step, a run of steps would miss it."""
    phases = list(timeline.get("phases", {}).values())
    if not phases:
        return step_s, 0.0
    lo, hi = (min(a for a, _ in phases) if start is None else start), window_end(timeline)
    span = step_s if start is None else max(0.0, hi - lo)
    gpu = min(span, union_s(gpu_spans(timeline), lo, hi))
    return gpu, span - gpu


def window_end(timeline: dict) -> float | None:
    """Where a step's window ends: the end of its last phase (None without phases)."""
    phases = list(timeline.get("phases", {}).values())
    return max(b for _, b in phases) if phases else None


def simulated_step_s(
    step_s: float, timeline: dict, time_scale: float, start: float | None = None
) -> tuple[float, float]:
    """(simulated seconds, unscaled driver seconds) of one step (``split_step``'s window)."""
    gpu, driver = split_step(step_s, timeline, start)
    return gpu / time_scale + driver, driver


def simulated_metrics(
    metrics: dict[str, float], time_scale: float, timeline: dict | None = None, start: float | None = None
) -> dict[str, float]:
    """``sim/<name>_s``: each ``time/<name>`` of a step divided by ``time_scale``; with the step's
    ``timeline``, ``sim/step_s`` is GPU time scaled plus ``sim/driver_s`` unscaled over the step's
    window (from ``start``, see ``split_step``), and ``sim/step_scaled_s`` the plain division of the
    step's wall time (whose driver share is scaled up too)."""
    out = {
        f"sim/{k[len('time/') :]}_s": v / time_scale
        for k, v in metrics.items()
        if k.startswith("time/") and isinstance(v, (int, float))
    }
    if timeline is not None and "time/step" in metrics:
        out["sim/step_scaled_s"] = out["sim/step_s"]
        out["sim/step_s"], out["sim/driver_s"] = simulated_step_s(metrics["time/step"], timeline, time_scale, start)
    return out


LATE_SHARE = 0.1  # an engine late by more than this share of a step's wall time distorts the reading


def late_warning(step: int, late_s: float, step_s: float, time_scale: float) -> str | None:
    """One line when the simulated engine fell behind real time in a step, else None.

    The engine sleeps each step's scaled GPU time less its own bookkeeping; when drawing tokens for
    many sequences takes longer than that (a large batch, a small ``time_scale``, a loaded machine),
    it runs late, and the window the controller waits is longer than the GPUs would have taken --
    simulated seconds then read high. A larger ``sim.time_scale`` gives the bookkeeping room."""
    if step_s <= 0 or late_s <= LATE_SHARE * step_s:
        return None
    return (
        f"flash: warning: step {step}: the simulated engine ran {late_s:.2f} s behind real time "
        f"({late_s / step_s:.0%} of the step): its bookkeeping outran the scaled GPU time, so simulated "
        f"seconds read high; raise sim.time_scale (now {time_scale:g}) or run on a quieter machine"
    )


class SimSteps:
    """A run's simulated step metrics, step after step: each step's window starts where the
    previous one's ended (``split_step``) -- except after an evaluation, which is not a training
    step's time --, and an engine running late is named once (``late_warning``; the per-step
    ``rollout/sim_late_s`` metric keeps every step's reading). ``seconds_per_step`` is the run's
    mean over the same windows, so the summary and the per-step metrics count alike."""

    def __init__(self, time_scale: float, out=print):
        self.time_scale, self.out, self.said = time_scale, out, False
        self.start: float | None = None
        self.steps, self.sim_s, self.wall_s = 0, 0.0, 0.0  # steps seen, their simulated and wall seconds

    def metrics(self, step: int, logged: dict[str, float], timeline: dict) -> dict[str, float]:
        out = simulated_metrics(logged, self.time_scale, timeline, self.start)
        end, step_s = window_end(timeline), logged.get("time/step", 0.0)
        self.steps, self.sim_s = self.steps + 1, self.sim_s + out.get("sim/step_s", 0.0)
        self.wall_s += step_s if self.start is None or end is None else max(0.0, end - self.start)
        self.start = None if "time/eval" in logged else end
        line = late_warning(step, logged.get("rollout/sim_late_s", 0.0), step_s, self.time_scale)
        if line and not self.said:
            self.said = True
            self.out(line)
        return out

    def seconds_per_step(self, train_s: float) -> float:
        """Simulated seconds per step of the steps seen, plus the rest of the train time (before
        the first step's phases, evaluations) unscaled; none seen: ``train_s`` scaled whole."""
        if not self.steps:
            return train_s / self.time_scale
        return (self.sim_s + max(0.0, train_s - self.wall_s)) / self.steps
