"""The buffer service's wire format: msgpack frames, arrays as raw bytes + dtype + shape, no pickle.

A frame from the network must never execute code, so nothing here can build an arbitrary object:
msgpack yields only None/bool/int/float/str/bytes/list/dict, extension types are refused, and the
decoder turns that into a ``Group`` only after checking every field's type, every array's dtype
against an allow-list and its byte length against ``shape × itemsize``, and that the per-token
arrays of a sample agree in length. Anything else is a ``WireError`` whose ``reason`` is one of
``REASONS`` -- the service counts rejections by that name and keeps serving.

Layout (positional msgpack arrays: the schema is the field order below, checked on decode; no
key strings repeated in every frame):

    group  = [prompt_id, admitted_version, data_index, [sample, ...]]
    sample = [prompt_id, sample_index, reward, finish_reason, admitted_version, meta,
              prompt_ids, response_ids, behav_logprobs, versions, loss_mask]
    array  = [dtype, shape, data, was_list]      e.g. ["<i4", [1024], <4096 bytes>, false]

A sample's arrays are its per-token fields, ``flash.buffers.types.TOKEN_FIELDS`` in order; a field's
``kind`` picks the dtypes it may travel as (``KIND_DTYPES``). An optional field may be nil:
``loss_mask`` nil is every response token trained on, else it is an array of 0/1 as uint8, one per
response token (an array comes back as uint8 whatever integer dtype it had, a list as a list): a
multi-turn sample's observation tokens must stay untrained wherever it is read.

The fields marked ``runs`` (``versions``, ``loss_mask``) change value a few times per response (a
weight update, a turn), so either may travel as runs when that is smaller: dtype ``"runs:<i4"``,
shape ``[n]`` (the tokens), data = the k run values (of that dtype) then the k run ends (``<i4``,
increasing, the last = n).
The decoder expands them only after checking ``n`` against the response's length, so a short
frame cannot ask for a large array.

A NumPy array goes as its own dtype (int32 token ids cost 4 bytes a token) and comes back as a
read-only NumPy view over the bytes msgpack unpacked (its one copy; ``.copy()`` it to write); a Python list
goes as int32/float32 when every value survives that, else int64/float64 (exact for every Python
int in range and every float), and comes back as a list: what a producer puts is what the
consumer gets, value for value and type for type.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import msgpack
import numpy as np

from .codec import to_array, to_list
from .frame_scan import MAX_ARRAY, FrameRefused, Tally, frame_cost
from .types import TOKEN_FIELDS, Group, Sample, TokenField

# Every way a frame can be refused; the service keeps a counter per name.
REASONS = (
    "oversized",
    "multipart",
    "truncated",
    "malformed",
    "extra_data",
    "bad_type",
    "bad_schema",
    "bad_dtype",
    "bad_shape",
    "length_mismatch",
    "unknown_op",
    "too_many_waiters",
    "bad_value",
    "unknown_producer",
    "too_many_producers",
    "producers_per_client",
    "duplicate_prompt",
    "not_owner",
    "oversized_message",
    "oversized_decoded",
)

# Little-endian only, so a frame means the same on every host.
INT_DTYPES = {d: np.dtype(d) for d in ("<i4", "<i8")}
FLOAT_DTYPES = {d: np.dtype(d) for d in ("<f2", "<f4", "<f8")}
BIT_DTYPES = {"|u1": np.dtype("|u1")}
KIND_DTYPES: dict[str, dict[str, np.dtype]] = {"int": INT_DTYPES, "float": FLOAT_DTYPES, "bit": BIT_DTYPES}
# the fields with one value per response token besides the tokens themselves: their lengths must agree
ALONG_RESPONSE = tuple(f.name for f in TOKEN_FIELDS if f.along == "response" and f.name != "response_ids")
RUNS = "runs:"  # the dtype prefix of an array sent as runs
RUN_ENDS = np.dtype("<i4")
MIN_RUNS_LEN = 2048  # shorter arrays travel plain (expanding runs costs more than their bytes)
GROUP_FIELDS = (("prompt_id", int), ("admitted_version", int), ("data_index", int), ("samples", list))
SAMPLE_FIELDS = (
    ("prompt_id", int),
    ("sample_index", int),
    ("reward", float),
    ("finish_reason", str),
    ("admitted_version", int),
    ("meta", dict),
) + tuple((f.name, (list, type(None)) if f.optional else list) for f in TOKEN_FIELDS)
ARRAY_PARTS = (("dtype", str), ("shape", list), ("data", bytes), ("was_list", bool))
META_TYPES = (type(None), bool, int, float, str)  # JSON's: a checkpoint writes meta as JSON
MAX_META_DEPTH = 8
# bytes of one Python list item per per-token value (an 8-byte slot + the number; 0 and 1 are shared)
LIST_ITEM = {"int": 8 + 36, "float": 8 + 24, "bit": 8}


class Budget:
    """The bytes of Python objects one message may decode to (``oversized_decoded`` past ``limit``).

    Each charge comes before what it pays for is built (a frame's values from its size or its
    headers, ``flash.buffers.frame_scan``; a group's lists and runs from its arrays' lengths): a frame's
    cost in memory is checked before it is decoded, never after."""

    __slots__ = ("limit", "spent")

    def __init__(self, limit: int):
        self.limit, self.spent = limit, 0

    def charge(self, nbytes: int, what: str) -> None:
        self.spent += nbytes
        if self.spent > self.limit:
            raise WireError(
                "oversized_decoded", f"{what} would take the message past {self.limit} bytes of decoded values"
            )


class WireError(ValueError):
    """A frame (or a value to encode) the schema refuses; ``reason`` is one of ``REASONS``."""

    def __init__(self, reason: str, detail: str):
        assert reason in REASONS, reason
        super().__init__(f"{reason}: {detail}")
        self.reason = reason


# ---------------------------------------------------------------------------------------- encoding


def pack(message: dict | list) -> bytes:
    """A control message or a group (already plain msgpack types) → one frame."""
    return msgpack.packb(message, use_bin_type=True)


def encode_group(group: Group) -> bytes:
    """A Group → its frame. Checked on this side too, so a producer's bug fails in the producer."""
    if not group.samples:
        raise WireError("bad_schema", f"group {group.prompt_id} has no samples")
    return pack(
        [
            _int(group.prompt_id, "group.prompt_id"),
            _int(group.admitted_version, "group.admitted_version"),
            _int(group.data_index, "group.data_index"),
            [_encode_sample(s, group.prompt_id) for s in group.samples],
        ]
    )


