"""One per-token field table (flash.buffers.types.TOKEN_FIELDS) and one Sample/Group codec (flash.buffers.codec):
every field of the table goes through every encoding -- the buffer service's wire, a checkpoint's
JSON, the schedule record -- and comes back value for value and type for type; files in the
layouts the readers accept load the same."""

import dataclasses
import json

import numpy as np
import pytest

from flash.buffers.codec import CodecError, group_from_dict, group_to_dict, to_array, to_list
from flash.buffers.types import TOKEN_FIELDS, Group, Sample
from flash.buffers.wire import decode_group, encode_group, unpack
from flash.app.schedule import groups_from_line, step_line
from flash.errors import FlashError

N = 5  # response tokens
# per kind: values a lax encoding would change (ints beyond int32, floats that are not float32 values)
VALUES = {
    "int": [70000, -3, 1 << 40, 0, 7],
    "float": [0.1, -2.5, 1e-300, -0.0, -1234.5678901234567],
    "bit": [1, 0, 0, 1, 1],
}


def _group(**fields) -> Group:
    tokens = {
        "prompt_ids": [1, 2, 3],
        "response_ids": list(range(10, 10 + N)),
        "behav_logprobs": [-0.5] * N,
        "versions": [2] * N,
    }
    s = Sample(
        prompt_id=4, sample_index=1, reward=0.25, finish_reason="stop", admitted_version=2, **{**tokens, **fields}
    )
    return Group(prompt_id=4, samples=[s], admitted_version=2, data_index=9)


def _wire(g: Group) -> Group:
    return decode_group(unpack(encode_group(g), 1 << 20))


def _checkpoint(g: Group) -> Group:
    return group_from_dict(json.loads(json.dumps(group_to_dict(g))))


def _schedule(g: Group) -> Group:
    return groups_from_line(json.loads(json.dumps(step_line(0, [g], {"loss": 1.0}, {}))))[0]


ENCODINGS = {"wire": _wire, "checkpoint": _checkpoint, "schedule": _schedule}


def test_the_table_lists_every_per_token_field_of_a_sample_with_its_kind():
    listed = {f.name: f.type for f in dataclasses.fields(Sample) if f.type.startswith("list[")}
    assert list(listed) == [f.name for f in TOKEN_FIELDS]
    for f in TOKEN_FIELDS:
        assert listed[f.name].startswith(f"list[{f.python.__name__}]"), f
        assert f.optional == listed[f.name].endswith("| None"), f
    assert [f.name for f in TOKEN_FIELDS if f.kind == "bit"] == ["loss_mask"]
    assert [f.name for f in TOKEN_FIELDS if f.along == "prompt"] == ["prompt_ids"]


@pytest.mark.parametrize("encoding", ENCODINGS)
@pytest.mark.parametrize("field", TOKEN_FIELDS, ids=lambda f: f.name)
def test_every_field_of_the_table_round_trips_through_every_encoding(field, encoding):
    values = VALUES[field.kind]
    back = ENCODINGS[encoding](_group(**{field.name: list(values)})).samples[0]
    assert getattr(back, field.name) == values
    assert [type(v) for v in getattr(back, field.name)] == [field.python] * len(values)
    if field.optional:
        assert getattr(ENCODINGS[encoding](_group(**{field.name: None})).samples[0], field.name) is None


@pytest.mark.parametrize("encoding", ENCODINGS)
@pytest.mark.parametrize("field", TOKEN_FIELDS, ids=lambda f: f.name)
def test_numpy_arrays_are_written_as_the_same_values(field, encoding):
    dtype = {"int": "<i8", "float": "<f4", "bit": "|u1"}[field.kind]
    arr = np.array(VALUES[field.kind], dtype=dtype)
    back = getattr(ENCODINGS[encoding](_group(**{field.name: arr})).samples[0], field.name)
    assert np.asarray(back).tolist() == arr.tolist()  # a float32 logprob as the float64 holding it
    assert isinstance(back, np.ndarray) == (encoding == "wire")  # the wire hands arrays back as arrays


