"""Warm starts the session's later tests need, built in one background process during the unit tier.

pytest runs one test at a time, and the unit tier (tests/unit, first in ``testpaths``) keeps one
of the machine's cores busy for a few minutes and leaves the other idle; the golden-numerics
recipes and the default recipe's learning run each built their warm start when they first ran
(~80 s of one core for the eight golden ones, ~55 s of two for the default recipe's on a 2-core
AMD EPYC). A warm start is a pure function of its cache key (``flash.train.sft.cache_key``: model,
task, SFT settings and threads), so the session builds those its selected tests use in a background
process (``python -m tests.helpers.prebuild``, niced) into the session's warm-start cache, from the
same configs the tests load; a test waits for its own before it runs (``wait``). Only a session
that runs unit tests starts the builder (there is an idle core to fill); a test whose warm start
the builder failed to build, or never got to, builds it itself as before.

The builder appends ``ok NAME`` or ``failed NAME: why`` to ``CACHE/.prebuilt`` as it goes, and writes
its output to ``CACHE/.prebuild.log``.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
DONE_FILE = ".prebuilt"
LOG_FILE = ".prebuild.log"
DEFAULT_RECIPE = "recipes/stutter.yaml"
WAIT_LIMIT_S = 900.0  # a builder stuck past this leaves the test to build its own
# the tests whose warm starts the builder knows (node ids without their parameters)
GOLDEN_TEST = "tests/integration/test_golden_numerics.py::test_recipe_reproduces_its_golden_numerics"
DEFAULT_TEST = "tests/e2e/test_default_recipe.py::test_default_recipe_learns"


@dataclass(frozen=True)
class Entry:
    """One warm start: a name for the done file, and the recipe and overrides whose config names it."""

    name: str
    recipe: str
    overrides: tuple[str, ...]


def default_recipe_overrides(ratio: float, seed: int) -> list[str]:
    """The overrides of the default recipe's learning run (tests/e2e/test_default_recipe.py)."""
    return [f"async_ratio={ratio}", f"seed={seed}", f"sft.seed={seed}"]


def golden_entry(recipe: str) -> Entry:
    from tests import golden

    return Entry(f"golden-{recipe}", f"recipes/{recipe}.yaml", tuple(golden.overrides(recipe)))


def default_recipe_entry(seed: int) -> Entry:
    # the async ratio names no part of the warm start: both ratios of one seed share it
    return Entry(f"default-seed{seed}", DEFAULT_RECIPE, tuple(default_recipe_overrides(0, seed)))


def entry_of(nodeid: str, params: dict) -> Entry | None:
    """The warm start a selected test uses, if the builder knows it (its params: the test's
    parametrization)."""
    if nodeid.startswith(f"{GOLDEN_TEST}["):
        return golden_entry(params["recipe"])
    if nodeid.startswith(f"{DEFAULT_TEST}["):
        return default_recipe_entry(params["seed"])
    return None


def plan(items: list[tuple[str, dict]]) -> list[Entry]:
    """The warm starts to prebuild for a selection of (node id, params): none unless it runs unit
    tests (the idle core the builder fills), each once, in the order the tests come."""
    if not any(nodeid.startswith("tests/unit/") for nodeid, _ in items):
        return []
    entries = (entry_of(nodeid, params) for nodeid, params in items)
    return list(dict.fromkeys(e for e in entries if e is not None))


_builder: subprocess.Popen | None = None


def start(cache_dir: str, entries: list[Entry]) -> None:
    """Start the background builder for ``entries`` (no-op for none)."""
    global _builder
    if not entries:
        return
    Path(cache_dir, DONE_FILE).write_text("")
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    with open(Path(cache_dir, LOG_FILE), "w") as log:
        _builder = subprocess.Popen(
            [sys.executable, "-m", "tests.helpers.prebuild", cache_dir, json.dumps([asdict(e) for e in entries])],
            cwd=ROOT,
            env=env,
            stdout=log,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
        )


def stop() -> None:
    """End the builder if it is still running (the session is over): SIGINT first, so the warm
    start it was building leaves no temporary directory in the cache (``flash.cache.build_once``)."""
    global _builder
    if _builder is not None and _builder.poll() is None:
        _builder.send_signal(signal.SIGINT)
        try:
            _builder.wait(10)
        except subprocess.TimeoutExpired:
            _builder.kill()
            _builder.wait()
    _builder = None


def finished(cache_dir: str) -> dict[str, str]:
    """Name -> ``ok`` or ``failed: why`` for each warm start the builder is done with."""
    path = Path(cache_dir, DONE_FILE)
    if not path.exists():
        return {}
    done = {}
    for line in path.read_text().splitlines():
        status, _, rest = line.partition(" ")
        name, _, why = rest.partition(": ")
        done[name] = status if status == "ok" else f"failed: {why}"
    return done


def wait(cache_dir: str, name: str, limit_s: float = WAIT_LIMIT_S) -> str:
    """Wait until the builder is done with ``name`` (or has exited, or was never started):
    ``ok``, ``failed: why``, or ``not prebuilt``; the caller builds it itself unless ``ok``."""
    deadline = time.monotonic() + limit_s
    while time.monotonic() < deadline:
        status = finished(cache_dir).get(name)
        if status is not None:
            return status
        if _builder is None or _builder.poll() is not None:
            return "not prebuilt"
        time.sleep(0.2)
    return "not prebuilt"


def build(cache_dir: str, entries: list[Entry]) -> None:
    """Build each entry's warm start into ``cache_dir``, recording each outcome in the done file."""
    from flash.app.config import load_config
    from flash.app.data import build_task
    from flash.app.runner import prepare_model

    for entry in entries:
        try:
            with tempfile.TemporaryDirectory() as run_dir:
                cfg = load_config(
                    str(ROOT / entry.recipe), [*entry.overrides, f"cache_dir={cache_dir}", f"run_dir={run_dir}"]
                )
                start_s = time.perf_counter()
                path = prepare_model(cfg, build_task(cfg))
            line = f"ok {entry.name}"
            print(f"{entry.name}: {path} in {time.perf_counter() - start_s:.1f} s", flush=True)
        except Exception as e:  # the test builds it itself; the reason stays in the done file
            line = f"failed {entry.name}: {type(e).__name__}: {e}".replace("\n", " ")
            print(line, flush=True)
        with open(Path(cache_dir, DONE_FILE), "a") as f:
            f.write(line + "\n")


if __name__ == "__main__":
    os.nice(10)  # the tests come first once the unit tier is over
    build(sys.argv[1], [Entry(e["name"], e["recipe"], tuple(e["overrides"])) for e in json.loads(sys.argv[2])])
