"""A scripted stand-in for the rollout engine, for unit tests of the rollout scheduler only.

It satisfies the engine protocols of ``flash.engine.base`` (checked in
tests/integration/test_engine_contract.py); the scheduler's methods (``submit``, ``get_finished``, ``abort``)
finish each request at a scripted wall-clock delay after its submission, with scripted tokens, so
that scheduling decisions (which response finishes first, how long generation takes) are exact
instead of depending on a model and a loaded CPU. Run it as a threaded Ray actor, as
``flash.engine.torch_worker.start_engine`` runs the real ones.
"""

from __future__ import annotations

import os
import threading
import time

from flash.engine.base import GenerationOutput, GenerationRequest


class ScriptedEngine:
    def __init__(self, delays: dict[str, float], default_delay: float = 0.05, lengths: dict[str, int] | None = None):
        self.delays, self.default_delay = delays, default_delay
        self.lengths = lengths or {}
        self._cv = threading.Condition()
        self._due: dict[str, tuple[float, GenerationRequest]] = {}
        self.submitted: list[GenerationRequest] = []
        self.aborted: list[str] = []  # ids aborted while still running
        self.delivered: list[tuple[str, float]] = []  # (id, time.time()) as handed out
        self._version, self.paused, self.asleep = 0, None, False

    def submit(self, requests: list[GenerationRequest]) -> int:
        now = time.time()
        with self._cv:
            for r in requests:
                self._due[r.request_id] = (now + self.delays.get(r.request_id, self.default_delay), r)
                self.submitted.append(r)
            self._cv.notify_all()
        return len(requests)

    def _output(self, r: GenerationRequest, reason: str) -> GenerationOutput:
        k = int(r.request_id.split(":")[1]) if ":" in r.request_id else 0  # evaluation ids have no index
        n = self.lengths.get(r.request_id, 3) if reason != "abort" else 1
        return GenerationOutput(r.request_id, list(r.prompt_ids), [k + 1] * n, [-0.5] * n, [0] * n, reason)

    def get_finished(self, timeout: float) -> list[GenerationOutput]:
        end = time.time() + timeout
        with self._cv:
            while True:
                now = time.time()
                ready = sorted((d, rid) for rid, (d, _) in self._due.items() if d <= now)
                if ready or now >= end:
                    break
                nxt = min((d for d, _ in self._due.values()), default=end)
                self._cv.wait(max(0.0, min(end, nxt) - now))
            outs = [self._output(self._due.pop(rid)[1], "stop") for _, rid in ready]
            self.delivered += [(o.request_id, now) for o in outs]
            return outs

    def abort(self, request_ids: list[str] | None = None) -> list[GenerationOutput]:
        with self._cv:
            ids = list(self._due) if request_ids is None else [i for i in request_ids if i in self._due]
            self.aborted += ids
            return [self._output(self._due.pop(i)[1], "abort") for i in ids]

    def log(self) -> dict:
        with self._cv:
            return {
                "submitted": [(r.request_id, r.params.seed) for r in self.submitted],
                "aborted": list(self.aborted),
                "delivered": list(self.delivered),
            }

    # ---- the rest of the contract: recorded, not simulated (no model, nothing to load) ----------
    def pause(self, mode: str) -> None:
        self.paused = mode

    def resume(self) -> None:
        self.paused = None

    def update_weights(self, named_tensors, version: int) -> float:
        self._version = version
        return 0.0

    def version(self) -> int:
        return self._version

    def sleep(self, level: int = 1) -> dict:
        self.asleep = True
        return {"level": level, "released": False}

    def wake_up(self) -> dict:
        self.asleep = False
        return {"level": 0}

    def stats(self) -> dict[str, float]:
        with self._cv:
            return {
                "tokens_generated": 0.0,
                "busy_s": 0.0,
                "idle_s": 0.0,
                "num_running": float(len(self._due)),
                "num_waiting": 0.0,
                "version": float(self._version),
            }

    def busy_spans(self) -> list[list[float]]:
        return []

    def health(self) -> bool:
        return True

    def pid(self) -> int:
        return os.getpid()

    def shutdown(self) -> None:
        self.abort(None)


class CorridorPlayer(ScriptedEngine):
    """Plays ``corridor`` turns for the episode workflow, one character token per action under a
    character codec (token = ``ord``): a unit in ``bad`` answers ``x`` (an invalid action: the
    episode ends at once with reward 0), every other unit walks straight to the goal (reward 1).
    ``delays`` are per unit id (``"<prompt>:<k>"``) and apply to each of its turns."""

    def __init__(
        self, delays: dict[str, float], bad: set[str] = frozenset(), default_delay: float = 0.02, width: int = 8
    ):
        super().__init__(delays, default_delay)
        self.bad, self.width = set(bad), width

    def submit(self, requests: list[GenerationRequest]) -> int:
        now = time.time()
        with self._cv:
            for r in requests:
                unit = r.request_id.rsplit("/", 1)[0]
                self._due[r.request_id] = (now + self.delays.get(unit, self.default_delay), r)
                self.submitted.append(r)
            self._cv.notify_all()
        return len(requests)

    def _output(self, r: GenerationRequest, reason: str) -> GenerationOutput:
        unit = r.request_id.rsplit("/", 1)[0]
        board = "".join(map(chr, r.prompt_ids))[-(self.width + 1) : -1]  # the latest observation's cells
        action = "x" if unit in self.bad else ("r" if board.index("g") > board.index("a") else "l")
        return GenerationOutput(r.request_id, list(r.prompt_ids), [ord(action)], [-0.5], [self._version], reason)
