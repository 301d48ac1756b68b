"""EngineClient's recovery, without Ray: scripted engine actors behind an in-process ``ray``.

Each stand-in actor answers its methods (``pid`` its process id, ``health`` True, anything else
the method's name) or raises the faults a test queues for a method; ``ray.kill`` restarts it under
a new pid, as Ray does with ``max_restarts``. The tests follow one fault each way it can arrive (a
dead actor, a hung one, a broken generation thread, a failed push wrapped as ``EngineFault``), on
one engine and on a replica behind a router, and read what the recovery did: the calls each actor
got, the kills, the fault event, the requeue, and the error that stops the run when it cannot.
"""

from __future__ import annotations

import threading
from types import SimpleNamespace

import pytest
from ray.exceptions import GetTimeoutError, RayActorError

import flash.engine.client as engine_client
from flash.engine.client import EngineClient, EngineFailed, EngineFault
from flash.engine.loop import EngineLoopError
from flash.engine.router import ReplicaError
from tests.helpers.actors import ScriptedActor as Actor


class Weights:
    """An object ref of pushed weights (``ray.ObjectRef`` of the in-process ``ray``)."""

    def __init__(self, name: str):
        self.name = name

    def __repr__(self):
        return f"Weights({self.name})"


@pytest.fixture
def fake_ray(monkeypatch):
    """``ray.get`` resolves a stand-in's call in-process (its timeout recorded); ``ray.kill``
    restarts the actor under the next pid."""
    ns = SimpleNamespace(timeouts=[], killed=[], ObjectRef=Weights)

    def get(ref, timeout=None):
        ns.timeouts.append(timeout)
        return ref()

    def kill(actor, no_restart=True):
        assert no_restart is False  # Ray must restart it
        ns.killed.append(actor.name)
        actor.process += 1

    ns.get, ns.kill = get, kill
    monkeypatch.setattr(engine_client, "ray", ns)
    return ns


def client_of(engine, max_restarts=2, replicas=None, **kw):
    warnings: list[str] = []
    client = EngineClient(
        engine,
        hang_timeout_s=kw.pop("hang_timeout_s", 5.0),
        max_restarts=max_restarts,
        warn=warnings.append,
        replicas=replicas,
        **kw,
    )
    client.events_seen = []
    client.on_event = client.events_seen.append
    return client, warnings


PUSH = [("pause", "continue"), ("update_weights", "w", 7), ("resume",)]


def test_a_dead_engine_is_waited_for_given_the_pushed_weights_and_its_requests_requeued(fake_ray):
    engine = Actor("engine").fail("stats", RayActorError()).fail("health", RayActorError())
    client, warnings = client_of(engine)
    client.pushed(Weights("w7"), 7)
    client.requeue = lambda: 3
    assert client.call("stats") == "stats"  # the call is asked again of the new incarnation

    assert engine.calls[4][1].name == "w7"  # the object ref last pushed, as it was
    assert [c if c[0] != "update_weights" else ("update_weights", "w", c[2]) for c in engine.calls] == [
        ("stats",),
        ("health",),
        ("health",),
        *PUSH,
        ("pid",),
        ("stats",),
    ]
    assert fake_ray.killed == []  # a dead actor is restarted by Ray itself
    (event,) = client.events_seen
    assert event["recovery_s"] >= 0.2  # one wait for the restart between the two health probes
    assert {k: event[k] for k in ("event", "kind", "error", "requeued", "version", "replica", "pid")} == {
        "event": "engine_fault",
        "kind": "died",
        "error": "RayActorError",
        "requeued": 3,
        "version": 7,
        "replica": 0,
        "pid": 100,
    }
    assert (client.epoch, client.faults, client.restarts) == (1, 1, 1)
    assert client.metrics() == {"faults/engine": 1.0, "faults/engine_recovery_s": event["recovery_s"]}
    assert warnings == [
        "flash: rollout engine died (RayActorError); restarting it and requeueing its requests "
        "(faults counted in faults/engine, logged once)"
    ]


