"""The buffer service's wire codec (flash/buffers/wire.py): a group comes back value for value and
type for type, and each kind of bad frame is refused with its named reason.

- Lists and arrays round-trip exactly (narrowed to int32 / float32 only where every value fits);
  a multi-turn sample's loss mask travels and a bad one is refused by name.
- Each spoiled field of a valid frame, and each frame-level fault (truncated, extra data,
  malformed, oversized), is refused under its reason; the encoder refuses what it cannot send.
- Versions and loss masks travel as runs when that is smaller, and bad runs are refused.
(The service itself, over zmq: test_buffer_service.py.)
"""

from __future__ import annotations

import msgpack
import numpy as np
import pytest

from flash.buffers import Group, Sample
from flash.buffers.guard import ValueLimits, check_values
from flash.buffers.wire import WireError, decode_group, encode_group, unpack
from tests.helpers.wire import MB, make_group, same


def test_codec_round_trip_is_exact_for_lists_and_arrays():
    lists = make_group(3, length=6)
    lists.samples[0].response_ids[0] = 2**40  # wider than int32: lists travel as int64, exactly
    lists.samples[0].behav_logprobs[1] = 0.1  # not a float32 value: lists travel as float64
    lists.samples[1].behav_logprobs[2] = float("-inf")
    arrays = make_group(4, length=6, arrays=True)
    arrays.samples[1].behav_logprobs = arrays.samples[1].behav_logprobs.astype(np.float16)
    arrays.samples[1].response_ids = arrays.samples[1].response_ids.astype(np.int64)
    vs = arrays.samples[1].versions
    arrays.samples[1].versions = np.stack([vs, vs + 1], axis=1)[:, 0]  # a strided view: still exact
    empty = Group(
        prompt_id=9,
        samples=[Sample(prompt_id=9, sample_index=0, prompt_ids=[1], admitted_version=4)],
        admitted_version=4,
    )
    for g in (lists, arrays, empty):
        back = decode_group(unpack(encode_group(g), MB))
        assert same(back, g) and back.version == g.version
    # lists whose values fit go as int32 / float32 too (an engine's float32 logprobs, its token ids);
    # one value that does not fit keeps its field wide, and the list still comes back exactly
    assert len(encode_group(make_group(4, length=6))) == len(encode_group(make_group(4, length=6, arrays=True)))
    assert len(encode_group(lists)) > len(encode_group(make_group(3, length=6)))
    assert [type(v) for v in decode_group(unpack(encode_group(lists), MB)).samples[1].behav_logprobs] == [float] * 6
    back = decode_group(unpack(encode_group(arrays), MB))
    assert not back.samples[0].response_ids.flags.writeable  # a view over the frame: no copy
    assert back.version == 0 and empty.version == 4
    assert back.samples[0].response_ids.tobytes() == arrays.samples[0].response_ids.tobytes()


def test_a_loss_mask_travels_and_a_bad_one_is_refused_by_name():
    """A multi-turn sample's observation tokens (mask 0) must stay untrained after the wire."""
    g = make_group(3, length=6)
    g.samples[0].loss_mask = [1, 1, 0, 0, 0, 1]
    g.samples[1].loss_mask = np.array([1, 0, 1, 0, 1, 1], dtype=np.int64)
    back = decode_group(unpack(encode_group(g), MB))
    assert same(back, g)
    assert back.samples[0].loss_mask == [1, 1, 0, 0, 0, 1]
    assert back.samples[1].loss_mask.dtype == np.uint8 and back.samples[1].loss_mask.tolist() == [1, 0, 1, 0, 1, 1]
    for mask, reason in (([1, 0, 2, 1, 1, 1], "bad_value"), ([1, 0, 1], "length_mismatch"), ([0.5] * 6, "bad_type")):
        g.samples[0].loss_mask = mask
        with pytest.raises(WireError) as err:
            encode_group(g)
        assert err.value.reason == reason
    g.samples[0].loss_mask = [1] * 6
    for spoil, reason in (
        (lambda m: m.__setitem__(0, "<i4"), "bad_dtype"),
        (lambda m: m.__setitem__(1, [5]), "bad_shape"),
        (lambda m: (m.__setitem__(1, [5]), m.__setitem__(2, b"\x01" * 5)), "length_mismatch"),
    ):
        raw = unpack(encode_group(g), MB)
        spoil(raw[3][0][LOSS_MASK])
        with pytest.raises(WireError) as err:
            decode_group(unpack(msgpack.packb(raw), MB))
        assert err.value.reason == reason, (reason, err.value)
    raw = unpack(encode_group(g), MB)
    raw[3][0][LOSS_MASK][2] = b"\x01\x01\x07\x01\x01\x01"  # a well-formed mask holding a 7
    with pytest.raises(WireError, match="bad_value: group 3 sample 0: loss_mask holds 7 > 1"):
        check_values(decode_group(unpack(msgpack.packb(raw), MB)), ValueLimits(), max_version=10)


