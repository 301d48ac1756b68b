"""Tiny models and tokenizers built offline, so the default recipe needs no model hub.

The tokenizer is byte level: every byte of UTF-8 text is one token, so any text (capitals,
newlines, tabs, emoji, CJK) encodes losslessly (after Unicode NFC normalization, as every
Qwen2 tokenizer does) and the embedding table stays tiny (264 rows). Ids (docs/tasks.md):

- 0-3: ``<pad>``, ``<bos>``, ``<eos>``, ``<unk>``;
- 4-58: ``DEFAULT_ALPHABET`` (digits, lowercase letters, space, a little punctuation) in order,
  so the symbolic tasks' text has small, stable ids;
- 59-259: every other byte value, in byte order;
- 260-263: the chat roles ``<|system|>``, ``<|user|>``, ``<|assistant|>``, ``<|tool|>``.

Text prompts are ``<bos>`` then the bytes; chats use ``CHAT_TEMPLATE`` (a role token, the
content, ``<eos>`` per turn). It *is* a ``Qwen2Tokenizer`` (a ``PreTrainedTokenizerFast``) whose
byte-level BPE vocabulary holds single bytes and no merges. Why not a bare ``tokenizers`` object:
transformers 5 re-creates the tokenizer of any ``qwen2`` checkpoint as ``Qwen2Tokenizer``
(byte-level pre-tokenizer and decoder, NFC normalizer) whatever ``tokenizer_config.json`` says.
Built as that class, what we save is what ``AutoTokenizer`` loads.

The model is a Hugging Face ``Qwen2ForCausalLM`` with a small ``Qwen2Config``: every engine and
trainer in flash (and vLLM later) treats it exactly like a real checkpoint. ``head_dim`` must be
at least 32 because vLLM's CPU attention kernels do not support 16.
"""

from __future__ import annotations

import functools
import string
import unicodedata
from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING

from transformers import PreTrainedTokenizerFast
from transformers.convert_slow_tokenizer import bytes_to_unicode
from transformers.models.qwen2.tokenization_qwen2 import Qwen2Tokenizer

from flash.chat_template import MAX_TEMPLATE_CHARS

if TYPE_CHECKING:
    from transformers import Qwen2ForCausalLM

PAD, BOS, EOS, UNK = "<pad>", "<bos>", "<eos>", "<unk>"
SPECIAL_TOKENS = (PAD, BOS, EOS, UNK)
ROLES = ("system", "user", "assistant", "tool")
ROLE_TOKENS = tuple(f"<|{role}|>" for role in ROLES)
# The first bytes after the specials, in this order: digits, lowercase letters, space and a
# little punctuation (the symbolic tasks' text). Every other byte follows in byte order.
DEFAULT_ALPHABET = string.digits + string.ascii_lowercase + " =+-*/%?:.,;()<>#|"
# Part of the warm start's cache key: bump when the ids ``build_tokenizer`` gives change.
TOKENIZER_VERSION = 2
# A turn is its role token, its content (an assistant's tool calls as <tool_call> JSON) and <eos>;
# the generation prompt is <|assistant|>, so a sampled reply ends its turn with <eos>.
CHAT_TEMPLATE = (
    "{{ bos_token }}{% if tools %}<|system|>tools: {{ tools | tojson }}{{ eos_token }}{% endif %}"
    "{% for m in messages %}"
    "{% if m['role'] not in ['system', 'user', 'assistant', 'tool'] %}"
    "{{ raise_exception('unknown chat role: ' ~ m['role']) }}{% endif %}"
    "<|{{ m['role'] }}|>{{ m['content'] or '' }}"
    "{% for c in m['tool_calls'] or [] %}<tool_call>"
    "{\"name\": \"{{ c['function']['name'] }}\", \"arguments\": {{ c['function']['arguments'] | tojson }}}"
    "</tool_call>{% endfor %}{{ eos_token }}"
    "{% endfor %}{% if add_generation_prompt %}<|assistant|>{% endif %}"
)


