"""The buffer service's requests: each op's fields and their types, checked before it is served.

Every request is a msgpack map with ``op`` and exactly the fields ``OPS`` lists for it, each of
its type (a bool is not an int); a put's groups follow as further parts (``flash.buffers.service``).
``client_of`` says who sent it.
"""

from __future__ import annotations

from typing import Any

import zmq

from .wire import WireError

OPS: dict[str, dict[str, type]] = {
    "put": {"rid": int, "producer": str, "seq": int},  # + the groups' frames, one part each
    "wait_space": {"rid": int, "wait_ms": int},
    "meta": {"rid": int, "since": int, "wait_ms": int},
    "take": {"rid": int, "keys": list, "consumer": str, "tid": int},
    "hello": {"rid": int},
    "drain": {"rid": int, "token": bytes},
    "stats": {"rid": int},
    "close": {"rid": int, "token": bytes},
}


def request_rid(msg: Any) -> int:
    """The request id to echo, if there is a usable one (so even a rejection reaches its caller)."""
    if isinstance(msg, dict) and isinstance(msg.get("rid"), int) and not isinstance(msg.get("rid"), bool):
        return msg["rid"]
    return -1


def check_request(msg: Any) -> None:
    if not isinstance(msg, dict):
        raise WireError("bad_schema", f"a request is a map, got {type(msg).__name__}")
    op = msg.get("op")
    if op not in OPS:
        raise WireError("unknown_op", f"op {op!r} is not one of {', '.join(OPS)}")
    schema = OPS[op]
    keys = set(msg) - {"op"}
    if keys != set(schema):
        raise WireError("bad_schema", f"{op}: expected keys {sorted(schema)}, got {sorted(keys)}")
    for key, typ in schema.items():
        value = msg[key]
        if (typ is int and isinstance(value, bool)) or not isinstance(value, typ):
            raise WireError("bad_type", f"{op}.{key} must be {typ.__name__}, got {type(value).__name__}")


def client_of(parts: list[zmq.Frame]) -> bytes:
    """Who sent a message: its CURVE public key (the ZAP user id) and its connection's routing id.
    The run's clients share one key, so the connection tells them apart."""
    try:
        user = str(parts[1].get("User-Id") or "")  # a string property
    except zmq.ZMQError:  # no such property: a plaintext socket
        user = ""
    return user.encode() + b"/" + parts[0].bytes
