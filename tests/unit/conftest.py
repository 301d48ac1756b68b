"""The unit tier: no Ray, no run processes, each test within a CPU-time budget.

A unit test's call phase (fixtures excluded) may spend at most ``FLASH_UNIT_BUDGET_S`` seconds
(2 by default) of this process's CPU time, and must leave no Ray started; either failure names the
test and says where it belongs instead (``tests/integration``). CPU time rather than wall time, so
the budget means the same on a quiet machine and beside other jobs; the first import of a module
during the call is not charged to the test (whichever test runs first would pay for torch's or
transformers' lazy imports).
"""

from __future__ import annotations

import importlib._bootstrap as bootstrap
import os
import sys
import time
from contextlib import contextmanager

import pytest

UNIT_BUDGET_S = float(os.environ.get("FLASH_UNIT_BUDGET_S", "2"))


def over_budget(nodeid: str, cpu_s: float, budget_s: float = UNIT_BUDGET_S) -> str | None:
    """The failure message for a unit test that spent ``cpu_s`` CPU seconds, or None within budget."""
    if cpu_s <= budget_s:
        return None
    return (f"{nodeid}: {cpu_s:.2f} s of CPU, over the unit tier's {budget_s:g} s budget: "
            "make it smaller or move it to tests/integration")


def ray_started() -> bool:
    ray = sys.modules.get("ray")
    return bool(ray is not None and ray.is_initialized())


@contextmanager
def import_clock():
    """CPU seconds spent loading modules for the first time while inside (outermost loads only):
    a one-item list, read after the block."""
    spent, depth, plain = [0.0], [0], bootstrap._find_and_load

    def timed(name, import_):
        if depth[0]:
            return plain(name, import_)
        depth[0], start = 1, time.process_time()
        try:
            return plain(name, import_)
        finally:
            depth[0] = 0
            spent[0] += time.process_time() - start

    bootstrap._find_and_load = timed
    try:
        yield spent
    finally:
        bootstrap._find_and_load = plain


@pytest.hookimpl(wrapper=True)
def pytest_runtest_call(item):
    start = time.process_time()
    with import_clock() as imports:
        result = yield
    message = over_budget(item.nodeid, time.process_time() - start - imports[0])
    if message:
        pytest.fail(message, pytrace=False)
    if ray_started():
        pytest.fail(f"{item.nodeid}: started Ray; a test that needs Ray belongs in tests/integration", pytrace=False)
    return result
