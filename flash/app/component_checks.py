"""Checks of what a config loads from outside itself (``flash.app.config_checks.validate`` runs
them): the model (a local Hugging Face folder or a GGUF file, its loaders, a chat template), the
reward (its function's pool, a judge's section, the autoscaled pool's bounds, the rows' reward
names against ``reward.fn``) and the agent (its function, the gateway's limits, a tool parser),
each refused with a message that names the key and the fix.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

from flash.errors import ConfigError, require

if TYPE_CHECKING:  # annotations only
    from flash.app.schema import FlashConfig, ModelConfig, RewardConfig


def check_model(model: ModelConfig) -> None:
    """``model.path`` is a local Hugging Face folder; ``model.gguf`` excludes it, and its file (or
    package) and GGUF loaders must be here; ``model.chat_template`` is a template or a template
    file (``flash.models.read_chat_template``)."""
    require(model.path is None or model.gguf is None, "model.path and model.gguf both name the model; set one of them")
    if model.chat_template:
        from flash.models import read_chat_template

        try:
            read_chat_template(model.chat_template)
        except (OSError, ValueError) as exc:
            raise ConfigError(str(exc)) from None
    if model.path is not None:
        _check_model_path(model.path)
    if model.gguf is None:
        return
    from flash.gguf import check_loaders, resolve_gguf
    from flash.gguf_metadata import check_metadata

    check_metadata(resolve_gguf(model.gguf))
    check_loaders()


WEIGHT_FILES = (
    "model.safetensors",
    "model.safetensors.index.json",
    "pytorch_model.bin",
    "pytorch_model.bin.index.json",
)
TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "vocab.json")


def _check_model_path(path: str) -> None:
    from pathlib import Path

    folder = Path(path).expanduser()
    if folder.is_dir():
        require(
            (folder / "config.json").is_file(),
            f"model.path={path} has no config.json: point it at a "
            "Hugging Face model folder (config.json, weights, tokenizer files)",
        )
        require(
            any((folder / f).is_file() for f in WEIGHT_FILES),
            f"model.path={path} has no weights (none of {', '.join(WEIGHT_FILES)}); finish the download",
        )
        require(
            any((folder / f).is_file() for f in TOKENIZER_FILES),
            f"model.path={path} has no tokenizer (none of {', '.join(TOKENIZER_FILES)}); save the "
            f"tokenizer beside the weights (tokenizer.save_pretrained)",
        )
        return
    hub_like = path.count("/") == 1 and not path.startswith((".", "/", "~"))
    require(
        False,
        f"model.path={path} is not a local folder"
        + (
            ": flash reads no model hub at run time; download it first (e.g. `huggingface-cli download "
            f"{path} --local-dir models/{path.split('/')[1]}`) and pass model.path=models/{path.split('/')[1]}"
            if hub_like
            else ""
        ),
    )


def check_agent(cfg: FlashConfig) -> None:
    from flash.recipes.tasks import task_class

    a, task_agent = cfg.agent, task_class(cfg.task["name"]).agent is not None
    if a.fn is None and not task_agent:
        return
    from flash.envs.agents import load_agent
    from flash.envs.gateway_requests import is_loopback

    require(not (task_agent and a.fn), f"task {cfg.task['name']} runs its own episodes: leave agent.fn unset")
    try:
        if a.fn is not None:
            load_agent(a.fn)
    except ValueError as exc:
        raise ConfigError(str(exc)) from None
    require(
        a.concurrency >= 1 and a.max_turns >= 1 and a.retries >= 0 and a.processes >= 0,
        f"agent.concurrency and agent.max_turns must be >= 1, agent.retries and agent.processes >= 0, got "
        f"{a.concurrency}, {a.max_turns}, {a.retries}, {a.processes}",
    )
    for key in ("timeout_s", "header_timeout_s", "body_timeout_s"):
        value = getattr(a, key)
        require(math.isfinite(value) and value > 0, f"agent.{key} must be > 0, got {value}")
    require(a.max_connections >= 1, f"agent.max_connections must be >= 1, got {a.max_connections}")
    require(
        is_loopback(a.host),
        f"agent.host={a.host} is not loopback: the gateway serves the agents of this machine; keep 127.0.0.1",
    )
    require(
        cfg.rollout.scheduler == "plain",
        "agent runs use rollout.scheduler: plain (tail batching cuts single-turn responses)",
    )
    if a.tool_parser:
        from flash.envs.chat_messages import TOOL_PARSERS

        try:
            TOOL_PARSERS.get(a.tool_parser)
        except ValueError as exc:
            raise ConfigError(f"agent.tool_parser: {exc}; or null to return replies as plain text") from None


def check_reward(cfg: FlashConfig) -> None:
    from flash.app.schema import DataConfig

    deadline = cfg.reward.response_deadline_s
    require(
        math.isfinite(deadline) and deadline > 0,
        f"reward.response_deadline_s must be a finite number of "
        f"seconds > 0 (one response's scoring, all its tests), got {deadline}",
    )
    require(
        cfg.reward.max_consecutive_errors >= 0,
        "reward.max_consecutive_errors must be >= 0 (reward errors in "
        f"a row that stop the run; 0: never), got {cfg.reward.max_consecutive_errors}",
    )
    d = cfg.data
    named = [
        k
        for k, on in (
            ("data.reward", d.reward != DataConfig.reward),
            ("data.reward_key", d.reward_key),
            ("data.rewards", d.rewards),
        )
        if on
    ]
    if cfg.reward.fn and d.train and named:
        raise ConfigError(
            f"reward.fn ({cfg.reward.fn.get('name')}) and {' and '.join(named)} both choose the rows' "
            f"reward, and reward.fn would score every row: set reward.fn={{}} to score by {named[0]}, "
            f"or drop {' and '.join(named)}"
        )
    if cfg.reward.fn:
        from flash.rewards.registry import check_pool_args

        r = cfg.reward
        check_pool_args(dict(r.fn), r.num_workers, r.concurrency, r.timeout_s, tuple(cfg.plugins))
        if r.fn.get("name") == "judge":
            from flash.rewards.judge import check_section

            try:
                check_section(dict(r.fn))
            except ValueError as exc:
                raise ConfigError(f"reward.fn: {exc}") from None
    _check_autoscale(cfg.reward)


def _check_autoscale(r: RewardConfig) -> None:
    if not r.max_workers:
        return
    from flash.rewards.workers import autoscale_config

    try:
        autoscale_config(r)
    except ValueError as exc:
        raise ConfigError(f"reward: {exc}") from None
    require(
        r.min_workers <= r.num_workers <= r.max_workers,
        f"reward.num_workers ({r.num_workers}) is the autoscaled pool's starting size: it must lie in "
        f"[reward.min_workers, reward.max_workers] = [{r.min_workers}, {r.max_workers}]",
    )
