"""The parent's side of the sandbox fork server (``_zygote.py``): one server per process, many
concurrent calls through one SOCK_SEQPACKET socket.

Why a server: starting an interpreter and building namespaces per call cost ~75 ms where a bare
``python -S -c`` costs ~8 ms; the server pays for both once and each call is two forks.

A call hands the server four descriptors (a memfd with the code and files, a read-only memfd as
stdin, the write ends of two pipes) and gets back the call's pid and, later, its exit status.
The code's bytes go straight from this process to the call through the memfd, never through the
server's memory. Every call runs under the system-call filter of ``syscall_filter.py`` and in a
session keyring of its own. A reader thread matches replies to calls; if the server dies every
waiting call fails with ``SandboxSetupError`` and the next call starts a new server.
"""

from __future__ import annotations

import functools
import itertools
import json
import os
import platform
import socket
import subprocess
import threading
import time
from pathlib import Path

from flash.rewards.syscall_filter import ARCHES, launcher_config

_START_TIMEOUT_S = 30.0
_REPLY_GRACE_S = 10.0
_KILL_GRACE_S = 2.0  # for the call's mirror process to end its namespace, before SIGKILL


class SandboxSetupError(RuntimeError):
    """The sandbox itself could not start (a host problem, not the code's fault)."""


@functools.lru_cache(maxsize=1)
def _zygote_source() -> str:
    return Path(__file__).with_name("_zygote.py").read_text()


def memfd(data: bytes, readonly: bool = False) -> int:
    """An anonymous in-memory file holding ``data``, at offset 0 (read-only: a fresh open file
    description that cannot write back)."""
    fd = os.memfd_create("flash-sandbox", os.MFD_CLOEXEC)
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view) :]
    os.lseek(fd, 0, os.SEEK_SET)
    if not readonly:
        return fd
    ro = os.open(f"/proc/self/fd/{fd}", os.O_RDONLY | os.O_CLOEXEC)
    os.close(fd)
    return ro


class _Call:
    __slots__ = ("pid", "status", "done")

    def __init__(self) -> None:
        self.pid: int | None = None
        self.status: dict | None = None  # {"exit": n} | {"signal": n} | {"lost": reason}
        self.done = threading.Event()


def confinement() -> dict:
    """The system-call filter and keyring settings every call gets (``syscall_filter``)."""
    confine = launcher_config()
    if not confine:
        raise SandboxSetupError(
            f"the code sandbox has no system-call filter for this machine "
            f"({platform.machine()}); it runs on {', '.join(ARCHES)}"
        )
    return confine


class ForkServer:
    """A running ``_zygote.py`` and the calls in flight on it. ``confine``: the filter and
    keyring settings of its calls (default ``confinement()``)."""

    def __init__(self, python: str, drop_to: tuple[int, int] | None, confine: dict | None = None) -> None:
        cfg = {"drop_to": drop_to, **(confine or confinement())}
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        cfg["fd"] = theirs.fileno()
        self.proc = subprocess.Popen(
            [python, "-I", "-c", _zygote_source(), json.dumps(cfg)],
            pass_fds=[theirs.fileno()],
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            env={},
            cwd="/",
            start_new_session=True,
        )
        theirs.close()
        self.sock = ours
        ours.settimeout(_START_TIMEOUT_S)
        try:
            hello = json.loads(ours.recv(1 << 16) or b'{"error": "the sandbox server exited"}')
        except (OSError, ValueError) as exc:
            hello = {"error": f"the sandbox server did not start: {exc}"}
        ours.settimeout(None)
        if "error" in hello:
            self.close()
            raise SandboxSetupError(hello["error"])
        self._calls: dict[int, _Call] = {}
        self._lock = threading.Lock()
        self._ids = itertools.count()
        self.lost: str | None = None
        threading.Thread(target=self._read, name="sandbox-forkserver", daemon=True).start()

    def _read(self) -> None:
        while True:
            try:
                msg = self.sock.recv(1 << 16)
            except OSError:
                msg = b""
            if not msg:
                return self._fail_all("the sandbox server exited")
            reply = json.loads(msg)
            with self._lock:
                call = self._calls.get(reply["id"])
            if call is None:
                continue
            if "pid" in reply:
                call.pid = reply["pid"]
            else:
                call.status = reply
                call.done.set()

    def _fail_all(self, reason: str) -> None:
        with self._lock:
            self.lost = reason
            calls, self._calls = list(self._calls.values()), {}
        for call in calls:
            call.status = {"lost": reason}
            call.done.set()

    def start(
        self, header: dict, payload: bytes, stdin: bytes, extra_fds: list[int] = ()
    ) -> tuple[int, _Call, int, int]:
        """Send one call; returns its id, its handle and the read ends of stdout and stderr.
        ``extra_fds`` (closed here): the call's cgroup.procs files, which it joins first."""
        sent = [memfd(payload), memfd(stdin, readonly=True)]
        out_r, out_w = os.pipe2(os.O_CLOEXEC)
        err_r, err_w = os.pipe2(os.O_CLOEXEC)
        sent += [out_w, err_w, *extra_fds]
        call = _Call()
        try:
            with self._lock:
                if self.lost:
                    raise SandboxSetupError(self.lost)
                cid = next(self._ids)
                self._calls[cid] = call
                socket.send_fds(self.sock, [json.dumps({**header, "op": "run", "id": cid}).encode()], sent)
        except OSError as exc:
            for fd in (out_r, err_r):
                os.close(fd)
            raise SandboxSetupError(f"the sandbox server is gone: {exc}") from exc
        finally:
            for fd in sent:
                os.close(fd)
        return cid, call, out_r, err_r

    def kill(self, cid: int, hard: bool = False) -> None:
        """End the call's whole pid namespace (``hard``: SIGKILL its mirror process instead,
        for one that does not answer; the server then reaps the namespace's init)."""
        with self._lock:
            if self.lost is None:
                try:
                    self.sock.send(json.dumps({"op": "kill", "id": cid, "hard": hard}).encode())
                except OSError:
                    pass

    def finish(self, cid: int, call: _Call, deadline: float) -> dict:
        """The call's exit status; killed at ``deadline`` if it is still running then."""
        if not call.done.wait(max(deadline - time.monotonic(), 0.0)):
            self.kill(cid)
            if not call.done.wait(_KILL_GRACE_S):
                self.kill(cid, hard=True)
            if not call.done.wait(_REPLY_GRACE_S):
                self._forget(cid)
                raise SandboxSetupError("the sandbox server did not report a killed call")
        self._forget(cid)
        if "lost" in call.status:
            raise SandboxSetupError(call.status["lost"])
        return call.status

    def _forget(self, cid: int) -> None:
        with self._lock:
            self._calls.pop(cid, None)

    def close(self) -> None:
        try:
            self.sock.close()
        finally:
            self.proc.kill()
            self.proc.wait()


_SERVERS: dict[tuple, ForkServer] = {}
_SERVERS_LOCK = threading.Lock()


def server(python: str, drop_to: tuple[int, int] | None) -> ForkServer:
    """This process's server (a forked child starts its own; a dead one is replaced)."""
    key = (os.getpid(), python, drop_to)
    with _SERVERS_LOCK:
        srv = _SERVERS.get(key)
        if srv is None or srv.lost is not None or srv.proc.poll() is not None:
            if srv is not None:
                srv.close()
            srv = _SERVERS[key] = ForkServer(python, drop_to)
        return srv
