"""One contract for every trainer role, at the API the controller, checkpointer and runner use.

The protocols of ``flash.train.base`` are checked first, from the classes' signatures, for every
role: the single trainer's actor (``TrainerWorker``), the FSDP2 group (``TrainerGroup``), the
simulated trainer, the reference and the critic. Then the same behaviour checks run against every
policy trainer built here on CPU: the single trainer and the simulated one in this process, the
FSDP2 group with one gloo rank in this process behind the group's handle (``LocalRay``) and with
two ranks on Ray (``slow``). A train step returns the agreed metrics as floats, a step fed in parts
too, ``get_weights`` has the model's names and shapes, ``stats`` counts busy seconds, and a
checkpoint written between steps loads back.
"""

from __future__ import annotations

import contextlib
import inspect
import math
from types import SimpleNamespace

import pytest
import ray
import torch

from flash.checkpoint import file_table
from flash.train.base import BATCH_METRICS, CRITIC_PROTOCOLS, POLICY_PROTOCOLS, REFERENCE_PROTOCOLS, STEP_METRICS
from tests.helpers.train import make_batch, settings


def role_classes() -> dict:
    from flash.train.critic import Critic
    from flash.train.reference import Reference
    from flash.train.sim_trainer import SimTrainer
    from flash.train.trainer_group import TrainerGroup
    from flash.train.worker import TrainerWorker

    return {
        "single": (TrainerWorker, POLICY_PROTOCOLS),
        "group": (TrainerGroup, POLICY_PROTOCOLS),
        "sim": (SimTrainer, POLICY_PROTOCOLS),
        "reference": (Reference, REFERENCE_PROTOCOLS),
        "critic": (Critic, CRITIC_PROTOCOLS),
    }


def protocol_methods(proto) -> list[str]:
    return sorted(n for n, v in vars(proto).items() if inspect.isfunction(v) and n[:2] != "__")


def params(fn) -> list[tuple]:
    """A method's parameters after ``self``: name, kind, default (annotations are strings here).
    Ray's ``_ray_trace_ctx`` (added in place once an actor of the class started) is not compared."""
    return [
        (p.name, p.kind, p.default)
        for p in list(inspect.signature(fn).parameters.values())[1:]
        if p.name != "_ray_trace_ctx"
    ]


# ---- the protocols -----------------------------------------------------------------------------
@pytest.mark.parametrize("name", ["single", "group", "sim", "reference", "critic"])
def test_role_class_signatures_match_the_protocols(name):
    """Each protocol's parameters, in order, then only parameters with defaults."""
    cls, protocols = role_classes()[name]
    for proto in protocols:
        assert len(protocol_methods(proto)) <= 5, proto
        for method in protocol_methods(proto):
            assert callable(getattr(cls, method, None)), f"{cls.__name__} lacks {proto.__name__}.{method}"
            want, got = params(getattr(proto, method)), params(getattr(cls, method))
            assert got[: len(want)] == want, (cls.__name__, method, got)
            assert all(default is not inspect.Parameter.empty for _, _, default in got[len(want) :]), (
                cls.__name__,
                method,
                got,
            )


def test_the_roles_beside_the_policy_satisfy_theirs_as_instances(model_dir):
    from flash.train.critic import Critic, CriticSettings
    from flash.train.reference import Reference

    reference, critic = Reference(model_dir, 0.7, 64, threads=1), Critic(model_dir, CriticSettings(), threads=1)
    assert all(isinstance(reference, p) for p in REFERENCE_PROTOCOLS)
    assert all(isinstance(critic, p) for p in CRITIC_PROTOCOLS)


# ---- behaviour, against every policy trainer built here --------------------------------------------
@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    from flash.models import TinyModelConfig
    from tests.helpers.models import save_tiny

    cfg = TinyModelConfig(
        hidden_size=64, num_layers=2, num_heads=2, num_kv_heads=2, intermediate_size=128, max_positions=64
    )
    return save_tiny(tmp_path_factory.mktemp("tiny"), cfg)


def model_shapes(model_dir) -> dict[str, tuple]:
    from flash.cluster import load_model

    return {k: tuple(v.shape) for k, v in load_model(model_dir).state_dict().items()}


class LocalRay:
    """The few Ray calls ``flash.train.trainer_group`` and ``fsdp_rank`` make, run in this process:
    an actor is the object itself, a call's result its own reference. A one-rank group then runs the
    group's and the rank's real code without starting Ray (its two-rank form on Ray is the ``slow`` case)."""

    exceptions = ray.exceptions

    class _Handle:
        def __init__(self, obj):
            self._obj = obj

        def __getattr__(self, method):
            return SimpleNamespace(remote=lambda *args: getattr(self._obj, method)(*args))

    def remote(self, cls):
        start = lambda *args: self._Handle(cls(*args))
        return SimpleNamespace(options=lambda **kw: SimpleNamespace(remote=start))

    @staticmethod
    def get(refs):
        return refs

    @staticmethod
    def put(value):
        return value

    @staticmethod
    def wait(refs, num_returns=1):
        return refs[:num_returns], refs[num_returns:]

    @staticmethod
    def get_runtime_context():
        return SimpleNamespace(get_node_id=lambda: "local")


