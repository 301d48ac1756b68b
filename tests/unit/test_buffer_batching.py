"""Batched puts to the buffer service: several groups per message, each with its own (producer, seq).

- A batch with one malformed group: the others are stored, the bad one is answered and counted by
  its reason, and its seq counts as decided (no gap behind it); a retried batch stores nothing twice.
- A batch meeting a full buffer: the groups that fit are stored, the rest answered ``full``.
- A refusal only for the next expected seq (behind a gap: ``gap``), and a resend split at a refused
  seq's hole, so both sides agree on which seqs are decided.
- The producer: a batch fills and goes out without a flush; a lone put goes out when its linger
  ends; a group the service refuses is raised by name while its batch-mates are stored.
- Producers in separate processes (strict, and batched with lingers), a consumer here, a buffer
  smaller than the work: exactly once and in order; a producer blocked on a full buffer resumes
  when space frees.
- Exactly once through a lossy link (requests and answers dropped and delayed at random, the
  producer timing out and resending batches).
- The knobs are part of the typed config (a misspelled one is caught).
"""

from __future__ import annotations

import multiprocessing as mp
import random
import threading
import time

import msgpack
import pytest
import zmq

from flash.buffers.client import BufferProducer, BufferUnavailable, RemoteSampleBuffer
from flash.buffers.service import BufferService
from flash.buffers.wire import WireError, encode_group, unpack
from tests.helpers.wire import MB, _raw_socket, answers, hello, make_group, put_parts, same


def _spoiled(pid: int) -> bytes:
    """A group frame whose response ids claim a dtype outside the allow-list."""
    raw = unpack(encode_group(make_group(pid)), MB)
    raw[3][0][7][0] = "<u1"
    return msgpack.packb(raw)


def _wait_for(cond, timeout: float = 10.0) -> float:
    t0 = time.monotonic()
    while not cond():
        assert time.monotonic() - t0 < timeout, "timed out"
        time.sleep(0.005)
    return time.monotonic() - t0


# ------------------------------------------------------------------------------------------ service


def test_a_bad_group_in_a_batch_is_rejected_by_name_and_the_others_stored():
    with BufferService(capacity=16) as svc:
        ctx = zmq.Context()
        sock = _raw_socket(ctx, svc.address)
        p = hello(sock)
        header, good0, good2 = put_parts(p, 0, make_group(0), make_group(2))
        sock.send_multipart([header, good0, _spoiled(1), good2])
        got = answers(sock, 3)
        assert [a["status"] for a in got] == ["stored", "rejected", "stored"]
        assert [a["seq"] for a in got] == [0, 1, 2] and got[1]["reason"] == "bad_dtype"
        sock.send_multipart(put_parts(p, 3, make_group(3)))  # seq 1 is decided: no gap behind it
        assert answers(sock, 1)[0]["status"] == "stored"
        sock.send_multipart([header, good0, _spoiled(1), good2])  # the batch retried: nothing twice
        assert [a["status"] for a in answers(sock, 3)] == ["duplicate"] * 3
        stats = svc.stats()
        assert (stats["puts"], stats["rejected"], stats["rejected_bad_dtype"]) == (3.0, 1.0, 1.0)
        assert (stats["put_batches"], stats["duplicates"], stats["frames_in"]) == (3.0, 3.0, 4.0)  # + the hello
        assert [m.prompt_id for m in svc.buffer.meta()[2]] == [0, 2, 3]
        sock.close()
        ctx.term()


def test_a_bad_group_behind_a_gap_is_answered_gap_and_refused_only_in_its_turn():
    """A refusal decides a seq on both sides, so the service gives one only to the next expected
    seq: behind a gap even an oversized group is answered ``gap`` (the producer keeps it and
    resends), and refused in its turn."""
    with BufferService(capacity=16, max_frame_bytes=64 * 1024) as svc:
        ctx = zmq.Context()
        sock = _raw_socket(ctx, svc.address)
        p = hello(sock)
        header, good0, good2 = put_parts(p, 0, make_group(0), make_group(2))
        big = encode_group(make_group(1)) + b"\x00" * (64 * 1024)
        sock.send_multipart(put_parts(p, 1)[:1] + [big])  # seq 0 never arrived
        assert answers(sock, 1)[0]["status"] == "gap"
        sock.send_multipart([header, good0, big, good2])
        got = answers(sock, 3)
        assert [(a["status"], a["reason"]) for a in got] == [("stored", ""), ("rejected", "oversized"), ("stored", "")]
        stats = svc.stats()
        assert (stats["gap_replies"], stats["rejected_oversized"], stats["puts"]) == (1.0, 1.0, 2.0)
        sock.close()
        ctx.term()


