"""The segment rebuild (`jkv.policies.segments`, the seed's section 3.2) on the pool: after the
step that ends a prompt, the policy's own `rebuild` (the one `jkv.generate` runs) takes each
layer's prompt from the row's pages, and what it builds goes back into the row's prefix:

  * its ordinary slots (anchors whole, transitions merged) in the first blocks, each head's in
    order, as a select-once policy's kept tokens; a merged slot's weight (the tokens it stands
    for, whose log the attention adds to its logit) in its position's high bits
    (`jkv_kernels.ragged_paged_attention.weighted_positions`);
  * its low-rank middle in the next blocks, one segment of `head_dim` tokens per page
    ("low-rank pages"): the key (value) page's first `page_size // 2` rows hold the basis,
    the next ones the coefficients transposed, its position slot 0 the tokens it holds. They
    lie inside the prefix's gap, where the attention reads them as factors (the ragged kernel's
    `lowrank`), expanded one page at a time.

So a rebuilt row costs its ordinary slots plus a page per `head_dim` middle tokens of each head
(SmolLM2: 64 tokens in 16 rows, 4x), in the pool's own pages and dtype (fp8 pools: the factors'
rows quantised as tokens are). Two programs: `paged_rebuild` (the rebuild, every layer in one
scan: the SVDs one after another, `segments.lowrank_store`; over the prompt's bucket of slots,
`rebuild_columns`), then, once the host has the row's new blocks (`Scheduler.compress` with the
segments per head), `write_rebuilt`.
"""

from __future__ import annotations

import dataclasses
from typing import NamedTuple

import jax
import jax.numpy as jnp

from jkv import kv as kvlib
from jkv.core.backends import ops
from jkv.core.paged import PagedRows, lowrank_rank, write_tokens
from jkv.engine import programs
from jkv.engine.plan import bucket
from jkv.engine.runner import PagedKV, token_index
from jkv.engine.select import prompt_slots
from jkv.policies.base import Context
from jkv.policies.segments import SegmentCapacity
from jkv_kernels.ragged_paged_attention import weighted_positions


def policy_rank(policy, head_dim: int) -> int:
    """The rank a segment rebuild factors at most (`SegmentCapacity.store_shape`'s rule)."""
    r = head_dim // 8 if policy.max_rank is None else policy.max_rank
    return max(1, min(r, head_dim, policy.segment_len))


