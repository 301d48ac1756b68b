"""Supervised warm start: a tiny model, trained offline on a task's demonstrations, cached on disk.

RL from a random initialisation never sees a reward; RL from a perfect imitator has nothing to
learn. The warm start sits in between: ``warm_start`` builds the byte tokenizer and a fresh
tiny Qwen2 (``flash.models``), trains it with cross-entropy on the response tokens of
``task.sft_pair(i)`` (the task makes those demonstrations imperfect on purpose, e.g. ``echo``'s
``slip_prob``, which is where the noise knob lives), and saves a Hugging Face checkpoint that
every engine and trainer loads like a hub model. The policy then has the task's skill but
reproduces the demonstrations' mistake rate when sampled, which is what RL removes.

Batches are bucketed by length (a pool of ``pool_batches`` batches is sorted and cut), so the
long tail of response lengths does not turn most of every batch into padding.

Caching: the checkpoint directory is named by a hash of every input (model config, SFT config,
task name, options and source files (``flash.tasks.task_fingerprint``), the tokenizer's and the
training code's format versions), so a second call with the same configs and code returns at once
and any change retrains. It is written to a temporary directory and renamed into place, so a crash
or a concurrent run never leaves a half-written checkpoint behind.

Reproducibility: model init, data order and dropout-free training are all seeded; the same
configs give the same weights on the same machine and torch version.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import math
import os
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

from flash.buffers.reward import error_text, reward_value
from flash.cache import build_once
from flash.cluster import pinned_threads
from flash.errors import RewardsFailing
from flash.models import (
    TOKENIZER_VERSION,
    TinyModelConfig,
    build_tiny_model,
    build_tokenizer,
    decode_response,
    encode_prompt,
    encode_response,
)
from flash.tasks import Task, TaskItem, task_fingerprint

log = logging.getLogger(__name__)

FORMAT_VERSION = 1  # bump when the training code changes what a given config produces
META_FILE = "flash_warm_start.json"


@dataclass(frozen=True)
class SFTConfig:
    """Supervised warm-start schedule.

    The defaults fit ``echo`` with the default ``TinyModelConfig``: 300 steps take ~55 s on 2
    uncontended CPU cores and leave a policy that copies exactly at greedy decoding yet slips at
    the demonstrated rate when sampled (~1/3 held-out accuracy at temperature 1.0). A task that
    needs an induction head (``stutter``) needs ~1000 steps; lr above ~4e-3 stalls at these sizes.

    Demonstration noise is a task option (e.g. ``echo``'s ``slip_prob``), not a field here: it
    defines the data, and the cache key covers it through the task's options.
    """

    steps: int = 300
    batch_size: int = 64
    pool_batches: int = 16  # batches pooled and sorted by length, to cut padding
    lr: float = 3e-3
    min_lr_ratio: float = 0.1  # cosine decay from lr to lr * min_lr_ratio
    warmup_steps: int = 30
    weight_decay: float = 0.01
    grad_clip: float = 1.0
    seed: int = 0
    first_index: int = 0  # demonstrations use train items first_index ... + steps * batch_size
    eval_after: bool = True  # measure sampled held-out accuracy once trained (logged, saved)
    eval_temperature: float = 1.0
    eval_seed: int = 0
    # torch threads of the warm start, whatever the calling process uses: float sums are reduced in
    # a thread-count-dependent order, so the same configs on 1 or 64 threads give different models.
    # Part of the cache key (``to_dict``), so a cached warm start is the one these configs make.
    threads: int = 2

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


def task_tokenizer(task: Task):
    """The byte tokenizer of ``task``'s warm start (``flash.models.build_tokenizer``), with the
    task's ``chat_template`` in place of its own if it has one (saved with the checkpoint, so every
    role loads it)."""
    tokenizer = build_tokenizer()
    if task.chat_template:
        tokenizer.chat_template = task.chat_template
    return tokenizer


def cache_key(model_cfg: TinyModelConfig, sft_cfg: SFTConfig, task: Task) -> str:
    """Hex digest naming the checkpoint that these inputs produce."""
    inputs = {
        "format": FORMAT_VERSION,
        "model": dataclasses.asdict(model_cfg),
        "sft": sft_cfg.to_dict(),
        "task": task_fingerprint(task),
        "tokenizer": TOKENIZER_VERSION,
    }
    if task.chat_template:
        inputs["chat_template"] = task.chat_template
    blob = json.dumps(inputs, sort_keys=True, default=str)
    return hashlib.sha256(blob.encode()).hexdigest()[:16]


def warm_start(
    model_cfg: TinyModelConfig,
    sft_cfg: SFTConfig,
    task: Task,
    cache_root: str | os.PathLike,
    on_step: Callable[[int], None] | None = None,
) -> str:
    """Directory of the warm-started model + tokenizer for these configs, training it if needed.

    Loadable with ``AutoModelForCausalLM.from_pretrained(dir)`` and
    ``AutoTokenizer.from_pretrained(dir)``; ``dir/flash_warm_start.json`` records the configs,
    the final loss, the training time and (with ``eval_after``) the held-out sampled accuracy.
    ``on_step(step)``: called after each SFT step (progress for a log file).
    """
    cache_root = os.fspath(cache_root)
    final = os.path.join(cache_root, f"sft-{task.name}-{cache_key(model_cfg, sft_cfg, task)}")
    meta = build_once(final, META_FILE, lambda tmp: _train_and_save(model_cfg, sft_cfg, task, tmp, on_step))
    if meta is None:  # cached (or another process built it meanwhile)
        return final
    acc = meta.get("eval_accuracy")
    log.info(
        "warm start %s: %d SFT steps in %.1fs, final loss %.3f%s -> %s",
        task.name,
        sft_cfg.steps,
        meta["train_seconds"],
        meta["final_loss"],
        "" if acc is None else f", held-out sampled accuracy {acc:.1%}",
        final,
    )
    return final


def _train_and_save(
    model_cfg: TinyModelConfig, sft_cfg: SFTConfig, task: Task, out: str, on_step: Callable[[int], None] | None = None
) -> dict:
    tokenizer = task_tokenizer(task)
    model = build_tiny_model(tokenizer, model_cfg)
    start = time.perf_counter()
    with pinned_threads(sft_cfg.threads):
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(sft_cfg.seed)
            final_loss = train_sft(model, tokenizer, task, sft_cfg, on_step)
        meta = _meta(model_cfg, sft_cfg, task, final_loss, time.perf_counter() - start)
        if sft_cfg.eval_after:
            meta["eval_accuracy"] = sampled_accuracy(
                model, tokenizer, task, task.eval_items(), temperature=sft_cfg.eval_temperature, seed=sft_cfg.eval_seed
            )
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    with open(os.path.join(out, META_FILE), "w") as f:
        json.dump(meta, f, indent=2, sort_keys=True)
    return meta


def _meta(model_cfg: TinyModelConfig, sft_cfg: SFTConfig, task: Task, final_loss: float, seconds: float) -> dict:
    return {
        "model": dataclasses.asdict(model_cfg),
        "sft": sft_cfg.to_dict(),
        "task": task_fingerprint(task),
        "format": FORMAT_VERSION,
        "final_loss": final_loss,
        "train_seconds": round(seconds, 2),
    }


def sft_batch(tokenizer, pairs: list[tuple[str, str]]) -> dict[str, torch.Tensor]:
    """Right-padded ``input_ids`` / ``attention_mask`` / ``labels`` with the loss on response
    tokens only (prompt and padding labelled -100)."""
    seqs, labels = [], []
    for prompt, response in pairs:
        p, r = encode_prompt(tokenizer, prompt), encode_response(tokenizer, response)
        seqs.append(p + r)
        labels.append([-100] * len(p) + r)
    width = max(map(len, seqs))
    pad = tokenizer.pad_token_id
    ids = torch.tensor([s + [pad] * (width - len(s)) for s in seqs])
    mask = torch.tensor([[1] * len(s) + [0] * (width - len(s)) for s in seqs])
    lab = torch.tensor([row + [-100] * (width - len(row)) for row in labels])
    return {"input_ids": ids, "attention_mask": mask, "labels": lab}


def _size(prompt) -> int:
    """A demonstration prompt's length in characters (a chat's as its JSON), for bucketing."""
    return len(prompt) if isinstance(prompt, str) else len(json.dumps(prompt))


def _bucketed_batches(task: Task, cfg: SFTConfig, step: int) -> list[list[tuple[str, str]]]:
    """Batches for steps ``step .. step + pool_batches - 1``: their demonstrations pooled, sorted
    by length and cut into batches, so a batch pads to similar lengths (the long tail of the
    task's responses would otherwise make most of every batch padding)."""
    n = min(cfg.pool_batches, cfg.steps - step)
    first = cfg.first_index + step * cfg.batch_size
    pairs = [task.sft_pair(i) for i in range(first, first + n * cfg.batch_size)]
    pairs.sort(key=lambda pr: _size(pr[0]) + len(pr[1]))
    batches = [pairs[b * cfg.batch_size : (b + 1) * cfg.batch_size] for b in range(n)]
    order = torch.randperm(n).tolist()  # seeded by the caller
    return [batches[i] for i in order]


def train_sft(model, tokenizer, task: Task, cfg: SFTConfig, on_step: Callable[[int], None] | None = None) -> float:
    """AdamW with linear warmup and cosine decay; returns the mean loss of the last 20 steps."""
    model.train()
    opt = torch.optim.AdamW(model.parameters(), lr=cfg.lr, betas=(0.9, 0.98), weight_decay=cfg.weight_decay)

    def lr_at(step: int) -> float:
        if step < cfg.warmup_steps:
            return cfg.lr * (step + 1) / cfg.warmup_steps
        frac = (step - cfg.warmup_steps) / max(1, cfg.steps - cfg.warmup_steps)
        cosine = 0.5 * (1 + math.cos(math.pi * frac))
        return cfg.lr * (cfg.min_lr_ratio + (1 - cfg.min_lr_ratio) * cosine)

    recent: list[float] = []
    queue: list[list[tuple[str, str]]] = []
    for step in range(cfg.steps):
        if not queue:
            queue = _bucketed_batches(task, cfg, step)
        batch = sft_batch(tokenizer, queue.pop(0))
        for group in opt.param_groups:
            group["lr"] = lr_at(step)
        loss = model(**batch).loss
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.grad_clip)
        opt.step()
        recent = (recent + [loss.item()])[-20:]
        if on_step is not None:
            on_step(step + 1)
    model.eval()
    return sum(recent) / max(1, len(recent))