def _encode_sample(s: Sample, prompt_id: int) -> list:
    if s.prompt_id != prompt_id:
        raise WireError("bad_schema", f"sample of prompt {s.prompt_id} in group {prompt_id}")
    parts: list[list | None] = []
    lengths: dict[str, int] = {}
    for f in TOKEN_FIELDS:  # each per-token field → its array part (None: an optional field left out)
        value = getattr(s, f.name)
        if value is None and f.optional:
            parts.append(None)
            continue
        part = _encode_bits(value, f, prompt_id) if f.kind == "bit" else _encode_array(value, f)
        lengths[f.name] = part[1][0]
        parts.append(_as_runs(part) if f.runs else part)
    _check_lengths(lengths, prompt_id)
    if not isinstance(s.meta, dict):
        raise WireError("bad_type", f"meta must be a dict, got {type(s.meta).__name__}")
    _check_meta(s.meta, "meta", 0)
    return [
        _int(s.prompt_id, "prompt_id"),
        _int(s.sample_index, "sample_index"),
        float(s.reward),
        str(s.finish_reason),
        _int(s.admitted_version, "admitted_version"),
        s.meta,
        *parts,
    ]


def _encode_bits(value: Any, f: TokenField, prompt_id: int) -> list:
    """A list or array of 0/1 → a uint8 array part."""
    is_list = not isinstance(value, np.ndarray)
    arr = _list_array(value, f) if is_list else value
    if arr.ndim != 1 or arr.dtype.kind not in "iub":
        raise WireError("bad_type", f"{f.name} must be a 1-D list or array of 0/1, got {arr.dtype} {arr.shape}")
    if len(arr) and (arr.min() < 0 or arr.max() > 1):
        raise WireError("bad_value", f"prompt {prompt_id}: {f.name} holds values other than 0 and 1")
    return ["|u1", [len(arr)], arr.astype(np.uint8).tobytes(), is_list]


