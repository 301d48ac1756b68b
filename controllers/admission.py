"""Admission half of the scheduler core: which prompts start, when, and how they restart.

``Admission`` is the base of ``controllers.scheduler.RolloutCore``; it holds the *admission*
thread and what belongs with it: whenever ``Provisioning`` allows (the staleness bound, counting
trainable groups only, plus ``max_additional_prompts`` spares), it takes the next prompt from the
task's stream and launches its ``n + redundancy`` units through the workflow (prompt replication:
each its own id and seed, so engines or a router may spread them freely); at a new policy version
it lets more prompts in and ends older spares; a checkpoint's state (the prompts in flight, the
admission accounting) is saved and restored here, and after an engine restart the lost units are
asked again. Collection and scoring (what happens once a unit finishes) are in the core. The
state both halves share (``_lock``, ``_pending``, the lifecycle, ``Provisioning``) is set up by
``RolloutCore.__init__``.

Request seeds depend only on (run seed, prompt id, request index), never on timing.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from buffers import Group, Sample
from controllers.workflows.base import Unit, request_id, request_seed
from flash.engine.base import SamplingParams


@dataclass
class PromptSource:
    """The task's prompt stream as the scheduler needs it: item, token ids, reward."""

    item: Callable[[int], Any]  # data index -> TaskItem
    encode: Callable[[str], list[int]]
    decode: Callable[[list[int]], str]
    reward: Callable[[Any, str], float]
    guard: Any = None  # flash.guards.InputGuard: skips (or rejects) malformed/empty/too long prompts

    def take(self, index: int) -> tuple[int, Any, list[int]]:
        """The first usable prompt at data position >= ``index``: (its index, item, token ids)."""
        if self.guard is not None:
            return self.guard.take(index, self.item, self.encode)
        item = self.item(index)
        return index, item, self.encode(item.prompt)


@dataclass
class _Pending:
    item: Any
    data_index: int
    version: int
    wave: int
    requests: int  # n + redundancy
    finished: list[int] = field(default_factory=list)  # request indices kept (first n to finish)
    samples: dict[int, Sample] = field(default_factory=dict)  # request index -> scored sample
    parked: Group | None = None  # a spare's kept group, waiting for promotion
    cap: int | None = None  # max_new_tokens of its requests when below the run's (tail batching)
    meta: dict = field(default_factory=dict)  # copied into each sample's meta (e.g. the round)


