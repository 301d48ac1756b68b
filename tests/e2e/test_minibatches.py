"""Several optimizer steps per rollout batch: mini-batches and epochs against a hand loop, the
proximal policy fixed at the start of the batch, the lr schedule (and its resume), the approximate
proximal policy, and the config checks of the new keys."""

import copy
import math

import pytest
import torch

from flash import algos
from flash.algos.proximal import approx_prox_logp, prox_approx_error
from flash.controllers.prox_mode import prox_mode
from flash.controllers.train_step import proximal
from flash.app.config import load_config
from flash.app.recipe_files import recipe_paths
from flash.errors import ConfigError
from flash.train.batch import collate
from flash.train.trainer import Trainer, token_logprobs
from flash.train.updates import chunk_bounds, lr_at
from tests.helpers.train import toy_model
from tests.helpers.train import toy_samples as samples
from tests.helpers.train import toy_settings as settings

STUTTER = recipe_paths()["stutter"]


@pytest.fixture(scope="module")
def model():
    return toy_model()


def data(n=6):
    batch = collate(samples(n=n))
    adv = torch.randn(batch.mask.shape, generator=torch.Generator().manual_seed(1)) * batch.mask
    return batch, adv


def params(m):
    return [p.detach().clone() for p in m.parameters()]


def record_steps(tr):
    """Wrap ``tr.finish_step`` to keep each optimizer step's metrics."""
    seen, orig = [], tr.finish_step
    tr.finish_step = lambda advance=True: seen.append(orig(advance)) or seen[-1]
    return seen


# ---- the update loop ---------------------------------------------------------------------------
def test_chunks_are_contiguous_balanced_and_never_empty():
    assert chunk_bounds(7, 3) == [(0, 3), (3, 5), (5, 7)]
    assert chunk_bounds(4, 1) == [(0, 4)]
    with pytest.raises(ValueError, match="train.mini_batches=5 but the batch has only 4 rows"):
        chunk_bounds(4, 5)


def test_k_mini_batches_equal_k_hand_steps_with_the_start_of_batch_prox(model):
    """Fused prox (prox_logp=None) with 3 mini-batches: the trainer takes prox once, before the first
    step, then one AdamW step per chunk -- the same as this hand loop."""
    batch, adv = data()
    s = settings(loss={"name": "decoupled_ppo"}, mini_batches=3)
    tr = Trainer(copy.deepcopy(model), s)
    m = tr.train_step(batch, adv, None)
    assert m["optimizer_steps"] == 3.0 and tr.steps == 1 and tr.optimizer_steps == 3

    hand = copy.deepcopy(model).train()
    opt = torch.optim.AdamW(hand.parameters(), lr=s.lr, weight_decay=0.0, betas=s.betas)
    with torch.no_grad():
        prox = token_logprobs(hand, batch, s.temperature)[0] * batch.mask
    for lo, hi in [(0, 2), (2, 4), (4, 6)]:
        part = batch.rows(lo, hi)
        w = part.mask.shape[1]
        opt.zero_grad()
        logp, _ = token_logprobs(hand, part, s.temperature)
        inputs = algos.LossInputs(
            logp=logp,
            prox_logp=prox[lo:hi, :w],
            behav_logp=part.behav_logp,
            advantages=adv[lo:hi, :w],
            mask=part.mask,
            rewards=part.rewards,
            versions=part.versions,
        )
        loss, _ = algos.policy_loss("decoupled_ppo", inputs, agg="token-mean")
        # the trainer's micro-batch weighting, w·loss then ÷w: the same floats, so AdamW's
        # normalisation does not blow up float noise on gradients that are ~0 (k_proj's bias)
        w = float(part.mask.sum())
        (loss * w).backward()
        for p in hand.parameters():
            p.grad.div_(w)
        torch.nn.utils.clip_grad_norm_(hand.parameters(), s.grad_clip)
        opt.step()
    for a, b in zip(params(tr.model), params(hand)):
        assert torch.allclose(a, b, atol=1e-6)

    one = Trainer(copy.deepcopy(model), settings(loss={"name": "decoupled_ppo"}))
    one.train_step(batch, adv, None)
    assert any(not torch.allclose(a, b, atol=1e-4) for a, b in zip(params(one.model), params(tr.model)))


