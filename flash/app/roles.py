"""The compute roles of a run and the small typed records the runner keeps them in.

``start_roles`` places and starts the actors a config asks for -- the ``actor_infer`` replicas
(behind a router when several) with the ``EngineClient`` every engine call goes through, the
trainer (one process or an FSDP2 group), the critic for GAE, the placed reference for a KL
penalty, the model-update group -- and
``Roles.close`` stops them. ``RunFiles`` are the run directory's append-only logs, ``Clock`` the
run's timing and initial accuracy (both continue across a resume), ``Guards`` the input and
non-finite-step guards. Kept out of ``flash.app.runner`` so the runner reads as its steps and
``flash.app.run_state`` can read these parts by type.
"""

from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass, field
from pathlib import Path
from collections.abc import Callable
from typing import IO, Any

import ray

from flash.algos.policy import kl_coef
from flash.buffers.guard import ValueLimits
from flash.controllers.staleness import StalenessManager
from flash.app.config import FlashConfig
from flash.app.resume import LOGS
from flash.cluster import init_ray, wait_ready
from flash.devices import REFERENCE_BYTES_PER_PARAM, TRAINER_BYTES_PER_PARAM, tf32_env
from flash.engine.client import EngineClient
from flash.engine.router import start_router
from flash.engine.torch_worker import start_engine
from flash.guards import DataError, InputGuard, SkipGuard
from flash.placement import Placement, Plan, plan_placement
from flash.run_files import open_run_file
from flash.train.critic import CriticSettings
from flash.train.fsdp import group_settings
from flash.train.reference import start_reference
from flash.train.sim_trainer import start_sim_trainer
from flash.train.trainer import TrainerSettings
from flash.train.trainer_group import start_trainer_group
from flash.train.worker import start_critic, start_trainer
from flash.weights.group import ModelUpdateGroup


@dataclass
class Roles:
    """The run's actors. ``engine`` is the one replica or the router in front of ``replicas``."""

    placement: Placement
    replicas: list
    engine: Any
    client: EngineClient
    trainer: Any
    critic: Any | None
    model_update: ModelUpdateGroup
    colocated: bool
    reference: Any | None = None  # the placed KL reference (flash.train.reference), else None

    def actors(self) -> list:
        return [
            a
            for a in dict.fromkeys([self.engine, *self.replicas, self.trainer, self.critic, self.reference])
            if a is not None
        ]

    def dead_role(self, exc: Exception) -> str:
        """Which of the run's actors a RayActorError names (the message a user acts on): the
        trainer unless the error's actor id is another role's."""
        dead = getattr(exc, "actor_id", None)
        named = {
            "critic worker": [self.critic],
            "reference worker": [self.reference],
            "rollout engine": [self.engine, *self.replicas],
        }
        for role, actors in named.items():
            if dead and any(a is not None and a._actor_id.hex() == dead for a in actors):
                return role
        return "trainer worker"

    def close(self, extra_actors: list = ()) -> None:
        self.model_update.close()
        for actor in dict.fromkeys([*self.actors(), *extra_actors]):
            ray.kill(actor)
        self.placement.remove()


@dataclass
class RunFiles:
    """The run directory's logs: appended on resume (cut back to the checkpoint first)."""

    metrics: IO[str]
    timeline: IO[str]  # per-step spans, `flash plot`
    eval: IO[str]  # every held-out evaluation
    ledger: IO[str]  # one line per sample outcome
    schedule: IO[str]  # what each step trained (flash.app.schedule), for `flash replay`
    samples: IO[str]  # a few decoded responses per step (tracking.log_samples)

    @classmethod
    def open(cls, run_dir: Path, append: bool) -> RunFiles:
        mode = "a" if append else "w"
        return cls(**{name: open_run_file(run_dir / f"{name}.jsonl", mode) for name in LOGS})

    def by_name(self) -> dict[str, IO[str]]:
        """Every log by name: the list a checkpoint records offsets of and a resume cuts back."""
        return {name: getattr(self, name) for name in LOGS}

    def close(self) -> None:
        for f in self.by_name().values():
            f.close()


@dataclass
class Clock:
    """When the run started and trained, and its first held-out accuracy (kept by checkpoints)."""

    t0: float = field(default_factory=time.monotonic)
    train_start: float | None = None
    elapsed0: float = 0.0  # training seconds before a resume
    wall0: float = 0.0  # the run's wall seconds before a resume (up to its checkpoint)
    last_eval_s: float = 0.0
    acc0: float | None = None
    start_step: int = 0

    def elapsed(self) -> float:
        return time.monotonic() - self.train_start if self.train_start is not None else 0.0

    def wall(self) -> float:
        """The run's wall seconds: this process's, and a resumed run's before its checkpoint."""
        return self.wall0 + time.monotonic() - self.t0


