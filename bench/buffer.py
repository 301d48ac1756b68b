"""Buffer service throughput: 4 producer processes, 1 consumer, trajectories of 1k and 8k tokens.

    python -m bench.buffer [--repeats 3] [--lengths 1024,8192] [--capacity 64] [--batch 32]

A trajectory is one Group of one Sample: 16 prompt tokens and ``L`` response tokens with int32
token ids, float32 behaviour logprobs and int32 versions (``12 L + 64`` payload bytes; GB/s counts
those bytes). Every system moves the same trajectories from 4 producer processes to one consumer
through a bound of ``capacity`` items, and the consumer checks it got each prompt id exactly once:

- ``service_local``: ``BufferProducer.put`` (encode, acknowledged, backpressure) into a
  ``BufferService`` thread in the consumer's process; the consumer calls ``service.buffer.get_batch``
  (the controller beside the service: no second hop).
- ``service_local_plain``: the same without CURVE (``buffer.auth=none``, plaintext on loopback):
  what authentication and encryption cost (``curve_cost``: plain over CURVE samples/s).
- ``service_local_unchecked``: plaintext and the service's value checks (``flash.buffers.guard``) off --
  patched out in this process for that run, no setting can do it: what authentication and
  validation together cost (``auth_validation_cost``: unchecked over ``service_local``).
- ``service_remote``: the same producers; the consumer is a ``RemoteSampleBuffer`` over TCP
  (metadata long-poll, local ``select``, take, decode: a second hop).
- ``ray_queue``: ``ray.util.queue.Queue(maxsize=capacity)`` carrying the same Group objects, put by 4
  Ray actors one by one (fewer of them per run: ``--ray-mb``, it is slow); the consumer takes
  ``get_nowait_batch(batch)`` when that many are there.
- ``zmq_bare``: PUSH/PULL of the service's own frame bytes, encoded once, no acks, no decode: the
  limit of the transport.
- ``zmq_bare_curve``: the same with CURVE on both sockets (keys made per run, as the service's):
  the limit of an encrypted transport, to hold ``service_local`` against.

Producer processes start once and wait for a "go" per run, so start-up is not timed. On a shared
machine wall-clock rates swing with the load, so the report adds CPU microseconds per sample
(producers' send loops + the consumer's process, service thread included) for the zmq systems. Each repeat
runs every system back to back (the order rotates); the report is the median samples/s and GB/s
and the median per-repeat ratios. The last line is JSON.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import statistics
import time

import numpy as np
import zmq

from flash.buffers.factory import BufferConfig
from flash.buffers.types import Group, Sample

SYSTEMS = (
    "service_local",
    "service_local_plain",
    "service_local_unchecked",
    "service_remote",
    "ray_queue",
    "zmq_bare",
    "zmq_bare_curve",
)
PRODUCERS = 4
PROMPT = 16


def trajectory(pid: int, length: int, arrays: dict) -> Group:
    """A Group of one sample sharing the template's arrays (building it costs nothing)."""
    s = Sample(
        prompt_id=pid,
        sample_index=0,
        prompt_ids=arrays["prompt"],
        response_ids=arrays["ids"],
        behav_logprobs=arrays["lp"],
        versions=arrays["vs"],
        reward=1.0,
        finish_reason="length",
    )
    return Group(prompt_id=pid, samples=[s], data_index=pid)


def template(length: int, lists: bool = False) -> dict:
    """A trajectory's arrays; ``lists``: as Python lists, the way the engines hand them over."""
    rng = np.random.default_rng(length)
    arrays = {
        "prompt": rng.integers(0, 50_000, PROMPT).astype(np.int32),
        "ids": rng.integers(0, 50_000, length).astype(np.int32),
        "lp": -rng.random(length).astype(np.float32),
        "vs": np.full(length, 3, dtype=np.int32),
    }
    return {k: v.tolist() for k, v in arrays.items()} if lists else arrays


def payload_bytes(length: int) -> int:
    return 4 * PROMPT + 12 * length


# ------------------------------------------------------------------------------ producer processes


