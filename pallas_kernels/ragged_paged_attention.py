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
    rope (optional)    (raw [R] bool, sink [R], shift [R] int32, inv_freq [H/2] float32): row
                       r is a StreamingLLM ring when raw[r]: its keys, stored rotated at their
                       text positions like every row's, rank as contiguous text after its
                       sinks, so a key at pos < sink[r] is turned on read by shift[r] more
                       (RoPE's angles add: the query at text position p sees it at distance
                       p - shift - pos, its rank's); the window's keys are read as stored

Slot i of (r, k) lives at page `page_table[r, k, i // page_size]`, offset `i % page_size`. The
step's new tokens are in the pool already (the caller writes them first), so a chunk of queries
sees itself causally, by positions. Maths, for query t of row r, query head n = k*G + g:

    visible(i) = i < len[r,k] and not gap[r,k,0] <= i < gap[r,k,1]
                 and pos[i] <= q_pos[t] (and q_pos[t] - pos[i] < window with a sliding window)
    z[i]   = sm_scale * q[t,n] . (K[page, off] * k_scale[page, off])
    out[t,n] = sum_i softmax_visible(z)[i] * V[page, off] * v_scale[page, off]
    (zeros where nothing is visible)

A low-rank page's tokens join the same softmax (`lowrank_tokens`): the factors are expanded one
page at a time, never a row's whole middle.

Two implementations beside the float32 reference, both with a cost that grows with the tokens
each row holds, never with rows x the longest row, and a compiled shape that depends on T, R and
the pool only: `ragged_paged_attention_xla` (in `ragged_paged_attention_xla.py`), the engine's
path on the "xla" backend (loops whose trip counts are the rows, their query tiles and their own
key blocks: data, not shapes); and `ragged_paged_attention`, here, the Pallas Triton kernel of
the "pallas" backends (one program per row, kv head and query tile, each walking its own row's
key blocks through the page table).

Bytes per call (memory bound, itemsize 4 / 2 / 1): read 2 * sum_r,k len[r,k] * H * itemsize
(K, V of every row's visible blocks) + 4 * sum len (positions; + 4 for FP8 scales) once per
query tile of the row, + T*N*H*itemsize (q); write T*N*H*itemsize.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from jkv_kernels import _backend as bk

MASKED = -1e30
WEIGHT_SHIFT = 24  # positions below 2**24 tokens; a slot's weight - 1 in the bits above


def weighted_positions(positions, weights):
    """int32 positions that also carry each slot's weight (an int >= 1, at most 128)."""
    return positions + ((weights.astype(jnp.int32) - 1) << WEIGHT_SHIFT)


def split_positions(stored):
    """(positions, log weights float32) of `weighted_positions`' encoding; an empty slot's -1
    stays -1 with weight 1."""
    live = stored >= 0
    pos = jnp.where(live, stored & ((1 << WEIGHT_SHIFT) - 1), stored)
    weight = jnp.where(live, (stored >> WEIGHT_SHIFT) + 1, 1)
    return pos, jnp.log(weight.astype(jnp.float32))


def lowrank_tokens(k_page, v_page, rank: int):
    """Keys and values `[..., C * H, H]` float32 of low-rank pages `[..., page_size, H]`
    (dequantised): the basis in rows 0 .. rank, then C = page_size // rank - 1 blocks of
    coefficients C^T, H tokens each."""
    *lead, page, h = k_page.shape
    chunks = page // rank - 1

    def expand(x):
        basis = x[..., :rank, :]
        coef = x[..., rank : rank * (chunks + 1), :].reshape(*lead, chunks, rank, h)
        return jnp.einsum("...cjt,...jh->...cth", coef, basis, precision="highest").reshape(
            *lead, chunks * h, h
        )

    return expand(k_page.astype(jnp.float32)), expand(v_page.astype(jnp.float32))


def validate_args(q, k_pages, v_pages, page_table, lengths, gaps, q_start, q_len, q_positions):
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


def visible_slots(slots, lengths, gaps, pos, qpos, window):
    """[..., S] bool from slots [S], lengths/gap bounds [...] and positions."""
    ok = slots < lengths[..., None]
    if gaps is not None:
        ok &= (slots < gaps[..., 0:1]) | (slots >= gaps[..., 1:2])
    ok &= pos <= qpos
    if window is not None:
        ok &= qpos - pos < window
    return ok


def sink_turn(pos, sink, shift):
    """The extra RoPE angle step of a ring's stored key at `pos` (`shift` below `sink`, else 0):
    the sinks rank at their positions, the window at pos - `shift`, the query at its own."""
    return jnp.where(pos < sink, shift, 0)


def rotated_keys(x, pos, sink, shift, inv_freq):
    """x `[..., H]` float32 (keys rotated at their positions) turned by RoPE as a ring reads
    them (`sink_turn`; all broadcast to x's shape without H)."""
    rank = sink_turn(pos, sink, shift).astype(jnp.float32)
    angles = rank[..., None] * inv_freq.astype(jnp.float32)
    angles = jnp.concatenate([angles, angles], axis=-1)
    half = x.shape[-1] // 2
    swapped = jnp.concatenate([-x[..., half:], x[..., :half]], axis=-1)
    return x * jnp.cos(angles) + swapped * jnp.sin(angles)


@functools.partial(
    jax.jit, static_argnames=("sliding_window", "sm_scale", "weights", "lowrank_rank")
)
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
    rope=None,
    weights: bool = False,
    lowrank=None,
    lowrank_rank: int = 0,
):
    """Float32 reference: each row's pages gathered into a dense copy, every query against it.
    Returns `[T, N, H]` float32 (zeros for tokens no row owns)."""
    validate_args(q, k_pages, v_pages, page_table, lengths, gaps, q_start, q_len, q_positions)
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
    log_w = jnp.zeros(dense_pos.shape, jnp.float32)
    if weights:
        dense_pos, log_w = split_positions(dense_pos)
    if rope is not None:
        raw, sink, shift, inv_freq = rope
        turned = rotated_keys(
            dense_k, dense_pos, sink[:, None, None], shift[:, None, None], inv_freq
        )
        dense_k = jnp.where(raw[:, None, None, None], turned, dense_k)
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
    stored = visible_slots(slots, lengths[owner], None if gaps is None else gaps[owner], 0, 0, None)
    # a zero probability times NaN is NaN: slots that hold nothing are zeroed, not only masked
    vv = jnp.where(stored[..., None], vv, 0.0)
    vis = visible_slots(
        slots,
        lengths[owner],
        None if gaps is None else gaps[owner],
        pp,
        q_positions[:, None, None],
        sliding_window,
    )  # [T, K, S]
    bias = log_w[owner]
    if lowrank is not None:  # each row's low-rank pages, expanded, join its slots
        start, count = lowrank
        cols = jnp.arange(m)
        live = cols[None] < count[:, None]  # [R, M]
        pages = jnp.take_along_axis(
            page_table, jnp.clip(start[:, None, None] + cols, 0, m - 1), axis=2
        )  # [R, K, M]
        lk, lv = lowrank_tokens(k[pages], v[pages], lowrank_rank)  # [R, K, M, C*H, H]
        held = pos_pages[pages][..., 0]  # [R, K, M]
        per = lk.shape[3]
        ok = live[:, None, :, None] & (jnp.arange(per) < held[..., None])
        ok = ok.reshape(r, kh, m * per)[owner]
        kk = jnp.concatenate([kk, lk.reshape(r, kh, m * per, h)[owner]], axis=2)
        vv = jnp.concatenate(
            [vv, jnp.where(ok[..., None], lv.reshape(r, kh, m * per, h)[owner], 0.0)], axis=2
        )
        vis = jnp.concatenate([vis, ok], axis=2)
        bias = jnp.concatenate([bias, jnp.zeros(ok.shape, jnp.float32)], axis=2)
    qg = q.astype(jnp.float32).reshape(t, kh, n // kh, h)
    z = jnp.einsum("tkgh,tksh->tkgs", qg, kk, precision="highest") * scale
    z = jnp.where(vis[:, :, None], z + bias[:, :, None], MASKED)
    p = jnp.where(vis[:, :, None], jnp.exp(z - jnp.max(z, -1, keepdims=True)), 0.0)
    denom = jnp.sum(p, -1, keepdims=True)
    p = jnp.where(denom > 0, p / jnp.where(denom > 0, denom, 1.0), 0.0)
    out = jnp.einsum("tkgs,tksh->tkgh", p, vv, precision="highest").reshape(t, n, h)
    return jnp.where(owned[:, None, None], out, 0.0)


def ragged_paged_attention_kernel(
    *refs,
    n_heads: int,
    q_tile: int,
    page_size: int,
    block_s: int,
    sm_scale: float,
    compute_dtype,
    fp8: bool,
    gaps: bool,
    window: int | None,
    rope: bool = False,
    weights: bool = False,
    lowrank_rank: int = 0,
):
    refs = list(refs)
    q_ref = refs.pop(0)  # [T, N, H] every query token (gathered by address)
    k_ref = refs.pop(0)  # [P, page_size, H] the whole key pool; uint8 bits when FP8
    v_ref = refs.pop(0)  # [P, page_size, H] the whole value pool, same storage
    table_ref = refs.pop(0)  # [M] page ids of this (row, kv head)
    len_ref = refs.pop(0)  # [] slots of this (row, kv head) that may be valid
    start_ref = refs.pop(0)  # [] this row's first query token
    qlen_ref = refs.pop(0)  # [] its query tokens
    qpos_ref = refs.pop(0)  # [T] text position of every query token
    pos_ref = refs.pop(0)  # [P, page_size] text position of every stored token
    gap_ref = refs.pop(0) if gaps else None  # [2] slots [gap[0], gap[1]) hold nothing
    ks_ref = refs.pop(0) if fp8 else None  # [P, page_size] key scales
    vs_ref = refs.pop(0) if fp8 else None  # [P, page_size] value scales
    # a StreamingLLM ring's: whether this row is one, its sinks and shift (its sinks' keys
    # turned on read, `sink_turn`), and the inverse frequencies repeated over both halves [H]
    raw_ref, sink_ref, shift_ref, freq_ref = (refs.pop(0) for _ in range(4)) if rope else [None] * 4
    # the row's low-rank pages: table columns lr_start .. lr_start + lr_count
    lr_start_ref, lr_count_ref = (refs.pop(0) for _ in range(2)) if lowrank_rank else (None, None)
    _ = refs.pop(0)  # [T + 1, N, H] float32 zeros, aliased to the output
    o_ref = refs.pop(0)  # [T + 1, N, H] float32 output, written by address (its rows only)

    t_total = q_ref.shape[0]
    h = q_ref.shape[2]
    rows_p = bk.block_size(q_tile * n_heads, cap=max(q_tile * n_heads, bk.MIN_DOT),
                           floor=bk.MIN_DOT)  # fmt: skip
    kv = pl.program_id(1)
    t0 = pl.program_id(2) * q_tile
    q_len = qlen_ref[()]
    length = len_ref[()]
    # query row r of this program: token t0 + r // G of the row, query head kv * G + r % G
    r = jnp.arange(rows_p)
    local = t0 + r // n_heads
    row_ok = (r < q_tile * n_heads) & (local < q_len)
    tok = jnp.where(row_ok, start_ref[()] + local, 0)
    # rows of no query store to the spare token T: a masked store that shares its address with
    # a live one may write the old value over it (the interpreter's gather-then-scatter)
    spare = jnp.where(row_ok, tok, t_total)
    head = kv * n_heads + r % n_heads
    cols = jnp.arange(h)
    q = bk.load(q_ref.at[tok[:, None], head[:, None], cols[None, :]], mask=row_ok[:, None],
                other=0).astype(compute_dtype)  # fmt: skip
    qpos = bk.load(qpos_ref.at[tok], mask=row_ok, other=0)  # [rows_p]
    busy = t0 < q_len
    n_blocks = jnp.where(busy, (length + block_s - 1) // block_s, 0)
    offs = jnp.arange(block_s) % page_size
    decode = functools.partial(bk.to_f32, fp8=fp8)
    lo = gap_ref[0] if gaps else 0
    hi = gap_ref[1] if gaps else 0

    def body(i, carry):
        slots = i * block_s + jnp.arange(block_s)
        valid = (slots < length) & ((slots < lo) | (slots >= hi))
        page = bk.load(table_ref.at[slots // page_size], mask=valid, other=0)  # [bs]
        pos = bk.load(pos_ref.at[page, offs], mask=valid, other=0)
        if weights:  # a merged slot's weight - 1 above WEIGHT_SHIFT: log weight on its logit
            log_w = jnp.log(((pos >> WEIGHT_SHIFT) + 1).astype(jnp.float32))
            pos = pos & ((1 << WEIGHT_SHIFT) - 1)
        kb = decode(bk.load(k_ref.at[page[:, None], offs[:, None], cols[None, :]],
                            mask=valid[:, None], other=0))  # fmt: skip
        if rope:  # rotate-half by a second load of the block, its halves swapped
            swap = (cols + h // 2) % h
            kswap = decode(bk.load(k_ref.at[page[:, None], offs[:, None], swap[None, :]],
                                   mask=valid[:, None], other=0))  # fmt: skip
            kswap = kswap * jnp.where(cols < h // 2, -1.0, 1.0)[None, :]
            turn = sink_turn(pos, sink_ref[()], shift_ref[()]).astype(jnp.float32)
            angle = turn[:, None] * freq_ref[...][None, :]
            kb = jnp.where(raw_ref[()] != 0, kb * jnp.cos(angle) + kswap * jnp.sin(angle), kb)
        z = bk.dot(q, kb.astype(compute_dtype), trans_b=True)  # [rows_p, bs]
        if fp8:
            ks = bk.load(ks_ref.at[page, offs], mask=valid, other=0).astype(jnp.float32)
            z = z * ks[None, :]
        z = z * sm_scale
        if weights:
            z = z + log_w[None, :]
        keep = valid[None, :] & (pos[None, :] <= qpos[:, None]) & row_ok[:, None]
        if window:
            keep = keep & (qpos[:, None] - pos[None, :] < window)
        z = jnp.where(keep, z, -jnp.inf)
        vs = None
        if fp8:
            vs = bk.load(vs_ref.at[page, offs], mask=valid, other=0).astype(jnp.float32)
        vb = decode(bk.load(v_ref.at[page[:, None], offs[:, None], cols[None, :]],
                            mask=valid[:, None], other=0))  # fmt: skip
        return bk.softmax_update(carry, z, vb, compute_dtype, vs)

    carry = jax.lax.fori_loop(0, n_blocks, body, bk.softmax_start(rows_p, h))
    if lowrank_rank:
        rank, width = lowrank_rank, table_ref.shape[0]
        rp = max(bk.MIN_DOT, rank)  # the factors' rows, padded for the dots
        jr = jnp.arange(rp)

        def factors(x_ref, s_ref, page, first):
            """Rows first .. first + rank of a low-rank page, float32 `[rp, H]` (zeros past)."""
            ok = jr < rank
            rows = jnp.where(ok, first + jr, 0)
            x = decode(bk.load(x_ref.at[page, rows[:, None], cols[None, :]], mask=ok[:, None],
                               other=0))  # fmt: skip
            if fp8:
                x = x * bk.load(s_ref.at[page, rows], mask=ok, other=0).astype(jnp.float32)[:, None]
            return x

        def low_page(i, carry):
            page = table_ref[jnp.minimum(lr_start_ref[()] + i, width - 1)]
            held = pos_ref[page, 0]
            basis_k = factors(k_ref, ks_ref, page, 0)
            basis_v = factors(v_ref, vs_ref, page, 0)
            for c in range(page_size // rank - 1):  # H tokens a block of coefficients
                coef_k = factors(k_ref, ks_ref, page, rank * (c + 1))  # C^T [rp, H tokens]
                coef_v = factors(v_ref, vs_ref, page, rank * (c + 1))
                keys = bk.dot(jnp.transpose(coef_k), basis_k)  # [H tokens, H]
                vals = bk.dot(jnp.transpose(coef_v), basis_v)
                ok = (c * h + cols < held) & busy
                vals = jnp.where(ok[:, None], vals, 0.0)
                z = bk.dot(q, keys.astype(compute_dtype), trans_b=True) * sm_scale
                z = jnp.where(ok[None, :] & row_ok[:, None], z, -jnp.inf)
                carry = bk.softmax_update(carry, z, vals, compute_dtype)
            return carry

        carry = jax.lax.fori_loop(0, jnp.where(busy, lr_count_ref[()], 0), low_page, carry)
    o, _, lsum = carry
    out = jnp.where(lsum[:, None] > 0, o / jnp.where(lsum > 0, lsum, 1.0)[:, None], 0.0)
    bk.store(o_ref.at[spare[:, None], head[:, None], cols[None, :]], out, mask=row_ok[:, None])


@functools.partial(
    jax.jit,
    static_argnames=(
        "sliding_window",
        "sm_scale",
        "q_tile",
        "pages_per_block",
        "num_warps",
        "num_stages",
        "backend",
        "interpret",
        "_fill",
        "weights",
        "lowrank_rank",
    ),  # fmt: skip
)
def ragged_paged_attention(
    q,
    k_pages,
    v_pages,
    page_table,
    lengths,
    q_start,
    q_len,
    q_positions,
    pos_pages,
    num_decode=None,
    num_rows=None,
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
    q_tile: int = 16,
    pages_per_block: int | None = None,
    num_warps: int = 4,
    num_stages: int = 2,
    backend: str = "triton",
    interpret: bool | None = None,
    _fill: float = 0.0,
):
    """The Pallas kernel: the grid (R rows, K kv heads, query tiles) gives each program
    `q_tile` query tokens of one row times the G query heads of one kv head (rows of Triton's
    dots, padded to 16), which walk the row's key blocks below its length through the page
    table, pages gathered by address. A decode row's one query is one program per kv head; a
    chunk's tiles run side by side. `num_decode` and `num_rows` are accepted for the XLA path's
    signature (rows past `q_len` 0 do nothing). Returns `[T, N, H]` in q's dtype (zeros for
    tokens no row owns)."""
    del num_decode, num_rows
    bk.check_backend(backend)
    interpret = bk.resolve_interpret(interpret)
    validate_args(q, k_pages, v_pages, page_table, lengths, gaps, q_start, q_len, q_positions)
    t, n, h = q.shape
    p, page_size, _ = k_pages.shape
    r, kh, m = page_table.shape
    block_s = bk.paged_blocks(q.shape, k_pages.shape, q_tile, pages_per_block)
    fp8 = k_pages.dtype == bk.FP8
    if fp8 != (k_scale is not None) or fp8 != (v_scale is not None):
        raise ValueError("FP8 storage needs both scales, other storage neither")
    g = n // kh
    low = q.dtype != jnp.float32 and k_pages.dtype in (q.dtype, bk.FP8)
    compute_dtype = q.dtype if low else jnp.float32
    scale = 1.0 / math.sqrt(h) if sm_scale is None else float(sm_scale)
    # the longest row's query tiles (a static bound: every chunk fits the step's tokens)
    tiles = bk.cdiv(t, q_tile)

    def per_row(*blk):
        return pl.BlockSpec((None, *blk), lambda i, j, _: (i,) + (0,) * len(blk))

    def per_kv(*blk):
        return pl.BlockSpec((None, None, *blk), lambda i, j, _: (i, j) + (0,) * len(blk))

    whole = lambda *shape: pl.BlockSpec(shape, lambda i, j, _: (0,) * len(shape))  # noqa: E731
    args = [q, bk.to_bits(k_pages), bk.to_bits(v_pages), page_table.astype(jnp.int32),
            jnp.clip(lengths.astype(jnp.int32), 0, m * page_size), q_start.astype(jnp.int32),
            q_len.astype(jnp.int32), q_positions.astype(jnp.int32),
            pos_pages.astype(jnp.int32)]  # fmt: skip
    in_specs = [
        whole(t, n, h),  # q: gathered by token and head
        whole(p, page_size, h),  # k_pages: the whole pool, rows gathered by page id
        whole(p, page_size, h),  # v_pages
        per_kv(m),  # page_table: the page ids of (row i, kv head j)
        per_kv(),  # lengths
        per_row(),  # q_start of row i
        per_row(),  # q_len of row i
        whole(t),  # q_positions
        whole(p, page_size),  # pos_pages
    ]
    if gaps is not None:
        args.append(gaps.astype(jnp.int32))
        in_specs.append(per_kv(2))
    if fp8:
        args += [k_scale, v_scale]
        in_specs += [whole(p, page_size), whole(p, page_size)]
    if rope is not None:
        raw, sink, shift, inv_freq = rope
        freq = jnp.concatenate([inv_freq, inv_freq]).astype(jnp.float32)
        args += [raw.astype(jnp.int32), sink.astype(jnp.int32), shift.astype(jnp.int32), freq]
        in_specs += [per_row(), per_row(), per_row(), whole(h)]  # row i's flag, sinks, shift
    if (lowrank is None) != (not lowrank_rank):
        raise ValueError(f"{lowrank_rank=}: low-rank pages need their rank, and only they")
    if lowrank is not None:
        if (
            lowrank_rank & (lowrank_rank - 1)
            or page_size % lowrank_rank
            or page_size < 2 * lowrank_rank
        ):
            raise ValueError(
                f"{lowrank_rank=}: expected a power of two dividing page_size={page_size} at most "
                "half of it (a basis, then blocks of coefficients)"
            )
        args += [lowrank[0].astype(jnp.int32), lowrank[1].astype(jnp.int32)]
        in_specs += [per_row(), per_row()]
    args.append(jnp.full((t + 1, n, h), _fill, jnp.float32))  # tests poison it with NaN
    in_specs.append(whole(t + 1, n, h))
    kernel = functools.partial(
        ragged_paged_attention_kernel, n_heads=g, q_tile=q_tile, page_size=page_size,
        block_s=block_s, sm_scale=scale, compute_dtype=compute_dtype, fp8=fp8,
        gaps=gaps is not None, window=sliding_window, rope=rope is not None, weights=weights,
        lowrank_rank=lowrank_rank if lowrank is not None else 0,
    )  # fmt: skip
    out = pl.pallas_call(
        kernel,
        grid=(r, kh, tiles),
        in_specs=in_specs,
        out_specs=whole(t + 1, n, h),
        out_shape=jax.ShapeDtypeStruct((t + 1, n, h), jnp.float32),
        input_output_aliases={len(args) - 1: 0},
        compiler_params=bk.compiler_params(num_warps, num_stages),
        interpret=interpret,
        name="jkv_ragged_paged_attention",
    )(*args)
    return out[:t].astype(q.dtype)
