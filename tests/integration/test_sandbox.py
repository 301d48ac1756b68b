"""Code sandbox: hostile code ends in the expected status and leaves the host untouched.

Every test also checks that no process of a sandbox call outlives ``execute``
(``tests.helpers.sandbox``). Runs real sandboxes (milliseconds each); the timeout cases wait for
their deadline.
"""

import json
import os
import signal
import socket
from pathlib import Path

import pytest

from flash.rewards import sandbox
from flash.rewards.sandbox import Limits, classify, execute, isolation_level
from tests.helpers.sandbox import host_untouched  # noqa: F401 -- autouse: nothing outlives a call

RECIPE_CODE = str(Path(__file__).resolve().parents[2] / "recipes" / "code.yaml")
LEVELS = ["namespaces", "audit-hook"] if isolation_level() == "namespaces" else ["audit-hook"]


def test_normal_code_reads_stdin_and_passes():
    res = execute("import sys\nprint(sum(int(x) for x in sys.stdin.read().split()))", stdin="1 2 3 4\n", timeout_s=5)
    assert (res.status, res.stdout, res.stderr, res.exit_code, res.signal) == ("ok", "10\n", "", 0, None)
    assert res.isolation == isolation_level()
    assert 0 < res.wall_s < 5


def test_error_exit_code_and_working_dir_removed():
    res = execute("import os, sys\nprint(os.getcwd())\nopen('x.txt', 'w').write('hi')\nsys.exit(3)", timeout_s=5)
    assert (res.status, res.exit_code) == ("error", 3)
    workdir = res.stdout.strip()
    assert "flash-sandbox-" in workdir and not os.path.exists(workdir)


def test_infinite_loop_is_a_timeout_at_the_wall_clock_deadline():
    res = execute("while True:\n    pass", timeout_s=1.0)
    assert (res.status, res.exit_code, res.signal) == ("timeout", None, signal.SIGKILL)
    assert 1.0 <= res.wall_s < 2.5


def test_sleeping_code_is_a_timeout_too():
    res = execute("import time\nprint('started', flush=True)\ntime.sleep(60)", timeout_s=0.8)
    assert (res.status, res.stdout) == ("timeout", "started\n")  # output before the kill is kept


def test_fork_bomb_is_refused_and_torn_down():
    res = execute("import os\nwhile True:\n    os.fork()", timeout_s=5, max_procs=16)
    assert res.status == "error" and "BlockingIOError" in res.stderr
    assert res.wall_s < 5


def test_fork_bomb_that_swallows_errors_runs_to_the_deadline_and_is_killed_whole():
    src = "import os, time\nwhile True:\n    try:\n        os.fork()\n    except OSError:\n        time.sleep(0.01)"
    res = execute(src, timeout_s=1.5, max_procs=16)
    assert res.status == "timeout"  # the autouse fixture checks none of the forks survived


def test_memory_bomb_is_memory():
    res = execute("x = []\nwhile True:\n    x.append(bytearray(10**7))", timeout_s=10, memory_mb=256)
    assert res.status == "memory" and "MemoryError" in res.stderr


def test_limits_are_the_ones_asked_for():
    src = (
        "import resource as r, json\nprint(json.dumps({n: r.getrlimit(getattr(r, n)) for n in "
        "['RLIMIT_CPU', 'RLIMIT_AS', 'RLIMIT_NPROC', 'RLIMIT_FSIZE', 'RLIMIT_NOFILE']}))"
    )
    res = execute(src, timeout_s=2.5, memory_mb=300, max_procs=7, max_file_mb=3, max_open_files=40)
    got = json.loads(res.stdout)
    # CPU: ceil(2.5) + 1 = 4 soft, 5 hard; sizes in bytes
    assert got == {
        "RLIMIT_CPU": [4, 5],
        "RLIMIT_AS": [300 << 20] * 2,
        "RLIMIT_NPROC": [7, 7],
        "RLIMIT_FSIZE": [3 << 20] * 2,
        "RLIMIT_NOFILE": [40, 40],
    }


