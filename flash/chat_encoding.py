"""Text from outside is text: special tokens come from a template, never from the text.

``text_ids(tokenizer, text)`` is the one encoding of outside text (text prompts, rendered
``data.template`` rows, environment observations, tool results, judge inputs, completions
prompts): special tokens are never parsed, and the ids are checked to hold no special id at all
(a tokenizer whose normalizer turns a look-alike into a special token's spelling that its
vocabulary then maps to the special id is refused: ``SpecialTokenInText``, a ``ValueError``
whose ``reason`` is ``special_token``). ``wrap=True`` adds the tokenizer's own post-processor
tokens (its ``<bos>``, ...) around the text, as ``tokenizer.encode(text)`` would.

``tokenizer.apply_chat_template(..., tokenize=True)`` renders the conversation to one string and
tokenizes it with special tokens parsed, so a message that *spells* a control token (``<|im_end|>``,
``<|eot_id|>``, ``<eos>``, ...) gets the real token: data could close a turn and open a forged one.
``chat_template_ids`` keeps the two apart:

1. Every string in the messages and tools (content, names, ids, tool-call arguments, schemas, keys
   included) has each special token's spelling replaced by a placeholder unique to the call.
2. The template renders the placeholder text (``flash.chat_template``: bounded in time and size);
   the special tokens spelled in it are the template's.
   Nothing spelled in the messages and the rendered text's ids hold exactly those special ids,
   in order: the ids are ``apply_chat_template``'s own, unchanged. Otherwise (a spelling, or a
   look-alike that the tokenizer's normalizer made into a special token) the text is cut at the
   template's special tokens, as the tokenizer cuts at added tokens: each is its id, each text
   run between them gets the spellings back and is encoded by ``text_ids``.

Special tokens are the tokenizer's added tokens marked special and its named ones (``bos``,
``eos``, ...); an added token that is not special is vocabulary, as the tokenizer treats it. A
template that computes on the spelled text (compares it with a special token's spelling, changes
its case) sees the placeholder instead.
"""

from __future__ import annotations

import functools
import re
import secrets
from typing import Any

from flash.chat_template import render_chat


def special_tokens(tokenizer: Any) -> dict[str, tuple[int, bool, bool]]:
    """Each special token's spelling -> (id, strips whitespace on its left, on its right)."""
    out = {
        t.content: (i, bool(t.lstrip), bool(t.rstrip))
        for i, t in tokenizer.added_tokens_decoder.items()
        if t.special and t.content
    }
    for name in tokenizer.all_special_tokens:
        if name and name not in out:
            out[name] = (tokenizer.convert_tokens_to_ids(name), False, False)
    return out


def _spelling_pattern(spellings: list[str]) -> re.Pattern | None:
    """One regex over the spellings, the longest first (``<|eot|>`` inside ``<|eot|>x``)."""
    if not spellings:
        return None
    return re.compile("|".join(re.escape(s) for s in sorted(spellings, key=len, reverse=True)))


def _mask(value: Any, pattern: re.Pattern, mark: str, found: list[str]) -> Any:
    """``value`` with every spelling in its strings (dict keys too) replaced by ``mark + i + 'X'``,
    where ``found[i]`` is the spelling it stands for."""
    if isinstance(value, str):

        def swap(m: re.Match) -> str:
            found.append(m.group())
            return f"{mark}{len(found) - 1}X"

        return pattern.sub(swap, value)
    if isinstance(value, dict):
        return {_mask(k, pattern, mark, found): _mask(v, pattern, mark, found) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_mask(v, pattern, mark, found) for v in value]
    return value


class SpecialTokenInText(ValueError):
    """Text from outside that this tokenizer encodes to a special token even as plain text."""

    reason = "special_token"


