"""What the buffer service's per-frame checks cost, this tree against another commit's, in one run.

    python -m bench.buffer_checks [--base main] [--repeats 7] [--rounds 200]

The service's work on one group frame once it has arrived: ``unpack`` (msgpack, size and
container checks), ``decode_group`` (schema, dtypes, lengths, runs) and ``check_values`` (finite,
in range). ``new`` is this tree, with the message's decoded-bytes ``Budget`` charged as the service
does; ``old`` is ``buffers/wire.py`` as it is at ``--base`` (read with ``git show``, loaded beside
this one), with the same ``check_values``, and its own ``Budget`` where it has one. Frames: a
trajectory of one sample (16 prompt tokens, L response tokens; int32 ids, float32 logprobs, int32
versions) sent as arrays or as lists, the default recipe's group (8 samples of 40 tokens, lists),
and a group of 16 samples of 8,192 tokens (arrays; over ``flash.buffers.frame_scan.FAST_BYTES``). Each repeat times ``--rounds`` decodes of
a frame with old and new in alternation (old, new, new, old, ...), so a change in the machine's
load falls on both; times are this thread's CPU time; the report is the median µs per frame of each and the median per-repeat ratio
old / new (below 1: the new checks cost more). The last line is JSON.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import re
import statistics
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

from flash.buffers import wire
from flash.buffers.guard import ValueLimits, check_values
from flash.buffers.service import message_caps
from flash.buffers.types import Group, Sample

MAX_FRAME = 64 << 20


def old_wire(base: str):
    """``buffers/wire.py`` at commit ``base``, as a module of its own."""
    root = Path(__file__).resolve().parent.parent
    source = subprocess.run(
        ["git", "show", f"{base}:buffers/wire.py"], cwd=root, check=True, capture_output=True, text=True
    ).stdout
    source = re.sub(r"^from buffers\.", "from .", source, flags=re.M)  # a commit's bare imports, as its own package's
    spec = importlib.util.spec_from_loader("old_wire", loader=None)
    module = importlib.util.module_from_spec(spec)
    module.__package__ = "flash.buffers"  # its relative imports: the current buffers' codec, types, ...
    sys.modules["old_wire"] = module
    exec(compile(source, f"{base}:buffers/wire.py", "exec"), module.__dict__)  # noqa: S102 - our own repository
    return module


def frames() -> dict[str, bytes]:
    rng = np.random.default_rng(0)

    def sample(pid: int, k: int, length: int, prompt: int, lists: bool) -> Sample:
        arrays = {
            "prompt_ids": rng.integers(0, 50_000, prompt).astype(np.int32),
            "response_ids": rng.integers(0, 50_000, length).astype(np.int32),
            "behav_logprobs": -rng.random(length).astype(np.float32),
            "versions": np.full(length, 3, dtype=np.int32),
        }
        if lists:
            arrays = {name: a.tolist() for name, a in arrays.items()}
        return Sample(
            prompt_id=pid,
            sample_index=k,
            reward=1.0,
            finish_reason="stop",
            meta={"data_index": pid, "request_id": f"r{pid}.{k}", "request": k},
            **arrays,
        )

    out = {}
    for length in (1024, 8192):
        for lists in (False, True):
            g = Group(prompt_id=1, samples=[sample(1, 0, length, 16, lists)], data_index=1)
            out[f"L={length} {'lists' if lists else 'arrays'}"] = wire.encode_group(g)
    out["8 x 40 lists"] = wire.encode_group(
        Group(prompt_id=1, data_index=1, samples=[sample(1, k, 40, 24, True) for k in range(8)])
    )
    out["16 x 8192 arrays"] = wire.encode_group(
        Group(
            prompt_id=1,
            data_index=1,  # over 1 MiB
            samples=[sample(1, k, 8192, 16, False) for k in range(16)],
        )
    )
    return out


def timed(decode, frame: bytes, rounds: int) -> float:
    """CPU µs per decode (this thread's CPU time: on a shared machine, wall time measures the others)."""
    start = time.thread_time()
    for _ in range(rounds):
        decode(frame)
    return (time.thread_time() - start) / rounds * 1e6


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--base", default="main")
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--rounds", type=int, default=200)
    args = ap.parse_args()
    old = old_wire(args.base)
    limits, cap = ValueLimits(vocab_size=50_000), message_caps(MAX_FRAME)[1]

    def check(g):
        check_values(g, limits, 3)

    def decode_old(frame):
        if not hasattr(old, "Budget"):  # a wire.py from before the decoded-bytes budget
            return old.decode_group(old.unpack(frame, MAX_FRAME), check)
        budget = old.Budget(cap)  # charged as the service did then
        return old.decode_group(old.unpack(frame, MAX_FRAME, budget), check, budget)

    def decode_new(frame):
        budget = wire.Budget(cap)
        return wire.decode_group(wire.unpack(frame, MAX_FRAME, budget), check, budget)

    report = {}
    for name, frame in frames().items():
        rounds = max(10, args.rounds * 4096 // max(len(frame), 4096))
        olds, news, ratios = [], [], []
        for r in range(args.repeats):
            pair = [timed(decode_old, frame, rounds), timed(decode_new, frame, rounds)]
            if r % 2:  # alternate which goes first
                pair = [timed(decode_new, frame, rounds), timed(decode_old, frame, rounds)][::-1]
            olds.append(pair[0])
            news.append(pair[1])
            ratios.append(pair[0] / pair[1])
        report[name] = {
            "bytes": len(frame),
            "old_us": statistics.median(olds),
            "new_us": statistics.median(news),
            "old_over_new": statistics.median(ratios),
        }
        print(
            f"{name:>16}: {len(frame):>8} B  old {report[name]['old_us']:8.1f} µs  new "
            f"{report[name]['new_us']:8.1f} µs  old/new {report[name]['old_over_new']:.3f}",
            flush=True,
        )
    print(json.dumps(report))


if __name__ == "__main__":
    main()
