"""Code sandbox: the system-call filter (flash/rewards/syscall_filter.py) and the keyrings of the
fork server and of each call (_zygote.py, _jail.py).

Sandboxed code tries each class of denied call against a host that holds a secret key in its
session keyring, the way a driver's fork server would inherit one: a thread of this process joins
a fresh keyring and starts the fork server (credentials, keyrings included, are per thread).
"""

import ctypes
import json
import platform
import queue
import signal
import struct
import threading

import pytest

from flash.rewards import forkserver, sandbox, syscall_filter
from flash.rewards.sandbox import SandboxSetupError, execute, isolation_level
from tests.helpers.sandbox import host_untouched  # noqa: F401 -- autouse: nothing outlives a call

MACHINE = platform.machine()
EPERM, ENOKEY = [-1, 1], [-1, 126]
SESSION, USER, USER_SESSION = -3, -4, -5  # KEY_SPEC_*
GET_ID, JOIN, CLEAR, SEARCH, READ = 0, 1, 7, 10, 11  # KEYCTL_*
namespaces = pytest.mark.skipif(isolation_level() != "namespaces", reason="this host gives no namespaces")
_libc = ctypes.CDLL(None, use_errno=True)


def _sys(name: str, *args) -> list[int]:
    ctypes.set_errno(0)
    conv = [ctypes.c_long(a) if isinstance(a, int) else a for a in args]
    rc = _libc.syscall(ctypes.c_long(syscall_filter.number(name, MACHINE)), *conv)
    return [rc, ctypes.get_errno() if rc == -1 else 0]


_NR = {n: syscall_filter.number(n, MACHINE) for n in syscall_filter.NUMBERS} if MACHINE in syscall_filter.ARCHES else {}
PRELUDE = f"""\
import ctypes, json, os
libc = ctypes.CDLL(None, use_errno=True)
NR = {_NR!r}
def call(name, *args):
    ctypes.set_errno(0)
    conv = [ctypes.c_long(a) if isinstance(a, int) else a for a in args]
    rc = libc.syscall(ctypes.c_long(NR[name] if isinstance(name, str) else name), *conv)
    return [rc, ctypes.get_errno() if rc == -1 else 0]
out = {{}}
"""


def _boxed(body: str) -> dict:
    res = execute(PRELUDE + body + "\nprint(json.dumps(out))", timeout_s=10)
    assert res.status == "ok", res.stderr
    return json.loads(res.stdout)


class _Host:
    """A thread of this process in an anonymous session keyring of its own holding one secret
    key, and the fork server it started (which inherits that keyring, as a driver's would)."""

    def __init__(self, confine: dict | None = None) -> None:
        self._jobs: queue.Queue = queue.Queue()
        threading.Thread(target=self._loop, daemon=True).start()
        self.keyring = self.run(lambda: _sys("keyctl", JOIN, None)[0])
        self.secret = self.run(lambda: _sys("add_key", b"user", b"host-secret", b"s3cret", 6, SESSION)[0])
        args = (sandbox.sandbox_python(), sandbox._drop_to()) + ((confine,) if confine else ())
        self.server = self.run(lambda: forkserver.ForkServer(*args))

    def _loop(self) -> None:
        while True:
            fn, box = self._jobs.get()
            if fn is None:
                return
            try:
                box.put((True, fn()))
            except BaseException as exc:  # noqa: BLE001 -- handed back to the caller
                box.put((False, exc))

    def run(self, fn):
        box: queue.Queue = queue.Queue(1)
        self._jobs.put((fn, box))
        ok, value = box.get(timeout=60)
        if not ok:
            raise value
        return value

    def contents(self) -> tuple[list[int], bytes]:
        """The serials in the host's session keyring and the secret key's payload."""

        def read(serial: int) -> bytes:
            buf = ctypes.create_string_buffer(256)
            n = _sys("keyctl", READ, serial, buf, 256)[0]
            return buf.raw[: max(n, 0)]

        ring, secret = self.run(lambda: (read(SESSION), read(self.secret)))
        return list(struct.unpack(f"={len(ring) // 4}i", ring)), secret

    def close(self) -> None:
        self.server.close()
        self._jobs.put((None, None))


@pytest.fixture(scope="module")
def host():
    if isolation_level() != "namespaces" or MACHINE not in syscall_filter.ARCHES:
        pytest.skip("this host gives no namespaces")
    h = _Host()
    yield h
    h.close()


