"""The unit tier's budget: what a test spent, and the message when it is over."""

from __future__ import annotations

import importlib._bootstrap as bootstrap
import os
import sys
import time
from contextlib import contextmanager

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
