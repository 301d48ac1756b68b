"""BufferService: one SampleBuffer served over zmq (ROUTER) with msgpack frames.

Producers in any process or host push groups (``BufferProducer``); consumers pull batches
(``RemoteSampleBuffer``, or ``service.buffer`` directly in the service's own process). One
background thread owns the socket and answers every request in arrival order, so the store needs
no cross-process locking and a slow client cannot block another.

Requests (all msgpack maps with ``op`` and ``rid``; the reply echoes ``rid``):

    put         {producer, seq} + 1..MAX_BATCH group frames (seqs seq, seq + 1, ...)
                                              -> per group: stored | duplicate | gap | full | closed
                                                 | rejected_<reason>; the answers to one client's
                                                 puts in a burst go as one message
                                                 {status: acks, acks: [[rid, seq, [status, ...]], ...]}
    wait_space  {wait_ms}                     -> ok once the buffer has room (or timeout)
    meta        {since, wait_ms}              -> epoch, closed, capacity, per-group metadata;
                                                 parked until the epoch moves past ``since``
    take        {keys, consumer, tid}         -> ok + the groups' frames | missing (all or none);
                                                 the same (consumer, tid) again replays the answer
    hello                                     -> ok + a producer id issued by the service (puts
                                                 carry it; ``flash.buffers.guard.ProducerTable``)
    drain / close  {token}                    -> only with the owner's token (``flash.buffers.auth``)
    stats

Exactly once, in order: each group of a put carries ``(producer, seq)``; a ``seq`` not above the
last one decided for that producer is a retry (``duplicate``: acknowledged, not stored again), one
past the next expected is refused (``gap``: an earlier group was refused, and the producer resends
from there; see ``flash.buffers.producer``). A group the schema refuses is answered
``rejected_<reason>`` and its seq counts as decided, so the groups after it in the batch are still
stored. Once a group of a batch is refused with ``gap``, ``full`` or ``closed``, the rest of the
batch gets the same answer (they would have to wait for it anyway). Backpressure: a put on a full
buffer is answered ``full`` and the producer parks a ``wait_space`` request, answered the moment a
take frees room.

Hostile input: with CURVE (``flash.buffers.auth``) only the run's clients get a frame in at all;
libzmq drops a peer whose part exceeds ``max_message_bytes`` (MAXMSGSIZE) before it is buffered;
a message whose parts together exceed it is refused unparsed (each group of a put answered
``rejected_oversized_message``); every frame is size-checked before it is parsed, and known whole
and within the message's ``Budget`` of ``max_decoded_bytes`` before msgpack builds anything
(``flash.buffers.frame_scan``; ``rejected_oversized_decoded``: a refused frame costs a walk over its bytes),
schema-checked (``flash.buffers.wire``) and value-checked (``flash.buffers.guard``: finite, versions in range,
token ids in the vocabulary); a prompt already stored is refused whoever replays it; a client
(its connection) holds at most ``producers_per_client`` producer ids; long-polls
(``flash.buffers.longpoll``) wait at most ``MAX_WAIT_MS`` and each client parks at most
``max_waiters_per_client``. A refused frame is answered ``rejected`` with its reason, counted under
``rejected_<reason>``, and the service goes on serving. libzmq itself holds a multipart message's parts until its last arrives (each part
bounded, their count not): the caps bound what the service builds from a message, not that.
Connections are bounded too (``flash.buffers.connections``: a cap in all and per host, the least
recently active giving way, the idle and the never-handshaken closed, each counted).
"""

from __future__ import annotations

import logging
import os
import secrets
import threading
import time
from collections.abc import Callable

import zmq

from .auth import ServiceKeys
from .buffer import BufferClosed
from .connections import COUNTERS as CONNECTION_COUNTERS
from .connections import ConnectionLimits, Connections, fit_caps
from .guard import ProducerTable, SeenPrompts, ValueLimits, check_values
from .longpoll import MAX_WAIT_MS, LongPolls
from .store import KeyedSampleBuffer
from .types import Group
from .requests import check_request, client_of, request_rid
from .wire import REASONS, Budget, WireError, decode_group, pack, unpack

__all__ = ["BATCH_BYTES", "DECODED_PER_BYTE", "MAX_BATCH", "MAX_WAIT_MS", "BufferService", "message_caps"]

