"""Environments as tasks: what a recipe's ``task: {name: corridor}`` names.

An ``EnvTask`` is a ``Task`` whose item ``i`` is an environment seed (train and eval seeds come from
separate streams, so the held-out metric is on unseen starts) and whose prompt is the seed's first
observation. The runner sees ``isinstance(task, EnvTask)`` and rolls out episodes
(``flash.controllers.workflows.episode``) instead of single responses; the reward then comes from the
environment, not from ``reward``.

Options are the environment's own knobs plus the episode knobs of ``EpisodeOptions`` in one flat
dataclass (``task.width``, ``task.max_turns``, ...), checked like every task's options.

Warm start: ``sft_pair(i)`` is one turn of a demonstration episode played by the environment's
``expert_action`` where each move is, with probability ``demo_noise``, replaced by another valid
action; the prompt is the transcript so far (``flash.envs.episode.transcript_text``: the same
characters, hence the same tokens, an episode's context has at that turn) and the response the
move. The warm-started policy so errs at about the noise rate per move, which RL removes.
``reward(item, response)`` scores a single response as the episode's *first move* (1.0 when it is
the expert's): only the SFT stage's held-out check uses it; episodes are scored by the game.
"""

from __future__ import annotations

import dataclasses
import random
from dataclasses import dataclass
from typing import ClassVar

from flash.envs.base import make_env
from flash.envs.corridor import CorridorOptions
from flash.envs.episode import transcript_text
from flash.envs.gym import FrozenLakeOptions
from flash.envs.synthetic import SyntheticOptions
from flash.tasks import Task, TaskItem, register_task


@dataclass(frozen=True)
class EpisodeOptions:
    seed: int = 0
    eval_size: int = 128  # held-out seeds
    max_turns: int = 16  # LLM turns per episode at most (outcome 'truncated' beyond)
    demo_noise: float = 0.25  # per-move probability that a demonstration move is not the expert's
    env_workers: int = 2  # EnvWorker actors running the environments
    env_concurrency: int = 16  # environment calls one EnvWorker runs at once (its threads)
    # every environment step sleeps this long (latency injection); with rollout.engine: sim these are
    # simulated seconds, slept × sim.time_scale like the simulated GPUs' time
    step_delay_s: float = 0.0
    step_delay_sigma: float = 0.0  # > 0: the sleep is lognormal with median step_delay_s (a long tail)

    def __post_init__(self) -> None:
        if self.max_turns < 1:
            raise ValueError(f"max_turns must be >= 1, got {self.max_turns}")
        if not 0.0 <= self.demo_noise < 1.0:
            raise ValueError(f"demo_noise must be in [0, 1), got {self.demo_noise}")
        if self.env_workers < 1 or self.env_concurrency < 1:
            raise ValueError(
                f"env_workers and env_concurrency must be >= 1, got {self.env_workers}, {self.env_concurrency}"
            )
        if self.eval_size < 1:
            raise ValueError(f"eval_size must be >= 1, got {self.eval_size}")


class EnvTask(Task):
    """A task whose items are environment seeds; subclasses set ``env`` and ``EnvOptions``."""

    env: ClassVar[str] = ""
    EnvOptions: ClassVar[type] = type(None)
    runtime_options = ("env_workers", "env_concurrency", "step_delay_s", "step_delay_sigma")

    def env_kwargs(self) -> dict:
        """The environment's own options, taken from the task's flat options."""
        return {f.name: getattr(self.options, f.name) for f in dataclasses.fields(self.EnvOptions)}

    def make_env(self):
        return make_env(self.env, **self.env_kwargs())

    def _make_item(self, index: int, split: str, rng: random.Random) -> TaskItem:
        seed = rng.randrange(2**31 - 1)
        env = self.make_env()
        obs = env.reset(seed)
        return TaskItem(index=index, prompt=obs, answer=env.expert_action(), meta={"seed": seed, "split": split})

    def max_response_tokens(self) -> int:
        """Tokens of one action: an LLM turn's length (``rollout.max_new_tokens`` must equal it)."""
        return type(self.make_env()).action_tokens

    def reward(self, item: TaskItem, response: str) -> float:
        return 1.0 if response.strip() == item.answer else 0.0

    def demonstration(self, index: int) -> tuple[list[str], list[str]]:
        """(observations, actions) of the noisy expert's episode from train seed ``index``."""
        item = self.item(index, "train")
        rng = self.rng(index, "train", stream="demo")
        env = self.make_env()
        observations, actions = [env.reset(item.meta["seed"])], []
        for _ in range(self.options.max_turns):
            action = env.expert_action()
            if rng.random() < self.options.demo_noise:
                action = rng.choice([a for a in env.actions if a != action])
            obs, _, done, _ = env.step(action)
            actions.append(action)
            if done:
                break
            observations.append(obs)
        return observations, actions

    def sft_pair(self, index: int) -> tuple[str, str]:
        observations, actions = self.demonstration(index)
        turn = self.rng(index, "train", stream="turn").randrange(len(actions))
        return transcript_text(observations[: turn + 1], actions[:turn]), actions[turn]


@dataclass(frozen=True)
class CorridorTaskOptions(CorridorOptions, EpisodeOptions):
    def __post_init__(self) -> None:
        CorridorOptions.__post_init__(self)
        EpisodeOptions.__post_init__(self)


@dataclass(frozen=True)
class FrozenLakeTaskOptions(FrozenLakeOptions, EpisodeOptions):
    def __post_init__(self) -> None:
        FrozenLakeOptions.__post_init__(self)
        EpisodeOptions.__post_init__(self)


@register_task("corridor")
class CorridorTask(EnvTask):
    """The native game (``flash.envs.corridor``) as a task."""

    Options = CorridorTaskOptions
    EnvOptions = CorridorOptions
    env = "corridor"


@register_task("frozenlake")
class FrozenLakeTask(EnvTask):
    """Gymnasium's FrozenLake on random maps (``flash.envs.gym``); needs the ``envs`` extra."""

    Options = FrozenLakeTaskOptions
    EnvOptions = FrozenLakeOptions
    env = "frozenlake"


@dataclass(frozen=True)
class SyntheticTaskOptions(SyntheticOptions, EpisodeOptions):
    def __post_init__(self) -> None:
        SyntheticOptions.__post_init__(self)
        EpisodeOptions.__post_init__(self)


@register_task("synthetic")
class SyntheticTask(EnvTask):
    """An agentic workload's shape for simulated runs (``flash.envs.synthetic``): turns, observation
    lengths and the environment's latency, no game; with ``rollout.engine: sim``."""

    Options = SyntheticTaskOptions
    EnvOptions = SyntheticOptions
    env = "synthetic"

    def max_response_tokens(self) -> int:
        return self.options.action_tokens
