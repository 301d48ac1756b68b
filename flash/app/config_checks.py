"""Value checks of a loaded ``FlashConfig`` (``flash.app.config.validate``): the ranges, the plugin
knobs (loss, advantage, task, reward, filters) and the combinations that cannot run, each refused
with a message that names the key and the fix; what the config loads from outside itself (the
model, the reward function, the agent) is checked by ``flash.app.component_checks``. Kept apart
from the schema so that ``config.py`` stays the one place to read what a key is.
"""

from __future__ import annotations

import dataclasses
import math
from typing import TYPE_CHECKING

from flash.controllers.filters import check_filter
from flash.controllers.tail_policy import TailConfig, check_tail
from flash.controllers.prox_mode import prox_mode
from flash.app.component_checks import check_agent, check_model, check_reward
from flash.app.keys import check_choices, check_keys
from flash.errors import ConfigError, require

if TYPE_CHECKING:  # annotations only
    from flash.app.schema import FlashConfig, ModelUpdateConfig, RolloutConfig, TrainConfig


def check_finite(cfg, path: str = "") -> None:
    """Refuse inf and nan in every typed field: no setting of flash means anything by them."""
    for f in dataclasses.fields(cfg):
        value, key = getattr(cfg, f.name), f"{path}{f.name}"
        if dataclasses.is_dataclass(value):
            check_finite(value, key + ".")
        elif isinstance(value, float) and not math.isfinite(value):
            raise ConfigError(f"{key}={value} is not a finite number")


def validate(cfg: FlashConfig) -> None:
    """Value checks and plugin-knob checks; everything `flash validate` promises short of running."""
    from flash import algos
    from flash.recipes.tasks import task_class

    try:
        algos.load_plugins(list(cfg.plugins))
    except ImportError as exc:
        raise ConfigError(f"cannot import plugin module: {exc}") from None
    except SyntaxError as exc:  # the user's file does not parse: where, not the importer's stack
        raise ConfigError(f"plugin {exc.filename} line {exc.lineno}: {exc.msg}; fix the file") from None
    check_finite(cfg)
    check_choices(cfg)  # the Literal fields of the schema (flash.app.keys)
    require(cfg.async_ratio >= 0, f"async_ratio must be a finite number >= 0, got {cfg.async_ratio}")
    _check_engine_and_backend(cfg)
    require(cfg.rollout.n >= 1, f"rollout.n must be >= 1, got {cfg.rollout.n}")
    require(cfg.rollout.temperature > 0, "rollout.temperature must be > 0 for RL sampling")
    require(0 < cfg.rollout.top_p <= 1, f"rollout.top_p must be in (0, 1], got {cfg.rollout.top_p}")
    require(cfg.rollout.max_new_tokens >= 1, "rollout.max_new_tokens must be >= 1")
    _check_lifecycle(cfg.rollout)
    require(cfg.train.steps >= 1, f"train.steps must be >= 1, got {cfg.train.steps}")
    require(cfg.train.prompts_per_step >= 1, "train.prompts_per_step must be >= 1")
    require(cfg.train.micro_batch_size >= 1, "train.micro_batch_size must be >= 1")
    _check_group(cfg.train)
    require(cfg.train.lr > 0, f"train.lr must be > 0, got {cfg.train.lr}")
    _check_optimizers(cfg)
    _check_ranges(cfg)
    _check_updates(cfg)
    _check_model_update(cfg.model_update)
    _check_plugin_section(
        "algo.loss", cfg.algo.loss, lambda name, knobs: algos.validate_loss(name, knobs, agg=cfg.algo.agg)
    )
    _check_plugin_section("algo.advantage", cfg.algo.advantage, algos.validate_advantage)
    _check_corrections(cfg)
    _check_task(cfg.task, task_class)
    from flash.app.data import check_data

    check_data(cfg)
    require(1 <= cfg.eval.n <= 256, f"eval.n must be in [1, 256], got {cfg.eval.n}")
    from flash.app.evaluation import build_eval_sets

    build_eval_sets(cfg)
    check_model(cfg.model)
    _check_stream(cfg)
    check_reward(cfg)
    check_agent(cfg)
    _check_placement(cfg)
    _check_resources(cfg)
    from flash.app.tracking import check_backends

    check_backends(list(cfg.tracking.backends))
    from flash.guards import check_consistency

    check_consistency(cfg)