def test_a_resend_splits_its_batches_at_a_refused_seq():
    """Go-back-N over a window with a hole (a refused group's seq leaves it): each message carries
    consecutive seqs only, since the service numbers a message's groups from its header's seq. One
    message over the hole would file group 6 as seq 5 (a duplicate) and never store it."""
    with BufferService(capacity=16) as svc:
        producer = BufferProducer(svc.address, window=16, batch_groups=3, linger_ms=60_000)
        for pid in range(7):
            producer.put(make_group(pid))
        _wait_for(lambda: len(svc.buffer) == 6)  # two full batches out, group 6 held, no ack read yet
        sent: list[list[int]] = []
        send = producer._send_batch
        producer._send_batch = lambda seqs: (sent.append(list(seqs)), send(seqs))
        with producer._lock:
            del producer._inflight[3]  # as if seq 3 had been refused: a hole in the window
            producer._resend_from(1)
        producer.flush()
        assert sent == [[1, 2], [4, 5, 6]]
        assert [g.prompt_id for g in svc.buffer.drain()] == list(range(7))  # each once, 6 included
        assert svc.stats()["duplicates"] == 4.0  # 1, 2, 4, 5 sent again
        producer.close()


def test_a_batch_meeting_a_full_buffer_stores_what_fits_and_the_rest_waits():
    with BufferService(capacity=3) as svc:
        ctx = zmq.Context()
        sock = _raw_socket(ctx, svc.address)
        p = hello(sock)
        sock.send_multipart(put_parts(p, 0, *map(make_group, range(5))))
        assert [a["status"] for a in answers(sock, 5)] == ["stored"] * 3 + ["full"] * 2
        sock.send_multipart(put_parts(p, 4, make_group(4)))  # seq 3 still missing: the order holds
        assert answers(sock, 1)[0]["status"] == "gap"
        svc.buffer.get_batch(2)
        sock.send_multipart(put_parts(p, 3, make_group(3), make_group(4)))  # go-back-N from the full one
        assert [a["status"] for a in answers(sock, 2)] == ["stored", "stored"]
        assert [m.prompt_id for m in svc.buffer.meta()[2]] == [2, 3, 4]
        assert svc.stats()["full_replies"] == 1.0  # counted once per batch, where it was refused
        sock.close()
        ctx.term()


# ------------------------------------------------------------------------------------------ producer


def test_a_full_batch_goes_out_at_once_and_a_lone_put_when_its_linger_ends():
    with BufferService(capacity=64) as svc:
        held = BufferProducer(svc.address, window=32, batch_groups=8, linger_ms=60_000)
        for pid in range(9):
            held.put(make_group(pid))
        _wait_for(lambda: len(svc.buffer) == 8)  # the full batch: one message, no flush
        time.sleep(0.2)
        assert len(svc.buffer) == 8 and svc.stats()["put_batches"] == 1.0  # the 9th lingers
        held.flush()
        assert len(svc.buffer) == 9 and held.stats()["batches"] == 2.0

        lone = BufferProducer(svc.address, window=32, batch_groups=8, linger_ms=300)
        t0 = time.monotonic()
        lone.put(make_group(100))
        _wait_for(lambda: len(svc.buffer) == 10)
        waited = time.monotonic() - t0
        assert 0.3 <= waited < 2.0, waited  # held for the linger, then sent by itself
        assert lone.stats()["batches"] == 1.0 and svc.stats()["put_batches"] == 3.0

        at_once = BufferProducer(svc.address, window=32, linger_ms=0)
        for pid in range(200, 203):
            at_once.put(make_group(pid))
        _wait_for(lambda: len(svc.buffer) == 13)
        assert at_once.stats()["batches"] == 3.0  # linger 0: a message per put
        for p in (held, lone, at_once):
            p.close()
        assert [g.prompt_id for g in svc.buffer.drain()] == [*range(9), 100, 200, 201, 202]


