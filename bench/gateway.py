"""What the gateway costs per call: the same chat calls through the OpenAI client and the gateway
vs straight to the engine.

    python -m bench.gateway [--calls 200] [--repeats 3] [--max-tokens 16] [--concurrency 1,8]
    python -m bench.gateway --parse [--repeats 5]     # the body parse alone, before and with the depth bound

One process, one in-process ``TorchEngine`` over the tiny model (flash.models, random weights, a
ChatML-like template on the character tokenizer). ``direct``: render the messages with the chat
template, ``engine.generate`` one request, decode. ``gateway``: the same conversation turn through
``openai.AsyncOpenAI`` -> HTTP -> the gateway (session bookkeeping, validation, the token-exact
append) -> the same engine. Both ask the same prompts with the same seeds and ``--max-tokens``
(the engine stops only at the cap here: eos is masked off), so they generate the same tokens; the
difference is the gateway's overhead. ``--concurrency`` agents at once; the engine serves one call
at a time in both (a lock), so concurrency overlaps only the HTTP and bookkeeping with generation.
Clients are made before the calls are timed, over one shared HTTP pool as flash's agent runner
makes them (an agent gets one per episode): their cost is reported apart.
Each repeat runs both back to back; the report is the median seconds per call and the ratio
gateway / direct. The last line is JSON.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import threading
import time

CHATML = (
    "{% for m in messages %}<bos>{{ m['role'] }} {{ m['content'] }}<eos> {% endfor %}"
    "{% if add_generation_prompt %}<bos>assistant {% endif %}"
)


def build(max_tokens: int):
    import torch

    from flash.engine.base import GenerationRequest, SamplingParams
    from flash.engine.torch_engine import TorchEngine
    from flash.models import TinyModelConfig, build_tiny_model, build_tokenizer, chat_ids

    tok = build_tokenizer()
    tok.chat_template = CHATML
    model = build_tiny_model(tok, TinyModelConfig(num_layers=2)).eval()
    engine = TorchEngine(model, max_num_seqs=64, seed=0)
    lock = threading.Lock()

    def generate(prompt_ids, params, key=""):
        with lock:  # one batch at a time: the engine is not shared between threads
            return engine.generate([GenerationRequest(f"r{time.monotonic_ns()}", list(prompt_ids), params)])[0]

    def direct(messages, seed):
        params = SamplingParams(max_new_tokens=max_tokens, temperature=1.0, stop_token_ids=[], seed=seed)
        out = generate(chat_ids(tok, messages), params)
        return tok.decode(out.token_ids, skip_special_tokens=True)

    torch.set_num_threads(1)
    return tok, generate, direct


def prompts(n: int) -> list[list[dict]]:
    return [[{"role": "user", "content": f"add {i % 9} and {(i * 7) % 9}."}] for i in range(n)]


async def via_gateway(gw, n: int, concurrency: int, max_tokens: int) -> tuple[float, float]:
    """(seconds per call, seconds to make one client): sessions and clients are made before the
    calls are timed (an agent makes its client once per episode; its cost is reported apart)."""
    import openai

    slots = asyncio.Semaphore(concurrency)
    made = time.perf_counter()
    http = openai.DefaultAsyncHttpxClient()  # shared, as flash's agent runner shares it
    clients = [
        openai.AsyncOpenAI(base_url=gw.url, api_key=gw.open_session(), max_retries=0, http_client=http)
        for _ in range(n)
    ]
    per_client = (time.perf_counter() - made) / n

    async def one(i, messages):
        async with slots:
            await clients[i].chat.completions.create(model="policy", messages=messages, max_tokens=max_tokens, seed=i)

    start = time.perf_counter()
    await asyncio.gather(*(one(i, m) for i, m in enumerate(prompts(n))))
    per_call = (time.perf_counter() - start) / n
    for c in clients:
        gw.close_session(c.api_key)
    await http.aclose()
    return per_call, per_client


def via_direct(direct, n: int, concurrency: int) -> float:
    from concurrent.futures import ThreadPoolExecutor

    start = time.perf_counter()
    with ThreadPoolExecutor(concurrency) as pool:
        list(pool.map(lambda im: direct(im[1], im[0]), enumerate(prompts(n))))
    return (time.perf_counter() - start) / n


def parse_bodies() -> dict[str, bytes]:
    """Request bodies as agents send them: one short turn; a conversation with tools and tool calls
    (~64 KiB); the largest body the gateway takes (1 MiB: one long message); a deep tool schema."""
    tools = [
        {
            "type": "function",
            "function": {
                "name": f"tool{i}",
                "description": "does a thing " * 8,
                "parameters": {"type": "object", "properties": {"x": {"type": "string"}, "n": {"type": "integer"}}},
            },
        }
        for i in range(8)
    ]
    call = {"id": "c", "type": "function", "function": {"name": "tool1", "arguments": json.dumps({"x": "a" * 40})}}
    turns = [
        {"role": "user", "content": "what is 12 * 34? " * 4},
        {"role": "assistant", "content": None, "tool_calls": [call]},
        {"role": "tool", "content": "408"},
    ]
    deep: dict = {"type": "string"}
    for _ in range(29):  # 59 levels, 63 in the body: within the bound
        deep = {"type": "object", "properties": {"x": deep}}
    return {
        "short (1 turn)": json.dumps({"model": "p", "messages": turns[:1], "max_tokens": 16}).encode(),
        "64 KiB (tools, 100 turns)": json.dumps({"messages": turns * 100, "tools": tools}).encode(),
        "1 MiB (one message)": json.dumps({"messages": [{"role": "user", "content": "x" * ((1 << 20) - 64)}]}).encode(),
        "deep schema (64 levels)": json.dumps(
            {"messages": turns[:1], "tools": [{"type": "function", "function": {"name": "f", "parameters": deep}}]}
        ).encode(),
    }


def parse_costs(repeats: int) -> dict:
    """Microseconds per body: the parse before the depth bound (``json.loads`` refusing NaN, as
    ``parse_body`` did) and the gateway's ``parse_body`` now (the bracket count, the depth scan when
    over 64 brackets open, then the same parse); the scan alone; median of ``repeats`` runs."""
    from flash.envs.gateway_requests import _no_constants, parse_body
    from flash.envs.json_bounds import json_depth

    def old(body: bytes) -> dict:
        return json.loads(body, parse_constant=_no_constants)

    rows = {}
    for name, body in parse_bodies().items():
        n = max(3, min(2000, (1 << 22) // len(body)))

        def per_call(fn, body=body, n=n):
            start = time.perf_counter()
            for _ in range(n):
                fn(body)
            return 1e6 * (time.perf_counter() - start) / n

        runs = [(per_call(old), per_call(parse_body), per_call(json_depth)) for _ in range(repeats)]
        rows[name] = {
            "bytes": len(body),
            "old_us": statistics.median(r[0] for r in runs),
            "new_us": statistics.median(r[1] for r in runs),
            "scan_us": statistics.median(r[2] for r in runs),
        }
        r = rows[name]
        print(
            f"{name}: {r['bytes']} bytes, before {r['old_us']:.1f} us, parse_body (scan + parse) "
            f"{r['new_us']:.1f} us (+{100 * (r['new_us'] / r['old_us'] - 1):.0f}%), the scan alone "
            f"{r['scan_us']:.1f} us",
            flush=True,
        )
    return rows


def main() -> None:
    from flash.envs.gateway import Gateway

    p = argparse.ArgumentParser()
    p.add_argument("--calls", type=int, default=200)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--max-tokens", type=int, default=16)
    p.add_argument("--concurrency", default="1,8")
    p.add_argument("--parse", action="store_true", help="only the body parse: old (json.loads) vs the depth-bounded")
    args = p.parse_args()
    if args.parse:
        print(json.dumps({"repeats": args.repeats, "parse": parse_costs(args.repeats)}))
        return
    tok, generate, direct = build(args.max_tokens)
    rows = {}
    with Gateway(tok, generate, max_tokens_cap=args.max_tokens, stop_token_ids=[-1], workers=16) as gw:
        for c in (int(x) for x in args.concurrency.split(",")):
            runs = [
                (via_direct(direct, args.calls, c), *asyncio.run(via_gateway(gw, args.calls, c, args.max_tokens)))
                for _ in range(args.repeats)
            ]
            rows[c] = {
                "direct_ms": 1000 * statistics.median(d for d, _, _ in runs),
                "gateway_ms": 1000 * statistics.median(g for _, g, _ in runs),
                "ratio": statistics.median(g / d for d, g, _ in runs),
                "client_ms": 1000 * statistics.median(m for _, _, m in runs),
            }
            print(
                f"concurrency {c}: direct {rows[c]['direct_ms']:.1f} ms/call, gateway {rows[c]['gateway_ms']:.1f} "
                f"ms/call, ratio {rows[c]['ratio']:.2f} (making a client: {rows[c]['client_ms']:.1f} ms)",
                flush=True,
            )
    print(
        json.dumps(
            {"calls": args.calls, "repeats": args.repeats, "max_tokens": args.max_tokens, "by_concurrency": rows}
        )
    )


if __name__ == "__main__":
    main()
