"""`flash run`: build every role from a validated config, train, evaluate, write the summary.

Order of work: run dir and resolved config → task → model (warm start, cached) → Ray and the two
actors → initial held-out evaluation → the controller's steps (progress bar, trackers, periodic
evaluation, checkpoints) → stop rollout (what is left unfinished goes to the ledger) → final
evaluation → ``summary.json`` (flash.app.summary). The settings each part gets from the config are
built in flash.app.settings.

``resume=RUN_DIR`` (flash.app.resume): the same run dir, its newest valid checkpoint restored
(flash.app.run_state) instead of the initial evaluation, and the steps continue from there.
"""

from __future__ import annotations

import dataclasses
import json
import math
import time
from pathlib import Path

import ray
from ray.exceptions import RayActorError

from flash.buffers.factory import make_buffer
from flash.controllers import step_metrics
from flash.controllers.async_controller import AsyncController, ControllerSettings
from flash.controllers.prox_mode import prox_mode
from flash.controllers.reward_errors import RewardErrors
from flash.controllers.scheduler import RolloutScheduler
from flash.controllers.staleness import StalenessManager
from flash.controllers.tail_batching import TailBatchingScheduler
from flash.controllers.workflows.episode import Episodes
from flash.app import resume as resume_mod, run_state
from flash.app.data import build_source, check_prompt_format, data_steps, load_tokenizer, max_prompt_tokens, reward_name
from flash.app.evaluation import build_eval_sets, evaluate_sets, headline, set_figures
from flash.app.preflight import preflight
from flash.app.schedule import step_line
from flash.app.roles import Clock, RolloutBuffer, RunFiles, new_guards, start_roles
from flash.app.settings import resolve_threads, sampling_params, trainer_settings
from flash.app.summary import summary as run_summary
from flash.cache import default_cache_dir
from flash.checkpoint import Checkpointer, latest_verified, remove_partial
from flash.checkpoint_trust import RunDir, bind_run
from flash.app.config import FlashConfig, to_dict, to_yaml
from flash.errors import FlashError
from flash.run_files import write_run_text
from flash.sim.accounting import SimSteps
from flash.app.progress import Heartbeat, Progress, TrainEta, accuracy_mark, settle_steps
from flash.app.summary import last_eval, logged_no_update_streak
from flash.app.tracking import make_tracker, pick_samples
from flash.controllers.agent_runtime import build_agent_scheduler
from flash.controllers.episode_runtime import build_episode_scheduler
from flash.envs.task import EnvTask
from flash.train.fsdp import group_settings
from flash.cluster import pinned_threads, quiet


def prepare_model(cfg: FlashConfig, task, on_sft_step=None) -> str:
    """The policy's initial checkpoint: ``model.path``; ``model.gguf`` converted once (flash.gguf);
    else the tiny model warm-started on the task (flash.train.sft)."""
    if cfg.model.path:
        if cfg.sft != type(cfg.sft)():
            print(
                f"flash: sft: is not run with model.path (it warm-starts the built-in tiny model); the "
                f"policy starts from {cfg.model.path} as it is",
                flush=True,
            )
        return cfg.model.path
    if cfg.model.gguf:
        from flash.gguf import gguf_checkpoint

        return gguf_checkpoint(cfg.model.gguf, default_cache_dir(cfg.cache_dir))
    from flash.train.sft import warm_start

    # simulated roles load no weights: the tiny model's tokenizer and config, untrained
    sft = dataclasses.replace(cfg.sft, steps=0, eval_after=False) if cfg.train.backend == "sim" else cfg.sft
    return warm_start(cfg.model.tiny, sft, task, default_cache_dir(cfg.cache_dir), on_sft_step)


class TrainerDied(FlashError):
    """The trainer worker died; the run stopped at its last checkpoint."""


