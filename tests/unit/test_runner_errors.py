"""The run's last words name the actor that died, not always 'the trainer'."""

from types import SimpleNamespace

from ray.exceptions import RayActorError

from flash.app.roles import Roles

_dead_role = Roles.dead_role  # read through a stand-in: only the role handles are used


class _Handle:
    """Stands in for a Ray actor handle: only its id is read."""

    def __init__(self, hex_id: str):
        self._actor_id = SimpleNamespace(hex=lambda: hex_id)


def _run():
    engine = _Handle("e0")
    return SimpleNamespace(
        trainer=_Handle("t0"),
        critic=_Handle("c0"),
        reference=_Handle("r0"),
        engine=engine,
        replicas=[engine, _Handle("e1")],
    )


def test_dead_role_names_the_actor_the_error_names():
    r = _run()
    assert _dead_role(r, RayActorError(actor_id="t0")) == "trainer worker"
    assert _dead_role(r, RayActorError(actor_id="e1")) == "rollout engine"
    assert _dead_role(r, RayActorError(actor_id="c0")) == "critic worker"
    assert _dead_role(r, RayActorError(actor_id="r0")) == "reference worker"


def test_dead_role_defaults_to_the_trainer_when_the_error_names_no_known_actor():
    r = _run()
    r.critic = r.reference = None
    assert _dead_role(r, RayActorError()) == "trainer worker"
    assert _dead_role(r, RayActorError(actor_id="zz")) == "trainer worker"
