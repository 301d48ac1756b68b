"""One rank of the FSDP2 trainer group (``flash.train.trainer_group``): a Ray actor in the group's
torch.distributed process group holding 1/N of the model and optimizer.

``setup`` joins the process group and shards the model (``flash.train.fsdp.ShardedTrainer``); the
group actor then calls every rank with its share of each call (``logprobs``, ``accumulate``,
``finish_step``, the checkpoint hooks) in one order. Rank 0 is also the model-update group's sender
(``UpdateSender``): every rank takes part in ``mu_gather``, rank 0 keeps the full state dict and
pushes it to the replicas.
"""

from __future__ import annotations

import datetime
import io
import logging
import os
import sys
import time
from pathlib import Path

import ray
import torch

from flash.devices import read_peak_memory
from flash.staging import HostStager
from flash.train.batch import TrainBatch, batch_to
from flash.train.fsdp import COLLECTIVE_TIMEOUT_S, GroupSettings, ShardedTrainer, free_port, pick_device
from flash.train.trainer import TrainerSettings
from flash.usage import process_tree_cpu_s
from flash.weights.gather import FlatGather
from flash.weights.group import UpdateSender
from flash.weights.model_update import ModelUpdateError, connect, open_store, unique_tensors

log = logging.getLogger("flash")


def read_dcp_file(directory: Path, name: str, files: dict[str, dict] | None) -> bytes:
    """A file of a DCP folder: checked against the verified manifest's ``files``, or (None: a
    ``save`` folder, no manifest) as it is."""
    from flash.checkpoint_trust import read_verified

    return (directory / name).read_bytes() if files is None else read_verified(directory, name, files)


class FSDPRank(UpdateSender):
    """One rank: a process-group member holding 1/N of the model and optimizer. Rank 0 is also the
    model-update group's sender, pushing the state dict the ranks gathered (``mu_gather``)."""

    def __init__(
        self,
        rank: int,
        world: int,
        model_path: str,
        settings: TrainerSettings,
        group: GroupSettings,
        seed: int,
        threads: int,
        plugins: list[str],
        paths: list[str],
    ):
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
        store = (
            open_store(addr, COLLECTIVE_TIMEOUT_S, port, self.world)
            if self.rank == 0
            else connect(addr, port, COLLECTIVE_TIMEOUT_S)
        )
        dist.init_process_group(
            self.backend,
            store=store,
            rank=self.rank,
            world_size=self.world,
            timeout=datetime.timedelta(seconds=COLLECTIVE_TIMEOUT_S),
        )
        mesh = init_device_mesh(self.device.type, (self.world,))
        self.ckpt_group = dist.new_group(backend="gloo")  # checkpoint writes beside training (flash.checkpoint)
        model = load_model(self.model_path)
        self._ties = [names for names, _ in unique_tensors(model.state_dict()) if len(names) > 1]
        self.trainer = ShardedTrainer(model, self.settings, mesh, self.device, seed=self.seed)
        self._flat = FlatGather(self.trainer.model)
        if self._flat.reason is not None and self.rank == 0:
            log.warning(
                "weight push gathers per parameter (slower): the flat gather does not cover this model: %s",
                self._flat.reason,
            )
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
        state = (
            self._flat(dst=0, cast=cast, on_device=on_device) if self._flat.reason is None else self.full_state_dict()
        )
        if self.rank == 0:
            for names in self._ties:
                for alias in names[1:]:
                    state[alias] = state[names[0]]
            self._mu_full = state

    def mu_release(self) -> None:
        self._mu_full = None

    def _mu_state(self) -> dict[str, torch.Tensor]:
        if self._mu_full is None:
            raise ModelUpdateError(
                f"trainer rank {self.rank} holds no gathered weights: only rank 0 sends, "
                "after TrainerGroup.mu_plan gathered them"
            )
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
        return self.trainer.planned_accumulate(
            batch_to(batch, self.device), dev(advantages), dev(prox_logp), plan, dev(ref_logp)
        )

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

            set_rng_state(torch.load(io.BytesIO(read_dcp_file(Path(path), rng, files)), weights_only=True))

    def checkpoint_snapshot(self) -> None:
        from flash.checkpoint import rng_state
        from flash.train.fsdp_checkpoint import snapshot_dcp

        self._snapshot = {
            "dcp": snapshot_dcp(self.trainer.model, self.trainer.optimizer, self._stager),
            "rng": rng_state(),
        }

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
        return {
            "busy_s": t.busy_s if t else 0.0,
            "steps": float(t.steps) if t else 0.0,
            "cpu_s": process_tree_cpu_s(),
            **read_peak_memory(self.device if t else None),
        }

    def pid(self) -> int:
        return os.getpid()
