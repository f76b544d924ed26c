"""Attention over the KV state: append the new tokens, then attend over every valid slot.

Which kernels run is the backend's (`jkv.core.backends`): on "xla" everything is jnp here
(scatter appends, masked-softmax attention, fp8 through the kernels' jnp references); on the
Pallas backends every decode step runs the `decode_attention` kernel (fp8 dequantised in
registers) and fp8 appends run `quantize_append`; prefill (T > 1 query tokens) stays on the jnp
path.

RoPE is applied here, not in the model (the callable is `rotates_qk`): keys are stored rotated at
their positions, except for a `raw_keys` policy (StreamingLLM), whose keys are stored as they left
the projection and rotated on read to positions within the cache.

A KV policy (jkv.policies) hooks in at three points of each layer's call: where a decode token
is written (an evicting policy frees a slot when its row is at its budget), the positions keys
and queries are rotated by (StreamingLLM), and what it records afterwards (H2O's attention mass,
SnapKV's observation-window scores).

A state rebuilt by the SnapKV segment policy adds a logit bias per slot (merged slots) and
low-rank segments; both paths attend over ordinary slots and low-rank tokens in ONE softmax: the
XLA path scores the low-rank tokens as (q @ basis_k^T) @ coef_k^T beside the slots, the Pallas
path combines `decode_attention`'s and `lowrank_attention`'s results through their
log-sum-exps. Neither reconstructs a low-rank segment.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jkv import kv as kvlib
from jkv.core.backends import Ops, ops
from jkv_kernels import combine_attention
from jkv_models.llama import rope

MASKED = -1e30  # finite: a fully masked row stays NaN-free


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
    q: jax.Array,
    q_positions: jax.Array,
    layer: kvlib.LayerKV,
    sliding_window: int | None = None,
    *,
    q_valid: jax.Array | None = None,
    return_mass: bool = False,
    key_rotation: tuple[jax.Array, jax.Array] | None = None,
):
    """Attention of q `[B, T, N, H]` over the cache (float32 math). Returns `[B, T, N, H]`.

    A query with no visible slot gets zeros, never NaN. With `return_mass`, also the attention
    probability each slot received, summed over the group's G heads and over the queries
    marked in `q_valid` `[B, T]`: `[B, K, S]` float32. `key_rotation` = (positions `[B, K, S]`,
    inv_freq) rotates the keys by those positions first (StreamingLLM's re-rotation).
    """
    segmented = layer.bias is not None or layer.lowrank is not None
    if segmented and (return_mass or key_rotation is not None):
        raise ValueError(
            f"{return_mass=} key_rotation={key_rotation is not None}: a segment-rebuilt cache "
            "supports neither attention mass nor key re-rotation"
        )
    k, v = kvlib.dequantised(layer, q.dtype)
    if key_rotation is not None:
        k = rope(k, *key_rotation)
    # Slots past a row's length may hold anything (NaN included); a zero probability times NaN
    # is NaN, so V is masked, not only the scores.
    valid = jnp.arange(layer.capacity) < layer.lengths[:, :, None]  # [B, K, S]
    v = jnp.where(valid[..., None], v, jnp.zeros((), v.dtype))
    mask = slot_mask(layer, q_positions, sliding_window)  # [B, K, T, S]
    if q_valid is not None:
        mask &= q_valid[:, None, :, None]
    if segmented:
        return segment_attention(q, k, v, mask, layer, q_positions, sliding_window, q_valid)
    return masked_attention(q, k, v, mask, return_mass=return_mass)


def lowrank_mask(lr: kvlib.LowRank, q_positions, sliding_window, q_valid=None):
    """`[B, K, T, M, L]` bool: low-rank token (m, l) is visible to query t of row b."""
    live = jnp.arange(lr.coef_k.shape[3]) < lr.counts[..., None]  # [B, K, M, L]
    delta = q_positions[:, None, :, None, None] - lr.positions[:, :, None]
    mask = live[:, :, None] & (delta >= 0)
    if sliding_window is not None:
        mask &= delta < sliding_window
    if q_valid is not None:
        mask &= q_valid[:, None, :, None, None]
    return mask


def segment_attention(q, k, v, mask, layer, q_positions, sliding_window=None, q_valid=None):
    """One softmax over the slots (k, v `[B, K, S, H]`, mask `[B, K, T, S]`, plus
    `layer.bias`) and the low-rank tokens of `layer.lowrank`, whose keys and values stay
    factored: scores (q @ basis_k^T) @ coef_k^T, output (p @ coef_v) @ basis_v. float32 maths;
    returns `[B, T, N, H]` in q.dtype (zeros where a query sees nothing)."""
    b, t, n, h = q.shape
    kh = k.shape[1]
    f32 = jnp.float32
    qg = q.reshape(b, t, kh, n // kh, h).astype(f32)
    z = jnp.einsum("btkgh,bksh->bkgts", qg, k.astype(f32), precision="highest") * (h**-0.5)
    if layer.bias is not None:
        z = z + layer.bias[:, :, None, None, :]
    parts = [jnp.where(mask[:, :, None], z, MASKED)]
    lr = layer.lowrank
    if lr is not None:
        m, seg_len = lr.coef_k.shape[2:4]
        qb = jnp.einsum("btkgh,bkmrh->bkgtmr", qg, lr.basis_k.astype(f32), precision="highest")
        zl = jnp.einsum("bkgtmr,bkmlr->bkgtml", qb, lr.coef_k.astype(f32), precision="highest")
        lmask = lowrank_mask(lr, q_positions, sliding_window, q_valid)  # [B, K, T, M, L]
        zl = jnp.where(lmask[:, :, None], zl * (h**-0.5), MASKED)
        parts.append(zl.reshape(*zl.shape[:4], m * seg_len))
    p, scale = masked_softmax(jnp.concatenate(parts, axis=-1), axis=-1)  # scale [B, K, G, T]
    s = k.shape[2]
    out = jnp.einsum("bkgts,bksh->btkgh", p[..., :s], v.astype(f32), precision="highest")
    if lr is not None:
        pl_ = p[..., s:].reshape(*p.shape[:4], m, seg_len)
        pc = jnp.einsum("bkgtml,bkmlr->bkgtmr", pl_, lr.coef_v.astype(f32), precision="highest")
        out += jnp.einsum("bkgtmr,bkmrh->btkgh", pc, lr.basis_v.astype(f32), precision="highest")
    out = out * jnp.transpose(scale, (0, 3, 1, 2))[..., None]
    return out.reshape(b, t, n, h).astype(q.dtype)


def masked_softmax(scores: jax.Array, axis: int):
    """Unnormalised probabilities of scores already masked to `MASKED`, and the factor that
    normalises them: (p, scale) with p = exp(scores - max) (exactly 0 where masked) and scale =
    1 / sum(p), 0 where every score is masked (a query that sees nothing gets zeros, not NaN).
    `scale` has `axis` reduced away; dividing the small attention output by it, rather than the
    probabilities, keeps XLA's CPU fusions cheap."""
    top = jnp.max(scores, axis=axis, keepdims=True)
    p = jnp.exp(scores - top)
    denom = jnp.sum(p, axis=axis)
    seen = jnp.squeeze(top, axis) > MASKED / 2
    return p, jnp.where(seen, 1.0 / denom, 0.0)


def masked_attention(q, k, v, mask, *, return_mass: bool = False):
    """Softmax attention of q `[B, T, N, H]` over k, v `[B, K, S, H]` where mask `[B, K, T, S]`.

    Written for XLA's CPU fusions: one pass builds masked scores, one takes exp and the row sum,
    and the division happens on the small `[B, T, N, H]` output, not on the probabilities.
    """
    b, t, n, h = q.shape
    kh = k.shape[1]
    if t == 1:
        return _decode_attention(q, k, v, mask[:, :, 0], return_mass=return_mass)
    qg = q.reshape(b, t, kh, n // kh, h)
    scores = jnp.einsum("btkgh,bksh->bkgts", qg, k, preferred_element_type=jnp.float32)
    scores = jnp.where(mask[:, :, None], scores * (h**-0.5), MASKED)
    p, scale = masked_softmax(scores, axis=-1)  # scale [B, K, G, T]
    out = jnp.einsum("bkgts,bksh->btkgh", p.astype(v.dtype), v, preferred_element_type=jnp.float32)
    out = out * jnp.transpose(scale, (0, 3, 1, 2))[..., None]
    out = out.reshape(b, t, n, h).astype(q.dtype)
    if not return_mass:
        return out
    return out, jnp.einsum("bkgts,bkgt->bks", p, scale)


def _decode_attention(q, k, v, mask, *, return_mass: bool = False):
    """One query token: q `[B, 1, N, H]`, mask `[B, K, S]`, scores laid out `[B, K, S, G]`.

    K is the dot's left operand, contracted on its last (contiguous) dim, so XLA:CPU reads the
    cache in place; with `[B, K, G, S]` scores it first copies K transposed, every step.
    """
    b, _, n, h = q.shape
    kh = k.shape[1]
    qg = q.reshape(b, kh, n // kh, h)
    scores = jnp.einsum("bksh,bkgh->bksg", k, qg, preferred_element_type=jnp.float32)
    scores = jnp.where(mask[..., None], scores * (h**-0.5), MASKED)
    p, scale = masked_softmax(scores, axis=2)  # scale [B, K, G]
    out = jnp.einsum("bksg,bksh->bkgh", p.astype(v.dtype), v, preferred_element_type=jnp.float32)
    out = (out * scale[..., None]).reshape(b, 1, n, h).astype(q.dtype)
    if not return_mass:
        return out
    return out, jnp.einsum("bksg,bkg->bks", p, scale)


def _kernel_decode(q, layer, q_positions, sliding_window, kernels: Ops, return_mass, key_rotation):
    """Decode attention through the Pallas kernel: q `[B, 1, N, H]` -> `[B, 1, N, H]`."""
    windowed = sliding_window is not None
    rot_pos, inv_freq = key_rotation if key_rotation is not None else (None, None)
    if windowed and rot_pos is not None:
        raise ValueError("a sliding window and key re-rotation cannot be combined")
    lr = layer.lowrank
    if lr is not None and (return_mass or rot_pos is not None):
        raise ValueError("low-rank segments support neither attention mass nor key re-rotation")
    res = kernels.decode_attention(
        q[:, 0],
        layer.k,
        layer.v,
        layer.lengths,
        k_scale=layer.k_scale,
        v_scale=layer.v_scale,
        # Every valid slot precedes the query, so only a window needs positions (the causal
        # test is implied); re-rotation passes the rotation positions instead.
        positions=rot_pos if rot_pos is not None else (layer.positions if windowed else None),
        q_positions=q_positions[:, 0] if windowed else None,
        rope_inv_freq=inv_freq,
        slot_bias=layer.bias,
        sliding_window=sliding_window,
        return_mass=return_mass,
        return_lse=lr is not None,
    )
    if lr is not None:  # join the low-rank segments' softmax to the slots' one
        out, lse = res
        lr_out, lr_lse = kernels.lowrank_attention(
            q[:, 0],
            lr.coef_k,
            lr.basis_k,
            lr.coef_v,
            lr.basis_v,
            lr.counts,
            lr.rank_k,
            lr.rank_v,
            positions=lr.positions if windowed else None,
            q_positions=q_positions[:, 0] if windowed else None,
            sliding_window=sliding_window,
        )
        return combine_attention(out, lse, lr_out, lr_lse).astype(q.dtype)[:, None]
    if return_mass:
        return res[0][:, None], res[1]
    return res[:, None]


def flash_ready(layer: kvlib.LayerKV) -> bool:
    """Whether the prefill kernels (and their blocked jnp twin) take this layer: no low-rank
    segments, a head dim they tile (a power of two >= 16)."""
    h = layer.k.shape[-1]
    return layer.lowrank is None and h >= 16 and h & (h - 1) == 0


def chunk_attention(q, q_positions, n_new, layer, sliding_window, kernels: Ops, want_mass,
                    key_rotation):  # fmt: skip
    """Attention of T > 1 new queries per row over the cache, key block by key block (flash
    attention; no [T, S] score tensor): q `[B, T, N, H]` -> `[B, T, N, H]`, and with `want_mass`
    the probability each slot received `[B, K, S]` (a second pass over the keys)."""
    rot_pos, inv_freq = key_rotation if key_rotation is not None else (None, None)
    common = dict(
        q_lengths=n_new,
        k_scale=layer.k_scale,
        slot_bias=layer.bias,
        rope_positions=rot_pos,
        rope_inv_freq=inv_freq,
        sliding_window=sliding_window,
    )
    res = kernels.prefill_attention(
        q, layer.k, layer.v, layer.lengths, layer.positions, q_positions,
        v_scale=layer.v_scale, return_lse=want_mass, **common,
    )  # fmt: skip
    if not want_mass:
        return res
    out, lse = res
    mass = kernels.prefill_attention_mass(
        q, layer.k, layer.lengths, layer.positions, q_positions, lse, **common
    )
    return out, mass


def make_attention(
    n_new: jax.Array,
    *,
    sliding_window: int | None,
    backend: str = "xla",
    policy=None,
    limit: jax.Array | None = None,
    inv_freq: jax.Array,
):
    """The per-layer callable the model calls: rotate, append the T new tokens, attend.

    Args:
      n_new: `[B]` int32, how many of the T tokens of each row are real (the rest is padding).
      sliding_window: Mistral's window, or None.
      backend: one of `jkv.core.backends.BACKENDS`.
      policy: the KV policy shaping the state (its `jit_key()`), or None for the full cache.
      limit: `[B]` int32 slots each row may hold (`KVState.limit`; evicting policies).
      inv_freq: the model's RoPE inverse frequencies `[H/2]`.
    """
    kernels = ops(backend)
    active = policy is not None
    raw_keys = active and policy.raw_keys
    if raw_keys and sliding_window is not None:
        raise ValueError(
            f"kv_policy={policy.name!r} rotates keys to positions within its cache, which a "
            f"model's sliding_window={sliding_window} (in text positions) cannot follow; use "
            "another policy or the full cache"
        )

    def attention(layer_index, q, k, v, positions, layer: kvlib.LayerKV, carry):
        t = q.shape[1]
        decoding = t == 1
        start = policy.write_slots(layer, positions[:, 0], limit) if active and decoding else None
        if not raw_keys:
            k = rope(k, positions[:, :, None], inv_freq)
        layer = kvlib.append(
            layer, k, v, positions, n_new, start=start, quantize_append=kernels.quantize_append
        )
        want_mass = active and policy.wants_mass
        key_rotation = None
        if raw_keys:  # attend as if the cache were contiguous text
            slot_pos, q_pos = policy.cache_positions(layer, positions)
            q = rope(q, q_pos[:, :, None], inv_freq)
            key_rotation = (slot_pos, inv_freq)
        else:
            q = rope(q, positions[:, :, None], inv_freq)
        if kernels.decode_attention is not None and decoding:
            res = _kernel_decode(
                q, layer, positions, sliding_window, kernels, want_mass, key_rotation
            )
        elif not decoding and flash_ready(layer):
            res = chunk_attention(
                q, positions, n_new, layer, sliding_window, kernels, want_mass, key_rotation
            )
        else:
            q_valid = jnp.arange(t)[None, :] < n_new[:, None]
            res = cached_attention_reference(
                q,
                positions,
                layer,
                sliding_window,
                q_valid=q_valid,
                return_mass=want_mass,
                key_rotation=key_rotation,
            )
        out, mass = res if want_mass else (res, None)
        if active:
            layer = policy.observe(layer_index, layer, q, positions, n_new, mass, kernels)
        return out, layer, carry

    attention.rotates_qk = True
    return attention
