"""The buffer service's bookkeeping that a client could otherwise grow or abuse, each bounded.

- ``ProducerTable``: producer ids are issued by the service (``hello``), never chosen by a client,
  so a client cannot put under another's id or invent ids to get a group stored twice; the table
  holds at most ``max_producers``, a client (its connection: ``flash.buffers.service``) at most
  ``per_client``, and a producer silent for ``expire_s`` gives its slot to a new one (its next put
  is refused as ``unknown_producer``). A full table takes room from the client holding the most
  ids first, so hellos from one client never lock out another's first producer.
- ``SeenPrompts``: the last ``limit`` prompt ids stored; a group of a prompt already stored is
  refused (a group replayed by another producer is not a second group). A run admits each prompt
  id once (``flash.controllers.scheduler``), so a legitimate producer never meets it.
- ``ValueLimits`` / ``check_values``: what a decoded group may hold beyond its schema (which
  ``flash.buffers.wire`` checks): finite rewards and logprobs, versions in [0, the policy's version],
  token ids in [0, vocab), loss masks of 0/1, bounded lengths and sample counts.
"""

from __future__ import annotations

import secrets
import time
from collections import OrderedDict, deque
from dataclasses import dataclass

import numpy as np

from .reward import BadReward, reward_value
from .types import Group
from .wire import WireError


class ProducerTable:
    def __init__(
        self, max_producers: int = 4096, expire_s: float = 600.0, per_client: int = 64, pressure_idle_s: float = 60.0
    ):
        self.max_producers, self.expire_s, self.per_client = max_producers, expire_s, per_client
        self.pressure_idle_s = pressure_idle_s
        # id -> [last decided seq, last request time, client], the longest silent first
        self._table: OrderedDict[str, list] = OrderedDict()
        self._clients: dict[bytes, set[str]] = {}  # client -> the ids issued to it
        self.evicted = 0  # ids given up to make room before they expired

    def issue(self, client: bytes = b"", now: float | None = None) -> str:
        """A new producer id for ``client``: at most ``per_client`` each (``producers_per_client``);
        a full table makes room first (``_make_room``)."""
        now = time.monotonic() if now is None else now
        held = len(self._clients.get(client, ()))
        if held >= self.per_client:
            raise WireError("producers_per_client", f"this client holds {held} producer ids, the most one client may")
        if len(self._table) >= self.max_producers:
            self._make_room(held, now)
        pid = secrets.token_hex(12)
        self._table[pid] = [-1, now, client]
        self._clients.setdefault(client, set()).add(pid)
        return pid

    def _make_room(self, held: int, now: float) -> None:
        """Under pressure, for a client holding ``held`` ids, in order: the longest silent past
        ``expire_s``; else the longest silent of the client holding the most ids, if that is more
        than the asking client would (one client's flood gives way to another's first producer);
        else the longest silent past ``pressure_idle_s``."""
        oldest, (_, seen, _) = next(iter(self._table.items()))
        if now - seen >= self.expire_s:
            return self._drop(oldest)
        heaviest = max(self._clients.values(), key=len)
        if len(heaviest) > held + 1:
            self.evicted += 1
            return self._drop(min(heaviest, key=lambda pid: self._table[pid][1]))
        if now - seen >= self.pressure_idle_s:
            self.evicted += 1
            return self._drop(oldest)
        raise WireError(
            "too_many_producers",
            f"{self.max_producers} producers of as many clients active in the last {self.pressure_idle_s:.0f}s",
        )

    def _drop(self, pid: str) -> None:
        client = self._table.pop(pid)[2]
        held = self._clients[client]
        held.discard(pid)
        if not held:
            del self._clients[client]

    def last_seq(self, producer: str, now: float | None = None) -> int:
        """The producer's last decided seq (touching it); ``unknown_producer`` if never issued here."""
        entry = self._table.get(producer)
        if entry is None:
            raise WireError(
                "unknown_producer", "producer ids come from the service's hello; this one is unknown or expired"
            )
        entry[1] = time.monotonic() if now is None else now
        self._table.move_to_end(producer)
        return entry[0]

    def decided(self, producer: str, seq: int) -> None:
        self._table[producer][0] = seq

    def __len__(self) -> int:
        return len(self._table)


