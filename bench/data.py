"""What reading prompts from a dataset file costs: start-up, memory, and per-step data time.

    python -m bench.data [--rows 1000000] [--repeats 3] [--steps 200] [--batch 16]

Writes a Parquet file of ``rows`` GSM8K-like rows (question, answer ``... #### N``, solution) with
pyarrow, then in a fresh child process per repeat (so the Arrow cache and the page cache of one
repeat do not pass to the next as Python state):

- ``startup_s``: building the ``dataset`` task over the file (``datasets`` converts Parquet to its
  Arrow cache the first time; later opens memory-map it: ``startup_first_s`` and ``startup_s``);
- ``rss_mb``: the process's resident memory growth from opening the task, after importing
  ``datasets`` (memory-mapped rows are
  not loaded into Python lists: a 1M-row file costs tens of MB, not its size in dicts);
- ``us_per_prompt``: taking ``steps × batch`` prompts at consecutive data positions through the input
  guard (row read, prompt, reference check with math-verify, tokenization with the character
  tokenizer), against the generated ``wordproblems`` task doing the same (``ratio``).

The report is the median over repeats; the last line is JSON.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time


def write_parquet(path: str, rows: int) -> None:
    import pyarrow as pa
    import pyarrow.parquet as pq

    a = [(i * 7919) % 97 + 1 for i in range(rows)]
    b = [(i * 104729) % 89 + 1 for i in range(rows)]
    table = pa.table(
        {
            "question": [f"tom has {x} apples and buys {y} more. how many apples now?" for x, y in zip(a, b)],
            "answer": [f"{x}+{y}={x + y}\n#### {x + y}" for x, y in zip(a, b)],
            "solution": [f"{x}+{y}={x + y}" for x, y in zip(a, b)],
        }
    )
    pq.write_table(table, path)


def rss_mb() -> float:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    return 0.0


def take_cost(task, steps: int, batch: int) -> float:
    """Microseconds per prompt taken through the input guard (item, checks, tokenization)."""
    from flash.guards import InputGuard
    from flash.models import build_tokenizer, encode_prompt

    tok = build_tokenizer()
    guard = InputGuard(max_prompt_tokens=200, warn=lambda _: None)
    index, start = 0, time.perf_counter()
    for _ in range(steps * batch):
        index, _, _ = guard.take(index, task.item, lambda p: encode_prompt(tok, p))
        index += 1
    return (time.perf_counter() - start) / (steps * batch) * 1e6


def child(path: str, steps: int, batch: int) -> dict:
    """One repeat, in a process of its own."""
    from flash.recipes.tasks import make_task

    from flash.data.files import datasets_module

    datasets_module()  # the libraries' own import (pyarrow, pandas) is not the data's memory
    base = rss_mb()
    start = time.perf_counter()
    task = make_task("dataset", train=(path,), prompt_key="question", holdout=0)
    startup = time.perf_counter() - start
    grown = rss_mb() - base
    data_us = take_cost(task, steps, batch)
    gen_us = take_cost(make_task("wordproblems", max_operand=99, ops="+"), steps, batch)
    return {
        "startup_s": startup,
        "rss_mb": grown,
        "rows": task.rows_per_epoch,
        "dataset_us_per_prompt": data_us,
        "generated_us_per_prompt": gen_us,
        "ratio": data_us / gen_us,
    }


def run_child(path: str, steps: int, batch: int) -> dict:
    out = subprocess.run(
        [sys.executable, "-m", "bench.data", "--child", path, "--steps", str(steps), "--batch", str(batch)],
        capture_output=True,
        text=True,
        check=True,
    )
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--rows", type=int, default=1_000_000)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--child", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.child:
        print(json.dumps(child(args.child, args.steps, args.batch)))
        return
    with tempfile.TemporaryDirectory() as tmp:
        os.environ["HF_DATASETS_CACHE"] = os.path.join(tmp, "hf")  # the first open converts: timed apart
        path = os.path.join(tmp, "rows.parquet")
        write_parquet(path, args.rows)
        size_mb = os.path.getsize(path) / 2**20
        first = run_child(path, args.steps, args.batch)
        runs = [run_child(path, args.steps, args.batch) for _ in range(args.repeats)]
    med = {k: statistics.median(r[k] for r in runs) for k in runs[0]}
    print(f"{args.rows} rows, Parquet {size_mb:.1f} MB; first open (Arrow cache built) {first['startup_s']:.2f} s")
    print(
        f"open {med['startup_s']:.2f} s, RSS +{med['rss_mb']:.0f} MB; per prompt: dataset "
        f"{med['dataset_us_per_prompt']:.0f} us, generated {med['generated_us_per_prompt']:.0f} us "
        f"(ratio {med['ratio']:.2f}); per step of {args.batch}: "
        f"{med['dataset_us_per_prompt'] * args.batch / 1000:.1f} ms"
    )
    print(
        json.dumps(
            {
                "rows": args.rows,
                "parquet_mb": size_mb,
                "startup_first_s": first["startup_s"],
                "rss_first_mb": first["rss_mb"],
                **{k: med[k] for k in med if k != "rows"},
                "repeats": args.repeats,
            }
        )
    )


if __name__ == "__main__":
    main()
