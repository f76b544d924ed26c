"""The response cache around a generation, one way for every caller: look the request up,
generate on a miss, fill. `jkv.generate(cache=)`, `jkv.stream(cache=)` and `jkv serve` all do
so; the cache never calls the model (`ResponseCache.lookup` returns a `Miss` to fill).

A request's key covers the model's name, the model's identity (`params.identity`: weights,
tokenizer and generation config), every setting that changes the output (`request_settings`),
a salt when the caller has one (`jkv serve`: the tenant's) and the prompt as the model reads
it (`prompt_key`): token ids as given, a text exactly, so whitespace the tokenizer keeps (a
byte-level BPE keeps all of it) makes another key. The seed's canonical hash (whitespace-
normalised text) is kept only where it cannot change the answer: for a tokenizer that cannot
see whitespace (`blind_whitespace`: no normalizer, a pre-tokenizer that first splits on
whitespace and drops it, no added token holding whitespace), and only over the characters it
treats as whitespace (Python's `str.split` also splits at U+001C-U+001F, which such
tokenizers read as symbols). A text hit costs no tokenisation.

Every result says where it came from in `result.cache` and `result.stats["cache"]`: "l1",
"l2", "coalesced" (shared another call's generation) or None (this call generated); a hit
reports the `kv_bytes` and statistics of the generation that produced it.
"""

from __future__ import annotations

import dataclasses
import json
import re
import threading

import msgpack

from jkv.output import GenerationResult
from jkv.response_cache.keys import Settings, check_model_name, derive_model_name
from jkv.response_cache.miss import Lookup, Miss

_VALID_NAMES: set[str] = set()  # names already checked (a set lookup per call, not a regex)
_SETTINGS: dict[bytes, Settings] = {}  # msgpack of the values -> their Settings
_SETTINGS_MAX = 4096
_local = threading.local()


@dataclasses.dataclass(frozen=True)
class Key:
    """Everything of a request's cache key but the prompt."""

    model_name: str
    model_version: str
    settings: Settings


def _scalar(value):
    """msgpack's fallback: numpy scalars by value (as the key's canonical form takes them)."""
    if getattr(value, "shape", None) == ():
        return value.item()
    raise TypeError(f"cannot pack {type(value).__name__}")


def request_settings(req, params) -> dict:
    """Every setting of a request that changes its output, resolved (cache-key input)."""
    return dict(zip(req.key_names, req.key_values(params), strict=True))


def key(params, req, *, salt: str | None = None) -> Key:
    """The key of `req` (a `jkv.request.Request`) on `params`, `salt` (a tenant's) in it.

    Raises:
        ValueError: a model name cache keys cannot hold.
    """
    name = params.name
    if name not in _VALID_NAMES:
        try:
            check_model_name(name)
        except ValueError as e:
            fix = derive_model_name(name) if isinstance(name, str) else "my-model"
            raise ValueError(
                f"params.name={name!r} cannot be used in response-cache keys ({e}); name the "
                f"model with jkv.load(..., name={fix!r}) or params.replace(name={fix!r})"
            ) from None
        _VALID_NAMES.add(name)
    return Key(name, params.identity, _settings(req, params, salt))


def _settings(req, params, salt) -> Settings:
    """`Settings` of the request's key values (and salt), memoised on their msgpack bytes
    (which keep int, float, bool and str apart, so equal bytes are equal settings)."""
    values = req.key_values(params)
    packer = getattr(_local, "packer", None)
    if packer is None:  # a Packer per thread: reusing one is a third cheaper than packb
        packer = _local.packer = msgpack.Packer(use_bin_type=True, default=_scalar)
    packed = packer.pack((values, salt))
    found = _SETTINGS.get(packed)
    if found is None:
        named = dict(zip(req.key_names, values, strict=True))
        found = Settings(named if salt is None else {**named, "cache_salt": salt})
        if len(_SETTINGS) >= _SETTINGS_MAX:
            _SETTINGS.clear()
        _SETTINGS[packed] = found
    return found


