"""Code sandbox: run model-written Python as hostile code and say how it ended.

``execute(source, stdin, timeout_s, memory_mb)`` -> ``SandboxResult(status, stdout, stderr,
exit_code, wall_s)`` with ``status`` one of ``ok | error | timeout | memory | killed``.

What holds (``isolation_level()`` says which level this host gives; every result carries it):

- ``namespaces`` (unprivileged user namespaces allowed -- checked once per process): a fork
  server (``_zygote.py``, driven by ``forkserver.py``) builds the isolation once, then each call
  gets its own user, pid, mount, network and ipc namespaces. The code sees a root of read-only
  system directories and nothing else of the host (no /tmp, /root, home directories or project;
  an /etc of the loader's cache, the time zone and a passwd/group of root and its own user);
  its working directory and /tmp are a fresh tmpfs capped at ``disk_mb`` and ``max_files``; it
  is pid 1 of its own pid namespace, which the fork server ends with the call (all its
  processes die with it, however they detach: ``_zygote.py``); no network at all (only a
  downed loopback), host loopback included; no capabilities, no_new_privs, and no nested user
  namespaces (the kernel's per-namespace limit set to 0). Whole-tree bounds: where this process
  may make cgroups (``cgroups.py``), each call gets a memory cgroup of ``memory_mb + disk_mb``
  (files included; the OOM killer's work is reported as ``memory``) and a pids cgroup of
  ``max_procs``; elsewhere at most ``max_procs`` processes of at most ``memory_mb`` each, plus
  ``disk_mb`` of files.
- ``audit-hook`` (fallback, **not a boundary**): a subprocess per call (``_jail.py``) with an
  audit hook that makes socket creation, ctypes, exec and subprocesses raise. Pure Python can
  switch such a hook off; rewards refuse this level unless the user allows it.
- both: an anonymous session keyring of the call's own (none of the host's keys, nothing left
  by another call) and a seccomp system-call filter (``syscall_filter.py``) installed before the
  code runs: ``EPERM`` for ``add_key``, ``request_key``, ``keyctl``, ``ptrace``, ``bpf``,
  ``io_uring_setup`` and the other calls listed there; a call through a foreign ABI kills the
  process. A kernel that cannot apply the filter gets no sandbox at all: the server's setup and
  the launcher fail with one ``flash-sandbox-setup:`` line (``SandboxSetupError``).
- both: at the end of every call (its code's exit or the deadline) whatever is left in its
  cgroups is SIGKILLed until they are empty, then removed; where the host gives no cgroups the
  audit-hook level can only kill the call's process group (a process that leaves it is not
  found; logged once). A call whose processes or cgroups stay is counted (``leaked()``,
  ``sandbox/leaked``: must stay 0).
- both: a wall-clock deadline after which everything is killed (the call's ``timeout_s``, or the
  time its response has left, ``flash.rewards.deadline``, when that is sooner); rlimits on CPU time, address
  space, processes, file size and open files; a scrubbed environment; ``python -I`` semantics;
  stdout/stderr capped. Root is dropped to ``nobody`` first (root ignores RLIMIT_NPROC and
  file permissions).
"""

from __future__ import annotations

import functools
import json
import logging
import math
import os
import selectors
import shutil
import signal
import stat
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import flash.rewards.cgroups as cgroups
from flash.rewards.deadline import sandbox_timeout
from flash.rewards.forkserver import SandboxSetupError, confinement, memfd, server

__all__ = [
    "STATUSES",
    "ISOLATION_LEVELS",
    "Limits",
    "SandboxResult",
    "SandboxSetupError",
    "UnisolatedRefused",
    "allow_unisolated",
    "check_unisolated",
    "classify",
    "execute",
    "isolation_level",
    "leaked",
    "sandbox_python",
]

log = logging.getLogger(__name__)

STATUSES = ("ok", "error", "timeout", "memory", "killed")
ISOLATION_LEVELS = ("namespaces", "audit-hook")
NOBODY = (65534, 65534)
SETUP_FAILED = 125
_SETUP_MARK = b"flash-sandbox-setup:"
_MEMORY_MARKS = (b"MemoryError", b"Cannot allocate memory", b"[Errno 12]")
_ENV = {"PATH": "/usr/bin:/bin", "LANG": "C.UTF-8", "PYTHONIOENCODING": "utf-8", "PYTHONDONTWRITEBYTECODE": "1"}
_WORKDIR = "/tmp/flash-sandbox-work"  # inside the call's own tmpfs (namespaces level)