def test_a_hung_then_a_broken_engine_are_killed_and_the_third_fault_names_the_knob(fake_ray):
    engine = Actor("engine").fail("get_finished", GetTimeoutError(), EngineLoopError("loop died"))
    client, warnings = client_of(engine, max_restarts=2)
    fetched = []
    client.pushed(lambda: fetched.append("fetched") or Weights("w3"), 3)  # fetched at each restart only
    assert fetched == []
    assert client.poll(0.5) == "get_finished"
    assert fake_ray.timeouts[0] == 0.5 + 5.0  # the poll's own timeout past which the engine is hung
    assert [e["kind"] for e in client.events_seen] == ["hung", "broken"]
    assert fake_ray.killed == ["engine", "engine"]  # hung: killed at once; broken: after the probe
    assert [e["pid"] for e in client.events_seen] == [101, 102] and fetched == ["fetched", "fetched"]
    assert engine.names().count("health") == 3  # broken's probe, then one per restart
    assert len(warnings) == 1 and client.epoch == 2

    engine.fail("get_finished", RayActorError())
    with pytest.raises(
        EngineFailed,
        match=r"rollout engine died again after 2 restarts "
        r"\(rollout.max_engine_restarts=2\); last error: RayActorError",
    ):
        client.poll(0.5)
    assert (client.faults, client.epoch, fake_ray.killed) == (3, 2, ["engine", "engine"])  # nothing killed


@pytest.mark.parametrize(
    "health, kind, killed", [(RayActorError(), "died", []), (ValueError("weights half loaded"), "broken", ["engine"])]
)
def test_a_failed_push_is_probed_died_or_broken(fake_ray, health, kind, killed):
    """An ``EngineFault`` names no kind: the engine's ``health`` tells a dead actor from a failing one."""
    engine = Actor("engine").fail("health", health)
    client, _ = client_of(engine)
    pushes = []

    def push():
        pushes.append(client.epoch)
        if len(pushes) == 1:
            raise EngineFault("push failed")
        return "pushed"

    assert client.run(push, exclusive=True) == "pushed"
    assert pushes == [0, 1] and fake_ray.killed == killed
    assert [(e["kind"], e["error"]) for e in client.events_seen] == [(kind, "EngineFault")]


def test_a_fault_another_caller_already_recovered_is_not_recovered_again(fake_ray):
    engine = Actor("engine").fail("stats", GetTimeoutError())
    client, _ = client_of(engine)
    client.call("stats")
    calls = len(engine.calls)
    client.recover([0], GetTimeoutError())  # read before the first recovery moved the epoch
    assert (client.faults, client.epoch, fake_ray.killed, len(engine.calls)) == (1, 1, ["engine"], calls)


def test_an_engine_that_does_not_come_back_stops_the_run(fake_ray):
    engine = Actor("engine").fail("stats", RayActorError())
    engine.always["health"] = RayActorError()
    client, _ = client_of(engine, start_timeout_s=0.3)
    with pytest.raises(
        EngineFailed,
        match=r"rollout engine did not come back within 0s after it failed "
        r"\(RayActorError.*last error: RayActorError",
    ):
        client.call("stats")
    assert engine.names().count("health") >= 2 and client.epoch == 0


def test_another_actors_death_is_no_engine_fault(fake_ray):
    """The trainer dying while the engine waits for its weights stops the run: no restart."""
    engine = Actor("engine")
    engine._actor_id = SimpleNamespace(hex=lambda: "e1")
    engine.fail("update_weights", RayActorError(actor_id="t1"))
    client, _ = client_of(engine)
    with pytest.raises(RayActorError):
        client.call("update_weights", "w", 1)
    assert client.faults == 0 and engine.names() == ["update_weights"]


# ---- replicas behind a router --------------------------------------------------------------
def router_of(n=2):
    router = Actor("router", pid=50)
    router.answers["replica_down"] = lambda i: [f"held{i}a", f"held{i}b"]
    return router, [Actor(f"replica{i}", pid=200 + 10 * i) for i in range(n)]


def recovery_threads(i: int) -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name == f"recover-replica{i}"]


def test_a_dead_replica_recovers_in_the_background_while_the_others_serve_on(fake_ray):
    router, replicas = router_of()
    router.fail(
        "get_finished",
        ReplicaError("engine replica 1 failed in get_finished", 1, "died"),
        ReplicaError("engine replica 1 failed in get_finished", 1, "died"),
    )
    router.answers["get_finished"] = lambda timeout: ["out-a", "out-b"]
    gate = threading.Event()
    replicas[1].answers["health"] = lambda: gate.wait(10.0)  # the new process starts up meanwhile
    client, _ = client_of(router, replicas=replicas)
    client.pushed(Weights("w2"), 2)
    requeued = []
    client.requeue = lambda ids: requeued.append(ids) or len(ids)

    assert client.poll(0.2) == []
    (worker,) = recovery_threads(1)  # waiting for the new process
    assert client.poll(0.2) == []  # the same replica again: its recovery is under way, no second one
    assert client.poll(0.2) == ["out-a", "out-b"]  # replica 0's outputs, during the recovery
    gate.set()
    worker.join(5.0)
    assert fake_ray.timeouts[0] == 0.2 + 30.0 + 5.0  # a router poll answers within timeout + 5 s

    assert requeued == [["held1a", "held1b"]]  # only what replica 1 held, once
    assert [c for c in router.calls if c[0] != "get_finished"] == [("replica_down", 1), ("replica_up", 1)]
    assert replicas[0].calls == [] and [c[0] for c in replicas[1].calls] == [
        "health",
        "pause",
        "update_weights",
        "resume",
        "pid",
    ]
    (event,) = client.events_seen
    assert (event["kind"], event["replica"], event["requeued"], event["pid"], event["outputs_meanwhile"]) == (
        "died",
        1,
        2,
        210,
        2,
    )
    assert client.epochs == [0, 1] and client.epoch == 1 and fake_ray.killed == []


