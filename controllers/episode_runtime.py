"""How ``flash run`` builds episode rollout for a task that is an environment (``EnvTask``).

Kept out of the runner so that the runner's only knowledge of environments is one branch.
"""

from __future__ import annotations

import dataclasses

from flash.errors import ConfigError


def check_episode_config(cfg, task) -> None:
    """Fail before the warm start on settings that cannot work for episodes, naming the fix."""
    action = task.max_response_tokens()
    if cfg.rollout.max_new_tokens != action:
        raise ConfigError(
            f"rollout.max_new_tokens is the tokens of one LLM turn in an episode; task '{task.name}' takes "
            f"actions of {action} token(s): set rollout.max_new_tokens={action}")
    if cfg.eval.max_new_tokens not in (0, action):
        raise ConfigError(f"eval.max_new_tokens must be 0 or {action} (one action) for task '{task.name}'")
    if cfg.rollout.scheduler != "plain":
        raise ConfigError(f"rollout.scheduler: {cfg.rollout.scheduler} works on single-turn tasks; "
                          f"'{task.name}' runs multi-turn episodes: set rollout.scheduler: plain")


def build_episode_scheduler(cfg, task, tokenizer, engine, buffer, staleness, params):
    """Start the task's EnvWorker actors and the EpisodeScheduler that drives them."""
    from controllers.episode_scheduler import EpisodeScheduler
    from flash.envs.worker import start_env_workers

    options = dataclasses.asdict(task.options)
    restarts = cfg.rollout.max_worker_restarts  # Ray restarts a dead worker; its episodes play again
    workers = start_env_workers(task.options.env_workers, task.name, options, task.options.step_delay_s,
                                max_restarts=restarts)
    return EpisodeScheduler(engine, workers, task, episode_codec(tokenizer), buffer, staleness, params,
                            n=cfg.rollout.n, seed=cfg.seed, max_turns=task.options.max_turns,
                            hang_timeout_s=cfg.rollout.hang_timeout_s, max_worker_restarts=restarts)


def episode_codec(tokenizer):
    """Character-tokenizer codec: the same ids for a character in prompts and observations."""
    from controllers.episode_scheduler import EpisodeCodec
    from flash.models import decode_response, encode_prompt

    return EpisodeCodec(
        encode_prompt=lambda text: encode_prompt(tokenizer, text),
        encode_observation=lambda text: encode_prompt(tokenizer, text)[1:],  # no <bos>
        decode=lambda ids: decode_response(tokenizer, ids),
    )
