"""The engine's one step over the pool in place: every scheduled row, decoding or prefilling,
as ONE flattened batch of tokens through THE model (`jkv.core.step.flat_step`), whose layers
write the new K and V into their pages and attend through each row's page table
(`jkv.core.paged`). The pool is donated: the step updates it in place.

Prompts a policy compresses run here like a full cache's; their selection follows over the
pool (`jkv.engine.select`). StreamingLLM's rows store their keys as every row's, and their sinks
are turned on read to their rank in the cache (`PagedRows.raw`); once compressed they decode
into a ring whose slot the host chooses (`jkv.policies.base.Ring`: its rule ignores the tokens'
content). H2O's rows add the attention their queries pay to each slot's mass in the pool, and a
full H2O ring's token goes, per head, to the slot H2O's rule picks on the device
(`PagedRows.mass`). No row's context is copied into a dense array.

Compiled shapes: rows padded to powers of two (`bucket`), tokens to `token_bucket` (the rows
themselves, or a power of 4); the row tables have their fixed width, so a step's shape never
depends on how long its rows are. Which rows are StreamingLLM's or H2O's is data: one program
serves every policy (H2O's mass arrays are there when the engine keeps the mass).
"""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp
import numpy as np

from jkv.core.paged import MassRows, PagedRows, as_bits, from_bits, make_paged_attention
from jkv.core.sampling import SamplingArrays, sample
from jkv.core.step import flat_step
from jkv.engine import programs
from jkv.engine.plan import bucket, token_bucket
from jkv.engine.runner import PagedKV, RowTables
from jkv.policies.h2o import lightest_slots
from jkv_models.config import ModelConfig


@programs.jit(static_argnames=("config", "backend", "dtype", "mesh"), donate_argnames=("pool",))
def flat_logits(
    weights, config: ModelConfig, pool: PagedKV, rows: PagedRows, tokens, positions, last_tok,
    from_last, *, backend: str, dtype: str, mesh=None,
):  # fmt: skip
    """THE model over the flattened tokens `[T]` of `rows`, the pool updated in place. Returns
    (float32 logits `[R, V]` at each row's last token, the pool)."""
    tokens = jnp.where(from_last >= 0, last_tok[jnp.maximum(from_last, 0)], tokens)
    scales = ("k_scale", "v_scale") if pool.k_scale is not None else ()
    mass = ("mass",) if rows.mass is not None else ()  # H2O's rows read and add to it
    names = ("k", "v", "positions", "block_pages", *scales, *mass)
    attend = make_paged_attention(
        rows, config=config, backend=backend, kv_dtype=dtype, mesh=mesh, evict=lightest_slots
    )
    last = rows.q_start + jnp.maximum(rows.q_len - 1, 0)  # [R]
    logits, _, new = flat_step(weights, config, tokens, positions, attend, last,
                               as_bits({n: getattr(pool, n) for n in names}))  # fmt: skip
    new = from_bits(new, dtype)
    return logits, dataclasses.replace(pool, **{n: new[n] for n in names if n != "block_pages"})


@programs.jit
def sample_rows(logits, sampling: SamplingArrays, sample_index, last_tok):
    """`[P]` int32: row r's token sampled from its logits `[R, V]` at r < R (the next step's
    input, one shape whatever R). A program of its own: one per row bucket, not per step
    shape."""
    tok = sample(logits, sampling, sample_index)
    return jnp.zeros_like(last_tok).at[: tok.shape[0]].set(tok)


