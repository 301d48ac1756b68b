"""A flood of idle connections does not exhaust the buffer service's descriptors.

The service runs in its own process under an open-files limit of 256 (soft and hard, so nothing
can raise it), the way a process left at a small default limit meets ~1,000 idle connections:
zmq clients that finish their handshake (libzmq's handshake timer never closes them) and never
send, and stay away once closed (a flood that reconnects at R a second leaves a newcomer cap / R
seconds to say hello: ``flash.buffers.connections``). The flood's connections past the service's cap are
closed and counted, and a producer that connects after the flood is served within its first
request's timeout. (While the flood arrives faster than the service closes its excess, libzmq may
find no descriptor for a moment: ``accept_failed`` counts those, and the connection waits in the
listen backlog until one is freed.)
"""

from __future__ import annotations

import os
import resource
import subprocess
import sys
import time
from pathlib import Path

import zmq

from flash.buffers.client import RemoteSampleBuffer
from flash.buffers.producer import BufferProducer
from tests.helpers.wire import make_group

ROOT = Path(__file__).resolve().parents[2]
SERVICE = """
import resource, sys
resource.setrlimit(resource.RLIMIT_NOFILE, (256, 256))
from flash.buffers.service import BufferService
svc = BufferService(capacity=64).start()
print(svc.address, flush=True)
sys.stdin.read()
svc.stop()
"""
FLOOD = 400


def test_a_flood_of_idle_connections_leaves_a_producer_served():
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft < 3 * FLOOD + 256:  # this process holds the flood's client ends (a zmq socket: 2 descriptors)
        resource.setrlimit(resource.RLIMIT_NOFILE, (min(hard, 3 * FLOOD + 512), hard))
    env = {**os.environ, "PYTHONPATH": f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    proc = subprocess.Popen(
        [sys.executable, "-c", SERVICE],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
        cwd=ROOT,
    )
    ctx = zmq.Context()
    ctx.set(zmq.MAX_SOCKETS, 2 * FLOOD)
    flood: list[zmq.Socket] = []
    try:
        address = proc.stdout.readline().strip()
        for _ in range(FLOOD):
            flood.append(ctx.socket(zmq.DEALER))
            flood[-1].setsockopt(zmq.LINGER, 0)
            flood[-1].setsockopt(zmq.RECONNECT_IVL, -1)
            flood[-1].connect(address)
        time.sleep(1.0)
        producer = BufferProducer(address, rpc_timeout_s=5.0)  # a producer arriving after the flood
        for pid in range(3):
            producer.put(make_group(pid))
        producer.flush()
        producer.close()
        remote = RemoteSampleBuffer(address, rpc_timeout_s=5.0)
        stats = remote.stats()
        deadline = time.monotonic() + 20  # until the whole flood is accepted (slower on a loaded machine)
        while stats["connections"] + stats["connections_closed_cap"] < FLOOD and time.monotonic() < deadline:
            time.sleep(0.2)
            stats = remote.stats()
        remote.disconnect()
        assert stats["puts"] == 3
        cap = stats["connections"]  # the flood holds the cap: half the descriptors left at start
        assert 8 <= cap < 128 and stats["connections_closed_cap"] >= FLOOD - cap
    finally:
        for sock in flood:
            sock.close(0)
        ctx.term()
        proc.stdin.close()
        proc.wait(10)
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
    assert "raise the open-files limit, ulimit -n" in proc.stderr.read()
