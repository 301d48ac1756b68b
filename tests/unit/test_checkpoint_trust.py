"""A checkpoint is data: crafted ones are refused before anything in them is parsed or run.

Each test builds the attack a hostile checkpoint would carry (a manifest that lists nothing or
points outside, a symlink, a copied run dir, an edited manifest, a pickle that runs code in
``trainer.pt`` or in DCP's ``.metadata``) and pins the outcome: the reason named, and the payload's
marker file never written.
"""

import json
import os
import pickle

import pytest
import torch
from torch.distributed.checkpoint.api import CheckpointException

from flash import checkpoint as ck
from flash.app.runner import _find_checkpoint
from flash.checkpoint_trust import KEY_DIR_ENV, RunKey
from flash.errors import ConfigError
from flash.train.fsdp_checkpoint import load_dcp


class Payload:
    """Unpickled, it would create ``path``: the marker that code from a checkpoint ran."""

    def __init__(self, path):
        self.path = str(path)

    def __reduce__(self):
        return (open, (self.path, "w"))


def checkpoint(root, step, key, files=None):
    """A complete, signed checkpoint holding ``files`` (name -> bytes)."""
    tmp = root / f"ckpt-{step}.tmp"
    tmp.mkdir(parents=True)
    for name, data in (files or {"trainer.pt": b"x" * 100}).items():
        (tmp / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp / name).write_bytes(data)
    ck.write_json(
        tmp / "state.json",
        {
            "step": step,
            "version": step,
            "logs": {},
            "buffer": [],
            "scheduler": {},
            "skips": {},
            "data_skipped": {},
            "faults": {},
        },
    )
    ck.write_manifest(tmp, step, key)
    ck.commit(tmp, root / f"ckpt-{step}")
    return root / f"ckpt-{step}"


def resign(path, key, **changes):
    """Rewrite the manifest with ``changes`` and sign it with ``key`` (an attacker holding it)."""
    manifest = json.loads((path / "manifest.json").read_text())
    manifest.update(changes)
    (path / "manifest.json").write_text(json.dumps(key.sign(manifest)))


def test_a_manifest_listing_nothing_or_pointing_outside_is_refused_without_reading_outside(tmp_path):
    key = RunKey.new()
    path = checkpoint(tmp_path / "ckpts", 1, key)
    resign(path, key, files={})
    assert ck.verify(path) == "state.json is not in the manifest"
    secret = tmp_path / "secret.txt"
    secret.write_bytes(b"s" * 1234)
    for name in ("../../secret.txt", str(secret), "a/../../x", "./state.json", ""):
        resign(path, key, files={name: {"bytes": 1, "sha256": "0" * 64}})
        why = ck.verify(path)
        assert why.startswith("no readable manifest") and "not a plain path" in why and "1234" not in why


def test_links_and_unlisted_files_in_a_checkpoint_are_refused(tmp_path):
    key = RunKey.new()
    outside = tmp_path / "outside.bin"
    outside.write_bytes(b"o" * 50)
    path = checkpoint(tmp_path / "ckpts", 1, key)
    (path / "trainer.pt").unlink()
    os.symlink(outside, path / "trainer.pt")  # the manifest re-made over the link: sizes and hashes agree
    resign(
        path,
        key,
        files={
            "trainer.pt": {"bytes": 50, "sha256": ck.sha256_file(outside)},
            "state.json": {
                "bytes": (path / "state.json").stat().st_size,
                "sha256": ck.sha256_file(path / "state.json"),
            },
        },
    )
    assert ck.verify(path) == "trainer.pt is a symlink (a checkpoint holds only regular files)"
    path2 = checkpoint(tmp_path / "ckpts", 2, key)
    os.symlink(tmp_path, path2 / "linked-dir")
    assert ck.verify(path2) == "linked-dir is a symlink (a checkpoint holds only regular files)"
    path3 = checkpoint(tmp_path / "ckpts", 3, key)
    (path3 / "extra.pt").write_bytes(b"e")
    assert ck.verify(path3) == "extra.pt is not in the manifest"


