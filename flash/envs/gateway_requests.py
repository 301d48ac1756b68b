"""The gateway's HTTP requests read and its responses written: each field of a request body checked,
refused with one line (``Refused``: status, metrics reason, message), and the bodies of OpenAI's
responses and errors (flash.envs.gateway serves them).

A body is a JSON object, NaN and Infinity refused, its nesting bounded before parsing
(flash.envs.json_bounds); a sampling option the engine would not apply (``UNSUPPORTED``) is refused,
never ignored; an engine output that is malformed or continued another prompt is a server fault.
"""

from __future__ import annotations

import ipaddress
import math
import secrets
import time
from collections.abc import Callable
from typing import Any

from aiohttp import web

from flash.engine.base import GenerationOutput, SamplingParams
from flash.envs.chat_messages import openai_calls
from flash.envs.json_bounds import MAX_JSON_DEPTH, TooDeep, loads as bounded_loads

UNSUPPORTED = (  # (field, the values accepted, why others are refused)
    ("n", (None, 1), "one choice per call: each is a turn of the session"),
    ("best_of", (None, 1), "one choice per call: each is a turn of the session"),
    ("stop", (None, [], ""), "a stop string would cut a sampled token; the engine stops on end-of-turn"),
    ("presence_penalty", (None, 0), "the engine samples from the policy as it is"),
    ("frequency_penalty", (None, 0), "the engine samples from the policy as it is"),
    ("logit_bias", (None, {}), "the engine samples from the policy as it is"),
    ("echo", (None, False), "a completion returns the new text only"),
    ("suffix", (None, ""), "a completion continues its prompt"),
    ("tool_choice", (None, "auto", "none"), "the engine cannot force a tool call: the model chooses"),
    ("parallel_tool_calls", (None, True), "the model's reply may hold several calls"),
)


class Refused(Exception):
    """A request the gateway answers with an error: HTTP status, metrics reason, one-line message."""

    def __init__(self, status: int, reason: str, message: str):
        super().__init__(message)
        self.status, self.reason, self.message = status, reason, message


def bad_request(message: str, reason: str = "bad_request") -> Refused:
    return Refused(400, reason, message)


def _show(x: Any) -> str:
    """A value quoted back in a one-line error, cut short (it came from the request)."""
    return text if len(text := repr(x)) <= 40 else text[:37] + "..."


def _no_constants(name: str) -> float:
    raise ValueError(f"{name} is not a number JSON allows")


def parse_body(body: bytes, max_depth: int = MAX_JSON_DEPTH) -> dict:
    """The JSON object of a request body; NaN and Infinity are refused (they are not JSON), and
    so is a body nesting deeper than ``max_depth`` (measured before parsing: flash.envs.json_bounds)."""
    try:
        data = bounded_loads(body, max_depth, parse_constant=_no_constants)
    except TooDeep as exc:
        raise bad_request(f"the body is refused: {exc}", "too_deep") from None
    except (ValueError, UnicodeDecodeError) as exc:
        raise bad_request(f"the body is not valid JSON: {str(exc).splitlines()[0][:120]}", "bad_json") from None
    if not isinstance(data, dict):
        raise bad_request("the body must be a JSON object", "bad_json")
    return data


def _number(body: dict, name: str, default: float, ok: Callable[[float], bool], rule: str) -> float:
    x = body.get(name)
    if x is None:
        return default
    try:
        v = math.nan if isinstance(x, bool) or not isinstance(x, (int, float)) else float(x)
    except OverflowError:  # an integer beyond any float
        v = math.inf
    if not ok(v):  # NaN fails every rule
        raise bad_request(f"{name} must be {rule}, got {_show(x)}", "bad_params")
    return v