class Run:
    """One training run's live parts, so ``run`` reads as its steps: the config and what it names
    (task, tokenizer, initial checkpoint), the run directory and its logs, the roles, the rollout
    (buffer, scheduler, controller), the guards, checkpoints and the clock."""

    def __init__(self, cfg: FlashConfig, recipe_name: str, heartbeat: Heartbeat | None = None):
        heartbeat = heartbeat or Heartbeat(0, enabled=False)
        self.clock = Clock()
        quiet()
        self.cfg = cfg
        self.sim_steps = SimSteps(cfg.sim.time_scale)  # simulated seconds per step (train.backend: sim)
        self.reward_cpu = step_metrics.PerStep("reward/cpu_s")  # the reward pool's CPU seconds, per step
        checked = preflight(cfg, recipe_name)  # every refusal before the start (also `flash validate`'s)
        resume_dir, self.task = checked.resume_dir, checked.task
        if resume_dir is not None:
            cfg.run_dir = str(resume_dir)
        self.dir = resume_mod.make_run_dir(cfg, recipe_name, resuming=resume_dir is not None)
        self.resume_point = _find_checkpoint(self.dir, resume_dir is not None, cfg.trust_checkpoint)
        self.key = bind_run(self.dir, self.resume_point.manifest if self.resume_point else None)  # run.json
        write_run_text(self.dir / "config.yaml", to_yaml(cfg))
        cfg.train.steps = data_steps(cfg, self.task)
        heartbeat.set(phase="warm start")
        self.model_path = prepare_model(cfg, self.task, lambda s: heartbeat.set(step=s, total=cfg.sft.steps))
        heartbeat.set(phase="starting roles")
        self.tokenizer = load_tokenizer(cfg, self.model_path)
        check_prompt_format(cfg, self.task, self.tokenizer)  # again on the loaded one (a GGUF model's is new)
        self.files = RunFiles.open(self.dir, append=resume_dir is not None)  # resumed: cut back to the checkpoint
        self.roles = start_roles(cfg, self.model_path, trainer_settings(cfg), resolve_threads(cfg))
        B = cfg.train.prompts_per_step
        # transport local: the in-process buffer; zmq: a BufferService here and a proxy on it
        self.buffer = RolloutBuffer(
            *make_buffer(cfg.buffer, int(math.ceil((cfg.async_ratio + 2) * B))), StalenessManager(cfg.async_ratio, B)
        )
        self.guards = new_guards(cfg, max_prompt_tokens(cfg, self.model_path), getattr(self.task, "read_skipped", None))
        self.eval_sets = build_eval_sets(cfg, self.task)
        self.reward_pool, self.scheduler = self._make_scheduler()
        self.controller = AsyncController(
            self.roles.engine,
            self.roles.trainer,
            self.scheduler,
            self.buffer.buffer,
            self.buffer.staleness,
            ControllerSettings(
                prompts_per_step=B,
                interrupt=cfg.rollout.interrupt,
                advantage=dict(cfg.algo.advantage),
                prox=prox_mode(cfg.algo.recompute_prox, cfg.async_ratio),
                measure_prox_error=cfg.algo.measure_prox_error,
                pad_id=self.tokenizer.pad_token_id or 0,
                stream=cfg.train.stream,
                colocated=self.roles.colocated,
            ),
            ledger=self.files.ledger,
            critic=self.roles.critic,
            model_update=self.roles.model_update,
            supervisor=self.roles.client,
            reference=self.roles.reference,
        )
        self.buffer.bound_values(self.model_path, lambda: self.controller.version + 1)
        self.checkpointer = Checkpointer(self.dir, cfg.checkpoint, self.roles.trainer, cfg.train.steps, self.key)
        self._start_durability()
        self._start_worker_faults()

    def _start_worker_faults(self) -> None:
        """Reward and environment worker deaths (recovered in their pools) go to ``events.jsonl``;
        their pids too, so tests and benchmarks can kill one."""
        pids: dict[str, list[int]] = {}
        for name, part in (("reward", self.reward_pool), ("env", self._episodes())):
            if part is not None:
                part.on_event = lambda event: resume_mod.append_event(self.dir, **event)
                pids[f"{name}_pids"] = part.pids()
        if pids:
            resume_mod.append_event(self.dir, "workers_ready", **pids)

    def _episodes(self) -> Episodes | None:
        workflow = self.scheduler.workflow
        return workflow if isinstance(workflow, Episodes) else None

    def _make_scheduler(self):
        """(reward pool or None, scheduler): episodes on EnvWorker actors for env tasks; else
        single-turn requests, scored by the task's reward or by a reward-worker pool when
        ``reward.fn`` is set. Every engine call goes through the roles' engine client."""
        cfg, params, client = self.cfg, sampling_params(self.cfg, self.tokenizer), self.roles.client
        if cfg.agent.fn or self.task.agent is not None:  # agents (the user's, or the task's) through the gateway
            return None, build_agent_scheduler(
                cfg,
                self.task,
                self.tokenizer,
                self.roles.engine,
                self.buffer.buffer,
                self.buffer.staleness,
                params,
                client,
            )
        if isinstance(self.task, EnvTask):  # multi-turn episodes on EnvWorker actors
            return None, build_episode_scheduler(
                cfg,
                self.task,
                self.tokenizer,
                self.roles.engine,
                self.buffer.buffer,
                self.buffer.staleness,
                params,
                client,
            )
        from flash.rewards.judge import with_default_model
        from flash.rewards.workers import pool_from_config

        # a judge without a model judges with the policy's initial checkpoint
        reward_cfg = dataclasses.replace(cfg.reward, fn=with_default_model(dict(cfg.reward.fn), self.model_path))
        pool = pool_from_config(reward_cfg, tuple(cfg.plugins), cfg.rollout.max_worker_restarts)
        reward_fn = pool.reward_fn() if pool else None
        tail = cfg.rollout.scheduler == "tail_batching"
        cls, extra = (TailBatchingScheduler, {"tail": cfg.rollout.tail_batching}) if tail else (RolloutScheduler, {})
        return pool, cls(
            self.roles.engine,
            build_source(self.task, self.tokenizer, self.guards.inputs, reward_fn),
            self.buffer.buffer,
            self.buffer.staleness,
            params,
            n=cfg.rollout.n,
            seed=cfg.seed,
            reward_workers=cfg.rollout.reward_workers,
            inject_delay_s=cfg.rollout.inject_delay_s,
            queue_scheduling=cfg.rollout.queue_scheduling,
            redundancy=cfg.rollout.redundancy,
            max_additional_prompts=cfg.rollout.max_additional_prompts,
            filters=cfg.rollout.filter,
            client=client,
            reward_deadline_s=cfg.reward.response_deadline_s,
            reward_errors=RewardErrors(cfg.reward.max_consecutive_errors, reward_name(cfg)),
            **extra,
        )

    def _start_durability(self) -> None:
        """Engine fault recovery, checkpoints, and the restore of a resumed run.

        The engine client (flash.engine.client, built with the engines) handles the engine, or each
        replica behind the router; a restarted one's lost work is asked again by the scheduler
        (``requeue_lost``: single-turn requests or the turns episodes wait for). The client and the
        scheduler need each other, so this is the one step that binds them. Checkpoints cover every
        setup (flash.app.run_state)."""
        client = self.roles.client
        client.requeue = self.scheduler.requeue_lost
        client.on_event = lambda event: resume_mod.append_event(self.dir, **event)
        self.controller.on_update = lambda version: run_state.on_update(self.durable(), version)
        if self.resume_point is not None:
            self.clock.start_step = run_state.restore(self.durable(), self.roles, self.controller, self.resume_point)
        pids = {"engine_pids": ray.get([r.pid.remote() for r in self.roles.replicas])}
        pids["engine_pid"] = pids["engine_pids"][0]
        if group_settings(self.cfg.train) is None:
            pids["trainer_pid"] = ray.get(self.roles.trainer.pid.remote())
        resume_mod.append_event(self.dir, "roles_ready", step=self.clock.start_step, **pids)

    def durable(self) -> run_state.Durable:
        """What a checkpoint holds beside the trainer's tensors (flash.app.run_state)."""
        return run_state.Durable(
            self.buffer,
            self.scheduler,
            self.clock,
            self.guards,
            self.roles.client,
            self.reward_pool,
            self.checkpointer,
            self.files,
            self.cfg.train,
        )

    def evaluate(self, tag: str, step: int, progress: Progress) -> dict[str, float]:
        """Every evaluation set's metrics (flash.app.evaluation) and the headline held-out accuracy
        ``eval/accuracy`` (the first set's mean@n); also a line in ``eval.jsonl`` (step, seconds
        since training began). Its count and time left go to ``progress`` while it runs."""
        start = time.monotonic()
        params = sampling_params(self.cfg, self.tokenizer, eval_mode=True)
        n = self.cfg.eval.n
        try:
            metrics = evaluate_sets(
                self.scheduler,
                self.eval_sets,
                params,
                n,
                self.cfg.seed + 991,
                self.dir,
                step,
                self.scheduler.source.decode,
                decode_prompt=self.tokenizer.decode,
                on_progress=progress.evaluating,
            )
        finally:
            progress.evaluating(None)
        metrics["eval/accuracy"] = headline(metrics, self.eval_sets, n) or 0.0
        self.clock.last_eval_s = time.monotonic() - start
        elapsed = start - self.clock.train_start if self.clock.train_start is not None else 0.0
        self.files.eval.write(
            json.dumps(
                {
                    "tag": tag,
                    "step": step,
                    "elapsed": elapsed,
                    "accuracy": metrics["eval/accuracy"],
                    "seconds": self.clock.last_eval_s,
                    "sets": {k: v for k, v in metrics.items() if k != "eval/accuracy"},
                }
            )
            + "\n"
        )
        self.files.eval.flush()
        return metrics

    def close(self) -> None:
        try:
            self.checkpointer.wait()
        except RuntimeError as exc:  # the last checkpoint is the one before; say so, do not hide it
            print(f"flash: {exc}", flush=True)
        self.scheduler.stop()
        self.files.close()
        episodes = self._episodes()
        self.roles.close(episodes.workers if episodes is not None else [])
        if self.reward_pool is not None:
            self.reward_pool.close()
        self.buffer.close()