@dataclass
class RolloutBuffer:
    """The SampleBuffer the roles exchange groups through, the zmq service behind it (or None: the
    in-process buffer) and the staleness rule that bounds what is in it."""

    buffer: Any  # SampleBuffer, or a RemoteSampleBuffer on ``service``
    service: Any | None
    staleness: StalenessManager

    @property
    def store(self):
        """The buffer a checkpoint reads and a resume fills: with ``buffer.transport=zmq`` the
        service's own store (it lives in the driver; the proxy on it only crosses the wire), else
        the in-process SampleBuffer. Both answer ``snapshot``/``restore``."""
        return self.service.buffer if self.service is not None else self.buffer

    def bound_values(self, model_path: str, version: Callable[[], int]) -> None:
        """What the service stores beyond its schema (``flash.buffers.guard``): token ids below the
        model's vocabulary, versions up to ``version()`` -- the controller's + 1, since a push resumes
        the engine under the new version before the controller counts it."""
        if self.service is None:
            return
        from transformers import AutoConfig

        vocab = getattr(AutoConfig.from_pretrained(model_path), "vocab_size", None)
        self.service.limits = ValueLimits(vocab_size=vocab if isinstance(vocab, int) and vocab > 0 else None)
        self.service.max_version = version

    def close(self) -> None:
        if self.service is not None:
            self.buffer.disconnect()
            self.service.stop()


@dataclass
class Guards:
    inputs: InputGuard  # malformed, empty or too long prompts
    steps: SkipGuard  # non-finite losses or gradients


def start_roles(cfg: FlashConfig, model_path: str, settings: TrainerSettings, threads: tuple[int, int]) -> Roles:
    """Place and start every role, wait until each answers, form the model-update group."""
    engine_threads, trainer_threads = threads
    plan = plan_placement(cfg.placement, engine=cfg.rollout.engine)
    init_ray(cfg.ray.address, cfg.ray.num_cpus, num_gpus=cfg.placement.num_gpus)
    placement = Placement.create(plan, cfg.placement.cpus_per_bundle)
    colocated = plan.colocated("actor_infer", "actor_train")
    replicas, engine, client = _start_engines(cfg, plan, placement, model_path, engine_threads, colocated)
    trainer = start_trainer_role(cfg, model_path, settings, trainer_threads, placement)
    critic = start_critic_role(cfg, model_path, trainer_threads)
    reference = start_reference_role(cfg, model_path, trainer_threads, placement)
    started = {"engine": engine, "trainer": trainer, "critic": critic, "reference": reference}
    started = {name: actor for name, actor in started.items() if actor is not None}
    wait_ready(*started.values(), timeout=cfg.resources.ready_timeout_s, names=list(started))
    # from the trainer (a single process, or an FSDP2 group's rank 0) to every engine replica;
    # the backend follows the placement (``model_update.backend``)
    model_update = ModelUpdateGroup(trainer, list(replicas), **vars(cfg.model_update))
    model_update.setup()
    return Roles(placement, replicas, engine, client, trainer, critic, model_update, colocated, reference)