def build_tokenizer(alphabet: str = DEFAULT_ALPHABET) -> PreTrainedTokenizerFast:
    """The tiny model's byte-level tokenizer, with ``CHAT_TEMPLATE``.

    Ids: ``<pad>``=0, ``<bos>``=1, ``<eos>``=2, ``<unk>``=3, then the bytes of ``alphabet`` (ASCII
    characters) in order, then every other byte value, then the role tokens ``ROLE_TOKENS``.
    """
    chars = list(dict.fromkeys(alphabet))  # unique, order kept
    if any(len(c) != 1 or ord(c) > 127 for c in chars):
        raise ValueError("alphabet must be single ASCII characters")
    to_bytelevel = bytes_to_unicode()  # ' ' -> 'Ġ', printable ASCII maps to itself
    vocab = {tok: i for i, tok in enumerate(SPECIAL_TOKENS)}
    for byte in [ord(c) for c in chars] + list(range(256)):
        vocab.setdefault(to_bytelevel[byte], len(vocab))
    tokenizer = Qwen2Tokenizer(
        vocab=vocab,
        merges=[],
        unk_token=UNK,
        bos_token=BOS,
        eos_token=EOS,
        pad_token=PAD,
        extra_special_tokens=list(ROLE_TOKENS),
        padding_side="left",
        model_max_length=1024,
    )
    tokenizer.chat_template = CHAT_TEMPLATE
    return tokenizer


def _encode_bytes(tokenizer: PreTrainedTokenizerFast, text: str) -> list[int]:
    """One id per byte of ``text``'s UTF-8 (NFC); text that spells a special token stays bytes."""
    from flash.chat_encoding import text_ids

    ids = text_ids(tokenizer, text)
    if len(ids) != len(unicodedata.normalize("NFC", text).encode()):  # a vocabulary lacking bytes
        raise ValueError(f"the tokenizer has no token for some bytes of {text[:80]!r}")
    return ids


def is_tiny_tokenizer(tokenizer: PreTrainedTokenizerFast) -> bool:
    """True for the byte tokenizer ``build_tokenizer`` makes (its special tokens say so)."""
    return (tokenizer.bos_token, tokenizer.eos_token, tokenizer.pad_token) == (BOS, EOS, PAD)


def encode_prompt(tokenizer: PreTrainedTokenizerFast, prompt: str | list[dict] | dict) -> list[int]:
    """Prompt ids. A chat (a list of ``{role, content}`` turns, or ``{"messages": [...], "tools":
    [...]}`` as a chat request carries them): the tokenizer's chat template with the generation
    prompt, exactly as ``apply_chat_template`` gives it. Text with the tiny model's byte
    tokenizer: ``<bos>`` then one id per byte, the response follows directly. Text with a
    chat template (e.g. SmolLM2-Instruct): one user turn, then the assistant header, as the model
    was tuned to see it. Any other tokenizer: the text as text, inside the tokenizer's own
    post-processor tokens (``flash.chat_encoding.text_ids``). No special token comes from text."""
    if isinstance(prompt, (list, dict)):
        if not tokenizer.chat_template:
            raise ValueError(
                "the prompt is a chat but the tokenizer has no chat template; set "
                "model.chat_template (a Jinja string or a file)"
            )
        if isinstance(prompt, dict):
            return chat_ids(tokenizer, prompt["messages"], prompt.get("tools"))
        return chat_ids(tokenizer, prompt)
    if is_tiny_tokenizer(tokenizer):
        return [tokenizer.bos_token_id] + _encode_bytes(tokenizer, prompt)
    if tokenizer.chat_template:
        return chat_ids(tokenizer, [{"role": "user", "content": prompt}])
    from flash.chat_encoding import text_ids

    return text_ids(tokenizer, prompt, wrap=True)


def chat_ids(tokenizer: PreTrainedTokenizerFast, messages: list[dict], tools: list[dict] | None = None) -> list[int]:
    """``apply_chat_template(messages, tools=tools, add_generation_prompt=True)`` as a list of ids,
    message text tokenized as text only (flash.chat_encoding)."""
    from flash.chat_encoding import chat_template_ids

    return chat_template_ids(tokenizer, messages, tools, generation=True)


