"""Checkpoints: everything a run needs to continue with no prompt lost or repeated (invariant 5).

A checkpoint after ``step`` completed train steps is a directory ``RUN_DIR/checkpoints/ckpt-<step>``:

- ``trainer.pt``: model and optimizer state dicts, the trainer's torch RNG state and step count
  (written by the trainer actor itself); with an FSDP2 trainer group instead ``trainer/``, a torch
  distributed checkpoint (every rank writes its own shards of model and optimizer, plus its RNG)
  with the step count and world size (``flash.train.trainer_group``); a group of another size reshards
  it on load;
- ``state.json``: the controller's step and policy version, the scheduler's data position, admission
  count, counters and RNG, **the buffer's groups** (complete, scored samples; with ``buffer.transport=zmq`` the
  service's store, which lives in the driver) and **the prompts in flight** (restarted from scratch
  on resume: their partial responses are dropped, their prompts are not; an environment episode
  in flight plays again from the same env seed), the guards' counters, and the byte length of each
  run log (ledger, metrics, timeline, eval)
  at this step, so a resume cuts the logs back to exactly this point and they continue from it;
- ``manifest.json``: size and sha256 of every file, the step and the run dir's inode, written
  last, signed with the run's key (``flash.checkpoint_trust``: a checkpoint not signed by a key this
  machine holds, or signed for another run or run dir, is refused unless ``trust_checkpoint=true``;
  one whose signed step is not its directory's, or a directory that is a symlink, is refused; the
  manifest lists exactly the checkpoint's files, links refused). Loaders are given the verified
  manifest's file table and hash the bytes they parse (``read_verified``).

Atomic: everything goes into ``ckpt-<step>.tmp/``, each file fsynced, then the manifest, then one
``rename`` (and an fsync of the parent dir). A crash at any moment leaves either the complete new
checkpoint or none; a checkpoint damaged later (truncated, edited) fails its manifest check and
``latest_valid`` falls back to the previous one. ``prune`` deletes only checkpoints this run signed
for their own step and run dir; any other is left where it is.

Cost in the step: only the snapshot (the trainer copies its state to host memory, pinned buffers
reused from one checkpoint to the next on a GPU: ``flash.staging``; the driver copies the buffer and
the scheduler state). Hashing and disk writes run in a background thread (``checkpoint.async_write``)
while training goes on; the next checkpoint waits for the previous write.
"""

from __future__ import annotations

import hashlib
import io
import json
import logging
import os
import shutil
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import ray
import torch

from flash.buffers.codec import group_to_dict
from flash.checkpoint_trust import (
    INODE,
    RefusedCheckpoint,
    RunDir,
    RunKey,
    check_place,
    check_signature,
    inode,
    listed_files_only,
    read_manifest,
    read_verified,
)
from flash.errors import ConfigError
from flash.run_files import open_run_file, run_subdir
from flash.staging import HostStager

log = logging.getLogger("flash")

PREFIX = "ckpt-"
MANIFEST = "manifest.json"
STATE = "state.json"
TRAINER = "trainer.pt"
TRAINER_DIR = "trainer"  # an FSDP2 group's DCP folder (flash.train.trainer_group) instead of trainer.pt
# Test hook: seconds to sleep inside a checkpoint write, after the trainer's file and before the
# manifest, so a test can SIGKILL the run mid-checkpoint.
PAUSE_ENV = "FLASH_CKPT_PAUSE_S"


