"""The scheduler core's reward threads: a thread pool that scores finished units, and the count
of the jobs handed to it and not yet done (``busy``), so the core can wait until every response
taken from the engine is filed (``RolloutCore.quiesce``).

``submit`` is called under the core's lock (the condition ``lock``); a job's end takes that lock to
count itself done and notifies its waiters. Every job runs under the core's thread guard
(``flash.controllers.thread_errors``). ``map`` scores an evaluation's units concurrently on the same
threads, its results in order, telling ``on_done`` how many are done about once a second.
"""

from __future__ import annotations

import threading
from concurrent.futures import ThreadPoolExecutor, wait
from typing import Any, Callable, Iterable


class RewardThreads:
    """``workers`` reward threads; ``busy``: jobs submitted and not yet done."""

    def __init__(
        self, lock: threading.Condition, workers: int, guard: Callable[[Callable[[], None]], Callable[[], None]]
    ):
        self.busy = 0
        self._lock, self._guard = lock, guard
        self._pool = ThreadPoolExecutor(max_workers=max(1, workers), thread_name_prefix="reward")

    def submit(self, job: Callable[[], None]) -> None:
        """Run ``job`` on a reward thread, counted in ``busy`` until it ends (under the lock)."""
        self.busy += 1
        self._pool.submit(self._guard(lambda: self._counted(job)))

    def _counted(self, job: Callable[[], None]) -> None:
        try:
            job()
        finally:
            with self._lock:
                self.busy -= 1
                self._lock.notify_all()

    def map(
        self,
        fn: Callable[..., Any],
        *args: Iterable,
        on_done: Callable[[int], None] | None = None,
        every_s: float = 1.0,
    ) -> list:
        """``fn`` over the zipped ``args`` concurrently; the results in order (an error re-raised).
        ``on_done(count)``: the calls done so far, every ``every_s`` seconds while they run and once
        when all are done."""
        futures = [self._pool.submit(fn, *a) for a in zip(*args)]
        pending = set(futures)
        while on_done is not None and pending:
            pending = wait(pending, timeout=every_s).not_done
            on_done(len(futures) - len(pending))
        return [f.result() for f in futures]

    def shutdown(self) -> None:
        self._pool.shutdown(wait=True, cancel_futures=True)
