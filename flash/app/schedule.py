"""The schedule record of a run: what the asynchronous schedule decided, one line per train step.

``RUN_DIR/schedule.jsonl`` holds, for each step, the groups it trained in batch order -- prompt,
the policy version each was admitted at, every sample's tokens, behaviour logprobs, per-token
versions and reward -- the interrupts each response went through (the token positions where the
policy version changed under it), and the step's loss and gradient norm. Rollout under
``async_ratio > 0`` depends on timing, so a second run does not draw the same batches; training on
a recorded batch does not: ``flash replay RUN_DIR`` (flash.app.replay) re-trains from this record
and must find every step's loss again, bit for bit.

The record is data read back from disk: ``groups_from_line`` checks every field's type and size
before anything is built from it (DESIGN.md invariant 7) and a bad line is one ``FlashError``
naming the step and field.
"""

from __future__ import annotations

import itertools
import json
from pathlib import Path
from typing import Any

from buffers.reward import BadReward, reward_value
from buffers.types import Group, Sample
from flash.errors import FlashError

SCHEDULE = "schedule.jsonl"
MAX_LINE_BYTES = 256 << 20  # one step's batch; far above any recipe's
CHECKED = ("loss", "grad_norm")  # the trainer's numbers a replay must find again


def _floats(values: Any) -> list[float]:
    """Python floats (a NumPy array from the zmq buffer as well as a list): JSON writes a float's
    shortest exact repr, so it reads back to the same bits."""
    return [float(v) for v in (values.tolist() if hasattr(values, "tolist") else values)]


def _ints(values: Any) -> list[int]:
    return [int(v) for v in (values.tolist() if hasattr(values, "tolist") else values)]


def interrupts(versions: list[int]) -> list[list[int]]:
    """[token position, new version] wherever the policy changed under a response mid-way (a weight
    update it was continued across); [] for a response one version wrote."""
    return [[i, v] for i, (u, v) in enumerate(itertools.pairwise(versions), start=1) if v != u]


def step_line(step: int, groups: list[Group], train: dict[str, float], context: dict[str, Any]) -> dict:
    """The record of train step ``step``: ``groups`` in the order the step collated them,
    ``train`` the trainer's metrics, ``context`` what else the replay needs (threads, prox mode)."""
    return {
        "step": step, **context,
        "train": {k: float(train[k]) for k in CHECKED if k in train},
        "groups": [{
            "prompt_id": g.prompt_id, "data_index": g.data_index, "admitted_version": g.admitted_version,
            "samples": [_sample(s) for s in g.samples],
        } for g in groups],
    }


def _sample(s: Sample) -> dict:
    versions = _ints(s.versions)
    return {
        "index": s.sample_index, "prompt_ids": _ints(s.prompt_ids), "response_ids": _ints(s.response_ids),
        "behav_logprobs": _floats(s.behav_logprobs), "versions": versions, "reward": float(s.reward),
        "finish": s.finish_reason, "admitted_version": s.admitted_version,
        "loss_mask": None if s.loss_mask is None else _ints(s.loss_mask),
        "interrupts": interrupts(versions),
    }


def read_schedule(run_dir: Path) -> list[dict]:
    """The step lines of ``RUN_DIR/schedule.jsonl``, each checked to be a JSON object with a step."""
    path = Path(run_dir) / SCHEDULE
    if not path.is_file():
        raise FlashError(f"{path} not found: replay needs a run dir written by `flash run` "
                         "(it records the schedule of every step)")
    lines = []
    with open(path, "rb") as f:
        for n, raw in enumerate(f, start=1):
            if len(raw) > MAX_LINE_BYTES:
                raise FlashError(f"{path}:{n}: a line over {MAX_LINE_BYTES >> 20} MiB; not a schedule record")
            try:
                line = json.loads(raw)
            except ValueError as exc:
                raise FlashError(f"{path}:{n}: not JSON ({exc.__class__.__name__}); the record is damaged") from exc
            if not isinstance(line, dict) or not isinstance(line.get("step"), int):
                raise FlashError(f"{path}:{n}: a schedule line is an object with an integer 'step'")
            lines.append(line)
    steps = [line["step"] for line in lines]
    if steps != list(range(len(steps))):
        raise FlashError(f"{path}: steps {steps[:5]}... are not 0, 1, 2, ...: the record is incomplete")
    return lines


def groups_from_line(line: dict) -> list[Group]:
    """The step's groups rebuilt from its line, every field checked (a FlashError names the first
    bad one)."""
    where = f"schedule step {line['step']}"
    groups = _field(line, "groups", list, where)
    return [_group(g, f"{where} group {i}") for i, g in enumerate(groups)]


def _group(g: Any, where: str) -> Group:
    if not isinstance(g, dict):
        raise FlashError(f"{where}: not an object")
    prompt_id = _field(g, "prompt_id", int, where)
    samples = [_sample_from(s, prompt_id, f"{where} sample {i}")
               for i, s in enumerate(_field(g, "samples", list, where))]
    if not samples:
        raise FlashError(f"{where}: no samples")
    return Group(prompt_id=prompt_id, samples=samples,
                 admitted_version=_field(g, "admitted_version", int, where),
                 data_index=_field(g, "data_index", int, where))


def _sample_from(s: Any, prompt_id: int, where: str) -> Sample:
    if not isinstance(s, dict):
        raise FlashError(f"{where}: not an object")
    response = _numbers(s, "response_ids", int, where)
    per_token = {k: _numbers(s, k, kind, where) for k, kind in (("behav_logprobs", float), ("versions", int))}
    mask = None if s.get("loss_mask") is None else _numbers(s, "loss_mask", int, where)
    for key, values in {**per_token, **({"loss_mask": mask} if mask is not None else {})}.items():
        if len(values) != len(response):
            raise FlashError(f"{where}: {key} has {len(values)} entries for {len(response)} response tokens")
    try:
        reward = reward_value(s.get("reward"))
    except BadReward as exc:
        raise FlashError(f"{where}: reward {s.get('reward')!r}: {exc}") from None
    return Sample(prompt_id=prompt_id, sample_index=_field(s, "index", int, where),
                  prompt_ids=_numbers(s, "prompt_ids", int, where), response_ids=response,
                  behav_logprobs=per_token["behav_logprobs"], versions=per_token["versions"],
                  reward=reward, finish_reason=str(s.get("finish", "")),
                  admitted_version=_field(s, "admitted_version", int, where), loss_mask=mask)


def _field(d: dict, key: str, kind, where: str):
    value = d.get(key)
    if not isinstance(value, kind) or isinstance(value, bool):
        raise FlashError(f"{where}: field {key!r} is missing or not {getattr(kind, '__name__', 'a number')}")
    return value


def _numbers(d: dict, key: str, kind: type, where: str) -> list:
    values = _field(d, key, list, where)
    ok = (int,) if kind is int else (int, float)
    if not all(isinstance(v, ok) and not isinstance(v, bool) for v in values):
        raise FlashError(f"{where}: {key} holds something that is not {'an integer' if kind is int else 'a number'}")
    return [kind(v) for v in values]