def _start_engines(
    cfg: FlashConfig, plan: Plan, placement: Placement, model_path: str, engine_threads: int, colocated: bool
) -> tuple[list, Any, EngineClient]:
    """The actor_infer replicas (they share the role's threads), behind a router when several, and
    the engine client: restarts up to ``max_engine_restarts`` (0: a fault stops the run at once,
    naming the knob)."""
    n = len(plan.workers["actor_infer"])
    replicas = [
        start_engine(
            model_path,
            cfg.rollout.max_num_seqs,
            cfg.seed,
            max(1, engine_threads // n),
            engine=cfg.rollout.engine,
            options=engine_options(cfg, plan, placement.options("actor_infer", i), i),
            sleep_mode=colocated,
            # Ray restarts a dead replica; flash.engine.client recovers its work
            max_restarts=cfg.rollout.max_engine_restarts,
            engine_kwargs=engine_kwargs(cfg, plan, i, colocated),
        )
        for i in range(n)
    ]
    engine = replicas[0] if n == 1 else start_router(replicas, cfg.rollout.prompt_affinity, cfg.rollout.hang_timeout_s)
    client = EngineClient(
        engine, cfg.rollout.hang_timeout_s, cfg.rollout.max_engine_restarts, replicas=replicas if n > 1 else None
    )
    return replicas, engine, client


def engine_kwargs(cfg: FlashConfig, plan: Plan, i: int, colocated: bool) -> dict:
    """The constructor arguments of ``actor_infer`` worker ``i`` beyond the shared ones: the
    simulated engines share sim.rollout_gpus; the others hold model.dtype weights; a vLLM worker
    runs one tensor-parallel rank per device the placement gives it (a torch engine takes its
    prefill budget), seeds requests as
    ``rollout.request_seeds`` says and, colocated, takes what the trainer leaves of the GPU."""
    if cfg.rollout.engine == "sim":
        return {"sim": cfg.sim, "replicas": len(plan.workers["actor_infer"])}
    extra: dict[str, Any] = {"dtype": cfg.model.dtype}
    if cfg.rollout.engine == "torch":
        extra["max_num_batched_tokens"] = cfg.rollout.max_num_batched_tokens
    if cfg.rollout.engine == "vllm":
        extra["tensor_parallel_size"] = max(1, len(plan.workers["actor_infer"][i].devices))
        extra["request_seeds"] = cfg.rollout.request_seeds
        if colocated:
            extra["trainer_bytes_per_param"] = colocated_trainer_bytes_per_param(cfg, plan)
    return extra


def engine_options(cfg: FlashConfig, plan: Plan, options: dict, i: int) -> dict:
    """``actor_infer`` worker ``i``'s actor options (its placement's) plus the environment that
    makes it, and the processes it starts, run float32 matmuls in TF32 on a GPU (``tf32_env``)."""
    env = tf32_env(plan.workers["actor_infer"][i].devices, cfg.model.dtype, cfg.resources.tf32)
    if not env or cfg.rollout.engine == "sim":
        return options
    runtime = dict(options.get("runtime_env") or {})
    runtime["env_vars"] = {**(runtime.get("env_vars") or {}), **env}
    return {**options, "runtime_env": runtime}


def colocated_trainer_bytes_per_param(cfg: FlashConfig, plan: Plan) -> float:
    """What the trainer keeps between steps on each GPU it shares with an engine, per model
    parameter: fp32 weights and AdamW state (and a local KL reference's copy), sharded over its
    ranks (``flash.devices.TRAINER_BYTES_PER_PARAM``)."""
    local_reference = kl_coef(cfg.algo.loss) != 0.0 and not reference_placed(cfg)
    per_param = TRAINER_BYTES_PER_PARAM + (REFERENCE_BYTES_PER_PARAM if local_reference else 0)
    return per_param / max(1, len(plan.workers["actor_train"]))


def start_trainer_role(
    cfg: FlashConfig,
    model_path: str,
    settings: TrainerSettings,
    trainer_threads: int,
    placement: Placement | None = None,
):
    """One trainer process, or an FSDP2 group when ``train.workers`` > 1 (or a group knob) is set:
    one rank per ``actor_train`` worker, each in its own devices' placement bundle (``None``: no
    placement, as `flash replay` starts it); or the simulated trainer (``train.backend: sim``)."""
    group = group_settings(cfg.train)

    def options(i: int) -> dict | None:
        return placement.options("actor_train", i) if placement is not None else None

    if cfg.train.backend == "sim":  # GPU time from the cost model (validated: never a group)
        return start_sim_trainer(cfg.sim, settings, cfg.seed, options=options(0))
    if group is None:
        return start_trainer(model_path, settings, cfg.seed, trainer_threads, list(cfg.plugins), options=options(0))
    ranks = [options(i) for i in range(group.workers)] if placement is not None else None
    return start_trainer_group(
        model_path, settings, group, cfg.seed, trainer_threads, list(cfg.plugins), rank_options=ranks
    )


def start_critic_role(cfg: FlashConfig, model_path: str, trainer_threads: int):
    """The critic for the ``gae`` estimator (the only one that reads values), else None."""
    if cfg.algo.advantage["name"] != "gae":
        return None
    return start_critic(model_path, CriticSettings(**dataclasses.asdict(cfg.critic)), cfg.seed, trainer_threads)


def reference_placed(cfg: FlashConfig) -> bool:
    """Whether the KL reference runs as its own placed role (else the trainer keeps a copy)."""
    return cfg.placement.roles.reference.num_workers > 0


def start_reference_role(cfg: FlashConfig, model_path: str, threads: int, placement: Placement | None = None):
    """The frozen initial policy as its own actor where ``placement.roles.reference`` places one
    (config_checks refuses one that no KL penalty reads), else None."""
    if not reference_placed(cfg):
        return None
    options = placement.options("reference", 0) if placement is not None else None
    return start_reference(
        model_path,
        cfg.rollout.temperature,
        cfg.train.micro_batch_size,
        threads,
        options,
        cfg.model.dtype,
        cfg.resources.tf32,
    )


def new_guards(cfg: FlashConfig, max_prompt_tokens: int, read_skipped: dict | None = None) -> Guards:
    """The run's guards; ``read_skipped``: rows the dataset skipped before reading (counted with the
    input guard's own, in ``data/skipped_<reason>``; under ``data.strict`` they stop the run)."""
    inputs = InputGuard(max_prompt_tokens, strict=cfg.data.strict)
    if read_skipped and cfg.data.strict:
        raise DataError(
            f"data rows over the size or nesting bounds ({dict(read_skipped)}); fix or remove them, "
            f"or set data.strict=false to skip such rows (counted in data/skipped_<reason>)"
        )
    inputs.counts.update(read_skipped or {})
    return Guards(inputs, SkipGuard(cfg.train.max_consecutive_skips))
