"""The SampleBuffer service over zmq + msgpack.

- Fuzz: random bytes, truncated and oversized frames and wrong types, interleaved with valid puts
  (some sent twice): every valid group comes out exactly once, each rejection is counted under its
  reason, and the service still answers. (Producers in other processes: test_buffer_batching.py.)
- The controller's staleness-aware ``select`` runs through the proxy, and ``wake`` re-runs it.
(The codec on its own: test_buffer_codec.py.)
"""

from __future__ import annotations

import random
import threading
import time

import pytest
import zmq

from flash.buffers import BufferClosed
from flash.buffers.client import BufferProducer, BufferUnavailable, RemoteSampleBuffer
from flash.buffers.rpc import BufferServiceError
from flash.buffers.service import BufferService
from flash.buffers.wire import REASONS, decode_group, pack, unpack
from tests.helpers.wire import MB, _raw_socket, answers, hello, make_group, put_parts, same


@pytest.fixture
def service():
    # the fuzz test takes a producer id per bad group, all from one client
    svc = BufferService(capacity=64, max_frame_bytes=64 * 1024, producers_per_client=1024).start()
    yield svc
    svc.stop()


def _fuzz_frames(rng: random.Random, sock, valid: dict) -> tuple[list[list[bytes]], dict[str, int]]:
    """Each valid group's put (some sent twice), each followed by three bad frames of random kinds;
    and how many of each kind were sent."""
    sent = {r: 0 for r in REASONS} | {"random": 0, "duplicate": 0}
    frames: list[list[bytes]] = []
    # a bad group decides its seq: a fresh producer each (issued by the service), so each is decoded
    bad = iter([hello(sock) for _ in range(3 * len(valid))])
    fuzz = hello(sock)
    for seq, (_pid, g) in enumerate(valid.items()):
        header, good = put_parts(fuzz, seq, g, rid=seq)
        frames.append([header, good])
        if rng.random() < 0.3:  # a retried put: same producer and seq
            frames.append([header, good])
            sent["duplicate"] += 1
        for _ in range(3):
            kind = rng.choice(["random", "truncated", "oversized", "multipart", "bad_type", "unknown_op"])
            sent[kind] += 1
            if kind == "random":
                frames.append([rng.randbytes(rng.randint(0, 300))])
            elif kind == "truncated":  # the group cut short, or the header
                cut = rng.choice([good, header])
                part = cut[: rng.randint(1, len(cut) - 1)]
                frames.append(
                    [pack({"op": "put", "rid": 0, "producer": next(bad), "seq": 0}), part] if cut is good else [part]
                )
            elif kind == "oversized":
                frames.append(
                    [pack({"op": "put", "rid": 0, "producer": next(bad), "seq": 0}), good + b"\x00" * (64 * 1024)]
                )  # its producer's next seq: refused unparsed
            elif kind == "multipart":
                frames.append(
                    rng.choice(
                        [
                            [header],
                            [pack({"op": "stats", "rid": 0}), good],
                            [pack({"op": "meta", "rid": 0, "since": 0, "wait_ms": 0}), good, good],
                        ]
                    )
                )
            elif kind == "bad_type":
                frames.append([pack({"op": "put", "rid": 0, "producer": "fuzz", "seq": "7"}), good])
            else:
                frames.append([pack({"op": "exec", "rid": 0})])
    return frames, sent


