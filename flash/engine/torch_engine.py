"""The embedded rollout engine: continuous batching over a Hugging Face causal LM (CPU or GPU).

How it works
- A sequence is prompt + response so far. All of its tokens but the last are in the KV cache; the
  last one is *pending*. One decode step feeds every running sequence's pending token in one
  batched forward pass and samples one new token per sequence, so a step costs one token of compute
  per sequence, never a recompute of the whole sequence.
- Admission prefills the newcomers' ``(prompt + partial response)[:-1]`` as left-padded batches
  of at most ``max_num_batched_tokens`` tokens (rows x longest; whole sequences, one longer than
  the budget alone) straight into free rows of the running batch; a finished or aborted row leaves at once, so a
  request added mid-decode joins at the next step and a freed slot is refilled at the next step.
- The running batch is one left-padded KV cache (``flash.engine.kv_cache.KVBatch``): per layer, K/V buffers
  ``[rows, kv_heads, capacity, head_dim]`` sized to the sequences running (at most ``max_num_seqs``
  rows; the columns their prompts and new tokens can need), so a decode step writes its
  column in place instead of re-concatenating the cache (as ``DynamicCache`` would), plus a 2D
  attention mask (0 = padding) and explicit per-row position ids. A leaving row is swap-removed
  (only the moved row is copied) and the window skips columns that are padding in every row, so
  attention spans the longest live sequence. Buffers are reallocated only to grow.
- Sampling is seeded per request (``flash.engine.sampling``): each request owns a CPU
  ``torch.Generator`` and draws one uniform per sampled token, so its tokens do not depend on its
  batch mates.
- One host read per decode step, of the sampled tokens and logprobs together: the next inputs stay
  on the device, the window and whether it holds padding are known on the host (``KVBatch.lens``),
  the sampling tensors go up once per batch composition, and the attention mask is handed to the
  model ready-made, so transformers never reads it.
- A weight update invalidates the KV cache. Running sequences go back to the head of the waiting
  queue *with* their partial responses and generator state and are re-prefilled under the new
  weights (interrupt mode ``continue``); ``restart`` and ``wait`` are handled by ``preempt``.

Not threaded: ``flash.engine.loop.EngineLoop`` drives ``step`` from a background thread.
"""

from __future__ import annotations

import hashlib
from collections import deque
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field

import torch
from transformers.masking_utils import create_causal_mask

from flash.algos.registry import did_you_mean
from flash.devices import release_cached_memory
from flash.engine.base import INTERRUPT_MODES, GenerationOutput, GenerationRequest
from flash.engine.kv_cache import KVBatch
from flash.engine.sampling import SamplingPlan, sample, upload


def derive_seed(engine_seed: int, request_id: str) -> int:
    """A stable 63-bit seed from (engine seed, request id); Python's ``hash`` is salted per process."""
    digest = hashlib.sha256(f"{engine_seed}:{request_id}".encode()).digest()
    return int.from_bytes(digest[:8], "little") & (2**63 - 1)


@dataclass(eq=False)
class _Seq:
    """A request in flight: its response so far and its own random generator."""

    req: GenerationRequest
    seed: int
    gen: torch.Generator
    arrival: int  # order of add_request: requeued requests keep their place in the FIFO
    tokens: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    versions: list[int] = field(default_factory=list)

    @property
    def context(self) -> list[int]:
        return self.req.prompt_ids + self.tokens

    @property
    def pending(self) -> int:
        """The last token: not yet in the KV cache, fed by the next decode step."""
        return self.tokens[-1] if self.tokens else self.req.prompt_ids[-1]

    def reset(self) -> None:
        """Drop the response and rewind the generator, so the request regenerates identically."""
        self.tokens, self.logprobs, self.versions = [], [], []
        self.gen.manual_seed(self.seed)

    def finish_reason(self) -> str | None:
        p = self.req.params
        if self.tokens and self.tokens[-1] in p.stop_token_ids:
            return "stop"
        return "length" if len(self.tokens) >= p.max_new_tokens else None

    def output(self, reason: str) -> GenerationOutput:
        r = self.req
        return GenerationOutput(
            r.request_id, list(r.prompt_ids), list(self.tokens), list(self.logprobs), list(self.versions), reason
        )


