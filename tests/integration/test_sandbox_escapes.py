"""Code sandbox, namespaces level: each escape found against the old sandbox, tried again.

Every test runs real sandboxes on the fork server (a few milliseconds each) and, like
test_sandbox.py, checks that nothing of the sandbox outlives the call.
"""

import json
import os
import socket
import sys
import threading
import time
from pathlib import Path

import pytest

import flash
from flash.rewards import cgroups
from flash.rewards.sandbox import execute, isolation_level
from tests.helpers.sandbox import host_untouched  # noqa: F401 -- autouse: nothing outlives a call

pytestmark = pytest.mark.skipif(isolation_level() != "namespaces", reason="this host gives no namespaces")


def _in_thread(fn):
    box = {}
    thread = threading.Thread(target=lambda: box.update(res=fn()))
    thread.start()
    return thread, box


def test_a_concurrent_sandbox_cannot_read_another_or_the_host():
    token = f"hidden-input-{os.getpid()}-{time.time_ns()}"
    holder = f"import os, time\nopen('hidden.txt', 'w').write({token!r})\nprint(os.getcwd(), flush=True)\ntime.sleep(3)"
    thread, box = _in_thread(lambda: execute(holder, timeout_s=10))
    time.sleep(0.5)
    project, venv = str(Path(flash.__file__).resolve().parents[1]), sys.prefix
    snoop = (
        "import os, json\nseen = []\n"
        "for top in ['/tmp', '/dev', '/']:\n"
        "    for root, dirs, files in os.walk(top):\n"
        "        dirs[:] = [d for d in dirs if root != '/' or d in ('tmp', 'dev')]\n"
        "        for f in files:\n"
        "            try:\n"
        "                seen.append(open(os.path.join(root, f), errors='replace').read(200))\n"
        "            except OSError:\n"
        "                pass\n"
        f"paths = {[project, venv, '/root', '/home', '/work', '/var', '/opt']!r}\n"
        "print(json.dumps({'root': sorted(os.listdir('/')), 'seen': seen,\n"
        "                  'present': [p for p in paths if os.path.exists(p)]}))"
    )
    res = execute(snoop, timeout_s=10)
    thread.join()
    assert box["res"].status == "ok" and res.status == "ok", res.stderr
    got = json.loads(res.stdout)
    assert token not in res.stdout
    assert got["present"] == []  # the project, the venv, home directories: not even their names
    assert set(got["root"]) <= {"usr", "bin", "sbin", "lib", "lib32", "lib64", "libx32", "etc", "dev", "proc", "tmp"}


def test_nested_namespaces_mounts_and_capabilities_are_refused():
    src = (
        "import ctypes, json, os\nlibc = ctypes.CDLL(None, use_errno=True)\n"
        "out = {}\n"
        "for name, flag in [('user', 0x10000000), ('mount', 0x00020000), ('net', 0x40000000)]:\n"
        "    out[name] = (libc.unshare(flag), ctypes.get_errno())\n"
        "out['tmpfs'] = (libc.mount(b'tmpfs', b'/tmp', b'tmpfs', 0, b'size=900m'),"
        " ctypes.get_errno())\n"
        "status = dict(l.split(':\\t') for l in open('/proc/self/status').read().splitlines()"
        " if ':\\t' in l)\n"
        "out['caps'] = [status[k].strip() for k in ('CapEff', 'CapPrm', 'CapBnd', 'NoNewPrivs')]\n"
        "print(json.dumps(out))"
    )
    res = execute(src, timeout_s=5)
    got = json.loads(res.stdout)
    for name in ("user", "mount", "net", "tmpfs"):
        assert got[name][0] == -1 and got[name][1] in (1, 28), (name, got[name])  # EPERM/ENOSPC
    assert got["caps"] == ["0000000000000000"] * 3 + ["1"]


