"""Code sandbox: nothing of a call outlives it, however its processes detach, and its root shows
nothing of the host's /etc.

Each detaching program ends its detached processes in ``sleep MARK`` (a number unique to the
test), so a survivor is found by its /proc/<pid>/cmdline; the call's cgroups (where the host gives
them) must be gone when ``execute`` returns. Every case runs twice: with the call's cgroups, and
with them switched off, where the pid namespace alone must end the call.
"""

import itertools
import os
import threading
import time
from pathlib import Path

import pytest

from flash.rewards import cgroups, forkserver, sandbox
from flash.rewards.sandbox import execute, isolation_level
from tests.helpers.sandbox import host_untouched  # noqa: F401 -- autouse: nothing outlives a call

pytestmark = pytest.mark.skipif(isolation_level() != "namespaces", reason="this host gives no namespaces")

_SEQ = itertools.count()
# Bound to the test's marker before each program: a child that runs ``sleep MARK`` and a wait
# until it does (so every case really has a detached process when the call ends).
_PRELUDE = """import ctypes, os, signal, time
def sleep_here():
    os.execv('/bin/sleep', ['sleep', MARK])
def until_sleeping(pid):
    while MARK.encode() not in open(f'/proc/{pid}/cmdline', 'rb').read():
        time.sleep(0.005)
    os.write(1, b'detached\\n')
def clear_death_signal():
    ctypes.CDLL(None).prctl(1, 0, 0, 0, 0)  # PR_SET_PDEATHSIG 0
def ignore_signals():
    for s in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGUSR1, signal.SIGALRM):
        signal.signal(s, signal.SIG_IGN)
"""

# name -> (program, status)
DETACHING = {
    "new session": ("pid = os.fork()\nif pid == 0:\n    os.setsid()\n    sleep_here()\nuntil_sleeping(pid)", "ok"),
    "new process group": (
        "pid = os.fork()\nif pid == 0:\n    os.setpgid(0, 0)\n    sleep_here()\nuntil_sleeping(pid)",
        "ok",
    ),
    "double fork": (
        "pid = os.fork()\nif pid == 0:\n    grandchild = os.fork()\n"
        "    if grandchild == 0:\n        os.setsid()\n        sleep_here()\n"
        "    until_sleeping(grandchild)\n    os._exit(0)\nos.waitpid(pid, 0)\n"
        "time.sleep(60)",
        "timeout",
    ),
    "death signal cleared": ("clear_death_signal()\nos.write(1, b'detached\\n')\nsleep_here()", "timeout"),
    "signals ignored": (
        "clear_death_signal()\nignore_signals()\npid = os.fork()\nif pid == 0:\n"
        "    os.setsid()\n    clear_death_signal()\n    sleep_here()\n"
        "until_sleeping(pid)\nwhile True:\n    pass",
        "timeout",
    ),
    "fork bomb at the pids limit": (
        "clear_death_signal()\nn = 0\nwhile True:\n    try:\n"
        "        pid = os.fork()\n    except OSError:\n        break\n"
        "    if pid == 0:\n        os.setsid()\n        sleep_here()\n"
        "    n += 1\nuntil_sleeping(pid)\nprint(n, flush=True)\n"
        "time.sleep(60)",
        "timeout",
    ),
}


def _program(name: str, mark: str) -> str:
    return f"MARK = {mark!r}\n{_PRELUDE}{DETACHING[name][0]}"


def _marker() -> str:
    return f"{4000 + next(_SEQ)}.{os.getpid()}{time.monotonic_ns() % 10**6:06d}"


def _with_marker(mark: str) -> set[int]:
    """Host pids whose command line holds ``mark``."""
    found = set()
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                if mark.encode() in (entry / "cmdline").read_bytes():
                    found.add(int(entry.name))
            except OSError:
                continue
    return found


def _call_cgroups() -> list[Path]:
    """Cgroup directories of this process's sandbox calls that exist now."""
    return [d for base in cgroups._bases().values() for d in base.glob(f"flash-sandbox-{os.getpid()}-*")]


@pytest.fixture(params=["cgroups", "pid namespace only"])
def way(request, monkeypatch):
    if request.param == "cgroups" and not cgroups.available():
        pytest.skip("no per-call cgroups on this host")
    if request.param != "cgroups":
        monkeypatch.setattr(cgroups, "create", lambda *a: None)
    return request.param


@pytest.mark.parametrize("name", list(DETACHING))
def test_a_call_that_detaches_leaves_nothing_behind(name, way):
    mark, leaked = _marker(), sandbox.leaked()
    res = execute(_program(name, mark), timeout_s=1.5, max_procs=16)
    assert (res.status, res.stdout.split()[0]) == (DETACHING[name][1], "detached"), res.stderr
    assert _with_marker(mark) == set()  # at return, not eventually
    assert _call_cgroups() == []
    assert sandbox.leaked() == leaked
    assert res.wall_s < 10  # killed at the deadline, not left to run out their sleep


def test_the_fork_bomb_really_filled_the_pids_limit():
    """The bomb above is bounded by the call's own limit (so it ends a full call, not an empty
    one): here it reports how many children it made before fork failed."""
    res = execute(_program("fork bomb at the pids limit", _marker()), timeout_s=1.5, max_procs=16)
    assert res.status == "timeout" and 8 <= int(res.stdout.split()[-1]) < 16


