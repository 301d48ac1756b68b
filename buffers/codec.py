"""Samples and groups as JSON values, and per-token values between lists and NumPy arrays.

Every JSON file that holds samples -- a checkpoint's buffer (flash.checkpoint), a step of the
schedule record (flash.app.schedule) -- holds them as these dicts, ``dataclasses.asdict``'s keys
in the dataclasses' order:

    group  = {"prompt_id", "samples", "admitted_version", "data_index"}
    sample = {"prompt_id", "sample_index", "prompt_ids", "response_ids", "behav_logprobs",
              "versions", "reward", "finish_reason", "admitted_version", "meta", "loss_mask"}

A sample's per-token fields (``TOKEN_FIELDS``) are lists of Python numbers of the field's kind: an
array's values as ``tolist`` gives them (a float32 logprob as the float64 that holds it exactly;
JSON writes a float's shortest exact repr, so it reads back to the same bits). ``meta`` may be left
out (``meta=False``; it reads back as {}), and so may a sample's ``prompt_id`` (the group's).
``index`` and ``finish`` are read as ``sample_index`` and ``finish_reason`` (ALIASES: schedule.jsonl
files that use those keys replay unchanged).

The dicts are read from disk: ``group_from_dict`` checks every field's type and every per-token
field's length before anything is built, and a ``CodecError`` names the first bad field.
"""

from __future__ import annotations

import array
import copy
from dataclasses import fields
from typing import Any

import numpy as np

from .reward import BadReward, reward_value
from .types import TOKEN_FIELDS, Group, Sample, TokenField

TOKEN = {f.name: f for f in TOKEN_FIELDS}
ARRAY_KINDS = {"int": "iu", "float": "f", "bit": "iu"}  # NumPy dtype kinds whose tolist() is the field's kind
SCALARS = {"prompt_id": int, "sample_index": int, "reward": float, "finish_reason": str, "admitted_version": int}
ALIASES = {"sample_index": "index", "finish_reason": "finish"}


class CodecError(ValueError):
    """A dict that is not a group or a sample; the message names the field."""


# ---------------------------------------------------------------------------------- lists <-> arrays


def to_list(values: Any, field: TokenField) -> list:
    """Per-token values (a list or a 1-D NumPy array) as a list of Python numbers of the field's kind."""
    if isinstance(values, np.ndarray):
        if values.dtype.kind in ARRAY_KINDS[field.kind]:
            return values.tolist()
        values = values.tolist()
    cast = field.python
    return [cast(v) for v in values]


def to_array(values: Any, field: TokenField) -> np.ndarray:
    """A list of Python numbers → int64 / float64 (bit: int64) without silent conversion: a float
    among token ids is a TypeError, an int beyond int64 an OverflowError."""
    if not isinstance(values, (list, tuple)):
        raise TypeError(f"a list or a NumPy array is required, got {type(values).__name__}")
    floats = field.kind == "float"
    # array.array converts a list of Python numbers faster than NumPy, and as strictly
    return np.frombuffer(array.array("d" if floats else "q", values), dtype="<f8" if floats else "<i8")


# ---------------------------------------------------------------------------------------- encoding


def group_to_dict(g: Group, meta: bool = True) -> dict:
    """A group as JSON values (see the module docstring); ``meta=False`` leaves the samples' out."""
    return {
        "prompt_id": int(g.prompt_id),
        "samples": [sample_to_dict(s, meta) for s in g.samples],
        "admitted_version": int(g.admitted_version),
        "data_index": int(g.data_index),
    }


def sample_to_dict(s: Sample, meta: bool = True) -> dict:
    out = {}
    for f in fields(Sample):
        value = getattr(s, f.name)
        if f.name in TOKEN:
            out[f.name] = None if value is None and TOKEN[f.name].optional else to_list(value, TOKEN[f.name])
        elif f.name == "meta":
            if meta:
                out["meta"] = copy.deepcopy(value)
        else:
            out[f.name] = SCALARS[f.name](value)
    return out


# ---------------------------------------------------------------------------------------- decoding


def group_from_dict(d: Any, where: str = "group") -> Group:
    """A group's dict → the Group, every field checked (a CodecError names the first bad one)."""
    if not isinstance(d, dict):
        raise CodecError(f"{where}: not an object")
    prompt_id = _field(d, "prompt_id", int, where)
    samples = [
        sample_from_dict(s, prompt_id, f"{where} sample {i}") for i, s in enumerate(_field(d, "samples", list, where))
    ]
    if not samples:
        raise CodecError(f"{where}: no samples")
    return Group(
        prompt_id=prompt_id,
        samples=samples,
        admitted_version=_field(d, "admitted_version", int, where),
        data_index=_field(d, "data_index", int, where),
    )


def sample_from_dict(d: Any, prompt_id: int, where: str = "sample") -> Sample:
    """A sample's dict (of the group of ``prompt_id``) → the Sample, every field checked."""
    if not isinstance(d, dict):
        raise CodecError(f"{where}: not an object")
    own = d.get("prompt_id", prompt_id)
    if type(own) is not int or own != prompt_id:
        raise CodecError(f"{where}: field 'prompt_id' is {own!r}, not its group's {prompt_id}")
    tokens: dict[str, Any] = {f.name: _tokens(d, f, where) for f in TOKEN_FIELDS}  # Sample's kwargs
    n = len(tokens["response_ids"])
    for f in TOKEN_FIELDS:
        values = tokens[f.name]
        if f.along == "response" and values is not None and len(values) != n:
            raise CodecError(f"{where}: {f.name} has {len(values)} entries for {n} response tokens")
    meta = d.get("meta", {})
    if not isinstance(meta, dict):
        raise CodecError(f"{where}: field 'meta' is not an object")
    return Sample(
        prompt_id=prompt_id,
        meta=meta,
        **tokens,
        **{key: _scalar(d, key, where) for key in SCALARS if key != "prompt_id"},
    )


def _scalar(d: dict, key: str, where: str) -> Any:
    if key == "reward":  # what counts as a reward is flash.buffers.reward's to say
        try:
            return reward_value(d.get(key))
        except BadReward as exc:
            raise CodecError(f"{where}: reward {d.get(key)!r}: {exc}") from None
    kind = SCALARS[key]
    found = key if key in d or key not in ALIASES else ALIASES[key]
    return kind(_field(d, found, (int, float) if kind is float else kind, where))


def _field(d: dict, key: str, kind: type | tuple[type, ...], where: str) -> Any:
    value = d.get(key)
    if not isinstance(value, kind) or isinstance(value, bool):
        raise CodecError(f"{where}: field {key!r} is missing or not {getattr(kind, '__name__', 'a number')}")
    return value


def _tokens(d: dict, f: TokenField, where: str) -> list | None:
    if f.optional and d.get(f.name) is None:
        return None
    values = _field(d, f.name, list, where)
    if f.kind == "float":
        if not all(type(v) is float or type(v) is int for v in values):
            raise CodecError(f"{where}: {f.name} holds something that is not a number")
        return [float(v) for v in values]
    if not all(type(v) is int for v in values):
        raise CodecError(f"{where}: {f.name} holds something that is not an integer")
    if f.kind == "bit" and not all(v == 0 or v == 1 for v in values):
        raise CodecError(f"{where}: {f.name} holds something other than 0 and 1")
    return list(values)
