"""`jkv.generate(..., cache=)` and `jkv.stream(..., cache=)`: the response cache in front of the
model.

A request is looked up before anything else is done with it. Its key covers the model's name,
the model's identity (`params.identity`: weights, tokenizer and generation config), every
setting that changes the output (`request_settings`) and the prompt, a text whitespace-
normalised for the key only. Before a lookup only cheap checks run, so a hit costs no
tokenisation; on a miss the model reads the user's prompt exactly as given, and its answer then
serves every prompt with the same key.

A single prompt goes through `get_or_generate` (concurrent identical misses generate once); a
batch looks every row up and generates its misses together, rows with the same key once. Every
result says where it came from in `result.cache` and `result.stats["cache"]`: "l1", "l2",
"coalesced" (shared another call's generation) or None (this call generated); a hit reports the
`kv_bytes` and statistics of the generation that produced it.
"""

from __future__ import annotations

import dataclasses
import threading

import msgpack

from jkv.output import GenerationResult
from jkv.prompt import encode_prompts, is_batch
from jkv.response_cache.keys import Settings, check_model_name, derive_model_name, normalize_prompt

_VALID_NAMES: set[str] = set()  # names already checked (a set lookup per call, not a regex)
_SETTINGS: dict[bytes, Settings] = {}  # msgpack of the values -> their Settings
_SETTINGS_MAX = 4096
_local = threading.local()


def _scalar(value):
    """msgpack's fallback: numpy scalars by value (as the key's canonical form takes them)."""
    if getattr(value, "shape", None) == ():
        return value.item()
    raise TypeError(f"cannot pack {type(value).__name__}")


def request_settings(req, params) -> dict:
    """Every setting of a request that changes its output, resolved (cache-key input)."""
    return dict(zip(req.key_names, req.key_values(params), strict=True))


def _settings(req, params) -> Settings:
    """`Settings(request_settings(req, params))`, memoised on the values' msgpack bytes (which
    keep int, float, bool and str apart, so equal bytes are equal settings)."""
    values = req.key_values(params)
    packer = getattr(_local, "packer", None)
    if packer is None:  # a Packer per thread: reusing one is a third cheaper than packb
        packer = _local.packer = msgpack.Packer(use_bin_type=True, default=_scalar)
    packed = packer.pack(values)
    found = _SETTINGS.get(packed)
    if found is None:
        found = Settings(dict(zip(req.key_names, values, strict=True)))
        if len(_SETTINGS) >= _SETTINGS_MAX:
            _SETTINGS.clear()
        _SETTINGS[packed] = found
    return found


def generate_cached(params, prompt, req, cache, run):
    """`generate` through the response cache.

    Args:
        params: the model.
        prompt: a str, token ids, or a batch of either.
        req: the validated request (`jkv.request.Request`).
        cache: a `jkv.ResponseCache`.
        run: `run(params, token_rows, req)` -> one `GenerationResult` per row.

    Returns:
        A `GenerationResult` (a list of them for a batch) with `cache` set.

    Raises:
        ValueError: a bad prompt, or a model name cache keys cannot hold.
    """
    name, identity = _model(params)
    settings = _settings(req, params)
    if not is_batch(prompt):
        return _single(params, prompt, req, cache, run, (name, identity, settings))
    return _batch(params, list(prompt), req, cache, run, (name, identity, settings))


def stream_cached(params, prompt, req, cache, stream_fn):
    """`stream` through the response cache: a generator of text pieces.

    A hit yields its whole text as one piece; a miss yields the pieces of
    `stream_fn(params, prompt, req)` (the user's prompt exactly) and caches its result once
    the stream has ended (a stream closed early caches nothing). Concurrent identical misses
    each stream their own generation.

    Args:
        params, prompt, req, cache: as in `generate_cached` (one prompt, not a batch).
        stream_fn: a generator function yielding str pieces and returning (as
            `StopIteration.value`) the final `GenerationResult`.

    Returns:
        (as `StopIteration.value`) the `GenerationResult`, `cache` set.

    Raises:
        ValueError: a batch, a bad prompt, or a model name cache keys cannot hold.
    """
    if is_batch(prompt):
        raise ValueError(f"stream takes one prompt; got a batch of {len(prompt)}")
    name, identity = _model(params)
    settings = _settings(req, params)
    _refuse_empty(params, prompt)
    hit = cache.get(name, identity, prompt, settings)
    if hit is not None:
        result = _from_record(hit.record, hit.level)
        if result.text:
            yield result.text
        return result
    result = yield from stream_fn(params, prompt, req)
    return _generated(result, cache.put(name, identity, prompt, settings, result))


def _single(params, prompt, req, cache, run, key):
    _refuse_empty(params, prompt)
    made = []

    def produce():
        rows, _ = encode_prompts(params, prompt)  # the user's text, not the key's
        made.append(run(params, rows, req)[0])
        return made[0]

    name, identity, settings = key
    record, level = cache.get_or_generate(name, identity, prompt, settings, produce)
    if level is None and made:
        return _generated(made[0], record)
    return _from_record(record, level)


def _batch(params, prompts, req, cache, run, key):
    name, identity, settings = key
    _refuse_empty(params, prompts, batch=True)
    results: list = [None] * len(prompts)
    leaders: dict = {}  # a row's key -> the first missing row with it, which generates
    todo, followers = [], []
    for i, prompt in enumerate(prompts):
        hit = cache.get(name, identity, prompt, settings)
        if hit is not None:
            results[i] = _from_record(hit.record, hit.level)
            continue
        first = leaders.setdefault(_row_key(prompt), i) if settings.cacheable else i
        (todo if first == i else followers).append((i, first))
    if todo:
        rows, _ = encode_prompts(params, prompts)  # every row: an error names the right one
        made = run(params, [rows[i] for i, _ in todo], req)
        for (i, _), res in zip(todo, made, strict=True):
            results[i] = _generated(res, cache.put(name, identity, prompts[i], settings, res))
    for i, first in followers:
        res = results[first]
        results[i] = dataclasses.replace(
            res, cache="coalesced", stats={**res.stats, "cache": "coalesced"}
        )
    return results


def _model(params) -> tuple[str, str]:
    """(name, identity) of the params in cache keys; refuses a name keys cannot hold."""
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
    return name, params.identity


def _refuse_empty(params, prompt, batch: bool = False) -> None:
    """An empty text never reaches a lookup: it would share the key of a blank one, which may
    have been answered. `encode_prompts` raises its usual error (naming the row of a batch)."""
    if batch:
        empty = any(isinstance(p, str) and not p for p in prompt)
    else:
        empty = isinstance(prompt, str) and not prompt
    if empty:
        encode_prompts(params, prompt)


def _row_key(prompt):
    """What makes two rows of a batch one request (the cache key's prompt rule)."""
    if isinstance(prompt, str):
        return "s", normalize_prompt(prompt)
    return "t", tuple(int(t) for t in prompt)


def _from_record(record, level):
    stats = {**record.stats, "cache": level, "cache_group": record.group_id}
    return GenerationResult(
        record.text, list(record.tokens), record.finish_reason, record.kv_bytes, stats, level
    )


def _generated(result, record):
    """The result of the call that generated, with where it came from (None) in its stats."""
    stats = {**result.stats, "cache": None, "cache_group": record.group_id}
    return dataclasses.replace(result, stats=stats, cache=None)
