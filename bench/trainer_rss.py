"""Where a CPU trainer's resident memory goes: one recipe's train steps, part by part, in this process.

    python -m bench.trainer_rss [--recipe recipes/humaneval_smollm2.yaml] [--steps 2] [--trim]

Builds the recipe's trainer as its run does (the model from ``prepare_model``, the run's
``trainer_settings``, ``flash.cluster.load_model``) and a batch of the recipe's shape
(``train.prompts_per_step`` of the task's own prompts, encoded by the model's tokenizer, each with
``rollout.n`` responses of ``rollout.max_new_tokens`` tokens), then runs ``--steps`` train steps
as the run's trainer does (``Trainer.train_step``; the behaviour logprobs as the proximal ones, as
at ``async_ratio: 0``).

Each part of a step -- the model's forward, the logprobs (``_SpanLogprobs``, forward and
backward), the loss, the backward, the gradient clip, the AdamW step -- is marked by wrapping it.
At every boundary the process's peak resident bytes since the last boundary are read exactly
(``VmHWM``, then reset through ``/proc/self/clear_refs``), with the live tensor bytes the step
holds at its peak (``flash.app.memory_trace.LiveBytes`` over the real tensors) and glibc's heap
figures (``mallinfo2``: bytes in use, and bytes free but kept in the arenas). After each step the weights
are pushed as the CPU run pushes them (``model_update.backend`` auto: one shared-memory segment,
``flash.weights.shm``), which the trainer keeps mapped. ``--trim`` calls
``malloc_trim(0)`` after each step; ``--no-live`` leaves the live bytes out (0), for speed. Run it under ``MALLOC_ARENA_MAX=…`` or
``MALLOC_MMAP_THRESHOLD_=…`` to see the allocator's share. The last line is JSON.
"""

from __future__ import annotations

import argparse
import ctypes
import json
from contextlib import ExitStack
from unittest import mock

MIB = 2**20
_LIBC = ctypes.CDLL("libc.so.6")


class _MallInfo2(ctypes.Structure):
    _fields_ = [
        (name, ctypes.c_size_t)
        for name in (
            "arena",
            "ordblks",
            "smblks",
            "hblks",
            "hblkhd",
            "usmblks",
            "fsmblks",
            "uordblks",
            "fordblks",
            "keepcost",
        )
    ]


_LIBC.mallinfo2.restype = _MallInfo2


def heap() -> dict[str, float]:
    """glibc's heap in MiB: in use (arenas + mmapped chunks), and free but kept in the arenas."""
    m = _LIBC.mallinfo2()
    return {"in_use": (m.uordblks + m.hblkhd) / MIB, "free_kept": m.fordblks / MIB, "mmapped": m.hblkhd / MIB}


def status() -> dict[str, float]:
    """This process's resident figures in MiB (``/proc/self/status``)."""
    keys = ("VmRSS", "VmHWM", "RssAnon", "RssFile", "RssShmem")
    out = {}
    with open("/proc/self/status") as f:
        for line in f:
            name, _, value = line.partition(":")
            if name in keys:
                out[name] = int(value.split()[0]) / 1024
    return out


def reset_peak() -> None:
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")


class Parts:
    """The peak resident bytes, live tensor bytes and heap of each marked part (innermost wins)."""

    def __init__(self, counter):
        self.counter, self.stack, self.step = counter, ["outside"], 0
        self.rows: dict[tuple[int, str], dict[str, float]] = {}

    def boundary(self) -> None:
        key = (self.step, self.stack[-1])
        row = self.rows.setdefault(key, {"rss_peak": 0.0, "live_peak": 0.0})
        row["rss_peak"] = max(row["rss_peak"], status()["VmHWM"])
        row["live_peak"] = max(row["live_peak"], self.counter.peak / MIB)
        row.update({f"heap_{k}": v for k, v in heap().items()})
        reset_peak()
        self.counter.reset()

    def wrap(self, name: str, fn):
        def inner(*args, **kwargs):
            self.boundary()
            self.stack.append(name)
            try:
                return fn(*args, **kwargs)
            finally:
                self.boundary()
                self.stack.pop()

        return inner


def recipe_batch(cfg, model_path: str):
    """The recipe's batch: its first prompts (task order), ``n`` responses of the longest length
    each (random ids), behaviour logprobs -1, and random advantages."""
    import torch

    from flash.buffers.types import Sample
    from flash.app.data import build_source, build_task, load_tokenizer
    from flash.train.batch import collate

    task, tok = build_task(cfg), load_tokenizer(cfg, model_path)
    source = build_source(task, tok)
    gen = torch.Generator().manual_seed(0)
    samples, new = [], cfg.rollout.max_new_tokens
    for p in range(cfg.train.prompts_per_step):
        prompt = source.encode(task.item(p).prompt)
        for k in range(cfg.rollout.n):
            response = torch.randint(0, len(tok), (new,), generator=gen).tolist()
            samples.append(
                Sample(
                    prompt_id=p,
                    sample_index=k,
                    prompt_ids=prompt,
                    response_ids=response,
                    behav_logprobs=[-1.0] * new,
                    versions=[0] * new,
                    reward=0.0,
                )
            )
    batch = collate(samples, tok.pad_token_id or 0)
    return batch, torch.randn(batch.mask.shape, generator=gen) * batch.mask