@functools.lru_cache(maxsize=16)
def _plain_tokenizer(tokenizer: Any, size: int) -> Any:
    """A copy of the fast tokenizer's Rust tokenizer that never parses special tokens (None for
    a Python tokenizer). A fast tokenizer's switch for that is one flag on its shared Rust
    tokenizer, which every ``encode`` call sets: flipping it would race with other threads
    encoding with the same tokenizer. So text is encoded by a copy with the flag set for good
    (made once per tokenizer and vocabulary ``size``)."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None:
        return None
    from tokenizers import Tokenizer

    copy = Tokenizer.from_str(backend.to_str())
    copy.encode_special_tokens = True
    return copy


@functools.lru_cache(maxsize=16)
def _special_ids(tokenizer: Any, size: int) -> dict[int, str]:
    return {i: name for name, (i, _, _) in special_tokens(tokenizer).items()}


def text_ids(tokenizer: Any, text: str, wrap: bool = False) -> list[int]:
    """``text`` as plain text: no special token parsed, no special id in the ids (module
    docstring). ``wrap``: the tokenizer's post-processor tokens around it (its ``<bos>``, ...)."""
    plain = _plain_tokenizer(tokenizer, len(tokenizer))
    if plain is None:  # a Python tokenizer: its own option, per call
        ids = list(tokenizer.encode(text, add_special_tokens=False, split_special_tokens=True))
        wrapped = list(tokenizer.encode(text, add_special_tokens=True, split_special_tokens=True)) if wrap else ids
    else:
        enc = plain.encode(text, add_special_tokens=False)
        ids = enc.ids
        wrapped = plain.post_process(enc, add_special_tokens=True).ids if wrap else ids
    specials = _special_ids(tokenizer, len(tokenizer))
    forged = next((i for i in ids if i in specials), None)
    if forged is not None:
        raise SpecialTokenInText(
            f"the text {text[:60]!r} encodes to the special token {specials[forged]!r} (id {forged}) "
            "even with special tokens off (this tokenizer's normalizer and vocabulary make it one): "
            "text from outside may not carry a special token"
        )
    return list(wrapped)


def _as_ids(ids: Any) -> list[int]:
    return list(ids["input_ids"] if hasattr(ids, "keys") else ids)


def chat_template_ids(
    tokenizer: Any, messages: list[dict], tools: list[dict] | None = None, generation: bool = True
) -> list[int]:
    """``apply_chat_template(messages, tools=tools, add_generation_prompt=generation)`` ids, with
    every message's and tool's text tokenized as text (module docstring)."""
    specials = special_tokens(tokenizer)
    pattern = _spelling_pattern(list(specials))
    found: list[str] = []
    mark = f"FLASHSPELLED{secrets.token_hex(6)}N"
    masked = _mask(messages, pattern, mark, found) if pattern else messages
    masked_tools = _mask(tools, pattern, mark, found) if pattern and tools else tools
    text = render_chat(tokenizer, masked, masked_tools, generation)
    if not found:  # the template's own ids, if their special tokens are exactly the template's
        ids = _as_ids(tokenizer(text, add_special_tokens=False)["input_ids"])
        if pattern is None or _specials_in(ids, specials) == [specials[m.group()][0] for m in pattern.finditer(text)]:
            return ids
    restore = re.compile(re.escape(mark) + r"(\d+)X")

    def as_text(run: str) -> list[int]:
        run = restore.sub(lambda m: found[int(m.group(1))] if int(m.group(1)) < len(found) else m.group(), run)
        return text_ids(tokenizer, run) if run else []

    ids: list[int] = []
    pos = 0
    for m in pattern.finditer(text):
        token, lstrip, rstrip = specials[m.group()]
        run = text[pos : m.start()]
        ids += as_text(run.rstrip() if lstrip else run) + [token]
        pos = m.end()
        while rstrip and pos < len(text) and text[pos].isspace():
            pos += 1
    return ids + as_text(text[pos:])


def _specials_in(ids: list[int], specials: dict[str, tuple[int, bool, bool]]) -> list[int]:
    controls = {i for i, _, _ in specials.values()}
    return [i for i in ids if i in controls]
