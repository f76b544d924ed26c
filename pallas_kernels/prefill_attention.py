"""Prefill attention (T new queries per row) over a ragged, optionally FP8, GQA KV cache.

Chunked prefill: the chunk's own keys are already in the cache, so this only reads it.
Maths, for row b, kv head k, query head n = k*G + g, query t < q_len[b], slot s:

    kk[s]    = K[b,k,s] * k_scale[b,k,s]                 (scale only for FP8 storage)
    kk[s]    = kk[s]*cos(rp[s]*f) + rotate_half(kk[s])*sin(rp[s]*f)
                                        (RoPE on read: rp = rope_positions, f = rope_inv_freq)
    vis[t,s] = s < len[b,k] and keep[b,k,s] and pos[s] <= qpos[t]     (causal by position,
               and qpos[t] - pos[s] < window                            not by slot index)
    z[t,g,s] = sm_scale * q[b,t,n] . kk[s] + bias[b,k,s]   where vis[t,s], else -inf
    lse[t,g] = log sum_s exp(z[t,g,s])                     (-inf when nothing is visible)
    out[b,t,n] = sum_s exp(z[t,g,s] - lse[t,g]) * V[b,k,s] * v_scale[b,k,s]
                                        (0 when nothing is visible, and for t >= q_len[b])
    mass[b,k,s] = sum_{t < q_len, g} exp(z[t,g,s] - lse[t,g])   (H2O's accumulated attention)

Flash attention (Dao et al. 2022) on the grid (B, K, query blocks): the T*G query rows of a kv
head are flattened (r = t*G + g) and tiled by block_r >= 16 rows (Triton's dot needs M >= 16);
a program keeps the online softmax (running max m, sum l, unnormalised output o) over key
blocks below the row's length. A key block whose slots are all dropped (keep bits 0), or all
in the future of (or outside the window of) every query of the program, is skipped after
reading only its positions and keep bits: K and V are not loaded. Scales factor out of the
dots (z = (q . k8) * ks, o = (p * vs) @ v8), so FP8 is decoded from its bits in registers.
`prefill_attention_mass.py` is a second kernel on the grid (B, K, key blocks): each program
loads its keys once and walks the query blocks, adding exp(z - lse) per slot.
`prefill_attention_blocked.py` is the same online softmax in plain jnp (a `fori_loop` over key
blocks), for XLA: float32 temporaries are O(B*K*G*T*(H + block_s)), never [T, S]. The pieces
they share are in `prefill_parts.py`.

Bytes per call (itemsize i = 4 / 2 / 1 for f32 / bf16 / fp8 storage, iq for q; P =
cdiv(T*G, block_r) query blocks per (row, kv head); only live key blocks are read):
    attention read   P * B*K*len*(2*H*i + 4 [positions] + 2*2 [bf16 FP8 scales] + 4 [slot_bias]
                     + 4 [rope_positions] + 1/8 [keep bits]) + B*T*N*(H*iq + 4 [q_positions])
              write  B*T*N*H*iq (out) + 4*B*T*N (lse)
    mass      read   B*K*len*(H*i + the same per-slot vectors, one scale) once
                     + cdiv(S, block_s) * B*T*N*(H*iq + 4 [lse] + 4 [q_positions])
              write  4*B*K*S
    both      + one read and one write of q (and out) to move rows to [B, K, T*G, H] and back
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from jkv_kernels import _backend as bk
from jkv_kernels.prefill_parts import (
    JNP_STATICS,
    KERNEL_STATICS,
    any_visible,
    block_logits,
    finish,
    from_rows,
    jnp_setup,
    kernel_inputs,
    load_keys,
    logits_jnp,
    query_rows,
    setup,
    slot_block,
    slots_jnp,
    to_rows,
    validate,
    visible,
)

# --- The kernel -----------------------------------------------------------------------------


def prefill_attention_kernel(
    *refs,
    n_heads: int,
    block_r: int,
    block_s: int,
    sm_scale: float,
    compute_dtype,
    fp8: bool,
    bias: bool,
    keep: bool,
    rope: bool,
    window: int | None,
    lse: bool,
):
    refs = list(refs)
    q_ref = refs.pop(0)  # [R, H] query rows r = t*G + g of one (row, kv head), R = T*G
    k_ref = refs.pop(0)  # [S, H] keys of one (row, kv head); uint8 bits when FP8
    v_ref = refs.pop(0)  # [S, H] values, same storage
    len_ref = refs.pop(0)  # [] valid slots of this (row, kv head)
    qlen_ref = refs.pop(0)  # [] real queries of this row
    qpos_ref = refs.pop(0)  # [T] int32 position of each query
    pos_ref = refs.pop(0)  # [S] int32 position of each slot
    ks_ref = refs.pop(0) if fp8 else None  # [S] key scales
    vs_ref = refs.pop(0) if fp8 else None  # [S] value scales
    bias_ref = refs.pop(0) if bias else None  # [S] float32 logit bias per slot
    keep_ref = refs.pop(0) if keep else None  # [ceil(S/32)] uint32 packed keep bits
    rpos_ref = refs.pop(0) if rope else None  # [S] int32 RoPE position of each slot
    inv_ref = refs.pop(0) if rope else None  # [H/2] float32 RoPE inverse frequencies
    o_ref = refs.pop(0)  # [R, H] output rows, q's dtype
    lse_ref = refs.pop(0) if lse else None  # [R] float32 log-sum-exp of each row's logits

    n_rows, h = q_ref.shape
    length = len_ref[()]
    n_real = qlen_ref[()] * n_heads
    r0 = pl.program_id(2) * block_r
    rows, real, qpos = query_rows(r0, block_r, n_real, n_heads, qpos_ref)
    in_range = rows < n_rows
    q = bk.load(q_ref.at[pl.ds(r0, block_r), :], mask=in_range[:, None], other=0)
    q = q.astype(compute_dtype)
    n_blocks = jnp.where(r0 < n_real, (length + block_s - 1) // block_s, 0)

    def update(s0, live, pos, carry):
        kf = load_keys(k_ref, s0, block_s, live, fp8=fp8, rpos_ref=rpos_ref, inv_ref=inv_ref)
        z = block_logits(
            q, kf, s0, block_s, live,
            ks_ref=ks_ref, bias_ref=bias_ref, sm_scale=sm_scale, compute_dtype=compute_dtype,
        )  # fmt: skip
        # where, not a multiplicative mask: garbage (NaN) in a dead slot must not leak.
        z = jnp.where(visible(live, pos, real, qpos, window), z, -jnp.inf)
        rows_s = pl.ds(s0, block_s)
        vs = None
        if fp8:
            vs = bk.load(vs_ref.at[rows_s], mask=live, other=0).astype(jnp.float32)
        # Dropped slots' values may be garbage: masked loads read them as 0 (p is 0 there).
        vb = bk.to_f32(bk.load(v_ref.at[rows_s, :], mask=live[:, None], other=0), fp8)
        return bk.softmax_update(carry, z, vb, compute_dtype, vs)

    def body(i, carry):
        s0 = i * block_s
        _, live, pos = slot_block(s0, block_s, length, pos_ref, keep_ref)
        return lax.cond(
            any_visible(live, pos, real, qpos, window),
            functools.partial(update, s0, live, pos),
            lambda c: c,
            carry,
        )

    o, m, lsum = lax.fori_loop(0, n_blocks, body, bk.softmax_start(block_r, h))
    live = real & (lsum > 0)
    l_safe = jnp.where(live, lsum, 1.0)
    out = jnp.where(live[:, None], o / l_safe[:, None], 0.0)
    bk.store(o_ref.at[pl.ds(r0, block_r), :], out.astype(o_ref.dtype), mask=in_range[:, None])
    if lse:
        m_use = jnp.where(m == -jnp.inf, 0.0, m)
        value = jnp.where(live, m_use + jnp.log(l_safe), -jnp.inf)
        bk.store(lse_ref.at[pl.ds(r0, block_r)], value, mask=in_range)


@functools.partial(jax.jit, static_argnames=KERNEL_STATICS + ("return_lse",))
def prefill_attention(
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
    block_q: int = 16,
    block_s: int = 64,
    num_warps: int = 4,
    num_stages: int = 2,
    backend: str = "triton",
    interpret: bool | None = None,
):
    """Attention of T new queries per row over a ragged GQA KV cache (flash attention).

    Args:
      q: [B, T, N, H] queries, already rotated; float32/bfloat16/float16.
      k, v: [B, K, S, H] cache (holding the chunk's own keys), float32, bfloat16 or
        float8_e4m3fn.
      lengths: [B, K] int32 valid slots 0..len-1 per (row, kv head), clipped to 0..S.
      positions: [B, K, S] int32 text position of each slot (any order).
      q_positions: [B, T] int32 text position of each query; a query sees the slots at or
        before its position (causal by position, not by slot index).
      q_lengths: [B] int32 real queries per row (clipped to 0..T); None means T. Padded
        queries output 0.
      k_scale, v_scale: [B, K, S] bfloat16 (or float32) per-slot scales; required exactly for
        FP8 storage.
      slot_bias: [B, K, S] float32 logit bias per slot (log counts of merged slots).
      keep_mask: [B, K, ceil(S/32)] uint32 keep bits (`kv_compact.pack_mask`); dropped slots
        never contribute, and a key block with no bit set is skipped without reading K, V.
      rope_positions: [B, K, S] int32 RoPE position of each slot; None means `positions`.
      rope_inv_freq: [H/2] float32; when given, keys are stored unrotated and rotated here.
      sliding_window: static int; a slot with q_position - position >= window is masked.
      sm_scale: softmax scale, default 1/sqrt(H).
      return_lse: also return the log-sum-exp of each query head's logits.
      block_q: queries per program (power of two); a program's tile is block_q*G query rows,
        rounded up to a power of two >= 16.
      block_s: slots per inner step (power of two >= 16).
      num_warps, num_stages: Triton compiler parameters.
      backend: "triton" (the only one so far).
      interpret: run the kernel in the Pallas interpreter; None means "on CPU".

    Returns:
      out [B, T, N, H] in q.dtype, or (out, lse [B, T, N] float32) with return_lse. A query
      that sees nothing (or is padding) gives out 0 and lse -inf.

    Raises:
      ValueError: on shapes, dtypes, block sizes or a backend that do not fit.
    """
    bk.check_backend(backend)
    interpret = bk.resolve_interpret(interpret)
    rope_positions = validate(
        q, k, v, lengths, positions, q_positions, q_lengths, k_scale, v_scale, slot_bias,
        keep_mask, rope_positions, rope_inv_freq, sliding_window,
    )  # fmt: skip
    block_r, block_s, sm_scale, compute_dtype = setup(q, k, block_q, block_s, sm_scale)
    b, t, n, h = q.shape
    _, kh, s, _ = k.shape
    g = n // kh
    rows = t * g
    fp8 = k.dtype == bk.FP8

    per_kv = lambda *blk: pl.BlockSpec((None, None, *blk), lambda i, j, _: (i, j) + (0,) * len(blk))
    extra, extra_specs = kernel_inputs(
        lengths, positions, q_positions, q_lengths, k_scale, v_scale, slot_bias, keep_mask,
        rope_positions, rope_inv_freq, b=b, t=t, s=s,
    )  # fmt: skip
    args = [to_rows(q, kh), bk.to_bits(k), bk.to_bits(v), *extra]
    in_specs = [
        per_kv(rows, h),  # q: all T*G rows of kv head j; program r loads rows r*block_r..
        per_kv(s, h),  # k: the whole row; the kernel walks it in block_s steps
        per_kv(s, h),  # v
        *extra_specs,
    ]
    out_shape = [jax.ShapeDtypeStruct((b, kh, rows, h), q.dtype)]
    out_specs = [per_kv(rows, h)]  # each program stores its own block_r rows (masked)
    if return_lse:
        out_shape.append(jax.ShapeDtypeStruct((b, kh, rows), jnp.float32))
        out_specs.append(per_kv(rows))

    kernel = functools.partial(
        prefill_attention_kernel,
        n_heads=g,
        block_r=block_r,
        block_s=block_s,
        sm_scale=sm_scale,
        compute_dtype=compute_dtype,
        fp8=fp8,
        bias=slot_bias is not None,
        keep=keep_mask is not None,
        rope=rope_inv_freq is not None,
        window=sliding_window,
        lse=return_lse,
    )
    outs = pl.pallas_call(
        kernel,
        grid=(b, kh, bk.cdiv(rows, block_r)),
        in_specs=in_specs,
        out_specs=out_specs,
        out_shape=out_shape,
        compiler_params=bk.compiler_params(num_warps, num_stages),
        interpret=interpret,
        name="jkv_prefill_attention",
    )(*args)
    out = from_rows(outs[0], t)
    return (out, from_rows(outs[1], t)) if return_lse else out


# --- The float32 reference -----------------------------------------------------------------


@functools.partial(jax.jit, static_argnames=JNP_STATICS)
def prefill_attention_reference(
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
):
    """Plain-jnp float32 `prefill_attention` (materialises the [B, K, G, T, S] scores)."""
    rope_positions = validate(
        q, k, v, lengths, positions, q_positions, q_lengths, k_scale, v_scale, slot_bias,
        keep_mask, rope_positions, rope_inv_freq, sliding_window,
    )  # fmt: skip
    qf, q_positions, q_real, sm_scale, lengths = jnp_setup(
        q, k, lengths, q_positions, q_lengths, sm_scale
    )
    kf, vf, live, pos, bias = slots_jnp(
        k, v, lengths, positions, k_scale, v_scale, slot_bias, keep_mask, rope_positions,
        rope_inv_freq, 0, k.shape[2], 0,
    )  # fmt: skip
    z = logits_jnp(qf, kf, live, pos, bias, q_positions, q_real, sliding_window, sm_scale)
    m = z.max(axis=-1)
    m_use = jnp.where(m == -jnp.inf, 0.0, m)
    e = jnp.exp(z - m_use[..., None])
    o = jnp.einsum("bkgts,bksh->bkgth", e, vf, precision="highest")
    return finish(o, m, e.sum(axis=-1), q, return_lse)
