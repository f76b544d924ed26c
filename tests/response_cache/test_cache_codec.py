"""Values: round trips, and every way a stored value can be unreadable."""

from __future__ import annotations

import msgpack
import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from jkv.response_cache.codec import FORMAT_VERSION, CodecError, Record, decode, encode, fields_of

records = st.builds(
    Record,
    text=st.text(),
    tokens=st.lists(st.integers(-(2**31), 2**31 - 1)).map(tuple),
    finish_reason=st.sampled_from(["stop", "length", "eos"]),
    model_version=st.text(max_size=20),
    group_id=st.none() | st.integers(0, 2**32),
    created_at=st.floats(0, 4e9),
    kv_bytes=st.integers(0, 2**40),
    stats=st.dictionaries(
        st.text(max_size=10),
        st.none()
        | st.booleans()
        | st.integers(-(2**40), 2**40)
        | st.floats(allow_nan=False)
        | st.text(max_size=10)
        | st.lists(st.integers(0, 2**20), max_size=4),
        max_size=5,
    ),
)


@given(records)
def test_round_trip(record):
    data = encode(record)
    assert data[0] == FORMAT_VERSION
    assert decode(data) == record


def test_layout_is_the_documented_one():
    data = encode(Record("hi", (1, 258), "stop", "v1", 3, 2.5, 4096, {"prompt_tokens": 7}))
    assert data == b"\x02" + msgpack.packb(
        ["hi", b"\x01\0\0\0\x02\x01\0\0", "stop", "v1", 3, 2.5, 4096, {"prompt_tokens": 7}],
        use_bin_type=True,
    )


def test_values_of_the_previous_schema_are_rejected():
    old = b"\x01" + msgpack.packb(["hi", b"\x01\0\0\0", "stop", "v1", None, 2.5])
    with pytest.raises(CodecError, match="format byte 01"):
        decode(old)


@given(records, st.data())
def test_every_truncation_is_a_codec_error(record, data):
    encoded = encode(record)
    cut = data.draw(st.integers(0, len(encoded) - 1))
    with pytest.raises(CodecError):
        decode(encoded[:cut])


@given(st.binary(max_size=200))
def test_garbage_is_a_codec_error_or_a_record(garbage):
    for data in (garbage, bytes([FORMAT_VERSION]) + garbage):
        try:
            assert isinstance(decode(data), Record)
        except CodecError:
            pass


@given(records, st.integers(0, 255).filter(lambda b: b != FORMAT_VERSION))
def test_other_format_versions_are_rejected(record, version):
    with pytest.raises(CodecError, match="format byte"):
        decode(bytes([version]) + encode(record)[1:])


@pytest.mark.parametrize(
    "fields",
    [
        ["t", b"\x01\0\0\0", "stop", "v", None, 1.0, 0],  # too few
        ["t", b"\x01\0\0\0", "stop", "v", None, 1.0, 0, {}, "extra"],
        [b"t", b"\x01\0\0\0", "stop", "v", None, 1.0, 0, {}],  # bytes text
        ["t", [1], "stop", "v", None, 1.0, 0, {}],  # tokens as a list
        ["t", b"\x01\0\0", "stop", "v", None, 1.0, 0, {}],  # tokens not whole int32s
        ["t", b"\x01\0\0\0", "stop", "v", "7", 1.0, 0, {}],  # str group
        ["t", b"\x01\0\0\0", "stop", "v", None, 1, 0, {}],  # int time
        ["t", b"\x01\0\0\0", "stop", "v", None, 1.0, -1, {}],  # negative kv_bytes
        ["t", b"\x01\0\0\0", "stop", "v", None, 1.0, 1.5, {}],  # float kv_bytes
        ["t", b"\x01\0\0\0", "stop", "v", None, 1.0, 0, [1]],  # stats not a map
        ["t", b"\x01\0\0\0", "stop", "v", None, 1.0, 0, {1: 1}],  # int stats key
        {"text": "t"},
    ],
    ids=[
        "short",
        "long",
        "bytes_text",
        "token_list",
        "token_bytes",
        "str_group",
        "int_time",
        "negative_kv_bytes",
        "float_kv_bytes",
        "stats_list",
        "int_stats_key",
        "map",
    ],
)
def test_wrong_field_types_are_rejected(fields):
    with pytest.raises(CodecError):
        decode(bytes([FORMAT_VERSION]) + msgpack.packb(fields, use_bin_type=True))


class Result:
    text = "hi"
    tokens = [1, 2]
    finish_reason = "stop"
    kv_bytes = np.int64(512)
    stats = {"prefill_s": np.float32(0.5), "kv_capacity": (16, 16), "policy": {"k": np.int32(3)}}


def test_result_kv_bytes_and_stats_become_plain_data():
    assert fields_of(Result())[3:] == (
        512,
        {"prefill_s": 0.5, "kv_capacity": [16, 16], "policy": {"k": 3}},
    )
    bare = {"text": "hi", "tokens": [1], "finish_reason": "stop"}
    assert fields_of(bare)[3:] == (0, {})
    with pytest.raises(ValueError, match=r"stats\['x'\]=<object"):
        fields_of({**bare, "stats": {"x": object()}})
    with pytest.raises(ValueError, match="kv_bytes=-1"):
        fields_of({**bare, "kv_bytes": -1})


def test_fields_from_mapping_or_object():
    expected = ("hi", (1, 2), "stop")
    assert fields_of({"text": "hi", "tokens": (1, 2), "finish_reason": "stop"})[:3] == expected
    assert fields_of(Result())[:3] == expected
    with pytest.raises(ValueError, match="tokens="):
        fields_of({"text": "hi", "tokens": ["1"], "finish_reason": "stop"})
    with pytest.raises(ValueError, match="tokens="):
        fields_of({"text": "hi", "tokens": [1.5], "finish_reason": "stop"})
    with pytest.raises(ValueError, match="int32"):
        fields_of({"text": "hi", "tokens": [2**31], "finish_reason": "stop"})
    with pytest.raises(ValueError, match="text="):
        fields_of(object())
