"""Perplexity under compression: `score` (a text's log-probabilities over a prompt pass,
continuing a compressed state if given), `stream_score` (token by token through the decode path,
as StreamingLLM measures it) and `logits` (no compression, the model's plain output).

All three run the model through `jkv.core.step.model_step`.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

from jkv import kv as kvlib
from jkv import policies
from jkv.core.backends import validate_backend
from jkv.core.step import model_step
from jkv.kv import PREFILL_CHUNK, bucket
from jkv.params import Params
from jkv.policies.compress import compress
from jkv.prefill import check_chunk, check_state, chunks, empty_state, prefill_step
from jkv.prompt import encode_prompts
from jkv_models.config import ModelConfig


def one_text(params: Params, text, what: str, *, continuation: bool = False) -> list[int]:
    """The ids of the one text a scoring function takes (at least 2 tokens)."""
    if not isinstance(params, Params):
        raise ValueError(f"params is a {type(params).__name__}; expected jkv.Params")
    rows, is_batch = encode_prompts(params, text, continuation=continuation)
    if is_batch:
        raise ValueError(f"{what} takes one text; got a batch of {len(rows)}")
    if len(rows[0]) < 2:
        raise ValueError(f"text has {len(rows[0])} token(s); scoring needs at least 2")
    return rows[0]


def score(
    params: Params,
    text,
    *,
    kv_state=None,
    backend=None,
    chunk: int = PREFILL_CHUNK,
):
    """Log-probabilities the model gives each next token of `text` (one row), continuing
    `kv_state` if given (e.g. a context compressed by a policy): perplexity under compression.
    The text goes through the model `chunk` tokens per step, as prefill does: the working memory
    is a chunk's logits and attention tiles, whatever the text's length.

    Returns:
      float32 numpy `[n - 1]`: log p(token_i | the state and text[:i]) for i = 1..n-1.
    """
    ids = one_text(params, text, "score", continuation=kv_state is not None)
    backend = validate_backend(backend)
    check_chunk(chunk)
    t = bucket(len(ids))
    if kv_state is not None:
        kv_state = check_state(kv_state, params, 1, None)
        kv, policy = kvlib.with_room(kv_state, t), kv_state.policy
    else:
        kv, policy = empty_state(params.config, 1, t, params.kv_dtype), None
    return chunked_logp(params, ids, kv, min(chunk, t), backend=backend, policy=policy)


def chunked_logp(params, ids, kv, chunk, *, backend, policy, evict_to=None):
    """log p(ids[i + 1] | ids[:i + 1]) over `kv`, `chunk` tokens per model step; with `evict_to`
    (an evicting policy's capacities plus one chunk) the policy evicts after every step."""
    cfg = params.config
    out, done = [], 0
    for tokens, n_new in chunks([ids], chunk):
        tokens, n = jnp.asarray(tokens), int(n_new[0])
        logits_, kv = prefill_step(
            params.weights,
            cfg,
            tokens,
            jnp.asarray(n_new),
            kv,
            backend=backend,
            policy=policy,
            all_logits=True,
        )
        targets = ids[done + 1 : done + n + 1]  # the next token of each of this step's tokens
        logp = jax.nn.log_softmax(logits_[0, : len(targets)], axis=-1)
        out.append(np.asarray(logp[jnp.arange(len(targets)), jnp.asarray(targets)]))
        done += n
        if evict_to is not None:
            kv = compress(
                params.weights,
                cfg,
                kv,
                tokens,
                jnp.asarray(n_new),
                kv.limit,
                policy=policy,
                capacities=evict_to,
                backend=backend,
            )
    return np.concatenate(out).astype(np.float32)


@functools.partial(jax.jit, static_argnames=("config", "backend"))
def _teacher_forced(weights, config: ModelConfig, ids, kv, *, backend: str):
    """log p(ids[i + 1] | ids[:i + 1]) fed one token at a time through the decode path
    (`kv.policy` applied at every step, as in generation): float32 `[n - 1]`."""

    def step(kv, tok):
        logits, kv = model_step(
            weights,
            config,
            kv,
            tok[None, None],
            kv.next_position[:, None],
            jnp.ones((1,), jnp.int32),
            policy=kv.policy,
            backend=backend,
            logits_at=jnp.zeros((1,), jnp.int32),
        )
        return kv, jax.nn.log_softmax(logits[0].astype(jnp.float32))

    _, logp = jax.lax.scan(step, kv, ids[:-1])
    return logp[jnp.arange(ids.shape[0] - 1), ids[1:]]


def stream_score(params: Params, text, *, policy=None, backend=None):
    """Per-token log-probabilities of `text` (one row) decoded token by token, the way
    StreamingLLM measures perplexity: with `policy` (an evicting policy of integer budget, e.g.
    `StreamingLLM(budget=256)`) the cache never holds more than its budget however long the text;
    with None, a full cache of the whole text (the contrast past the trained context).

    Returns:
      float32 numpy `[n - 1]`: log p(token_i | text[:i]) for i = 1..n-1.
    """
    ids = one_text(params, text, "stream_score")
    backend = validate_backend(backend)
    policy = policies.resolve(policy)
    cfg = params.config
    if policy is None:
        kv = empty_state(cfg, 1, len(ids), params.kv_dtype)
    elif policy.evicts and isinstance(policy.budget, int):
        cap = policy.capacities(cfg.num_layers, [len(ids)], 0)[0]
        kv = empty_state(
            cfg,
            1,
            cap,
            params.kv_dtype,
            policy=policy.jit_key(),
            limit=policy.row_limits([len(ids)]),
        )
    else:
        raise ValueError(
            f"policy={policy.describe()} must evict at a fixed integer budget (e.g. "
            "StreamingLLM(budget=256)); a fractional budget needs the whole text up front"
        )
    out = _teacher_forced(params.weights, cfg, jnp.asarray(ids, jnp.int32), kv, backend=backend)
    return np.asarray(out, np.float32)


def chunk_score(params: Params, text, *, policy=None, chunk: int = PREFILL_CHUNK, backend=None):
    """Per-token log-probabilities of `text` (one row) fed `chunk` tokens per model step, the
    way a long prompt is prefilled: with `policy` (an evicting policy of integer budget) the
    policy evicts back to its budget after every step, so the cache never holds more than
    budget + chunk tokens however long the text; with None, a full cache of the whole text.
    A chunk's tokens see each other and what the cache kept (`stream_score` feeds one token at
    a time instead).

    Returns:
      float32 numpy `[n - 1]`: log p(token_i | text[:i], as the cache kept it) for i = 1..n-1.
    """
    ids = one_text(params, text, "chunk_score")
    backend = validate_backend(backend)
    policy = policies.resolve(policy)
    check_chunk(chunk)
    cfg = params.config
    evict_to, key = None, None
    if policy is None:
        kv = empty_state(cfg, 1, bucket(len(ids)), params.kv_dtype)
    elif policy.evicts and isinstance(policy.budget, int):
        key = policy.jit_key()
        evict_to = tuple(c + chunk for c in policy.capacities(cfg.num_layers, [len(ids)], 0))
        kv = empty_state(
            cfg, 1, evict_to, params.kv_dtype, policy=key, limit=policy.row_limits([len(ids)])
        )
    else:
        raise ValueError(
            f"policy={policy.describe()} must evict at a fixed integer budget (e.g. "
            "StreamingLLM(budget=256)); a fractional budget needs the whole text up front"
        )
    return chunked_logp(params, ids, kv, chunk, backend=backend, policy=key, evict_to=evict_to)


def logits(params: Params, token_ids) -> jax.Array:
    """Float32 logits `[B, T, V]` for token ids `[B, T]` (or `[T]`), no cache, causal."""
    if not isinstance(params, Params):
        raise ValueError(f"params is a {type(params).__name__}; expected jkv.Params")
    try:
        ids = np.asarray(token_ids)
    except ValueError:
        raise ValueError("token_ids rows differ in length; expected a rectangular [B, T]") from None
    if ids.dtype == object or not np.issubdtype(ids.dtype, np.integer) and ids.size:
        raise ValueError(f"token_ids must be integer ids; got dtype {ids.dtype}")
    if ids.ndim == 1:
        ids = ids[None]
    if ids.ndim != 2 or ids.shape[1] == 0:
        raise ValueError(f"token_ids has shape {ids.shape}; expected [B, T] with T >= 1")
    vocab = params.config.vocab_size
    if ids.min() < 0 or ids.max() >= vocab:
        raise ValueError(
            f"token_ids holds id {int(ids.max() if ids.max() >= vocab else ids.min())};"
            f" expected ids in [0, {vocab})"
        )
    b, t = ids.shape
    tokens = np.zeros((b, bucket(t)), np.int32)
    tokens[:, :t] = ids
    kv = empty_state(params.config, b, bucket(t), params.kv_dtype)
    out, _ = prefill_step(
        params.weights,
        params.config,
        jnp.asarray(tokens),
        jnp.full((b,), t, jnp.int32),
        kv,
        all_logits=True,
    )
    return out[:, :t]
