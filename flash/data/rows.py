"""One dataset row → one ``TaskItem``: the prompt (text, or chat messages), the reference answer,
and every other column for the reward.

A prompt is either text (``prompt_key`` names a string column, or ``template`` formats several
columns) or a chat: a ``messages``-style column holding ``[{role, content}, ...]``. A
``system_prompt`` turns either into messages with that system turn first (a chat that already has
a system turn keeps its own). Text prompts stay text, so the tokenizer's chat template (or none,
for the character tokenizer) decides how they are wrapped (``flash.models.encode_prompt``).

A row that cannot make an item raises ``BadRow`` with a short reason (``missing_key``,
``wrong_type``, ``empty``, ``bad_answer``, ``bad_reward_name``): the input guard skips and counts it
per reason, or stops the run under ``data.strict``.

A row never names code: its ``reward_key`` column may only hold one of ``RowSpec.reward_names``
(the rewards the recipe lists in ``data.rewards`` and the registered reward names); any other text,
an import path such as ``os:system`` included, is a ``bad_reward_name`` row, never looked up.
"""

from __future__ import annotations

import json
import re
import string
from dataclasses import dataclass
from functools import lru_cache

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
    reward_names: frozenset[str] = frozenset()  # what a reward_key column may name


MAX_TEMPLATE_WIDTH = 4096  # the largest width or precision a data.template field may ask for
_SPEC = re.compile(
    r"(?:(?P<fill>.)?[<>=^])?[-+ ]?z?#?0?(?P<width>\d*)[,_]?(?:\.(?P<precision>\d*))?"
    r"[bcdeEfFgGnosxX%]?",
    re.DOTALL,
)
_HOW = (
    "fields are plain column names with an optional format spec of bounded width, e.g. "
    "'Question: {question}' or '{id:>6}'"
)


@dataclass(frozen=True)
class TemplateField:
    """One ``{name:spec}`` of a template: a column name and a format spec with no fields inside."""

    name: str
    spec: str


@lru_cache(maxsize=64)
def parse_template(template: str) -> tuple[str | TemplateField, ...]:
    """``template`` as literal text and fields, parsed once; ValueError (one line naming the field
    and the fix) for anything but a plain column name with a plain format spec: attribute, index
    or positional fields (``{x.__class__}``, ``{x[0]}``, ``{}``), conversions (``{x!r}``), fields
    nested in a spec (``{x:{y}}``) and widths or precisions over ``MAX_TEMPLATE_WIDTH``."""
    try:
        parsed = list(string.Formatter().parse(template))
    except ValueError as exc:
        raise ValueError(
            f"data.template is not a valid format string ({exc}); write literal braces as '{{{{' and '}}}}'"
        ) from None
    pieces: list[str | TemplateField] = []
    for literal, name, spec, conversion in parsed:
        if literal:
            pieces.append(literal)
        if name is None:
            continue
        shown = "{" + name + (f"!{conversion}" if conversion else "") + (f":{spec}" if spec else "") + "}"
        shown = shown if len(shown) <= 80 else shown[:77] + "..."
        if not name.isidentifier():
            raise ValueError(
                f"data.template field {shown} must be a plain column name (no attribute, "
                f"index or positional fields); {_HOW}"
            )
        if conversion:
            raise ValueError(f"data.template field {shown} has a conversion (!{conversion}); drop it: {_HOW}")
        pieces.append(TemplateField(name, _checked_spec(shown, spec or "")))
    if not any(isinstance(p, TemplateField) for p in pieces):
        raise ValueError("data.template uses no column: write e.g. 'Question: {question}\\nAnswer:'")
    return tuple(pieces)


def _checked_spec(shown: str, spec: str) -> str:
    if "{" in spec or "}" in spec:
        raise ValueError(f"data.template field {shown} has a field inside its format spec; {_HOW}")
    match = _SPEC.fullmatch(spec)
    if match is None:
        raise ValueError(f"data.template field {shown} has an invalid format spec {spec!r}; {_HOW}")
    for part in ("width", "precision"):
        if match[part] and (len(match[part]) > 6 or int(match[part]) > MAX_TEMPLATE_WIDTH):
            raise ValueError(
                f"data.template field {shown} asks for {part} {match[part][:12]}, over "
                f"{MAX_TEMPLATE_WIDTH}; use a smaller {part}"
            )
    return spec


def template_fields(template: str) -> list[str]:
    """The column names a template uses, in order (see ``parse_template``)."""
    return [p.name for p in parse_template(template) if isinstance(p, TemplateField)]