def test_fuzz_every_valid_group_exactly_once_rejections_counted(service):
    rng = random.Random(0)
    ctx = zmq.Context()
    sock = _raw_socket(ctx, service.address)
    valid = {pid: make_group(pid, length=rng.randint(1, 40), arrays=pid % 2 == 0) for pid in range(40)}
    frames, sent = _fuzz_frames(rng, sock, valid)
    for parts in frames:
        sock.send_multipart(parts)
    replies = answers(sock, len(frames))  # one answer per frame
    statuses = [r["status"] for r in replies]
    assert statuses.count("stored") == len(valid) and statuses.count("duplicate") == sent["duplicate"]
    assert statuses.count("rejected") == len(frames) - len(valid) - sent["duplicate"]
    stats = service.stats()
    for reason in ("truncated", "oversized", "multipart", "unknown_op"):
        assert stats[f"rejected_{reason}"] >= sent[reason]
    assert stats["rejected_oversized"] == sent["oversized"] and stats["rejected_multipart"] == sent["multipart"]
    assert stats["rejected"] == statuses.count("rejected")
    assert sum(stats[f"rejected_{r}"] for r in REASONS) == stats["rejected"]
    assert stats["puts"] == len(valid) and stats["duplicates"] == sent["duplicate"]
    consumer = RemoteSampleBuffer(service.address)  # alive: a fresh client is served
    got = consumer.get_batch(len(valid), timeout=10)
    assert sorted(g.prompt_id for g in got) == sorted(valid)
    assert all(same(g, valid[g.prompt_id]) for g in got)
    assert len(consumer) == 0 and service.stats()["gets"] == len(valid)
    consumer.disconnect()
    sock.close()
    ctx.term()


def test_a_retried_put_is_stored_once_even_across_an_outage():
    with BufferService(capacity=8) as svc:
        producer = BufferProducer(svc.address, rpc_timeout_s=0.3)
        g = make_group(1)
        serve = svc._op_put
        svc._op_put = lambda *a: (time.sleep(0.8), setattr(svc, "_op_put", serve), serve(*a))[2]  # one stall
        with pytest.raises(BufferUnavailable):
            producer.put(g)  # unanswered in time: it may or may not have been stored
        time.sleep(1.0)  # the stall ends: the first copy is stored
        producer.put(g)  # the same object again: same put id
        producer.put(make_group(2))
        consumer = RemoteSampleBuffer(svc.address)
        got = consumer.get_batch(2, timeout=5)
        assert sorted(x.prompt_id for x in got) == [1, 2] and len(consumer) == 0
        assert svc.stats()["duplicates"] == 1.0 and svc.stats()["puts"] == 2.0  # the stalled copy was stored
        assert producer.stats()["retries"] == 1.0
        consumer.disconnect()
    producer.close()


def test_puts_stored_in_seq_order_and_takes_replayed(service):
    ctx = zmq.Context()
    sock = _raw_socket(ctx, service.address)
    p, q = hello(sock), hello(sock)
    for seq in (0, 2, 1, 2, 1):
        sock.send_multipart(put_parts(p, seq, make_group(seq)))
    assert [a["status"] for a in answers(sock, 5)] == ["stored", "gap", "stored", "stored", "duplicate"]
    sock.send_multipart(put_parts(q, 1, make_group(9)))  # another producer's seqs are its own
    assert answers(sock, 1)[0]["status"] == "gap"
    metas = service.buffer.meta()[2]
    assert [m.prompt_id for m in metas] == [0, 1, 2]
    stats = service.stats()
    assert (stats["puts"], stats["gap_replies"], stats["duplicates"]) == (3.0, 2.0, 1.0)
    # a take retried under the same id (its answer lost) gets the same groups, not nothing
    take = {"op": "take", "rid": 0, "keys": [metas[1].key], "consumer": "c", "tid": 7}
    for _ in range(2):
        sock.send(pack(take))
        reply = unpack(sock.recv(), MB)
        assert [decode_group(unpack(f, MB)).prompt_id for f in reply["groups"]] == [1]
    sock.send(pack({**take, "tid": 8}))  # a new take of the same key: it is gone now
    assert unpack(sock.recv(), MB)["status"] == "missing"
    assert service.stats()["take_replays"] == 1.0 and service.stats()["gets"] == 1.0
    sock.close()
    ctx.term()