# Runs before the code in audit-hook mode; audit hooks cannot be removed once added.
_AUDIT_PRELUDE = """\
import sys
def _flash_guard(event, args, blocked=("socket.", "ctypes.", "subprocess.", "os.exec",
                 "os.posix_spawn", "os.spawn", "os.system", "os.fork", "os.forkpty", "os.kill",
                 "os.killpg", "signal.pthread_kill", "_posixsubprocess.")):
    if event.startswith(blocked):
        raise PermissionError(f"flash sandbox: {event} is blocked (no namespaces on this host)")
sys.addaudithook(_flash_guard)
del _flash_guard
import runpy
runpy.run_path("main.py", run_name="__main__")
"""


class UnisolatedRefused(SandboxSetupError):
    """The host gives no namespaces and nobody allowed running untrusted code without them."""


_POLICY = {"allow_unisolated": False, "warned": False, "warned_pgroup": False, "why": ""}
_LEAKS = {"calls": 0}  # calls that ended with a process or cgroup of theirs still present
_LEAKS_LOCK = threading.Lock()


def leaked() -> int:
    """Calls of this process whose processes or cgroups were still present after the call
    (``sandbox/leaked``; stays 0 unless the kernel refuses to kill or remove them)."""
    return _LEAKS["calls"]


def _new_group(lim: Limits) -> cgroups.CallGroup | None:
    return cgroups.create(int((lim.memory_mb + lim.disk_mb) * (1 << 20)), int(lim.max_procs))


def _end_group(group: cgroups.CallGroup | None) -> None:
    """Kill what is left of the call in its cgroups, wait for it to go, remove them; count a
    call whose processes or cgroups stay."""
    if group is not None and not group.end():
        with _LEAKS_LOCK:
            _LEAKS["calls"] += 1
        log.error(
            "flash sandbox: a finished call's processes or cgroups are still present: %s",
            ", ".join(str(d) for d in group.dirs.values()),
        )


def allow_unisolated(allow: bool) -> None:
    """This process's answer to "run code on a host without namespaces?" (``execute`` with
    ``isolation="auto"`` refuses by default; the runner sets it from
    ``reward.sandbox.allow_unisolated`` in the driver and in every reward worker)."""
    _POLICY["allow_unisolated"] = bool(allow)


@dataclass(frozen=True)
class SandboxResult:
    status: str  # one of STATUSES
    stdout: str
    stderr: str
    exit_code: int | None  # the process's exit code; None when it died by a signal
    wall_s: float
    signal: int | None = None  # the signal that ended it, if any
    truncated: bool = False  # stdout or stderr went past max_output_bytes and was cut
    isolation: str = ""  # one of ISOLATION_LEVELS: what held for this run


@dataclass(frozen=True)
class Limits:
    timeout_s: float = 5.0  # wall clock; CPU time is limited to ceil(timeout_s) + 1 s
    memory_mb: int = 512  # address space per process (RLIMIT_AS)
    max_procs: int = 32  # processes and threads of the whole call (RLIMIT_NPROC per namespace)
    max_file_mb: int = 16  # largest file it may write (RLIMIT_FSIZE)
    max_open_files: int = 64  # RLIMIT_NOFILE
    max_output_bytes: int = 1 << 20  # per stream; the rest is read and dropped
    disk_mb: int = 64  # all files of the call together (its tmpfs; namespaces level)
    max_files: int = 4096  # files and directories of the call together (tmpfs inodes)

    def __post_init__(self) -> None:
        for name in self.__dataclass_fields__:
            value = getattr(self, name)
            if not (isinstance(value, (int, float)) and math.isfinite(value) and value > 0):
                raise ValueError(f"sandbox {name} must be a finite number > 0, got {value!r}")

    def rlimits(self) -> dict[str, tuple[int, int]]:
        cpu = math.ceil(self.timeout_s) + 1
        mb = 1 << 20
        return {
            "RLIMIT_CPU": (cpu, cpu + 1),
            "RLIMIT_AS": (int(self.memory_mb * mb),) * 2,
            "RLIMIT_NPROC": (int(self.max_procs),) * 2,
            "RLIMIT_CORE": (0, 0),
            "RLIMIT_FSIZE": (int(self.max_file_mb * mb),) * 2,
            "RLIMIT_NOFILE": (int(self.max_open_files),) * 2,
        }


