"""The simulated GPU roles (flash.sim, rollout.engine sim, train.backend sim).

- The cost model's functions, pinned with numbers computed by hand from the presets; the CPU
  presets' host terms add per sequence, per context token and per pass.
- Response lengths: seeded, in [1, cap], long-tailed.
- The simulated engine keeps the engine contract (abort, the three interrupt modes, per-token
  versions, refused requests) and is deterministic for a seed: same tokens, same step times.
- The simulated trainer's step time is the cost model's, its metrics finite, its checkpoint whole.
- A simulated run through the real controller keeps the staleness bound and ends every admitted
  prompt exactly once; a second run with the same seed trains the same tokens.
"""

from __future__ import annotations

import json
import math
import random
import time

import pytest
import torch

from flash.buffers import Sample
from flash.engine.base import ENGINE_PROTOCOLS, GenerationRequest, SamplingParams, UpdateTarget
from flash.engine.sim_engine import WEIGHT_NAME, SimBatcher, SimEngineWorker, SimSettings
from flash.checkpoint import file_table
from flash.errors import ConfigError
from flash.sim import cost
from flash.sim.accounting import simulated_metrics
from flash.sim.config import SimConfig, check_sim
from flash.sim.workload import response_length
from flash.train.batch import collate
from flash.train.sim_trainer import SimTrainer, synthetic_loss

SEVEN_B = cost.PRESETS["qwen2.5-7b-h100"]
VOCAB = 64
STOP = 0


# ---- the cost model ----------------------------------------------------------------------------
def test_cost_model_pinned_by_hand():
    # KV per token: 2 (K, V) · layers · kv_heads · head_dim · 2 bytes
    assert cost.QWEN25_7B.kv_bytes_per_token == 2 * 28 * 4 * 128 * 2 == 57344
    assert cost.QWEN25_32B.kv_bytes_per_token == 2 * 64 * 8 * 128 * 2 == 262144
    # batch 1, no context: 15.22 GB / (3.35 TB/s · 0.77) = 5.9004 ms, + 3 ms overhead
    assert cost.decode_step_s(SEVEN_B, 1, 0) == pytest.approx(0.0089004, rel=1e-4)
    # batch 256 × 1,500 context: memory (15.22e9 + 57344 · 384000) / 2.5795e12 = 14.437 ms beats
    # compute 2 · 7.61e9 · 256 / (989.4e12 · 0.5) = 7.876 ms; + 3 ms
    assert cost.decode_step_s(SEVEN_B, 256, 256 * 1500) == pytest.approx(0.017437, rel=1e-3)
    # batch 4096, no context: compute-bound, 2 · 7.61e9 · 4096 / 4.947e14 = 126.02 ms, + 3 ms
    assert cost.decode_step_s(SEVEN_B, 4096, 0) == pytest.approx(0.12902, rel=1e-3)
    assert cost.decode_step_s(SEVEN_B, 0, 0) == 0.0
    # tp 4 divides both terms: 32B at batch 1 is 65 GB / (4 · 2.5795e12) = 6.2997 ms, + 3 ms
    assert cost.decode_step_s(cost.PRESETS["qwen2.5-32b-h100"], 1, 0) == pytest.approx(0.0092997, rel=1e-4)
    # prefill of 1,000 tokens: 2 · 7.61e9 · 1000 / (989.4e12 · 0.5) = 30.766 ms
    assert cost.prefill_s(SEVEN_B, 1000) == pytest.approx(0.030766, rel=1e-4)
    # a train step over 1M tokens on 8 GPUs: 6 · 7.61e9 · 1e6 / (8 · 989.4e12 · 0.35) = 16.482 s
    assert cost.train_step_s(SEVEN_B, 1e6, 8) == pytest.approx(16.482, rel=1e-4)
    assert cost.forward_s(SEVEN_B, 1e6, 8) == pytest.approx(16.482 / 3, rel=1e-4)
    # weight push: 15.22 GB / 25 GB/s + 0.5 s
    assert cost.weight_sync_s(SEVEN_B) == pytest.approx(1.1088, rel=1e-4)


