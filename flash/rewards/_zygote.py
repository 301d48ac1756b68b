"""Sandbox fork server: namespaces set up once, one forked interpreter per call (stdlib only).

The parent (``flash.rewards.sandbox``) starts ``python -I -c <this source> CONFIG_JSON`` with one end of a
SOCK_SEQPACKET socket pair. Setup, once:

1. drop root to an unprivileged uid (root bypasses RLIMIT_NPROC and file permissions), then join a new
   anonymous session keyring (none of the host's keys is possessed here);
2. new user, network, ipc, uts and mount namespaces; the network has only a downed loopback;
3. a new root built from an allow-list: read-only binds of the system directories and this interpreter's
   prefix and import path, a synthesized /etc (the loader's cache and the time zone from the host, a passwd
   and group naming only root and the code's user), a few device nodes, the host's /proc (only as the "fully
   visible" proc the kernel wants before a nested proc mount; every call covers it) and nothing else -- the
   host's /etc files, /tmp, /root, home directories and the project are simply absent;
4. pre-import the standard modules model-written code uses, so a call costs a fork, not an interpreter start;
5. check in a forked probe that the kernel applies the system-call filter (``syscall_filter.py``, sent in
   CONFIG_JSON): a kernel without seccomp filters fails the setup;
6. become the child subreaper of everything forked here.

Per call the parent sends a small JSON header and four descriptors: a memfd holding the code and its files,
the code's stdin (a read-only memfd) and the write ends of its stdout/stderr pipes; where the host gives
cgroups, also the call's ``cgroup.procs`` files (``cgroups.py``). The payload never passes through this
process, so a forked sandbox cannot find another call's hidden inputs in its inherited memory. Each call:

- ``C`` (forked here, stays in this pid namespace, dies with us): its own session and anonymous session
  keyring (so no key of one call is seen by another), a new user, pid, mount, network and ipc namespace of
  its own -- so RLIMIT_NPROC counts only this call's processes and two concurrent calls share nothing --
  then forks ``G`` and mirrors its exit status;
- ``G`` (pid 1 of the call's pid namespace): a session of its own (no signal of the code reaches C), a fresh
  /proc (its lists of keys covered by /dev/null), a size-capped tmpfs on /tmp holding the working directory,
  nested user namespaces refused (``user.max_user_namespaces = 0`` in the call's namespace: the kernel's own
  limit, which the code cannot raise), every capability dropped with no_new_privs, rlimits, then the code
  runs as ``__main__``.

How a call ends, whatever its code does (a new session, a double fork, its death signal cleared, signals
ignored): the namespace's processes live exactly as long as G, since the kernel kills everything in a pid
namespace when its init exits and C's wait for G returns only once it is empty. The server ends a call by
sending C ``KILL_SIGNAL``, on which C SIGKILLs G; a C that dies first (killed from outside) leaves G to this
server, its subreaper, which SIGKILLs and reaps it.

A setup step that fails exits 125 with a ``flash-sandbox-setup:`` line on the call's stderr (or, during the
one-time setup, an ``error`` message on the socket).
"""

import ctypes
import json
import os
import platform
import resource
import selectors
import signal
import socket
import sys

