"""The process helpers of flash.cluster that need no Ray: where a worker imports a plugin from, the
one reaper per driver, and the wait for started roles (over a stand-in ``ray``)."""

from __future__ import annotations

import os

import flash
from flash import cluster


def test_plugin_paths_name_the_directory_a_worker_imports_each_module_from(tmp_path, monkeypatch):
    (tmp_path / "my_plugin_mod.py").write_text("X = 1\n")
    package = tmp_path / "pkgs" / "my_plugin_pkg"
    package.mkdir(parents=True)
    (package / "__init__.py").write_text("")
    (package / "losses.py").write_text("")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.syspath_prepend(str(tmp_path / "pkgs"))
    # a module: its own directory; a package (named by a submodule): the directory above it
    assert cluster.plugin_paths(["my_plugin_mod", "my_plugin_pkg.losses"]) == [str(tmp_path), str(tmp_path / "pkgs")]
    assert cluster.plugin_paths(["flash.placement"]) == [os.path.dirname(os.path.dirname(flash.__file__))]
    assert cluster.plugin_paths(["no_such_module_anywhere"]) == []  # nothing to add: the import fails later
    assert cluster.plugin_paths([]) == []


def test_a_driver_starts_its_reaper_once(monkeypatch):
    running = object()  # the reaper this driver already started
    monkeypatch.setattr(cluster, "_REAPER", running)
    cluster.start_reaper()
    assert cluster._REAPER is running  # no second watcher


def fake_ray_wait(monkeypatch):
    """``ray.wait`` over scripted ``stats`` answers: a call answering "late" has not answered yet."""
    from types import SimpleNamespace

    def wait(refs, num_returns, timeout):
        assert num_returns == len(refs) and timeout > 0
        late = [r for r in refs if r() == "late"]
        return [r for r in refs if r not in late], late

    monkeypatch.setattr(cluster, "ray", SimpleNamespace(wait=wait, get=lambda refs: [r() for r in refs]))


def test_roles_that_do_not_answer_in_time_are_named_with_the_knob(monkeypatch):
    import pytest

    from flash.errors import RolesNotReady
    from tests.helpers.actors import ScriptedActor

    fake_ray_wait(monkeypatch)
    engine, trainer, reference = ScriptedActor("e"), ScriptedActor("t"), ScriptedActor("r")
    trainer.answers["stats"] = reference.answers["stats"] = "late"
    with pytest.raises(
        RolesNotReady, match=r"^trainer, reference did not answer within 90 s .*resources\.ready_timeout_s"
    ):
        cluster.wait_ready(engine, trainer, reference, timeout=90, names=["engine", "trainer", "reference"])
    with pytest.raises(RolesNotReady, match=r"^actor 1 did not answer"):  # unnamed: by position
        cluster.wait_ready(engine, trainer, timeout=90)
    trainer.answers["stats"] = reference.answers["stats"] = {}
    assert cluster.wait_ready(engine, trainer, reference, timeout=90) >= 0