def build(recipe: str):
    from flash.app.config import load_config
    from flash.app.runner import prepare_model
    from flash.app.settings import trainer_settings
    from flash.cluster import load_model
    from flash.train.trainer import Trainer

    import torch

    from flash.app.settings import resolve_threads

    cfg = load_config(recipe)
    torch.set_num_threads(max(1, resolve_threads(cfg)[1]))  # the trainer actor's threads
    path = prepare_model(cfg, None)
    before = status()
    model = load_model(path)
    loaded = status()
    trainer = Trainer(model, trainer_settings(cfg), seed=cfg.seed)
    return cfg, path, trainer, {"before_model": before, "model_loaded": loaded, "trainer_built": status()}


def patches(parts: Parts, trainer) -> list:
    """The wrapped parts of a step (``Parts.wrap``)."""
    import torch

    import flash.train.logprobs as lp

    fwd, bwd = lp._SpanLogprobs.forward, lp._SpanLogprobs.backward
    return [
        mock.patch.object(trainer.model, "forward", parts.wrap("forward", trainer.model.forward)),
        mock.patch.object(lp._SpanLogprobs, "forward", staticmethod(parts.wrap("logprobs", fwd))),
        mock.patch.object(lp._SpanLogprobs, "backward", staticmethod(parts.wrap("logprobs backward", bwd))),
        mock.patch.object(trainer, "loss_fn", parts.wrap("loss", trainer.loss_fn)),
        mock.patch.object(torch.Tensor, "backward", parts.wrap("backward", torch.Tensor.backward)),
        mock.patch.object(torch.nn.utils, "clip_grad_norm_", parts.wrap("clip", torch.nn.utils.clip_grad_norm_)),
        mock.patch.object(trainer.optimizer, "step", parts.wrap("optimizer step", trainer.optimizer.step)),
    ]


def push(sender, state) -> None:
    """The weight push of the run's CPU trainer: its state packed into one shared-memory segment."""
    from flash.weights.model_update import plan_state

    sender.write(state, plan_state(state, 64 * MIB))


class _NoCount:
    """``--no-live``: no live-bytes count (its dispatch mode slows every op several times)."""

    peak = 0

    def add(self, tensors) -> None:
        pass

    def reset(self) -> None:
        pass

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        pass


def run(recipe: str, steps: int, trim: bool, live: bool = True) -> dict:
    import torch

    from flash.app.memory_trace import LiveBytes
    from flash.weights.shm import ShmSender

    cfg, path, trainer, setup = build(recipe)
    batch, adv = recipe_batch(cfg, path)
    sender = ShmSender()  # the CPU run's colocated push (model_update.backend auto: shm)
    counter = LiveBytes() if live else _NoCount()
    counter.add(list(trainer.model.parameters()))
    parts = Parts(counter)
    torch.manual_seed(0)
    ends = []
    with ExitStack() as stack:
        for p in patches(parts, trainer):
            stack.enter_context(p)
        stack.enter_context(counter)
        for step in range(1, steps + 1):
            parts.step = step
            reset_peak()
            counter.add(
                [t for s in trainer.optimizer.state.values() for t in s.values() if isinstance(t, torch.Tensor)]
            )
            trainer.train_step(batch, adv, batch.behav_logp)
            parts.wrap("weight push (shm)", push)(sender, trainer.model.state_dict())
            parts.boundary()
            if trim:
                _LIBC.malloc_trim(0)
            ends.append({"step": step, **status(), **{f"heap_{k}": v for k, v in heap().items()}})
    sender.close()
    shape = {
        "rows": len(batch),
        "length": int(batch.input_ids.shape[1]),
        "micro_batch": cfg.train.micro_batch_size,
        "params_mib": sum(p.numel() * p.element_size() for p in trainer.model.parameters()) / MIB,
    }
    return {
        "shape": shape,
        "setup": setup,
        "parts": [{"step": s, "part": n, **v} for (s, n), v in parts.rows.items()],
        "step_ends": ends,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--recipe", default="recipes/humaneval_smollm2.yaml")
    ap.add_argument("--steps", type=int, default=2)
    ap.add_argument("--trim", action="store_true")
    ap.add_argument("--no-live", action="store_true", help="no live tensor bytes (several times faster)")
    args = ap.parse_args()
    out = run(args.recipe, args.steps, args.trim, live=not args.no_live)
    print(f"shape {out['shape']}")
    for name, s in out["setup"].items():
        print(f"{name:14s} RSS {s['VmRSS']:8.0f} MiB (anon {s['RssAnon']:.0f}, file {s['RssFile']:.0f})")
    print(f"{'step':>4} {'part':18s} {'peak RSS':>9} {'live':>8} {'heap used':>9} {'heap free':>9}  (MiB)")
    for r in out["parts"]:
        print(
            f"{r['step']:4d} {r['part']:18s} {r['rss_peak']:9.0f} {r['live_peak']:8.0f} {r['heap_in_use']:9.0f} "
            f"{r['heap_free_kept']:9.0f}"
        )
    for e in out["step_ends"]:
        print(
            f"after step {e['step']}: RSS {e['VmRSS']:.0f} MiB, heap used {e['heap_in_use']:.0f}, "
            f"free kept {e['heap_free_kept']:.0f}"
        )
    print(json.dumps(out))


if __name__ == "__main__":
    main()
