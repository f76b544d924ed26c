"""Attention of a ragged batch of query tokens over a paged, optionally FP8, GQA KV pool.

Layout (the serving engine's pool: a page holds ONE kv head's `page_size` tokens):

    q                  [T, N, H]          the step's query tokens, every row's one after another
    k_pages, v_pages   [P, page_size, H]  one pool for all layers, kv heads and requests
    k/v_scale          [P, page_size]     FP8 scales (bfloat16)
    pos_pages          [P, page_size]     text position of every stored token
    page_table         [R, K, M]          page ids of (row r, kv head k) for this layer's call
    lengths            [R, K]             slots below the length may be valid ...
    gaps               [R, K, 2]          ... except those in [gap[0], gap[1]) (a compressed
                                          head's prefix ends inside its last prefix page, its
                                          tail starts on the next block)
    q_start, q_len     [R]                row r's queries are q[q_start : q_start + q_len]
                                          (vLLM's cu_q_lens, as start and length)
    q_positions        [T]                text position of every query token

Slot i of (r, k) lives at page `page_table[r, k, i // page_size]`, offset `i % page_size`. The
step's new tokens are in the pool already (the caller writes them first), so a chunk of queries
sees itself causally, by positions. Maths, for query t of row r, query head n = k*G + g:

    visible(i) = i < len[r,k] and not gap[r,k,0] <= i < gap[r,k,1]
                 and pos[i] <= q_pos[t] (and q_pos[t] - pos[i] < window with a sliding window)
    z[i]   = sm_scale * q[t,n] . (K[page, off] * k_scale[page, off])
    out[t,n] = sum_i softmax_visible(z)[i] * V[page, off] * v_scale[page, off]
    (zeros where nothing is visible)

Two implementations beside the float32 reference: `ragged_paged_attention_xla`, the engine's
path on the "xla" backend: loops whose trip counts are the rows, their query tiles and their own
key blocks (data, not shapes), so its cost grows with the tokens each row holds, never with
rows x the longest row, and its compiled shape depends on T and R only; and (on the Pallas
backends) the engine calls `paged_decode_attention` for rows of one query.

Bytes per call (memory bound, itemsize 4 / 2 / 1): read 2 * sum_r,k len[r,k] * H * itemsize
(K, V of every row's visible blocks) + 4 * sum len (positions; + 4 for FP8 scales) once per
query tile of the row, + T*N*H*itemsize (q); write T*N*H*itemsize.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax

_MASKED = -1e30


def _validate(q, k_pages, v_pages, page_table, lengths, gaps, q_start, q_len, q_positions):
    if q.ndim != 3 or k_pages.ndim != 3 or k_pages.shape != v_pages.shape:
        raise ValueError(
            f"{q.shape=} {k_pages.shape=} {v_pages.shape=}: expected q [T, N, H] and k_pages, "
            "v_pages [P, page_size, H]"
        )
    t, n, h = q.shape
    if k_pages.shape[2] != h:
        raise ValueError(f"{q.shape=} {k_pages.shape=}: head dims differ")
    if page_table.ndim != 3:
        raise ValueError(f"{page_table.shape=}: expected [R, K, M]")
    r, kh, _ = page_table.shape
    if kh == 0 or n % kh:
        raise ValueError(f"{q.shape=} {page_table.shape=}: N={n} must be a multiple of K={kh}")
    if lengths.shape != (r, kh) or (gaps is not None and gaps.shape != (r, kh, 2)):
        raise ValueError(
            f"{lengths.shape=} gaps={None if gaps is None else gaps.shape}: expected [{r}, {kh}] "
            f"and [{r}, {kh}, 2]"
        )
    if q_start.shape != (r,) or q_len.shape != (r,) or q_positions.shape != (t,):
        raise ValueError(
            f"{q_start.shape=} {q_len.shape=} {q_positions.shape=}: expected [{r}], [{r}], [{t}]"
        )


def _visible(slots, lengths, gaps, pos, qpos, window):
    """[..., S] bool from slots [S], lengths/gap bounds [...] and positions."""
    ok = slots < lengths[..., None]
    if gaps is not None:
        ok &= (slots < gaps[..., 0:1]) | (slots >= gaps[..., 1:2])
    ok &= pos <= qpos
    if window is not None:
        ok &= qpos - pos < window
    return ok


@functools.partial(jax.jit, static_argnames=("sliding_window", "sm_scale"))
def ragged_paged_attention_reference(
    q,
    k_pages,
    v_pages,
    page_table,
    lengths,
    q_start,
    q_len,
    q_positions,
    pos_pages,
    *,
    gaps=None,
    k_scale=None,
    v_scale=None,
    sliding_window=None,
    sm_scale=None,
):
    """Float32 reference: each row's pages gathered into a dense copy, every query against it.
    Returns `[T, N, H]` float32 (zeros for tokens no row owns)."""
    _validate(q, k_pages, v_pages, page_table, lengths, gaps, q_start, q_len, q_positions)
    t, n, h = q.shape
    r, kh, m = page_table.shape
    page = k_pages.shape[1]
    scale = h**-0.5 if sm_scale is None else sm_scale
    k = k_pages.astype(jnp.float32)
    v = v_pages.astype(jnp.float32)
    if k_scale is not None:
        k = k * k_scale.astype(jnp.float32)[..., None]
        v = v * v_scale.astype(jnp.float32)[..., None]
    dense_k = k[page_table].reshape(r, kh, m * page, h)  # [R, K, S, H]
    dense_v = v[page_table].reshape(r, kh, m * page, h)
    dense_pos = pos_pages[page_table].reshape(r, kh, m * page)
    # each token's row (-1: none)
    tok = jnp.arange(t)
    owner = jnp.sum(
        jnp.arange(r)[None, :]
        * ((tok[:, None] >= q_start[None, :]) & (tok[:, None] < (q_start + q_len)[None, :])),
        axis=1,
    )
    owned = jnp.any((tok[:, None] >= q_start) & (tok[:, None] < q_start + q_len), axis=1)
    kk, vv, pp = dense_k[owner], dense_v[owner], dense_pos[owner]  # [T, K, S, ...]
    slots = jnp.arange(m * page)
    stored = _visible(slots, lengths[owner], None if gaps is None else gaps[owner], 0, 0, None)
    # a zero probability times NaN is NaN: slots that hold nothing are zeroed, not only masked
    vv = jnp.where(stored[..., None], vv, 0.0)
    vis = _visible(
        slots,
        lengths[owner],
        None if gaps is None else gaps[owner],
        pp,
        q_positions[:, None, None],
        sliding_window,
    )  # [T, K, S]
    qg = q.astype(jnp.float32).reshape(t, kh, n // kh, h)
    z = jnp.einsum("tkgh,tksh->tkgs", qg, kk, precision="highest") * scale
    z = jnp.where(vis[:, :, None], z, _MASKED)
    p = jnp.where(vis[:, :, None], jnp.exp(z - jnp.max(z, -1, keepdims=True)), 0.0)
    denom = jnp.sum(p, -1, keepdims=True)
    p = jnp.where(denom > 0, p / jnp.where(denom > 0, denom, 1.0), 0.0)
    out = jnp.einsum("tkgs,tksh->tkgh", p, vv, precision="highest").reshape(t, n, h)
    return jnp.where(owned[:, None, None], out, 0.0)


@functools.partial(
    jax.jit, static_argnames=("sliding_window", "sm_scale", "q_tile", "row_tile", "pages_per_step")
)
def ragged_paged_attention_xla(
    q,
    k_pages,
    v_pages,
    page_table,
    lengths,
    q_start,
    q_len,
    q_positions,
    pos_pages,
    num_decode,
    num_rows,
    *,
    gaps=None,
    k_scale=None,
    v_scale=None,
    sliding_window=None,
    sm_scale=None,
    q_tile: int = 64,
    row_tile: int = 8,
    pages_per_step: int = 8,
):
    """The XLA path. Rows [0, num_decode) hold one query each and are taken `row_tile` at a
    time (rows of similar lengths together waste least: the blocks every row of a tile has run
    vectorised, the rest row by row); rows [num_decode,
    num_rows) hold chunks, taken `q_tile` queries at a time. Every tile reads only its own key
    blocks of `pages_per_step` pages (loops with data trip counts). Returns `[T, N, H]` in q's
    dtype (zeros for tokens no row owns)."""
    _validate(q, k_pages, v_pages, page_table, lengths, gaps, q_start, q_len, q_positions)
    t, n, h = q.shape
    r_all, kh, m = page_table.shape
    g = n // kh
    page = k_pages.shape[1]
    bs = pages_per_step * page
    scale = h**-0.5 if sm_scale is None else sm_scale
    f32 = jnp.float32
    pad = max(q_tile, row_tile)
    qg = jnp.pad(q.astype(f32).reshape(t, kh, g, h), ((0, pad), (0, 0), (0, 0), (0, 0)))
    qpos = jnp.pad(q_positions, (0, pad))
    out = jnp.zeros((t + pad, kh, g, h), f32)
    # rows padded so that a tile never reads past the table; padding rows hold nothing
    table = jnp.pad(page_table, ((0, row_tile), (0, 0), (0, 0)))
    lens = jnp.pad(lengths, ((0, row_tile), (0, 0)))
    gaps_p = None if gaps is None else jnp.pad(gaps, ((0, row_tile), (0, 0), (0, 0)))

    def block(rows, j):
        """Key block j of `rows` `[W]`: K, V `[W, K, S, H]` float32, positions `[W, K, S]`, and
        which slots hold a token `[W, K, S]`."""
        cols = j * pages_per_step + jnp.arange(pages_per_step)
        pages = jnp.take(table[rows], jnp.minimum(cols, m - 1), axis=2)  # [W, K, pps]
        kb = k_pages[pages].astype(f32)  # [W, K, pps, page, H]
        vb = v_pages[pages].astype(f32)
        if k_scale is not None:
            kb = kb * k_scale[pages].astype(f32)[..., None]
            vb = vb * v_scale[pages].astype(f32)[..., None]
        w = rows.shape[0]
        pos = pos_pages[pages].reshape(w, kh, bs)
        slots = j * bs + jnp.arange(bs)
        stored = _visible(slots, lens[rows], None if gaps_p is None else gaps_p[rows], 0, 0, None)
        stored &= jnp.repeat(cols < m, page)
        vb = jnp.where(stored[..., None], vb.reshape(w, kh, bs, h), 0.0)  # 0 x NaN is NaN
        return kb.reshape(w, kh, bs, h), vb, pos, stored

    def start(w, width):
        return (
            jnp.full((w, kh, g, width), _MASKED, f32),
            jnp.zeros((w, kh, g, width), f32),
            jnp.zeros((w, kh, g, width, h), f32),
        )

    def blocks(rows, qt, qp, valid_q, lo, hi, carry):
        """Flash steps over key blocks lo..hi of `rows` `[W]` for queries `qt`
        `[W, Q, K, G, H]` at `qp` `[W, Q]`: the carry (max, sum, output) goes on."""

        def step(j, carry):
            kb, vb, pos, stored = block(rows, j)
            vis = stored[:, :, None, :] & (pos[:, :, None, :] <= qp[:, None, :, None])
            if sliding_window is not None:
                vis &= qp[:, None, :, None] - pos[:, :, None, :] < sliding_window
            vis &= valid_q[:, None, :, None]  # [W, K, Q, S]
            z = jnp.einsum("wqkgh,wksh->wkgqs", qt, kb) * scale
            m_, l_, acc = carry
            z = jnp.where(vis[:, :, None], z, _MASKED)
            m_new = jnp.maximum(m_, jnp.max(z, axis=-1))
            p = jnp.where(vis[:, :, None], jnp.exp(z - m_new[..., None]), 0.0)
            alpha = jnp.exp(m_ - m_new)
            l_ = l_ * alpha + jnp.sum(p, axis=-1)
            acc = acc * alpha[..., None] + jnp.einsum("wkgqs,wksh->wkgqh", p, vb)
            return m_new, l_, acc

        return lax.fori_loop(lo, hi, step, carry)

    def finish(carry):
        """`[W, Q, K, G, H]` outputs of a finished carry (zeros where nothing was visible)."""
        _, l_, acc = carry
        res = jnp.where(l_[..., None] > 0, acc / jnp.where(l_ > 0, l_, 1.0)[..., None], 0.0)
        return jnp.transpose(res, (0, 3, 1, 2, 4))

    def merge(out, t0, res, valid):
        """Writes `res` `[Q, K, G, H]` at queries t0.. where `valid` `[Q]`, leaving the rest."""
        old = lax.dynamic_slice(out, (t0, 0, 0, 0), res.shape)
        new = jnp.where(valid[:, None, None, None], res, old)
        return lax.dynamic_update_slice(out, new, (t0, 0, 0, 0))

    def decode_tile(i, out):
        """`row_tile` decode rows: the key blocks all of them have, vectorised; each row's
        further blocks alone (so one long row costs its own blocks, not the tile's)."""
        rows = i * row_tile + jnp.arange(row_tile)
        real = rows < num_decode
        starts = jnp.where(real, q_start[jnp.minimum(rows, r_all - 1)], t + pad - 1)
        qt = qg[starts][:, None]  # [W, 1, K, G, H]
        qp = qpos[starts][:, None]
        n_blocks = jnp.where(real, (jnp.max(lens[rows], axis=1) + bs - 1) // bs, 0)  # [W]
        common = jnp.min(jnp.where(real, n_blocks, jnp.iinfo(jnp.int32).max))
        carry = blocks(rows, qt, qp, real[:, None], 0, common, start(row_tile, 1))

        def alone(w, carry):
            one = jax.tree.map(lambda x: lax.dynamic_slice_in_dim(x, w, 1), carry)
            one = blocks(rows[w][None], qt[w][None], qp[w][None], real[w][None, None], common,
                         n_blocks[w], one)  # fmt: skip
            return jax.tree.map(
                lambda x, y: lax.dynamic_update_slice_in_dim(x, y, w, 0), carry, one
            )

        res = finish(lax.fori_loop(0, row_tile, alone, carry))[:, 0]
        # one query per row: scattered to their tokens (padding rows to a dropped index)
        return out.at[jnp.where(real, starts, t + pad)].set(res, mode="drop")

    def chunk_row(r, out):
        def tile(i, out):
            t0 = q_start[r] + i * q_tile
            valid = jnp.arange(q_tile) < q_len[r] - i * q_tile
            qt = lax.dynamic_slice(qg, (t0, 0, 0, 0), (q_tile, kh, g, h))[None]
            qp = lax.dynamic_slice(qpos, (t0,), (q_tile,))[None]
            n_blocks = (jnp.max(lens[r]) + bs - 1) // bs
            carry = blocks(jnp.full((1,), r), qt, qp, valid[None], 0, n_blocks, start(1, q_tile))
            return merge(out, t0, finish(carry)[0], valid)

        return lax.fori_loop(0, (q_len[r] + q_tile - 1) // q_tile, tile, out)

    out = lax.fori_loop(0, (num_decode + row_tile - 1) // row_tile, decode_tile, out)
    out = lax.fori_loop(num_decode, num_rows, chunk_row, out)
    return out[:t].reshape(t, n, h).astype(q.dtype)
