"""Rewards: adaptive timeout formula, reward registry errors, math-verify equivalences, the code
reward on hidden tests, and the Ray reward pool (failures as named reasons, timeouts, measured
concurrency limit, worker replacement)."""

import time
from concurrent.futures import ThreadPoolExecutor

import pytest

from flash.errors import ConfigError
from flash.rewards import build_reward, registered_rewards, validate_reward
from flash.rewards.builtin import CodeReward, count_function_passes, extract_code
from flash.rewards.timeout import AdaptiveTimeout
from flash.rewards.workers import GRACE_S
from flash.tasks import TaskItem

# ---- adaptive timeout -----------------------------------------------------------------------


def test_adaptive_timeout_formula_on_hand_computed_values():
    t = AdaptiveTimeout(t_min=1.0, t_max=10.0, lam=3.0)
    assert t.timeout() == 10.0  # no correct run yet: T_max
    t.observe(0.5, correct=True)
    assert t.timeout() == 1.5  # min(max(1, 3 * 0.5), 10)
    t.observe(0.2, correct=True)
    assert t.timeout() == 1.5  # anchor is the slowest correct run: still 0.5
    t.observe(9.0, correct=False)
    assert t.timeout() == 1.5  # wrong runs never move the anchor
    t.observe(2.0, correct=True)
    assert t.timeout() == 6.0
    t.observe(4.0, correct=True)
    assert t.timeout() == 10.0  # 3 * 4 = 12, capped at T_max
    t.observe(0.1, correct=True, family="easy")
    assert (t.timeout("easy"), t.anchor("easy")) == (1.0, 0.1)  # 0.3 raised to T_min
    assert t.metrics() == {
        "sandbox/timeout/t_min": 1.0,
        "sandbox/timeout/t_max": 10.0,
        "sandbox/timeout/lambda": 3.0,
        "sandbox/timeout/anchor/default": 4.0,
        "sandbox/timeout/T/default": 10.0,
        "sandbox/timeout/anchor/easy": 0.1,
        "sandbox/timeout/T/easy": 1.0,
    }


def test_adaptive_timeout_rejects_bad_knobs():
    with pytest.raises(ValueError, match="t_min <= t_max"):
        AdaptiveTimeout(5.0, 1.0, 2.0)
    with pytest.raises(ValueError, match="lam must be a finite number > 0"):
        AdaptiveTimeout(1.0, 5.0, 0.0)


# ---- registry -------------------------------------------------------------------------------


def test_registry_names_valid_choices():
    assert {"math", "code"} <= set(registered_rewards())
    with pytest.raises(ValueError, match=r"unknown reward 'maht'; did you mean 'math'\?"):
        validate_reward({"name": "maht"})
    with pytest.raises(ValueError, match="cannot import module 'no_such_pkg.mod'"):
        validate_reward({"name": "no_such_pkg.mod:fn"})
    with pytest.raises(ValueError, match="has no function 'exakt'; did you mean 'exact'"):
        validate_reward({"name": "tests.reward_fns:exakt"})
    with pytest.raises(
        ValueError,
        match=r"unknown knob 'all_or_none' for reward 'code'; "
        r"did you mean 'all_or_nothing'",
    ):
        validate_reward({"name": "code", "all_or_none": True})
    with pytest.raises(ValueError, match="reward.name is required"):
        validate_reward({})


def test_user_function_by_import_path_with_knobs():
    item = TaskItem(0, "p", "Paris")
    assert build_reward({"name": "tests.reward_fns:exact"})(item, "paris") == 0.0
    assert build_reward({"name": "tests.reward_fns:exact", "case_sensitive": False})(item, "paris") == 1.0


# ---- math -----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "answer,response,expected",
    [
        ("1/2", "0.5", 1.0),
        ("0.5", "1/2", 1.0),
        ("\\frac{1}{2}", "1/2", 1.0),
        ("1/2", "The answer is $\\frac{1}{2}$.", 1.0),
        ("1/2", "so we get \\boxed{0.5}", 1.0),
        ("1/2", "0.6", 0.0),
        ("12", "I think it is 13", 0.0),
        ("12", "", 0.0),
    ],
)
def test_math_reward_equivalences(answer, response, expected):
    assert build_reward({"name": "math"})(TaskItem(0, "q", answer), response) == expected


# ---- code -----------------------------------------------------------------------------------

ADD_TESTS = [
    {"input": [1, 2], "output": 3},
    {"input": [0, 5], "output": 5},
    {"input": [-1, 1], "output": 0},
    {"input": [0, 0], "output": 0},
]
ADD = TaskItem(0, "write add(a, b)", "", meta={"entry_point": "add", "tests": ADD_TESTS})