def test_host_terms_of_the_cpu_presets_add_per_sequence_context_token_and_pass():
    cpu = cost.PRESETS["tiny-cpu-1t"]
    # no context: batch 1 is memory-bound (3.4484 MB of fp32 weights / 21.4 GB/s = 161 µs), batch
    # 101 compute-bound (2 · 862,100 · 101 / 77 GFLOP/s = 2.2615 ms), + 100 × the per-sequence work
    more = cost.decode_step_s(cpu, 101, 0) - cost.decode_step_s(cpu, 1, 0)
    roofline = 2 * 862_100 * 101 / 77.0e9 - 862_100 * 4 / 21.4e9
    assert more == pytest.approx(roofline + 100 * cpu.eff.seq_overhead_s, rel=1e-9)
    # 1,000 context tokens: 4,096 KV bytes each over 21.4 GB/s, + the per-token host work
    assert cost.TINY_QWEN2.kv_bytes_per_token == 2 * 4 * 4 * 32 * 4 == 4096
    more = cost.decode_step_s(cpu, 1, 1000) - cost.decode_step_s(cpu, 1, 0)
    assert more == pytest.approx(4096 * 1000 / 21.4e9 + 1000 * cpu.eff.context_overhead_s, rel=1e-9)
    two = cost.PRESETS["tiny-cpu-2t"]
    assert cost.train_step_s(two, 0, 1, passes=2) == pytest.approx(2 * two.eff.train_overhead_s)
    assert cost.decode_step_s(SEVEN_B, 1, 0) == pytest.approx(0.0089004, rel=1e-4)  # GPU presets: none


def test_decode_run_is_the_sum_of_its_steps():
    steps = sum(cost.decode_step_s(SEVEN_B, 64, 64 * 500 + 64 * i) for i in range(100))
    assert cost.decode_run_s(SEVEN_B, 64, 64 * 500, 100) == pytest.approx(steps, rel=1e-9)


def test_response_lengths_seeded_capped_and_long_tailed():
    draw = lambda seed: response_length(random.Random(seed), 100, 1.0, 1000)
    lengths = [draw(s) for s in range(4000)]
    assert lengths == [draw(s) for s in range(4000)]
    assert 1 <= min(lengths) and max(lengths) == 1000
    ordered = sorted(lengths)
    assert 85 <= ordered[2000] <= 115  # the median
    assert sum(x > 270 for x in lengths) / len(lengths) == pytest.approx(0.16, abs=0.03)  # > e · median


# ---- the engine --------------------------------------------------------------------------------
def _requests(n: int, max_new: int = 40, prefix: str = "r") -> list[GenerationRequest]:
    return [
        GenerationRequest(
            f"{prefix}{i}", [1, 2, 3], SamplingParams(max_new_tokens=max_new, stop_token_ids=[STOP], seed=i)
        )
        for i in range(n)
    ]


def _settings(**kw) -> SimSettings:
    return SimSettings(SEVEN_B, **{"instances": 2, "time_scale": 1e-4, **kw})


def _drain(batcher: SimBatcher) -> dict:
    out = {}
    while batcher.can_step:
        out.update((o.request_id, o) for o in batcher.step())
    return out


def test_engine_is_deterministic_for_a_seed():
    runs = []
    for _ in range(2):
        b = SimBatcher(_settings(), VOCAB, max_num_seqs=4, seed=7)
        for r in _requests(12):
            b.add_request(r)
        outs = _drain(b)
        runs.append((b.step_costs, {k: (o.token_ids, o.logprobs, o.finish_reason) for k, o in outs.items()}))
    assert runs[0] == runs[1]
    tokens = [t for toks, _, _ in runs[0][1].values() for t in toks]
    assert all(0 <= t < VOCAB for t in tokens)
    assert all(math.isfinite(lp) and lp < 0 for _, lps, _ in runs[0][1].values() for lp in lps)
    for toks, _, reason in runs[0][1].values():  # a short response ends on the stop token, a capped one does not
        assert (reason == "stop") == (toks[-1] == STOP) and (reason == "length") == (len(toks) == 40)


@pytest.fixture
def model_dir(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"vocab_size": VOCAB}))
    return str(tmp_path)


def _finish(worker, ids: set[str], timeout: float = 10.0) -> dict:
    done, end = {}, time.monotonic() + timeout
    while not ids <= set(done) and time.monotonic() < end:
        done.update((o.request_id, o) for o in worker.get_finished(timeout=0.5))
    return done