def test_a_failing_request_is_answered_counted_and_the_service_goes_on(service, monkeypatch):
    producer, consumer = BufferProducer(service.address), RemoteSampleBuffer(service.address)
    producer.put(make_group(1))
    real_take = service.buffer.take
    monkeypatch.setattr(service.buffer, "take", lambda keys, **kw: 1 / 0)
    with pytest.raises(BufferServiceError, match="ZeroDivisionError"):
        consumer.get_batch(1, timeout=5)
    monkeypatch.setattr(service.buffer, "take", real_take)
    assert [g.prompt_id for g in consumer.get_batch(1, timeout=5)] == [1]
    assert service.stats()["internal_errors"] == 1.0
    consumer.disconnect()
    producer.close()


def test_timeout_and_close_reach_remote_waiters():
    with BufferService(capacity=1) as svc:
        consumer, producer = RemoteSampleBuffer(svc.address), BufferProducer(svc.address)
        t0 = time.monotonic()
        with pytest.raises(TimeoutError):
            consumer.get_batch(1, timeout=0.2)
        assert 0.2 <= time.monotonic() - t0 < 1.5
        producer.put(make_group(1))
        with pytest.raises(TimeoutError):
            producer.put(make_group(2), timeout=0.2)  # full: not stored
        assert len(consumer) == 1
        errors = []

        def wait():
            try:
                consumer.get_batch(2)
            except BufferClosed as exc:
                errors.append(exc)

        th = threading.Thread(target=wait)
        th.start()
        time.sleep(0.1)
        RemoteSampleBuffer(svc.address).close()
        th.join(3)
        assert len(errors) == 1
        with pytest.raises(BufferClosed):
            producer.put(make_group(3))
        assert [g.prompt_id for g in consumer.drain()] == [1]  # what was in it is not lost
        consumer.disconnect()
        producer.close()


# ------------------------------------------------------------------------------------------ controller


def test_a_pick_made_while_a_put_of_ours_landed_is_made_again():
    """The scheduler drops a group from pending once ``put`` returns; a select that ran on a view
    from before that put would see the group nowhere. The proxy re-runs select instead."""
    with BufferService(capacity=8) as svc:
        buf = RemoteSampleBuffer(svc.address)
        buf.put(make_group(1))
        seen: list[list[int]] = []

        def select(metas):
            seen.append([m.prompt_id for m in metas])
            if len(seen) == 1:
                buf.put(make_group(2))  # lands after the view was taken, before the pick is used
            return list(range(len(metas)))

        assert [g.prompt_id for g in buf.get_batch(2, select=select, timeout=5)] == [1, 2]
        assert seen == [[1], [1, 2]]
        buf.disconnect()


class _Scheduler:
    """The two things the controller's select reads from the scheduler."""

    def __init__(self, pending: list[int]):
        self.pending = pending

    def check(self) -> None:
        pass

    def pending_versions(self) -> list[int]:
        return list(self.pending)


def test_controller_select_runs_through_the_proxy_and_wake_reruns_it():
    # imported here: the other tests of this module need neither torch nor Ray
    from flash.controllers.async_controller import AsyncController, ControllerSettings
    from flash.controllers.staleness import StalenessManager

    with BufferService(capacity=16) as svc:
        buf = RemoteSampleBuffer(svc.address, poll_ms=10_000)  # only a put or a wake can end a wait
        scheduler = _Scheduler(pending=[])
        ctl = AsyncController(
            None,
            None,
            scheduler,
            buf,
            StalenessManager(1.0, 2),
            ControllerSettings(prompts_per_step=2, interrupt="continue", advantage={"name": "grpo"}, prox="behav"),
        )
        for pid, v in [(10, 1), (11, 0), (12, 1)]:
            buf.put(make_group(pid, version=v))
        # step 1 at r = 1, B = 2: the oldest two, versions 0 and 1 (the tie goes to arrival order)
        assert sorted(g.prompt_id for g in ctl._get_batch(1)) == [10, 11]
        buf.put(make_group(13, version=2))  # buffer: 12 (v1), 13 (v2)
        scheduler.pending = [0]  # a v0 group still out is due by step 2: 12 + 13 would break the bound
        got = []
        th = threading.Thread(target=lambda: got.extend(ctl._get_batch(2)))
        th.start()
        time.sleep(0.3)
        assert not got
        scheduler.pending = []  # (it was filtered, say): nothing else is due
        t0 = time.monotonic()
        buf.wake()
        th.join(5)
        # within 0.5 s: the wake re-ran select (the controller's own 1 s retry would come later)
        assert sorted(g.prompt_id for g in got) == [12, 13] and time.monotonic() - t0 < 0.5
        buf.disconnect()


