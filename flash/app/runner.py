"""`flash run`: build every role from a validated config, train, evaluate, write the summary.

Order of work: run dir and resolved config → task → model (warm start, cached) → Ray and the two
actors → initial held-out evaluation → the controller's steps (progress bar, trackers, periodic
evaluation, checkpoints) → stop rollout (what is left unfinished goes to the ledger) → final
evaluation → ``summary.json``.

``resume=RUN_DIR`` (flash.app.resume): the same run dir, its newest valid checkpoint restored
(flash.app.run_state) instead of the initial evaluation, and the steps continue from there.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import time
from datetime import datetime
from pathlib import Path

import ray
from ray.exceptions import RayActorError

import algos
from buffers.factory import make_buffer
from controllers.async_controller import AsyncController, ControllerSettings, prox_mode
from controllers.scheduler import PromptSource, RolloutScheduler
from controllers.staleness import StalenessManager
from controllers.tail_batching import TailBatchingScheduler
from controllers.workflows.episode import Episodes
from flash.app import resume as resume_mod
from flash.app import run_state
from flash.checkpoint import Checkpointer, latest_valid, remove_partial
from flash.app.config import FlashConfig, to_dict, to_yaml
from flash.engine.base import SamplingParams
from flash.errors import FlashError
from flash.engine.client import EngineClient
from flash.guards import InputGuard, SkipGuard
from flash.engine.router import start_router
from flash.placement import Placement, plan_placement
from flash.weights.group import ModelUpdateGroup
from flash.app.tracking import Progress, make_tracker
from flash.train.critic import CriticSettings
from controllers.episode_runtime import build_episode_scheduler, check_episode_config
from flash.envs.task import EnvTask
from flash.train.trainer import TrainerSettings
from flash.train.fsdp import group_settings
from flash.train.trainer_group import start_trainer_group
from flash.cluster import init_ray, quiet, wait_ready
from flash.engine.torch_worker import start_engine
from flash.train.worker import start_critic, start_trainer


def default_cache_dir(cfg: FlashConfig) -> str:
    return cfg.cache_dir or os.environ.get("FLASH_CACHE") or str(Path.home() / ".cache" / "flash")


def make_run_dir(cfg: FlashConfig, recipe_name: str) -> Path:
    if cfg.run_dir:
        path = Path(cfg.run_dir)
    else:
        stamp = datetime.now().strftime("%Y%m%d-%H%M%S")
        path = Path("runs") / f"{recipe_name}-{stamp}"
    path.mkdir(parents=True, exist_ok=True)
    return path


def run_cores(cfg: FlashConfig) -> int:
    """The CPU cores the run's local Ray gets (``ray.num_cpus``, else the machine's)."""
    return cfg.ray.num_cpus or os.cpu_count() or 2


def resolve_threads(cfg: FlashConfig) -> tuple[int, int]:
    """(engine, trainer) torch threads: all cores each when phases alternate, split otherwise."""
    cores = run_cores(cfg)
    if cfg.async_ratio == 0:
        auto_engine = auto_trainer = cores
    else:
        auto_engine, auto_trainer = max(1, cores // 2), max(1, cores - cores // 2)
    return (cfg.resources.engine_threads or auto_engine, cfg.resources.trainer_threads or auto_trainer)


def prepare_model(cfg: FlashConfig, task) -> str:
    """The policy's initial checkpoint: ``model.path``; ``model.gguf`` converted once (flash.gguf);
    else the tiny model warm-started on the task (flash.train.sft)."""
    if cfg.model.path:
        return cfg.model.path
    if cfg.model.gguf:
        from flash.gguf import gguf_checkpoint

        return gguf_checkpoint(cfg.model.gguf, default_cache_dir(cfg))
    from flash.train.sft import warm_start

    return warm_start(cfg.model.tiny, cfg.sft, task, default_cache_dir(cfg))


def build_source(task, tokenizer, guard: InputGuard | None = None, reward=None) -> PromptSource:
    """``guard``: the input guard prompts are taken through; ``reward``: a RewardPool's
    ``reward_fn()``; unset: the task's own reward."""
    from flash.models import decode_response, encode_prompt

    return PromptSource(
        item=lambda i: task.item(i, split="train"),
        encode=lambda text: encode_prompt(tokenizer, text),
        decode=lambda ids: decode_response(tokenizer, ids),
        reward=reward or task.reward,
        guard=guard,
    )


