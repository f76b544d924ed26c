"""The engine's device side: the page pool's arrays and one compiled step over a batch of rows.

The pool stores exactly its pages: K and V `[P, page_size, H]`, positions (and fp8 scales, and
H2O's attention mass) `[P, page_size]`, page p being one kv head's `page_size` tokens of one
layer, so its bytes are `P x page_bytes` (`jkv.memory.page_bytes`). Beside them, the device's
copy of the block rows (`block_pages [num_blocks, L * K]`, `jkv.engine.page_pool`): a row's
page table is one list of block ids for all its heads, and head h of block b is page
`block_pages[b, h]`.

A step maps each row's dense slots to pool tokens through its table (the layout of
`jkv.engine.sequence`: a compressed prefix with per-head counts, then the tail), gathers every
(layer, kv head) into a dense state padded to the longest row's power of two of blocks, runs THE
model step (`jkv.core.step.model_step`, the one `jkv.generate` runs) and samples; then
`write_pages` (a jit of its own, so the update is in place) writes the new tokens into their
pages. Rows, new tokens per row and blocks per row are padded to powers of two, so compiled
steps are bounded; all per-row settings are traced arrays.

The host keeps every running row's table in `RowTables` (vLLM's persistent block table): a
step copies only the blocks added since the last one, so the host's work per step does not
grow with layers x kv heads.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec

from jkv import kv as kvlib
from jkv.core.sampling import SamplingArrays, sample
from jkv.core.step import model_step, next_positions
from jkv.memory import page_bytes
from jkv.policies.base import Context
from jkv_kernels import scatter_set
from jkv_models.config import ModelConfig


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class PagedKV:
    k: jax.Array  # [P, page_size, H] storage dtype
    v: jax.Array  # [P, page_size, H]
    positions: jax.Array  # [P, page_size] int32 text position of every token
    block_pages: jax.Array  # [num_blocks, L * K] int32 the page of each head of each block
    k_scale: jax.Array | None = None  # [P, page_size] bfloat16, fp8 storage only
    v_scale: jax.Array | None = None
    mass: jax.Array | None = None  # [P, page_size] float32 attention received (H2O)

    @property
    def page_size(self) -> int:
        return self.k.shape[1]

    @property
    def num_pages(self) -> int:
        return self.k.shape[0]

    def token_arrays(self) -> tuple[str, ...]:
        """Every per-token array (what a compaction moves)."""
        return ("k", "v", *_scaled(self), *(("mass",) if self.mass is not None else ()))

    def page_nbytes(self) -> int:
        """Device bytes of the pages (not the block rows: bookkeeping, counted apart)."""
        return sum(getattr(self, n).nbytes for n in self.token_arrays())


def empty_pool(
    config: ModelConfig, num_pages: int, page_size: int, dtype: str, block_pages, mass=False,
    mesh=None,
) -> PagedKV:  # fmt: skip
    """A pool of zeros; `block_pages` the host's rows; `mass`: with a float32 of accumulated
    attention per stored token; `mesh`: its pages split in equal segments over the "model"
    axis (each device makes its own, `jkv.engine.page_pool`), the block rows replicated."""
    shape = (num_pages, page_size, config.head_dim)
    fp8 = dtype == "float8_e4m3fn"

    def fill(shape, dtype, value=0):
        if mesh is None:
            return jnp.full(shape, value, dtype)
        pages = NamedSharding(mesh, PartitionSpec("model"))
        return jax.jit(lambda: jnp.full(shape, value, dtype), out_shardings=pages)()

    rows = jnp.asarray(block_pages, jnp.int32)
    if mesh is not None:
        rows = jax.device_put(rows, NamedSharding(mesh, PartitionSpec()))
    return PagedKV(
        k=fill(shape, dtype),
        v=fill(shape, dtype),
        positions=fill(shape[:2], jnp.int32),
        block_pages=rows,
        k_scale=fill(shape[:2], kvlib.SCALE_DTYPE, 1) if fp8 else None,
        v_scale=fill(shape[:2], kvlib.SCALE_DTYPE, 1) if fp8 else None,
        mass=fill(shape[:2], jnp.float32) if mass else None,
    )


def pool_bytes(
    config: ModelConfig, num_pages: int, page_size: int, dtype: str, mass: bool = False
) -> int:
    """Device bytes of a pool's pages: `num_pages x jkv.memory.page_bytes(...)`."""
    return num_pages * page_bytes(config, page_size, dtype, mass=mass)


