"""A tied-embedding model resumes after a level-2 sleep and a push: the model-update group sends a
tied LM head once (under the embedding's name, ``redundant_names`` skips the alias), and the
engine counts both names loaded, since they are one tensor."""

from __future__ import annotations

import pytest
import torch

from flash.engine.base import GenerationRequest, SamplingParams
from flash.engine.torch_engine import TorchEngine
from flash.weights.model_update import plan_state, redundant_names, unique_tensors
from tests.helpers.models import PROMPTS, hf_greedy, make_model

HEAD, EMBED = "lm_head.weight", "model.embed_tokens.weight"


def pushed(trainer_model, engine_model) -> list[tuple[str, torch.Tensor]]:
    """What the group loads into ``engine_model``: the trainer's tensors but the engine's own aliases."""
    state = trainer_model.state_dict()
    metas = plan_state(state, 1 << 20)
    ties = [names for names, _ in unique_tensors(engine_model.state_dict()) if len(names) > 1]
    skip = redundant_names(metas, ties)
    assert skip == {HEAD}
    return [(name, state[name]) for meta in metas for name in meta.names if name not in skip]


def test_a_tied_model_resumes_after_level_2_sleep_and_a_push():
    _, trainer_model = make_model(seed=1)
    _, engine_model = make_model(seed=2)
    assert engine_model.lm_head.weight is engine_model.model.embed_tokens.weight
    engine = TorchEngine(engine_model, max_num_seqs=4)
    engine.preempt("continue")
    assert engine.sleep(2)["weights"] == "discarded"
    assert engine_model.lm_head.weight.numel() == 0
    engine.wake_up()
    items = pushed(trainer_model, engine_model)
    engine.update_weights([(n, t) for n, t in items if n != EMBED], version=1)
    with pytest.raises(RuntimeError, match=r"push all of them before resume\(\) \(2 missing"):
        engine.resume()  # the tied tensor not pushed yet: under neither of its names
    engine.update_weights([(n, t) for n, t in items if n == EMBED], version=1)
    engine.resume()
    assert engine_model.lm_head.weight is engine_model.model.embed_tokens.weight  # still one tensor
    assert torch.equal(engine_model.lm_head.weight, trainer_model.lm_head.weight)
    reqs = [
        GenerationRequest(f"r{i}", p, SamplingParams(max_new_tokens=6, temperature=0.0)) for i, p in enumerate(PROMPTS)
    ]
    assert [o.token_ids for o in engine.generate(reqs)] == [hf_greedy(trainer_model, p, 6) for p in PROMPTS]
