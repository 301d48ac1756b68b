"""``LoopActor``: the engine contract over an ``EngineLoop``, shared by every engine whose steps
a loop thread drives (the torch engine, the simulated engine).

The host's ``__init__`` calls ``_start_loop`` with its stepper (``TorchEngine`` or anything with
the same step, preempt and weight methods) and the limits ``check_request`` needs; the host adds
its own ``get_weights`` and model-update hooks (``flash.weights.group.UpdateReceiver``).
"""

from __future__ import annotations

import os
import threading

from flash.engine.base import GenerationOutput, GenerationRequest, check_request, error_output
from flash.engine.loop import EngineLoop
from flash.usage import process_tree_cpu_s


class LoopActor:
    vocab_size: int
    max_context: int
    loop: EngineLoop

    def _start_loop(self, stepper, vocab_size: int, max_context: int) -> None:
        self.vocab_size, self.max_context = vocab_size, max_context
        self.loop = EngineLoop(stepper)
        self._refused: list = []  # outputs of requests check_request refused, not yet taken
        self._refused_lock = threading.Lock()  # submit and get_finished run on different threads

    def submit(self, requests: list[GenerationRequest]) -> int:
        """Queue ``requests``; one that cannot be served finishes at once with an error output."""
        ok = []
        for r in requests:
            why = check_request(r, vocab_size=self.vocab_size, max_context=self.max_context)
            if why is None:
                ok.append(r)
            else:
                with self._refused_lock:
                    self._refused.append(error_output(r, why))
        if ok:
            self.loop.submit(ok)
        return len(requests)

    def get_finished(self, timeout: float) -> list[GenerationOutput]:
        with self._refused_lock:
            refused, self._refused = self._refused, []
        if refused:
            return refused + self.loop.get_finished(timeout=0)
        return self.loop.get_finished(timeout=timeout)

    def pause(self, mode: str) -> None:
        self.loop.pause(mode)

    def resume(self) -> None:
        self.loop.resume()

    def update_weights(self, named_tensors, version: int) -> float:
        """Load the pushed weights; returns the bytes received (the model-update size metric)."""
        self.loop.update_weights(named_tensors, version)
        tensors = named_tensors.values() if hasattr(named_tensors, "values") else (t for _, t in named_tensors)
        return float(sum(t.numel() * t.element_size() for t in tensors))

    def sleep(self, level: int = 1) -> dict:
        """Release memory for a colocated trainer while paused (the stepper's ``sleep``)."""
        return self.loop.sleep(level)

    def wake_up(self) -> dict:
        return self.loop.wake_up()

    def _mu_apply(self, items, version: int) -> None:
        """Model-update group: load each pushed tensor as it arrives."""
        self.loop.update_weights(items, version)

    def abort(self, request_ids: list[str] | None = None) -> list[GenerationOutput]:
        return self.loop.abort(request_ids)

    def stats(self) -> dict:
        return {**self.loop.stats(), "cpu_s": process_tree_cpu_s()}

    def version(self) -> int:
        return int(self.loop.stats()["version"])

    def health(self) -> bool:
        """True, or raises: the engine loop's thread died or was shut down."""
        self.loop.stats()
        return True

    def busy_spans(self) -> list[list[float]]:
        return self.loop.busy_spans()

    def pid(self) -> int:
        """The actor's process id (fault-injection tests and benchmarks kill it)."""
        return os.getpid()

    def shutdown(self) -> None:
        self.loop.shutdown()
