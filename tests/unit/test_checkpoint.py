"""Checkpoint files, trainer state round trip, resume bookkeeping, guards and consistency checks.

Fast (no Ray): the end-to-end kill/resume and engine-fault tests are in test_resume_e2e.py.
"""

import json
import os

import numpy as np
import pytest
import torch

from flash.buffers import Group, Sample, SampleBuffer
from flash.buffers.codec import group_from_dict, group_to_dict
from flash import checkpoint as ck
from flash.checkpoint_trust import RunKey
from flash.app.config import load_config
from flash.errors import ConfigError
from flash.guards import DataError, InputGuard, NonFiniteError, SkipGuard
from flash.app.resume import config_differences, resolve_resume, restore_logs
from flash.recipes.tasks import TaskItem
from tests.helpers.checkpointing import small_batch, small_trainer


KEY = RunKey.new()  # one run's key: prune deletes only the run's own checkpoints


def fake_checkpoint(root, step, payload=b"x" * 1000):
    tmp = root / f"ckpt-{step}.tmp"
    tmp.mkdir(parents=True)
    (tmp / "trainer.pt").write_bytes(payload)
    ck.write_json(tmp / "state.json", {"step": step})
    ck.write_manifest(tmp, step, KEY)
    ck.commit(tmp, root / f"ckpt-{step}")
    return root / f"ckpt-{step}"


def test_manifest_lists_every_file_with_size_and_sha256(tmp_path):
    path = fake_checkpoint(tmp_path, 3)
    manifest = json.loads((path / "manifest.json").read_text())
    assert manifest["step"] == 3
    assert manifest["files"]["trainer.pt"]["bytes"] == 1000
    assert manifest["files"]["trainer.pt"]["sha256"] == ck.sha256_file(path / "trainer.pt")
    assert manifest["bytes"] == 1000 + (path / "state.json").stat().st_size
    assert ck.verify(path) is None


def test_truncated_or_edited_checkpoint_falls_back_to_the_previous_one(tmp_path):
    fake_checkpoint(tmp_path, 2)
    newest = fake_checkpoint(tmp_path, 4)
    with open(newest / "trainer.pt", "r+b") as f:
        f.truncate(600)
    warnings = []
    path, skipped = ck.latest_valid(tmp_path, warn=warnings.append)
    assert path == tmp_path / "ckpt-2"
    assert skipped == ["ckpt-4: trainer.pt has 600 bytes, the manifest says 1000"]
    assert len(warnings) == 1 and "falling back" in warnings[0]
    # same size, one byte changed: the hash catches it
    older = tmp_path / "ckpt-2"
    data = bytearray((older / "trainer.pt").read_bytes())
    data[10] ^= 1
    (older / "trainer.pt").write_bytes(bytes(data))
    assert ck.verify(older) == "trainer.pt does not match its sha256"
    assert ck.latest_valid(tmp_path, warn=warnings.append) == (
        None,
        ["ckpt-4: trainer.pt has 600 bytes, the manifest says 1000", "ckpt-2: trainer.pt does not match its sha256"],
    )


