"""Golden numerics: the first synchronous steps of every shipped CPU recipe, pinned.

Each recipe runs shrunk (``shape``: three synchronous steps, a few prompts and samples, a short
warm start, every role on one torch thread) from its seed; ``measure`` reads back what the run
wrote -- per step the loss, the gradient norm and the mean reward (``metrics.jsonl``), and the
first token ids of the first responses of step 0 with the count of every response token that step
sampled (``schedule.jsonl``, groups in data order) --
and ``differences`` compares that with ``tests/golden/RECIPE.json``: numbers within a tight
tolerance (another CPU's BLAS may reduce in another order), token ids exactly.

Golden values change only through ``python -m tests.golden bless RECIPE`` (``tests.golden.bless``):
it runs the recipe's learning test first and records its result in BENCHMARKS.md.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

GOLDEN_DIR = Path(__file__).resolve().parent
ROOT = GOLDEN_DIR.parents[1]
STEPS = 3
QUANTITIES = {"loss": "train/loss", "grad_norm": "train/grad_norm", "reward_mean": "reward/mean"}
RESPONSES, TOKENS = 2, 24  # token ids pinned: the first TOKENS of the first RESPONSES of step 0
# abs: a policy-gradient loss at step 1 is a cancellation of per-token terms of order 1 (each group's
# advantages sum to 0), so its float32 rounding alone reaches ~1e-7; 1e-6 still pins any real change.
# rel of the gradient norm: each parameter's gradient is a sum over tokens whose advantages cancel
# (a group's sum to 0), reduced by backward in an order the CPU's kernels choose, so its rounding is
# large next to the small norm left: on an AMD EPYC without AVX-512 the math recipe's three norms sit
# rel 1.1-2.2e-5 and the code recipe's second 2.3e-4 off the blessing machine's, every loss, reward
# and token bit for bit the same. Another sample, advantage or loss moves a norm by far more.
REL, ABS = 1e-5, 1e-6
REL_OF = {"grad_norm": 1e-3}

# Every recipe: synchronous, three steps, one torch thread per role and for the warm start (the
# sampled tokens then depend on no thread count), no evaluation beyond one prompt before and after,
# no checkpoint, no trackers.
COMMON = [
    "async_ratio=0",
    f"train.steps={STEPS}",
    "train.prompts_per_step=2",
    "rollout.n=8",
    "checkpoint.enabled=false",
    "checkpoint.every_steps=0",
    "eval.every_steps=0",
    "eval.n=1",
    "task.eval_size=1",
    "tracking.tensorboard=false",
    "tracking.progress=false",
    "tracking.log_samples=0",
    "resources.engine_threads=1",
    "resources.trainer_threads=1",
    "resources.driver_threads=1",
    "sft.threads=1",
    "sft.eval_after=false",
    "sft.batch_size=32",
    "ray.num_cpus=2",
]

# Per recipe: what shrinks it further. A short warm start gets some answers right (easier items
# where the recipe's are beyond it: one-letter strings, one-operation specs, sums of 1 and 2), so
# some steps have groups with different rewards: a non-zero loss and gradient to pin. The code
# reward's adaptive timeout is off (it follows wall-clock run times, which the load moves).
SHAPES: dict[str, list[str]] = {
    "stutter": ["sft.steps=40", "task.max_len=1", "rollout.max_new_tokens=4"],
    "math": ["sft.steps=40"],
    "reasoning_gym": ["sft.steps=40"],
    "code": [
        "sft.steps=60",
        "task.min_ops=1",
        "task.max_ops=1",
        "task.paren_share=0",
        "reward.num_workers=1",
        "reward.fn.adaptive=false",
    ],
    "corridor": ["sft.steps=40", "task.env_workers=1"],
    "frozenlake": ["sft.steps=40", "task.env_workers=1"],
    "calculator": [
        "sft.steps=40",
        "agent.processes=0",
        "task.min_operand=1",
        "task.max_operand=2",
        "task.ops=+",
        "task.skip_prob=0.9",
    ],
    "verifiers_tool": ["sft.steps=40", "task.args.skip_prob=0.9", "train.prompts_per_step=4", "rollout.n=16"],
}

# Shipped recipes with no golden values, and why.
NOT_PINNED = {
    "gsm8k_1gpu": "a GPU recipe (a Qwen2.5 checkpoint on CUDA); tests/unit/test_gpu_recipes.py validates it",
    "gsm8k_8gpu": "an 8-GPU recipe; tests/unit/test_gpu_recipes.py validates it",
    "sim_rlvr": "simulated roles (train.backend: sim): no model is trained; the loss is synthetic and "
    "the gradient norm 1 / (1 + step) by construction (tests/integration/test_sim.py pins the loss)",
    "sim_agentic": "simulated roles, as sim_rlvr, with environment steps that sleep a drawn latency",
    "math_smollm2": "a 135 M-parameter model: its GGUF conversion alone takes ~30 s (the recipe's own "
    "figure) and its roles load 135 M weights, beyond the golden runs' budget",
    "humaneval_smollm2": "SmolLM2-135M, as math_smollm2 (beyond the golden runs' budget); "
    "tests/unit/test_humaneval.py pins its rows' scores in the sandbox",
}


def overrides(recipe: str) -> list[str]:
    """The overrides a recipe's golden run uses (the run and cache dirs are the caller's)."""
    return [*COMMON, *SHAPES[recipe]]


def golden_path(recipe: str) -> Path:
    return GOLDEN_DIR / f"{recipe}.json"


def run_golden(recipe: str, run_dir: Path, cache_dir: str) -> dict:
    """Run the recipe's golden shape in this process (Ray may already be up) and measure it."""
    from flash.app.config import load_config
    from flash.app.runner import run

    cfg = load_config(
        str(ROOT / "recipes" / f"{recipe}.yaml"), [*overrides(recipe), f"run_dir={run_dir}", f"cache_dir={cache_dir}"]
    )
    run(cfg, recipe)
    return measure(recipe, run_dir)


