"""SnapKV observation-window scores: how much attention the last W prompt queries pay each slot.

Maths, for row b, kv head k, query head g of its group, window query w (n = k*G + g):

    p_w       = len[b,k] - W + w                   slot of query w (queries with p_w < 0, i.e.
                                                    rows shorter than W, do not exist: ignored)
    z[g,w,s]  = sm_scale * q[b,n,w] . K[b,k,s]     for s <= p_w (causal), else -inf
    a[g,w,s]  = softmax_s(z[g,w,:])
    score[s]  = sum_{g,w} a[g,w,s]                 for s < len[b,k]; 0 past it
    out[b,k]  = pool(score) along S, kernel size P (odd), stride 1, same size, zero padded:
                avg divides by P (torch avg_pool1d's count_include_pad, as SnapKV uses it),
                max takes the window max (scores are >= 0, so zero padding is neutral);
                slots past the length are 0 before pooling and set to 0 after it.

Two kernels, each one pass over K, on the grid (B, K, R / block_r, splits) where the R = G*W
query rows of a kv head are tiled by block_r (>= 16 for the dots): pass 1 keeps the online
softmax max m and sum l per query row and S range (combined in jnp); pass 2 recomputes the logits
and adds the normalised probabilities of its rows per slot. Only [B, K, R] statistics and
[B, K, R / block_r, S] partial sums reach HBM, never [B, N, W, S].

Bytes per call: read 2 * B*K*len*H*itemsize (K, twice) + 2 * B*N*W*H*itemsize (q, twice);
write 8*B*K*splits*R (statistics) + 4*B*K*(R / block_r)*S (partial sums) + 4*B*K*S (out).
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from jkv_kernels import _backend as bk

_TARGET_PROGRAMS = 264


def _logits(q_ref, k_ref, r0, s0, length, *, n_rows, n_window, block_s, sm_scale, cd):
    """Masked logits [br, bs] of query rows r0.. against slots s0.., and their mask."""
    br = q_ref.shape[0]
    rows = r0 + jnp.arange(br)
    qslot = length - n_window + rows % n_window  # slot of each query row
    slots = s0 + jnp.arange(block_s)
    row_ok = (rows < n_rows) & (qslot >= 0)
    q = bk.load(q_ref, mask=(rows < n_rows)[:, None], other=0).astype(cd)
    k = bk.load(k_ref.at[pl.ds(s0, block_s), :], mask=(slots < length)[:, None], other=0)
    z = bk.dot(q, k.astype(cd), trans_b=True) * sm_scale
    keep = row_ok[:, None] & (slots[None, :] <= qslot[:, None])  # causal, and below the length
    return jnp.where(keep, z, -jnp.inf), keep


def window_stats_kernel(q_ref, k_ref, len_ref, m_ref, l_ref, *, split_s, **kw):
    # q_ref: [br, H] query rows r = g*W + w of one kv head (rows >= R masked)
    # k_ref: [S, H] keys of one (row, kv head)
    # len_ref: [] valid length
    # m_ref, l_ref: [br] float32 softmax max and sum of these rows over this split's S range
    block_s = kw["block_s"]
    length = len_ref[()]
    r0 = pl.program_id(2) * q_ref.shape[0]
    lo = pl.program_id(3) * split_s
    hi = jnp.minimum(lo + split_s, length)
    n_blocks = jnp.where(hi > lo, (hi - lo + block_s - 1) // block_s, 0)

    def body(i, carry):
        m, lsum = carry
        z, _ = _logits(q_ref, k_ref, r0, lo + i * block_s, length, **kw)
        m_new = jnp.maximum(m, z.max(axis=1))
        m_use = jnp.where(m_new == -jnp.inf, 0.0, m_new)
        lsum = jnp.exp(m - m_use) * lsum + jnp.exp(z - m_use[:, None]).sum(axis=1)
        return m_new, lsum

    br = q_ref.shape[0]
    init = (jnp.full((br,), -jnp.inf, jnp.float32), jnp.zeros((br,), jnp.float32))
    m, lsum = jax.lax.fori_loop(0, n_blocks, body, init)
    bk.store(m_ref, m)
    bk.store(l_ref, lsum)


def window_probs_kernel(q_ref, k_ref, len_ref, m_ref, l_ref, o_ref, *, split_s, **kw):
    # q_ref: [br, H] query rows of one kv head; k_ref: [S, H]; len_ref: []
    # m_ref, l_ref: [br] float32 final softmax max and sum of these rows
    # o_ref: [S] float32 sum over these rows of the probabilities per slot (this split's range)
    block_s = kw["block_s"]
    s_total = k_ref.shape[0]
    length = len_ref[()]
    r0 = pl.program_id(2) * q_ref.shape[0]
    lo = pl.program_id(3) * split_s
    hi = jnp.minimum(lo + split_s, length)
    n_live = jnp.where(hi > lo, (hi - lo + block_s - 1) // block_s, 0)
    m = m_ref[...]
    lsum = l_ref[...]
    m_use = jnp.where(m == -jnp.inf, 0.0, m)
    inv_l = jnp.where(lsum > 0, 1.0 / jnp.where(lsum > 0, lsum, 1.0), 0.0)

    def body(i, carry):
        s0 = lo + i * block_s
        z, keep = _logits(q_ref, k_ref, r0, s0, length, **kw)
        p = jnp.where(keep, jnp.exp(z - m_use[:, None]) * inv_l[:, None], 0.0)
        slots = s0 + jnp.arange(block_s)
        bk.store(o_ref.at[pl.ds(s0, block_s)], p.sum(axis=0), mask=slots < s_total)
        return carry

    jax.lax.fori_loop(0, n_live, body, 0)

    def zero(i, carry):  # slots of this split past the length: write 0, every element written
        s0 = lo + i * block_s
        slots = s0 + jnp.arange(block_s)
        ok = (slots >= length) & (slots < jnp.minimum(lo + split_s, s_total))
        bk.store(o_ref.at[pl.ds(s0, block_s)], jnp.zeros((block_s,), jnp.float32), mask=ok)
        return carry

    jax.lax.fori_loop(n_live, split_s // block_s, zero, 0)


def _validate(q, k, lengths, pool, kernel_size):
    if q.ndim != 4 or k.ndim != 4:
        raise ValueError(f"{q.shape=} {k.shape=}: expected q [B, N, W, H], k [B, K, S, H]")
    b, n, w, h = q.shape
    kb, kh, _, kd = k.shape
    if kb != b or kd != h or kh == 0 or n % kh:
        raise ValueError(f"{q.shape=} {k.shape=}: expected k [B={b}, K | N={n}, S, H={h}]")
    if not bk.is_pow2(h) or h < bk.MIN_DOT:
        raise ValueError(f"{q.shape=}: H={h} must be a power of two >= {bk.MIN_DOT}")
    if k.dtype not in (jnp.float32, jnp.bfloat16) or q.dtype not in (jnp.float32, jnp.bfloat16):
        raise ValueError(f"{q.dtype=} {k.dtype=}: expected float32 or bfloat16")
    if lengths.shape != (b, kh) or not jnp.issubdtype(lengths.dtype, jnp.integer):
        raise ValueError(f"{lengths.shape=} {lengths.dtype=}: expected int32 [{b}, {kh}]")
    if pool not in ("avg", "max"):
        raise ValueError(f"{pool=}: expected 'avg' or 'max'")
    if not isinstance(kernel_size, int) or kernel_size < 1 or kernel_size % 2 == 0:
        raise ValueError(f"{kernel_size=}: expected an odd int >= 1 (same-size pooling)")


def pool_scores(score, lengths, pool, kernel_size):
    """score [B, K, S] (0 past the length) -> pooled, same size, 0 past the length."""
    r = kernel_size // 2
    pad = [(0, 0), (0, 0), (r, r)]
    if pool == "avg":
        out = jax.lax.reduce_window(score, 0.0, jax.lax.add, (1, 1, kernel_size), (1, 1, 1), pad)
        out = out / kernel_size
    else:
        out = jax.lax.reduce_window(score, 0.0, jax.lax.max, (1, 1, kernel_size), (1, 1, 1), pad)
    return jnp.where(jnp.arange(score.shape[-1]) < lengths[..., None], out, 0.0)


@functools.partial(
    jax.jit,
    static_argnames=(
        "pool",
        "kernel_size",
        "sm_scale",
        "block_r",
        "block_s",
        "num_splits",
        "num_warps",
        "num_stages",
        "backend",
        "interpret",
    ),
)
def window_scores(
    q,
    k,
    lengths,
    *,
    pool: str = "avg",
    kernel_size: int = 7,
    sm_scale: float | None = None,
    block_r: int = 64,
    block_s: int = 64,
    num_splits: int | None = None,
    num_warps: int = 4,
    num_stages: int = 2,
    backend: str = "triton",
    interpret: bool | None = None,
):
    """SnapKV voting: pooled attention of the last W prompt queries on every cached slot.

    Args:
      q: [B, N, W, H] the last W prompt queries, already rotated; float32/bfloat16.
      k: [B, K, S, H] keys (as attention sees them, i.e. rotated); float32/bfloat16.
      lengths: [B, K] int32; query w of (b, k) sits at slot lengths[b,k] - W + w and sees
        slots <= its own. Queries that would sit before slot 0 are ignored.
      pool: "avg" or "max"; kernel_size: odd pooling width (1 = no pooling).
      sm_scale: softmax scale, default 1/sqrt(H).
      block_r: query rows (of the G*W per kv head) per program, power of two >= 16.
      block_s: slots per step, power of two >= 16.
      num_splits: S ranges in parallel; None picks enough to fill the GPU.
      num_warps, num_stages: Triton compiler parameters.
      backend: "triton".
      interpret: run in the Pallas interpreter; None means "on CPU".

    Returns:
      [B, K, S] float32 pooled scores; 0 at and past each length.

    Raises:
      ValueError: on a shape, dtype, pooling, block size or backend that does not fit.
    """
    bk.check_backend(backend)
    interpret = bk.resolve_interpret(interpret)
    _validate(q, k, lengths, pool, kernel_size)
    bk.check_block("block_r", block_r, bk.MIN_DOT)
    bk.check_block("block_s", block_s, bk.MIN_DOT)
    b, n, w, h = q.shape
    _, kh, s, _ = k.shape
    n_rows = (n // kh) * w
    block_r = bk.block_size(n_rows, cap=block_r, floor=bk.MIN_DOT)
    n_rb = bk.cdiv(n_rows, block_r)
    if num_splits is None:
        num_splits = bk.next_pow2(bk.cdiv(_TARGET_PROGRAMS, b * kh * n_rb))
    num_splits = max(1, min(num_splits, bk.cdiv(s, block_s)))
    split_s = bk.cdiv(bk.cdiv(s, num_splits), block_s) * block_s
    num_splits = bk.cdiv(s, split_s)
    sm_scale = 1.0 / math.sqrt(h) if sm_scale is None else float(sm_scale)
    cd = jnp.bfloat16 if (q.dtype == jnp.bfloat16 and k.dtype == jnp.bfloat16) else jnp.float32
    kw = dict(n_rows=n_rows, n_window=w, block_s=block_s, sm_scale=sm_scale, cd=cd, split_s=split_s)

    lengths = jnp.clip(lengths.astype(jnp.int32), 0, s)
    q_rows = q.reshape(b, kh, n_rows, h)  # row r = g*W + w of kv head k
    grid = (b, kh, n_rb, num_splits)
    in_specs = [
        pl.BlockSpec((None, None, block_r, h), lambda i, j, r, t: (i, j, r, 0)),  # q row block
        pl.BlockSpec((None, None, s, h), lambda i, j, r, t: (i, j, 0, 0)),  # K: whole row
        pl.BlockSpec((None, None), lambda i, j, r, t: (i, j)),  # length
    ]
    params = bk.compiler_params(num_warps, num_stages)
    stat = pl.BlockSpec((None, None, None, block_r), lambda i, j, r, t: (i, j, t, r))
    m, lsum = pl.pallas_call(
        functools.partial(window_stats_kernel, **kw),
        grid=grid,
        in_specs=in_specs,
        out_specs=[stat, stat],  # per (row, kv head, split): max and sum of a block of rows
        out_shape=[jax.ShapeDtypeStruct((b, kh, num_splits, n_rb * block_r), jnp.float32)] * 2,
        compiler_params=params,
        interpret=interpret,
        name="jkv_window_stats",
    )(q_rows, k, lengths)
    m_max = m.max(axis=2)  # [B, K, R_padded]
    lsum = (jnp.exp(m - jnp.where(m_max == -jnp.inf, 0.0, m_max)[:, :, None]) * lsum).sum(axis=2)
    rows = pl.BlockSpec((None, None, block_r), lambda i, j, r, t: (i, j, r))
    part = pl.pallas_call(
        functools.partial(window_probs_kernel, **kw),
        grid=grid,
        in_specs=in_specs + [rows, rows],  # + final max and sum of this row block
        # Each program writes its split's S range of its row block's partial sums.
        out_specs=pl.BlockSpec((None, None, None, s), lambda i, j, r, t: (i, j, r, 0)),
        out_shape=jax.ShapeDtypeStruct((b, kh, n_rb, s), jnp.float32),
        compiler_params=params,
        interpret=interpret,
        name="jkv_window_probs",
    )(q_rows, k, lengths, m_max, lsum)
    return pool_scores(part.sum(axis=2), lengths, pool, kernel_size)


@functools.partial(jax.jit, static_argnames=("pool", "kernel_size", "sm_scale"))
def window_scores_reference(q, k, lengths, *, pool="avg", kernel_size=7, sm_scale=None):
    """Plain-jnp float32 `window_scores` (materialises the [B, K, G, W, S] probabilities)."""
    _validate(q, k, lengths, pool, kernel_size)
    b, n, w, h = q.shape
    _, kh, s, _ = k.shape
    sm_scale = 1.0 / math.sqrt(h) if sm_scale is None else float(sm_scale)
    lengths = jnp.clip(lengths.astype(jnp.int32), 0, s)
    qg = q.astype(jnp.float32).reshape(b, kh, n // kh, w, h)
    kf = k.astype(jnp.float32)
    kf = jnp.where((jnp.arange(s) < lengths[..., None])[..., None], kf, 0.0)
    z = jnp.einsum("bkgwh,bksh->bkgws", qg, kf, precision="highest") * sm_scale
    qslot = lengths[:, :, None] - w + jnp.arange(w)  # [B, K, W]
    keep = (jnp.arange(s) <= qslot[..., None]) & (qslot[..., None] >= 0)  # [B, K, W, S]
    keep = keep[:, :, None]
    z = jnp.where(keep, z, -jnp.inf)
    m = z.max(axis=-1, keepdims=True)
    e = jnp.where(keep, jnp.exp(z - jnp.where(m == -jnp.inf, 0.0, m)), 0.0)
    lsum = e.sum(axis=-1, keepdims=True)
    score = (e / jnp.where(lsum > 0, lsum, 1.0)).sum(axis=(2, 3))  # [B, K, S]
    return pool_scores(score, lengths, pool, kernel_size)