def test_disk_is_capped_for_the_whole_call_not_per_file():
    src = (
        "import os\nwritten = 0\n"
        "try:\n"
        "    for i in range(16):\n"
        "        with open(f'f{i}', 'wb') as f:\n"
        "            for _ in range(15):\n"
        "                f.write(b'x' * (1 << 20))\n"
        "                f.flush()\n"
        "                written += 1 << 20\n"
        "except OSError as e:\n"
        "    print('refused', e.errno)\n"
        "print(written >> 20)"
    )
    res = execute(src, timeout_s=10, disk_mb=32, max_file_mb=16)
    refused, written_mb = res.stdout.split("\n")[:2]
    assert refused == "refused 28"  # ENOSPC: the call's tmpfs is full
    assert 16 <= int(written_mb) <= 32  # was 16 x 15 = 240 MB with single files capped only


def test_memory_and_processes_are_bounded_for_the_whole_tree():
    """Each child writes 80 MB (under the 128 MB per process). With a memory cgroup per call the
    tree holds at most memory_mb + disk_mb = 144 MB, so the OOM killer takes a child; without one
    the bound is max_procs processes of memory_mb each. Measured from inside, in both cases."""
    src = (
        "import os, time\nkids, refused = [], 0\n"
        "for _ in range(8):\n"
        "    try:\n"
        "        pid = os.fork()\n"
        "    except OSError:\n"
        "        refused += 1\n"
        "        continue\n"
        "    if pid == 0:\n"
        "        block = b'\\x01' * (80 << 20)\n"
        "        time.sleep(2)\n"
        "        os._exit(0)\n"
        "    kids.append(pid)\n"
        "time.sleep(1)\n"
        "rss = 0\n"
        "for pid in [1] + kids:\n"
        "    try:\n"
        "        for line in open(f'/proc/{pid}/status'):\n"
        "            if line.startswith('VmRSS:'):\n"
        "                rss += int(line.split()[1])\n"
        "    except OSError:\n"
        "        pass\n"
        "killed = sum(os.waitpid(k, 0)[1] == 9 for k in kids)\n"
        "print(len(kids), refused, rss >> 10, killed)"
    )
    res = execute(src, timeout_s=10, memory_mb=128, disk_mb=16, max_procs=4)
    kids, refused, rss_mb, killed = map(int, res.stdout.split())
    # the process count is this call's alone: its waiting parent, the code and 2 children
    assert (kids, refused) == (2, 6)
    if cgroups.available():
        assert killed >= 1 and rss_mb <= 144
    else:
        assert killed == 0 and 160 <= rss_mb <= 4 * 128


def test_a_tree_over_its_memory_is_a_memory_outcome():
    if not cgroups.available():
        pytest.skip("no per-call memory cgroup on this host")
    # 60 MB of files and two processes of 70 MB each: under 128 MB per process, over the call's
    # 128 + 64 = 192 MB; whichever process the OOM killer takes, the call ends as "memory"
    src = (
        "import os, sys, time\nwith open('/tmp/f', 'wb') as f:\n    for _ in range(60):\n"
        "        f.write(b'x' * (1 << 20))\npid = os.fork()\nblock = b'\\x01' * (70 << 20)\n"
        "if pid == 0:\n    time.sleep(1)\n    os._exit(0)\n"
        "status = os.waitpid(pid, 0)[1]\nprint('child', status)\nsys.exit(0 if status == 0 else 1)"
    )
    res = execute(src, timeout_s=10, memory_mb=128, disk_mb=64, max_file_mb=64)
    assert res.status == "memory", (res.status, res.stdout, res.stderr[-300:])
    one = execute(
        "import os\nwith open('/tmp/f', 'wb') as f:\n    for _ in range(60):\n"
        "        f.write(b'x' * (1 << 20))\nblock = b'\\x01' * (100 << 20)\nprint('kept')",
        timeout_s=10,
        memory_mb=150,
        disk_mb=64,
        max_file_mb=64,
    )
    # 60 MB of files count against the call's 214 MB with the 100 MB block and the interpreter:
    # fits; the same block at memory_mb 128 would not fit the address space alone
    assert one.status == "ok" and one.stdout == "kept\n"