def ragged_step(
    weights,
    config: ModelConfig,
    pool: PagedKV,
    rows: PagedRows,
    tokens,
    positions,
    sampling: SamplingArrays,
    sample_index,
    last_tok,
    from_last,
    *,
    backend: str,
    dtype: str,
    mesh=None,
):
    """One step over the flattened tokens `[T]` (text positions `[T]`) of `rows`; `mesh`: the
    pool is sharded over kv heads on its "model" axis (`jkv.core.paged`). `last_tok` `[P]`: the
    step before's output, `from_last` `[T]`: where a token is its row `from_last[t]` of it (a
    token the host has not read yet: async scheduling), -1 where `tokens` has it. Two
    dispatches (`flat_logits`, `sample_rows`), nothing waited for. Returns (`[P]` int32: row
    r's token sampled at its last one at r < R, the updated pool; `pool` is donated)."""
    logits, pool = programs.call(
        flat_logits, weights, config, pool, rows, tokens, positions, last_tok, from_last,
        backend=backend, dtype=dtype, mesh=mesh,
    )  # fmt: skip
    return programs.call(sample_rows, logits, sampling, sample_index, last_tok), pool


def order(scheduled):
    """Decode rows first, longest first (the XLA path takes them in tiles of similar lengths),
    then prefill chunks."""
    return sorted(scheduled, key=lambda r: (r.n != 1, -r.row.computed if r.n == 1 else 0))


def pack_ragged(plan_rows, row_tables: RowTables, group: int, page: int, most: int,
                mass: bool = False):  # fmt: skip
    """Host arrays for `ragged_step` from a step's plain rows (`jkv.engine.plan.RowPlan`) in
    `order`: (`PagedRows`, tokens `[T]`, positions `[T]`), rows padded to a power of two, tokens
    to `token_bucket` (`most`: the largest step's tokens). Reads nothing but the rows (and
    brings their page-table rows up to date). `mass`: the pool keeps H2O's attention mass (the
    step's `MassRows` are there whether or not it holds H2O's rows)."""
    b = bucket(len(plan_rows))
    t = token_bucket(sum(r.n for r in plan_rows), b, most)
    slots = [row_tables.sync(r) for r in plan_rows]
    tables = np.zeros((b, row_tables.width), np.int32)
    tables[: len(slots)] = row_tables.table[slots]
    base = np.zeros((b, group), np.int32)
    n_prefix, held, lowrank = np.zeros(b, np.int32), np.zeros(b, np.int32), np.zeros(b, np.int32)
    q_start, q_len = np.zeros(b, np.int32), np.zeros(b, np.int32)
    tok_row, tok_slot = np.full(t, b, np.int32), np.zeros(t, np.int32)
    tokens, positions = np.zeros(t, np.int32), np.zeros(t, np.int32)
    raw, sink, shift = np.zeros(b, bool), np.zeros(b, np.int32), np.zeros(b, np.int32)
    on, evict, importance = np.zeros(b, bool), np.zeros(b, bool), np.zeros(b, bool)
    limit, recent, protect = np.ones(b, np.int32), np.zeros(b, np.int32), np.zeros(b, np.int32)
    at = 0
    for i, r in enumerate(plan_rows):
        n = r.n
        base[i], n_prefix[i], held[i], lowrank[i] = r.base, r.n_prefix, r.held, r.n_lowrank
        if r.rank_sink is not None:
            raw[i], sink[i], shift[i] = True, r.rank_sink, r.shift
        if r.mass_rule is not None:  # H2O: its queries add mass
            on[i] = True
            recent[i], protect[i], importance[i] = r.mass_rule
        evict[i], limit[i] = r.evict, r.limit
        q_start[i], q_len[i] = at, n
        tokens[at : at + n] = r.tokens
        positions[at : at + n] = np.arange(r.start, r.start + n)
        tok_row[at : at + n] = i
        tok_slot[at : at + n] = np.arange(r.first, r.first + n)
        at += n
    num_decode = sum(1 for r in plan_rows if r.n == 1)
    heavy = MassRows(on, evict, limit, recent, protect, importance) if mass else None
    rows = PagedRows(tables, base, n_prefix, held, q_start, q_len, tok_row, tok_slot,
                     np.int32(num_decode), np.int32(len(plan_rows)), raw, sink, shift,
                     heavy, lowrank)  # fmt: skip
    return rows, tokens, positions
