"""Attention over the engine's paged pool, in place: each layer writes the step's new K and V
into their pages, then attends through each row's page table (`ragged_attention` of the
backend: no dense copy of a row's context).

The step is one flattened batch of tokens (vLLM v1: no phases): decode rows' single tokens
first, then prefill chunks, row r's tokens at `q_start[r] .. q_start[r] + q_len[r]`. Where a
row's tokens live (`PagedRows`) follows the engine's layout (`jkv.engine.sequence`): its
blocks' pages per (layer, kv head) in `block_pages`, a compressed head's kept tokens below its
`base` count in the first `n_prefix` blocks, everything else (all of an uncompressed row) in the
tail, token t of the tail at slot n_prefix * page_size + t of every head.

The pool travels through the layers as the model's carry (a dict of its arrays, under the layer
scan): a layer's writes are in the pool the next layer reads, and the whole step updates the
donated buffers in place.

Over a mesh (`mesh`: the engine sharded over kv heads), the pool's pages are split in equal
segments, one per "model" device, a kv head's pages in the segment of the device owning the
head (`jkv.engine.page_pool`): each layer's writes and attention run in `shard_map` on every
device's own heads (its share of the query heads, its segment's pages), so no device reads
another's pages.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from jkv import kv as kvlib
from jkv.core.backends import ops
from jkv_kernels import as_narrow_bits, quantize_reference, scatter_set
from jkv_models.llama import rope


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class MassRows:
    """H2O's rows in a step: their queries add the attention they pay each slot to its mass in
    the pool, and a full ring's token overwrites each head's lightest slot (`evict`, the rule
    the engine hands `make_paged_attention`), the rule's settings per row."""

    on: jax.Array  # [R] bool the row's queries add mass (an H2O row)
    evict: jax.Array  # [R] bool its ring is full: its token goes where the rule says, per head
    limit: jax.Array  # [R] int32 its ring's slots
    recent: jax.Array  # [R] int32 H2O's protected recent window
    protect: jax.Array  # [R] int32 its first tokens protected under scorer="importance"
    importance: jax.Array  # [R] bool scorer="importance"


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class PagedRows:
    """Where the step's rows and tokens live (host numpy, traced in the step)."""

    tables: jax.Array  # [R, M] int32 block ids of each row (0: none)
    base: jax.Array  # [R, L * K] int32 compressed: kept tokens per head in the prefix; else 0
    n_prefix: jax.Array  # [R] int32 prefix blocks (0: uncompressed)
    held: jax.Array  # [R] int32 tail tokens after the step (all of an uncompressed row's)
    q_start: jax.Array  # [R] int32 the row's first token in the step
    q_len: jax.Array  # [R] int32 its tokens in the step (0: a padding row)
    tok_row: jax.Array  # [T] int32 each token's row (R: padding)
    tok_slot: jax.Array  # [T] int32 each token's tail slot (n_prefix * page_size + tail index)
    num_decode: jax.Array  # [] int32 rows [0, num_decode) hold one token each
    num_rows: jax.Array  # [] int32 real rows
    # StreamingLLM's rings, None when the step has none: a ring ranks its tokens as contiguous
    # text after its sinks, so its keys below position `sink` are turned on read by `shift`
    # more (stored, like every row's, rotated at their text positions)
    raw: jax.Array | None = None  # [R] bool
    sink: jax.Array | None = None  # [R] int32
    shift: jax.Array | None = None  # [R] int32
    mass: MassRows | None = None  # H2O's rows, None when the step has none
    # The segment rebuild's low-rank pages: the last `lowrank[r]` of row r's prefix blocks
    # (None: a pass over uncompressed rows)
    lowrank: jax.Array | None = None  # [R] int32


def lowrank_rank(page_size: int) -> int:
    """Basis rows of a low-rank page (`jkv.engine.rebuild`); the coefficients of `head_dim`
    tokens take as many rows after them."""
    return page_size // 2


def local_pages(pages, first) -> jax.Array:
    """This device's page ids of global page ids `pages`: its segment starts at page `first`
    (unsharded: 0), the null page 0 is every segment's first page."""
    return jnp.where(pages == 0, 0, pages - first)


