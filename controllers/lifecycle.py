"""Per-sample lifecycle: every request the scheduler makes is in exactly one state at any time.

    admitted → generating → scoring → buffered → trained
                   │            ├──→ filtered(rule)      (its whole group, flash.controllers.filters)
                   └────────────┴──→ aborted(reason)     (redundant | surplus)

- *admitted*: the request is built (a prompt's ``n + redundancy`` requests at once);
- *generating*: submitted to an engine;
- *scoring*: generation finished; being scored, or scored and waiting for the rest of its group
  (with ``rollout.queue_scheduling=false`` also waiting for its admission wave to finish);
- *buffered*: its group is in the SampleBuffer (or in the batch being trained);
- *trained*, *filtered*, *aborted*: terminal.

Units: ``rollout/lifecycle/<state>`` counts samples that ever entered ``state`` (cumulative) and
``rollout/lifecycle/<state>_now`` the samples in it now; ``rollout/filtered/<rule>`` counts
*groups*; ``rollout/aborted/<reason>`` counts *samples*. Because every transition is made under one
lock and checked against the diagram (an illegal one raises), each snapshot satisfies

    admitted = trained + filtered + aborted + buffered_now + scoring_now + generating_now (+ admitted_now)

and a sample can neither vanish nor end twice (docs/design.md invariant 5, at sample granularity).
Filtered groups and aborted samples also leave ledger events, which the controller writes.

``Outcomes`` is the scheduler core's part that owns the lifecycle with the core's run counters
(samples and tokens generated, errors, late outputs, reward time): their metrics and their part
of a checkpoint.
"""

from __future__ import annotations

import threading
from collections import Counter
from typing import Any, Iterable

from .filters import RULES

STATES = ("admitted", "generating", "scoring", "buffered", "trained", "filtered", "aborted")
ABORT_REASONS = ("redundant", "surplus")  # why a sample ends aborted (rollout/aborted/<reason>)
LIVE = ("admitted", "generating", "scoring", "buffered")
TERMINAL = ("trained", "filtered", "aborted")
NEXT = {
    "admitted": ("generating", "aborted"),
    "generating": ("scoring", "aborted"),
    "scoring": ("buffered", "filtered", "aborted"),
    "buffered": ("trained",),
}


class IllegalTransition(RuntimeError):
    """A bookkeeping bug: a sample moved along an edge the diagram lacks, or was unknown."""


class Lifecycle:
    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._state: dict[str, str] = {}  # live samples only; terminal ones leave (bounded memory)
        self._entered: Counter = Counter()
        self._now: Counter = Counter()
        self.filtered: Counter = Counter()  # rule -> groups
        self.aborted: Counter = Counter()  # reason -> samples
        self._events: list[dict[str, Any]] = []

    def admit(self, ids: Iterable[str]) -> None:
        with self._lock:
            for rid in ids:
                if rid in self._state:
                    raise IllegalTransition(f"sample {rid} admitted twice")
                self._state[rid] = "admitted"
                self._entered["admitted"] += 1
                self._now["admitted"] += 1

    def move(self, ids: Iterable[str], to: str) -> None:
        with self._lock:
            self._move(list(ids), to)

    def _move(self, ids: list[str], to: str) -> None:
        for rid in ids:  # check all first: a failed move changes nothing
            src = self._state.get(rid)
            if src is None or to not in NEXT.get(src, ()):
                raise IllegalTransition(f"sample {rid}: {src or 'unknown'} -> {to} is not a lifecycle edge")
        for rid in ids:
            self._now[self._state[rid]] -= 1
            self._entered[to] += 1
            if to in TERMINAL:
                del self._state[rid]
            else:
                self._state[rid] = to
                self._now[to] += 1

    def filter_group(self, ids: list[str], rule: str, event: dict[str, Any]) -> None:
        with self._lock:
            self._move(ids, "filtered")
            self.filtered[rule] += 1
            self._events.append({**event, "outcome": "filtered", "rule": rule})

    def abort(self, ids: list[str], reason: str, events: list[dict[str, Any]]) -> None:
        with self._lock:
            self._move(ids, "aborted")
            self.aborted[reason] += len(ids)
            self._events.extend({**e, "outcome": "aborted", "reason": reason} for e in events)

    def state(self, rid: str) -> str | None:
        """The live state of ``rid``; None once it ended (or if it never existed)."""
        with self._lock:
            return self._state.get(rid)

    def drain_events(self) -> list[dict[str, Any]]:
        """Ledger events (filtered groups, aborted samples/groups) since the last call."""
        with self._lock:
            out, self._events = self._events, []
            return out

    def snapshot(self) -> dict[str, int]:
        """Cumulative ``<state>`` and current ``<state>_now`` counts, taken atomically."""
        with self._lock:
            snap = {s: self._entered[s] for s in STATES}
            snap.update({f"{s}_now": self._now[s] for s in LIVE})
            return snap

    def state_dict(self) -> dict[str, Any]:
        """Counters and undrained ledger events, for a checkpoint (flash.checkpoint)."""
        with self._lock:
            return {
                "entered": dict(self._entered),
                "filtered": dict(self.filtered),
                "aborted": dict(self.aborted),
                "events": list(self._events),
            }

    def load_state_dict(self, state: dict[str, Any], live: dict[str, str], readmitted: int = 0) -> None:
        """Restore a checkpoint's counters with ``live`` (request id -> state: the restored buffer's
        samples) as the only live samples. ``readmitted``: samples live at the checkpoint that the
        restore admits again (restarted prompts); they leave the ``admitted`` count here, so it
        counts them once."""
        with self._lock:
            self._entered = Counter(state["entered"])
            self._entered["admitted"] -= readmitted
            self.filtered, self.aborted = Counter(state["filtered"]), Counter(state["aborted"])
            self._events = list(state["events"])
            self._state = dict(live)
            self._now = Counter(live.values())

    def metrics(self) -> dict[str, float]:
        with self._lock:
            filtered, aborted = dict(self.filtered), dict(self.aborted)
        m = {f"rollout/lifecycle/{k}": float(v) for k, v in self.snapshot().items()}
        m.update({f"rollout/filtered/{k}": float(v) for k, v in filtered.items()})
        m.update({f"rollout/aborted/{k}": float(v) for k, v in aborted.items()})
        return m