@contextlib.contextmanager
def local_group(model_dir):
    """A one-rank ``TrainerGroup`` in this process (``LocalRay``); its process group ends after."""
    import torch.distributed as dist

    from flash.cluster import pinned_threads
    from flash.train import fsdp_rank, trainer_group
    from flash.train.fsdp import GroupSettings

    with pytest.MonkeyPatch.context() as mp, pinned_threads(torch.get_num_threads()):
        mp.setattr(trainer_group, "ray", LocalRay())
        mp.setattr(fsdp_rank, "ray", LocalRay())
        try:
            yield trainer_group.TrainerGroup(
                model_dir, settings(), GroupSettings(workers=1), seed=0, threads=1, plugins=[]
            )
        finally:
            if dist.is_initialized():
                dist.destroy_process_group()


@pytest.fixture(
    scope="module",
    params=[
        "single",
        "sim",
        "group1",
        # its two rank processes take ~2 min to start on a loaded 2-core machine
        pytest.param("group2", marks=pytest.mark.slow),
    ],
)
def trainer(request, model_dir):
    """(a fresh policy trainer, the names and shapes its ``get_weights`` must have)."""
    from flash.cluster import pinned_threads

    if request.param == "group1":
        with local_group(model_dir) as group:
            yield group, model_shapes(model_dir)
    elif request.param == "single":
        from flash.train.worker import TrainerWorker

        with pinned_threads(torch.get_num_threads()):  # the worker sets its own count
            yield TrainerWorker(model_dir, settings(), seed=0, threads=1, plugins=[]), model_shapes(model_dir)
    elif request.param == "sim":
        from flash.sim.config import SimConfig
        from flash.train.sim_trainer import WEIGHT_NAME, SimTrainer

        yield SimTrainer(SimConfig(), settings()), {WEIGHT_NAME: (1,)}
    else:
        import ray

        from flash.cluster import init_ray
        from flash.train.fsdp import GroupSettings
        from flash.train.trainer_group import TrainerGroup

        init_ray(None, num_cpus=2)
        group = TrainerGroup(model_dir, settings(), GroupSettings(workers=2), seed=0, threads=2, plugins=[])
        yield group, model_shapes(model_dir)
        for rank in group.ranks:
            ray.kill(rank)
        ray.shutdown()


def floats(metrics: dict, keys) -> bool:
    return set(keys) <= set(metrics) and all(type(metrics[k]) is float and math.isfinite(metrics[k]) for k in keys)


def test_policy_trainer_is_every_protocol(trainer):
    assert all(isinstance(trainer[0], p) for p in POLICY_PROTOCOLS), type(trainer[0]).__name__


def test_logprobs_and_a_train_step_give_the_agreed_metrics_as_floats(trainer):
    tr = trainer[0]
    batch, adv = make_batch()
    prox = tr.logprobs(batch)
    assert prox.shape == batch.mask.shape and bool(torch.isfinite(prox).all())
    busy = tr.stats()["busy_s"]
    metrics = tr.train_step(batch, adv, prox)
    assert floats(metrics, BATCH_METRICS), metrics
    assert metrics["optimizer_steps"] == 1.0 and metrics["skipped"] == 0.0
    stats = tr.stats()
    assert type(stats["busy_s"]) is float and stats["busy_s"] > busy


def test_a_step_fed_in_parts_gives_the_agreed_metrics_as_floats(trainer):
    tr = trainer[0]
    batch, adv = make_batch(seed=1)
    parts = [(batch.rows(lo, hi), lo, hi) for lo, hi in ((0, 3), (3, 7))]
    tr.begin_step()
    weights = [tr.accumulate(part, adv[lo:hi, : part.mask.shape[1]], part.behav_logp) for part, lo, hi in parts]
    assert all(type(w) is float and w > 0 for w in weights), weights
    assert floats(tr.finish_step(), STEP_METRICS)


def test_get_weights_has_the_models_names_and_shapes(trainer):
    tr, shapes = trainer
    assert {k: tuple(v.shape) for k, v in tr.get_weights().items()} == shapes


def test_a_checkpoint_between_steps_loads_back_with_its_step_count(trainer, tmp_path):
    tr = trainer[0]
    steps = int(tr.stats()["steps"])
    before = {k: v.clone() for k, v in tr.get_weights().items()}
    tr.checkpoint_snapshot()
    tr.checkpoint_write(str(tmp_path))
    batch, adv = make_batch(seed=2)
    tr.train_step(batch, adv, tr.logprobs(batch))
    assert int(tr.stats()["steps"]) == steps + 1
    assert tr.load_checkpoint(str(tmp_path), file_table(tmp_path)) == steps and int(tr.stats()["steps"]) == steps
    after = tr.get_weights()  # the simulated trainer's one tensor is its step count
    assert all(torch.equal(before[k], after[k]) for k in before)