@pytest.mark.parametrize(
    "field", [f for f in TOKEN_FIELDS if f.along == "response" and f.name != "response_ids"], ids=lambda f: f.name
)
def test_a_per_token_field_of_another_length_is_refused_by_every_reader(field):
    d = group_to_dict(_group())
    d["samples"][0][field.name] = VALUES[field.kind][: N - 1]
    with pytest.raises(CodecError, match=f"group sample 0: {field.name} has 4 entries for 5 response tokens"):
        group_from_dict(d)


@pytest.mark.parametrize(
    "key, value, message",
    [
        ("loss_mask", [1, 0, 2, 1, 1], "loss_mask holds something other than 0 and 1"),
        ("versions", [1, 1, 1.0, 1, 1], "versions holds something that is not an integer"),
        ("prompt_ids", [1, True], "prompt_ids holds something that is not an integer"),
        ("behav_logprobs", [0.0, "x", 0.0, 0.0, 0.0], "behav_logprobs holds something that is not a number"),
        ("prompt_id", 5, "field 'prompt_id' is 5, not its group's 4"),
        ("finish_reason", None, "field 'finish_reason' is missing or not str"),
        ("meta", [], "field 'meta' is not an object"),
    ],
)
def test_a_bad_field_is_one_error_naming_it(key, value, message):
    d = group_to_dict(_group(loss_mask=[1] * N))
    d["samples"][0][key] = value
    with pytest.raises(CodecError, match=message):
        group_from_dict(d, "ckpt-3 buffer group 0")


def test_a_checkpoint_holds_a_group_as_asdict_writes_it():
    """state.json files hold the buffer's groups in ``dataclasses.asdict``'s layout, byte for byte."""
    g = _group(loss_mask=[1, 1, 0, 0, 1], meta={"request_id": "4:1", "nested": {"k": [1, 2.5]}})
    assert json.dumps(group_to_dict(g)) == json.dumps(dataclasses.asdict(g))
    assert group_from_dict(json.loads(json.dumps(dataclasses.asdict(g)))) == g


def test_a_schedule_line_with_the_short_keys_reads_the_same():
    """A schedule sample written as {index, finish, ...} without prompt_id and meta."""
    old = {
        "index": 1,
        "prompt_ids": [1, 2, 3],
        "response_ids": [10, 11, 12, 13, 14],
        "behav_logprobs": [-0.5] * N,
        "versions": [2] * N,
        "reward": 0.25,
        "finish": "stop",
        "admitted_version": 2,
        "loss_mask": None,
        "interrupts": [],
    }
    line = {"step": 0, "groups": [{"prompt_id": 4, "data_index": 9, "admitted_version": 2, "samples": [old]}]}
    assert groups_from_line(line) == [_group()]
    line["groups"][0]["samples"][0]["reward"] = float("nan")
    with pytest.raises(
        FlashError, match="schedule step 0 group 0 sample 0: reward nan: a reward is a finite number, not nan"
    ):
        groups_from_line(line)


def test_one_conversion_between_lists_and_arrays():
    ints, floats, bits = TOKEN_FIELDS[1], TOKEN_FIELDS[2], TOKEN_FIELDS[4]
    assert to_array([1, 1 << 40], ints).dtype == np.dtype("<i8")
    assert to_array([0.5, 1], floats).tolist() == [0.5, 1.0]
    for bad, field in (([1, 0.5], ints), ([1, "x"], floats), ((1 << 63,), bits), ("12", ints)):
        with pytest.raises((TypeError, OverflowError)):
            to_array(bad, field)
    assert to_list(np.array([True, False]), bits) == [1, 0] and type(to_list(np.array([True]), bits)[0]) is int
    assert to_list([np.float32(0.1)], floats) == [float(np.float32(0.1))]
    assert to_list(np.array([1, 2], "<i4"), floats) == [1.0, 2.0]
