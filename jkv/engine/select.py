"""A select-once KV policy's choice at a prompt's end, on the pool in place (the engine's
selection): the prompt ran on the flattened step like a full cache's, all of it in its pages;
then, for the rows whose prompt ended in that step, one program

  * runs the model again over each row's observation window (its prompt's last `window`
    tokens, at most a few dozen; attention reads the row's pages, writes nothing: their K and V
    are in the pool) to get every layer's rotated window queries;
  * scores every slot of the row per (layer, kv head) through its page table: SnapKV's window
    votes (`paged_window_scores`, the Pallas kernels on the "pallas" backends, their XLA path
    on "xla"), or the key norms a Quantile policy keeps by (read block by block), or nothing
    (StreamingLLM keeps by position);
  * hands the policy a view of each layer (its slots' positions and scores, no keys or values)
    and keeps what the policy's `keep` keeps, as `jkv.generate` does over its dense cache.

Returns what each head keeps as pool tokens in slot order, for the compaction
(`runner.compact`). Nothing here copies a row's keys or values into a dense array.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

from jkv import kv as kvlib
from jkv.core.backends import ops
from jkv.core.paged import PagedRows, as_bits, from_bits, make_paged_attention
from jkv.core.step import flat_step
from jkv.engine import programs
from jkv.engine.plan import bucket
from jkv.engine.runner import PagedKV, Rows, token_index
from jkv.policies.base import Context
from jkv_kernels import bits_take

KEY_BLOCK = 256  # slots whose keys a Quantile policy's norms read at a time
SELECT_ROWS = 4  # rows a selection takes at most (more ending in one step: several calls)


def vote_window(policy) -> int:
    """The observation window a select-once policy's votes need (`window_queries`), 0 when it
    keeps by something else (positions, key norms, H2O's mass)."""
    if policy.needs_replay:  # KVzip: its replay's queries (`jkv.engine.replay`)
        return 0
    return policy.window if policy.observes and not policy.wants_mass else 0


def prompt_slots(rows: PagedRows, page: int, num_kv_heads: int):
    """The slots of E rows whose uncompressed prompts (`rows.held` tokens) are in the pool:
    (`Rows` for `token_index`, every slot `[E, K, S]`, lengths `[E, K]`, which slots hold a
    token `[E, K, S]`), S the rows' table width in slots."""
    e, kh = rows.tables.shape[0], num_kv_heads
    s = rows.tables.shape[1] * page
    index_rows = Rows(rows.tables, rows.base, rows.n_prefix, rows.held, jnp.zeros(e, bool))
    dense = jnp.broadcast_to(jnp.arange(s, dtype=jnp.int32), (e, kh, s))
    lengths = jnp.broadcast_to(rows.held[:, None], (e, kh))
    return index_rows, dense, lengths, dense < lengths[..., None]


def key_norms(pool: PagedKV, at, lengths) -> jax.Array:
    """`[E, K, S]` float32 L1 norm of the key stored at pool tokens `at` `[E, K, S]` (0 at and
    past `lengths` `[E, K]`), `KEY_BLOCK` slots at a time."""
    e, kh, s = at.shape
    width = -(-s // KEY_BLOCK) * KEY_BLOCK
    at = jnp.pad(at, ((0, 0), (0, 0), (0, width - s)))
    flat = lambda x: x.reshape(x.shape[0] * x.shape[1], *x.shape[2:])  # noqa: E731

    def block(i, out):
        idx = jax.lax.dynamic_slice_in_dim(at, i * KEY_BLOCK, KEY_BLOCK, axis=2)
        k = bits_take(flat(pool.k), idx).astype(jnp.float32)  # [E, K, blk, H]
        if pool.k_scale is not None:
            k = k * bits_take(flat(pool.k_scale), idx).astype(jnp.float32)[..., None]
        return jax.lax.dynamic_update_slice_in_dim(out, jnp.abs(k).sum(-1), i * KEY_BLOCK, 2)

    out = jax.lax.fori_loop(0, width // KEY_BLOCK, block, jnp.zeros((e, kh, width), jnp.float32))
    return jnp.where(jnp.arange(s) < lengths[..., None], out[..., :s], 0.0)


def pool_pass(weights, config, pool: PagedKV, rows: PagedRows, tokens, positions, *,
              backend: str, dtype: str, write: bool):  # fmt: skip
    """The model over `tokens` `[T]` (at text `positions` `[T]`) of rows whose earlier tokens
    are in the pool, attention reading the rows' pages (and writing the tokens' K and V when
    `write`). Returns (`[L, T, N, H]` every layer's rotated queries, the pool)."""
    scales = ("k_scale", "v_scale") if pool.k_scale is not None else ()
    names = ("k", "v", "positions", "block_pages", *scales)
    attend = make_paged_attention(rows, config=config, backend=backend, kv_dtype=dtype,
                                  write=write, queries=True)  # fmt: skip
    last = rows.q_start + jnp.maximum(rows.q_len - 1, 0)
    _, queries, new = flat_step(weights, config, tokens, positions, attend, last,
                                as_bits({n: getattr(pool, n) for n in names}))  # fmt: skip
    new = from_bits(new, dtype)
    if write:
        pool = dataclasses.replace(pool, **{n: new[n] for n in names if n != "block_pages"})
    return queries, pool


@programs.jit(static_argnames=("config", "backend", "dtype"))
def window_queries(weights, config, pool: PagedKV, rows: PagedRows, tokens, positions, *,
                   backend: str, dtype: str):  # fmt: skip
    """`[L, T, N, H]` every layer's rotated queries of the window tokens `[T]` (at text
    `positions` `[T]`) of E rows whose prompts are in the pool: the model over the windows,
    attention reading the rows' pages, nothing written. One program for every policy that
    votes with a window (SnapKV, PyramidKV, Ada-KV, EffiCache)."""
    queries, _ = pool_pass(weights, config, pool, rows, tokens, positions, backend=backend,
                           dtype=dtype, write=False)  # fmt: skip
    return queries


@programs.jit(static_argnames=("config", "backend", "policy"))
def paged_select(
    config, pool: PagedKV, rows: PagedRows, queries, positions, budgets, sensitivity=None,
    replayed=None, *, backend: str, policy,
):  # fmt: skip
    """What `policy` (a select-once policy's `jit_key()`) keeps of E rows whose prompts are in
    the pool, uncompressed. No model runs here: a policy's own program is small.

    Args:
      rows: the E rows (`pack_select`): their tables, `held` their prompt's length, their
        window tokens at `q_start`, `q_len` (none for a policy that needs no window).
      queries: `[L, T, N, H]` their window queries (`window_queries`; None for a policy that
        does not vote with a window); positions: `[T]` the window tokens' text positions.
      budgets: `[E]` int32 prompt tokens each row keeps; `sensitivity`: `[E, L, K]` EffiCache's.
      replayed: `[>= E, L, K, S]` float32 KVzip's slot scores from its replay
        (`jkv.engine.replay`; rows past E ignored), whose selection ranks all layers together.

    Returns:
      (`[E, L, K, S]` int32 each head's kept pool tokens first, in slot order; `[E, L, K]` int32
      how many; `[E, S]` int32 the text positions layer 0's kv head 0 keeps, in that order: a
      StreamingLLM ring's, whose heads all keep the same).
    """
    nl, kh = config.num_layers, config.num_kv_heads
    kernels = ops(backend)
    e = rows.tables.shape[0]
    index_rows, dense, lengths, live = prompt_slots(rows, pool.page_size, kh)
    flat = lambda x: x.reshape(x.shape[0] * x.shape[1], *x.shape[2:])  # noqa: E731
    ctx = Context(prompt_lengths=rows.held, budgets=budgets, now=rows.held - 1, num_layers=nl,
                  sensitivity=sensitivity)  # fmt: skip

    def one_layer(layer, q):
        """Layer `layer`'s (traced) kept pool tokens `[E, K, S]` first in slot order, their
        count `[E, K]` and kv head 0's text positions in that order `[E, S]`."""
        at = token_index(pool, index_rows, layer, kh, dense)  # [E, K, S] pool tokens
        heads = layer * kh + jnp.arange(kh)
        if policy.wants_mass:  # H2O: the attention its prompt's queries paid, from the pool
            scores = jnp.where(live, flat(pool.mass)[at], 0.0)
        elif policy.observes:
            table = jnp.transpose(pool.block_pages[rows.tables][:, :, heads], (0, 2, 1))
            scores = kernels.paged_window_scores(
                q, pool.k, table, lengths, rows.q_start, rows.q_len, positions, pool.positions,
                k_scale=pool.k_scale, pool=policy.pool, kernel_size=policy.kernel,
            )  # fmt: skip
        elif policy.keeps_by_key_norms:
            scores = key_norms(pool, at, lengths)
        else:  # StreamingLLM: positions alone
            scores = jnp.zeros(at.shape, jnp.float32)
        view = kvlib.LayerKV(k=None, v=None, lengths=lengths,
                             positions=jnp.where(live, flat(pool.positions)[at], -1),
                             scores=scores)  # fmt: skip
        keep = policy.keep(layer, view, ctx)  # [E, K, S]
        order = jnp.argsort(~keep, axis=-1, stable=True).astype(jnp.int32)
        first = jnp.take_along_axis(view.positions[:, 0], order[:, 0], axis=-1)
        counts = jnp.sum(keep, axis=-1, dtype=jnp.int32)
        return jnp.take_along_axis(at, order, axis=-1), counts, first

    if policy.needs_replay:  # every layer's view first: the ranking spans them all

        def view(layer):
            at = token_index(pool, index_rows, layer, kh, dense)
            return at, jnp.where(live, flat(pool.positions)[at], -1)

        at, pos = jax.lax.map(view, jnp.arange(nl, dtype=jnp.int32))  # [L, E, K, S]
        layers = tuple(
            kvlib.LayerKV(
                k=None, v=None, lengths=lengths, positions=pos[i], scores=replayed[:e, i]
            )  # fmt: skip
            for i in range(nl)
        )
        keep = jnp.swapaxes(policy.keep_all(dataclasses.replace(ctx, layers=layers)), 0, 1)
        order = jnp.argsort(~keep, axis=-1, stable=True).astype(jnp.int32)  # [L, E, K, S]
        counts = jnp.sum(keep, axis=-1, dtype=jnp.int32)
        src = jnp.take_along_axis(at, order, axis=-1)
        first = jnp.take_along_axis(pos[:, :, 0], order[:, :, 0], axis=-1)
        return jnp.swapaxes(src, 0, 1), jnp.swapaxes(counts, 0, 1), first[0]

    # one layer's program, scanned (as the model's layers are): [L, E, ...]
    src, counts, first = jax.lax.map(lambda xs: one_layer(*xs),
                                     (jnp.arange(nl, dtype=jnp.int32), queries))  # fmt: skip
    return jnp.swapaxes(src, 0, 1), jnp.swapaxes(counts, 0, 1), first[0]


def pack_select(ending, row_tables, group: int, page: int, window: int):
    """Host arrays for `paged_select` from the rows `ending` (scheduled rows whose prompt ends
    in the step just run, before its bookkeeping): (`PagedRows`, tokens `[T]`, positions
    `[T]`); rows padded to a power of two, each row's window to `bucket(window)` tokens (none
    without a window)."""
    b = bucket(len(ending))
    w = bucket(window) if window else 0
    slots = [row_tables.sync(r.seq) for r in ending]
    tables = np.zeros((b, row_tables.width), np.int32)
    tables[: len(slots)] = row_tables.table[slots]
    held, q_start, q_len = np.zeros(b, np.int32), np.zeros(b, np.int32), np.zeros(b, np.int32)
    tok_row, tok_slot = np.full(max(b * w, 1), b, np.int32), np.zeros(max(b * w, 1), np.int32)
    tokens, positions = np.zeros(max(b * w, 1), np.int32), np.zeros(max(b * w, 1), np.int32)
    for i, r in enumerate(ending):
        seq = r.seq
        n = len(seq.prompt)  # every prompt token is in the tail, slot i at position i
        k = min(window, n)
        held[i], q_start[i], q_len[i] = n, i * w, k
        tokens[i * w : i * w + k] = seq.prompt[n - k : n]
        positions[i * w : i * w + k] = np.arange(n - k, n)
        tok_row[i * w : i * w + k] = i
        tok_slot[i * w : i * w + k] = np.arange(n - k, n)
    rows = PagedRows(tables, np.zeros((b, group), np.int32), np.zeros(b, np.int32), held, q_start,
                     q_len, tok_row, tok_slot, np.int32(0), np.int32(len(ending)))  # fmt: skip
    return rows, tokens, positions
