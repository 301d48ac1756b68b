"""The process helpers of flash.cluster that need no Ray: where a worker imports a plugin from, and
the one reaper per driver."""

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
