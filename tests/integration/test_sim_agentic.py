"""Simulated agentic runs: the synthetic environment (``flash.envs.synthetic``) and multi-turn
episodes with environment latency against the simulated engine and trainer."""

from __future__ import annotations

import json
import math

import pytest

from flash.envs.base import make_env
from flash.envs.synthetic import SyntheticOptions


def _play(seed: int, action: str = "zz", **options) -> tuple[list[str], float, str]:
    env = make_env("synthetic", **options)
    observations, done, result = [env.reset(seed)], False, None
    while not done:
        result = env.step(action)
        observations.append(result.observation)
        done = result.done
    return observations, result.reward, result.info["outcome"]


def test_synthetic_episodes_come_from_the_seed_whatever_the_actions():
    assert _play(11) == _play(11, action="anything at all")  # actions are not read
    lengths, wins = [], 0
    for seed in range(400):
        obs, reward, outcome = _play(seed, turns_min=3, turns_max=7, obs_chars=5, success_rate=0.25)
        lengths.append(len(obs) - 1)
        assert all(len(o) == 6 and o.endswith(":") for o in obs)
        assert (reward, outcome) in ((1.0, "success"), (0.0, "failure"))
        wins += reward == 1.0
    assert min(lengths) == 3 and max(lengths) == 7 and set(lengths) == set(range(3, 8))
    assert 0.19 < wins / 400 < 0.31
    env = make_env("synthetic")
    env.reset(0)
    while not env.step("a").done:
        pass
    with pytest.raises(RuntimeError, match="call reset"):
        env.step("a")


@pytest.mark.parametrize(
    "bad, match",
    [
        ({"turns_min": 0}, "turns_min"),
        ({"turns_min": 5, "turns_max": 4}, "turns_max"),
        ({"obs_chars": 0}, "obs_chars"),
        ({"success_rate": 1.5}, "success_rate"),
    ],
)
def test_synthetic_options_are_checked(bad, match):
    with pytest.raises(ValueError, match=match):
        SyntheticOptions(**bad)


def test_the_shipped_recipe_validates_and_a_turn_must_match_the_action_length():
    from flash.controllers.episode_runtime import check_episode_config
    from flash.app.config import load_config
    from flash.errors import ConfigError
    from flash.tasks import make_task

    cfg = load_config("recipes/sim_agentic.yaml")
    assert (cfg.rollout.engine, cfg.train.backend, cfg.task["name"]) == ("sim", "sim", "synthetic")
    task = make_task("synthetic", action_tokens=32)
    check_episode_config(cfg, task)  # the shipped turn length is the task's action length
    with pytest.raises(ConfigError, match="rollout.max_new_tokens=32"):
        check_episode_config(load_config("recipes/sim_agentic.yaml", ["rollout.max_new_tokens=16"]), task)


@pytest.fixture(scope="module")
def ray_session():
    import ray

    yield
    if ray.is_initialized():
        ray.shutdown()


def _sim_run(tmp_path, name: str, *overrides: str) -> tuple[dict, list[dict], list[dict]]:
    from flash.app.config import load_config
    from flash.app.runner import run

    d = tmp_path / name
    cfg = load_config(
        "recipes/sim_agentic.yaml",
        [
            f"run_dir={d}",
            "train.steps=4",
            "train.prompts_per_step=8",
            "rollout.n=4",
            "sim.rollout_gpus=4",
            "sim.train_gpus=4",
            "task.turns_min=2",
            "task.turns_max=4",
            "task.env_workers=2",
            "task.eval_size=2",
            "tracking.progress=false",
            "checkpoint.enabled=false",
            *overrides,
        ],
    )
    summary = run(cfg, "sim")
    ledger, metrics = (
        [json.loads(x) for x in (d / f).read_text().splitlines()] for f in ("ledger.jsonl", "metrics.jsonl")
    )
    return summary, ledger, metrics