def _find_checkpoint(run_dir: Path, resuming: bool, trust: bool) -> resume_mod.ResumePoint | None:
    """The checkpoint to resume from (verified for this run dir: ``RunDir``), or None: a fresh start."""
    if not resuming:
        resume_mod.append_event(run_dir, "start")
        return None
    ckpt, manifest, skipped = latest_verified(run_dir / "checkpoints", trust=trust, run=RunDir.read(run_dir))
    remove_partial(run_dir / "checkpoints")  # writes a kill interrupted: never read, now gone
    state = resume_mod.load_state(ckpt, manifest) if ckpt is not None else None
    resume_mod.restore_logs(run_dir, state["logs"] if state else None)
    resume_mod.append_event(
        run_dir, "resume", checkpoint=str(ckpt) if ckpt else None, step=state["step"] if state else 0, skipped=skipped
    )
    return resume_mod.ResumePoint(ckpt, state, manifest) if ckpt is not None else None


def resume_command(recipe: str, run_dir: Path | str) -> str:
    """The command that resumes a run: ``recipe`` as the user named it (empty: the run dir alone,
    whose ``config.yaml`` holds every setting; ``flash.app.config.resumed_run``)."""
    return f"flash run {recipe + ' ' if recipe else ''}resume={run_dir}"