CLONE_NEWNS, CLONE_NEWUTS, CLONE_NEWIPC = 0x00020000, 0x04000000, 0x08000000
CLONE_NEWUSER, CLONE_NEWPID, CLONE_NEWNET = 0x10000000, 0x20000000, 0x40000000
MS_RDONLY, MS_NOSUID, MS_NODEV, MS_NOEXEC, MS_REMOUNT = 1, 2, 4, 8, 32
MS_BIND, MS_REC, MS_PRIVATE = 4096, 16384, 1 << 18
MNT_DETACH, AT_FDCWD, AT_RECURSIVE, MOUNT_ATTR_RDONLY = 2, -100, 0x8000, 1
SYS_MOUNT_SETATTR = 442  # the same number on every architecture (new syscalls are unified)
SYS_PIVOT_ROOT = {"x86_64": 155, "aarch64": 41}.get(platform.machine())
PR_SET_PDEATHSIG, PR_SET_DUMPABLE, PR_CAPBSET_DROP, PR_SET_NO_NEW_PRIVS = 1, 4, 24, 38
PR_SET_CHILD_SUBREAPER, PR_GET_SECCOMP, PR_SET_SECCOMP, SECCOMP_MODE_FILTER = 36, 21, 22, 2
KEYCTL_JOIN_SESSION_KEYRING = 1
PR_CAP_AMBIENT, PR_CAP_AMBIENT_CLEAR_ALL, CAP_VERSION_3 = 47, 4, 0x20080522
SETUP_FAILED = 125
KILL_SIGNAL = signal.SIGUSR1  # server -> C: end the call (C then SIGKILLs G, the namespace's init)
SYSTEM_DIRS = ("/usr", "/bin", "/sbin", "/lib", "/lib32", "/lib64", "/libx32")
ETC_FILES = ("ld.so.cache", "localtime")  # of the host's /etc, only what an interpreter reads
DEVICES = ("null", "zero", "full", "random", "urandom")
NEWROOT = "/tmp"  # a tmpfs mounted here becomes the root; host paths under /tmp stay out
WORKDIR = "/tmp/flash-sandbox-work"
PRELOAD = tuple(  # the standard modules imported once, before any call forks
    "json math re collections itertools functools heapq bisect string random typing dataclasses fractions decimal"
    " statistics copy operator io traceback runpy threading atexit time datetime enum array struct textwrap"
    " unicodedata".split()
)

_libc = ctypes.CDLL(None, use_errno=True)


class SetupError(Exception):
    pass


def _check(rc: int, step: str) -> None:
    if rc != 0:
        raise SetupError(f"{step} failed: {os.strerror(ctypes.get_errno())}")


def _mount(src, dst, fstype, flags, data=None, step="mount") -> None:
    enc = lambda s: None if s is None else s.encode()  # noqa: E731
    _check(_libc.mount(enc(src), enc(dst), enc(fstype), flags, enc(data)), f"{step} {dst}")


class _MountAttr(ctypes.Structure):
    _fields_ = [(name, ctypes.c_uint64) for name in ("attr_set", "attr_clr", "propagation", "userns_fd")]


def _setattr(path: str, flags: int, attr_set: int, attr_clr: int, step: str) -> None:
    attr = _MountAttr(attr_set, attr_clr, 0, 0)
    rc = _libc.syscall(SYS_MOUNT_SETATTR, AT_FDCWD, path.encode(), flags, ctypes.byref(attr), ctypes.sizeof(attr))
    _check(rc, step)


class _SockFprog(ctypes.Structure):
    _fields_ = [("len", ctypes.c_ushort), ("filter", ctypes.c_void_p)]


def _new_session_keyring(keyctl: int) -> None:
    """Join a new anonymous session keyring: keys possessed before are possessed no more."""
    if _libc.syscall(ctypes.c_long(keyctl), ctypes.c_long(KEYCTL_JOIN_SESSION_KEYRING), None) < 0:
        raise SetupError(f"new session keyring failed: {os.strerror(ctypes.get_errno())}")


def _install_filter(prog: bytes) -> None:
    """no_new_privs, then the system-call filter (kept across fork and exec, never removed)."""
    buf = ctypes.create_string_buffer(prog, len(prog))
    fprog = _SockFprog(len(prog) // 8, ctypes.addressof(buf))
    _check(_libc.prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0), "no_new_privs")
    _check(_libc.prctl(PR_SET_SECCOMP, SECCOMP_MODE_FILTER, ctypes.byref(fprog), 0, 0), "system-call filter (seccomp)")


