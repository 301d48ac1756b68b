"""KeyedSampleBuffer: the SampleBuffer the service holds, with a key per group for remote takers.

A remote consumer cannot send its ``select`` rule over the wire (it is a Python callable, and a
frame must never carry code). So it reads each group's metadata (``GroupMeta``: key, version,
size), runs ``select`` locally, and asks for exactly the keys it chose; ``take`` hands them all
over or none (another consumer may have taken one meanwhile: the caller looks again). Keys are
assigned here, never reused, so a stale choice can never take a group it did not see.

In the service's own process the same object is an ordinary ``SampleBuffer`` (``get_batch`` with
real Groups, ``wake``, ``drain``), so a controller living beside the service pays no wire cost.
Every change bumps ``epoch`` and calls ``on_change`` (the service wakes parked long-polls with it).
"""

from __future__ import annotations

import itertools
from collections.abc import Callable
from dataclasses import dataclass
from typing import NamedTuple

from .buffer import BufferClosed, SampleBuffer, Select
from .types import Group


class GroupMeta(NamedTuple):
    """What ``select`` sees of a group in a remote buffer (duck-types Group's ``version``/``prompt_id``)."""

    key: int
    prompt_id: int
    version: int
    admitted_version: int
    data_index: int
    num_samples: int
    nbytes: int  # its frame's size (0 until a local put is first encoded)

    def to_wire(self) -> list[int]:
        return list(self)


@dataclass
class _Entry:
    meta: GroupMeta
    frame: bytes | memoryview | None  # the encoded group as it arrived (None: put in-process, encoded on demand)


class KeyedSampleBuffer(SampleBuffer):
    def __init__(self, capacity: int, on_change: Callable[[], None] | None = None):
        super().__init__(capacity)
        self._entries: dict[int, _Entry] = {}  # id(group) -> entry, for groups now held
        self._keys = itertools.count()
        self.epoch = 0
        self._on_change = on_change or (lambda: None)

    def put(self, group: Group, timeout: float | None = None, frame: bytes | memoryview | None = None) -> None:
        with self._cond:
            if id(group) in self._entries:
                raise ValueError(f"group {group.prompt_id}: this Group object is already in the buffer")
            super().put(group, timeout)
            self._register(group, frame)
        self._on_change()

    def try_put(self, group: Group, frame: bytes | memoryview | None = None, notify: bool = True) -> bool:
        """Put without waiting: False when full (the service answers 'full'), BufferClosed if closed.

        ``notify=False`` leaves waking in-process waiters to the caller (``wake`` once per burst:
        each wake is a thread switch, and the service stores puts in bursts).
        """
        with self._cond:
            if self._closed:
                raise BufferClosed("put on a closed SampleBuffer")
            if len(self._groups) >= self.capacity:
                return False
            self._groups.append(group)  # SampleBuffer.put without its wait (the hot path)
            self._puts += 1
            self._register(group, frame)
            if notify:
                self._cond.notify_all()
        self._on_change()
        return True

    def get_batch(self, n: int, select: Select | None = None, timeout: float | None = None) -> list[Group]:
        batch = super().get_batch(n, select, timeout)
        self._forget(batch)
        return batch

    def drain(self) -> list[Group]:
        out = super().drain()
        self._forget(out)
        return out

    def restore(self, groups: list[Group]) -> None:
        """Put back a checkpoint's groups, each under a fresh key (a resumed service starts over).

        They enter the store directly, never through a producer's ``put``: the ``(producer, seq)``
        exactly-once check applies to puts over the wire only, so a restored group is neither
        refused as a duplicate of an old seq nor stored twice (the checkpoint holds it once).
        """
        with self._cond:
            for g in groups:
                if id(g) in self._entries:
                    raise ValueError(f"group {g.prompt_id}: this Group object is already in the buffer")
            super().restore(groups)
            for g in groups:
                self._register(g, None)
        self._on_change()

    def close(self) -> None:
        super().close()
        with self._cond:
            self.epoch += 1
        self._on_change()

    def meta(self) -> tuple[int, bool, list[GroupMeta]]:
        """(epoch, closed, metadata of every held group in arrival order)."""
        with self._cond:
            return self.epoch, self._closed, [self._entries[id(g)].meta for g in self._groups]

    def take(self, keys: list[int], closed_ok: bool = False) -> list[tuple[Group, bytes | memoryview]] | None:
        """Remove exactly these groups and return them with their frames; None if any is gone.

        ``closed_ok``: ``drain`` empties a closed buffer too (as SampleBuffer.drain does).
        """
        from .wire import encode_group

        with self._cond:
            if self._closed and not closed_ok:
                raise BufferClosed("take on a closed SampleBuffer")
            where = {self._entries[id(g)].meta.key: i for i, g in enumerate(self._groups)}
            if len(set(keys)) != len(keys) or any(k not in where for k in keys):
                return None
            picked = sorted(where[k] for k in keys)
            out = [(self._groups[i], self._entries[id(self._groups[i])].frame) for i in picked]
            drop = set(picked)
            self._groups = [g for i, g in enumerate(self._groups) if i not in drop]
            self._gets += len(out)
            self._cond.notify_all()
        self._forget([g for g, _ in out])
        return [(g, frame if frame is not None else encode_group(g)) for g, frame in out]

    def _register(self, group: Group, frame: bytes | memoryview | None) -> None:
        meta = GroupMeta(
            key=next(self._keys),
            prompt_id=group.prompt_id,
            version=group.version,
            admitted_version=group.admitted_version,
            data_index=group.data_index,
            num_samples=len(group.samples),
            nbytes=len(frame) if frame else 0,
        )
        self._entries[id(group)] = _Entry(meta, frame)
        self.epoch += 1

    def _forget(self, groups: list[Group]) -> None:
        """Drop the entries of groups that left (they are still alive here, so no id was reused)."""
        if not groups:
            return
        with self._cond:
            for g in groups:
                self._entries.pop(id(g), None)
            self.epoch += 1
        self._on_change()
