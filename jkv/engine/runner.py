"""The engine's device side: the page pool's arrays and the programs around its one step.

The pool stores exactly its pages: K and V `[P, page_size, H]`, positions (and fp8 scales, and
H2O's attention mass) `[P, page_size]`, page p being one kv head's `page_size` tokens of one
layer, so its bytes are `P x page_bytes` (`jkv.memory.page_bytes`). Beside them, the device's
copy of the block rows (`block_pages [num_blocks, L * K]`, `jkv.engine.page_pool`): a row's
page table is one list of block ids for all its heads, and head h of block b is page
`block_pages[b, h]`.

The step itself is `jkv.engine.ragged.ragged_step` (every row's tokens as one flattened batch,
attention through the page tables in place); here: the pool, the mapping of a row's slots to
pool tokens (`token_index`, the layout of `jkv.engine.sequence`: a compressed prefix with
per-head counts, then the tail; a ring's slots all in its prefix), the compaction and the
block-row updates, each donating the pool so it is updated in place.

The host keeps every running row's table in `RowTables` (vLLM's persistent block table): a
step copies only the blocks added since the last one, so the host's work per step does not
grow with layers x kv heads.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec

from jkv import kv as kvlib
from jkv.engine import programs
from jkv.memory import page_bytes
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


@programs.jit(donate_argnames=("pool",))
def set_rows(pool: PagedKV, ids, rows) -> PagedKV:
    """Writes the host's changed block rows (`ids` `[n]`, `rows` `[n, L * K]`; ids out of
    range: padding) into the device's copy, in place."""
    return dataclasses.replace(pool, block_pages=pool.block_pages.at[ids].set(rows, mode="drop"))


@programs.jit(donate_argnames=("pool",))
def compact(pool: PagedKV, src, table, counts, row=0) -> PagedKV:
    """Moves one row's kept tokens into its new prefix, in place: `src` `[G, S]` the pool
    tokens each head keeps, in order (or `[E, ...]` of E rows' with G * S elements each, of
    which row `row` (traced)); `table` `[W]` the row's new blocks; `counts` `[G]` kept per head
    (G = L * K). Kept token i of head h goes to slot i of its column. Every source is read
    before any destination is written, so a head may compact into its own pages."""
    g = counts.shape[0]
    if src.ndim > 2:  # a selection's output for several rows, as it came
        src = src[row].reshape(g, -1)
    s = src.shape[1]
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


@programs.jit(donate_argnames=("pool",))
def write_context(pool: PagedKV, table, counts, slots: dict) -> PagedKV:
    """Writes a KV context's kept slots into one row's prefix, in place: `slots` its per-slot
    arrays by the pool's names (`k`, `v` `[G, S, H]`, `positions` and fp8 scales `[G, S]`, G =
    L * K heads); `table` `[W]` the row's blocks; `counts` `[G]` the slots each head holds. Slot i
    of head h goes to slot i of its column (`compress`'s layout); H2O's mass starts at zero."""
    g, s = counts.shape[0], slots["positions"].shape[1]
    page = pool.page_size
    i = jnp.arange(s, dtype=jnp.int32)
    block = table[jnp.minimum(i // page, table.shape[0] - 1)]  # [S]
    dst = pool.block_pages[block[None, :], jnp.arange(g)[:, None]] * page + i % page  # [G, S]
    dst = jnp.where(i < counts[:, None], dst, pool.num_pages * page)
    values = dict(slots)
    if pool.mass is not None:
        values["mass"] = jnp.zeros((g, s), jnp.float32)
    return dataclasses.replace(
        pool,
        **{n: scatter_set(_flat(getattr(pool, n)), dst, x).reshape(getattr(pool, n).shape)
           for n, x in values.items()},
    )  # fmt: skip


@programs.jit(static_argnames=("slots",))
def read_row(pool: PagedKV, table, base, n_prefix, tail, *, slots: int) -> dict:
    """One row's held slots of every head, as a dense cache holds them (`jkv.kv.LayerKV`):
    `k`, `v` `[G, slots, H]`, `positions` and fp8 scales `[G, slots]` (G = L * K), slot i of
    head h the i-th it holds (its kept prefix, `base[h]` of them, then its tail of `tail`
    tokens; uncompressed: `base` 0, the tail all of it); past what a head holds, an empty
    slot's values (`jkv.kv_context.SLOT_FIELDS`)."""
    g, page = base.shape[0], pool.page_size
    i = jnp.arange(slots, dtype=jnp.int32)[None, :]  # [1, S]
    b = base[:, None]  # [G, 1]
    logical = jnp.where(i < b, i, n_prefix * page + i - b)
    block = table[jnp.clip(logical // page, 0, table.shape[0] - 1)]  # [G, S]
    tok = pool.block_pages[block, jnp.arange(g)[:, None]] * page + logical % page
    held = i < b + tail
    out = {}
    for name, empty in (("k", 0), ("v", 0), ("positions", -1), ("k_scale", 1), ("v_scale", 1)):
        x = getattr(pool, name)
        if x is None:
            continue
        x = _flat(x)[tok]
        out[name] = jnp.where(
            held[..., None] if x.ndim == 3 else held, x, jnp.array(empty, x.dtype)
        )
    return out


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
        """`seq`'s row (a `Sequence` or a step's `RowPlan`: its request id, blocks and epoch),
        brought up to date. Returns the row."""
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