def test_a_group_the_service_refuses_is_raised_by_name_and_its_batch_mates_stored():
    with BufferService(capacity=16, max_frame_bytes=64 * 1024) as svc:
        producer = BufferProducer(svc.address, window=8, batch_groups=8, linger_ms=60_000)
        big = make_group(2, length=6000)  # int64 lists: ~140 KiB, over the service's limit, not ours
        for g in (make_group(1), big, make_group(3)):
            producer.put(g)
        with pytest.raises(WireError, match="oversized: the service refused group 2 .seq 1."):
            producer.flush()
        producer.put(make_group(4))
        producer.flush()
        assert [g.prompt_id for g in svc.buffer.drain()] == [1, 3, 4]
        stats = producer.stats()
        assert (stats["puts"], stats["rejected"], stats["unacknowledged"]) == (3.0, 1.0, 0.0)
        assert svc.stats()["rejected_oversized"] == 1.0
        producer.close()


# ------------------------------------------------------------------------------------------ processes


def _produce(address: str, pids: list[int], out, knobs: dict | None = None, pause_s: float = 0.0) -> None:
    """A producer process: put every group (array-typed, lengths vary) with random pauses of up to
    ``pause_s`` between puts (so batches go out both full and by their linger), report its counters."""
    producer = BufferProducer(address, wait_ms=200, **(knobs or {}))
    rng = random.Random(pids[0])
    for pid in pids:
        time.sleep(rng.uniform(0, pause_s))
        producer.put(make_group(pid, length=5 + pid % 50, version=pid % 3, arrays=True))
    producer.flush()
    out.put(producer.stats())
    producer.close()


def test_producer_processes_exactly_once_under_backpressure():
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    work = {p: [p * 1000 + i for i in range(25)] for p in range(3)}
    # window 1: each put acknowledged before the next; 3 and 8: go-back-N with puts in flight, sent
    # in batches of up to 2 and 4 groups (a batch of 4 meets a buffer of 4: stored in part, then full)
    knobs = (
        {"window": 1},
        {"window": 3, "batch_groups": 2, "linger_ms": 1},
        {"window": 8, "batch_groups": 4, "linger_ms": 5},
    )
    with BufferService(capacity=4) as svc:
        procs = [
            ctx.Process(target=_produce, args=(svc.address, pids, out, k, 0.004))
            for pids, k in zip(work.values(), knobs)
        ]
        for p in procs:
            p.start()
        consumer = RemoteSampleBuffer(svc.address)
        deadline = time.monotonic() + 60  # spawn start under load
        while svc.stats()["full_replies"] == 0 and time.monotonic() < deadline:
            time.sleep(0.05)
        assert len(consumer) == 4  # full, producers told to wait
        rng, got = random.Random(1), []
        while len(got) < 75:
            time.sleep(rng.uniform(0, 0.02))
            k = min(rng.randint(1, 4), 75 - len(got))
            fifo = lambda gs, k=k: list(range(k)) if len(gs) >= k else None  # arrival order
            got += consumer.get_batch(k, select=fifo, timeout=30)
        for p in procs:
            p.join(30)
            assert p.exitcode == 0
        stats = [out.get(timeout=5) for _ in procs]
    ids = [g.prompt_id for g in got]
    assert sorted(ids) == sorted(pid for pids in work.values() for pid in pids)  # each exactly once
    assert all(
        same(g, make_group(g.prompt_id, length=5 + g.prompt_id % 50, version=g.prompt_id % 3, arrays=True)) for g in got
    )
    for pids in work.values():  # with a FIFO rule, one producer's groups keep their order
        mine = [i for i in ids if i in set(pids)]
        assert mine == pids
    assert sum(s["puts"] for s in stats) == 75 and sum(s["full"] for s in stats) > 0
    assert all(s["unacknowledged"] == 0 and s["full"] > 0 for s in stats)  # every one was held back
    assert sum(s["blocked_s"] for s in stats) > 0
    consumer.disconnect()


def test_a_blocked_producer_resumes_when_space_frees():
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    with BufferService(capacity=4) as svc:
        proc = ctx.Process(target=_produce, args=(svc.address, list(range(5)), out))
        proc.start()
        consumer = RemoteSampleBuffer(svc.address)
        deadline = time.monotonic() + 60  # spawn start under load
        while svc.stats()["full_replies"] == 0 and time.monotonic() < deadline:
            time.sleep(0.05)
        time.sleep(0.5)
        assert proc.is_alive() and len(consumer) == 4  # blocked: the 5th group is not in
        assert svc.stats()["waiters"] == 1.0  # parked on wait_space, not spinning
        t0 = time.monotonic()
        assert [g.prompt_id for g in consumer.get_batch(1)] == [0]
        proc.join(10)
        resumed_s = time.monotonic() - t0
        assert proc.exitcode == 0 and resumed_s < 2.0
        assert sorted(g.prompt_id for g in consumer.drain()) == [1, 2, 3, 4]
        assert out.get(timeout=5)["blocked_s"] >= 0.5
        assert svc.stats()["producer_blocked_s"] >= 0.5
        consumer.disconnect()


