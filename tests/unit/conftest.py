"""The unit tier: no Ray, no run processes, each test within a CPU-time budget.

A unit test's call phase (fixtures excluded) may spend at most ``FLASH_UNIT_BUDGET_S`` seconds
(2 by default) of this process's CPU time, and must leave no Ray started; either failure names the
test and says where it belongs instead (``tests/integration``). CPU time rather than wall time, so
the budget means the same on a quiet machine and beside other jobs; the first import of a module
during the call is not charged to the test (whichever test runs first would pay for torch's or
transformers' lazy imports). A test that checks the whole tree (every file's functions) may state
a larger budget of its own with ``@pytest.mark.cpu_budget(seconds)``.
"""

from __future__ import annotations

import sys
import time

import pytest

from tests.helpers.tiers import UNIT_BUDGET_S, import_clock, over_budget, ray_started


@pytest.hookimpl(wrapper=True)
def pytest_runtest_call(item):
    start = time.process_time()
    with import_clock() as imports:
        result = yield
    declared = item.get_closest_marker("cpu_budget")  # a whole-tree check states its own, with a reason
    budget = float(declared.args[0]) if declared else UNIT_BUDGET_S
    message = over_budget(item.nodeid, time.process_time() - start - imports[0], budget)
    if message:
        pytest.fail(message, pytrace=False)
    return result


@pytest.hookimpl(wrapper=True)
def pytest_runtest_teardown(item, nextitem):
    """After the test's fixtures are gone (a monkeypatched ``ray.is_initialized`` undone with them)."""
    result = yield
    if ray_started():
        sys.modules["ray"].shutdown()  # the failure stays this test's: the next one starts clean
        pytest.fail(f"{item.nodeid}: started Ray; a test that needs Ray belongs in tests/integration", pytrace=False)
    return result


@pytest.fixture
def one_torch_thread():
    """Tiny models gain nothing from intra-op threads, and on a shared 2-core machine OpenMP
    threads that wait for a busy core make a test ~5x slower: one thread for the test."""
    import torch

    prev = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(prev)
