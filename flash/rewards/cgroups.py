"""Per-call memory and pids cgroups for the code sandbox, where this process may make them.

Why: rlimits bound each process (RLIMIT_AS) and the number of processes (RLIMIT_NPROC), so without
a cgroup a call's whole tree may hold ``max_procs x memory_mb`` plus its tmpfs. With a memory
cgroup per call the tree -- its files in the tmpfs included, since tmpfs pages are charged to the
writer's cgroup -- holds at most ``memory_mb + disk_mb``; the kernel's OOM killer ends the call
(reported as ``memory``) rather than the host running out.

Where: cgroup v1 hierarchies with the ``memory`` and ``pids`` controllers in which this process
can create a child of its own cgroup (root in a container, as on these machines). A cgroup v2
subtree would need its controllers delegated to a leaf we do not live in; not done here, so such
a host keeps the rlimit bounds (``available()`` says which holds). The parent opens each call's
``cgroup.procs`` files and hands the descriptors to the call (the sandbox's root has no /sys);
the call's mirror process writes its own pid to them before it forks the code, so every process
of the call is inside from its first instruction.

At the end of a call (``CallGroup.end``) whatever is still in its cgroups is SIGKILLed, round
after round, until ``cgroup.procs`` is empty, then the directories are removed. v1 has no
``cgroup.kill`` and a freezer would be a third hierarchy per call; none is needed: a process
with SIGKILL pending cannot complete a fork, so each round leaves at most children forked before
it, and the pids limit bounds those. A group that will not empty or go is kept and retried at
the next ``create`` (``left()`` counts them).
"""

from __future__ import annotations

import functools
import itertools
import os
import signal
import threading
import time
from pathlib import Path

_NAMES = itertools.count()
_REMOVE_TRIES = 50
_KILL_WAIT_S = 2.0
_LEFT: list[CallGroup] = []  # groups that would not empty or go; retried at each create()
_LEFT_LOCK = threading.Lock()


@functools.lru_cache(maxsize=1)
def _bases() -> dict[str, Path]:
    """controller -> this process's own cgroup directory in a writable v1 hierarchy."""
    mounts: dict[str, Path] = {}
    try:
        for line in Path("/proc/self/mounts").read_text().splitlines():
            _, point, fstype, opts, *_ = line.split()
            if fstype == "cgroup":
                for ctl in ("memory", "pids"):
                    if ctl in opts.split(","):
                        mounts[ctl] = Path(point)
        own = {}
        for line in Path("/proc/self/cgroup").read_text().splitlines():
            _, ctls, path = line.split(":", 2)
            for ctl in ctls.split(","):
                if ctl in mounts:
                    own[ctl] = mounts[ctl] / path.lstrip("/")
    except (OSError, ValueError):
        return {}
    bases = {ctl: p for ctl, p in own.items() if p.is_dir() and os.access(p, os.W_OK)}
    if set(bases) != {"memory", "pids"}:
        return {}
    for base in bases.values():
        _remove_orphans(base)
    return bases


def _remove_orphans(base: Path) -> None:
    """Empty call cgroups left by a process that died mid-call (named after its pid)."""
    for d in base.glob("flash-sandbox-*-*"):
        pid = d.name.split("-")[2]
        if pid.isdigit() and not Path(f"/proc/{pid}").exists():
            try:
                d.rmdir()
            except OSError:
                pass  # processes still inside: left for the next start


def available() -> bool:
    """Whether calls get their own memory and pids cgroups on this host."""
    return bool(_bases())


class CallGroup:
    """One call's memory and pids cgroups."""

    def __init__(self, dirs: dict[str, Path]) -> None:
        self.dirs = dirs

    def open_procs(self) -> list[int]:
        """Write-only descriptors of the files the call's first process writes its pid to."""
        return [os.open(d / "cgroup.procs", os.O_WRONLY | os.O_CLOEXEC) for d in self.dirs.values()]

    def oom_killed(self) -> bool:
        """Did the kernel's OOM killer end a process of this call?"""
        try:
            text = (self.dirs["memory"] / "memory.oom_control").read_text()
        except OSError:
            return False
        fields = dict(line.split() for line in text.splitlines() if len(line.split()) == 2)
        return int(fields.get("oom_kill", "0")) > 0

    def pids(self) -> list[int]:
        """The processes in the call's cgroups now (host pids; [] once they are gone)."""
        found: set[int] = set()
        for d in self.dirs.values():
            try:
                found.update(int(p) for p in (d / "cgroup.procs").read_text().split())
            except (OSError, ValueError):
                continue
        return sorted(found)

    def kill(self, wait_s: float = _KILL_WAIT_S) -> bool:
        """SIGKILL every process in the cgroups until none is left (a process with SIGKILL
        pending cannot fork, so each round leaves at most the children forked before it, and
        the pids cgroup bounds those); True once they are empty, False if ``wait_s`` ran out."""
        deadline = time.monotonic() + wait_s
        while pids := self.pids():
            for pid in pids:
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
            if time.monotonic() > deadline:
                return False
            time.sleep(0.001)
        return True

    def remove(self) -> bool:
        """Remove the directories (their processes may take a moment to leave); True once all
        are gone."""
        for d in self.dirs.values():
            for _ in range(_REMOVE_TRIES):
                try:
                    d.rmdir()
                    break
                except FileNotFoundError:
                    break
                except OSError:
                    time.sleep(0.01)
        return not any(d.exists() for d in self.dirs.values())

    def end(self) -> bool:
        """Kill whatever of the call is left, wait for it to go, remove the cgroups; False when
        something of it is still there (kept and retried at the next ``create``)."""
        gone = self.kill() and self.remove()
        if not gone:
            with _LEFT_LOCK:
                _LEFT.append(self)
        return gone


def _retry_left() -> None:
    with _LEFT_LOCK:
        groups = list(_LEFT)
    for group in groups:
        if group.kill(wait_s=0.0) and group.remove():
            with _LEFT_LOCK:
                _LEFT.remove(group)


def left() -> int:
    """Calls whose processes or cgroups are still present after their end."""
    return len(_LEFT)


def create(memory_bytes: int, max_pids: int) -> CallGroup | None:
    """New cgroups for one call, or None where this host gives none (or making them fails)."""
    bases = _bases()
    if not bases:
        return None
    if _LEFT:
        _retry_left()
    name = f"flash-sandbox-{os.getpid()}-{next(_NAMES)}"
    group = CallGroup({ctl: base / name for ctl, base in bases.items()})
    try:
        for d in group.dirs.values():
            d.mkdir()
        mem = group.dirs["memory"]
        (mem / "memory.limit_in_bytes").write_text(str(memory_bytes))
        swap = mem / "memory.memsw.limit_in_bytes"  # no swapping out of the limit, where accounted
        if swap.exists():
            swap.write_text(str(memory_bytes))
        (group.dirs["pids"] / "pids.max").write_text(str(max_pids))
    except OSError:
        group.remove()
        return None
    return group
