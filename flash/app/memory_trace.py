"""Peak bytes of a role's work, traced with fake tensors (no byte allocated, every op's shape logic run).

Under ``FakeTensorMode`` a ``LiveBytes`` dispatch mode counts every tensor storage from the op
that creates it until it is freed (the live bytes an allocator would hold), and keeps the largest
count per phase. What is traced is flash's own code at the recipe's shapes and dtypes:

- ``train_phases``: one micro-batch of the single ``Trainer`` (``flash.train.trainer``): its
  ``_micro_loss`` (forward, ``token_logprobs``, the loss) and ``backward``, then the gradient clip
  and the AdamW step (``foreach``, as on CUDA), with the AdamW state already there (a step before);
  decoder layers recomputed in backward when ``activation_checkpointing`` is set;
- ``prefill_bytes``: the torch engine's ``_admit`` of one full batch of prompts (``TorchEngine``,
  its prefill budget ``max_num_batched_tokens`` and its KV buffers) at the engine's dtype.

Speed: a fake op costs the same whatever its size, but a deep model has many of them. The model is
traced at two and at three decoder layers and each phase's peak is extended linearly to the
model's depth, ``peak(L) = peak(2) + (L - 2) * (peak(3) - peak(2))``: every decoder layer past the
first adds the same weights, gradients, AdamW state, saved activations and KV buffers (the first
is left out: at one layer a phase can peak elsewhere) (``tests/unit/test_memory_estimate.py``
checks the extension against a full-depth trace). The trace runs on the CPU's fake device; the
CPU's autocast casts the same matmuls to the lower precision that CUDA's does.
"""

from __future__ import annotations

import copy
import weakref
from dataclasses import astuple, dataclass, replace

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves
from torch.utils.weak import WeakIdKeyDictionary


class LiveBytes(TorchDispatchMode):
    """Live storage bytes (every tensor an op makes, until it is freed) and their peak since ``reset``;
    with ``watch_grads``, also the peak (and the gradient bytes then) in each backward window ``j``:
    while the gradients of ``j`` decoder layers have arrived (``j`` = 0: the forward, the loss and
    the top layer's backward)."""

    def __init__(self):
        super().__init__()
        self._seen = WeakIdKeyDictionary()
        self.live = self.peak = 0
        self.grads = 0  # gradient bytes accumulated so far
        self.window = 0
        self.windows: dict[int, tuple[int, int]] = {}  # j -> (peak, gradient bytes at it)

    def add(self, tensors) -> None:
        """Count tensors that exist already (weights, optimizer state) as live."""
        for t in tensors:
            self._track(t)

    def reset(self) -> None:
        """Start a new phase: the peak from what is live now, no more backward windows."""
        self.peak, self.window = self.live, -1

    def watch_grads(self, params, layer_of: dict[int, int]) -> None:
        """Count each parameter's gradient once it is accumulated; a parameter of a decoder layer
        (``layer_of``: ``id(param)`` -> layer index) whose gradients had not arrived opens a window."""
        arrived: set[int] = set()

        def hook(p: torch.Tensor) -> None:
            self.grads += p.grad.untyped_storage().nbytes()
            layer = layer_of.get(id(p))
            if layer is not None and layer not in arrived:
                arrived.add(layer)
                self.window += 1
            self._note()

        for p in params:
            p.register_post_accumulate_grad_hook(hook)

    def _note(self) -> None:
        self.peak = max(self.peak, self.live)
        if self.window >= 0 and self.live >= self.windows.get(self.window, (-1, 0))[0]:
            self.windows[self.window] = (self.live, self.grads)

    def _track(self, t: torch.Tensor) -> None:
        storage = t.untyped_storage()
        if storage in self._seen:
            return
        size = storage.nbytes()
        self._seen[storage] = size
        weakref.finalize(storage, self._free, size)
        self.live += size
        self._note()

    def _free(self, size: int) -> None:
        self.live -= size

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for leaf in tree_leaves(out):
            if isinstance(leaf, torch.Tensor):
                self._track(leaf)
        return out


@dataclass(frozen=True)
class TrainShape:
    rows: int  # rows per micro-batch
    length: int  # tokens per row (prompt + response, padded)
    start: int  # the first response column (logprobs are scored from it on)
    dtype: str = "float32"  # model.dtype: the forward's precision (weights and AdamW stay float32)
    checkpointing: bool = False  # train.activation_checkpointing
    entropy: bool = True  # the entropy computed on the traced step (a logging step)


