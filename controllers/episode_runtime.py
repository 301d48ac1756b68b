"""How ``flash run`` builds episode rollout for a task that is an environment (``EnvTask``): the
scheduler core running the episode workflow on the task's ``EnvWorker`` actors.

Kept out of the runner so that the runner's only knowledge of environments is one branch.
"""

from __future__ import annotations

import dataclasses

from flash.buffers import SampleBuffer
from .admission import PromptSource
from .filters import FilterConfig
from .scheduler import RolloutCore
from .staleness import StalenessManager
from .workflows.episode import EpisodeCodec, Episodes
from flash.engine.base import SamplingParams
from flash.errors import ConfigError


class EpisodeScheduler(RolloutCore):
    """The core running the episode workflow: a unit is one episode of the item's environment
    seed; filters, spares and redundancy (start ``n + redundancy`` episodes, keep the first ``n``
    to finish) work as for single-turn prompts."""

    def __init__(
        self,
        engine,
        workers: list,
        task,
        codec: EpisodeCodec,
        buffer: SampleBuffer,
        staleness: StalenessManager,
        params: SamplingParams,
        n: int,
        seed: int,
        max_turns: int,
        start_index: int = 0,
        env_threads: int = 16,
        *,
        hang_timeout_s: float = 120.0,
        max_worker_restarts: int = 0,
        redundancy: int = 0,
        max_additional_prompts: int = 0,
        filters: FilterConfig | None = None,
        reward_workers: int = 4,
        client=None,
    ):
        workflow = Episodes(
            workers,
            codec,
            max_turns,
            env_threads,
            hang_timeout_s=hang_timeout_s,
            max_worker_restarts=max_worker_restarts,
        )
        source = PromptSource(
            item=lambda i: task.item(i, "train"),
            encode=lambda text: [],
            decode=codec.decode if codec is not None else None,
            reward=None,
        )
        super().__init__(
            engine,
            workflow,
            source,
            buffer,
            staleness,
            params,
            n,
            seed,
            reward_workers,
            start_index=start_index,
            redundancy=redundancy,
            max_additional_prompts=max_additional_prompts,
            filters=filters,
            client=client,
        )

    def start(self) -> None:
        workflow = self.workflow
        assert isinstance(workflow, Episodes)  # the one ``__init__`` built
        if workflow._pids is None:  # each worker's process, to tell a restarted one
            workflow.pids()
        super().start()


def check_episode_config(cfg, task) -> None:
    """Fail before the warm start on settings that cannot work for episodes, naming the fix."""
    action = task.max_response_tokens()
    if cfg.rollout.max_new_tokens != action:
        raise ConfigError(
            f"rollout.max_new_tokens is the tokens of one LLM turn in an episode; task '{task.name}' takes "
            f"actions of {action} token(s): set rollout.max_new_tokens={action}"
        )
    if cfg.eval.max_new_tokens not in (0, action):
        raise ConfigError(f"eval.max_new_tokens must be 0 or {action} (one action) for task '{task.name}'")
    if cfg.rollout.scheduler != "plain":
        raise ConfigError(
            f"rollout.scheduler: {cfg.rollout.scheduler} works on single-turn tasks; "
            f"'{task.name}' runs multi-turn episodes: set rollout.scheduler: plain"
        )


def build_episode_scheduler(cfg, task, tokenizer, engine, buffer, staleness, params, client=None):
    """Start the task's EnvWorker actors and the EpisodeScheduler that drives them."""
    from flash.envs.worker import start_env_workers

    options = dataclasses.asdict(task.options)
    restarts = cfg.rollout.max_worker_restarts  # Ray restarts a dead worker; its episodes play again
    o = task.options
    # a simulated run's environment latency is simulated seconds, scaled like the simulated GPUs'
    scale = cfg.sim.time_scale if cfg.rollout.engine == "sim" else 1.0
    workers = start_env_workers(
        o.env_workers,
        task.name,
        options,
        o.step_delay_s * scale,
        max_restarts=restarts,
        step_delay_sigma=o.step_delay_sigma,
        concurrency=o.env_concurrency,
    )
    # one driver thread per call the workers can run at once: fewer would queue environment calls
    # (a slow tool's latency) behind each other however many episodes are live
    return EpisodeScheduler(
        engine,
        workers,
        task,
        episode_codec(tokenizer),
        buffer,
        staleness,
        params,
        n=cfg.rollout.n,
        seed=cfg.seed,
        max_turns=o.max_turns,
        env_threads=o.env_workers * o.env_concurrency,
        hang_timeout_s=cfg.rollout.hang_timeout_s,
        max_worker_restarts=restarts,
        redundancy=cfg.rollout.redundancy,
        max_additional_prompts=cfg.rollout.max_additional_prompts,
        filters=cfg.rollout.filter,
        reward_workers=cfg.rollout.reward_workers,
        client=client,
    )


def episode_codec(tokenizer):
    """Character-tokenizer codec: the same ids for a character in prompts and observations."""
    from flash.models import decode_response, encode_prompt

    return EpisodeCodec(
        encode_prompt=lambda text: encode_prompt(tokenizer, text),
        encode_observation=lambda text: encode_prompt(tokenizer, text)[1:],  # no <bos>
        decode=lambda ids: decode_response(tokenizer, ids),
    )
