"""A checkpoint loads only where it was written and only as it was verified.

Each attack is a class, tried with several payloads: an older checkpoint renamed (or copied, or
linked) to a higher step; a checkpoint of another run, or a whole run dir copied, placed in a run
dir; a checkpoint directory that is a symlink; a file replaced between the driver's check and the
loader's read. Each is refused by name, the ledger is not cut, and prune never deletes the real
newest checkpoint (nor the refused one).
"""

import json
import os
import shutil
from types import SimpleNamespace

import pytest
import ray
import torch

from flash import checkpoint as ck
from flash.app import run_state
from flash.app.resume import load_state
from flash.app.runner import _find_checkpoint
from flash.checkpoint_trust import (
    INODE,
    KEY_DIR_ENV,
    RUN_FILE,
    CheckpointChanged,
    RunDir,
    RunKey,
    bind_run,
    read_verified,
)
from flash.errors import ConfigError
from flash.train.fsdp_checkpoint import load_dcp


def checkpoint(run_dir, step, key, files=None):
    """A complete checkpoint of ``run_dir``, signed with ``key`` (as the Checkpointer writes it)."""
    root = run_dir / "checkpoints"
    tmp = root / f"ckpt-{step}.tmp"
    tmp.mkdir(parents=True)
    for name, data in (files or {"trainer.pt": bytes([step]) * 100}).items():
        (tmp / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp / name).write_bytes(data)
    ck.write_json(
        tmp / "state.json",
        {
            "step": step,
            "version": step,
            "logs": {"ledger": step},
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


def new_run(tmp_path, name="run", steps=(1, 2, 3)):
    """A run dir made as a run makes it (``run.json``), with checkpoints at ``steps`` and a ledger."""
    run_dir = tmp_path / name
    run_dir.mkdir()
    key = bind_run(run_dir, None)
    for s in steps:
        checkpoint(run_dir, s, key)
    (run_dir / "ledger.jsonl").write_bytes(b"L" * 100)
    return run_dir, key


def refused(run_dir, trust=False):
    """The one-line refusal a resume of ``run_dir`` gives (the ledger must stay as it was)."""
    ledger = (run_dir / "ledger.jsonl").read_bytes()
    with pytest.raises(ConfigError) as exc:
        _find_checkpoint(run_dir, resuming=True, trust=trust)
    assert (run_dir / "ledger.jsonl").read_bytes() == ledger and "\n" not in str(exc.value)
    return str(exc.value)


# ---------------------------------------------------------------- rollback by rename


@pytest.mark.parametrize(
    "how, src, dst, left",
    [
        ("rename", 1, 9, ["ckpt-3", "ckpt-9"]),  # an old one renamed past the newest
        ("rename", 3, 4, ["ckpt-2", "ckpt-4"]),  # the newest renamed one step up
        ("copy", 2, 10, ["ckpt-10", "ckpt-3"]),  # a copy of an old one under a higher name
        ("rename", 2, 0, ["ckpt-0"]),  # one renamed down: found once the newer ones are gone
    ],
)
def test_a_checkpoint_renamed_to_another_step_is_refused_by_name_and_never_pruned(tmp_path, how, src, dst, left):
    run_dir, key = new_run(tmp_path)
    root = run_dir / "checkpoints"
    (shutil.copytree if how == "copy" else os.rename)(root / f"ckpt-{src}", root / f"ckpt-{dst}")
    if dst < src:
        for s in (1, 3):
            shutil.rmtree(root / f"ckpt-{s}")
    why = refused(run_dir)
    assert why == (
        f"checkpoint {root / f'ckpt-{dst}'} is refused: its manifest was signed for step {src}, "
        f"not {dst} (renamed); rename it back to ckpt-{src} or move it out of the checkpoints folder"
    )
    assert refused(run_dir, trust=True) == why  # trust vouches for the origin, not for the step
    assert f"ckpt-{dst}" not in [p.name for p in ck.own_checkpoints(root, key)]
    ck.prune(root, keep_last=1, key=key)  # keeps the real newest; the refused one is left for the user
    assert sorted(p.name for p in root.iterdir()) == left


def test_prune_counts_only_the_runs_own_checkpoints(tmp_path):
    run_dir, key = new_run(tmp_path, steps=(1, 2, 3, 4))
    root = run_dir / "checkpoints"
    other_run, other_key = new_run(tmp_path, "other", steps=(7,))
    shutil.copytree(other_run / "checkpoints" / "ckpt-7", root / "ckpt-7")  # another run's, higher
    os.symlink(root / "ckpt-4", root / "ckpt-8")  # a link to the run's own newest
    (root / "ckpt-9").mkdir()  # no manifest
    assert [p.name for p in ck.own_checkpoints(root, key)] == ["ckpt-4", "ckpt-3", "ckpt-2", "ckpt-1"]
    assert sorted(p.name for p in ck.prune(root, keep_last=2, key=key)) == ["ckpt-1", "ckpt-2"]
    assert sorted(p.name for p in root.iterdir()) == ["ckpt-3", "ckpt-4", "ckpt-7", "ckpt-8", "ckpt-9"]


# ---------------------------------------------------------------- transplant


def test_a_checkpoint_of_another_run_is_refused_unless_trusted(tmp_path):
    run_a, key_a = new_run(tmp_path, "a", steps=(5, 7))
    run_b, key_b = new_run(tmp_path, "b", steps=(1, 2))
    shutil.copytree(run_a / "checkpoints" / "ckpt-7", run_b / "checkpoints" / "ckpt-7")
    assert refused(run_b).endswith(
        "ckpt-7 is refused: it was written in another run dir (moved or copied here); "
        "if you trust where it came from, resume it with trust_checkpoint=true"
    )
    point = _find_checkpoint(run_b, resuming=True, trust=True)
    assert point.path.name == "ckpt-7" and point.state["step"] == 7
    assert bind_run(run_b, point.manifest) == key_b  # b's own record: b's key signs on
    # A checkpoint written before run binding (no inode in its manifest) is bound by its run id
    legacy = run_b / "checkpoints" / "ckpt-7"
    manifest = json.loads((legacy / "manifest.json").read_text())
    del manifest[INODE]
    (legacy / "manifest.json").write_text(json.dumps(key_a.sign(manifest)))
    assert f"it was written by run {key_a.run_id}, and this run dir is run {key_b.run_id}'s" in refused(run_b)


@pytest.mark.parametrize("change", ["copy", "edit", "other machine", "unreadable"])
def test_a_copied_or_forged_run_dir_is_refused_unless_trusted(tmp_path, monkeypatch, change):
    run_a, key_a = new_run(tmp_path, "a", steps=(3,))
    target = tmp_path / "c"
    shutil.copytree(run_a, target)  # a copy of the whole run dir, run.json and all
    if change == "edit":  # the record edited to name the copy's inode, re-signed by no key
        target = run_a
        record = json.loads((run_a / RUN_FILE).read_text())
        (run_a / RUN_FILE).write_text(json.dumps({**record, INODE: record[INODE] + 1}))
    elif change == "other machine":
        target = run_a
        monkeypatch.setenv(KEY_DIR_ENV, str(tmp_path / "other-keys"))
    elif change == "unreadable":
        target = run_a
        (run_a / RUN_FILE).write_bytes(b"\xff{")
    want = {
        "copy": f"it is a copy of run {key_a.run_id}'s dir",
        "edit": "its run.json was edited",
        "other machine": "it was not written by a run of this user on this machine",
        "unreadable": "unreadable",
    }[change]
    why = refused(target)
    assert "is refused: " in why and want in why and why.endswith("trust_checkpoint=true")
    point = _find_checkpoint(target, resuming=True, trust=True)
    assert point.state["step"] == 3
    key = bind_run(target, point.manifest)  # adopted: a new run id, recorded for this dir
    assert key != key_a and RunDir.read(target) == RunDir(key.run_id, os.stat(target).st_ino, key, None)
    if change != "other machine":
        assert refused(target).endswith("trust_checkpoint=true")  # the adopted dir still refuses the old one


def test_a_run_dir_moved_within_its_file_system_keeps_its_checkpoints(tmp_path):
    run_a, key_a = new_run(tmp_path, "a", steps=(2,))
    os.rename(run_a, tmp_path / "moved")
    point = _find_checkpoint(tmp_path / "moved", resuming=True, trust=False)
    assert point.state["step"] == 2 and bind_run(tmp_path / "moved", point.manifest) == key_a


def test_checkpoints_written_before_run_binding_keep_loading_in_their_own_run(tmp_path):
    run_dir = tmp_path / "old"
    key = RunKey.new()
    for s in (1, 2):
        path = checkpoint(run_dir, s, key)
        manifest = json.loads((path / "manifest.json").read_text())
        del manifest[INODE]  # as a manifest written before run binding
        (path / "manifest.json").write_text(json.dumps(key.sign(manifest)))
    (run_dir / "ledger.jsonl").write_bytes(b"L" * 10)
    assert not (run_dir / RUN_FILE).exists()
    point = _find_checkpoint(run_dir, resuming=True, trust=False)
    assert point.state["step"] == 2
    assert bind_run(run_dir, point.manifest) == key  # the run's own key, now recorded in run.json
    assert RunDir.read(run_dir).key == key
    assert _find_checkpoint(run_dir, resuming=True, trust=False).state["step"] == 2  # bound by its run id
    assert [p.name for p in ck.own_checkpoints(run_dir / "checkpoints", key)] == ["ckpt-2", "ckpt-1"]


# ---------------------------------------------------------------- symlinked checkpoint dirs


@pytest.mark.parametrize("target", ["own newest", "copy outside", "dangling", "older"])
def test_a_checkpoint_directory_that_is_a_symlink_is_refused(tmp_path, target):
    run_dir, key = new_run(tmp_path)
    root = run_dir / "checkpoints"
    outside = tmp_path / "elsewhere"
    if target == "copy outside":  # the run's own ckpt-3 moved out and linked back: intact, same step
        os.rename(root / "ckpt-3", outside)
        os.symlink(outside, root / "ckpt-3")
        name = "ckpt-3"
    else:
        name = "ckpt-5"
        src = {"own newest": root / "ckpt-3", "dangling": tmp_path / "nothing", "older": root / "ckpt-1"}[target]
        os.symlink(src, root / name)
    assert refused(run_dir) == (
        f"checkpoint {root / name} is refused: it is a symlink, not a directory of its "
        "own; move the directory it links to here in its place, or remove the link"
    )
    assert refused(run_dir, trust=True).endswith("or remove the link")
    ck.prune(root, keep_last=1, key=key)
    assert (root / name).is_symlink() and (target != "copy outside" or (outside / "trainer.pt").is_file())


@pytest.mark.parametrize("inside", ["file", "nested dir", "fifo"])
def test_links_and_special_files_anywhere_inside_are_refused(tmp_path, inside):
    run_dir, key = new_run(tmp_path, steps=())
    path = checkpoint(run_dir, 1, key, files={"trainer/a.bin": b"a", "trainer/sub/b.bin": b"b"})
    victim = path / "trainer" / "sub" / "b.bin"
    victim.unlink()
    if inside == "fifo":
        os.mkfifo(victim)
    else:
        os.symlink(tmp_path if inside == "nested dir" else path / "trainer" / "a.bin", victim)
    why = ck.verify(path)
    assert why == (
        "trainer/sub/b.bin is not a regular file"
        if inside == "fifo"
        else "trainer/sub/b.bin is a symlink (a checkpoint holds only regular files)"
    )


# ---------------------------------------------------------------- verify, then load


def _tiny_trainer(seed):
    torch.manual_seed(seed)
    model = torch.nn.Linear(4, 3)
    return SimpleNamespace(
        model=model, optimizer=torch.optim.AdamW(model.parameters()), steps=seed, optimizer_steps=seed
    )


def _swap(path, how, other):
    """Replace ``path`` (after the driver's check) the way ``how`` says; ``other``: another file."""
    if how == "renamed over":
        os.replace(other, path)
    elif how == "edited in place":
        with open(path, "r+b") as f:
            f.seek(f.seek(0, 2) // 2)
            f.write(b"\x00\x01")
    elif how == "truncated":
        os.truncate(path, 10)
    elif how == "grown":
        with open(path, "ab") as f:
            f.write(b"x" * 10)
    elif how == "deleted":
        path.unlink()
    elif how == "same bytes behind a link":
        shutil.copy(path, other)
        path.unlink()
        os.symlink(other, path)
    elif how == "fifo":
        path.unlink()
        os.mkfifo(path)


SWAPS = ["renamed over", "edited in place", "truncated", "grown", "deleted", "same bytes behind a link", "fifo"]


@pytest.mark.parametrize("how", SWAPS)
def test_a_trainer_file_replaced_after_verification_is_refused_by_name(tmp_path, how):
    run_dir, key = new_run(tmp_path, steps=())
    a, b = _tiny_trainer(1), _tiny_trainer(2)
    ck.save_trainer_state(ck.trainer_state(a), str(tmp_path))
    path = checkpoint(run_dir, 1, key, files={"trainer.pt": (tmp_path / "trainer.pt").read_bytes()})
    point = _find_checkpoint(run_dir, resuming=True, trust=False)  # the driver's check passes
    ck.save_trainer_state(ck.trainer_state(b), str(tmp_path))  # a valid state of other weights
    _swap(path / "trainer.pt", how, tmp_path / "trainer.pt")
    before = b.model.weight.detach().clone()
    with pytest.raises(
        CheckpointChanged,
        match=rf"^checkpoint {path}: trainer.pt (changed after it was verified|"
        r"cannot be read as it was verified)",
    ):
        ck.load_trainer_state(b, str(path), point.manifest["files"])
    assert torch.equal(b.model.weight, before) and b.steps == 2  # nothing of it was loaded


def test_the_verified_trainer_file_loads_and_state_json_is_checked_too(tmp_path):
    run_dir, key = new_run(tmp_path, steps=())
    a, b = _tiny_trainer(1), _tiny_trainer(2)
    ck.save_trainer_state(ck.trainer_state(a), str(tmp_path))
    path = checkpoint(run_dir, 1, key, files={"trainer.pt": (tmp_path / "trainer.pt").read_bytes()})
    point = _find_checkpoint(run_dir, resuming=True, trust=False)
    assert ck.load_trainer_state(b, str(path), point.manifest["files"]) == 1
    assert torch.equal(b.model.weight, a.model.weight)
    ck.write_json(path / "state.json", {**point.state, "step": 1, "buffer": [{"forged": 1}]})
    with pytest.raises(CheckpointChanged, match="state.json changed after it was verified"):
        load_state(path, point.manifest)
    with pytest.raises(CheckpointChanged, match="rng.pt is not in its verified manifest"):
        read_verified(path, "rng.pt", point.manifest["files"])


def test_a_trainers_refusal_reaches_the_driver_as_one_line(monkeypatch):
    cause = CheckpointChanged("checkpoint /x/ckpt-1: trainer.pt changed after it was verified (...)")
    err = ray.exceptions.RayTaskError("load_checkpoint", "Traceback ...\nlots of lines", cause)

    def raise_it(_):
        raise err

    monkeypatch.setattr(run_state.ray, "get", raise_it)
    trainer = SimpleNamespace(load_checkpoint=SimpleNamespace(remote=lambda *a: None))
    with pytest.raises(CheckpointChanged) as exc:
        run_state.load_trainer(trainer, "/x/ckpt-1", {})
    assert str(exc.value) == str(cause)


@pytest.mark.parametrize("victim", [".metadata", "distcp"])
@pytest.mark.parametrize("how", ["renamed over", "edited in place", "same bytes behind a link"])
def test_an_fsdp_file_replaced_after_verification_is_refused_by_name(tmp_path, victim, how):
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict

    def save(seed, where):
        t = _tiny_trainer(seed)
        t.model(torch.randn(2, 4)).sum().backward()
        t.optimizer.step()
        msd, osd = get_state_dict(t.model, t.optimizer)
        dcp.save({"model": msd, "optim": osd}, checkpoint_id=str(where))
        return t

    good, other = save(1, tmp_path / "good"), save(2, tmp_path / "other")
    files = ck.file_table(tmp_path / "good")  # what the verified manifest lists of trainer/
    fresh = _tiny_trainer(3)
    load_dcp(fresh.model, fresh.optimizer, str(tmp_path / "good"), files)  # intact: loads
    assert torch.equal(fresh.model.weight, good.model.weight)
    name = ".metadata" if victim == ".metadata" else next(n for n in files if n.endswith(".distcp"))
    _swap(tmp_path / "good" / name, how, tmp_path / "other" / name)
    fresh = _tiny_trainer(3)
    before = fresh.model.weight.detach().clone()
    with pytest.raises(CheckpointChanged, match=rf": {name} (changed after|cannot be read as) it was verified"):
        load_dcp(fresh.model, fresh.optimizer, str(tmp_path / "good"), files)
    assert torch.equal(fresh.model.weight, before) and not torch.equal(before, other.model.weight)