@dataclass(frozen=True)
class Phases:
    """Peak live bytes of one trainer step's phases, and what is resident before and after it.

    The backward's peak is kept per window (``LiveBytes``): the first (j = 0), the first and the
    last with a decoder layer in backward (j = 1, j = L - 1) and the last (j = L). Between the first
    and the last inner window the live bytes change by the same amount per layer (one layer's
    saved inputs freed, its gradients added), so the inner windows peak at one of these two, and
    each of the four is linear in the depth: extended one by one, they give the deep model's peak.
    """

    resident: int  # weights and AdamW state (the gradients are dropped at the step's start)
    step: int  # the peak of the gradient clip and the AdamW step
    params: int  # the trained weights' bytes (their gradients' too: both float32)
    layer: int  # one decoder layer's weight bytes (float32)
    layers: int  # decoder layers
    first: int  # peak of window 0: the forward, the loss, the top layer's backward
    inner_top: int  # peak of window 1
    inner_bottom: int  # peak of window L - 1
    last: int  # peak of window L: the embedding's backward
    first_grads: int = 0  # the gradient bytes at each window's peak
    inner_top_grads: int = 0
    inner_bottom_grads: int = 0
    last_grads: int = 0

    @property
    def backward(self) -> int:
        return max(self.first, self.inner_top, self.inner_bottom, self.last)

    @property
    def peak(self) -> int:
        return max(self.backward, self.step)

    def windows(self) -> list[tuple[int, int]]:
        """(peak, gradient bytes at it) of each of the four windows."""
        return [
            (self.first, self.first_grads),
            (self.inner_top, self.inner_top_grads),
            (self.inner_bottom, self.inner_bottom_grads),
            (self.last, self.last_grads),
        ]


def with_layers(config, layers: int):
    """A copy of an HF config with ``layers`` decoder layers (every other field kept)."""
    out = copy.deepcopy(config)
    text = out.get_text_config(decoder=True)
    text.num_hidden_layers = layers
    if getattr(text, "layer_types", None):
        text.layer_types = list(text.layer_types)[:layers]
    return out


def depth(config) -> int:
    return int(config.get_text_config(decoder=True).num_hidden_layers)


BASE_LAYERS = 2  # the depths traced: BASE_LAYERS and BASE_LAYERS + 1


def extend(base: int, more: int, layers: int) -> int:
    """``peak(L) = peak(2) + (L - 2) * (peak(3) - peak(2))`` (module docstring); a model no
    deeper than the traces is traced as it is."""
    return base + (layers - BASE_LAYERS) * (more - base)


def train_phases(config, shape: TrainShape, settings=None) -> Phases:
    """``Phases`` of the trainer at ``config``'s depth, from traces at two and three layers."""
    layers = depth(config)
    if layers <= BASE_LAYERS + 1:
        return trace_train(config, shape, settings)
    base, more = (trace_train(with_layers(config, n), shape, settings) for n in (BASE_LAYERS, BASE_LAYERS + 1))
    return Phases(*(extend(a, b, layers) for a, b in zip(astuple(base), astuple(more))))


def trace_train(config, shape: TrainShape, settings=None) -> Phases:
    """One trainer step at ``config`` as it is (no depth extension): see the module docstring.
    ``settings``: the run's ``TrainerSettings`` (its loss, and a KL reference the trainer keeps);
    None: a PPO loss. The micro-batch, dtype and entropy are ``shape``'s."""
    from torch._subclasses.fake_tensor import FakeTensorMode
    from transformers import AutoModelForCausalLM

    from flash.models import enable_activation_checkpointing
    from flash.train.fsdp import decoder_layers
    from flash.train.trainer import Trainer

    with FakeTensorMode():
        model = AutoModelForCausalLM.from_config(config)
        if shape.checkpointing:
            enable_activation_checkpointing(decoder_layers(model))
        trainer = Trainer(model, _settings(shape, settings))
        for group in trainer.optimizer.param_groups:
            group["foreach"] = True  # CUDA's default: one temporary per state over every tensor
        params = list(model.parameters())
        for p in params:  # one earlier step: the AdamW state exists, as on every step but the first
            p.grad = torch.zeros_like(p)
        trainer.optimizer.step()
        trainer.begin_step()
        part, adv = zero_batch(shape.rows, shape.length)
        counter = LiveBytes()
        reference = list(trainer.ref_model.parameters()) if trainer.ref_model is not None else []
        counter.add(
            params
            + reference
            + [t for s in trainer.optimizer.state.values() for t in s.values() if isinstance(t, torch.Tensor)]
        )
        layers = decoder_layers(model)
        counter.watch_grads(params, {id(p): i for i, m in enumerate(layers) for p in m.parameters()})
        resident = counter.live
        with counter:
            loss, _ = trainer._micro_loss(part, adv, None, None, shape.start)
            loss.backward()
            del loss
            counter.reset()
            torch.nn.utils.clip_grad_norm_(params, 1.0)
            trainer.optimizer.step()
    n, w = len(layers), counter.windows
    picked = [w.get(j, (0, 0)) for j in (0, 1, n - 1, n)] if n > 1 else [w[0], (0, 0), (0, 0), w.get(1, (0, 0))]
    return Phases(
        resident,
        counter.peak,
        sum(p.numel() * p.element_size() for p in params),
        sum(p.numel() * p.element_size() for p in layers[0].parameters()),
        n,
        *(peak for peak, _ in picked),
        *(grads for _, grads in picked),
    )