def lookup(cache, key: Key, prompt, *, coalesce: bool = True) -> Lookup | Miss:
    """`cache.lookup` of one prompt's `prompt_key` (or token ids) under `key`: a hit, or the
    `Miss` to fill with the generated result (`coalesce`: identical concurrent lookups wait
    for that fill)."""
    return cache.lookup(key.model_name, key.model_version, prompt, key.settings, coalesce=coalesce)


# Every character Python's str.split splits at (the highest is U+3000).
WHITESPACE = "".join(c for c in map(chr, range(0x3001)) if c.isspace())
SPLITS = ("Whitespace", "WhitespaceSplit")  # pre-tokenizers that split at whitespace, drop it
_BLIND: dict = {}  # tokenizer -> (its whitespace characters, a pattern of their runs)
_SEEN: dict = {}  # its whitespace characters -> those of `WHITESPACE` it sees (not among them)


def prompt_key(params, prompt):
    """What the key of a text prompt holds: the text, whitespace-normalised over the
    characters the tokenizer cannot see (`blind_whitespace`: the same ids, so the same
    answer), else exactly. None for anything else (token ids, bytes): key it by its ids."""
    if not isinstance(prompt, str):
        return None
    chars, runs = blind_whitespace(params.tokenizer)
    if not chars:
        return prompt
    if runs is None or not any(c in prompt for c in _SEEN[chars]):  # str.split's C loop
        return " ".join(prompt.split())
    return runs.sub(" ", prompt).strip(chars)


def blind_whitespace(tokenizer) -> tuple[str, re.Pattern | None]:
    """The whitespace characters `tokenizer` cannot tell apart from one space, or from
    nothing at a text's ends ("" when it can see whitespace), and a pattern of their runs
    (None when they are all of `WHITESPACE`). Decided once per tokenizer: by its definition
    (the pipeline drops whitespace before the model sees it), then a probe of each
    character."""
    if tokenizer in _BLIND:
        return _BLIND[tokenizer]
    found = "", None
    spec = json.loads(tokenizer.to_str()) if tokenizer is not None else {}
    pre = spec.get("pre_tokenizer") or {}
    first = (pre.get("pretokenizers") or [{}])[0] if pre.get("type") == "Sequence" else pre
    spaced = any(
        any(c.isspace() for c in t.get("content", "")) for t in spec.get("added_tokens") or []
    )
    if spec and spec.get("normalizer") is None and first.get("type") in SPLITS and not spaced:
        encode = lambda text: tokenizer.encode(text, add_special_tokens=False)  # noqa: E731
        space, word = encode("x y"), encode("x")
        chars = "".join(
            c for c in WHITESPACE if encode(f"x{c}y") == space and encode(f"{c}x{c}") == word
        )
        runs = None if chars == WHITESPACE else re.compile(f"[{re.escape(chars)}]+")
        found = chars, runs
        _SEEN[chars] = "".join(c for c in WHITESPACE if c not in chars)
    _BLIND[tokenizer] = found
    return found


def result_of(found: Lookup) -> GenerationResult:
    """A hit as a result: the generation that filled it, `cache` set to the level."""
    record, level = found
    stats = {**record.stats, "cache": level, "cache_group": record.group_id}
    return GenerationResult(
        record.text, list(record.tokens), record.finish_reason, record.kv_bytes, stats, level
    )


def generated(result: GenerationResult, record) -> GenerationResult:
    """The result of the call that generated (and filled `record`), where it came from (None)
    in its stats."""
    stats = {**result.stats, "cache": None, "cache_group": record.group_id}
    return dataclasses.replace(result, stats=stats, cache=None)


def coalesced(result: GenerationResult) -> GenerationResult:
    """A batch row answered by another row's generation (its prompt had the same key)."""
    return dataclasses.replace(
        result, cache="coalesced", stats={**result.stats, "cache": "coalesced"}
    )
