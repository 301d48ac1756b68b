"""The code sandbox's tests: finding the processes of sandbox calls on the host, and the autouse
fixture that fails a test when one of them outlives its call."""

import os
import time
from pathlib import Path

import pytest

from flash.rewards import forkserver


def sandbox_processes() -> list[int]:
    """Host pids of sandbox calls: a working directory that is a sandbox directory, or a parent
    that is a fork server (each call's mirror process)."""
    servers = {srv.proc.pid for srv in forkserver._SERVERS.values()}
    pids = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                ppid = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
                if ppid in servers or "flash-sandbox-" in os.readlink(entry / "cwd"):
                    pids.append(int(entry.name))
            except (OSError, IndexError, ValueError):
                pass
    return pids


@pytest.fixture(autouse=True)
def host_untouched():
    before = set(sandbox_processes())
    yield
    deadline = time.monotonic() + 10.0  # the kernel may take a moment to reap a pid namespace (longer under load)
    while set(sandbox_processes()) - before and time.monotonic() < deadline:
        time.sleep(0.05)
    assert set(sandbox_processes()) - before == set()
