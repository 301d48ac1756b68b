"""Tail batching as a rollout-scheduler mode (``rollout.scheduler: tail_batching``).

The rules (threshold, long-round trigger) are in ``flash.controllers.tail_policy``; this subclass of
``RolloutScheduler`` applies them to admission and collection:

- a *round* is everything admitted while the policy is at one version (with ``async_ratio = 0``,
  exactly one train batch). At each version the round is *long* if the long-prompt queue is due
  (``long_round_due``), else *short*;
- a short round admits its ``B`` prompts as usual plus ``ceil((over_provision - 1) * B)`` spares
  (``flash.controllers.provisioning``: spares do not count against the staleness bound), every request
  capped at the threshold (``max_new_tokens = cap``: the engine stops it there);
- a response that reaches the cap ends its whole group: the group's other requests are aborted in
  the engine, every live sample ends ``aborted(tail_cut)`` (one ledger event with ``why``:
  ``threshold``), the prompt goes to the long-prompt queue and its slot is refilled;
- first to finish wins: a spare whose group is complete while every slot is taken takes the slot
  of a regular group of the same version still decoding, which becomes a spare
  (``Provisioning.demote``); once every slot holds a finished group and none is decoding, the
  round is full and the spares left are cut (``why``: ``round_full``); spares still out at the
  next version are cut too (``why``: ``expired``). Each goes to the long-prompt queue;
- a long round takes its prompts from the queue (then, if it runs dry, from the stream) and runs
  them whole at full length, with no spares; each re-run is a new admission (new prompt id, its
  ``meta['cut_from']`` names the cut one), so every prompt id still ends exactly once.

Staleness: regular admissions, cuts (a filtered group, for the accounting), spares and their
promotion at their own version are all covered by the proof in ``controllers/provisioning.py``;
a demotion is a filter followed by a spare admission at the same version. The bound therefore
holds at any ``async_ratio`` (tested under random delays).

Prompts are never lost: the long-prompt queue is in ``state_dict`` (a checkpoint), and at the end
of a run the prompts still queued are written to the ledger (``leftover``).
"""

from __future__ import annotations

import math
from collections import deque

from flash.buffers import Group
from .workflows.base import parse_request_id
from .filters import filter_reason
from .inflight import Pending
from .scheduler import RolloutScheduler
from .tail_policy import LengthThreshold, TailConfig, long_round_due
from flash.engine.base import GenerationOutput


