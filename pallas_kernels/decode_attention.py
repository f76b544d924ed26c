"""Decode attention (one query token per row) over a ragged, optionally FP8, GQA KV cache.

Maths, for row b, kv head k, query head n = k*G + g, valid slots s < len[b, k]:

    kk[s]   = K[b,k,s] * k_scale[b,k,s]                 (scale only for FP8 storage)
    kk[s]   = kk[s]*cos(pos[s]*f) + rotate_half(kk[s])*sin(pos[s]*f)   (RoPE on read, optional)
    z[g, s] = sm_scale * q[b,n] . kk[s] + bias[b,k,s]     (slot_bias: optional, float32 logits)
              -inf where s >= len, and with q_positions also where
              pos[s] > q_pos[b] (causal) or q_pos[b] - pos[s] >= window (sliding window)
    p[g, s] = exp(z[g,s] - max_s z[g]) / sum_s exp(...)
    out[b,n] = sum_s p[g,s] * V[b,k,s] * v_scale[b,k,s]
    mass[b,k,s] = sum_g p[g,s]                           (H2O's accumulated attention, optional)
    lse[b,n] = log sum_s exp(z[g,s])                     (optional; -inf for an empty row)

`slot_bias` carries the log(count) of merged slots (SnapKV segment rebuild); `lse` lets this
softmax join another part's over the same query exactly (`lowrank_attention.combine_attention`).

Flash-decoding: the grid (B, K, splits) gives each program the G query heads of one kv head
(padded to 16 rows: Triton's dot needs M >= 16) and one contiguous S range; it keeps the running
max m, sum l and unnormalised output o of the online softmax, visiting only blocks below the
valid length. A jnp combine rescales split j by exp(m_j - m) and divides by l. Scales factor out
of the dots (z = (q . k8) * ks, o = (p * vs) @ v8), so FP8 is decoded from its bits in registers
and never dequantised in memory. For `return_mass` the kernel also writes the masked logits z
and the combine turns them into probabilities with the final m, l: no second read of K.

Bytes per call (memory bound; itemsize 4 / 2 / 1 for f32 / bf16 / fp8):
    read   2 * B*K*len*H*itemsize (K, V: valid slots only) + 8*B*K*len (FP8 scales)
           + 4*B*K*len (positions, RoPE or window) + 4*B*K*len (slot_bias)
           + B*N*H*itemsize (q)
    write  4 * B*K*splits*G*(H + 2) (partials) + B*N*H*itemsize (out)
    mass   + 4*B*K*G*S written and read back (logits) + 4*B*K*S written (mass)
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from jkv_kernels import _backend as bk

# Two waves of programs on a 132-SM GPU (H100/H200) keep every SM busy for one long row.
_TARGET_PROGRAMS = 264
_STORAGE = (jnp.dtype(jnp.float32), jnp.dtype(jnp.bfloat16), bk.FP8)


def decode_attention_kernel(
    *refs,
    n_heads: int,
    block_s: int,
    split_s: int,
    sm_scale: float,
    compute_dtype,
    fp8: bool,
    rope: bool,
    causal: bool,
    window: int | None,
    mass: bool,
    bias: bool = False,
    fp8_native: bool = False,
):
    refs = list(refs)
    q_ref = refs.pop(0)  # [Gp, H] the G query heads of one kv head; rows >= G are padding
    k_ref = refs.pop(0)  # [S, H] keys of one (row, kv head); FP8: uint8 bits unless fp8_native
    v_ref = refs.pop(0)  # [S, H] values, same storage
    len_ref = refs.pop(0)  # [] valid length of this (row, kv head)
    ks_ref = refs.pop(0) if fp8 else None  # [S] key scales
    vs_ref = refs.pop(0) if fp8 else None  # [S] value scales
    bias_ref = refs.pop(0) if bias else None  # [S] float32 logit bias per slot
    pos_ref = refs.pop(0) if (rope or causal) else None  # [S] original position per slot
    qpos_ref = refs.pop(0) if causal else None  # [] position of this row's query
    inv_ref = refs.pop(0) if rope else None  # [H/2] RoPE inverse frequencies
    o_ref = refs.pop(0)  # [Gp, H] float32 unnormalised output of this split
    m_ref = refs.pop(0)  # [Gp] float32 running max of this split
    l_ref = refs.pop(0)  # [Gp] float32 running sum of this split
    z_ref = refs.pop(0) if mass else None  # [Gp, S] float32 masked logits

    gp, h = q_ref.shape
    s_total = k_ref.shape[0]
    length = len_ref[()]
    lo = pl.program_id(2) * split_s
    hi = jnp.minimum(lo + split_s, length)
    n_blocks = jnp.where(hi > lo, (hi - lo + block_s - 1) // block_s, 0)
    row_ok = jnp.arange(gp) < n_heads
    qpos = qpos_ref[()] if causal else None

    if rope:
        # Rotate-half RoPE on two halves of H, each padded to >= 16 columns for the dots.
        hh = h // 2
        hp = max(hh, bk.MIN_DOT)
        col_ok = jnp.arange(hp) < hh

        def load_half(ref, row_start, n, row_mask, offset, load=None):
            """[n, hp] columns offset..offset+H/2 of rows row_start.. (zero past H/2)."""
            load = load or (lambda at, mask: bk.load(at, mask=mask, other=0))
            if hp == hh:
                return load(ref.at[pl.ds(row_start, n), pl.ds(offset, hh)], row_mask[:, None])
            # H = 16: a half is narrower than a dot allows; gather it zero-padded to 16 columns.
            rows_i = (row_start + jnp.arange(n))[:, None]
            cols_i = (offset + jnp.arange(hp))[None, :]
            return load(ref.at[rows_i, cols_i], row_mask[:, None] & col_ok[None, :])

        q1 = load_half(q_ref, 0, gp, row_ok, 0).astype(compute_dtype)
        q2 = load_half(q_ref, 0, gp, row_ok, hh).astype(compute_dtype)
        if hp == hh:
            inv = bk.load(inv_ref)  # [H/2]
        else:
            inv = bk.load(inv_ref.at[jnp.arange(hp)], mask=col_ok, other=0.0)  # [16]
    else:
        q = bk.load(q_ref, mask=row_ok[:, None], other=0).astype(compute_dtype)

    # fp8_native: the FP8 block is loaded as float8_e4m3fn and converted by the compiler (a
    # hardware conversion on Hopper); otherwise its uint8 bits are decoded arithmetically.
    decode = functools.partial(bk.to_f32, fp8=fp8 and not fp8_native)

    def load_kv(at, mask):
        """A K or V block as float32, masked-off elements 0."""
        if fp8_native:  # Triton cannot fill a masked float8 load with a constant: select after
            return jnp.where(mask, bk.load(at, mask=mask).astype(jnp.float32), 0.0)
        return decode(bk.load(at, mask=mask, other=0))

    def body(i, carry):
        s0 = lo + i * block_s
        slots = s0 + jnp.arange(block_s)
        valid = slots < length
        rows = pl.ds(s0, block_s)
        pos = bk.load(pos_ref.at[rows], mask=valid, other=0) if pos_ref is not None else None
        if rope:
            k1 = load_half(k_ref, s0, block_s, valid, 0, load_kv)
            k2 = load_half(k_ref, s0, block_s, valid, hh, load_kv)
            ang = pos.astype(jnp.float32)[:, None] * inv[None, :]  # [bs, hp]
            cos, sin = jnp.cos(ang), jnp.sin(ang)
            r1 = (k1 * cos - k2 * sin).astype(compute_dtype)
            r2 = (k2 * cos + k1 * sin).astype(compute_dtype)
            z = bk.dot(q1, r1, trans_b=True) + bk.dot(q2, r2, trans_b=True)  # [Gp, bs]
        else:
            kb = load_kv(k_ref.at[rows, :], valid[:, None])
            z = bk.dot(q, kb.astype(compute_dtype), trans_b=True)  # [Gp, bs]
        if fp8:
            z = z * bk.load(ks_ref.at[rows], mask=valid, other=0).astype(jnp.float32)[None, :]
        z = z * sm_scale
        if bias:
            z = z + bk.load(bias_ref.at[rows], mask=valid, other=0).astype(jnp.float32)[None, :]
        keep = bk.visible_slots(valid, pos, qpos, causal=causal, window=window)
        # where, not a multiplicative mask: garbage (NaN) in a dead slot must not leak.
        z = jnp.where(keep[None, :], z, -jnp.inf)
        if mass:
            bk.store(z_ref.at[:, rows], z, mask=row_ok[:, None] & (slots < s_total)[None, :])
        vs = None
        if fp8:
            vs = bk.load(vs_ref.at[rows], mask=valid, other=0).astype(jnp.float32)
        vb = load_kv(v_ref.at[rows, :], valid[:, None])
        return bk.softmax_update(carry, z, vb, compute_dtype, vs)

    o, m, lsum = jax.lax.fori_loop(0, n_blocks, body, bk.softmax_start(gp, h))
    bk.store(o_ref, o, mask=row_ok[:, None])
    bk.store(m_ref, m, mask=row_ok)
    bk.store(l_ref, lsum, mask=row_ok)


def _validate(
    q, k, v, lengths, k_scale, v_scale, positions, q_positions, rope_inv_freq, window, bias=None
):
    if q.ndim != 3 or k.ndim != 4:
        raise ValueError(f"{q.shape=} {k.shape=}: expected q [B, N, H] and k [B, K, S, H]")
    b, n, h = q.shape
    kb, kh, s, kd = k.shape
    if v.shape != k.shape or kb != b or kd != h:
        raise ValueError(f"{q.shape=} {k.shape=} {v.shape=}: expected k, v [B={b}, K, S, H={h}]")
    if kh == 0 or n % kh:
        raise ValueError(f"{q.shape=} {k.shape=}: N={n} must be a multiple of K={kh}")
    if not bk.is_pow2(h) or h < bk.MIN_DOT:
        raise ValueError(f"{q.shape=}: H={h} must be a power of two >= {bk.MIN_DOT}")
    if lengths.shape != (b, kh) or not jnp.issubdtype(lengths.dtype, jnp.integer):
        raise ValueError(f"{lengths.shape=} {lengths.dtype=}: expected int32 [{b}, {kh}]")
    if k.dtype not in _STORAGE or v.dtype != k.dtype:
        raise ValueError(f"{k.dtype=} {v.dtype=}: expected one of float32, bfloat16, float8_e4m3fn")
    if q.dtype not in (jnp.float32, jnp.bfloat16, jnp.float16):
        raise ValueError(f"{q.dtype=}: expected float32, bfloat16 or float16")
    fp8 = k.dtype == bk.FP8
    if fp8 != (k_scale is not None) or fp8 != (v_scale is not None):
        raise ValueError(
            f"{k.dtype=} k_scale={k_scale is not None} v_scale={v_scale is not None}: "
            "FP8 storage needs both scales, other storage neither"
        )
    vecs = (
        ("k_scale", k_scale),
        ("v_scale", v_scale),
        ("positions", positions),
        ("slot_bias", bias),
    )
    for name, x in vecs:
        if x is not None and x.shape != (b, kh, s):
            raise ValueError(f"{name}.shape={x.shape}: expected [{b}, {kh}, {s}]")
    for name, x in (("k_scale", k_scale), ("v_scale", v_scale), ("slot_bias", bias)):
        if x is not None and x.dtype not in (jnp.float32, jnp.bfloat16):
            raise ValueError(f"{name}.dtype={x.dtype}: expected float32 or bfloat16")
    if rope_inv_freq is not None:
        if rope_inv_freq.shape != (h // 2,):
            raise ValueError(f"{rope_inv_freq.shape=}: expected [H/2={h // 2}]")
        if positions is None:
            raise ValueError("rope_inv_freq needs positions [B, K, S] to rotate the keys")
    if window is not None:
        if not isinstance(window, int) or window < 1:
            raise ValueError(f"sliding_window={window!r}: expected a static int >= 1")
        if q_positions is None:
            raise ValueError("sliding_window needs positions [B, K, S] and q_positions [B]")
    if q_positions is not None:
        if positions is None:
            raise ValueError("q_positions needs positions [B, K, S] to compare against")
        if q_positions.shape != (b,) or not jnp.issubdtype(q_positions.dtype, jnp.integer):
            raise ValueError(f"{q_positions.shape=} {q_positions.dtype=}: expected int32 [{b}]")


def split_outputs(b, kh, num_splits, g, gp, h, s, return_mass):
    """Shapes and BlockSpecs of flash-decoding's per-split results on the grid (B, K, splits):
    o [B, K, NS, G, H], m and l [B, K, NS, G] (one block per (row, kv head, split), Gp >= G
    rows padded for the dots), and with `return_mass` the logits z [B, K, G, S] (every split
    writes its own slot range)."""
    split = lambda *blk: pl.BlockSpec(
        (None, None, None, *blk), lambda i, j, t: (i, j, t) + (0,) * len(blk)
    )
    out_shape = [
        jax.ShapeDtypeStruct((b, kh, num_splits, g, h), jnp.float32),  # o
        jax.ShapeDtypeStruct((b, kh, num_splits, g), jnp.float32),  # m
        jax.ShapeDtypeStruct((b, kh, num_splits, g), jnp.float32),  # l
    ]
    out_specs = [split(gp, h), split(gp), split(gp)]
    if return_mass:
        out_shape.append(jax.ShapeDtypeStruct((b, kh, g, s), jnp.float32))
        out_specs.append(pl.BlockSpec((None, None, gp, s), lambda i, j, _: (i, j, 0, 0)))
    return out_shape, out_specs


def combine_splits(o, m, lsum, z, lengths):
    """Merges the splits: o [B,K,NS,G,H], m, l [B,K,NS,G], z [B,K,G,S] -> out, mass, lse."""
    m_max = m.max(axis=2)  # [B, K, G]
    m_use = jnp.where(m_max == -jnp.inf, 0.0, m_max)
    w = jnp.exp(m - m_use[:, :, None])  # [B, K, NS, G]; 0 for empty splits
    l_sum = (w * lsum).sum(axis=2)
    live = l_sum > 0  # false only for length-0 rows: they output 0, not NaN
    l_safe = jnp.where(live, l_sum, 1.0)
    out = jnp.where(live[..., None], (w[..., None] * o).sum(axis=2) / l_safe[..., None], 0.0)
    lse = jnp.where(live, m_use + jnp.log(l_safe), -jnp.inf)  # [B, K, G]
    if z is None:
        return out, None, lse
    slot_ok = jnp.arange(z.shape[-1]) < lengths[:, :, None, None]  # [B, K, 1, S]
    # Slots past the length were never written by the kernel: select, never multiply.
    p = jnp.where(slot_ok, jnp.exp(z - m_use[..., None]) / l_safe[..., None], 0.0)
    return out, p.sum(axis=2), lse


@functools.partial(
    jax.jit,
    static_argnames=(
        "sliding_window",
        "sm_scale",
        "return_mass",
        "return_lse",
        "block_s",
        "num_splits",
        "num_warps",
        "num_stages",
        "fp8_native",
        "backend",
        "interpret",
    ),
)
def decode_attention(
    q,
    k,
    v,
    lengths,
    *,
    k_scale=None,
    v_scale=None,
    positions=None,
    q_positions=None,
    rope_inv_freq=None,
    slot_bias=None,
    sliding_window: int | None = None,
    sm_scale: float | None = None,
    return_mass: bool = False,
    return_lse: bool = False,
    block_s: int = 64,
    num_splits: int | None = None,
    num_warps: int = 4,
    num_stages: int = 2,
    fp8_native: bool = False,
    backend: str = "triton",
    interpret: bool | None = None,
):
    """Attention of one query token per row over a ragged GQA KV cache (flash-decoding).

    Args:
      q: [B, N, H] query (already rotated when RoPE is used), float32/bfloat16/float16.
      k, v: [B, K, S, H] cache, float32, bfloat16 or float8_e4m3fn.
      lengths: [B, K] int32 valid lengths in 0..S (clipped to that range).
      k_scale, v_scale: [B, K, S] float32 (or bfloat16) per-slot scales; required exactly
        for FP8 storage.
      positions: [B, K, S] int32 original position of each slot (RoPE on read, window).
      q_positions: [B] int32 position of each row's query; when given, slots whose position
        is greater are masked (causal), as are those outside `sliding_window`.
      rope_inv_freq: [H/2] float32; when given, keys are stored pre-RoPE and rotated here.
      slot_bias: [B, K, S] float32 logit bias added to each slot's scaled score (merged slots'
        log(count)).
      sliding_window: static int; slots with q_position - position >= window are masked.
      sm_scale: softmax scale, default 1/sqrt(H).
      return_mass: also return the attention mass per slot summed over each group's G heads.
      return_lse: also return the log-sum-exp of each query head's logits.
      block_s: slots per inner step (power of two >= 16).
      num_splits: S ranges processed in parallel; None picks enough to fill the GPU.
      num_warps, num_stages: Triton compiler parameters.
      fp8_native: load FP8 storage as float8_e4m3fn and let the compiler convert it (hardware
        conversion on Hopper) instead of decoding its uint8 bits arithmetically.
      backend: "triton" (the only one so far).
      interpret: run the kernel in the Pallas interpreter; None means "on CPU".

    Returns:
      out [B, N, H] in q.dtype; with return_mass and/or return_lse a tuple (out, mass [B, K, S]
      float32, lse [B, N] float32), the unrequested ones left out. Rows of length 0 give out 0,
      mass 0 and lse -inf.

    Raises:
      ValueError: on shapes, dtypes, block sizes or a backend that do not fit.
    """
    bk.check_backend(backend)
    interpret = bk.resolve_interpret(interpret)
    _validate(
        q, k, v, lengths, k_scale, v_scale, positions, q_positions, rope_inv_freq, sliding_window,
        slot_bias,
    )  # fmt: skip
    bk.check_block("block_s", block_s, bk.MIN_DOT)
    if num_splits is not None and num_splits < 1:
        raise ValueError(f"{num_splits=}: expected an int >= 1 or None")
    b, n, h = q.shape
    _, kh, s, _ = k.shape
    g = n // kh
    gp = bk.block_size(g, cap=max(g, bk.MIN_DOT), floor=bk.MIN_DOT)
    fp8 = k.dtype == bk.FP8
    rope = rope_inv_freq is not None
    causal = q_positions is not None
    sm_scale = 1.0 / math.sqrt(h) if sm_scale is None else float(sm_scale)
    # 16-bit dots when the query is 16-bit and the cache converts to it exactly (same dtype or
    # FP8, whose values bf16 and f16 both hold); exact float32 dots otherwise.
    low = q.dtype != jnp.float32 and k.dtype in (q.dtype, bk.FP8)
    compute_dtype = q.dtype if low else jnp.float32

    if num_splits is None:
        num_splits = bk.next_pow2(bk.cdiv(_TARGET_PROGRAMS, b * kh))
    num_splits = max(1, min(num_splits, bk.cdiv(s, block_s)))
    split_s = bk.cdiv(bk.cdiv(s, num_splits), block_s) * block_s
    num_splits = bk.cdiv(s, split_s)  # no empty programs

    lengths = jnp.clip(lengths.astype(jnp.int32), 0, s)
    kv = (k, v) if fp8_native else (bk.to_bits(k), bk.to_bits(v))
    args = [q.reshape(b, kh, g, h), *kv, lengths]
    per_kv = lambda *blk: pl.BlockSpec((None, None, *blk), lambda i, j, _: (i, j) + (0,) * len(blk))
    in_specs = [
        per_kv(gp, h),  # q: the G heads of kv head j, rows padded to gp (masked loads)
        per_kv(s, h),  # k: the whole row; the kernel walks its own S range in block_s steps
        per_kv(s, h),  # v
        per_kv(),  # lengths: one scalar per (row, kv head)
    ]
    if fp8:
        args += [k_scale, v_scale]  # float32 or bfloat16; widened in registers
        in_specs += [per_kv(s), per_kv(s)]
    if slot_bias is not None:
        args.append(slot_bias.astype(jnp.float32))
        in_specs.append(per_kv(s))  # the whole row's biases, read with its slots
    if rope or causal:
        args.append(positions.astype(jnp.int32))
        in_specs.append(per_kv(s))
    if causal:
        args.append(q_positions.astype(jnp.int32))
        in_specs.append(pl.BlockSpec((None,), lambda i, j, _: (i,)))
    if rope:
        args.append(rope_inv_freq.astype(jnp.float32))
        in_specs.append(pl.BlockSpec((h // 2,), lambda i, j, _: (0,)))

    out_shape, out_specs = split_outputs(b, kh, num_splits, g, gp, h, s, return_mass)

    kernel = functools.partial(
        decode_attention_kernel,
        n_heads=g,
        block_s=block_s,
        split_s=split_s,
        sm_scale=sm_scale,
        compute_dtype=compute_dtype,
        fp8=fp8,
        rope=rope,
        causal=causal,
        window=sliding_window,
        mass=return_mass,
        bias=slot_bias is not None,
        fp8_native=fp8_native,
    )
    outs = pl.pallas_call(
        kernel,
        grid=(b, kh, num_splits),
        in_specs=in_specs,
        out_specs=out_specs,
        out_shape=out_shape,
        compiler_params=bk.compiler_params(num_warps, num_stages),
        interpret=interpret,
        name="jkv_decode_attention",
    )(*args)
    out, mass, lse = combine_splits(*outs[:3], outs[3] if return_mass else None, lengths)
    return _outputs(out.reshape(b, n, h).astype(q.dtype), mass, lse.reshape(b, n), return_lse)


def _outputs(out, mass, lse, return_lse):
    extra = ([] if mass is None else [mass]) + ([lse] if return_lse else [])
    return (out, *extra) if extra else out


def apply_rope_reference(x, positions, inv_freq):
    """Rotate-half RoPE (Hugging Face Llama): x [..., S, H], positions [..., S], inv_freq [H/2]."""
    ang = positions.astype(jnp.float32)[..., None] * inv_freq.astype(jnp.float32)
    ang = jnp.concatenate([ang, ang], axis=-1)  # [..., S, H]
    x1, x2 = jnp.split(x, 2, axis=-1)
    return x * jnp.cos(ang) + jnp.concatenate([-x2, x1], axis=-1) * jnp.sin(ang)


@functools.partial(
    jax.jit, static_argnames=("sliding_window", "sm_scale", "return_mass", "return_lse")
)
def decode_attention_reference(
    q,
    k,
    v,
    lengths,
    *,
    k_scale=None,
    v_scale=None,
    positions=None,
    q_positions=None,
    rope_inv_freq=None,
    slot_bias=None,
    sliding_window: int | None = None,
    sm_scale: float | None = None,
    return_mass: bool = False,
    return_lse: bool = False,
):
    """Plain-jnp float32 `decode_attention` (materialises the [B, K, G, S] scores)."""
    _validate(
        q, k, v, lengths, k_scale, v_scale, positions, q_positions, rope_inv_freq, sliding_window,
        slot_bias,
    )  # fmt: skip
    b, n, h = q.shape
    _, kh, s, _ = k.shape
    g = n // kh
    sm_scale = 1.0 / math.sqrt(h) if sm_scale is None else float(sm_scale)
    lengths = jnp.clip(lengths.astype(jnp.int32), 0, s)
    valid = jnp.arange(s) < lengths[..., None]  # [B, K, S]
    kf = k.astype(jnp.float32)
    vf = v.astype(jnp.float32)
    if k_scale is not None:
        kf = kf * k_scale.astype(jnp.float32)[..., None]
        vf = vf * v_scale.astype(jnp.float32)[..., None]
    kf = jnp.where(valid[..., None], kf, 0.0)
    vf = jnp.where(valid[..., None], vf, 0.0)
    if rope_inv_freq is not None:
        kf = apply_rope_reference(kf, positions, rope_inv_freq)
    keep = valid
    if q_positions is not None:
        delta = q_positions[:, None, None] - positions  # [B, K, S]
        keep = keep & (delta >= 0)
        if sliding_window is not None:
            keep = keep & (delta < sliding_window)
    qf = q.astype(jnp.float32).reshape(b, kh, g, h)
    z = jnp.einsum("bkgh,bksh->bkgs", qf, kf, precision="highest") * sm_scale
    if slot_bias is not None:
        z = z + jnp.where(valid, slot_bias.astype(jnp.float32), 0.0)[:, :, None, :]
    z = jnp.where(keep[:, :, None, :], z, -jnp.inf)
    m = z.max(axis=-1, keepdims=True)
    m_use = jnp.where(m == -jnp.inf, 0.0, m)
    e = jnp.exp(z - m_use)
    lsum = e.sum(axis=-1, keepdims=True)
    p = e / jnp.where(lsum > 0, lsum, 1.0)  # [B, K, G, S]
    out = jnp.einsum("bkgs,bksh->bkgh", p, vf, precision="highest").reshape(b, n, h)
    lse = jnp.where(lsum > 0, m_use + jnp.log(jnp.where(lsum > 0, lsum, 1.0)), -jnp.inf)
    mass = p.sum(axis=2) if return_mass else None
    return _outputs(out.astype(q.dtype), mass, lse.reshape(b, n), return_lse)