def prefill_chunks(lengths: list[int], budget: int) -> list[tuple[int, int]]:
    """Consecutive ranges ``[lo, hi)`` of ``lengths`` whose left-padded batch (rows x longest)
    holds at most ``budget`` tokens, in order; a length above the budget forms a range alone.
    ``budget`` 0: no budget, one range of them all."""
    if budget == 0:
        return [(0, len(lengths))]
    chunks, lo, width = [], 0, 0
    for i, n in enumerate(lengths):
        grown = max(width, n)
        if i > lo and (i - lo + 1) * grown > budget:
            chunks.append((lo, i))
            lo, grown = i, n
        width = grown
    chunks.append((lo, len(lengths)))
    return chunks


def alias_groups(model) -> dict[str, tuple[str, ...]]:
    """Each state-dict name of ``model`` -> every name of the same tensor object, in order (a
    tied LM head and its embedding share one; a push loads it under one name only)."""
    groups: dict[int, list[str]] = {}
    for name, t in model.state_dict(keep_vars=True).items():
        groups.setdefault(id(t), []).append(name)
    return {name: tuple(names) for names in groups.values() for name in names}


class BatchState:
    """What ``EngineLoop`` reads of a batcher's state (the torch engine, the simulated one): the
    weights' version, whether it sleeps, and its running and waiting queues."""

    _version: int
    _asleep: object
    _running: list
    _waiting: deque

    @property
    def version(self) -> int:
        return self._version

    @property
    def asleep(self) -> bool:
        return self._asleep is not None

    @property
    def num_running(self) -> int:
        return len(self._running)

    @property
    def num_waiting(self) -> int:
        return len(self._waiting)