@pytest.fixture
def on_host(host, monkeypatch):
    """Sandbox calls of this test run on the host thread's fork server."""
    monkeypatch.setattr(sandbox, "server", lambda *_: host.server)
    assert host.contents() == ([host.secret], b"s3cret")
    yield host
    assert host.contents() == ([host.secret], b"s3cret")  # the host's keyring untouched


def _run_filter(prog: bytes, arch: int, nr: int) -> int:
    """What the classic-BPF program returns for one system call (the opcodes the filter uses)."""
    insns = [struct.unpack_from("=HBBI", prog, i) for i in range(0, len(prog), 8)]
    data, acc, pc = struct.pack("=iI", nr, arch), 0, 0
    while True:
        code, jt, jf, k = insns[pc]
        if code == 0x06:  # BPF_RET | BPF_K
            return k
        if code == 0x20:  # BPF_LD | BPF_W | BPF_ABS
            acc, pc = struct.unpack_from("=I", data, k)[0], pc + 1
        elif code in (0x15, 0x35):  # BPF_JMP | BPF_JEQ / BPF_JGE | BPF_K
            pc += 1 + (jt if (acc == k if code == 0x15 else acc >= k) else jf)
        else:
            raise AssertionError(f"opcode {code:#x} outside the filter's subset")


ALLOWED = {  # read, write, openat, mmap, clone, clone3, execve, futex, wait4, exit_group, prctl
    "x86_64": (0, 1, 257, 9, 56, 435, 59, 202, 61, 231, 157),
    "aarch64": (63, 64, 56, 222, 220, 435, 221, 98, 260, 94, 167),
}
FOREIGN = {"x86_64": 0x40000003, "aarch64": 0x40000028}  # AUDIT_ARCH_I386, AUDIT_ARCH_ARM


@pytest.mark.parametrize("machine", ["x86_64", "aarch64"])
def test_the_filter_refuses_each_listed_call_and_a_foreign_abi(machine):
    prog, arch = syscall_filter.program(machine), syscall_filter.ARCHES[machine]
    eperm, allow, kill = 0x00050001, 0x7FFF0000, 0x80000000
    assert len(syscall_filter.DENIED_NAMES) == 42
    for name in syscall_filter.DENIED_NAMES:
        assert _run_filter(prog, arch, syscall_filter.number(name, machine)) == eperm, name
    assert [_run_filter(prog, arch, nr) for nr in ALLOWED[machine]] == [allow] * 11
    assert _run_filter(prog, FOREIGN[machine], 39) == kill
    x32 = 0x40000000 | syscall_filter.number("keyctl", machine)
    assert _run_filter(prog, arch, x32) == (eperm if machine == "x86_64" else allow)
    assert syscall_filter.program("riscv64") is None


def test_a_machine_without_a_filter_gets_no_sandbox(monkeypatch):
    monkeypatch.setattr(syscall_filter.platform, "machine", lambda: "riscv64")
    with pytest.raises(
        SandboxSetupError,
        match=r"no system-call filter for this machine "
        r"\(riscv64\); it runs on x86_64, aarch64",
    ):
        forkserver.confinement()


@namespaces
def test_every_denied_call_is_eperm_in_a_sandboxed_call():
    got = _boxed(
        "for name in NR:\n"
        "    if name in %r:\n"
        "        out[name] = call(name, 0, 0, 0, 0, 0, 0)\n"
        "status = open('/proc/self/status').read().splitlines()\n"
        "out['status'] = [l for l in status if l.startswith(('Seccomp', 'NoNewPrivs'))]\n"
        % (syscall_filter.DENIED_NAMES,)
    )
    assert got.pop("status") == ["NoNewPrivs:\t1", "Seccomp:\t2", "Seccomp_filters:\t1"]
    assert got == {name: EPERM for name in syscall_filter.DENIED_NAMES}


@namespaces
def test_sandboxed_code_cannot_read_or_clear_the_host_session_keyring(on_host):
    got = _boxed(
        "buf = ctypes.create_string_buffer(256)\n"
        f"out['id'] = call('keyctl', {GET_ID}, {SESSION}, 0)\n"
        f"out['search'] = call('keyctl', {SEARCH}, {SESSION}, b'user', b'host-secret', 0)\n"
        f"out['read_ring'] = call('keyctl', {READ}, {on_host.keyring}, buf, 256)\n"
        f"out['read_key'] = call('keyctl', {READ}, {on_host.secret}, buf, 256)\n"
        f"out['clear'] = call('keyctl', {CLEAR}, {SESSION})\n"
        f"out['clear_host'] = call('keyctl', {CLEAR}, {on_host.keyring})\n"
        "out['proc_keys'] = open('/proc/keys').read()\n"
    )
    assert got.pop("proc_keys") == ""  # not even the keys' names are listed
    assert got == dict.fromkeys(("id", "search", "read_ring", "read_key", "clear", "clear_host"), EPERM)


