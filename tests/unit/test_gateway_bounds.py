"""The gateway's bounds on what comes from outside: JSON nesting (from the client and in the
policy's own reply), connections that send nothing or send slowly, requests in flight per session.
Every refusal is an answer with a counted reason, and a policy reply is always recorded."""

from __future__ import annotations

import json
import socket
import threading
import time

import httpx
import pytest

from flash.envs.chat_messages import TOOL_PARSERS, ToolCallError, hermes, split_reply
from flash.envs.gateway import Gateway
from flash.envs.json_bounds import MAX_JSON_DEPTH, TooDeep, check_json
from flash.guards import json_depth
from tests.helpers.chat import Scripted, bpe_tokenizer

USER = [{"role": "user", "content": "q"}]
TOOLS = [{"type": "function", "function": {"name": "calc", "parameters": {"type": "object"}}}]


def arrays(d: int, inner: str = "1") -> str:
    return "[" * d + inner + "]" * d


def objects(d: int, inner: str = "1") -> str:
    return '{"a": ' * d + inner + "}" * d


@pytest.fixture(scope="module")
def tok():
    return bpe_tokenizer()


def post(gw: Gateway, key: str, body: bytes | dict, route: str = "chat/completions") -> httpx.Response:
    content = body if isinstance(body, bytes) else json.dumps(body).encode()
    return httpx.post(f"{gw.url}/{route}", content=content, headers={"Authorization": f"Bearer {key}"}, timeout=30)


@pytest.mark.parametrize(
    "text, depth",
    [
        ("1", 0),
        ('"[[{{"', 0),
        ("[]", 1),
        ("{}", 1),
        (arrays(64), 64),
        (objects(65), 65),
        ('[{"a": [1, {"b": []}]}]', 5),
        ('["]]]]", [[]]]', 3),
        ('{"k\\"[[": [[]]}', 3),
        ('["\\\\", [[1]]]', 3),
        ('["\\\\\\"[[[", []]', 2),
        ("[" + '"x",' * 5000 + "[[]]]", 3),
        (arrays(3000), 3000),
        (objects(3000), 3000),
        (arrays(511), 511),
        (objects(512), 512),
        ('"' + arrays(5000) + '"', 0),
        ("]]][[", 0),
        ('["\u00e9[", {"\U0001f600": [[]]}]', 4),
    ],
)
def test_json_depth_counts_brackets_outside_strings(text, depth):
    assert json_depth(text) == depth and json_depth(text.encode()) == depth
    if depth <= 500:  # what json itself parses agrees

        def deepest(x):
            kids = list(x.values()) if isinstance(x, dict) else x if isinstance(x, list) else None
            return 0 if kids is None else 1 + max(map(deepest, kids), default=0)

        try:
            assert deepest(json.loads(text)) == depth
        except json.JSONDecodeError:
            pass
    if depth > MAX_JSON_DEPTH:
        with pytest.raises(TooDeep, match=f"{depth} levels deep"):
            check_json(text)
    else:
        check_json(text)


def test_deep_json_from_the_client_is_refused_by_name(tok):
    policy = Scripted(tok, ["ok"] * 64)
    with Gateway(tok, policy, max_tokens_cap=16) as gw:
        key = gw.open_session()
        for nest in (arrays, objects):
            for d, ok in (
                (MAX_JSON_DEPTH - 5, True),
                (MAX_JSON_DEPTH - 4, True),
                (MAX_JSON_DEPTH - 3, False),
                (5000, False),
                (30_000, False),
            ):  # the body's own levels: 4 above the schema
                tools = [{"type": "function", "function": {"name": "calc", "parameters": "SCHEMA"}}]
                body = json.dumps({"messages": USER, "tools": tools}).replace('"SCHEMA"', nest(d)).encode()
                r = post(gw, key, body)
                assert (r.status_code, ok) in ((200, True), (400, False)), (nest, d, r.text)
                if not ok:
                    assert r.json()["error"]["code"] == "too_deep" and "levels deep" in r.json()["error"]["message"]
            for d, ok in ((MAX_JSON_DEPTH, True), (MAX_JSON_DEPTH + 1, False), (30_000, False)):
                args = objects(d - 1, "[]") if nest is objects else '{"a": ' + arrays(d - 1) + "}"
                said = {
                    "role": "assistant",
                    "content": None,
                    "tool_calls": [{"id": "c1", "type": "function", "function": {"name": "calc", "arguments": args}}],
                }
                r = post(gw, key, {"messages": USER + [said, {"role": "tool", "tool_call_id": "c1", "content": "2"}]})
                assert r.status_code == (200 if ok else 400), (nest, d, r.text)
                if not ok:
                    assert r.json()["error"]["code"] == "too_deep" and "arguments" in r.json()["error"]["message"]
        in_strings = {"messages": [{"role": "user", "content": arrays(2000) + objects(2000)}]}
        assert post(gw, key, in_strings).status_code == 200  # brackets in strings never count
        metrics = gw.metrics()
    assert metrics["refused/too_deep"] == 10 and metrics.get("refused/internal", 0) == 0
    assert metrics["calls"] == 7


def reply(d: int, nest) -> str:
    return (
        'checking <tool_call>{"name": "calc", "arguments": '
        + (objects(d - 2, "{}") if nest is objects else '{"a": ' + arrays(d - 2) + "}")
        + "}</tool_call>"
    )