def _probe_filter(cfg: dict) -> None:
    """Install the filter in a forked child and see the kernel apply it there."""
    pid = os.fork()
    if pid == 0:
        try:
            _install_filter(bytes.fromhex(cfg["seccomp"]))
        except SetupError:
            os._exit(2)
        os._exit(0 if _libc.prctl(PR_GET_SECCOMP, 0, 0, 0, 0) == SECCOMP_MODE_FILTER else 3)
    code = os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1])
    if code != 0:
        why = {2: "refuses to install it", 3: "does not apply it"}.get(code, f"fails ({code})")
        raise SetupError(f"this kernel {why}: the sandbox's system-call filter (seccomp) is required to run code")


def _write(path: str, text: str) -> None:
    with open(path, "w") as f:
        f.write(text)


def _enter_user_namespace(flags: int) -> None:
    uid, gid = os.getuid(), os.getgid()
    _check(_libc.unshare(CLONE_NEWUSER | flags), "unshare")
    _write("/proc/self/setgroups", "deny")
    _write("/proc/self/uid_map", f"{uid} {uid} 1")
    _write("/proc/self/gid_map", f"{gid} {gid} 1")


def _allowed_paths() -> list[str]:
    """System directories plus this interpreter's installation. Import-path entries outside
    both (an editable install's project directory, a user's .pth) stay out: they are exactly
    the project files the code must not read."""
    paths = [p for p in SYSTEM_DIRS if os.path.lexists(p)]
    for p in (sys.base_prefix, sys.base_exec_prefix):
        real = os.path.realpath(p)
        if os.path.isdir(real) and not _inside(real, paths):
            paths.append(real)
    for p in paths:
        if p == NEWROOT or p.startswith(NEWROOT + "/"):
            raise SetupError(f"the sandbox cannot show {p}: nothing under {NEWROOT} is kept")
    return paths


def _inside(path: str, tops: list[str]) -> bool:
    return any(path == top or path.startswith(top.rstrip("/") + "/") for top in tops)


def _bind(src: str, rel: str) -> None:
    dst = NEWROOT + rel
    if os.path.islink(src):
        os.makedirs(os.path.dirname(dst), exist_ok=True)
        os.symlink(os.readlink(src), dst)
        return
    if os.path.isdir(src):
        os.makedirs(dst, exist_ok=True)
    else:
        os.makedirs(os.path.dirname(dst), exist_ok=True)
        open(dst, "w").close()
    _mount(src, dst, None, MS_BIND | MS_REC, step="bind")


def _make_etc() -> None:
    """A synthesized /etc: the loader's cache and the time zone from the host, and a passwd and
    group naming only root and the code's own user (home: its working directory)."""
    os.makedirs(NEWROOT + "/etc")
    for name in ETC_FILES:
        if os.path.lexists(f"/etc/{name}"):
            _bind(f"/etc/{name}", f"/etc/{name}")
    uid, gid = os.getuid(), os.getgid()
    user = "nobody" if uid == 65534 else "sandbox"
    own = f"{user}:x:{uid}:{gid}:{user}:{WORKDIR}:/usr/sbin/nologin\n" * (uid != 0)
    _write(NEWROOT + "/etc/passwd", "root:x:0:0:root:/root:/usr/sbin/nologin\n" + own)
    _write(NEWROOT + "/etc/group", "root:x:0:\n" + f"{user}:x:{gid}:\n" * (gid != 0))


def _build_root() -> None:
    """A tmpfs root holding read-only binds of the allowed paths, then pivot into it."""
    if SYS_PIVOT_ROOT is None:
        raise SetupError(f"no pivot_root number known for {platform.machine()}")
    _mount(None, "/", None, MS_REC | MS_PRIVATE, step="private mounts")
    _mount("tmpfs", NEWROOT, "tmpfs", MS_NOSUID | MS_NODEV, "size=1m,mode=755", step="root tmpfs")
    for path in _allowed_paths():
        _bind(path, path)
    _make_etc()
    for dev in DEVICES:
        _bind(f"/dev/{dev}", f"/dev/{dev}")
    _bind("/proc", "/proc")
    os.makedirs(NEWROOT + "/tmp")
    os.makedirs(NEWROOT + "/.old")
    _check(_libc.syscall(SYS_PIVOT_ROOT, NEWROOT.encode(), (NEWROOT + "/.old").encode()), "pivot_root")
    os.chdir("/")
    _check(_libc.umount2(b"/.old", MNT_DETACH), "detach the host root")
    os.rmdir("/.old")
    _setattr("/", AT_RECURSIVE, MOUNT_ATTR_RDONLY, 0, "read-only root")
    for path in [f"/dev/{dev}" for dev in DEVICES] + ["/proc"]:  # /proc: each call's uid_map
        _setattr(path, 0, 0, MOUNT_ATTR_RDONLY, f"writable {path}")