@pytest.mark.slow  # ~40 s on a loaded machine, Ray and actor start-up included
def test_simulated_agentic_run_keeps_the_bound_loses_nothing_and_counts_the_environment(tmp_path, ray_session):
    ratio, steps, n, prompts = 2, 4, 4, 8
    summary, ledger, metrics = _sim_run(
        tmp_path, "a", f"async_ratio={ratio}", "sim.time_scale=0.02", "task.step_delay_s=5.0", "task.step_delay_sigma=0"
    )
    assert summary["steps"] == steps and summary["max_staleness_observed"] <= ratio
    trained = [x for x in ledger if x["outcome"] == "trained"]
    assert len(trained) == steps * prompts * n and all(x["step"] - x["version"] <= ratio for x in trained)
    groups: dict[int, list] = {}
    for x in trained:
        groups.setdefault(x["prompt_id"], []).append(x["sample"])
    assert all(sorted(v) == list(range(n)) for v in groups.values())
    left = [x["prompt_id"] for x in ledger if x["outcome"] != "trained" and "request" not in x]
    assert sorted(list(groups) + left) == list(range(summary["prompts_admitted"]))  # each prompt exactly once
    last = metrics[-1]
    turns, episodes = last["rollout/episodes/turns"], last["rollout/episodes/episodes"]
    assert 2.0 <= turns / episodes <= 4.0  # multi-turn: 2-4 environment steps per episode
    # every episode waits >= 2 environment steps of 5 simulated s, and at most 1 + r batches are in
    # flight: the run takes >= 10 s per 1 + r steps, which only counting the environment's spans as
    # simulated time gives (their wall time, 2 x 0.1 s, would otherwise be ~0.2 s of driver time)
    total = sum(m["sim/step_s"] for m in metrics)
    assert total >= steps * 10.0 / (1 + ratio)
    assert sum(m["sim/driver_s"] for m in metrics) < total / 2


@pytest.mark.margin  # ~30 s: two short runs (the engine's determinism is pinned in tests/integration/test_sim.py)
def test_a_simulated_agentic_run_is_deterministic_for_a_seed(tmp_path, ray_session):
    """Same seed, same episodes: every trained sample's tokens, reward and outcome (times differ)."""
    runs = [
        _sim_run(tmp_path, f"d{i}", "async_ratio=0", "train.steps=2", "sim.time_scale=0.005", "task.step_delay_s=0.5")
        for i in range(2)
    ]
    keys = [
        sorted(
            (x["prompt_id"], x["sample"], x["reward"], x.get("len"), x["step"])
            for x in ledger
            if x["outcome"] == "trained"
        )
        for _, ledger, _ in runs
    ]
    assert keys[0] == keys[1] and len(keys[0]) == 2 * 8 * 4
    assert not math.isclose(sum(k[2] for k in keys[0]), 0.0)  # rewards vary: episodes succeed and fail


@pytest.mark.slow  # ~40 s: hung steps wait out a 3 s timeout and a worker restart each
def test_an_episode_whose_step_hangs_again_after_its_replay_ends_as_env_hung(tmp_path, ray_session):
    """Latency drawn from (episode, step) comes back on a replay: without a bound, an episode whose
    step outlasts the hang timeout would kill its worker for ever. Median 0.09 real s, sigma 1.5:
    about one step in 100 outlasts the 3 s timeout."""
    summary, ledger, _ = _sim_run(
        tmp_path,
        "h",
        "async_ratio=1",
        "sim.time_scale=0.02",
        "task.step_delay_s=4.5",
        "task.step_delay_sigma=1.5",
        "rollout.hang_timeout_s=3",
        "rollout.max_worker_restarts=100",
    )
    counters = summary["rollout_counters"]
    hung = counters.get("outcome/env_hung", 0)
    assert hung >= 1 and counters["episodes_restarted"] >= hung
    assert summary["faults_env"] >= hung  # each hung episode's step killed its worker at least once
    trained = [x for x in ledger if x["outcome"] == "trained"]
    assert len({(x["prompt_id"], x["sample"]) for x in trained}) == len(trained) == 4 * 8 * 4
    assert sum(x.get("finish") == "env_hung" for x in trained) >= 1  # ended, scored, trained once