def test_default_is_the_single_step_bit_for_bit(model):
    """(1, 1) is exactly begin_step → accumulate(whole batch) → finish_step, as before."""
    batch, adv = data()
    a, b = Trainer(copy.deepcopy(model), settings()), Trainer(copy.deepcopy(model), settings())
    ma = a.train_step(batch, adv, None)
    b.begin_step()
    b.accumulate(batch, adv, None)
    mb = b.finish_step()
    assert ma["loss"] == mb["loss"] and ma["grad_norm"] == mb["grad_norm"] == ma["grad_norm_last"]
    assert ma["optimizer_steps"] == 1.0 and "mismatch_mean" in ma
    assert all(torch.equal(x, y) for x, y in zip(params(a.model), params(b.model)))


def test_epochs_and_mini_batches_keep_the_prox_of_the_start_of_the_batch(model):
    """2 epochs × 2 mini-batches = 4 steps, all reading one prox: the first step's ratio is 1
    (nothing clipped), the later ones have moved away from it and a tight clip catches them."""
    batch = collate(samples())
    adv = torch.ones(batch.mask.shape) * batch.mask
    s = settings(
        loss={"name": "ppo", "old_policy": "prox", "clip_low": 1e-3, "clip_high": 1e-3}, mini_batches=2, update_epochs=2
    )
    tr = Trainer(copy.deepcopy(model), s)
    start = tr.logprobs(batch)
    seen_prox = []
    orig = tr.accumulate
    tr.accumulate = lambda part, a, prox, ref=None: seen_prox.append(prox) or orig(part, a, prox, ref)
    steps = record_steps(tr)
    m = tr.train_step(batch, adv, None)
    assert m["optimizer_steps"] == 4.0 and len(steps) == 4 and tr.steps == 1
    assert torch.allclose(torch.cat([seen_prox[0], seen_prox[1]]), start, atol=1e-6)
    assert seen_prox[2] is seen_prox[0] or torch.equal(seen_prox[2], seen_prox[0])
    assert steps[0]["clipfrac"] == 0.0 and abs(steps[0]["ratio/mean"] - 1.0) < 1e-5
    assert all(st["clipfrac"] > 0.5 for st in steps[1:])
    assert m["clipfrac"] == pytest.approx(sum(st["clipfrac"] for st in steps) / 4)
    assert m["approx_kl/prox"] == pytest.approx(sum(st["approx_kl/prox"] for st in steps) / 4)
    assert m["grad_norm_last"] == steps[-1]["grad_norm"]
    assert m["grad_norm"] == pytest.approx(sum(st["grad_norm"] for st in steps) / 4)
    assert m["entropy"] > 0


# ---- learning-rate schedule --------------------------------------------------------------------
def test_lr_at_hand_values():
    # warmup 2 of 10, base 1.0: steps 0, 1 ramp to 1/2 and 1
    assert lr_at(0, 10, 1.0, "constant", 2, 0.0) == 0.5
    assert lr_at(1, 10, 1.0, "constant", 2, 0.0) == 1.0
    assert lr_at(9, 10, 1.0, "constant", 2, 0.0) == 1.0
    assert lr_at(0, 10, 1.0, "cosine", 2, 0.0) == 0.5
    assert lr_at(2, 10, 1.0, "cosine", 2, 0.0) == 1.0  # p = 0
    assert lr_at(6, 10, 1.0, "cosine", 2, 0.0) == pytest.approx(0.5)  # p = 4/8: cos = 0
    assert lr_at(4, 10, 1.0, "cosine", 2, 0.0) == pytest.approx((1 + math.cos(math.pi / 4)) / 2)  # 0.8536
    assert lr_at(10, 10, 1.0, "cosine", 2, 0.0) == pytest.approx(0.0)
    # floor 0.1 at base 2: 2·(0.1 + 0.9·(1 + cos(π/2))/2) = 1.1 halfway, 0.2 at the end
    assert lr_at(5, 10, 2.0, "cosine", 0, 0.1) == pytest.approx(1.1)
    assert lr_at(10, 10, 2.0, "cosine", 0, 0.1) == pytest.approx(0.2)
    with pytest.raises(ValueError, match="unknown lr schedule"):
        lr_at(0, 10, 1.0, "linear", 0, 0.0)


