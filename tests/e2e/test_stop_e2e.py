"""Stopping a run and moving it: SIGTERM stops `flash run` cleanly with a resume hint, the run dir
copied to a machine without its key resumes only when the user says it trusts it, and a driver
killed outright leaves no Ray process behind.

Real runs (subprocesses with their own Ray).
"""

import os
import shutil
import subprocess
import sys
import time

from tests.helpers.processes import ROOT, SMALL, launch, roles_ready, session_pids, steps_done, wait_for


def test_sigterm_stops_with_a_resume_hint_and_a_copied_run_needs_the_trust_flag(tmp_path, warm_cache):
    run_dir = tmp_path / "run"
    proc = launch(run_dir, warm_cache, [f"run_dir={run_dir}", "train.steps=30"])
    assert wait_for(lambda: steps_done(run_dir) >= 2, proc, timeout=600)
    os.kill(proc.pid, 15)  # the driver alone, as a scheduler's stop does
    assert proc.wait(timeout=120) == 130
    log = (tmp_path / "run.log").read_text()
    last = log.strip().splitlines()[-1]
    assert last.startswith("flash: interrupted (SIGTERM; resume from the last checkpoint: flash run ")
    assert last.endswith(f"resume={run_dir})") and "Traceback" not in log
    assert gone_within(proc.pid, 30) == []  # Ray's processes of the run went with it

    copy = tmp_path / "copied"
    shutil.copytree(run_dir, copy)
    env = {**os.environ, "PYTHONPATH": str(ROOT), "FLASH_KEY_DIR": str(tmp_path / "another-machine")}
    cmd = [
        sys.executable,
        "-m",
        "flash.app.cli",
        "run",
        "recipes/stutter.yaml",
        *SMALL,
        f"resume={copy}",
        f"cache_dir={warm_cache}",
    ]
    out = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300, check=False)
    assert out.returncode == 2 and "Traceback" not in out.stderr
    assert out.stderr.strip().splitlines()[-1].startswith(f"flash: error: checkpoint {copy}/checkpoints/ckpt-")
    assert "resume it with trust_checkpoint=true" in out.stderr


def gone_within(sid: int, seconds: float) -> list[int]:
    """The session's processes still alive after waiting up to ``seconds`` for them to go."""
    deadline = time.monotonic() + seconds
    while session_pids(sid) and time.monotonic() < deadline:
        time.sleep(0.5)
    return session_pids(sid)


def test_a_driver_killed_outright_leaves_no_ray_process_behind(tmp_path, warm_cache):
    run_dir = tmp_path / "run"
    proc = launch(run_dir, warm_cache, [f"run_dir={run_dir}", "train.steps=30"])
    assert wait_for(lambda: roles_ready(run_dir) >= 1, proc, timeout=600)
    assert len(session_pids(proc.pid)) >= 5  # the driver, Ray's GCS, raylet, agents, the roles' workers
    os.kill(proc.pid, 9)  # the driver alone: no ray.shutdown runs
    proc.wait(timeout=30)
    assert gone_within(proc.pid, 30) == []