def setup(cfg: dict) -> None:
    if cfg["drop_to"] is not None:
        uid, gid = cfg["drop_to"]
        os.setgroups([])
        os.setgid(gid)
        os.setuid(uid)
        _libc.prctl(PR_SET_DUMPABLE, 1, 0, 0, 0)  # else /proc/self/uid_map stays root's
    _new_session_keyring(cfg["keyctl"])
    _enter_user_namespace(CLONE_NEWNET | CLONE_NEWIPC | CLONE_NEWUTS | CLONE_NEWNS)
    _build_root()
    for name in PRELOAD:
        __import__(name)
    _probe_filter(cfg)


class _CapHeader(ctypes.Structure):
    _fields_ = [("version", ctypes.c_uint32), ("pid", ctypes.c_int)]


def _drop_capabilities() -> None:
    """no_new_privs, an empty bounding set, no ambient, inheritable, permitted or effective."""
    _check(_libc.prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0), "no_new_privs")
    for cap in range(64):
        if _libc.prctl(PR_CAPBSET_DROP, cap, 0, 0, 0) != 0:
            break  # past the last capability this kernel knows
    _libc.prctl(PR_CAP_AMBIENT, PR_CAP_AMBIENT_CLEAR_ALL, 0, 0, 0)
    data = (ctypes.c_uint32 * 6)()
    _check(_libc.capset(ctypes.byref(_CapHeader(CAP_VERSION_3, 0)), data), "capset")


def _prepare_call(req: dict, payload_fd: int, prog: bytes) -> None:
    """In G, before the code: a session of its own (so no signal of the code reaches C), /proc,
    the tmpfs, the files, the locks, the limits, the system-call filter."""
    os.setsid()
    signal.pthread_sigmask(signal.SIG_UNBLOCK, {KILL_SIGNAL})
    _check(_libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0), "pdeathsig")
    _mount("proc", "/proc", "proc", MS_NOSUID | MS_NODEV | MS_NOEXEC, step="mount")
    for path in filter(os.path.exists, ("/proc/keys", "/proc/key-users")):  # the host's keys
        _mount("/dev/null", path, None, MS_BIND, step="hide")
    tmp = f"size={req['disk_mb']}m,nr_inodes={req['max_files']},mode=700"
    _mount("tmpfs", "/tmp", "tmpfs", MS_NOSUID | MS_NODEV, tmp, step="mount")
    _write("/proc/sys/user/max_user_namespaces", "0")
    with os.fdopen(payload_fd, "rb") as f:
        payload = json.loads(f.read())
    os.mkdir(WORKDIR, 0o700)
    os.chdir(WORKDIR)
    for name, text in payload["files"].items():
        with open(name, "w", encoding="utf-8") as f:
            f.write(text)
    _drop_capabilities()
    for name, (soft, hard) in req["limits"].items():
        resource.setrlimit(getattr(resource, name), (soft, hard))
    _install_filter(prog)


def _stdio() -> None:
    """Fresh text streams over fds 0-2, as a new interpreter would have them."""
    sys.stdin = sys.__stdin__ = open(0, encoding="utf-8", closefd=False)
    sys.stdout = sys.__stdout__ = open(1, "w", encoding="utf-8", closefd=False)
    sys.stderr = sys.__stderr__ = open(2, "w", encoding="utf-8", errors="backslashreplace", buffering=1, closefd=False)