# ---- files -----------------------------------------------------------------------------------
def fsync_path(path: Path) -> None:
    """Flush a file's (or a directory's entries') data to disk."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def write_json(path: Path, obj: Any) -> None:
    with open_run_file(path, "w") as f:
        json.dump(obj, f)
        f.flush()
        os.fsync(f.fileno())


def file_table(directory: Path) -> dict[str, dict]:
    """Size and sha256 of every file under ``directory`` but the manifest, by relative name."""
    return {
        p.relative_to(directory).as_posix(): {"bytes": p.stat().st_size, "sha256": sha256_file(p)}
        for p in sorted(directory.rglob("*"))
        if p.is_file() and p.name != MANIFEST
    }


def write_manifest(tmp: Path, step: int, key: RunKey, run_dir_inode: int | None = None) -> dict:
    """``file_table(tmp)``, the step and the run dir's inode (default: ``tmp``'s grandparent,
    ``RUN_DIR/checkpoints/ckpt-<step>.tmp``), signed with ``key``; written (and fsynced) last."""
    files = file_table(tmp)
    manifest = key.sign(
        {
            "step": step,
            "files": files,
            "bytes": sum(f["bytes"] for f in files.values()),
            INODE: inode(tmp.parent.parent) if run_dir_inode is None else run_dir_inode,
        }
    )
    write_json(tmp / MANIFEST, manifest)
    return manifest


def verify(path: Path, trust: bool = False, run: RunDir | None = None) -> str | None:
    """None when the checkpoint at ``path`` is exactly what its signed manifest lists, else what is
    wrong with it (``checked``)."""
    return checked(path, trust, run)[1]


def checked(path: Path, trust: bool = False, run: RunDir | None = None) -> tuple[dict | None, str | None]:
    """(the verified manifest, None), or (None, what is wrong: damage). Names and links are checked
    before any listed file is opened, so nothing outside the checkpoint is read. Raises
    ``RefusedCheckpoint`` for an intact one that must not load here (``check_place``; ``run``: the
    run dir's record, default read from ``path``'s grandparent) or whose directory is a symlink, and
    ``UntrustedCheckpoint`` for one signed by no key held here, unless ``trust``."""
    if path.is_symlink():
        raise RefusedCheckpoint(
            "it is a symlink, not a directory of its own; move the directory it "
            "links to here in its place, or remove the link"
        )
    try:
        manifest = read_manifest(path)
    except (OSError, ValueError) as exc:
        return None, f"no readable manifest ({exc})"
    files = manifest["files"]
    why = listed_files_only(path, set(files))
    for name, want in files.items() if why is None else ():
        f = path / name
        if f.stat().st_size != want["bytes"]:
            return None, f"{name} has {f.stat().st_size} bytes, the manifest says {want['bytes']}"
        if sha256_file(f) != want["sha256"]:
            return None, f"{name} does not match its sha256"
    why = why or check_signature(manifest, trust)
    if why is not None:
        return None, why
    check_place(manifest, step_of(path), run or RunDir.read(path.parent.parent), trust)
    return manifest, None


def step_of(path: Path) -> int | None:
    name = path.name
    if not name.startswith(PREFIX) or name.endswith(".tmp"):
        return None
    try:
        return int(name[len(PREFIX) :])
    except ValueError:
        return None


def complete_checkpoints(root: Path) -> list[Path]:
    """Renamed (never ``.tmp``) checkpoint dirs, newest first."""
    if not root.is_dir():
        return []
    found = [(step_of(p), p) for p in root.iterdir() if p.is_dir() or p.is_symlink()]
    return [p for s, p in sorted((x for x in found if x[0] is not None), reverse=True)]


def latest_valid(
    root: Path, warn: Callable[[str], None] = log.warning, trust: bool = False
) -> tuple[Path | None, list[str]]:
    """``latest_verified`` without the manifest."""
    path, _, skipped = latest_verified(root, warn, trust)
    return path, skipped


def latest_verified(
    root: Path, warn: Callable[[str], None] = log.warning, trust: bool = False, run: RunDir | None = None
) -> tuple[Path | None, dict | None, list[str]]:
    """The newest checkpoint that passes ``checked``, with its verified manifest; each one skipped
    (damaged) is reported and returned. An intact checkpoint that may not load here (from
    elsewhere, renamed, a symlink) stops the search with a ConfigError naming it and the fix
    (falling back past it would silently restart the run from an older point, or from scratch)."""
    skipped = []
    for path in complete_checkpoints(root):
        try:
            manifest, why = checked(path, trust, run)
        except RefusedCheckpoint as exc:
            raise ConfigError(f"checkpoint {path} is refused: {exc}") from None
        if why is None:
            return path, manifest, skipped
        skipped.append(f"{path.name}: {why}")
        warn(f"flash: checkpoint {path} is damaged ({why}); falling back to the previous one")
    return None, None, skipped


def own_checkpoints(root: Path, key: RunKey) -> list[Path]:
    """The complete checkpoints ``key`` signed for their own step and this run dir, newest first
    (read from their manifests; no file is hashed). A renamed, linked, foreign or unreadable one is
    not among them."""
    here = inode(root.parent)
    own = []
    for path in complete_checkpoints(root):
        try:
            manifest = read_manifest(path) if not path.is_symlink() else None
        except (OSError, ValueError):
            continue
        if (
            manifest
            and manifest.get("step") == step_of(path)
            and manifest.get(INODE, here) == here
            and key.signed_by_me(manifest)
        ):
            own.append(path)
    return own


def prune(root: Path, keep_last: int, key: RunKey) -> list[Path]:
    """Delete this run's checkpoints beyond its newest ``keep_last`` (``own_checkpoints``: one that
    fails that check is never deleted, nor counted), and leftover ``.tmp`` dirs."""
    gone = own_checkpoints(root, key)[keep_last:]
    for path in gone:
        shutil.rmtree(path, ignore_errors=True)
    return gone + remove_partial(root)


def remove_partial(root: Path) -> list[Path]:
    """Delete ``.tmp`` dirs: writes that never reached their rename (a kill mid-checkpoint)."""
    gone = [p for p in root.glob(f"{PREFIX}*.tmp") if p.is_dir()] if root.is_dir() else []
    for path in gone:
        shutil.rmtree(path, ignore_errors=True)
    return gone


def commit(tmp: Path, final: Path) -> None:
    """The atomic step: one rename, then the parent dir's entry made durable."""
    if final.exists():  # a damaged one of the same step (the resume fell back past it): set aside,
        trash = final.with_name(final.name + ".replaced.tmp")  # pruned later, never read
        shutil.rmtree(trash, ignore_errors=True)
        os.rename(final, trash)
    os.rename(tmp, final)
    fsync_path(final.parent)