def interrupted(exc: KeyboardInterrupt, recipe: str, run_dir: Path | str) -> str:
    """What an interrupt says: its cause (``SIGTERM``, else ``ctrl-C``) and the resume command."""
    return f"{str(exc) or 'ctrl-C'}; resume from the last checkpoint: {resume_command(recipe, run_dir)}"


def run(cfg: FlashConfig, recipe_name: str = "run", recipe_arg: str | None = None) -> dict:
    """Train as configured; returns (and writes) the run summary. ``recipe_arg``: the recipe as the
    user named it, for the resume command a stopped run prints (default ``recipe_name``).

    Every numeric stage pins its own torch threads from the config (the warm start ``sft.threads``,
    the roles ``resources.*_threads``, this driver ``resources.driver_threads``), so the numbers do
    not depend on what the calling process did before (a test session, a notebook)."""
    heartbeat = Heartbeat(cfg.tracking.heartbeat_s, cfg.tracking.progress)
    try:
        with pinned_threads(cfg.resources.driver_threads):
            return _run(cfg, recipe_name, heartbeat, recipe_name if recipe_arg is None else recipe_arg)
    finally:
        heartbeat.close()


def _run(cfg: FlashConfig, recipe_name: str, heartbeat: Heartbeat, recipe_arg: str) -> dict:
    r = Run(cfg, recipe_name, heartbeat)
    start = r.clock.start_step
    tracker = make_tracker(
        cfg.tracking, str(r.dir), config=to_dict(cfg), purge_step=start + 1 if r.resume_point else None
    )
    progress = Progress(
        cfg.train.steps,
        cfg.tracking.progress,
        heartbeat,
        start=start,
        streak=logged_no_update_streak(r.dir) if r.resume_point else 0,
    )
    progress.write(
        f"flash: run dir {r.dir}" + (f" (resumed at step {start} from {r.resume_point.path})" if r.resume_point else "")
    )
    if r.roles.placement.plan.num_gpus or len(r.roles.replicas) > 1:
        progress.write(f"flash: {r.roles.placement.plan.describe()}")
    try:
        r.scheduler.start()
        if r.clock.acc0 is None:
            heartbeat.set(phase="evaluation before training")
            metrics = r.evaluate("initial", 0, progress)
            r.clock.acc0 = metrics["eval/accuracy"]
            tracker.log(step_metrics.eval_metrics(metrics, r.clock.last_eval_s), 0)
            progress.write(f"flash: held-out before training: {set_figures(metrics, cfg.eval.n)}")
        acc0 = r.clock.acc0
        _train_progress(r, progress, heartbeat)
        if start < cfg.train.steps:
            r.scheduler.set_version(r.controller.version)
        r.scheduler.start_admission()
        train_start = r.clock.train_start = time.monotonic() - r.clock.elapsed0
        try:
            records = r.controller.run(
                cfg.train.steps, on_step=lambda rec: _on_step(r, rec, tracker, progress), start=start
            )
        except RayActorError as exc:  # engine, reward and env faults are recovered (flash.engine.client, pools)
            raise TrainerDied(
                f"the {r.roles.dead_role(exc)} died ({exc.__class__.__name__}); the run stopped. "
                f"Resume from its last checkpoint: {resume_command(recipe_arg, r.dir)}"
            ) from exc
        r.checkpointer.wait()
        train_s = time.monotonic() - train_start
        left = r.controller.shutdown_rollout()
        heartbeat.set(phase="evaluation after training")
        metrics = r.evaluate("final", cfg.train.steps, progress)
        acc1 = metrics["eval/accuracy"]
        tracker.log(step_metrics.eval_metrics(metrics, r.clock.last_eval_s), cfg.train.steps)
        progress.write(f"flash: held-out after training: {set_figures(metrics, cfg.eval.n)}")
    except KeyboardInterrupt as exc:  # ctrl-C, or SIGTERM (flash.errors.Terminated)
        raise type(exc)(interrupted(exc, recipe_arg, r.dir)) from None
    finally:
        progress.close()
        tracker.close()
        r.close()
    summary = run_summary(cfg, r, records, acc0, acc1, train_s, left)
    write_run_text(r.dir / "summary.json", json.dumps(summary, indent=2))
    return summary