class Admission:
    """Admission, spare expiry, checkpoint state and engine-restart requeue (see the module doc)."""

    def set_version(self, version: int) -> None:
        """The policy moved to ``version``: more prompts may be admitted; older spares end."""
        with self._lock:
            self._version = version
            abort_ids = self._expire_spares(version)
            self._on_version(version)
            self._lock.notify_all()
        self._abort(abort_ids)
        self.buffer.wake()

    def _on_version(self, version: int) -> None:
        """Hook under the lock when the policy moved to ``version``, before admission goes on."""

    def _admit_loop(self) -> None:
        while not self._admit_stop.is_set():
            with self._lock:
                self._lock.wait_for(lambda: self._admit_stop.is_set() or
                                    self._prov.next_action(self._version) is not None)
                if self._admit_stop.is_set():
                    return
                batch, promoted = self._admit_wave()
                self._engine_io.acquire()
            try:
                self.workflow.launch(batch)
            finally:
                self._engine_io.release()
            for pid, group in promoted:
                self._to_buffer(pid, group)

    def _admit_wave(self) -> tuple[list[Unit], list[tuple[int, Group]]]:
        """Everything admission allows now (under the lock): promotions first, then new prompts."""
        wave, self._waves = self._waves, self._waves + 1
        batch, promoted = [], []
        while (action := self._prov.next_action(self._version)) is not None:
            kind, pid = action
            if kind == "promote":
                self._prov.promote(pid)
                group = self._pending[pid].parked
                if group is not None:  # already scored and kept: straight to the buffer
                    self.lifecycle.move([s.meta["request_id"] for s in group.samples], "buffered")
                    promoted.append((pid, group))
            else:
                batch.extend(self._admit_one(wave, spare=kind == "spare"))
        self._gate.open(wave, len(batch))
        return batch, promoted

    def _admit_one(self, wave: int, spare: bool) -> list[Unit]:
        """Admit the next prompt (``_take_prompt``) under a new prompt id; its units."""
        prompt_id = self._admitted
        index, item, ids, cap, meta = self._take_prompt(spare)
        requests = self.n + self.redundancy
        self._pending[prompt_id] = _Pending(item=item, data_index=index, version=self._version,
                                            wave=wave, requests=requests, cap=cap, meta=meta)
        self._prov.admitted(prompt_id, self._version, spare)
        self._admitted += 1
        reqs = self._units(prompt_id, ids, range(requests))
        rids = [r.id for r in reqs]
        self.lifecycle.admit(rids)
        self.lifecycle.move(rids, "generating")
        return reqs

    def _take_prompt(self, spare: bool) -> tuple[int, Any, list[int], int | None, dict]:
        """The next usable prompt of the stream (``PromptSource.take``: the input guard skips bad
        rows): (data index, item, token ids, length cap or None, sample meta)."""
        index, item, ids = self.source.take(self._next_index)
        self._next_index = index + 1
        return index, item, ids, None, {}

    def _expire_spares(self, version: int) -> list[str]:
        """Abort spares of versions before ``version`` (under the lock); engine ids to abort."""
        engine_ids: list[str] = []
        for pid in self._prov.expire(version):
            engine_ids += self._drop_prompt(pid, self.expire_reason, {})
        return engine_ids

    expire_reason = "surplus"  # why an expired spare ends (rollout/aborted/<reason>)

    def _drop_prompt(self, pid: int, reason: str, event: dict) -> list[str]:
        """End every live request of pending prompt ``pid`` as aborted(reason), one ledger event for
        the prompt (under the lock); returns the ids still generating, to abort in the engine."""
        p = self._pending.pop(pid)
        rids = [request_id(pid, j) for j in range(p.requests)]
        states = {r: self.lifecycle.state(r) for r in rids}
        live = [r for r in rids if states[r] is not None]
        generating = [r for r in live if states[r] == "generating"]
        self.lifecycle.abort(live, reason, [{"prompt_id": pid, "data_index": p.data_index,
                                             "samples": len(live), **event}])
        self._dispatch(self._gate.resolved(p.wave, len(generating)))
        return generating

    # ---- checkpoint and fault hooks (flash.checkpoint, flash.engine.client) ---------------------------
    def state_dict(self) -> dict:
        """Data position, admissions, version, counters, RNG, the prompts in flight, the admission
        accounting (``Provisioning``: counted groups and spares) and the lifecycle counters.

        A prompt in flight (regular or spare, generating, scoring, or a spare's parked group) is
        restarted from scratch on resume: same prompt id, data index, admission version and request
        seeds, for the requests of it still live here; its partial responses are dropped, never its
        prompt. The restore takes those requests out of the lifecycle's ``admitted`` count and admits
        them again, so ``admitted = ended + live`` still holds after it.
        """
        with self._lock:
            version, state, gauss = self._rng.getstate()
            pending = []
            for pid, p in sorted(self._pending.items()):
                live = [k for k in range(p.requests) if self.lifecycle.state(request_id(pid, k)) is not None]
                pending.append({"prompt_id": pid, "data_index": p.data_index, "version": p.version,
                                "spare": self._prov.is_spare(pid), "requests": live,
                                "cap": p.cap, "meta": dict(p.meta)})
            return {
                "admitted": self._admitted, "next_index": self._next_index, "version": self._version,
                "counters": dict(self.counters), "rng": [version, list(state), gauss],
                "pending": pending, "waves": self._waves,
                "provisioning": {"counted": self._prov.counted},
                "lifecycle": self.lifecycle.state_dict(),
            }

    def load_state_dict(self, state: dict, buffered_groups: list[Group] | None = None) -> int:
        """Restore a checkpoint's state before ``start`` (the buffer's groups already put back:
        ``buffered_groups``, or read from an in-process buffer); the prompts that were in flight
        restart from scratch (same prompt ids, same request seeds). Returns how many prompts restarted."""
        if buffered_groups is None:
            buffered_groups = self.buffer.snapshot()[0]
        buffered = [s.meta["request_id"] for g in buffered_groups for s in g.samples]
        with self._lock:
            self._admitted, self._next_index = state["admitted"], state["next_index"]
            self._version = state["version"]
            self.counters.update(state["counters"])
            version, rng, gauss = state["rng"]
            self._rng.setstate((version, tuple(rng), gauss))
            self._waves = state.get("waves", 0)
            self._prov.counted = state.get("provisioning", {}).get("counted", self._admitted)
            restarted = sum(len(p.get("requests", ())) for p in state["pending"])
            if "lifecycle" in state:
                self.lifecycle.load_state_dict(state["lifecycle"], {rid: "buffered" for rid in buffered},
                                               readmitted=restarted)
            wave, self._waves = self._waves, self._waves + 1
            reqs = []
            for p in state["pending"]:
                pid = p["prompt_id"]
                item = self.source.item(p["data_index"])
                ks = p.get("requests", list(range(self.n + self.redundancy)))
                self._pending[pid] = _Pending(item=item, data_index=p["data_index"], version=p["version"],
                                              wave=wave, requests=self.n + self.redundancy,
                                              cap=p.get("cap"), meta=dict(p.get("meta", {})))
                if p.get("spare"):  # not counted: the checkpoint's count never included it
                    self._prov.admitted(pid, p["version"], spare=True)
                new = self._units(pid, self.source.encode(item.prompt), ks)
                rids = [r.id for r in new]
                self.lifecycle.admit(rids)
                self.lifecycle.move(rids, "generating")
                reqs += new
            self._gate.open(wave, len(reqs))
        self.workflow.launch(reqs)
        return len(state["pending"])

    def requeue_lost(self, ids: list[str] | None = None) -> int:
        """After an engine restart: ask again what the engine lost -- every unit still generating
        for a pending prompt (and of an evaluation) whose output was not taken from the engine yet,
        of those ``ids`` only when given (the requests a restarted replica behind a router held);
        the workflow decides what that means for it (``Workflow.requeue``). Returns how many.

        Called inside the engine client's recovery, possibly from a thread that holds
        ``_engine_io``: it launches without that lock (an abort racing a recovery at worst lets a
        request run on)."""
        only = None if ids is None else set(ids)
        with self._lock:
            lost = [u for u in self._eval_units.values() if u.id not in self._eval and (only is None or u.id in only)]
            for pid, p in sorted(self._pending.items()):
                ks = [k for k in range(p.requests) if request_id(pid, k) not in self._received
                      and self.lifecycle.state(request_id(pid, k)) == "generating"
                      and (only is None or request_id(pid, k) in only)]
                if ks:
                    lost += self._units(pid, self.source.encode(p.item.prompt), ks)
        return self.workflow.requeue(lost, ids)

    def _units(self, prompt_id: int, ids: list[int], ks) -> list[Unit]:
        """Units ``ks`` of a pending prompt: seeds from (run seed, prompt id, k); its ``cap`` (tail
        batching) lowers max_new_tokens."""
        p = self._pending[prompt_id]
        knobs = {**self.params.__dict__, **({"max_new_tokens": p.cap} if p.cap is not None else {})}
        return [Unit(request_id(prompt_id, k), prompt_id, k, p.item, ids,
                     SamplingParams(**{**knobs, "seed": request_seed(self.seed, prompt_id, k)}),
                     version=p.version, data_index=p.data_index, meta=dict(p.meta))
                for k in ks]
