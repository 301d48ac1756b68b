"""The runner with several engine replicas placed by AutoDeviceMapping on simulated GPUs.

- Disaggregated (trainer on device 0, two engine replicas on devices 1 and 2 of 4), synchronous:
  the samples and losses equal the plain synchronous loop's with one engine -- the router changes
  where requests run, never what they generate (per-request seeds).
- Colocated (trainer and two engine replicas on the same 2 devices), async ratio 1: the engines
  sleep through every train phase, the staleness bound holds and every admitted prompt ends
  exactly once.
- A 2-rank FSDP2 trainer group and 2 replicas, disaggregated on 4 devices (gloo) and colocated on 2
  (shared memory): each rank sits in its own device's bundle, and after the controller's updates
  every replica serves exactly the group's gathered state dict, pushed through the model-update
  group (not Ray's object store), at the version every replica acknowledged.
"""

import json
import math

import pytest
import ray
import torch

from flash.app.runner import Run, run
from flash.cluster import load_model
from flash.weights.model_update import unique_tensors
from tests.helpers.inproc import assert_equals_plain_loop, run_steps, small_cfg
from tests.helpers.processes import recipe_summary


@pytest.fixture(scope="module")
def cache(warm_cache):
    yield warm_cache
    ray.shutdown()


DISAGGREGATED = [
    "placement.num_gpus=4",
    "placement.roles.actor_train.device_mapping=[0]",
    "placement.roles.actor_infer.device_mapping=[1,2]",
    "placement.roles.actor_infer.num_workers=2",
]
COLOCATED = [
    "placement.num_gpus=2",
    "placement.roles.actor_train.device_mapping=[0,1]",
    "placement.roles.actor_infer.device_mapping=[0,1]",
    "placement.roles.actor_infer.num_workers=2",
]
# 2 trainer ranks (train.workers=2 implies actor_train.num_workers=2) + 2 engine replicas
GROUP_LAYOUTS = {
    # (overrides, each rank's devices, each replica's devices, the model-update backend)
    "disaggregated": (
        [
            "placement.num_gpus=4",
            "placement.roles.actor_train.device_mapping=[0,1]",
            "placement.roles.actor_infer.device_mapping=[2,3]",
            "placement.roles.actor_infer.num_workers=2",
            "model_update.backend=gloo",
        ],
        [[0], [1]],
        "gloo",
    ),
    "colocated": (COLOCATED, [[0], [1]], "shm"),  # auto: members share devices on one host
}


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory):
    """A random tiny model (no warm start: this test is about the bytes, not the learning)."""
    from tests.helpers.models import TINY, save_tiny

    return save_tiny(tmp_path_factory.mktemp("tiny"), TINY)


@pytest.mark.slow  # ~30 s a layout on a quiet machine (Ray with 4 simulated GPUs, 2 ranks, 2 replicas)
@pytest.mark.parametrize("layout", sorted(GROUP_LAYOUTS))
def test_two_rank_group_pushes_exact_weights_to_two_replicas(tmp_path, tiny_model, layout):
    ray.shutdown()
    extra, rank_devices, backend = GROUP_LAYOUTS[layout]
    # weight decay moves every weight at each step even where a random model's rewards are all 0
    cfg = small_cfg(
        tmp_path,
        str(tmp_path / "cache"),
        f"model.path={tiny_model}",
        "train.weight_decay=0.1",
        "async_ratio=1",
        "train.workers=2",
        *extra,
    )
    assert cfg.placement.roles.actor_train.num_workers == 2
    r = Run(cfg, f"group-{layout}")
    try:
        assert r.roles.model_update.backend == backend and len(r.roles.replicas) == 2
        assert ray.get(r.roles.trainer.devices.remote()) == rank_devices
        r.scheduler.start()
        r.scheduler.start_admission()
        records = r.controller.run(2)
        full = ray.get(r.roles.trainer.get_weights.remote())
        served = ray.get([e.get_weights.remote() for e in r.roles.replicas])
        versions = ray.get([e.version.remote() for e in r.roles.replicas])
    finally:
        r.close()
    assert versions == [2, 2] and r.roles.model_update.version == 2 and r.roles.model_update.counters["pushes"] == 2
    initial = load_model(r.model_path).state_dict()
    same = [k for k in full if torch.equal(full[k], initial[k]) and initial[k].any()]
    assert not same, same  # two steps moved every weight (but the zero-initialised biases)
    for i, got in enumerate(served):
        assert got.keys() == full.keys()
        for name, t in full.items():
            assert torch.equal(got[name], t), f"replica {i}: {name} differs from the trainer's"
    unique = sum(t.numel() * t.element_size() for _, t in unique_tensors(initial))  # a tied head once
    for rec in records:  # through the group (not the object store), to both replicas
        assert rec.metrics["model_update/replicas"] == 2.0
        assert unique <= rec.metrics["model_update/bytes"] < unique + 64 * len(full)


