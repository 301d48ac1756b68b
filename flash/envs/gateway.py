"""The agent gateway: an OpenAI-compatible HTTP server whose every call is a token-exact turn.

User agent code talks to the policy with any OpenAI client (``base_url`` = ``Gateway.start()``,
``api_key`` = a key from ``open_session``). Each call becomes one engine request whose prompt is
the session's tokens so far, and what was sampled is recorded as ``flash.envs.chat_session``
lays it out, so training sees exactly the sampled tokens (docs/design.md invariant 8). The gateway
knows nothing of the scheduler: the caller passes a blocking ``generate(prompt_ids, params,
session_key) -> GenerationOutput`` wired to an engine, and collects a session's segments with
``close_session``.

Tools: a chat request's ``tools`` go to the chat template; the reply's tool-call text becomes
``tool_calls`` through the gateway's tool-call parser, and assistant turns with ``tool_calls`` and
``tool`` turns are read back (flash.envs.chat_messages).

Routes: ``POST /v1/chat/completions``, ``POST /v1/completions``, ``GET /v1/models``; responses in
OpenAI's JSON shape, one choice, streamed as server-sent events on ``stream: true`` (the reply is
generated whole, then sent in chunks). Requests are data (invariant 7): bodies are bounded in size
(413) and nesting (400 ``too_deep``, measured before parsing), parsed without NaN or Infinity, and
validated field by field (400 with one line; flash.envs.gateway_requests); a request head must
arrive within ``header_timeout_s`` and a body within ``body_timeout_s`` (flash.envs.conn_guard;
408), and a session has at most ``max_connections`` requests in flight (429). Message and prompt
text is text (flash.chat_encoding; ``raw_completion_prompts=True``: completions prompts parse
special tokens, for trusted agents). A refused request never stops the server and is counted by
reason in ``metrics()``. Every call needs a live session key (401 otherwise); the server binds to
loopback unless ``allow_remote=True``.

Why aiohttp: it runs on a plain asyncio loop (one daemon thread, started and stopped by two
methods) and comes with what flash already installs beside Ray; FastAPI would need an ASGI server
with its own signal handling. Generation and tokenization run in a thread pool: the loop only
parses and routes, so a slow engine call never stalls the other sessions.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import secrets
import socket
import threading
from collections import Counter
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

from aiohttp import web

from flash.chat_encoding import SpecialTokenInText
from flash.engine.base import GenerationOutput, SamplingParams
from flash.envs.chat_messages import (
    TOOL_PARSERS,
    BadMessages,
    parse_messages,
    parse_stream,
    parse_tools,
    split_reply,
    stream_chunks,
)
from flash.envs.chat_session import ChatSession, Turn, plan_chat, plan_completion, record
from flash.envs.conn_guard import ConnectionGuard
from flash.envs.gateway_requests import (
    Refused,
    bad_request,
    check_output,
    completion_body,
    error_body,
    is_loopback,
    parse_body,
    parse_prompt,
    parse_sampling,
)

MiB = 1 << 20
Generate = Callable[[list[int], SamplingParams, str], GenerationOutput]


@dataclass
class _Entry:
    """A live session: its token state, the caller's meta, one record per served call."""

    meta: dict
    state: ChatSession = field(default_factory=ChatSession)
    calls: list[dict] = field(default_factory=list)
    lock: asyncio.Lock = field(default_factory=asyncio.Lock)  # one call at a time per session
    open: int = 0  # requests of this session in flight (each holds a connection)


