"""The schedule record of a run: what the asynchronous schedule decided, one line per train step.

``RUN_DIR/schedule.jsonl`` holds, for each step, the groups it trained in batch order -- prompt,
the policy version each was admitted at, every sample's tokens, behaviour logprobs, per-token
versions, loss mask and reward (``flash.buffers.codec``'s dicts, without ``meta``) -- the interrupts each
response went through (the token positions where the policy version changed under it), and the
step's loss and gradient norm. Rollout under
``async_ratio > 0`` depends on timing, so a second run does not draw the same batches; training on
a recorded batch does not: ``flash replay RUN_DIR`` (flash.app.replay) re-trains from this record
and must find every step's loss again, bit for bit.

The record is data read back from disk: the file is read one line at a time within
``flash.run_files.SCHEDULE_BOUNDS`` (its size, a line's length, its nesting, checked before a line
is parsed), ``groups_from_line`` checks every field's type and size before anything is built from
it (``flash.buffers.codec``; docs/design.md invariant 7) and a bad line is one ``FlashError`` naming the
file and line, or the step and field.
"""

from __future__ import annotations

import itertools
import os
from pathlib import Path
from typing import Any, Iterator

from flash.buffers.codec import CodecError, group_from_dict, group_to_dict
from flash.buffers.types import Group
from flash.errors import FlashError
from flash.run_files import SCHEDULE_BOUNDS, read_jsonl

SCHEDULE = "schedule.jsonl"
CHECKED = ("loss", "grad_norm")  # the trainer's numbers a replay must find again


def interrupts(versions: list[int]) -> list[list[int]]:
    """[token position, new version] wherever the policy changed under a response mid-way (a weight
    update it was continued across); [] for a response one version wrote."""
    return [[i, v] for i, (u, v) in enumerate(itertools.pairwise(versions), start=1) if v != u]


def step_line(step: int, groups: list[Group], train: dict[str, float], context: dict[str, Any]) -> dict:
    """The record of train step ``step``: ``groups`` in the order the step collated them,
    ``train`` the trainer's metrics, ``context`` what else the replay needs (threads, prox mode)."""
    return {
        "step": step,
        **context,
        "train": {k: float(train[k]) for k in CHECKED if k in train},
        "groups": [_group_record(g) for g in groups],
    }


def _group_record(g: Group) -> dict:
    """The group's dict without ``meta`` (replay needs none of it), each sample with its interrupts."""
    d = group_to_dict(g, meta=False)
    for s in d["samples"]:
        s["interrupts"] = interrupts(s["versions"])
    return d


def schedule_lines(run_dir: Path, steps: int | None = None) -> Iterator[dict]:
    """The step lines of ``RUN_DIR/schedule.jsonl`` (its first ``steps``; all by default), one in
    memory at a time, each checked to be a JSON object with the next step's number; the file is
    read within ``SCHEDULE_BOUNDS`` (flash.run_files: size, line length, nesting)."""
    path = Path(run_dir) / SCHEDULE
    if not os.path.lexists(path):
        raise FlashError(
            f"{path} not found: replay needs a run dir written by `flash run` (it records the schedule of every step)"
        )
    for want, (n, line) in enumerate(read_jsonl(path, SCHEDULE_BOUNDS)):
        if steps is not None and want >= steps:
            return
        if not isinstance(line.get("step"), int):
            raise FlashError(f"{path}:{n}: a schedule line is an object with an integer 'step'")
        if line["step"] != want:
            raise FlashError(
                f"{path}:{n}: step {line['step']!r} where step {want} is due: steps are not 0, 1, "
                "2, ...: the record is incomplete"
            )
        yield line


def count_steps(run_dir: Path, steps: int | None = None) -> int:
    """The steps ``schedule_lines`` gives, every line read and checked (none kept): a damaged
    record is refused before a replay starts its trainer."""
    return sum(1 for _ in schedule_lines(run_dir, steps))


def groups_from_line(line: dict) -> list[Group]:
    """The step's groups rebuilt from its line, every field checked (a FlashError names the first
    bad one)."""
    where = f"schedule step {line['step']}"
    groups = line.get("groups")
    if not isinstance(groups, list):
        raise FlashError(f"{where}: field 'groups' is missing or not list")
    try:
        return [group_from_dict(g, f"{where} group {i}") for i, g in enumerate(groups)]
    except CodecError as exc:
        raise FlashError(str(exc)) from None
