"""What makes a checkpoint safe to load: its manifest covers exactly its files, and a key this
machine holds signed that manifest.

A checkpoint is data from disk, and disk is shared (a copied run dir, a download, a colleague's
scratch space), so before anything in it is parsed beyond JSON:

- **The manifest covers the checkpoint, nothing else.** Its file names must be plain relative
  paths; the directory is walked without following links, and the set of regular files found
  must equal the set listed (a file added beside the listed ones, a symlink anywhere, a FIFO or
  device node, ``..`` or an absolute name: refused before any size or hash is compared, so the
  check never reads outside the checkpoint).
- **Signed per run.** Each run makes a random key (``secrets``) kept outside the run dir, in the
  user's key store (``$FLASH_KEY_DIR``, else ``$XDG_STATE_HOME/flash/keys`` or
  ``~/.local/state/flash/keys``; mode 0700, each key 0600), and the manifest carries the run's id
  and an HMAC-SHA256 of its canonical JSON under that key. A copied run dir carries no key, so a
  checkpoint from elsewhere is refused unless the user says ``trust_checkpoint=true``; one whose
  signature does not match the key we hold was edited after it was written.
- **Bound to its place.** The signed manifest names its step and the run dir it was written in
  (the dir's inode; the run's id is recorded in ``RUN_DIR/run.json`` at creation, signed with the
  run's key for that inode). A checkpoint whose signed step is not its directory's (an older one
  renamed to a higher step), or signed for another run or run dir (a transplant, a copied run dir)
  is refused by name (``RefusedCheckpoint``: the search stops, never falls back past it); the
  latter is allowed with ``trust_checkpoint=true``. A checkpoint directory that is a symlink is
  refused. A manifest written before run binding (no ``run_dir_inode``) is bound by its run id
  only: it loads in its own run (the run id ``run.json`` records, or any, in a run dir made before
  ``run.json`` existed), and a resume records that run's ``run.json``.
- **Load what was verified.** Every loader (the driver's ``state.json``, the trainer's
  ``trainer.pt``, each FSDP2 rank's DCP files and RNG) is given the verified manifest's file table
  and reads each file once into memory (``read_verified``: one descriptor, no link, a regular file,
  at most the listed size), hashes those bytes and parses them; a file replaced after the driver's
  check is refused by name (``CheckpointChanged``).

The loaders then read only safe formats: JSON, ``torch.load(weights_only=True)``, and DCP metadata
through an allow-list unpickler (``flash.train.fsdp_checkpoint``).
"""

from __future__ import annotations

import hashlib
import hmac
import json
import os
import re
import secrets
import stat
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path, PurePosixPath

from flash.errors import FlashError
from flash.run_files import open_run_file, parse_json

MAX_MANIFEST_BYTES = 16 << 20
KEY_DIR_ENV = "FLASH_KEY_DIR"
RUN_FILE = "run.json"  # RUN_DIR/run.json: the run's id and its dir's inode, signed
INODE = "run_dir_inode"  # the manifest's field naming the run dir it was written in
_RUN_ID = re.compile(r"^[0-9a-f]{16}$")


class RefusedCheckpoint(Exception):
    """A checkpoint that is intact but must not be loaded where it lies: the search for a checkpoint
    stops here (falling back past it would silently restart the run from an older point)."""


class UntrustedCheckpoint(RefusedCheckpoint):
    """Intact, but not signed by a key this machine holds, or signed for another run or run dir:
    ``trust_checkpoint=true`` accepts it."""


class CheckpointChanged(FlashError):
    """A checkpoint file whose bytes, read by its loader, are not the ones the manifest lists."""


def key_dir() -> Path:
    if os.environ.get(KEY_DIR_ENV):
        return Path(os.environ[KEY_DIR_ENV])
    state = os.environ.get("XDG_STATE_HOME") or str(Path.home() / ".local" / "state")
    return Path(state) / "flash" / "keys"