def lowrank_slots(policy, prompt_len: int, config, page_size: int) -> int:
    """The slots a rebuilt row's low-rank pages take at most (a page per head_dim middle
    tokens), what admission reserves beside its ordinary slots."""
    return -(-policy.max_middle(prompt_len) // config.head_dim) * page_size


def rebuild_columns(prompt_len: int, page_size: int, width: int) -> int:
    """The table columns a rebuild of a `prompt_len`-token prompt reads: a power of two (one
    program per bucket, its SVDs over the bucket's slots, not the row's whole width)."""
    return min(bucket(-(-prompt_len // page_size)), width)


def rebuild_buckets(width: int) -> list[int]:
    """Every `rebuild_columns` of rows `width` blocks wide (what warmup compiles)."""
    return sorted({min(1 << i, width) for i in range(width.bit_length() + 1)})


def rebuild_rows(rows: PagedRows, prompt_len: int, page_size: int) -> PagedRows:
    """`rows` (`pack_select`'s, one row) with its table cut to `rebuild_columns`."""
    cols = rebuild_columns(prompt_len, page_size, rows.tables.shape[1])
    return dataclasses.replace(rows, tables=rows.tables[:, :cols])


class Rebuilt(NamedTuple):
    """What `paged_rebuild` built for rows `[E]` (device arrays, every layer `L`)."""

    k: jax.Array  # [E, L, K, S, H] float32 ordinary slots
    v: jax.Array
    positions: jax.Array  # [E, L, K, S] int32 weighted positions (-1: none)
    counts: jax.Array  # [E, L, K] int32 ordinary slots per head
    lr_k: jax.Array  # [E, L, K, M, page, H] float32 low-rank pages (basis, coefficients)
    lr_v: jax.Array
    lr_held: jax.Array  # [E, L, K, M] int32 tokens each holds
    segments: jax.Array  # [E, L, K] int32 low-rank pages per head


@programs.jit(static_argnames=("config", "backend", "policy"))
def paged_rebuild(config, pool: PagedKV, rows: PagedRows, queries, positions, budgets, *,
                  backend: str, policy) -> Rebuilt:  # fmt: skip
    """The segment rebuild of E rows whose prompts are in the pool, uncompressed (`rows`,
    `queries`, `positions`, `budgets` as `jkv.engine.select.paged_select` takes them)."""
    nl, kh, h = config.num_layers, config.num_kv_heads, config.head_dim
    page = pool.page_size
    s = rows.tables.shape[1] * page
    rank, rp = policy_rank(policy, h), lowrank_rank(page)
    kernels = ops(backend)
    index_rows, dense, lengths, live = prompt_slots(rows, page, kh)
    flat = lambda x: x.reshape(x.shape[0] * x.shape[1], *x.shape[2:])  # noqa: E731
    ctx = Context(prompt_lengths=rows.held, budgets=budgets, now=rows.held - 1, num_layers=nl)
    cap = SegmentCapacity(s, segments=s // h, segment_len=h, max_rank=rank)

    def gathered(name, at):
        x = flat(getattr(pool, name))[at].astype(jnp.float32)
        if pool.k_scale is not None:
            x = x * flat(getattr(pool, f"{name}_scale"))[at].astype(jnp.float32)[..., None]
        return x

    def pages(coef, basis):
        """`[E, K, M, page, H]` low-rank pages: the basis `[.., R, H]`, the coefficients `[..,
        H tokens, R]` transposed, each padded to `rp` rows."""
        pad = ((0, 0),) * 3 + ((0, rp - rank), (0, 0))
        return jnp.concatenate(
            [jnp.pad(basis, pad), jnp.pad(jnp.swapaxes(coef, -1, -2), pad)], axis=-2
        ).astype(jnp.float32)

    def one_layer(after, xs):
        layer, q = xs
        at = token_index(pool, index_rows, layer, kh, dense)  # [E, K, S] pool tokens
        heads = layer * kh + jnp.arange(kh)
        table = jnp.transpose(pool.block_pages[rows.tables][:, :, heads], (0, 2, 1))
        votes = kernels.paged_window_scores(
            q, pool.k, table, lengths, rows.q_start, rows.q_len, positions, pool.positions,
            k_scale=pool.k_scale, pool=policy.pool, kernel_size=policy.kernel,
        )  # fmt: skip
        view = kvlib.LayerKV(
            k=gathered("k", at), v=gathered("v", at), lengths=lengths,
            positions=jnp.where(live, flat(pool.positions)[at], -1), scores=votes,
        )  # fmt: skip
        out = policy.rebuild(layer, view, dataclasses.replace(ctx, after=after), cap, kernels)
        weight = jnp.rint(jnp.exp(out.bias)).astype(jnp.int32)
        held = jnp.arange(s) < out.lengths[..., None]
        lr = out.lowrank
        done = (jnp.sum(lr.rank_k) + jnp.sum(lr.rank_v)).astype(jnp.float32)
        return done, (
            out.k.astype(jnp.float32),
            out.v.astype(jnp.float32),
            jnp.where(held, weighted_positions(out.positions, weight), -1),
            out.lengths,
            pages(lr.coef_k, lr.basis_k),
            pages(lr.coef_v, lr.basis_v),
            lr.counts,
            jnp.sum(lr.counts > 0, axis=-1, dtype=jnp.int32),
        )

    _, outs = jax.lax.scan(one_layer, jnp.float32(0.0), (jnp.arange(nl, dtype=jnp.int32), queries))
    return Rebuilt(*(jnp.swapaxes(x, 0, 1) for x in outs))


@programs.jit(static_argnames=("dtype",), donate_argnames=("pool",))
def write_rebuilt(pool: PagedKV, built: Rebuilt, row, table, n_ordinary, *, dtype: str) -> PagedKV:
    """Row `row` (traced) of `built` written into its new prefix, in place: `table` `[W]` its
    blocks (`Scheduler.compress`'s), ordinary slot i of head h in block i // page_size, its
    low-rank page j in block `n_ordinary` + j (a head's column)."""
    page = pool.page_size
    k, v, pos, counts, lr_k, lr_v, lr_held, segments = (x[row] for x in built)
    nl, kh, s, h = k.shape
    m = lr_k.shape[2]
    g = nl * kh
    heads = jnp.arange(g).reshape(nl, kh)
    nowhere = pool.num_pages * page

    def column(j):
        return table[jnp.clip(j, 0, table.shape[0] - 1)]

    i = jnp.arange(s)
    dst = pool.block_pages[column(i // page)[None, None, :], heads[..., None]] * page + i % page
    dst = jnp.where(i < counts[..., None], dst, nowhere)  # [L, K, S]
    j = jnp.arange(m)
    lr_page = pool.block_pages[column(n_ordinary + j)[None, None, :], heads[..., None]]  # [L,K,M]
    lr_dst = lr_page[..., None] * page + jnp.arange(page)  # [L, K, M, page]
    lr_dst = jnp.where((j < segments[..., None])[..., None], lr_dst, nowhere)
    lr_pos = jnp.where(jnp.arange(page) == 0, lr_held[..., None], -1)
    at = jnp.concatenate([dst.reshape(-1), lr_dst.reshape(-1)])[:, None]  # [N, 1]
    keys = jnp.concatenate([k.reshape(-1, h), lr_k.reshape(-1, h)])[:, None]  # [N, 1, H]
    values = jnp.concatenate([v.reshape(-1, h), lr_v.reshape(-1, h)])[:, None]
    where = jnp.concatenate([pos.reshape(-1), lr_pos.reshape(-1)])
    names = ("k", "v", "positions", *(("k_scale", "v_scale") if pool.k_scale is not None else ()))
    out = write_tokens({n: getattr(pool, n) for n in names}, at, keys, values, where, dtype)
    return dataclasses.replace(pool, **out)