def _as_runs(part: list) -> list:
    """An encoded array part as runs when that is smaller (see the module docstring), else as is."""
    dtype, (n,), data, was_list = part
    if n < MIN_RUNS_LEN:
        return part
    arr = np.frombuffer(data, dtype=dtype)
    starts = np.flatnonzero(arr[1:] != arr[:-1]) + 1  # where a new run begins, after the first
    k = len(starts) + 1
    if k * (arr.itemsize + RUN_ENDS.itemsize) >= len(data):
        return part
    ends = np.empty(k, RUN_ENDS)
    ends[:-1], ends[-1] = starts, n
    return [RUNS + dtype, [n], arr[:1].tobytes() + arr[starts].tobytes() + ends.tobytes(), was_list]


def _encode_array(value: Any, f: TokenField) -> list:
    """NumPy array: its own (little-endian) dtype; list/tuple: int64 or float64, exact."""
    name, allowed = f.name, KIND_DTYPES[f.kind]
    if type(value) is np.ndarray and value.dtype.str in allowed and value.ndim == 1 and value.flags.c_contiguous:
        # packed without a copy; the ignore: numpy's stubs give ndarray the buffer protocol on Python >= 3.12 only
        return [value.dtype.str, [len(value)], memoryview(value).cast("B"), False]  # type: ignore[arg-type]
    is_list = not isinstance(value, np.ndarray)
    if is_list:
        arr = _narrow(_list_array(value, f))
    else:
        arr = value.astype(value.dtype.newbyteorder("<"), copy=False)
    if arr.dtype.str not in allowed:
        raise WireError("bad_dtype", f"{name}: dtype {value.dtype} not in {', '.join(allowed)}")
    if arr.ndim != 1:
        raise WireError("bad_shape", f"{name}: must be 1-D, got shape {arr.shape}")
    return [arr.dtype.str, [int(arr.shape[0])], np.ascontiguousarray(arr).tobytes(), is_list]


def _narrow(arr: np.ndarray) -> np.ndarray:
    """A list's int64 / float64 values as int32 / float32 when every value survives (token ids and
    versions fit; an engine's float32 logprobs are float32 values): half the bytes, and the
    consumer's list is the same, value for value."""
    if not arr.size:
        return arr
    if arr.dtype.kind == "i":
        return arr.astype("<i4") if -(1 << 31) <= arr.min() and arr.max() < (1 << 31) else arr
    narrow = arr.astype("<f4")
    return narrow if (narrow == arr).all() else arr  # (a NaN stays float64: NaN != NaN)


def _list_array(value: Any, f: TokenField) -> np.ndarray:
    """A list → int64 / float64 without silent conversion (``flash.buffers.codec.to_array``)."""
    try:
        return to_array(value, f)
    except (TypeError, ValueError, OverflowError) as exc:
        raise WireError(
            "bad_type",
            f"{f.name}: {exc}; expected a list of {'floats' if f.kind == 'float' else 'ints in the int64 range'}",
        ) from None


def _int(value: Any, name: str) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
        raise WireError("bad_type", f"{name} must be an int, got {type(value).__name__}")
    return int(value)


def _check_meta(value: Any, where: str, depth: int) -> None:
    """``meta`` travels as plain msgpack and is checkpointed as JSON: JSON's scalars, str-keyed dicts
    and lists, nested ≤ 8 deep."""
    if depth > MAX_META_DEPTH:
        raise WireError("bad_schema", f"{where} nests deeper than {MAX_META_DEPTH}")
    if isinstance(value, dict):
        for k, v in value.items():
            if not isinstance(k, str):
                raise WireError("bad_type", f"{where} key {k!r} is not a str")
            _check_meta(v, f"{where}[{k!r}]", depth + 1)
    elif isinstance(value, list):
        for i, v in enumerate(value):
            _check_meta(v, f"{where}[{i}]", depth + 1)
    elif not isinstance(value, META_TYPES):
        raise WireError(
            "bad_type",
            f"{where} is a {type(value).__name__}; meta holds only "
            "None/bool/int/float/str and lists/str-keyed dicts of them",
        )


# ---------------------------------------------------------------------------------------- decoding


