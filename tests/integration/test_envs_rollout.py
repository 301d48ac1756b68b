"""Episode rollout on Ray with a real engine and EnvWorker actors (tiny warm-started model).

- A suspend (pause + weight update + resume) while environment steps run waits for them and holds
  new ones back; every episode's transcript stays consistent: each action applied exactly once,
  the observations equal a replay of the actions, the tokens equal the transcript's text, and the
  turns after the update carry the new version.
- Through ``flash run``: every admitted seed ends trained, buffered or in flight, exactly once.
"""

import dataclasses
import json
import time

import pytest
import ray
from transformers import AutoTokenizer

from flash.buffers import SampleBuffer
from flash.controllers.episode_runtime import EpisodeScheduler
from flash.controllers.staleness import StalenessManager
from flash.engine.base import SamplingParams
from flash.envs import make_env
from flash.envs.episode import transcript_text
from flash.controllers.episode_runtime import episode_codec
from flash.envs.worker import start_env_workers
from flash.models import TinyModelConfig, encode_prompt
from flash.train.sft import SFTConfig, warm_start
from flash.cluster import init_ray, load_model, wait_ready
from flash.engine.torch_worker import start_engine
from flash.recipes.tasks import make_task
from tests.helpers.processes import TINY_OVERRIDES
from tests.helpers.waiting import wait_until

TINY = TinyModelConfig(
    hidden_size=64, num_layers=1, num_heads=2, num_kv_heads=2, intermediate_size=64, max_positions=128
)


@pytest.fixture(scope="module")
def cache(warm_cache):
    return warm_cache


@pytest.fixture(scope="module")
def model_path(cache):
    return warm_start(TINY, SFTConfig(steps=80, eval_after=False), make_task("corridor"), cache)


@pytest.fixture(scope="module", autouse=True)
def ray_session():
    yield
    if ray.is_initialized():
        ray.shutdown()


def expected_mask(actions, observations, codec):
    """1 on each action's tokens, 0 on each observation between turns."""
    mask = []
    for i, act in enumerate(actions):
        mask += [1] * max(1, len(codec.encode_observation(act)))
        if i + 1 < len(actions):
            mask += [0] * len(codec.encode_observation(observations[i + 1]))
    return mask


def check_episode(sample, worker, codec, tok):
    """The episode's transcript is what the environment did, and its tokens are that transcript."""
    actions, observations = sample.meta["actions"], sample.meta["observations"]
    assert ray.get(worker.applied.remote(f"{sample.prompt_id}:{sample.sample_index}")) == actions
    env = make_env("corridor")
    replay = [env.reset(sample.meta["seed"])] + [env.step(a)[0] for a in actions]
    assert replay == observations
    if all(a in ("l", "r") for a in actions):  # (an <eos> action decodes to '' and ends the episode)
        text = transcript_text(observations[: len(actions)], actions)
        assert sample.prompt_ids + sample.response_ids == encode_prompt(tok, text)
        assert sample.loss_mask == expected_mask(actions, observations, codec)
    acts = [v for v, m in zip(sample.versions, sample.loss_mask) if m]
    assert sample.versions == sorted(sample.versions)  # observations carry the next turn's version
    assert len(acts) == len(actions) and set(acts) <= {0, 1}


@pytest.mark.slow  # ~2 min on a loaded 2-core machine
def test_environment_steps_run_on_through_a_weight_update(model_path):
    """A weight update holds no environment step: the ones in flight finish during it and new ones
    start, their next turns wait in the paused engine, and every episode stays consistent."""
    init_ray(None, 2)
    task = make_task("corridor")
    tok = AutoTokenizer.from_pretrained(model_path)
    codec = episode_codec(tok)
    engine = start_engine(model_path, 64, 0, 1)
    workers = start_env_workers(2, "corridor", dataclasses.asdict(task.options), step_delay_s=0.4)
    wait_ready(engine)
    buffer = SampleBuffer(16)
    params = SamplingParams(max_new_tokens=1, temperature=1.0, stop_token_ids=[tok.eos_token_id])
    sched = EpisodeScheduler(
        engine, workers, task, codec, buffer, StalenessManager(0, 2), params, n=2, seed=0, max_turns=10
    )
    sched.start()
    sched.start_admission()
    wait_until(
        lambda: sched.counters["turns"] >= 2 and sum(ray.get(w.stats.remote())["in_step"] for w in workers) >= 1,
        timeout=120.0,
        what="an environment step in flight",
    )
    ray.get(engine.pause.remote("continue"))
    steps = sum(ray.get(w.stats.remote())["steps"] for w in workers)
    time.sleep(1.5)  # paused: the steps in flight return (0.4 s each), none is held back
    assert sum(ray.get(w.stats.remote())["steps"] for w in workers) > steps
    ray.get(engine.update_weights.remote(load_model(model_path).state_dict(), 1))
    ray.get(engine.resume.remote())
    sched.set_version(1)  # r = 0, B = 2: two more seeds at version 1
    groups = [buffer.get_batch(1, timeout=240)[0] for _ in range(4)]
    sched.stop()
    samples = [s for g in sorted(groups, key=lambda g: g.prompt_id) for s in g.samples]
    assert [g.prompt_id for g in sorted(groups, key=lambda g: g.prompt_id)] == [0, 1, 2, 3]
    for s in samples:
        check_episode(s, workers[(s.prompt_id * 2 + s.sample_index) % 2], codec, tok)
    assert any(0 in s.versions and 1 in s.versions for s in samples[:4])  # episodes spanned the update
    assert all(set(s.versions) == {1} for s in samples[4:])  # admitted after it
    outcomes = {k: v for k, v in sched.counters.items() if k.startswith("outcome/")}
    assert sum(outcomes.values()) == sched.counters["episodes"] == 8
    assert sched.counters["turns"] == sum(len(s.meta["actions"]) for s in samples)
    for actor in (engine, *workers):
        ray.kill(actor)