def render_template(template: str, row: dict) -> str:
    """The template filled from ``row`` with no attribute or item access: each field's value is a
    string, a number or a boolean formatted by its spec, or a list/dict shown as text (no spec)."""
    out = []
    for piece in parse_template(template):
        if isinstance(piece, str):
            out.append(piece)
            continue
        value = _column(row, piece.name)
        if not isinstance(value, (str, int, float)):
            if piece.spec:
                raise BadRow(
                    "wrong_type",
                    f"column {piece.name!r} is {type(value).__name__}; a format spec applies to text and numbers only",
                )
            value = str(value)
        try:
            out.append(format(value, piece.spec))
        except (ValueError, OverflowError) as exc:  # e.g. a 'd' spec on text, 'c' on a huge number
            raise BadRow("wrong_type", f"column {piece.name!r}: {exc}") from None
    return "".join(out)


def _column(row: dict, key: str):
    if key not in row or row[key] is None:
        raise BadRow("missing_key", f"row has no value in column {key!r}")
    return row[key]


def _messages(value) -> list[dict]:
    if not isinstance(value, list) or not value:
        raise BadRow(
            "wrong_type", f"a chat prompt must be a non-empty list of {{role, content}}, got {type(value).__name__}"
        )
    out = []
    for turn in value:
        if not isinstance(turn, dict) or not isinstance(turn.get("content"), str) or turn.get("role") not in ROLES:
            raise BadRow(
                "wrong_type", f"a chat turn must be {{role: one of {list(ROLES)}, content: text}}, got {str(turn)[:80]}"
            )
        out.append({"role": turn["role"], "content": turn["content"]})
    return out


def render_prompt(row: dict, spec: RowSpec) -> str | list[dict]:
    """The row's prompt: text, or a list of chat turns (see the module docstring)."""
    if spec.template:
        prompt: str | list[dict] = render_template(spec.template, row)
    else:
        value = _column(row, spec.prompt_key)
        if isinstance(value, str):
            prompt = value
        else:
            prompt = _messages(value)
    if isinstance(prompt, str):
        if not prompt.strip():
            raise BadRow("empty", f"column {spec.prompt_key!r} is empty")
        return (
            prompt
            if spec.system_prompt is None
            else [{"role": "system", "content": spec.system_prompt}, {"role": "user", "content": prompt}]
        )
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
OWN_META = {
    "row": "the row number",
    "epoch": "the pass over the data",
    "split": "train or eval",
    "reward_fn": "the reward named by data.reward_key",
}


def row_item(row: dict, spec: RowSpec, index: int, meta: dict) -> TaskItem:
    """The ``TaskItem`` of ``row``; ``meta`` (e.g. the row number) is added to the other columns.
    A column named ``reward_fn`` never chooses the reward: only ``data.reward_key`` does."""
    prompt = render_prompt(row, spec)
    answer = answer_text(_column(row, spec.answer_key))
    extra = {k: v for k, v in row.items() if k not in (spec.prompt_key, spec.answer_key, "reward_fn")}
    if spec.reward_key is not None:
        extra["reward_fn"] = checked_reward_name(
            _column(row, spec.reward_key), spec.reward_names, f"column {spec.reward_key!r}"
        )
    return TaskItem(index=index, prompt=prompt, answer=answer, meta={**extra, **meta})


def checked_reward_name(name, names: frozenset[str], where: str) -> str:
    """``name`` when it is one of ``names``; else ``BadRow`` (``wrong_type`` for a value that is no
    text, ``bad_reward_name`` for a name the recipe does not allow). ``where``: e.g. "column 'kind'"."""
    if not isinstance(name, str) or not name:
        raise BadRow("wrong_type", f"{where} must name a reward, got {str(name)[:80]!r}")
    if name not in names:
        from flash.algos.registry import closest_names

        shown = name if len(name) <= 80 else name[:77] + "..."
        allowed = ", ".join(sorted(names)[:12]) + (", ..." if len(names) > 12 else "")
        near = closest_names(name[:80], names, n=1)
        guess = f"did you mean {near[0]!r}? " if near else ""
        raise BadRow(
            "bad_reward_name",
            f"{where} names reward {shown!r}, which the recipe does not list "
            f"(a row may name {allowed or 'none'}): {guess}list it in data.rewards "
            "to allow it",
        )
    return name


def prompt_text(prompt: str | list[dict]) -> str:
    """A prompt as one readable text (chats as ``role: content`` lines), for logs and judges."""
    if isinstance(prompt, str):
        return prompt
    return "\n".join(f"{t['role']}: {t['content']}" for t in prompt)
