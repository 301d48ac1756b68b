"""Each GPU role's memory, estimated on the CPU before the run, and whether each card holds its roles.

``flash validate`` (and ``flash run``, through ``flash.app.preflight``) estimates, for a recipe that
places roles on GPUs, the peak bytes of each GPU role from fake-tensor traces of its own code
(``flash.app.memory_trace``) at the recipe's shapes and dtypes, and refuses a placement whose card
cannot hold it, in one line that names the GPU, the roles, the estimate, the card and the fix.
The card is a setting (``resources.card``: a name from ``CARDS``; ``resources.gpu_memory_gib``: its
memory); with neither, the estimates are printed and nothing is refused.

Per role (``W`` ranks of the trainer group, ``b`` the compute dtype's bytes, ``L`` the longest
sequence = the prompt budget + the larger of ``rollout.max_new_tokens`` and ``eval.max_new_tokens``):

- **actor_train**: one micro-batch (``train.micro_batch_size`` rows, or ``train.micro_tokens // L``)
  of ``L`` tokens, scored from its first column (the worst case: a one-token prompt), traced through
  the trainer's forward, loss and backward and its AdamW step, with the AdamW state already there
  (``Phases``). A rank of a ``W``-rank FSDP2 group holds ``1/W`` of the weights, gradients and AdamW
  state: its backward peak is ``backward − (resident + grads at the peak)·(1 − 1/W) + U`` (the
  largest over the backward's windows, ``Phases``) with
  ``U = (root + 2·layer)·b/4 + max(root, layer)`` (the root unit and two decoder layers unsharded in
  the compute dtype, one unit's float32 gradient before its reduce-scatter; ``root``, ``layer``:
  float32 weight bytes); its AdamW step peak is ``step / W``. Between steps (while a colocated
  engine generates) it keeps weights, gradients and AdamW state: ``(resident + params) / W``.
  A checkpoint snapshot takes no GPU memory: ``flash.staging`` copies each rank's weights and
  AdamW state (``resident / W``) to pinned host memory.
- **actor_infer, torch engine**: its weights and the prefill of ``rollout.max_num_seqs`` prompts in
  forwards of at most ``rollout.max_num_batched_tokens`` tokens (traced: ``TorchEngine._admit``),
  then decoding: KV buffers of at most ``max_num_seqs`` rows and ``L + max(max_new_tokens, 64)``
  columns of ``2·layers·kv_heads·head_dim·b`` bytes per row (a rebuild frees a layer's old buffers
  before allocating its new ones: one layer's live window more), plus one decode step's float32
  logits (three vocabulary rows per sequence: logits, probabilities, logprobs). Asleep (level 2,
  colocated): nothing.
- **actor_infer, vLLM**: vLLM takes ``gpu_memory_utilization`` of the card (0.9; colocated: what the
  trainer leaves, ``flash.devices.colocated_engine_fraction``); it must hold the weights
  (``/ tensor-parallel ranks``) and the KV cache of one ``max_model_len`` sequence. Without a card:
  the weights and the KV cache of a full batch (``max_num_seqs`` sequences of ``L`` tokens).

Colocated roles take turns, so a card's peak is the largest of its roles' peaks, each plus what
the others keep meanwhile (``card_peak``); a role alone on its card needs its own peak.
"""

from __future__ import annotations

from dataclasses import dataclass

from flash.app.config import FlashConfig
from flash.app.memory_trace import Phases, PrefillShape, TrainShape, prefill_bytes, train_phases
from flash.app.cards import GIB, Card, resolve_card
from flash.errors import FlashError

VLLM_UTILIZATION = 0.9  # vLLM's default gpu_memory_utilization
MAX_CONFIG_BYTES = 1 << 20  # a config.json larger than this is not read
# what building or tracing a model flash does not know may raise (the estimate then says so)
TRACE_FAILURES = (ValueError, TypeError, KeyError, AttributeError, RuntimeError, NotImplementedError)


@dataclass(frozen=True)
class RoleMemory:
    role: str
    devices: tuple[int, ...]
    peak: int  # bytes on each of its GPUs while it works
    kept: int  # bytes it keeps while a colocated role works
    detail: str  # what the peak is made of
    phase: str = ""  # the torch engine's: "prefill" when its prefill, not its decoding, peaks


def gib(n: float) -> str:
    return f"{n / GIB:.2f} GiB"


