"""The FSDP2 trainer group: N rank processes behind the same methods as ``TrainerWorker``.

Parts:
- ``FSDPRank`` (one Ray actor per rank): joins the torch.distributed group, loads the model, shards
  it (``flash.train.fsdp.ShardedTrainer``) and runs its share of each call.
- ``TrainerGroup`` (one Ray actor): the controller's handle. It answers ``logprobs``,
  ``train_step``, ``get_weights``, ``save`` and ``stats`` like ``TrainerWorker``, so the controller
  cannot tell a group from a single trainer; plus ``load`` and ``export_hf``. Per call it plans the
  batch (``flash.train.microbatch.plan_batch``: rows to ranks, micro-batches under the token budget,
  equal counts), sends the batch once through the object store, starts every rank's share and adds
  the ranks' partial results up. It is also the model-update group's sender (``mu_*``, as
  ``UpdateSender``): every rank takes part in gathering the full state dict, rank 0 keeps it and is
  the member that broadcasts (or writes the shared segment) to the replicas; the weights never
  pass through this actor or Ray's object store.

Every collective call goes to all ranks in the same order (one lock), or the group would deadlock.
Rank actors are owned by the group actor: killing the group kills them too (Ray fate-sharing).
"""

from __future__ import annotations

import datetime
import io
import json
import logging
import os
import sys
import threading
import time
from pathlib import Path

import ray
import torch

from flash.algos.metrics import combine, finalize
from flash.errors import FlashError
from flash.staging import HostStager
from flash.train.batch import TrainBatch, batch_to
from flash.train.fsdp import COLLECTIVE_TIMEOUT_S, GroupSettings, ShardedTrainer, free_port, pick_device
from flash.weights.gather import FlatGather
from flash.train.microbatch import MicroPlan, plan_batch
from flash.weights.model_update import ModelUpdateError, connect, open_store, unique_tensors
from flash.weights.group import UpdateSender, gathers_on_device
from flash.train.trainer import TrainerSettings
from flash.train.updates import train_batch
from flash.devices import max_peak_memory, read_peak_memory
from flash.usage import process_tree_cpu_s

log = logging.getLogger("flash")

META_FILE = "flash_trainer.json"  # beside the DCP shards: steps and the world size that wrote them


def _read(directory: Path, name: str, files: dict[str, dict] | None) -> bytes:
    """A file of a DCP folder: checked against the verified manifest's ``files``, or (None: a
    ``save`` folder, no manifest) as it is."""
    from flash.checkpoint_trust import read_verified

    return (directory / name).read_bytes() if files is None else read_verified(directory, name, files)


class TrainerGroupError(RuntimeError):
    """A rank failed: its peers may be stuck in a collective, so the group takes no more calls."""