def _check_engine_and_backend(cfg: FlashConfig) -> None:
    """The engine and trainer kinds; simulated roles come in pairs (their weights are one
    counter, which a real engine cannot load and a real trainer does not push)."""
    from flash.sim.config import check_sim

    engine, backend = cfg.rollout.engine, cfg.train.backend
    require(
        (engine == "sim") == (backend == "sim"),
        f"rollout.engine={engine} with train.backend={backend}: simulated roles run together; set both "
        f"to sim, or neither",
    )
    if backend == "sim":
        require(check_sim(cfg.sim) is None, str(check_sim(cfg.sim)))
        require(
            group_free(cfg.train) and not cfg.train.activation_checkpointing,
            "train.backend=sim simulates its GPUs with sim.train_gpus; leave "
            "train.workers, micro_tokens and activation_checkpointing unset",
        )
    else:
        unread = sim_settings_set(cfg.sim)
        require(
            not unread,
            f"{', '.join(f'sim.{k}' for k in unread)}: read only by simulated roles "
            f"(rollout.engine: sim and train.backend: sim); drop them, or set both to sim",
        )


def sim_settings_set(sim) -> list[str]:
    """The ``sim:`` settings that differ from their defaults (a real run would ignore them)."""
    from flash.sim.config import SimConfig

    default = SimConfig()
    return [f.name for f in dataclasses.fields(SimConfig) if getattr(sim, f.name) != getattr(default, f.name)]


def group_free(train: TrainConfig) -> bool:
    from flash.train.fsdp import group_settings

    return group_settings(train) is None


def _check_placement(cfg: FlashConfig) -> None:
    from flash import algos
    from flash.placement import check_engine_devices, check_runnable, plan_placement

    plan = plan_placement(cfg.placement, engine=cfg.rollout.engine)  # PlacementError: a ConfigError
    check_runnable(plan)
    check_engine_devices(plan, cfg.rollout.engine)
    ranks = cfg.placement.roles.actor_train.num_workers
    require(
        ranks == cfg.train.workers,
        f"train.workers={cfg.train.workers} but placement.roles.actor_train.num_workers={ranks}: the "
        f"trainer group runs one rank per actor_train worker; set both to the same count (or only one "
        f"of them, the other follows)",
    )
    require(
        not (cfg.train.stream and plan.colocated("actor_infer", "actor_train")),
        "train.stream trains while the engines generate, but placement colocates actor_train and "
        "actor_infer (their engines sleep while training); give them disjoint devices or set "
        "train.stream: false",
    )
    require(
        not plan.workers["reference"] or algos.kl_coef(cfg.algo.loss) != 0.0,
        "placement.roles.reference places the frozen reference policy, but no loss reads it "
        "(algo.loss.kl_coef is 0); set algo.loss.kl_coef > 0 or placement.roles.reference.num_workers: 0",
    )


def _check_updates(cfg: FlashConfig) -> None:
    """Mini-batches, epochs, the lr schedule and the approximate proximal policy."""
    t, rows = cfg.train, cfg.train.prompts_per_step * cfg.rollout.n
    for key in ("mini_batches", "update_epochs"):
        require(getattr(t, key) >= 1, f"train.{key} must be an integer >= 1, got {getattr(t, key)}")
    require(
        t.mini_batches <= rows,
        f"train.mini_batches={t.mini_batches} exceeds the batch's rows "
        f"(train.prompts_per_step × rollout.n = {rows}): a mini-batch would be empty",
    )
    require(t.warmup_steps >= 0, f"train.warmup_steps must be >= 0 (optimizer steps), got {t.warmup_steps}")
    require(
        t.entropy_every_steps >= 0,
        f"train.entropy_every_steps must be >= 0 (0: never log the entropy), got {t.entropy_every_steps}",
    )
    require(0.0 <= t.min_lr_ratio <= 1.0, f"train.min_lr_ratio must be in [0, 1], got {t.min_lr_ratio}")
    require(
        t.min_lr_ratio == 0.0 or t.lr_schedule == "cosine",
        "train.min_lr_ratio is the cosine "
        "schedule's floor but train.lr_schedule is 'constant' (it would be unused); set "
        "train.lr_schedule: cosine or remove it",
    )
    require(
        not cfg.algo.measure_prox_error or prox_mode(cfg.algo.recompute_prox, cfg.async_ratio) == "approx",
        "algo.measure_prox_error measures the approximate proximal policy; set "
        "algo.recompute_prox: approx or remove it",
    )