def unpack(frame: bytes | memoryview, max_bytes: int, budget: Budget | None = None) -> Any:
    """One frame → plain msgpack values, or a WireError naming why not; ``budget``: charged with
    the most its values may take in memory, before anything is decoded (``flash.buffers.frame_scan``:
    a refused frame costs a walk over its bytes, never its values)."""
    if len(frame) > max_bytes:
        raise WireError("oversized", f"{len(frame)} bytes > limit {max_bytes}")
    try:
        charge = frame_cost(frame, budget.limit - budget.spent if budget is not None else 1 << 62)
    except FrameRefused as exc:
        raise WireError(exc.reason, exc.detail) from None
    tally = Tally(len(frame)) if charge is None and budget is not None else None
    hooks = {} if tally is None else {"list_hook": tally.on_list, "object_hook": tally.on_map}
    # the frame is whole and within the room (flash.buffers.frame_scan): msgpack's limits are a second line
    items = min(max(len(frame), 1), MAX_ARRAY)
    try:
        value = msgpack.unpackb(
            frame,
            raw=False,
            strict_map_key=True,
            ext_hook=_refuse_ext,
            max_bin_len=max_bytes,
            max_str_len=max_bytes,
            max_array_len=items,
            max_map_len=items,
            **hooks,
        )
    except WireError:
        raise
    except msgpack.ExtraData:
        raise WireError("extra_data", "bytes after the end of the message") from None
    except ValueError as exc:
        text = str(exc)
        reason = (
            "truncated"
            if "incomplete" in text or "exceeds max_" in text
            else "bad_type"
            if "map key" in text
            else "malformed"
        )  # keys must be str
        raise WireError(reason, str(exc) or type(exc).__name__) from None
    except Exception as exc:  # noqa: BLE001 - msgpack may raise TypeError etc. on hostile input
        raise WireError("malformed", f"{type(exc).__name__}: {exc}") from None
    if budget is not None:  # within the room: a tally is at most the frame's worst case
        budget.charge(tally.total if tally is not None else charge or 0, "a frame")
    return value


def _refuse_ext(code: int, data: bytes) -> Any:
    raise WireError("bad_type", f"msgpack extension type {code} is not accepted")


def decode_group(raw: Any, check: Callable[[Group], None] | None = None, budget: Budget | None = None) -> Group:
    """Validated plain values (from ``unpack``) → a Group, or a WireError.

    ``check`` (the service's value checks) sees the group while every per-token field is still a
    NumPy array: a check is then one pass over an array, where a list sent as a list would first
    have to be converted back. The fields that were lists become lists after it. ``budget`` is
    charged with what decoding builds (runs expanded, lists) from each array's dtype and length,
    before it is built."""
    prompt_id, admitted_version, data_index, samples = _fields(raw, GROUP_FIELDS, "group")
    if not samples:
        raise WireError("bad_schema", f"group {prompt_id} has no samples")
    decoded = [_decode_sample(s, prompt_id, budget) for s in samples]
    group = Group(
        prompt_id=prompt_id, samples=[s for s, _ in decoded], admitted_version=admitted_version, data_index=data_index
    )
    if check is not None:
        check(group)
    for sample, lists in decoded:
        for f in lists:
            setattr(sample, f.name, to_list(getattr(sample, f.name), f))
    return group


def _decode_sample(raw: Any, group_id: int, budget: Budget | None) -> tuple[Sample, list[TokenField]]:
    """The sample, its per-token fields as arrays, and the fields that were lists."""
    prompt_id, index, reward, finish, admitted, meta, *parts = _fields(raw, SAMPLE_FIELDS, "sample")
    if prompt_id != group_id:
        raise WireError("bad_schema", f"sample of prompt {prompt_id} in group {group_id}")
    values: dict[str, Any] = {}  # per-token arrays, where Sample declares lists (flash.buffers.types: either)
    lists: list[TokenField] = []
    for part, f in zip(parts, TOKEN_FIELDS):
        if part is None:  # an optional field left out (the schema allows nil for no other)
            continue
        runs_of = len(values["response_ids"]) if f.runs else None  # runs of the response's length
        values[f.name] = _decode_array(part, f, runs_of, budget)
        lists += [f] if part[3] else []
    _check_lengths({k: len(v) for k, v in values.items()}, prompt_id)
    _check_meta(meta, "meta", 0)
    return Sample(
        prompt_id=prompt_id,
        sample_index=index,
        reward=reward,
        finish_reason=finish,
        admitted_version=admitted,
        meta=meta,
        **values,
    ), lists