class FSDPRank(UpdateSender):
    """One rank: a process-group member holding 1/N of the model and optimizer. Rank 0 is also the
    model-update group's sender, pushing the state dict the ranks gathered (``mu_gather``)."""

    def __init__(self, rank: int, world: int, model_path: str, settings: TrainerSettings,
                 group: GroupSettings, seed: int, threads: int, plugins: list[str], paths: list[str]):
        from flash import algos

        torch.set_num_threads(max(1, threads))
        sys.path[:0] = [p for p in paths if p not in sys.path]
        algos.load_plugins(list(plugins))
        self.rank, self.world, self.model_path = rank, world, model_path
        self.settings, self.group, self.seed = settings, group, seed
        self.device, self.backend = pick_device()
        self.trainer: ShardedTrainer | None = None
        self.ckpt_group = None
        self._snapshot: dict | None = None
        self._stager = HostStager()  # the snapshot's host buffers, reused by the next one
        self._ties: list[tuple[str, ...]] = []  # names sharing one tensor in the unsharded model
        self._mu_full: dict[str, torch.Tensor] | None = None  # rank 0: the gathered weights to push
        self._flat: FlatGather | None = None  # mu_gather's plan (flash.weights.gather), made at setup

    def node(self) -> str:
        return ray.get_runtime_context().get_node_id()

    def rendezvous(self, spread: bool) -> tuple[str, int]:
        """Rank 0's address and a port free on it, for every rank's ``setup``: loopback when all
        ranks share this host (nothing listens outside it), else this node's IP."""
        host = ray.util.get_node_ip_address() if spread else "127.0.0.1"
        return host, free_port(host)

    def setup(self, addr: str, port: int) -> str:
        """Join the process group (blocks until all ranks join), then load and shard the model."""
        import torch.distributed as dist
        from torch.distributed.device_mesh import init_device_mesh

        from flash.cluster import load_model

        # rank 0's store listens on ``addr`` only (loopback when the ranks share this host)
        store = (open_store(addr, COLLECTIVE_TIMEOUT_S, port, self.world) if self.rank == 0
                 else connect(addr, port, COLLECTIVE_TIMEOUT_S))
        dist.init_process_group(self.backend, store=store, rank=self.rank, world_size=self.world,
                                timeout=datetime.timedelta(seconds=COLLECTIVE_TIMEOUT_S))
        mesh = init_device_mesh(self.device.type, (self.world,))
        self.ckpt_group = dist.new_group(backend="gloo")  # checkpoint writes beside training (flash.checkpoint)
        model = load_model(self.model_path)
        self._ties = [names for names, _ in unique_tensors(model.state_dict()) if len(names) > 1]
        self.trainer = ShardedTrainer(model, self.settings, mesh, self.device, seed=self.seed)
        self._flat = FlatGather(self.trainer.model)
        if self._flat.reason is not None and self.rank == 0:
            log.warning("weight push gathers per parameter (slower): the flat gather does not cover this "
                        "model: %s", self._flat.reason)
        return self.backend

    def devices(self) -> list[int]:
        """The logical devices the placement gave this rank (``flash.placement``; empty: CPU only)."""
        from flash.placement import visible_devices

        return visible_devices()

    # ---- model-update group: every rank gathers, rank 0 sends (TrainerGroup.mu_*) ----
    def mu_gather(self, cast: dict[str, str] | None = None, on_device: bool = False) -> None:
        """Collective: the full state dict on rank 0, kept for its next ``mu_plan``/``mu_send``: in
        the replicas' dtypes (``cast``, cast on each rank's device before the gather) and on rank
        0's device (``on_device``: the CUDA-IPC push, ``gathers_on_device``) or in host memory.

        One flat gather per bucket (``flash.weights.gather``) rather than ``get_model_state_dict``'s
        collective per parameter; a layout it does not cover (``self._flat.reason``, decided at
        setup from metadata every rank shares, logged once) takes the per-parameter path, the one
        ``get_weights`` uses (``full_state_dict``). Tied
        names (a tied LM head) are tied again in the gathered dict, so the push sends them once."""
        state = (self._flat(dst=0, cast=cast, on_device=on_device) if self._flat.reason is None
                 else self.full_state_dict())
        if self.rank == 0:
            for names in self._ties:
                for alias in names[1:]:
                    state[alias] = state[names[0]]
            self._mu_full = state

    def mu_release(self) -> None:
        self._mu_full = None

    def _mu_state(self) -> dict[str, torch.Tensor]:
        if self._mu_full is None:
            raise ModelUpdateError(f"trainer rank {self.rank} holds no gathered weights: only rank 0 sends, "
                                   "after TrainerGroup.mu_plan gathered them")
        return self._mu_full

    def _mu_device(self) -> torch.device:
        return self.device  # where this rank computes: the backend choice compares it with the replicas'

    def logprobs(self, batch: TrainBatch, plan) -> torch.Tensor:
        start = time.monotonic()
        out = self.trainer.planned_logprobs(batch_to(batch, self.device), plan).cpu()
        self.trainer.busy_s += time.monotonic() - start
        return out

    def begin_step(self) -> None:
        self.trainer.begin_step()

    def accumulate(self, batch: TrainBatch, advantages, prox_logp, ref_logp, plan) -> float:
        dev = lambda t: None if t is None else t.to(self.device)
        return self.trainer.planned_accumulate(batch_to(batch, self.device), dev(advantages), dev(prox_logp), plan,
                                               dev(ref_logp))

    def finish_step(self, total: float, advance: bool = True) -> dict:
        return self.trainer.planned_finish(total, advance)

    def full_state_dict(self):
        from flash.train.fsdp_checkpoint import full_state_dict

        return full_state_dict(self.trainer.model)

    def save(self, path: str) -> None:
        from flash.train.fsdp_checkpoint import save_dcp

        save_dcp(self.trainer.model, self.trainer.optimizer, path)

    def load(self, path: str, steps: int, files: dict[str, dict] | None = None) -> None:
        """Model and optimizer from a DCP folder (any world size wrote it), and this rank's RNG
        when the folder has one for it (a checkpoint written by ``checkpoint_write``). ``files``:
        the folder's verified manifest table (every file read is checked against it), or None."""
        from flash.train.fsdp_checkpoint import load_dcp

        load_dcp(self.trainer.model, self.trainer.optimizer, path, files)
        self.trainer.steps = steps
        # every batch takes the same number of optimizer steps: the lr schedule's position follows
        self.trainer.optimizer_steps = steps * self.trainer.s.updates_per_batch
        rng = f"rng-{self.rank}.pt"
        if (rng in files) if files is not None else (Path(path) / rng).is_file():
            from flash.checkpoint import set_rng_state

            set_rng_state(torch.load(io.BytesIO(_read(Path(path), rng, files)), weights_only=True))

    def checkpoint_snapshot(self) -> None:
        from flash.checkpoint import rng_state
        from flash.train.fsdp_checkpoint import snapshot_dcp

        self._snapshot = {"dcp": snapshot_dcp(self.trainer.model, self.trainer.optimizer, self._stager),
                          "rng": rng_state()}

    def checkpoint_write(self, path: str) -> None:
        from flash.checkpoint import save_trainer_state
        from flash.train.fsdp_checkpoint import save_snapshot

        snapshot, self._snapshot = self._snapshot, None
        if snapshot is None:
            raise RuntimeError("checkpoint_write without a checkpoint_snapshot first")
        save_snapshot(snapshot["dcp"], path, self.ckpt_group)
        save_trainer_state(snapshot["rng"], path, name=f"rng-{self.rank}.pt")

    def export_hf(self, path: str):
        from flash.train.fsdp_checkpoint import export_hf

        return export_hf(self.trainer.model, path, self.model_path)

    def stats(self) -> dict:
        t = self.trainer
        return {"busy_s": t.busy_s if t else 0.0, "steps": float(t.steps) if t else 0.0, "cpu_s": process_tree_cpu_s(),
                **read_peak_memory(self.device if t else None)}

    def pid(self) -> int:
        return os.getpid()