def test_trainer_follows_the_schedule_and_resumes_it(model, tmp_path):
    from flash.checkpoint import file_table, load_trainer_state, save_trainer_state, trainer_state

    batch, adv = data()
    s = settings(lr=1e-2, mini_batches=2, lr_schedule="cosine", warmup_steps=2, total_optimizer_steps=6)
    tr = Trainer(copy.deepcopy(model), s)
    steps = record_steps(tr)
    m = tr.train_step(batch, adv, None)
    want = [5e-3, 1e-2]  # warmup: 1/2, 2/2 of lr
    assert [st["lr"] for st in steps] == want
    assert m["lr"] == pytest.approx(sum(want) / 2)
    save_trainer_state(trainer_state(tr), str(tmp_path))
    again = Trainer(copy.deepcopy(model), s)
    assert load_trainer_state(again, str(tmp_path), file_table(tmp_path)) == 1 and again.optimizer_steps == 2
    steps = record_steps(again)
    again.train_step(batch, adv, None)
    # cosine from step 2 of 6: p = 0, then 1/4
    assert [st["lr"] for st in steps] == pytest.approx([1e-2, 1e-2 * (1 + math.cos(math.pi / 4)) / 2])
    assert again.optimizer.param_groups[0]["lr"] == steps[-1]["lr"]


# ---- approximate proximal policy ---------------------------------------------------------------
def test_approx_prox_hand_values():
    """Trainer at version t = 3: α = clamp((t−1−v)/(t−v), 0, 1) = 0, 0, 1/2, 2/3 for v = 3, 2, 1, 0."""
    behav = torch.full((1, 4), -1.0)
    logp = torch.full((1, 4), -2.0)
    versions = torch.tensor([[3, 2, 1, 0]])
    got = approx_prox_logp(behav, logp, versions, 3)
    assert torch.allclose(got, torch.tensor([[-1.0, -1.0, -1.5, -5 / 3]]))
    # |approx − recomputed| with recomputed = logp: 1, 1, 1/2, 1/3 → mean 17/24
    assert prox_approx_error(behav, logp, versions, torch.ones(1, 4), 3) == pytest.approx(17 / 24)
    mask = torch.tensor([[0.0, 0.0, 1.0, 1.0]])
    assert prox_approx_error(behav, logp, versions, mask, 3) == pytest.approx((0.5 + 1 / 3) / 2)


def test_approx_mode_interpolates_in_the_train_forward(model):
    """Samples of version 0, trainer at version 2: prox = behav + (logp − behav)/2, so the ratio to
    prox is exp((logp − behav)/2) at the first step."""
    batch = collate(samples())
    adv = torch.ones(batch.mask.shape) * batch.mask
    tr = Trainer(copy.deepcopy(model), settings(loss={"name": "decoupled_ppo"}, prox="approx"))
    tr.steps = 2
    logp = tr.logprobs(batch)
    m = tr.train_step(batch, adv, proximal(prox_mode("approx", 1.0), batch, None))
    want = algos.masked_mean(torch.exp((logp - batch.behav_logp) / 2), batch.mask)
    assert m["ratio/mean"] == pytest.approx(float(want), abs=1e-5)
    assert "mismatch_mean" not in m  # that is the fused path's measure


def test_prox_modes():
    assert prox_mode("approx", 0.0) == prox_mode("approx", 2.0) == "approx"
    assert prox_mode("auto", 1.0) == "fused" and prox_mode("always", 0.0) == "separate"