def test_unfinished_tmp_dirs_are_never_used_and_prune_keeps_the_newest(tmp_path):
    for step in (1, 2, 3):
        fake_checkpoint(tmp_path, step)
    crashed = tmp_path / "ckpt-4.tmp"  # a write killed before its rename
    crashed.mkdir()
    (crashed / "trainer.pt").write_bytes(b"partial")
    assert ck.latest_valid(tmp_path)[0] == tmp_path / "ckpt-3"
    assert ck.verify(tmp_path / "ckpt-3") is None
    (tmp_path / "ckpt-3" / "manifest.json").unlink()  # killed between files and manifest cannot happen
    assert ck.verify(tmp_path / "ckpt-3").startswith("no readable manifest")  # ... but is detected
    gone = ck.prune(tmp_path, keep_last=2, key=KEY)  # ckpt-3 fails its check: neither counted nor deleted
    assert sorted(p.name for p in gone) == ["ckpt-4.tmp"]
    fake_checkpoint(tmp_path, 5)
    assert [p.name for p in ck.prune(tmp_path, keep_last=2, key=KEY)] == ["ckpt-1"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt-2", "ckpt-3", "ckpt-5"]


def _sample(pid, k):
    return Sample(
        prompt_id=pid,
        sample_index=k,
        prompt_ids=[1, 2],
        response_ids=[3, 4, 5],
        behav_logprobs=[-0.1234567890123, -1.5, -2.0],
        versions=[2, 2, 3],
        reward=1.0,
        finish_reason="stop",
        admitted_version=2,
        meta={"data_index": 7},
    )


def test_groups_survive_the_json_round_trip_exactly():
    g = Group(prompt_id=5, samples=[_sample(5, 0), _sample(5, 1)], admitted_version=2, data_index=7)
    back = group_from_dict(json.loads(json.dumps(group_to_dict(g))))
    assert back == g and back.version == 2


def test_groups_the_buffer_service_holds_as_numpy_arrays_survive_the_json_round_trip():
    # a producer that puts NumPy arrays gets NumPy arrays back from the zmq service: its store holds them
    s = _sample(5, 0)
    s.prompt_ids, s.response_ids = np.array([1, 2], dtype="<i4"), np.array([3, 4, 5], dtype="<i4")
    s.behav_logprobs, s.versions = np.array([-0.1, -1.5, -2.0], dtype="<f4"), np.array([2, 2, 3], dtype="<i8")
    s.loss_mask = np.array([1, 0, 1], dtype="|u1")
    back = group_from_dict(json.loads(json.dumps(group_to_dict(Group(prompt_id=5, samples=[s])))))
    b = back.samples[0]
    assert (b.prompt_ids, b.response_ids, b.versions, b.loss_mask) == ([1, 2], [3, 4, 5], [2, 2, 3], [1, 0, 1])
    assert b.behav_logprobs == [float(x) for x in s.behav_logprobs]  # the float32 values, exactly
    assert all(type(x) is int for x in b.response_ids + b.versions + b.loss_mask)


class _Sched:
    def __init__(self, pending):
        self.pending = pending

    def state_dict(self):
        return {"pending": [{"prompt_id": p, "data_index": p, "version": 0} for p in self.pending]}


def test_rollout_snapshot_counts_a_group_in_buffer_and_pending_once():
    buf = SampleBuffer(capacity=4)
    buf.put(Group(prompt_id=1, samples=[_sample(1, 0)]))
    snap = ck.snapshot_rollout(buf, _Sched(pending=[1, 2]))  # 1: put, not yet removed from pending
    assert [g["prompt_id"] for g in snap["buffer"]] == [1]
    assert [p["prompt_id"] for p in snap["scheduler"]["pending"]] == [2]
    assert len(buf) == 1  # a snapshot does not take anything out


def test_trainer_state_round_trip_continues_bit_for_bit(tmp_path):
    a = small_trainer()
    a.train_step(*small_batch(1), None)
    ck.save_trainer_state(ck.trainer_state(a), str(tmp_path))
    want = [a.train_step(*small_batch(s), None)["loss"] for s in (2, 3)]
    b = small_trainer(seed=123)  # different init: everything must come from the checkpoint
    assert ck.load_trainer_state(b, str(tmp_path), ck.file_table(tmp_path)) == 1
    got = [b.train_step(*small_batch(s), None)["loss"] for s in (2, 3)]
    assert got == want
    for (name, pa), pb in zip(a.model.named_parameters(), b.model.parameters()):
        assert torch.equal(pa, pb), name


def test_restore_logs_cuts_back_to_the_checkpoint_and_empties_without_one(tmp_path):
    (tmp_path / "ledger.jsonl").write_text('{"a": 1}\n{"b": 2}\n')
    (tmp_path / "metrics.jsonl").write_text('{"step": 1}\n{"step": 2}\n')
    restore_logs(tmp_path, {"ledger": 9, "metrics": 12})
    assert (tmp_path / "ledger.jsonl").read_text() == '{"a": 1}\n'
    assert (tmp_path / "metrics.jsonl").read_text() == '{"step": 1}\n'
    restore_logs(tmp_path, None)
    assert (tmp_path / "ledger.jsonl").read_text() == ""


def test_resume_refuses_changed_settings_but_allows_more_steps(tmp_path):
    saved = {"seed": 0, "async_ratio": 2.0, "train": {"steps": 10, "lr": 1e-3}, "checkpoint": {"every_steps": 2}}
    now = {"seed": 0, "async_ratio": 0.0, "train": {"steps": 20, "lr": 1e-3}, "checkpoint": {"every_steps": 5}}
    assert config_differences(saved, now) == ["async_ratio: 2.0 -> 0.0"]
    with pytest.raises(ConfigError, match="not a run dir"):
        resolve_resume(str(tmp_path / "nope"), "stutter")
    with pytest.raises(ConfigError, match="no run of recipe 'stutter'"):
        resolve_resume("latest", "stutter", runs_root=tmp_path)
    for name in ("stutter-1", "stutter-2"):
        (tmp_path / name).mkdir()
        (tmp_path / name / "config.yaml").write_text("seed: 0\n")
    os.utime(tmp_path / "stutter-1" / "config.yaml", (2e9, 2e9))  # the newest by time, not by name
    assert resolve_resume("latest", "stutter", runs_root=tmp_path) == tmp_path / "stutter-1"


def test_nonfinite_loss_skips_the_step_and_leaves_weights_alone():
    t = small_trainer()
    before = {k: v.clone() for k, v in t.model.state_dict().items()}
    batch, adv = small_batch(1)
    m = t.train_step(batch, adv * float("nan"), None)
    assert m["skipped"] == 1.0
    assert all(torch.equal(before[k], v) for k, v in t.model.state_dict().items())
    assert t.train_step(batch, adv, None)["skipped"] == 0.0


def test_skip_guard_counts_logs_once_and_stops_after_the_limit():
    logged = []
    g = SkipGuard(max_consecutive=3, warn=logged.append)
    assert g.update(1, True, float("nan"), 0.0) == {"train/skipped_nonfinite": 1.0}
    assert g.update(2, True, float("nan"), 0.0) == {"train/skipped_nonfinite": 2.0}
    assert g.update(3, False, 0.5, 1.0) == {"train/skipped_nonfinite": 2.0}  # a good step resets the run
    g.update(4, True, 0.1, float("inf"))
    g.update(5, True, 0.1, float("inf"))
    with pytest.raises(NonFiniteError, match="3 optimizer steps in a row .*train.max_consecutive_skips=3"):
        g.update(6, True, 0.1, float("inf"))
    assert g.total == 5 and len(logged) == 1


ROWS = {0: "abc", 1: "", 2: None, 3: "x" * 50, 4: "ok", 5: "bad", 6: "ok"}


def _item(i):
    if ROWS[i] == "bad":
        raise ValueError("row 5 is not valid JSON")
    return TaskItem(index=i, prompt=ROWS[i], answer="")


def test_input_guard_skips_bad_rows_with_a_count_and_one_log_line_each():
    logged = []
    guard = InputGuard(max_prompt_tokens=10, warn=logged.append)
    encode = lambda text: list(range(len(text)))
    assert guard.take(0, _item, encode)[0] == 0
    index, item, ids = guard.take(1, _item, encode)
    assert (index, item.prompt, ids) == (4, "ok", [0, 1])
    assert guard.metrics() == {"data/skipped_empty": 1.0, "data/skipped_malformed": 1.0, "data/skipped_too_long": 1.0}
    assert len(logged) == 3 and "data index 3" in logged[2] and "50 tokens > data.max_prompt_tokens=10" in logged[2]
    assert guard.take(5, _item, encode)[0] == 6  # a second malformed row: counted, not logged again
    assert guard.counts["malformed"] == 2 and len(logged) == 3


def test_strict_data_rejects_the_first_bad_row_naming_it():
    guard = InputGuard(max_prompt_tokens=10, strict=True)
    with pytest.raises(DataError, match="data index 1 is empty.*data.strict=false"):
        guard.take(1, _item, lambda t: list(t))


@pytest.mark.parametrize(
    "overrides, needle",
    [
        (["async_ratio=2", "ray.num_cpus=1"], "set async_ratio=0 (synchronous) or ray.num_cpus>=2"),
        (
            ["async_ratio=1", "ray.num_cpus=2", "resources.engine_threads=2", "resources.trainer_threads=1"],
            "lower them so they sum to <= 2",
        ),
        (["checkpoint.enabled=false", "checkpoint.every_steps=5"], "drop one of them"),
        (["checkpoint.keep_last=0"], "checkpoint.keep_last must be >= 1"),
        (["resume=runs/a", "run_dir=runs/b"], "drop run_dir"),
        (["data.max_prompt_tokens=250"], "raise model.tiny.max_positions"),
        (["train.max_consecutive_skips=0"], "train.max_consecutive_skips must be >= 1"),
        (["rollout.hang_timeout_s=0"], "rollout.hang_timeout_s must be > 0"),
        (["resources.ready_timeout_s=0"], "resources.ready_timeout_s must be > 0 seconds"),
    ],
)
def test_contradictory_settings_fail_validation_naming_the_fix(overrides, needle):
    with pytest.raises(ConfigError) as err:
        load_config("recipes/stutter.yaml", overrides)
    assert needle in str(err.value)


def test_checkpoint_keys_are_strict():
    with pytest.raises(ConfigError, match="did you mean 'every_steps'"):
        load_config("recipes/stutter.yaml", ["checkpoint.every_step=2"])
    cfg = load_config("recipes/stutter.yaml", ["async_ratio=0", "ray.num_cpus=1", "checkpoint.every_steps=3"])
    assert cfg.checkpoint.every_steps == 3 and cfg.checkpoint.keep_last == 2


def test_the_scheduler_takes_prompts_through_the_guard_and_moves_past_skipped_rows():
    from flash.controllers.scheduler import PromptSource

    encode = lambda text: list(range(len(text)))
    guarded = PromptSource(
        item=_item,
        encode=encode,
        decode=str,
        reward=lambda i, r: 0.0,
        guard=InputGuard(max_prompt_tokens=10, warn=lambda m: None),
    )
    assert guarded.take(1)[0] == 4  # rows 1-3 skipped; the scheduler's next data position is 5
    plain = PromptSource(item=_item, encode=encode, decode=str, reward=lambda i, r: 0.0)
    assert plain.take(0)[0] == 0 and plain.take(0)[2] == [0, 1, 2]


def test_rng_state_round_trips_through_a_weights_only_load_and_reads_a_bare_cpu_state(tmp_path):
    import torch

    from flash.checkpoint import rng_state, set_rng_state

    torch.save(rng_state(), tmp_path / "rng.pt")
    drawn = torch.rand(4)
    set_rng_state(torch.load(tmp_path / "rng.pt", weights_only=True))  # the trainer loads with weights_only
    assert torch.equal(torch.rand(4), drawn)
    bare = torch.get_rng_state()  # what checkpoints held before the GPU generators were kept
    drawn = torch.rand(4)
    set_rng_state(bare)
    assert torch.equal(torch.rand(4), drawn)
