"""SnapKV's observation-window scores over the engine's paged pool: how much attention a few
query tokens of each row (its prompt's last W) pay each slot of that row, read through the page
table in place (`window_scores` over a dense cache is its twin).

Layout (as `ragged_paged_attention`'s; a page holds ONE kv head's `page_size` tokens):

    q                  [T, N, H]          the rows' window queries, one row after another
    k_pages            [P, page_size, H]  the key pool (uint8 bits under FP8, k_scale beside)
    pos_pages          [P, page_size]     text position of every stored token
    page_table         [R, K, M]          page ids of (row r, kv head k) for this layer
    lengths            [R, K]             slots below the length are the row's tokens
    q_start, q_len     [R]                row r's queries are q[q_start : q_start + q_len]
    q_positions        [T]                text position of every query

Maths, for row r, kv head k, query t of the row, query head n = k*G + g:

    visible(i)   = i < len[r,k] and pos[i] <= q_pos[t]
                   (and q_pos[t] - pos[i] < window, with a sliding window)
    z[t,g,i]     = sm_scale * q[t,n] . K[i]             (K[i] decoded: bits x scale under FP8)
    score[r,k,i] = sum_{t,g} softmax_visible(z[t,g,:])[i]       (0 at and past the length)
    out[r,k]     = pool(score[r,k]) along the slots: `window_scores`'s pooling (avg or max,
                   odd kernel, same size, zero padded), 0 at and past the length.

For a row whose slot i holds text position i (an uncompressed prompt) this is `window_scores`
of the same queries over the row's keys. Three implementations: the float32 reference (each
row's pages gathered into a dense copy), `paged_window_scores_xla` (the "xla" backend's path:
loops over each row's own key blocks, `pages_per_step` pages at a time, with data trip counts),
and `paged_window_scores` (Pallas Triton): a statistics kernel over the grid (R, K, query tiles)
writes each query's softmax max and sum by address, then a probabilities kernel over (R, K)
walks the row's key blocks once, summing every query tile's probabilities per slot in registers.

Bytes per call: read (1 + 1) * sum_r,k len[r,k] * H * itemsize (K, once per pass; the second
pass once per query tile of the row's window, from cache) + 4 * sum len (positions); write
8 * T * N (statistics) + 4 * R * K * M * page_size (scores).
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from jkv_kernels import _backend as bk
from jkv_kernels.window_scores import pool_scores


def _validate(q, k_pages, page_table, lengths, q_start, q_len, q_positions, pos_pages, pool,
              kernel_size):  # fmt: skip
    if q.ndim != 3 or k_pages.ndim != 3 or q.shape[2] != k_pages.shape[2]:
        raise ValueError(f"{q.shape=} {k_pages.shape=}: expected q [T, N, H], k [P, page, H]")
    t, n, _ = q.shape
    if page_table.ndim != 3:
        raise ValueError(f"{page_table.shape=}: expected [R, K, M]")
    r, kh, _ = page_table.shape
    if kh == 0 or n % kh:
        raise ValueError(f"{q.shape=} {page_table.shape=}: N={n} must be a multiple of K={kh}")
    if lengths.shape != (r, kh):
        raise ValueError(f"{lengths.shape=}: expected [{r}, {kh}]")
    if q_start.shape != (r,) or q_len.shape != (r,) or q_positions.shape != (t,):
        raise ValueError(
            f"{q_start.shape=} {q_len.shape=} {q_positions.shape=}: expected [{r}], [{r}], [{t}]"
        )
    if pos_pages.shape != k_pages.shape[:2]:
        raise ValueError(f"{pos_pages.shape=}: expected {k_pages.shape[:2]}")
    if pool not in ("avg", "max"):
        raise ValueError(f"{pool=}: expected 'avg' or 'max'")
    if not isinstance(kernel_size, int) or kernel_size < 1 or kernel_size % 2 == 0:
        raise ValueError(f"{kernel_size=}: expected an odd int >= 1 (same-size pooling)")


def _owner(t, q_start, q_len):
    """([T] the row of each query token, [T] whether a row owns it)."""
    tok = jnp.arange(t)[:, None]
    mine = (tok >= q_start[None, :]) & (tok < (q_start + q_len)[None, :])  # [T, R]
    return jnp.argmax(mine, axis=1), jnp.any(mine, axis=1)


@functools.partial(jax.jit, static_argnames=("pool", "kernel_size", "sm_scale", "window"))
def paged_window_scores_reference(
    q, k_pages, page_table, lengths, q_start, q_len, q_positions, pos_pages, *, k_scale=None,
    pool="avg", kernel_size=7, sm_scale=None, window=None,
):  # fmt: skip
    """Float32 reference: each row's pages gathered into a dense copy. Returns `[R, K, M * page]`
    float32."""
    _validate(q, k_pages, page_table, lengths, q_start, q_len, q_positions, pos_pages, pool,
              kernel_size)  # fmt: skip
    t, n, h = q.shape
    r, kh, m = page_table.shape
    page = k_pages.shape[1]
    s = m * page
    scale = h**-0.5 if sm_scale is None else sm_scale
    k = k_pages.astype(jnp.float32)
    if k_scale is not None:
        k = k * k_scale.astype(jnp.float32)[..., None]
    dense_k = k[page_table].reshape(r, kh, s, h)
    dense_pos = pos_pages[page_table].reshape(r, kh, s)
    lengths = jnp.clip(lengths, 0, s)
    row, owned = _owner(t, q_start, q_len)
    kk, pp = dense_k[row], dense_pos[row]  # [T, K, S, ...]
    vis = (jnp.arange(s) < lengths[row][..., None]) & (pp <= q_positions[:, None, None])
    if window is not None:
        vis &= q_positions[:, None, None] - pp < window
    vis &= owned[:, None, None]  # [T, K, S]
    qg = q.astype(jnp.float32).reshape(t, kh, n // kh, h)
    z = jnp.einsum("tkgh,tksh->tkgs", qg, jnp.where(vis[..., None], kk, 0.0),
                   precision="highest") * scale  # fmt: skip
    z = jnp.where(vis[:, :, None], z, -jnp.inf)
    top = jnp.max(z, -1, keepdims=True)
    e = jnp.where(vis[:, :, None], jnp.exp(z - jnp.where(jnp.isfinite(top), top, 0.0)), 0.0)
    lsum = jnp.sum(e, -1, keepdims=True)
    p = (e / jnp.where(lsum > 0, lsum, 1.0)).sum(axis=2)  # [T, K, S]
    score = jnp.zeros((r, kh, s), jnp.float32).at[row].add(p)
    return pool_scores(score, lengths, pool, kernel_size)


@functools.partial(
    jax.jit,
    static_argnames=("pool", "kernel_size", "sm_scale", "window", "q_tile", "pages_per_step"),
)
def paged_window_scores_xla(
    q, k_pages, page_table, lengths, q_start, q_len, q_positions, pos_pages, *, k_scale=None,
    pool="avg", kernel_size=7, sm_scale=None, window=None, q_tile: int = 64,
    pages_per_step: int = 8,
):  # fmt: skip
    """The XLA path: row by row, `q_tile` of its queries at a time, two passes over its own
    key blocks of `pages_per_step` pages (softmax statistics, then the probabilities summed
    per slot). Returns `[R, K, M * page]` float32."""
    _validate(q, k_pages, page_table, lengths, q_start, q_len, q_positions, pos_pages, pool,
              kernel_size)  # fmt: skip
    t, n, h = q.shape
    r_all, kh, m = page_table.shape
    g = n // kh
    page = k_pages.shape[1]
    bs = pages_per_step * page
    s = m * page
    n_steps = -(-m // pages_per_step)
    scale = h**-0.5 if sm_scale is None else sm_scale
    f32 = jnp.float32
    qg = jnp.pad(q.astype(f32).reshape(t, kh, g, h), ((0, q_tile), (0, 0), (0, 0), (0, 0)))
    qpos = jnp.pad(q_positions, (0, q_tile))
    lens = jnp.clip(lengths, 0, s)
    table = jnp.pad(page_table, ((0, 0), (0, 0), (0, pages_per_step)))

    def block(r, j):
        """Key block j of row r: K `[K, bs, H]` float32, positions and stored-ness `[K, bs]`."""
        pages = lax.dynamic_slice_in_dim(table[r], j * pages_per_step, pages_per_step, axis=1)
        kb = bk.bits_take(k_pages, pages).astype(f32)  # [K, pps, page, H]
        if k_scale is not None:
            kb = kb * bk.bits_take(k_scale, pages).astype(f32)[..., None]
        slots = j * bs + jnp.arange(bs)
        stored = slots[None, :] < lens[r][:, None]  # [K, bs]
        kb = jnp.where(stored[..., None], kb.reshape(kh, bs, h), 0.0)  # 0 x NaN is NaN
        return kb, pos_pages[pages].reshape(kh, bs), stored

    def logits(r, j, qt, qp, live):
        kb, pos, stored = block(r, j)
        z = jnp.einsum("qkgh,ksh->kgqs", qt, kb) * scale  # [K, G, Q, bs]
        vis = stored[:, None, :] & (pos[:, None, :] <= qp[None, :, None]) & live[None, :, None]
        if window is not None:
            vis &= qp[None, :, None] - pos[:, None, :] < window
        return jnp.where(vis[:, None], z, -jnp.inf), vis

    def row_scores(r, out):
        n_blocks = (jnp.max(lens[r]) + bs - 1) // bs

        def tile(i, acc):
            t0 = q_start[r] + i * q_tile
            live = jnp.arange(q_tile) < q_len[r] - i * q_tile
            qt = lax.dynamic_slice(qg, (t0, 0, 0, 0), (q_tile, kh, g, h))
            qp = lax.dynamic_slice(qpos, (t0,), (q_tile,))

            def stats(j, carry):
                mx, lsum = carry
                z, _ = logits(r, j, qt, qp, live)
                new = jnp.maximum(mx, z.max(-1))
                use = jnp.where(jnp.isfinite(new), new, 0.0)
                return new, lsum * jnp.exp(mx - use) + jnp.exp(z - use[..., None]).sum(-1)

            init = (jnp.full((kh, g, q_tile), -jnp.inf, f32), jnp.zeros((kh, g, q_tile), f32))
            mx, lsum = lax.fori_loop(0, n_blocks, stats, init)
            mx = jnp.where(jnp.isfinite(mx), mx, 0.0)
            inv = jnp.where(lsum > 0, 1.0 / jnp.where(lsum > 0, lsum, 1.0), 0.0)

            def probs(j, acc):
                z, vis = logits(r, j, qt, qp, live)
                p = jnp.where(vis[:, None], jnp.exp(z - mx[..., None]) * inv[..., None], 0.0)
                part = lax.dynamic_slice_in_dim(acc, j * bs, bs, axis=1) + p.sum(axis=(1, 2))
                return lax.dynamic_update_slice_in_dim(acc, part, j * bs, axis=1)

            return lax.fori_loop(0, n_blocks, probs, acc)

        acc = jnp.zeros((kh, n_steps * bs), f32)
        acc = lax.fori_loop(0, (q_len[r] + q_tile - 1) // q_tile, tile, acc)
        return out.at[r].set(acc[:, :s])

    score = lax.fori_loop(0, r_all, row_scores, jnp.zeros((r_all, kh, s), f32))
    return pool_scores(score, lens, pool, kernel_size)


def _tile_rows(q_ref, start, n_rows_q, q_tile, n_heads, kv, t0, q_len, compute_dtype):
    """The query rows of one tile: token t0 + r // G of the row, head kv * G + r % G."""
    h = q_ref.shape[2]
    r = jnp.arange(n_rows_q)
    local = t0 + r // n_heads
    row_ok = (r < q_tile * n_heads) & (local < q_len)
    tok = jnp.where(row_ok, start + local, 0)
    head = kv * n_heads + r % n_heads
    cols = jnp.arange(h)
    q = bk.load(q_ref.at[tok[:, None], head[:, None], cols[None, :]], mask=row_ok[:, None],
                other=0).astype(compute_dtype)  # fmt: skip
    return q, tok, head, row_ok