def max_prompt_tokens(cfg: FlashConfig, model_path: str) -> int:
    """``data.max_prompt_tokens``, or the model's context minus the response budget."""
    if cfg.data.max_prompt_tokens:
        return cfg.data.max_prompt_tokens
    from transformers import AutoConfig

    text = AutoConfig.from_pretrained(model_path).get_text_config(decoder=True)
    return max(1, text.max_position_embeddings - cfg.rollout.max_new_tokens)


class TrainerDied(FlashError):
    """The trainer worker died; the run stopped at its last checkpoint."""


def sampling_params(cfg: FlashConfig, tokenizer, *, eval_mode: bool = False) -> SamplingParams:
    max_new = cfg.eval.max_new_tokens if eval_mode and cfg.eval.max_new_tokens else cfg.rollout.max_new_tokens
    return SamplingParams(
        max_new_tokens=max_new,
        temperature=cfg.eval.temperature if eval_mode else cfg.rollout.temperature,
        top_p=cfg.rollout.top_p,
        stop_token_ids=[tokenizer.eos_token_id],
    )


def trainer_settings(cfg: FlashConfig) -> TrainerSettings:
    return TrainerSettings(
        lr=cfg.train.lr, weight_decay=cfg.train.weight_decay, betas=tuple(cfg.train.betas),
        grad_clip=cfg.train.grad_clip, micro_batch_size=cfg.train.micro_batch_size,
        temperature=cfg.rollout.temperature, loss=dict(cfg.algo.loss), agg=cfg.algo.agg,
        max_len=cfg.rollout.max_new_tokens,
    )


