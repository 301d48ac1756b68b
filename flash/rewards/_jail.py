"""Launcher for the ``audit-hook`` sandbox level: the first process of each such call (stdlib
only, no flash imports). The ``namespaces`` level runs on the fork server (``_zygote.py``).

The parent runs ``python -I -S -c <this file's source> CONFIG_JSON`` in a new session, with the
call's ``cgroup.procs`` files open where the host gives cgroups (it joins them first). Doing the
setup here rather than in a ``preexec_fn`` keeps it out of the parent after ``fork``, where a
threaded parent (a Ray actor) can deadlock on locks held by other threads. Order: drop root to
an unprivileged uid (root bypasses RLIMIT_NPROC and file permissions), join a new anonymous
session keyring (no host key is possessed), enter the working directory, set the resource
limits, install the system-call filter (``syscall_filter.py``; kept across exec), exec the
interpreter whose audit hook guards the code.
A setup step that fails exits 125 with a ``flash-sandbox-setup:`` line on stderr.
"""

import ctypes
import json
import os
import resource
import sys

PR_SET_DUMPABLE, PR_SET_NO_NEW_PRIVS, PR_SET_SECCOMP, SECCOMP_MODE_FILTER = 4, 38, 22, 2
KEYCTL_JOIN_SESSION_KEYRING = 1
SETUP_FAILED = 125
_libc = ctypes.CDLL(None, use_errno=True)


class _SockFprog(ctypes.Structure):
    _fields_ = [("len", ctypes.c_ushort), ("filter", ctypes.c_void_p)]


def _checked(rc: int, step: str) -> None:
    if rc < 0:
        raise OSError(ctypes.get_errno(), f"{step}: {os.strerror(ctypes.get_errno())}")


def _confine(cfg: dict) -> None:
    """no_new_privs and the system-call filter."""
    prog = bytes.fromhex(cfg["seccomp"])
    buf = ctypes.create_string_buffer(prog, len(prog))
    fprog = _SockFprog(len(prog) // 8, ctypes.addressof(buf))
    _checked(_libc.prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0), "no_new_privs")
    _checked(
        _libc.prctl(PR_SET_SECCOMP, SECCOMP_MODE_FILTER, ctypes.byref(fprog), 0, 0), "system-call filter (seccomp)"
    )


def main() -> None:
    cfg = json.loads(sys.argv[1])
    try:
        for fd in cfg["cgroup_fds"]:  # the call's cgroups, before anything else runs
            os.write(fd, str(os.getpid()).encode())
            os.close(fd)
        if cfg["drop_to"] is not None:
            uid, gid = cfg["drop_to"]
            os.setgroups([])
            os.setgid(gid)
            os.setuid(uid)
            _libc.prctl(PR_SET_DUMPABLE, 1, 0, 0, 0)
        _checked(
            _libc.syscall(ctypes.c_long(cfg["keyctl"]), ctypes.c_long(KEYCTL_JOIN_SESSION_KEYRING), None),
            "session keyring",
        )
        os.chdir(cfg["workdir"])
        for name, (soft, hard) in cfg["limits"].items():
            resource.setrlimit(getattr(resource, name), (soft, hard))
        _confine(cfg)
        os.execve(cfg["argv"][0], cfg["argv"], cfg["env"])
    except OSError as exc:
        sys.stderr.write(f"flash-sandbox-setup: {exc}\n")
        sys.stderr.flush()
        os._exit(SETUP_FAILED)


main()
