"""The simulated engine's own bookkeeping per decode step, with no simulated time to sleep.

    python -m bench.sim_decode [--running 1500] [--steps 40] [--repeats 5]

``SimBatcher`` at ``sim.time_scale`` 0 with ``--running`` responses of 4,096-token caps in flight:
what one step costs the driver in real time (drawing every running response's next ids and
logprobs, admitting, finishing). A simulated step shorter than this runs late
(``rollout/sim_late_s``), so it bounds how small ``sim.time_scale`` can be at a given scale.
Median of the repeats, milliseconds per step. The last line is JSON.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

from flash.engine.base import GenerationRequest, SamplingParams
from flash.engine.sim_engine import SimBatcher, SimSettings
from flash.sim.config import SimConfig


def ms_per_step(running: int, steps: int) -> float:
    settings = SimSettings.from_config(SimConfig())
    settings.time_scale = 0.0
    b = SimBatcher(settings, vocab_size=50_000, max_num_seqs=running, seed=0)
    for i in range(running):
        b.add_request(
            GenerationRequest(f"r{i}", list(range(50)), SamplingParams(max_new_tokens=4096, stop_token_ids=[2], seed=i))
        )
    b.step()  # admission
    start = time.perf_counter()
    for _ in range(steps):
        b.step()
    return (time.perf_counter() - start) / steps * 1e3


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--running", type=int, default=1500)
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--repeats", type=int, default=5)
    args = ap.parse_args(argv)
    runs = [ms_per_step(args.running, args.steps) for _ in range(args.repeats)]
    result = {
        "bench": "sim_decode",
        "running": args.running,
        "steps": args.steps,
        "ms_per_step": round(statistics.median(runs), 2),
        "runs": [round(r, 2) for r in runs],
    }
    print(json.dumps(result))
    return result


if __name__ == "__main__":
    main()
