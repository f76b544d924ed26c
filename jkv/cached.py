"""`jkv.generate(..., cache=ResponseCache)`: the response cache in front of the model.

The flow is the seed's: L1 -> L2 (fill L1) -> model (fill both). The key covers the model's
name and weights fingerprint, the normalised prompt and every setting that changes the output
(`request_settings`); a single prompt goes through `get_or_generate` (concurrent identical
misses generate once); a batch looks every row up and generates only the misses, together.
"""

from __future__ import annotations

import dataclasses

from jkv.cache.keys import normalize_prompt


def request_settings(req, params) -> dict:
    """Every setting of a request that changes its output, resolved (cache-key input)."""
    s = req.sampling
    return {
        "max_new_tokens": req.max_new_tokens,
        "temperature": s.temperature,
        "top_k": s.top_k,
        "top_p": s.top_p,
        "min_p": s.min_p,
        "logit_keep_ratio": s.logit_keep_ratio,
        "seed": req.seed,
        "stop": list(req.stop),
        "kv_policy": None if req.policy is None else req.policy.describe(),
        "kv_dtype": req.kv_dtype or params.config.dtype,
        "backend": req.backend,
    }


def _normalised(prompt):
    return normalize_prompt(prompt) if isinstance(prompt, str) else prompt


def _from_record(record, level):
    from jkv.generate import GenerationResult

    return GenerationResult(
        text=record.text,
        tokens=list(record.tokens),
        finish_reason=record.finish_reason,
        kv_bytes=0,
        stats={"cache_group": record.group_id},
        cache=level,
    )


def generate_cached(params, prompt, req, cache, run):
    """`generate` through the response cache; `run(params, token_rows, req)` generates."""
    from jkv.prefill import encode_prompts

    settings = request_settings(req, params)
    _, is_batch = encode_prompts(params, prompt)  # validates before any lookup
    raw = list(prompt) if is_batch else [prompt]
    keys = [_normalised(p) for p in raw]
    if not is_batch:
        fresh = []

        def produce():
            rows, _ = encode_prompts(params, keys[0])
            fresh.append(run(params, rows, req)[0])
            return fresh[0]

        record, level = cache.get_or_generate(
            params.name, params.version, keys[0], settings, produce
        )
        if level is None and fresh:  # this call generated: keep its real stats and bytes
            return dataclasses.replace(fresh[0], cache=None)
        return _from_record(record, level)

    results: list = [None] * len(keys)
    misses = []
    for i, key in enumerate(keys):
        hit = cache.get(params.name, params.version, key, settings)
        if hit is None:
            misses.append(i)
        else:
            results[i] = _from_record(hit.record, hit.level)
    if misses:
        rows, _ = encode_prompts(params, [keys[i] for i in misses])
        for i, res in zip(misses, run(params, rows, req), strict=True):
            cache.put(params.name, params.version, keys[i], settings, res)
            results[i] = res
    return results
