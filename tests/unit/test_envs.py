"""Environments: protocol and registry, the corridor game, the FrozenLake adapter, episodes as
token sequences (observations masked out of the loss, per-turn versions). Episode rollout on Ray
is in test_envs_rollout.py."""

from types import SimpleNamespace

import pytest
import torch

from flash.buffers import Sample
from flash.buffers.trace import TokenTrace
from flash.train.batch import collate
from flash.envs import make_env, register_env
from flash.envs.corridor import Corridor, CorridorOptions, move, render
from flash.envs.episode import (
    Transcript,
    add_observation,
    add_turn,
    to_sample,
    transcript_text,
)
from flash.errors import ConfigError
from flash.models import (
    TinyModelConfig,
    build_tiny_model,
    build_tokenizer,
    encode_prompt,
)
from flash.train.trainer import token_logprobs
from flash.recipes.tasks import make_task


# ---- protocol and registry ---------------------------------------------------------------------
def test_registry_names_the_closest_env_and_option():
    with pytest.raises(ValueError, match="did you mean 'corridor'"):
        make_env("coridor")
    with pytest.raises(ValueError, match="did you mean 'width'"):
        make_env("corridor", widht=5)
    with pytest.raises(ValueError, match="width must be >= 2"):
        make_env("corridor", width=1)


def test_register_env_rejects_incomplete_or_duplicate_classes():
    class NoStep:
        Options = CorridorOptions
        actions, action_tokens = ("x",), 1

        def reset(self, seed):
            return ""

    with pytest.raises(TypeError, match=r"lacks \['step'\]"):
        register_env("nostep")(NoStep)
    with pytest.raises(ValueError, match="already registered by flash.envs.corridor.Corridor"):
        register_env("corridor")(type("Other", (Corridor,), {}))


def test_env_task_options_are_checked_with_the_closest_name():
    with pytest.raises(ValueError, match="did you mean 'max_turns'"):
        make_task("corridor", max_turn=3)
    with pytest.raises(ValueError, match="demo_noise must be in"):
        make_task("corridor", demo_noise=1.0)


# ---- corridor dynamics -------------------------------------------------------------------------
def corridor_at(agent, goal, width=8, slack=1):
    env = Corridor(CorridorOptions(width=width, slack=slack))
    env.reset(0)
    env.agent, env.goal, env.moves, env.budget = agent, goal, 0, abs(goal - agent) + slack
    return env


def test_corridor_render_and_walls():
    assert render(8, 2, 5) == "..a..g..:"
    assert move(8, 0, "l") == 0 and move(8, 7, "r") == 7 and move(8, 3, "l") == 2 and move(8, 3, "r") == 4


def test_corridor_straight_walk_succeeds_in_distance_moves():
    env = corridor_at(2, 5)
    assert env.step("r") == ("...a.g..:", 0.0, False, {"moves": 1})
    assert env.step("r") == ("....ag..:", 0.0, False, {"moves": 2})
    assert env.step("r") == (".....a..:", 1.0, True, {"outcome": "success", "moves": 3})
    with pytest.raises(RuntimeError, match="call reset"):
        env.step("r")


def test_corridor_one_wrong_move_loses_with_slack_one():
    env = corridor_at(2, 5)  # budget 3 + 1 = 4 moves
    results = [env.step(a) for a in "lrrr"]
    assert [r.observation for r in results] == [".a...g..:", "..a..g..:", "...a.g..:", "....ag..:"]
    assert results[-1][1:3] == (0.0, True) and results[-1].info["outcome"] == "out_of_moves"


def test_corridor_invalid_action_ends_the_episode():
    env = corridor_at(2, 5)
    obs, reward, done, info = env.step("x")
    assert (obs, reward, done, info["outcome"]) == ("..a..g..:", 0.0, True, "invalid_action")


def test_corridor_reset_is_deterministic_and_expert_solves_every_seed():
    env = make_env("corridor")
    assert env.reset(123) == make_env("corridor").reset(123)
    for seed in range(50):
        env.reset(seed)
        for _ in range(10):
            _, reward, done, info = env.step(env.expert_action())
            if done:
                break
        assert info["outcome"] == "success" and reward == 1.0


# ---- FrozenLake adapter --------------------------------------------------------------------------
def test_frozenlake_text_and_path_on_a_hand_map():
    from flash.envs.gym import lake_text, shortest_path_action

    desc = ["SFFF", "FHFH", "FFFH", "HFFG"]
    assert lake_text(desc, 0) == "*fff|fhfh|fffh|hffg:"
    assert lake_text(desc, 6) == "sfff|fh*h|fffh|hffg:"
    assert shortest_path_action(desc, 0) in ("r", "d")
    assert shortest_path_action(desc, 4) == "d"  # (1,0): right is a hole
    assert shortest_path_action(desc, 14) == "r"  # next to the goal