def _exit_code(exc: BaseException | None) -> int:
    import traceback

    if exc is None:
        return 0
    if isinstance(exc, SystemExit):
        if exc.code is None or isinstance(exc.code, int):
            return exc.code or 0
        print(exc.code, file=sys.stderr)
        return 1
    tb = exc.__traceback__  # from the code's first frame, as the interpreter would print it
    while tb is not None and tb.tb_frame.f_code.co_filename != "main.py":
        tb = tb.tb_next
    traceback.print_exception(type(exc), exc, tb)
    return 1


def _run_code(env: dict) -> None:
    """Run main.py as ``python -I main.py`` would, then exit as the interpreter would."""
    import atexit
    import runpy
    import threading

    os.environ.clear()
    os.environ.update(env)
    _stdio()
    sys.argv = ["main.py"]
    try:
        runpy.run_path("main.py", run_name="__main__")
        exc = None
    except BaseException as e:  # noqa: BLE001 -- everything the code raises is its own outcome
        exc = e
    code = _exit_code(exc)
    try:
        threading._shutdown()
        atexit._run_exitfuncs()
        for stream in (sys.stdout, sys.stderr, sys.__stdout__, sys.__stderr__):
            stream.flush()
    except BaseException:  # noqa: BLE001 -- a broken stream at exit: the exit code stands
        pass
    os._exit(code & 0xFF)


def _call_child(req: dict, payload_fd: int, prog: bytes) -> None:
    """G: pid 1 of the call's namespaces."""
    try:
        _prepare_call(req, payload_fd, prog)
    except (OSError, SetupError) as exc:
        os.write(2, f"flash-sandbox-setup: {exc}\n".encode())
        os._exit(SETUP_FAILED)
    _run_code(req["env"])


def _mirror(pid: int) -> None:
    """Exit the way G did: same exit code, or death by the same signal. Until G has exited,
    KILL_SIGNAL (from the server) SIGKILLs G, which ends the call's whole pid namespace."""
    live = [True]

    def kill_namespace(*_) -> None:
        if live[0]:  # G is a zombie at worst (waited with WNOWAIT): its pid is not reused
            os.kill(pid, signal.SIGKILL)

    signal.signal(KILL_SIGNAL, kill_namespace)
    signal.pthread_sigmask(signal.SIG_UNBLOCK, {KILL_SIGNAL})
    os.waitid(os.P_PID, pid, os.WEXITED | os.WNOWAIT)
    live[0] = False
    _, status = os.waitpid(pid, 0)
    if os.WIFSIGNALED(status):
        sig = os.WTERMSIG(status)
        if sig not in (signal.SIGKILL, signal.SIGSTOP):  # those two have no handler to reset
            signal.signal(sig, signal.SIG_DFL)
        signal.pthread_sigmask(signal.SIG_UNBLOCK, {sig})
        os.kill(os.getpid(), sig)
    os._exit(os.WEXITSTATUS(status) if os.WIFEXITED(status) else SETUP_FAILED)


def _call(req: dict, fds: list[int], server_fd: int, cfg: dict) -> None:
    """C: the call's keyring and namespaces, then G, then wait."""
    try:
        os.close(server_fd)
        os.setsid()  # kill(0) from the code reaches this call's processes, not the server
        _new_session_keyring(cfg["keyctl"])
        for fd in fds[4:]:  # its cgroups (flash.rewards.cgroups), before anything else runs
            os.write(fd, str(os.getpid()).encode())
        for target, fd in zip((0, 1, 2), fds[1:]):
            os.dup2(fd, target)
        _check(_libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0), "pdeathsig")
        os.closerange(3, fds[0])
        os.closerange(fds[0] + 1, 1 << 16)
        _enter_user_namespace(CLONE_NEWPID | CLONE_NEWNS | CLONE_NEWNET | CLONE_NEWIPC)
        signal.pthread_sigmask(signal.SIG_BLOCK, {KILL_SIGNAL})  # until _mirror handles it
        pid = os.fork()
    except (OSError, SetupError) as exc:
        os.write(2, f"flash-sandbox-setup: {exc}\n".encode())
        os._exit(SETUP_FAILED)
    if pid == 0:
        _call_child(req, fds[0], bytes.fromhex(cfg["seccomp"]))
    for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
        signal.signal(sig, signal.SIG_IGN)  # only SIGKILL (from the server) ends us early
    devnull = os.open("/dev/null", os.O_RDWR)
    for fd in (0, 1, 2, fds[0]):
        os.dup2(devnull, fd)  # the pipes close when the code's last process does
    _mirror(pid)


