"""Code sandbox: run model-written Python as hostile code and say how it ended.

``execute(source, stdin, timeout_s, memory_mb)`` -> ``SandboxResult(status, stdout, stderr,
exit_code, wall_s)`` with ``status`` one of ``ok | error | timeout | memory | killed``.

What holds (``isolation_level()`` says which level this host gives; every result carries it):

- always: a new session (its own process group), killed as a whole at the wall-clock deadline
  and reaped; rlimits on CPU time, address space, processes, file size and open files; a fresh
  temporary working directory, removed afterwards; a scrubbed environment (nothing inherited:
  no tokens, no keys); ``python -I``; stdout/stderr capped. Root is dropped to ``nobody`` first,
  because root ignores RLIMIT_NPROC and file permissions.
- ``namespaces`` (unprivileged user namespaces allowed -- checked once per process): new user,
  network, pid, mount, ipc and uts namespaces. No network at all (only a downed loopback), no
  view of or signal to host processes (the code is pid 1 of its namespace), every mount
  read-only except the working directory, and all its processes die with the launcher.
- ``audit-hook`` (fallback): an audit hook in the sandboxed interpreter makes socket creation,
  ctypes, exec and subprocesses raise. Weaker: native code or a second interpreter could get
  past it, and files outside the working directory are protected only by the dropped uid.

The launcher that sets all this up is ``_jail.py`` (see its docstring for the order of steps).
"""

from __future__ import annotations

import functools
import math
import os
import selectors
import shutil
import signal
import stat
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

STATUSES = ("ok", "error", "timeout", "memory", "killed")
ISOLATION_LEVELS = ("namespaces", "audit-hook")
NOBODY = (65534, 65534)
SETUP_FAILED = 125
_SETUP_MARK = b"flash-sandbox-setup:"
_MEMORY_MARKS = (b"MemoryError", b"Cannot allocate memory", b"[Errno 12]")

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


class SandboxSetupError(RuntimeError):
    """The sandbox itself could not start (a host problem, not the code's fault)."""


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
    memory_mb: int = 512  # address space (RLIMIT_AS)
    max_procs: int = 32  # processes and threads (RLIMIT_NPROC)
    max_file_mb: int = 16  # largest file it may write (RLIMIT_FSIZE)
    max_open_files: int = 64  # RLIMIT_NOFILE
    max_output_bytes: int = 1 << 20  # per stream; the rest is read and dropped

    def __post_init__(self) -> None:
        for name in ("timeout_s", "memory_mb", "max_procs", "max_file_mb", "max_open_files",
                     "max_output_bytes"):
            value = getattr(self, name)
            if not (isinstance(value, (int, float)) and math.isfinite(value) and value > 0):
                raise ValueError(f"sandbox {name} must be a finite number > 0, got {value!r}")

    def rlimits(self) -> dict[str, tuple[int, int]]:
        cpu = math.ceil(self.timeout_s) + 1
        mb = 1 << 20
        return {"RLIMIT_CPU": (cpu, cpu + 1), "RLIMIT_AS": (self.memory_mb * mb,) * 2,
                "RLIMIT_NPROC": (self.max_procs,) * 2, "RLIMIT_CORE": (0, 0),
                "RLIMIT_FSIZE": (self.max_file_mb * mb,) * 2,
                "RLIMIT_NOFILE": (self.max_open_files,) * 2}


def execute(source: str, stdin: str = "", timeout_s: float = 5.0, memory_mb: int = 512,
            isolation: str = "auto", files: dict[str, str] | None = None,
            **limits) -> SandboxResult:
    """Run ``source`` as ``main.py`` in a fresh sandbox; never raises for anything the code
    does. ``files``: more files for the working directory (name -> text; plain names only).
    ``limits``: the other fields of ``Limits``. ``isolation``: ``auto`` (the best this
    host allows) or one of ISOLATION_LEVELS (``namespaces`` raises SandboxSetupError where the
    host refuses it)."""
    lim = Limits(timeout_s=timeout_s, memory_mb=memory_mb, **limits)
    level = isolation_level() if isolation == "auto" else isolation
    if level not in ISOLATION_LEVELS:
        raise ValueError(f"isolation must be 'auto' or one of {ISOLATION_LEVELS}, got {isolation!r}")
    workdir = _make_workdir(source, files or {})
    try:
        return _run(workdir, stdin.encode(), lim, level)
    finally:
        _remove_tree(workdir)


@functools.lru_cache(maxsize=1)
def isolation_level() -> str:
    """``namespaces`` if this host lets an unprivileged process create user, network, pid and
    mount namespaces (probed once by starting a real sandbox), else ``audit-hook``."""
    workdir = _make_workdir("print('ok')")
    try:
        res = _run(workdir, b"", Limits(timeout_s=20), "namespaces")
        return "namespaces" if res.status == "ok" and res.stdout == "ok\n" else "audit-hook"
    except SandboxSetupError:
        return "audit-hook"
    finally:
        _remove_tree(workdir)


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
    raise SandboxSetupError(f"no python reachable by uid {NOBODY[0]} among {candidates}; "
                            "install a system python3 or run the sandbox as a non-root user")