def test_a_checkpoint_from_elsewhere_needs_the_trust_flag_and_an_edited_one_falls_back(tmp_path, monkeypatch):
    mine = RunKey.new()
    older = checkpoint(tmp_path / "run" / "checkpoints", 1, mine)
    newest = checkpoint(tmp_path / "run" / "checkpoints", 2, mine)
    # edited after writing: sizes and hashes re-made, the signature not (no key) -> damaged, falls back
    (newest / "trainer.pt").write_bytes(b"evil")
    manifest = json.loads((newest / "manifest.json").read_text())
    manifest["files"]["trainer.pt"] = {"bytes": 4, "sha256": ck.sha256_file(newest / "trainer.pt")}
    (newest / "manifest.json").write_text(json.dumps(manifest))
    assert ck.verify(newest) == "its manifest's signature does not match (edited after it was written)"
    assert ck.latest_valid(older.parent, warn=lambda _: None)[0] == older
    # the same run dir on a machine without its key: refused (not skipped: no silent restart from
    # an older point), naming the flag; trusted, its signature goes unchecked (its files still are)
    monkeypatch.setenv(KEY_DIR_ENV, str(tmp_path / "other-machine-keys"))
    with pytest.raises(ConfigError, match=r"ckpt-2 is refused: it was not written by .*trust_checkpoint=true"):
        ck.latest_valid(older.parent, warn=lambda _: None)
    with pytest.raises(ConfigError, match="trust_checkpoint=true"):
        _find_checkpoint(tmp_path / "run", resuming=True, trust=False)
    point = _find_checkpoint(tmp_path / "run", resuming=True, trust=True)
    assert point.path == newest and point.state["step"] == 2
    ck.write_json(older / "state.json", {"step": 1})  # trusted, and malformed inside: named
    resign(
        older,
        mine,
        files={
            n: {"bytes": (older / n).stat().st_size, "sha256": ck.sha256_file(older / n)}
            for n in ("trainer.pt", "state.json")
        },
    )
    (newest / "extra").write_bytes(b"e")
    with pytest.raises(ConfigError, match="ckpt-1: state.json lacks 'version'"):
        _find_checkpoint(tmp_path / "run", resuming=True, trust=True)


def test_signing_keys_live_outside_the_run_and_are_private(tmp_path):
    key = RunKey.new()
    path = checkpoint(tmp_path / "ckpts", 1, key)
    stored = RunKey.find(key.run_id)
    assert stored == key and json.loads((path / "manifest.json").read_text())["run_id"] == key.run_id
    key_file = ck.Path(os.environ[KEY_DIR_ENV]) / f"{key.run_id}.key"
    assert key_file.stat().st_mode & 0o777 == 0o600
    assert not any(key.secret in p.read_bytes() for p in path.rglob("*") if p.is_file())
    assert RunKey.find("../" + key.run_id) is None and RunKey.find(12) is None


def test_a_trainer_state_pickle_that_runs_code_is_refused(tmp_path):
    marker = tmp_path / "ran"
    (tmp_path / "ckpt").mkdir()
    with open(tmp_path / "ckpt" / "trainer.pt", "wb") as f:
        torch.save({"model": Payload(marker)}, f)
    with pytest.raises(pickle.UnpicklingError):
        ck.load_trainer_state(object(), str(tmp_path / "ckpt"), ck.file_table(tmp_path / "ckpt"))
    assert not marker.exists()


def test_dcp_metadata_and_byte_items_that_run_code_are_refused(tmp_path):
    import torch.distributed.checkpoint as dcp

    model = torch.nn.Linear(4, 3)
    opt = torch.optim.AdamW(model.parameters(), lr=0.125)
    model(torch.randn(2, 4)).sum().backward()
    opt.step()
    from torch.distributed.checkpoint.state_dict import get_state_dict

    msd, osd = get_state_dict(model, opt)
    dcp.save({"model": msd, "optim": osd}, checkpoint_id=str(tmp_path / "good"))
    fresh = torch.nn.Linear(4, 3)
    fresh_opt = torch.optim.AdamW(fresh.parameters(), lr=1.0)
    load_dcp(fresh, fresh_opt, str(tmp_path / "good"))  # the genuine article loads through the guards
    assert torch.equal(fresh.weight, model.weight) and fresh_opt.param_groups[0]["lr"] == 0.125
    marker = tmp_path / "ran"
    (tmp_path / "good" / ".metadata").write_bytes(pickle.dumps(Payload(marker)))
    with pytest.raises(pickle.UnpicklingError, match="refers to io.open, which a checkpoint never holds"):
        load_dcp(fresh, fresh_opt, str(tmp_path / "good"))
    assert not marker.exists()
    # a byte item (DCP stores optimizer hyper-parameters as torch.save bytes) carrying the payload
    osd["param_groups"][0]["lr"] = Payload(marker)
    dcp.save({"model": msd, "optim": osd}, checkpoint_id=str(tmp_path / "evil-bytes"))
    with pytest.raises(CheckpointException, match="Weights only load failed"):
        load_dcp(fresh, fresh_opt, str(tmp_path / "evil-bytes"))
    assert not marker.exists()