# positions in the wire layout (flash.buffers.wire): group [pid, admitted, data_index, samples];
# sample [pid, index, reward, finish, admitted, meta, prompt_ids, response_ids, logprobs, versions, loss_mask];
# array [dtype, shape, data, was_list]
RESPONSE, LOGPROBS, VERSIONS, LOSS_MASK = 7, 8, 9, 10


def _mutations():
    """(how to spoil a valid group frame, the reason the decoder must name)."""

    def arr(field, part, value):
        return lambda g: g[3][0][field].__setitem__(part, value)

    return [
        (lambda g: g.__setitem__(0, True), "bad_type"),  # a bool is not an int
        (lambda g: g.append(1), "bad_schema"),
        (lambda g: g.pop(2), "bad_schema"),
        (lambda g: g.__setitem__(3, []), "bad_schema"),
        (lambda g: g.__setitem__(3, {}), "bad_type"),
        (lambda g: g[3][0].__setitem__(2, "1"), "bad_type"),  # reward
        (lambda g: g[3][0].__setitem__(2, 1), "bad_type"),  # an int is not a float
        (lambda g: g[3][0].__setitem__(0, 99), "bad_schema"),  # sample of another prompt
        (lambda g: g[3][0].__setitem__(5, {1: 2}), "bad_type"),  # (re-packed: a non-str meta key)
        (arr(RESPONSE, 0, "<u1"), "bad_dtype"),
        (arr(RESPONSE, 0, ">i8"), "bad_dtype"),  # big-endian: refused, not misread
        (arr(LOGPROBS, 0, "<i8"), "bad_dtype"),  # logprobs must be floats
        (arr(VERSIONS, 0, "|O"), "bad_dtype"),  # objects never
        (arr(RESPONSE, 1, [2, 3]), "bad_shape"),
        (arr(RESPONSE, 1, [-1]), "bad_shape"),
        (arr(RESPONSE, 2, b"\x00" * 7), "bad_shape"),
        (arr(VERSIONS, 1, [0]), "bad_shape"),
        (arr(VERSIONS, 3, 0), "bad_type"),
        (lambda g: g[3][0].__setitem__(RESPONSE, {"dtype": "<i8"}), "bad_type"),  # a map, not an array
        (lambda g: g[3][0].__setitem__(RESPONSE, ["<i8", [0], b""]), "bad_schema"),  # 3 parts of 4
        (lambda g: g[3][0].__setitem__(LOSS_MASK, {}), "bad_type"),  # nil or an array
    ]


def test_decoder_names_the_reason_for_each_bad_field():
    for mutate, reason in _mutations():
        raw = unpack(encode_group(make_group(5)), MB)
        mutate(raw)
        with pytest.raises(WireError) as err:
            decode_group(unpack(msgpack.packb(raw, strict_types=False), MB))
        assert err.value.reason == reason, (reason, err.value)
    raw = unpack(encode_group(make_group(5)), MB)  # consistent bytes and shape, wrong length
    raw[3][1][VERSIONS] = ["<i8", [4], b"\x00" * 32, True]
    with pytest.raises(WireError, match="length_mismatch: prompt 5: 5 response tokens, 5 logprobs, 4 versions"):
        decode_group(unpack(msgpack.packb(raw), MB))


