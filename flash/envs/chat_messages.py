"""Chat messages and tool calls as the gateway reads and writes them (OpenAI's shapes).

Requests: ``messages`` are validated field by field (invariant 7: a request is data) and brought
to the form chat templates read -- an assistant turn's ``tool_calls`` with ``arguments`` as an
object (OpenAI clients send it as a JSON string; Hugging Face templates render the object), text
``content`` parts joined into one string. ``tools`` go to the template as they are.

Replies: the model writes a tool call as text in its template's format; a **tool-call parser**
(``TOOL_PARSERS``, ``agent.tool_parser``) turns that text into the reply's ``content`` and
``tool_calls``, as vLLM's ``--tool-call-parser`` does. Built in: ``hermes`` -- ``<tool_call>{"name":
..., "arguments": {...}}</tool_call>`` blocks (Hermes 2 Pro, Qwen 2.5/3, and the calculator
recipe's template). A reply whose blocks do not parse (cut by ``max_tokens``, bad JSON) stays plain
content and is counted: the agent sees what the model said, and the sampled tokens are trained
either way. JSON in a block, and a request's ``arguments``, is bounded in nesting depth before it is
parsed (flash.envs.json_bounds): deeper arguments from a client are refused (400, ``too_deep``);
from the policy they are a reply without tool calls. Register another format with ``@TOOL_PARSERS.register("name")`` on a function
``parse(text) -> (content | None, [{"name", "arguments"}])`` that raises ``ToolCallError``.

History: a turn extends its session only when the agent kept what the model said; ``same_turns``
compares role, content and the calls' names and arguments (not the call ids, which a client may
rewrite).
"""

from __future__ import annotations

import json
import re
import secrets
from typing import Any

from flash.algos.registry import Registry
from flash.envs.json_bounds import TooDeep, check_json
from flash.envs.json_bounds import loads as bounded_loads

ROLES = ("system", "developer", "user", "assistant", "tool")
MESSAGE_KEYS = ("role", "content", "name", "tool_call_id", "tool_calls")
MAX_TOOL_CALLS = 32  # per message
TOOL_PARSERS = Registry("tool-call parser", "flash.tool_parsers")


class BadMessages(ValueError):
    """A request's messages or tools are malformed (the gateway answers 400, counted by ``reason``)."""

    def __init__(self, message: str, reason: str = "bad_messages"):
        super().__init__(message)
        self.reason = reason


class ToolCallError(ValueError):
    """A reply's tool-call text does not parse (the reply stays plain content)."""


def _show(x: Any) -> str:
    text = repr(x)
    return text if len(text) <= 40 else text[:37] + "..."


def _text(content: Any, where: str) -> str:
    """A message's content as one string: a string, null (empty) or a list of text parts."""
    if content is None or isinstance(content, str):
        return content or ""
    if isinstance(content, list) and all(
        isinstance(p, dict) and p.get("type") == "text" and isinstance(p.get("text"), str) for p in content
    ):
        return "".join(p["text"] for p in content)
    raise BadMessages(f"{where}.content must be a string or a list of text parts")


def _arguments(raw: Any, where: str) -> dict:
    if isinstance(raw, str):
        try:
            raw = bounded_loads(raw) if raw.strip() else {}
        except TooDeep as exc:
            raise BadMessages(f"{where}.function.arguments: {exc}", "too_deep") from None
        except ValueError:
            raise BadMessages(f"{where}.function.arguments is not valid JSON") from None
    if not isinstance(raw, dict):
        raise BadMessages(f"{where}.function.arguments must be a JSON object")
    return raw


def parse_call(raw: Any, where: str) -> dict:
    """One ``tool_calls`` entry in the template's form: ``{id, type, function: {name, arguments}}``."""
    fn = raw.get("function") if isinstance(raw, dict) else None
    if not isinstance(fn, dict) or raw.get("type", "function") != "function":
        raise BadMessages(f"{where} must be {{id, type: 'function', function: {{name, arguments}}}}")
    if not isinstance(fn.get("name"), str) or not fn["name"]:
        raise BadMessages(f"{where}.function.name must be a non-empty string")
    call_id = raw.get("id") or ""
    if not isinstance(call_id, str):
        raise BadMessages(f"{where}.id must be a string")
    return {
        "id": call_id,
        "type": "function",
        "function": {"name": fn["name"], "arguments": _arguments(fn.get("arguments"), where)},
    }