# ---- trainer state (called inside the trainer actor) -------------------------------------------
def trainer_state(trainer, stager: HostStager | None = None) -> dict:
    """A copy of everything the trainer needs to continue bit-for-bit (taken between steps), in
    host memory (``stager``: the trainer's own, whose buffers the next snapshot reuses)."""
    state = (stager or HostStager()).stage(
        {"model": dict(trainer.model.state_dict()), "optimizer": trainer.optimizer.state_dict()}
    )
    return {
        **state,
        "rng": rng_state(),
        "steps": trainer.steps,
        "optimizer_steps": trainer.optimizer_steps,  # the lr schedule's position
    }


def rng_state() -> dict:
    """The CPU generator and, where there are GPUs, each device's: dropout or sampling on a GPU
    draws from the latter, so a resume that restored only the CPU's would not continue bit-for-bit."""
    return {
        "cpu": torch.get_rng_state(),
        "cuda": list(torch.cuda.get_rng_state_all()) if torch.cuda.is_available() else [],
    }


def set_rng_state(state: Any) -> None:
    """Restore what ``rng_state`` took (a bare tensor: a checkpoint that kept the CPU generator
    alone). GPU generators are restored when this process sees as many devices as were saved."""
    if isinstance(state, torch.Tensor):
        torch.set_rng_state(state)
        return
    torch.set_rng_state(state["cpu"])
    cuda = state.get("cuda") or []
    if cuda and torch.cuda.is_available() and torch.cuda.device_count() == len(cuda):
        torch.cuda.set_rng_state_all(cuda)


def write_snapshot(snapshot: Any, directory: str) -> None:
    """A trainer's ``checkpoint_write``: the state its ``checkpoint_snapshot`` took, saved."""
    if snapshot is None:
        raise RuntimeError("checkpoint_write without a checkpoint_snapshot first")
    save_trainer_state(snapshot, directory)


def save_trainer_state(state: Any, directory: str, name: str = TRAINER) -> None:
    path = Path(directory) / name
    with open_run_file(path, "wb") as f:
        torch.save(state, f)
        f.flush()
        os.fsync(f.fileno())


def check_trainer_files(ckpt: Path, group: bool) -> None:
    """The checkpoint holds what this run's trainer reads: ``trainer.pt`` (one trainer process) or
    ``trainer/`` (an FSDP2 group, any size). A mismatch names the setting to resume with."""
    has_dir, has_file = (ckpt / TRAINER_DIR).is_dir(), (ckpt / TRAINER).is_file()
    if group and not has_dir and has_file:
        raise ConfigError(
            f"{ckpt} was written by a single trainer process (trainer.pt); an FSDP2 group "
            f"cannot load it: resume with train.workers=1 and no group knobs"
        )
    if not group and not has_file and has_dir:
        raise ConfigError(
            f"{ckpt} was written by an FSDP2 trainer group (trainer/, a torch distributed "
            f"checkpoint); resume with an FSDP2 group: train.workers > 1, any number (it reshards)"
        )


def load_trainer_state(trainer, directory: str, files: dict[str, dict]) -> int:
    """Restore model, optimizer, RNG and step count from ``trainer.pt`` as the verified manifest's
    ``files`` lists it (``read_verified``: the bytes hashed are the bytes loaded); returns the step count."""
    data = read_verified(Path(directory), TRAINER, files)
    state = torch.load(io.BytesIO(data), map_location="cpu", weights_only=True)
    del data
    trainer.model.load_state_dict(state["model"])
    trainer.optimizer.load_state_dict(state["optimizer"])
    set_rng_state(state["rng"])
    trainer.steps = int(state["steps"])
    # a checkpoint from before mini-batches took one optimizer step per batch
    trainer.optimizer_steps = int(state.get("optimizer_steps", trainer.steps))
    return trainer.steps


