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
`prefill_attention_mass` is a second kernel on the grid (B, K, key blocks): each program
loads its keys once and walks the query blocks, adding exp(z - lse) per slot.
`prefill_attention_blocked` is the same online softmax in plain jnp (a `fori_loop` over key
blocks), for XLA: float32 temporaries are O(B*K*G*T*(H + block_s)), never [T, S].

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
import math

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from jkv_kernels import _backend as bk
from jkv_kernels.decode_attention import apply_rope_reference

_STORAGE = (jnp.dtype(jnp.float32), jnp.dtype(jnp.bfloat16), bk.FP8)
_I32_MIN = int(jnp.iinfo(jnp.int32).min)
_I32_MAX = int(jnp.iinfo(jnp.int32).max)


# --- Pieces shared by the two kernels -------------------------------------------------------


def _slot_block(s0, block_s, length, pos_ref, keep_ref):
    """Slots s0.. : live ones (below the length, keep bit set) and their positions."""
    slots = s0 + jnp.arange(block_s)
    live = slots < length
    if keep_ref is not None:
        words = bk.load(keep_ref.at[slots // 32], mask=live, other=0)
        live = live & (((words >> (slots % 32).astype(jnp.uint32)) & 1) == 1)
    pos = bk.load(pos_ref.at[pl.ds(s0, block_s)], mask=live, other=0)
    return slots, live, pos


def _query_rows(r0, block_r, n_real, n_heads, qpos_ref):
    """Rows r0.. (r = t*G + g): which are real queries (t < q_len) and their positions."""
    rows = r0 + jnp.arange(block_r)
    real = rows < n_real
    qpos = bk.load(qpos_ref.at[rows // n_heads], mask=real, other=0)
    return rows, real, qpos


def _any_visible(live, pos, real, qpos, window):
    """Whether some live slot is visible to some real row (a cheap superset test)."""
    q_max = jnp.max(jnp.where(real, qpos, _I32_MIN))
    ok = live & (pos <= q_max)
    if window:
        ok = ok & (jnp.min(jnp.where(real, qpos, _I32_MAX)) - pos < window)
    return jnp.sum(ok.astype(jnp.int32)) > 0


def _visible(live, pos, real, qpos, window):
    """[br, bs] visibility of slots to rows."""
    vis = real[:, None] & live[None, :] & (pos[None, :] <= qpos[:, None])
    if window:
        vis = vis & (qpos[:, None] - pos[None, :] < window)
    return vis


def _decode(x, fp8):
    return bk.fp8_bits_to_f32(x) if fp8 else x.astype(jnp.float32)


def _load_keys(k_ref, s0, block_s, live, *, fp8, rpos_ref, inv_ref):
    """[bs, H] float32 keys of slots s0.. (0 where not live), decoded and rotated on read."""
    h = k_ref.shape[1]
    kf = _decode(bk.load(k_ref.at[pl.ds(s0, block_s), :], mask=live[:, None], other=0), fp8)
    if rpos_ref is None:
        return kf
    # Rotate-half RoPE on the whole row: a second (cached) load with the halves swapped keeps
    # every dot at full width H, whatever H/2 is.
    hh = h // 2
    cols = jnp.arange(h)
    rows_i = (s0 + jnp.arange(block_s))[:, None]
    mask = jnp.broadcast_to(live[:, None], (block_s, h))
    swapped = _decode(
        bk.load(k_ref.at[rows_i, ((cols + hh) % h)[None, :]], mask=mask, other=0), fp8
    )
    inv = bk.load(inv_ref.at[cols % hh])  # [H]: f repeated over both halves
    rpos = bk.load(rpos_ref.at[pl.ds(s0, block_s)], mask=live, other=0)
    ang = rpos.astype(jnp.float32)[:, None] * inv[None, :]  # [bs, H]
    sign = jnp.where(cols < hh, -1.0, 1.0)[None, :]
    return kf * jnp.cos(ang) + sign * swapped * jnp.sin(ang)


def _logits(q, kf, s0, block_s, live, *, ks_ref, bias_ref, sm_scale, compute_dtype):
    """[br, bs] float32 unmasked logits of query rows q [br, H] against keys kf [bs, H]."""
    z = bk.dot(q, kf.astype(compute_dtype), trans_b=True)
    rows = pl.ds(s0, block_s)
    if ks_ref is not None:
        z = z * bk.load(ks_ref.at[rows], mask=live, other=0).astype(jnp.float32)[None, :]
    z = z * sm_scale
    if bias_ref is not None:
        z = z + bk.load(bias_ref.at[rows], mask=live, other=0).astype(jnp.float32)[None, :]
    return z


# --- Kernels --------------------------------------------------------------------------------


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
    rows, real, qpos = _query_rows(r0, block_r, n_real, n_heads, qpos_ref)
    in_range = rows < n_rows
    q = bk.load(q_ref.at[pl.ds(r0, block_r), :], mask=in_range[:, None], other=0)
    q = q.astype(compute_dtype)
    n_blocks = jnp.where(r0 < n_real, (length + block_s - 1) // block_s, 0)

    def update(s0, live, pos, carry):
        o, m, lsum = carry
        kf = _load_keys(k_ref, s0, block_s, live, fp8=fp8, rpos_ref=rpos_ref, inv_ref=inv_ref)
        z = _logits(
            q, kf, s0, block_s, live,
            ks_ref=ks_ref, bias_ref=bias_ref, sm_scale=sm_scale, compute_dtype=compute_dtype,
        )  # fmt: skip
        # where, not a multiplicative mask: garbage (NaN) in a dead slot must not leak.
        z = jnp.where(_visible(live, pos, real, qpos, window), z, -jnp.inf)
        m_new = jnp.maximum(m, z.max(axis=1))
        m_use = jnp.where(m_new == -jnp.inf, 0.0, m_new)  # all dead so far: keep exp finite
        alpha = jnp.exp(m - m_use)
        p = jnp.exp(z - m_use[:, None])  # [br, bs]
        lsum = alpha * lsum + p.sum(axis=1)
        rows_s = pl.ds(s0, block_s)
        if fp8:
            p = p * bk.load(vs_ref.at[rows_s], mask=live, other=0).astype(jnp.float32)[None, :]
        # Dropped slots' values may be garbage: masked loads read them as 0 (p is 0 there).
        vb = _decode(bk.load(v_ref.at[rows_s, :], mask=live[:, None], other=0), fp8)
        o = alpha[:, None] * o + bk.dot(p.astype(compute_dtype), vb.astype(compute_dtype))
        return o, m_new, lsum

    def body(i, carry):
        s0 = i * block_s
        _, live, pos = _slot_block(s0, block_s, length, pos_ref, keep_ref)
        return lax.cond(
            _any_visible(live, pos, real, qpos, window),
            functools.partial(update, s0, live, pos),
            lambda c: c,
            carry,
        )

    init = (
        jnp.zeros((block_r, h), jnp.float32),
        jnp.full((block_r,), -jnp.inf, jnp.float32),
        jnp.zeros((block_r,), jnp.float32),
    )
    o, m, lsum = lax.fori_loop(0, n_blocks, body, init)
    live = real & (lsum > 0)
    l_safe = jnp.where(live, lsum, 1.0)
    out = jnp.where(live[:, None], o / l_safe[:, None], 0.0)
    bk.store(o_ref.at[pl.ds(r0, block_r), :], out.astype(o_ref.dtype), mask=in_range[:, None])
    if lse:
        m_use = jnp.where(m == -jnp.inf, 0.0, m)
        value = jnp.where(live, m_use + jnp.log(l_safe), -jnp.inf)
        bk.store(lse_ref.at[pl.ds(r0, block_r)], value, mask=in_range)


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
    slots, live, pos = _slot_block(s0, block_s, length, pos_ref, keep_ref)
    kf = _load_keys(k_ref, s0, block_s, live, fp8=fp8, rpos_ref=rpos_ref, inv_ref=inv_ref)
    has_live = jnp.sum(live.astype(jnp.int32)) > 0
    n_blocks = jnp.where(has_live, (n_real + block_r - 1) // block_r, 0)

    def add(r0, real, qpos, acc):
        q = bk.load(q_ref.at[pl.ds(r0, block_r), :], mask=real[:, None], other=0)
        z = _logits(
            q.astype(compute_dtype), kf, s0, block_s, live,
            ks_ref=ks_ref, bias_ref=bias_ref, sm_scale=sm_scale, compute_dtype=compute_dtype,
        )  # fmt: skip
        lse = bk.load(lse_ref.at[pl.ds(r0, block_r)], mask=real, other=0)
        lse = jnp.where(lse == -jnp.inf, 0.0, lse)  # such rows see nothing: p is 0 anyway
        p = jnp.where(_visible(live, pos, real, qpos, window), jnp.exp(z - lse[:, None]), 0.0)
        return acc + p.sum(axis=0)

    def body(j, acc):
        r0 = j * block_r
        _, real, qpos = _query_rows(r0, block_r, n_real, n_heads, qpos_ref)
        return lax.cond(
            _any_visible(live, pos, real, qpos, window),
            functools.partial(add, r0, real, qpos),
            lambda a: a,
            acc,
        )

    acc = lax.fori_loop(0, n_blocks, body, jnp.zeros((block_s,), jnp.float32))
    bk.store(mass_ref.at[pl.ds(s0, block_s)], acc, mask=slots < s_total)


# --- Validation and layout ------------------------------------------------------------------


def _validate(
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
    if k.dtype not in _STORAGE or (not mass and v.dtype != k.dtype):
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


def _to_rows(x, kh):
    """[B, T, N, ...] -> [B, K, T*G, ...]: the query rows r = t*G + g of each kv head."""
    b, t, n = x.shape[:3]
    x = x.reshape(b, t, kh, n // kh, *x.shape[3:])
    return jnp.moveaxis(x, 2, 1).reshape(b, kh, t * (n // kh), *x.shape[4:])


def _from_rows(x, t):
    """[B, K, T*G, ...] -> [B, T, N, ...]."""
    b, kh, r = x.shape[:3]
    x = x.reshape(b, kh, t, r // t, *x.shape[3:])
    return jnp.moveaxis(x, 1, 2).reshape(b, t, kh * (r // t), *x.shape[4:])


def _kernel_inputs(
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


def _setup(q, k, block_q, block_s, sm_scale):
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


_KERNEL_STATICS = (
    "sliding_window",
    "sm_scale",
    "block_q",
    "block_s",
    "num_warps",
    "num_stages",
    "backend",
    "interpret",
)


@functools.partial(jax.jit, static_argnames=_KERNEL_STATICS + ("return_lse",))
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
    rope_positions = _validate(
        q, k, v, lengths, positions, q_positions, q_lengths, k_scale, v_scale, slot_bias,
        keep_mask, rope_positions, rope_inv_freq, sliding_window,
    )  # fmt: skip
    block_r, block_s, sm_scale, compute_dtype = _setup(q, k, block_q, block_s, sm_scale)
    b, t, n, h = q.shape
    _, kh, s, _ = k.shape
    g = n // kh
    rows = t * g
    fp8 = k.dtype == bk.FP8

    per_kv = lambda *blk: pl.BlockSpec((None, None, *blk), lambda i, j, _: (i, j) + (0,) * len(blk))
    extra, extra_specs = _kernel_inputs(
        lengths, positions, q_positions, q_lengths, k_scale, v_scale, slot_bias, keep_mask,
        rope_positions, rope_inv_freq, b=b, t=t, s=s,
    )  # fmt: skip
    args = [_to_rows(q, kh), bk.to_bits(k), bk.to_bits(v), *extra]
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
    out = _from_rows(outs[0], t)
    return (out, _from_rows(outs[1], t)) if return_lse else out


@functools.partial(jax.jit, static_argnames=_KERNEL_STATICS)
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
    rope_positions = _validate(
        q, k, None, lengths, positions, q_positions, q_lengths, k_scale, None, slot_bias,
        keep_mask, rope_positions, rope_inv_freq, sliding_window, mass=True,
    )  # fmt: skip
    if lse.shape != q.shape[:3] or lse.dtype != jnp.float32:
        raise ValueError(f"{lse.shape=} {lse.dtype=}: expected float32 {q.shape[:3]}")
    block_r, block_s, sm_scale, compute_dtype = _setup(q, k, block_q, block_s, sm_scale)
    b, t, n, h = q.shape
    _, kh, s, _ = k.shape
    g = n // kh
    rows = t * g

    per_kv = lambda *blk: pl.BlockSpec((None, None, *blk), lambda i, j, _: (i, j) + (0,) * len(blk))
    extra, extra_specs = _kernel_inputs(
        lengths, positions, q_positions, q_lengths, k_scale, None, slot_bias, keep_mask,
        rope_positions, rope_inv_freq, b=b, t=t, s=s,
    )  # fmt: skip
    args = [_to_rows(q, kh), bk.to_bits(k), _to_rows(lse, kh), *extra]
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


# --- Plain jnp: the reference and the blocked XLA path ---------------------------------------


def _slots_jnp(
    k, v, lengths, positions, k_scale, v_scale, slot_bias, keep_mask, rope_positions,
    rope_inv_freq, start, n, first,
):  # fmt: skip
    """Float32 keys, values, liveness, positions and bias of slots start..start+n (>= first).

    Dead slots (past the length, dropped, or before `first`) have keys, values and bias 0.
    """
    take = lambda x: lax.dynamic_slice_in_dim(x, start, n, axis=2)
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


def _logits_jnp(qf, kf, live, pos, bias, q_positions, q_real, window, sm_scale):
    """Masked logits [B, K, G, T, n] of qf [B, K, G, T, H] against kf [B, K, n, H]."""
    z = jnp.einsum("bkgth,bknh->bkgtn", qf, kf, precision="highest") * sm_scale
    if bias is not None:
        z = z + bias[:, :, None, None, :]
    delta = q_positions[:, None, :, None] - pos[:, :, None, :]  # [B, K, T, n]
    vis = live[:, :, None, :] & (delta >= 0) & q_real[:, None, :, None]
    if window is not None:
        vis = vis & (delta < window)
    return jnp.where(vis[:, :, None], z, -jnp.inf)


def _jnp_setup(q, k, lengths, q_positions, q_lengths, sm_scale):
    b, t, n, h = q.shape
    _, kh, s, _ = k.shape
    qf = q.astype(jnp.float32).reshape(b, t, kh, n // kh, h).transpose(0, 2, 3, 1, 4)
    q_lengths = jnp.full((b,), t, jnp.int32) if q_lengths is None else q_lengths
    q_real = jnp.arange(t) < jnp.clip(q_lengths.astype(jnp.int32), 0, t)[:, None]  # [B, T]
    sm_scale = 1.0 / math.sqrt(h) if sm_scale is None else float(sm_scale)
    lengths = jnp.clip(lengths.astype(jnp.int32), 0, s)
    return qf, q_positions.astype(jnp.int32), q_real, sm_scale, lengths


def _finish(o, m, lsum, q, return_lse):
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


_JNP_STATICS = ("sliding_window", "sm_scale", "return_lse")


@functools.partial(jax.jit, static_argnames=_JNP_STATICS)
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
    rope_positions = _validate(
        q, k, v, lengths, positions, q_positions, q_lengths, k_scale, v_scale, slot_bias,
        keep_mask, rope_positions, rope_inv_freq, sliding_window,
    )  # fmt: skip
    qf, q_positions, q_real, sm_scale, lengths = _jnp_setup(
        q, k, lengths, q_positions, q_lengths, sm_scale
    )
    kf, vf, live, pos, bias = _slots_jnp(
        k, v, lengths, positions, k_scale, v_scale, slot_bias, keep_mask, rope_positions,
        rope_inv_freq, 0, k.shape[2], 0,
    )  # fmt: skip
    z = _logits_jnp(qf, kf, live, pos, bias, q_positions, q_real, sliding_window, sm_scale)
    m = z.max(axis=-1)
    m_use = jnp.where(m == -jnp.inf, 0.0, m)
    e = jnp.exp(z - m_use[..., None])
    o = jnp.einsum("bkgts,bksh->bkgth", e, vf, precision="highest")
    return _finish(o, m, e.sum(axis=-1), q, return_lse)


@functools.partial(jax.jit, static_argnames=_JNP_STATICS + ("block_s",))
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
    rope_positions = _validate(
        q, k, v, lengths, positions, q_positions, q_lengths, k_scale, v_scale, slot_bias,
        keep_mask, rope_positions, rope_inv_freq, sliding_window,
    )  # fmt: skip
    if not isinstance(block_s, int) or block_s < 1:
        raise ValueError(f"{block_s=}: expected a static int >= 1")
    qf, q_positions, q_real, sm_scale, lengths = _jnp_setup(
        q, k, lengths, q_positions, q_lengths, sm_scale
    )
    b, kh, s, h = k.shape
    bs = min(block_s, s)

    def body(i, carry):
        o, m, lsum = carry
        start = jnp.minimum(i * bs, s - bs)
        kf, vf, live, pos, bias = _slots_jnp(
            k, v, lengths, positions, k_scale, v_scale, slot_bias, keep_mask, rope_positions,
            rope_inv_freq, start, bs, i * bs,
        )  # fmt: skip
        z = _logits_jnp(qf, kf, live, pos, bias, q_positions, q_real, sliding_window, sm_scale)
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
    return _finish(o, m, lsum, q, return_lse)


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
    rope_positions = _validate(
        q, k, None, lengths, positions, q_positions, q_lengths, k_scale, None, slot_bias,
        keep_mask, rope_positions, rope_inv_freq, sliding_window, mass=True,
    )  # fmt: skip
    qf, q_positions, q_real, sm_scale, lengths = _jnp_setup(
        q, k, lengths, q_positions, q_lengths, sm_scale
    )
    kf, _, live, pos, bias = _slots_jnp(
        k, None, lengths, positions, k_scale, None, slot_bias, keep_mask, rope_positions,
        rope_inv_freq, 0, k.shape[2], 0,
    )  # fmt: skip
    z = _logits_jnp(qf, kf, live, pos, bias, q_positions, q_real, sliding_window, sm_scale)
    b, t, n = lse.shape
    lse = lse.reshape(b, t, k.shape[1], n // k.shape[1]).transpose(0, 2, 3, 1)  # [B, K, G, T]
    lse = jnp.where(lse == -jnp.inf, 0.0, lse)
    p = jnp.where(z == -jnp.inf, 0.0, jnp.exp(z - lse[..., None]))
    return p.sum(axis=(2, 3))