def parse_sampling(body: dict, *, cap: int, default_max: int, stop_ids: list[int]) -> SamplingParams:
    """Sampling parameters; an option the engine would not apply is refused, never ignored."""
    for name, allowed, why in UNSUPPORTED:
        if body.get(name) not in allowed:
            raise bad_request(f"{name}={_show(body[name])} is not supported: {why}", "unsupported")
    n = body.get("max_completion_tokens", body.get("max_tokens"))
    n = default_max if n is None else n
    if isinstance(n, bool) or not isinstance(n, int) or not 1 <= n <= cap:
        raise bad_request(f"max_tokens must be an integer in [1, {cap}], got {_show(n)}", "max_tokens")
    temperature = _number(body, "temperature", 1.0, lambda t: 0.0 <= t <= 100.0, "in [0, 100]")
    top_p = _number(body, "top_p", 1.0, lambda p: 0.0 < p <= 1.0, "in (0, 1]")
    seed = body.get("seed")
    if seed is not None and (isinstance(seed, bool) or not isinstance(seed, int) or not 0 <= seed < 2**63):
        raise bad_request(f"seed must be an integer in [0, 2**63), got {_show(seed)}", "bad_params")
    return SamplingParams(
        max_new_tokens=n, temperature=temperature, top_p=top_p, stop_token_ids=list(stop_ids), seed=seed
    )


def parse_prompt(raw: Any) -> str:
    if not isinstance(raw, str) or not raw:
        raise bad_request("prompt must be a non-empty string", "bad_prompt")
    return raw


def check_output(out: GenerationOutput, prompt_ids: list[int]) -> None:
    """Refuse what the engine could not serve; a malformed output, or one that continued another
    prompt than the session's (a ``generate`` that trims or rewrites it), is a server fault."""
    if out.finish_reason == "error":
        raise bad_request(f"the engine refused the request: {out.error}", "engine")
    if out.finish_reason == "abort":
        raise Refused(503, "aborted", "generation was aborted (the engine is stopping); retry")
    n = len(out.token_ids)
    if out.finish_reason not in ("stop", "length") or n == 0 or not n == len(out.logprobs) == len(out.versions):
        raise Refused(
            500, "engine_output", f"the engine returned a malformed output ({out.finish_reason!r}, {n} tokens)"
        )
    if list(out.prompt_ids) != prompt_ids:
        raise Refused(500, "engine_output", "the engine continued a different prompt than the session's")


def is_loopback(host: str) -> bool:
    try:
        return host == "localhost" or ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def error_body(status: int, reason: str, message: str) -> web.Response:
    """An error in OpenAI's shape, which its clients raise as the matching exception type."""
    kind = "server_error" if status >= 500 else {401: "authentication_error"}.get(status, "invalid_request_error")
    return web.json_response(
        {"error": {"message": message, "type": kind, "param": None, "code": reason}}, status=status
    )


def completion_body(
    route: str, model: str, text: str, out: GenerationOutput, prompt_tokens: int, calls: list[dict] | None = None
) -> dict:
    """The OpenAI response object for one served call (chat or text completion); a chat reply
    with tool calls has them in ``tool_calls``, its other text as ``content`` (null when none)."""
    n = len(out.token_ids)
    usage = {"prompt_tokens": prompt_tokens, "completion_tokens": n, "total_tokens": prompt_tokens + n}
    if route == "chat":
        message = {"role": "assistant", "content": text}
        if calls:
            message = {"role": "assistant", "content": text or None, "tool_calls": openai_calls(calls)}
        finish = "tool_calls" if calls and out.finish_reason == "stop" else out.finish_reason
        choice = {"index": 0, "message": message, "finish_reason": finish, "logprobs": None}
        kind, prefix = "chat.completion", "chatcmpl-"
    else:
        choice = {"index": 0, "text": text, "finish_reason": out.finish_reason, "logprobs": None}
        kind, prefix = "text_completion", "cmpl-"
    return {
        "id": prefix + secrets.token_hex(12),
        "object": kind,
        "created": int(time.time()),
        "model": model,
        "choices": [choice],
        "usage": usage,
    }
