"""SampleBuffer: bounded with backpressure, select rules, oldest-first default, close releases waiters."""

import threading
import time

import pytest

from flash.buffers import BufferClosed, Group, Sample, SampleBuffer


def group(pid: int, version: int) -> Group:
    s = Sample(
        prompt_id=pid,
        sample_index=0,
        prompt_ids=[1],
        response_ids=[2, 3],
        behav_logprobs=[-0.1, -0.2],
        versions=[version, version + 1],
    )
    return Group(prompt_id=pid, samples=[s], admitted_version=version)


def test_sample_version_is_oldest_token():
    s = Sample(prompt_id=0, sample_index=0, prompt_ids=[1], versions=[3, 3, 4], admitted_version=2)
    assert s.version == 3
    assert Sample(prompt_id=0, sample_index=0, prompt_ids=[1], admitted_version=2).version == 2


def test_default_batch_is_oldest_versions_first():
    buf = SampleBuffer(capacity=8)
    for pid, v in [(0, 2), (1, 0), (2, 1), (3, 0)]:
        buf.put(group(pid, v))
    batch = buf.get_batch(2)
    assert sorted(g.prompt_id for g in batch) == [1, 3]
    assert len(buf) == 2
    assert buf.stats()["groups_out"] == 2.0


def test_put_blocks_when_full_until_a_batch_is_taken():
    buf = SampleBuffer(capacity=2)
    buf.put(group(0, 0))
    buf.put(group(1, 0))
    with pytest.raises(TimeoutError):
        buf.put(group(2, 0), timeout=0.05)
    done = threading.Event()

    def producer():
        buf.put(group(2, 0))
        done.set()

    threading.Thread(target=producer, daemon=True).start()
    time.sleep(0.1)
    assert not done.is_set()  # backpressure: the producer waits
    buf.get_batch(1)
    assert done.wait(2.0)
    assert len(buf) == 2


def test_select_rule_reevaluated_on_wake():
    buf = SampleBuffer(capacity=4)
    buf.put(group(0, 0))
    allow = threading.Event()
    out = []

    def consumer():
        out.extend(buf.get_batch(1, select=lambda gs: [0] if allow.is_set() and gs else None))

    th = threading.Thread(target=consumer, daemon=True)
    th.start()
    time.sleep(0.05)
    assert not out
    allow.set()
    buf.wake()
    th.join(2.0)
    assert [g.prompt_id for g in out] == [0]


def test_close_releases_waiters():
    buf = SampleBuffer(capacity=1)
    err = []

    def consumer():
        try:
            buf.get_batch(1)
        except BufferClosed as exc:
            err.append(exc)

    th = threading.Thread(target=consumer, daemon=True)
    th.start()
    time.sleep(0.05)
    buf.close()
    th.join(2.0)
    assert len(err) == 1
    with pytest.raises(BufferClosed):
        buf.put(group(0, 0))