def _train_progress(r: Run, progress: Progress, heartbeat: Heartbeat) -> None:
    """What the train phase shows (flash.app.progress): the last held-out accuracy and its step when
    the run evaluates periodically (a resumed run's from ``eval.jsonl``), the run's training time so
    far and an ETA from the steps this process measures."""
    cfg, start = r.cfg, r.clock.start_step
    last = last_eval(r.dir)
    progress.accuracy = (last["accuracy"], last["step"]) if cfg.eval.every_steps and last else None
    eval_s = r.clock.last_eval_s or (last["seconds"] if last else 0.0)
    progress.eta = TrainEta(
        cfg.train.steps, settle_steps(cfg.async_ratio), cfg.eval.every_steps, eval_s, r.clock.elapsed0
    )
    heartbeat.set(
        phase="train",
        step=start,
        total=cfg.train.steps,
        time=(r.clock.elapsed0, None),
        accuracy=accuracy_mark(*progress.accuracy) if progress.accuracy else None,
    )


def _on_step(r: Run, rec, tracker, progress) -> None:
    """Periodic evaluation, then log the step (metrics.jsonl, timeline.jsonl, trackers).

    The evaluation blocks only the controller: its requests join the training requests in the same
    engine (continuous batching), so rollout of training samples goes on meanwhile, up to the
    admission bound. Rollout therefore waits at most as long as the evaluation takes (``time/eval``).
    """
    every = r.cfg.eval.every_steps
    step = rec.step + 1
    evaluated: dict[str, float] = {}
    if every and step % every == 0 and step < r.cfg.train.steps:
        evaluated = step_metrics.eval_metrics(r.evaluate(f"step{step}", step, progress), r.clock.last_eval_s)
        rec.metrics["eval/accuracy"] = evaluated["eval/accuracy"]
    sim = (lambda logged: r.sim_steps.metrics(step, logged, rec.timeline)) if r.cfg.train.backend == "sim" else None
    logged = step_metrics.logged_metrics(
        rec.metrics, evaluated, time.monotonic() - r.clock.train_start, sim, _run_sources(r, step, rec.metrics)
    )
    tracker.log(logged, step)
    r.files.metrics.write(json.dumps({"step": step, **logged}) + "\n")
    r.files.metrics.flush()
    r.files.timeline.write(json.dumps({"step": step, **rec.timeline}) + "\n")
    r.files.timeline.flush()
    _record_schedule(r, rec)
    if r.cfg.tracking.log_samples:
        picked = pick_samples(step, rec.groups, r.cfg.tracking.log_samples, r.tokenizer.decode)
        r.files.samples.write("".join(json.dumps(x) + "\n" for x in picked))
        r.files.samples.flush()
        tracker.samples("samples", picked, step)
    run_state.commit_checkpoint(r.checkpointer, r.files)
    progress.update({"step": step, **logged})


