"""The unit tier's budget: what a test spent, and the message when it is over."""

from __future__ import annotations

import importlib._bootstrap as bootstrap
import os
import sys
import time
from contextlib import contextmanager
from pathlib import Path

UNIT_BUDGET_S = float(os.environ.get("FLASH_UNIT_BUDGET_S", "2"))
EXTENDED_LIST = Path(__file__).resolve().parents[1] / "extended.txt"


def extended_ids(path: Path = EXTENDED_LIST) -> list[str]:
    """The node ids the extended tier lists (``tests/extended.txt``: one per line, ``#`` comments)."""
    lines = (line.split("#", 1)[0].strip() for line in path.read_text().splitlines())
    return [line for line in lines if line]


def over_budget(nodeid: str, cpu_s: float, budget_s: float = UNIT_BUDGET_S) -> str | None:
    """The failure message for a unit test that spent ``cpu_s`` CPU seconds, or None within budget."""
    if cpu_s <= budget_s:
        return None
    return (
        f"{nodeid}: {cpu_s:.2f} s of CPU, over the unit tier's {budget_s:g} s budget: "
        "make it smaller or move it to tests/integration"
    )


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