def _settings(shape: TrainShape, settings=None):
    from flash.train.trainer import TrainerSettings

    if settings is None:
        settings = TrainerSettings(
            lr=1e-6,
            weight_decay=0.0,
            betas=(0.9, 0.999),
            grad_clip=1.0,
            micro_batch_size=1,
            temperature=1.0,
            loss={"name": "ppo", "old_policy": "prox"},
            agg="token-mean",
        )
    return replace(
        settings,
        micro_batch_size=shape.rows,
        dtype=shape.dtype,
        tf32=False,
        prox="fused",
        entropy_every_steps=1 if shape.entropy else 0,
    )


def zero_batch(rows: int, length: int):
    """A ``rows`` x ``length`` train batch of zeros (every token a response token) and its advantages."""
    from flash.train.batch import TrainBatch

    cols = length - 1
    batch = TrainBatch(
        input_ids=torch.zeros(rows, length, dtype=torch.long),
        attention_mask=torch.ones(rows, length, dtype=torch.long),
        mask=torch.ones(rows, cols),
        behav_logp=torch.zeros(rows, cols),
        versions=torch.zeros(rows, cols, dtype=torch.long),
        rewards=torch.zeros(rows),
        group_ids=torch.zeros(rows, dtype=torch.long),
    )
    return batch, torch.zeros(rows, cols)


@dataclass(frozen=True)
class PrefillShape:
    rows: int  # prompts admitted at once (rollout.max_num_seqs)
    prompt: int  # tokens per prompt (the longest: data.max_prompt_tokens)
    budget: int  # rollout.max_num_batched_tokens (0: one prefill of every prompt)
    dtype: str = "float32"  # the engine's weights (model.dtype)


def prefill_bytes(config, shape: PrefillShape) -> int:
    """Peak live bytes of the torch engine admitting ``rows`` prompts (weights, KV buffers and the
    prefill forwards) at ``config``'s depth, from traces at two and three layers."""
    layers = depth(config)
    if layers <= BASE_LAYERS + 1:
        return trace_prefill(config, shape)
    base, more = (trace_prefill(with_layers(config, n), shape) for n in (BASE_LAYERS, BASE_LAYERS + 1))
    return extend(base, more, layers)


def trace_prefill(config, shape: PrefillShape) -> int:
    """The engine's first prefill forward of the batch, its KV buffers allocated for every row:
    the later forwards of the same batch have the same shapes (the last one fewer rows)."""
    from torch._subclasses.fake_tensor import FakeTensorMode
    from transformers import AutoModelForCausalLM

    from flash.devices import torch_dtype
    from flash.engine.base import GenerationRequest, SamplingParams
    from flash.engine.kv_cache import KVBatch
    from flash.engine.torch_engine import TorchEngine, prefill_chunks

    with FakeTensorMode():
        model = AutoModelForCausalLM.from_config(config, dtype=torch_dtype(shape.dtype))
        engine = TorchEngine(model, max_num_seqs=shape.rows, max_num_batched_tokens=shape.budget)
        first = prefill_chunks([shape.prompt] * shape.rows, shape.budget)[0]
        for i in range(first[1] - first[0]):
            engine.add_request(GenerationRequest(f"r{i}", [1] * (shape.prompt + 1), SamplingParams(max_new_tokens=1)))
        engine._kv = KVBatch(shape.rows, engine._num_layers, engine._device)
        engine._kv.reserve(left=shape.prompt, right=1, rows=shape.rows)  # every row's buffers, as once all are admitted
        counter = LiveBytes()
        counter.add(list(model.parameters()) + list(model.buffers()))
        with counter, torch.inference_mode():
            engine._admit()
    return counter.peak
