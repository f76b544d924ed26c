"""The Flax decoder: cache-free and cached paths agree; sliding window; GQA grouping."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from jkv import kv
from jkv.core import attention
from jkv_models.config import ModelConfig
from jkv_models.llama import (
    causal_attention,
    forward,
    init_params,
    stack_layers,
    unstack_layers,
)

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


def _hlo_ops(cfg) -> int:
    """Instructions in the optimised program of one cached forward pass of `cfg`."""
    params = jax.eval_shape(lambda k: init_params(cfg, k), jax.random.key(0))
    state = kv.init_state(num_layers=cfg.num_layers, batch=1, num_kv_heads=cfg.num_kv_heads,
                          head_dim=cfg.head_dim, capacity=32, dtype="float32")  # fmt: skip
    layers = jax.tree.map(lambda *xs: jnp.stack(xs), *state.layers)  # stacked entries: scanned

    def step(params, tokens, layers):
        attend = attention.make_attention(
            jnp.ones((1,), jnp.int32), sliding_window=None, inv_freq=jnp.asarray(cfg.inv_freq())
        )
        return forward(params, cfg, tokens, jnp.zeros((1, 1), jnp.int32), layers, attend)

    text = jax.jit(step).lower(params, jnp.zeros((1, 1), jnp.int32), layers).compile().as_text()
    return sum(" = " in line for line in text.splitlines())


def test_the_layers_compile_once_whatever_the_depth():
    """The decoder layers run under `lax.scan`: a 12-layer model's program holds one layer
    body, as a 2-layer one's does (unrolled, it would hold 6x the layers' instructions)."""
    two, twelve = _hlo_ops(CFG), _hlo_ops(CFG.replace(num_layers=12))
    assert twelve <= two * 1.05, (two, twelve)


def test_per_layer_trees_are_stacked_and_back():
    params = init_params(CFG, jax.random.key(4))
    per_layer = unstack_layers(params)
    assert sorted(k for k in per_layer if k.startswith("layers")) == ["layers_0", "layers_1"]
    q1 = per_layer["layers_1"]["self_attn"]["q_proj"]["kernel"]
    np.testing.assert_array_equal(q1, params["layers"]["self_attn"]["q_proj"]["kernel"][1])
    again = stack_layers(per_layer)
    assert jax.tree.structure(again) == jax.tree.structure(params)
    for a, b in zip(jax.tree.leaves(again), jax.tree.leaves(params), strict=True):
        np.testing.assert_array_equal(a, b)
    tokens = jnp.arange(6)[None] % CFG.vocab_size
    np.testing.assert_array_equal(  # layer i's weights are the stack's row i, in order
        forward(again, CFG, tokens, jnp.arange(6)[None])[0],
        forward(params, CFG, tokens, jnp.arange(6)[None])[0],
    )