def test_nothing_persists_between_calls():
    first = execute(
        "import os\nopen('/tmp/persist', 'w').write('x')\nos.makedirs('/tmp/d')\nprint(sorted(os.listdir('/tmp')))",
        timeout_s=5,
    )
    second = execute("import os\nprint(sorted(os.listdir('/tmp')), os.path.exists('/dev/shm'))", timeout_s=5)
    assert first.stdout == "['d', 'flash-sandbox-work', 'persist']\n"
    assert second.stdout == "['flash-sandbox-work'] False\n"


def test_abstract_sockets_reach_neither_the_host_nor_another_sandbox():
    name = f"flash-test-{os.getpid()}"
    host = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    host.bind("\0" + name + "-host")
    host.listen(1)
    listener = (
        "import socket\ns = socket.socket(socket.AF_UNIX)\n"
        f"s.bind('\\0{name}-box')\ns.listen(1)\ns.settimeout(3)\n"
        "try:\n    s.accept()\n    print('accepted')\nexcept OSError:\n    print('alone')"
    )
    thread, box = _in_thread(lambda: execute(listener, timeout_s=10))
    time.sleep(0.5)
    dialer = (
        "import socket\nfor n in ['-box', '-host']:\n"
        "    try:\n        socket.socket(socket.AF_UNIX).connect('\\0" + name + "' + n)\n"
        "        print('reached', n)\n    except OSError as e:\n        print('refused', e.errno)"
    )
    res = execute(dialer, timeout_s=5)
    thread.join()
    host.close()
    assert res.stdout == "refused 111\nrefused 111\n"  # ECONNREFUSED: no such name in its netns
    assert box["res"].stdout == "alone\n"


def test_it_sees_only_its_own_processes_and_cannot_reach_the_server():
    src = (
        "import os, signal\n"
        "print(sorted(p for p in os.listdir('/proc') if p.isdigit()), flush=True)\n"
        "os.kill(0, signal.SIGKILL)"
    )  # its process group: its own session's init, nothing else
    res = execute(src, timeout_s=5)
    assert res.stdout == "['1']\n" and res.status == "ok"
    again = execute("print('server alive')", timeout_s=5)
    assert again.stdout == "server alive\n"


def test_a_child_that_leaves_the_session_dies_with_the_call():
    src = "import os, time\nif os.fork() == 0:\n    os.setsid()\n    time.sleep(30)\nprint('parent done')"
    t0 = time.monotonic()
    res = execute(src, timeout_s=10)
    assert res.status == "ok" and time.monotonic() - t0 < 5  # the fixture checks it is gone