class Outcomes:
    """The lifecycle of every sample and the core's run counters (the core's lock guards
    ``counters``; the workflow may share the dict: ``Episodes.core``)."""

    def __init__(self) -> None:
        self.lifecycle = Lifecycle()
        # late_outputs: a finished response of a request already aborted (it raced the abort);
        # reward_deadline: responses whose scoring passed reward.response_deadline_s (scored 0)
        self.counters: dict[str, float] = {
            "samples_generated": 0,
            "tokens_generated": 0,
            "reward_errors": 0,
            "request_errors": 0,
            "late_outputs": 0,
            "reward_seconds": 0.0,
            "reward_deadline": 0,
        }

    def metrics(self) -> dict[str, float]:
        """Lifecycle counts, filtered groups by rule, aborted samples by reason (every rule and
        reason present, zero until it happens, so a tracker's series start at step 1), late
        outputs, reward time, the responses whose reward failed (raised or returned no reward:
        ``reward/errors``) and those whose scoring passed its deadline."""
        m = {f"rollout/filtered/{rule}": 0.0 for rule in RULES}
        m.update({f"rollout/aborted/{reason}": 0.0 for reason in ABORT_REASONS})
        m.update(self.lifecycle.metrics())
        m.update(
            {
                "rollout/late_outputs": float(self.counters["late_outputs"]),
                "reward/seconds_total": float(self.counters["reward_seconds"]),
                "reward/errors": float(self.counters["reward_errors"]),
                "reward/deadline": float(self.counters["reward_deadline"]),
            }
        )
        return m

    def state_dict(self) -> dict[str, Any]:
        return {"counters": dict(self.counters), "lifecycle": self.lifecycle.state_dict()}

    def load_state_dict(self, state: dict[str, Any], buffered: list[str], readmitted: int) -> None:
        """Counters and lifecycle of a checkpoint; ``buffered``: the request ids of the restored
        buffer's samples, ``readmitted``: the requests the restore admits again
        (``Lifecycle.load_state_dict``)."""
        self.counters.update(state["counters"])
        if "lifecycle" in state:
            self.lifecycle.load_state_dict(
                state["lifecycle"], {rid: "buffered" for rid in buffered}, readmitted=readmitted
            )


def unbalance(snap: dict[str, int]) -> int:
    """admitted − (ended + live); 0 in every consistent snapshot."""
    ended = sum(snap[s] for s in TERMINAL)
    live = sum(snap[f"{s}_now"] for s in LIVE)
    return snap["admitted"] - ended - live
