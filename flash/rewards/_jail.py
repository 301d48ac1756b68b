"""Sandbox launcher: the first process of every sandbox run (stdlib only, no flash imports).

The parent runs ``python -I -S -c <this file's source> CONFIG_JSON`` in a new session. Doing the
setup here rather than in a ``preexec_fn`` keeps it out of the parent after ``fork``, where a
threaded parent (a Ray actor) can deadlock on locks held by other threads.

Order matters:
1. drop root to an unprivileged uid (root bypasses RLIMIT_NPROC and file permissions);
2. new user + network + pid + mount + ipc + uts namespaces (no network, no view of host pids);
3. the whole filesystem read-only except the working directory (mount_setattr, Linux >= 5.12);
4. resource limits -- set *after* the new user namespace, so RLIMIT_NPROC counts only this
   sandbox's processes, not every process the uid already runs on the host;
5. fork: the child is pid 1 of the new pid namespace, mounts a fresh /proc, dies with us
   (PDEATHSIG), and execs the sandboxed interpreter; we mirror its exit status. Killing this
   launcher therefore tears down every process the code started, even ones that left the
   process group with setsid().
A setup step that fails exits 125 with a ``flash-sandbox-setup:`` line on stderr.
"""

import ctypes
import json
import os
import resource
import signal
import sys

CLONE_NEWNS, CLONE_NEWUTS, CLONE_NEWIPC = 0x00020000, 0x04000000, 0x08000000
CLONE_NEWUSER, CLONE_NEWPID, CLONE_NEWNET = 0x10000000, 0x20000000, 0x40000000
MS_NOSUID, MS_NODEV, MS_NOEXEC, MS_BIND, MS_REC, MS_PRIVATE = 2, 4, 8, 4096, 16384, 1 << 18
AT_FDCWD, AT_RECURSIVE, MOUNT_ATTR_RDONLY, SYS_MOUNT_SETATTR = -100, 0x8000, 1, 442
PR_SET_PDEATHSIG, PR_SET_DUMPABLE = 1, 4
SETUP_FAILED = 125

_libc = ctypes.CDLL(None, use_errno=True)


def _fail(step: str) -> None:
    err = ctypes.get_errno()
    sys.stderr.write(f"flash-sandbox-setup: {step} failed: {os.strerror(err)}\n")
    sys.stderr.flush()
    os._exit(SETUP_FAILED)


def _check(rc: int, step: str) -> None:
    if rc != 0:
        _fail(step)


def _write(path: str, text: str) -> None:
    with open(path, "w") as f:
        f.write(text)


class _MountAttr(ctypes.Structure):
    _fields_ = [("attr_set", ctypes.c_uint64), ("attr_clr", ctypes.c_uint64),
                ("propagation", ctypes.c_uint64), ("userns_fd", ctypes.c_uint64)]


def _setattr(path: str, flags: int, attr_set: int, attr_clr: int) -> int:
    attr = _MountAttr(attr_set, attr_clr, 0, 0)
    return _libc.syscall(SYS_MOUNT_SETATTR, AT_FDCWD, path.encode(), flags,
                         ctypes.byref(attr), ctypes.sizeof(attr))


def _readonly_except(workdir: str) -> None:
    """Every mount read-only, then the working directory (a bind mount of itself) writable."""
    _check(_libc.mount(None, b"/", None, MS_REC | MS_PRIVATE, None), "private mounts")
    _check(_libc.mount(workdir.encode(), workdir.encode(), None, MS_BIND | MS_REC, None),
           "bind workdir")
    _check(_setattr("/", AT_RECURSIVE, MOUNT_ATTR_RDONLY, 0), "read-only root")
    _check(_setattr(workdir, 0, 0, MOUNT_ATTR_RDONLY), "writable workdir")


def _enter_namespaces(cfg: dict) -> None:
    uid, gid = os.getuid(), os.getgid()
    flags = CLONE_NEWUSER | CLONE_NEWNET | CLONE_NEWPID | CLONE_NEWIPC | CLONE_NEWUTS | CLONE_NEWNS
    _check(_libc.unshare(flags), "unshare")
    _write("/proc/self/setgroups", "deny")
    _write("/proc/self/uid_map", f"{uid} {uid} 1")
    _write("/proc/self/gid_map", f"{gid} {gid} 1")
    if cfg["readonly_fs"]:
        _readonly_except(cfg["workdir"])


def _set_limits(limits: dict) -> None:
    for name, (soft, hard) in limits.items():
        resource.setrlimit(getattr(resource, name), (soft, hard))


def _child(cfg: dict) -> None:
    """pid 1 of the new pid namespace: dies with the launcher, sees only its own /proc."""
    try:
        _check(_libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0), "pdeathsig")
        if cfg["readonly_fs"]:
            _check(_libc.mount(b"proc", b"/proc", b"proc", MS_NOSUID | MS_NODEV | MS_NOEXEC, None),
                   "mount /proc")
        os.execve(cfg["argv"][0], cfg["argv"], cfg["env"])
    except OSError as exc:
        sys.stderr.write(f"flash-sandbox-setup: exec failed: {exc}\n")
    os._exit(SETUP_FAILED)


def _mirror(pid: int) -> None:
    """Exit the way the child did: same exit code, or death by the same signal."""
    _, status = os.waitpid(pid, 0)
    if os.WIFSIGNALED(status):
        sig = os.WTERMSIG(status)
        signal.signal(sig, signal.SIG_DFL)
        os.kill(os.getpid(), sig)
    os._exit(os.WEXITSTATUS(status) if os.WIFEXITED(status) else SETUP_FAILED)


def main() -> None:
    cfg = json.loads(sys.argv[1])
    try:
        if cfg["drop_to"] is not None:
            uid, gid = cfg["drop_to"]
            os.setgroups([])
            os.setgid(gid)
            os.setuid(uid)
            _libc.prctl(PR_SET_DUMPABLE, 1, 0, 0, 0)  # else /proc/self/uid_map stays root's
        if cfg["namespaces"]:
            _enter_namespaces(cfg)
        os.chdir(cfg["workdir"])
        _set_limits(cfg["limits"])
    except OSError as exc:
        sys.stderr.write(f"flash-sandbox-setup: {exc}\n")
        os._exit(SETUP_FAILED)
    if not cfg["namespaces"]:
        os.execve(cfg["argv"][0], cfg["argv"], cfg["env"])
    pid = os.fork()
    if pid == 0:
        _child(cfg)
    for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
        signal.signal(sig, signal.SIG_IGN)  # only SIGKILL from the parent ends us early
    _mirror(pid)


main()
