"""The default recipe, trainer and engine colocated on one GPU, learns as it does on CPU.

The whole recipe (``flash run stutter``) in a process of its own, synchronous (``async_ratio=0``),
with one device mapped to both roles and the weights pushed by CUDA IPC (``model_update.backend``
named, so a run whose roles are not both on the GPU fails at setup instead of silently taking
another path). Bar: the CPU learning test's for a synchronous run (tests/e2e/test_default_recipe.py:
>= 20 points of held-out accuracy from the same warm start, every step trained).
"""

from __future__ import annotations

import math

from flash.app.config import load_config
from tests.helpers.processes import read_jsonl, recipe_summary

RECIPE = "recipes/stutter.yaml"
BAR = 0.20  # tests/e2e/test_default_recipe.py's bar(0): the least synchronous gain its measured spread supports
RUN_TIMEOUT_S = 420  # the longest test of tests/gpu: SFT warm start, 100 steps, evaluations
ONE_GPU = [
    "async_ratio=0",
    "placement.num_gpus=1",
    "placement.roles.actor_train.device_mapping=[0]",
    "placement.roles.actor_infer.device_mapping=[0]",
    "model_update.backend=cuda_ipc",
]


def test_default_recipe_colocated_on_one_gpu_learns(tmp_path, warm_cache):
    cfg = load_config(RECIPE, ONE_GPU)
    s = recipe_summary(tmp_path, warm_cache, RECIPE, ONE_GPU, timeout=RUN_TIMEOUT_S)
    gain = s["eval_accuracy_final"] - s["eval_accuracy_initial"]
    assert gain >= BAR, s
    assert s["steps"] == cfg.train.steps
    assert s["samples_trained"] == cfg.train.steps * cfg.train.prompts_per_step * cfg.rollout.n
    assert s["max_staleness_observed"] <= math.ceil(cfg.async_ratio)
    # each role's peak GPU memory in its phase, every step (the engine sleeps while the trainer steps)
    steps = read_jsonl(tmp_path / "metrics.jsonl")
    assert all(m["memory/train_peak_gb"] > 0 and m["memory/rollout_peak_gb"] > 0 for m in steps)
