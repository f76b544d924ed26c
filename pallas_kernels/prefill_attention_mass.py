"""`prefill_attention_mass`: the attention probability each cache slot received from a prefill
chunk (H2O's accumulated attention), a second kernel over K on the grid (B, K, key blocks): each
program loads its keys once and walks the query blocks, adding exp(z - lse) per slot, with the
log-sum-exps `prefill_attention(..., return_lse=True)` returned. Maths and byte counts in
`prefill_attention.py`; the float32 reference beside the kernel.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from jkv_kernels import _backend as bk
from jkv_kernels.prefill_parts import (
    KERNEL_STATICS,
    any_visible,
    block_logits,
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


def prefill_mass_kernel(
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
):
    refs = list(refs)
    q_ref = refs.pop(0)  # [R, H] query rows r = t*G + g of one (row, kv head)
    k_ref = refs.pop(0)  # [S, H] keys of one (row, kv head); uint8 bits when FP8
    lse_ref = refs.pop(0)  # [R] float32 log-sum-exp of each row (from prefill_attention)
    len_ref = refs.pop(0)  # [] valid slots
    qlen_ref = refs.pop(0)  # [] real queries of this row
    qpos_ref = refs.pop(0)  # [T] int32 position of each query
    pos_ref = refs.pop(0)  # [S] int32 position of each slot
    ks_ref = refs.pop(0) if fp8 else None  # [S] key scales
    bias_ref = refs.pop(0) if bias else None  # [S] float32 logit bias per slot
    keep_ref = refs.pop(0) if keep else None  # [ceil(S/32)] uint32 packed keep bits
    rpos_ref = refs.pop(0) if rope else None  # [S] int32 RoPE position of each slot
    inv_ref = refs.pop(0) if rope else None  # [H/2] float32 RoPE inverse frequencies
    mass_ref = refs.pop(0)  # [S] float32 mass per slot; this program writes its block_s slots

    s_total = k_ref.shape[0]
    length = len_ref[()]
    n_real = qlen_ref[()] * n_heads
    s0 = pl.program_id(2) * block_s
    slots, live, pos = slot_block(s0, block_s, length, pos_ref, keep_ref)
    kf = load_keys(k_ref, s0, block_s, live, fp8=fp8, rpos_ref=rpos_ref, inv_ref=inv_ref)
    has_live = jnp.sum(live.astype(jnp.int32)) > 0
    n_blocks = jnp.where(has_live, (n_real + block_r - 1) // block_r, 0)

    def add(r0, real, qpos, acc):
        q = bk.load(q_ref.at[pl.ds(r0, block_r), :], mask=real[:, None], other=0)
        z = block_logits(
            q.astype(compute_dtype), kf, s0, block_s, live,
            ks_ref=ks_ref, bias_ref=bias_ref, sm_scale=sm_scale, compute_dtype=compute_dtype,
        )  # fmt: skip
        lse = bk.load(lse_ref.at[pl.ds(r0, block_r)], mask=real, other=0)
        lse = jnp.where(lse == -jnp.inf, 0.0, lse)  # such rows see nothing: p is 0 anyway
        p = jnp.where(visible(live, pos, real, qpos, window), jnp.exp(z - lse[:, None]), 0.0)
        return acc + p.sum(axis=0)

    def body(j, acc):
        r0 = j * block_r
        _, real, qpos = query_rows(r0, block_r, n_real, n_heads, qpos_ref)
        return lax.cond(
            any_visible(live, pos, real, qpos, window),
            functools.partial(add, r0, real, qpos),
            lambda a: a,
            acc,
        )

    acc = lax.fori_loop(0, n_blocks, body, jnp.zeros((block_s,), jnp.float32))
    bk.store(mass_ref.at[pl.ds(s0, block_s)], acc, mask=slots < s_total)


@functools.partial(jax.jit, static_argnames=KERNEL_STATICS)
def prefill_attention_mass(
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
    block_q: int = 16,
    block_s: int = 64,
    num_warps: int = 4,
    num_stages: int = 2,
    backend: str = "triton",
    interpret: bool | None = None,
):
    """Attention probability each slot received from the chunk (a second pass over K).

    Args:
      q, k, lengths, positions, q_positions, q_lengths, k_scale, slot_bias, keep_mask,
      rope_positions, rope_inv_freq, sliding_window, sm_scale: as `prefill_attention`
        (no values: only the logits are recomputed).
      lse: [B, T, N] float32 from `prefill_attention(..., return_lse=True)` on the same inputs.
      block_q, block_s, num_warps, num_stages, backend, interpret: as `prefill_attention`.

    Returns:
      mass [B, K, S] float32: sum over the G heads of each kv head and the real queries of
      exp(z - lse); 0 past each length and in dropped slots.

    Raises:
      ValueError: on shapes, dtypes, block sizes or a backend that do not fit.
    """
    bk.check_backend(backend)
    interpret = bk.resolve_interpret(interpret)
    rope_positions = validate(
        q, k, None, lengths, positions, q_positions, q_lengths, k_scale, None, slot_bias,
        keep_mask, rope_positions, rope_inv_freq, sliding_window, mass=True,
    )  # fmt: skip
    if lse.shape != q.shape[:3] or lse.dtype != jnp.float32:
        raise ValueError(f"{lse.shape=} {lse.dtype=}: expected float32 {q.shape[:3]}")
    block_r, block_s, sm_scale, compute_dtype = setup(q, k, block_q, block_s, sm_scale)
    b, t, n, h = q.shape
    _, kh, s, _ = k.shape
    g = n // kh
    rows = t * g

    per_kv = lambda *blk: pl.BlockSpec((None, None, *blk), lambda i, j, _: (i, j) + (0,) * len(blk))
    extra, extra_specs = kernel_inputs(
        lengths, positions, q_positions, q_lengths, k_scale, None, slot_bias, keep_mask,
        rope_positions, rope_inv_freq, b=b, t=t, s=s,
    )  # fmt: skip
    args = [to_rows(q, kh), bk.to_bits(k), to_rows(lse, kh), *extra]
    in_specs = [
        per_kv(rows, h),  # q: all T*G rows of kv head j, walked in block_r steps
        per_kv(s, h),  # k: the whole row; program i loads slots i*block_s.. once
        per_kv(rows),  # lse: one per query row
        *extra_specs,
    ]
    kernel = functools.partial(
        prefill_mass_kernel,
        n_heads=g,
        block_r=block_r,
        block_s=block_s,
        sm_scale=sm_scale,
        compute_dtype=compute_dtype,
        fp8=k.dtype == bk.FP8,
        bias=slot_bias is not None,
        keep=keep_mask is not None,
        rope=rope_inv_freq is not None,
        window=sliding_window,
    )
    return pl.pallas_call(
        kernel,
        grid=(b, kh, bk.cdiv(s, block_s)),
        in_specs=in_specs,
        out_specs=per_kv(s),  # each program stores its own block_s slots (masked at S)
        out_shape=jax.ShapeDtypeStruct((b, kh, s), jnp.float32),
        compiler_params=bk.compiler_params(num_warps, num_stages),
        interpret=interpret,
        name="jkv_prefill_attention_mass",
    )(*args)


# --- The float32 reference -----------------------------------------------------------------


@functools.partial(jax.jit, static_argnames=("sliding_window", "sm_scale"))
def prefill_attention_mass_reference(
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
):
    """Plain-jnp float32 `prefill_attention_mass` (materialises the scores)."""
    rope_positions = validate(
        q, k, None, lengths, positions, q_positions, q_lengths, k_scale, None, slot_bias,
        keep_mask, rope_positions, rope_inv_freq, sliding_window, mass=True,
    )  # fmt: skip
    qf, q_positions, q_real, sm_scale, lengths = jnp_setup(
        q, k, lengths, q_positions, q_lengths, sm_scale
    )
    kf, _, live, pos, bias = slots_jnp(
        k, None, lengths, positions, k_scale, None, slot_bias, keep_mask, rope_positions,
        rope_inv_freq, 0, k.shape[2], 0,
    )  # fmt: skip
    z = logits_jnp(qf, kf, live, pos, bias, q_positions, q_real, sliding_window, sm_scale)
    b, t, n = lse.shape
    lse = lse.reshape(b, t, k.shape[1], n // k.shape[1]).transpose(0, 2, 3, 1)  # [B, K, G, T]
    lse = jnp.where(lse == -jnp.inf, 0.0, lse)
    p = jnp.where(z == -jnp.inf, 0.0, jnp.exp(z - lse[..., None]))
    return p.sum(axis=(2, 3))