def combine_steps(results: list[dict], counts: dict[str, float]) -> dict:
    """The ranks' step results → the single-trainer metrics dict (all floats).

    Each rank's metric partials combine by the metric's reduction (``flash.algos.metrics.combine``:
    means by weight, max / min over ranks, sums added); grad norm and skip are global (every rank
    holds the same). ``counts``: the step's micro-batch plan counters.
    """
    metrics = finalize(combine([r["partials"] for r in results]))
    metrics.setdefault("loss", 0.0)
    metrics.update(grad_norm=results[0]["grad_norm"], skipped=results[0]["skipped"], lr=results[0]["lr"])
    metrics.update(counts)
    return metrics


def plan_counts(plan: MicroPlan) -> dict[str, float]:
    return {"micro_batches": float(plan.count), "pad_micro_batches": float(plan.pad_micro_batches),
            "over_budget_rows": float(plan.over_budget)}


class TrainerGroup:
    """The controller's trainer handle when ``train.workers`` > 1 (or FSDP knobs are set)."""

    def __init__(self, model_path: str, settings: TrainerSettings, group: GroupSettings, seed: int,
                 threads: int, plugins: list[str], paths: list[str] = (), rank_options: list[dict] | None = None):
        n = group.workers
        opts = rank_options or [{} for _ in range(n)]
        if len(opts) != n:
            raise ValueError(f"rank_options has {len(opts)} entries for {n} workers")
        cls = ray.remote(FSDPRank)
        per_rank = max(1, threads // n)
        # max_concurrency 3: a checkpoint write runs beside a step's call (and a stats call)
        self.ranks = [cls.options(**{"num_cpus": 0, "max_concurrency": 3, **o}).remote(
            r, n, model_path, settings, group, seed, per_rank, list(plugins), list(paths)) for r, o in enumerate(opts)]
        spread = len(set(ray.get([r.node.remote() for r in self.ranks]))) > 1
        addr, port = ray.get(self.ranks[0].rendezvous.remote(spread))
        self.backend = ray.get([r.setup.remote(addr, port) for r in self.ranks])[0]
        self.settings, self.group = settings, group
        self.lock = threading.Lock()  # collectives in one order on every rank
        self.steps = 0
        self.busy_s = 0.0
        self.failed: str | None = None  # why the group broke (a rank failed), once it has
        self._open: dict[str, float] = {}  # the open step's weight and plan counters
        self._snapshot_steps: int | None = None  # steps at the checkpoint snapshot not yet written
        self._mu_backends: dict[str, str] = {}  # each model-update group's backend (where rank 0 gathers)

    def _plan(self, batch: TrainBatch) -> MicroPlan:
        if len(batch) == 0:
            raise ValueError("the trainer group got an empty batch (0 rows); nothing to train on")
        lengths = batch.attention_mask.sum(dim=1).tolist()
        return plan_batch(lengths, self.group.workers, self.group.micro_tokens, self.settings.micro_batch_size)

    def _call(self, method: str, per_rank: list[tuple]) -> list:
        """``method`` on every rank (rank r gets ``per_rank[r]``), in one order; their results.

        Results are taken as they come, so a rank that dies or raises is reported at once (its
        peers would wait in a collective until the timeout); the group is then broken for good.
        """
        if self.failed:
            raise TrainerGroupError(f"trainer group is broken ({self.failed}); start a new one and load "
                                    "the last checkpoint")
        with self.lock:
            refs = [getattr(r, method).remote(*args) for r, args in zip(self.ranks, per_rank, strict=True)]
            pending = list(refs)
            while pending:
                ready, pending = ray.wait(pending, num_returns=1)
                try:
                    ray.get(ready)
                except ray.exceptions.RayError as exc:
                    rank = refs.index(ready[0])
                    cause = getattr(exc, "cause", None)
                    self.failed = f"rank {rank} failed in {method}: {type(exc).__name__}: {str(exc).splitlines()[0]}"
                    if isinstance(cause, FlashError):  # a refusal by name (a changed checkpoint file)
                        self.failed = f"rank {rank} failed in {method}: {cause}"
                        raise cause from None
                    raise TrainerGroupError(self.failed) from None
            return ray.get(refs)

    def _all(self, method: str, *args) -> list:
        return self._call(method, [args] * len(self.ranks))

    def logprobs(self, batch: TrainBatch) -> torch.Tensor:
        """Proximal logprobs ``[N, L-1]``: each rank's rows, added up (zeros elsewhere)."""
        start = time.monotonic()
        plan, ref = self._plan(batch), ray.put(batch)
        parts = self._call("logprobs", [(ref, p) for p in plan.ranks])
        self.busy_s += time.monotonic() - start
        return torch.stack(parts).sum(0)

    def train_step(self, batch: TrainBatch, advantages: torch.Tensor, prox_logp: torch.Tensor | None,
                   ref_logp: torch.Tensor | None = None) -> dict:
        """The batch's optimizer steps, each sharded over the ranks (``Trainer.train_step``)."""
        return train_batch(self, batch, advantages, prox_logp, self.settings, self.steps, ref_logp)

    # ---- one step in parts, as ``Trainer`` (the stream trainer feeds groups as they finish) ----
    def begin_step(self) -> None:
        self._all("begin_step")
        self._open = {"weight": 0.0, "micro_batches": 0.0, "pad_micro_batches": 0.0, "over_budget_rows": 0.0}

    def accumulate(self, batch: TrainBatch, advantages: torch.Tensor, prox_logp: torch.Tensor | None,
                   ref_logp: torch.Tensor | None = None) -> float:
        """Backward over ``batch``, its rows planned over the ranks; returns its weight."""
        self._require_open("accumulate")
        start = time.monotonic()
        plan = self._plan(batch)
        refs = [ray.put(batch), ray.put(advantages), ray.put(prox_logp), ray.put(ref_logp)]
        added = sum(self._call("accumulate", [(*refs, p) for p in plan.ranks]))
        for key, value in plan_counts(plan).items():
            self._open[key] += value
        self._open["weight"] += added
        self.busy_s += time.monotonic() - start
        return added

    def finish_step(self, advance: bool = True) -> dict:
        """Divide by the step's global weight, clip, step on every rank; the step's metrics.
        ``advance``: the batch's last optimizer step (the version counter moves on)."""
        self._require_open("finish_step")
        start = time.monotonic()
        counts, self._open = dict(self._open), {}
        results = self._all("finish_step", counts.pop("weight"), advance)
        self.steps += int(advance)
        self.busy_s += time.monotonic() - start
        self.metric_reductions = {n: m.reduce for r in results for n, m in r["partials"].metrics.items()}
        return combine_steps(results, counts)

    def _require_open(self, method: str) -> None:
        if not self._open:
            raise RuntimeError(f"{method} outside a step: call begin_step first")

    def get_weights(self) -> dict[str, torch.Tensor]:
        """The full (gathered) state dict, keys as the plain model's ``state_dict``."""
        return self._all("full_state_dict")[0]

    def save(self, path: str) -> str:
        """A torch distributed checkpoint (model + optimizer) at ``path``, plus the step count."""
        Path(path).mkdir(parents=True, exist_ok=True)
        self._all("save", str(path))
        (Path(path) / META_FILE).write_text(json.dumps({"steps": self.steps, "workers": self.group.workers}))
        return str(path)

    def load(self, path: str, files: dict[str, dict] | None = None) -> int:
        """Restore model, optimizer and step count from ``save``'s folder; returns the step count.
        ``files``: the folder's verified manifest table (a checkpoint's ``trainer/``), or None."""
        meta = Path(path) / META_FILE
        if files is None and not meta.is_file():
            raise FileNotFoundError(f"{meta} not found: {path} is not a checkpoint TrainerGroup.save wrote")
        steps = int(json.loads(_read(Path(path), META_FILE, files))["steps"])
        self._all("load", str(path), steps, files)
        self.steps = steps
        return steps

    # ---- checkpoint hooks (flash.checkpoint), the same three as TrainerWorker's ----
    def checkpoint_snapshot(self) -> None:
        """Every rank copies its own shards (between steps, in the collectives' order)."""
        self._all("checkpoint_snapshot")
        self._snapshot_steps = self.steps

    def checkpoint_write(self, directory: str) -> None:
        """The snapshot as a DCP folder ``directory/trainer/`` (model + optimizer shards, each rank's
        RNG, the step count and world size), every rank writing its shards in parallel.

        Runs while training goes on (the Checkpointer's background thread): not under the
        collectives' lock, the ranks' save uses its own process group. The Checkpointer's manifest
        then covers every file of the folder, and its rename makes the whole checkpoint appear at once.
        """
        from flash.checkpoint import TRAINER_DIR, write_json

        steps, self._snapshot_steps = self._snapshot_steps, None
        if steps is None:
            raise RuntimeError("checkpoint_write without a checkpoint_snapshot first")
        path = Path(directory) / TRAINER_DIR
        path.mkdir(parents=True, exist_ok=True)
        ray.get([r.checkpoint_write.remote(str(path)) for r in self.ranks])
        write_json(path / META_FILE, {"steps": steps, "workers": self.group.workers})

    def load_checkpoint(self, directory: str, files: dict[str, dict]) -> int:
        """Restore a checkpoint ``checkpoint_write`` wrote, every file checked against ``files``
        (the verified manifest's table); a group of another size reshards it (DCP)."""
        from flash.checkpoint import TRAINER_DIR

        prefix = f"{TRAINER_DIR}/"
        return self.load(str(Path(directory) / TRAINER_DIR),
                         {n[len(prefix):]: v for n, v in files.items() if n.startswith(prefix)})

    def export_hf(self, path: str) -> dict:
        """A Hugging Face folder (safetensors, config, tokenizer) of the current weights."""
        return self._all("export_hf", str(path))[0]

    def stats(self) -> dict:
        """Busy time and steps (as ``TrainerWorker``), plus ``failed`` (1.0 once a rank failed)."""
        out = {"busy_s": self.busy_s, "steps": float(self.steps), "workers": float(len(self.ranks)),
               "failed": float(self.failed is not None)}
        if not self.failed:
            ranks = ray.get([r.stats.remote() for r in self.ranks])
            out["rank_busy_s_max"] = max(r["busy_s"] for r in ranks)
            out["cpu_s"] = sum(r.get("cpu_s", 0.0) for r in ranks)
            out.update(max_peak_memory(ranks))
        return out

    def pids(self) -> list[int]:
        """Each rank's process id (profilers, and the tests' way to kill one)."""
        return ray.get([r.pid.remote() for r in self.ranks])

    def devices(self) -> list[list[int]]:
        """Each rank's logical devices from the placement (empty lists: CPU only)."""
        return ray.get([r.devices.remote() for r in self.ranks])

    # ---- the model-update group's sender (flash.weights.group.UpdateSender's methods) ----
    # Rank 0 is the member: it opens the rendezvous, joins the group and sends. Planning a push first
    # gathers the full state dict (a collective over all ranks, so it takes the group's lock).
    def mu_where(self) -> dict[str, str]:
        return ray.get(self.ranks[0].mu_where.remote())

    def mu_open(self, group: str, backend: str, host: str, timeout_s: float) -> int:
        self._mu_backends[group] = backend
        return ray.get(self.ranks[0].mu_open.remote(group, backend, host, timeout_s))

    def mu_join(self, group: str, world: int, timeout_s: float) -> None:
        ray.get(self.ranks[0].mu_join.remote(group, world, timeout_s))

    def mu_plan(self, group: str, bucket_bytes: int, cast: dict[str, str] | None = None) -> list:
        self._all("mu_gather", cast, gathers_on_device(self._mu_backends.get(group, "")))
        return ray.get(self.ranks[0].mu_plan.remote(group, bucket_bytes, cast))

    def mu_send(self, group: str) -> dict:
        try:
            return ray.get(self.ranks[0].mu_send.remote(group))
        finally:
            self.ranks[0].mu_release.remote()  # the gathered copy is not kept between pushes

    def mu_close(self, group: str) -> None:
        self._mu_backends.pop(group, None)
        ray.get(self.ranks[0].mu_close.remote(group))


def start_trainer_group(model_path: str, settings: TrainerSettings, group: GroupSettings, seed: int,
                        threads: int, plugins: list[str], rank_options: list[dict] | None = None):
    """The group actor (``threads`` torch threads split over its ranks); ``rank_options`` are Ray
    actor options per rank (e.g. a placement group bundle), for device mapping."""
    from flash.cluster import plugin_paths

    actor = ray.remote(TrainerGroup).options(num_cpus=0, max_concurrency=3)  # + a checkpoint write
    return actor.remote(model_path, settings, group, seed, threads, list(plugins), plugin_paths(plugins),
                        rank_options)
