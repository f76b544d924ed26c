"""The engine's ragged paged attention on the "xla" backend: the layout and maths of
`jkv_kernels.ragged_paged_attention` (its module docstring), as loops whose trip counts are the
rows, their query tiles and their own key blocks (data, not shapes), so a compiled shape depends
on T, R and the pool only and the cost grows with the tokens each row holds. Decode rows run in
tiles of `row_tile` rows; a low-rank page is attended factored, never expanded. Checked against
`ragged_paged_attention_reference` in tests/pallas_kernels/test_ragged_paged_attention.py.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax

from jkv_kernels import _backend as bk
from jkv_kernels.ragged_paged_attention import (
    MASKED,
    rotated_keys,
    split_positions,
    validate_args,
    visible_slots,
)


@functools.partial(
    jax.jit,
    static_argnames=(
        "sliding_window", "sm_scale", "weights", "lowrank_rank", "q_tile", "row_tile",
        "pages_per_step",
    ),
)  # fmt: skip
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
    rope=None,
    weights: bool = False,
    lowrank=None,
    lowrank_rank: int = 0,
    q_tile: int = 64,
    row_tile: int = 8,
    pages_per_step: int = 8,
):
    """The XLA path. Rows [0, num_decode) hold one query each and are taken `row_tile` at a
    time (rows of similar lengths together waste least: the blocks every row of a tile has run
    vectorised, the rest row by row); rows [num_decode,
    num_rows) hold chunks, taken `q_tile` queries at a time. Every tile reads only its own key
    blocks of `pages_per_step` pages (loops with data trip counts). Returns `[T, N, H]` in q's
    dtype (zeros for tokens no row owns). A row's low-rank pages (`lowrank`) run after its
    other blocks, one page at a time, in the same flash carry."""
    validate_args(q, k_pages, v_pages, page_table, lengths, gaps, q_start, q_len, q_positions)
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
    rope_p = None if rope is None else tuple(jnp.pad(x, (0, row_tile)) for x in rope[:3])

    def block(rows, j):
        """Key block j of `rows` `[W]`: K, V `[W, K, S, H]` float32, positions `[W, K, S]`, and
        which slots hold a token `[W, K, S]`."""
        cols = j * pages_per_step + jnp.arange(pages_per_step)
        pages = jnp.take(table[rows], jnp.minimum(cols, m - 1), axis=2)  # [W, K, pps]
        kb = bk.bits_take(k_pages, pages).astype(f32)  # [W, K, pps, page, H]
        vb = bk.bits_take(v_pages, pages).astype(f32)
        if k_scale is not None:
            kb = kb * bk.bits_take(k_scale, pages).astype(f32)[..., None]
            vb = vb * bk.bits_take(v_scale, pages).astype(f32)[..., None]
        w = rows.shape[0]
        pos = pos_pages[pages].reshape(w, kh, bs)
        log_w = None
        if weights:
            pos, log_w = split_positions(pos)
        slots = j * bs + jnp.arange(bs)
        stored = visible_slots(
            slots, lens[rows], None if gaps_p is None else gaps_p[rows], 0, 0, None
        )
        stored &= jnp.repeat(cols < m, page)
        if rope is not None:  # a ring's sinks, turned to their rank (`sink_turn`)
            raw, sink, shift = (x[rows] for x in rope_p)
            turns = raw & (shift > 0)  # a ring past its first eviction
            sinks = stored & turns[:, None, None] & (pos < sink[:, None, None])  # [W, K, S]

            def turn(kb):
                turned = rotated_keys(kb, pos, sink[:, None, None], shift[:, None, None], rope[3])
                return jnp.where(sinks[..., None], turned, kb)

            # only a block holding a ring's sinks (its first) is turned: the window reads as is
            kb = lax.cond(jnp.any(sinks), turn, lambda kb: kb, kb.reshape(w, kh, bs, h))
        vb = jnp.where(stored[..., None], vb.reshape(w, kh, bs, h), 0.0)  # 0 x NaN is NaN
        return kb.reshape(w, kh, bs, h), vb, pos, stored, log_w

    def start(w, width):
        return (
            jnp.full((w, kh, g, width), MASKED, f32),
            jnp.zeros((w, kh, g, width), f32),
            jnp.zeros((w, kh, g, width, h), f32),
        )

    def blocks(rows, qt, qp, valid_q, lo, hi, carry):
        """Flash steps over key blocks lo..hi of `rows` `[W]` for queries `qt`
        `[W, Q, K, G, H]` at `qp` `[W, Q]`: the carry (max, sum, output) goes on."""

        def step(j, carry):
            kb, vb, pos, stored, log_w = block(rows, j)
            vis = stored[:, :, None, :] & (pos[:, :, None, :] <= qp[:, None, :, None])
            if sliding_window is not None:
                vis &= qp[:, None, :, None] - pos[:, :, None, :] < sliding_window
            vis &= valid_q[:, None, :, None]  # [W, K, Q, S]
            return flash(carry, qt, kb, vb, vis, log_w)

        return lax.fori_loop(lo, hi, step, carry)

    def flash(carry, qt, kb, vb, vis, log_w=None):
        """One flash step of queries `qt` `[W, Q, K, G, H]` over keys and values `[W, K, S, H]`
        where `vis` `[W, K, Q, S]` (logits + `log_w` `[W, K, S]`, a slot's log weight)."""
        z = jnp.einsum("wqkgh,wksh->wkgqs", qt, kb) * scale
        if log_w is not None:
            z = z + log_w[:, :, None, None, :]
        return softmax_step(carry, z, vis, lambda p: jnp.einsum("wkgqs,wksh->wkgqh", p, vb))

    def softmax_step(carry, z, vis, weighted):
        """The online softmax's step for logits `z` `[W, K, G, Q, S]` where `vis`; `weighted(p)`:
        the values summed by the probabilities `p`, `[W, K, G, Q, H]`."""
        m_, l_, acc = carry
        z = jnp.where(vis[:, :, None], z, MASKED)
        m_new = jnp.maximum(m_, jnp.max(z, axis=-1))
        p = jnp.where(vis[:, :, None], jnp.exp(z - m_new[..., None]), 0.0)
        alpha = jnp.exp(m_ - m_new)
        l_ = l_ * alpha + jnp.sum(p, axis=-1)
        return m_new, l_, acc * alpha[..., None] + weighted(p)

    def low_pages(rows, qt, valid_q, carry):
        """Flash steps over the low-rank pages of `rows` `[W]` (their queries `qt` `[W, Q, K,
        G, H]`, `valid_q` `[W, Q]`), a page of every row at a time, as many as the row with
        most has (none: no trip); they precede every query."""
        if lowrank is None:
            return carry
        r0 = jnp.minimum(rows, r_all - 1)
        lo = lowrank[0][r0]
        count = jnp.where(rows < r_all, lowrank[1][r0], 0)  # [W]

        def one(i, carry):
            col = jnp.clip(lo + i, 0, m - 1)  # [W]
            pages = table[r0[:, None], jnp.arange(kh)[None, :], col[:, None]]  # [W, K]
            kp = bk.bits_take(k_pages, pages).astype(f32)
            vp = bk.bits_take(v_pages, pages).astype(f32)
            if k_scale is not None:
                kp = kp * bk.bits_take(k_scale, pages).astype(f32)[..., None]
                vp = vp * bk.bits_take(v_scale, pages).astype(f32)[..., None]
            # factored, never expanded: q . k_t = (q B^T) . C^T[:, t]; sum_t p_t v_t =
            # (sum_t p_t C_v^T[:, t]) B_v (rank x fewer multiplies than the page's tokens)
            rank = lowrank_rank
            chunks = page // rank - 1
            split = lambda x: (
                x[..., :rank, :],
                x[..., rank : rank * (chunks + 1), :].reshape(*x.shape[:2], chunks, rank, h),
            )  # noqa: E731
            (basis_k, coef_k), (basis_v, coef_v) = split(kp), split(vp)
            held = jnp.where(i < count[:, None], pos_pages[pages, 0], 0)  # [W, K]
            stored = jnp.arange(chunks * h).reshape(chunks, h) < held[..., None, None]
            coef_v = jnp.where(stored[:, :, :, None, :], coef_v, 0.0)  # 0 x NaN is NaN
            basis_v = jnp.where(held[..., None, None] > 0, basis_v, 0.0)  # a page not read
            qb = jnp.einsum("wqkgh,wkrh->wkgqr", qt, basis_k)
            z = jnp.einsum("wkgqr,wkcrt->wkgqct", qb, coef_k).reshape(*qb.shape[:4], -1) * scale
            vis = stored.reshape(*stored.shape[:2], -1)[:, :, None, :] & valid_q[:, None, :, None]

            def weighted(p):
                pc = jnp.einsum("wkgqct,wkcrt->wkgqr", p.reshape(*p.shape[:4], chunks, h), coef_v)
                return jnp.einsum("wkgqr,wkrh->wkgqh", pc, basis_v)

            return softmax_step(carry, z, vis, weighted)

        return lax.fori_loop(0, jnp.max(count), one, carry)

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

        carry = low_pages(rows, qt, real[:, None], lax.fori_loop(0, row_tile, alone, carry))
        res = finish(carry)[:, 0]
        # one query per row: scattered to their tokens (padding rows to a dropped index)
        return out.at[jnp.where(real, starts, t + pad)].set(res, mode="drop")

    def chunk_row(r, out):
        def tile(i, out):
            t0 = q_start[r] + i * q_tile
            valid = jnp.arange(q_tile) < q_len[r] - i * q_tile
            qt = lax.dynamic_slice(qg, (t0, 0, 0, 0), (q_tile, kh, g, h))[None]
            qp = lax.dynamic_slice(qpos, (t0,), (q_tile,))[None]
            n_blocks = (jnp.max(lens[r]) + bs - 1) // bs
            row = jnp.full((1,), r)
            carry = blocks(row, qt, qp, valid[None], 0, n_blocks, start(1, q_tile))
            carry = low_pages(row, qt, valid[None], carry)
            return merge(out, t0, finish(carry)[0], valid)

        return lax.fori_loop(0, (q_len[r] + q_tile - 1) // q_tile, tile, out)

    out = lax.fori_loop(0, (num_decode + row_tile - 1) // row_tile, decode_tile, out)
    out = lax.fori_loop(num_decode, num_rows, chunk_row, out)
    return out[:t].reshape(t, n, h).astype(q.dtype)
