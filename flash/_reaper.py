"""Kills what a local Ray leaves behind when its driver dies without shutting it down.

A driver killed by SIGKILL or the OOM killer never runs ``ray.shutdown``; Ray's GCS, raylet and
workers notice, but its agents (dashboard agent, runtime-env agent) ignore SIGTERM and live on,
reparented to init, with their ports open. This script, started by ``flash.cluster.init_ray`` in
a session of its own (so whatever kills the driver's session spares it), watches the driver: while
it lives, it records the driver's descendants every half second (pid and start time, so a reused
pid is never hit); once the driver is gone, it SIGKILLs every recorded process still alive and
their descendants, and exits.

Standard library only, run with ``python -I``: it must work whatever state the driver's
environment was in.
"""

from __future__ import annotations

import os
import signal
import sys
import time

POLL_S = 0.5


def _stat(pid: int) -> tuple[int, int] | None:
    """(parent pid, start time in clock ticks) of ``pid``, or None if it is gone."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            fields = f.read().rsplit(b")", 1)[1].split()
    except OSError:
        return None
    return int(fields[1]), int(fields[19])


def _table() -> dict[int, tuple[int, int]]:
    out = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit() and (st := _stat(int(entry))) is not None:
            out[int(entry)] = st
    return out


def _descendants(roots: set[int], table: dict[int, tuple[int, int]]) -> set[int]:
    children: dict[int, list[int]] = {}
    for pid, (ppid, _) in table.items():
        children.setdefault(ppid, []).append(pid)
    found, todo = set(), list(roots)
    while todo:
        for child in children.get(todo.pop(), []):
            if child not in found:
                found.add(child)
                todo.append(child)
    return found


def watch(driver: int, driver_start: int) -> int:
    """Record the driver's descendants while it lives; kill the survivors after. Returns how many."""
    me, known = os.getpid(), {}
    while (st := _stat(driver)) is not None and st[1] == driver_start:
        table = _table()
        known.update({pid: table[pid][1] for pid in _descendants({driver}, table) if pid != me})
        time.sleep(POLL_S)
    killed = 0
    for _ in range(10):
        table = _table()
        alive = {pid for pid, start in known.items() if pid in table and table[pid][1] == start}
        targets = (alive | _descendants(alive, table)) - {me}
        if not targets:
            break
        for pid in targets:
            try:
                os.kill(pid, signal.SIGKILL)
                killed += 1
            except ProcessLookupError:
                pass
        time.sleep(0.2)
    return killed


if __name__ == "__main__":
    pid = int(sys.argv[1])
    st = _stat(pid)
    if st is not None:
        watch(pid, st[1])