TEMPLATE_SUFFIXES = (".jinja", ".jinja2", ".j2", ".txt")
MAX_TEMPLATE_BYTES = MAX_TEMPLATE_CHARS  # a template file's size: the rendering sandbox's text bound


def set_chat_template(tokenizer: PreTrainedTokenizerFast, template: str | None) -> None:
    """``model.chat_template``: a Jinja string, or the path of a file holding one, replaces the
    tokenizer's own. Templates render in a bounded sandbox (flash.chat_template): a template is data."""
    if not template:
        return
    from flash.chat_template import mark_source

    tokenizer.chat_template = read_chat_template(template)
    inline = "{" in template
    mark_source(tokenizer, "model.chat_template" if inline else f"model.chat_template ({template})")


def read_chat_template(template: str) -> str:
    """The template ``model.chat_template`` names: the text itself when it holds ``{`` (inline
    Jinja), else a template file: a regular ``TEMPLATE_SUFFIXES`` file of UTF-8 text, at most
    ``MAX_TEMPLATE_BYTES``, holding Jinja (``{{ }}`` or ``{% %}``). Any other file is refused in one
    line that names it, never its text."""
    import os
    import stat
    from pathlib import Path

    if "{" in template:
        if len(template.encode()) > MAX_TEMPLATE_BYTES:
            raise ValueError(
                f"model.chat_template: {len(template.encode())} bytes, more than a chat template "
                f"holds ({MAX_TEMPLATE_BYTES})"
            )
        return template
    path = Path(template).expanduser()
    if path.suffix.lower() not in TEMPLATE_SUFFIXES:
        raise ValueError(
            f"model.chat_template {template[:200]!r} is neither a Jinja template nor a template file "
            f"({', '.join(TEMPLATE_SUFFIXES)})"
        )
    if not path.is_file():
        raise ValueError(f"model.chat_template: no template file {path}")
    with open(path, "rb") as f:
        if not stat.S_ISREG(os.fstat(f.fileno()).st_mode):
            raise ValueError(f"model.chat_template: {path} is not a regular file")
        data = f.read(MAX_TEMPLATE_BYTES + 1)
    if len(data) > MAX_TEMPLATE_BYTES:
        raise ValueError(
            f"model.chat_template: {path} is over {MAX_TEMPLATE_BYTES} bytes, more than a chat template holds"
        )
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError:
        raise ValueError(f"model.chat_template: {path} is not UTF-8 text") from None
    if "\x00" in text or not ("{{" in text or "{%" in text):
        raise ValueError(
            f"model.chat_template: {path} holds no Jinja ({{{{ ... }}}} or {{% ... %}}): not a chat template"
        )
    return text


def encode_response(tokenizer: PreTrainedTokenizerFast, text: str) -> list[int]:
    """Response ids as the policy should emit them: one id per byte, then ``<eos>``."""
    return _encode_bytes(tokenizer, text) + [tokenizer.eos_token_id]


def decode_response(tokenizer: PreTrainedTokenizerFast, ids: list[int]) -> str:
    """Text of a generated response: cut at the first ``<eos>``, padding and specials dropped."""
    ids = list(ids)
    if tokenizer.eos_token_id in ids:
        ids = ids[: ids.index(tokenizer.eos_token_id)]
    return tokenizer.decode(ids, skip_special_tokens=True)


@dataclass(frozen=True)
class TinyModelConfig:
    """Shape of the tiny Qwen2 policy (~0.8 M parameters at the defaults).

    ``hidden_size / num_heads`` is the head dimension and must be >= 32 (vLLM CPU kernels).
    """

    hidden_size: int = 128
    num_layers: int = 4
    num_heads: int = 4
    num_kv_heads: int = 4
    intermediate_size: int = 384
    max_positions: int = 256
    rope_theta: float = 10000.0
    tie_embeddings: bool = True
    seed: int = 0

    def __post_init__(self) -> None:
        sizes = ("hidden_size", "num_layers", "num_heads", "num_kv_heads", "intermediate_size", "max_positions")
        for name in sizes:
            if getattr(self, name) < 1:
                raise ValueError(f"model.tiny.{name} must be >= 1, got {getattr(self, name)}")
        if not self.rope_theta > 0:
            raise ValueError(f"model.tiny.rope_theta must be > 0, got {self.rope_theta}")
        if self.hidden_size % self.num_heads or self.num_heads % self.num_kv_heads:
            raise ValueError("hidden_size must divide by num_heads, num_heads by num_kv_heads")
        if self.hidden_size // self.num_heads < 32:
            raise ValueError(f"head_dim {self.hidden_size // self.num_heads} < 32 (vLLM needs >= 32)")

    def to_dict(self) -> dict:
        return asdict(self)