def parse_message(m: Any, i: int) -> dict:
    where = f"messages[{i}]"
    if not isinstance(m, dict):
        raise BadMessages(f"{where} must be an object with role and content")
    if m.get("role") not in ROLES:
        raise BadMessages(f"{where}.role must be one of {', '.join(ROLES)}")
    extra = sorted(k for k, v in m.items() if v is not None and k not in MESSAGE_KEYS)
    if extra:
        raise BadMessages(f"{where} has an unsupported field {_show(extra[0])}")
    out = {"role": m["role"], "content": _text(m.get("content"), where)}
    for key in ("name", "tool_call_id"):
        if m.get(key) is not None:
            if not isinstance(m[key], str):
                raise BadMessages(f"{where}.{key} must be a string")
            out[key] = m[key]
    calls = m.get("tool_calls")
    if calls:
        if m["role"] != "assistant" or not isinstance(calls, list) or len(calls) > MAX_TOOL_CALLS:
            raise BadMessages(
                f"{where}.tool_calls must be a list of at most {MAX_TOOL_CALLS} calls on an assistant message"
            )
        out["tool_calls"] = [parse_call(c, f"{where}.tool_calls[{j}]") for j, c in enumerate(calls)]
    elif m.get("content") is None:
        raise BadMessages(f"{where}.content must be a string (null only beside tool_calls)")
    return out


def parse_messages(raw: Any) -> list[dict]:
    """Chat messages in the template's form (module docstring); fields set to null are ignored,
    any other field is refused rather than silently dropped."""
    if not isinstance(raw, list) or not raw:
        raise BadMessages("messages must be a non-empty list of {role, content} objects")
    return [parse_message(m, i) for i, m in enumerate(raw)]


def parse_tools(raw: Any) -> list[dict] | None:
    """Tool schemas handed to the chat template as they are; an empty list is no tools."""
    if raw is None or raw == []:
        return None
    if not isinstance(raw, list) or not all(isinstance(t, dict) for t in raw):
        raise BadMessages("tools must be a list of objects")
    return raw


def _turn_key(m: dict) -> tuple:
    calls = tuple(
        (c["function"]["name"], json.dumps(c["function"]["arguments"], sort_keys=True))
        for c in m.get("tool_calls") or ()
    )
    return m["role"], m.get("content") or "", calls


def same_turns(old: list[dict], new: list[dict]) -> bool:
    """Whether ``new`` starts with ``old`` (role, content, tool calls' names and arguments)."""
    return len(new) >= len(old) and all(_turn_key(a) == _turn_key(b) for a, b in zip(old, new))


def reply_message(content: str, calls: list[dict]) -> dict:
    """The model's reply as a history message (what a well-behaved agent sends back)."""
    out = {"role": "assistant", "content": content}
    if calls:
        out["tool_calls"] = [
            {"id": c["id"], "type": "function", "function": {"name": c["name"], "arguments": c["arguments"]}}
            for c in calls
        ]
    return out


def openai_calls(calls: list[dict]) -> list[dict]:
    """The reply's ``tool_calls`` as OpenAI sends them (``arguments`` a JSON string)."""
    return [
        {"id": c["id"], "type": "function", "function": {"name": c["name"], "arguments": json.dumps(c["arguments"])}}
        for c in calls
    ]


def _checked_calls(calls: Any) -> list[dict]:
    """A parser's calls, each ``{name: str, arguments: dict}`` nesting within the JSON bound."""
    if not isinstance(calls, list) or len(calls) > MAX_TOOL_CALLS:
        raise ToolCallError(f"a parser returns a list of at most {MAX_TOOL_CALLS} calls")
    for c in calls:
        if not (isinstance(c, dict) and isinstance(c.get("name"), str) and isinstance(c.get("arguments"), dict)):
            raise ToolCallError("a parsed call needs a string name and object arguments")
        check_json(json.dumps(c["arguments"]))
    return [{"name": c["name"], "arguments": c["arguments"]} for c in calls]