def _scaled(pool: PagedKV) -> tuple[str, ...]:
    """The per-token arrays of the pool that a step's new tokens write, besides K and V:
    positions, and fp8 scales."""
    return ("positions",) if pool.k_scale is None else ("positions", "k_scale", "v_scale")


def _flat(x: jax.Array) -> jax.Array:
    """A pool array with its pages and offsets as one token axis."""
    return x.reshape(x.shape[0] * x.shape[1], *x.shape[2:])


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class Rows:
    """Where each row's tokens live (host numpy, traced in the step)."""

    tables: jax.Array  # [B, M] int32 block ids (0: none)
    base: jax.Array  # [B, L * K] int32 compressed: kept tokens per head in the prefix; else 0
    n_prefix: jax.Array  # [B] int32 prefix blocks (0: uncompressed)
    tail: jax.Array  # [B] int32 tokens after the prefix before the step (`Sequence.tail`)
    ring: jax.Array  # [B] bool compressed by an evicting policy: `limit` slots, no tail

    def held(self, limits) -> jax.Array:
        """`[B, L * K]` tokens each head holds before the step."""
        held = self.base + self.tail[:, None]
        return jnp.where(self.ring[:, None], jnp.minimum(held, limits[:, None]), held)


def token_index(pool: PagedKV, rows: Rows, layer: int, num_kv_heads: int, slots):
    """`[B, K, X]` int32: the pool token (page * page_size + offset) of dense slots `slots`
    `[B, K, X]` of `layer`'s kv heads: a compressed head's slot below its kept count is in the
    prefix, the rest in the tail; a ring's slots are all in its prefix."""
    page = pool.page_size
    heads = layer * num_kv_heads + jnp.arange(num_kv_heads)
    base = rows.base[:, heads][..., None]  # [B, K, 1]
    in_prefix = rows.ring[:, None, None] | (slots < base)
    logical = jnp.where(in_prefix, slots, rows.n_prefix[:, None, None] * page + slots - base)
    blocks = rows.tables.shape[1]
    col = jnp.clip(logical // page, 0, blocks - 1)
    block = jnp.take_along_axis(
        jnp.broadcast_to(rows.tables[:, None, :], (*col.shape[:2], blocks)), col, axis=-1
    )  # [B, K, X]
    return pool.block_pages[block, heads[None, :, None]] * page + logical % page


@functools.partial(jax.jit, static_argnames=("config", "backend", "dtype", "policy"))
def paged_step(
    weights,
    config: ModelConfig,
    pool: PagedKV,
    rows: Rows,
    tokens,
    n_new,
    start,
    sampling: SamplingArrays,
    sample_index,
    budgets=None,
    limits=None,
    sensitivity=None,
    *,
    backend: str,
    dtype: str,
    policy=None,
):
    """One model step over B rows of the pool.

    Args:
      rows: each row's table and layout (`Rows`).
      tokens: `[B, T]` int32, row b's first `n_new[b]` real; `start`: `[B]` int32 text
        position of `tokens[:, 0]`.
      sampling, sample_index: per-row settings and the index of the token each row samples.
      budgets: `[B]` int32 prompt tokens each row keeps (`policy.row_budgets`), with `policy`.
      limits: `[B]` int32 slots an evicting policy's row holds (a ring; `KVState.limit`).
      sensitivity: `[B, L, K]` float32 head sensitivity of rows whose prompt ends in the step
        (EffiCache, `head_sensitivity`), or None.
      policy: a KV policy's `jit_key()` (it observes the step, SnapKV's window votes or
        H2O's mass, evicts into a ring if it evicts, and selects what each row would keep), or
        None.

    Returns:
      (`[B]` int32 sampled tokens (meaningful for rows whose step reaches their last known
      token), the writes for `write_pages`, with a policy what rows whose prompt ends in this
      step keep (each head's kept tokens as pool tokens, in slot order `[B, L, K, S]` int32,
      and how many `[B, L, K]` int32; else None), and for a policy that accumulates attention
      mass (H2O) the pool tokens and mass of every held slot for `write_mass` (else None)).
    """
    b, t = tokens.shape
    nl, kh = config.num_layers, config.num_kv_heads
    observes = policy is not None and policy.observes
    accumulates = policy is not None and policy.wants_mass  # H2O: its mass so far, from pages
    if accumulates and pool.mass is None:
        raise ValueError(f"kv_policy={policy.name!r} needs a pool built with mass=True")
    limits = jnp.full((b,), kvlib.NO_LIMIT, jnp.int32) if limits is None else limits
    held = rows.held(limits).reshape(b, nl, kh)
    s = rows.tables.shape[1] * pool.page_size
    dense = jnp.broadcast_to(jnp.arange(s, dtype=jnp.int32), (b, kh, s))
    index = [token_index(pool, rows, layer, kh, dense) for layer in range(nl)]  # [B, K, S] each
    layers = []
    for layer in range(nl):
        at = index[layer]
        if accumulates:
            scores = _flat(pool.mass)[at]
        else:
            scores = jnp.zeros(at.shape, jnp.float32) if observes else None
        layers.append(
            kvlib.LayerKV(
                k=_flat(pool.k)[at],
                v=_flat(pool.v)[at],
                lengths=held[:, layer],
                scores=scores,
                **{name: _flat(getattr(pool, name))[at] for name in _scaled(pool)},
            )
        )
    kv = kvlib.KVState(layers=tuple(layers), next_position=start, limit=limits, dtype=dtype)
    logits, kv = model_step(
        weights,
        config,
        kv,
        tokens,
        next_positions(kv, t),
        n_new,
        policy=policy,
        backend=backend,
        logits_at=jnp.maximum(n_new - 1, 0),
    )
    # The new tokens sit in slots held .. held + n_new - 1 of each head's dense copy.
    offs = jnp.arange(t, dtype=jnp.int32)
    live = offs[None, None, :] < n_new[:, None, None]  # [B, 1, T]
    drop = pool.num_pages * pool.page_size  # out of range: the write is dropped
    where, new = [], []
    for layer in range(nl):
        slots = held[:, layer, :, None] + offs  # [B, K, T]
        if policy is not None and policy.evicts and t == 1:
            # A ring at its limit overwrote its oldest token: find the slot by its position.
            slots = ring_slots(kv.layers[layer], start)
        where.append(jnp.where(live, token_index(pool, rows, layer, kh, slots), drop))
        x = kv.layers[layer]
        idx = jnp.minimum(slots, x.capacity - 1)  # [B, K, T]
        new.append((
            jnp.take_along_axis(x.k, idx[..., None], axis=2),  # [B, K, T, H]
            jnp.take_along_axis(x.v, idx[..., None], axis=2),
            *(jnp.take_along_axis(getattr(x, n), idx, axis=2) for n in _scaled(pool)),
        ))  # fmt: skip
    new = tuple(jnp.stack(x, axis=1) for x in zip(*new, strict=True))  # [B, L, ...]
    tok = sample(logits, sampling, sample_index)
    writes = (jnp.stack(where, axis=1), *new)
    if policy is None:
        return tok, writes, None, None
    order, counts = kept_slots(policy, kv, nl, n_new, budgets, start, sensitivity)
    src = jnp.stack(
        [jnp.take_along_axis(index[i], order[:, i], axis=-1) for i in range(nl)], axis=1
    )  # [B, L, K, S] pool tokens, kept first
    kept = (src, counts)
    if not accumulates:
        return tok, writes, kept, None
    # Every stored token received attention: all of each head's mass goes back to its pages.
    mass = jnp.stack([x.scores for x in kv.layers], axis=1)  # [B, L, K, S]
    lengths = jnp.stack([x.lengths for x in kv.layers], axis=1)  # [B, L, K]
    valid = jnp.arange(s) < lengths[..., None]
    return tok, writes, kept, (jnp.where(valid, jnp.stack(index, 1), drop), mass)


def ring_slots(layer: kvlib.LayerKV, position) -> jax.Array:
    """`[B, K, 1]` int32: the slot of each head holding the token at `position` `[B]` (one
    decode token per row, written where the policy chose)."""
    valid = jnp.arange(layer.capacity)[None, None, :] < layer.lengths[:, :, None]
    hit = valid & (layer.positions == position[:, None, None])
    return jnp.argmax(hit, axis=-1).astype(jnp.int32)[..., None]


def kept_slots(policy, kv: kvlib.KVState, num_layers: int, n_new, budgets, start, sensitivity):
    """What `policy` keeps of each row whose whole prompt is in `kv` (the step's dense copy):
    per head, its slots with the kept ones first, in slot order `[B, L, K, S]`, and how many
    are kept `[B, L, K]`."""
    ctx = Context(
        prompt_lengths=start + n_new,
        budgets=budgets,
        now=start + n_new - 1,
        num_layers=num_layers,
        sensitivity=sensitivity,
    )
    order, counts = [], []
    for i, layer in enumerate(kv.layers):
        keep = policy.keep(i, layer, ctx)  # [B, K, S]
        order.append(jnp.argsort(~keep, axis=-1, stable=True).astype(jnp.int32))
        counts.append(jnp.sum(keep, axis=-1, dtype=jnp.int32))
    return jnp.stack(order, axis=1), jnp.stack(counts, axis=1)


@functools.partial(jax.jit, donate_argnames=("pool",))
def set_rows(pool: PagedKV, ids, rows) -> PagedKV:
    """Writes the host's changed block rows (`ids` `[n]`, `rows` `[n, L * K]`; ids out of
    range: padding) into the device's copy, in place."""
    return dataclasses.replace(pool, block_pages=pool.block_pages.at[ids].set(rows, mode="drop"))


@functools.partial(jax.jit, donate_argnames=("pool",))
def compact(pool: PagedKV, src, table, counts) -> PagedKV:
    """Moves one row's kept tokens into its new prefix, in place: `src` `[G, S]` the pool
    tokens each head keeps, in order; `table` `[W]` the row's new blocks; `counts` `[G]` kept
    per head (G = L * K). Kept token i of head h goes to slot i of its column. Every source is
    read before any destination is written, so a head may compact into its own pages."""
    g, s = src.shape
    page = pool.page_size
    i = jnp.arange(s, dtype=jnp.int32)
    block = table[jnp.minimum(i // page, table.shape[0] - 1)]  # [S]
    dst = pool.block_pages[block[None, :], jnp.arange(g)[:, None]] * page + i % page  # [G, S]
    dst = jnp.where(i < counts[:, None], dst, pool.num_pages * page)
    moved = {n: _flat(getattr(pool, n))[src] for n in pool.token_arrays()}
    return dataclasses.replace(
        pool,
        **{n: scatter_set(_flat(getattr(pool, n)), dst, x).reshape(getattr(pool, n).shape)
           for n, x in moved.items()},
    )  # fmt: skip


@functools.partial(jax.jit, donate_argnames=("pool",))
def write_pages(pool: PagedKV, writes) -> PagedKV:
    """Writes a step's new tokens into their pages, in place: (pool tokens `[B, L, K, T]`, K,
    V `[B, L, K, T, H]`, positions (and fp8 scales) `[B, L, K, T]`); out-of-range tokens are
    dropped. A jit of its own: in the same program as the gathers that read the pool, XLA
    copies the whole pool around the update (measured: 37 ms against 6 ms per step for a
    4,096-page pool)."""
    at, *values = writes
    names = ("k", "v", *_scaled(pool))
    return dataclasses.replace(
        pool,
        **{n: scatter_set(_flat(getattr(pool, n)), at, x).reshape(getattr(pool, n).shape)
           for n, x in zip(names, values, strict=True)},
    )  # fmt: skip


@functools.partial(jax.jit, donate_argnames=("pool",))
def write_mass(pool: PagedKV, at, mass) -> PagedKV:
    """Writes back the attention mass of every token a step's rows hold (H2O accumulates it
    over every query), in place: pool tokens `at` and `mass` `[B, L, K, S]` (slots past a
    head's length have `at` out of range: dropped)."""
    return dataclasses.replace(
        pool, mass=scatter_set(_flat(pool.mass), at, mass).reshape(pool.mass.shape)
    )


def bucket(n: int, low: int = 1) -> int:
    """The power of two >= max(n, low)."""
    return max(low, 1 << max(0, (n - 1).bit_length()))


class RowTables:
    """The page tables of the running sequences on the host, one row each, updated with what
    changed since the last step (vLLM's persistent block table): a decode step appends at most
    one block id per row, a compression rewrites its row once."""

    def __init__(self, rows: int, width: int):
        self.table = np.zeros((rows, width), np.int32)
        self._slot: dict[str, int] = {}
        self._seen: dict[str, tuple[int, int]] = {}  # request id -> (epoch, blocks copied)
        self._free = list(range(rows - 1, -1, -1))

    @property
    def width(self) -> int:
        return self.table.shape[1]

    def sync(self, seq) -> int:
        """`seq`'s row, brought up to date. Returns the row."""
        rid, blocks = seq.request_id, seq.blocks
        if len(blocks) > self.width:
            raise ValueError(f"{len(blocks)} blocks: the table holds {self.width} per row")
        slot = self._slot.get(rid)
        if slot is None:
            if not self._free:
                raise RuntimeError("more running sequences than table rows")
            slot = self._slot[rid] = self._free.pop()
        epoch, n = self._seen.get(rid, (None, 0))
        if epoch != seq.epoch:  # replaced: the whole row again
            self.table[slot, : len(blocks)] = blocks
            self.table[slot, len(blocks) :] = 0
        elif n < len(blocks):
            self.table[slot, n : len(blocks)] = blocks[n:]
        self._seen[rid] = (seq.epoch, len(blocks))
        return slot

    def keep_only(self, request_ids) -> None:
        """Frees the rows of every sequence not in `request_ids` (finished, preempted)."""
        for rid in [r for r in self._slot if r not in request_ids]:
            self._free.append(self._slot.pop(rid))
            self._seen.pop(rid, None)

    def clear(self) -> None:
        self.keep_only(())


def pack(scheduled, row_tables: RowTables, group: int, chunk: int):
    """Host arrays for `paged_step` from scheduled rows: (`Rows`, tokens, n_new, start), rows
    and blocks per row padded to powers of two (padding rows: no tokens), new tokens per row to
    1 (all rows decoding) or `chunk`: two token shapes in all."""
    b = bucket(len(scheduled))
    t = 1 if all(r.n == 1 for r in scheduled) else chunk
    m = bucket(max(len(r.seq.blocks) for r in scheduled))
    slots = [row_tables.sync(r.seq) for r in scheduled]
    tables = np.zeros((b, m), np.int32)
    w = min(m, row_tables.width)
    tables[: len(slots), :w] = row_tables.table[slots, :w]
    base = np.zeros((b, group), np.int32)
    n_prefix, tail = np.zeros((b,), np.int32), np.zeros((b,), np.int32)
    ring = np.zeros((b,), bool)
    tokens = np.zeros((b, t), np.int32)
    n_new, start = np.zeros((b,), np.int32), np.zeros((b,), np.int32)
    for i, r in enumerate(scheduled):
        seq = r.seq
        if seq.compressed:
            base[i], n_prefix[i], ring[i] = seq.base, seq.n_prefix, seq.ring
        tail[i] = seq.tail
        tokens[i, : r.n] = seq.token_slice(r.start, r.n)
        n_new[i], start[i] = r.n, r.start
    return Rows(tables, base, n_prefix, tail, ring), tokens, n_new, start
