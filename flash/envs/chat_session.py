"""Token-exact chat sessions: what an agent says through chat messages, kept as the sampled tokens.

An agent talks to the policy in messages; the trainer must see the very tokens the engine sampled
(docs/design.md invariant 8). Re-rendering the conversation with the chat template each call and
training on that would drift: the template re-tokenizes the decoded reply (``"ab"`` sampled as
``a`` ``b`` may come back as one merged token), drops special tokens, or trims whitespace. So a
session keeps its token sequence and only ever *appends* to it:

    call 1   prompt = render(M_1, gen)                            -> sampled r_1
    call 2   prompt = tokens_1 + tail + render(M_2, gen)[len(F):]  -> sampled r_2        (extends)
             where P = render(M_1, gen), F = render(M_1 + [reply_1]), tail = what the template
             puts after the stop token r_1 ends with (ChatML's ``\\n`` after ``<|im_end|>``)

Call 2 extends the session only if the template is append-only here (F starts with P, the new
render N starts with F) and the agent kept its history (M_2 starts with M_1 and the reply, tool
calls included: F renders the reply as the agent was answered, content and parsed calls). If
not -- a template that rewrites earlier turns, an agent that edited its history -- appending would
put tokens before the engine that no render of M_2 holds, so the session closes its segment and
starts a new one whose prompt is N (counted in ``new_segments``). Each segment is a
``flash.buffers.trace.TokenTrace``, one training sample: the first prompt, then context (mask 0) and
sampled tokens (mask 1) in order; context tokens carry logprob 0.0 and the version of the sampled
token that follows them, so a sample's version (its oldest token) is always a generated token's.

Text completions (``/v1/completions``) follow the same rule on text: the new prompt extends the
session when it starts with the previous prompt + completion text, and only the new text is
tokenized -- as text (``flash.chat_encoding.text_ids``): a prompt that spells a special token
gets its characters, unless the gateway was started with ``raw_completion_prompts`` (the
recipe's ``agent.raw_completion_prompts``, for trusted agents that write raw prompts). A sampled
stop token stays in the sequence (it was sampled) though the text omits it.

The functions are pure but ``record``, which appends one finished call; the gateway owns locking.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from flash.buffers.trace import TokenTrace
from flash.chat_encoding import chat_template_ids, text_ids
from flash.envs.chat_messages import reply_message, same_turns


@dataclass
class ChatSession:
    """What a session remembers between calls (``rendered``: P, the ids last sent for a chat)."""

    segments: list[TokenTrace] = field(default_factory=list)
    mode: str = ""  # "chat" | "completion" (the last call's route)
    tools: list[dict] | None = None
    messages: list[dict] = field(default_factory=list)
    rendered: list[int] = field(default_factory=list)
    reply: str = ""  # the assistant text returned by the last call
    reply_calls: list[dict] = field(default_factory=list)  # and its parsed tool calls
    text: str = ""  # completions: the last prompt text + its completion text
    new_segments: int = 0  # segments started because a call could not extend the session


@dataclass(frozen=True)
class Turn:
    """How one call continues a session: the engine's prompt and the context it adds (mask 0)."""

    prompt_ids: list[int]
    context: list[int]  # appended before the sampled tokens; the whole prompt for a new segment
    new_segment: bool
    mode: str
    tools: list[dict] | None = None
    messages: list[dict] = field(default_factory=list)
    rendered: list[int] = field(default_factory=list)
    text: str = ""


def render(tokenizer: Any, messages: list[dict], tools: list[dict] | None, generation: bool) -> list[int]:
    """The chat template's ids for ``messages``, their text tokenized as text: a message that
    spells a special token gets the spelling's characters, never the control token
    (flash.chat_encoding)."""
    return chat_template_ids(tokenizer, messages, tools, generation)