def test_big_file_is_refused_by_fsize():
    res = execute("open('big', 'wb').write(b'x' * (3 << 20))", timeout_s=5, max_file_mb=1)
    assert res.status in ("error", "killed")  # EFBIG, or SIGXFSZ where it is not ignored
    assert res.status == "killed" and res.signal == signal.SIGXFSZ or "File too large" in res.stderr


@pytest.mark.parametrize("level", LEVELS)
def test_write_outside_its_directory_fails(tmp_path, level):
    victim = tmp_path / "victim.txt"
    victim.write_text("original")
    outside = Path("/tmp") / f"flash-sandbox-escape-{os.getpid()}"
    system = "/usr/flash-sandbox-escape"
    src = (
        f"for p in [{str(victim)!r}, {str(outside)!r}, {system!r}]:\n"
        "    try:\n        open(p, 'w').write('pwned')\n        print('wrote', p)\n"
        "    except OSError as e:\n        print('refused', p, e.errno)"
    )
    res = execute(src, timeout_s=5, isolation=level)
    assert res.status == "ok" and f"refused {victim}" in res.stdout
    assert f"refused {system}" in res.stdout and not os.path.exists(system)
    assert victim.read_text() == "original"
    if level == "namespaces":  # its /tmp is its own tmpfs: the write lands there, not on the host
        assert f"wrote {outside}" in res.stdout and not outside.exists()
    elif outside.exists():  # audit-hook mode: only the dropped uid protects the host
        outside.unlink()


@pytest.mark.parametrize("level", LEVELS)
def test_network_connection_fails_and_reaches_nothing(level):
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen(1)
    server.settimeout(0.5)
    port = server.getsockname()[1]
    src = (
        f"import socket\ns = socket.create_connection(('127.0.0.1', {port}), timeout=2)\n"
        "s.sendall(b'exfiltrated')\nprint('connected')"
    )
    res = execute(src, timeout_s=5, isolation=level)
    assert res.status == "error" and "connected" not in res.stdout
    expect = "Network is unreachable" if level == "namespaces" else "flash sandbox: socket."
    assert expect in res.stderr
    with pytest.raises(socket.timeout):
        server.accept()
    server.close()


def test_parent_environment_secrets_are_absent(monkeypatch):
    monkeypatch.setenv("FLASH_TEST_SECRET", "hunter2-token")
    src = (
        f"import os, json\nleak = []\n"
        f"for p in ['/proc/{os.getpid()}/environ', '/proc/1/environ', '/proc/self/environ']:\n"
        "    try:\n        leak.append(open(p, 'rb').read().decode(errors='replace'))\n"
        "    except OSError:\n        pass\n"
        "print(json.dumps({'env': dict(os.environ), 'proc': leak}))"
    )
    res = execute(src, timeout_s=5)
    assert res.status == "ok" and "hunter2-token" not in res.stdout
    env = json.loads(res.stdout)["env"]
    assert set(env) == {"PATH", "HOME", "TMPDIR", "LANG", "PYTHONIOENCODING", "PYTHONDONTWRITEBYTECODE"}


def test_killing_its_parent_kills_only_the_sandbox():
    # its parent is outside its pid namespace (getppid() is 0): kill(0) reaches its own session,
    # whose only process is the namespace's init, which ignores signals from inside
    res = execute("import os\nos.kill(os.getppid(), 9)\nprint('still here')", timeout_s=5)
    assert (res.status, res.stdout) == ("ok", "still here\n")
    os.kill(os.getpid(), 0)  # this test process is alive (we are running it)


def test_signalling_the_host_by_pid_is_refused():
    src = f"import os\nos.kill({os.getpid()}, 9)\nprint('sent')"
    res = execute(src, timeout_s=5)
    assert res.status == "error" and "sent" not in res.stdout
    assert "ProcessLookupError" in res.stderr or "PermissionError" in res.stderr