def _children() -> list[int]:
    """This process's children (the kernel's list, else a scan of /proc)."""
    me = os.getpid()
    try:
        with open(f"/proc/{me}/task/{me}/children") as f:
            return [int(p) for p in f.read().split()]
    except OSError:
        pass
    kids = []
    for name in os.listdir("/proc"):
        try:
            with open(f"/proc/{name}/stat") as f:
                if int(f.read().rsplit(")", 1)[1].split()[1]) == me:
                    kids.append(int(name))
        except (OSError, ValueError, IndexError):
            continue
    return kids


def _reap_orphans(calls: set[int]) -> None:
    """SIGKILL and reap every child that is not a running call's C: a G whose C died first
    (this process is their subreaper). Reaping G waits for its pid namespace to empty."""
    for pid in _children():
        if pid not in calls:
            try:
                os.kill(pid, signal.SIGKILL)
                os.waitpid(pid, 0)
            except (ProcessLookupError, ChildProcessError):
                pass


def _end_all(running: dict) -> None:
    """The parent is gone: end every call (and its namespace), then exit."""
    for pid, _ in running.values():
        os.kill(pid, KILL_SIGNAL)
    for pid, _ in running.values():
        os.waitpid(pid, 0)
    _reap_orphans(set())
    os._exit(0)


def serve(sock: socket.socket, cfg: dict) -> None:
    """Fork a call per request; report each call's pid and, when it ends, its exit status."""
    sel = selectors.DefaultSelector()
    sel.register(sock, selectors.EVENT_READ)
    running: dict[int, tuple[int, int]] = {}  # call id -> (pid, pidfd)
    while True:
        for key, _ in sel.select():
            if key.fileobj is not sock:
                cid = key.data
                pid, pidfd = running.pop(cid)
                sel.unregister(pidfd)
                os.close(pidfd)
                _, status = os.waitpid(pid, 0)
                end = {"exit": os.WEXITSTATUS(status)}
                if os.WIFSIGNALED(status):  # C ended early: its G may be left, with its namespace
                    end = {"signal": os.WTERMSIG(status)}
                    _reap_orphans({p for p, _ in running.values()})
                sock.send(json.dumps({"id": cid, **end}).encode())
                continue
            msg, fds, _, _ = socket.recv_fds(sock, 1 << 16, 8)
            if not msg:
                _end_all(running)
            req = json.loads(msg)
            if req["op"] == "kill":  # hard: C did not answer KILL_SIGNAL (its G is then reaped)
                if req["id"] in running:
                    sig = signal.SIGKILL if req.get("hard") else KILL_SIGNAL
                    os.kill(running[req["id"]][0], sig)
                continue
            pid = os.fork()
            if pid == 0:
                _call(req, fds, sock.fileno(), cfg)
            for fd in fds:
                os.close(fd)
            pidfd = os.pidfd_open(pid)
            running[req["id"]] = (pid, pidfd)
            sel.register(pidfd, selectors.EVENT_READ, req["id"])
            sock.send(json.dumps({"id": req["id"], "pid": pid}).encode())


def main() -> None:
    cfg = json.loads(sys.argv[1])
    sock = socket.socket(fileno=cfg["fd"])
    try:
        setup(cfg)
    except (OSError, SetupError, ImportError) as exc:
        sock.send(json.dumps({"error": f"flash-sandbox-setup: {exc}"}).encode())
        os._exit(SETUP_FAILED)
    _libc.prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0)  # a G whose C died comes back to us
    sock.send(json.dumps({"ready": os.getpid()}).encode())
    serve(sock, cfg)


main()