@torch.no_grad()
def sample_responses(
    model,
    tokenizer,
    prompts: list[str],
    *,
    temperature: float = 1.0,
    seed: int = 0,
    max_new_tokens: int = 64,
    batch_size: int = 256,
) -> list[str]:
    """Sampled (or greedy at ``temperature == 0``) completions with Hugging Face ``generate``,
    seeded so the same model, prompts and seed give the same responses."""
    was_training, out = model.training, []
    model.eval()
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        for lo in range(0, len(prompts), batch_size):
            enc = [encode_prompt(tokenizer, p) for p in prompts[lo : lo + batch_size]]
            width = max(map(len, enc))
            pad = tokenizer.pad_token_id
            ids = torch.tensor([[pad] * (width - len(e)) + e for e in enc])  # left padding
            mask = torch.tensor([[0] * (width - len(e)) + [1] * len(e) for e in enc])
            # top_k=0: plain sampling at the temperature (generate's default top_k is 50)
            knobs = (
                dict(do_sample=True, temperature=temperature, top_k=0, top_p=1.0)
                if temperature > 0
                else dict(do_sample=False)
            )
            gen = model.generate(
                input_ids=ids,
                attention_mask=mask,
                max_new_tokens=max_new_tokens,
                pad_token_id=pad,
                eos_token_id=tokenizer.eos_token_id,
                **knobs,
            )
            out += [decode_response(tokenizer, row[width:].tolist()) for row in gen]
    model.train(was_training)
    return out