def producer_main(commands, results) -> None:
    """A producer process: for each command, connect, report ready, wait for go, send, report done."""
    from flash.buffers.client import BufferProducer
    from flash.buffers.wire import encode_group

    ctx = zmq.Context()
    while True:
        cmd = commands.get()
        if cmd is None:
            return
        kind, address, length, pids, knobs = cmd
        knobs = dict(knobs)
        arrays = template(length, lists=knobs.pop("lists", False))
        if kind == "service":
            producer = BufferProducer(address, **knobs)
            results.put("ready")
            commands.get()  # go
            cpu = time.process_time()
            for pid in pids:
                producer.put(trajectory(pid, length, arrays))
            producer.flush()  # every put acknowledged
            cpu = time.process_time() - cpu
            producer.close()
        else:
            sock = ctx.socket(zmq.PUSH)
            sock.setsockopt(zmq.SNDHWM, 64)
            if knobs.get("keys") is not None:
                knobs["keys"].apply(sock)
            sock.connect(address)
            frame = encode_group(trajectory(0, length, arrays))
            results.put("ready")
            commands.get()
            cpu = time.process_time()
            for _ in pids:
                sock.send(frame, copy=False)
            sock.close(linger=-1)
            cpu = time.process_time() - cpu
        results.put(("done", cpu))


class Pool:
    """Four producer processes kept across runs."""

    def __init__(self):
        ctx = mp.get_context("spawn")
        self.commands = [ctx.Queue() for _ in range(PRODUCERS)]
        self.results = ctx.Queue()
        self.procs = [ctx.Process(target=producer_main, args=(q, self.results), daemon=True) for q in self.commands]
        for p in self.procs:
            p.start()

    def run(
        self, kind: str, address: str, length: int, n: int, consume, knobs: dict | None = None
    ) -> tuple[float, float]:
        """(seconds from 'go' until ``consume`` has taken all ``n`` items, CPU seconds of every process
        involved: the producers' send loops and this process -- with the service thread -- meanwhile)."""
        share = n // PRODUCERS
        for i, q in enumerate(self.commands):
            q.put((kind, address, length, list(range(i * share, (i + 1) * share)), knobs or {}))
        for _ in self.commands:
            assert self.results.get(timeout=120) == "ready"
        start, cpu = time.perf_counter(), time.process_time()
        for q in self.commands:
            q.put("go")
        consume(share * PRODUCERS)
        secs, cpu = time.perf_counter() - start, time.process_time() - cpu
        for _ in self.commands:
            tag, producer_cpu = self.results.get(timeout=120)
            assert tag == "done"
            cpu += producer_cpu
        return secs, cpu

    def close(self) -> None:
        for q in self.commands:
            q.put(None)
        for p in self.procs:
            p.join(10)


# ------------------------------------------------------------------------------ systems


def run_service(
    pool: Pool,
    length: int,
    n: int,
    capacity: int,
    batch: int,
    remote: bool,
    knobs: dict,
    curve: bool = True,
    checked: bool = True,
) -> tuple[float, float]:
    from flash import buffers
    import flash.buffers.service  # noqa: F401  (loads it for the name above)
    from flash.buffers.auth import ServiceKeys
    from flash.buffers.client import RemoteSampleBuffer
    from flash.buffers.service import BufferService

    if not checked:
        check_values, buffers.service.check_values = buffers.service.check_values, lambda *args: None
        try:
            return run_service(pool, length, n, capacity, batch, remote, knobs, curve)
        finally:
            buffers.service.check_values = check_values

    keys = ServiceKeys.new() if curve else None
    client = keys.client if keys else None
    knobs = {**knobs, "keys": client}
    with BufferService(capacity, keys=keys) as svc:
        consumer = RemoteSampleBuffer(svc.address, keys=client) if remote else svc.buffer

        def consume(total: int) -> None:
            seen: set[int] = set()
            while len(seen) < total:
                k = min(batch, total - len(seen))
                fifo = lambda gs, k=k: list(range(k)) if len(gs) >= k else None
                for g in consumer.get_batch(k, select=fifo, timeout=60):
                    assert g.prompt_id not in seen and len(g.samples[0].response_ids) == length
                    seen.add(g.prompt_id)

        secs = pool.run("service", svc.address, length, n, consume, knobs)
        if remote:
            consumer.disconnect()
    return secs