# ---- per role ----------------------------------------------------------------------------------
def rank_bytes(p: Phases, ranks: int, dtype_bytes: int) -> tuple[int, int, int]:
    """(backward peak, AdamW step peak, kept) of one of ``ranks`` FSDP2 ranks from the single
    trainer's ``Phases`` (module docstring); ``ranks`` 1: the single trainer's own."""
    kept = p.resident + p.params
    if ranks == 1:
        return p.backward, p.step, kept
    root = p.params - p.layer * p.layers
    unsharded = (root + 2 * p.layer) * dtype_bytes // 4 + max(root, p.layer)
    shard = 1 - 1 / ranks
    backward = max(int(peak - (p.resident + grads) * shard) for peak, grads in p.windows()) + unsharded
    return backward, p.step // ranks, kept // ranks


def trainer_memory(cfg: FlashConfig, config, devices: tuple[int, ...], ranks: int) -> RoleMemory:
    from flash.app.settings import trainer_settings
    from flash.devices import torch_dtype

    length = sequence_budget(cfg, config)
    rows = max(1, cfg.train.micro_tokens // length) if cfg.train.micro_tokens else cfg.train.micro_batch_size
    shape = TrainShape(
        rows, length, 0, cfg.model.dtype, cfg.train.activation_checkpointing, cfg.train.entropy_every_steps > 0
    )
    phases = train_phases(config, shape, trainer_settings(cfg))
    b = torch_dtype(cfg.model.dtype).itemsize
    backward, step, kept = rank_bytes(phases, ranks, b)
    detail = (
        f"{ranks} rank(s), {rows}×{length}-token micro-batch, {cfg.model.dtype}"
        f"{', activation checkpointing' if shape.checkpointing else ''}: backward {gib(backward)}, "
        f"AdamW step {gib(step)}; checkpoint snapshot: 0 on the GPU, {gib(phases.resident / ranks)} "
        f"to pinned host"
    )
    return RoleMemory("actor_train", devices, max(backward, step), kept, detail)


def kv_bytes_per_token(config, dtype_bytes: int) -> int:
    text = config.get_text_config(decoder=True)
    heads = int(getattr(text, "num_key_value_heads", None) or text.num_attention_heads)
    head_dim = int(getattr(text, "head_dim", None) or text.hidden_size // text.num_attention_heads)
    return 2 * int(text.num_hidden_layers) * heads * head_dim * dtype_bytes


def weight_bytes(config, dtype_bytes: int) -> int:
    """The model's parameter bytes at ``dtype_bytes`` each, counted on the meta device."""
    import torch
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    return sum(p.numel() for p in model.parameters()) * dtype_bytes


def decode_kv_bytes(cfg: FlashConfig, config, dtype_bytes: int) -> int:
    """The torch engine's KV buffers at their largest (``flash.engine.kv_cache``): ``max_num_seqs``
    rows of ``L + max(max_new_tokens, SLACK)`` columns, plus one layer's live window copied out
    while its buffers are rebuilt."""
    from flash.engine.kv_cache import SLACK

    rows, length = cfg.rollout.max_num_seqs, sequence_budget(cfg, config)
    per_token = kv_bytes_per_token(config, dtype_bytes)
    new = max(cfg.rollout.max_new_tokens, cfg.eval.max_new_tokens, SLACK)
    layers = int(config.get_text_config(decoder=True).num_hidden_layers)
    return rows * (length + new) * per_token + rows * length * per_token // layers


def torch_engine_memory(cfg: FlashConfig, config, devices: tuple[int, ...]) -> RoleMemory:
    from flash.devices import torch_dtype

    b = torch_dtype(cfg.model.dtype).itemsize
    rows, length = cfg.rollout.max_num_seqs, sequence_budget(cfg, config)
    prefill = prefill_bytes(
        config, PrefillShape(rows, prompt_budget(cfg, config), cfg.rollout.max_num_batched_tokens, cfg.model.dtype)
    )
    vocab = int(config.get_text_config(decoder=True).vocab_size)
    decode = weight_bytes(config, b) + decode_kv_bytes(cfg, config, b) + rows * vocab * 4 * 3
    detail = (
        f"{rows} sequences of ≤ {length} tokens, {cfg.model.dtype}; prefill {gib(prefill)}, "
        f"decode {gib(decode)} (KV buffers at their largest)"
    )
    return RoleMemory("actor_infer", devices, max(prefill, decode), 0, detail, "prefill" if prefill > decode else "")


def vllm_memory(
    cfg: FlashConfig, config, devices: tuple[int, ...], tp: int, card: Card | None, trainer_kept: int | None
) -> RoleMemory:
    from flash.devices import colocated_engine_fraction, torch_dtype

    b = torch_dtype(cfg.model.dtype).itemsize
    text = config.get_text_config(decoder=True)
    weights = weight_bytes(config, b) // tp
    need = weights + int(text.max_position_embeddings) * kv_bytes_per_token(config, b) // tp
    if card is None:
        batch = cfg.rollout.max_num_seqs * sequence_budget(cfg, config) * kv_bytes_per_token(config, b) // tp
        return RoleMemory(
            "actor_infer",
            devices,
            weights + batch,
            0,
            f"vLLM, {tp} rank(s): weights {gib(weights)} + a full batch's KV cache {gib(batch)}",
        )
    share = VLLM_UTILIZATION
    if trainer_kept is not None:
        try:
            share = colocated_engine_fraction(card.bytes, trainer_kept)
        except ValueError as exc:
            raise FlashError(f"GPU {devices[0]} ({card.name}): {exc}") from None
    taken = int(share * card.bytes)
    if need > taken:
        raise FlashError(
            f"actor_infer (vLLM) on GPU {devices[0]} needs an estimated {gib(need)} (weights and one "
            f"{text.max_position_embeddings}-token sequence's KV cache) but gets {share:.0%} of the "
            f"{card.name}'s {gib(card.bytes)}: give each replica more GPUs "
            f"(placement.roles.actor_infer) or a card with more memory"
        )
    return RoleMemory(
        "actor_infer",
        devices,
        taken,
        0,
        f"vLLM takes {share:.3f} of the card: weights {gib(weights)}, the rest KV cache",
    )


# ---- shapes ------------------------------------------------------------------------------------
def prompt_budget(cfg: FlashConfig, config) -> int:
    context = int(config.get_text_config(decoder=True).max_position_embeddings)
    return cfg.data.max_prompt_tokens or max(1, context - cfg.rollout.max_new_tokens)


def sequence_budget(cfg: FlashConfig, config) -> int:
    return prompt_budget(cfg, config) + max(cfg.rollout.max_new_tokens, cfg.eval.max_new_tokens)


# ---- cards -------------------------------------------------------------------------------------
def card_peak(roles: list[RoleMemory]) -> tuple[int, RoleMemory]:
    """The peak of one card whose ``roles`` take turns: each role's peak plus what the others keep
    meanwhile, the largest of these; and the role working then."""
    best = max(roles, key=lambda r: r.peak + sum(o.kept for o in roles if o is not r))
    return best.peak + sum(o.kept for o in roles if o is not best), best


def fix_for(cfg: FlashConfig, role: RoleMemory, colocated: bool) -> str:
    """The settings that lower ``role``'s peak, in one clause."""
    if role.role == "actor_train":
        knobs = [f"train.micro_batch_size (now {cfg.train.micro_batch_size})"]
        fix = f"lower {knobs[0]}"
        if not cfg.train.activation_checkpointing:
            fix += ", set train.activation_checkpointing=true"
        fix += ", or shard the trainer over more GPUs (placement.roles.actor_train)"
    else:
        other = (
            f"rollout.max_num_batched_tokens (now {cfg.rollout.max_num_batched_tokens or 'none'})"
            if role.phase == "prefill"
            else f"rollout.max_new_tokens (now {cfg.rollout.max_new_tokens})"
        )
        fix = f"lower rollout.max_num_seqs (now {cfg.rollout.max_num_seqs}) or {other}"
    return fix + (", or give actor_infer its own GPUs" if colocated else "")


def check_cards(cfg: FlashConfig, roles: list[RoleMemory], card: Card | None) -> list[str]:
    """One line per GPU set (``GPU 0 (H100 79.6 GiB): peak ...``); a ``FlashError`` naming the fix
    when a card cannot hold the roles placed on it."""
    lines = []
    for devices in sorted({r.devices for r in roles}):
        here = [r for r in roles if r.devices == devices]
        peak, busy = card_peak(here)
        others = " + ".join(f"{r.role} {gib(r.kept)} kept" for r in here if r is not busy)
        parts = f"{busy.role} {gib(busy.peak)}" + (f" + {others}" if others else "")
        name = f"GPU {','.join(map(str, devices))}"
        if card is not None and peak > card.bytes:
            raise FlashError(
                f"{name} needs an estimated {gib(peak)} ({parts}) but the {card.name} has "
                f"{gib(card.bytes)}: {fix_for(cfg, busy, len(here) > 1)}"
            )
        on = f" ({card.name}, {gib(card.bytes)})" if card is not None else ""
        lines.append(f"{name}{on}: peak {gib(peak)} ({parts})")
    return lines


# ---- the recipe --------------------------------------------------------------------------------
def model_config(cfg: FlashConfig):
    """The HF config of ``model.path`` (a local folder ``load_config`` checked), read as data; None
    for a model the run builds or converts itself (``model.tiny``, ``model.gguf``)."""
    from pathlib import Path

    from transformers import AutoConfig

    if not cfg.model.path:
        return None
    path = Path(cfg.model.path).expanduser() / "config.json"
    if path.stat().st_size > MAX_CONFIG_BYTES:
        raise FlashError(
            f"{path} is over {MAX_CONFIG_BYTES >> 20} MiB: not a model config; point model.path at a "
            "Hugging Face model folder"
        )
    return AutoConfig.from_pretrained(path.parent, trust_remote_code=False)


def role_memory(cfg: FlashConfig, config, card: Card | None) -> list[RoleMemory]:
    """The estimates of the roles placed on GPUs that run a model (the trainer, a torch or vLLM engine)."""
    from flash.placement import plan_placement

    plan = plan_placement(cfg.placement, cfg.rollout.engine)
    out: list[RoleMemory] = []
    train, infer = plan.workers["actor_train"], plan.workers["actor_infer"]
    trainer = None
    if cfg.train.backend == "torch" and train and train[0].devices:
        trainer = trainer_memory(cfg, config, tuple(plan.devices("actor_train")), len(train))
        out.append(trainer)
    if cfg.rollout.engine in ("torch", "vllm") and infer and infer[0].devices:
        devices = tuple(plan.devices("actor_infer"))
        if cfg.rollout.engine == "torch":
            out.append(torch_engine_memory(cfg, config, devices))
        else:
            kept = trainer.kept if trainer is not None and plan.colocated("actor_train", "actor_infer") else None
            out.append(vllm_memory(cfg, config, devices, len(infer[0].devices), card, kept))
    return out


def role_line(r: RoleMemory, shared: bool) -> str:
    """``actor_train on GPU 0: peak 12.38 GiB, 7.36 GiB kept while ... (what it is made of)``."""
    each = " each" if len(r.devices) > 1 else ""
    kept = f", {gib(r.kept)} kept while the colocated role works" if shared else ""
    return f"{r.role} on GPU {','.join(map(str, r.devices))}: peak {gib(r.peak)}{each}{kept} ({r.detail})"


def memory_lines(cfg: FlashConfig) -> list[str]:
    """``flash validate``'s memory lines: each GPU role's estimate, then each GPU set's peak against
    the card; nothing for a recipe without GPU roles that run a model. Raises ``FlashError`` (one
    line) for an unknown card or a placement that does not fit."""
    if cfg.placement.num_gpus == 0:
        return []
    config = model_config(cfg)
    return [] if config is None else estimate_lines(cfg, config)


def estimate_lines(cfg: FlashConfig, config) -> list[str]:
    """``memory_lines`` for the model of HF config ``config`` (``bench.memory_estimate``: a
    published model's config without its weights)."""
    card = resolve_card(cfg.resources.card, cfg.resources.gpu_memory_gib)
    try:
        roles = role_memory(cfg, config, card)
    except TRACE_FAILURES as exc:  # a model flash cannot trace (not a causal LM): the run is not refused
        return [f"not estimated: {type(exc).__name__}: {str(exc).splitlines()[0][:200] if str(exc) else ''}"]
    lines = [role_line(r, shared=sum(o.devices == r.devices for o in roles) > 1) for r in roles]
    lines += check_cards(cfg, roles, card)
    if card is None and roles:
        lines.append("no card given: set resources.card (H100, H200) or resources.gpu_memory_gib to check the fit")
    return lines
