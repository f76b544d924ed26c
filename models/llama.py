"""The Llama-family decoder (Llama 2/3, Mistral, Qwen2) in Flax.

A pure function of (params, tokens, positions, kv cache) -> (logits, kv cache). The model knows
nothing of how the cache is stored: each attention layer hands its rotated q, k, v to an
`attention` callable with that layer's opaque cache entry (and a `carry` every layer reads and
replaces, e.g. a page pool) and gets the output, the new entry and the new carry back. Without
a cache the layer attends causally within the given tokens (training, scoring).

The decoder layers run under `jax.lax.scan` over their stacked weights (MaxText's
`scan_layers`): a program holds ONE layer body whatever the depth, so compiling a 30-layer model
costs about what a 1-layer one does. Per-layer cache entries are scanned too (stacked on a
leading L axis); a tuple of entries of different shapes (PyramidKV's layers) runs the layers
one after another instead.

Parameter names follow Hugging Face's module names; every decoder layer's tensors are stacked
on a leading axis L under `layers` (`stack_layers`; checkpoint files keep one tensor per layer,
`layers_i/...`, `unstack_layers`):
  embed_tokens/embedding [V, D]; layers/self_attn/{q,k,v}_proj/kernel [L, D, N|K, H],
  o_proj/kernel [L, N, H, D]; layers/mlp/{gate,up}_proj/kernel [L, D, F], down_proj/kernel
  [L, F, D]; layers/{input,post_attention}_layernorm/scale [L, D]; norm/scale [D];
  lm_head/kernel [D, V] (untied only).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

from jkv_models.config import ModelConfig

# attention(layer, q [B,T,N,H], k [B,T,K,H], v [B,T,K,H], positions [B,T], entry, carry)
#   -> (out [B,T,N,H], entry, carry)
# `layer` is the layer's index: a traced int32 under the layer scan, a Python int when the
# layers run one by one (a tuple of cache entries). `entry` is the layer's cache entry (None
# without a cache), `carry` what the previous layer's call returned (None if unused). q and k
# arrive rotated by RoPE at `positions`, or as they left the projections when the callable has
# a true `rotates_qk` attribute (it then applies `apply_rope` itself, e.g. at positions of its
# own choosing).
AttentionFn = Callable[
    [Any, jax.Array, jax.Array, jax.Array, jax.Array, Any, Any], tuple[jax.Array, Any, Any]
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

    @nn.compact
    def __call__(self, x, positions, layer, entry, carry, attention: AttentionFn | None):
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
            out, entry, carry = attention(layer, q, key, val, positions, entry, carry)
        out = OutProj(cfg.hidden_size, dt, cfg.o_bias, name="o_proj")(out)
        return out, entry, carry


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
    """One layer; its parameters are one slice of the stacked `layers` tree."""

    config: ModelConfig

    @nn.compact
    def __call__(self, x, positions, layer, entry, carry, attention):
        cfg = self.config
        dt = jnp.dtype(cfg.dtype)
        h, entry, carry = Attention(cfg, name="self_attn")(
            RMSNorm(cfg.rms_norm_eps, dt, name="input_layernorm")(x),
            positions, layer, entry, carry, attention,
        )  # fmt: skip
        x = x + h
        x = x + MLP(cfg, name="mlp")(
            RMSNorm(cfg.rms_norm_eps, dt, name="post_attention_layernorm")(x)
        )
        return x, entry, carry


class Ends(nn.Module):
    """What is not a decoder layer: the embedding, the final norm, the output projection."""

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
        self.norm = RMSNorm(cfg.rms_norm_eps, dt)
        if not cfg.tie_word_embeddings:
            self.lm_head = _dense(cfg.vocab_size, "lm_head", dt)

    def embed(self, tokens):
        return self.embed_tokens(tokens)  # [B, T, D]

    def final_norm(self, x):
        return self.norm(x)

    def logits(self, hidden):
        if self.config.tie_word_embeddings:
            out = self.embed_tokens.attend(hidden)
        else:
            out = self.lm_head(hidden)
        return out.astype(jnp.float32)

    def __call__(self, tokens):  # init: every parameter of the ends
        return self.logits(self.final_norm(self.embed(tokens)))


def _ends(params) -> dict:
    return {"params": {n: p for n, p in params.items() if n != LAYERS}}


LAYERS = "layers"  # the stacked decoder layers' subtree


def run_layers(
    params, config: ModelConfig, x, positions, cache=None, attention=None, carry=None,
    remat: bool = False,
):  # fmt: skip
    """The decoder layers over hidden states x `[B, T, D]`: under `lax.scan` over the stacked
    weights (and `cache`'s stacked entries, if any), or one by one when `cache` is a tuple of
    per-layer entries. `remat`: a gradient through them keeps each layer's input only and
    recomputes the rest (memory of one layer's activations, not all of them). Returns (x, the
    new cache, the final carry)."""
    layer = DecoderLayer(config)

    def one(weights, x, index, entry, carry):
        return layer.apply({"params": weights}, x, positions, index, entry, carry, attention)

    if remat:
        one = jax.checkpoint(one)

    stacked = params[LAYERS]
    if isinstance(cache, tuple | list):  # entries of different shapes: one layer at a time
        if len(cache) != config.num_layers:
            raise ValueError(f"{len(cache)} cache entries for {config.num_layers} layers")
        entries = []
        for i, entry in enumerate(cache):
            x, entry, carry = one(_layer_weights(stacked, i), x, i, entry, carry)
            entries.append(entry)
        return x, tuple(entries), carry

    def body(c, xs):
        x, carry = c
        weights, index, entry = xs
        x, entry, carry = one(weights, x, index, entry, carry)
        return (x, carry), entry

    index = jnp.arange(config.num_layers, dtype=jnp.int32)
    (x, carry), entries = jax.lax.scan(body, (x, carry), (stacked, index, cache))
    return x, entries, carry


def _layer_weights(stacked, i: int):
    """Layer i's weights, read in place from the stacked tensors: a dynamic index XLA cannot
    fold into a static slice (which XLA:CPU copies, and hoists out of a decode loop: a second
    copy of every weight)."""
    (index,) = jax.lax.optimization_barrier((jnp.int32(i),))
    return jax.tree.map(lambda w: jax.lax.dynamic_index_in_dim(w, index, keepdims=False), stacked)


def init_params(config: ModelConfig, key: jax.Array) -> dict:
    """Random parameters (normal(0.02) weights, unit norms), as a plain nested dict with the
    decoder layers stacked under `layers`."""
    tokens = jnp.zeros((1, 2), jnp.int32)
    ends_key, layers_key = jax.random.split(key)
    params = dict(Ends(config).init(ends_key, tokens)["params"])
    x = jnp.zeros((1, 2, config.hidden_size), jnp.dtype(config.dtype))

    def one(k):
        return DecoderLayer(config).init(k, x, tokens, 0, None, None, None)["params"]

    params[LAYERS] = jax.vmap(one)(jax.random.split(layers_key, config.num_layers))
    return params


def param_shapes(config: ModelConfig) -> dict:
    """The parameter tree as `jax.ShapeDtypeStruct`s, without allocating (any model size)."""
    return jax.eval_shape(lambda k: init_params(config, k), jax.random.key(0))


def stack_layers(weights: dict) -> dict:
    """A tree with one subtree per layer (`layers_0`, `layers_1`, ...: checkpoint files' and
    older jkv trees' layout) as the model's, the layers stacked under `layers`; a tree already
    stacked is returned as it is."""
    names = sorted((k for k in weights if k.startswith("layers_")), key=lambda k: int(k[7:]))
    if not names:
        return weights
    if names != [f"layers_{i}" for i in range(len(names))]:
        raise ValueError(f"layer subtrees {names}: expected layers_0 .. layers_{len(names) - 1}")
    out = {k: v for k, v in weights.items() if not k.startswith("layers_")}
    out[LAYERS] = jax.tree.map(lambda *xs: _stack(xs), *(weights[k] for k in names))
    return out


def _stack(xs):
    if isinstance(xs[0], jax.ShapeDtypeStruct):
        return jax.ShapeDtypeStruct((len(xs), *xs[0].shape), xs[0].dtype)
    if all(isinstance(x, jax.Array) for x in xs):
        return jnp.stack(xs)
    return jnp.asarray(np.stack([np.asarray(x) for x in xs]))


def unstack_layers(weights: dict) -> dict:
    """The model's tree with its stacked `layers` as one subtree per layer (`layers_i`): the
    layout checkpoint files name tensors by. Leaves are views where the arrays allow."""
    if LAYERS not in weights:
        return weights
    out = {k: v for k, v in weights.items() if k != LAYERS}
    leaves, treedef = jax.tree.flatten(weights[LAYERS])
    n = leaves[0].shape[0]
    for i in range(n):
        out[f"layers_{i}"] = jax.tree.unflatten(treedef, [_slice(x, i) for x in leaves])
    return out


def _slice(x, i):
    if isinstance(x, jax.ShapeDtypeStruct):
        return jax.ShapeDtypeStruct(x.shape[1:], x.dtype)
    return x[i]


def hidden_states(params, config: ModelConfig, tokens, positions):
    """Final-norm hidden states `[B, T, D]` of a cache-free causal pass (embeddings, probes)."""
    ends = Ends(config)
    x = ends.apply(_ends(params), tokens, method=Ends.embed)
    x, _, _ = run_layers(params, config, x, positions)
    return ends.apply(_ends(params), x, method=Ends.final_norm)


def forward(
    params,
    config: ModelConfig,
    tokens,
    positions,
    cache=None,
    attention: AttentionFn | None = None,
    *,
    logits_at=None,
    carry=None,
    remat: bool = False,
):
    """Runs the decoder.

    Args:
      params: the parameter tree (`init_params` layout: the layers stacked).
      config: the model config (static under jit).
      tokens: `[B, T]` int32 token ids.
      positions: `[B, T]` int32 absolute positions (RoPE angles and causal order).
      cache: the layers' cache entries, stacked on a leading L axis (scanned), or a tuple of L
        entries (the layers then run one by one), or None.
      attention: called by every layer as `attention(layer, q, k, v, positions, entry, carry)`
        (`AttentionFn`); None: causal attention within `tokens` (no cache).
      logits_at: optional `[B]` int32 index of the one position per row whose logits are wanted,
        or `[B, R]` of R positions per row (a flattened batch of ragged rows).
      carry: what the first layer's `attention` call receives (e.g. the engine's page pool);
        each call's returned carry goes to the next layer's.
      remat: recompute each layer's activations in a gradient's backward pass (`run_layers`).

    Returns:
      (logits float32 `[B, T, V]`, or `[B, V]` (`[B, R, V]`) with `logits_at`; the new cache
      (stacked like `cache`; with `cache=None`, whatever the calls returned as their entries,
      stacked); and, when `carry` is given, the last layer's carry as a third value).
    """
    ends = Ends(config)
    x = ends.apply(_ends(params), tokens, method=Ends.embed)
    x, cache, out_carry = run_layers(params, config, x, positions, cache, attention, carry, remat)
    hidden = ends.apply(_ends(params), x, method=Ends.final_norm)
    if logits_at is not None and logits_at.ndim == 2:
        hidden = jnp.take_along_axis(hidden, logits_at[:, :, None], axis=1)  # [B, R, D]
    elif logits_at is not None:
        hidden = jnp.take_along_axis(hidden, logits_at[:, None, None], axis=1)[:, 0]  # [B, D]
    logits = ends.apply(_ends(params), hidden, method=Ends.logits)
    if carry is not None:
        return logits, cache, out_carry
    return logits, cache
