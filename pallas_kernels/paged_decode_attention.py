"""Decode attention (one query token per row) over a paged, optionally FP8, GQA KV pool.

Layout (the serving engine's pool, KV-Compress style: a page holds ONE kv head's tokens):

    k_pages, v_pages   [P, page_size, H]   one pool for all layers, kv heads and requests
    k/v_scale_pages    [P, page_size]      FP8 scales (bfloat16)
    pos_pages          [P, page_size]      text position of every stored token
    page_table         [B, K, max_pages]   page ids of (row b, kv head k) for this layer's call
    lengths            [B, K]              token i < len[b,k] lives at
                                           page_table[b,k,i // page_size], offset i % page_size;
                                           entries past the length are unread

Heads of one row may hold different numbers of tokens (per-head compression) and a head's pages
lie anywhere in the pool; two rows may share pages (prefix caching). Maths, for row b, kv head
k, query head n = k*G + g, token i < len[b, k] at (page, offset) = (table[b,k,i // ps], i % ps):

    kk[i]   = K[page, off] * k_scale[page, off]           (scale only for FP8 storage)
    pos[i]  = pos_pages[page, off]
    rot[i]  = pos[i] if pos[i] < rope_sink else pos[i] - rope_shift[b,k]   (StreamingLLM: the
              sinks keep their positions and the window is contiguous after them)
    kk[i]   = kk[i]*cos(rot[i]*f) + rotate_half(kk[i])*sin(rot[i]*f)   (RoPE on read, optional)
    z[g, i] = sm_scale * q[b,n] . kk[i]
              -inf where i >= len, and with q_positions also where
              pos[i] > q_pos[b] (causal) or q_pos[b] - pos[i] >= window (sliding window)
    p[g, i] = exp(z[g,i] - max_i z[g]) / sum_i exp(...)
    out[b,n] = sum_i p[g,i] * V[page, off] * v_scale[page, off]
    mass[b,k,i] = sum_g p[g,i]                           (H2O's accumulated attention, optional)

Flash-decoding as in `decode_attention`: the grid (B, K, splits) gives each program the G query
heads of one kv head (padded to 16 rows for Triton's dot) and one contiguous range of its page
table; blocks of `pages_per_block` pages are visited only below the length. The pool stays in
HBM as raw pointers: each slot's page id is read from the table inside the kernel and its row
gathered by address (64-bit offsets once the pool passes 4 GiB), so no page is ever copied.
A jnp combine merges the splits (`decode_attention.combine_splits`). FP8 is decoded from its bits in
registers; for `return_mass` the kernel writes the masked logits and the combine normalises them.

Bytes per call (memory bound; itemsize 4 / 2 / 1 for f32 / bf16 / fp8; len summed over (b, k)):
    read   2 * B*K*len*H*itemsize (K, V: valid slots only) + 4*B*K*len (bf16 FP8 scales)
           + 4*B*K*len (positions, RoPE or window) + 4*B*K*ceil(len/page_size) (page ids)
           + B*N*H*itemsize (q)
    write  4 * B*K*splits*G*(H + 2) (partials) + B*N*H*itemsize (out)
    mass   + 4*B*K*G*S written and read back (logits) + 4*B*K*S written (mass),
           S = max_pages * page_size
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from jkv_kernels import _backend as bk
from jkv_kernels.decode_attention import (
    apply_rope_reference,
    combine_splits,
    decode_attention_reference,
    split_outputs,
)

# Two waves of programs on a 132-SM GPU (H100/H200) keep every SM busy for one long row.
_TARGET_PROGRAMS = 264
# Slots per inner step when pages_per_block is left to its default.
_BLOCK_SLOTS = 64
_STORAGE = (jnp.dtype(jnp.float32), jnp.dtype(jnp.bfloat16), bk.FP8)


def paged_decode_attention_kernel(
    *refs,
    n_heads: int,
    page_size: int,
    block_s: int,
    split_s: int,
    sm_scale: float,
    compute_dtype,
    fp8: bool,
    rope: bool,
    shift: bool,
    rope_sink: int,
    causal: bool,
    window: int | None,
    mass: bool,
):
    refs = list(refs)
    q_ref = refs.pop(0)  # [Gp, H] the G query heads of one kv head; rows >= G are padding
    k_ref = refs.pop(0)  # [P, page_size, H] the whole key pool; uint8 bits when FP8
    v_ref = refs.pop(0)  # [P, page_size, H] the whole value pool, same storage
    table_ref = refs.pop(0)  # [max_pages] page ids of this (row, kv head)
    len_ref = refs.pop(0)  # [] valid length of this (row, kv head)
    ks_ref = refs.pop(0) if fp8 else None  # [P, page_size] key scales
    vs_ref = refs.pop(0) if fp8 else None  # [P, page_size] value scales
    pos_ref = refs.pop(0) if (rope or causal) else None  # [P, page_size] text positions
    qpos_ref = refs.pop(0) if causal else None  # [] position of this row's query
    shift_ref = refs.pop(0) if shift else None  # [] RoPE shift of this (row, kv head)
    inv_ref = refs.pop(0) if rope else None  # [H/2] RoPE inverse frequencies
    o_ref = refs.pop(0)  # [Gp, H] float32 unnormalised output of this split
    m_ref = refs.pop(0)  # [Gp] float32 running max of this split
    l_ref = refs.pop(0)  # [Gp] float32 running sum of this split
    z_ref = refs.pop(0) if mass else None  # [Gp, S] float32 masked logits

    gp, h = q_ref.shape
    s_total = table_ref.shape[0] * page_size
    length = len_ref[()]
    lo = pl.program_id(2) * split_s
    hi = jnp.minimum(lo + split_s, length)
    n_blocks = jnp.where(hi > lo, (hi - lo + block_s - 1) // block_s, 0)
    row_ok = jnp.arange(gp) < n_heads
    qpos = qpos_ref[()] if causal else None
    # Blocks start on a page boundary, so a slot's offset in its page depends on the lane only.
    offs = jnp.arange(block_s) % page_size

    def gather(ref, page, valid, col0, width):
        """[block_s, >= 16] columns col0..col0+width of each slot's pool row (0 where masked).

        All-array indices: one address per element, the interpreter's only gather form."""
        wp = max(width, bk.MIN_DOT)  # H = 16 with RoPE: a half is padded to a dot's 16 columns
        cols = jnp.arange(wp)
        mask = valid[:, None] if wp == width else valid[:, None] & (cols < width)[None, :]
        return bk.load(
            ref.at[page[:, None], offs[:, None], (col0 + cols)[None, :]], mask=mask, other=0
        )

    if rope:
        # Rotate-half RoPE on two halves of H, each padded to >= 16 columns for the dots.
        hh = h // 2
        hp = max(hh, bk.MIN_DOT)
        col_ok = jnp.arange(hp) < hh
        if hp == hh:
            q1 = bk.load(q_ref.at[:, pl.ds(0, hh)], mask=row_ok[:, None], other=0)
            q2 = bk.load(q_ref.at[:, pl.ds(hh, hh)], mask=row_ok[:, None], other=0)
            inv = bk.load(inv_ref)  # [H/2]
        else:
            rows_i = jnp.arange(gp)[:, None]
            mask = row_ok[:, None] & col_ok[None, :]
            q1 = bk.load(q_ref.at[rows_i, jnp.arange(hp)[None, :]], mask=mask, other=0)
            q2 = bk.load(q_ref.at[rows_i, (hh + jnp.arange(hp))[None, :]], mask=mask, other=0)
            inv = bk.load(inv_ref.at[jnp.arange(hp)], mask=col_ok, other=0.0)  # [16]
        q1, q2 = q1.astype(compute_dtype), q2.astype(compute_dtype)
        shift_val = shift_ref[()] if shift else 0
    else:
        q = bk.load(q_ref, mask=row_ok[:, None], other=0).astype(compute_dtype)

    decode = functools.partial(bk.to_f32, fp8=fp8)

    def body(i, carry):
        s0 = lo + i * block_s
        slots = s0 + jnp.arange(block_s)
        valid = slots < length
        # One table read per slot (a page's lanes hit the same cached word): the page id of
        # every lane, 0 (a valid id, never used) where masked.
        page = bk.load(table_ref.at[slots // page_size], mask=valid, other=0)  # [bs]
        pos = None
        if pos_ref is not None:
            pos = bk.load(pos_ref.at[page, offs], mask=valid, other=0)  # [bs]
        if rope:
            k1 = decode(gather(k_ref, page, valid, 0, hh))
            k2 = decode(gather(k_ref, page, valid, hh, hh))
            rot = jnp.where(pos < rope_sink, pos, pos - shift_val) if shift else pos
            ang = rot.astype(jnp.float32)[:, None] * inv[None, :]  # [bs, hp]
            cos, sin = jnp.cos(ang), jnp.sin(ang)
            r1 = (k1 * cos - k2 * sin).astype(compute_dtype)
            r2 = (k2 * cos + k1 * sin).astype(compute_dtype)
            z = bk.dot(q1, r1, trans_b=True) + bk.dot(q2, r2, trans_b=True)  # [Gp, bs]
        else:
            kb = decode(gather(k_ref, page, valid, 0, h))
            z = bk.dot(q, kb.astype(compute_dtype), trans_b=True)  # [Gp, bs]
        if fp8:
            ks = bk.load(ks_ref.at[page, offs], mask=valid, other=0).astype(jnp.float32)
            z = z * ks[None, :]
        z = z * sm_scale
        keep = bk.visible_slots(valid, pos, qpos, causal=causal, window=window)
        # where, not a multiplicative mask: garbage (NaN) in a dead slot must not leak.
        z = jnp.where(keep[None, :], z, -jnp.inf)
        if mass:
            rows = pl.ds(s0, block_s)
            bk.store(z_ref.at[:, rows], z, mask=row_ok[:, None] & (slots < s_total)[None, :])
        vs = None
        if fp8:
            vs = bk.load(vs_ref.at[page, offs], mask=valid, other=0).astype(jnp.float32)
        vb = decode(gather(v_ref, page, valid, 0, h))
        return bk.softmax_update(carry, z, vb, compute_dtype, vs)

    o, m, lsum = jax.lax.fori_loop(0, n_blocks, body, bk.softmax_start(gp, h))
    bk.store(o_ref, o, mask=row_ok[:, None])
    bk.store(m_ref, m, mask=row_ok)
    bk.store(l_ref, lsum, mask=row_ok)


def _validate(
    q,
    k_pages,
    v_pages,
    page_table,
    lengths,
    k_scale_pages,
    v_scale_pages,
    pos_pages,
    rope_inv_freq,
    rope_shift,
    rope_sink,
    q_positions,
    window,
):
    if q.ndim != 3 or k_pages.ndim != 3:
        raise ValueError(
            f"{q.shape=} {k_pages.shape=}: expected q [B, N, H] and k_pages [P, page_size, H]"
        )
    b, n, h = q.shape
    p, page_size, kd = k_pages.shape
    if v_pages.shape != k_pages.shape or kd != h:
        raise ValueError(
            f"{q.shape=} {k_pages.shape=} {v_pages.shape=}: expected k_pages, v_pages "
            f"[P, page_size, H={h}]"
        )
    if not bk.is_pow2(h) or h < bk.MIN_DOT:
        raise ValueError(f"{q.shape=}: H={h} must be a power of two >= {bk.MIN_DOT}")
    if not bk.is_pow2(page_size):
        raise ValueError(f"{k_pages.shape=}: page_size={page_size} must be a power of two")
    if page_table.ndim != 3 or page_table.shape[0] != b:
        raise ValueError(f"{page_table.shape=}: expected [B={b}, K, max_pages]")
    if not jnp.issubdtype(page_table.dtype, jnp.integer):
        raise ValueError(f"{page_table.dtype=}: expected int32")
    _, kh, max_pages = page_table.shape
    if kh == 0 or n % kh or max_pages == 0:
        raise ValueError(
            f"{q.shape=} {page_table.shape=}: N={n} must be a multiple of K={kh} >= 1, "
            "max_pages >= 1"
        )
    if lengths.shape != (b, kh) or not jnp.issubdtype(lengths.dtype, jnp.integer):
        raise ValueError(f"{lengths.shape=} {lengths.dtype=}: expected int32 [{b}, {kh}]")
    if k_pages.dtype not in _STORAGE or v_pages.dtype != k_pages.dtype:
        raise ValueError(
            f"{k_pages.dtype=} {v_pages.dtype=}: expected one of float32, bfloat16, float8_e4m3fn"
        )
    if q.dtype not in (jnp.float32, jnp.bfloat16, jnp.float16):
        raise ValueError(f"{q.dtype=}: expected float32, bfloat16 or float16")
    fp8 = k_pages.dtype == bk.FP8
    if fp8 != (k_scale_pages is not None) or fp8 != (v_scale_pages is not None):
        raise ValueError(
            f"{k_pages.dtype=} k_scale_pages={k_scale_pages is not None} "
            f"v_scale_pages={v_scale_pages is not None}: "
            "FP8 storage needs both scales, other storage neither"
        )
    for name, x in (("k_scale_pages", k_scale_pages), ("v_scale_pages", v_scale_pages)):
        if x is None:
            continue
        if x.shape != (p, page_size):
            raise ValueError(f"{name}.shape={x.shape}: expected [P={p}, page_size={page_size}]")
        if x.dtype not in (jnp.float32, jnp.bfloat16):
            raise ValueError(f"{name}.dtype={x.dtype}: expected bfloat16 or float32")
    if pos_pages is not None:
        if pos_pages.shape != (p, page_size) or not jnp.issubdtype(pos_pages.dtype, jnp.integer):
            raise ValueError(
                f"{pos_pages.shape=} {pos_pages.dtype=}: expected int32 [{p}, {page_size}]"
            )
    if rope_inv_freq is not None:
        if rope_inv_freq.shape != (h // 2,):
            raise ValueError(f"{rope_inv_freq.shape=}: expected [H/2={h // 2}]")
        if pos_pages is None:
            raise ValueError("rope_inv_freq needs pos_pages [P, page_size] to rotate the keys")
    if rope_shift is not None:
        if rope_inv_freq is None:
            raise ValueError("rope_shift needs rope_inv_freq (it shifts the RoPE positions)")
        if rope_shift.shape != (b, kh) or not jnp.issubdtype(rope_shift.dtype, jnp.integer):
            raise ValueError(f"{rope_shift.shape=} {rope_shift.dtype=}: expected int32 [{b}, {kh}]")
    if not isinstance(rope_sink, int) or rope_sink < 0:
        raise ValueError(f"rope_sink={rope_sink!r}: expected a static int >= 0")
    if window is not None:
        if not isinstance(window, int) or window < 1:
            raise ValueError(f"sliding_window={window!r}: expected a static int >= 1")
        if q_positions is None:
            raise ValueError("sliding_window needs pos_pages [P, page_size] and q_positions [B]")
    if q_positions is not None:
        if pos_pages is None:
            raise ValueError("q_positions needs pos_pages [P, page_size] to compare against")
        if q_positions.shape != (b,) or not jnp.issubdtype(q_positions.dtype, jnp.integer):
            raise ValueError(f"{q_positions.shape=} {q_positions.dtype=}: expected int32 [{b}]")


@functools.partial(
    jax.jit,
    static_argnames=(
        "rope_sink",
        "sliding_window",
        "return_mass",
        "sm_scale",
        "pages_per_block",
        "num_splits",
        "num_warps",
        "num_stages",
        "backend",
        "interpret",
    ),
)
def paged_decode_attention(
    q,
    k_pages,
    v_pages,
    page_table,
    lengths,
    *,
    k_scale_pages=None,
    v_scale_pages=None,
    pos_pages=None,
    rope_inv_freq=None,
    rope_shift=None,
    rope_sink: int = 0,
    q_positions=None,
    sliding_window: int | None = None,
    return_mass: bool = False,
    sm_scale: float | None = None,
    pages_per_block: int | None = None,
    num_splits: int | None = None,
    num_warps: int = 4,
    num_stages: int = 2,
    backend: str = "triton",
    interpret: bool | None = None,
):
    """Attention of one query token per row over a paged GQA KV pool (flash-decoding).

    Args:
      q: [B, N, H] query (already rotated when RoPE is used), float32/bfloat16/float16.
      k_pages, v_pages: [P, page_size, H] pool, float32, bfloat16 or float8_e4m3fn.
      page_table: [B, K, max_pages] int32 page ids in [0, P) of each (row, kv head); entries
        at or past ceil(len / page_size) are never read.
      lengths: [B, K] int32 tokens held by each (row, kv head), clipped to
        [0, max_pages * page_size].
      k_scale_pages, v_scale_pages: [P, page_size] bfloat16 (or float32) per-token scales;
        required exactly for FP8 storage.
      pos_pages: [P, page_size] int32 text position of every token (RoPE on read, window).
      rope_inv_freq: [H/2] float32; when given, keys are stored pre-RoPE and rotated here at
        pos if pos < rope_sink else pos - rope_shift.
      rope_shift: [B, K] int32 RoPE position shift of each (row, kv head); default 0.
      rope_sink: static int; tokens at positions below it keep their position (sinks).
      q_positions: [B] int32 position of each row's query; when given, tokens at a later
        position are masked (causal), as are those outside `sliding_window`.
      sliding_window: static int; tokens with q_position - position >= window are masked.
      return_mass: also return the attention mass per slot summed over each group's G heads.
      sm_scale: softmax scale, default 1/sqrt(H).
      pages_per_block: pages per inner step; pages_per_block * page_size must be a power of
        two >= 16. None picks 64 slots' worth (at least one page).
      num_splits: page ranges processed in parallel; None picks enough to fill the GPU.
      num_warps, num_stages: Triton compiler parameters.
      backend: "triton" (the only one so far).
      interpret: run the kernel in the Pallas interpreter; None means "on CPU".

    Returns:
      out [B, N, H] in q.dtype; with return_mass a tuple (out, mass [B, K, max_pages *
      page_size] float32), slot i of mass being token i of that (row, kv head). Heads of
      length 0 give out 0 and mass 0.

    Raises:
      ValueError: on shapes, dtypes, block sizes or a backend that do not fit.
    """
    bk.check_backend(backend)
    interpret = bk.resolve_interpret(interpret)
    _validate(
        q, k_pages, v_pages, page_table, lengths, k_scale_pages, v_scale_pages, pos_pages,
        rope_inv_freq, rope_shift, rope_sink, q_positions, sliding_window,
    )  # fmt: skip
    b, n, h = q.shape
    _, page_size, _ = k_pages.shape
    _, kh, max_pages = page_table.shape
    if pages_per_block is None:
        pages_per_block = max(1, _BLOCK_SLOTS // page_size)
    if not isinstance(pages_per_block, int) or pages_per_block < 1:
        raise ValueError(f"{pages_per_block=}: expected an int >= 1 or None")
    block_s = pages_per_block * page_size
    if not bk.is_pow2(block_s) or block_s < bk.MIN_DOT:
        raise ValueError(
            f"{pages_per_block=} * {page_size=} = {block_s} must be a power of two >= {bk.MIN_DOT}"
        )
    if num_splits is not None and num_splits < 1:
        raise ValueError(f"{num_splits=}: expected an int >= 1 or None")
    g = n // kh
    s = max_pages * page_size
    gp = bk.block_size(g, cap=max(g, bk.MIN_DOT), floor=bk.MIN_DOT)
    fp8 = k_pages.dtype == bk.FP8
    rope = rope_inv_freq is not None
    shift = rope and rope_shift is not None
    causal = q_positions is not None
    sm_scale = 1.0 / math.sqrt(h) if sm_scale is None else float(sm_scale)
    # 16-bit dots when the query is 16-bit and the pool converts to it exactly (same dtype or
    # FP8, whose values bf16 and f16 both hold); exact float32 dots otherwise.
    low = q.dtype != jnp.float32 and k_pages.dtype in (q.dtype, bk.FP8)
    compute_dtype = q.dtype if low else jnp.float32

    n_blocks = bk.cdiv(max_pages, pages_per_block)
    if num_splits is None:
        num_splits = bk.next_pow2(bk.cdiv(_TARGET_PROGRAMS, b * kh))
    num_splits = max(1, min(num_splits, n_blocks))
    split_s = bk.cdiv(n_blocks, num_splits) * block_s  # whole blocks, so whole pages
    num_splits = bk.cdiv(s, split_s)  # no empty programs

    lengths = jnp.clip(lengths.astype(jnp.int32), 0, s)
    args = [
        q.reshape(b, kh, g, h),
        bk.to_bits(k_pages),
        bk.to_bits(v_pages),
        page_table.astype(jnp.int32),
        lengths,
    ]
    per_kv = lambda *blk: pl.BlockSpec((None, None, *blk), lambda i, j, _: (i, j) + (0,) * len(blk))
    whole = lambda *shape: pl.BlockSpec(shape, lambda i, j, _: (0,) * len(shape))
    p = k_pages.shape[0]
    in_specs = [
        per_kv(gp, h),  # q: the G heads of kv head j, rows padded to gp (masked loads)
        whole(p, page_size, h),  # k_pages: the whole pool; rows are gathered by page id
        whole(p, page_size, h),  # v_pages
        per_kv(max_pages),  # page_table: the page ids of (row i, kv head j)
        per_kv(),  # lengths: one scalar per (row, kv head)
    ]
    if fp8:
        args += [k_scale_pages, v_scale_pages]  # bfloat16 or float32; widened in registers
        in_specs += [whole(p, page_size), whole(p, page_size)]  # gathered like the pool
    if rope or causal:
        args.append(pos_pages.astype(jnp.int32))
        in_specs.append(whole(p, page_size))
    if causal:
        args.append(q_positions.astype(jnp.int32))
        in_specs.append(pl.BlockSpec((None,), lambda i, j, _: (i,)))  # this row's position
    if shift:
        args.append(rope_shift.astype(jnp.int32))
        in_specs.append(per_kv())  # one shift per (row, kv head)
    if rope:
        args.append(rope_inv_freq.astype(jnp.float32))
        in_specs.append(whole(h // 2))

    out_shape, out_specs = split_outputs(b, kh, num_splits, g, gp, h, s, return_mass)

    kernel = functools.partial(
        paged_decode_attention_kernel,
        n_heads=g,
        page_size=page_size,
        block_s=block_s,
        split_s=split_s,
        sm_scale=sm_scale,
        compute_dtype=compute_dtype,
        fp8=fp8,
        rope=rope,
        shift=shift,
        rope_sink=rope_sink,
        causal=causal,
        window=sliding_window,
        mass=return_mass,
    )
    outs = pl.pallas_call(
        kernel,
        grid=(b, kh, num_splits),
        in_specs=in_specs,
        out_specs=out_specs,
        out_shape=out_shape,
        compiler_params=bk.compiler_params(num_warps, num_stages),
        interpret=interpret,
        name="jkv_paged_decode_attention",
    )(*args)
    out, mass, _ = combine_splits(*outs[:3], outs[3] if return_mass else None, lengths)
    out = out.reshape(b, n, h).astype(q.dtype)
    return (out, mass) if return_mass else out


def gather_pages(pages, page_table):
    """Dense copy of the paged tokens: pages [P, page_size, ...] by page_table [B, K, max_pages].

    Returns [B, K, max_pages * page_size, ...]: slot i of (b, k) is token i, read from page
    page_table[b, k, i // page_size] at offset i % page_size (slots past the length hold
    whatever those pages hold).
    """
    dense = pages[page_table]  # [B, K, max_pages, page_size, ...]
    b, kh, max_pages, page_size = dense.shape[:4]
    return dense.reshape(b, kh, max_pages * page_size, *dense.shape[4:])


@functools.partial(
    jax.jit, static_argnames=("rope_sink", "sliding_window", "return_mass", "sm_scale")
)
def paged_decode_attention_reference(
    q,
    k_pages,
    v_pages,
    page_table,
    lengths,
    *,
    k_scale_pages=None,
    v_scale_pages=None,
    pos_pages=None,
    rope_inv_freq=None,
    rope_shift=None,
    rope_sink: int = 0,
    q_positions=None,
    sliding_window: int | None = None,
    return_mass: bool = False,
    sm_scale: float | None = None,
):
    """Plain-jnp float32 `paged_decode_attention`: gather the pages densely, rotate the keys at
    their shifted positions, then `decode_attention_reference`'s masked softmax."""
    _validate(
        q, k_pages, v_pages, page_table, lengths, k_scale_pages, v_scale_pages, pos_pages,
        rope_inv_freq, rope_shift, rope_sink, q_positions, sliding_window,
    )  # fmt: skip
    s = page_table.shape[2] * k_pages.shape[1]
    lengths = jnp.clip(lengths.astype(jnp.int32), 0, s)
    valid = (jnp.arange(s) < lengths[..., None])[..., None]  # [B, K, S, 1]
    k = gather_pages(k_pages, page_table).astype(jnp.float32)  # [B, K, S, H]
    v = gather_pages(v_pages, page_table).astype(jnp.float32)
    if k_scale_pages is not None:
        k = k * gather_pages(k_scale_pages, page_table).astype(jnp.float32)[..., None]
        v = v * gather_pages(v_scale_pages, page_table).astype(jnp.float32)[..., None]
    # Pages past the length may hold anything (NaN included): zero them before any arithmetic.
    k = jnp.where(valid, k, 0.0)
    v = jnp.where(valid, v, 0.0)
    pos = None if pos_pages is None else gather_pages(pos_pages, page_table).astype(jnp.int32)
    if rope_inv_freq is not None:
        rot = pos
        if rope_shift is not None:
            rot = jnp.where(pos < rope_sink, pos, pos - rope_shift[:, :, None])
        k = apply_rope_reference(k, rot, rope_inv_freq)
    return decode_attention_reference(
        q,
        k,
        v,
        lengths,
        positions=pos,
        q_positions=q_positions,
        sliding_window=sliding_window,
        sm_scale=sm_scale,
        return_mass=return_mass,
    )