def _key_block(k_ref, ks_ref, table_ref, pos_ref, i, length, *, block_s, page_size, fp8):
    """Key block i of a (row, kv head): K `[bs, H]` float32 (0 past the length), its scales
    folded in, positions `[bs]` and stored-ness `[bs]`."""
    h = k_ref.shape[2]
    slots = i * block_s + jnp.arange(block_s)
    valid = slots < length
    offs = jnp.arange(block_s) % page_size
    page = bk.load(table_ref.at[slots // page_size], mask=valid, other=0)
    pos = bk.load(pos_ref.at[page, offs], mask=valid, other=0)
    cols = jnp.arange(h)
    kb = bk.to_f32(bk.load(k_ref.at[page[:, None], offs[:, None], cols[None, :]],
                           mask=valid[:, None], other=0), fp8)  # fmt: skip
    if fp8:
        ks = bk.load(ks_ref.at[page, offs], mask=valid, other=0).astype(jnp.float32)
        kb = kb * ks[:, None]
    return kb, pos, valid


def paged_stats_kernel(*refs, n_heads, q_tile, page_size, block_s, sm_scale, compute_dtype,
                       fp8, window):  # fmt: skip
    refs = list(refs)
    q_ref = refs.pop(0)  # [T, N, H] every query token (gathered by address)
    k_ref = refs.pop(0)  # [P, page_size, H] the key pool; uint8 bits when FP8
    table_ref = refs.pop(0)  # [M] page ids of this (row, kv head)
    len_ref = refs.pop(0)  # [] its slots
    start_ref = refs.pop(0)  # [] the row's first query token
    qlen_ref = refs.pop(0)  # [] its query tokens
    qpos_ref = refs.pop(0)  # [T] text position of every query token
    pos_ref = refs.pop(0)  # [P, page_size] text position of every stored token
    ks_ref = refs.pop(0) if fp8 else None  # [P, page_size] key scales
    _, _ = refs.pop(0), refs.pop(0)  # [T + 1, N] initial max and sum, aliased to the outputs
    m_ref = refs.pop(0)  # [T + 1, N] float32 softmax max of each query (token, head)
    l_ref = refs.pop(0)  # [T + 1, N] float32 softmax sum
    t_total = q_ref.shape[0]
    n_rows_q = bk.block_size(q_tile * n_heads, cap=max(q_tile * n_heads, bk.MIN_DOT),
                             floor=bk.MIN_DOT)  # fmt: skip
    length = len_ref[()]
    q_len = qlen_ref[()]
    t0 = pl.program_id(2) * q_tile
    q, tok, head, row_ok = _tile_rows(q_ref, start_ref[()], n_rows_q, q_tile, n_heads,
                                      pl.program_id(1), t0, q_len, compute_dtype)  # fmt: skip
    qpos = bk.load(qpos_ref.at[tok], mask=row_ok, other=0)
    n_blocks = jnp.where(t0 < q_len, (length + block_s - 1) // block_s, 0)

    def body(i, carry):
        mx, lsum = carry
        kb, pos, valid = _key_block(k_ref, ks_ref, table_ref, pos_ref, i, length,
                                    block_s=block_s, page_size=page_size, fp8=fp8)  # fmt: skip
        z = bk.dot(q, kb.astype(compute_dtype), trans_b=True) * sm_scale
        keep = valid[None, :] & (pos[None, :] <= qpos[:, None]) & row_ok[:, None]
        if window:
            keep = keep & (qpos[:, None] - pos[None, :] < window)
        z = jnp.where(keep, z, -jnp.inf)
        new = jnp.maximum(mx, z.max(axis=1))
        use = jnp.where(new == -jnp.inf, 0.0, new)
        return new, jnp.exp(mx - use) * lsum + jnp.exp(z - use[:, None]).sum(axis=1)

    init = (jnp.full((n_rows_q,), -jnp.inf, jnp.float32), jnp.zeros((n_rows_q,), jnp.float32))
    mx, lsum = jax.lax.fori_loop(0, n_blocks, body, init)
    spare = jnp.where(row_ok, tok, t_total)  # rows of no query store to the spare token T
    bk.store(m_ref.at[spare, head], mx, mask=row_ok)
    bk.store(l_ref.at[spare, head], lsum, mask=row_ok)


def paged_probs_kernel(*refs, n_heads, q_tile, page_size, block_s, sm_scale, compute_dtype,
                       fp8, window):  # fmt: skip
    refs = list(refs)
    q_ref = refs.pop(0)  # [T, N, H] every query token
    k_ref = refs.pop(0)  # [P, page_size, H] the key pool
    table_ref = refs.pop(0)  # [M] page ids of this (row, kv head)
    len_ref = refs.pop(0)  # [] its slots
    start_ref = refs.pop(0)  # [] the row's first query token
    qlen_ref = refs.pop(0)  # [] its query tokens
    qpos_ref = refs.pop(0)  # [T] query positions
    pos_ref = refs.pop(0)  # [P, page_size] stored positions
    ks_ref = refs.pop(0) if fp8 else None  # [P, page_size] key scales
    m_ref = refs.pop(0)  # [T + 1, N] softmax max of every query (token, head)
    l_ref = refs.pop(0)  # [T + 1, N] softmax sum
    o_ref = refs.pop(0)  # [S] float32 this (row, kv head)'s scores, every slot written
    s_total = o_ref.shape[0]
    n_rows_q = bk.block_size(q_tile * n_heads, cap=max(q_tile * n_heads, bk.MIN_DOT),
                             floor=bk.MIN_DOT)  # fmt: skip
    length = jnp.minimum(len_ref[()], s_total)
    q_len = qlen_ref[()]
    start = start_ref[()]
    kv = pl.program_id(1)
    n_blocks = jnp.where(q_len > 0, (length + block_s - 1) // block_s, 0)
    n_tiles = (q_len + q_tile - 1) // q_tile

    def block(i, carry):
        kb = _key_block(k_ref, ks_ref, table_ref, pos_ref, i, length, block_s=block_s,
                        page_size=page_size, fp8=fp8)  # fmt: skip
        kb, pos, valid = kb
        kb = kb.astype(compute_dtype)

        def tile(j, acc):
            q, tok, head, row_ok = _tile_rows(q_ref, start, n_rows_q, q_tile, n_heads, kv,
                                              j * q_tile, q_len, compute_dtype)  # fmt: skip
            qpos = bk.load(qpos_ref.at[tok], mask=row_ok, other=0)
            mx = bk.load(m_ref.at[tok, head], mask=row_ok, other=0.0)
            lsum = bk.load(l_ref.at[tok, head], mask=row_ok, other=0.0)
            mx = jnp.where(mx == -jnp.inf, 0.0, mx)
            inv = jnp.where(lsum > 0, 1.0 / jnp.where(lsum > 0, lsum, 1.0), 0.0)
            z = bk.dot(q, kb, trans_b=True) * sm_scale
            keep = valid[None, :] & (pos[None, :] <= qpos[:, None]) & row_ok[:, None]
            if window:
                keep = keep & (qpos[:, None] - pos[None, :] < window)
            p = jnp.where(keep, jnp.exp(z - mx[:, None]) * inv[:, None], 0.0)
            return acc + p.sum(axis=0)

        acc = jax.lax.fori_loop(0, n_tiles, tile, jnp.zeros((block_s,), jnp.float32))
        slots = i * block_s + jnp.arange(block_s)
        bk.store(o_ref.at[slots], acc, mask=slots < s_total)
        return carry

    jax.lax.fori_loop(0, n_blocks, block, 0)

    def zero(i, carry):  # the slots past the length (every element of the row is written)
        slots = i * block_s + jnp.arange(block_s)
        bk.store(o_ref.at[slots], jnp.zeros((block_s,), jnp.float32), mask=slots < s_total)
        return carry

    jax.lax.fori_loop(n_blocks, (s_total + block_s - 1) // block_s, zero, 0)


@functools.partial(
    jax.jit,
    static_argnames=("pool", "kernel_size", "sm_scale", "window", "q_tile", "pages_per_block",
                     "num_warps", "num_stages", "backend", "interpret", "_fill"),
)  # fmt: skip
def paged_window_scores(
    q, k_pages, page_table, lengths, q_start, q_len, q_positions, pos_pages, *, k_scale=None,
    pool: str = "avg", kernel_size: int = 7, sm_scale: float | None = None, window=None,
    q_tile: int = 16, pages_per_block: int | None = None, num_warps: int = 4, num_stages: int = 2,
    backend: str = "triton", interpret: bool | None = None, _fill: float = 0.0,
):  # fmt: skip
    """The Pallas kernels: statistics over the grid (R rows, K kv heads, query tiles), each
    program `q_tile` window tokens of one row times the G query heads of one kv head (rows of
    Triton's dots, padded to 16) walking the row's key blocks through the page table; then the
    probabilities over (R, K), each program walking its row's key blocks once and every query
    tile of its window per block. Returns `[R, K, M * page_size]` float32 pooled scores."""
    bk.check_backend(backend)
    interpret = bk.resolve_interpret(interpret)
    _validate(q, k_pages, page_table, lengths, q_start, q_len, q_positions, pos_pages, pool,
              kernel_size)  # fmt: skip
    t, n, h = q.shape
    p, page_size, _ = k_pages.shape
    r, kh, m = page_table.shape
    s = m * page_size
    block_s = bk.paged_blocks(q.shape, k_pages.shape, q_tile, pages_per_block)
    fp8 = k_pages.dtype == bk.FP8
    if fp8 != (k_scale is not None):
        raise ValueError("FP8 keys need their scales, other storage none")
    low = q.dtype != jnp.float32 and k_pages.dtype in (q.dtype, bk.FP8)
    compute_dtype = q.dtype if low else jnp.float32
    scale = 1.0 / math.sqrt(h) if sm_scale is None else float(sm_scale)
    lengths = jnp.clip(lengths.astype(jnp.int32), 0, s)

    def per_row(*blk, grid3=True):
        if grid3:
            return pl.BlockSpec((None, *blk), lambda i, j, _: (i,) + (0,) * len(blk))
        return pl.BlockSpec((None, *blk), lambda i, j: (i,) + (0,) * len(blk))

    def per_kv(*blk, grid3=True):
        if grid3:
            return pl.BlockSpec((None, None, *blk), lambda i, j, _: (i, j) + (0,) * len(blk))
        return pl.BlockSpec((None, None, *blk), lambda i, j: (i, j) + (0,) * len(blk))

    def whole(*shape, grid3=True):
        if grid3:
            return pl.BlockSpec(shape, lambda i, j, _: (0,) * len(shape))
        return pl.BlockSpec(shape, lambda i, j: (0,) * len(shape))

    def inputs(grid3):
        args = [q, bk.to_bits(k_pages), page_table.astype(jnp.int32), lengths,
                q_start.astype(jnp.int32), q_len.astype(jnp.int32),
                q_positions.astype(jnp.int32), pos_pages.astype(jnp.int32)]  # fmt: skip
        specs = [
            whole(t, n, h, grid3=grid3),  # q: gathered by token and head
            whole(p, page_size, h, grid3=grid3),  # k_pages: the whole pool, by page id
            per_kv(m, grid3=grid3),  # page_table: the page ids of (row i, kv head j)
            per_kv(grid3=grid3),  # lengths
            per_row(grid3=grid3),  # q_start of row i
            per_row(grid3=grid3),  # q_len of row i
            whole(t, grid3=grid3),  # q_positions
            whole(p, page_size, grid3=grid3),  # pos_pages
        ]
        if fp8:
            args.append(k_scale)
            specs.append(whole(p, page_size, grid3=grid3))
        return args, specs

    kw = dict(n_heads=n // kh, q_tile=q_tile, page_size=page_size, block_s=block_s,
              sm_scale=scale, compute_dtype=compute_dtype, fp8=fp8, window=window)  # fmt: skip
    params = bk.compiler_params(num_warps, num_stages)
    args, specs = inputs(True)
    stat = jax.ShapeDtypeStruct((t + 1, n), jnp.float32)
    n_args = len(args)
    mx, lsum = pl.pallas_call(
        functools.partial(paged_stats_kernel, **kw),
        grid=(r, kh, bk.cdiv(t, q_tile)),
        in_specs=specs + [whole(t + 1, n), whole(t + 1, n)],
        out_specs=[whole(t + 1, n), whole(t + 1, n)],  # written by address (its queries only)
        out_shape=[stat, stat],
        input_output_aliases={n_args: 0, n_args + 1: 1},
        compiler_params=params,
        interpret=interpret,
        name="jkv_paged_window_stats",
    )(*args, jnp.full((t + 1, n), _fill, jnp.float32), jnp.full((t + 1, n), _fill, jnp.float32))
    args, specs = inputs(False)
    score = pl.pallas_call(
        functools.partial(paged_probs_kernel, **kw),
        grid=(r, kh),
        in_specs=specs + [whole(t + 1, n, grid3=False), whole(t + 1, n, grid3=False)],
        out_specs=per_kv(s, grid3=False),  # each program its (row, kv head)'s every slot
        out_shape=jax.ShapeDtypeStruct((r, kh, s), jnp.float32),
        compiler_params=params,
        interpret=interpret,
        name="jkv_paged_window_probs",
    )(*args, mx, lsum)
    return pool_scores(score, lengths, pool, kernel_size)
