"""Prompt -> KV state: the first part of every request, and `jkv.prefill`.

`prefill_step` is one model step over a padded prompt batch (lengths bucketed to powers of two,
`jkv.kv.bucket`, so recompiles stay bounded). `prepare` builds the state a request decodes from:
a fresh cache, or a copy of a given state with room for the new tokens, then prefill, then the
KV policy's compression, so what the policy drops never reaches the decode loop.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

from jkv import kv as kvlib
from jkv import policies
from jkv.core.backends import validate_backend
from jkv.core.step import model_step, next_positions
from jkv.kv import PREFILL_CHUNK, bucket, headroom
from jkv.kv_context import KVContext, check_shape
from jkv.limits import check_context, check_memory
from jkv.memory import prefill_plan, step_tokens
from jkv.params import Params
from jkv.policies.compress import compress, compress_alone
from jkv.prompt import encode_prompts
from jkv.replay import replay
from jkv.sharding import shard_kv
from jkv_models.config import ModelConfig


@functools.partial(
    jax.jit, static_argnames=("config", "backend", "policy", "all_logits"), donate_argnames=("kv",)
)
def prefill_step(
    weights,
    config: ModelConfig,
    tokens: jax.Array,
    n_new: jax.Array,
    kv: kvlib.KVState,
    *,
    backend: str = "xla",
    policy=None,
    all_logits: bool = False,
):
    """Runs the prompt `[B, T]` (row b's first n_new[b] tokens are real) through the model.

    Returns (logits float32 `[B, V]` at each row's last real token, or `[B, T, V]` with
    `all_logits`; the filled KV state).
    """
    return model_step(
        weights,
        config,
        kv,
        tokens,
        next_positions(kv, tokens.shape[1]),
        n_new,
        policy=policy,
        backend=backend,
        logits_at=None if all_logits else jnp.maximum(n_new - 1, 0),
    )


def chunks(prompts: list[list[int]], chunk: int):
    """The prompts cut into steps of `chunk` tokens, aligned at each row's END: every row's last
    step holds its last min(len, chunk) tokens (so an observation window of up to `chunk`
    tokens, and the logits of the last token, are in the last step), its first step the rest.

    Yields (tokens `[B, chunk]` int32 numpy, row b's real ones first; n_new `[B]` int32).
    """
    lengths = np.array([len(p) for p in prompts])
    steps = -(-int(lengths.max()) // chunk)
    for j in range(steps):
        end = lengths - (steps - 1 - j) * chunk
        start = np.maximum(end - chunk, 0)
        n_new = np.maximum(end - start, 0).astype(np.int32)
        tokens = np.zeros((len(prompts), chunk), np.int32)
        for b, p in enumerate(prompts):
            tokens[b, : n_new[b]] = p[start[b] : start[b] + n_new[b]]
        yield tokens, n_new


def check_chunk(chunk) -> None:
    """Raises ValueError unless `chunk` (prompt tokens per model step) is a power of two >= 16."""
    if isinstance(chunk, bool) or not isinstance(chunk, int) or chunk < 16 or chunk & (chunk - 1):
        raise ValueError(f"chunk={chunk!r} must be a power of two >= 16 (tokens per model step)")


def prefill_chunked(
    params, prompts, kv, *, backend, policy, chunk, evict_to=None, budgets_after=None
):
    """Runs the prompts through the model `chunk` tokens at a time (one compiled step for every
    chunk), each step attending to the cache so far plus itself: attention memory is
    O(chunk x key block), never O(prompt^2).

    `evict_to` (an evicting policy's per-layer capacities, each with room for one chunk): after
    every step but the last, the policy evicts each row back to its budget (`KVState.limit`),
    so the cache never holds more than budget + chunk tokens, whatever the prompt's length
    (StreamingLLM keeps its sinks and window as it streams; H2O keeps its heavy hitters by the
    attention mass accumulated so far). `budgets_after(seen)` ([B] tokens seen so far -> [B]
    slots each row keeps) replaces the fixed budget for a policy that compresses each chunk as
    it arrives (`SnapKV(chunked=True)`: its share of the tokens seen, by the chunk's own window).
    Returns (logits `[B, V]` at each row's last token, the state)."""
    steps = list(chunks(prompts, chunk))
    logits = None
    seen = np.zeros(len(prompts), np.int64)
    for j, (tokens, n_new) in enumerate(steps):
        seen += n_new
        tokens, n_new = jnp.asarray(tokens), jnp.asarray(n_new)
        logits, kv = prefill_step(
            params.weights, params.config, tokens, n_new, kv, backend=backend, policy=policy
        )
        if evict_to is not None and j < len(steps) - 1:
            budgets = kv.limit if budgets_after is None else jnp.asarray(budgets_after(seen))
            kv = compress(
                params.weights,
                params.config,
                kv,
                tokens,
                n_new,
                budgets,
                policy=policy,
                capacities=evict_to,
                backend=backend,
                keep_scores=True,
            )
    return logits, kv


# ------------------------------------------------------------------ the state a request needs
def check_state(state, params: Params, batch: int, kv_dtype: str | None) -> kvlib.KVState:
    """The KVState to continue from `kv_state` (a `KVContext` from `jkv.prefill`, checked against
    these weights, or a bare `KVState`), once it fits `batch` rows of this model (ValueError)."""
    if isinstance(state, KVContext):
        return state.check(params, batch, kv_dtype)
    if not isinstance(state, kvlib.KVState):
        raise ValueError(
            f"kv_state is a {type(state).__name__}; expected the KVContext that jkv.prefill returned"
        )
    check_shape(state, params.config, batch, kv_dtype)
    return state


def prepare(
    params: Params,
    prompts: list[list[int]],
    *,
    policy,
    kv_dtype: str,
    backend: str,
    max_new_tokens: int,
    kv_state: kvlib.KVState | None = None,
    chunk: int = PREFILL_CHUNK,
):
    """Prefills `prompts` into a state ready to decode `max_new_tokens` more tokens per row,
    `chunk` prompt tokens per model step (`prefill_chunked`).

    Without `kv_state`: a fresh cache; the policy (if any) compresses the prompt's cache.
    With `kv_state` (from `jkv.prefill`): the prompts continue it, uncompressed (its policy
    keeps evicting if it evicts); the given state is left intact.

    Every compiled shape is a bucket: the prompt's (`bucket`), the decode headroom's
    (`headroom`) and the capacities a policy asks for; budgets travel as per-row data.

    Returns:
      (logits `[B, V]` at each row's last token, the state).
    """
    cfg = params.config
    lengths = [len(p) for p in prompts]
    t = bucket(max(lengths))
    tokens = np.zeros((len(prompts), t), np.int32)
    for i, p in enumerate(prompts):
        tokens[i, : len(p)] = p
    tokens, n_new = jnp.asarray(tokens), jnp.asarray(lengths, jnp.int32)

    evict_to = budgets_after = None
    if kv_state is not None:
        key = kv_state.policy
        chunk = step_tokens(max(lengths), chunk, key)
        evicting = key is not None and key.evicts
        kv = kvlib.with_room(kv_state, t + (0 if evicting else headroom(max_new_tokens)))
    else:
        key = None if policy is None else policy.jit_key()
        plan = prefill_plan(cfg.num_layers, lengths, max_new_tokens, policy, chunk)
        chunk, evict_to = plan.step, plan.evict_to
        if evict_to is not None and not policy.evicts:
            budgets_after = policy.row_budgets
        limits = None if policy is None else policy.row_limits(lengths)
        kv = empty_state(cfg, len(prompts), plan.capacity, kv_dtype, policy=key, limit=limits)
    if params.mesh is not None:
        kv = shard_kv(kv, params.mesh)
    logits, kv = prefill_chunked(
        params,
        prompts,
        kv,
        backend=backend,
        policy=key,
        chunk=chunk,
        evict_to=evict_to,
        budgets_after=budgets_after,
    )
    budgets = capacities = None
    if kv_state is None and policy is not None and policy.needs_replay:
        kv = replay(params, prompts, kv, policy, backend)  # KVzip: the replay scores the slots
    if kv_state is None and policy is not None:
        budgets = jnp.asarray(policy.row_budgets(lengths))
        capacities = plan.final
    elif kv_state is not None and key is not None and key.evicts:
        # Back to the fixed capacity: the policy's rule picks what the new tokens displace.
        budgets, capacities = kv.limit, tuple(x.capacity for x in kv_state.layers)
    if budgets is not None:
        kv = compress_alone(
            params.weights,
            cfg,
            kv,
            tokens,
            n_new,
            budgets,
            policy=key,
            capacities=capacities,
            backend=backend,
        )
    return logits, kv


def prefill(
    params: Params,
    context,
    *,
    kv_policy=None,
    kv_budget=None,
    kv_dtype=None,
    backend=None,
    allow_beyond_context: bool = False,
    chunk: int = PREFILL_CHUNK,
) -> KVContext:
    """Prefills (and compresses) a context once, to continue later from the returned state.

    `jkv.generate(params, question, kv_state=state)` then appends the question to the
    compressed context and decodes: kvpress's question-agnostic protocol, the honest way to
    score compression (the policy never sees the question). The state can serve many
    questions; each generate call works on a copy.

    Args:
      params: from `jkv.load`.
      context: a str, token ids, or a batch of either.
      kv_policy, kv_budget: a `jkv.policies.KVPolicy`, or a name with a budget (tokens or a
        ratio of the context).
      kv_dtype: KV storage dtype (default: the params' dtype).
      backend: attention backend ("xla", "pallas", "pallas_interpret").
      allow_beyond_context: accept a context longer than the model's trained one (as in
        `jkv.generate`).
      chunk: prompt tokens per model step (a power of two >= 16): attention's working memory
        is O(chunk x key block), whatever the context's length.

    Returns:
      A `jkv.KVContext`: the `KVState` (its `policy` attached), the token ids it was computed
      from and the weights' fingerprint; `.nbytes` what it holds, `.to_bytes()` /
      `KVContext.from_bytes` to store or send it.
    """
    if not isinstance(params, Params):
        raise ValueError(f"params is a {type(params).__name__}; expected jkv.Params")
    policy = policies.resolve(kv_policy, kv_budget)
    kv_dtype = kvlib.validate_kv_dtype(kv_dtype or params.kv_dtype)
    backend = validate_backend(backend)
    check_chunk(chunk)
    prompts, _ = encode_prompts(params, context)
    lengths = [len(p) for p in prompts]
    rerank_within = max(policy.row_limits(lengths)) if policy and policy.raw_keys else None
    check_context(
        params.config, lengths, 0, rerank_within=rerank_within, allowed=allow_beyond_context
    )
    check_memory(params, lengths, 0, policy=policy, kv_dtype=kv_dtype)
    _, state = prepare(
        params,
        prompts,
        policy=policy,
        kv_dtype=kv_dtype,
        backend=backend,
        max_new_tokens=0,
        chunk=chunk,
    )
    return KVContext(state=state, tokens=tuple(map(tuple, prompts)), weights=params.version)


def empty_state(
    cfg: ModelConfig, batch: int, capacity: int, dtype: str, *, policy=None, limit=None
):
    """An empty KV state shaped for `cfg` that carries `policy` (a `jit_key()`) and the row
    budgets `limit`, with the per-slot score array when that policy accumulates one."""
    return kvlib.init_state(
        num_layers=cfg.num_layers,
        batch=batch,
        num_kv_heads=cfg.num_kv_heads,
        head_dim=cfg.head_dim,
        capacity=capacity,
        dtype=dtype,
        scores=policy is not None and policy.observes,
        policy=policy,
        limit=limit,
    )
