"""The functional KV state: a pytree passed into every model call and returned, never mutated.

One `LayerKV` per layer, so layers may hold different capacities (PyramidKV). Slots are
per (row, kv head): after a policy evicts, kv head 0 of row 1 may hold different tokens than kv
head 1, and `lengths` says how many slots of each are valid (slots 0..len-1). `positions` keeps
the original token position of each slot, which attention masks and RoPE need after eviction.

Bytes: K and V hold `2 * B * S * K * H * itemsize` per layer; fp8 storage adds a
bfloat16 scale per (row, kv head, slot) for each of K and V. `positions` (int32) and `lengths`
are bookkeeping, counted separately, as are the float32 `scores` a policy keeps per slot
(H2O's accumulated attention).

The SnapKV segment rebuild (jkv.policies.segments) adds two optional parts, None otherwise:
a float32 logit `bias` per slot (log of the tokens a merged slot stands for; 0 for ordinary
slots), counted with K and V since attention reads it, and a `LowRank` store of the middle
segments as factors (coefficients and bases, float32 for a float32 cache, bfloat16 otherwise),
also counted with K and V; its token counts, ranks and positions are bookkeeping.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np

from jkv_kernels import mask_to_indices, pack_mask, window_set

KV_DTYPES = ("float32", "bfloat16", "float8_e4m3fn")
SCALE_DTYPE = jnp.bfloat16  # 2 bytes: keeps fp8 KV at ~0.51x bf16 with scales counted
MIN_BUCKET = 16
NO_LIMIT = 2**30  # `KVState.limit` of rows whose policy never evicts
PREFILL_CHUNK = 512  # prompt tokens per prefill model step (a power of two >= MIN_BUCKET)
ATTENTION_BLOCK = 256  # key slots per step of the jnp flash-attention path


def bucket(n: int, low: int = MIN_BUCKET) -> int:
    """Every compiled size (prompt length, cache capacity, decode headroom, an engine step's
    rows) is a power of two, at least `low`: the number of compiled variants grows with
    log(length), not length."""
    return max(low, 1 << (max(int(n), 1) - 1).bit_length())


FINE_ABOVE = 4096  # slots


def capacity_bucket(n: int) -> int:
    """A compressed cache's size: `bucket(n)` up to FINE_ABOVE slots; above, n rounded up to a
    sixteenth of its power of two (8 sizes per octave), so a large budget wastes at most 12.5%
    of its slots instead of up to half, for 8x the compiled variants where they are few."""
    b = bucket(n)
    if b <= FINE_ABOVE:
        return b
    step = b // 16
    return -(-int(n) // step) * step


def fine_bucket(n: int) -> int:
    """n rounded up to an eighth of its power of two (at least 128): 8 sizes per octave, for
    work that a power of two would pad by up to 2x (KVzip's replay, `jkv.replay`)."""
    step = max(128, bucket(n) // 8)
    return -(-max(int(n), 1) // step) * step


def headroom(max_new_tokens: int) -> int:
    """Slots a full cache reserves for decoding `max_new_tokens` (0 for none)."""
    return 0 if max_new_tokens <= 0 else bucket(max_new_tokens)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class LowRank:
    """Low-rank segments of one layer: segment m of (row, kv head) holds count[m] tokens with
    keys ~ coef_k[m] @ basis_k[m] and values ~ coef_v[m] @ basis_v[m] (rank_k / rank_v leading
    columns used; the rest is zero). M, L, R are static; counts and ranks are data."""

    coef_k: jax.Array  # [B, K, M, L, R] float32 or bfloat16
    basis_k: jax.Array  # [B, K, M, R, H]
    coef_v: jax.Array  # [B, K, M, L, R]
    basis_v: jax.Array  # [B, K, M, R, H]
    counts: jax.Array  # [B, K, M] int32 tokens per segment (rows >= count are zero)
    rank_k: jax.Array  # [B, K, M] int32
    rank_v: jax.Array  # [B, K, M] int32
    positions: jax.Array  # [B, K, M, L] int32 original position of each token, -1 past count

    def factor_bytes(self) -> int:
        return int(sum(x.nbytes for x in (self.coef_k, self.basis_k, self.coef_v, self.basis_v)))

    def bookkeeping_bytes(self) -> int:
        return int(sum(x.nbytes for x in (self.counts, self.rank_k, self.rank_v, self.positions)))

    def used_bytes(self, row: int | None = None) -> int:
        """Bytes of the factors at their achieved ranks and counts (of one row, if given)."""
        h = self.basis_k.shape[-1]
        item = self.coef_k.dtype.itemsize
        n = np.asarray(self.counts, np.int64)
        rk, rv = np.asarray(self.rank_k, np.int64), np.asarray(self.rank_v, np.int64)
        if row is not None:
            n, rk, rv = n[row], rk[row], rv[row]
        return int(((n + h) * (rk + rv)).sum()) * item

    def copy(self) -> LowRank:
        return jax.tree.map(lambda x: jnp.array(x, copy=True), self)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class LayerKV:
    """One layer's cache."""

    k: jax.Array  # [B, K, S, H] storage dtype
    v: jax.Array  # [B, K, S, H] storage dtype
    lengths: jax.Array  # [B, K] int32: valid slots are 0..len-1
    positions: jax.Array  # [B, K, S] int32: original token position of each slot
    k_scale: jax.Array | None = None  # [B, K, S] bfloat16, fp8 storage only
    v_scale: jax.Array | None = None  # [B, K, S] bfloat16, fp8 storage only
    scores: jax.Array | None = None  # [B, K, S] float32 policy importance (e.g. H2O's mass)
    bias: jax.Array | None = None  # [B, K, S] float32 logit bias (merged slots: log count)
    lowrank: LowRank | None = None  # the segment rebuild's low-rank middle segments

    @property
    def capacity(self) -> int:
        # positions, not k: a view of scores and positions alone (`jkv.engine.select`) has none
        return self.positions.shape[2]

    def replace(self, **changes) -> LayerKV:
        return dataclasses.replace(self, **changes)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class KVState:
    """The whole model's cache plus the per-row token clock."""

    layers: tuple[LayerKV, ...]  # L entries
    next_position: jax.Array  # [B] int32: position of each row's next token
    # [B] int32: slots a row may hold; an evicting policy frees a slot beyond it (its budget,
    # per row, so a row holds what it would alone); NO_LIMIT for other policies.
    limit: jax.Array
    dtype: str = dataclasses.field(default="float32", metadata=dict(static=True))
    # The KV policy that shaped this state (None: full cache), as compiled functions see it
    # (`KVPolicy.jit_key()`: its budget lives in `limit`); decode steps keep applying it.
    policy: object = dataclasses.field(default=None, metadata=dict(static=True))

    @property
    def batch_size(self) -> int:
        return self.next_position.shape[0]

    def replace(self, **changes) -> KVState:
        return dataclasses.replace(self, **changes)


def dequantised(layer: LayerKV, dtype) -> tuple[jax.Array, jax.Array]:
    """(K, V) `[B, K, S, H]` in `dtype`: fp8 storage times its scales (float32 maths), other
    storage cast. The Pallas kernels do the same on read, in registers."""
    k, v = layer.k, layer.v
    if layer.k_scale is not None:
        k = k.astype(jnp.float32) * layer.k_scale[..., None].astype(jnp.float32)
        v = v.astype(jnp.float32) * layer.v_scale[..., None].astype(jnp.float32)
    return k.astype(dtype), v.astype(dtype)


def validate_kv_dtype(kv_dtype: str) -> str:
    if kv_dtype not in KV_DTYPES:
        raise ValueError(f"kv_dtype={kv_dtype!r} is not supported; expected one of {KV_DTYPES}")
    return kv_dtype


def init_state(
    *,
    num_layers: int,
    batch: int,
    num_kv_heads: int,
    head_dim: int,
    capacity: int | Sequence[int],
    dtype: str,
    scores: bool = False,
    policy=None,
    limit=None,
) -> KVState:
    """An empty state. `capacity` is one S for all layers or one per layer; `scores` adds the
    per-slot float32 score array policies accumulate into; `limit` `[B]` (default NO_LIMIT)."""
    validate_kv_dtype(dtype)
    caps = [capacity] * num_layers if isinstance(capacity, int) else list(capacity)
    if len(caps) != num_layers:
        raise ValueError(f"capacity has {len(caps)} entries; expected one per layer ({num_layers})")
    layers = []
    for s in caps:
        shape = (batch, num_kv_heads, s, head_dim)
        fp8 = dtype == "float8_e4m3fn"
        layers.append(
            LayerKV(
                k=jnp.zeros(shape, dtype),
                v=jnp.zeros(shape, dtype),
                lengths=jnp.zeros(shape[:2], jnp.int32),
                positions=jnp.full(shape[:3], -1, jnp.int32),
                # separate buffers: the state is donated and a buffer cannot be donated twice
                k_scale=jnp.ones(shape[:3], SCALE_DTYPE) if fp8 else None,
                v_scale=jnp.ones(shape[:3], SCALE_DTYPE) if fp8 else None,
                scores=jnp.zeros(shape[:3], jnp.float32) if scores else None,
            )
        )
    return KVState(
        layers=tuple(layers),
        next_position=jnp.zeros((batch,), jnp.int32),
        limit=jnp.full((batch,), NO_LIMIT, jnp.int32) if limit is None else jnp.asarray(limit),
        dtype=dtype,
        policy=policy,
    )


def append(
    layer: LayerKV,
    k_new: jax.Array,
    v_new: jax.Array,
    positions: jax.Array,
    n_new: jax.Array,
    *,
    start: jax.Array | None = None,
    quantize_append=None,
) -> LayerKV:
    """Writes T new tokens (`k_new`, `v_new` `[B, T, K, H]`, `positions` `[B, T]`) into the cache.

    Only the first `n_new[b]` tokens of row b are kept (the rest is padding). They go to slots
    `start[b, k] + t`, by default right after the valid slots (`start=lengths`); an evicting
    policy passes the slot it frees instead. fp8 storage goes through
    `quantize_append(cache, scale, new [B, K, T, H], start [B, K], n_new [B])` (the
    `jkv_kernels.kv_quantize` kernel or its reference), which returns (cache, scale).
    """
    b, t, kh, _ = k_new.shape
    start = layer.lengths if start is None else start
    offs = jnp.arange(t, dtype=jnp.int32)
    live = offs[None, None, :] < n_new[:, None, None]
    slots = jnp.where(live, start[:, :, None] + offs, layer.capacity)  # [B, K, T]; S: dropped
    bi = jnp.arange(b)[:, None, None]
    ki = jnp.arange(kh)[None, :, None]
    k_new = jnp.swapaxes(k_new, 1, 2)  # [B, K, T, H]
    v_new = jnp.swapaxes(v_new, 1, 2)
    changes = {}
    if layer.k_scale is None:
        changes["k"] = window_set(layer.k, start, k_new, n_new)
        changes["v"] = window_set(layer.v, start, v_new, n_new)
    else:
        if quantize_append is None:
            raise ValueError("fp8 KV storage needs a quantize_append function")
        changes["k"], changes["k_scale"] = quantize_append(
            layer.k, layer.k_scale, k_new, start, n_new
        )
        changes["v"], changes["v_scale"] = quantize_append(
            layer.v, layer.v_scale, v_new, start, n_new
        )
    if layer.scores is not None:  # a new token starts with no accumulated score
        changes["scores"] = layer.scores.at[bi, ki, slots].set(0.0, mode="drop")
    if layer.bias is not None:  # a new token is one ordinary slot
        changes["bias"] = layer.bias.at[bi, ki, slots].set(0.0, mode="drop")
    pos = jnp.broadcast_to(positions[:, None, :], slots.shape)
    return dataclasses.replace(
        layer,
        positions=layer.positions.at[bi, ki, slots].set(pos, mode="drop"),
        # Writing over an evicted slot (start < length) leaves the length as it was.
        lengths=jnp.minimum(jnp.maximum(layer.lengths, start + n_new[:, None]), layer.capacity),
        **changes,
    )


def compact(layer: LayerKV, keep: jax.Array, capacity: int, *, compact_fn) -> LayerKV:
    """Keeps the slots where `keep` `[B, K, S]` is true (and below the length), in slot order,
    in a new cache of `capacity` slots: what is dropped is gone from memory.

    The selection travels as a bit-packed mask (one bit per slot) to `compact_fn`, which is
    `jkv_kernels.kv_compact` or its reference; the policy scores and slot biases follow the
    same gather, a low-rank store is kept as it is. A capacity above the current one compacts
    in place, then adds empty slots.
    """
    inner = min(capacity, layer.capacity)
    keep = keep & (jnp.arange(layer.capacity) < layer.lengths[:, :, None])
    out = compact_fn(
        layer.k,
        layer.v,
        layer.lengths,
        keep_mask=pack_mask(keep),
        capacity=inner,
        k_scale=layer.k_scale,
        v_scale=layer.v_scale,
        positions=layer.positions,
    )
    src = mask_to_indices(keep, inner)  # [B, K, C], S where nothing is kept
    live = jnp.arange(inner) < out.lengths[:, :, None]

    def follow(x):
        if x is None:
            return None
        return jnp.where(live, jnp.take_along_axis(x, jnp.minimum(src, layer.capacity - 1), 2), 0.0)

    compacted = LayerKV(
        k=out.k,
        v=out.v,
        lengths=out.lengths,
        positions=out.positions,
        k_scale=out.k_scale,
        v_scale=out.v_scale,
        scores=follow(layer.scores),
        bias=follow(layer.bias),
        lowrank=layer.lowrank,
    )
    return pad_slots(compacted, capacity - inner)


def pad_slots(layer: LayerKV, extra: int) -> LayerKV:
    """The same cache with `extra` more (empty) slots at the end, in new buffers (donating the
    result never consumes `layer`)."""

    def pad(x, fill=0):
        if x is None:
            return None
        widths = [(0, 0)] * x.ndim
        widths[2] = (0, extra)
        return jnp.pad(x, widths, constant_values=fill)

    return LayerKV(
        k=pad(layer.k),
        v=pad(layer.v),
        lengths=jnp.array(layer.lengths, copy=True),
        positions=pad(layer.positions, -1),
        k_scale=pad(layer.k_scale, 1),
        v_scale=pad(layer.v_scale, 1),
        scores=pad(layer.scores),
        bias=pad(layer.bias),
        lowrank=None if layer.lowrank is None else layer.lowrank.copy(),
    )


def with_room(state: KVState, extra: int) -> KVState:
    """The state with `extra` empty slots added to every layer (fresh arrays: the caller's state
    is left intact, so one compressed context can serve many questions)."""
    return state.replace(
        layers=tuple(pad_slots(x, extra) for x in state.layers),
        next_position=jnp.array(state.next_position, copy=True),
        limit=jnp.array(state.limit, copy=True),
    )


def nbytes(state: KVState) -> int:
    """Bytes of K, V and their fp8 scales: the 2 * S * K * H * itemsize per layer and row of the
    allocated state (with the segment rebuild's slot biases and low-rank factors, which attention
    reads as K and V)."""
    total = 0
    for layer in state.layers:
        total += layer.k.nbytes + layer.v.nbytes
        if layer.k_scale is not None:
            total += layer.k_scale.nbytes + layer.v_scale.nbytes
        total += 0 if layer.bias is None else layer.bias.nbytes
        total += 0 if layer.lowrank is None else layer.lowrank.factor_bytes()
    return int(total)


def bookkeeping_bytes(state: KVState) -> int:
    """Bytes of positions, lengths, policy scores and low-rank counts, ranks and positions
    (outside the K/V formula; reported beside it)."""
    total = state.next_position.nbytes
    for layer in state.layers:
        total += layer.positions.nbytes + layer.lengths.nbytes
        total += 0 if layer.scores is None else layer.scores.nbytes
        total += 0 if layer.lowrank is None else layer.lowrank.bookkeeping_bytes()
    return int(total)


def used_bytes(state: KVState, row: int | None = None) -> int:
    """Bytes of the valid slots only (what a perfectly packed cache would hold), of the whole
    batch or of one row; low-rank segments at their achieved ranks and token counts."""
    total = 0
    for layer in state.layers:
        per_slot = 2 * layer.k.shape[-1] * layer.k.dtype.itemsize
        if layer.k_scale is not None:
            per_slot += 2 * layer.k_scale.dtype.itemsize
        per_slot += 0 if layer.bias is None else layer.bias.dtype.itemsize
        lengths = np.asarray(layer.lengths)
        total += int((lengths if row is None else lengths[row]).sum()) * per_slot
        total += 0 if layer.lowrank is None else layer.lowrank.used_bytes(row)
    return total
