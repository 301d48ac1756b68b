"""User reward functions named by import path in tests/integration/test_rewards.py (``tests.reward_fns:NAME``);
imported inside Ray reward workers, so this module has no test-only imports."""

import os
import time


def exact(item, response, case_sensitive: bool = True):
    """1.0 if the response equals the answer."""
    a, b = str(item.answer), response.strip()
    return float(a == b if case_sensitive else a.lower() == b.lower())


def divide_by_zero(item, response):
    return 1 / 0


def slow(item, response, seconds: float = 5.0):
    time.sleep(seconds)
    return 1.0


def not_a_number(item, response):
    return float("nan")


def logged_sleep(item, response, log_dir: str = "", seconds: float = 0.3):
    """Sleeps and records (start, end) in ``log_dir`` so a test can measure how many overlap."""
    start = time.time()
    time.sleep(seconds)
    end = time.time()
    with open(os.path.join(log_dir, f"{item.index}-{os.getpid()}-{start}"), "w") as f:
        f.write(f"{start} {end}")
    return 1.0


def marked_exact(item, response, mark_dir: str = "", seconds: float = 0.2):
    """``exact`` after ``seconds``; while it runs, a file ``<pid>-<n>`` in ``mark_dir`` says which
    worker process is mid-call (a fault test kills that process then)."""
    path = os.path.join(mark_dir, f"{os.getpid()}-{time.monotonic_ns()}")
    open(path, "w").close()
    try:
        time.sleep(seconds)
        return exact(item, response)
    finally:
        os.remove(path)


def burn_in_child(item, response, cpu_s: float = 0.4):
    """Runs a child process that burns ``cpu_s`` CPU seconds and is reaped (as a sandbox run is)."""
    import subprocess
    import sys

    prog = f"import time\nt = time.process_time()\nwhile time.process_time() - t < {cpu_s}: pass\n"
    subprocess.run([sys.executable, "-c", prog], check=True)
    return 1.0


def response_length(item, response):
    """The response's length in characters: a reward that differs between samples of any model."""
    return float(len(response))


def exact_result(item, response):
    """``exact`` as a ``RewardResult`` (the other form a reward function may return)."""
    from flash.rewards import RewardResult

    return RewardResult(exact(item, response), "ok")