@pytest.mark.slow
def test_two_disaggregated_replicas_reproduce_the_synchronous_loop(tmp_path, cache):
    ray.shutdown()  # a local Ray with 4 (simulated) GPUs
    cfg = small_cfg(tmp_path, cache, "async_ratio=0", "algo.loss.name=ppo", *DISAGGREGATED)
    r = Run(cfg, "sync2")
    colocated, replicas = r.controller.s.colocated, len(r.roles.replicas)
    records, stats = run_steps(r, 3)
    assert not colocated and replicas == 2
    assert_equals_plain_loop(records, cfg, r, 3)
    assert stats["replicas"] == 2 and stats["version"] == 3
    assert stats["replica0/routed"] > 0 and stats["replica1/routed"] > 0  # both replicas served


@pytest.mark.slow
def test_colocated_replicas_sleep_through_training_and_lose_nothing(tmp_path, cache):
    ray.shutdown()
    steps, ratio = 4, 1
    cfg = small_cfg(
        tmp_path, cache, f"async_ratio={ratio}", f"train.steps={steps}", "rollout.prompt_affinity=true", *COLOCATED
    )
    summary = run(cfg, "colocated")
    assert summary["steps"] == steps and summary["max_staleness_observed"] <= math.ceil(ratio)
    metrics = [json.loads(x) for x in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert all("time/sleep" in m and "time/wake_up" in m for m in metrics)  # engines slept every step
    lines = [json.loads(x) for x in (tmp_path / "ledger.jsonl").read_text().splitlines()]
    trained = {}
    for x in lines:
        if x["outcome"] == "trained":
            trained.setdefault(x["prompt_id"], []).append(x["sample"])
    assert all(sorted(v) == list(range(cfg.rollout.n)) for v in trained.values())
    left = [x["prompt_id"] for x in lines if x["outcome"] != "trained"]
    assert sorted([*trained, *left]) == list(range(summary["prompts_admitted"]))
    assert len(trained) == steps * cfg.train.prompts_per_step


RECIPE_LAYOUTS = {  # the README's 2 + 2 commands: train.workers=2 implies actor_train.num_workers=2
    "disaggregated": [
        "placement.num_gpus=4",
        "placement.roles.actor_train.device_mapping=[0,1]",
        "placement.roles.actor_infer.device_mapping=[2,3]",
        "placement.roles.actor_infer.num_workers=2",
    ],
    "colocated": COLOCATED,
}


# Both layouts' learning runs are in the margin set (pytest -m margin, ~2 min each): their
# mechanics -- the exact push to every replica from the 2-rank group, the engines asleep through
# training when colocated, nothing lost, the synchronous run equal to the plain loop -- are pinned
# above in seconds, and the single-process learning bar stays in the default suite
# (tests/e2e/test_default_recipe.py).
LAYOUT_PARAMS = [pytest.param(name, marks=pytest.mark.margin) for name in sorted(RECIPE_LAYOUTS)]


@pytest.mark.slow  # the whole default recipe (a few minutes on 2 cores), like tests/e2e/test_default_recipe.py
@pytest.mark.parametrize("layout", LAYOUT_PARAMS)
def test_default_recipe_learns_with_two_ranks_and_two_replicas(tmp_path, cache, layout):
    """The default recipe, unchanged but for 2 FSDP2 ranks and 2 engine replicas placed on simulated
    GPUs: the single-process learning bar at the recipe's async ratio (tests/e2e/test_default_recipe.py,
    from the measured spread of asynchronous runs) holds in both layouts."""
    from flash.app.config import load_config

    overrides = ["train.workers=2", *RECIPE_LAYOUTS[layout]]
    cfg = load_config("recipes/stutter.yaml", overrides)
    s = recipe_summary(tmp_path, cache, "recipes/stutter.yaml", overrides)  # a process of its own
    gain = s["eval_accuracy_final"] - s["eval_accuracy_initial"]
    assert gain >= (0.20 if cfg.async_ratio == 0 else 0.15), s
    assert s["steps"] == cfg.train.steps and s["max_staleness_observed"] <= math.ceil(cfg.async_ratio)
    assert s["samples_trained"] == cfg.train.steps * cfg.train.prompts_per_step * cfg.rollout.n
    metrics = [json.loads(x) for x in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert all(m["model_update/replicas"] == 2.0 and m["model_update/bytes"] > 0 for m in metrics)
    assert all(("time/sleep" in m) == (layout == "colocated") for m in metrics)
