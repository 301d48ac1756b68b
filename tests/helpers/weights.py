"""A model-update push as the controller makes it: engines paused, pushed, resumed."""

from __future__ import annotations

import ray


def push(group, engines, version: int) -> dict:
    """``group.push(version)`` while every engine is paused (the engines' loading needs it)."""
    ray.get([e.pause.remote("continue") for e in engines])
    try:
        return group.push(version)
    finally:
        ray.get([e.resume.remote() for e in engines])


def vllm_start(tmp_path, dtype: str = "float32", **engine_kwargs):
    """A trainer on the tiny Qwen2 B and a vLLM engine in ``dtype`` started on A: (trainer, engine,
    A's path)."""
    from flash.cluster import init_ray, wait_ready
    from flash.engine.torch_worker import start_engine
    from flash.train.trainer import TrainerSettings
    from flash.train.worker import start_trainer
    from tests.helpers.models import make_model

    init_ray(None, num_cpus=2)
    paths = {}
    for seed in (0, 1):  # the engine starts on A, the trainer holds B
        tok, model = make_model(seed)
        paths[seed] = str(tmp_path / f"m{seed}")
        model.save_pretrained(paths[seed])
        tok.save_pretrained(paths[seed])
    settings = TrainerSettings(
        lr=0.05,
        weight_decay=0.0,
        betas=(0.9, 0.999),
        grad_clip=1.0,
        micro_batch_size=64,
        temperature=1.0,
        loss={"name": "ppo", "old_policy": "prox"},
        agg="token-mean",
    )
    trainer = start_trainer(paths[1], settings, seed=0, threads=1, plugins=[])
    engine = start_engine(
        paths[0], max_num_seqs=16, seed=0, threads=1, engine="vllm", engine_kwargs={"dtype": dtype, **engine_kwargs}
    )
    wait_ready(engine, trainer, timeout=600)
    return trainer, engine, paths[0]
