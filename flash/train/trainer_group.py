"""The FSDP2 trainer group: N rank processes behind the same methods as ``TrainerWorker``.

Parts:
- ``FSDPRank`` (one Ray actor per rank, ``flash.train.fsdp_rank``): joins the torch.distributed
  group, loads the model, shards it (``flash.train.fsdp.ShardedTrainer``) and runs its share of each
  call.
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

import json
import threading
import time
from pathlib import Path

import ray
import torch

from flash.algos.metrics import combine, finalize
from flash.devices import max_peak_memory
from flash.errors import FlashError
from flash.train.batch import TrainBatch
from flash.train.fsdp import GroupSettings
from flash.train.fsdp_rank import FSDPRank, read_dcp_file
from flash.train.microbatch import MicroPlan, plan_batch
from flash.train.trainer import TrainerSettings
from flash.train.updates import train_batch
from flash.weights.group import gathers_on_device

META_FILE = "flash_trainer.json"  # beside the DCP shards: steps and the world size that wrote them


class TrainerGroupError(RuntimeError):
    """A rank failed: its peers may be stuck in a collective, so the group takes no more calls."""


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
    return {
        "micro_batches": float(plan.count),
        "pad_micro_batches": float(plan.pad_micro_batches),
        "over_budget_rows": float(plan.over_budget),
    }


class TrainerGroup:
    """The controller's trainer handle when ``train.workers`` > 1 (or FSDP knobs are set)."""

    def __init__(
        self,
        model_path: str,
        settings: TrainerSettings,
        group: GroupSettings,
        seed: int,
        threads: int,
        plugins: list[str],
        paths: list[str] = (),
        rank_options: list[dict] | None = None,
    ):
        n = group.workers
        opts = rank_options or [{} for _ in range(n)]
        if len(opts) != n:
            raise ValueError(f"rank_options has {len(opts)} entries for {n} workers")
        cls = ray.remote(FSDPRank)
        per_rank = max(1, threads // n)
        # max_concurrency 3: a checkpoint write runs beside a step's call (and a stats call)
        self.ranks = [
            cls.options(**{"num_cpus": 0, "max_concurrency": 3, **o}).remote(
                r, n, model_path, settings, group, seed, per_rank, list(plugins), list(paths)
            )
            for r, o in enumerate(opts)
        ]
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
            raise TrainerGroupError(
                f"trainer group is broken ({self.failed}); start a new one and load the last checkpoint"
            )
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

    def train_step(
        self,
        batch: TrainBatch,
        advantages: torch.Tensor,
        prox_logp: torch.Tensor | None,
        ref_logp: torch.Tensor | None = None,
    ) -> dict:
        """The batch's optimizer steps, each sharded over the ranks (``Trainer.train_step``)."""
        return train_batch(self, batch, advantages, prox_logp, self.settings, self.steps, ref_logp)

    # ---- one step in parts, as ``Trainer`` (the stream trainer feeds groups as they finish) ----
    def begin_step(self) -> None:
        self._all("begin_step")
        self._open = {"weight": 0.0, "micro_batches": 0.0, "pad_micro_batches": 0.0, "over_budget_rows": 0.0}

    def accumulate(
        self,
        batch: TrainBatch,
        advantages: torch.Tensor,
        prox_logp: torch.Tensor | None,
        ref_logp: torch.Tensor | None = None,
    ) -> float:
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
        steps = int(json.loads(read_dcp_file(Path(path), META_FILE, files))["steps"])
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
        return self.load(
            str(Path(directory) / TRAINER_DIR), {n[len(prefix) :]: v for n, v in files.items() if n.startswith(prefix)}
        )

    def export_hf(self, path: str) -> dict:
        """A Hugging Face folder (safetensors, config, tokenizer) of the current weights."""
        return self._all("export_hf", str(path))[0]

    def stats(self) -> dict:
        """Busy time and steps (as ``TrainerWorker``), plus ``failed`` (1.0 once a rank failed)."""
        out = {
            "busy_s": self.busy_s,
            "steps": float(self.steps),
            "workers": float(len(self.ranks)),
            "failed": float(self.failed is not None),
        }
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


def start_trainer_group(
    model_path: str,
    settings: TrainerSettings,
    group: GroupSettings,
    seed: int,
    threads: int,
    plugins: list[str],
    rank_options: list[dict] | None = None,
):
    """The group actor (``threads`` torch threads split over its ranks); ``rank_options`` are Ray
    actor options per rank (e.g. a placement group bundle), for device mapping."""
    from flash.cluster import plugin_paths

    actor = ray.remote(TrainerGroup).options(num_cpus=0, max_concurrency=3)  # + a checkpoint write
    return actor.remote(model_path, settings, group, seed, threads, list(plugins), plugin_paths(plugins), rank_options)
