"""The Llama-family decoder (Llama 2/3, Mistral, Qwen2) in Flax.

A pure function of (params, tokens, positions, kv cache) -> (logits, kv cache). The model knows
nothing of how the cache is stored: each attention layer hands its rotated q, k, v to an
`attention` callable with that layer's opaque cache entry and gets the output and the new entry
back. Without a cache the layer attends causally within the given tokens (training, scoring).

Parameter names follow Hugging Face's module names so the converter is a short table:
  embed_tokens/embedding [V, D]; layers_i/self_attn/{q,k,v}_proj/kernel [D, N|K, H],
  o_proj/kernel [N, H, D]; layers_i/mlp/{gate,up}_proj/kernel [D, F], down_proj/kernel [F, D];
  {input,post_attention}_layernorm/scale [D]; norm/scale [D]; lm_head/kernel [D, V] (untied only).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp

from jkv_models.config import ModelConfig

# attention(layer, q [B,T,N,H], k [B,T,K,H], v [B,T,K,H], positions [B,T], cache) -> (out, cache)
# q and k arrive rotated by RoPE at `positions`, or as they left the projections when the
# callable has a true `rotates_qk` attribute (it then applies `apply_rope` itself, e.g. at
# positions of its own choosing).
AttentionFn = Callable[
    [int, jax.Array, jax.Array, jax.Array, jax.Array, Any], tuple[jax.Array, Any]
]


def rope_cos_sin(positions: jax.Array, inv_freq: jax.Array, dtype) -> tuple[jax.Array, jax.Array]:
    """cos, sin `[..., H]` for integer positions `[...]` (angles in float32, as HF does)."""
    angles = positions.astype(jnp.float32)[..., None] * inv_freq  # [..., H/2]
    angles = jnp.concatenate([angles, angles], axis=-1)  # [..., H]
    return jnp.cos(angles).astype(dtype), jnp.sin(angles).astype(dtype)


def apply_rope(x: jax.Array, cos: jax.Array, sin: jax.Array) -> jax.Array:
    """Rotate-half RoPE on x `[..., H]` with cos/sin broadcastable to x."""
    half = x.shape[-1] // 2
    rotated = jnp.concatenate([-x[..., half:], x[..., :half]], axis=-1)
    return x * cos + rotated * sin


def rope(x: jax.Array, positions: jax.Array, inv_freq: jax.Array) -> jax.Array:
    """x `[..., H]` rotated by integer `positions` `[...]` (shape of x without H), in x's dtype."""
    cos, sin = rope_cos_sin(positions, inv_freq, x.dtype)
    return apply_rope(x, cos, sin)


