"""Polling a condition a background thread brings about, failing by name at a deadline."""

from __future__ import annotations

import time
from typing import Callable


def wait_until(pred: Callable[[], bool], timeout: float = 5.0, what: str = "condition") -> None:
    end = time.monotonic() + timeout
    while not pred():
        assert time.monotonic() < end, f"{what} not reached within {timeout}s"
        time.sleep(0.01)
