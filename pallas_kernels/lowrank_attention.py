"""Decode attention (one query token per row) over low-rank KV segments, never reconstructed.

A (row b, kv head k) holds M segments; segment m stores n = count[b,k,m] tokens as factors:
keys K_m ~ Ck_m @ Bk_m with coefficients Ck_m [L, R] and basis Bk_m [R, H] (rank rk = rank_k[b,k,m]:
columns/rows >= rk are ignored), values likewise with Cv_m, Bv_m, rank rv. For query head
n = k*G + g:

    qb[g]      = q[b,n] @ Bk_m^T                                  [R]   (rank space)
    z[g,m,j]   = sm_scale * qb[g] . Ck_m[j]        for j < count (else -inf); with q_positions also
                 -inf where pos[m,j] > q_pos (causal) or q_pos - pos[m,j] >= window
    p          = softmax over all (m, j) of z[g]
    out[b,n]   = sum_m (p[g,m,:] @ Cv_m) @ Bv_m                   [H]   (rank space, then H)
    lse[b,n]   = log sum_{m,j} exp(z[g,m,j])                      (-inf when nothing is visible)

so a score costs R + R*H/L multiply-adds per token instead of H, and no [L, H] tile is built.
`lse` lets the result join another attention over the same query in one softmax
(`combine_attention`): with decode_attention(..., return_lse=True) over the ordinary slots,
out = (o1 e^{lse1} + o2 e^{lse2}) / (e^{lse1} + e^{lse2}), computed from the larger lse.

The grid is (B, K, M): one program per segment, its G query heads padded to 16 rows and its
rank padded to 16 columns (Triton's dot needs every dimension >= 16; masked loads give zeros).
Each writes its unnormalised output o, max m and sum l; a jnp combine rescales them like
flash-decoding's splits.

Bytes per call (itemsize of the factors): read B*K*M*(2*L*R + 2*R*H)*itemsize (factors)
+ 12*B*K*M (counts, ranks) + 4*B*K*M*L (positions, windowed only) + B*N*H*itemsize(q);
write 4*B*K*M*G*(H + 2) (partials) + 4*B*N*(H + 1) (out, lse).
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from jkv_kernels import _backend as bk

_FACTORS = (jnp.dtype(jnp.float32), jnp.dtype(jnp.bfloat16))


def lowrank_attention_kernel(
    *refs, n_heads: int, rank: int, sm_scale: float, compute_dtype, causal: bool, window
):
    refs = list(refs)
    q_ref = refs.pop(0)  # [Gp, H] the G query heads of one kv head; rows >= G are padding
    ck_ref = refs.pop(0)  # [L, R] key coefficients of one segment
    bk_ref = refs.pop(0)  # [R, H] key basis
    cv_ref = refs.pop(0)  # [L, R] value coefficients
    bv_ref = refs.pop(0)  # [R, H] value basis
    cnt_ref = refs.pop(0)  # [] tokens in this segment
    rk_ref = refs.pop(0)  # [] key rank
    rv_ref = refs.pop(0)  # [] value rank
    pos_ref = refs.pop(0) if causal else None  # [L] positions of the segment's tokens
    qpos_ref = refs.pop(0) if causal else None  # [] position of this row's query
    o_ref = refs.pop(0)  # [Gp, H] float32 unnormalised output of this segment
    m_ref = refs.pop(0)  # [Gp] float32 max logit
    l_ref = refs.pop(0)  # [Gp] float32 sum of exp(logit - max)

    gp, h = q_ref.shape
    seg_len = ck_ref.shape[0]
    rp = max(bk.MIN_DOT, bk.next_pow2(rank))
    count = cnt_ref[()]
    row_ok = jnp.arange(gp) < n_heads
    tok = jnp.arange(seg_len)
    tok_ok = tok < count
    r_idx = jnp.arange(rp)
    h_idx = jnp.arange(h)

    def factors(c_ref, b_ref, r_live):
        """Coefficients [L, Rp] and basis [Rp, H], zero past the rank and past the count."""
        r_ok = (r_idx < rank) & (r_idx < r_live)
        r_safe = jnp.where(r_ok, r_idx, 0)
        coef = bk.load(
            c_ref.at[tok[:, None], r_safe[None, :]], mask=tok_ok[:, None] & r_ok[None, :], other=0
        )
        basis = bk.load(b_ref.at[r_safe[:, None], h_idx[None, :]], mask=r_ok[:, None], other=0)
        return coef.astype(compute_dtype), basis.astype(compute_dtype)

    q = bk.load(q_ref, mask=row_ok[:, None], other=0).astype(compute_dtype)
    ck, bkey = factors(ck_ref, bk_ref, rk_ref[()])
    qb = bk.dot(q, bkey, trans_b=True)  # [Gp, Rp] the queries in the key basis
    z = bk.dot(qb.astype(compute_dtype), ck, trans_b=True) * sm_scale  # [Gp, L]
    keep = tok_ok
    if causal:
        pos = bk.load(pos_ref, mask=tok_ok, other=0)
        qpos = qpos_ref[()]
        keep = keep & (pos <= qpos)
        if window:
            keep = keep & (qpos - pos < window)
    # where, not a multiplicative mask: garbage (NaN) past the count must not leak.
    z = jnp.where(keep[None, :], z, -jnp.inf)
    m = z.max(axis=1)
    m_use = jnp.where(m == -jnp.inf, 0.0, m)
    p = jnp.exp(z - m_use[:, None])  # [Gp, L]
    cv, bval = factors(cv_ref, bv_ref, rv_ref[()])
    pc = bk.dot(p.astype(compute_dtype), cv)  # [Gp, Rp] the output in the value basis
    o = bk.dot(pc.astype(compute_dtype), bval)  # [Gp, H]
    bk.store(o_ref, o, mask=row_ok[:, None])
    bk.store(m_ref, m, mask=row_ok)
    bk.store(l_ref, p.sum(axis=1), mask=row_ok)


def _validate(q, coef_k, basis_k, coef_v, basis_v, counts, rank_k, rank_v, positions, qpos, win):
    if q.ndim != 3 or coef_k.ndim != 5 or basis_k.ndim != 5:
        raise ValueError(
            f"{q.shape=} {coef_k.shape=} {basis_k.shape=}: expected q [B, N, H], "
            "coefficients [B, K, M, L, R] and bases [B, K, M, R, H]"
        )
    b, n, h = q.shape
    cb, kh, m, seg_len, r = coef_k.shape
    if cb != b or basis_k.shape != (b, kh, m, r, h):
        raise ValueError(
            f"{q.shape=} {coef_k.shape=} {basis_k.shape=}: expected basis [B, K, M, R, H]"
        )
    if coef_v.shape != coef_k.shape or basis_v.shape != basis_k.shape:
        raise ValueError(f"{coef_v.shape=} {basis_v.shape=}: expected the key factors' shapes")
    if kh == 0 or n % kh:
        raise ValueError(f"{q.shape=} {coef_k.shape=}: N={n} must be a multiple of K={kh}")
    if not bk.is_pow2(h) or h < bk.MIN_DOT:
        raise ValueError(f"{q.shape=}: H={h} must be a power of two >= {bk.MIN_DOT}")
    if not bk.is_pow2(seg_len) or seg_len < bk.MIN_DOT:
        raise ValueError(f"{coef_k.shape=}: L={seg_len} must be a power of two >= {bk.MIN_DOT}")
    if q.dtype not in (jnp.float32, jnp.bfloat16, jnp.float16):
        raise ValueError(f"{q.dtype=}: expected float32, bfloat16 or float16")
    for name, x in (
        ("coef_k", coef_k),
        ("basis_k", basis_k),
        ("coef_v", coef_v),
        ("basis_v", basis_v),
    ):
        if x.dtype not in _FACTORS:
            raise ValueError(f"{name}.dtype={x.dtype}: expected float32 or bfloat16")
    for name, x in (("counts", counts), ("rank_k", rank_k), ("rank_v", rank_v)):
        if x.shape != (b, kh, m) or not jnp.issubdtype(x.dtype, jnp.integer):
            raise ValueError(
                f"{name}.shape={x.shape} {name}.dtype={x.dtype}: expected int32 [{b}, {kh}, {m}]"
            )
    if win is not None:
        if not isinstance(win, int) or win < 1:
            raise ValueError(f"sliding_window={win!r}: expected a static int >= 1")
        if qpos is None:
            raise ValueError("sliding_window needs positions [B, K, M, L] and q_positions [B]")
    if qpos is not None:
        if positions is None or positions.shape != (b, kh, m, seg_len):
            raise ValueError(f"q_positions needs positions [{b}, {kh}, {m}, {seg_len}]")
        if qpos.shape != (b,) or not jnp.issubdtype(qpos.dtype, jnp.integer):
            raise ValueError(f"{qpos.shape=} {qpos.dtype=}: expected int32 [{b}]")


def _combine(o, m, lsum):
    """Merges the segments: o [B,K,M,G,H], m, l [B,K,M,G] -> out [B,K,G,H], lse [B,K,G]."""
    m_max = m.max(axis=2)
    m_use = jnp.where(m_max == -jnp.inf, 0.0, m_max)
    w = jnp.exp(m - m_use[:, :, None])  # 0 for empty segments
    l_sum = (w * lsum).sum(axis=2)
    live = l_sum > 0
    l_safe = jnp.where(live, l_sum, 1.0)
    out = jnp.where(live[..., None], (w[..., None] * o).sum(axis=2) / l_safe[..., None], 0.0)
    return out, jnp.where(live, m_use + jnp.log(l_safe), -jnp.inf)


@functools.partial(
    jax.jit,
    static_argnames=(
        "sliding_window",
        "sm_scale",
        "num_warps",
        "num_stages",
        "backend",
        "interpret",
    ),
)
def lowrank_attention(
    q,
    coef_k,
    basis_k,
    coef_v,
    basis_v,
    counts,
    rank_k,
    rank_v,
    *,
    positions=None,
    q_positions=None,
    sliding_window: int | None = None,
    sm_scale: float | None = None,
    num_warps: int = 4,
    num_stages: int = 1,
    backend: str = "triton",
    interpret: bool | None = None,
):
    """Attention of one query token per row over low-rank segments (factors never expanded).

    Args:
      q: [B, N, H] query, float32/bfloat16/float16.
      coef_k, coef_v: [B, K, M, L, R] coefficients, float32 or bfloat16 (L a power of two >= 16).
      basis_k, basis_v: [B, K, M, R, H] bases, same dtypes.
      counts: [B, K, M] int32 tokens per segment (rows j >= count are ignored).
      rank_k, rank_v: [B, K, M] int32 ranks (coefficient columns / basis rows past them ignored).
      positions: [B, K, M, L] int32 token positions; with q_positions [B] int32, tokens after the
        query are masked (causal), as are those outside `sliding_window` (static int).
      sm_scale: softmax scale, default 1/sqrt(H).
      num_warps, num_stages: Triton compiler parameters.
      backend: "triton".
      interpret: run in the Pallas interpreter; None means "on CPU".

    Returns:
      (out [B, N, H] float32, the softmax-normalised output over these segments (0 where
      nothing is visible); lse [B, N] float32, the log-sum-exp of the logits, -inf where
      nothing is visible). Combine with another part by `combine_attention`.

    Raises:
      ValueError: on shapes, dtypes or a backend that do not fit.
    """
    bk.check_backend(backend)
    interpret = bk.resolve_interpret(interpret)
    _validate(
        q, coef_k, basis_k, coef_v, basis_v, counts, rank_k, rank_v,
        positions, q_positions, sliding_window,
    )  # fmt: skip
    b, n, h = q.shape
    _, kh, m, seg_len, r = coef_k.shape
    g = n // kh
    gp = bk.block_size(g, cap=max(g, bk.MIN_DOT), floor=bk.MIN_DOT)
    causal = q_positions is not None
    sm_scale = 1.0 / math.sqrt(h) if sm_scale is None else float(sm_scale)
    low = q.dtype != jnp.float32 and all(
        x.dtype == q.dtype for x in (coef_k, basis_k, coef_v, basis_v)
    )
    compute_dtype = q.dtype if low else jnp.float32

    seg = lambda *blk: pl.BlockSpec(
        (None, None, None, *blk), lambda i, j, t: (i, j, t) + (0,) * len(blk)
    )
    args = [q.reshape(b, kh, g, h), coef_k, basis_k, coef_v, basis_v]
    args += [x.astype(jnp.int32) for x in (counts, rank_k, rank_v)]
    in_specs = [
        pl.BlockSpec((None, None, gp, h), lambda i, j, t: (i, j, 0, 0)),  # q: G heads, padded rows
        seg(seg_len, r),  # key coefficients of segment t
        seg(r, h),  # key basis
        seg(seg_len, r),  # value coefficients
        seg(r, h),  # value basis
        seg(),  # count
        seg(),  # key rank
        seg(),  # value rank
    ]
    if causal:
        args += [positions.astype(jnp.int32), q_positions.astype(jnp.int32)]
        in_specs += [seg(seg_len), pl.BlockSpec((None,), lambda i, j, t: (i,))]
    out_shape = [
        jax.ShapeDtypeStruct((b, kh, m, g, h), jnp.float32),  # o
        jax.ShapeDtypeStruct((b, kh, m, g), jnp.float32),  # m
        jax.ShapeDtypeStruct((b, kh, m, g), jnp.float32),  # l
    ]
    out_specs = [seg(gp, h), seg(gp), seg(gp)]  # one block per (row, kv head, segment)
    kernel = functools.partial(
        lowrank_attention_kernel,
        n_heads=g,
        rank=r,
        sm_scale=sm_scale,
        compute_dtype=compute_dtype,
        causal=causal,
        window=sliding_window,
    )
    o, mx, lsum = pl.pallas_call(
        kernel,
        grid=(b, kh, m),
        in_specs=in_specs,
        out_specs=out_specs,
        out_shape=out_shape,
        compiler_params=bk.compiler_params(num_warps, num_stages),
        interpret=interpret,
        name="jkv_lowrank_attention",
    )(*args)
    out, lse = _combine(o, mx, lsum)
    return out.reshape(b, n, h), lse.reshape(b, n)


@functools.partial(jax.jit, static_argnames=("sliding_window", "sm_scale"))
def lowrank_attention_reference(
    q,
    coef_k,
    basis_k,
    coef_v,
    basis_v,
    counts,
    rank_k,
    rank_v,
    *,
    positions=None,
    q_positions=None,
    sliding_window: int | None = None,
    sm_scale: float | None = None,
):
    """Plain-jnp float32 `lowrank_attention`: reconstructs K = Ck @ Bk, V = Cv @ Bv (masked to the
    ranks and counts) and runs a dense softmax over every segment's tokens."""
    _validate(
        q, coef_k, basis_k, coef_v, basis_v, counts, rank_k, rank_v,
        positions, q_positions, sliding_window,
    )  # fmt: skip
    b, n, h = q.shape
    _, kh, m, seg_len, r = coef_k.shape
    g = n // kh
    sm_scale = 1.0 / math.sqrt(h) if sm_scale is None else float(sm_scale)
    tok_ok = jnp.arange(seg_len) < counts[..., None]  # [B, K, M, L]

    def expand(coef, basis, rank):
        r_ok = jnp.arange(r) < rank[..., None]  # [B, K, M, R]
        c = jnp.where(tok_ok[..., None] & r_ok[..., None, :], coef.astype(jnp.float32), 0.0)
        bas = jnp.where(r_ok[..., None], basis.astype(jnp.float32), 0.0)
        return jnp.einsum("bkmlr,bkmrh->bkmlh", c, bas, precision="highest").reshape(b, kh, -1, h)

    kf = expand(coef_k, basis_k, rank_k)  # [B, K, M*L, H]
    vf = expand(coef_v, basis_v, rank_v)
    keep = tok_ok
    if q_positions is not None:
        delta = q_positions[:, None, None, None] - positions
        keep = keep & (delta >= 0)
        if sliding_window is not None:
            keep = keep & (delta < sliding_window)
    keep = keep.reshape(b, kh, 1, -1)
    qf = q.astype(jnp.float32).reshape(b, kh, g, h)
    z = jnp.einsum("bkgh,bksh->bkgs", qf, kf, precision="highest") * sm_scale
    z = jnp.where(keep, z, -jnp.inf)
    mx = z.max(axis=-1, keepdims=True)
    e = jnp.exp(z - jnp.where(mx == -jnp.inf, 0.0, mx))
    lsum = e.sum(axis=-1)
    live = lsum > 0
    l_safe = jnp.where(live, lsum, 1.0)
    out = jnp.einsum("bkgs,bksh->bkgh", e / l_safe[..., None], vf, precision="highest")
    lse = jnp.where(
        live, jnp.where(mx[..., 0] == -jnp.inf, 0.0, mx[..., 0]) + jnp.log(l_safe), -jnp.inf
    )
    return out.reshape(b, n, h), lse.reshape(b, n)


@jax.jit
def combine_attention(out1, lse1, out2, lse2):
    """One softmax from two disjoint parts: out_i [B, N, H] normalised over part i, lse_i [B, N]
    its log-sum-exp (-inf: empty). Returns float32 [B, N, H] (0 where both parts are empty)."""
    top = jnp.maximum(lse1, lse2)
    top = jnp.where(top == -jnp.inf, 0.0, top)
    w1, w2 = jnp.exp(lse1 - top), jnp.exp(lse2 - top)  # exp(-inf) == 0: an empty part drops out
    den = w1 + w2
    num = out1.astype(jnp.float32) * w1[..., None] + out2.astype(jnp.float32) * w2[..., None]
    return jnp.where(den[..., None] > 0, num / jnp.where(den > 0, den, 1.0)[..., None], 0.0)
