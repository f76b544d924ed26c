"""Pieces shared by the prefill attention kernels (`prefill_attention`,
`prefill_attention_mass`), their references and the blocked jnp path: in-kernel block loads and
masks, argument validation, the query-row layout, and the plain-jnp slot and logit helpers.

The maths is in `prefill_attention.py`'s docstring.
"""

from __future__ import annotations

import math

import jax.numpy as jnp
from jax.experimental import pallas as pl

from jkv_kernels import _backend as bk
from jkv_kernels.decode_attention import apply_rope_reference

STORAGE = (jnp.dtype(jnp.float32), jnp.dtype(jnp.bfloat16), bk.FP8)
I32_MIN = int(jnp.iinfo(jnp.int32).min)
I32_MAX = int(jnp.iinfo(jnp.int32).max)


# --- In-kernel pieces -------------------------------------------------------------------------


def slot_block(s0, block_s, length, pos_ref, keep_ref):
    """Slots s0.. : live ones (below the length, keep bit set) and their positions."""
    slots = s0 + jnp.arange(block_s)
    live = slots < length
    if keep_ref is not None:
        words = bk.load(keep_ref.at[slots // 32], mask=live, other=0)
        live = live & (((words >> (slots % 32).astype(jnp.uint32)) & 1) == 1)
    pos = bk.load(pos_ref.at[pl.ds(s0, block_s)], mask=live, other=0)
    return slots, live, pos


def query_rows(r0, block_r, n_real, n_heads, qpos_ref):
    """Rows r0.. (r = t*G + g): which are real queries (t < q_len) and their positions."""
    rows = r0 + jnp.arange(block_r)
    real = rows < n_real
    qpos = bk.load(qpos_ref.at[rows // n_heads], mask=real, other=0)
    return rows, real, qpos


def any_visible(live, pos, real, qpos, window):
    """Whether some live slot is visible to some real row (a cheap superset test)."""
    q_max = jnp.max(jnp.where(real, qpos, I32_MIN))
    ok = live & (pos <= q_max)
    if window:
        ok = ok & (jnp.min(jnp.where(real, qpos, I32_MAX)) - pos < window)
    return jnp.sum(ok.astype(jnp.int32)) > 0


def visible(live, pos, real, qpos, window):
    """[br, bs] visibility of slots to rows."""
    vis = real[:, None] & live[None, :] & (pos[None, :] <= qpos[:, None])
    if window:
        vis = vis & (qpos[:, None] - pos[None, :] < window)
    return vis


def load_keys(k_ref, s0, block_s, live, *, fp8, rpos_ref, inv_ref):
    """[bs, H] float32 keys of slots s0.. (0 where not live), decoded and rotated on read."""
    h = k_ref.shape[1]
    kf = bk.to_f32(bk.load(k_ref.at[pl.ds(s0, block_s), :], mask=live[:, None], other=0), fp8)
    if rpos_ref is None:
        return kf
    # Rotate-half RoPE on the whole row: a second (cached) load with the halves swapped keeps
    # every dot at full width H, whatever H/2 is.
    hh = h // 2
    cols = jnp.arange(h)
    rows_i = (s0 + jnp.arange(block_s))[:, None]
    mask = jnp.broadcast_to(live[:, None], (block_s, h))
    swapped = bk.to_f32(
        bk.load(k_ref.at[rows_i, ((cols + hh) % h)[None, :]], mask=mask, other=0), fp8
    )
    inv = bk.load(inv_ref.at[cols % hh])  # [H]: f repeated over both halves
    rpos = bk.load(rpos_ref.at[pl.ds(s0, block_s)], mask=live, other=0)
    ang = rpos.astype(jnp.float32)[:, None] * inv[None, :]  # [bs, H]
    sign = jnp.where(cols < hh, -1.0, 1.0)[None, :]
    return kf * jnp.cos(ang) + sign * swapped * jnp.sin(ang)


def block_logits(q, kf, s0, block_s, live, *, ks_ref, bias_ref, sm_scale, compute_dtype):
    """[br, bs] float32 unmasked logits of query rows q [br, H] against keys kf [bs, H]."""
    z = bk.dot(q, kf.astype(compute_dtype), trans_b=True)
    rows = pl.ds(s0, block_s)
    if ks_ref is not None:
        z = z * bk.load(ks_ref.at[rows], mask=live, other=0).astype(jnp.float32)[None, :]
    z = z * sm_scale
    if bias_ref is not None:
        z = z + bk.load(bias_ref.at[rows], mask=live, other=0).astype(jnp.float32)[None, :]
    return z


# --- Validation and layout ------------------------------------------------------------------


def validate(
    q, k, v, lengths, positions, q_positions, q_lengths, k_scale, v_scale, slot_bias,
    keep_mask, rope_positions, rope_inv_freq, window, *, mass=False,
):  # fmt: skip
    """Raises ValueError unless the inputs fit; returns the RoPE positions (default: positions)."""
    if q.ndim != 4 or k.ndim != 4:
        raise ValueError(f"{q.shape=} {k.shape=}: expected q [B, T, N, H] and k [B, K, S, H]")
    b, t, n, h = q.shape
    kb, kh, s, kd = k.shape
    if kb != b or kd != h or (not mass and v.shape != k.shape):
        vs = None if v is None else v.shape
        raise ValueError(f"{q.shape=} {k.shape=} v.shape={vs}: expected k, v [B={b}, K, S, H={h}]")
    if kh == 0 or n % kh:
        raise ValueError(f"{q.shape=} {k.shape=}: N={n} must be a multiple of K={kh}")
    if t < 1 or s < 1:
        raise ValueError(f"{q.shape=} {k.shape=}: expected T >= 1 and S >= 1")
    if not bk.is_pow2(h) or h < bk.MIN_DOT:
        raise ValueError(f"{q.shape=}: H={h} must be a power of two >= {bk.MIN_DOT}")
    if k.dtype not in STORAGE or (not mass and v.dtype != k.dtype):
        vd = None if v is None else v.dtype
        raise ValueError(f"{k.dtype=} v.dtype={vd}: expected one of float32, bfloat16, fp8_e4m3fn")
    if q.dtype not in (jnp.float32, jnp.bfloat16, jnp.float16):
        raise ValueError(f"{q.dtype=}: expected float32, bfloat16 or float16")
    fp8 = k.dtype == bk.FP8
    scales = (k_scale,) if mass else (k_scale, v_scale)
    if any(fp8 != (x is not None) for x in scales):
        raise ValueError(
            f"{k.dtype=} k_scale={k_scale is not None} v_scale={v_scale is not None}: "
            "FP8 storage needs the scales, other storage none"
        )
    ints = (
        ("lengths", lengths, (b, kh)),
        ("positions", positions, (b, kh, s)),
        ("q_positions", q_positions, (b, t)),
        ("q_lengths", q_lengths, (b,)),
        ("rope_positions", rope_positions, (b, kh, s)),
    )
    for name, x, shape in ints:
        if x is not None and (x.shape != shape or not jnp.issubdtype(x.dtype, jnp.integer)):
            raise ValueError(
                f"{name}.shape={x.shape} {name}.dtype={x.dtype}: expected int32 {shape}"
            )
    for name, x in (("k_scale", k_scale), ("v_scale", v_scale), ("slot_bias", slot_bias)):
        if x is not None and (x.shape != (b, kh, s) or x.dtype not in (jnp.float32, jnp.bfloat16)):
            raise ValueError(
                f"{name}.shape={x.shape} {name}.dtype={x.dtype}: expected float32 or bfloat16 "
                f"[{b}, {kh}, {s}]"
            )
    words = bk.cdiv(s, 32)
    if keep_mask is not None and (
        keep_mask.shape != (b, kh, words) or keep_mask.dtype != jnp.uint32
    ):
        raise ValueError(
            f"{keep_mask.shape=} {keep_mask.dtype=}: expected uint32 [{b}, {kh}, {words}] "
            "(kv_compact.pack_mask)"
        )
    if rope_inv_freq is not None and rope_inv_freq.shape != (h // 2,):
        raise ValueError(f"{rope_inv_freq.shape=}: expected [H/2={h // 2}]")
    if rope_positions is not None and rope_inv_freq is None:
        raise ValueError("rope_positions needs rope_inv_freq [H/2] to rotate the keys")
    if window is not None and (not isinstance(window, int) or window < 1):
        raise ValueError(f"sliding_window={window!r}: expected a static int >= 1")
    return positions if rope_inv_freq is not None and rope_positions is None else rope_positions


def to_rows(x, kh):
    """[B, T, N, ...] -> [B, K, T*G, ...]: the query rows r = t*G + g of each kv head."""
    b, t, n = x.shape[:3]
    x = x.reshape(b, t, kh, n // kh, *x.shape[3:])
    return jnp.moveaxis(x, 2, 1).reshape(b, kh, t * (n // kh), *x.shape[4:])


def from_rows(x, t):
    """[B, K, T*G, ...] -> [B, T, N, ...]."""
    b, kh, r = x.shape[:3]
    x = x.reshape(b, kh, t, r // t, *x.shape[3:])
    return jnp.moveaxis(x, 1, 2).reshape(b, t, kh * (r // t), *x.shape[4:])


def kernel_inputs(
    lengths, positions, q_positions, q_lengths, k_scale, v_scale, slot_bias, keep_mask,
    rope_positions, rope_inv_freq, *, b, t, s,
):  # fmt: skip
    """The arrays both kernels read after q, k (v or lse), with their BlockSpecs."""
    per_kv = lambda *blk: pl.BlockSpec((None, None, *blk), lambda i, j, _: (i, j) + (0,) * len(blk))
    per_row = lambda *blk: pl.BlockSpec((None, *blk), lambda i, j, _: (i,) + (0,) * len(blk))
    q_lengths = jnp.full((b,), t, jnp.int32) if q_lengths is None else q_lengths
    args = [
        jnp.clip(lengths.astype(jnp.int32), 0, s),
        jnp.clip(q_lengths.astype(jnp.int32), 0, t),
        q_positions.astype(jnp.int32),
        positions.astype(jnp.int32),
    ]
    specs = [
        per_kv(),  # lengths: one scalar per (row, kv head)
        per_row(),  # q_lengths: one scalar per row
        per_row(t),  # q_positions: the row's T positions, gathered per query row
        per_kv(s),  # positions: the whole row; the kernels walk it in block_s steps
    ]
    for x in (k_scale, v_scale):
        if x is not None:
            args.append(x)  # float32 or bfloat16; widened in registers
            specs.append(per_kv(s))
    if slot_bias is not None:
        args.append(slot_bias.astype(jnp.float32))
        specs.append(per_kv(s))
    if keep_mask is not None:
        args.append(keep_mask)
        specs.append(per_kv(keep_mask.shape[-1]))  # the row's packed bits, ceil(S/32) words
    if rope_inv_freq is not None:
        args += [rope_positions.astype(jnp.int32), rope_inv_freq.astype(jnp.float32)]
        specs += [per_kv(s), pl.BlockSpec((rope_inv_freq.shape[0],), lambda i, j, _: (0,))]
    return args, specs


def setup(q, k, block_q, block_s, sm_scale):
    """Block sizes, softmax scale and dot dtype shared by the kernel wrappers."""
    bk.check_block("block_q", block_q)
    bk.check_block("block_s", block_s, bk.MIN_DOT)
    _, t, n, h = q.shape
    g = n // k.shape[1]
    block_r = bk.block_size(t * g, cap=max(bk.MIN_DOT, bk.next_pow2(block_q * g)), floor=bk.MIN_DOT)
    block_s = bk.block_size(k.shape[2], cap=block_s, floor=bk.MIN_DOT)
    sm_scale = 1.0 / math.sqrt(h) if sm_scale is None else float(sm_scale)
    # 16-bit dots when the query is 16-bit and the cache converts to it exactly (same dtype or
    # FP8, whose values bf16 and f16 both hold); exact float32 dots otherwise.
    low = q.dtype != jnp.float32 and k.dtype in (q.dtype, bk.FP8)
    return block_r, block_s, sm_scale, (q.dtype if low else jnp.float32)


KERNEL_STATICS = (
    "sliding_window",
    "sm_scale",
    "block_q",
    "block_s",
    "num_warps",
    "num_stages",
    "backend",
    "interpret",
)


# --- Plain jnp ------------------------------------------------------------------------------


def slots_jnp(
    k, v, lengths, positions, k_scale, v_scale, slot_bias, keep_mask, rope_positions,
    rope_inv_freq, start, n, first,
):  # fmt: skip
    """Float32 keys, values, liveness, positions and bias of slots start..start+n (>= first).

    Dead slots (past the length, dropped, or before `first`) have keys, values and bias 0.
    """
    take = lambda x: bk.bits_slice(x, start, n, axis=2)
    slots = start + jnp.arange(n)
    live = (slots >= first) & (slots < lengths[..., None])  # [B, K, n]
    if keep_mask is not None:
        words = jnp.take(keep_mask, slots // 32, axis=2)
        live = live & (((words >> (slots % 32).astype(jnp.uint32)) & 1) == 1)

    def dequant(x, scale):
        x = take(x).astype(jnp.float32)
        if scale is not None:
            x = x * take(scale).astype(jnp.float32)[..., None]
        return jnp.where(live[..., None], x, 0.0)

    kf = dequant(k, k_scale)
    vf = None if v is None else dequant(v, v_scale)
    if rope_inv_freq is not None:
        kf = apply_rope_reference(kf, take(rope_positions), rope_inv_freq)
    bias = None if slot_bias is None else jnp.where(live, take(slot_bias).astype(jnp.float32), 0.0)
    return kf, vf, live, take(positions), bias


def logits_jnp(qf, kf, live, pos, bias, q_positions, q_real, window, sm_scale):
    """Masked logits [B, K, G, T, n] of qf [B, K, G, T, H] against kf [B, K, n, H]."""
    z = jnp.einsum("bkgth,bknh->bkgtn", qf, kf, precision="highest") * sm_scale
    if bias is not None:
        z = z + bias[:, :, None, None, :]
    delta = q_positions[:, None, :, None] - pos[:, :, None, :]  # [B, K, T, n]
    vis = live[:, :, None, :] & (delta >= 0) & q_real[:, None, :, None]
    if window is not None:
        vis = vis & (delta < window)
    return jnp.where(vis[:, :, None], z, -jnp.inf)


def jnp_setup(q, k, lengths, q_positions, q_lengths, sm_scale):
    b, t, n, h = q.shape
    _, kh, s, _ = k.shape
    qf = q.astype(jnp.float32).reshape(b, t, kh, n // kh, h).transpose(0, 2, 3, 1, 4)
    q_lengths = jnp.full((b,), t, jnp.int32) if q_lengths is None else q_lengths
    q_real = jnp.arange(t) < jnp.clip(q_lengths.astype(jnp.int32), 0, t)[:, None]  # [B, T]
    sm_scale = 1.0 / math.sqrt(h) if sm_scale is None else float(sm_scale)
    lengths = jnp.clip(lengths.astype(jnp.int32), 0, s)
    return qf, q_positions.astype(jnp.int32), q_real, sm_scale, lengths


def finish(o, m, lsum, q, return_lse):
    """o [B, K, G, T, H], m, lsum [B, K, G, T] -> out [B, T, N, H] (and lse [B, T, N])."""
    b, t, n, h = q.shape
    live = lsum > 0
    l_safe = jnp.where(live, lsum, 1.0)
    out = jnp.where(live[..., None], o / l_safe[..., None], 0.0)
    out = out.transpose(0, 3, 1, 2, 4).reshape(b, t, n, h).astype(q.dtype)
    if not return_lse:
        return out
    m_use = jnp.where(m == -jnp.inf, 0.0, m)
    lse = jnp.where(live, m_use + jnp.log(l_safe), -jnp.inf)
    return out, lse.transpose(0, 3, 1, 2).reshape(b, t, n)


JNP_STATICS = ("sliding_window", "sm_scale", "return_lse")