def token_pages(pool, rows: PagedRows, heads, first=0) -> jax.Array:
    """`[T, K]` int32 pool token (page * page_size + offset) each new token of kv heads `heads`
    `[K]` (columns of `block_pages`, pages from `first` on) goes to; out of range for padding
    tokens (dropped)."""
    page = pool["k"].shape[1]
    r = jnp.minimum(rows.tok_row, rows.tables.shape[0] - 1)
    col = jnp.clip(rows.tok_slot // page, 0, rows.tables.shape[1] - 1)
    block = rows.tables[r, col]  # [T]
    pages = local_pages(pool["block_pages"][block[:, None], heads[None, :]], first)
    at = pages * page + (rows.tok_slot % page)[:, None]
    real = rows.tok_row < rows.tables.shape[0]
    return jnp.where(real[:, None], at, pool["k"].shape[0] * page)


def head_layout(pool, rows: PagedRows, heads, first=0):
    """(page table `[R, K, M]`, lengths `[R, K]`, gaps `[R, K, 2]`) of kv heads `heads` `[K]`
    after the step's writes: a compressed head's slots from its kept count to the end of the
    prefix hold nothing."""
    page = pool["k"].shape[1]
    table = local_pages(pool["block_pages"][rows.tables][:, :, heads], first)  # [R, M, K]
    prefix = (rows.n_prefix * page)[:, None]  # [R, 1]
    base = rows.base[:, heads]  # [R, K]
    lengths = jnp.broadcast_to(prefix + rows.held[:, None], base.shape)
    gaps = jnp.stack([base, jnp.broadcast_to(prefix, base.shape)], axis=-1)
    return jnp.transpose(table, (0, 2, 1)), lengths, gaps


def head_slots(pool, rows: PagedRows, heads, first=0):
    """(`[R, K, S]` pool token of every slot of each row's kv heads `heads` (S = M * page, out of
    range where the table has no page), `[R, K]` the slots below which they hold tokens after
    the step) of rows that are uncompressed or rings (H2O's)."""
    page = pool["k"].shape[1]
    table = local_pages(pool["block_pages"][rows.tables][:, :, heads], first)  # [R, M, K]
    slot = jnp.arange(table.shape[1] * page)
    at = jnp.transpose(table, (0, 2, 1))[:, :, slot // page] * page + slot % page
    lengths = jnp.where(rows.n_prefix[:, None] > 0, rows.base[:, heads], rows.held[:, None])
    return at, lengths


def accumulate_mass(pool, rows: PagedRows, heads, first, q, positions, kernels, window):
    """The pool with the attention H2O rows' queries (`q` `[T, N, H]` rotated, at `positions`
    `[T]`) pay each of their slots added to its mass (after the step's writes)."""
    mr = rows.mass
    at, lengths = head_slots(pool, rows, heads, first)
    page = pool["k"].shape[1]
    table = at[:, :, ::page] // page  # [R, K, M] the pages
    mass = kernels.paged_window_scores(
        q, pool["k"], table, lengths, rows.q_start, jnp.where(mr.on, rows.q_len, 0), positions,
        pool["positions"], k_scale=pool.get("k_scale"), pool="avg", kernel_size=1,
        window=window,
    )  # fmt: skip
    live = (jnp.arange(at.shape[2]) < lengths[..., None]) & mr.on[:, None, None]
    flat = pool["mass"].reshape(-1)
    flat = flat.at[jnp.where(live, at, flat.shape[0])].add(mass, mode="drop")
    return {**pool, "mass": flat.reshape(pool["mass"].shape)}


def evicting_pages(pool, rows: PagedRows, heads, first, at, positions, evict):
    """`at` `[T, K]` with the token of each full H2O ring sent to the slot `evict` chooses per
    head (the rule over the ring's positions and masses before the write)."""
    mr = rows.mass
    slots, lengths = head_slots(pool, rows, heads, first)
    flat = lambda name: pool[name].reshape(-1)  # noqa: E731
    valid = jnp.arange(slots.shape[2]) < lengths[..., None]
    view = kvlib.LayerKV(k=None, v=None, lengths=lengths,
                         positions=jnp.where(valid, flat("positions")[slots], -1),
                         scores=jnp.where(valid, flat("mass")[slots], 0.0))  # fmt: skip
    q_pos = positions[jnp.minimum(rows.q_start, positions.shape[0] - 1)]  # a ring's one token
    chosen = evict(view, q_pos, mr.limit, recent=mr.recent, protect=mr.protect,
                   importance=mr.importance)  # [R, K]  # fmt: skip
    chosen_at = jnp.take_along_axis(slots, chosen[..., None], axis=-1)[..., 0]
    r = jnp.minimum(rows.tok_row, rows.tables.shape[0] - 1)
    moved = mr.evict[r] & (rows.tok_row < rows.tables.shape[0])
    return jnp.where(moved[:, None], chosen_at[r], at)


def as_bits(pool: dict) -> dict:
    """The pool's 8- and 16-bit float arrays as their bits (uint8, uint16: a free bitcast), the
    rest as they are: what the layers carry. XLA:CPU widens or copies a whole narrow-float buffer
    around a scatter or a gather (an fp8 pool's step grew with the pool: 0.5 s a step for 262K
    demo pages, against 1.5 ms in float32); on integers both run in place. On the CPU only:
    elsewhere the pool is carried as it is (a GPU converts fp8 natively, and a change of carry
    type could cost a copy of the pool at the program's edges, as it does on the CPU)."""
    if jax.default_backend() != "cpu":
        return dict(pool)
    return {n: as_narrow_bits(x) for n, x in pool.items()}


def from_bits(pool: dict, kv_dtype: str) -> dict:
    """`as_bits` undone: the pool's arrays as the kernels read them."""
    floats = {"k": kv_dtype, "v": kv_dtype, "k_scale": kvlib.SCALE_DTYPE,
              "v_scale": kvlib.SCALE_DTYPE}  # fmt: skip
    out = dict(pool)
    for n, dtype in floats.items():
        if n in pool and jnp.dtype(dtype).itemsize <= 2 and pool[n].dtype != jnp.dtype(dtype):
            out[n] = jax.lax.bitcast_convert_type(pool[n], jnp.dtype(dtype))
    return out


def write_tokens(pool, at, k, v, positions, kv_dtype: str):
    """The new tokens (`k`, `v` `[T, K, H]`, `positions` `[T]`) written at pool tokens `at`
    `[T, K]`; fp8 storage gets one bfloat16 scale per token (`kv_quantize`'s rule)."""
    flat = lambda x: x.reshape(x.shape[0] * x.shape[1], *x.shape[2:])  # noqa: E731
    out = dict(pool)

    def put(name, values):  # into a float buffer, or into its bits (`as_bits`)
        buf = flat(pool[name])
        if not jnp.issubdtype(buf.dtype, jnp.floating):
            values = as_narrow_bits(values)
        out[name] = scatter_set(buf, at, values)

    if kv_dtype == "float8_e4m3fn":
        for name, x in (("k", k), ("v", v)):
            values, scales = quantize_reference(
                jnp.swapaxes(x, 0, 1)[None], scale_dtype=kvlib.SCALE_DTYPE
            )  # [1, K, T, H]
            put(name, jnp.swapaxes(values[0], 0, 1))
            put(f"{name}_scale", jnp.swapaxes(scales[0], 0, 1))
    else:
        put("k", k.astype(jnp.dtype(kv_dtype)))
        put("v", v.astype(jnp.dtype(kv_dtype)))
    pos = jnp.broadcast_to(positions[:, None], at.shape)
    out["positions"] = scatter_set(flat(pool["positions"]), at, pos)
    return {n: x.reshape(pool[n].shape) for n, x in out.items()}


def make_paged_attention(
    rows: PagedRows, *, config, backend: str, kv_dtype: str, mesh=None, write: bool = True,
    evict=None, queries: bool | None = None,
):  # fmt: skip
    """The per-layer callable the model calls on the flattened step: rotate q and k at their
    positions, write k and v into the pool (the model's `carry`: a dict of the pool's arrays,
    each layer's call returning the updated one), attend through the rows' page tables.
    `mesh`: the pool is sharded over kv heads on its "model" axis; each device runs its own
    heads. `write=False`: the tokens are in the pool already (a second pass over some of them,
    the engine's selection); nothing is written, and each layer's rotated queries `[T, N, H]`
    are its cache entry (stacked by the model: `[L, T, N, H]`). `evict`: H2O's slot rule
    (`jkv.policies.h2o.lightest_slots`), for a step with H2O's rows (`rows.mass`), whose
    queries also add to the pool's mass. `queries` (default: `not write`): each layer's rotated
    queries are its cache entry, also when writing (KVzip's replay in the engine)."""
    kernels = ops(backend)
    queries = not write if queries is None else queries
    inv_freq = jnp.asarray(config.inv_freq())

    def local(layer, q, k, v, positions, pool, rows):
        """Write and attend on the kv heads `k` holds (all, or this device's share)."""
        q = rope(q, positions[:, :, None], inv_freq)[0]  # [T, N, H]
        k = rope(k, positions[:, :, None], inv_freq)[0]  # [T, K, H]
        # a ring's sinks turned on read to their rank (`jkv_kernels.ragged_paged_attention`)
        rope_args = None if rows.raw is None else (rows.raw, rows.sink, rows.shift, inv_freq)
        d = 0 if mesh is None else jax.lax.axis_index("model")  # this device's heads, pages
        heads = layer * config.num_kv_heads + d * k.shape[1] + jnp.arange(k.shape[1])
        first = d * pool["k"].shape[0]
        # H2O's rows, when the step has any (data: a step without them skips their work)
        heavy = write and rows.mass is not None
        any_heavy = jnp.any(rows.mass.on) if heavy else None
        if write:
            at = token_pages(pool, rows, heads, first)
            if heavy:  # full H2O rings: each head's lightest slot; fresh mass

                def evicting(mass):
                    at_h = evicting_pages({**pool, "mass": mass}, rows, heads, first, at,
                                          positions[0], evict)  # fmt: skip
                    on = rows.mass.on[jnp.minimum(rows.tok_row, rows.tables.shape[0] - 1)]
                    flat = mass.reshape(-1).at[jnp.where(on[:, None], at_h, mass.size)]
                    return at_h, flat.set(0.0, mode="drop").reshape(mass.shape)

                at, mass = jax.lax.cond(any_heavy, evicting, lambda m: (at, m), pool["mass"])
                pool = {**pool, "mass": mass}
            pool = write_tokens(pool, at, k, v[0], positions[0], kv_dtype)
        view = from_bits(pool, kv_dtype)  # the kernels read floats (carried as bits)
        table, lengths, gaps = head_layout(pool, rows, heads, first)
        low = {}  # a rebuilt row's low-rank pages: inside its gap, read as factors
        if rows.lowrank is not None:
            low = dict(lowrank=(rows.n_prefix - rows.lowrank, rows.lowrank),
                       lowrank_rank=lowrank_rank(pool["k"].shape[1]))  # fmt: skip

        def attend(rope_args):
            return kernels.ragged_attention(
                q, view["k"], view["v"], table, lengths, rows.q_start, rows.q_len,
                positions[0], view["positions"], rows.num_decode, rows.num_rows, gaps=gaps,
                k_scale=view.get("k_scale"), v_scale=view.get("v_scale"),
                sliding_window=config.sliding_window, rope=rope_args, weights=True, **low,
            )  # fmt: skip

        if rope_args is None or backend == "xla":  # the XLA path skips it block by block
            out = attend(rope_args)
        else:  # a kernel with the turn on read only in steps that hold a ring past its first
            turns = jnp.any(rows.raw & (rows.shift > 0))  # eviction
            out = jax.lax.cond(turns, lambda: attend(rope_args), lambda: attend(None))
        if heavy:

            def accumulating(mass):
                return accumulate_mass({**view, "mass": mass}, rows, heads, first, q,
                                       positions[0], kernels, config.sliding_window)["mass"]  # fmt: skip

            pool = {**pool, "mass": jax.lax.cond(any_heavy, accumulating, lambda m: m,
                                                 pool["mass"])}  # fmt: skip
        return out[None], pool

    def attention(layer, q, k, v, positions, entry, pool):
        if queries:
            entry = rope(q, positions[:, :, None], inv_freq)[0]
        if mesh is None:
            out, pool = local(layer, q, k, v, positions, pool, rows)
            return out, entry, pool
        heads = P(None, None, "model", None)  # [1, T, N or K, H]
        pages = {n: P() if n == "block_pages" else P("model") for n in pool}
        out, pool = jax.shard_map(
            local,
            mesh=mesh,
            in_specs=(P(), heads, heads, heads, P(), pages, P()),
            out_specs=(heads, pages),
            check_vma=False,
        )(jnp.asarray(layer, jnp.int32), q, k, v, positions, pool, rows)
        return out, entry, pool

    attention.rotates_qk = True
    return attention
