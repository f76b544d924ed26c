"""`prefill_attention_blocked`: `prefill_attention` in plain jnp for XLA, an online softmax over
key blocks (a `fori_loop`): float32 temporaries are O(B*K*G*T*(H + block_s)), never [T, S].
Same arguments and results as the kernel; tested against the same float32 reference.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax

from jkv_kernels.prefill_parts import (
    JNP_STATICS,
    finish,
    jnp_setup,
    logits_jnp,
    slots_jnp,
    validate,
)


@functools.partial(jax.jit, static_argnames=JNP_STATICS + ("block_s",))
def prefill_attention_blocked(
    q,
    k,
    v,
    lengths,
    positions,
    q_positions,
    *,
    q_lengths=None,
    k_scale=None,
    v_scale=None,
    slot_bias=None,
    keep_mask=None,
    rope_positions=None,
    rope_inv_freq=None,
    sliding_window: int | None = None,
    sm_scale: float | None = None,
    return_lse: bool = False,
    block_s: int = 256,
):
    """`prefill_attention` in plain jnp for XLA: an online softmax over key blocks.

    Same arguments and results as `prefill_attention`; `block_s` (any int >= 1) bounds the
    float32 temporaries to O(B*K*G*T*(H + block_s)). The loop stops at the longest row's
    length; a last block that would run past S is moved back to end at S, its slots already
    seen masked out, so the cache is never padded or copied.
    """
    rope_positions = validate(
        q, k, v, lengths, positions, q_positions, q_lengths, k_scale, v_scale, slot_bias,
        keep_mask, rope_positions, rope_inv_freq, sliding_window,
    )  # fmt: skip
    if not isinstance(block_s, int) or block_s < 1:
        raise ValueError(f"{block_s=}: expected a static int >= 1")
    qf, q_positions, q_real, sm_scale, lengths = jnp_setup(
        q, k, lengths, q_positions, q_lengths, sm_scale
    )
    b, kh, s, h = k.shape
    bs = min(block_s, s)

    def body(i, carry):
        o, m, lsum = carry
        start = jnp.minimum(i * bs, s - bs)
        kf, vf, live, pos, bias = slots_jnp(
            k, v, lengths, positions, k_scale, v_scale, slot_bias, keep_mask, rope_positions,
            rope_inv_freq, start, bs, i * bs,
        )  # fmt: skip
        z = logits_jnp(qf, kf, live, pos, bias, q_positions, q_real, sliding_window, sm_scale)
        m_new = jnp.maximum(m, z.max(axis=-1))
        m_use = jnp.where(m_new == -jnp.inf, 0.0, m_new)
        alpha = jnp.exp(m - m_use)
        p = jnp.exp(z - m_use[..., None])  # [B, K, G, T, bs]
        o = alpha[..., None] * o + jnp.einsum("bkgts,bksh->bkgth", p, vf, precision="highest")
        return o, m_new, alpha * lsum + p.sum(axis=-1)

    stats = qf.shape[:-1]  # [B, K, G, T]
    init = (
        jnp.zeros(qf.shape, jnp.float32),
        jnp.full(stats, -jnp.inf, jnp.float32),
        jnp.zeros(stats, jnp.float32),
    )
    n_blocks = (jnp.max(lengths) + bs - 1) // bs
    o, m, lsum = lax.fori_loop(0, n_blocks, body, init)
    return finish(o, m, lsum, q, return_lse)


@functools.partial(jax.jit, static_argnames=("sliding_window", "sm_scale", "block_s"))
def prefill_attention_mass_blocked(
    q,
    k,
    lengths,
    positions,
    q_positions,
    lse,
    *,
    q_lengths=None,
    k_scale=None,
    slot_bias=None,
    keep_mask=None,
    rope_positions=None,
    rope_inv_freq=None,
    sliding_window: int | None = None,
    sm_scale: float | None = None,
    block_s: int = 256,
):
    """`prefill_attention_mass` in plain jnp for XLA: key block by key block, each slot's
    exp(z - lse) summed over the G heads and the real queries, written into its block of the
    [B, K, S] result. Float32 temporaries are O(B*K*G*T*block_s), never [T, S].

    Same arguments and result as `prefill_attention_mass` (`lse` from
    `prefill_attention_blocked(..., return_lse=True)`); `block_s` any int >= 1.
    """
    rope_positions = validate(
        q, k, None, lengths, positions, q_positions, q_lengths, k_scale, None, slot_bias,
        keep_mask, rope_positions, rope_inv_freq, sliding_window, mass=True,
    )  # fmt: skip
    if not isinstance(block_s, int) or block_s < 1:
        raise ValueError(f"{block_s=}: expected a static int >= 1")
    if lse.shape != q.shape[:3] or lse.dtype != jnp.float32:
        raise ValueError(f"{lse.shape=} {lse.dtype=}: expected float32 {q.shape[:3]}")
    qf, q_positions, q_real, sm_scale, lengths = jnp_setup(
        q, k, lengths, q_positions, q_lengths, sm_scale
    )
    b, kh, s, _ = k.shape
    t, n = lse.shape[1:]
    lse = lse.reshape(b, t, kh, n // kh).transpose(0, 2, 3, 1)  # [B, K, G, T]
    lse = jnp.where(lse == -jnp.inf, 0.0, lse)  # such queries see nothing: p is 0 anyway
    bs = min(block_s, s)

    def body(i, mass):
        start = jnp.minimum(i * bs, s - bs)
        kf, _, live, pos, bias = slots_jnp(
            k, None, lengths, positions, k_scale, None, slot_bias, keep_mask, rope_positions,
            rope_inv_freq, start, bs, i * bs,
        )  # fmt: skip
        z = logits_jnp(qf, kf, live, pos, bias, q_positions, q_real, sliding_window, sm_scale)
        p = jnp.where(z == -jnp.inf, 0.0, jnp.exp(z - lse[..., None])).sum(axis=(2, 3))
        # The last block may overlap the one before: its slots already seen are dead (0) here.
        return lax.dynamic_update_slice_in_dim(
            mass, lax.dynamic_slice_in_dim(mass, start, bs, axis=2) + p, start, axis=2
        )

    n_blocks = (jnp.max(lengths) + bs - 1) // bs
    return lax.fori_loop(0, n_blocks, body, jnp.zeros((b, kh, s), jnp.float32))