def test_code_reward_fraction_of_hidden_tests():
    reward = CodeReward(t_min=1.0, t_max=5.0)
    assert reward(ADD, "```python\ndef add(a, b):\n    return a + b\n```") == 1.0
    # wrong whenever a == 0: tests 2 and 4 fail -> 2 of 4
    assert reward(ADD, "def add(a, b):\n    return a + b if a else -1") == 0.5
    assert reward(ADD, "def add(a, b):\n    raise ValueError") == 0.0
    assert CodeReward(all_or_nothing=True)(ADD, "def add(a, b):\n    return a + b if a else -1") == 0.0


def test_code_reward_resists_cheap_hacks():
    reward = CodeReward(t_min=1.0, t_max=5.0)
    assert reward(ADD, "import os\nos._exit(0)") == 0.0  # exit 0 before the tests run
    forged = "import os\nfor i in range(4):\n    os.write(1, b'%d\\tnull\\n' % i)\nos._exit(0)"
    assert reward(ADD, forged) == 0.0  # forged result lines carry the wrong values


def test_code_reward_timeout_keeps_finished_results_and_counts_status():
    reward = CodeReward(t_min=0.5, t_max=1.0)
    loops_on_zero = "def add(a, b):\n    while a == 0:\n        pass\n    return a + b"
    assert reward(ADD, loops_on_zero) == 0.25  # test 1 printed before test 2 looped
    m = reward.metrics()
    assert (m["sandbox/status/timeout"], m["sandbox/leaked"]) == (1.0, 0.0)


def test_code_reward_anchors_its_timeout_on_correct_runs():
    reward = CodeReward(t_min=1e-4, t_max=30.0, lam=2.0)  # t_min under any run: the anchor sets T
    assert reward.timeouts.timeout() == 30.0
    reward(ADD, "def add(a, b):\n    return a - b")  # wrong: no anchor
    assert reward.timeouts.anchor() is None
    reward(ADD, "def add(a, b):\n    return a + b")
    anchor = reward.timeouts.anchor()
    assert 1e-4 < anchor < 15.0  # the correct run's wall time (a fork-server call: milliseconds)
    assert reward.timeouts.timeout() == pytest.approx(2.0 * anchor)
    m = reward.metrics()
    assert (m["sandbox/timeout/T/default"], m["sandbox/status/ok"]) == (2.0 * anchor, 2.0)


def test_code_reward_program_tests_over_stdin():
    item = TaskItem(
        1,
        "reverse each line",
        "",
        meta={"tests": [{"stdin": "abc\n", "stdout": "cba\n"}, {"stdin": "xy\n", "stdout": "yx"}]},
    )
    reward = CodeReward(t_min=1.0, t_max=5.0)
    assert reward(item, "print(input()[::-1])") == 1.0
    assert reward(item, "s = input()\nprint(s[::-1] if len(s) == 3 else s)") == 0.5


def test_result_line_parsing_and_code_extraction():
    assert count_function_passes("0\t3\n1\t5\n1\t5\n9\t0\nnoise\n2\tnot-json\n", ADD_TESTS) == 2
    assert count_function_passes("0\t3.0000000001\n", ADD_TESTS) == 1
    assert extract_code("text\n```python\nx = 1\n```\nmore\n```\ny = 2\n```") == "y = 2\n"
    assert extract_code("def f(): pass") == "def f(): pass"


def test_code_reward_without_tests_is_an_error():
    with pytest.raises(ValueError, match="has no meta\\['tests'\\]"):
        CodeReward()(TaskItem(3, "p", ""), "pass")


# ---- reward pool (Ray) ------------------------------------------------------------------------


def test_pool_rejects_bad_config_before_starting_workers():
    from flash.rewards.workers import RewardPool

    with pytest.raises(ConfigError, match="did you mean 'code'"):
        RewardPool({"name": "cdoe"})
    with pytest.raises(ConfigError, match="concurrency >= 1"):
        RewardPool({"name": "math"}, concurrency=0)


def test_a_non_finite_reward_scored_in_the_driver_is_a_counted_reward_error_as_in_the_pool():
    import threading
    from types import SimpleNamespace

    from flash.controllers.reward_errors import RewardErrors
    from flash.controllers.scheduler import RolloutCore

    rewards = iter([float("nan"), float("inf"), 0.5])
    core = SimpleNamespace(
        source=SimpleNamespace(reward=lambda item, text: next(rewards), decode=str),
        _lock=threading.Lock(),
        counters={"reward_errors": 0},
        reward_deadline_s=None,
        reward_errors=RewardErrors(),
    )
    scores = [RolloutCore.score(core, TaskItem(0, "p", "1/2"), [1]) for _ in range(3)]
    assert scores == [0.0, 0.0, 0.5] and core.counters["reward_errors"] == 2  # never a NaN group