def _decode_array(raw: Any, f: TokenField, runs_of: int | None = None, budget: Budget | None = None) -> np.ndarray:
    """An array part → a read-only view over its bytes; ``runs_of``: the length an array sent as
    runs must have (None: it may not be runs)."""
    name, allowed = f.name, KIND_DTYPES[f.kind]
    dtype, shape, data, was_list = _fields(raw, ARRAY_PARTS, name)
    if runs_of is not None and dtype.startswith(RUNS):
        dt = _dtype(dtype[len(RUNS) :], name, allowed)
        if shape != [runs_of]:
            raise WireError("length_mismatch", f"{name}: runs of {shape!r} tokens for {runs_of} response tokens")
        if budget is not None:  # the expanded array, then the list it becomes
            budget.charge(runs_of * (dt.itemsize + (LIST_ITEM[f.kind] if was_list else 0)), name)
        return _expand_runs(dt, data, name, runs_of)
    dt = _dtype(dtype, name, allowed)
    if len(shape) != 1 or type(shape[0]) is not int or shape[0] < 0:
        raise WireError("bad_shape", f"{name}: shape must be [n] with n >= 0, got {shape!r}")
    if len(data) != shape[0] * dt.itemsize:
        raise WireError("bad_shape", f"{name}: {len(data)} bytes for shape {shape} of {dtype}")
    if budget is not None and was_list:
        budget.charge(shape[0] * LIST_ITEM[f.kind], name)
    return np.frombuffer(data, dtype=dt)  # a read-only view: no copy


def _dtype(dtype: str, name: str, allowed: dict[str, np.dtype]) -> np.dtype:
    dt = allowed.get(dtype)
    if dt is None:
        raise WireError("bad_dtype", f"{name}: dtype {dtype!r} not in {', '.join(allowed)}")
    return dt


def _expand_runs(dt: np.dtype, data: bytes, name: str, n: int) -> np.ndarray:
    k, rest = divmod(len(data), dt.itemsize + RUN_ENDS.itemsize)
    if rest or (k == 0) != (n == 0):
        raise WireError("bad_shape", f"{name}: {len(data)} bytes are not whole runs of {dt.str} + {RUN_ENDS.str}")
    values, ends = np.frombuffer(data, dt, k), np.frombuffer(data, RUN_ENDS, k, k * dt.itemsize)
    lengths = ends.copy()
    np.subtract(ends[1:], ends[:-1], out=lengths[1:])
    if k and (lengths.min() <= 0 or ends[-1] != n):
        raise WireError("bad_shape", f"{name}: run ends must increase from above 0 to {n}")
    out = np.repeat(values, lengths)
    out.flags.writeable = False  # like every other array from a frame
    return out


def _fields(raw: Any, schema: tuple[tuple[str, type | tuple[type, ...]], ...], where: str) -> list:
    """Exactly the schema's fields, in order, each of its type (a bool is not an int, an int not a
    float: ``type(v) is t``, which is also the fast check)."""
    if type(raw) is not list or len(raw) != len(schema):
        raise WireError(
            "bad_schema",
            f"{where} must be an array of {len(schema)} fields "
            f"({', '.join(n for n, _ in schema)}), got {_describe(raw)}",
        )
    for value, (key, typ) in zip(raw, schema):
        if type(value) is not typ and not (type(typ) is tuple and type(value) in typ):
            names = " or ".join(t.__name__ for t in (typ if isinstance(typ, tuple) else (typ,)))
            raise WireError("bad_type", f"{where}.{key} must be {names}, got {type(value).__name__}")
    return raw


def _describe(raw: Any) -> str:
    return f"{len(raw)} fields" if isinstance(raw, list) else type(raw).__name__


def _check_lengths(lengths: dict[str, int], prompt_id: int) -> None:
    """Each response token has exactly one behaviour logprob and one version (invariants 1, 3), and
    one loss-mask entry when the sample has a mask."""
    n = lengths["response_ids"]
    per_token = {k: lengths[k] for k in ALONG_RESPONSE if k in lengths}
    if any(m != n for m in per_token.values()):
        raise WireError(
            "length_mismatch",
            f"prompt {prompt_id}: {n} response tokens, "
            + ", ".join(f"{m} {_LABELS.get(k, k)}" for k, m in per_token.items()),
        )


_LABELS = {"behav_logprobs": "logprobs", "loss_mask": "loss_mask entries"}
