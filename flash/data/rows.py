"""One dataset row → one ``TaskItem``: the prompt (text, or chat messages), the reference answer,
and every other column for the reward.

A prompt is either text (``prompt_key`` names a string column, or ``template`` formats several
columns) or a chat: a ``messages``-style column holding ``[{role, content}, ...]``. A
``system_prompt`` turns either into messages with that system turn first (a chat that already has
a system turn keeps its own). Text prompts stay text, so the tokenizer's chat template (or none,
for the character tokenizer) decides how they are wrapped (``flash.models.encode_prompt``).

A row that cannot make an item raises ``BadRow`` with a short reason (``missing_key``,
``wrong_type``, ``empty``, ``bad_answer``): the input guard skips and counts it per reason, or
stops the run under ``data.strict``.
"""

from __future__ import annotations

import json
import string
from dataclasses import dataclass

from flash.tasks import TaskItem

ROLES = ("system", "user", "assistant", "tool")


class BadRow(ValueError):
    """A row that cannot become a prompt; ``reason`` names the kind (a metric's suffix)."""

    def __init__(self, reason: str, detail: str) -> None:
        super().__init__(detail)
        self.reason = reason


@dataclass(frozen=True)
class RowSpec:
    """How a row's columns make an item (the ``data:`` keys that shape prompts)."""

    prompt_key: str = "prompt"
    answer_key: str = "answer"
    system_prompt: str | None = None
    template: str | None = None
    reward_key: str | None = None


def template_fields(template: str) -> list[str]:
    """The column names a template uses. Only plain ``{name}`` fields (with an optional format
    spec) are allowed: attribute and index access (``{x.__class__}``, ``{x[0]}``) would let a
    recipe reach into Python objects, so they are refused."""
    names = []
    for _, field, _, _ in string.Formatter().parse(template):
        if field is None:
            continue
        if not field.isidentifier():
            raise ValueError(f"data.template field {{{field}}} must be a plain column name "
                             f"(no attribute, index or positional fields)")
        names.append(field)
    if not names:
        raise ValueError("data.template uses no column: write e.g. 'Question: {question}\\nAnswer:'")
    return names


def _column(row: dict, key: str):
    if key not in row or row[key] is None:
        raise BadRow("missing_key", f"row has no value in column {key!r}")
    return row[key]


def _messages(value) -> list[dict]:
    if not isinstance(value, list) or not value:
        raise BadRow("wrong_type", f"a chat prompt must be a non-empty list of {{role, content}}, got "
                                   f"{type(value).__name__}")
    out = []
    for turn in value:
        if not isinstance(turn, dict) or not isinstance(turn.get("content"), str) or turn.get("role") not in ROLES:
            raise BadRow("wrong_type", f"a chat turn must be {{role: one of {list(ROLES)}, content: text}}, "
                                       f"got {str(turn)[:80]}")
        out.append({"role": turn["role"], "content": turn["content"]})
    return out


def render_prompt(row: dict, spec: RowSpec) -> str | list[dict]:
    """The row's prompt: text, or a list of chat turns (see the module docstring)."""
    if spec.template:
        values = {name: _column(row, name) for name in template_fields(spec.template)}
        prompt: str | list[dict] = spec.template.format_map(values)
    else:
        value = _column(row, spec.prompt_key)
        if isinstance(value, str):
            prompt = value
        else:
            prompt = _messages(value)
    if isinstance(prompt, str):
        if not prompt.strip():
            raise BadRow("empty", f"column {spec.prompt_key!r} is empty")
        return prompt if spec.system_prompt is None else [
            {"role": "system", "content": spec.system_prompt}, {"role": "user", "content": prompt}]
    if not any(t["content"].strip() for t in prompt if t["role"] != "system"):
        raise BadRow("empty", "the chat has no non-empty turn besides the system prompt")
    if spec.system_prompt is not None and prompt[0]["role"] != "system":
        prompt = [{"role": "system", "content": spec.system_prompt}] + prompt
    return prompt


def answer_text(value) -> str:
    """The reference as text for the reward: strings as they are, other JSON values as JSON (a
    boolean is ``true``, as the file writes it, not Python's ``True``)."""
    if isinstance(value, str):
        return value
    return json.dumps(value) if isinstance(value, (list, dict, bool)) else str(value)


# what flash adds to a row's other columns in ``item.meta``, replacing columns of the same name
OWN_META = {"row": "the row number", "epoch": "the pass over the data", "split": "train or eval",
            "reward_fn": "the reward named by data.reward_key"}


def row_item(row: dict, spec: RowSpec, index: int, meta: dict) -> TaskItem:
    """The ``TaskItem`` of ``row``; ``meta`` (e.g. the row number) is added to the other columns.
    A column named ``reward_fn`` never chooses the reward: only ``data.reward_key`` does."""
    prompt = render_prompt(row, spec)
    answer = answer_text(_column(row, spec.answer_key))
    extra = {k: v for k, v in row.items() if k not in (spec.prompt_key, spec.answer_key, "reward_fn")}
    if spec.reward_key is not None:
        name = _column(row, spec.reward_key)
        if not isinstance(name, str) or not name:
            raise BadRow("wrong_type", f"column {spec.reward_key!r} must name a reward, got {name!r}")
        extra["reward_fn"] = name
    return TaskItem(index=index, prompt=prompt, answer=answer, meta={**extra, **meta})


def prompt_text(prompt: str | list[dict]) -> str:
    """A prompt as one readable text (chats as ``role: content`` lines), for logs and judges."""
    if isinstance(prompt, str):
        return prompt
    return "\n".join(f"{t['role']}: {t['content']}" for t in prompt)