def test_engine_keeps_the_contract(model_dir):
    # every response runs to its cap (sigma 0, median above it); ~4.5 ms of real time per token
    settings = _settings(time_scale=0.5, max_tokens_per_step=1, length_median=1e5, length_sigma=0.0)
    w = SimEngineWorker(model_dir, 8, 0, 1, sim=settings)
    try:
        assert all(isinstance(w, p) for p in (*ENGINE_PROTOCOLS, UpdateTarget))
        # a refused request errors at once, the others are served
        bad = GenerationRequest("bad", [VOCAB + 5], SamplingParams(max_new_tokens=4))
        w.submit([bad, *_requests(2, max_new=3, prefix="ok")])
        done = _finish(w, {"bad", "ok0", "ok1"})
        assert done["bad"].finish_reason == "error" and "vocabulary" in done["bad"].error
        # continue: partial responses kept, later tokens carry the new version
        long = [
            GenerationRequest("c", [1, 2], SamplingParams(max_new_tokens=400, seed=1)),
            GenerationRequest("x", [1, 2], SamplingParams(max_new_tokens=400, seed=2)),
        ]
        w.submit(long)
        time.sleep(0.2)
        w.pause("continue")
        w.update_weights({WEIGHT_NAME: torch.zeros(1)}, 1)
        w.resume()
        time.sleep(0.2)
        aborted = {o.request_id: o for o in w.abort(["c"])}
        assert aborted["c"].finish_reason == "abort" and 0 in aborted["c"].versions and 1 in aborted["c"].versions
        assert aborted["c"].versions == sorted(aborted["c"].versions) and w.version() == 1
        # restart: the same request regenerates the same tokens under the new version
        w.pause("restart")
        w.update_weights({WEIGHT_NAME: torch.ones(1)}, 2)
        w.resume()
        w.abort(["x"])
        # wait: running requests finish, new ones hold until resume
        w.submit(_requests(1, max_new=5, prefix="w"))
        deadline = time.monotonic() + 5.0
        while w.stats()["num_running"] < 1 and time.monotonic() < deadline:  # started before the pause
            time.sleep(0.005)
        w.pause("wait")
        assert _finish(w, {"w0"}, timeout=2.0)["w0"].finish_reason == "length"
        w.submit(_requests(1, max_new=5, prefix="h"))
        assert w.get_finished(timeout=0.3) == [] and w.stats()["num_waiting"] == 1
        w.resume()
        assert _finish(w, {"h0"})["h0"].versions[0] == 2
        assert w.stats()["sim_sync_s"] == pytest.approx(2 * cost.weight_sync_s(SEVEN_B))
    finally:
        w.shutdown()


def test_restart_regenerates_the_same_response():
    b = SimBatcher(_settings(), VOCAB, max_num_seqs=4, seed=0)
    ref = _drain(_fed(SimBatcher(_settings(), VOCAB, max_num_seqs=4, seed=0)))
    _fed(b)
    b.step()
    b.step()
    b.preempt("restart")
    b.update_weights({}, 1)
    b.resume()
    again = _drain(b)
    assert {k: o.token_ids for k, o in again.items()} == {k: o.token_ids for k, o in ref.items()}
    assert all(set(o.versions) == {1} for o in again.values())


def _fed(b: SimBatcher) -> SimBatcher:
    for r in _requests(3, max_new=200):
        b.add_request(r)
    return b


# ---- the trainer -------------------------------------------------------------------------------
def _batch():
    samples = [
        Sample(
            prompt_id=0,
            sample_index=k,
            prompt_ids=[1, 2, 3],
            response_ids=[4] * (k + 2),
            behav_logprobs=[-0.5] * (k + 2),
            versions=[0] * (k + 2),
            reward=float(k),
        )
        for k in range(4)
    ]
    return collate(samples, pad_id=0)


class _Settings:
    lr, update_epochs, updates_per_batch = 1e-4, 1, 1


def test_trainer_time_metrics_and_checkpoint(tmp_path):
    sim = SimConfig(time_scale=1e-3, train_gpus=8)
    trainer = SimTrainer(sim, _Settings())
    batch = _batch()
    tokens = float(batch.attention_mask.sum())  # 4 prompts of 3 + responses of 2..5 = 26
    assert tokens == 26
    assert trainer.step_seconds(batch) == pytest.approx(cost.train_step_s(SEVEN_B, 26, 8))
    adv = torch.ones_like(batch.mask)
    m = trainer.train_step(batch, adv, None)
    assert m["loss"] == pytest.approx(0.5) == synthetic_loss(batch, adv)
    assert all(math.isfinite(v) for v in m.values()) and trainer.stats()["steps"] == 1.0
    assert trainer.get_weights()[WEIGHT_NAME].item() == 1.0
    trainer.checkpoint_snapshot()
    trainer.checkpoint_write(str(tmp_path))
    fresh = SimTrainer(sim, _Settings())
    assert fresh.load_checkpoint(str(tmp_path), file_table(tmp_path)) == 1
    trainer.begin_step()
    trainer.accumulate(batch, adv, None)
    assert trainer.finish_step()["loss"] == pytest.approx(0.5)