def measure(recipe: str, run_dir: Path) -> dict:
    """The golden record of a finished run dir: per-step quantities and step 0's first tokens."""
    lines = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    steps = [{"step": m["step"], **{q: float(m[key]) for q, key in QUANTITIES.items()}} for m in lines]
    first = json.loads((run_dir / "schedule.jsonl").read_text().splitlines()[0])
    sampled = sum(len(s["response_ids"]) for g in first["groups"] for s in g["samples"])
    return {
        "recipe": recipe,
        "overrides": overrides(recipe),
        "steps": steps,
        "tokens": first_tokens(first),
        "step0_response_tokens": sampled,
    }


def first_tokens(schedule_line: dict) -> list[list[int]]:
    """The first TOKENS ids of the first RESPONSES responses of a step, groups in data order and
    samples in sample order (so the collation order of a step does not move them)."""
    groups = sorted(schedule_line["groups"], key=lambda g: g["data_index"])
    samples = [s for g in groups for s in sorted(g["samples"], key=lambda s: s["sample_index"])]
    return [list(s["response_ids"][:TOKENS]) for s in samples[:RESPONSES]]


@dataclass(frozen=True)
class Moved:
    """One golden value that a run did not reproduce."""

    recipe: str
    step: int | None  # None: not a per-step value
    quantity: str
    old: object
    new: object

    def line(self) -> str:
        where = f"step {self.step} " if self.step is not None else ""
        return f"{self.recipe}: {where}{self.quantity} moved: {self.old!r} -> {self.new!r}"


def _close(old: float, new: float, rel: float = REL) -> bool:
    return abs(new - old) <= max(rel * abs(old), ABS)  # pytest.approx(old, rel=rel, abs=ABS)


def differences(golden: dict, measured: dict) -> list[Moved]:
    """Every golden value the measured record does not reproduce (empty: it matches)."""
    recipe = golden["recipe"]
    if golden["overrides"] != measured["overrides"]:
        return [Moved(recipe, None, "overrides", golden["overrides"], measured["overrides"])]
    moved: list[Moved] = []
    if len(golden["steps"]) != len(measured["steps"]):
        moved.append(Moved(recipe, None, "steps logged", len(golden["steps"]), len(measured["steps"])))
    for old, new in zip(golden["steps"], measured["steps"]):
        moved += [
            Moved(recipe, old["step"], q, old[q], new[q])
            for q in QUANTITIES
            if not _close(old[q], new[q], REL_OF.get(q, REL))
        ]
    if golden["tokens"] != measured["tokens"]:
        moved.append(Moved(recipe, 0, "first token ids", golden["tokens"], measured["tokens"]))
    if golden["step0_response_tokens"] != measured["step0_response_tokens"]:
        moved.append(
            Moved(
                recipe, 0, "response tokens sampled", golden["step0_response_tokens"], measured["step0_response_tokens"]
            )
        )
    return moved


def failure_message(moved: list[Moved]) -> str:
    """What moved, old -> new, and the command that re-blesses the recipe."""
    recipe = moved[0].recipe
    return "\n".join(
        [
            f"golden numerics of recipe {recipe!r} moved (tests/golden/{recipe}.json):",
            *(f"  {m.line()}" for m in moved),
            f"If the change is meant, re-bless: python -m tests.golden bless {recipe}",
            "(it runs the recipe's learning test first and records the result in BENCHMARKS.md)",
        ]
    )


def write_golden(record: dict, directory: Path = GOLDEN_DIR) -> Path:
    """Write a measured record as the recipe's golden file."""
    path = directory / f"{record['recipe']}.json"
    path.write_text(golden_text(record))
    return path


def golden_text(record: dict) -> str:
    """The record as JSON with one line per key, and per step (short diffs when a value moves)."""

    def value(v) -> str:
        if isinstance(v, list) and v and isinstance(v[0], dict):
            return "[\n" + ",\n".join(f"  {json.dumps(x)}" for x in v) + "\n ]"
        return json.dumps(v)

    return "{\n" + ",\n".join(f" {json.dumps(k)}: {value(v)}" for k, v in record.items()) + "\n}\n"


def read_golden(recipe: str, directory: Path = GOLDEN_DIR) -> dict:
    return json.loads((directory / f"{recipe}.json").read_text())
