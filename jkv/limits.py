"""What one request may ask for, checked on the host before anything is allocated.

Two limits: the model's trained context (`max_position_embeddings`), which a request passes only
when asked (`allow_beyond_context=True`, flagged in `result.stats`) or under a policy that keeps
its positions within its cache (StreamingLLM's re-rotation); and the memory the request needs
(its KV cache, the working set of one prefill step, the token buffer) against what the device
has free. Both raise `ValueError` naming the request's values and what would fit.
"""

from __future__ import annotations

import jax

from jkv import kv as kvlib
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
    device = device or jax.devices()[0]
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
    """Bytes a request allocates at its peak: (KV cache, one prefill step's working set, token
    buffer). A prefill step takes at most `PREFILL_CHUNK` tokens and attends key block by key
    block, so its working set is a chunk's activations and its float32 attention tiles, whatever
    the prompt's length (an estimate: XLA's buffer assignment decides the exact figure)."""
    cfg = params.config
    batch, longest = len(prompt_lengths), start + max(prompt_lengths)
    kv = memory(
        params,
        batch,
        longest,
        max_new_tokens=max_new_tokens,
        kv_dtype=kv_dtype,
        kv_policy=policy,
    ).total
    if policy is not None:  # the prompt's full cache exists until it is compressed
        kv = max(kv, memory(params, batch, longest, max_new_tokens=0, kv_dtype=kv_dtype).total)
    c = min(kvlib.bucket(max(prompt_lengths)), kvlib.PREFILL_CHUNK)
    tiles = cfg.num_heads * (2 * kvlib.ATTENTION_BLOCK + cfg.head_dim)  # scores, probs, output
    activations = 4 * cfg.hidden_size + 3 * cfg.intermediate_size + cfg.vocab_size // c
    step = batch * c * (tiles + activations) * 4
    tokens = batch * kvlib.bucket(max(max_new_tokens, 1)) * 4
    return kv, step, tokens


def check_memory(params, prompt_lengths, max_new_tokens: int, *, policy, kv_dtype, start=0):
    """Raises ValueError when the request cannot fit in the device's free memory."""
    parts = request_bytes(
        params, prompt_lengths, max_new_tokens, policy=policy, kv_dtype=kv_dtype, start=start
    )
    free = available_bytes(params.mesh.devices.flat[0] if params.mesh is not None else None)
    if free is None or sum(parts) <= free:
        return
    kv, step, tokens = (x / GIB for x in parts)
    raise ValueError(
        f"this request (batch {len(prompt_lengths)}, longest prompt {max(prompt_lengths)} "
        f"tokens, max_new_tokens={max_new_tokens}, kv_dtype={kv_dtype!r}) needs about "
        f"{sum(parts) / GIB:.1f} GiB (KV cache {kv:.1f}, a prefill step {step:.1f}, "
        f"token buffer {tokens:.1f}) but {free / GIB:.1f} GiB are free; lower max_new_tokens, "
        "the prompt or the batch, or use a kv_policy with a budget"
    )
