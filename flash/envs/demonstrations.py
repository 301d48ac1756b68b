"""Demonstrations held in a dataset column, as warm-start pairs: one per assistant turn.

A demonstration is what follows a row's prompt in a good episode: a string (the one reply), or a
list of chat messages in OpenAI's form -- assistant turns (content, or ``tool_calls`` whose
``arguments`` are a JSON string or an object) with the tool results or user turns between them::

    [{"role": "assistant", "content": null, "tool_calls": [{"id": "c0", "type": "function",
      "function": {"name": "mul", "arguments": "{\\"a\\": 7, \\"b\\": 8}"}}]},
     {"role": "tool", "tool_call_id": "c0", "content": "56"},
     {"role": "assistant", "content": "56"}]

Each assistant turn is one pair: the chat before it (the row's prompt, then the demonstration's
earlier turns, with the tools) and the text the model writes for it, which is what the chat
template renders for that turn after its generation prompt, up to the end-of-turn token. So a
tool call is demonstrated in exactly the form the gateway's parser reads back. A demonstration is
data: it is validated like a request's messages (flash.envs.chat_messages: roles, fields, JSON
arguments bounded in depth) and bounded in length before anything renders it.
"""

from __future__ import annotations

from typing import Any

from flash.envs.chat_messages import BadMessages, parse_messages

MAX_MESSAGES = 64  # per demonstration
MAX_CHARS = 65536  # text in one demonstration


class DemonstrationError(ValueError):
    """A demonstration that cannot be a warm-start pair (the message says why)."""


def _chars(value: Any) -> int:
    if isinstance(value, str):
        return len(value)
    if isinstance(value, dict):
        return sum(_chars(k) + _chars(v) for k, v in value.items())
    if isinstance(value, (list, tuple)):
        return sum(_chars(v) for v in value)
    return 8


def prompt_messages(prompt: Any) -> list[dict]:
    """A row's prompt as chat messages: a string is one user turn."""
    if isinstance(prompt, str):
        return [{"role": "user", "content": prompt}]
    try:
        return parse_messages(list(prompt) if isinstance(prompt, (list, tuple)) else prompt)
    except BadMessages as exc:
        raise DemonstrationError(f"the row's prompt is not a chat: {exc}") from None


def demonstration_messages(demo: Any) -> list[dict]:
    """The demonstration as validated chat messages (a string: one assistant turn)."""
    if isinstance(demo, str):
        demo = [{"role": "assistant", "content": demo}]
    if not isinstance(demo, (list, tuple)) or not demo:
        raise DemonstrationError(
            "a demonstration is the reply (a string) or the turns after the prompt "
            f"(a list of chat messages), got {type(demo).__name__}"
        )
    if len(demo) > MAX_MESSAGES or _chars(demo) > MAX_CHARS:
        raise DemonstrationError(f"a demonstration holds at most {MAX_MESSAGES} messages and {MAX_CHARS} characters")
    try:
        messages = parse_messages(list(demo))
    except BadMessages as exc:
        raise DemonstrationError(str(exc)) from None
    if not any(m["role"] == "assistant" for m in messages):
        raise DemonstrationError("a demonstration has at least one assistant turn")
    return messages


def assistant_text(
    template: str, messages: list[dict], message: dict, tools: list[dict] | None, bos: str, eos: str
) -> str:
    """What the model writes for assistant turn ``message`` after ``messages``: the template's
    rendering of the chat with it, less the rendering up to its generation prompt, cut at the
    end-of-turn token ``eos``."""
    from flash.chat_template import render as bounded_render  # sandboxed Jinja, bounded

    def render(**context):
        return bounded_render(template, "the task's chat template", **context)

    head = render(messages=messages, tools=tools, add_generation_prompt=True, bos_token=bos, eos_token=eos)
    full = render(messages=[*messages, message], tools=tools, add_generation_prompt=False, bos_token=bos, eos_token=eos)
    if not full.startswith(head):
        raise DemonstrationError(
            "the chat template renders an assistant turn that does not follow its generation "
            "prompt; a demonstration cannot be cut out of it"
        )
    body = full[len(head) :]
    cut = body.rfind(eos)
    return body[:cut] if cut >= 0 else body.rstrip()


def demonstration_turns(
    prompt: Any, demo: Any, tools: list[dict] | None, template: str, bos: str = "<bos>", eos: str = "<eos>"
) -> list[tuple[dict, str]]:
    """Warm-start pairs ``({"messages", "tools"}, text)``, one per assistant turn of ``demo``."""
    context, turns = prompt_messages(prompt), demonstration_messages(demo)
    pairs = []
    for i, message in enumerate(turns):
        if message["role"] == "assistant":
            before = context + turns[:i]
            pairs.append(
                ({"messages": before, "tools": tools}, assistant_text(template, before, message, tools, bos, eos))
            )
    return pairs