def execute(
    source: str,
    stdin: str = "",
    timeout_s: float = 5.0,
    memory_mb: int = 512,
    isolation: str = "auto",
    files: dict[str, str] | None = None,
    **limits,
) -> SandboxResult:
    """Run ``source`` as ``main.py`` in a fresh sandbox; never raises for anything the code
    does. ``files``: more files for the working directory (name -> text; plain names only).
    ``limits``: the other fields of ``Limits``. ``isolation``: ``auto`` (the best this
    host allows) or one of ISOLATION_LEVELS (``namespaces`` raises SandboxSetupError where the
    host refuses it). Inside a response's deadline (``flash.rewards.deadline``) the call gets at
    most the time left, and raises ``RewardDeadline`` when none is left or when the deadline, not
    its own timeout, ended it (its processes killed first, as at any timeout)."""
    timeout_s, cut_by = sandbox_timeout(timeout_s)
    lim = Limits(timeout_s=timeout_s, memory_mb=memory_mb, **limits)
    level = isolation_level() if isolation == "auto" else isolation
    if level not in ISOLATION_LEVELS:
        raise ValueError(f"isolation must be 'auto' or one of {ISOLATION_LEVELS}, got {isolation!r}")
    if isolation == "auto" and level == "audit-hook":
        check_unisolated()
    files = {**_checked_files(files or {}), "main.py": source}
    result = _run(level, files, stdin.encode(), lim)
    if cut_by is not None and result.status == "timeout":
        raise cut_by.passed()
    return result


def _run(level: str, files: dict[str, str], stdin: bytes, lim: Limits) -> SandboxResult:
    if level == "namespaces":
        return _run_forked(files, stdin, lim)
    workdir = _make_workdir(files)
    try:
        return _run_unisolated(workdir, stdin, lim)
    finally:
        _remove_tree(workdir)


@functools.lru_cache(maxsize=1)
def isolation_level() -> str:
    """``namespaces`` if this host lets an unprivileged process create user, network, pid and
    mount namespaces and apply the system-call filter (probed once by running a real sandbox),
    else ``audit-hook`` (why: in ``check_unisolated``'s refusal)."""
    try:
        res = _run_forked({"main.py": "print('ok')"}, b"", Limits(timeout_s=20))
        if res.status == "ok" and res.stdout == "ok\n":
            return "namespaces"
        _POLICY["why"] = f"a probe call ended {res.status}: {res.stderr.strip()[-200:]}"
    except SandboxSetupError as exc:
        _POLICY["why"] = str(exc)
    return "audit-hook"


def check_unisolated() -> None:
    """Refuse to run code at the audit-hook level unless this process allows it; allowed, warn
    once per process (the refusal is the default because the hook is no boundary)."""
    if not _POLICY["allow_unisolated"]:
        raise UnisolatedRefused(
            "this host gives the code sandbox no namespaces (unprivileged user namespaces are "
            f"off, or: {_POLICY['why'] or 'the namespaces level was not tried'}) and the "
            "audit-hook fallback is not a security boundary: enable user namespaces "
            "(sysctl kernel.unprivileged_userns_clone=1 / user.max_user_namespaces > 0), or set "
            "reward.sandbox.allow_unisolated: true to run model-written code unisolated anyway"
        )
    if not _POLICY["warned"]:
        _POLICY["warned"] = True
        log.warning(
            "flash sandbox: running model-written code WITHOUT namespace isolation "
            "(reward.sandbox.allow_unisolated: true); only an audit hook guards the host"
        )


def _checked_files(files: dict[str, str]) -> dict[str, str]:
    for name in files:
        if not name or "/" in name or name.startswith(".") or name == "main.py":
            raise ValueError(f"sandbox file names must be plain names like 'tests.json', got {name!r}")
    return files