@pytest.mark.slow
def test_flash_run_episodes_nothing_lost(tmp_path, cache):
    from flash.app.config import load_config
    from flash.app.runner import run

    cfg = load_config(
        "recipes/corridor.yaml",
        [
            *TINY_OVERRIDES,
            f"cache_dir={cache}",
            f"run_dir={tmp_path}",
            "train.steps=3",
            "train.prompts_per_step=2",
            "rollout.n=2",
            "async_ratio=1",
            "rollout.interrupt=restart",
            "task.eval_size=4",
            "task.step_delay_s=0.05",
            "tracking.tensorboard=false",
            "tracking.progress=false",
            "resources.engine_threads=1",
            "resources.trainer_threads=1",
            "ray.num_cpus=2",
        ],
    )
    summary = run(cfg, "corridor-test")
    rows = [json.loads(line) for line in (tmp_path / "ledger.jsonl").read_text().splitlines()]
    trained = [r["prompt_id"] for r in rows if r["outcome"] == "trained"]
    left = {r["prompt_id"] for r in rows if r["outcome"] in ("buffered", "in_flight")}
    assert len(trained) == 3 * 2 * 2  # steps x prompts x samples
    assert sorted(set(trained) | left) == list(range(summary["prompts_admitted"]))
    assert not set(trained) & left and all(trained.count(p) == 2 for p in set(trained))
    c = summary["rollout_counters"]
    assert sum(v for k, v in c.items() if k.startswith("outcome/")) == c["episodes"] >= 12 + 4 + 4
    assert 0.0 <= summary["eval_accuracy_final"] <= 1.0 and summary["max_staleness_observed"] <= 1


@pytest.mark.slow
def test_an_episode_past_the_context_ends_as_a_counted_request_error(model_path):
    """Width 50: the third turn's context (1 + 3 x 51 + 2 tokens) exceeds the 128-token context,
    so the engine refuses it; the episode ends 'request_error' with its two turns, nothing hangs."""
    init_ray(None, 2)
    task = make_task("corridor", width=50, slack=40)
    tok = AutoTokenizer.from_pretrained(model_path)
    engine = start_engine(model_path, 64, 0, 1)
    workers = start_env_workers(1, "corridor", dataclasses.asdict(task.options))
    wait_ready(engine)
    buffer = SampleBuffer(16)
    params = SamplingParams(max_new_tokens=1, temperature=1.0, stop_token_ids=[tok.eos_token_id])
    sched = EpisodeScheduler(
        engine, workers, task, episode_codec(tok), buffer, StalenessManager(0, 4), params, n=2, seed=0, max_turns=10
    )
    sched.start()
    sched.start_admission()
    samples = [s for _ in range(4) for s in buffer.get_batch(1, timeout=240)[0].samples]
    sched.stop()
    refused = [s for s in samples if s.finish_reason == "request_error"]
    assert len(refused) == sched.counters["request_errors"] == sched.counters.get("outcome/request_error", 0)
    assert refused, [s.finish_reason for s in samples]
    for s in refused:
        assert len(s.meta["actions"]) == 2 and s.loss_mask == [1] + [0] * 51 + [1] and s.reward == 0.0
    assert {s.finish_reason for s in samples} <= {"success", "request_error", "invalid_action", "out_of_moves"}
    for actor in (engine, *workers):
        ray.kill(actor)