def test_frame_level_rejections_and_encoder_checks():
    frame = encode_group(make_group(6))
    cases = [
        (frame[: len(frame) // 2], "truncated"),
        (frame[:1], "truncated"),
        (frame + b"\x00", "extra_data"),
        (b"\xc1", "malformed"),
        (msgpack.packb(msgpack.ExtType(1, b"x")), "bad_type"),
        (frame, "oversized"),
    ]
    for bad, reason in cases:
        with pytest.raises(WireError) as err:
            unpack(bad, 100 if reason == "oversized" else MB)
        assert err.value.reason == reason
    g = make_group(6)
    g.samples[0].response_ids[1] = 1.5  # a float among token ids is an error, not truncated to 1
    with pytest.raises(WireError, match="bad_type: response_ids"):
        encode_group(g)
    g = make_group(6)
    g.samples[0].meta["obj"] = object()  # meta must be plain data: nothing to unpickle on the far side
    with pytest.raises(WireError, match=r"bad_type: meta\['obj'\] is a object"):
        encode_group(g)
    g = make_group(6)
    g.samples[0].meta["raw"] = b"\x00"  # checkpoints write meta as JSON, which has no bytes
    with pytest.raises(WireError, match=r"bad_type: meta\['raw'\] is a bytes"):
        encode_group(g)
    g = make_group(6, arrays=True)
    g.samples[0].versions = g.samples[0].versions[:3]
    with pytest.raises(WireError, match="length_mismatch"):
        encode_group(g)


def test_versions_and_masks_travel_as_runs_when_smaller_and_bad_runs_are_refused():
    n = 4096
    g = make_group(21, n=3, length=n, arrays=True)
    g.samples[0].versions = np.full(n, 7, dtype=np.int32)  # one run
    g.samples[1].versions = np.repeat(np.array([2, 3, 5], dtype=np.int64), [100, 3000, 996])  # three
    g.samples[2].versions = (np.arange(n) % 2).tolist()  # alternating: plain is smaller
    g.samples[1].loss_mask = [1] * 1000 + [0] * 96 + [1] * 3000
    frame = encode_group(g)
    raw = unpack(frame, MB)
    assert [s[VERSIONS][0] for s in raw[3]] == ["runs:<i4", "runs:<i8", "<i4"]  # the list narrowed
    assert raw[3][1][LOSS_MASK][0] == "runs:|u1" and len(raw[3][1][LOSS_MASK][2]) == 3 * 5
    assert len(raw[3][0][VERSIONS][2]) == 8  # 4 + 4 bytes instead of 16 KiB
    back = decode_group(unpack(frame, MB))
    assert same(back, g) and back.samples[1].loss_mask == g.samples[1].loss_mask
    assert back.samples[1].versions.dtype == np.int64 and back.samples[0].version == 7
    assert not back.samples[0].versions.flags.writeable
    short = make_group(22, n=1, length=100, arrays=True)  # below MIN_RUNS_LEN: always plain
    assert unpack(encode_group(short), MB)[3][0][VERSIONS][0] == "<i4"

    def spoiled(part):
        raw = unpack(frame, MB)
        raw[3][0][VERSIONS] = part
        return msgpack.packb(raw)

    ends = np.array([n], dtype="<i4").tobytes()
    seven = np.array([7], dtype="<i4").tobytes()
    for part, reason in (
        (["runs:<i4", [10**9], seven + ends, False], "length_mismatch"),  # asks for a huge array
        (["runs:<f4", [n], seven + ends, False], "bad_dtype"),
        (["runs:<i4", [n], seven + ends + b"\x00", False], "bad_shape"),
        (["runs:<i4", [n], seven + np.array([n - 1], "<i4").tobytes(), False], "bad_shape"),
        (["runs:<i4", [n], seven * 2 + np.array([9, 3], "<i4").tobytes(), False], "bad_shape"),
        (["runs:<i4", [n], b"", False], "bad_shape"),
    ):
        with pytest.raises(WireError) as err:
            decode_group(unpack(spoiled(part), MB))
        assert err.value.reason == reason, (part, err.value)
    raw = unpack(frame, MB)
    raw[3][0][RESPONSE] = ["runs:<i4", [n], seven + ends, False]  # only versions and masks may be runs
    with pytest.raises(WireError, match="bad_dtype: response_ids"):
        decode_group(unpack(msgpack.packb(raw), MB))