def test_pool_failures_are_named_counted_and_the_run_continues(ray_local):
    from flash.rewards.workers import RewardPool

    item = TaskItem(0, "p", "1/2")
    raising = RewardPool({"name": "tests.reward_fns:divide_by_zero"}, num_workers=1, timeout_s=5)
    nan = RewardPool({"name": "tests.reward_fns:not_a_number"}, num_workers=1, timeout_s=5)
    math_pool = RewardPool({"name": "math"}, num_workers=1, timeout_s=20)
    try:
        for _ in range(3):
            r = raising.score(item, "x")
            assert (r.reward, r.reason) == (0.0, "error:ZeroDivisionError")
        assert (nan.score(item, "x").reason) == "error:BadReward"
        assert math_pool.score(item, "0.5").reward == 1.0  # other pools unaffected
        m = raising.metrics()
        assert (m["reward/calls"], m["reward/failures/error:ZeroDivisionError"]) == (3.0, 3.0)
        assert math_pool.metrics().get("reward/failures/timeout", 0.0) == 0.0
    finally:
        for p in (raising, nan, math_pool):
            p.close()


def test_pool_timeout_scores_zero_and_replaces_stuck_worker(ray_local):
    from flash.rewards.workers import RewardPool

    pool = RewardPool({"name": "tests.reward_fns:slow", "seconds": 30.0}, num_workers=1, timeout_s=0.5, max_stuck=0)
    try:
        r = pool.score(TaskItem(0, "p", ""), "x")
        assert (r.reward, r.reason) == (0.0, "timeout") and 0.5 <= r.wall_s < 0.5 + GRACE_S
        m = pool.metrics()
        assert (m["reward/failures/timeout"], m["reward/worker_restarts"]) == (1.0, 1.0)
        assert m["reward/stuck_calls"] == 0.0  # the replacement worker has nothing stuck
    finally:
        pool.close()


def test_pool_counts_its_workers_cpu_with_the_sandbox_children_they_reaped(ray_local):
    """``reward/cpu_s`` (what the planner's CPU bound adds per step): a reward that runs a child
    burning 0.4 CPU-s, as a sandbox run does, grows the pool's count by that much at least."""
    from flash.rewards.workers import RewardPool

    pool = RewardPool({"name": "tests.reward_fns:burn_in_child", "cpu_s": 0.4}, num_workers=1, timeout_s=30.0)
    try:
        before = pool.metrics()["reward/cpu_s"]
        assert pool.score(TaskItem(0, "p", ""), "x").reward == 1.0
        assert pool.metrics()["reward/cpu_s"] - before >= 0.4 - 0.02  # clock ticks: 10 ms
    finally:
        pool.close()


def _max_overlap(intervals: list[tuple[float, float]]) -> int:
    events = sorted(
        [(s, 1) for s, _ in intervals] + [(e, -1) for _, e in intervals], key=lambda x: (x[0], x[1])
    )  # an end before a start at the same instant
    live = peak = 0
    for _, delta in events:
        live += delta
        peak = max(peak, live)
    return peak


def test_pool_concurrency_limit_is_honoured(ray_local, tmp_path):
    from concurrent.futures import ThreadPoolExecutor

    from flash.rewards.workers import RewardPool

    pool = RewardPool(
        {"name": "tests.reward_fns:logged_sleep", "log_dir": str(tmp_path), "seconds": 0.4},
        num_workers=2,
        concurrency=2,
        timeout_s=20,
    )
    try:
        with ThreadPoolExecutor(12) as ex:  # 12 callers at once, capacity 2 x 2
            results = list(ex.map(lambda i: pool.score(TaskItem(i, "p", ""), "x"), range(12)))
        assert [r.reason for r in results] == ["ok"] * 12
        intervals = [tuple(map(float, p.read_text().split())) for p in tmp_path.iterdir()]
        assert len(intervals) == 12
        assert _max_overlap(intervals) == 4  # never more than 2 x 2, and the capacity is used
        assert len({p.name.split("-")[1] for p in tmp_path.iterdir()}) == 2  # both workers used
    finally:
        pool.close()


# ---- config --------------------------------------------------------------------------------


def test_reward_config_section_is_strict():
    from flash.app.config import load_config

    recipe = "recipes/stutter.yaml"
    cfg = load_config(recipe, ["reward.fn.name=code", "reward.fn.all_or_nothing=true", "reward.num_workers=3"])
    assert (dict(cfg.reward.fn), cfg.reward.num_workers) == ({"name": "code", "all_or_nothing": True}, 3)
    assert load_config(recipe).reward.fn == {}  # unset: the task's own reward, no workers
    for overrides, message in [
        (["reward.fn.name=maht"], "reward.fn: unknown reward 'maht'; did you mean 'math'"),
        (["reward.fn.name=code", "reward.fn.t_mx=3"], "unknown knob 't_mx' for reward 'code'"),
        (["reward.num_worker=3"], "unknown config key 'reward.num_worker' .did you mean 'num_workers'"),
        (["reward.fn.name=math", "reward.timeout_s=0"], "timeout_s must be a finite number > 0"),
    ]:
        with pytest.raises(ConfigError, match=message):
            load_config(recipe, overrides)


