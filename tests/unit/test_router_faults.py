"""Router's fault paths in-process: its replicas scripted, ``ray`` resolving their calls at once.

A replica whose call raises is named (``ReplicaError`` with its index and kind) and, with fault
recovery on, taken out of service at once; the live replicas' outputs taken in the same poll are
handed out by the next one, and fan-outs skip the quarantined replica.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import ray as real_ray
from ray.exceptions import GetTimeoutError, RayActorError

import flash.engine.router as router_mod
from flash.engine.router import ReplicaError, Router, failure_kind
from tests.helpers.actors import ScriptedActor


@pytest.fixture
def fake_ray(monkeypatch):
    monkeypatch.setattr(
        router_mod,
        "ray",
        SimpleNamespace(
            get=lambda ref: ref(),
            wait=lambda refs, num_returns, timeout: (refs[:num_returns], refs[num_returns:]),
            exceptions=real_ray.exceptions,
            ObjectRef=object,
        ),
    )


def test_failure_kinds():
    assert [failure_kind(e) for e in (RayActorError(), GetTimeoutError(), ValueError())] == ["died", "hung", "broken"]


def test_a_dead_replica_is_named_quarantined_and_the_others_outputs_kept(fake_ray):
    out = SimpleNamespace(request_id="r0")
    outputs = [out]
    replicas = [ScriptedActor("r0"), ScriptedActor("r1")]
    replicas[0].answers["get_finished"] = lambda *args: [outputs.pop(0)] if outputs else []
    replicas[1].always["get_finished"] = RayActorError()
    router = Router(replicas, hang_timeout_s=5.0)
    with pytest.raises(ReplicaError, match=r"engine replica 1 failed in get_finished: RayActorError") as info:
        router.get_finished(0.1)
    assert (info.value.replica, info.value.kind) == (1, "died") and router.balancer.down == {1}
    assert router.get_finished(0.1) == [out]  # replica 0's output, taken in the failed poll
    router.pause("continue")  # out of service: the fan-out skips it
    assert replicas[0].names() == ["get_finished", "get_finished", "pause"] and replicas[1].names() == ["get_finished"]
    assert router.replica_down(1) == [] and router.replica_up(1) is None and router.balancer.down == set()