# ------------------------------------------------------------------------------------------ lossy link


class LossyLink:
    """A ROUTER/DEALER relay that drops and delays messages at random, both ways (seeded)."""

    def __init__(self, target: str, drop: float, seed: int):
        self.target, self.drop, self.rng = target, drop, random.Random(seed)
        self.dropped = 0
        self._stop, self._ready = threading.Event(), threading.Event()
        self._thread = threading.Thread(target=self._relay, daemon=True)
        self._thread.start()
        self._ready.wait(5)

    def _relay(self) -> None:
        ctx = zmq.Context()
        front, back = ctx.socket(zmq.ROUTER), ctx.socket(zmq.DEALER)
        front.bind("tcp://127.0.0.1:0")
        back.connect(self.target)
        self.address = front.getsockopt(zmq.LAST_ENDPOINT).decode()
        self._ready.set()
        poller, ident = zmq.Poller(), b""
        poller.register(front, zmq.POLLIN)
        poller.register(back, zmq.POLLIN)
        while not self._stop.is_set():
            for sock, _ in poller.poll(20):
                parts = sock.recv_multipart()
                if sock is front:
                    ident, parts = parts[0], parts[1:]
                if self.rng.random() < self.drop:
                    self.dropped += 1
                    continue
                if self.rng.random() < 0.2:
                    time.sleep(self.rng.uniform(0, 0.01))
                (back if sock is front else front).send_multipart(parts if sock is front else [ident, *parts])
        for s in (front, back):
            s.close(0)
        ctx.term()

    def close(self) -> None:
        self._stop.set()
        self._thread.join(5)


def _flush_until_done(producer: BufferProducer) -> int:
    """Flush, resending after each timeout (a dropped answer), until all is acknowledged."""
    for tries in range(100):
        try:
            producer.flush()
            return tries
        except BufferUnavailable:
            pass
    raise AssertionError("never acknowledged")


def test_exactly_once_in_order_through_a_lossy_link_with_batches():
    groups = [make_group(pid, length=3 + pid % 7) for pid in range(60)]
    with BufferService(capacity=6) as svc:
        link = LossyLink(svc.address, drop=0.15, seed=3)
        producer = BufferProducer(link.address, rpc_timeout_s=0.15, wait_ms=50, window=8, batch_groups=4, linger_ms=2)
        got: list = []
        rng = random.Random(4)

        def consume() -> None:  # beside the service, slower than the producer: the buffer fills
            while len(got) < len(groups):
                time.sleep(rng.uniform(0, 0.01))
                got.extend(svc.buffer.get_batch(1, timeout=30))

        th = threading.Thread(target=consume)
        th.start()
        timeouts = 0
        for g in groups:
            try:
                producer.put(g)  # after a timeout the group is held: never put it twice
            except BufferUnavailable:
                timeouts += 1 + _flush_until_done(producer)
        timeouts += _flush_until_done(producer)
        th.join(30)
        link.close()
        stats, service = producer.stats(), svc.stats()
    assert [g.prompt_id for g in got] == list(range(60))  # each exactly once, in put order
    assert all(same(g, groups[g.prompt_id]) for g in got)
    assert link.dropped > 0 and timeouts > 0  # the link did lose messages and the producer resent
    assert service["puts"] == 60 and stats["puts"] == 60 and stats["unacknowledged"] == 0
    assert stats["batches"] < 60 + 8 * timeouts  # batched: fewer messages than groups, resends aside
    assert service["full_replies"] > 0  # and the producer was held back by a full buffer meanwhile
    producer.close()


# ------------------------------------------------------------------------------------------ config


def test_batching_knobs_are_typed_config_and_misspellings_are_caught():
    from flash.app.config import ConfigError, load_config

    cfg = load_config("recipes/stutter.yaml", ["buffer.linger_ms=0.5", "buffer.batch_groups=4", "buffer.window=8"])
    assert (cfg.buffer.linger_ms, cfg.buffer.batch_groups, cfg.buffer.window) == (0.5, 4, 8)
    with pytest.raises(ConfigError, match="did you mean 'linger_ms'"):
        load_config("recipes/stutter.yaml", ["buffer.lingr_ms=2"])
    with pytest.raises(ConfigError, match="buffer.batch_groups must be >= 1"):
        load_config("recipes/stutter.yaml", ["buffer.batch_groups=0"])