def test_frozenlake_adapter_steps_gymnasium():
    pytest.importorskip("gymnasium", reason="FrozenLake needs the 'envs' extra: pip install 'flash-rl[envs]'")
    from flash.envs.gym import lake_text

    env = make_env("frozenlake")
    obs = env.reset(7)
    assert obs == lake_text(env.desc, 0) and obs.startswith("*") and obs.endswith(":")
    assert env.reset(7) == obs  # deterministic map per seed
    for _ in range(20):
        obs, reward, done, info = env.step(env.expert_action())
        if done:
            break
    assert (reward, info["outcome"]) == (1.0, "success")
    assert obs == lake_text(env.desc, len(env.desc) ** 2 - 1)
    env.reset(7)
    assert env.step("x")[2:] == (True, {"outcome": "invalid_action", "action": "x", "valid": ["l", "d", "r", "u"]})
    seed = next(s for s in range(200) if make_env("frozenlake").reset(s)[1] == "h")  # a hole right of start
    env.reset(seed)
    result = env.step("r")
    assert (result.reward, result.done, result.info["outcome"]) == (0.0, True, "hole")


# ---- episodes as token sequences -----------------------------------------------------------------
def two_turn_transcript():
    t = Transcript(TokenTrace([1, 5, 6]), observations=["ab"])
    add_turn(t, [7], [-0.5], [0], version_now=0)
    add_observation(t, [8, 9])
    add_turn(t, [10, 11], [-0.2, -0.3], [1, 2], version_now=1)  # a turn continued across an update
    t.actions, t.observations, t.reward = ["x", "yz"], ["ab", "cd", "ef"], 1.0
    return t


def test_episode_sample_masks_observations_and_dates_them_by_the_next_turn():
    s = to_sample(two_turn_transcript(), prompt_id=3, sample_index=1, admitted_version=0, outcome="success", meta={})
    assert s.prompt_ids == [1, 5, 6] and s.response_ids == [7, 8, 9, 10, 11]
    assert s.loss_mask == [1, 0, 0, 1, 1]
    assert s.behav_logprobs == [-0.5, 0.0, 0.0, -0.2, -0.3]
    assert s.versions == [0, 1, 1, 1, 2]  # observation tokens carry the next turn's first version
    assert s.version == 0 and s.reward == 1.0 and s.meta["turns"] == 2


def test_trailing_observation_without_a_turn_is_dropped():
    t = two_turn_transcript()
    add_observation(t, [12, 13])  # the next turn was refused by the engine
    s = to_sample(t, prompt_id=0, sample_index=0, admitted_version=0, outcome="request_error", meta={})
    assert s.response_ids == [7, 8, 9, 10, 11] and len(s.loss_mask) == len(s.versions) == 5


class _Core:
    n, counters = 1, {}

    def __init__(self):
        self.delivered = []

    def deliver(self, outs):
        self.delivered += outs


@pytest.mark.parametrize("outcome", ["abort", "error", "success"])
def test_an_episode_ends_as_a_finished_unit_whatever_its_environment_calls_the_outcome(outcome):
    from flash.controllers.workflows.base import Unit
    from flash.controllers.workflows.episode import EpisodeCodec, Episodes, _Episode
    from flash.engine.base import SamplingParams
    from flash.tasks import TaskItem

    worker = SimpleNamespace(close=SimpleNamespace(remote=lambda key: None))  # an EnvWorker's handle
    wf = Episodes([worker], EpisodeCodec(list, list, str), max_turns=4, env_threads=1)
    wf.core = core = _Core()
    unit = Unit("3:0", 3, 0, TaskItem(index=0, prompt="", answer="", meta={"seed": 5}), [], SamplingParams())
    ep = _Episode(unit, wf.workers[0], 0, transcript=two_turn_transcript())
    wf._live[unit.id] = ep
    wf._finish(ep, outcome)  # an environment's info["outcome"] is any name it likes
    (out,) = core.delivered
    # the core takes an 'abort' output for an engine partial (dropped: the prompt would never end)
    # and an 'error' one for a request the engine refused
    assert out.request_id == unit.id and out.finish_reason not in ("abort", "error")
    assert wf.finish(unit, out).finish_reason == outcome  # the sample keeps the environment's name
    wf.stop()