# ---- config ------------------------------------------------------------------------------------
def test_bad_sim_config_is_one_clear_line():
    from flash.app.config import load_config

    assert check_sim(SimConfig(model="qwen2.5-7b")).startswith("unknown sim.model 'qwen2.5-7b'")
    assert (
        check_sim(SimConfig(rollout_gpus=6, model="qwen2.5-32b-h100")) == "sim.rollout_gpus=6 is not a multiple of tp=4"
    )
    with pytest.raises(ConfigError, match="set both to sim, or neither"):
        load_config("recipes/stutter.yaml", ["rollout.engine=sim"])
    with pytest.raises(ConfigError, match="sim.time_scale must be > 0"):
        load_config("recipes/stutter.yaml", ["rollout.engine=sim", "train.backend=sim", "sim.time_scale=0"])
    with pytest.raises(ConfigError, match="did you mean 'sim'"):
        load_config("recipes/stutter.yaml", ["train.backend=simm"])
    with pytest.raises(ConfigError, match=r"^sim.time_scale, sim.rollout_gpus: read only by simulated roles"):
        load_config("recipes/stutter.yaml", ["sim.time_scale=0.5", "sim.rollout_gpus=16"])  # a real run ignores them
    assert simulated_metrics({"time/step": 0.5, "reward/mean": 1.0}, 0.01) == {"sim/step_s": 50.0}
    shipped = load_config("recipes/sim_rlvr.yaml")  # the shipped simulated recipe validates
    assert (shipped.rollout.engine, shipped.train.backend) == ("sim", "sim")


# ---- a simulated run through the real controller -----------------------------------------------
@pytest.fixture(scope="module")
def ray_session():
    import ray

    yield
    if ray.is_initialized():
        ray.shutdown()


def _ledger(run_dir) -> list[dict]:
    return [json.loads(x) for x in (run_dir / "ledger.jsonl").read_text().splitlines()]