def run_zmq_bare(
    pool: Pool, length: int, n: int, capacity: int, batch: int, curve: bool = False, lists: bool = False
) -> tuple[float, float]:
    from flash.buffers.auth import ServiceKeys

    ctx = zmq.Context()
    sock = ctx.socket(zmq.PULL)
    sock.setsockopt(zmq.RCVHWM, capacity)
    keys = ServiceKeys.new() if curve else None
    auth = keys.serve(ctx, sock) if keys else None
    sock.bind("tcp://127.0.0.1:0")
    address = sock.getsockopt(zmq.LAST_ENDPOINT).decode()

    from flash.buffers.wire import encode_group

    size = len(encode_group(trajectory(0, length, template(length, lists))))  # what each producer sends

    def consume(total: int) -> None:
        for _ in range(total):
            frame = sock.recv(copy=False)
            assert len(frame) == size

    secs = pool.run("zmq", address, length, n, consume, {"keys": keys.client if keys else None, "lists": lists})
    sock.close(0)
    if auth is not None:
        auth.stop()
    ctx.term()
    return secs


def run_ray_queue(actors, length: int, n: int, capacity: int, batch: int) -> tuple[float, float]:
    """(seconds, NaN): Ray's CPU is spread over its actor, raylet and GCS processes; not counted."""
    import ray
    from ray.util.queue import Empty, Queue

    queue = Queue(maxsize=capacity, actor_options={"num_cpus": 0})
    share = n // PRODUCERS
    ray.get([a.prepare.remote(length) for a in actors])
    start = time.perf_counter()
    refs = [a.produce.remote(queue, list(range(i * share, (i + 1) * share))) for i, a in enumerate(actors)]
    seen: set[int] = set()
    while len(seen) < share * PRODUCERS:
        try:
            items = queue.get_nowait_batch(min(batch, share * PRODUCERS - len(seen)))
        except Empty:
            items = [queue.get(timeout=60)]
        for g in items:
            assert g.prompt_id not in seen and len(g.samples[0].response_ids) == length
            seen.add(g.prompt_id)
    secs = time.perf_counter() - start
    ray.get(refs)
    queue.shutdown()
    return secs, float("nan")


def ray_producers():
    import ray

    @ray.remote(num_cpus=0)
    class RayProducer:
        def prepare(self, length: int) -> None:
            self.length, self.arrays = length, template(length)

        def produce(self, queue, pids: list[int]) -> None:
            for pid in pids:
                queue.put(trajectory(pid, self.length, self.arrays))

    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    return [RayProducer.remote() for _ in range(PRODUCERS)]


# ------------------------------------------------------------------------------ main


def parser() -> argparse.ArgumentParser:
    """The benchmark's options."""
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--lengths", default="1024,8192")
    ap.add_argument("--capacity", type=int, default=64)
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--window", type=int, default=16, help="BufferProducer puts in flight (4 x 16 = capacity)")
    ap.add_argument(
        "--batch-groups",
        type=int,
        default=BufferConfig.batch_groups,
        help="BufferProducer: groups per put message (1: one message per group)",
    )
    ap.add_argument(
        "--linger-ms",
        type=float,
        default=BufferConfig.linger_ms,
        help="BufferProducer: how long a batch waits to fill (0: send each put at once)",
    )
    ap.add_argument("--mb", type=float, default=48.0, help="payload MB per run of the zmq systems")
    ap.add_argument("--ray-mb", type=float, default=4.0, help="payload MB per run of Ray's queue (slow)")
    ap.add_argument(
        "--lists",
        action="store_true",
        help="trajectories as Python lists (what the engines produce) instead of NumPy arrays",
    )
    ap.add_argument("--systems", default=",".join(SYSTEMS), help="which systems to run (ratios need both sides)")
    return ap


def system_runs(pool: Pool, actors, args, knobs: dict) -> dict:
    """Each system's run: (length, count) -> (seconds, CPU seconds)."""
    return {
        "service_local": lambda L, n: run_service(pool, L, n, args.capacity, args.batch, remote=False, knobs=knobs),
        "service_local_plain": lambda L, n: run_service(
            pool, L, n, args.capacity, args.batch, remote=False, knobs=knobs, curve=False
        ),
        "service_local_unchecked": lambda L, n: run_service(
            pool, L, n, args.capacity, args.batch, remote=False, knobs=knobs, curve=False, checked=False
        ),
        "service_remote": lambda L, n: run_service(pool, L, n, args.capacity, args.batch, remote=True, knobs=knobs),
        "ray_queue": lambda L, n: run_ray_queue(actors, L, count_for(args.ray_mb, L), args.capacity, args.batch),
        "zmq_bare": lambda L, n: run_zmq_bare(pool, L, n, args.capacity, args.batch, lists=args.lists),
        "zmq_bare_curve": lambda L, n: run_zmq_bare(
            pool, L, n, args.capacity, args.batch, curve=True, lists=args.lists
        ),
    }