def _check_optimizers(cfg: FlashConfig) -> None:
    """The policy's, the critic's and the warm start's optimizer knobs. Outside these ranges they do
    not fail, they train wrongly: a grad_clip <= 0 scales every gradient by a factor <= 0 (ascent,
    or no step at all), a negative lr ascends, a negative weight_decay inflates the weights."""
    for section in ("train", "critic", "sft"):
        opt = getattr(cfg, section)
        require(
            opt.grad_clip > 0, f"{section}.grad_clip must be > 0 (the largest gradient norm kept), got {opt.grad_clip}"
        )
        require(opt.lr > 0, f"{section}.lr must be > 0, got {opt.lr}")
        require(opt.weight_decay >= 0, f"{section}.weight_decay must be >= 0 (0: none), got {opt.weight_decay}")


SEED_MAX = 2**32 - 1  # numpy's generators refuse a negative seed, torch's one of 2**64 or more
# (key, lowest, highest or None): counts, sizes and seeds a user sets that mean nothing outside them
# (a negative seed or zero max_num_seqs fails only inside a role, after the run started; a negative
# eval.every_steps evaluated every |k| steps)
RANGES = (
    ("seed", 0, SEED_MAX),
    ("model.tiny.seed", 0, SEED_MAX),
    ("sft.seed", 0, SEED_MAX),
    ("sft.eval_seed", 0, SEED_MAX),
    ("rollout.max_num_seqs", 1, None),
    ("rollout.max_num_batched_tokens", 0, None),
    ("sft.steps", 0, None),
    ("sft.batch_size", 1, None),
    ("sft.pool_batches", 1, None),
    ("sft.warmup_steps", 0, None),
    ("sft.min_lr_ratio", 0, 1),
    ("sft.first_index", 0, None),
    ("sft.eval_temperature", 0, None),
    ("critic.micro_batch_size", 1, None),
    ("eval.every_steps", 0, None),
    ("eval.temperature", 0, None),
    ("eval.max_new_tokens", 0, None),
    ("tracking.console_every", 0, None),
    ("tracking.heartbeat_s", 0, None),
    ("tracking.log_samples", 0, None),
)


def _check_ranges(cfg: FlashConfig) -> None:
    for key, low, high in RANGES:
        value = cfg
        for part in key.split("."):
            value = getattr(value, part)
        require(
            low <= value and (high is None or value <= high),
            f"{key} must be " + (f"in [{low}, {high}]" if high is not None else f">= {low}") + f", got {value}",
        )


STREAM_ESTIMATORS = ("grpo", "dr_grpo", "rloo")  # advantages of a group need only that group


def _check_resources(cfg: FlashConfig) -> None:
    res = cfg.resources
    for key in ("engine_threads", "trainer_threads"):
        require(getattr(res, key) >= 0, f"resources.{key} must be >= 0 (0 = auto), got {getattr(res, key)}")
    require(res.driver_threads >= 1, f"resources.driver_threads must be >= 1, got {res.driver_threads}")
    require(res.ready_timeout_s > 0, f"resources.ready_timeout_s must be > 0 seconds, got {res.ready_timeout_s}")
    require(cfg.sft.threads >= 1, f"sft.threads must be >= 1, got {cfg.sft.threads}")
    from flash.app.cards import resolve_card

    resolve_card(res.card, res.gpu_memory_gib)  # a card flash knows, or its memory


def _check_stream(cfg: FlashConfig) -> None:
    if not cfg.train.stream:
        return
    require(
        cfg.async_ratio == 0,
        "train.stream trains the synchronous batch as it arrives: it needs "
        f"async_ratio: 0 (got {cfg.async_ratio}); with async_ratio > 0 set train.stream: false",
    )
    adv = dict(cfg.algo.advantage)
    require(
        adv.get("name") in STREAM_ESTIMATORS and not adv.get("whiten"),
        f"train.stream needs a group-local advantage estimator ({', '.join(STREAM_ESTIMATORS)}, "
        f"whiten off): '{adv.get('name')}' normalises over the whole batch",
    )
    require(
        prox_mode(cfg.algo.recompute_prox, cfg.async_ratio) == "behav",
        "train.stream uses the behaviour logprobs "
        "as the proximal policy (exact at async_ratio 0); set algo.recompute_prox: auto",
    )
    require(
        cfg.train.mini_batches * cfg.train.update_epochs == 1,
        "train.stream takes one optimizer step "
        "per batch as its groups arrive; set train.mini_batches: 1 and train.update_epochs: 1",
    )


