"""A thread's failure, kept for the caller: every thread of the scheduler core (admission,
collector, reward threads, an episode's environment steps) runs under ``ThreadErrors.guard``, and
the controller re-raises what one of them raised (``check``).

A thread ended by its closed buffer (``BufferClosed``: the run is shutting down) ends quietly; any
other error is kept and ``on_error`` runs (the core wakes the buffer, so a controller waiting on it
sees the failure at once). A ``FlashError`` (a run that must stop, said in one line: reward workers
that keep dying, a reward that fails on every response) is re-raised as itself, so the command
line prints its line; any other error is wrapped, naming the scheduler.
"""

from __future__ import annotations

from typing import Callable

from flash.buffers import BufferClosed
from flash.errors import FlashError


class ThreadErrors:
    """The error a guarded thread raised (``error``, the latest one), re-raised by ``check``."""

    def __init__(self, on_error: Callable[[], None]):
        self.error: BaseException | None = None
        self._on_error = on_error

    def guard(self, fn: Callable[[], None]) -> Callable[[], None]:
        """``fn`` as a thread's target: its error kept instead of lost with the thread."""

        def run():
            try:
                fn()
            except BufferClosed:
                pass
            except BaseException as exc:  # surfaced to the controller by check()
                self.error = exc
                self._on_error()

        run.__name__ = fn.__name__
        return run

    def check(self) -> None:
        """Re-raise a guarded thread's error in the caller (a ``FlashError`` as itself)."""
        if isinstance(self.error, FlashError):
            raise self.error
        if self.error is not None:
            raise RuntimeError(f"rollout scheduler failed: {self.error!r}") from self.error