# ------------------------------------------------------------------------------------------ end to end


@pytest.mark.slow
def test_a_run_through_the_zmq_buffer_loses_nothing(tmp_path):
    """``buffer.transport=zmq``: the scheduler's puts and the controller's batches cross the wire,
    and the ledger still shows every admitted prompt ending exactly once within the bound."""
    import json
    import math

    import ray

    from flash.app.config import load_config
    from flash.app.runner import run
    from tests.helpers.inproc import SMALL

    steps, ratio = 4, 1
    cfg = load_config(
        "recipes/stutter.yaml",
        [
            *SMALL,
            f"cache_dir={tmp_path / 'cache'}",
            f"run_dir={tmp_path}",
            f"async_ratio={ratio}",
            f"train.steps={steps}",
            "rollout.inject_delay_s=0.05",
            "buffer.transport=zmq",
        ],
    )
    try:
        summary = run(cfg, "zmq")
    finally:
        ray.shutdown()
    assert summary["steps"] == steps and summary["max_staleness_observed"] <= ratio
    lines = [json.loads(x) for x in (tmp_path / "ledger.jsonl").read_text().splitlines()]
    trained = {x["prompt_id"] for x in lines if x["outcome"] == "trained"}
    left = [x["prompt_id"] for x in lines if x["outcome"] != "trained"]
    assert len(trained) == steps * cfg.train.prompts_per_step
    assert sorted([*trained, *left]) == list(range(summary["prompts_admitted"]))
    assert summary["prompts_admitted"] == math.floor((steps + ratio) * cfg.train.prompts_per_step)


def test_a_send_with_nowhere_to_queue_raises_unavailable_instead_of_blocking(monkeypatch):
    """Nothing listens at the address: the socket's pipe holds its high-water mark of messages, then
    a send has nowhere to go; it gives up after SEND_TIMEOUT_MS as BufferUnavailable (which callers
    retry), where a plain DEALER would block for ever."""
    import socket

    import flash.buffers.rpc as rpc_module

    monkeypatch.setattr(rpc_module, "SEND_TIMEOUT_MS", 300)
    with socket.socket() as s:  # a port nobody listens on
        s.bind(("127.0.0.1", 0))
        address = f"tcp://127.0.0.1:{s.getsockname()[1]}"
    rpc = rpc_module.Rpc(address, MB)
    hwm = rpc.sock.getsockopt(zmq.SNDHWM)
    for _ in range(hwm):  # queued on the connecting pipe
        rpc.send({"op": "stats"})
    started = time.monotonic()
    with pytest.raises(BufferUnavailable, match="takes no messages from this client"):
        rpc.send({"op": "stats"}, payloads=[b"x" * 10])
    assert 0.25 < time.monotonic() - started < 5
    rpc.close()


def test_a_multi_turn_sample_keeps_its_loss_mask_through_the_service_into_the_batch():
    """Through a producer, the service and the remote consumer, the trainer's batch still leaves an
    episode's observation tokens untrained."""
    from flash.train.batch import collate

    g = make_group(11, n=1, length=6, arrays=True)
    g.samples[0].loss_mask = [1, 1, 0, 0, 0, 1]
    with BufferService(capacity=8) as svc:
        buf = RemoteSampleBuffer(svc.address)
        buf.put(g)
        [got] = buf.get_batch(1, timeout=5)
        buf.disconnect()
    batch = collate(got.samples)
    assert batch.mask[0].tolist() == [0, 1, 1, 0, 0, 0, 1]  # target columns: the prompt's last, then the mask