def build_tiny_model(tokenizer: PreTrainedTokenizerFast, cfg: TinyModelConfig) -> Qwen2ForCausalLM:
    """A freshly initialised (seeded) Qwen2 causal LM sized for ``tokenizer``'s vocabulary."""
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM  # the modeling code: only where a model is built

    config = Qwen2Config(
        vocab_size=len(tokenizer),
        hidden_size=cfg.hidden_size,
        num_hidden_layers=cfg.num_layers,
        num_attention_heads=cfg.num_heads,
        num_key_value_heads=cfg.num_kv_heads,
        head_dim=cfg.hidden_size // cfg.num_heads,
        intermediate_size=cfg.intermediate_size,
        max_position_embeddings=cfg.max_positions,
        rope_theta=cfg.rope_theta,
        tie_word_embeddings=cfg.tie_embeddings,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        use_cache=True,
    )
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(cfg.seed)
        model = Qwen2ForCausalLM(config)
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    model.generation_config.eos_token_id = tokenizer.eos_token_id
    model.generation_config.bos_token_id = tokenizer.bos_token_id
    return model


CACHE_KWARGS = ("past_key_values", "past_key_value", "layer_past", "cache")  # names across transformers versions


CHECKPOINTED = "_flash_checkpointed"  # the class attribute marking a checkpointed layer class


def decoder_layers(model) -> list:
    """The model's repeated blocks (HF names their class in ``_no_split_modules``): the units of
    activation checkpointing and of FSDP sharding. Found by ancestry: ``fully_shard`` and
    ``enable_activation_checkpointing`` swap a layer's class for a subclass of it."""
    names = set(getattr(model, "_no_split_modules", None) or [])
    layers = [m for m in model.modules() if any(c.__name__ in names for c in type(m).__mro__)]
    if not layers:
        raise ValueError(
            f"{type(model).__name__} names no decoder-layer class in _no_split_modules; "
            "cannot choose its decoder layers (FSDP units, activation checkpointing)"
        )
    return layers


def enable_activation_checkpointing(layers) -> None:
    """Recompute each of ``layers`` (a model's decoder layers: ``decoder_layers``) in backward
    instead of keeping its activations: torch's non-reentrant checkpoint around the layer's whole
    call, its hooks included, in training with gradients on. Done here rather than by
    transformers' ``gradient_checkpointing_enable``, whose mechanism changes between versions. A
    checkpointed layer never writes a KV cache (its recompute would append to the cache a second
    time). Idempotent: a layer already checkpointed is left as it is (never recomputed twice)."""
    for layer in layers:
        if not is_checkpointed(layer):
            layer.__class__ = _checkpointed(type(layer))


def is_checkpointed(layer) -> bool:
    """Whether ``layer`` recomputes its activations in backward (``enable_activation_checkpointing``)."""
    return bool(getattr(type(layer), CHECKPOINTED, False))


@functools.cache
def _checkpointed(cls: type) -> type:
    """``cls`` with a ``__call__`` that runs the original under ``torch.utils.checkpoint``."""
    from torch.utils.checkpoint import checkpoint

    def __call__(self, *args, **kwargs):
        import torch

        if not (self.training and torch.is_grad_enabled()):
            return cls.__call__(self, *args, **kwargs)
        kwargs.update({k: None for k in CACHE_KWARGS if kwargs.get(k) is not None})
        if kwargs.get("use_cache"):
            kwargs["use_cache"] = False
        return checkpoint(cls.__call__, self, *args, use_reentrant=False, **kwargs)

    return type(f"Checkpointed{cls.__name__}", (cls,), {"__call__": __call__, CHECKPOINTED: True})