def test_a_replica_recovery_that_fails_stops_the_run_at_the_next_poll(fake_ray):
    router, replicas = router_of()
    router.fail("get_finished", ReplicaError("engine replica 0 failed in get_finished", 0, "broken"))
    replicas[0].always["health"] = GetTimeoutError()
    client, _ = client_of(router, replicas=replicas, start_timeout_s=0.3)
    assert client.poll(0.2) == []
    for worker in recovery_threads(0):
        worker.join(5.0)
    assert fake_ray.killed == ["replica0"]  # broken: killed, then never answered
    with pytest.raises(EngineFailed, match="did not come back within 0s"):
        client.poll(0.2)
    assert client.epochs == [0, 0] and client.faults == 1


def test_a_push_failure_behind_the_router_recovers_the_replica_that_does_not_answer(fake_ray):
    router, replicas = router_of()
    replicas[1].fail("health", RayActorError())
    client, _ = client_of(router, replicas=replicas)
    client.requeue = lambda ids: len(ids)
    attempts = []

    def push():
        attempts.append(client.epochs[:])
        if len(attempts) == 1:
            raise EngineFault("push to the router failed")
        return "pushed"

    assert client.run(push, exclusive=True) == "pushed"
    assert attempts == [[0, 0], [0, 1]]
    assert [(e["kind"], e["replica"], e["error"], e["requeued"]) for e in client.events_seen] == [
        ("died", 1, "ReplicaError", 2)
    ]
    assert router.calls == [("replica_down", 1), ("replica_up", 1)]


def test_a_fault_no_replica_explains_stops_the_run(fake_ray):
    router, replicas = router_of()
    client, _ = client_of(router, replicas=replicas, hang_timeout_s=0.05)
    with pytest.raises(
        EngineFailed,
        match=r"rollout engine fault \(EngineFault\('push failed'\)\) and every "
        r"replica answers; stopping",
    ):
        client.recover([0, 0], EngineFault("push failed"))
    assert [c[0] for r in replicas for c in r.calls] == ["health", "health"] and client.faults == 0


def test_a_submit_fault_leaves_the_resubmission_to_the_recovery(fake_ray):
    router, replicas = router_of()
    router.fail(
        "submit",
        GetTimeoutError(),  # the router itself did not answer: submit again
        ReplicaError("engine replica 0 failed in submit", 0, "died"),
    )
    client, _ = client_of(router, replicas=replicas)
    requeued = []
    client.requeue = lambda ids: requeued.append(ids) or len(ids)
    client.submit(["r1", "r2"])
    assert router.names() == ["submit", "submit", "replica_down", "replica_up"]
    assert requeued == [["held0a", "held0b"]] and client.epochs == [1, 0]
    assert fake_ray.timeouts[:2] == [5.0, 5.0]  # a submit answers at once: past the hang timeout it is hung


def test_a_fault_read_before_another_replicas_recovery_is_done_with(fake_ray):
    """A push that failed while another caller recovered a replica: retried, nothing probed."""
    router, replicas = router_of()
    client, _ = client_of(router, replicas=replicas)
    client.epochs = [0, 1]  # replica 1 came back since the push began
    client.recover([0, 0], EngineFault("push failed"))
    assert replicas[0].calls == replicas[1].calls == [] and client.faults == 0


@pytest.mark.parametrize("use", ["poll", "submit"])
def test_other_errors_behind_the_router_are_raised_as_they_are(fake_ray, use):
    router, replicas = router_of()
    router.fail("get_finished", ValueError("bad timeout")).fail("submit", ValueError("bad timeout"))
    client, _ = client_of(router, replicas=replicas)
    with pytest.raises(ValueError, match="bad timeout"):
        client.poll(0.2) if use == "poll" else client.submit([])
    assert client.faults == 0 and router.names() == [{"poll": "get_finished"}.get(use, use)]