def sampled_accuracy(
    model, tokenizer, task: Task, items: list[TaskItem], *, temperature: float = 1.0, seed: int = 0
) -> float:
    """Mean reward of one sampled response per item: the held-out metric of the recipes (a reward
    that fails scores 0, as in training: ``held_out_rewards``)."""
    responses = sample_responses(
        model,
        tokenizer,
        [it.prompt for it in items],
        temperature=temperature,
        seed=seed,
        max_new_tokens=task.max_response_tokens(),
    )
    return sum(held_out_rewards(task.reward, items, responses)) / max(1, len(items))


def held_out_rewards(reward, items: list[TaskItem], responses: list[str]) -> list[float]:
    """Each response's reward; one whose reward raises or returns no reward (``flash.buffers.reward``)
    scores 0, and a reward that fails on every response stops the warm start in one line naming
    its error (``RewardsFailing``)."""
    scores, errors = [], []
    for item, response in zip(items, responses):
        try:
            scores.append(reward_value(reward(item, response)))
        except Exception as exc:  # noqa: BLE001 - a user's reward bug is named, not a traceback
            scores.append(0.0)
            errors.append(error_text(exc))
    if errors and len(errors) == len(scores):
        raise RewardsFailing(
            f"the reward failed on every one of the {len(scores)} held-out responses the warm "
            f"start sampled (sft.eval_after); its last error: {errors[-1]}. Fix the reward "
            "(`flash data RECIPE` scores each row's reference with it)"
        )
    return scores
