"""Small in-process runs of the default recipe and the plain synchronous loop they must equal."""

from __future__ import annotations

import torch

from flash import algos
from flash.buffers import Group, Sample
from flash.controllers.scheduler import request_seed
from flash.app.config import load_config
from flash.app.settings import sampling_params, trainer_settings
from flash.cluster import load_model
from flash.engine.base import GenerationRequest, SamplingParams
from flash.engine.torch_engine import TorchEngine
from flash.train.batch import collate, flatten
from flash.train.trainer import Trainer

SMALL = [
    "sft.steps=40",
    "sft.eval_after=false",
    "model.tiny.num_layers=2",
    "train.prompts_per_step=4",
    "rollout.n=4",
    "rollout.max_new_tokens=32",
    "task.eval_size=16",
    "tracking.tensorboard=false",
    "tracking.progress=false",
    "resources.engine_threads=1",
    "resources.trainer_threads=1",
    "ray.num_cpus=2",
]


def small_cfg(tmp_path, cache, *extra):
    return load_config("recipes/stutter.yaml", [*SMALL, f"cache_dir={cache}", f"run_dir={tmp_path}", *extra])


def plain_sync_loop(cfg, model_path, task, tokenizer, steps):
    """The textbook loop: generate the batch, score, advantages, one step, copy weights."""
    torch.set_num_threads(1)
    engine = TorchEngine(load_model(model_path).eval(), max_num_seqs=cfg.rollout.max_num_seqs, seed=cfg.seed)
    trainer = Trainer(load_model(model_path), trainer_settings(cfg), seed=cfg.seed)
    params = sampling_params(cfg, tokenizer)
    B, n = cfg.train.prompts_per_step, cfg.rollout.n
    out = []
    for t in range(steps):
        items = [task.item(t * B + i) for i in range(B)]
        reqs = [
            GenerationRequest(
                f"{t * B + i}:{k}",
                _encode(tokenizer, items[i].prompt),
                SamplingParams(**{**params.__dict__, "seed": request_seed(cfg.seed, t * B + i, k)}),
            )
            for i in range(B)
            for k in range(n)
        ]
        outs = engine.generate(reqs)  # the whole batch at once, as the scheduler submits it
        groups = []
        for i in range(B):
            samples = []
            for k, o in enumerate(outs[i * n : (i + 1) * n]):
                s = Sample(
                    prompt_id=t * B + i,
                    sample_index=k,
                    prompt_ids=o.prompt_ids,
                    response_ids=o.token_ids,
                    behav_logprobs=o.logprobs,
                    versions=o.versions,
                )
                s.reward = task.reward(items[i], _decode(tokenizer, o.token_ids))
                samples.append(s)
            groups.append(Group(prompt_id=t * B + i, samples=samples))
        batch = collate(flatten(groups), pad_id=tokenizer.pad_token_id or 0)
        adv = algos.compute_advantages("grpo", batch.rewards, batch.group_ids, batch.mask)
        m = trainer.train_step(batch, adv, batch.behav_logp)
        engine.update_weights(trainer.state_dict(), t + 1)
        out.append(([s.response_ids for s in flatten(groups)], m["loss"]))
    return out


def _encode(tok, text):
    from flash.models import encode_prompt

    return encode_prompt(tok, text)


def _decode(tok, ids):
    from flash.models import decode_response

    return decode_response(tok, ids)


def assert_equals_plain_loop(records, cfg, run, steps: int) -> None:
    """A synchronous run's samples equal ``plain_sync_loop``'s token for token, its losses to 1e-6."""
    import pytest

    ours = [([s.response_ids for s in flatten(rec.groups)], rec.metrics["train/loss"]) for rec in records]
    ref = plain_sync_loop(cfg, run.model_path, run.task, run.tokenizer, steps)
    assert len(ours) == len(ref) == steps
    for t, ((tok_a, loss_a), (tok_b, loss_b)) in enumerate(zip(ours, ref)):
        assert tok_a == tok_b, f"step {t}: different samples"
        assert loss_a == pytest.approx(loss_b, rel=1e-6, abs=1e-7), f"step {t}"


def run_steps(run, steps: int):
    """Drive a built ``Run`` for ``steps`` controller steps, then close it: (records, engine stats)."""
    import ray

    try:
        run.scheduler.start()
        run.scheduler.start_admission()
        records = run.controller.run(steps)
        stats = ray.get(run.roles.engine.stats.remote())
    finally:
        run.close()
    return records, stats
