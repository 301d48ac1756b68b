"""The checks `flash run` makes before it starts anything, in one function `flash validate` calls too.

``load_config`` has checked the values (``flash.app.config_checks``); what ``preflight`` adds needs
the task, the run directory or this host: the resume target and its settings, a ``run_dir`` that
holds another run, the task's own limits on the settings (multi-turn episodes), the prompts' format
against the tokenizer, the code sandbox's policy, and whether each GPU holds the roles placed on it
(``flash.app.memory_fit``: estimated from fake-tensor traces, checked against ``resources.card``). A recipe that `flash validate` accepts is not
refused by any of these once `flash run` starts it.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from flash.app import resume as resume_mod
from flash.app.config import FlashConfig, to_dict
from flash.errors import FlashError


@dataclass
class Preflight:
    task: Any  # the run's task object (flash.app.data.build_task)
    resume_dir: Path | None  # the run dir a resume continues, else None
    memory: list[str]  # each GPU role's estimated peak and each card's (flash.app.memory_fit)


def preflight(cfg: FlashConfig, recipe_name: str) -> Preflight:
    """Every refusal of `flash run` before its warm start and roles (module docstring); what it
    builds on the way (the task, the resume target) is returned for the run to use."""
    from flash import algos
    from flash.controllers.episode_runtime import check_episode_config
    from flash.app.data import build_task, check_prompt_format
    from flash.app.memory_fit import memory_lines
    from flash.envs.task import EnvTask

    resume_dir = resume_mod.resolve_resume(cfg.resume, recipe_name)
    if resume_dir is not None:
        resume_mod.check_same_run(to_dict(cfg), resume_dir)
    resume_mod.check_run_dir(cfg, resuming=resume_dir is not None)
    check_engine_env(cfg)
    algos.load_plugins(list(cfg.plugins))
    task = build_task(cfg)
    if isinstance(task, EnvTask):
        check_episode_config(cfg, task)
    elif not cfg.agent.fn and task.agent is None:  # single-turn responses scored in this process's threads
        apply_sandbox_policy(cfg)
    tokenizer = start_tokenizer(cfg, task)
    if tokenizer is not None:
        check_prompt_format(cfg, task, tokenizer)
    return Preflight(task, resume_dir, memory_lines(cfg))


def start_tokenizer(cfg: FlashConfig, task) -> Any:
    """The policy's tokenizer where it exists before the warm start, for the prompt-format check
    (``flash.app.data_preview.preview_tokenizer``); None for a GGUF model (its tokenizer comes with
    the conversion: the run checks the prompts once it has it) and for built-in tasks (their
    prompts fit the tokenizer by construction)."""
    from flash.app.data import uses_dataset
    from flash.app.data_preview import preview_tokenizer

    if not uses_dataset(cfg) or cfg.model.gguf:
        return None
    return preview_tokenizer(cfg, task)


def check_engine_env(cfg: FlashConfig) -> None:
    """``rollout.engine: vllm``: refused with the one command that fixes it when vLLM cannot import
    beside this torch (``flash.engine.vllm_env``), before any process starts."""
    if cfg.rollout.engine != "vllm":
        return
    from flash.engine.vllm_env import vllm_env_problem

    problem = vllm_env_problem()
    if problem:
        raise FlashError(problem)


def apply_sandbox_policy(cfg: FlashConfig) -> None:
    """Set this process's sandbox policy (task rewards score in the driver's threads); with the
    ``code`` reward on a host without namespaces, refuse before any worker starts rather than at
    every call."""
    from flash.rewards import sandbox

    sandbox.allow_unisolated(cfg.reward.sandbox.allow_unisolated)
    if cfg.reward.fn.get("name") == "code" and sandbox.isolation_level() != "namespaces":
        try:
            sandbox.check_unisolated()
        except sandbox.UnisolatedRefused as exc:
            raise FlashError(str(exc)) from None