def causal_attention(q, k, v, q_positions, k_positions, *, sliding_window=None, k_valid=None):
    """Softmax attention of q `[B, T, N, H]` over k, v `[B, S, K, H]` by positions (float32 math).

    A key is visible when its position <= the query's (and within the sliding window); `k_valid`
    `[B, S]` masks padding. A query with no visible key gets zeros, never NaN.
    """
    b, t, n, h = q.shape
    kh = k.shape[2]
    qg = q.reshape(b, t, kh, n // kh, h)
    scores = jnp.einsum("btkgh,bskh->bkgts", qg, k, preferred_element_type=jnp.float32)
    delta = q_positions[:, :, None] - k_positions[:, None, :]  # [B, T, S]
    mask = delta >= 0
    if sliding_window is not None:
        mask &= delta < sliding_window
    if k_valid is not None:
        mask &= k_valid[:, None, :]
    scores = jnp.where(mask[:, None, None], scores * (h**-0.5), _MASKED)
    top = jnp.max(scores, axis=-1, keepdims=True)
    p = jnp.exp(scores - top)  # masked keys: exactly 0
    denom = jnp.sum(p, axis=-1)  # [B, K, G, T]
    out = jnp.einsum("bkgts,bskh->btkgh", p.astype(v.dtype), v, preferred_element_type=jnp.float32)
    scale = jnp.where(top[..., 0] > _MASKED / 2, 1.0 / denom, 0.0)
    out = out * jnp.transpose(scale, (0, 3, 1, 2))[..., None]
    return out.reshape(b, t, n, h).astype(q.dtype)


_MASKED = -1e30  # finite, so a query with no visible key stays NaN-free


class RMSNorm(nn.Module):
    eps: float
    dtype: Any

    @nn.compact
    def __call__(self, x):
        scale = self.param("scale", nn.initializers.ones, (x.shape[-1],), self.dtype)
        xf = x.astype(jnp.float32)
        xf = xf * jax.lax.rsqrt(jnp.mean(xf * xf, axis=-1, keepdims=True) + self.eps)
        return scale * xf.astype(x.dtype)


def _dense(features, name, dtype, *, use_bias=False, axis=-1):
    return nn.DenseGeneral(
        features,
        axis=axis,
        use_bias=use_bias,
        dtype=dtype,
        param_dtype=dtype,
        name=name,
        kernel_init=nn.initializers.normal(0.02),
    )


class OutProj(nn.Module):
    """o_proj: kernel `[N, H, D]` applied as one `[N*H, D]` matmul.

    A dot contracting two axes ([N, H]) runs ~4x slower on XLA:CPU than the same bytes as a
    plain matmul; the reshapes are free (contiguous).
    """

    features: int
    dtype: Any
    use_bias: bool = False

    @nn.compact
    def __call__(self, x):  # [B, T, N, H]
        n, h = x.shape[-2:]
        kernel = self.param(
            "kernel", nn.initializers.normal(0.02), (n, h, self.features), self.dtype
        )
        y = jnp.dot(x.reshape(*x.shape[:-2], n * h), kernel.reshape(n * h, self.features))
        if self.use_bias:
            y = y + self.param("bias", nn.initializers.zeros, (self.features,), self.dtype)
        return y


class Attention(nn.Module):
    config: ModelConfig
    layer: int

    @nn.compact
    def __call__(self, x, positions, cache, attention: AttentionFn | None):
        cfg = self.config
        dt = jnp.dtype(cfg.dtype)
        n, k, h = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        q = _dense((n, h), "q_proj", dt, use_bias=cfg.qkv_bias)(x)  # [B, T, N, H]
        key = _dense((k, h), "k_proj", dt, use_bias=cfg.qkv_bias)(x)  # [B, T, K, H]
        val = _dense((k, h), "v_proj", dt, use_bias=cfg.qkv_bias)(x)  # [B, T, K, H]
        if not getattr(attention, "rotates_qk", False):
            cos, sin = rope_cos_sin(positions, jnp.asarray(cfg.inv_freq()), dt)
            cos, sin = cos[:, :, None], sin[:, :, None]  # over the heads axis
            q, key = apply_rope(q, cos, sin), apply_rope(key, cos, sin)
        if attention is None:
            out = causal_attention(
                q, key, val, positions, positions, sliding_window=cfg.sliding_window
            )
        else:
            out, cache = attention(self.layer, q, key, val, positions, cache)
        out = OutProj(cfg.hidden_size, dt, cfg.o_bias, name="o_proj")(out)
        return out, cache


class MLP(nn.Module):
    config: ModelConfig

    @nn.compact
    def __call__(self, x):
        cfg = self.config
        dt = jnp.dtype(cfg.dtype)
        gate = _dense(cfg.intermediate_size, "gate_proj", dt, use_bias=cfg.mlp_bias)(x)
        up = _dense(cfg.intermediate_size, "up_proj", dt, use_bias=cfg.mlp_bias)(x)
        return _dense(cfg.hidden_size, "down_proj", dt, use_bias=cfg.mlp_bias)(nn.silu(gate) * up)


class DecoderLayer(nn.Module):
    config: ModelConfig
    layer: int

    @nn.compact
    def __call__(self, x, positions, cache, attention):
        cfg = self.config
        dt = jnp.dtype(cfg.dtype)
        h, cache = Attention(cfg, self.layer, name="self_attn")(
            RMSNorm(cfg.rms_norm_eps, dt, name="input_layernorm")(x), positions, cache, attention
        )
        x = x + h
        x = x + MLP(cfg, name="mlp")(
            RMSNorm(cfg.rms_norm_eps, dt, name="post_attention_layernorm")(x)
        )
        return x, cache


class Llama(nn.Module):
    """The decoder. `__call__` returns final-norm hidden states; `logits` projects to the vocab."""

    config: ModelConfig

    def setup(self):
        cfg = self.config
        dt = jnp.dtype(cfg.dtype)
        self.embed_tokens = nn.Embed(
            cfg.vocab_size,
            cfg.hidden_size,
            dtype=dt,
            param_dtype=dt,
            embedding_init=nn.initializers.normal(0.02),
        )
        self.layers = [DecoderLayer(cfg, i) for i in range(cfg.num_layers)]
        self.norm = RMSNorm(cfg.rms_norm_eps, dt)
        if not cfg.tie_word_embeddings:
            self.lm_head = _dense(cfg.vocab_size, "lm_head", dt)

    def __call__(
        self,
        tokens,
        positions,
        cache: Sequence[Any] | None = None,
        attention: AttentionFn | None = None,
    ):
        x = self.embed_tokens(tokens)  # [B, T, D]
        new_cache = []
        for i, layer in enumerate(self.layers):
            x, entry = layer(x, positions, None if cache is None else cache[i], attention)
            new_cache.append(entry)
        return self.norm(x), (None if cache is None else tuple(new_cache))

    def logits(self, hidden):
        if self.config.tie_word_embeddings:
            out = self.embed_tokens.attend(hidden)
        else:
            out = self.lm_head(hidden)
        return out.astype(jnp.float32)

    def embed(self, tokens, positions):
        """Final hidden states and logits in one pass (used by init)."""
        hidden, _ = self(tokens, positions)
        return self.logits(hidden)


def init_params(config: ModelConfig, key: jax.Array) -> dict:
    """Random parameters (normal(0.02) weights, unit norms), as a plain nested dict."""
    tokens = jnp.zeros((1, 2), jnp.int32)
    variables = Llama(config).init(key, tokens, jnp.zeros((1, 2), jnp.int32), method=Llama.embed)
    return variables["params"]


def param_shapes(config: ModelConfig) -> dict:
    """The parameter tree as `jax.ShapeDtypeStruct`s, without allocating (any model size)."""
    return jax.eval_shape(lambda k: init_params(config, k), jax.random.key(0))


def hidden_states(params, config: ModelConfig, tokens, positions):
    """Final-norm hidden states `[B, T, D]` of a cache-free causal pass (embeddings, probes)."""
    return Llama(config).apply({"params": params}, tokens, positions)[0]


def forward(
    params,
    config: ModelConfig,
    tokens,
    positions,
    cache=None,
    attention: AttentionFn | None = None,
    *,
    logits_at=None,
):
    """Runs the decoder.

    Args:
      params: the parameter tree (`init_params` layout).
      config: the model config (static under jit).
      tokens: `[B, T]` int32 token ids.
      positions: `[B, T]` int32 absolute positions (RoPE angles and causal order).
      cache: per-layer cache entries (a sequence of L opaque pytrees) or None.
      attention: called by every layer as `attention(layer, q, k, v, positions, cache_entry)`;
        None: causal attention within `tokens` (no cache).
      logits_at: optional `[B]` int32 index of the one position per row whose logits are wanted,
        or `[B, R]` of R positions per row (a flattened batch of ragged rows).

    Returns:
      (logits float32 `[B, T, V]`, or `[B, V]` (`[B, R, V]`) with `logits_at`; the new cache or
      None).
    """
    model = Llama(config)
    hidden, cache = model.apply({"params": params}, tokens, positions, cache, attention)
    if logits_at is not None and logits_at.ndim == 2:
        hidden = jnp.take_along_axis(hidden, logits_at[:, :, None], axis=1)  # [B, R, D]
    elif logits_at is not None:
        hidden = jnp.take_along_axis(hidden, logits_at[:, None, None], axis=1)[:, 0]  # [B, D]
    return model.apply({"params": params}, hidden, method=Llama.logits), cache
