"""What one request may ask for, checked on the host before anything is allocated.

Two limits: the model's trained context (`max_position_embeddings`), which a request passes only
when asked (`allow_beyond_context=True`, flagged in `result.stats`) or under a policy that keeps
its positions within its cache (StreamingLLM's re-rotation); and the memory the request needs
(the predicted peak of its prefill and of its decoding, `jkv.memory`) against what the device
has free. Both raise `ValueError` naming the request's values and what would fit.
"""

from __future__ import annotations

import jax

from jkv.memory import memory

GIB = 2**30


def check_context(
    cfg, prompt_lengths, max_new_tokens: int, *, start=0, rerank_within=None, allowed=False
) -> bool:
    """Whether the request runs past the trained context (True only when `allowed`).

    `start`: positions already in a continued `kv_state`; `rerank_within`: the cache size of a
    policy that re-ranks positions within its cache (StreamingLLM), else None.
    Raises ValueError when it runs past and is not allowed."""
    context = cfg.max_position_embeddings
    # the last new token is sampled, never fed back: it takes no position
    longest = start + max(prompt_lengths) + max(max_new_tokens - 1, 0)
    if longest <= context:
        return False
    if rerank_within is not None and rerank_within <= context:
        return False  # positions re-ranked within a cache no longer than the context
    if allowed:
        return True
    after = f" after the kv_state's {start}" if start else ""
    raise ValueError(
        f"a prompt of {max(prompt_lengths)} tokens{after} plus max_new_tokens={max_new_tokens} "
        f"needs {longest} positions, more than the model's trained context "
        f"(max_position_embeddings={context}); shorten the prompt or max_new_tokens, use "
        "kv_policy='streaming' with a budget within the context, or pass "
        "allow_beyond_context=True"
    )


def available_bytes(device=None) -> int | None:
    """Free memory of `device` (default: the first device): the allocator's limit minus what is
    in use where the backend reports it (GPU), else the host's MemAvailable (CPU)."""
    device = device or jax.local_devices()[0]  # addressable: a group's others are not
    stats = device.memory_stats() or {}
    if "bytes_limit" in stats:
        return int(stats["bytes_limit"]) - int(stats.get("bytes_in_use", 0))
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def request_bytes(params, prompt_lengths, max_new_tokens: int, *, policy, kv_dtype, start=0):
    """(KV cache after prefill, predicted prefill peak, predicted decode peak) in bytes, weights
    excluded (`jkv.memory`'s `peaks`: the live state plus each step's working set, bounded by
    the prefill chunk whatever the prompt's length)."""
    report = memory(
        params,
        len(prompt_lengths),
        start + max(prompt_lengths),
        max_new_tokens=max_new_tokens,
        kv_dtype=kv_dtype,
        kv_policy=policy,
    )
    return report.total, report.prefill_peak, report.decode_peak


def check_memory(params, prompt_lengths, max_new_tokens: int, *, policy, kv_dtype, start=0):
    """Raises ValueError when the request cannot fit in the device's free memory."""
    kv, prefill, decode = request_bytes(
        params, prompt_lengths, max_new_tokens, policy=policy, kv_dtype=kv_dtype, start=start
    )
    free = available_bytes(params.mesh.devices.flat[0] if params.mesh is not None else None)
    if free is None or max(prefill, decode) <= free:
        return
    raise ValueError(
        f"this request (batch {len(prompt_lengths)}, longest prompt {max(prompt_lengths)} "
        f"tokens, max_new_tokens={max_new_tokens}, kv_dtype={kv_dtype!r}) needs about "
        f"{max(prefill, decode) / GIB:.1f} GiB at its peak (prefill {prefill / GIB:.1f}, decode "
        f"{decode / GIB:.1f}; the KV cache alone {kv / GIB:.1f}) but {free / GIB:.1f} GiB are "
        "free; lower max_new_tokens, the prompt or the batch, or use a kv_policy with a budget"
    )