class Run:
    """One training run's live parts, so ``run`` reads as its steps."""

    def __init__(self, cfg: FlashConfig, recipe_name: str):
        from recipes.tasks import make_task
        from transformers import AutoTokenizer

        self.t0 = time.monotonic()
        quiet()
        self.cfg = cfg
        resume_dir = resume_mod.resolve_resume(cfg.resume, recipe_name)
        if resume_dir is not None:
            resume_mod.check_same_run(to_dict(cfg), resume_dir)
            cfg.run_dir = str(resume_dir)
        self.dir = make_run_dir(cfg, recipe_name)
        self.ckpt, self.state = self._find_checkpoint(resume_dir)
        (self.dir / "config.yaml").write_text(to_yaml(cfg))
        algos.load_plugins(list(cfg.plugins))
        task_opts = {k: v for k, v in cfg.task.items() if k != "name"}
        self.task = make_task(cfg.task["name"], **task_opts)
        if isinstance(self.task, EnvTask):
            check_episode_config(cfg, self.task)
        self.model_path = prepare_model(cfg, self.task)
        self.tokenizer = AutoTokenizer.from_pretrained(self.model_path)
        self.eval_items = self.task.eval_items()
        mode = "a" if resume_dir is not None else "w"  # resumed: logs were cut back to the checkpoint
        self.metrics_file = open(self.dir / "metrics.jsonl", mode)
        self.timeline_file = open(self.dir / "timeline.jsonl", mode)  # per-step spans, `flash plot`
        self.eval_file = open(self.dir / "eval.jsonl", mode)  # every held-out evaluation
        self.ledger = open(self.dir / "ledger.jsonl", mode)
        self.train_start: float | None = None
        self.last_eval_s = 0.0
        self.acc0: float | None = None
        self.start_step = 0
        self.elapsed0 = 0.0  # training seconds before a resume
        self._start_roles()

    def _find_checkpoint(self, resume_dir):
        """(checkpoint dir, its state) to resume from, or (None, None): a fresh start."""
        if resume_dir is None:
            resume_mod.append_event(self.dir, "start")
            return None, None
        ckpt, skipped = latest_valid(self.dir / "checkpoints")
        remove_partial(self.dir / "checkpoints")  # writes a kill interrupted: never read, now gone
        state = resume_mod.load_state(ckpt) if ckpt is not None else None
        resume_mod.restore_logs(self.dir, state["logs"] if state else None)
        resume_mod.append_event(self.dir, "resume", checkpoint=str(ckpt) if ckpt else None,
                                step=state["step"] if state else 0, skipped=skipped)
        return ckpt, state

    def _start_roles(self) -> None:
        cfg = self.cfg
        engine_threads, trainer_threads = resolve_threads(cfg)
        plan = plan_placement(cfg.placement, engine=cfg.rollout.engine)
        init_ray(cfg.ray.address, cfg.ray.num_cpus, num_gpus=cfg.placement.num_gpus)
        self.placement = Placement.create(plan, cfg.placement.cpus_per_bundle)
        settings = trainer_settings(cfg)
        colocated = plan.colocated("actor_infer", "actor_train")
        self._start_engines(plan, engine_threads, colocated)
        self._start_trainer(settings, trainer_threads)
        self.critic = None
        if cfg.algo.advantage["name"] == "gae":  # the only estimator that reads values
            self.critic = start_critic(self.model_path, CriticSettings(**dataclasses.asdict(cfg.critic)), cfg.seed,
                                       trainer_threads)
        wait_ready(self.engine, self.trainer, *([self.critic] if self.critic else []))
        self._start_model_update()
        B = cfg.train.prompts_per_step
        self.staleness = StalenessManager(cfg.async_ratio, B)
        # transport local: the in-process buffer; zmq: a BufferService here and a proxy on it
        self.buffer, self.buffer_service = make_buffer(cfg.buffer, int(math.ceil((cfg.async_ratio + 2) * B)))
        self.input_guard = InputGuard(max_prompt_tokens(cfg, self.model_path), strict=cfg.data.strict)
        self.skip_guard = SkipGuard(cfg.train.max_consecutive_skips)
        self.scheduler = self._make_scheduler()
        self.scheduler.supervisor = self.supervisor
        self.controller = AsyncController(
            self.engine, self.trainer, self.scheduler, self.buffer, self.staleness,
            ControllerSettings(
                prompts_per_step=B, interrupt=cfg.rollout.interrupt, advantage=dict(cfg.algo.advantage),
                prox=prox_mode(cfg.algo.recompute_prox, cfg.async_ratio),
                pad_id=self.tokenizer.pad_token_id or 0, stream=cfg.train.stream,
                colocated=colocated,
            ),
            ledger=self.ledger, critic=self.critic, model_update=self.model_update, supervisor=self.supervisor,
        )
        self._start_durability()
        self._start_worker_faults()

    def _start_worker_faults(self) -> None:
        """Reward and environment worker deaths (recovered in their pools) go to ``events.jsonl``;
        their pids too, so tests and benchmarks can kill one."""
        pids: dict[str, list[int]] = {}
        env = self.scheduler.workflow if isinstance(self.scheduler.workflow, Episodes) else None
        for name, part in (("reward", self.reward_pool), ("env", env)):
            if part is not None:
                part.on_event = lambda event: resume_mod.append_event(self.dir, **event)
                pids[f"{name}_pids"] = part.pids()
        if pids:
            resume_mod.append_event(self.dir, "workers_ready", **pids)

    def _start_engines(self, plan, engine_threads: int, colocated: bool) -> None:
        """The actor_infer replicas (they share the role's threads), behind a router when several."""
        cfg = self.cfg
        n = len(plan.workers["actor_infer"])
        self.replicas = [start_engine(self.model_path, cfg.rollout.max_num_seqs, cfg.seed,
                                      max(1, engine_threads // n), engine=cfg.rollout.engine,
                                      options=self.placement.options("actor_infer", i), sleep_mode=colocated,
                                      # Ray restarts a dead replica; flash.engine.client recovers its work
                                      max_restarts=cfg.rollout.max_engine_restarts)
                         for i in range(n)]
        self.engine = self.replicas[0] if n == 1 else start_router(self.replicas, cfg.rollout.prompt_affinity,
                                                                   cfg.rollout.hang_timeout_s)
        # every engine call of the run goes through it: restarts up to max_engine_restarts (0: a
        # fault stops the run at once, naming the knob)
        self.supervisor = EngineClient(self.engine, cfg.rollout.hang_timeout_s, cfg.rollout.max_engine_restarts,
                                       replicas=self.replicas if n > 1 else None)

    def _start_trainer(self, settings, trainer_threads: int) -> None:
        """One trainer process, or an FSDP2 group when ``train.workers`` > 1 (or a group knob) is set:
        one rank per ``actor_train`` worker, each in its own devices' placement bundle."""
        cfg = self.cfg
        group = group_settings(cfg.train)
        if group is None:
            self.trainer = start_trainer(self.model_path, settings, cfg.seed, trainer_threads, list(cfg.plugins),
                                         options=self.placement.options("actor_train", 0))
        else:
            ranks = [self.placement.options("actor_train", i) for i in range(group.workers)]
            self.trainer = start_trainer_group(self.model_path, settings, group, cfg.seed, trainer_threads,
                                               list(cfg.plugins), rank_options=ranks)

    def _start_model_update(self) -> None:
        """The model-update group from the trainer (a single process, or an FSDP2 group's rank 0) to
        every engine replica; the backend follows the placement (``model_update.backend``)."""
        self.model_update = ModelUpdateGroup(self.trainer, list(self.replicas), **vars(self.cfg.model_update))
        self.model_update.setup()

    def _make_scheduler(self):
        """Episodes on EnvWorker actors for env tasks; else single-turn requests, scored by the
        task's reward or by a reward-worker pool when ``reward.fn`` is set."""
        cfg, params = self.cfg, sampling_params(self.cfg, self.tokenizer)
        self.reward_pool = None
        if isinstance(self.task, EnvTask):  # multi-turn episodes on EnvWorker actors
            return build_episode_scheduler(cfg, self.task, self.tokenizer, self.engine, self.buffer,
                                           self.staleness, params)
        from flash.rewards.judge import with_default_model
        from flash.rewards.workers import pool_from_config

        # a judge without a model judges with the policy's initial checkpoint
        reward_cfg = dataclasses.replace(cfg.reward, fn=with_default_model(dict(cfg.reward.fn), self.model_path))
        self.reward_pool = pool_from_config(reward_cfg, tuple(cfg.plugins), cfg.rollout.max_worker_restarts)
        reward_fn = self.reward_pool.reward_fn() if self.reward_pool else None
        tail = cfg.rollout.scheduler == "tail_batching"
        cls, extra = (TailBatchingScheduler, {"tail": cfg.rollout.tail_batching}) if tail else (RolloutScheduler, {})
        return cls(
            self.engine, build_source(self.task, self.tokenizer, self.input_guard, reward_fn), self.buffer, self.staleness,
            params, n=cfg.rollout.n, seed=cfg.seed,
            reward_workers=cfg.rollout.reward_workers, inject_delay_s=cfg.rollout.inject_delay_s,
            queue_scheduling=cfg.rollout.queue_scheduling, redundancy=cfg.rollout.redundancy,
            max_additional_prompts=cfg.rollout.max_additional_prompts, filters=cfg.rollout.filter, **extra,
        )

    def _start_durability(self) -> None:
        """Engine fault recovery, checkpoints, and the restore of a resumed run.

        The supervisor (flash.engine.client, built with the engines) handles the engine, or each
        replica behind the router, driven by the scheduler (single-turn requests or environment
        episodes: each resubmits what a restarted engine lost, ``requeue_lost``). Checkpoints cover every setup
        (flash.app.run_state: either buffer transport, one trainer or an FSDP2 group, single-turn
        requests or environment episodes)."""
        cfg = self.cfg
        self.notes: list[str] = []
        self.supervisor.requeue = self.scheduler.requeue_lost
        self.supervisor.on_event = lambda event: resume_mod.append_event(self.dir, **event)
        self.checkpointer = Checkpointer(self.dir, cfg.checkpoint, self.trainer, cfg.train.steps)
        self.controller.on_update = lambda version: run_state.on_update(self, version)
        if self.state is not None:
            self.start_step = run_state.restore(self, self.ckpt, self.state)
        pids = {"engine_pids": ray.get([r.pid.remote() for r in self.replicas])}
        pids["engine_pid"] = pids["engine_pids"][0]
        if group_settings(cfg.train) is None:
            pids["trainer_pid"] = ray.get(self.trainer.pid.remote())
        resume_mod.append_event(self.dir, "roles_ready", step=self.start_step, **pids)

    def evaluate(self, tag: str, step: int = 0) -> float:
        """Held-out accuracy now; also a line in ``eval.jsonl`` (step, seconds since training began)."""
        start = time.monotonic()
        params = sampling_params(self.cfg, self.tokenizer, eval_mode=True)
        rewards = self.scheduler.evaluate(self.eval_items, params, tag=tag, seed=self.cfg.seed + 991)
        acc = sum(1.0 for r in rewards if r > 0) / max(len(rewards), 1)
        self.last_eval_s = time.monotonic() - start
        elapsed = start - self.train_start if self.train_start is not None else 0.0
        self.eval_file.write(json.dumps({"tag": tag, "step": step, "elapsed": elapsed, "accuracy": acc,
                                         "seconds": self.last_eval_s}) + "\n")
        self.eval_file.flush()
        return acc

    def close(self) -> None:
        try:
            self.checkpointer.wait()
        except RuntimeError as exc:  # the last checkpoint is the one before; say so, do not hide it
            print(f"flash: {exc}", flush=True)
        self.scheduler.stop()
        self.ledger.close()
        for f in (self.metrics_file, self.timeline_file, self.eval_file):
            f.close()
        if self.model_update is not None:
            self.model_update.close()
        for actor in dict.fromkeys([self.engine, *self.replicas, self.trainer, self.critic,
                                    *(self.scheduler.workflow.workers if isinstance(self.scheduler.workflow, Episodes)
                                      else [])]):
            if actor is not None:
                ray.kill(actor)
        if self.reward_pool is not None:
            self.reward_pool.close()
        if self.buffer_service is not None:
            self.buffer.disconnect()
            self.buffer_service.stop()
        self.placement.remove()


def run(cfg: FlashConfig, recipe_name: str = "run") -> dict:
    """Train as configured; returns (and writes) the run summary."""
    r = Run(cfg, recipe_name)
    start = r.start_step
    tracker = make_tracker(cfg.tracking, str(r.dir), config=to_dict(cfg), purge_step=start + 1 if r.ckpt else None)
    progress = Progress(cfg.train.steps, cfg.tracking.progress)
    progress.write(f"flash: run dir {r.dir}" + (f" (resumed at step {start} from {r.ckpt})" if r.ckpt else ""))
    if r.placement.plan.num_gpus or len(r.replicas) > 1:
        progress.write(f"flash: {r.placement.plan.describe()}")
    for line in r.notes:
        progress.write(line)
    try:
        r.scheduler.start()
        if r.acc0 is None:
            r.acc0 = r.evaluate("initial")
            tracker.log({"eval/accuracy": r.acc0, "time/eval": r.last_eval_s}, 0)
        acc0 = r.acc0
        progress.write(f"flash: held-out accuracy before training {acc0:.3f}")
        if start < cfg.train.steps:
            r.scheduler.set_version(r.controller.version)
        r.scheduler.start_admission()
        train_start = r.train_start = time.monotonic() - r.elapsed0
        try:
            records = r.controller.run(cfg.train.steps, on_step=lambda rec: _on_step(r, rec, tracker, progress),
                                       start=start)
        except RayActorError as exc:  # engine, reward and env faults are recovered (flash.engine.client, pools)
            raise TrainerDied(f"the {_dead_role(r, exc)} died ({exc.__class__.__name__}); the run stopped. "
                              f"Resume from its last checkpoint: flash run {recipe_name} resume={r.dir}") from exc
        r.checkpointer.wait()
        train_s = time.monotonic() - train_start
        left = r.controller.shutdown_rollout()
        acc1 = r.evaluate("final", cfg.train.steps)
        tracker.log({"eval/accuracy": acc1, "time/eval": r.last_eval_s}, cfg.train.steps)
        progress.write(f"flash: held-out accuracy after training {acc1:.3f}")
    finally:
        progress.close()
        tracker.close()
        r.close()
    summary = _summary(cfg, r, records, acc0, acc1, train_s, left)
    (r.dir / "summary.json").write_text(json.dumps(summary, indent=2))
    return summary


def _dead_role(r: Run, exc: RayActorError) -> str:
    """Which of the run's actors a RayActorError names (the message a user acts on): the trainer
    unless the error's actor id is another role's."""
    dead = getattr(exc, "actor_id", None)
    roles = {"critic worker": [r.critic], "rollout engine": [r.engine, *r.replicas]}
    for role, actors in roles.items():
        if dead and any(a is not None and a._actor_id.hex() == dead for a in actors):
            return role
    return "trainer worker"


def _on_step(r: Run, rec, tracker, progress) -> None:
    """Periodic evaluation, then log the step (metrics.jsonl, timeline.jsonl, trackers).

    The evaluation blocks only the controller: its requests join the training requests in the same
    engine (continuous batching), so rollout of training samples goes on meanwhile, up to the
    admission bound. Rollout therefore waits at most as long as the evaluation takes (``time/eval``).
    """
    every = r.cfg.eval.every_steps
    step = rec.step + 1
    logged = dict(rec.metrics)
    if every and step % every == 0 and step < r.cfg.train.steps:
        rec.metrics["eval/accuracy"] = r.evaluate(f"step{step}", step)
        logged.update({"eval/accuracy": rec.metrics["eval/accuracy"], "time/eval": r.last_eval_s})
    logged["time/elapsed"] = time.monotonic() - r.train_start
    if r.reward_pool is not None:  # reward/calls, reward/failures/<reason>, sandbox/timeout/T/...
        logged.update(r.reward_pool.metrics())
    if r.buffer_service is not None:  # zmq transport: puts, gets, bytes, rejected_<reason>, ...
        logged.update({f"buffer/{k}": v for k, v in r.buffer_service.stats().items() if k != "depth"})
    logged.update(r.skip_guard.update(step, rec.metrics.get("train/skipped", 0.0) > 0,
                                      rec.metrics.get("train/loss", 0.0), rec.metrics.get("train/grad_norm", 0.0)))
    logged.update({**r.input_guard.metrics(), **r.checkpointer.metrics()})
    logged.update(r.supervisor.metrics())
    tracker.log(logged, step)
    r.metrics_file.write(json.dumps({"step": step, **logged}) + "\n")
    r.metrics_file.flush()
    r.timeline_file.write(json.dumps({"step": step, **rec.timeline}) + "\n")
    r.timeline_file.flush()
    run_state.commit_checkpoint(r)
    progress.update(logged)


def _summary(cfg, r: Run, records, acc0, acc1, train_s, left) -> dict:
    steps = r.start_step + len(records)  # a resumed run: all of its steps (train_s spans them too)
    trained = sum(len(g.samples) for rec in records for g in rec.groups)
    phase_keys = sorted({k for rec in records for k in rec.metrics if k.startswith("time/")})
    return {
        "eval_accuracy_initial": acc0,
        "eval_accuracy_final": acc1,
        "steps": steps,
        "wall_seconds": time.monotonic() - r.t0,
        "train_seconds": train_s,
        "seconds_per_step": train_s / max(steps, 1),
        "samples_trained": trained,
        "max_staleness_observed": max((rec.metrics["staleness/max"] for rec in records), default=0.0),
        "async_ratio": cfg.async_ratio,
        "interrupt": cfg.rollout.interrupt,
        "loss": cfg.algo.loss["name"],
        "prompts_admitted": r.scheduler.admitted,
        "prompts_unfinished": {k: len(v) for k, v in left.items()},
        "reward_errors": r.scheduler.counters["reward_errors"],
        "resumed_from_step": r.start_step if r.ckpt else None,
        "faults_engine": r.supervisor.faults,
        "faults_reward": r.reward_pool.faults if r.reward_pool is not None else 0,
        "faults_env": r.scheduler.counters.get("faults_env", 0),
        "train_skipped_nonfinite": r.skip_guard.total,
        "data_skipped": dict(r.input_guard.counts),
        "checkpoint": dict(r.checkpointer.last),
        "request_errors": r.scheduler.counters["request_errors"],
        "rollout_counters": dict(r.scheduler.counters),
        "reward_seconds": r.scheduler.counters.get("reward_seconds", 0.0),
        "filtered_groups": dict(r.scheduler.lifecycle.filtered),
        "aborted_samples": dict(r.scheduler.lifecycle.aborted),
        "lifecycle": r.scheduler.lifecycle.snapshot(),
        "phase_seconds_mean": {k[5:]: sum(rec.metrics.get(k, 0.0) for rec in records) / max(steps, 1)
                               for k in phase_keys},
        "run_dir": str(r.dir),
        # the CPU split the roles ran with (flash plan scales costs measured here to other splits)
        "threads": dict(zip(("engine", "trainer"), resolve_threads(cfg))),
        "cores": run_cores(cfg),
    }