def _make_workdir(source: str, files: dict[str, str] | None = None) -> str:
    files = {**(files or {}), "main.py": source}
    for name in files:
        if not name or "/" in name or name.startswith("."):
            raise ValueError(f"sandbox file names must be plain names like 'tests.json', got {name!r}")
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


def _launch_args(workdir: str, lim: Limits, level: str) -> list[str]:
    import json

    py = sandbox_python()
    argv = [py, "-I", "main.py"] if level == "namespaces" else [py, "-I", "-c", _AUDIT_PRELUDE]
    env = {"PATH": "/usr/bin:/bin", "HOME": workdir, "TMPDIR": workdir, "LANG": "C.UTF-8",
           "PYTHONIOENCODING": "utf-8", "PYTHONDONTWRITEBYTECODE": "1"}
    cfg = {"drop_to": _drop_to(), "namespaces": level == "namespaces",
           "readonly_fs": level == "namespaces", "workdir": workdir,
           "limits": lim.rlimits(), "argv": argv, "env": env}
    return [sys.executable, "-I", "-S", "-c", _jail_source(), json.dumps(cfg)]


def _run(workdir: str, stdin: bytes, lim: Limits, level: str) -> SandboxResult:
    t0 = time.monotonic()
    proc = subprocess.Popen(_launch_args(workdir, lim, level), stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, env={},
                            cwd=workdir, start_new_session=True, close_fds=True)
    try:
        out, err, timed_out, truncated = _communicate(proc, stdin, t0 + lim.timeout_s,
                                                      lim.max_output_bytes)
    finally:
        _kill_group(proc)
        if not proc.stdin.closed:
            proc.stdin.close()
    wall = time.monotonic() - t0
    rc = proc.returncode
    if rc == SETUP_FAILED and _SETUP_MARK in err:
        raise SandboxSetupError(err.decode(errors="replace").strip())
    status = classify(rc, err, timed_out)
    return SandboxResult(status=status, stdout=out.decode(errors="replace"),
                         stderr=err.decode(errors="replace"),
                         exit_code=rc if rc is not None and rc >= 0 else None, wall_s=wall,
                         signal=-rc if rc is not None and rc < 0 else None,
                         truncated=truncated, isolation=level)


def classify(returncode: int | None, stderr: bytes, timed_out: bool) -> str:
    """How a run ended, from the launcher's exit status (which mirrors the code's)."""
    if timed_out or returncode == -signal.SIGXCPU:
        return "timeout"
    if returncode == 0:
        return "ok"
    tail = stderr[-2000:]
    if any(mark in tail for mark in _MEMORY_MARKS):
        return "memory"
    if returncode is not None and returncode < 0:
        return "killed"
    return "error"


def _communicate(proc: subprocess.Popen, stdin: bytes, deadline: float,
                 cap: int) -> tuple[bytes, bytes, bool, bool]:
    """Feed stdin, read both streams keeping at most ``cap`` bytes each, until the process
    exits and its pipes close, or the deadline passes (then the whole group is killed)."""
    bufs = {proc.stdout: bytearray(), proc.stderr: bytearray()}
    truncated = timed_out = False
    sel = selectors.DefaultSelector()
    for f in bufs:
        os.set_blocking(f.fileno(), False)
        sel.register(f, selectors.EVENT_READ)
    pending = memoryview(stdin)
    if pending:
        os.set_blocking(proc.stdin.fileno(), False)
        sel.register(proc.stdin, selectors.EVENT_WRITE)
    else:
        proc.stdin.close()
    while sel.get_map():
        if not timed_out and proc.poll() is not None:
            _kill_group(proc)  # it exited: end what it left behind, so its pipes close
            if not proc.stdin.closed:
                sel.unregister(proc.stdin)
                proc.stdin.close()
        left = deadline - time.monotonic()
        if left <= 0:
            timed_out = True
            _kill_group(proc)
            left = 1.0  # drain what is already in the pipes, then stop
            deadline = time.monotonic() + left
        for key, _ in sel.select(timeout=min(left, 0.5)):
            if key.fileobj is proc.stdin:
                pending = _feed(proc, sel, pending)
                continue
            chunk = os.read(key.fd, 65536)
            if not chunk:
                sel.unregister(key.fileobj)
                continue
            buf = bufs[key.fileobj]
            room = cap - len(buf)
            truncated |= len(chunk) > room
            buf += chunk[:max(room, 0)]
        if timed_out and time.monotonic() >= deadline:
            break
    sel.close()
    proc.wait()
    return bytes(bufs[proc.stdout]), bytes(bufs[proc.stderr]), timed_out, truncated


def _feed(proc: subprocess.Popen, sel: selectors.BaseSelector, pending: memoryview) -> memoryview:
    try:
        pending = pending[os.write(proc.stdin.fileno(), pending[:65536]):]
    except (BrokenPipeError, OSError):
        pending = pending[:0]
    if not pending:
        sel.unregister(proc.stdin)
        proc.stdin.close()
    return pending


def _kill_group(proc: subprocess.Popen) -> None:
    """SIGKILL the launcher's whole process group (the launcher dying takes its pid namespace
    with it), then reap the launcher."""
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass
    proc.wait()