@namespaces
def test_sandboxed_code_cannot_add_a_key(on_host):
    got = _boxed(
        "for ring in (%d, %d, %d, %d):\n"
        "    out[ring] = call('add_key', b'user', b'left', b'x', 1, ring)\n"
        % (SESSION, USER, USER_SESSION, on_host.keyring)
    )
    assert got == {str(r): EPERM for r in (SESSION, USER, USER_SESSION, on_host.keyring)}


@namespaces
def test_sandboxed_code_cannot_request_a_key(on_host):
    got = _boxed(
        "out['host'] = call('request_key', b'user', b'host-secret', None, 0)\n"
        "out['upcall'] = call('request_key', b'user', b'new', b'callout', 0)\n"
    )
    assert got == {"host": EPERM, "upcall": EPERM}


@namespaces
def test_other_processes_memory_is_out_of_reach():
    got = _boxed(
        "pid = os.fork()\n"
        "if pid == 0:\n"
        "    os._exit(0 if call('ptrace', 0, 0, 0, 0)[0] == 0 else 10 + ctypes.get_errno())\n"
        "out['traceme'] = os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1])\n"
        "r, w = os.pipe()\n"
        "pid = os.fork()\n"
        "if pid == 0:\n"
        "    os.read(r, 1)\n"
        "    os._exit(0)\n"
        "out['attach'] = call('ptrace', 16, pid, 0, 0)\n"  # PTRACE_ATTACH
        "class IOV(ctypes.Structure):\n"
        "    _fields_ = [('base', ctypes.c_void_p), ('len', ctypes.c_size_t)]\n"
        "src, dst = ctypes.create_string_buffer(b'secret'), ctypes.create_string_buffer(8)\n"
        "mine, theirs = IOV(ctypes.addressof(dst), 6), IOV(ctypes.addressof(src), 6)\n"
        "for name in ('process_vm_readv', 'process_vm_writev'):\n"
        "    out[name] = call(name, pid, ctypes.byref(mine), 1, ctypes.byref(theirs), 1, 0)\n"
        "out['kcmp'] = call('kcmp', os.getpid(), pid, 0, 0, 0)\n"
        "os.write(w, b'x')\n"
        "os.waitpid(pid, 0)\n"
    )
    assert got == {"traceme": 11, "attach": EPERM, "process_vm_readv": EPERM, "process_vm_writev": EPERM, "kcmp": EPERM}


@namespaces
def test_kernel_interfaces_without_privilege_are_refused():
    got = _boxed(
        "params, attr = ctypes.create_string_buffer(120), ctypes.create_string_buffer(128)\n"
        "attr[0:8] = (1).to_bytes(4, 'little') + (128).to_bytes(4, 'little')\n"
        "out['io_uring_setup'] = call('io_uring_setup', 1, params)\n"
        "out['perf_event_open'] = call('perf_event_open', attr, 0, -1, -1, 0)\n"
        "out['bpf'] = call('bpf', 0, ctypes.create_string_buffer(128), 128)\n"
        "out['personality'] = call('personality', 0xFFFFFFFF)\n"
        "out['userfaultfd'] = call('userfaultfd', 0)\n"
    )
    assert got == dict.fromkeys(("io_uring_setup", "perf_event_open", "bpf", "personality", "userfaultfd"), EPERM)


@namespaces
def test_mount_and_namespace_calls_are_refused():
    got = _boxed(
        "handle, mount_id = ctypes.create_string_buffer(136), ctypes.create_string_buffer(8)\n"
        "handle[0:4] = (128).to_bytes(4, 'little')\n"
        "out['unshare'] = call('unshare', 0)\n"
        "out['setns'] = call('setns', os.open('/proc/self/ns/mnt', os.O_RDONLY), 0)\n"
        "out['name_to_handle_at'] = call('name_to_handle_at', -100, b'/', handle,"
        " mount_id, 0)\n"
        "out['fsopen'] = call('fsopen', b'tmpfs', 0)\n"
    )
    assert got == dict.fromkeys(("unshare", "setns", "name_to_handle_at", "fsopen"), EPERM)


