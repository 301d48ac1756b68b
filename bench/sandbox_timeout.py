"""Adaptive vs fixed code-sandbox timeout (RollPacker's reward scheduler): reward wall time, same
rewards.

    python -m bench.sandbox_timeout [--repeats 3] [--responses 16] [--loops 3] [--t-max 4]

A batch of responses to function-writing tasks is scored by the ``code`` reward, one after the
other, in a seeded shuffled order. Most responses are correct (one of them correct but slow: it
sleeps 0.15 s per call), some are wrong, and ``--loops`` of them loop forever. *Fixed* gives every
run ``t_max`` -- the timeout one sets by hand to be safe for slow honest code -- so each looping
response burns all of it. *Adaptive* uses T = min(max(t_min, lambda * slowest correct run), t_max).
Each repeat scores the same batch both ways back to back (alternating which goes first). Reports
the median seconds per batch, the median of the per-repeat ratios fixed/adaptive, and whether the
rewards were identical in every repeat. The last line is JSON.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import time

from flash.rewards.builtin import CodeReward
from flash.tasks import TaskItem

TASKS = {  # entry point -> (reference solution, inputs)
    "add": ("def add(a, b):\n    return a + b", [[1, 2], [5, -3], [0, 0]]),
    "mul": ("def mul(a, b):\n    return a * b", [[2, 3], [7, 0], [-1, 4]]),
    "fact": ("def fact(n):\n    r = 1\n    for k in range(2, n + 1):\n        r *= k\n    return r", [[0], [5], [10]]),
    "rev": ("def rev(s):\n    return s[::-1]", [["abc"], [""], ["racecar!"]]),
}


def _expected(entry: str, source: str, inputs: list) -> list:
    ns: dict = {}
    exec(source, ns)  # noqa: S102 - our own reference solutions
    return [ns[entry](*args) for args in inputs]


def make_batch(n: int, loops: int, seed: int) -> list[tuple[TaskItem, str, str]]:
    """(item, response, kind) with kinds correct / slow-correct / wrong / loop."""
    rng = random.Random(seed)
    kinds = ["loop"] * loops + ["slow"] + ["wrong"] * max(1, n // 8)
    kinds += ["correct"] * (n - len(kinds))
    rng.shuffle(kinds)
    if kinds[0] != "correct":  # the first run must not be a loop for either arm to learn from;
        first = kinds.index("correct")  # a fixed first item keeps both arms comparable
        kinds[0], kinds[first] = kinds[first], kinds[0]
    batch = []
    for i, kind in enumerate(kinds):
        entry = list(TASKS)[i % len(TASKS)]
        source, inputs = TASKS[entry]
        tests = [{"input": a, "output": o} for a, o in zip(inputs, _expected(entry, source, inputs))]
        item = TaskItem(i, f"write {entry}", "", meta={"entry_point": entry, "tests": tests})
        head, _, body = source.partition("\n")
        response = {
            "correct": source,
            "slow": f"{head}\n    import time; time.sleep(0.05)\n{body}",
            "wrong": f"{head}\n    return None",
            "loop": f"{head}\n    while True:\n        pass",
        }[kind]
        batch.append((item, response, kind))
    return batch


def score_batch(batch, adaptive: bool, t_min: float, t_max: float, lam: float) -> tuple[float, list, dict]:
    reward = CodeReward(adaptive=adaptive, t_min=t_min, t_max=t_max, lam=lam)
    t0 = time.monotonic()
    rewards = [reward(item, response) for item, response, _ in batch]
    return time.monotonic() - t0, rewards, reward.metrics()


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--responses", type=int, default=16)
    ap.add_argument("--loops", type=int, default=3)
    ap.add_argument("--t-min", type=float, default=1.0)
    ap.add_argument("--t-max", type=float, default=4.0)
    ap.add_argument("--lam", type=float, default=3.0)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    batch = make_batch(args.responses, args.loops, args.seed)
    secs: dict[str, list[float]] = {"fixed": [], "adaptive": []}
    ratios, same, final_t = [], True, []
    for rep in range(args.repeats):
        order = ["fixed", "adaptive"] if rep % 2 == 0 else ["adaptive", "fixed"]
        got = {}
        for arm in order:
            wall, rewards, metrics = score_batch(batch, arm == "adaptive", args.t_min, args.t_max, args.lam)
            got[arm] = rewards
            secs[arm].append(wall)
            if arm == "adaptive":
                final_t.append(metrics["sandbox/timeout/T/default"])
            print(
                f"repeat {rep} {arm:8s}: {wall:6.2f} s, reward sum {sum(rewards):.3f}, "
                f"statuses { {k[15:]: v for k, v in metrics.items() if k.startswith('sandbox/status/')} }",
                flush=True,
            )
        same &= got["fixed"] == got["adaptive"]
        ratios.append(secs["fixed"][-1] / secs["adaptive"][-1])
    result = {
        "responses": args.responses,
        "looping": args.loops,
        "repeats": args.repeats,
        "t_min": args.t_min,
        "t_max": args.t_max,
        "lambda": args.lam,
        "fixed_seconds_median": round(statistics.median(secs["fixed"]), 3),
        "adaptive_seconds_median": round(statistics.median(secs["adaptive"]), 3),
        "fixed_over_adaptive_median": round(statistics.median(ratios), 3),
        "adaptive_final_T_median": round(statistics.median(final_t), 3),
        "rewards_identical": same,
    }
    print(json.dumps(result))
    return result


if __name__ == "__main__":
    main()
