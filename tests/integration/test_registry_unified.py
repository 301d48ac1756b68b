"""One registry type serves losses, estimators, rewards, tasks and environments: the same lookup,
the same closest-name error, the same decorator registration, built-ins loaded on first lookup."""

from __future__ import annotations

import dataclasses
import subprocess
import sys

import pytest

from flash import algos
from flash.algos.registry import Registry, closest_error
from flash.envs.base import ENVS, make_env, register_env
from flash.rewards.registry import REWARDS, build_reward, register_reward, validate_reward
from flash.tasks import TASKS, Task, make_task, register_task


def test_every_pluggable_concept_is_one_registry_type():
    from flash.algos.advantages import ADVANTAGES
    from flash.algos.policy import LOSSES

    assert all(type(r) is Registry for r in (LOSSES, ADVANTAGES, REWARDS, TASKS, ENVS))
    assert [r.kind for r in (LOSSES, ADVANTAGES, REWARDS, TASKS, ENVS)] == [
        "loss",
        "advantage estimator",
        "reward",
        "task",
        "environment",
    ]


@pytest.mark.parametrize(
    "lookup,message",
    [
        (lambda: algos.validate_loss("decoupled_ppp"), "unknown loss 'decoupled_ppp'; did you mean 'decoupled_ppo'?"),
        (lambda: algos.validate_advantage("grp"), "unknown advantage estimator 'grp'; did you mean 'grpo'"),
        (lambda: validate_reward({"name": "maht"}), "unknown reward 'maht'; did you mean 'math'?"),
        (lambda: make_task("stuter"), "unknown task 'stuter'; did you mean 'stutter'?"),
        (lambda: make_env("coridor"), "unknown environment 'coridor'; did you mean 'corridor'?"),
        (
            lambda: make_task("echo", slip_prb=0.1),
            "unknown option 'slip_prb' for task 'echo'; did you mean 'slip_prob'?",
        ),
        (
            lambda: make_env("corridor", widht=3),
            "unknown option 'widht' for environment 'corridor'; did you mean 'width'?",
        ),
        (
            lambda: validate_reward({"name": "code", "t_mx": 1}),
            "unknown knob 't_mx' for reward 'code'; did you mean 't_max' or 't_min'?",
        ),
    ],
)
def test_one_closest_name_error_for_every_kind(lookup, message):
    with pytest.raises(ValueError) as info:
        lookup()
    assert str(info.value).startswith(message) and "(valid: " in str(info.value)


def test_closest_error_lists_every_valid_name_and_suggests_none_when_nothing_is_near():
    err = closest_error("task", "zzzz", ["echo", "stutter"])
    assert str(err) == "unknown task 'zzzz' (valid: echo, stutter)"


def test_a_users_task_env_and_reward_register_by_decorator():
    @dataclasses.dataclass(frozen=True)
    class Opts:
        size: int = 3
        eval_size: int = 2

    @register_task("my_unified_task")
    class MyTask(Task):
        Options = Opts

    @register_env("my_unified_env")
    class MyEnv:
        Options = Opts
        actions, action_tokens = ("a",), 1

        def __init__(self, options):
            self.options = options

        def reset(self, seed):
            return "start"

        def step(self, action):
            return ("end", 1.0, True, {})

    @register_reward("my_unified_reward")
    def exact(item, response, *, strip: bool = True):
        return float((response.strip() if strip else response) == item)

    try:
        assert make_task("my_unified_task", size=5).options.size == 5 and MyTask.name == "my_unified_task"
        assert make_env("my_unified_env").reset(0) == "start"
        assert build_reward({"name": "my_unified_reward", "strip": True})("ab", " ab ") == 1.0
        assert TASKS.get("my_unified_task").knobs == {"size": 3, "eval_size": 2}
        with pytest.raises(
            ValueError, match="unknown knob 'strp' for reward 'my_unified_reward'; did you mean 'strip'"
        ):
            validate_reward({"name": "my_unified_reward", "strp": False})
    finally:
        for registry, name in ((TASKS, "my_unified_task"), (ENVS, "my_unified_env"), (REWARDS, "my_unified_reward")):
            registry.unregister(name)


def test_builtins_load_on_first_lookup_without_importing_the_content_up_front():
    """``flash.tasks`` names ``flash.recipes.tasks`` as its built-ins by module name: importing the
    contract imports no recipe, and the first lookup registers them all."""
    code = (
        "import sys, flash.tasks as t; assert 'flash.recipes.tasks' not in sys.modules; "
        "names = t.registered_tasks(); assert 'flash.recipes.tasks' in sys.modules; print(' '.join(names))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.split()
    assert {"stutter", "echo", "chainsum", "wordproblems", "pyfunc", "corridor", "frozenlake"} <= set(out)
