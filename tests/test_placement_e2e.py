"""The runner with several engine replicas placed by AutoDeviceMapping on simulated GPUs.

- Disaggregated (trainer on device 0, two engine replicas on devices 1 and 2 of 4), synchronous:
  the samples and losses equal the plain synchronous loop's with one engine -- the router changes
  where requests run, never what they generate (per-request seeds).
- Colocated (trainer and two engine replicas on the same 2 devices), async ratio 1: the engines
  sleep through every train phase, the staleness bound holds and every admitted prompt ends
  exactly once.
"""

import json
import math

import pytest
import ray

from flash.batch import flatten
from flash.runner import Run, run
from tests.test_controller_e2e import plain_sync_loop, small_cfg


@pytest.fixture(scope="module")
def cache(tmp_path_factory):
    yield str(tmp_path_factory.mktemp("cache"))
    ray.shutdown()


DISAGGREGATED = ["placement.num_gpus=4", "placement.roles.actor_train.device_mapping=[0]",
                 "placement.roles.actor_infer.device_mapping=[1,2]", "placement.roles.actor_infer.num_workers=2"]
COLOCATED = ["placement.num_gpus=2", "placement.roles.actor_train.device_mapping=[0,1]",
             "placement.roles.actor_infer.device_mapping=[0,1]", "placement.roles.actor_infer.num_workers=2"]


@pytest.mark.slow
def test_two_disaggregated_replicas_reproduce_the_synchronous_loop(tmp_path, cache):
    ray.shutdown()  # a local Ray with 4 (simulated) GPUs
    cfg = small_cfg(tmp_path, cache, "async_ratio=0", "algo.loss.name=ppo", *DISAGGREGATED)
    r = Run(cfg, "sync2")
    try:
        assert not r.controller.s.colocated and len(r.replicas) == 2
        r.scheduler.start()
        r.scheduler.start_admission()
        records = r.controller.run(3)
        stats = ray.get(r.engine.stats.remote())
    finally:
        r.close()
    ours = [([s.response_ids for s in flatten(rec.groups)], rec.metrics["train/loss"]) for rec in records]
    ref = plain_sync_loop(cfg, r.model_path, r.task, r.tokenizer, 3)
    for t, ((tok_a, loss_a), (tok_b, loss_b)) in enumerate(zip(ours, ref)):
        assert tok_a == tok_b, f"step {t}: different samples"
        assert loss_a == pytest.approx(loss_b, rel=1e-6, abs=1e-7), f"step {t}"
    assert stats["replicas"] == 2 and stats["version"] == 3
    assert stats["replica0/routed"] > 0 and stats["replica1/routed"] > 0  # both replicas served


@pytest.mark.slow
def test_colocated_replicas_sleep_through_training_and_lose_nothing(tmp_path, cache):
    ray.shutdown()
    steps, ratio = 4, 1
    cfg = small_cfg(tmp_path, cache, f"async_ratio={ratio}", f"train.steps={steps}", "rollout.prompt_affinity=true",
                    *COLOCATED)
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
