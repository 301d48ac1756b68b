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
from dataclasses import dataclass
from pathlib import Path, PurePosixPath

MAX_MANIFEST_BYTES = 16 << 20
KEY_DIR_ENV = "FLASH_KEY_DIR"
_RUN_ID = re.compile(r"^[0-9a-f]{16}$")


class UntrustedCheckpoint(Exception):
    """A checkpoint that is intact but not signed by a key this machine holds."""


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
    f = path / "manifest.json"
    if f.is_symlink() or not f.is_file():
        raise ValueError("no manifest.json (or it is not a regular file)")
    if f.stat().st_size > MAX_MANIFEST_BYTES:
        raise ValueError(f"manifest.json is over {MAX_MANIFEST_BYTES >> 20} MiB")
    manifest = json.loads(f.read_text())
    files = manifest.get("files") if isinstance(manifest, dict) else None
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
            f"{key_dir()}); if you trust where it came from, resume it with trust_checkpoint=true")
    if not key.signed_by_me(manifest):
        return "its manifest's signature does not match (edited after it was written)"
    return None


def resume_key(manifest: dict | None) -> RunKey:
    """The key new checkpoints of this run are signed with: the resumed run's own, else a new one."""
    return (RunKey.find(manifest.get("run_id")) if manifest else None) or RunKey.new()
