"""Test-session environment, set before any test module imports torch or starts Ray.

OpenMP's default spin-waiting collapses throughput when the cores are shared (CI runs beside
other jobs on 2 cores): the `flash` CLI sets ``OMP_WAIT_POLICY=PASSIVE`` for the same reason, and
tests that train in-process (warm starts, controller loops) or start Ray workers (which inherit the
driver's environment) need it as much. Ray's usage-stats prompt is off so no test waits on it.
Checkpoint signing keys (flash.checkpoint_trust) go to a directory of this session, not the
user's key store.
"""

import os
import sys
import tempfile

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
os.environ.setdefault("FLASH_KEY_DIR", tempfile.mkdtemp(prefix="flash-test-keys-"))

import pytest  # noqa: E402  (after the environment above: it must precede torch and Ray)


@pytest.fixture(scope="module", autouse=True)
def no_ray_across_modules():
    """Each test module starts without Ray: one that leaves it started (a fixture or test that
    never shuts it down) does not hand its cluster, or the unit tier's no-Ray check, to the next."""
    yield
    ray = sys.modules.get("ray")
    if ray is not None and ray.is_initialized():
        ray.shutdown()


@pytest.fixture(scope="module")
def ray_local():
    """A local Ray on 2 CPUs for one test module (started once, shut down after its last test)."""
    import ray

    from flash.cluster import init_ray

    init_ray(None, num_cpus=2)
    yield
    ray.shutdown()


@pytest.fixture(scope="session")
def warm_cache(tmp_path_factory):
    """One warm-start cache for the whole session, empty at its start (``FLASH_TEST_CACHE``: a
    directory to reuse across local sessions). A warm start is a pure function of its cache key
    (the model, task, SFT settings and SFT threads; ``flash.train.sft``), so modules asking for
    the same one share it instead of each building it again."""
    return os.environ.get("FLASH_TEST_CACHE") or str(tmp_path_factory.mktemp("warm_cache"))


@pytest.fixture(scope="session", autouse=True)
def prebuilt_warm_starts(request, warm_cache):
    """The warm starts the selected tests use, built in the background while the unit tier runs
    (``tests.helpers.prebuild``); each such test waits for its own."""
    from tests.helpers import prebuild

    selected = [(item.nodeid, getattr(getattr(item, "callspec", None), "params", {})) for item in request.session.items]
    prebuild.start(warm_cache, prebuild.plan(selected))
    yield
    prebuild.stop()


MARGIN_TIMEOUT_S = 3600  # a margin run may build a cold warm start first (the calculator's: ~20 min)


@pytest.hookimpl(tryfirst=True)  # before `-m` deselects by marker
def pytest_collection_modifyitems(config, items):
    """The tests ``tests/extended.txt`` lists are marked ``extended`` (left out of the default run);
    margin runs (whole learning runs) get a longer per-test limit than the default suite's."""
    from tests.helpers.tiers import extended_ids

    extended = set(extended_ids())
    for item in items:
        if item.nodeid in extended:
            item.add_marker(pytest.mark.extended)
        if item.get_closest_marker("margin") and not item.get_closest_marker("timeout"):
            item.add_marker(pytest.mark.timeout(MARGIN_TIMEOUT_S))
