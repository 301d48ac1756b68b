"""Rollout throughput: the torch engine, the vLLM engine and Hugging Face ``generate``, side by side.

    python -m bench.engine [--requests 128] [--concurrency 32] [--repeats 5] [--threads 2]

One tiny Qwen2 (the default recipe's shape: hidden 128, 4 layers), one set of prompts and one
long-tailed length mix (7 in 8 responses short, 1 in 8 ten times longer), the same cores, in one
process. Every system samples at T = 1 with per-token logprobs, ignores EOS and stops exactly at
each request's length, so all produce the same number of useful tokens; tokens/s = those tokens /
wall time. At most ``--concurrency`` sequences run at once in every system:

- ``hf_generate``: static batches of ``concurrency`` requests, the loop a newcomer writes; a batch
  runs until its longest response is done (``generate(max_new_tokens=longest)``), so short
  responses wait on long ones -- the cost continuous batching removes.
- ``torch``: ``flash.engine.torch_worker.EngineWorker`` (the embedded continuous-batching engine, its thread
  loop and the actor-level API), called in-process.
- ``vllm``: ``flash.engine.vllm_engine.VLLMEngineWorker`` (vLLM's ``AsyncLLM`` behind the same
  API), called in-process.
- ``vllm_direct``: the same ``AsyncLLM`` instance fed the same requests straight through
  ``generate`` (no wrapper): the wrapper's overhead is ``1 − vllm / vllm_direct``.

Each repeat runs every system once, interleaved (the order rotates per repeat), after one warm-up
run each; the report is the median over repeats and the ratios against ``hf_generate``. The last
line is JSON.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import statistics
import tempfile
import time

# Before torch loads OpenMP, as `flash` does (flash.app.cli): HF generate and the torch engine run in
# this process, and spinning OpenMP waits collapse throughput on a shared machine.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import torch  # noqa: E402

SYSTEMS = ("hf_generate", "torch", "vllm", "vllm_direct")


def workload(n: int, seed: int = 0) -> list[tuple[list[int], int]]:
    """(prompt ids, response length) pairs: 1 in 8 responses is 10x the short ones."""
    rng = random.Random(seed)
    out = []
    for i in range(n):
        prompt = [1] + [rng.randrange(4, 50) for _ in range(rng.randint(4, 32))]
        short = rng.randint(8, 20)
        out.append((prompt, short * 10 if i % 8 == 7 else short))
    rng.shuffle(out)
    return out


def build_model(path: str) -> None:
    from flash.models import TinyModelConfig, build_tiny_model, build_tokenizer

    tokenizer = build_tokenizer()
    model = build_tiny_model(tokenizer, TinyModelConfig())
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)


def requests(work, tag: str):
    from flash.engine.base import GenerationRequest, SamplingParams

    return [
        GenerationRequest(f"{tag}/{i}", p, SamplingParams(max_new_tokens=n, temperature=1.0, seed=i))
        for i, (p, n) in enumerate(work)
    ]


@torch.inference_mode()
def run_hf(model, work, concurrency: int) -> int:
    """Static batches, left-padded, sampled to the batch's longest length; returns useful tokens."""
    useful = 0
    for start in range(0, len(work), concurrency):
        batch = work[start : start + concurrency]
        width = max(len(p) for p, _ in batch)
        ids = torch.zeros(len(batch), width, dtype=torch.long)
        mask = torch.zeros_like(ids)
        for i, (p, _) in enumerate(batch):
            ids[i, width - len(p) :] = torch.tensor(p)
            mask[i, width - len(p) :] = 1
        longest = max(n for _, n in batch)
        out = model.generate(
            ids,
            attention_mask=mask,
            do_sample=True,
            temperature=1.0,
            top_k=0,
            max_new_tokens=longest,
            min_new_tokens=longest,
            pad_token_id=0,
            eos_token_id=None,
            output_scores=True,
            return_dict_in_generate=True,
        )
        scores = torch.stack(out.scores, 1).log_softmax(-1)  # [batch, longest, vocab]
        logp = scores.gather(-1, out.sequences[:, width:, None]).squeeze(-1)
        useful += sum(min(n, logp.shape[1]) for _, n in batch)
    return useful


def run_worker(worker, work, tag: str) -> int:
    """Submit everything to an engine actor object, collect until all finished."""
    reqs = requests(work, tag)
    worker.submit(reqs)
    done, useful = set(), 0
    while len(done) < len(reqs):
        for o in worker.get_finished(timeout=1.0):
            assert o.finish_reason == "length", o
            done.add(o.request_id)
            useful += len(o.token_ids)
    return useful


