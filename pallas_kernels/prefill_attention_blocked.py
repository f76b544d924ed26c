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