def turn_tail(assistant_ids: list[int], response_ids: list[int], stop_ids: list[int]) -> list[int] | None:
    """The tokens the template renders after the model's reply, to append after the sampled ones.

    ``assistant_ids`` is the template's rendering of the assistant turn (A = F[len(P):]). A reply
    that ended on a stop token the template also uses gets what A has after that token's last
    occurrence (a ChatML newline; nothing for Llama 3's ``<|eot_id|>``). A reply cut by length gets
    the template's own stop token too (the last stop id in A), so the next turn sees a closed one.
    None: the sampled ending and the template disagree (a stop token A never holds), no splice."""
    if response_ids and response_ids[-1] in stop_ids:
        stop = response_ids[-1]
        if stop not in assistant_ids:
            return None
        return assistant_ids[len(assistant_ids) - assistant_ids[::-1].index(stop) :]
    where = [i for i, t in enumerate(assistant_ids) if t in stop_ids]
    return assistant_ids[where[-1] :] if where else None


def _fresh(ids: list[int], mode: str, **state: Any) -> Turn:
    return Turn(prompt_ids=list(ids), context=list(ids), new_segment=True, mode=mode, **state)


def plan_chat(
    session: ChatSession, tokenizer: Any, messages: list[dict], tools: list[dict] | None, stop_ids: list[int]
) -> Turn:
    """The next chat call's prompt: the session extended when the template and the agent's
    history allow it (module docstring), else a new segment with the plain render N."""
    new = render(tokenizer, messages, tools, True)
    state = {"tools": tools, "messages": list(messages), "rendered": new}
    if not session.segments or session.mode != "chat" or tools != session.tools:
        return _fresh(new, "chat", **state)
    said = session.messages + [reply_message(session.reply, session.reply_calls)]
    if not same_turns(said, messages):
        return _fresh(new, "chat", **state)
    full = render(tokenizer, said, tools, False)
    prev = session.rendered
    if full[: len(prev)] != prev or new[: len(full)] != full:
        return _fresh(new, "chat", **state)
    seg = session.segments[-1]
    tail = turn_tail(full[len(prev) :], seg.response_ids, stop_ids)
    if tail is None:
        return _fresh(new, "chat", **state)
    context = tail + new[len(full) :]
    return Turn(prompt_ids=seg.tokens + context, context=context, new_segment=False, mode="chat", **state)


def plan_completion(session: ChatSession, tokenizer: Any, prompt: str, raw: bool = False) -> Turn:
    """The next text completion's prompt: the session extended by the ids of the new text when
    ``prompt`` starts with the previous prompt + completion, else a new segment (``_encode``)."""
    said = session.text
    if session.segments and session.mode == "completion" and prompt.startswith(said) and prompt != said:
        seg = session.segments[-1]
        context = _encode(tokenizer, prompt[len(said) :], raw)
        return Turn(prompt_ids=seg.tokens + context, context=context, new_segment=False, mode="completion", text=prompt)
    return _fresh(_encode(tokenizer, prompt, raw), "completion", text=prompt)


def _encode(tokenizer: Any, text: str, raw: bool) -> list[int]:
    """Prompt text as text (``text_ids``); ``raw`` (``agent.raw_completion_prompts``, trusted
    agents only): as the tokenizer parses it, special tokens spelled in it included."""
    return list(tokenizer.encode(text, add_special_tokens=False)) if raw else text_ids(tokenizer, text)


def record(
    session: ChatSession,
    turn: Turn,
    response_ids: list[int],
    logprobs: list[float],
    versions: list[int],
    reply: str,
    calls: list[dict] | None = None,
) -> None:
    """Append one finished call: its context (mask 0, logprob 0.0, dated by the first sampled
    token's version) and its sampled tokens (mask 1, the engine's logprobs and versions).
    ``reply`` and ``calls``: what the agent was answered (content, parsed tool calls)."""
    if not response_ids or not len(response_ids) == len(logprobs) == len(versions):
        raise ValueError("a call records at least one sampled token, with a logprob and a version each")
    if turn.new_segment:
        if session.segments:
            session.new_segments += 1
        session.segments.append(TokenTrace(prompt_ids=list(turn.prompt_ids)))
    else:
        n = len(turn.context)
        session.segments[-1].extend(turn.context, [0.0] * n, [versions[0]] * n, trained=False)
    session.segments[-1].extend(response_ids, logprobs, versions, trained=True)
    session.mode, session.tools, session.messages = turn.mode, turn.tools, turn.messages
    session.rendered, session.text = turn.rendered, turn.text + (reply if turn.mode == "completion" else "")
    session.reply, session.reply_calls = reply, list(calls or [])