def main(argv: list[str] | None = None) -> dict:
    ap = parser()
    args = ap.parse_args(argv)
    lengths = [int(x) for x in args.lengths.split(",")]
    systems = tuple(s for s in SYSTEMS if s in args.systems.split(","))
    if unknown := set(args.systems.split(",")) - set(SYSTEMS):
        ap.error(f"unknown systems {sorted(unknown)}; choose from {', '.join(SYSTEMS)}")
    pool, actors = Pool(), ray_producers() if "ray_queue" in systems else None
    knobs = {"window": args.window, "batch_groups": args.batch_groups, "linger_ms": args.linger_ms, "lists": args.lists}
    runs = system_runs(pool, actors, args, knobs)
    rates: dict[int, dict[str, list[float]]] = {L: {s: [] for s in systems} for L in lengths}
    cpu_us: dict[int, dict[str, list[float]]] = {L: {s: [] for s in systems} for L in lengths}
    try:
        for L in lengths:
            n = count_for(args.mb, L)
            for rep in range(args.repeats):
                order = systems[rep % len(systems) :] + systems[: rep % len(systems)]
                for name in order:
                    count = count_for(args.ray_mb, L) if name == "ray_queue" else n
                    secs, cpu = runs[name](L, n)
                    rates[L][name].append(count / secs)
                    cpu_us[L][name].append(cpu / count * 1e6)
                    print(
                        f"L={L:5d} repeat {rep} {name:15s} {count:6d} samples in {secs:6.2f} s = "
                        f"{count / secs:8.0f} samples/s {count * payload_bytes(L) / secs / 1e9:6.3f} GB/s "
                        f"{cpu / count * 1e6:7.1f} CPU us/sample",
                        flush=True,
                    )
    finally:
        pool.close()
    return report(rates, cpu_us, args)


def count_for(mb: float, length: int) -> int:
    """Trajectories carrying ``mb`` MB of payload, a multiple of the producer count (>= 8 each)."""
    return max(PRODUCERS * 8, int(mb * 1e6 / payload_bytes(length)) // PRODUCERS * PRODUCERS)


def report(rates: dict[int, dict[str, list[float]]], cpu_us: dict[int, dict[str, list[float]]], args) -> dict:
    result = {
        "bench": "buffer",
        "producers": PRODUCERS,
        "repeats": args.repeats,
        "capacity": args.capacity,
        "batch": args.batch,
        "window": args.window,
        "batch_groups": args.batch_groups,
        "linger_ms": args.linger_ms,
        "mb": args.mb,
        "ray_mb": args.ray_mb,
        "lists": args.lists,
        "per_length": {},
    }
    for L, per in rates.items():
        med = {s: statistics.median(r) for s, r in per.items()}

        def ratio(a: str, b: str, per: dict[str, list[float]] = per) -> float | None:
            if a not in per or b not in per:
                return None
            return round(statistics.median(x / y for x, y in zip(per[a], per[b])), 3)

        result["per_length"][str(L)] = {
            "samples_per_s": {s: round(v, 1) for s, v in med.items()},
            "gb_per_s": {s: round(v * payload_bytes(L) / 1e9, 4) for s, v in med.items()},
            "cpu_us_per_sample": {s: round(statistics.median(v), 1) for s, v in cpu_us[L].items() if s != "ray_queue"},
            "service_local_vs_ray_queue": ratio("service_local", "ray_queue"),
            "service_remote_vs_ray_queue": ratio("service_remote", "ray_queue"),
            "zmq_bare_vs_service_local": ratio("zmq_bare", "service_local"),
            "curve_cost": ratio("service_local_plain", "service_local"),
            "auth_validation_cost": ratio("service_local_unchecked", "service_local"),
            "zmq_bare_vs_service_remote": ratio("zmq_bare", "service_remote"),
            "zmq_bare_curve_vs_service_local": ratio("zmq_bare_curve", "service_local"),
            "zmq_bare_vs_service_local_plain": ratio("zmq_bare", "service_local_plain"),
        }
        for s in per:
            print(f"L={L:5d} {s:15s} median {med[s]:8.0f} samples/s {med[s] * payload_bytes(L) / 1e9:6.3f} GB/s")
    print(json.dumps(result))
    return result


if __name__ == "__main__":  # producer processes start with spawn: keep the guard
    main()
