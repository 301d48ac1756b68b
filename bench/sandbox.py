"""Code sandbox vs a bare subprocess: per-call latency and calls per second, same programs.

    python -m bench.sandbox [--calls 40] [--repeats 5] [--threads 4]
    python -m bench.sandbox --paired-zygote OTHER/_zygote.py [--calls 150]

The *bare* side runs each program as ``python -S -c PROGRAM`` (the sandbox's interpreter, no
isolation, no limits) with ``subprocess.run``; the *sandbox* side is ``flash.rewards.sandbox.
execute`` at the best level this host gives (its fork server is started before timing). Each
repeat times ``--calls`` calls of every program on both sides back to back, alternating which goes
first; then both again from ``--threads`` threads at once (calls per second). Reports medians over
the repeats and the ratios sandbox/bare (latency; lower is better) and bare/sandbox (throughput).
The last line is JSON; ``sandbox_vs_bare`` is the median latency ratio over the programs.

``--paired-zygote``: a small per-call change seen through a loaded machine. Two fork servers in
this process, this tree's and one running another version of ``_zygote.py`` (e.g. the previous
commit's, from ``git show REV:flash/rewards/_zygote.py``), the same parent-side code; one call on
each in turn, ``--calls`` pairs per program. Reports medians and the median per-pair ratio
this / other.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from flash.rewards import sandbox

PROGRAMS = {  # name -> (source, stdin, expected stdout)
    "print": ("print(1)", "", "1\n"),
    "stdin_sum": ("import sys\nprint(sum(int(x) for x in sys.stdin.read().split()))", "1 2 3 4\n", "10\n"),
    "json_re": ("import json, re\nprint(json.dumps(re.findall(r'\\d+', 'a1b22c333')))", "", '["1", "22", "333"]\n'),
    "loop_1e5": ("print(sum(i * i for i in range(100000)))", "", f"{sum(i * i for i in range(100000))}\n"),
}


def _bare(source: str, stdin: str) -> str:
    return subprocess.run(
        [sandbox.sandbox_python(), "-S", "-c", source], input=stdin, capture_output=True, text=True, timeout=30
    ).stdout


def _boxed(source: str, stdin: str) -> str:
    res = sandbox.execute(source, stdin=stdin, timeout_s=30)
    if res.status != "ok":
        raise RuntimeError(f"sandbox run failed: {res.status} {res.stderr[-300:]}")
    return res.stdout


def _per_call(fn, source: str, stdin: str, want: str, calls: int) -> float:
    t0 = time.perf_counter()
    for _ in range(calls):
        if fn(source, stdin) != want:
            raise RuntimeError(f"{fn.__name__} gave a wrong answer")
    return (time.perf_counter() - t0) / calls


def _rate(fn, calls: int, threads: int) -> float:
    jobs = [PROGRAMS[name] for name in PROGRAMS for _ in range(calls // len(PROGRAMS) or 1)]
    t0 = time.perf_counter()
    with ThreadPoolExecutor(threads) as pool:
        outs = list(pool.map(lambda job: fn(job[0], job[1]), jobs))
    if outs != [job[2] for job in jobs]:
        raise RuntimeError(f"{fn.__name__} gave a wrong answer under concurrency")
    return len(jobs) / (time.perf_counter() - t0)


def _paired(zygote: str, pairs: int) -> dict:
    """This tree's fork server against one running ``zygote``, one call each in turn."""
    from flash.rewards import forkserver

    python, drop = sandbox.sandbox_python(), sandbox._drop_to()
    own_source, route = forkserver._zygote_source, sandbox.server
    servers = {"this": forkserver.ForkServer(python, drop)}
    try:
        forkserver._zygote_source = lambda: Path(zygote).read_text()
        servers["other"] = forkserver.ForkServer(python, drop)
    finally:
        forkserver._zygote_source = own_source
    out = {}
    try:
        for name, (src, stdin, want) in PROGRAMS.items():
            t: dict[str, list[float]] = {"this": [], "other": []}
            for i in range(pairs):
                for side in ("this", "other") if i % 2 == 0 else ("other", "this"):
                    sandbox.server = lambda *_, srv=servers[side]: srv
                    t[side].append(_per_call(_boxed, src, stdin, want, 1))
            out[name] = {
                "this_ms": round(statistics.median(t["this"]) * 1e3, 2),
                "other_ms": round(statistics.median(t["other"]) * 1e3, 2),
                "paired": round(statistics.median(a / b for a, b in zip(t["this"], t["other"])), 3),
            }
            print(
                f"  {name:10s} this {out[name]['this_ms']:6.2f}  other {out[name]['other_ms']:6.2f}  "
                f"paired {out[name]['paired']:.3f}x"
            )
    finally:
        sandbox.server = route
        for srv in servers.values():
            srv.close()
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--calls", type=int, default=40)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--threads", type=int, default=4)
    ap.add_argument("--paired-zygote", help="another _zygote.py to compare with, call for call")
    args = ap.parse_args()
    if args.paired_zygote:
        print(json.dumps({"paired_this_vs_other": _paired(args.paired_zygote, args.calls)}))
        return
    level = sandbox.isolation_level()  # starts the fork server outside the timing
    lat: dict[str, dict[str, list[float]]] = {n: {"bare": [], "sandbox": []} for n in PROGRAMS}
    rates: dict[str, list[float]] = {"bare": [], "sandbox": []}
    for rep in range(args.repeats):
        sides = [("bare", _bare), ("sandbox", _boxed)]
        for side, fn in sides if rep % 2 == 0 else sides[::-1]:
            for name, (src, stdin, want) in PROGRAMS.items():
                lat[name][side].append(_per_call(fn, src, stdin, want, args.calls))
            rates[side].append(_rate(fn, args.calls * len(PROGRAMS), args.threads))
    ratios = {}
    print(f"isolation: {level}; {args.repeats} repeats x {args.calls} calls per program; medians (ms per call)")
    for name, sides in lat.items():
        bare, boxed = statistics.median(sides["bare"]), statistics.median(sides["sandbox"])
        ratios[name] = statistics.median(s / b for s, b in zip(sides["sandbox"], sides["bare"]))
        print(f"  {name:10s} bare {bare * 1e3:6.2f}  sandbox {boxed * 1e3:6.2f}  ratio {ratios[name]:.2f}x")
    rate_bare, rate_box = statistics.median(rates["bare"]), statistics.median(rates["sandbox"])
    print(f"  {args.threads} threads: bare {rate_bare:.0f} calls/s, sandbox {rate_box:.0f} calls/s")
    print(
        json.dumps(
            {
                "isolation": level,
                "sandbox_vs_bare": round(statistics.median(ratios.values()), 3),
                "latency_ratio": {k: round(v, 3) for k, v in ratios.items()},
                "ms_per_call": {
                    k: {s: round(statistics.median(v) * 1e3, 2) for s, v in sides.items()} for k, sides in lat.items()
                },
                "calls_per_s": {"bare": round(rate_bare, 1), "sandbox": round(rate_box, 1), "threads": args.threads},
            }
        )
    )


if __name__ == "__main__":
    main()