def test_pool_from_config_scores_through_workers(ray_local):
    from flash.app.config import load_config
    from flash.rewards.workers import pool_from_config

    assert pool_from_config(load_config("recipes/stutter.yaml").reward) is None
    cfg = load_config("recipes/stutter.yaml", ["reward.fn.name=code", "reward.num_workers=1", "reward.fn.t_max=5"])
    pool = pool_from_config(cfg.reward)
    try:
        fn = pool.reward_fn()
        assert fn(ADD, "def add(a, b):\n    return a + b if a else -1") == 0.5
        m = pool.metrics()
        assert (m["reward/calls"], m["sandbox/status/ok"], m["sandbox/timeout/t_max"], m["sandbox/leaked"]) == (
            1.0,
            1.0,
            5.0,
            0.0,
        )
        assert "sandbox/timeout/T/default" not in m  # no correct run yet, so no anchor
    finally:
        pool.close()


def _kill_mid_call(mark_dir, timeout=60.0) -> int:
    """SIGKILL the worker process that is inside a ``marked_exact`` call; returns its pid."""
    import os
    import signal

    deadline = time.monotonic() + timeout
    while not os.listdir(mark_dir):
        assert time.monotonic() < deadline, "no reward call started"
        time.sleep(0.02)
    pid = int(os.listdir(mark_dir)[0].split("-")[0])
    os.kill(pid, signal.SIGKILL)
    return pid


def test_pool_worker_killed_mid_call_is_replaced_and_the_call_scored_again(ray_local, tmp_path):
    from flash.rewards.workers import RewardPool

    pool = RewardPool(
        {"name": "tests.reward_fns:marked_exact", "mark_dir": str(tmp_path), "seconds": 2.0},
        num_workers=1,
        concurrency=2,
        timeout_s=30,
    )
    events = []
    pool.on_event = events.append
    try:
        old = pool.pids()
        with ThreadPoolExecutor(2) as ex:  # two calls in flight on the one worker when it dies
            futures = [ex.submit(pool.score, TaskItem(i, "p", "ab"), "ab") for i in range(2)]
            killed = _kill_mid_call(tmp_path)
            results = [f.result(timeout=120) for f in futures]
        assert killed == old[0] and pool.pids() != old
        assert [(r.reward, r.reason) for r in results] == [(1.0, "ok"), (1.0, "ok")]  # scored, not 0
        m = pool.metrics()
        assert (m["faults/reward"], m["reward/reissued"], m["reward/worker_restarts"], m["reward/calls"]) == (
            1.0,
            2.0,
            1.0,
            2.0,
        )  # one death, counted once; both calls issued again; no failure outcome
        assert not [k for k in m if k.startswith("reward/failures/")]
        assert [e["event"] for e in events] == ["reward_fault"] and events[0]["recovery_s"] > 0
    finally:
        pool.close()


def test_pool_stops_the_run_when_workers_keep_dying(ray_local, tmp_path):
    from flash.rewards.workers import RewardFailed, RewardPool

    pool = RewardPool(
        {"name": "tests.reward_fns:marked_exact", "mark_dir": str(tmp_path), "seconds": 2.0},
        num_workers=1,
        timeout_s=30,
        max_restarts=0,
    )
    try:
        with ThreadPoolExecutor(1) as ex:
            future = ex.submit(pool.score, TaskItem(0, "p", "ab"), "ab")
            _kill_mid_call(tmp_path)
            with pytest.raises(RewardFailed, match="rollout.max_worker_restarts=0"):
                future.result(timeout=60)
        assert pool.faults == 1
    finally:
        pool.close()


def test_pool_resize_grows_with_ready_workers_and_shrinks_only_idle_ones(ray_local):
    from flash.rewards.workers import RewardPool

    pool = RewardPool({"name": "tests.reward_fns:exact"}, num_workers=1, concurrency=2, timeout_s=20)
    try:
        pool.resize(2)
        assert pool.num_workers == 2 and len(set(pool.pids())) == 2 and pool._slots.capacity == 4
        assert [pool.score(TaskItem(i, "p", "ab"), "ab").reward for i in range(3)] == [1.0] * 3
        pool.resize(1)
        m = pool.metrics()
        assert (m["reward/workers"], m["reward/scale_ups"], m["reward/scale_downs"]) == (1.0, 1.0, 1.0)
        assert pool._slots.capacity == 2 and pool.score(TaskItem(0, "p", "ab"), "ab").reward == 1.0
    finally:
        pool.close()