@functools.lru_cache(maxsize=1)
def _jail_source() -> str:
    return Path(__file__).with_name("_jail.py").read_text()


def _drop_to() -> tuple[int, int] | None:
    return NOBODY if os.geteuid() == 0 else None


def _world_executable(path: str) -> bool:
    """Can any uid run ``path``? (every parent directory o+x, the file o+x)."""
    p = Path(path)
    try:
        return all(q.stat().st_mode & stat.S_IXOTH for q in [p, *p.parents])
    except OSError:
        return False


@functools.lru_cache(maxsize=1)
def sandbox_python() -> str:
    """The interpreter the code runs under: this one, unless the dropped uid cannot reach it
    (e.g. a pyenv build under a 0700 /root), then the first world-executable system python."""
    candidates = [os.path.realpath(sys.executable), "/usr/bin/python3", "/usr/local/bin/python3"]
    if _drop_to() is None:
        return candidates[0]
    for cand in candidates:
        if _world_executable(cand):
            return cand
    raise SandboxSetupError(
        f"no python reachable by uid {NOBODY[0]} among {candidates}; "
        "install a system python3 or run the sandbox as a non-root user"
    )


def _run_forked(files: dict[str, str], stdin: bytes, lim: Limits) -> SandboxResult:
    """One call on this process's fork server."""
    srv = server(sandbox_python(), _drop_to())
    header = {
        "limits": lim.rlimits(),
        "disk_mb": int(lim.disk_mb),
        "max_files": int(lim.max_files),
        "env": {**_ENV, "HOME": _WORKDIR, "TMPDIR": _WORKDIR},
    }
    t0 = time.monotonic()
    group = _new_group(lim)
    try:
        cid, call, out_r, err_r = srv.start(
            header, json.dumps({"files": files}).encode(), stdin, group.open_procs() if group else []
        )
        deadline = t0 + lim.timeout_s
        (out, err), timed_out, truncated = _collect(
            (out_r, err_r), deadline, lim.max_output_bytes, kill=lambda: srv.kill(cid), exited=call.done.is_set
        )
        status = srv.finish(cid, call, deadline)
        oom = group is not None and group.oom_killed()
    finally:
        _end_group(group)
    rc = status["exit"] if "exit" in status else -status["signal"]
    timed_out = timed_out or (rc == -signal.SIGKILL and time.monotonic() >= deadline)
    return _result(rc, out, err, timed_out, truncated, time.monotonic() - t0, "namespaces", oom)


def _result(
    rc: int | None, out: bytes, err: bytes, timed_out: bool, truncated: bool, wall: float, level: str, oom: bool = False
) -> SandboxResult:
    if rc == SETUP_FAILED and _SETUP_MARK in err:
        raise SandboxSetupError(err.decode(errors="replace").strip())
    return SandboxResult(
        status=classify(rc, err, timed_out, oom),
        stdout=out.decode(errors="replace"),
        stderr=err.decode(errors="replace"),
        exit_code=rc if rc is not None and rc >= 0 else None,
        wall_s=wall,
        signal=-rc if rc is not None and rc < 0 else None,
        truncated=truncated,
        isolation=level,
    )


def _make_workdir(files: dict[str, str]) -> str:
    workdir = tempfile.mkdtemp(prefix="flash-sandbox-")
    drop = _drop_to()
    for name, text in files.items():
        Path(workdir, name).write_text(text)
        if drop is not None:
            os.chown(os.path.join(workdir, name), *drop)
    if drop is not None:
        os.chown(workdir, *drop)
    return workdir


def _remove_tree(path: str) -> None:
    """Remove the working directory even if the code chmod-ed parts of it to 000."""

    def fix(func, p, _exc):
        os.chmod(os.path.dirname(p), 0o700)
        if os.path.isdir(p):
            os.chmod(p, 0o700)
        func(p)

    shutil.rmtree(path, onerror=fix)


