"""Chat tokenizers, templates and a scripted policy for the gateway's tests."""

from __future__ import annotations

import threading

from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast

from flash.engine.base import GenerationOutput

TURN = "{{ bos_token }}{{ m.role }}:{{ m.content }}{{ eos_token }} "
CHATML = (
    "{% for m in messages %}" + TURN + "{% endfor %}{% if add_generation_prompt %}{{ bos_token }}assistant:{% endif %}"
)
WINDOW = CHATML.replace("in messages %}", "in messages[-4:] %}")
LLAMA3 = (
    "{{ bos_token }}{% for m in messages %}<|start_header_id|>{{ m.role }}<|end_header_id|>\n\n"
    "{{ m.content }}<|eot_id|>{% endfor %}"
    "{% if add_generation_prompt %}<|start_header_id|>assistant<|end_header_id|>\n\n{% endif %}"
)
SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)
SPECIAL = ["<|begin_of_text|>", "<|end_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>", "<|pad|>"]
WORDS = (
    "the quick brown fox jumps over lazy dog tool returns weather in paris sunny degrees user asks for sum "
    "assistant answers calls time search math every answer is brief exact polite tomorrow rain cloud wind "
    "city london tokyo berlin number result error retry function argument value list name today"
).split()


def train_bpe(specials: list[str]) -> Tokenizer:
    """A byte-level BPE with ``specials``, trained on a few lines (some hundred merges), Llama 3's split."""
    tk = Tokenizer(models.BPE())
    tk.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(SPLIT), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    tk.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=256 + 400,
        special_tokens=specials,
        show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    lines = [
        " ".join(WORDS[(i * 7 + j * 3) % len(WORDS)] for j in range(9)) + f", {i * 37 % 1000}." for i in range(120)
    ]
    tk.train_from_iterator(["\n".join(lines) + "\n\n"], trainer)  # about 320 merges
    return tk


def bpe_tokenizer() -> PreTrainedTokenizerFast:
    """The byte-level BPE with Llama 3's specials and template."""
    tk = train_bpe(SPECIAL)
    tok = PreTrainedTokenizerFast(
        tokenizer_object=tk,
        bos_token=SPECIAL[0],
        eos_token="<|eot_id|>",
        pad_token="<|pad|>",
        additional_special_tokens=SPECIAL[1:4],
    )
    tok.chat_template = LLAMA3
    return tok


class Scripted:
    """A blocking ``generate`` answering each session's k-th call with ``script[k]`` (+ stop token)."""

    def __init__(self, tok, script: list[str], stop: bool = True):
        self.tok, self.script, self.stop = tok, script, stop
        self.log: list[tuple[str, list[int], GenerationOutput]] = []
        self.lock = threading.Lock()

    def __call__(self, prompt_ids, params, key):
        with self.lock:
            k = sum(1 for s, _, _ in self.log if s == key)
            ids = self.tok.encode(self.script[k], add_special_tokens=False) + ([self.tok.eos_token_id] * self.stop)
            out = GenerationOutput(
                f"r{len(self.log)}",
                list(prompt_ids),
                ids,
                [-0.25] * len(ids),
                [3] * len(ids),
                "stop" if self.stop else "length",
            )
            self.log.append((key, list(prompt_ids), out))
            return out
