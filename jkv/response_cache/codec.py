"""Cached values: one leading format-version byte, then a msgpack array.

Layout (FORMAT_VERSION 2)::

    b"\\x02" + msgpack([text, tokens, finish_reason, model_version, group_id, created_at,
                        kv_bytes, stats])

    text, finish_reason, model_version: str; group_id: int or nil; created_at: float64;
    tokens: bin, little-endian int32 token ids (4 bytes each); kv_bytes: int >= 0 (the KV
    bytes of the generation that produced the value); stats: map of str to plain values (that
    generation's statistics).

A positional array rather than a map: smaller and faster to unpack, and the version byte
says how to read it. Tokens travel packed: one C call reads them back, and a wrong length
is caught for free, where a msgpack list would need a per-element type check. A reader that
meets another version byte (version 1 values lack kv_bytes and stats), a truncated or garbled
payload, or fields of the wrong type raises `CodecError`; the cache treats that as a miss
and deletes the value, so a format change never serves garbage and heals itself.
"""

from __future__ import annotations

import operator
import struct
from collections.abc import Mapping
from typing import Any, NamedTuple

import msgpack

FORMAT_VERSION = 2
_VERSION_BYTE = bytes([FORMAT_VERSION])
# The field types a payload must have, with and without a group id: one tuple comparison
# checks them all on the L2 hit path.
_TYPES = (str, bytes, str, str, int, float, int, dict)
_TYPES_UNGROUPED = (str, bytes, str, str, type(None), float, int, dict)


class CodecError(ValueError):
    """A stored value that cannot be read back (wrong version, truncated, garbage)."""


class Record(NamedTuple):
    """One cached response (a NamedTuple because it is built on every L2 hit and costs a fifth
    of a frozen dataclass to construct). Treat `stats` as read-only: L1 shares it between hits.

    Attributes:
        text: the generated text.
        tokens: the generated token ids.
        finish_reason: why generation stopped, e.g. "stop" or "length".
        model_version: the identity of the model the response came from.
        group_id: the embedding-cluster id (knowledge-refresh group), None when ungrouped.
        created_at: Unix time (seconds) when the response was generated.
        kv_bytes: the KV-state bytes of the generation that produced it.
        stats: that generation's statistics (plain data: str keys; None, bool, int, float, str,
            lists and maps of these).
    """

    text: str
    tokens: tuple[int, ...]
    finish_reason: str
    model_version: str
    group_id: int | None
    created_at: float
    kv_bytes: int = 0
    stats: dict = {}  # noqa: RUF012 -- shared default, never mutated (see the class docstring)


def fields_of(result: Any) -> tuple[str, tuple[int, ...], str, int, dict]:
    """Reads what a record keeps from what a generate callable returned.

    Args:
        result: a mapping with keys "text", "tokens", "finish_reason" and optionally
            "kv_bytes" and "stats", or an object with those attributes (e.g. a result
            dataclass).

    Returns:
        (text, tokens as a tuple of ints, finish_reason, kv_bytes (0 when absent), stats as
        plain data (empty when absent): numpy scalars by `.item()`, arrays and tuples as lists).

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
        _pack_tokens(tokens)  # int32 range
    except (TypeError, ValueError, OverflowError, struct.error):
        raise ValueError(
            f"generate result tokens={tokens!r} must be a sequence of int32 token ids"
        ) from None
    kv_bytes = get("kv_bytes") or 0
    try:
        kv_bytes = operator.index(kv_bytes)
    except TypeError:
        kv_bytes = -1
    if not 0 <= kv_bytes < 2**63:
        raise ValueError(f"generate result kv_bytes={get('kv_bytes')!r} must be an int >= 0")
    stats = get("stats")
    stats = {} if stats is None else _plain(stats, "stats")
    if type(stats) is not dict:
        raise ValueError(f"generate result stats={get('stats')!r} must be a mapping")
    return text, tokens, finish_reason, kv_bytes, stats


def _plain(value: Any, where: str) -> Any:
    """msgpack-ready data: str-keyed dicts, lists and scalars (numpy ones by `.item()`)."""
    if value is None or type(value) in (bool, int, float, str):
        return value
    if isinstance(value, Mapping):
        out = {}
        for k, v in value.items():
            if not isinstance(k, str):
                raise ValueError(f"generate result {where} has key {k!r}; expected str keys")
            out[k] = _plain(v, f"{where}[{k!r}]")
        return out
    if isinstance(value, list | tuple):
        return [_plain(v, f"{where}[{i}]") for i, v in enumerate(value)]
    if getattr(value, "shape", None) is not None and callable(getattr(value, "tolist", None)):
        return _plain(value.tolist(), where)  # numpy scalars and arrays
    for plain in (bool, int, float, str):  # subclasses, e.g. an IntEnum
        if isinstance(value, plain):
            return plain(value)
    raise ValueError(
        f"generate result {where}={value!r} must be plain data (None, bool, int, float, str, "
        "list, dict)"
    )


def encode(record: Record) -> bytes:
    """Serialises a record.

    Args:
        record: the response.

    Returns:
        The version byte followed by the msgpack payload.
    """
    payload = msgpack.packb(
        [
            record.text,
            _pack_tokens(record.tokens),
            record.finish_reason,
            record.model_version,
            record.group_id,
            float(record.created_at),
            record.kv_bytes,
            record.stats,
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
        fields = msgpack.unpackb(memoryview(data)[1:])
    except Exception as e:  # msgpack raises several types for truncated/garbled input
        raise CodecError(f"value payload does not unpack: {type(e).__name__}: {e}") from None
    if type(fields) is not list or len(fields) != len(_TYPES):
        raise CodecError(f"value payload is not a {len(_TYPES)}-field array")
    types = tuple(map(type, fields))
    text, packed, finish_reason, model_version, group_id, created_at, kv_bytes, stats = fields
    # Map keys are str or bytes (msgpack's strict_map_key): plain data either way.
    if (types != _TYPES and types != _TYPES_UNGROUPED) or len(packed) % 4 or kv_bytes < 0:
        raise CodecError("value payload fields have the wrong types")
    tokens = struct.unpack(f"<{len(packed) // 4}i", packed)
    return Record(text, tokens, finish_reason, model_version, group_id, created_at, kv_bytes, stats)


def _pack_tokens(tokens) -> bytes:
    """Little-endian int32s; struct.error when one is out of range."""
    return struct.pack(f"<{len(tokens)}i", *tokens)
