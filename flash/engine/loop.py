"""``EngineLoop``: a background thread that drives a ``TorchEngine`` and a thread-safe API around it.

The thread calls ``engine.step()`` while there is work it can progress and sleeps on a
``threading.Condition`` otherwise (no busy spin). Every public call that touches the engine waits
for a step boundary: it registers as a *waiter*, which stops the thread from starting another
step, waits until the step in flight ends, runs against the engine under the lock, then lets the
thread go on. Registering first keeps callers from being starved by a thread that re-takes the
lock right after each step.

Pausing (docs/design.md invariant 4, modes in ``flash.engine.base``): ``continue`` and ``restart``
park the thread at the next step boundary; ``wait`` stops admission and keeps stepping until the
running requests have finished, then parks. ``update_weights`` is allowed only while paused.

An exception raised in the thread is stored; every later public call raises ``EngineLoopError``
with it as ``__cause__`` (``shutdown`` too, if no call has reported it yet), so it cannot vanish.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING

from flash.devices import read_peak_memory
from flash.engine.base import INTERRUPT_MODES, GenerationOutput, GenerationRequest
from flash.usage import SpanRecorder

if TYPE_CHECKING:
    from flash.engine.torch_engine import TorchEngine


class EngineLoopError(RuntimeError):
    """The loop thread died; ``__cause__`` is the exception it raised."""


class EngineLoop:
    def __init__(self, engine: TorchEngine):
        self._engine = engine
        self._cv = threading.Condition()
        self._finished: list[GenerationOutput] = []
        self._paused: str | None = None  # the interrupt mode while paused
        self._in_step = False
        self._waiters = 0
        self._stopping = False
        self._error: BaseException | None = None
        self._error_reported = False
        self._busy_s = self._idle_s = 0.0
        self._spans = SpanRecorder()  # busy spans for the run's timeline (flash.usage)
        self._thread = threading.Thread(target=self._run, name="flash-engine-loop", daemon=True)
        self._thread.start()

    # ---- the thread ----------------------------------------------------------------------------
    def _runnable(self) -> bool:
        """Whether the thread should step now (called under the lock)."""
        if self._stopping or self._waiters or self._paused in ("continue", "restart"):
            return False
        return self._engine.can_step  # False for paused 'wait' once the running requests are done

    def _run(self) -> None:
        try:
            while True:
                with self._cv:
                    t0 = time.perf_counter()
                    while not self._stopping and not self._runnable():
                        self._cv.wait()
                    self._idle_s += time.perf_counter() - t0
                    if self._stopping:
                        return
                    self._in_step = True
                t0, wall0 = time.perf_counter(), time.time()
                outputs = self._engine.step()
                self._spans.add(wall0, time.time())
                with self._cv:
                    self._busy_s += time.perf_counter() - t0
                    self._in_step = False
                    self._finished += outputs
                    self._cv.notify_all()
        except BaseException as exc:  # noqa: BLE001 - stored and re-raised to callers
            with self._cv:
                self._error, self._in_step = exc, False
                self._cv.notify_all()

    # ---- helpers -------------------------------------------------------------------------------
    def _check(self) -> None:
        """Raise the loop thread's stored error, or if the loop was shut down (under the lock)."""
        if self._error is not None:
            self._error_reported = True
            raise EngineLoopError(f"engine loop thread failed: {self._error!r}") from self._error
        if self._stopping:
            raise RuntimeError("EngineLoop is shut down")

    @contextmanager
    def _engine_at_boundary(self) -> Iterator[TorchEngine]:
        """Hold the lock with no step in flight and none starting; wake the thread afterwards."""
        with self._cv:
            self._check()
            self._waiters += 1
            try:
                while self._in_step and self._error is None:
                    self._cv.wait()
                self._check()
                yield self._engine
            finally:
                self._waiters -= 1
                self._cv.notify_all()

    # ---- public API ----------------------------------------------------------------------------
    def submit(self, requests: list[GenerationRequest]) -> None:
        with self._engine_at_boundary() as engine:
            for r in requests:
                engine.add_request(r)

    def get_finished(self, timeout: float | None = None) -> list[GenerationOutput]:
        """All finished outputs not yet taken; blocks up to ``timeout`` s for one; [] on timeout."""
        with self._cv:
            self._cv.wait_for(lambda: self._finished or self._error is not None or self._stopping, timeout)
            if not self._finished:
                self._check()
            out, self._finished = self._finished, []
            return out

    def pause(self, mode: str) -> None:
        """Park the thread at a step boundary, applying interrupt ``mode``.

        ``wait`` returns once the running requests have finished (their outputs go to
        ``get_finished``); waiting requests are not started until ``resume``.
        """
        if mode not in INTERRUPT_MODES:
            raise ValueError(f"unknown interrupt mode {mode!r}; expected one of {INTERRUPT_MODES}")
        with self._engine_at_boundary() as engine:
            engine.preempt(mode)
            self._paused = mode
        if mode == "wait":
            with self._cv:
                # A concurrent pause in another mode parks the thread: stop waiting for the drain then.
                while self._error is None and self._paused == "wait" and (self._in_step or self._engine.num_running):
                    self._cv.wait()
                self._check()

    def resume(self) -> None:
        with self._engine_at_boundary() as engine:
            engine.resume()
            self._paused = None

    def update_weights(self, named_tensors, version: int) -> None:
        """Copy new weights into the engine in place; only while paused (raises RuntimeError)."""
        with self._engine_at_boundary() as engine:
            if self._paused is None:
                raise RuntimeError("update_weights needs a paused EngineLoop; call pause(mode) first")
            engine.update_weights(named_tensors, version)

    def sleep(self, level: int = 1) -> dict:
        """Release memory while paused (``TorchEngine.sleep``); returns what was released."""
        with self._engine_at_boundary() as engine:
            if self._paused is None:
                raise RuntimeError("sleep needs a paused engine; call pause(mode) first")
            return engine.sleep(level)

    def wake_up(self) -> dict:
        with self._engine_at_boundary() as engine:
            return engine.wake_up()

    def abort(self, request_ids: list[str] | None = None) -> list[GenerationOutput]:
        """Abort requests (None = all); their partial outputs are returned here, not by get_finished."""
        with self._engine_at_boundary() as engine:
            return engine.abort(request_ids)

    def stats(self) -> dict[str, float]:
        with self._cv:
            self._check()
            e = self._engine
            return {
                "tokens_generated": float(e.tokens_generated),
                "busy_s": self._busy_s,
                "idle_s": self._idle_s,
                "num_running": float(e.num_running),
                "num_waiting": float(e.num_waiting),
                "version": float(e.version),
                "asleep": float(e.asleep),
                "decode_steps": float(getattr(e, "decode_steps", 0)),
                **read_peak_memory(getattr(e, "_device", None)),
            }

    def busy_spans(self) -> list[list[float]]:
        """Busy spans ``[start, end]`` (``time.time()`` s) since the previous call, merged."""
        return self._spans.drain()

    def shutdown(self) -> None:
        """Stop the thread after its current step; idempotent. Raises a thread error never reported."""
        with self._cv:
            self._stopping = True
            self._cv.notify_all()
        if self._thread is not threading.current_thread():
            self._thread.join()
        if self._error is not None and not self._error_reported:
            self._error_reported = True
            raise EngineLoopError(f"engine loop thread failed: {self._error!r}") from self._error