def _check_model_update(mu: ModelUpdateConfig) -> None:
    require(mu.bucket_mb > 0, f"model_update.bucket_mb must be > 0, got {mu.bucket_mb}")
    require(mu.timeout_s > 0, f"model_update.timeout_s must be > 0, got {mu.timeout_s}")


def _check_lifecycle(rollout: RolloutConfig) -> None:
    require(
        rollout.redundancy >= 0,
        f"rollout.redundancy must be >= 0 (extra requests per prompt), got {rollout.redundancy}",
    )
    require(
        rollout.max_additional_prompts >= 0,
        f"rollout.max_additional_prompts must be >= 0, got {rollout.max_additional_prompts}",
    )
    require(
        rollout.max_additional_prompts == 0 or rollout.filter.enabled,
        "rollout.max_additional_prompts only refills filtered groups; set a rollout.filter rule "
        "(all_same_reward, min_reward_std, max_response_len) or set it to 0",
    )
    problem = check_filter(rollout.filter, rollout.n, rollout.max_new_tokens)
    require(problem is None, problem or "")
    problem = check_tail(rollout.tail_batching, rollout.max_new_tokens)
    require(problem is None, problem or "")
    require(
        rollout.scheduler == "tail_batching" or rollout.tail_batching == TailConfig(),
        "rollout.tail_batching.* is set but rollout.scheduler is 'plain' (the knobs would be unused); "
        "set rollout.scheduler: tail_batching or remove them",
    )


def _check_plugin_section(where: str, section: dict, validator) -> None:
    knobs = dict(section)
    name = knobs.pop("name", None)
    require(isinstance(name, str), f"{where}.name is required")
    try:
        validator(name, knobs)
    except (ValueError, KeyError) as exc:
        raise ConfigError(f"{where}: {exc}") from None


def _check_corrections(cfg: FlashConfig) -> None:
    """``algo.corrections`` name registered corrections with knobs they use, and no ratio of the
    loss or of a correction is identically 1 under ``recompute_prox`` and ``async_ratio``."""
    from flash import algos

    try:
        algos.validate_corrections(list(cfg.algo.corrections))
    except ValueError as exc:
        raise ConfigError(
            f"algo.corrections{exc}" if str(exc).startswith("[") else f"algo.corrections: {exc}"
        ) from None
    problem = noop_problem(cfg)
    require(problem is None, problem or "")


def steps_per_batch(train: TrainConfig) -> int:
    """Optimizer steps on one rollout batch: mini-batches × epochs."""
    return train.mini_batches * train.update_epochs


def noop_problem(cfg: FlashConfig) -> str | None:
    """The first ratio of ``algo.loss`` or ``algo.corrections`` that this config makes
    identically 1 (``flash.algos.offpolicy.ratio_problem``), as one line naming the fix; else None."""
    from flash import algos

    loss = dict(cfg.algo.loss)
    name = loss.pop("name")
    where = dict(
        prox_source=prox_mode(cfg.algo.recompute_prox, cfg.async_ratio),
        mode=cfg.algo.recompute_prox,
        async_ratio=cfg.async_ratio,
        steps_per_batch=steps_per_batch(cfg.train),
    )
    checks = [(f"algo.loss '{name}'", r, False) for r in algos.loss_ratios(name, loss) or ()]
    checks += [(f"algo.corrections '{c['name']}'", algos.corrections.RATIO, True) for c in cfg.algo.corrections]
    for who, ratio, explicit in checks:
        problem = algos.ratio_problem(who, ratio, explicit=explicit, **where)
        if problem:
            return problem
    return None


def _check_task(section: dict, task_class) -> None:
    options = dict(section)
    name = options.pop("name", None)
    require(isinstance(name, str), "task.name is required")
    try:
        cls = task_class(name)
    except (ValueError, KeyError) as exc:
        raise ConfigError(f"task: {exc}") from None
    check_keys(options, cls.Options, prefix="task.")
    try:  # the options' own range checks and the task's own (outside code it loads), before any warm start
        cls.check(cls.Options(**options))
    except (TypeError, ValueError) as exc:
        raise ConfigError(f"task: {exc}") from None


def _check_group(train: TrainConfig) -> None:
    """The FSDP2 group's knobs, checked by the group's own settings (one place says what is valid)."""
    from flash.train.fsdp import group_settings

    try:
        group_settings(train)
    except ValueError as exc:
        raise ConfigError(str(exc)) from None