def test_many_concurrent_calls_keep_their_own_outputs():
    results = {}

    def run(i):
        results[i] = execute(
            f"import sys, time\ntime.sleep(0.05)\nprint({i} * int(sys.stdin.read()))", stdin="3", timeout_s=10
        )

    threads = [threading.Thread(target=run, args=(i,)) for i in range(16)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert {i: r.stdout for i, r in results.items()} == {i: f"{3 * i}\n" for i in range(16)}


# Scores of the cases below under the previous sandbox (a subprocess and new namespaces per call,
# at 902e68e): one row per pyfunc eval item, one column per response; the last row: stdin programs.
SCORES_BEFORE = [
    [1.0, 0.166667, 1.0, 0.0, 0.0, 0.0, 0.0, 0.166667, 1.0, 0.0],
    [1.0, 0.0, 1.0, 0.0, 0.0, 0.0, 0.0, 0.333333, 1.0, 0.0],
    [1.0, 0.0, 1.0, 0.0, 0.0, 0.0, 0.0, 0.5, 1.0, 0.0],
    [1.0, 0.5, 1.0, 0.0, 0.0, 0.0, 0.0, 0.5, 1.0, 0.0],
    [1.0, 0.166667, 1.0, 0.0, 0.0, 0.0, 0.0, 0.166667, 1.0, 0.0],
    [1.0, 0.0, 1.0, 0.0, 0.0, 0.0, 0.0, 0.5, 1.0, 0.0],
    [0.666667, 1.0, 0.333333, 0.0],
]


def test_code_rewards_are_the_same_as_before():
    from flash.rewards.builtin import CodeReward
    from flash.tasks import TaskItem
    from flash.recipes.tasks.pyfunc import HEADER, PyFuncOptions, PyFuncTask, expression

    items = [PyFuncTask(PyFuncOptions()).item(i, "eval") for i in range(6)]
    bodies = [
        lambda it: it.meta["solution"],
        lambda it: HEADER + expression([tuple(s) for s in it.meta["chain"]], parens=False),
        lambda it: "```python\n" + it.meta["solution"] + "\n```",
        lambda it: "def f(x) return x",
        lambda it: "def f(x):\n    while True:\n        pass",
        lambda it: "def f(x):\n    raise ValueError(x)",
        lambda it: "import os\nprint('0\\t1')\nos._exit(0)\ndef f(x): return x",
        lambda it: "def f(x):\n    return x if x % 2 else " + it.meta["solution"][len(HEADER) :].replace("x", "(x)"),
        lambda it: "import sys\nsys.stdout.write('x' * 100000)\n" + it.meta["solution"],
        lambda it: "def f(x): return open('/etc/hostname').read()",
    ]
    reward = CodeReward(all_or_nothing=False, adaptive=False, t_max=1.0)
    scores = [[round(reward(it, body(it)), 6) for body in bodies] for it in items]
    prog = TaskItem(
        index=0,
        prompt="",
        answer="",
        meta={
            "tests": [
                {"stdin": "1 2\n", "stdout": "3"},
                {"stdin": "5 7\n", "stdout": "12\n"},
                {"stdin": "", "stdout": "0"},
            ]
        },
    )
    programs = [
        "print(sum(map(int, input().split())))",
        "import sys\nprint(sum(int(x) for x in sys.stdin.read().split()))",
        "print(3)",
        "import time\ntime.sleep(5)",
    ]
    scores.append([round(reward(prog, p), 6) for p in programs])
    assert scores == SCORES_BEFORE
    assert reward.metrics()["sandbox/unisolated_calls"] == 0.0


def test_a_dead_fork_server_fails_its_calls_by_name_and_the_next_call_starts_another():
    from flash.rewards import forkserver
    from flash.rewards.sandbox import SandboxSetupError

    assert execute("print('warm')", timeout_s=5).stdout == "warm\n"
    [srv] = [s for key, s in forkserver._SERVERS.items() if key[0] == os.getpid()]
    thread, box = _in_thread(lambda: _catch(lambda: execute("import time\ntime.sleep(5)", timeout_s=10)))
    time.sleep(0.5)
    os.kill(srv.proc.pid, 9)
    thread.join(timeout=15)
    assert isinstance(box["res"], SandboxSetupError) and "sandbox server exited" in str(box["res"])
    again = execute("print('new server')", timeout_s=5)
    assert again.stdout == "new server\n"
    [new] = [s for key, s in forkserver._SERVERS.items() if key[0] == os.getpid()]
    assert new is not srv and new.proc.pid != srv.proc.pid


def _catch(fn):
    try:
        return fn()
    except Exception as exc:  # noqa: BLE001 -- the test inspects what was raised
        return exc


def test_call_cgroups_left_by_a_dead_process_are_removed_at_the_next_start():
    if not cgroups.available():
        pytest.skip("no per-call cgroups on this host")
    import subprocess

    dead = subprocess.Popen(["true"])
    dead.wait()
    orphans = [base / f"flash-sandbox-{dead.pid}-0" for base in cgroups._bases().values()]
    for d in orphans:
        d.mkdir()
    cgroups._bases.cache_clear()
    assert cgroups.available() and not any(d.exists() for d in orphans)
    assert execute("print('ok')", timeout_s=5).stdout == "ok\n"
    mine = [d for base in cgroups._bases().values() for d in base.glob(f"flash-sandbox-{os.getpid()}-*")]
    assert mine == []  # a finished call leaves none behind
