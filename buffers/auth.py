"""Who may talk to a buffer service: libzmq's CURVE with keys made per run, and an owner token.

- **CURVE** (``auth="curve"``, the default): the service holds a server keypair, every client of
  the run one client keypair; the handshake proves both sides and encrypts every frame. A ZAP
  handler (pyzmq's ``ThreadAuthenticator``, in the service's process) admits only the run's client
  public key, so a process that learns the port but not the keys is disconnected before its first
  frame is read. The keys are made by the driver when it starts the service and reach the roles as
  arguments of their Ray actors (``ClientKeys``, three 40-byte Z85 strings), never through a file.
- **The owner token** (random, 16 bytes): ``close`` and ``drain`` carry it; only the process that
  created the service (the controller's ``RemoteSampleBuffer``) has it. Producers hold the client
  keys, so CURVE alone would let a producer close the run's buffer.

``auth="none"`` (plaintext) is allowed only on loopback or ipc endpoints (``check_bind``); it exists
for measuring CURVE's cost (``python -m bench.buffer``).
"""

from __future__ import annotations

import ipaddress
import secrets
from dataclasses import dataclass
from typing import Literal, get_args
from urllib.parse import urlsplit

import zmq

AuthMode = Literal["curve", "none"]  # buffer.auth
AUTH_MODES: tuple[str, ...] = get_args(AuthMode)


@dataclass(frozen=True)
class ClientKeys:
    """What a client of one run's service needs: the server's public key and the client keypair."""

    server_public: bytes
    client_public: bytes
    client_secret: bytes

    def apply(self, sock: zmq.Socket) -> None:
        """Make ``sock`` (before ``connect``) a CURVE client of the service."""
        sock.curve_serverkey = self.server_public
        sock.curve_publickey = self.client_public
        sock.curve_secretkey = self.client_secret


@dataclass(frozen=True)
class ServiceKeys:
    """The service's keypair and the one client keypair it admits (made fresh per run)."""

    server_public: bytes
    server_secret: bytes
    client: ClientKeys

    @classmethod
    def new(cls) -> ServiceKeys:
        server_public, server_secret = zmq.curve_keypair()
        client_public, client_secret = zmq.curve_keypair()
        return cls(server_public, server_secret, ClientKeys(server_public, client_public, client_secret))

    def serve(self, ctx: zmq.Context, sock: zmq.Socket):
        """Make ``sock`` (before ``bind``) a CURVE server that admits only ``client``; returns the
        started authenticator (stop it with the service)."""
        from zmq.auth.thread import ThreadAuthenticator

        auth = ThreadAuthenticator(ctx)
        auth.start()
        auth.configure_curve_callback("*", _OnlyKey(self.client.client_public))
        sock.curve_server = True
        sock.curve_publickey = self.server_public
        sock.curve_secretkey = self.server_secret
        return auth


class _OnlyKey:
    """ZAP credentials provider: admits exactly one client public key (both Z85, as pyzmq gives them)."""

    def __init__(self, z85_key: bytes):
        self.key = z85_key

    def callback(self, domain: str, z85_key: bytes) -> bool:
        return secrets.compare_digest(z85_key, self.key)


def new_owner_token() -> bytes:
    return secrets.token_bytes(16)


def is_loopback(endpoint: str) -> bool:
    """True for ipc:// and for tcp:// on a loopback address (127/8, ::1, localhost)."""
    if endpoint.startswith(("ipc://", "inproc://")):
        return True
    host = urlsplit(endpoint).hostname or ""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False  # an interface name or '*': every address of it


def check_bind(bind: str, auth: str) -> None:
    """Refuse a plaintext service reachable from other hosts (ValueError naming the fix)."""
    if auth not in AUTH_MODES:
        raise ValueError(f"buffer.auth must be one of: {', '.join(AUTH_MODES)} (got '{auth}')")
    if auth == "none" and not is_loopback(bind):
        raise ValueError(
            f"buffer.bind={bind} listens beyond loopback with buffer.auth=none: any host could "
            "put, take or close; use buffer.auth=curve (the default) or a 127.0.0.1 / ipc:// bind"
        )