class Gateway:
    """The HTTP server and its sessions (module docstring); thread-safe public methods."""

    def __init__(
        self,
        tokenizer: Any,
        generate: Generate,
        host: str = "127.0.0.1",
        port: int = 0,
        *,
        max_body_bytes: int = MiB,
        max_tokens_cap: int = 4096,
        default_max_tokens: int | None = None,
        stop_token_ids: list[int] | None = None,
        model_name: str = "flash-policy",
        allow_remote: bool = False,
        workers: int = 8,
        tool_parser: str | None = "hermes",
        header_timeout_s: float = 30.0,
        body_timeout_s: float = 60.0,
        max_connections: int = 16,
        raw_completion_prompts: bool = False,
    ):
        if not allow_remote and not is_loopback(host):
            raise ValueError(
                f"host {host!r} is not loopback: pass allow_remote=True to listen beyond this "
                "machine (every call still needs a session key)"
            )
        if max_tokens_cap < 1 or max_body_bytes < 1 or max_connections < 1:
            raise ValueError("max_tokens_cap, max_body_bytes and max_connections must be >= 1")
        if not (header_timeout_s > 0 and body_timeout_s > 0):
            raise ValueError("header_timeout_s and body_timeout_s must be > 0")
        self.tokenizer, self.generate, self.host, self.port = tokenizer, generate, host, port
        self.max_body_bytes, self.max_tokens_cap, self.model_name = max_body_bytes, max_tokens_cap, model_name
        self.default_max_tokens = min(default_max_tokens or max_tokens_cap, max_tokens_cap)
        if tool_parser:
            TOOL_PARSERS.get(tool_parser)  # an unknown name fails here, with the valid ones
        self.tool_parser = tool_parser or None
        self.stop_token_ids = list(stop_token_ids or [tokenizer.eos_token_id])
        self._sessions: dict[str, _Entry] = {}
        self._metrics: Counter = Counter()
        self.body_timeout_s, self.max_connections, self.raw = body_timeout_s, max_connections, raw_completion_prompts
        self._conns = ConnectionGuard(header_timeout_s, lambda name: self._count({name: 1}))
        self._lock = threading.Lock()  # sessions and metrics, shared with the callers' threads
        self._tok_lock = threading.Lock()  # a fast tokenizer is not safe to share between threads
        self._pool = ThreadPoolExecutor(max_workers=workers, thread_name_prefix="flash-gateway")
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._runner: web.AppRunner | None = None
        self._server: asyncio.Server | None = None
        self._closed = False
        self.url = ""

    # ---- lifecycle ---------------------------------------------------------------------------
    def start(self) -> str:
        """Start serving in a daemon thread (once); returns the base URL an OpenAI client takes."""
        if self._closed:
            raise RuntimeError("this gateway was closed; make a new one")
        if self._thread is None:
            self._loop = asyncio.new_event_loop()
            self._thread = threading.Thread(target=self._loop.run_forever, name="flash-gateway", daemon=True)
            self._thread.start()
            port = asyncio.run_coroutine_threadsafe(self._listen(), self._loop).result(timeout=30)
            host = f"[{self.host}]" if ":" in self.host else self.host
            self.url = f"http://{host}:{port}/v1"
        return self.url

    async def _listen(self) -> int:
        app = web.Application(client_max_size=self.max_body_bytes, middlewares=[self._guard])
        app.add_routes(
            [
                web.post("/v1/chat/completions", self._chat),
                web.post("/v1/completions", self._text),
                web.get("/v1/models", self._models),
            ]
        )
        self._runner = web.AppRunner(app, access_log=None)
        await self._runner.setup()
        family, kind, proto, _, addr = socket.getaddrinfo(self.host, self.port, type=socket.SOCK_STREAM)[0]
        sock = socket.socket(family, kind, proto)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(addr)
        loop = asyncio.get_running_loop()
        self._server = await loop.create_server(self._conns.protocol(self._runner.server), sock=sock)
        return sock.getsockname()[1]

    async def _stop(self) -> None:
        """Stop listening, close every connection, and end the tasks still serving one."""
        self._server.close()
        await self._runner.cleanup()
        tasks = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)

    def close(self) -> None:
        """Stop serving; open sessions stay readable through ``close_session``."""
        self._closed = True
        self._pool.shutdown(wait=False, cancel_futures=True)
        if self._thread is None:
            return
        if self._runner is not None:
            asyncio.run_coroutine_threadsafe(self._stop(), self._loop).result(timeout=30)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(timeout=30)
        self._loop.close()
        self._thread = self._loop = self._runner = self._server = None

    def __enter__(self) -> Gateway:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ---- sessions and metrics ----------------------------------------------------------------
    def open_session(self, meta: dict | None = None) -> str:
        """A fresh session; its key is the agent's API key (``Authorization: Bearer <key>``)."""
        key = secrets.token_urlsafe(24)
        with self._lock:
            self._sessions[key] = _Entry(meta=dict(meta or {}))
        return key

    def close_session(self, key: str) -> dict:
        """Forget a session (its key is refused from now on) and return what it recorded:
        ``segments`` (``flash.buffers.trace.TokenTrace``), ``calls`` (one dict per served call), counters."""
        with self._lock:
            entry = self._sessions.pop(key)
        s = entry.state
        return {
            "meta": entry.meta,
            "segments": list(s.segments),
            "calls": list(entry.calls),
            "new_segments": s.new_segments,
            "tokens_in": sum(c["prompt_tokens"] for c in entry.calls),
            "tokens_out": sum(c["completion_tokens"] for c in entry.calls),
        }

    def metrics(self) -> dict[str, int]:
        """Counters: ``calls``, ``refused/<reason>``, ``idle_closed`` (flash.envs.conn_guard),
        ``new_segments``, ``tokens_in``, ``tokens_out``, ``tool_calls`` (parsed from replies),
        ``tool_parse_errors`` (replies left as plain content); ``connections_open`` now."""
        with self._lock:
            return {
                "calls": 0,
                "new_segments": 0,
                "tokens_in": 0,
                "tokens_out": 0,
                "tool_calls": 0,
                "tool_parse_errors": 0,
                **self._metrics,
                "sessions_open": len(self._sessions),
                "connections_open": self._conns.open_connections(),
            }

    def _count(self, deltas: dict[str, int]) -> None:
        with self._lock:
            self._metrics.update(deltas)

    # ---- serving -----------------------------------------------------------------------------
    @web.middleware
    async def _guard(self, request: web.Request, handler: Callable) -> web.StreamResponse:
        """Every refusal as an OpenAI error, counted; an unexpected fault is a 500, never a crash.
        A request whose body came too slowly (408) or over its session's cap (429) also closes its
        connection. While a request is served its connection has no head deadline (ConnectionGuard)."""
        self._conns.busy(request.transport)
        try:
            return await handler(request)
        except Refused as r:
            self._count({f"refused/{r.reason}": 1})
            response = error_body(r.status, r.reason, r.message)
            if r.status in (408, 429):
                response.force_close()
            return response
        except web.HTTPException:
            raise
        except Exception as exc:  # noqa: BLE001 - answered and counted; the server keeps serving
            self._count({"refused/internal": 1})
            return error_body(500, "internal", f"internal error: {type(exc).__name__}")
        finally:
            self._conns.idle(request.transport)

    def _entry(self, request: web.Request) -> tuple[str, _Entry]:
        auth = request.headers.get("Authorization", "")
        key = auth[7:].strip() if auth[:7].lower() == "bearer " else ""
        with self._lock:
            entry = self._sessions.get(key) if key else None
        if entry is None:
            raise Refused(
                401, "unauthorized", "unknown or closed session key: open a session and pass its key as the API key"
            )
        return key, entry

    async def _body(self, request: web.Request) -> dict:
        if (request.content_length or 0) > self.max_body_bytes:
            raise Refused(413, "too_large", f"the body is over {self.max_body_bytes} bytes")
        try:
            raw = await asyncio.wait_for(request.read(), self.body_timeout_s)
        except web.HTTPRequestEntityTooLarge:
            raise Refused(413, "too_large", f"the body is over {self.max_body_bytes} bytes") from None
        except asyncio.TimeoutError:
            raise Refused(
                408, "body_timeout", f"the body did not arrive within {self.body_timeout_s:g} s: send it whole, at once"
            ) from None
        return parse_body(raw)

    @contextlib.contextmanager
    def _slot(self, entry: _Entry):
        """One of the session's ``max_connections`` requests in flight (each holds a connection), or 429."""
        if entry.open >= self.max_connections:
            raise Refused(
                429,
                "too_many_connections",
                f"this session has {entry.open} requests open, the most one episode may: wait for an answer first",
            )
        entry.open += 1
        try:
            yield
        finally:
            entry.open -= 1

    async def _models(self, request: web.Request) -> web.Response:
        self._entry(request)
        return web.json_response(
            {"object": "list", "data": [{"id": self.model_name, "object": "model", "created": 0, "owned_by": "flash"}]}
        )

    async def _chat(self, request: web.Request) -> web.StreamResponse:
        key, entry = self._entry(request)
        with self._slot(entry):
            return await self._chat_call(request, key, entry)

    async def _chat_call(self, request: web.Request, key: str, entry: _Entry) -> web.StreamResponse:
        body = await self._body(request)
        try:
            messages, tools = parse_messages(body.get("messages")), parse_tools(body.get("tools"))
        except BadMessages as exc:
            raise bad_request(str(exc), exc.reason) from None
        params, stream = self._params(body), self._stream(body)
        parser = self.tool_parser if tools and body.get("tool_choice") != "none" else None
        response = await self._serve(
            key,
            entry,
            "chat",
            params,
            plan_chat,
            entry.state,
            self.tokenizer,
            messages,
            tools,
            self.stop_token_ids,
            parser=parser,
        )
        return await self._answer(request, response, stream)

    async def _text(self, request: web.Request) -> web.StreamResponse:
        key, entry = self._entry(request)
        with self._slot(entry):
            body = await self._body(request)
            prompt, params, stream = parse_prompt(body.get("prompt")), self._params(body), self._stream(body)
            response = await self._serve(
                key, entry, "text", params, plan_completion, entry.state, self.tokenizer, prompt, self.raw
            )
            return await self._answer(request, response, stream)

    @staticmethod
    def _stream(body: dict) -> tuple[bool, bool]:
        try:
            return parse_stream(body)
        except BadMessages as exc:
            raise bad_request(str(exc), "bad_params") from None

    @staticmethod
    async def _answer(request: web.Request, body: dict, stream: tuple[bool, bool]) -> web.StreamResponse:
        """The response as JSON, or streamed as server-sent events (``stream: true``)."""
        if not stream[0]:
            return web.json_response(body)
        out = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"})
        await out.prepare(request)
        for chunk in stream_chunks(body, stream[1]):
            await out.write(f"data: {json.dumps(chunk)}\n\n".encode())
        await out.write(b"data: [DONE]\n\n")
        await out.write_eof()
        return out

    def _params(self, body: dict) -> SamplingParams:
        return parse_sampling(
            body, cap=self.max_tokens_cap, default_max=self.default_max_tokens, stop_ids=self.stop_token_ids
        )

    async def _serve(
        self,
        key: str,
        entry: _Entry,
        route: str,
        params: SamplingParams,
        plan: Callable[..., Turn],
        *args: Any,
        parser: str | None = None,
    ) -> dict:
        """One call: plan the prompt, generate, record; the response body (one call per session at a time);
        ``parser`` splits a chat reply into content and tool calls (flash.envs.chat_messages)."""
        loop = asyncio.get_running_loop()
        async with entry.lock:
            turn = await loop.run_in_executor(self._pool, self._tokenized, plan, *args)
            try:
                out = await loop.run_in_executor(self._pool, self.generate, list(turn.prompt_ids), params, key)
            except Exception as exc:  # noqa: BLE001 - the caller's engine failed: a 500, counted
                raise Refused(500, "generate", f"generation failed: {type(exc).__name__}: {exc}"[:300]) from None
            check_output(out, turn.prompt_ids)
            text = await loop.run_in_executor(self._pool, self._tokenized, self._reply_text, out.token_ids)
            content, calls, failed = split_reply(parser, text)
            self._record(key, entry, turn, out, content, calls, failed)
        return completion_body(route, self.model_name, content, out, len(turn.prompt_ids), calls)

    def _tokenized(self, fn: Callable, *args: Any) -> Any:
        """Run ``fn`` with the tokenizer to itself; a template that cannot render is the request's fault."""
        with self._tok_lock:
            try:
                return fn(*args)
            except Exception as exc:  # noqa: BLE001 - jinja and tokenizer errors are bad input
                first = str(exc).splitlines()[0] if str(exc) else ""
                raise bad_request(
                    f"the tokenizer or chat template could not process the request: {type(exc).__name__}: {first}"[
                        :300
                    ],
                    "special_token" if isinstance(exc, SpecialTokenInText) else "template",
                ) from None

    def _reply_text(self, ids: list[int]) -> str:
        """The reply as text: the trailing stop token dropped, special tokens skipped."""
        ids = ids[:-1] if ids and ids[-1] in self.stop_token_ids else ids
        return self.tokenizer.decode(ids, skip_special_tokens=True)

    def _record(
        self, key: str, entry: _Entry, turn: Turn, out: GenerationOutput, text: str, calls: list[dict], failed: bool
    ) -> None:
        with self._lock:
            if self._sessions.get(key) is not entry:
                raise Refused(401, "unauthorized", "the session was closed during the call")
            segments = len(entry.state.segments)
            record(entry.state, turn, out.token_ids, out.logprobs, out.versions, text, calls)
            restarted = bool(turn.new_segment and segments)
            entry.calls.append(
                {
                    "route": turn.mode,
                    "prompt_tokens": len(turn.prompt_ids),
                    "completion_tokens": len(out.token_ids),
                    "finish_reason": out.finish_reason,
                    "new_segment": turn.new_segment,
                    "segment": len(entry.state.segments) - 1,
                    "tool_calls": len(calls),
                }
            )
            self._metrics.update(
                {
                    "calls": 1,
                    "new_segments": int(restarted),
                    "tool_calls": len(calls),
                    "tool_parse_errors": int(failed),
                    "tokens_in": len(turn.prompt_ids),
                    "tokens_out": len(out.token_ids),
                }
            )
