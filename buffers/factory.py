"""The ``buffer`` config section and ``make_buffer``: the in-process SampleBuffer or the zmq service.

``transport: local`` (default) is the in-process buffer. ``transport: zmq`` starts a
``BufferService`` on ``bind`` in this process and returns a ``RemoteSampleBuffer`` on it, so the
scheduler's puts and the controller's ``get_batch`` both cross the wire, exactly as producers on
other hosts do; ``service.address`` is what those producers connect to (``make_producer`` builds
one from this section).

The producer knobs (``window``, ``batch_groups``, ``batch_kb``, ``linger_ms``) shape how a
streaming producer batches its puts (see ``flash.buffers.producer``). The driver's own proxy ignores
``window``: the scheduler must know a group is stored before it drops it from its pending list, so
its puts are strict (one acknowledged round trip each) and never linger.
"""

from __future__ import annotations

import difflib
from dataclasses import dataclass
from typing import Literal, get_args

from .auth import AuthMode, ClientKeys, ServiceKeys, check_bind, new_owner_token
from .buffer import SampleBuffer
from .client import RemoteSampleBuffer
from .connections import ConnectionLimits
from .producer import BufferProducer
from .service import BufferService, message_caps

Transport = Literal["local", "zmq"]  # buffer.transport
TRANSPORTS: tuple[str, ...] = get_args(Transport)


@dataclass
class BufferConfig:
    transport: Transport = "local"  # local (in-process) | zmq (BufferService + msgpack frames)
    bind: str = "tcp://127.0.0.1:0"  # zmq: where the service listens; port 0 = any free port
    auth: AuthMode = "curve"  # zmq: curve (per-run keys, encrypted) | none (plaintext; loopback/ipc binds only)
    max_frame_mb: float = 64.0  # zmq: a larger frame (one group) is refused and counted
    max_message_mb: float = 0.0  # zmq: one message's parts together; 0 = max_frame_mb + batch_kb
    max_decoded_mb: float = 0.0  # zmq: what one message's frames may decode to in memory; 0 = 32 × max_message_mb
    producers_per_client: int = 64  # zmq: producer ids one client connection may hold
    max_connections: int = 1024  # zmq: connections in all; past it the least recently active is closed
    max_connections_per_host: int = 256  # zmq: connections from one peer address, the same way
    connection_idle_s: float = 600.0  # zmq: a connection with no request for this long is closed
    handshake_s: float = 10.0  # zmq: a connection that has not finished its handshake by then is closed
    capacity: int = 0  # groups held before producers block; 0 = ceil((async_ratio + 2) * prompts_per_step)
    window: int = 16  # zmq producer: groups put but not yet acknowledged before put waits (1 = strict)
    batch_groups: int = 16  # zmq producer: groups per put message at most
    batch_kb: int = 1024  # zmq producer: a put message is sent once its groups reach this many KiB
    linger_ms: float = 1.0  # zmq producer: a batch not yet full is sent after this wait (0 = at once)

    def __post_init__(self) -> None:
        if self.transport not in TRANSPORTS:  # a leaf: its own matcher, not flash.algos.registry's
            near = difflib.get_close_matches(self.transport, TRANSPORTS, n=1, cutoff=0.5)
            hint = f" (did you mean '{near[0]}'?)" if near else ""
            raise ValueError(f"buffer.transport must be one of: {', '.join(TRANSPORTS)} (got '{self.transport}'){hint}")
        if not self.bind.startswith(("tcp://", "ipc://")):
            raise ValueError(f"buffer.bind must be a zmq endpoint like tcp://127.0.0.1:0, got '{self.bind}'")
        check_bind(self.bind, self.auth)
        if not self.max_frame_mb > 0:
            raise ValueError(f"buffer.max_frame_mb must be > 0, got {self.max_frame_mb}")
        if self.max_message_mb and not self.max_message_mb >= self.max_frame_mb:
            raise ValueError(
                f"buffer.max_message_mb must be 0 (auto) or >= buffer.max_frame_mb "
                f"({self.max_frame_mb}), got {self.max_message_mb}"
            )
        if not self.max_decoded_mb >= 0:
            raise ValueError(f"buffer.max_decoded_mb must be >= 0 (0 = auto), got {self.max_decoded_mb}")
        if self.capacity < 0:
            raise ValueError(f"buffer.capacity must be >= 0 (0 = auto), got {self.capacity}")
        for key in (
            "window",
            "batch_groups",
            "batch_kb",
            "producers_per_client",
            "max_connections",
            "max_connections_per_host",
        ):
            if getattr(self, key) < 1:
                raise ValueError(f"buffer.{key} must be >= 1, got {getattr(self, key)}")
        for key in ("connection_idle_s", "handshake_s"):
            if not getattr(self, key) > 0:
                raise ValueError(f"buffer.{key} must be > 0, got {getattr(self, key)}")
        if not self.linger_ms >= 0:
            raise ValueError(f"buffer.linger_ms must be >= 0 (0 = send each put at once), got {self.linger_ms}")


def make_buffer(cfg: BufferConfig, capacity: int) -> tuple[SampleBuffer | RemoteSampleBuffer, BufferService | None]:
    """(the buffer the scheduler and controller share, the service to stop at the end or None).

    ``capacity`` is the caller's default; ``cfg.capacity`` > 0 overrides it.
    """
    capacity = cfg.capacity or capacity
    if cfg.transport == "local":
        return SampleBuffer(capacity=capacity), None
    keys, token = (ServiceKeys.new() if cfg.auth == "curve" else None), new_owner_token()
    frame = int(cfg.max_frame_mb * (1 << 20))
    message, decoded = message_caps(
        frame, cfg.batch_kb << 10, int(cfg.max_message_mb * (1 << 20)), int(cfg.max_decoded_mb * (1 << 20))
    )
    limits = ConnectionLimits(
        total=cfg.max_connections,
        per_host=cfg.max_connections_per_host,
        idle_s=cfg.connection_idle_s,
        handshake_s=cfg.handshake_s,
    )
    service = BufferService(
        capacity,
        bind=cfg.bind,
        max_frame_bytes=frame,
        keys=keys,
        owner_token=token,
        max_message_bytes=message,
        max_decoded_bytes=decoded,
        producers_per_client=cfg.producers_per_client,
        connections=limits,
    ).start()
    client_keys = keys.client if keys is not None else None
    return RemoteSampleBuffer(
        service.address, max_frame_mb=cfg.max_frame_mb, keys=client_keys, owner_token=token
    ), service


def make_producer(cfg: BufferConfig, address: str, keys: ClientKeys | None) -> BufferProducer:
    """A streaming producer for the service at ``address`` (a rollout worker in another process);
    ``keys``: the service's ``keys.client`` (``service.keys.client``), handed over by the driver."""
    return BufferProducer(
        address,
        max_frame_mb=cfg.max_frame_mb,
        window=cfg.window,
        batch_groups=cfg.batch_groups,
        batch_kb=cfg.batch_kb,
        linger_ms=cfg.linger_ms,
        keys=keys,
    )