@dataclass(frozen=True)
class RunKey:
    """The run's id (written in each manifest) and its secret (never written into the run dir)."""

    run_id: str
    secret: bytes

    @classmethod
    def new(cls) -> RunKey:
        """A fresh key, stored before first use so a crash cannot leave a signed but unverifiable checkpoint."""
        root = key_dir()
        root.mkdir(parents=True, exist_ok=True, mode=0o700)
        while True:
            run_id, secret = secrets.token_hex(8), secrets.token_bytes(32)
            try:
                fd = os.open(root / f"{run_id}.key", os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
            except FileExistsError:
                continue
            with os.fdopen(fd, "wb") as f:
                f.write(secret)
                f.flush()
                os.fsync(f.fileno())
            return cls(run_id, secret)

    @classmethod
    def find(cls, run_id: object) -> RunKey | None:
        """The stored key of ``run_id``, or None (unknown here, or not a run id at all)."""
        if not isinstance(run_id, str) or not _RUN_ID.match(run_id):
            return None
        try:
            secret = (key_dir() / f"{run_id}.key").read_bytes()
        except OSError:
            return None
        return cls(run_id, secret) if len(secret) == 32 else None

    def sign(self, manifest: dict) -> dict:
        body = {k: v for k, v in manifest.items() if k != "hmac"}
        return {**body, "run_id": self.run_id, "hmac": self._mac({**body, "run_id": self.run_id})}

    def signed_by_me(self, manifest: dict) -> bool:
        mac = manifest.get("hmac")
        body = {k: v for k, v in manifest.items() if k != "hmac"}
        return isinstance(mac, str) and hmac.compare_digest(mac, self._mac(body))

    def _mac(self, body: dict) -> str:
        canon = json.dumps(body, sort_keys=True, separators=(",", ":")).encode()
        return hmac.new(self.secret, canon, hashlib.sha256).hexdigest()


def read_manifest(path: Path) -> dict:
    """The manifest as a dict of the expected shape; ValueError says what is wrong."""
    try:
        data = read_regular(path / "manifest.json", MAX_MANIFEST_BYTES)
    except (OSError, ValueError):
        raise ValueError("no manifest.json (or it is not a regular file)") from None
    if len(data) > MAX_MANIFEST_BYTES:
        raise ValueError(f"manifest.json is over {MAX_MANIFEST_BYTES >> 20} MiB")
    manifest = parse_json(data, "manifest.json")  # its nesting checked before it is parsed
    files = manifest.get("files")
    if not isinstance(files, dict):
        raise ValueError("manifest.json has no 'files' table")
    for name, want in files.items():
        if not _plain_relative(name):
            raise ValueError(f"manifest names {name!r}, which is not a plain path inside the checkpoint")
        if not (isinstance(want, dict) and isinstance(want.get("bytes"), int) and isinstance(want.get("sha256"), str)):
            raise ValueError(f"manifest entry for {name!r} lacks bytes/sha256")
    return manifest


def _plain_relative(name: object) -> bool:
    if not isinstance(name, str) or not name or "\\" in name or "\x00" in name:
        return False
    p = PurePosixPath(name)
    return not p.is_absolute() and all(part not in ("", ".", "..") for part in name.split("/"))


def listed_files_only(path: Path, listed: set[str]) -> str | None:
    """None when the regular files under ``path`` (links never followed) are exactly ``listed``
    plus the manifest; else the first difference. Anything but a regular file or directory is refused."""
    found = set()
    for root, dirs, files in os.walk(path, followlinks=False):
        for name in dirs + files:
            full = Path(root) / name
            mode = os.lstat(full).st_mode
            rel = full.relative_to(path).as_posix()
            if stat.S_ISLNK(mode):
                return f"{rel} is a symlink (a checkpoint holds only regular files)"
            if stat.S_ISREG(mode):
                found.add(rel)
            elif not stat.S_ISDIR(mode):
                return f"{rel} is not a regular file"
    found.discard("manifest.json")
    if found - listed:
        return f"{min(found - listed)} is not in the manifest"
    if listed - found:
        return f"{min(listed - found)} is missing"
    return None


def check_signature(manifest: dict, trust: bool) -> str | None:
    """None when a key held here signed ``manifest`` (or ``trust``); a reason when the signature
    is wrong. An unknown signer raises ``UntrustedCheckpoint`` (not damage: nothing to fall back on)."""
    key = RunKey.find(manifest.get("run_id"))
    if key is None:
        if trust:
            return None
        raise UntrustedCheckpoint(
            "it was not written by a run of this user on this machine (no key for its run id in "
            f"{key_dir()}); if you trust where it came from, resume it with trust_checkpoint=true"
        )
    if not key.signed_by_me(manifest):
        return "its manifest's signature does not match (edited after it was written)"
    return None


def inode(path: Path) -> int:
    """A directory's identity: its inode (kept by a move within its file system, not by a copy;
    the device number is left out, it changes across remounts and containers)."""
    return os.stat(path).st_ino


@dataclass(frozen=True)
class RunDir:
    """What ``RUN_DIR/run.json`` says about a run dir, checked here: ``run_id`` (None: no
    ``run.json``, a run dir made before run binding), the dir's inode now, the run's key when its
    record checks out, else ``why`` it does not (another machine's or user's run, an edited record,
    a copied run dir)."""

    run_id: str | None
    dir_inode: int
    key: RunKey | None
    why: str | None

    @classmethod
    def read(cls, run_dir: Path) -> RunDir:
        now, f = inode(run_dir), run_dir / RUN_FILE
        if not os.path.lexists(f):
            return cls(None, now, None, None)
        try:
            record = parse_json(read_regular(f, MAX_MANIFEST_BYTES), RUN_FILE)
        except (OSError, ValueError) as exc:
            return cls(None, now, None, f"its {RUN_FILE} is unreadable ({exc})")
        run_id = record.get("run_id") if isinstance(record, dict) else None
        key = RunKey.find(run_id)
        if key is None:
            return cls(
                str(run_id),
                now,
                None,
                f"it was made by a run of another user or machine (no key for run {str(run_id)[:40]!r} in {key_dir()})",
            )
        if not key.signed_by_me(record):
            return cls(run_id, now, None, f"its {RUN_FILE} was edited after it was written")
        if record.get(INODE) != now:
            return cls(run_id, now, None, f"it is a copy of run {run_id}'s dir (not the directory it was made in)")
        return cls(run_id, now, key, None)

    @classmethod
    def write(cls, run_dir: Path, key: RunKey) -> RunDir:
        """Record ``key``'s run as this run dir's (written to a temporary name, then renamed)."""
        now = inode(run_dir)
        tmp = run_dir / f"{RUN_FILE}.tmp"
        tmp.unlink(missing_ok=True)
        with open_run_file(tmp, "w") as f:
            json.dump(key.sign({INODE: now}), f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, run_dir / RUN_FILE)
        return cls(key.run_id, now, key, None)


def check_place(manifest: dict, step: int, run: RunDir, trust: bool) -> None:
    """Raise ``RefusedCheckpoint`` when an authentic manifest does not belong where it lies: signed
    for a step other than its directory's (always), or (unless ``trust``) for another run or run dir."""
    signed = manifest.get("step")
    if signed != step:
        raise RefusedCheckpoint(
            f"its manifest was signed for step {signed!r}, not {step} (renamed); rename it back to "
            f"ckpt-{signed} or move it out of the checkpoints folder"
        )
    if trust:
        return
    foreign = None
    if run.why is not None:
        foreign = f"this run dir is not the one its run was made in: {run.why}"
    elif manifest.get(INODE, run.dir_inode) != run.dir_inode:
        foreign = "it was written in another run dir (moved or copied here)"
    elif run.run_id is not None and manifest.get("run_id") != run.run_id:
        foreign = f"it was written by run {manifest.get('run_id')}, and this run dir is run {run.run_id}'s"
    if foreign:
        raise UntrustedCheckpoint(f"{foreign}; if you trust where it came from, resume it with trust_checkpoint=true")


def bind_run(run_dir: Path, resumed: dict | None) -> RunKey:
    """The key this run signs its checkpoints with, recorded in ``run.json``: the run dir's own
    when its record checks out here; else, in a run dir made before run binding, the resumed
    checkpoint's run's; else a new one (a fresh run, or a checkpoint trusted from elsewhere)."""
    run = RunDir.read(run_dir)
    if run.key is not None:
        return run.key
    own = resumed is not None and run.why is None and resumed.get(INODE, run.dir_inode) == run.dir_inode
    key = (RunKey.find(resumed.get("run_id")) if own else None) or RunKey.new()
    RunDir.write(run_dir, key)
    return key


def read_regular(path: Path, limit: int) -> bytes:
    """The bytes of a regular file read through one descriptor (no symlink followed at the last
    component, never a FIFO or device), at most ``limit`` + 1 of them."""
    fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0))
    with os.fdopen(fd, "rb") as f:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise ValueError(f"{path.name} is not a regular file")
        return f.read(limit + 1)


def read_verified(directory: Path, name: str, files: Mapping[str, dict]) -> bytes:
    """``directory/name`` read once into memory, when those bytes are the ones the verified
    manifest's ``files`` lists (size and sha256); else ``CheckpointChanged`` naming the file."""
    want = files.get(name)
    if want is None:
        raise CheckpointChanged(
            f"checkpoint {directory}: {name} is not in its verified manifest; "
            "resume again (a changed checkpoint is refused or falls back)"
        )
    try:
        data = read_regular(Path(directory) / name, int(want["bytes"]))
    except (OSError, ValueError) as exc:
        raise CheckpointChanged(
            f"checkpoint {directory}: {name} cannot be read as it was verified ({exc}); "
            "resume again (a changed checkpoint is refused or falls back)"
        ) from None
    if len(data) != want["bytes"] or hashlib.sha256(data).hexdigest() != want["sha256"]:
        raise CheckpointChanged(
            f"checkpoint {directory}: {name} changed after it was verified (its bytes are not "
            "the manifest's); resume again (a changed checkpoint is refused or falls back)"
        )
    return data