# ---- driver state ----------------------------------------------------------------------------
def snapshot_rollout(buffer, scheduler) -> dict:
    """The buffer's groups and the scheduler's state as one consistent view.

    Both are read under the buffer's lock (the scheduler's own lock nests inside it, the order
    ``get_batch`` already uses). A group that was just put but not yet removed from the
    scheduler's pending set counts as buffered only. The groups are written as ``flash.buffers.codec``'s
    dicts (read back by ``group_from_dict``): with ``buffer.transport=zmq`` the buffer's groups are
    the service's, and the NumPy arrays a producer put are written as lists of the same values.
    """
    groups, sched = buffer.snapshot(also=scheduler.state_dict)
    buffered = {g.prompt_id for g in groups}
    sched["pending"] = [p for p in sched["pending"] if p["prompt_id"] not in buffered]
    return {"buffer": [group_to_dict(g) for g in groups], "scheduler": sched}


def log_offsets(files: dict[str, Any]) -> dict[str, int]:
    """Byte length of each open run log (flushed first): where a resume cuts it back to."""
    out = {}
    for name, f in files.items():
        f.flush()
        out[name] = f.tell()
    return out


class Checkpointer:
    """Takes snapshots in the step and writes them atomically, in the background when asked."""

    def __init__(
        self,
        run_dir: Path,
        cfg,
        trainer,
        total_steps: int,
        key: RunKey,
        on_written: Callable[[dict], None] | None = None,
    ):
        self.root = run_subdir(run_dir, "checkpoints")
        self.run_dir_inode = inode(Path(run_dir))
        self.cfg, self.trainer, self.total_steps, self.key = cfg, trainer, total_steps, key
        self.on_written = on_written
        self.pause_s = float(os.environ.get(PAUSE_ENV, "0") or 0)
        self._pending: tuple[int, dict] | None = None
        self._thread: threading.Thread | None = None
        self._error: BaseException | None = None
        self.last: dict[str, float] = {}  # the newest finished write: step, bytes, seconds
        self.snapshot_s = 0.0

    def due(self, step: int) -> bool:
        every = self.cfg.every_steps
        return self.cfg.enabled and (step == self.total_steps or bool(every and step % every == 0))

    def snapshot(self, step: int, state: dict) -> None:
        """In the step, between weight push and new admissions: the trainer clones its state."""
        start = time.monotonic()
        self.wait()  # one write at a time; the trainer holds one snapshot
        ray.get(self.trainer.checkpoint_snapshot.remote())
        self.snapshot_s = time.monotonic() - start
        self._pending = (step, {**state, "snapshot_s": self.snapshot_s})

    def commit(self, offsets: dict[str, int]) -> None:
        """After the step's logs are written: record where they end, write (maybe in background)."""
        if self._pending is None:
            return
        step, state = self._pending
        self._pending = None
        state = {**state, "step": step, "logs": offsets}
        if self.cfg.async_write:
            self._thread = threading.Thread(
                target=self._write_guarded, args=(step, state), name="flash-checkpoint", daemon=True
            )
            self._thread.start()
        else:
            self._write(step, state)

    def wait(self) -> None:
        """Block until the write in progress is on disk; re-raise its error."""
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        if self._error is not None:
            err, self._error = self._error, None
            raise RuntimeError(f"checkpoint write failed: {err!r}") from err

    def _write_guarded(self, step: int, state: dict) -> None:
        try:
            self._write(step, state)
        except BaseException as exc:  # noqa: BLE001 - re-raised by wait()
            self._error = exc

    def _write(self, step: int, state: dict) -> None:
        start = time.monotonic()
        tmp = self.root / f"{PREFIX}{step}.tmp"
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
        ray.get(self.trainer.checkpoint_write.remote(str(tmp)))
        write_json(tmp / STATE, state)
        if self.pause_s:
            time.sleep(self.pause_s)
        manifest = write_manifest(tmp, step, self.key, self.run_dir_inode)
        for d in [*(p for p in tmp.rglob("*") if p.is_dir()), tmp]:  # every dir's entries (trainer/ too)
            fsync_path(d)
        commit(tmp, self.root / f"{PREFIX}{step}")
        prune(self.root, self.cfg.keep_last, self.key)
        self.last = {
            "step": float(step),
            "bytes": float(manifest["bytes"]),
            "write_s": time.monotonic() - start,
            "snapshot_s": state["snapshot_s"],
        }
        if self.on_written:
            self.on_written(self.last)

    def metrics(self) -> dict[str, float]:
        m = {"checkpoint/snapshot_s": self.snapshot_s} if self.snapshot_s else {}
        self.snapshot_s = 0.0  # reported in the step that took it only
        if self.last:
            m.update(
                {
                    "checkpoint/bytes": self.last["bytes"],
                    "checkpoint/write_s": self.last["write_s"],
                    "checkpoint/step": self.last["step"],
                }
            )
        return m
