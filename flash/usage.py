"""Role usage: how much of the wall clock each role spent working, and when.

The two things users of async RL trainers ask for and rarely get (verl and ROLL issue trackers):
the **idle ratio** of each role -- the fraction of wall time its workers had no work -- and a
**timeline** of busy spans, to see whether rollout and training truly overlap.

Each role keeps its own monotone ``busy_s`` counter, because only the role knows when it works.
The controller reads the counters once per step and divides by the wall time between reads
(``IdleMeter``). Idle time is deliberately *derived* (wall − busy) rather than counted by the role:
a role that waits through a whole window (the engine of a synchronous run while the trainer
steps) has not finished its wait when the counters are read, so an idle counter would report that
window as busy-or-nothing and the wait only later.

``SpanRecorder`` keeps the busy spans themselves, in ``time.time()`` seconds so that spans recorded
in different processes (engine actor, controller) line up on one axis; adjacent spans are merged
so that an engine stepping every few milliseconds yields a handful of spans per train step.
"""

from __future__ import annotations

import os
import threading
import time
from typing import Callable


class IdleMeter:
    """Idle ratio of one role over each window between reads: ``1 − Δbusy / Δwall``."""

    def __init__(self, clock: Callable[[], float] = time.monotonic):
        self._clock = clock
        self._last: tuple[float, float] | None = None  # (wall clock, busy counter) at the last read

    @property
    def started(self) -> bool:
        return self._last is not None

    def start(self, busy_s: float) -> None:
        self._last = (self._clock(), busy_s)

    def read(self, busy_s: float) -> float:
        """Idle fraction since the last read (or ``start``), in [0, 1]; 0.0 on the first call."""
        now = self._clock()
        last, self._last = self._last, (now, busy_s)
        if last is None or now <= last[0]:
            return 0.0
        busy = busy_s - last[1]
        return min(1.0, max(0.0, 1.0 - busy / (now - last[0])))


class SpanRecorder:
    """Busy spans ``[start, end]`` (wall-clock seconds), merged when less than ``gap_s`` apart.

    Thread-safe; ``drain`` hands over the spans recorded since the previous drain. At most
    ``max_spans`` are held: past that the last span is stretched, so memory stays bounded even if
    nobody drains (the timeline then shows one long busy span, never a missing one).
    """

    def __init__(self, gap_s: float = 0.005, max_spans: int = 4096):
        self.gap_s, self.max_spans = gap_s, max_spans
        self._spans: list[list[float]] = []
        self._lock = threading.Lock()

    def add(self, start: float, end: float) -> None:
        with self._lock:
            last = self._spans[-1] if self._spans else None
            if last is not None and (start - last[1] < self.gap_s or len(self._spans) >= self.max_spans):
                last[1] = max(last[1], end)
            else:
                self._spans.append([start, end])

    def drain(self) -> list[list[float]]:
        with self._lock:
            out, self._spans = self._spans, []
            return out


def clip_spans(spans: list[list[float]], lo: float, hi: float) -> list[list[float]]:
    """The parts of ``spans`` inside ``[lo, hi]``."""
    return [[max(a, lo), min(b, hi)] for a, b in spans if b > lo and a < hi]


def busy_fraction(spans: list[list[float]], lo: float, hi: float) -> float:
    """Fraction of ``[lo, hi]`` covered by (non-overlapping) ``spans``."""
    if hi <= lo:
        return 0.0
    return sum(b - a for a, b in clip_spans(spans, lo, hi)) / (hi - lo)


def _ticks_and_children(pid: int) -> tuple[float, list[int]]:
    """(utime + stime in clock ticks, child pids) of ``pid`` from /proc; (0, []) once it is gone."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            fields = f.read().rsplit(b")", 1)[1].split()  # after "(comm)", which may hold spaces
        kids = []
        for tid in os.listdir(f"/proc/{pid}/task"):
            with open(f"/proc/{pid}/task/{tid}/children") as f:
                kids += [int(k) for k in f.read().split()]
    except (OSError, ValueError):
        return 0.0, []
    # utime, stime, and cutime + cstime: children it has reaped (a sandbox run that ended) count too
    return float(sum(int(f) for f in fields[11:15])), kids


def process_tree_cpu_s(pid: int | None = None) -> float:
    """CPU seconds (user + system, every thread) of a process, its live descendants and the children
    they have reaped.

    Why: the planner (``flash plan``) predicts an asynchronous step from a synchronous run, and
    when the roles overlap on shared cores what bounds a step is the CPU they need together, not
    each role's wall time alone. A vLLM engine does its work in child processes, so the count must
    follow the tree. Linux's /proc; elsewhere only this process (``time.process_time``)."""
    if not os.path.exists("/proc/self/task"):
        return time.process_time() if pid in (None, os.getpid()) else 0.0
    pid = os.getpid() if pid is None else pid
    total, frontier, seen = 0.0, [pid], {pid}
    while frontier:
        ticks, kids = _ticks_and_children(frontier.pop())
        total += ticks
        frontier += [k for k in kids if k not in seen]
        seen.update(kids)
    return total / os.sysconf("SC_CLK_TCK")