# ---- config ------------------------------------------------------------------------------------
def test_new_keys_reach_the_trainer_settings():
    from flash.app.settings import trainer_settings

    cfg = load_config(
        STUTTER,
        [
            "train.mini_batches=4",
            "train.update_epochs=2",
            "train.steps=5",
            "train.lr_schedule=cosine",
            "train.warmup_steps=3",
            "train.min_lr_ratio=0.1",
            "algo.recompute_prox=approx",
            "algo.measure_prox_error=true",
        ],
    )
    s = trainer_settings(cfg)
    assert (s.mini_batches, s.update_epochs, s.total_optimizer_steps) == (4, 2, 40)
    assert (s.lr_schedule, s.warmup_steps, s.min_lr_ratio, s.prox) == ("cosine", 3, 0.1, "approx")


@pytest.mark.parametrize(
    "overrides, needle",
    [
        (["train.mini_batches=0"], "train.mini_batches must be an integer >= 1"),
        (["train.update_epochs=0"], "train.update_epochs must be an integer >= 1"),
        (["train.mini_batches=129"], "train.mini_batches=129 exceeds the batch's rows"),
        (["train.mini_batches=1.5"], "train.mini_batches"),
        (["train.lr_schedule=linear"], "train.lr_schedule must be one of constant, cosine"),
        (["train.warmup_steps=-1"], "train.warmup_steps must be >= 0"),
        (["train.lr_schedule=cosine", "train.min_lr_ratio=1.5"], "train.min_lr_ratio must be in [0, 1]"),
        (["train.lr_schedule=constant", "train.min_lr_ratio=0.1"], "train.min_lr_ratio is the cosine schedule's floor"),
        (["algo.recompute_prox=aprox"], "did you mean 'approx'"),
        (["algo.measure_prox_error=true"], "algo.measure_prox_error"),
        (["async_ratio=0", "train.stream=true", "train.mini_batches=2"], "train.mini_batches: 1"),
    ],
)
def test_bad_values_are_one_line_errors_naming_the_key(overrides, needle):
    with pytest.raises(ConfigError) as err:
        load_config(STUTTER, overrides)
    assert needle in str(err.value) and "\n" not in str(err.value)


@pytest.mark.slow
@pytest.mark.margin  # the suite keeps under 45 min: k mini-batches and epochs are pinned step for step above
def test_a_run_with_four_mini_batches_steps_four_times_per_batch_clips_and_replays(tmp_path):
    """End to end (`flash run` in its own process, async): 4 optimizer steps per rollout batch, a
    clip fraction above 0 once the policy has moved within a batch, the lr reported, and `flash
    replay` finds every step's numbers again through the mini-batch loop."""
    from tests.helpers.processes import STEPS, finish, launch, read_jsonl, replay_run

    run_dir = tmp_path / "mb"
    extra = [
        "async_ratio=1",
        "algo.loss.name=decoupled_ppo",
        "train.mini_batches=4",
        "train.lr=3e-3",
        "checkpoint.every_steps=0",
        "sft.steps=120",
    ]
    finish(launch(run_dir, str(tmp_path / "cache"), [f"run_dir={run_dir}", *extra]), run_dir)
    metrics = read_jsonl(run_dir / "metrics.jsonl")
    assert len(metrics) == STEPS
    assert all(m["train/optimizer_steps"] == 4.0 for m in metrics)
    assert max(m["train/clipfrac"] for m in metrics) > 0.0
    assert all(m["train/lr"] > 0 for m in metrics)
    rc, out = replay_run(run_dir)
    assert rc == 0 and "identical" in out, out


def test_a_max_over_several_optimizer_steps_stays_a_max():
    from flash.train.updates import combine_updates

    steps = [
        {"ratio/max": 1.5, "ratio/min": 0.9, "tokens": 10.0, "clipfrac": 0.2, "grad_norm": 1.0, "skipped": 0.0},
        {"ratio/max": 1.1, "ratio/min": 0.7, "tokens": 30.0, "clipfrac": 0.4, "grad_norm": 2.0, "skipped": 0.0},
    ]
    out = combine_updates(steps, {"ratio/max": "max", "ratio/min": "min", "tokens": "sum", "clipfrac": "mean"})
    assert (out["ratio/max"], out["ratio/min"], out["tokens"]) == (1.5, 0.7, 40.0)
    assert out["clipfrac"] == pytest.approx(0.3) and out["grad_norm_last"] == 2.0 and out["optimizer_steps"] == 2.0
