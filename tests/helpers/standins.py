"""Stand-ins for what a GPU recipe reads from disk, built offline: a model folder of the recipe's
architecture (its real config's family, ties and rope, at a tiny size) and GSM8K-format files."""

from __future__ import annotations

import json
from pathlib import Path

from tokenizers import Tokenizer, decoders, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast, Qwen2Config, Qwen2ForCausalLM
from transformers.convert_slow_tokenizer import bytes_to_unicode

# The fields that make a folder "Qwen2.5-0.5B-Instruct-like" or "Qwen2.5-7B-Instruct-like"
# (from their config.json), at a size that builds in a second.
ARCHITECTURES = {
    "Qwen2.5-0.5B-Instruct": dict(tie_word_embeddings=True, rope_theta=1_000_000.0),
    "Qwen2.5-7B-Instruct": dict(tie_word_embeddings=False, rope_theta=1_000_000.0),
}
GSM8K_ROWS = [
    (
        "Natalia sold clips to 48 of her friends in April, and then she sold half as many clips in May. "
        "How many clips did Natalia sell altogether in April and May?",
        "Natalia sold 48/2 = <<48/2=24>>24 clips in May.\nNatalia sold 48+24 = <<48+24=72>>72 clips.\n#### 72",
    ),
    (
        "Weng earns $12 an hour for babysitting. Yesterday, she just did 50 minutes of babysitting. "
        "How much did she earn?",
        "Weng earns 12/60 = $<<12/60=0.2>>0.2 per minute.\nWorking 50 minutes, she earned 0.2 x 50 = "
        "$<<0.2*50=10>>10.\n#### 10",
    ),
]


CHATML = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def byte_tokenizer() -> PreTrainedTokenizerFast:
    """A byte-level BPE tokenizer with no merges (every byte a token) and Qwen's ChatML specials:
    the kind of tokenizer Qwen2.5 ships, reading any text."""
    specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    vocab = {ch: i for i, ch in enumerate(bytes_to_unicode().values())}
    vocab.update({tok: len(vocab) + i for i, tok in enumerate(specials)})
    core = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    core.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    core.decoder = decoders.ByteLevel()
    tok = PreTrainedTokenizerFast(
        tokenizer_object=core, eos_token="<|im_end|>", pad_token="<|endoftext|>", additional_special_tokens=specials[1:]
    )
    tok.chat_template = CHATML
    return tok


def model_folder(root: Path, name: str) -> Path:
    """A Hugging Face folder (config, safetensors weights, tokenizer) of ``name``'s architecture."""
    folder = root / name
    tokenizer = byte_tokenizer()
    config = Qwen2Config(
        vocab_size=len(tokenizer),
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        max_position_embeddings=2048,
        pad_token_id=tokenizer.pad_token_id,
        eos_token_id=tokenizer.eos_token_id,
        **ARCHITECTURES[name],
    )
    Qwen2ForCausalLM(config).save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder


def gsm8k_files(root: Path) -> tuple[Path, Path]:
    """GSM8K-format JSONL files (``question``, ``answer`` ending in ``#### N``): train and test."""
    paths = root / "train.jsonl", root / "test.jsonl"
    for path in paths:
        path.write_text("".join(json.dumps({"question": q, "answer": a}) + "\n" for q, a in GSM8K_ROWS * 4))
    return paths


GPU_RECIPES = {"gsm8k_1gpu": "Qwen2.5-0.5B-Instruct", "gsm8k_8gpu": "Qwen2.5-7B-Instruct"}


def gpu_recipe_overrides(root: Path, recipe: str) -> list[str]:
    """The ``key=value`` overrides pointing ``recipe`` (gsm8k_1gpu, gsm8k_8gpu) at stand-ins under ``root``."""
    name = GPU_RECIPES[recipe]
    train, test = gsm8k_files(root)
    return [f"model.path={model_folder(root, name)}", f"data.train=[{train}]", f"data.eval=[{test}]"]