class TailBatchingScheduler(RolloutScheduler):
    expire_reason = "tail_cut"

    def __init__(self, *args, tail: TailConfig | None = None, **kwargs):
        super().__init__(*args, **kwargs)
        self.tail = tail or TailConfig()
        B = self.admission.prov.staleness.batch
        # the percentile is over groups' longest responses: the group rule cuts by the longest
        self._threshold = LengthThreshold(
            self.tail.threshold, self.tail.window, self.inflight.params.max_new_tokens, min_history=B
        )
        self._extra = math.ceil((self.tail.over_provision - 1) * B - 1e-9)
        self._base_spares = self.admission.prov.max_additional
        self._trigger = self.tail.long_round_queue or B
        self._long: deque[dict] = deque()  # {"data_index", "prompt_id" (the cut admission)}
        self._round, self._round_version = "short", -1
        self._cap: int | None = None
        self._longest: dict[int, int] = {}  # prompt id -> longest finished response so far
        self.tail_counters = {"long_rounds": 0, "short_rounds": 0, "cut_groups": 0, "swaps": 0}
        with self._lock:
            self._on_version(0)

    # ---- rounds and admission (under the lock) ---------------------------------------------
    def _on_version(self, version: int) -> None:
        if version == self._round_version:  # the run's start (or a resume) repeats the version: same round
            return
        self._round_version = version
        long = long_round_due(len(self._long), version, self._trigger, self.tail.long_round_every)
        self._round = "long" if long else "short"
        self._cap = None if long else self._threshold.cap()
        self.tail_counters["long_rounds" if long else "short_rounds"] += 1
        self.admission.prov.max_additional = self._base_spares + (0 if long else self._extra)

    def _take_prompt(self, spare: bool):
        """Long round: the queue first; a short round whose cuts overflowed the queue to twice its
        trigger also refills from it (at full length), so a threshold that cuts nearly every group
        still makes progress. Else the stream, capped in a short round. A queued prompt is only
        ever a regular admission (never a spare, never a swap's victim): it cannot be cut again."""
        if self._long and not spare and (self._round == "long" or len(self._long) >= 2 * self._trigger):
            entry = self._long.popleft()
            item = self.source.item(entry["data_index"])
            meta = {"round": "long", "cut_from": entry["prompt_id"]}
            return entry["data_index"], item, self.source.encode(item.prompt), None, meta
        index, item, ids, _, _ = super()._take_prompt(spare)
        cap = self._cap if self._round == "short" else None
        return index, item, ids, cap, {"round": self._round}

    # ---- collection (under the lock) ---------------------------------------------------------
    def _on_generated(self, out: GenerationOutput, to_abort: list[str]) -> list[GenerationOutput]:
        pid, _ = parse_request_id(out.request_id)
        p = self.inflight.prompts.get(pid)
        if p is None or self.lifecycle.state(out.request_id) != "generating":
            return super()._on_generated(out, to_abort)  # a late output, counted there
        if p.cap is not None and out.finish_reason == "length":  # reached the threshold: cut the group
            self.counters["samples_generated"] += 1
            self.counters["tokens_generated"] += len(out.token_ids)
            self._threshold.observe(p.cap)
            to_abort.extend(r for r in self._cut(pid, "threshold") if r != out.request_id)
            return []
        longest = self._longest[pid] = max(self._longest.get(pid, 0), len(out.token_ids))
        ready = super()._on_generated(out, to_abort)
        if len(p.finished) == self.n:  # the group's n responses are in: its length is known
            self._threshold.observe(longest)
        return ready

    def _cut(self, pid: int, why: str) -> list[str]:
        """End pending prompt ``pid`` as ``tail_cut`` and queue it; engine ids to abort."""
        self.admission.prov.filtered(pid)  # frees its slot (a regular group) or its place (a spare)
        return self._drop_prompt(pid, "tail_cut", {"why": why})

    def _drop_prompt(self, pid: int, reason: str, event: dict) -> list[str]:
        p = self.inflight.prompts[pid]
        self._longest.pop(pid, None)
        ids = super()._drop_prompt(pid, reason, {"why": "expired", "version": p.version, **event})
        if reason == "tail_cut":
            self._long.append({"data_index": p.data_index, "prompt_id": pid})
            self.tail_counters["cut_groups"] += 1
            self._lock.notify_all()  # a slot is free (refill)
        return ids

    def _group_done(self, pid: int, p: Pending, group: Group) -> bool:
        """First to finish wins (swap a finished spare in); a full round cuts its spares."""
        self._longest.pop(pid, None)
        version = self.admission.version
        if self.admission.prov.is_spare(pid) and p.version == version and not self._filtered(group):
            if not self.admission.prov.staleness.can_admit(self.admission.prov.counted, version):
                victim = self._victim(pid, version)
                if victim is not None:
                    self.admission.prov.demote(victim, version)
                    self.tail_counters["swaps"] += 1
            if self.admission.prov.staleness.can_admit(self.admission.prov.counted, version):
                self.admission.prov.promote(pid)
        to_buffer = super()._group_done(pid, p, group)
        if to_buffer and self._round_full(pid):
            self.admission.prov.max_additional = self._base_spares  # no new spares for the rest of the round
            for q in sorted(q for q in self.inflight.prompts if self.admission.prov.is_spare(q)):
                self._later_aborts += self._cut(q, "round_full")
        return to_buffer

    def _filtered(self, group: Group) -> bool:
        return (
            self.filters.enabled
            and filter_reason(group.rewards, [len(s.response_ids) for s in group.samples], self.filters) is not None
        )

    def _victim(self, pid: int, version: int) -> int | None:
        """The regular group of ``version`` still decoding that has the fewest responses in."""
        running = [
            (len(q.finished), -qid)
            for qid, q in self.inflight.prompts.items()
            if qid != pid
            and not self.admission.prov.is_spare(qid)
            and q.version == version
            and len(q.finished) < self.n
            and "cut_from" not in q.meta
        ]
        return -min(running)[1] if running else None

    def _round_full(self, pid: int) -> bool:
        """Every slot holds a finished group and no regular group is still out: spares are useless."""
        if self.admission.prov.staleness.can_admit(self.admission.prov.counted, self.admission.version):
            return False
        return not any(
            qid != pid and not self.admission.prov.is_spare(qid) and len(q.samples) < self.n
            for qid, q in self.inflight.prompts.items()
        )

    # ---- controller-facing ---------------------------------------------------------------------
    def metrics(self) -> dict[str, float]:
        m = super().metrics()
        m.setdefault("rollout/aborted/tail_cut", 0.0)
        with self._lock:
            m.update({f"rollout/tail/{k}": float(v) for k, v in self.tail_counters.items()})
            m.update(
                {
                    "rollout/tail/long_queue": float(len(self._long)),
                    "rollout/tail/long_round": float(self._round == "long"),
                    "rollout/tail/threshold": float(self._cap or self.inflight.params.max_new_tokens),
                }
            )
        return m

    def leftover(self) -> list[dict]:
        """Ledger lines for the prompts still in the long-prompt queue (at the end of a run)."""
        with self._lock:
            return [
                {"data_index": e["data_index"], "cut_prompt_id": e["prompt_id"], "outcome": "long_queue"}
                for e in self._long
            ]

    def state_dict(self) -> dict:
        state = super().state_dict()
        with self._lock:
            state["tail"] = {
                "long_queue": list(self._long),
                "round": self._round,
                "cap": self._cap,
                "round_version": self._round_version,
                "lengths": list(self._threshold.lengths),
                "counters": dict(self.tail_counters),
                "max_additional": self.admission.prov.max_additional,
            }
        return state

    def load_state_dict(self, state: dict, buffered_groups=None) -> int:
        tail = state.get("tail")
        if tail is None:
            raise ValueError(
                "this checkpoint was written without tail batching (no long-prompt queue); "
                "resume it with rollout.scheduler: plain"
            )
        with self._lock:
            self._long = deque(tail["long_queue"])
            self._round, self._cap, self._round_version = tail["round"], tail["cap"], tail["round_version"]
            self._threshold.lengths.clear()
            self._threshold.lengths.extend(tail["lengths"])
            self.tail_counters.update(tail["counters"])
            self.admission.prov.max_additional = tail["max_additional"]
        return super().load_state_dict(state, buffered_groups)