def test_repeated_detaching_calls_do_not_stack_cgroups_or_processes():
    if not cgroups.available():
        pytest.skip("no per-call cgroups on this host")
    marks = [_marker() for _ in range(4)]
    for mark in marks:
        res = execute(_program("death signal cleared", mark), timeout_s=0.5)
        assert (res.status, res.stdout) == ("timeout", "detached\n")
    assert _call_cgroups() == [] and cgroups.left() == 0
    assert set().union(*map(_with_marker, marks)) == set()


def test_a_call_whose_mirror_process_dies_first_still_ends_whole(monkeypatch):
    """C (the call's process outside its pid namespace) killed from outside while the code has
    cleared its death signal: the fork server, their subreaper, kills and reaps the orphan."""
    monkeypatch.setattr(cgroups, "create", lambda *a: None)  # the server alone must end it
    mark = _marker()
    box = {}
    program = _program("death signal cleared", mark)
    thread = threading.Thread(target=lambda: box.update(res=execute(program, timeout_s=20)))
    thread.start()
    deadline = time.monotonic() + 10
    while not _with_marker(mark) and time.monotonic() < deadline:
        time.sleep(0.02)
    calls = [c.pid for srv in forkserver._SERVERS.values() for c in srv._calls.values()]
    assert _with_marker(mark) and len(calls) == 1
    os.kill(calls[0], 9)
    thread.join(10)
    assert box["res"].status == "killed" and box["res"].wall_s < 10
    assert _with_marker(mark) == set()


def test_the_audit_hook_level_runs_in_the_call_cgroups_too():
    if not cgroups.available():
        pytest.skip("no per-call cgroups on this host")
    res = execute("print(open('/proc/self/cgroup').read())", isolation="audit-hook")
    assert res.status == "ok" and res.stdout.count(f"flash-sandbox-{os.getpid()}-") == 2
    assert _call_cgroups() == []


HOST_ETC = (
    "passwd",
    "shadow",
    "group",
    "hosts",
    "hostname",
    "resolv.conf",
    "os-release",
    "machine-id",
    "fstab",
    "ssh",
    "environment",
)


def test_etc_is_synthesized_not_the_hosts():
    probe = (
        "import json, os\nout = {'ls': sorted(os.listdir('/etc')), 'read': {}}\n"
        f"for name in {list(HOST_ETC)!r}:\n"
        "    try:\n        out['read'][name] = open('/etc/' + name).read()\n"
        "    except OSError as exc:\n        out['read'][name] = type(exc).__name__\n"
        "print(json.dumps(out))"
    )
    res = execute(probe, timeout_s=10)
    assert res.status == "ok", res.stderr
    import json

    got = json.loads(res.stdout)
    assert set(got["ls"]) <= {"passwd", "group", "ld.so.cache", "localtime"}
    uid = 65534 if os.geteuid() == 0 else os.geteuid()
    assert [line.split(":")[2] for line in got["read"]["passwd"].splitlines()] == ["0", str(uid)]
    for name in HOST_ETC:
        if name not in ("passwd", "group"):
            assert got["read"][name] == "FileNotFoundError", name
    host_users = {line.split(":")[0] for line in Path("/etc/passwd").read_text().splitlines()}
    for user in host_users - {"root", "nobody"}:
        assert f"\n{user}:" not in "\n" + got["read"]["passwd"]


def test_python_runs_normally_on_the_synthesized_etc():
    src = (
        "import getpass, os, pwd, time, ctypes.util, subprocess, sys\n"
        "print(getpass.getuser(), pwd.getpwuid(os.getuid()).pw_dir == os.getcwd(),"
        " time.strftime('%Z') != '', ctypes.util.find_library('c') is not None)\n"
        "print(subprocess.run([sys.executable, '-c', 'import decimal, sqlite3; print(7)'],"
        " capture_output=True, text=True).stdout.strip())"
    )
    res = execute(src, timeout_s=10)
    user = "nobody" if os.geteuid() in (0, 65534) else "sandbox"
    assert (res.status, res.stdout) == ("ok", f"{user} True True True\n7\n"), res.stderr[-500:]


def test_a_call_left_behind_is_counted_and_removed_at_the_next_call(monkeypatch, caplog):
    """A kernel that will not empty a call's cgroups in time (forced here): the call counts as
    leaked, its cgroups are kept, and the next call's start removes them."""
    if not cgroups.available():
        pytest.skip("no per-call cgroups on this host")
    leaked = sandbox.leaked()
    monkeypatch.setattr(cgroups.CallGroup, "kill", lambda self, wait_s=0.0: False)
    assert execute("print('ok')", timeout_s=5).stdout == "ok\n"
    assert (sandbox.leaked(), cgroups.left(), len(_call_cgroups())) == (leaked + 1, 1, 2)
    assert "still present" in caplog.text
    monkeypatch.undo()
    assert execute("print('ok')", timeout_s=5).stdout == "ok\n"
    assert (sandbox.leaked(), cgroups.left(), _call_cgroups()) == (leaked + 1, 0, [])


def test_without_namespaces_or_cgroups_only_the_process_group_is_killed_and_it_says_so(monkeypatch, caplog):
    monkeypatch.setattr(cgroups, "create", lambda *a: None)
    monkeypatch.setitem(sandbox._POLICY, "warned_pgroup", False)
    res = execute("print('ok')", isolation="audit-hook")
    assert res.stdout == "ok\n" and "only its process group is killed" in caplog.text
