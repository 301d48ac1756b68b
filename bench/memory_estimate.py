"""Each GPU role's estimated peak memory for the GPU recipes at their real models' shapes, on CPU.

    python -m bench.memory_estimate [--card H100]

What ``flash validate`` prints (``flash.app.memory_fit``: fake-tensor traces of the trainer's
micro-batch and step and of the torch engine's prefill, no byte allocated), for ``gsm8k_1gpu``
(Qwen2.5-0.5B-Instruct) and ``gsm8k_8gpu`` (Qwen2.5-7B-Instruct), and for ``gsm8k_1gpu`` at
Qwen2.5-1.5B-Instruct's shape (the timing case: the estimate must take seconds). The models'
configs are written from their published ``config.json`` fields (no hub, no weights: the estimate
reads the config only; the folder gets empty weight and tokenizer files so the recipe validates).
The last line is JSON: the lines and the seconds per recipe.
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path

# Fields of the published config.json of each model (Qwen2.5 technical report, Table 1).
QWEN25 = {
    "Qwen2.5-0.5B-Instruct": dict(
        hidden_size=896,
        intermediate_size=4864,
        num_hidden_layers=24,
        num_attention_heads=14,
        num_key_value_heads=2,
        vocab_size=151936,
        tie_word_embeddings=True,
    ),
    "Qwen2.5-1.5B-Instruct": dict(
        hidden_size=1536,
        intermediate_size=8960,
        num_hidden_layers=28,
        num_attention_heads=12,
        num_key_value_heads=2,
        vocab_size=151936,
        tie_word_embeddings=True,
    ),
    "Qwen2.5-7B-Instruct": dict(
        hidden_size=3584,
        intermediate_size=18944,
        num_hidden_layers=28,
        num_attention_heads=28,
        num_key_value_heads=4,
        vocab_size=152064,
        tie_word_embeddings=False,
    ),
}
CASES = (
    ("gsm8k_1gpu", "Qwen2.5-0.5B-Instruct"),
    ("gsm8k_8gpu", "Qwen2.5-7B-Instruct"),
    ("gsm8k_1gpu", "Qwen2.5-1.5B-Instruct"),
)


def config_folder(root: Path, name: str) -> Path:
    """A folder holding ``name``'s config.json (and empty weight and tokenizer files)."""
    from transformers import Qwen2Config

    folder = root / name
    Qwen2Config(
        max_position_embeddings=32768, rope_theta=1_000_000.0, rms_norm_eps=1e-6, **QWEN25[name]
    ).save_pretrained(folder)
    for empty in ("model.safetensors", "tokenizer.json"):
        (folder / empty).touch()
    return folder


def estimate(recipe: str, model: str, card: str, root: Path) -> tuple[list[str], float]:
    from flash.app.config import load_config
    from flash.app.memory_fit import estimate_lines, model_config
    from flash.app.recipe_files import recipe_paths
    from flash.errors import FlashError

    data = root / "rows.jsonl"
    data.write_text(json.dumps({"question": "1+1?", "answer": "#### 2"}) + "\n")
    cfg = load_config(
        recipe_paths()[recipe],
        [
            f"model.path={config_folder(root, model)}",
            f"data.train=[{data}]",
            f"data.eval=[{data}]",
            f"resources.card={card}",
        ],
    )
    start = time.process_time()
    try:
        lines = estimate_lines(cfg, model_config(cfg))
    except FlashError as exc:  # a placement that does not fit: validate's refusal
        lines = [f"refused: {exc}"]
    return lines, time.process_time() - start


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--card", default="H100")
    args = ap.parse_args()
    out = []
    with tempfile.TemporaryDirectory() as tmp:
        for recipe, model in CASES:
            lines, cpu_s = estimate(recipe, model, args.card, Path(tmp))
            print(f"{recipe} with {model} ({cpu_s:.1f} s CPU):")
            for line in lines:
                print(f"  {line}")
            out.append({"recipe": recipe, "model": model, "lines": lines, "cpu_s": round(cpu_s, 2)})
    print(json.dumps(out))


if __name__ == "__main__":
    main()
