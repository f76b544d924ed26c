"""The Flax decoder: cache-free and cached paths agree; sliding window; GQA grouping."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from jkv import kv
from jkv.core import attention
from jkv_models.config import ModelConfig
from jkv_models.llama import causal_attention, forward, init_params

CFG = ModelConfig(
    vocab_size=64,
    hidden_size=32,
    intermediate_size=64,
    num_layers=2,
    num_heads=4,
    num_kv_heads=2,
    head_dim=8,
    sliding_window=None,
)


def _cached_logits(params, cfg, tokens, chunks):
    """Feeds `tokens` [1, T] through the cache in chunks; returns logits of every position."""
    state = kv.init_state(
        num_layers=cfg.num_layers,
        batch=1,
        num_kv_heads=cfg.num_kv_heads,
        head_dim=cfg.head_dim,
        capacity=tokens.shape[1],
        dtype="float32",
    )

    @jax.jit  # one program per chunk size (op by op, the test took a minute)
    def step(params, piece, pos, layers, n_new):
        attend = attention.make_attention(
            n_new, sliding_window=cfg.sliding_window, inv_freq=jnp.asarray(cfg.inv_freq())
        )
        return forward(params, cfg, piece, pos, layers, attend)

    out, start = [], 0
    for size in chunks:
        piece = tokens[:, start : start + size]
        n_new = jnp.array([size], jnp.int32)
        pos = state.next_position[:, None] + jnp.arange(size)
        logits, layers = step(params, piece, pos, state.layers, n_new)
        state = state.replace(layers=layers, next_position=state.next_position + n_new)
        out.append(logits)
        start += size
    return jnp.concatenate(out, axis=1)


def test_cached_chunks_equal_full_pass():
    params = init_params(CFG, jax.random.key(0))
    tokens = jax.random.randint(jax.random.key(1), (1, 24), 0, CFG.vocab_size)
    full, _ = forward(params, CFG, tokens, jnp.arange(24)[None])
    cached = _cached_logits(params, CFG, tokens, [10, 1, 1, 5, 7])
    np.testing.assert_allclose(cached, full, atol=2e-5)


def test_sliding_window_cached_equals_full():
    cfg = CFG.replace(sliding_window=5)
    params = init_params(cfg, jax.random.key(2))
    tokens = jax.random.randint(jax.random.key(3), (1, 20), 0, cfg.vocab_size)
    full, _ = forward(params, cfg, tokens, jnp.arange(20)[None])
    cached = _cached_logits(params, cfg, tokens, [8, 1, 1, 1, 9])
    np.testing.assert_allclose(cached, full, atol=2e-5)
    no_window, _ = forward(params, CFG, tokens, jnp.arange(20)[None])
    assert np.abs(np.asarray(no_window[:, 10:] - full[:, 10:])).max() > 1e-3  # the window matters


def test_gqa_grouping_matches_repeated_heads():
    rng = np.random.default_rng(0)
    q = rng.standard_normal((2, 6, 8, 16)).astype(np.float32)  # N=8
    k = rng.standard_normal((2, 6, 2, 16)).astype(np.float32)  # K=2, G=4
    v = rng.standard_normal((2, 6, 2, 16)).astype(np.float32)
    pos = np.broadcast_to(np.arange(6), (2, 6))
    got = causal_attention(jnp.asarray(q), jnp.asarray(k), jnp.asarray(v), pos, pos)
    # Reference: query head n uses kv head n // G (Hugging Face repeat_kv).
    kr, vr = np.repeat(k, 4, axis=2), np.repeat(v, 4, axis=2)
    s = np.einsum("btnh,bsnh->bnts", q, kr) / 4.0
    s = np.where(np.tril(np.ones((6, 6), bool)), s, -np.inf)
    p = np.exp(s - s.max(-1, keepdims=True))
    p /= p.sum(-1, keepdims=True)
    want = np.einsum("bnts,bsnh->btnh", p, vr)
    np.testing.assert_allclose(got, want, atol=1e-5)


def test_empty_cache_row_gives_zeros_not_nan():
    state = kv.init_state(
        num_layers=1, batch=1, num_kv_heads=2, head_dim=8, capacity=4, dtype="float32"
    )
    q = jnp.ones((1, 1, 4, 8))
    out = attention.cached_attention_reference(q, jnp.zeros((1, 1), jnp.int32), state.layers[0])
    assert np.all(np.asarray(out) == 0)
