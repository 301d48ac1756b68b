"""``judge``: an LLM judge served by a flash engine, as a reward.

    reward:
      fn: {name: judge, template: "...{prompt}...{response}...", pattern: "(yes|no)",
           scores: {"yes": 1.0, "no": 0.0}, max_concurrent: 4, timeout_s: 20}

Each reward worker that builds this scorer loads the judge model (``model``: a checkpoint
directory; unset in a recipe, the runner fills in the policy's *initial* checkpoint, so the judge
never drifts with the policy) into the embedded torch engine (``flash.engine.torch_engine``,
continuous batching) driven by its ``EngineLoop``: concurrent reward calls share decode steps.
At most ``max_concurrent`` verdicts are generated at once (a semaphore; the rest wait).

A call fills ``template`` with ``{prompt}``, ``{response}`` and ``{answer}`` (the item's prompt,
the policy's response, the reference answer), encodes it as the policy's prompts are encoded
(``flash.models.encode_prompt``: the chat template of a pretrained judge), generates up to
``max_new_tokens`` at ``temperature`` (0 = greedy, deterministic) and parses the verdict: the first
match of ``pattern`` (a regex, case-insensitive) in the decoded text; its first group is looked up
in ``scores`` (lower-cased) or, with ``scores`` empty, read as a number and multiplied by ``scale``
(e.g. ``pattern: "score: (\\d+)"``, ``scale: 0.1``).

Failure is an outcome: no verdict within ``timeout_s`` (the request is aborted), an
engine error, or text that does not parse all score 0.0 with a named reason
(``judge:timeout``, ``judge:error``, ``judge:unparseable``); the reward pool counts each as
``reward/failures/<reason>``, and ``metrics()`` adds the judge's own counters.
"""

from __future__ import annotations

import itertools
import re
import string
import threading
import time
from collections import Counter

from flash.engine.base import GenerationOutput, GenerationRequest, SamplingParams
from flash.rewards.registry import register_reward

DEFAULT_TEMPLATE = (
    "question: {prompt} reference answer: {answer} response: {response} "
    "is the response correct? answer yes or no. verdict:"
)
FIELDS = ("prompt", "response", "answer")


def check_template(template: str) -> None:
    """ValueError for a field other than {prompt}, {response}, {answer} (or a bad brace)."""
    try:
        names = {f for _, f, _, _ in string.Formatter().parse(template) if f is not None}
    except ValueError as exc:
        raise ValueError(f"judge template: {exc}") from None
    unknown = sorted(names - set(FIELDS))
    if unknown:
        raise ValueError(f"judge template has unknown fields {unknown}; valid: {list(FIELDS)}")


def parse_verdict(text: str, pattern: re.Pattern, scores: dict[str, float] | None, scale: float) -> float | None:
    """The reward the judge's ``text`` gives, or None when it does not parse."""
    m = pattern.search(text)
    if m is None:
        return None
    token = (m.group(1) if m.groups() else m.group(0)).strip().lower()
    if scores:
        return scores.get(token)
    try:
        return float(token) * scale
    except ValueError:
        return None


class JudgeServer:
    """A judge model in a TorchEngine behind an EngineLoop; ``ask`` is thread-safe and blocking."""

    def __init__(
        self, model_path: str, max_concurrent: int, seed: int = 0, threads: int = 1, max_num_seqs: int = 16
    ) -> None:
        import torch
        from transformers import AutoModelForCausalLM, AutoTokenizer

        from flash.engine.loop import EngineLoop
        from flash.engine.torch_engine import TorchEngine

        if threads:
            torch.set_num_threads(threads)
        self.tokenizer = AutoTokenizer.from_pretrained(model_path)
        model = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32)
        self.loop = EngineLoop(TorchEngine(model, max_num_seqs=max_num_seqs, seed=seed))
        self._slots = threading.BoundedSemaphore(max_concurrent)
        self._cv = threading.Condition()
        self._done: dict[str, GenerationOutput] = {}
        self._ids = itertools.count()
        self.inflight = self.max_inflight = 0
        threading.Thread(target=self._collect, daemon=True, name="judge-collect").start()

    def _collect(self) -> None:
        """Hand each finished output to the call waiting for it."""
        while True:
            try:
                outs = self.loop.get_finished(timeout=1.0)
            except Exception:  # noqa: BLE001 - the loop died or shut down; callers time out
                return
            if outs:
                with self._cv:
                    self._done.update((o.request_id, o) for o in outs)
                    self._cv.notify_all()

    def ask(self, prompt_ids: list[int], params: SamplingParams, timeout_s: float) -> GenerationOutput | None:
        """The judge's output, or None when it is not done within ``timeout_s`` (then aborted).
        The wait for a free slot counts against the deadline."""
        deadline = time.monotonic() + timeout_s
        if not self._slots.acquire(timeout=timeout_s):
            return None
        rid = f"judge-{next(self._ids)}"
        try:
            with self._cv:
                self.inflight += 1
                self.max_inflight = max(self.max_inflight, self.inflight)
            self.loop.submit([GenerationRequest(rid, prompt_ids, params)])
            with self._cv:
                self._cv.wait_for(lambda: rid in self._done, max(0.0, deadline - time.monotonic()))
                out = self._done.pop(rid, None)
            if out is None:
                self.loop.abort([rid])
                with self._cv:
                    self._done.pop(rid, None)
            return out
        finally:
            with self._cv:
                self.inflight -= 1
            self._slots.release()

    def close(self) -> None:
        self.loop.shutdown()


