"""Chat template ids where message text is only ever text: special tokens come from the template.

``tokenizer.apply_chat_template(..., tokenize=True)`` renders the conversation to one string and
tokenizes it with special tokens parsed, so a message that *spells* a control token (``<|im_end|>``,
``<|eot_id|>``, ``<eos>``, ...) gets the real token: data could close a turn and open a forged one.
``chat_template_ids`` keeps the two apart:

1. Every string in the messages and tools (content, names, ids, tool-call arguments, schemas, keys
   included) has each special token's spelling replaced by a placeholder unique to the call.
   Nothing spelled: the ids are ``apply_chat_template``'s own, unchanged.
2. Otherwise the template renders the placeholder text; the special tokens left in it are the
   template's. The text is cut at them, as the tokenizer cuts at added tokens: each is its id,
   each text run between them gets the spellings back and is tokenized with special tokens off
   (``split_special_tokens`` in transformers' terms), as plain characters.

Special tokens are the tokenizer's added tokens marked special and its named ones (``bos``,
``eos``, ...); an added token that is not special is vocabulary, as the tokenizer treats it. A
template that computes on the spelled text (compares it with a special token's spelling, changes
its case) sees the placeholder instead.
"""

from __future__ import annotations

import functools
import re
import secrets
from collections.abc import Callable
from typing import Any


def special_tokens(tokenizer: Any) -> dict[str, tuple[int, bool, bool]]:
    """Each special token's spelling -> (id, strips whitespace on its left, on its right)."""
    out = {t.content: (i, bool(t.lstrip), bool(t.rstrip))
           for i, t in tokenizer.added_tokens_decoder.items() if t.special and t.content}
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


@functools.lru_cache(maxsize=16)
def _text_encoder(tokenizer: Any, size: int) -> Callable[[str], list[int]]:
    """Text -> ids with special tokens off. A fast tokenizer's switch for that is one flag on its
    shared Rust tokenizer, which every ``encode`` call sets: flipping it would race with other
    threads encoding with the same tokenizer. So text is encoded by a copy of the Rust tokenizer
    with the flag set for good (made once per tokenizer and vocabulary ``size``)."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None:  # a Python tokenizer: its own option, per call
        return lambda text: list(tokenizer.encode(text, add_special_tokens=False, split_special_tokens=True))
    from tokenizers import Tokenizer

    copy = Tokenizer.from_str(backend.to_str())
    copy.encode_special_tokens = True
    return lambda text: copy.encode(text, add_special_tokens=False).ids


def _as_ids(ids: Any) -> list[int]:
    return list(ids["input_ids"] if hasattr(ids, "keys") else ids)


def chat_template_ids(tokenizer: Any, messages: list[dict], tools: list[dict] | None = None,
                      generation: bool = True) -> list[int]:
    """``apply_chat_template(messages, tools=tools, add_generation_prompt=generation)`` ids, with
    every message's and tool's text tokenized as text (module docstring)."""
    specials = special_tokens(tokenizer)
    pattern = _spelling_pattern(list(specials))
    found: list[str] = []
    mark = f"FLASHSPELLED{secrets.token_hex(6)}N"
    masked = _mask(messages, pattern, mark, found) if pattern else messages
    masked_tools = _mask(tools, pattern, mark, found) if pattern and tools else tools
    if not found:
        return _as_ids(tokenizer.apply_chat_template(messages, tools=tools, add_generation_prompt=generation,
                                                     tokenize=True))
    text = tokenizer.apply_chat_template(masked, tools=masked_tools, add_generation_prompt=generation,
                                         tokenize=False)
    restore = re.compile(re.escape(mark) + r"(\d+)X")

    encode = _text_encoder(tokenizer, len(tokenizer))

    def as_text(run: str) -> list[int]:
        run = restore.sub(lambda m: found[int(m.group(1))] if int(m.group(1)) < len(found) else m.group(), run)
        return encode(run) if run else []

    ids: list[int] = []
    pos = 0
    for m in pattern.finditer(text):
        token, lstrip, rstrip = specials[m.group()]
        run = text[pos:m.start()]
        ids += as_text(run.rstrip() if lstrip else run) + [token]
        pos = m.end()
        while rstrip and pos < len(text) and text[pos].isspace():
            pos += 1
    return ids + as_text(text[pos:])