class TorchEngine(BatchState):
    """Single-threaded continuous-batching engine; see the module docstring for the design."""

    def __init__(
        self, model, *, max_num_seqs: int = 64, version: int = 0, seed: int = 0, max_num_batched_tokens: int = 0
    ):
        if max_num_seqs < 1 or max_num_batched_tokens < 0:
            raise ValueError("max_num_seqs must be >= 1 and max_num_batched_tokens >= 0 (0: no budget)")
        self.model = model.eval()
        self.max_num_seqs, self.seed, self._version = max_num_seqs, seed, version
        self.max_num_batched_tokens = max_num_batched_tokens  # prefill budget: rows x width per forward
        self._num_layers = model.config.get_text_config(decoder=True).num_hidden_layers
        self._device = next(model.parameters()).device
        self._dtype = next(model.parameters()).dtype
        text = model.config.get_text_config(decoder=True)
        self._full_attention = set(getattr(text, "layer_types", None) or ["full_attention"]) == {"full_attention"}
        self._sampling: tuple[tuple[_Seq, ...], SamplingPlan] | None = None
        self._shapes = {name: tuple(t.shape) for name, t in model.state_dict().items()}
        self._aliases = alias_groups(model)  # a tied LM head: one tensor, two names
        self._waiting: deque[_Seq] = deque()
        self._running: list[_Seq] = []
        self._kv: KVBatch | None = None
        self._ids: set[str] = set()
        self.admitting = True  # False after preempt("wait") until resume()
        self._asleep: dict | None = None  # what sleep() released, until wake_up()
        self._missing: set[str] = set()  # weights a level-2 sleep discarded, not yet pushed again
        self.tokens_generated = 0
        self.decode_steps = 0  # batched decode iterations (flash.app.plan fits time per iteration)
        self._arrivals = 0

    def has_unfinished(self) -> bool:
        return bool(self._running or self._waiting)

    @property
    def can_step(self) -> bool:
        """Whether ``step`` would make progress (False when only waiting and admission is off)."""
        return bool(self._running or (self.admitting and self._waiting))

    # ---- requests ----------------------------------------------------------------------------
    def add_request(self, req: GenerationRequest) -> None:
        p = req.params
        if not req.prompt_ids:
            raise ValueError(f"request {req.request_id!r}: empty prompt")
        if p.temperature < 0 or not 0.0 < p.top_p <= 1.0:
            raise ValueError(f"request {req.request_id!r}: need temperature >= 0 and 0 < top_p <= 1")
        if req.request_id in self._ids:
            raise ValueError(f"request {req.request_id!r} is already in the engine")
        seed = p.seed if p.seed is not None else derive_seed(self.seed, req.request_id)
        self._ids.add(req.request_id)
        self._arrivals += 1
        self._waiting.append(_Seq(req, seed, torch.Generator().manual_seed(seed), self._arrivals))

    @torch.inference_mode()
    def step(self) -> list[GenerationOutput]:
        """Admit waiting requests into free slots (prefilling them), then one batched decode step.

        Returns the requests that finished in this step.
        """
        finished = self._admit() if self.admitting else []
        if self._running:
            finished += self._decode()
        return finished

    @torch.inference_mode()
    def abort(self, request_ids: list[str] | None = None) -> list[GenerationOutput]:
        """Remove requests (None = all), running or waiting; returns their partial outputs.

        Unknown ids are ignored (the request may have finished already). Aborted requests are
        reported only here, never again by ``step``.
        """
        hit = (lambda s: True) if request_ids is None else (lambda s, ids=set(request_ids): s.req.request_id in ids)
        keep = [i for i, s in enumerate(self._running) if not hit(s)]
        outs = [s.output("abort") for s in self._running if hit(s)]
        outs += [s.output("abort") for s in self._waiting if hit(s)]
        self._waiting = deque(s for s in self._waiting if not hit(s))
        if len(keep) < len(self._running):
            self._retain(keep)
        self._ids -= {o.request_id for o in outs}
        return outs

    def generate(self, requests: list[GenerationRequest]) -> list[GenerationOutput]:
        """Run ``requests`` to completion on an idle engine; outputs in request order.

        Requires an idle engine so that no other request's output is swallowed.
        """
        if self.has_unfinished():
            raise RuntimeError("generate() needs an idle engine; use add_request/step instead")
        for r in requests:
            self.add_request(r)
        done: dict[str, GenerationOutput] = {}
        while self.has_unfinished():
            if not self.can_step:
                raise RuntimeError("admission is paused (preempt('wait')); call resume() first")
            done.update((o.request_id, o) for o in self.step())
        return [done[r.request_id] for r in requests]

    # ---- interruption and weights ------------------------------------------------------------
    def preempt(self, mode: str) -> None:
        """Apply an interrupt mode (``base.INTERRUPT_MODES``) at a step boundary.

        - ``continue``: nothing to do now; ``update_weights`` invalidates the KV cache and requeues
          running requests with their partial responses (a pause without an update keeps the cache).
        - ``restart``: running requests go back to the head of the queue, and every request with a
          partial response drops it and rewinds its generator to its seed.
        - ``wait``: stop admitting; running requests drain through ``step``.
        """
        if mode not in INTERRUPT_MODES:
            raise ValueError(f"unknown interrupt mode {mode!r}; expected one of {INTERRUPT_MODES}")
        if mode == "restart":
            self._requeue_running()
            for s in self._waiting:
                s.reset()
        elif mode == "wait":
            self.admitting = False

    def resume(self) -> None:
        """Re-open admission after ``preempt``; refused while asleep or missing weights."""
        if self._asleep is not None:
            raise RuntimeError("the engine is asleep; call wake_up() before resume()")
        if self._missing:
            raise RuntimeError(
                f"a level-2 sleep discarded the weights; push all of them before resume() "
                f"({len(self._missing)} missing, e.g. {sorted(self._missing)[0]!r})"
            )
        self.admitting = True

    def sleep(self, level: int = 1) -> dict:
        """Release memory for a colocated trainer (docs/design.md: overlapping device mappings).

        Level 1 drops the KV cache (running requests are requeued with their partial responses,
        as after a weight update) and moves the weights to host memory when they live on an
        accelerator; level 2 discards the weights too (their shapes are kept), so the next
        ``update_weights`` must bring every tensor before ``resume``. On CPU the weights already
        are in host memory: level 1 releases the KV cache only. On CUDA the freed blocks go back
        to the driver (``release_cached_memory``), where the colocated trainer can take them. The
        KV cache comes back at the first step after ``resume`` (after the push, which needs the
        weights only). Returns what was released.
        """
        if level not in (1, 2):
            raise ValueError(f"sleep level must be 1 or 2, got {level}")
        if self._asleep is not None:
            return self._asleep
        kv = (
            0
            if self._kv is None
            else sum(
                t.numel() * t.element_size()
                for layer in self._kv.layers
                for t in (layer.k_buf, layer.v_buf)
                if t is not None
            )
        )
        self._requeue_running()
        weights = "kept"
        if level == 2:
            for t in {id(t): t for t in self.model.state_dict(keep_vars=True).values()}.values():
                t.data = torch.empty(0, dtype=t.dtype, device=t.device)
            self._missing.update(self._shapes)
            weights = "discarded"
        elif self._device.type != "cpu":
            self.model.to("cpu")
            weights = "offloaded"
        cache = release_cached_memory(self._device)
        self._asleep = {
            "level": level,
            "kv_bytes_released": kv,
            "weights": weights,
            "device": str(self._device),
            "cache_released": cache,
        }
        return self._asleep

    def wake_up(self) -> dict:
        """Undo ``sleep``: weights back on the device (or re-allocated, to be pushed, after level 2)."""
        info, self._asleep = self._asleep, None
        if info is None:
            return {"level": 0}
        if info["weights"] == "offloaded":
            self.model.to(self._device)
        elif info["weights"] == "discarded":
            for name, t in self.model.state_dict(keep_vars=True).items():
                if name in self._missing and name == self._aliases[name][0]:  # a tied tensor once
                    t.data = torch.empty(self._shapes[name], dtype=t.dtype, device=self._device)
        return info

    @torch.no_grad()
    def update_weights(
        self, named_tensors: Mapping[str, torch.Tensor] | Iterable[tuple[str, torch.Tensor]], version: int
    ) -> None:
        """Copy tensors into the model's parameters/buffers in place (names as in ``state_dict``).

        A partial set is fine (bucketed pushes). An unknown name or a shape mismatch raises before
        ``version`` changes; tensors copied before the bad one stay copied. The KV cache was made by
        the old weights, so running requests are requeued (head of the queue, partial responses
        kept) and re-prefilled at their next admission.
        """
        if self._asleep is not None:
            raise RuntimeError("the engine is asleep; call wake_up() before update_weights()")
        items = named_tensors.items() if isinstance(named_tensors, Mapping) else named_tensors
        state = self.model.state_dict()
        for name, tensor in items:
            if name not in state:
                raise KeyError(f"unknown parameter {name!r}{did_you_mean(name, state, n=1)}")
            if tuple(self._shapes[name]) != tuple(tensor.shape):
                raise ValueError(f"{name}: shape {tuple(tensor.shape)} != model's {tuple(self._shapes[name])}")
            state[name].copy_(tensor)
            self._missing.difference_update(self._aliases[name])  # its aliases hold it too
        self._requeue_running()
        self._version = version

    # ---- internals ---------------------------------------------------------------------------
    def _requeue_running(self) -> None:
        """Running requests back to the head of the queue, in arrival order; the KV cache is dropped."""
        self._waiting.extendleft(sorted(self._running, key=lambda s: s.arrival, reverse=True))
        self._running, self._kv = [], None

    def _retain(self, rows: list[int]) -> None:
        """Keep only these running rows; the others leave the batch (their slots free at once)."""
        kept = set(rows)
        order = self._kv.remove([i for i in range(len(self._running)) if i not in kept])
        self._running = [self._running[i] for i in order]
        if not self._running:
            self._kv = None  # free the buffers while idle (e.g. during a weight sync)

    def _admit(self) -> list[GenerationOutput]:
        finished, new = [], []
        while self._waiting and len(self._running) + len(new) < self.max_num_seqs:
            s = self._waiting.popleft()
            if s.req.params.max_new_tokens <= 0:
                finished.append(s.output("length"))
                self._ids.discard(s.req.request_id)
            else:
                new.append(s)
        if new:
            rest = max(s.req.params.max_new_tokens - len(s.tokens) for s in new)
            for lo, hi in prefill_chunks([len(s.context) - 1 for s in new], self.max_num_batched_tokens):
                self._prefill([s.context[:-1] for s in new[lo:hi]], [s.pending for s in new[lo:hi]], rest)
            self._running += new
        return finished

    def _rest(self) -> int:
        """The most tokens a running sequence may still take into the KV cache."""
        return max((s.req.params.max_new_tokens - len(s.tokens) for s in self._running), default=0)

    def _prefill(self, prefixes: list[list[int]], pending: list[int], rest: int) -> None:
        """Write the KV of the left-padded ``prefixes`` (all tokens but each pending one) into free
        rows; ``pending``: each row's next input token; ``rest``: the most tokens they may take."""
        width = max(len(p) for p in prefixes)
        if self._kv is None:
            self._kv = KVBatch(self.max_num_seqs, self._num_layers, self._device)
        kv = self._kv
        kv.reserve(left=width, right=1, rows=kv.n + len(prefixes), rest=max(rest, self._rest()))
        r0, r1, c0 = kv.n, kv.n + len(prefixes), kv.end - width
        lens = [len(p) for p in prefixes]
        kv.pos[r0:r1] = upload(torch.tensor(lens), self._device)
        kv.pending[r0:r1] = upload(torch.tensor(pending), self._device)
        kv.mask[r0:r1] = 0
        if width:
            ids = upload(torch.tensor([[0] * (width - len(p)) + p for p in prefixes]), self._device)
            kv.mask[r0:r1, c0 : kv.end] = upload(
                torch.tensor([[0] * (width - n) + [1] * n for n in lens]), self._device
            )
            mask = kv.mask[r0:r1, c0 : kv.end]
            kv.set_window(r0, r1, c0, c0)
            attn = self._attention_mask(mask, ids.shape, padded=min(lens) < width)
            self.model(
                input_ids=ids,
                attention_mask=attn,
                position_ids=(mask.cumsum(-1) - 1).clamp(min=0),
                past_key_values=kv.cache,
                use_cache=True,
                logits_to_keep=1,
            )
            pad = (mask == 0)[:, None, :, None]
            for layer in kv.layers:  # padding rows attended to nothing: keep their K/V clean zeros
                layer.keys.masked_fill_(pad, 0.0)
                layer.values.masked_fill_(pad, 0.0)
        kv.n = r1
        kv.lens += lens
        kv.set_live()

    def _attention_mask(self, mask: torch.Tensor, shape: torch.Size, padded: bool):
        """The attention mask of a forward over ``mask`` (2D, the cache's window and the new
        columns), made without reading it: none without padding (what transformers picks after
        reading that the mask is all ones), else transformers' own 4D causal-and-padding mask,
        built from the cache as the forward will see it. Models with other than full-attention
        layers get the 2D mask (transformers builds and reads their masks)."""
        if not padded:
            return None
        if not self._full_attention:
            return mask
        embeds = torch.empty(*shape, 0, dtype=self._dtype, device=self._device)
        return create_causal_mask(
            config=self.model.config,
            inputs_embeds=embeds,
            attention_mask=mask,
            past_key_values=self._kv.cache,
            allow_is_causal_skip=False,
        )

    def _plan(self) -> SamplingPlan:
        """The running batch's ``SamplingPlan``, made again only when the batch changed."""
        key = tuple(self._running)  # the sequences themselves (compared by identity)
        if self._sampling is None or self._sampling[0] != key:
            self._sampling = (key, SamplingPlan.of(self._running, self._device))
        return self._sampling[1]

    def _decode(self) -> list[GenerationOutput]:
        """One token for every running sequence; drops the finished ones from the batch. Inputs,
        positions and the window stay on the device or are known on the host: the one host read
        is of the sampled tokens and their logprobs, together."""
        kv = self._kv
        kv.reserve(right=1, rest=self._rest())
        n, start, end = kv.n, kv.start, kv.end
        kv.mask[:n, end] = 1
        mask, ids = kv.mask[:n, start : end + 1], kv.pending[:n, None]
        logits = (
            self.model(
                input_ids=ids,
                attention_mask=self._attention_mask(mask, ids.shape, kv.padded),
                position_ids=kv.pos[:n, None],
                past_key_values=kv.cache,
                use_cache=True,
                logits_to_keep=1,
            )
            .logits[:, -1]
            .float()
        )
        kv.advance()
        tokens, logprobs = sample(logits, self._running, self._plan())
        kv.pending[:n] = tokens
        picked = torch.stack([tokens.double(), logprobs.double()]).tolist()  # exact: ids < 2**53, fp32 values
        finished, keep = [], []
        for i, (s, tok, lp) in enumerate(zip(self._running, picked[0], picked[1])):
            s.tokens.append(int(tok))
            s.logprobs.append(lp)
            s.versions.append(self._version)
            reason = s.finish_reason()
            if reason is None:
                keep.append(i)
            else:
                finished.append(s.output(reason))
                self._ids.discard(s.req.request_id)
        self.tokens_generated += len(self._running)
        self.decode_steps += 1
        if len(keep) < len(self._running):
            self._retain(keep)
        return finished