def test_output_is_capped():
    res = execute(
        "import sys\nsys.stdout.write('x' * 500000)\nsys.stderr.write('e' * 500000)", timeout_s=5, max_output_bytes=1000
    )
    assert (res.status, len(res.stdout), len(res.stderr), res.truncated) == ("ok", 1000, 1000, True)


def test_extra_files_are_in_the_working_dir():
    res = execute("print(open('data.txt').read())", files={"data.txt": "payload"}, timeout_s=5)
    assert res.stdout == "payload\n"
    with pytest.raises(ValueError, match="plain names"):
        execute("pass", files={"../x": ""})


def test_classify_maps_exit_causes():
    assert classify(0, b"", False) == "ok"
    assert classify(1, b"Traceback...\nValueError: x\n", False) == "error"
    assert classify(1, b"Traceback...\nMemoryError\n", False) == "memory"
    assert classify(-signal.SIGXCPU, b"", False) == "timeout"  # CPU-time rlimit
    assert classify(-signal.SIGKILL, b"", True) == "timeout"  # killed by us at the deadline
    assert classify(-signal.SIGKILL, b"", False) == "killed"
    assert classify(-signal.SIGSEGV, b"", False) == "killed"


def test_bad_limits_name_the_field():
    with pytest.raises(ValueError, match="timeout_s must be a finite number > 0"):
        execute("pass", timeout_s=0)
    with pytest.raises(ValueError, match="memory_mb"):
        Limits(memory_mb=-1)
    with pytest.raises(ValueError, match="isolation must be"):
        execute("pass", isolation="docker")


def test_namespaces_are_used_where_the_host_allows_them():
    """This machine allows unprivileged user namespaces (docs/design.md facts); CI is the same kind."""
    probe = Path("/proc/sys/user/max_user_namespaces")
    if not probe.exists() or int(probe.read_text()) == 0:
        pytest.skip("user namespaces disabled on this host")
    assert isolation_level() == "namespaces"
    assert sandbox.ISOLATION_LEVELS == ("namespaces", "audit-hook")


def _copy_sandbox_package(home: Path) -> None:
    """The sandbox modules (standard library only) as a bare ``flash.rewards`` package under
    ``home``, readable by every uid. The checkout may sit under a directory uid 65534 cannot enter
    (a mode-700 clone), and the system python has none of the project's dependencies: a driver run
    as that uid loads this copy instead."""
    import shutil

    package = home / "flash" / "rewards"
    package.mkdir(parents=True)
    for init in (home / "flash" / "__init__.py", package / "__init__.py"):
        init.write_text("")
    module = Path(sandbox.__file__)
    for name in (
        "sandbox.py",
        "forkserver.py",
        "cgroups.py",
        "_jail.py",
        "_zygote.py",
        "syscall_filter.py",
        "deadline.py",
    ):
        shutil.copyfile(module.with_name(name), package / name)
    for p in home.rglob("*"):
        os.chmod(p, 0o755 if p.is_dir() else 0o644)


