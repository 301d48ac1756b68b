"""The frozen reference policy for a KL penalty, as the trainer's own copy or as a placed role.

The two places must give the same training: the reference role's logprobs equal the local copy's,
a step fed them equals a step that computes them, with one optimizer step or several, and a whole
synchronous run with a placed ``reference`` worker trains exactly the losses of one without.
"""

import pytest
import torch

from flash.app.config import load_config
from flash.errors import ConfigError
from flash.train.batch import collate
from flash.train.reference import Reference
from flash.train.trainer import Trainer
from tests.helpers.processes import read_jsonl, recipe_summary, recipe_warm_start_base
from tests.helpers.train import toy_model, toy_samples, toy_settings

KL = {"name": "vanilla", "kl_coef": 0.5, "kl_estimator": "k3"}


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("ref_model")
    toy_model().save_pretrained(path)
    return str(path)


def data():
    batch = collate(toy_samples(n=6))
    adv = torch.randn(batch.mask.shape, generator=torch.Generator().manual_seed(3)) * batch.mask
    return batch, adv


def trainer(model_dir, place, **kw):
    from flash.cluster import load_model

    return Trainer(load_model(model_dir), toy_settings(loss=KL, reference=place, **kw), seed=0)


def test_the_role_computes_the_local_copys_logprobs(model_dir):
    batch, _ = data()
    ref = Reference(model_dir, temperature=0.7, micro_batch_size=4)  # 4 < 6 rows: micro-batched
    local = trainer(model_dir, "local")
    got, want = ref.logprobs(batch), local.logprobs(batch, local.ref_model)
    assert torch.equal(got, want)
    assert float(got.abs().sum()) > 0 and torch.all(got[batch.mask == 0] == 0)
    assert not any(p.requires_grad for p in ref.model.parameters())


@pytest.mark.parametrize("mini_batches", [1, 3])
def test_a_step_fed_the_roles_logprobs_equals_the_local_step(model_dir, mini_batches):
    """Two steps each, so the second one's KL is against a policy that has moved (a nonzero KL)."""
    batch, adv = data()
    ref = Reference(model_dir, temperature=0.7, micro_batch_size=64).logprobs(batch)
    local = trainer(model_dir, "local", mini_batches=mini_batches)
    placed = trainer(model_dir, "role", mini_batches=mini_batches)
    assert local.ref_model is not None and placed.ref_model is None  # the role holds one model
    for _ in range(2):
        a = local.train_step(batch, adv, batch.behav_logp)
        b = placed.train_step(batch, adv, batch.behav_logp, ref)
        assert a["loss"] == b["loss"] and a["kl_ref"] == b["kl_ref"]
    assert b["kl_ref"] > 1e-6 and b["optimizer_steps"] == mini_batches
    for p, q in zip(local.model.parameters(), placed.model.parameters(), strict=True):
        assert torch.equal(p, q)


def test_a_role_trainer_without_the_roles_logprobs_says_what_is_missing(model_dir):
    batch, adv = data()
    with pytest.raises(ValueError, match="kl_coef=0.5 needs LossInputs.ref_logp"):
        trainer(model_dir, "role").train_step(batch, adv, batch.behav_logp)


def test_a_reference_worker_nothing_reads_is_refused_and_at_most_one_is_placed():
    with pytest.raises(ConfigError, match="no loss reads it .*set algo.loss.kl_coef > 0"):
        load_config("recipes/stutter.yaml", ["placement.roles.reference.num_workers=1"])
    with pytest.raises(ConfigError, match="at most 1 reference worker"):
        load_config("recipes/stutter.yaml", ["placement.roles.reference.num_workers=2", "algo.loss.kl_coef=0.1"])
    cfg = load_config("recipes/stutter.yaml", ["placement.roles.reference.num_workers=1", "algo.loss.kl_coef=0.1"])
    assert cfg.placement.roles.reference.num_workers == 1


@pytest.mark.slow  # two short synchronous runs of the default recipe, each in its own process
@pytest.mark.margin  # the suite keeps under 45 min: the role's logprobs and a step fed them are pinned above
def test_a_run_with_a_placed_reference_trains_the_local_references_losses(tmp_path, warm_cache):
    """Synchronous runs are deterministic for their seeds, so the placed reference must reproduce
    the local copy's run step for step: the same losses and KL, and its own timed phase. Both runs
    start from the default recipe's warm start, whose groups mix right and wrong answers: a policy
    whose every group scored alike would get no gradient (the KL's own is zero where the policy is
    the reference) and stay on the reference, and the comparison would hold for a role never read."""
    kl = ["async_ratio=0", "train.steps=5", "algo.loss.kl_coef=0.2", "tracking.progress=false"]
    runs = {}
    for name, extra in (("local", []), ("role", ["placement.roles.reference.num_workers=1"])):
        run_dir = tmp_path / name
        s = recipe_summary(run_dir, warm_cache, "recipes/stutter.yaml", [*recipe_warm_start_base(), *kl, *extra])
        assert s["steps"] == 5
        runs[name] = read_jsonl(run_dir / "metrics.jsonl")
    for a, b in zip(runs["local"], runs["role"], strict=True):
        assert a["train/loss"] == b["train/loss"] and a["train/kl_ref"] == b["train/kl_ref"]
        assert "time/reference" in b and "time/reference" not in a
    kls = [m["train/kl_ref"] for m in runs["role"]]
    assert kls[0] == 0.0 and max(kls) > 0.01, kls  # on the reference at step 1, off it once steps moved it