class SeenPrompts:
    def __init__(self, limit: int = 1 << 20):
        self.limit = limit
        self._order: deque[int] = deque()
        self._set: set[int] = set()

    def __contains__(self, prompt_id: int) -> bool:
        return prompt_id in self._set

    def add(self, prompt_id: int) -> None:
        self._set.add(prompt_id)
        self._order.append(prompt_id)
        if len(self._order) > self.limit:
            self._set.discard(self._order.popleft())


@dataclass(frozen=True)
class ValueLimits:
    vocab_size: int | None = None  # token ids must be below it (None: not checked)
    max_tokens: int = 1 << 20  # prompt + response tokens of one sample
    max_samples: int = 4096  # samples in one group


def check_values(group: Group, limits: ValueLimits, max_version: int) -> None:
    """Refuse (``bad_value``) a group whose values no engine produces: the schema cannot see them.

    Each per-token array costs one pass over its values (the service checks every group it
    stores): a range check reads the integers as unsigned, where a negative value is huge; only a
    failed pass looks again, to name the value."""
    if len(group.samples) > limits.max_samples:
        raise WireError("bad_value", f"group {group.prompt_id}: {len(group.samples)} samples > {limits.max_samples}")
    if not 0 <= group.admitted_version <= max_version:
        raise WireError(
            "bad_value",
            f"group {group.prompt_id}: admitted_version {group.admitted_version} outside [0, {max_version}]",
        )
    top = (limits.vocab_size - 1) if limits.vocab_size else None
    for s in group.samples:
        try:
            reward_value(s.reward)
        except BadReward as exc:
            raise WireError("bad_value", f"{_where(group, s)}: reward {s.reward!r}: {exc}") from None
        if (tokens := len(s.prompt_ids) + len(s.response_ids)) > limits.max_tokens:
            raise WireError("bad_value", f"{_where(group, s)}: {tokens} tokens > {limits.max_tokens}")
        if not 0 <= s.admitted_version <= max_version:
            raise WireError(
                "bad_value", f"{_where(group, s)}: admitted_version {s.admitted_version} outside [0, {max_version}]"
            )
        _finite(s.behav_logprobs, group, s, "behav_logprobs")
        _in_range(s.versions, max_version, group, s, "versions")
        _in_range(s.prompt_ids, top, group, s, "prompt_ids")
        _in_range(s.response_ids, top, group, s, "response_ids")
        if s.loss_mask is not None:
            _in_range(s.loss_mask, 1, group, s, "loss_mask")


def _where(group: Group, s) -> str:
    return f"group {group.prompt_id} sample {s.sample_index}"


def _finite(values, group: Group, s, name: str) -> None:
    arr = np.asarray(values)
    if arr.size and not np.isfinite(arr).all():
        raise WireError("bad_value", f"{_where(group, s)}: {name} holds NaN or inf")


# an integer dtype -> (the unsigned dtype of its width, its largest value)
_UNSIGNED = {
    np.dtype(t): (np.dtype(t.replace("i", "u")), np.iinfo(t).max)
    for t in ("|i1", "<i2", "<i4", "<i8", "|u1", "<u2", "<u4", "<u8")
}


def _in_range(values, hi: int | None, group: Group, s, name: str) -> None:
    """All of ``values`` in [0, hi] (hi None: no upper bound)."""
    arr = np.asarray(values)
    if not arr.size:
        return
    unsigned = _UNSIGNED.get(arr.dtype)
    if unsigned is not None and arr.view(unsigned[0]).max() <= (unsigned[1] if hi is None else min(hi, unsigned[1])):
        return
    low, high = arr.min(), arr.max()
    if low < 0:
        raise WireError("bad_value", f"{_where(group, s)}: {name} holds {low} < 0")
    if hi is not None and high > hi:
        raise WireError("bad_value", f"{_where(group, s)}: {name} holds {high} > {hi}")