def test_collate_honours_loss_mask_and_loss_equals_llm_tokens_alone():
    tok = build_tokenizer()
    model = build_tiny_model(
        tok,
        TinyModelConfig(
            hidden_size=64, num_layers=1, num_heads=2, num_kv_heads=2, intermediate_size=64, max_positions=64
        ),
    )
    episode = to_sample(two_turn_transcript(), prompt_id=0, sample_index=0, admitted_version=0, outcome="s", meta={})
    plain = Sample(
        prompt_id=1,
        sample_index=0,
        prompt_ids=[1, 20, 21],
        response_ids=[22, 23, 2],
        behav_logprobs=[-1.0, -1.0, -1.0],
        versions=[0, 0, 0],
    )
    batch = collate([episode, plain])
    assert batch.mask.tolist() == [[0, 0, 1, 0, 0, 1, 1], [0, 0, 1, 1, 1, 0, 0]]
    assert batch.versions[0].tolist() == [0, 0, 0, 1, 1, 1, 2]
    with torch.no_grad():
        logp, _ = token_logprobs(model, batch, 1.0)
        loss = -(logp * batch.mask).sum() / batch.mask.sum()
        # by hand: each LLM token's logprob from a forward over its own row, nothing else
        manual = []
        for s in (episode, plain):
            seq = torch.tensor([s.prompt_ids + s.response_ids])
            lp = torch.log_softmax(model(input_ids=seq).logits[0].float(), -1)
            for j, tok_id in enumerate(s.response_ids):
                if s.loss_mask is None or s.loss_mask[j]:
                    pos = len(s.prompt_ids) + j
                    manual.append(lp[pos - 1, tok_id])
    assert len(manual) == 6 and float(batch.mask.sum()) == 6  # 3 action tokens + 3 plain response tokens
    assert abs(float(loss) - float(-torch.stack(manual).mean())) < 1e-5


def test_collate_rejects_a_loss_mask_of_the_wrong_length():
    s = Sample(
        prompt_id=0,
        sample_index=0,
        prompt_ids=[1],
        response_ids=[5, 6],
        behav_logprobs=[0, 0],
        versions=[0, 0],
        loss_mask=[1],
    )
    with pytest.raises(ValueError, match="loss_mask has 1 entries for 2 response tokens"):
        collate([s])


def test_sft_demonstration_has_the_tokens_an_episode_context_has():
    task = make_task("corridor", demo_noise=0.3)
    tok = build_tokenizer()
    for index in range(20):
        observations, actions = task.demonstration(index)
        t = Transcript(TokenTrace(encode_prompt(tok, observations[0])), observations=[observations[0]])
        for act, obs in zip(actions, observations[1:]):
            add_turn(t, encode_prompt(tok, act)[1:], [0.0], [0], 0)
            add_observation(t, encode_prompt(tok, obs)[1:])
        k = len(observations) - 1
        assert t.trace.tokens == encode_prompt(tok, transcript_text(observations, actions[:k]))
        prompt, action = task.sft_pair(index)
        assert action in ("l", "r") and (prompt + action) in transcript_text(observations, actions)


def test_runner_rejects_multi_token_turns_for_single_character_actions(tmp_path):
    from flash.app.config import load_config
    from flash.controllers.episode_runtime import check_episode_config

    cfg = load_config("recipes/corridor.yaml", ["rollout.max_new_tokens=8"])
    with pytest.raises(ConfigError, match="set rollout.max_new_tokens=1"):
        check_episode_config(cfg, make_task("corridor"))


def test_tail_batching_is_refused_for_episode_tasks_before_anything_starts():
    from flash.app.config import load_config
    from flash.controllers.episode_runtime import check_episode_config

    cfg = load_config("recipes/corridor.yaml", ["rollout.scheduler=tail_batching"])
    with pytest.raises(ConfigError, match="runs multi-turn episodes: set rollout.scheduler: plain"):
        check_episode_config(cfg, make_task("corridor"))


@pytest.mark.parametrize("reward", [float("nan"), float("-inf"), None, "many"])
def test_an_environment_reward_that_is_not_a_finite_number_ends_its_episode_as_env_error(reward):
    """A NaN reward would make its group's advantages NaN and the whole step would be skipped."""
    from flash.controllers.workflows.base import Unit
    from flash.controllers.workflows.episode import EpisodeCodec, Episodes, _Episode
    from flash.engine.base import SamplingParams
    from flash.tasks import TaskItem

    worker = SimpleNamespace(close=SimpleNamespace(remote=lambda key: None))
    wf = Episodes([worker], EpisodeCodec(list, list, str), max_turns=4, env_threads=1)
    wf.core = core = _Core()
    unit = Unit("4:0", 4, 0, TaskItem(index=0, prompt="", answer="", meta={"seed": 6}), [], SamplingParams())
    ep = _Episode(unit, wf.workers[0], 0, transcript=two_turn_transcript())
    ep.transcript.reward = 0.5  # earned by the steps before
    wf._live[unit.id] = ep
    wf._env = lambda ep, method, *args: ("obs", reward, False, {})
    before = wf.counters.get("env_errors", 0)  # (the counters live on the core: shared by these cases)
    wf._step(ep, "left")
    (out,) = core.delivered
    sample = wf.finish(unit, out)
    assert sample.finish_reason == "env_error" and sample.reward == 0.5
    assert wf.counters["env_errors"] == before + 1 and f"step returned reward {reward!r}" in wf.last_env_error
    wf.stop()