class JudgeReward:
    """Scorer for ``reward.fn.name: judge`` (see the module docstring)."""

    def __init__(
        self,
        model: str,
        template: str,
        pattern: str,
        scores: dict | None,
        scale: float,
        max_concurrent: int,
        timeout_s: float,
        max_new_tokens: int,
        temperature: float,
        threads: int,
        seed: int,
    ) -> None:
        self.server = JudgeServer(model, max_concurrent, seed=seed, threads=threads)
        self.template, self.scale, self.timeout_s = template, scale, timeout_s
        self.pattern = re.compile(pattern, re.IGNORECASE)
        self.scores = {str(k).lower(): float(v) for k, v in scores.items()} if scores else None
        tok = self.server.tokenizer
        self.params = SamplingParams(
            max_new_tokens=max_new_tokens, temperature=temperature, stop_token_ids=[tok.eos_token_id], seed=seed
        )
        self.counters: Counter[str] = Counter()
        self._lock = threading.Lock()

    def __call__(self, item, response: str):
        from flash.models import decode_response, encode_prompt

        t0 = time.monotonic()
        text = self.template.format(prompt=item.prompt, response=response, answer=item.answer)
        try:
            out = self.server.ask(encode_prompt(self.server.tokenizer, text), self.params, self.timeout_s)
        except Exception as exc:  # noqa: BLE001 - an engine failure is a named outcome
            return self._result(0.0, f"judge:error:{type(exc).__name__}", t0)
        if out is None:
            return self._result(0.0, "judge:timeout", t0)
        if out.finish_reason == "error":
            return self._result(0.0, "judge:error", t0)
        verdict = parse_verdict(
            decode_response(self.server.tokenizer, out.token_ids), self.pattern, self.scores, self.scale
        )
        if verdict is None:
            return self._result(0.0, "judge:unparseable", t0)
        return self._result(verdict, "ok", t0)

    def _result(self, reward: float, reason: str, t0: float):
        from flash.rewards.workers import RewardResult

        with self._lock:
            self.counters["calls"] += 1
            if reason != "ok":
                self.counters[reason.replace(":", "/")] += 1
        return RewardResult(reward, reason, time.monotonic() - t0)

    def metrics(self) -> dict[str, float]:
        with self._lock:
            out = {f"judge/{k}": float(v) for k, v in self.counters.items()}
        out["judge/max_inflight"] = float(self.server.max_inflight)
        return out


@register_reward("judge", builder=True)
def judge_reward(
    model: str | None = None,
    template: str = DEFAULT_TEMPLATE,
    pattern: str = r"\b(yes|no)\b",
    scores: dict | None = None,
    scale: float = 1.0,
    max_concurrent: int = 4,
    timeout_s: float = 20.0,
    max_new_tokens: int = 8,
    temperature: float = 0.0,
    threads: int = 1,
    seed: int = 0,
) -> JudgeReward:
    """Knobs: ``model`` (judge checkpoint dir; default in a run: the policy's initial checkpoint),
    ``template``, ``pattern`` + ``scores`` (default ``yes`` → 1, ``no`` → 0) or ``scale``,
    ``max_concurrent`` verdicts at once, ``timeout_s`` per verdict, sampling, torch ``threads``."""
    check_judge_knobs(model, template, pattern, max_concurrent, timeout_s, max_new_tokens, temperature)
    if scores is None and pattern == r"\b(yes|no)\b":
        scores = {"yes": 1.0, "no": 0.0}
    return JudgeReward(
        model, template, pattern, scores, scale, max_concurrent, timeout_s, max_new_tokens, temperature, threads, seed
    )


def check_section(section: dict) -> None:
    """The judge's knob values, checked in the driver before any worker starts (``model`` may be
    unset there: the run fills in the policy's initial checkpoint)."""
    import inspect

    knobs = {k: v for k, v in section.items() if k != "name"}
    bound = inspect.signature(judge_reward).bind(**knobs)
    bound.apply_defaults()
    a = bound.arguments
    check_judge_knobs(
        a["model"] or "<policy>",
        a["template"],
        a["pattern"],
        a["max_concurrent"],
        a["timeout_s"],
        a["max_new_tokens"],
        a["temperature"],
    )


def with_default_model(section: dict, model_path: str) -> dict:
    """``section`` with ``model`` set to ``model_path`` when it is a judge without one."""
    if section.get("name") == "judge" and not section.get("model"):
        return {**section, "model": model_path}
    return dict(section)


def check_judge_knobs(model, template, pattern, max_concurrent, timeout_s, max_new_tokens, temperature) -> None:
    """ValueError naming the first bad knob (the pool reports it as a config error)."""
    if not model:
        raise ValueError(
            "judge reward needs 'model' (a checkpoint directory); in a run it defaults "
            "to the policy's initial checkpoint"
        )
    check_template(template)
    try:
        re.compile(pattern)
    except re.error as exc:
        raise ValueError(f"judge pattern {pattern!r} is not a valid regex: {exc}") from None
    if max_concurrent < 1 or max_new_tokens < 1:
        raise ValueError("judge needs max_concurrent >= 1 and max_new_tokens >= 1")
    if not timeout_s > 0 or temperature < 0:
        raise ValueError("judge needs timeout_s > 0 and temperature >= 0")