def run_vllm_direct(worker, work, tag: str) -> int:
    """The same requests straight into the worker's ``AsyncLLM`` (same sampling parameters)."""
    from vllm import SamplingParams
    from vllm.sampling_params import RequestOutputKind

    async def one(i, prompt, n):
        params = SamplingParams(
            max_tokens=n,
            temperature=1.0,
            seed=i,
            ignore_eos=True,
            logprobs=0,
            detokenize=False,
            output_kind=RequestOutputKind.DELTA,
        )
        count = 0
        async for out in worker._llm.generate({"prompt_token_ids": prompt}, params, request_id=f"{tag}/{i}"):
            c = out.outputs[0]
            _ = [lp[t].logprob for lp, t in zip(c.logprobs, c.token_ids)]  # what the wrapper reads too
            count += len(c.token_ids)
        return count

    async def main():
        return sum(await asyncio.gather(*(one(i, p, n) for i, (p, n) in enumerate(work))))

    return worker._call(main())


def measure(fn) -> tuple[int, float]:
    t0 = time.perf_counter()
    tokens = fn()
    return tokens, time.perf_counter() - t0


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--requests", type=int, default=128)
    ap.add_argument("--concurrency", type=int, default=32)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument(
        "--systems",
        default=",".join(SYSTEMS),
        help="comma-separated subset, e.g. vllm,vllm_direct for the wrapper overhead alone",
    )
    args = ap.parse_args(argv)
    systems = tuple(s for s in SYSTEMS if s in args.systems.split(","))

    from flash.engine.vllm_engine import VLLMEngineWorker
    from flash.cluster import load_model
    from flash.engine.torch_worker import EngineWorker

    torch.set_num_threads(args.threads)
    path = tempfile.mkdtemp(prefix="flash-bench-engine-")
    build_model(path)
    work, warm = workload(args.requests), workload(args.concurrency, seed=1)
    hf = load_model(path).eval() if "hf_generate" in systems else None
    torch_worker = EngineWorker(path, args.concurrency, 0, args.threads) if "torch" in systems else None
    vllm_worker = VLLMEngineWorker(path, args.concurrency, 0, args.threads) if "vllm" in args.systems else None
    all_runs = {
        "hf_generate": lambda w, tag: run_hf(hf, w, args.concurrency),
        "torch": lambda w, tag: run_worker(torch_worker, w, tag),
        "vllm": lambda w, tag: run_worker(vllm_worker, w, tag),
        "vllm_direct": lambda w, tag: run_vllm_direct(vllm_worker, w, tag),
    }
    runs = {s: all_runs[s] for s in systems}
    try:
        for name, fn in runs.items():
            fn(warm, f"warm-{name}")
        rates: dict[str, list[float]] = {s: [] for s in systems}
        for rep in range(args.repeats):
            order = systems[rep % len(systems) :] + systems[: rep % len(systems)]  # no system always last
            for name, fn in ((s, runs[s]) for s in order):
                tokens, secs = measure(lambda fn=fn, tag=f"{name}-{rep}": fn(work, tag))
                rates[name].append(tokens / secs)
                print(
                    f"repeat {rep} {name:12s} {tokens} tokens in {secs:6.2f} s = {tokens / secs:8.0f} tokens/s",
                    flush=True,
                )
    finally:
        for w in (torch_worker, vllm_worker):
            if w is not None:
                w.shutdown()
    return report(args, rates, sum(n for _, n in work))


def report(args, rates: dict[str, list[float]], useful_tokens: int) -> dict:
    """Medians per system, and ratios as medians of per-repeat pairs (the two ran side by side, so
    a noisy moment on the shared cores hits both; a ratio of medians would mix moments)."""
    med = {s: statistics.median(r) for s, r in rates.items()}
    result = {
        "bench": "engine",
        "requests": args.requests,
        "concurrency": args.concurrency,
        "repeats": args.repeats,
        "threads": args.threads,
        "useful_tokens": useful_tokens,
        "tokens_per_s": {s: round(v, 1) for s, v in med.items()},
    }
    if "hf_generate" in rates:
        result["vs_hf_generate"] = {
            s: round(statistics.median(a / b for a, b in zip(r, rates["hf_generate"])), 3) for s, r in rates.items()
        }
    if "vllm" in rates and "vllm_direct" in rates:
        pairs = [1 - a / b for a, b in zip(rates["vllm"], rates["vllm_direct"])]
        result["vllm_wrapper_overhead"] = round(statistics.median(pairs), 4)
        result["vllm_wrapper_overhead_per_repeat"] = [round(x, 3) for x in pairs]
    for s, v in med.items():
        print(f"{s:12s} median {v:8.0f} tokens/s")
    print(json.dumps(result))
    return result


if __name__ == "__main__":  # vLLM starts its engine processes with spawn: keep the guard
    main()
