"""RemoteSampleBuffer: the SampleBuffer API over a BufferService (puts go through a BufferProducer).

It keeps ``SampleBuffer``'s API so the controller takes either. Its
``get_batch(n, select)`` cannot ship ``select`` (a callable) to the service, so it long-polls the
service's metadata (``GroupMeta``: key, version, prompt id, size), runs ``select`` on it here, and
takes exactly the chosen keys; if another consumer got one first, the take is refused as a whole
and it looks again. ``select`` sees metadata, not samples: a rule may read ``version``,
``prompt_id``, ``admitted_version``, ``data_index``, ``num_samples`` and ``nbytes``.

``wake()`` is a byte on a pipe the waiting ``get_batch`` polls beside its socket, so scheduler
threads may call it at any time and the rule is re-evaluated at once.

A rule that reads state other than the buffer (the controller's reads the scheduler's pending
groups) is only as consistent as the view: a pick made while one of this proxy's own puts completed
is made again (``_next_view``), which covers the runner's wiring (scheduler and controller share one
proxy). Producers in other processes keep their own pending state; a rule reading it would need the
same care.
"""

from __future__ import annotations

import itertools
import os
import threading
import time
import uuid
from typing import Any

from .auth import ClientKeys
from .buffer import BufferClosed, Select, _oldest
from .producer import BufferProducer
from .rpc import BufferUnavailable, Rpc
from .store import GroupMeta
from .types import Group
from .wire import WireError, decode_group, unpack

__all__ = ["BufferProducer", "BufferUnavailable", "RemoteSampleBuffer"]


