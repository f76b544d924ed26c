"""Cached values: one leading format-version byte, then a msgpack array.

Layout (FORMAT_VERSION 1)::

    b"\\x01" + msgpack([text, tokens, finish_reason, model_version, group_id, created_at])

    text, finish_reason, model_version: str; group_id: int or nil; created_at: float64;
    tokens: bin, little-endian int32 token ids (4 bytes each).

A positional array rather than a map: smaller and faster to unpack, and the version byte
says how to read it. Tokens travel packed: one C call reads them back, and a wrong length
is caught for free, where a msgpack list would need a per-element type check. A reader that meets another version byte, a truncated or garbled
payload, or fields of the wrong type raises `CodecError`; the cache treats that as a miss
and deletes the value, so a format change never serves garbage and heals itself.
"""

from __future__ import annotations

import operator
import sys
from array import array
from collections.abc import Mapping
from typing import Any, NamedTuple

import msgpack

FORMAT_VERSION = 1
_VERSION_BYTE = bytes([FORMAT_VERSION])
_SWAP = sys.byteorder == "big"  # the stored form is little-endian everywhere
_I32 = next(code for code in "ilh" if array(code).itemsize == 4)


class CodecError(ValueError):
    """A stored value that cannot be read back (wrong version, truncated, garbage)."""


class Record(NamedTuple):
    """One cached response (immutable; a NamedTuple because it is built on every L2 hit and
    costs a fifth of a frozen dataclass to construct).

    Attributes:
        text: the generated text.
        tokens: the generated token ids.
        finish_reason: why generation stopped, e.g. "stop" or "length".
        model_version: the weights fingerprint the response came from.
        group_id: the embedding-cluster id (knowledge-refresh group), None when ungrouped.
        created_at: Unix time (seconds) when the response was generated.
    """

    text: str
    tokens: tuple[int, ...]
    finish_reason: str
    model_version: str
    group_id: int | None
    created_at: float


def fields_of(result: Any) -> tuple[str, tuple[int, ...], str]:
    """Reads (text, tokens, finish_reason) from what a generate callable returned.

    Args:
        result: a mapping with keys "text", "tokens", "finish_reason", or an object with
            those attributes (e.g. a result dataclass).

    Returns:
        The three fields, tokens as a tuple of ints.

    Raises:
        ValueError: a field is missing or of the wrong type.
    """
    get = result.get if isinstance(result, Mapping) else lambda name: getattr(result, name, None)
    text, tokens, finish_reason = get("text"), get("tokens"), get("finish_reason")
    if not isinstance(text, str):
        raise ValueError(f"generate result text={text!r} must be a str")
    if not isinstance(finish_reason, str):
        raise ValueError(f"generate result finish_reason={finish_reason!r} must be a str")
    try:
        tokens = tuple(operator.index(t) for t in tokens)
        array(_I32, tokens)
    except (TypeError, ValueError, OverflowError):
        raise ValueError(
            f"generate result tokens={tokens!r} must be a sequence of int32 token ids"
        ) from None
    return text, tokens, finish_reason


def encode(record: Record) -> bytes:
    """Serialises a record.

    Args:
        record: the response.

    Returns:
        The version byte followed by the msgpack payload.
    """
    tokens = array(_I32, record.tokens)
    if _SWAP:
        tokens.byteswap()
    payload = msgpack.packb(
        [
            record.text,
            tokens.tobytes(),
            record.finish_reason,
            record.model_version,
            record.group_id,
            float(record.created_at),
        ],
        use_bin_type=True,
    )
    return _VERSION_BYTE + payload


def decode(data: bytes) -> Record:
    """Reads a record back.

    Args:
        data: bytes written by `encode`.

    Returns:
        The record.

    Raises:
        CodecError: wrong version byte, truncated or garbled payload, or wrong field types.
    """
    if not data or data[0] != FORMAT_VERSION:
        head = data[:1].hex() or "empty"
        raise CodecError(f"value format byte {head} is not {FORMAT_VERSION:02x}")
    try:
        fields = msgpack.unpackb(data[1:], use_list=False)
    except Exception as e:  # msgpack raises several types for truncated/garbled input
        raise CodecError(f"value payload does not unpack: {type(e).__name__}: {e}") from None
    if type(fields) is not tuple or len(fields) != 6:
        raise CodecError("value payload is not a 6-field array")
    text, packed, finish_reason, model_version, group_id, created_at = fields
    if (
        type(text) is not str
        or type(packed) is not bytes
        or len(packed) % 4
        or type(finish_reason) is not str
        or type(model_version) is not str
        or not (group_id is None or type(group_id) is int)
        or type(created_at) is not float
    ):
        raise CodecError("value payload fields have the wrong types")
    tokens = array(_I32, packed)
    if _SWAP:
        tokens.byteswap()
    return Record(text, tuple(tokens), finish_reason, model_version, group_id, created_at)