@namespaces
@pytest.mark.skipif(MACHINE != "x86_64", reason="x32 and i386 are x86_64's other ABIs")
def test_a_foreign_abi_is_refused():
    x32 = _boxed("out['keyctl'] = call(0x40000000 | NR['keyctl'], 0, -3, 0)\n")
    assert x32 == {"keyctl": EPERM}
    i386_getpid = (
        "import ctypes, mmap\n"  # mov eax, 20; int 0x80; ret
        "m = mmap.mmap(-1, 4096, prot=mmap.PROT_READ | mmap.PROT_WRITE | mmap.PROT_EXEC)\n"
        "m.write(bytes([0xB8, 20, 0, 0, 0, 0xCD, 0x80, 0xC3]))\n"
        "fn = ctypes.CFUNCTYPE(ctypes.c_int)(ctypes.addressof(ctypes.c_char.from_buffer(m)))\n"
        "print(fn())\n"
    )
    res = execute(i386_getpid, timeout_s=10)
    if res.signal == signal.SIGSEGV:
        pytest.skip("this kernel has no i386 emulation")
    assert (res.status, res.signal, res.stdout) == ("killed", signal.SIGSYS, "")


@namespaces
def test_a_key_left_by_one_call_is_not_seen_by_the_next():
    """With the key calls let through, the keyrings alone keep calls and host apart."""
    keys = syscall_filter.DENIED["keys"]
    h = _Host(syscall_filter.launcher_config(tuple(n for n in syscall_filter.DENIED_NAMES if n not in keys)))
    try:
        with pytest.MonkeyPatch.context() as mp:
            mp.setattr(sandbox, "server", lambda *_: h.server)
            look = (
                "out['id'] = call('keyctl', %d, %d, 0)[0]\n"
                "for ring in (%d, %d, %d):\n"
                "    out[ring] = call('keyctl', %d, ring, b'user', b'left', 0)\n"
                "out['host'] = call('keyctl', %d, %d, b'user', b'host-secret', 0)\n"
                % (GET_ID, SESSION, SESSION, USER, USER_SESSION, SEARCH, SEARCH, SESSION)
            )
            first = _boxed(
                look + "for ring in (%d, %d, %d):\n"
                "    out['add%%d' %% ring] = call('add_key', b'user', b'left', b'x', 1,"
                " ring)[0] > 0\n" % (SESSION, USER, USER_SESSION)
            )
            second = _boxed(look)
        assert [first.pop(f"add{r}") for r in (SESSION, USER, USER_SESSION)] == [True] * 3
        ids = {first.pop("id"), second.pop("id"), h.keyring}
        assert len(ids) == 3  # each call in its own session keyring, neither the host's
        assert first == second == {**{str(r): ENOKEY for r in (SESSION, USER, USER_SESSION)}, "host": ENOKEY}
        assert h.contents() == ([h.secret], b"s3cret")
    finally:
        h.close()


@namespaces
def test_a_kernel_that_refuses_the_filter_gets_no_sandbox():
    nr = syscall_filter.number("keyctl", MACHINE)
    python, drop = sandbox.sandbox_python(), sandbox._drop_to()
    invalid = struct.pack("=HBBI", 0xFFFF, 0, 0, 0).hex()  # the kernel answers EINVAL
    with pytest.raises(
        SandboxSetupError,
        match=r"this kernel refuses to install it: the "
        r"sandbox's system-call filter \(seccomp\) is required to run code",
    ):
        forkserver.ForkServer(python, drop, {"seccomp": invalid, "keyctl": nr})


@pytest.mark.skipif(MACHINE not in syscall_filter.ARCHES, reason="no filter for this machine")
def test_the_audit_hook_level_runs_under_the_filter_too(monkeypatch):
    res = execute("print(open('/proc/self/status').read())", isolation="audit-hook")
    status = [line for line in res.stdout.splitlines() if line.startswith("Seccomp:")]
    assert (res.status, status) == ("ok", ["Seccomp:\t2"])
    invalid = {"seccomp": "ffff000000000000", "keyctl": syscall_filter.number("keyctl", MACHINE)}
    monkeypatch.setattr(sandbox, "confinement", lambda: invalid)
    with pytest.raises(
        SandboxSetupError,
        match=r"^flash-sandbox-setup: \[Errno 22\] system-call "
        r"filter \(seccomp\): Invalid argument$",
    ):
        execute("print(1)", isolation="audit-hook")