class RemoteSampleBuffer:
    """SampleBuffer's API over a BufferService (see the module docstring for ``select``)."""

    def __init__(
        self,
        address: str,
        max_frame_mb: float = 64.0,
        rpc_timeout_s: float = 10.0,
        poll_ms: int = 1000,
        keys: ClientKeys | None = None,
        owner_token: bytes = b"",
    ):
        """``keys``: the run's CURVE client keys (``flash.buffers.auth``); ``owner_token``: the service
        owner's token, without which ``close`` and ``drain`` are refused."""
        self.address, self.max_frame_mb, self.keys, self._token = address, max_frame_mb, keys, owner_token
        self.max_frame_bytes = int(max_frame_mb * (1 << 20))
        self.rpc_timeout_s, self.poll_ms = rpc_timeout_s, poll_ms
        self._wake_r, self._wake_w = os.pipe()
        os.set_blocking(self._wake_r, False)
        os.set_blocking(self._wake_w, False)
        self._data = Rpc(address, self.max_frame_bytes, wake_fd=self._wake_r, keys=keys)
        self._ctl = Rpc(address, self.max_frame_bytes, keys=keys)
        self._get_lock, self._ctl_lock = threading.Lock(), threading.Lock()
        self.consumer_id, self._tids, self.take_tries = uuid.uuid4().hex, itertools.count(), 3
        self._producer: BufferProducer | None = None
        self._puts_done = 0
        self._producer_lock = threading.Lock()

    def put(self, group: Group, timeout: float | None = None) -> None:
        with self._producer_lock:
            if self._producer is None:
                self._producer = BufferProducer(self.address, self.max_frame_mb, self.rpc_timeout_s, keys=self.keys)
        self._producer.put(group, timeout)
        with self._producer_lock:
            self._puts_done += 1

    def get_batch(self, n: int, select: Select | None = None, timeout: float | None = None) -> list[Group]:
        """Remove and return a batch: ``select(metas)`` picks indices, or None to keep waiting."""
        select = select or (lambda groups: _oldest(groups, n))
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._get_lock:
            self._drain_wakes()
            view: dict | None = None
            while True:
                view = self._next_view(view, deadline)
                if view is None:
                    raise TimeoutError(f"no batch of {n} groups within {timeout}s")
                if view["closed"]:
                    raise BufferClosed("get_batch on a closed SampleBuffer (service)")
                metas = view["metas"]
                picked = select(list(metas))
                if self._puts_done != view["puts_before"]:
                    view = None  # a put of ours landed meanwhile: look again (see _next_view)
                    continue
                if picked is None:
                    continue
                batch = self._take([metas[i].key for i in sorted(set(picked))])
                if batch is not None:
                    return batch

    def _next_view(self, view: dict | None, deadline: float | None) -> dict | None:
        """The service's metadata once it changes (at once when ``view`` is None; on ``wake``, the
        last one again).

        ``puts_before`` counts this proxy's puts done before the view was asked for. A ``select``
        that reads state those puts change (the scheduler drops a group from its pending list once
        ``put`` returns) must not run on a view older than such a put: the group would be in
        neither. So a pick made while a put of ours completed is thrown away and made again.
        """
        since = -1 if view is None else view["epoch"]
        puts_before = self._puts_done
        while True:
            left = None if deadline is None else deadline - time.monotonic()
            if left is not None and left <= 0:
                return None
            wait_ms = self.poll_ms if left is None else max(0, min(self.poll_ms, int(left * 1000)))
            rid = self._data.send({"op": "meta", "since": since, "wait_ms": wait_ms})
            reply = self._data.wait(rid, wait_ms / 1000 + self.rpc_timeout_s, wakeable=True)
            if reply is None and self._drain_wakes():
                if view is not None:
                    return view  # woken: re-run select on what we last saw
                continue
            if reply is None:  # the service answers a long-poll by its deadline: it is gone
                raise BufferUnavailable(f"no answer from the buffer service at {self.address}")
            fresh = _parse_meta(reply)
            if fresh["epoch"] != since or fresh["closed"]:
                return fresh | {"puts_before": puts_before}

    def _take(self, keys: list[int]) -> list[Group] | None:
        """Take exactly ``keys``; a lost answer is asked for again under the same take id (the
        service replays it), so groups taken for us are never lost in transit."""
        limit = self.max_frame_bytes * (len(keys) + 1)
        tid = next(self._tids)
        message = {"op": "take", "keys": keys, "consumer": self.consumer_id, "tid": tid}
        for _ in range(self.take_tries - 1):
            reply = self._data.wait(self._data.send(message), self.rpc_timeout_s, limit=limit)
            if reply is not None:
                break
        else:
            reply = self._data.call(message, self.rpc_timeout_s, limit=limit)
        if reply.get("status") == "closed":
            raise BufferClosed("get_batch on a closed SampleBuffer (service)")
        if reply.get("status") != "ok":
            return None  # another consumer took one of them first: look again
        return [decode_group(unpack(f, self.max_frame_bytes)) for f in reply["groups"]]

    def _drain_wakes(self) -> bool:
        try:
            return bool(os.read(self._wake_r, 4096))
        except BlockingIOError:
            return False

    def wake(self) -> None:
        """Re-evaluate a waiting ``get_batch`` rule now (its inputs changed outside the buffer)."""
        try:
            os.write(self._wake_w, b"x")
        except BlockingIOError:
            pass  # a wake is already pending

    def drain(self) -> list[Group]:
        reply = self._control({"op": "drain", "token": self._token}, limit=1 << 40)
        return [decode_group(unpack(f, self.max_frame_bytes)) for f in reply["groups"]]

    def close(self) -> None:
        """Close the service's buffer: every waiting producer and consumer gets BufferClosed."""
        self._control({"op": "close", "token": self._token})

    def disconnect(self) -> None:
        """Release this proxy's sockets (the service and its buffer go on)."""
        for rpc in (self._data, self._ctl):
            rpc.close()
        if self._producer is not None:
            self._producer.close()
        os.close(self._wake_r)
        os.close(self._wake_w)

    def __len__(self) -> int:
        return len(_parse_meta(self._control({"op": "meta", "since": -1, "wait_ms": 0}))["metas"])

    def stats(self) -> dict[str, float]:
        return {k: float(v) for k, v in self._control({"op": "stats"})["stats"].items()}

    def _control(self, message: dict, limit: int | None = None) -> dict:
        with self._ctl_lock:
            return self._ctl.call(message, self.rpc_timeout_s, limit=limit)


def _parse_meta(reply: dict) -> dict[str, Any]:
    """A meta reply → {epoch, closed, capacity, metas}; a malformed one is a WireError."""
    try:
        if any(not isinstance(row, list) or len(row) != 7 for row in reply["groups"]):
            raise TypeError("rows of 7 ints expected")
        metas = [GroupMeta(*row) for row in reply["groups"]]
        return {
            "epoch": int(reply["epoch"]),
            "closed": bool(reply["closed"]),
            "capacity": int(reply["capacity"]),
            "metas": metas,
        }
    except (KeyError, TypeError, ValueError) as exc:
        raise WireError("bad_schema", f"malformed meta reply: {exc}") from None