def _run_sources(r: Run, step: int, metrics: dict[str, float]) -> list[dict[str, float]]:
    """The run's own metric sources for a step (flash.controllers.step_metrics), in the order logged."""
    m = [r.reward_cpu(r.reward_pool.metrics())] if r.reward_pool is not None else []  # reward/calls, sandbox/...
    if r.buffer.service is not None:  # zmq transport: puts, gets, bytes, rejected_<reason>, ...
        m.append(step_metrics.service_metrics(r.buffer.service.stats()))
    m.append(
        r.guards.steps.update(
            step,
            metrics.get("train/skipped", 0.0) > 0,
            metrics.get("train/loss", 0.0),
            metrics.get("train/grad_norm", 0.0),
        )
    )
    return [*m, r.guards.inputs.metrics(), r.checkpointer.metrics(), r.roles.client.metrics()]


def _record_schedule(r: Run, rec) -> None:
    """The step's line in ``schedule.jsonl`` (flash.app.schedule): what `flash replay` re-trains."""
    train = {k[len("train/") :]: v for k, v in rec.metrics.items() if k.startswith("train/")}
    context = {
        "version": rec.step,
        "trainer_threads": resolve_threads(r.cfg)[1],
        "prox": r.controller.s.prox,
        "stream": r.controller.s.stream,
    }
    r.files.schedule.write(json.dumps(step_line(rec.step, rec.groups, train, context)) + "\n")
    r.files.schedule.flush()