def _run_unisolated(workdir: str, stdin: bytes, lim: Limits) -> SandboxResult:
    """The audit-hook level: a launcher subprocess per call, in a host working directory, in the
    call's cgroups where the host gives them (else only its process group is killed at the end)."""
    env = {**_ENV, "HOME": workdir, "TMPDIR": workdir}
    group = _new_group(lim)
    if group is None:
        _warn_process_group_only()
    procs = group.open_procs() if group else []
    cfg = {
        "drop_to": _drop_to(),
        "limits": lim.rlimits(),
        "env": env,
        "cgroup_fds": procs,
        "argv": [sandbox_python(), "-I", "-c", _AUDIT_PRELUDE],
        "workdir": workdir,
        **confinement(),
    }
    t0 = time.monotonic()
    stdin_fd = memfd(stdin, readonly=True)
    try:
        proc = subprocess.Popen(
            [sys.executable, "-I", "-S", "-c", _jail_source(), json.dumps(cfg)],
            stdin=stdin_fd,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            env={},
            cwd=workdir,
            start_new_session=True,
            pass_fds=procs,
        )
    except BaseException:
        _end_group(group)
        raise
    finally:
        for fd in [stdin_fd, *procs]:
            os.close(fd)
    try:
        (out, err), timed_out, truncated = _collect(
            (proc.stdout.fileno(), proc.stderr.fileno()),
            t0 + lim.timeout_s,
            lim.max_output_bytes,
            kill=lambda: _kill_group(proc),
            exited=lambda: proc.poll() is not None,
            close=False,
        )
        oom = group is not None and group.oom_killed()
    finally:
        _kill_group(proc)
        _end_group(group)
        proc.stdout.close()
        proc.stderr.close()
    return _result(proc.returncode, out, err, timed_out, truncated, time.monotonic() - t0, "audit-hook", oom)


def _warn_process_group_only() -> None:
    if not _POLICY["warned_pgroup"]:
        _POLICY["warned_pgroup"] = True
        log.warning(
            "flash sandbox: no pid namespace and no cgroups on this host: at the end of a "
            "call only its process group is killed, so a process that leaves it (a new "
            "session) is not found"
        )


def classify(returncode: int | None, stderr: bytes, timed_out: bool, oom: bool = False) -> str:
    """How a run ended, from the launcher's exit status (which mirrors the code's); ``oom``: the
    call's memory cgroup saw the OOM killer end one of its processes."""
    if timed_out or returncode == -signal.SIGXCPU:
        return "timeout"
    if returncode == 0:
        return "ok"
    tail = stderr[-2000:]
    if oom or any(mark in tail for mark in _MEMORY_MARKS):
        return "memory"
    if returncode is not None and returncode < 0:
        return "killed"
    return "error"


def _collect(
    fds: tuple[int, int], deadline: float, cap: int, kill, exited, close: bool = True
) -> tuple[list[bytes], bool, bool]:
    """Read both streams, keeping at most ``cap`` bytes each, until both close or the deadline
    passes (then ``kill()``, drain for a second, stop). Once ``exited()`` turns true, ``kill()``
    ends whatever the code left behind, so its pipes close."""
    bufs = {fd: bytearray() for fd in fds}
    truncated = timed_out = ended = False
    sel = selectors.DefaultSelector()
    for fd in fds:
        os.set_blocking(fd, False)
        sel.register(fd, selectors.EVENT_READ)
    while sel.get_map():
        if not ended and not timed_out and exited():
            ended = True
            kill()
        left = deadline - time.monotonic()
        if left <= 0 and not timed_out:
            timed_out = True
            kill()
            deadline = time.monotonic() + 1.0  # drain what is already in the pipes, then stop
            left = 1.0
        for key, _ in sel.select(timeout=min(max(left, 0.0), 0.5)):
            chunk = os.read(key.fd, 65536)
            if not chunk:
                sel.unregister(key.fd)
                continue
            buf = bufs[key.fd]
            room = cap - len(buf)
            truncated |= len(chunk) > room
            buf += chunk[: max(room, 0)]
        if timed_out and time.monotonic() >= deadline:
            break
    sel.close()
    if close:
        for fd in fds:
            os.close(fd)
    return [bytes(bufs[fd]) for fd in fds], timed_out, truncated


def _kill_group(proc: subprocess.Popen) -> None:
    """SIGKILL the launcher's whole process group, then reap the launcher."""
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass
    proc.wait()
