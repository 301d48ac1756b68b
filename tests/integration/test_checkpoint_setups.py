"""Checkpoints of the setups beyond the plain one: the zmq buffer service, an FSDP2 trainer group,
environment episodes (the parts; the kill-and-resume runs are in test_resume_setups_e2e.py).

- zmq: the service's store is what a checkpoint reads and a resume fills; restored groups bypass
  the producers' ``(producer, seq)`` check, so they are neither refused nor doubled, and a new
  producer's puts after the restore are stored as usual.
- FSDP2 group: the snapshot is taken between steps and written (DCP, its own process group) while
  the next step trains; the Checkpointer's manifest covers the DCP folder; loading it gives back the
  snapshot's weights exactly and the next step bit for bit; a one-rank group reshards it.
- Episodes: a seed in flight keeps its finished episodes and restarts the others from the same
  environment seed and turn seeds.
"""

import json
from types import SimpleNamespace

import pytest
import ray
import torch

from flash.buffers import Group, Sample, SampleBuffer
from flash.buffers.client import RemoteSampleBuffer
from flash.buffers.codec import group_from_dict
from flash.buffers.service import BufferService
from flash import checkpoint as ck
from flash.checkpoint_trust import CheckpointChanged, RunKey
from flash.app.config import CheckpointConfig
from flash.errors import ConfigError


def _sample(pid, k, reward=1.0):
    return Sample(
        prompt_id=pid,
        sample_index=k,
        prompt_ids=[1, 2, 3],
        response_ids=[4, 5 + k],
        behav_logprobs=[-0.5, -0.25],
        versions=[pid, pid],
        reward=reward,
        admitted_version=pid,
        meta={"request_id": f"{pid}:{k}", "request": k, "data_index": pid},
    )


def _group(pid):
    return Group(prompt_id=pid, samples=[_sample(pid, 0), _sample(pid, 1, 0.0)], admitted_version=pid, data_index=pid)


class _Sched:
    def __init__(self, pending):
        self.pending = pending

    def state_dict(self):
        return {"pending": [{"prompt_id": p, "data_index": p, "version": 0} for p in self.pending]}


# ---------------------------------------------------------------- zmq buffer service


def test_zmq_store_round_trips_through_a_checkpoint_and_new_puts_still_count_once():
    with BufferService(capacity=8) as old:
        proxy = RemoteSampleBuffer(old.address)
        for pid in (3, 5):
            proxy.put(_group(pid))
        state = ck.snapshot_rollout(old.buffer, _Sched(pending=[5, 7]))  # 5: stored, ack not yet seen
        proxy.disconnect()
    state = json.loads(json.dumps(state))  # what state.json holds
    assert [g["prompt_id"] for g in state["buffer"]] == [3, 5]
    assert [p["prompt_id"] for p in state["scheduler"]["pending"]] == [7]

    with BufferService(capacity=8) as new:  # the resumed run's service: fresh producer ids and seqs
        groups = [group_from_dict(g) for g in state["buffer"]]
        new.buffer.restore(groups)
        with pytest.raises(ValueError, match="already in the buffer"):
            new.buffer.restore(groups[:1])  # the same group twice is refused, not doubled
        proxy = RemoteSampleBuffer(new.address)
        proxy.put(_group(9))  # the new producer's seq 0: stored, not taken for a retry
        assert len(proxy) == 3
        got = proxy.get_batch(3)
        stats = proxy.stats()
        proxy.disconnect()
    assert sorted(g.prompt_id for g in got) == [3, 5, 9]
    assert [g for g in got if g.prompt_id in (3, 5)] == [_group(3), _group(5)]  # exact, over the wire
    assert stats["duplicates"] == 0 and stats["puts"] == 1 and stats["gets"] == 3


# ---------------------------------------------------------------- FSDP2 trainer group