@pytest.mark.parametrize("nest", [arrays, objects])
def test_a_deep_policy_reply_is_a_recorded_turn_without_calls(tok, nest):
    depths = (MAX_JSON_DEPTH, MAX_JSON_DEPTH + 1, 3000, 20_000)
    script = [reply(d, nest) for d in depths]
    policy = Scripted(tok, script)
    with Gateway(tok, policy, max_tokens_cap=16) as gw:
        key = gw.open_session()
        answers = [
            post(gw, key, {"messages": [{"role": "user", "content": f"q{i}"}], "tools": TOOLS})
            for i in range(len(depths))
        ]
        rec, metrics = gw.close_session(key), gw.metrics()
    assert [a.status_code for a in answers] == [200] * 4
    first = answers[0].json()["choices"][0]
    assert (
        first["finish_reason"] == "tool_calls"
        and json_depth(first["message"]["tool_calls"][0]["function"]["arguments"]) == MAX_JSON_DEPTH - 1
    )  # the arguments object sits one level inside the block
    for a, text in zip(answers[1:], script[1:]):  # past the bound: plain content, the agent sees the text
        msg = a.json()["choices"][0]["message"]
        assert msg["content"] == text and msg.get("tool_calls") is None
    assert metrics["tool_parse_errors"] == 3 and metrics["tool_calls"] == 1 and metrics["calls"] == 4
    sampled = [out.token_ids for _, _, out in policy.log]  # every sampled token is in the trace
    assert [seg.response_ids for seg in rec["segments"]] == sampled
    assert all(set(seg.loss_mask) == {1} for seg in rec["segments"])


def test_any_parser_failure_leaves_the_reply_as_content():
    def crashes(text):
        raise RecursionError("maximum recursion depth exceeded")

    def deep(text):
        nested: dict = {}
        for _ in range(MAX_JSON_DEPTH + 1):
            nested = {"a": nested}
        return None, [{"name": "f", "arguments": nested}]

    def shapeless(text):
        return None, [{"name": 3, "arguments": {}}]

    for name, fn in (("test-crashes", crashes), ("test-deep", deep), ("test-shapeless", shapeless)):
        TOOL_PARSERS.register(name)(fn)
        try:
            assert split_reply(name, "text") == ("text", [], True)
        finally:
            TOOL_PARSERS.unregister(name)
    with pytest.raises(ToolCallError, match="levels deep"):
        hermes(reply(MAX_JSON_DEPTH + 1, arrays))


def raw(gw: Gateway) -> socket.socket:
    host, port = gw.url.split("//")[1].split("/")[0].rsplit(":", 1)
    return socket.create_connection((host, int(port)), timeout=10)


def closed_after(sock: socket.socket, start: float) -> tuple[float, bytes]:
    """(seconds from ``start`` until the server closed the connection, what it sent before)."""
    got = b""
    while chunk := sock.recv(65536):
        got += chunk
    return time.monotonic() - start, got


def test_idle_and_slow_connections_are_closed_within_the_timeouts(tok):
    policy = Scripted(tok, ["ok"] * 4)
    with Gateway(tok, policy, max_tokens_cap=16, header_timeout_s=0.6, body_timeout_s=0.6) as gw:
        key = gw.open_session()
        body = json.dumps({"messages": USER}).encode()
        head = (
            f"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {key}\r\n"
            f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n\r\n"
        ).encode()
        sends = {
            "nothing": b"",
            "partial head": head[:40],
            "head without its end": head[:-2],
            "partial body": head + body[:10],
        }
        socks, start = {}, time.monotonic()
        for name, data in sends.items():
            socks[name] = raw(gw)
            socks[name].sendall(data)
        waited = {name: closed_after(s, start) for name, s in socks.items()}
        for name, (seconds, got) in waited.items():
            assert 0.4 < seconds < 3.0, (name, seconds)
            assert got.startswith(b"HTTP/1.1 408") == (name == "partial body"), (name, got[:80])
        kept = raw(gw)  # a served request, then idle: closed too, counted apart
        kept.sendall(head + body)
        seconds, got = closed_after(kept, time.monotonic())
        assert got.startswith(b"HTTP/1.1 200") and 0.4 < seconds < 3.0
        assert post(gw, key, {"messages": USER}).status_code == 200  # still serving
        time.sleep(0.2)
        metrics = gw.metrics()
    assert metrics["refused/header_timeout"] == 3 and metrics["refused/body_timeout"] == 1
    assert metrics["idle_closed"] >= 1 and metrics["calls"] == 2


def test_requests_in_flight_are_capped_per_session(tok):
    release = threading.Event()
    policy = Scripted(tok, ["ok"] * 8)

    def held(prompt_ids, params, key):
        release.wait(30)
        return policy(prompt_ids, params, key)

    with Gateway(tok, held, max_tokens_cap=16, max_connections=2) as gw:
        key, other = gw.open_session(), gw.open_session()
        codes: list[int] = []
        threads = [
            threading.Thread(target=lambda: codes.append(post(gw, key, {"messages": USER}).status_code))
            for _ in range(2)
        ]
        for t in threads:
            t.start()
        deadline = time.monotonic() + 10
        while gw._sessions[key].open < 2 and time.monotonic() < deadline:
            time.sleep(0.02)
        over = post(gw, key, {"messages": USER})
        assert over.status_code == 429 and over.json()["error"]["code"] == "too_many_connections"
        assert over.headers.get("Connection", "").lower() == "close"
        release.set()
        assert post(gw, other, {"messages": USER}).status_code == 200  # another episode is not held back
        for t in threads:
            t.join(30)
        assert sorted(codes) == [200, 200]
        assert post(gw, key, {"messages": USER}).status_code == 200  # answered: the slots are free again
        metrics = gw.metrics()
    assert metrics["refused/too_many_connections"] == 1 and metrics["calls"] == 4