def split_reply(parser: str | None, text: str) -> tuple[str, list[dict], bool]:
    """(content, calls with fresh ids, parse failed) of a reply; no parser: the text as it is.
    Any failure of the parser (its own error, JSON nested past the bound, a crash, a malformed
    result) leaves the reply as plain content: the turn is still served and its tokens recorded."""
    if not parser:
        return text, [], False
    try:
        content, calls = TOOL_PARSERS.get(parser).fn(text)
        calls = _checked_calls(calls)
        content = content or ""
        if not isinstance(content, str):
            raise ToolCallError("a parser's content is a string or None")
    except Exception:  # noqa: BLE001 - RecursionError included: the policy's text is data
        return text, [], True
    return content, [{**c, "id": "call_" + secrets.token_hex(8)} for c in calls], False


def parse_stream(body: dict) -> tuple[bool, bool]:
    """(stream, include usage): ``stream`` and ``stream_options`` of a request, validated."""
    stream, options = body.get("stream"), body.get("stream_options")
    if stream not in (None, True, False):
        raise BadMessages("stream must be true or false")
    if options is not None and (
        not isinstance(options, dict)
        or set(options) - {"include_usage"}
        or options.get("include_usage") not in (None, True, False)
    ):
        raise BadMessages("stream_options may only hold include_usage (true or false)")
    return bool(stream), bool((options or {}).get("include_usage"))


def stream_chunks(body: dict, include_usage: bool) -> list[dict]:
    """A finished response as the chunks OpenAI streams (server-sent events): the reply is
    generated whole (one engine request per turn), then sent as a content chunk, a tool-calls
    chunk, a finish chunk and, when asked, a usage chunk."""
    choice, chat = body["choices"][0], body["object"] == "chat.completion"
    head = {
        "id": body["id"],
        "object": "chat.completion.chunk" if chat else "text_completion",
        "created": body["created"],
        "model": body["model"],
    }
    if chat:
        msg = choice["message"]
        deltas = [{"role": "assistant", "content": msg["content"] or ""}]
        if msg.get("tool_calls"):
            deltas.append({"tool_calls": [{"index": i, **c} for i, c in enumerate(msg["tool_calls"])]})
        parts = [{"index": 0, "delta": d, "finish_reason": None, "logprobs": None} for d in deltas]
        parts.append({"index": 0, "delta": {}, "finish_reason": choice["finish_reason"], "logprobs": None})
    else:
        parts = [
            {"index": 0, "text": choice["text"], "finish_reason": None, "logprobs": None},
            {"index": 0, "text": "", "finish_reason": choice["finish_reason"], "logprobs": None},
        ]
    chunks = [{**head, "choices": [p]} for p in parts]
    if include_usage:
        chunks.append({**head, "choices": [], "usage": body["usage"]})
    return chunks


_HERMES = re.compile(r"<tool_call>(.*?)</tool_call>", re.S)


@TOOL_PARSERS.register("hermes")
def hermes(text: str) -> tuple[str | None, list[dict]]:
    """``<tool_call>{"name": N, "arguments": {...}}</tool_call>`` blocks; the rest is content."""
    calls = []
    for block in _HERMES.findall(text):
        try:
            obj = bounded_loads(block)
        except ValueError as exc:
            raise ToolCallError(f"a <tool_call> block is not JSON within bounds: {exc}") from None
        args = obj.get("arguments", obj.get("parameters", {})) if isinstance(obj, dict) else None
        if not isinstance(obj.get("name") if isinstance(obj, dict) else None, str) or not isinstance(args, dict):
            raise ToolCallError("a <tool_call> block needs a string name and object arguments")
        calls.append({"name": obj["name"], "arguments": args})
    rest = _HERMES.sub("", text)
    if "<tool_call>" in rest or len(calls) > MAX_TOOL_CALLS:
        raise ToolCallError("an unclosed <tool_call> block (cut by max_tokens?) or too many calls")
    return rest.strip() or None, calls