log = logging.getLogger(__name__)

MAX_BATCH = 1024  # groups in one put message
# a message's default caps: all its parts together (the largest group and a full batch beside it:
# a producer sends a batch once it reaches batch_kb, 1 MiB by default), and the Python objects its
# frames decode to (an honest group sent as lists is charged ~20 bytes per byte of its frame)
BATCH_BYTES = 1 << 20
DECODED_PER_BYTE = 32
COUNTERS = (
    "frames_in",
    "put_batches",
    "puts",
    "gets",
    "duplicates",
    "full_replies",
    "gap_replies",
    "bytes_in",
    "bytes_out",
    "producer_blocked_s",
    "take_replays",
    "rejected",
    "internal_errors",
)


class BufferService:
    def __init__(
        self,
        capacity: int,
        bind: str = "tcp://127.0.0.1:0",
        max_frame_bytes: int = 64 << 20,
        max_waiters: int = 1024,
        keys: ServiceKeys | None = None,
        owner_token: bytes | None = None,
        max_waiters_per_client: int = 16,
        limits: ValueLimits | None = None,
        max_message_bytes: int = 0,
        max_decoded_bytes: int = 0,
        producers_per_client: int = 64,
        connections: ConnectionLimits | None = None,
    ):
        self.bind, self.max_frame_bytes, self.max_waiters = bind, max_frame_bytes, max_waiters
        # 0: derived from max_frame_bytes (``message_caps``)
        self.max_message_bytes, self.max_decoded_bytes = message_caps(
            max_frame_bytes, max_message_bytes=max_message_bytes, max_decoded_bytes=max_decoded_bytes
        )
        self.keys, self.max_waiters_per_client = keys, max_waiters_per_client
        self.limits = limits or ValueLimits()
        self.connection_limits = connections or ConnectionLimits()
        self._conns: Connections | None = None  # at start: its caps fitted to the open-files limit
        self._next_sweep = 0.0
        # close/drain need it; None: whoever created the service in-process passes none (tests)
        self.owner_token = owner_token
        # the policy version no token can be above (the controller's, + 1 while a push resumes the
        # engine); None: only >= 0 is checked
        self.max_version: Callable[[], int] | None = None
        self._auth = None
        self._wake_r, self._wake_w = os.pipe()
        os.set_blocking(self._wake_r, False)
        os.set_blocking(self._wake_w, False)
        self.buffer = KeyedSampleBuffer(capacity, on_change=self._changed)
        self._ident = -1  # the service thread's id: its own changes need no wake-up
        self.address = ""
        self._counts: dict[str, float] = {k: 0.0 for k in COUNTERS + CONNECTION_COUNTERS} | {
            f"rejected_{r}": 0.0 for r in REASONS
        }
        self._lock = threading.Lock()
        self._producers = ProducerTable(per_client=producers_per_client)  # issued by hello, capped per client
        self._prompts = SeenPrompts()  # prompt ids stored: a replay is not a second group
        self._blocked_since: dict[str, float] = {}  # producer -> when it was first told 'full'
        self._last_take: dict[str, tuple[int, list[bytes | memoryview]]] = {}  # consumer -> (tid, frames)
        self._acks: dict[bytes, list[list]] = {}  # identity -> [rid, seq, status] not yet sent
        self._polls = LongPolls(self.buffer, max_waiters, max_waiters_per_client, self._lock)  # parked long-polls
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._ctx = zmq.Context()
        self._sock = self._ctx.socket(zmq.ROUTER)

    # ------------------------------------------------------------------------------ lifecycle
    def start(self) -> BufferService:
        """Bind (port 0: an ephemeral port; ``address`` says which) and serve in a daemon thread."""
        self._sock.setsockopt(zmq.LINGER, 0)
        # per part: libzmq drops the peer of a part larger than a whole message may be, before
        # buffering it; up to it an oversized group is still answered by name (refused unparsed)
        self._sock.setsockopt(zmq.MAXMSGSIZE, self.max_message_bytes)
        lim = self.connection_limits
        self._sock.setsockopt(zmq.HANDSHAKE_IVL, max(1, int(lim.handshake_s * 1000)))
        self._conns = Connections(*fit_caps(lim.total, lim.per_host), lim.idle_s, self._count)
        self._conns.watch(self._ctx, self._sock)
        if self.keys is not None:
            self._auth = self.keys.serve(self._ctx, self._sock)
        self._sock.bind(self.bind)
        endpoint = self._sock.getsockopt(zmq.LAST_ENDPOINT)
        assert isinstance(endpoint, bytes)  # a string option
        self.address = endpoint.decode()
        self._conns.listening(self.address)
        self._thread = threading.Thread(target=self._serve, name="buffer-service", daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        """Stop serving (the store stays readable in-process); idempotent."""
        self._stop.set()
        self._poke()
        if self._thread is not None:
            self._thread.join(5.0)
            self._thread = None
        if self._auth is not None:
            self._auth.stop()
            self._auth = None
        if not self._sock.closed:
            if self._conns is not None:
                self._sock.disable_monitor()
                self._conns.close()
            self._sock.close(0)
            self._ctx.term()
            os.close(self._wake_r)
            os.close(self._wake_w)

    def __enter__(self) -> BufferService:
        return self.start() if self._thread is None else self

    def __exit__(self, *exc) -> None:
        self.stop()

    def stats(self) -> dict[str, float]:
        """The store's SampleBuffer stats plus the service's counters (all floats, for metrics)."""
        with self._lock:
            out = dict(self._counts)
            out["waiters"] = float(len(self._polls))
            out["producers"] = float(len(self._producers))
            out["producers_evicted"] = float(self._producers.evicted)
            out["connections"] = float(len(self._conns or ()))
        out.update(self.buffer.stats())
        out["capacity"] = float(self.buffer.capacity)
        return out

    # ------------------------------------------------------------------------------ the loop
    def _changed(self) -> None:
        """The store changed: wake the service thread, unless it made the change itself."""
        if threading.get_ident() != self._ident:
            self._poke()

    def _poke(self) -> None:
        """Wake the service thread (any thread may call it: a pipe write is thread-safe)."""
        try:
            os.write(self._wake_w, b"x")
        except (BlockingIOError, OSError):
            pass  # pipe full (a wake is already pending) or closed at stop

    def _serve(self) -> None:
        self._ident = threading.get_ident()
        poller = zmq.Poller()
        poller.register(self._sock, zmq.POLLIN)
        poller.register(self._wake_r, zmq.POLLIN)
        assert self._conns is not None and self._conns.monitor is not None
        poller.register(self._conns.monitor, zmq.POLLIN)
        while not self._stop.is_set():
            events = dict(poller.poll(self._poll_timeout_ms()))
            self._watch_connections(self._conns.monitor in events)
            if self._wake_r in events:
                try:
                    os.read(self._wake_r, 4096)
                except BlockingIOError:
                    pass
            if self._sock in events:
                for _ in range(256):  # a bounded burst, then parked requests get a look
                    try:
                        parts = self._sock.recv_multipart(zmq.NOBLOCK, copy=False)
                    except zmq.Again:
                        break
                    self._handle(parts)
                self._flush_acks()
                self.buffer.wake()  # in-process get_batch waiters: once per burst, not per put
            self._serve_parked()

    def _serve_parked(self) -> None:
        for identity, answer in self._polls.due():
            self._reply(identity, answer)

    def _poll_timeout_ms(self) -> int:
        soonest = self._polls.soonest(default=self._next_sweep)
        return max(0, min(1000, int((min(soonest, self._next_sweep) - time.monotonic()) * 1000) + 1))

    def _watch_connections(self, events: bool) -> None:
        """Connections accepted and gone (``events``: the monitor has some), and the idle closed
        every quarter of ``idle_s`` (at most once a second)."""
        assert self._conns is not None
        now = time.monotonic()
        if not events and now < self._next_sweep:
            return
        busy = self._polls.identities()  # waiting on the service: not idle
        if events:
            self._conns.on_events(busy, now)
        if now >= self._next_sweep:
            self._conns.sweep(busy, now)
            self._next_sweep = now + min(1.0, self._conns.idle_s / 4)

    def _reply(self, identity: bytes, message: dict) -> None:
        frame = pack(message)
        self._sock.send_multipart([identity, frame], copy=len(frame) < (1 << 16))  # zero-copy only pays when large

    def _count(self, key: str, value: float = 1.0) -> None:
        with self._lock:
            self._counts[key] += value

    def _handle(self, parts: list[zmq.Frame]) -> None:
        identity = parts[0].bytes
        self._count("frames_in")
        if self._conns is not None and len(parts) > 1:
            self._conns.touch(parts[1], identity)
        rid = -1
        try:
            size = sum(len(p.buffer) for p in parts[1:])
            self._count("bytes_in", size)
            if not 2 <= len(parts) <= 2 + MAX_BATCH:
                raise WireError("multipart", f"{len(parts) - 1} parts; a request is one (a put 2..{MAX_BATCH + 1})")
            budget = Budget(self.max_decoded_bytes)  # what this message may decode to, all its parts
            msg = unpack(parts[1].buffer, self.max_frame_bytes, budget)
            rid = request_rid(msg)
            check_request(msg)
            if (len(parts) > 2) != (msg["op"] == "put"):
                raise WireError(
                    "multipart",
                    f"{msg['op']} with {len(parts) - 1} parts; a request is one part, a put a header and its groups",
                )
            if size > self.max_message_bytes:  # a put's groups are each refused by name, unparsed
                refusal = WireError(
                    "oversized_message", f"{len(parts) - 1} parts of {size} bytes together > {self.max_message_bytes}"
                )
                if msg["op"] != "put":
                    raise refusal
                msg["refusal"] = refusal
            if msg["op"] == "put":
                msg["groups"] = [p.buffer for p in parts[2:]]  # the groups' frames, as received (no copy)
                msg["budget"] = budget
            elif msg["op"] == "hello":
                msg["client"] = client_of(parts)
            reply = getattr(self, f"_op_{msg['op']}")(identity, msg)
        except WireError as exc:
            self._count("rejected")
            self._count(f"rejected_{exc.reason}")
            reply = {"status": "rejected", "reason": exc.reason, "detail": str(exc)[:500]}
        except Exception as exc:  # a bug here must not stop the service for everyone
            self._count("internal_errors")
            log.exception("buffer service: request failed")
            reply = {"status": "error", "detail": f"{type(exc).__name__}: {exc}"[:500]}
        if reply is None:  # parked, answered later
            return
        reply["rid"] = rid
        if "statuses" in reply:  # a put's answers: sent with the burst's others to this producer
            self._acks.setdefault(identity, []).append([rid, reply["seq"], reply["statuses"]])
        else:
            self._flush_acks(identity)  # keep this client's answers in order
            self._reply(identity, reply)

    def _flush_acks(self, identity: bytes | None = None) -> None:
        """Send the put answers of a burst: one message per producer, not one per put (each
        message is a wake-up of the producer and a send here)."""
        for ident in [identity] if identity is not None else list(self._acks):
            acks = self._acks.pop(ident, None)
            if acks:
                self._reply(ident, {"rid": -1, "status": "acks", "acks": acks})

    # ------------------------------------------------------------------------------ operations
    def _op_put(self, identity: bytes, msg: dict) -> dict:
        """Each group in seq order; after a gap, full or closed the rest get the same answer."""
        producer, first, frames = msg["producer"], msg["seq"], msg["groups"]
        self._count("put_batches")
        statuses: list[str] = []
        for i, frame in enumerate(frames):
            status = self._put_one(producer, first + i, frame, msg["budget"], msg.get("refusal"))
            statuses.append(status)
            if status in ("gap", "full", "closed"):
                statuses += [status] * (len(frames) - i - 1)
                break
        return {"seq": first, "statuses": statuses}

    def _put_one(
        self, producer: str, seq: int, frame: memoryview, budget: Budget, refusal: WireError | None = None
    ) -> str:
        """Store one group exactly once; a refused one is decided (its seq used) and counted.

        The order checks come first: a refusal is only ever given to the next expected seq, so a
        seq the producer counts as decided is decided here too (a refusal behind a gap would leave
        the producer waiting on a seq it no longer holds). ``budget``: the message's decoded bytes,
        kept for a stored group, given back for a refused one; ``refusal``: the whole message's."""
        try:
            last = self._producers.last_seq(producer)
        except WireError as exc:
            return self._refused(exc)
        if seq <= last:
            self._count("duplicates")
            return "duplicate"
        if seq > last + 1:  # an earlier group of this producer was refused: keep its order
            self._count("gap_replies")
            return "gap"
        spent = budget.spent
        try:
            if refusal is not None:
                raise refusal
            if len(frame) > self.max_frame_bytes:  # refused before it is parsed
                raise WireError("oversized", f"group frame of {len(frame)} bytes > {self.max_frame_bytes}")
            top = self.max_version() if self.max_version else 1 << 62
            group = decode_group(
                unpack(frame, self.max_frame_bytes, budget), lambda g: check_values(g, self.limits, top), budget
            )
            if group.prompt_id in self._prompts:
                raise WireError("duplicate_prompt", f"a group of prompt {group.prompt_id} was stored already")
        except WireError as exc:
            budget.spent = spent
            self._producers.decided(producer, seq)
            return self._refused(exc)
        return self._store(producer, seq, group, frame)

    def _refused(self, exc: WireError) -> str:
        self._count("rejected")
        self._count(f"rejected_{exc.reason}")
        return f"rejected_{exc.reason}"

    def _store(self, producer: str, seq: int, group: Group, frame: memoryview) -> str:
        try:
            stored = self.buffer.try_put(group, frame=frame, notify=False)
        except BufferClosed:
            return "closed"
        now = time.monotonic()
        if not stored:
            self._blocked_since.setdefault(producer, now)
            self._count("full_replies")
            return "full"
        self._producers.decided(producer, seq)
        self._prompts.add(group.prompt_id)
        self._count("puts")
        if producer in self._blocked_since:
            self._count("producer_blocked_s", now - self._blocked_since.pop(producer))
        return "stored"

    def _op_wait_space(self, identity: bytes, msg: dict) -> dict | None:
        return self._polls.park_or_answer(identity, msg, since=0)

    def _op_meta(self, identity: bytes, msg: dict) -> dict | None:
        return self._polls.park_or_answer(identity, msg, since=msg["since"])

    def _op_take(self, identity: bytes, msg: dict) -> dict:
        """All the keys or none. A consumer's last answer is kept until its next take, so a take
        retried after a lost reply gets the same groups again instead of losing them."""
        keys, consumer, tid = msg["keys"], msg["consumer"], msg["tid"]
        if any(type(k) is not int for k in keys):
            raise WireError("bad_type", "take.keys must be a list of ints")
        last = self._last_take.get(consumer)
        if last is not None and last[0] == tid:
            self._count("take_replays")
            return {"status": "ok", "groups": last[1]}
        try:
            taken = self.buffer.take(keys)
        except BufferClosed:
            return {"status": "closed"}
        if taken is None:
            return {"status": "missing"}
        frames = [frame for _, frame in taken]
        self._last_take[consumer] = (tid, frames)
        return self._groups_reply(frames)

    def _op_hello(self, identity: bytes, msg: dict) -> dict:
        return {"status": "ok", "producer": self._producers.issue(msg["client"])}

    def _check_owner(self, msg: dict) -> None:
        if self.owner_token is not None and not secrets.compare_digest(msg["token"], self.owner_token):
            raise WireError("not_owner", f"{msg['op']} is only accepted from the process that owns the service")

    def _op_drain(self, identity: bytes, msg: dict) -> dict:
        self._check_owner(msg)
        _, _, metas = self.buffer.meta()
        taken = self.buffer.take([m.key for m in metas], closed_ok=True) or []
        return self._groups_reply([frame for _, frame in taken])

    def _op_stats(self, identity: bytes, msg: dict) -> dict:
        return {"status": "ok", "stats": self.stats()}

    def _op_close(self, identity: bytes, msg: dict) -> dict:
        self._check_owner(msg)
        self.buffer.close()
        return {"status": "ok"}

    def _groups_reply(self, frames: list[bytes | memoryview]) -> dict:
        self._count("gets", len(frames))
        self._count("bytes_out", sum(len(f) for f in frames))
        return {"status": "ok", "groups": frames}


def message_caps(
    max_frame_bytes: int, batch_bytes: int = BATCH_BYTES, max_message_bytes: int = 0, max_decoded_bytes: int = 0
) -> tuple[int, int]:
    """(all parts of a message together, what they may decode to); a 0 is derived: the largest
    group beside a full batch of the producers' ``batch_bytes``, and ``DECODED_PER_BYTE`` times that."""
    message = max_message_bytes or max_frame_bytes + batch_bytes
    return message, max_decoded_bytes or DECODED_PER_BYTE * message
