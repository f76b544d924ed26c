"""Attention over the KV state: append the new tokens, then attend over every valid slot.

The backend switch lives here:
  "xla"               plain jnp (the CPU default): scatter appends, masked-softmax attention,
                      fp8 through the kernels' jnp references;
  "pallas"            the Pallas Triton kernels (the GPU default): `decode_attention` for
                      every decode step (fp8 dequantised in registers), `quantize_append` for
                      fp8 appends; prefill (T > 1 query tokens) stays on the XLA path;
  "pallas_interpret"  the same kernels in the Pallas interpreter, on any machine (slow: tests).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from jkv import kv as kvlib
from pallas_kernels import decode_attention, quantize_append, quantize_append_reference

BACKENDS = ("xla", "pallas", "pallas_interpret")


def validate_backend(backend: str | None) -> str:
    """Resolves None to the platform default and rejects unknown names."""
    if backend is None:
        return "pallas" if jax.default_backend() == "gpu" else "xla"
    if backend not in BACKENDS:
        raise ValueError(f"backend={backend!r} is not supported; expected one of {BACKENDS}")
    return backend


def _quantize_append_fn(backend: str):
    if backend == "xla":
        return quantize_append_reference
    return functools.partial(quantize_append, interpret=backend == "pallas_interpret")


def slot_mask(layer: kvlib.LayerKV, q_positions: jax.Array, sliding_window: int | None):
    """`[B, K, T, S]` bool: slot s of kv head k is visible to query t of row b."""
    s = layer.capacity
    valid = jnp.arange(s)[None, None, :] < layer.lengths[:, :, None]  # [B, K, S]
    delta = q_positions[:, None, :, None] - layer.positions[:, :, None, :]  # [B, K, T, S]
    mask = valid[:, :, None, :] & (delta >= 0)
    if sliding_window is not None:
        mask &= delta < sliding_window
    return mask


def cached_attention_reference(
    q: jax.Array, q_positions: jax.Array, layer: kvlib.LayerKV, sliding_window: int | None = None
) -> jax.Array:
    """Attention of q `[B, T, N, H]` over the cache (float32 math). Returns `[B, T, N, H]`.

    A query with no visible slot gets zeros, never NaN.
    """
    k, v = layer.k, layer.v
    if layer.k_scale is not None:  # fp8: dequantise (the Pallas kernel does this on read)
        k = k.astype(jnp.float32) * layer.k_scale[..., None].astype(jnp.float32)
        v = v.astype(jnp.float32) * layer.v_scale[..., None].astype(jnp.float32)
    mask = slot_mask(layer, q_positions, sliding_window)  # [B, K, T, S]
    return masked_attention(q, k.astype(q.dtype), v.astype(q.dtype), mask)


def masked_attention(q: jax.Array, k: jax.Array, v: jax.Array, mask: jax.Array) -> jax.Array:
    """Softmax attention of q `[B, T, N, H]` over k, v `[B, K, S, H]` where mask `[B, K, T, S]`.

    Written for XLA's CPU fusions: one pass builds masked scores, one takes exp and the row sum,
    and the division happens on the small `[B, T, N, H]` output, not on the probabilities.
    """
    b, t, n, h = q.shape
    kh = k.shape[1]
    if t == 1:
        return _decode_attention(q, k, v, mask[:, :, 0])
    qg = q.reshape(b, t, kh, n // kh, h)
    scores = jnp.einsum("btkgh,bksh->bkgts", qg, k, preferred_element_type=jnp.float32)
    scores = jnp.where(mask[:, :, None], scores * (h**-0.5), _MASKED)
    top = jnp.max(scores, axis=-1, keepdims=True)
    p = jnp.exp(scores - top)  # masked slots: exp(-1e30 - top) == 0 exactly
    denom = jnp.sum(p, axis=-1)  # [B, K, G, T]
    out = jnp.einsum("bkgts,bksh->btkgh", p.astype(v.dtype), v, preferred_element_type=jnp.float32)
    seen = top[..., 0] > _MASKED / 2  # rows with at least one visible slot
    scale = jnp.where(seen, 1.0 / denom, 0.0)  # [B, K, G, T]
    out = out * jnp.transpose(scale, (0, 3, 1, 2))[..., None]
    return out.reshape(b, t, n, h).astype(q.dtype)


def _decode_attention(q, k, v, mask):
    """One query token: q `[B, 1, N, H]`, mask `[B, K, S]`, scores laid out `[B, K, S, G]`.

    K is the dot's left operand, contracted on its last (contiguous) dim, so XLA:CPU reads the
    cache in place; with `[B, K, G, S]` scores it first copies K transposed, every step.
    """
    b, _, n, h = q.shape
    kh = k.shape[1]
    qg = q.reshape(b, kh, n // kh, h)
    scores = jnp.einsum("bksh,bkgh->bksg", k, qg, preferred_element_type=jnp.float32)
    scores = jnp.where(mask[..., None], scores * (h**-0.5), _MASKED)
    top = jnp.max(scores, axis=2, keepdims=True)  # [B, K, 1, G]
    p = jnp.exp(scores - top)
    denom = jnp.sum(p, axis=2)  # [B, K, G]
    out = jnp.einsum("bksg,bksh->bkgh", p.astype(v.dtype), v, preferred_element_type=jnp.float32)
    scale = jnp.where(top[:, :, 0] > _MASKED / 2, 1.0 / denom, 0.0)
    return (out * scale[..., None]).reshape(b, 1, n, h).astype(q.dtype)


_MASKED = -1e30  # finite: a fully masked row stays NaN-free


def make_attention(n_new: jax.Array, *, sliding_window: int | None, backend: str = "xla"):
    """The per-layer callable the model calls: append the T new tokens, attend over the cache.

    Args:
      n_new: `[B]` int32, how many of the T tokens of each row are real (the rest is padding).
      sliding_window: Mistral's window, or None.
      backend: one of `BACKENDS`.
    """
    backend = validate_backend(backend)
    qappend = _quantize_append_fn(backend)

    def attention(layer_index, q, k, v, positions, layer: kvlib.LayerKV):
        del layer_index
        layer = kvlib.append(layer, k, v, positions, n_new, quantize_append=qappend)
        if backend == "xla" or q.shape[1] != 1:
            return cached_attention_reference(q, positions, layer, sliding_window), layer
        # Decode on the kernel. Every valid slot precedes the query, so only a sliding window
        # needs positions (the causal test is implied).
        windowed = sliding_window is not None
        out = decode_attention(
            q[:, 0],
            layer.k,
            layer.v,
            layer.lengths,
            k_scale=layer.k_scale,
            v_scale=layer.v_scale,
            positions=layer.positions if windowed else None,
            q_positions=positions[:, 0] if windowed else None,
            sliding_window=sliding_window,
            interpret=backend == "pallas_interpret",
        )
        return out[:, None], layer

    return attention