@pytest.mark.slow
def test_group_checkpoint_is_written_beside_training_covered_by_the_manifest_and_reshards(ray_local, tmp_path):
    from flash.models import TinyModelConfig, build_tiny_model, build_tokenizer
    from tests.helpers.train import make_batch, settings, start_group

    tok = build_tokenizer()
    model = build_tiny_model(
        tok,
        TinyModelConfig(
            hidden_size=64, num_layers=2, num_heads=2, num_kv_heads=2, intermediate_size=128, max_positions=64
        ),
    )
    model.save_pretrained(tmp_path / "tiny")
    tok.save_pretrained(tmp_path / "tiny")
    s, (batch, adv) = settings(), make_batch(seed=5)
    group = start_group(str(tmp_path / "tiny"), s, workers=2)
    cfg = CheckpointConfig(every_steps=1, keep_last=2, async_write=True)
    checkpointer = ck.Checkpointer(tmp_path / "run", cfg, group, total_steps=3, key=RunKey.new())
    try:
        ray.get(group.train_step.remote(batch, adv, None))
        at_snapshot = ray.get(group.get_weights.remote())
        checkpointer.snapshot(1, {"version": 1})
        checkpointer.commit({})  # the write runs in a thread while the next step trains
        step2 = ray.get(group.train_step.remote(batch, adv, None))
        checkpointer.wait()
        after = ray.get(group.get_weights.remote())
        path = tmp_path / "run" / "checkpoints" / "ckpt-1"
        manifest = json.loads((path / "manifest.json").read_text())
        names = set(manifest["files"])
        assert {
            "trainer/.metadata",
            "trainer/rng-0.pt",
            "trainer/rng-1.pt",
            "trainer/flash_trainer.json",
            "state.json",
        } <= names and any(n.endswith(".distcp") for n in names)
        assert ck.verify(path) is None and not (tmp_path / "run" / "checkpoints" / "ckpt-1.tmp").exists()
        assert ray.get(group.load_checkpoint.remote(str(path), manifest["files"])) == 1
        back = ray.get(group.get_weights.remote())
        assert all(torch.equal(back[k], v) for k, v in at_snapshot.items())  # the snapshot, not step 2
        again = ray.get(group.train_step.remote(batch, adv, None))
        assert again["loss"] == step2["loss"]
        assert all(torch.equal(v, after[k]) for k, v in ray.get(group.get_weights.remote()).items())
    finally:
        ray.kill(group)
    one = start_group(str(tmp_path / "tiny"), s, workers=1)  # another size: DCP reshards
    try:
        assert ray.get(one.load_checkpoint.remote(str(path), manifest["files"])) == 1
        assert all(torch.equal(v, at_snapshot[k]) for k, v in ray.get(one.get_weights.remote()).items())
        rng = path / "trainer" / "rng-0.pt"  # replaced after the driver's check: the rank refuses it by name
        rng.write_bytes(rng.read_bytes()[::-1])
        with pytest.raises(CheckpointChanged, match=r"ckpt-1/trainer: rng-0.pt changed after it was verified"):
            ray.get(one.load_checkpoint.remote(str(path), manifest["files"]))
    finally:
        ray.kill(one)
    distcp = next(p for p in (path / "trainer").iterdir() if p.suffix == ".distcp")
    with open(distcp, "r+b") as f:
        f.truncate(f.seek(0, 2) // 2)
    assert ck.verify(path).startswith(f"trainer/{distcp.name} has ")


def test_a_checkpoint_of_the_other_trainer_kind_names_the_setting_to_resume_with(tmp_path):
    (tmp_path / "single").mkdir()
    (tmp_path / "single" / "trainer.pt").write_bytes(b"x")
    (tmp_path / "group" / "trainer").mkdir(parents=True)
    with pytest.raises(ConfigError, match="single trainer process.*train.workers=1"):
        ck.check_trainer_files(tmp_path / "single", group=True)
    with pytest.raises(ConfigError, match="FSDP2 trainer group.*train.workers > 1"):
        ck.check_trainer_files(tmp_path / "group", group=False)
    ck.check_trainer_files(tmp_path / "single", group=False)
    ck.check_trainer_files(tmp_path / "group", group=True)


def test_resume_may_change_the_worker_count_only():
    from flash.app.config import load_config, to_dict
    from flash.app.resume import config_differences

    def resolved(*overrides):  # as config.yaml holds it (train.workers sets actor_train.num_workers)
        return to_dict(load_config("recipes/stutter.yaml", list(overrides)))

    saved = resolved("train.workers=2")
    assert config_differences(saved, resolved("train.workers=3")) == []
    assert config_differences(saved, resolved("train.workers=2", "train.micro_tokens=64")) == [
        "train.micro_tokens: 0 -> 64"
    ]


# ---------------------------------------------------------------- environment episodes


def _episodes(workers=("w0", "w1", "w2")):
    from flash.controllers.episode_runtime import EpisodeScheduler
    from flash.controllers.staleness import StalenessManager
    from flash.engine.base import SamplingParams

    task = SimpleNamespace(item=lambda i, split: SimpleNamespace(prompt="", meta={"seed": 1000 + i}))
    sched = EpisodeScheduler(
        None,
        list(workers),
        task,
        None,
        SampleBuffer(8),
        StalenessManager(1, 2),
        SamplingParams(max_new_tokens=1),
        n=3,
        seed=7,
        max_turns=4,
    )
    launched = []
    sched.workflow._launch = launched.append  # record the environment resets instead of running them
    return sched, launched


def _played(launched):
    """(unit id, environment seed, worker, turn seed) of each recorded reset (``lambda ep=ep: ...``)."""
    return [
        (ep.key, ep.unit.item.meta["seed"], ep.worker, ep.unit.params.seed)
        for ep in (call.__defaults__[0] for call in launched)
    ]


def test_episode_state_restarts_the_seeds_in_flight_with_the_same_environment_and_turn_seeds():
    a, first = _episodes()
    with a._lock:
        units = a._admit_one(0, spare=False) + a._admit_one(0, spare=False)  # seeds 0 and 1, 3 episodes each
    a.workflow.launch(units)
    a.lifecycle.move(["1:2"], "scoring")  # seed 1's third episode has finished, its group has not
    a.inflight.prompts[1].samples[2] = _sample(1, 2)
    a.counters["episodes"] = 1
    a.counters["faults_env"] = 2  # env workers that died before the checkpoint: faults/env continues
    state = json.loads(json.dumps(a.state_dict()))
    # the format checkpoints have always had: old ones resume
    assert sorted(state) == [
        "admitted",
        "counters",
        "lifecycle",
        "next_index",
        "pending",
        "provisioning",
        "rng",
        "version",
        "waves",
    ]
    assert sorted(state["pending"][0]) == ["cap", "data_index", "meta", "prompt_id", "requests", "spare", "version"]
    assert [(p["prompt_id"], p["data_index"], p["requests"]) for p in state["pending"]] == [
        (0, 0, [0, 1, 2]),
        (1, 1, [0, 1, 2]),
    ]
    b, launched = _episodes()
    assert b.load_state_dict(state, buffered_groups=[]) == 2
    assert (b.admitted, b.admission.next_index, b.counters["episodes"], b.workflow.faults) == (2, 2, 1, 2)
    assert _played(launched) == _played(first)  # the same episodes, on the same workers, same seeds
    assert [p[1] for p in _played(launched)] == [1000] * 3 + [1001] * 3
    snap = b.lifecycle.snapshot()
    assert snap["admitted"] == 6 and snap["generating_now"] == 6  # admitted = ended + live still holds