@pytest.mark.skipif(
    os.geteuid() != 0 or not Path("/usr/bin/setpriv").exists() or isolation_level() != "namespaces",
    reason="needs root (to become an ordinary user) and namespaces",
)
def test_as_an_ordinary_user_same_uid_files_and_parent_are_still_safe():
    """CI may run as a non-root user: then the code runs under the *same* uid as its parent, and
    only the namespaces (read-only mounts, own pid namespace) protect the parent's files and the
    parent itself. Run the sandbox from a process that is uid 65534, against a file it owns."""
    import shutil
    import subprocess
    import tempfile

    home = Path(tempfile.mkdtemp(prefix="flash-test-nobody-"))
    try:
        victim = home / "victim.txt"
        victim.write_text("original")
        os.chmod(home, 0o755)
        for p in (home, victim):
            os.chown(p, 65534, 65534)
        write_src = f"open({str(victim)!r}, 'w').write('pwned')"
        _copy_sandbox_package(home)
        driver = (
            f"import sys\nsys.path.insert(0, {str(home)!r})\n"
            "import json, os\nfrom flash.rewards.sandbox import execute\n"
            f"w = execute({write_src!r}, timeout_s=5)\n"
            "k = execute('import os\\nos.kill(os.getppid(), 9)', timeout_s=5)\n"
            "p = execute('import os\\nos.kill(%d, 9)' % os.getpid(), timeout_s=5)\n"
            "print(json.dumps([os.getuid(), w.status, w.isolation, k.status, p.status, p.stderr]))\n"
        )
        out = subprocess.run(
            [
                "setpriv",
                "--reuid",
                "65534",
                "--regid",
                "65534",
                "--clear-groups",
                "/usr/bin/python3",
                "-I",
                "-c",
                driver,
            ],
            capture_output=True,
            text=True,
            timeout=60,
            cwd="/",
        )
        assert out.returncode == 0, out.stderr
        uid, write, level, kill_parent, kill_driver, err = json.loads(out.stdout)
        assert (uid, write, level, kill_parent, kill_driver) == (65534, "error", "namespaces", "ok", "error")
        assert "ProcessLookupError" in err  # the driver's pid does not exist in its pid namespace
        assert victim.read_text() == "original"  # same uid, file writable by it: ro mount held
    finally:
        shutil.rmtree(home)


@pytest.fixture
def unisolated_host(monkeypatch):
    """A host without namespaces, as ``execute`` and the runner see it."""
    monkeypatch.setattr(sandbox, "isolation_level", lambda: "audit-hook")
    monkeypatch.setitem(sandbox._POLICY, "allow_unisolated", False)
    monkeypatch.setitem(sandbox._POLICY, "warned", False)


def test_unisolated_host_refuses_code_unless_allowed_then_warns_and_counts(unisolated_host, caplog):
    from flash.rewards.builtin import CodeReward
    from flash.tasks import TaskItem

    item = TaskItem(index=0, prompt="", answer="", meta={"tests": [{"stdin": "2\n", "stdout": "4"}]})
    reward = CodeReward(adaptive=False, t_max=5.0)
    with pytest.raises(sandbox.UnisolatedRefused, match="reward.sandbox.allow_unisolated: true"):
        reward(item, "print(int(input()) * 2)")
    sandbox.allow_unisolated(True)
    with caplog.at_level("WARNING"):
        assert reward(item, "print(int(input()) * 2)") == 1.0
        assert reward(item, "print(int(input()) * 2)") == 1.0
    assert [r.message for r in caplog.records].count(
        "flash sandbox: running model-written code WITHOUT namespace isolation "
        "(reward.sandbox.allow_unisolated: true); only an audit hook guards the host"
    ) == 1
    assert reward.metrics()["sandbox/unisolated_calls"] == 2.0
    # an explicit level is the caller's choice, not the fallback: never refused
    sandbox.allow_unisolated(False)
    assert execute("print(1)", isolation="audit-hook").stdout == "1\n"


def test_the_recipe_switch_reaches_driver_and_reward_workers(unisolated_host):
    from flash.app.config import load_config
    from flash.app.preflight import apply_sandbox_policy
    from flash.errors import ConfigError, FlashError
    from flash.rewards.workers import RewardScorer

    code = ["reward.fn={name: code}"]
    cfg = load_config(RECIPE_CODE, code)
    with pytest.raises(FlashError, match="^this host gives the code sandbox no namespaces"):
        apply_sandbox_policy(cfg)
    apply_sandbox_policy(load_config(RECIPE_CODE, code + ["reward.sandbox.allow_unisolated=true"]))
    assert sandbox._POLICY["allow_unisolated"] is True
    RewardScorer({"name": "code"}, timeout_s=5.0, allow_unisolated=False)
    assert sandbox._POLICY["allow_unisolated"] is False
    with pytest.raises(ConfigError, match="allow_unisolatd"):
        load_config(RECIPE_CODE, ["reward.sandbox.allow_unisolatd=true"])
