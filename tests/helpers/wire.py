"""Raw frames and groups for the buffer service's wire protocol."""

from __future__ import annotations

import numpy as np
import zmq

from flash.buffers import Group, Sample
from flash.buffers.wire import encode_group, pack, unpack

MB = 1 << 20


def make_group(pid: int, n: int = 2, length: int = 5, version: int = 0, arrays: bool = False) -> Group:
    """A deterministic group: its contents follow from its arguments (so a consumer can check them)."""
    rng = np.random.default_rng(pid)
    samples = []
    for k in range(n):
        ids = rng.integers(0, 50_000, length)
        lp = -rng.random(length).astype(np.float32)
        vs = np.full(length, version) + (np.arange(length) >= length // 2)
        if arrays:
            ids, vs = ids.astype(np.int32), vs.astype(np.int32)
        else:
            ids, lp, vs = ids.tolist(), lp.tolist(), vs.tolist()
        samples.append(
            Sample(
                prompt_id=pid,
                sample_index=k,
                prompt_ids=[7, pid % 1000],
                response_ids=ids,
                behav_logprobs=lp,
                versions=vs,
                reward=float(k),
                finish_reason="stop",
                admitted_version=version,
                meta={"data_index": pid, "tags": ["a", 1, None]},
            )
        )
    return Group(prompt_id=pid, samples=samples, admitted_version=version, data_index=pid)


def same(a: Group, b: Group) -> bool:
    """Exact equality, arrays included (dtype too)."""
    if (a.prompt_id, a.admitted_version, a.data_index, len(a.samples)) != (
        b.prompt_id,
        b.admitted_version,
        b.data_index,
        len(b.samples),
    ):
        return False
    for x, y in zip(a.samples, b.samples):
        for name in ("prompt_ids", "response_ids", "behav_logprobs", "versions"):
            u, v = getattr(x, name), getattr(y, name)
            if type(u) is not type(v):
                return False
            if isinstance(u, np.ndarray) and (u.dtype != v.dtype or not np.array_equal(u, v)):
                return False
            if isinstance(u, list) and u != v:
                return False
        if _mask(x.loss_mask) != _mask(y.loss_mask):
            return False
        if (x.prompt_id, x.sample_index, x.reward, x.finish_reason, x.admitted_version, x.meta) != (
            y.prompt_id,
            y.sample_index,
            y.reward,
            y.finish_reason,
            y.admitted_version,
            y.meta,
        ):
            return False
    return True


def hello(sock: zmq.Socket) -> str:
    """A producer id issued by the service (as ``BufferProducer`` gets its own)."""
    sock.send(pack({"op": "hello", "rid": -7}))
    reply = unpack(sock.recv(), MB)
    assert reply["status"] == "ok" and reply["rid"] == -7, reply
    return reply["producer"]


def put_parts(producer: str, seq: int, *groups: Group, rid: int = 0) -> list[bytes]:
    """A put as a producer sends it: a header frame (naming the first seq) and one frame per group."""
    return [pack({"op": "put", "rid": rid, "producer": producer, "seq": seq}), *map(encode_group, groups)]


def answers(sock: zmq.Socket, n: int) -> list[dict]:
    """The next ``n`` answers, in order, one per group of a put (``rejected_<reason>`` read as
    ``rejected``, with its ``reason``); a burst's put answers come as one ``acks`` message."""
    out: list[dict] = []
    while len(out) < n:
        reply = unpack(sock.recv(), MB)
        if reply["status"] == "acks":
            out += [
                {"rid": rid, "seq": seq + i, "status": status.split("_")[0], "reason": status[9:]}
                for rid, seq, statuses in reply["acks"]
                for i, status in enumerate(statuses)
            ]
        else:
            out.append(reply)
    assert len(out) == n
    return out


RAW_TIMEOUT_MS = 90_000  # above the service's longest long-poll (flash.buffers.longpoll.MAX_WAIT_MS)


def _raw_socket(ctx: zmq.Context, address: str, keys=None) -> zmq.Socket:
    """A bare DEALER (``keys``: ``flash.buffers.auth.ClientKeys`` to be a CURVE client).

    Sends and receives give up after ``RAW_TIMEOUT_MS`` (zmq.Again): a DEALER whose peer dropped it
    (a refused handshake, an oversized frame) has no pipe left and would block a send forever."""
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.SNDTIMEO, RAW_TIMEOUT_MS)
    sock.setsockopt(zmq.RCVTIMEO, RAW_TIMEOUT_MS)
    if keys is not None:
        keys.apply(sock)
    sock.connect(address)
    return sock


def _mask(m) -> tuple | None:
    """A loss mask as (was a list, its values): the wire carries it as uint8 whatever integer dtype it had."""
    return None if m is None else (type(m) is list, np.asarray(m).tolist())