@pytest.mark.slow  # ~30 s on a loaded 2-core machine, nearly all of it Ray and actor start-up
def test_simulated_run_keeps_the_bound_and_loses_nothing(tmp_path, ray_session):
    from flash.app.runner import run
    from tests.helpers.inproc import small_cfg

    steps, ratio = 6, 2
    cfg = small_cfg(
        tmp_path,
        str(tmp_path / "cache"),
        "rollout.engine=sim",
        "train.backend=sim",
        f"async_ratio={ratio}",
        f"train.steps={steps}",
        "sim.time_scale=0.01",
        "task.eval_size=4",
    )
    summary = run(cfg, "sim")
    assert summary["steps"] == steps and summary["max_staleness_observed"] <= ratio
    lines = _ledger(tmp_path)
    trained = [x for x in lines if x["outcome"] == "trained"]
    assert all(x["step"] - x["version"] <= ratio for x in trained)
    per_prompt: dict[int, list] = {}
    for x in trained:
        per_prompt.setdefault(x["prompt_id"], []).append(x["sample"])
    assert all(sorted(v) == list(range(cfg.rollout.n)) for v in per_prompt.values())
    left = [x["prompt_id"] for x in lines if x["outcome"] != "trained" and "request" not in x]
    assert sorted(list(per_prompt) + left) == list(range(summary["prompts_admitted"]))  # each exactly once
    assert summary["prompts_admitted"] == (steps + ratio) * cfg.train.prompts_per_step
    metrics = [json.loads(x) for x in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    # GPU time scaled back, the driver's unscaled: between the wall time and the plain division
    # (each step's window runs from the previous step's end: the logging between steps is in it)
    assert all(m["time/step"] <= m["sim/step_s"] <= m["sim/step_scaled_s"] * 1.1 for m in metrics)
    assert all(m["sim/step_scaled_s"] == pytest.approx(m["time/step"] / 0.01) for m in metrics)
    assert summary["seconds_per_step"] < summary["sim_seconds_per_step"] <= summary["seconds_per_step"] / 0.01


def test_sim_eff_replaces_preset_fields_and_names_the_closest():
    from flash.sim.config import cost_model

    fitted = cost_model(SimConfig(model="tiny-cpu-1t", eff={"step_overhead_s": 0.03}))
    assert fitted.eff.step_overhead_s == 0.03
    assert fitted.eff.seq_overhead_s == cost.PRESETS["tiny-cpu-1t"].eff.seq_overhead_s
    assert (
        check_sim(SimConfig(eff={"step_overhed_s": 1.0}))
        == "unknown key sim.eff.step_overhed_s; did you mean sim.eff.step_overhead_s?"
    )
    assert check_sim(SimConfig(eff={"hbm": -1.0})) == "sim.eff.hbm must be >= 0, got -1.0"


def test_prompt_factor_is_shared_by_a_prompts_samples():
    from flash.sim.workload import prompt_factor

    assert prompt_factor([5, 6, 7], 0.0) == 1.0
    assert prompt_factor([5, 6, 7], 1.0) == prompt_factor([5, 6, 7], 1.0) != prompt_factor([5, 6, 8], 1.0)
    factors = [math.log(prompt_factor([i, i + 1], 1.0)) for i in range(2000)]
    assert abs(sum(factors) / len(factors)) < 0.1 and 0.9 < (sum(f * f for f in factors) / len(factors)) ** 0.5 < 1.1


def test_observed_lengths_from_a_ledger_or_a_list_and_their_errors(tmp_path):
    """sim.lengths: a run's trained lengths grouped by step and prompt (other outcomes skipped) or
    integers each alone; a prompt's samples draw from one group, token_scale divides, the cap
    holds; a bad file is one line."""
    from flash.sim.workload import load_lengths

    ledger = tmp_path / "run" / "ledger.jsonl"
    ledger.parent.mkdir()
    rows = [
        (0, 1, "trained", 3),
        (0, 1, "dropped", 99),
        (0, 2, "trained", 30),
        (0, 1, "trained", 4),
        (1, 1, "trained", 0),
        (0, 2, "trained", 33),
    ]
    ledger.write_text(
        "".join(json.dumps({"step": st, "prompt_id": p, "outcome": o, "len": n}) + "\n" for st, p, o, n in rows)
    )
    assert load_lengths(str(tmp_path / "run")) == load_lengths(str(ledger)) == ((3, 4), (30, 33), (1,))
    (tmp_path / "list.json").write_text("[5, 9]\n12\n")
    assert load_lengths(str(tmp_path / "list.json")) == ((5,), (9,), (12,))
    groups = ((4, 5), (20, 21), (60,))
    b = SimBatcher(_settings(lengths=groups), VOCAB, max_num_seqs=8, seed=3)
    requests = [
        GenerationRequest(
            f"p{p}-{i}", [1, p], SamplingParams(max_new_tokens=40, stop_token_ids=[STOP], seed=10 * p + i)
        )
        for p in range(12)
        for i in range(6)
    ]
    for r in requests:
        b.add_request(r)
    by_prompt: dict[str, set[int]] = {}
    for o in _drain(b).values():
        by_prompt.setdefault(o.request_id.split("-")[0], set()).add(len(o.token_ids))
    picked = {frozenset(v) for v in by_prompt.values()}
    assert all(v <= {4, 5} or v <= {20, 21} or v == {40} for v in picked)  # one group per prompt, 60 capped
    assert len({min(v) for v in picked}) == 3  # and every group picked by some prompt
    b = SimBatcher(_settings(lengths=((22,),), token_scale=2), VOCAB, max_num_seqs=8, seed=3)
    b.add_request(_requests(1)[0])
    assert [s.target for s in b._waiting] == [11]
    (tmp_path / "bad.txt").write_text("4\nfour\n")
    (tmp_path / "neg.txt").write_text("[4, -1]\n")
    for name, needle in [
        ("missing", "no file"),
        ("bad.txt", "bad.txt line 2 is neither JSON"),
        ("neg.txt", "line 1 has -1 where a length"),
    ]:
        assert needle in check_sim(SimConfig(lengths=str(tmp_path / name)))
    (tmp_path / "empty").mkdir()
    (tmp_path / "empty" / "ledger.jsonl").write_text(json.dumps({"outcome": "dropped", "len": 5}) + "\n")
    assert "no response length" in check_sim(SimConfig(lengths=str(tmp_path / "empty")))
