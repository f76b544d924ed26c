"""Compaction of the KV cache: gather the kept slots of each (row, kv head) to the front.

A keep selection per (row, kv head) is either
  * a bit-packed mask [B, K, ceil(S/32)] uint32: bit j of word w keeps slot 32*w + j
    (the kernel reads the packed bits directly), or
  * indices [B, K, C] int32: entries outside [0, len) (e.g. -1 or S padding) are skipped; the
    valid ones must be strictly ascending (what `mask_to_indices` and a sorted top-k give).
Either way a slot is kept only if it is also below the input length. Maths, per (b, k):

    kept     = the selected slots s < len[b,k], in ascending order
    new_len  = min(|kept|, C)
    out[i]   = in[kept[i]]      for i < new_len       (K, V, and optionally scales, positions)
    out[i]   = 0 (positions: -1)  for new_len <= i < C

The kernel walks the selection in blocks: exclusive prefix sums of the keep flags give each kept
slot its destination, so one pass gathers and scatters. Destinations never exceed sources and
blocks go in order, so with C == S the outputs alias the inputs (`input_output_aliases`) and
compaction is in place: a block only overwrites slots that earlier blocks, or itself before a
barrier, have already read. The grid is (B, K, H / block_h); per-slot vectors (scales,
positions) are moved by the h == 0 programs.

Bytes per call: read the selection (S/8 or 4*C per (b, k)) + kept slots * (2*H*itemsize + vector
bytes); write C * (2*H*itemsize + vector bytes) per (b, k) (kept slots plus the zero fill).
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from jkv_kernels import _backend as bk


class Compacted(NamedTuple):
    k: jax.Array  # [B, K, C, H]
    v: jax.Array  # [B, K, C, H]
    lengths: jax.Array  # [B, K] int32 = min(kept, C)
    k_scale: jax.Array | None  # [B, K, C] or None
    v_scale: jax.Array | None  # [B, K, C] or None
    positions: jax.Array | None  # [B, K, C] int32 (-1 past the new length) or None


def kv_compact_kernel(*refs, by_mask, n_sel, fills, block_s, barrier):
    n_in = 2 + 2 + len(fills)
    sel_ref = refs[0]  # [ceil(S/32)] uint32 packed keep bits, or [Ci] int32 keep indices
    len_ref = refs[1]  # [] valid input length of this (row, kv head)
    k_ref, v_ref = refs[2], refs[3]  # [S, bh] one column block of K and V
    vec_refs = refs[4:n_in]  # [S] each: k_scale, v_scale, positions (those given)
    ko_ref, vo_ref = refs[n_in], refs[n_in + 1]  # [C, bh] compacted K, V
    vec_out = refs[n_in + 2 :]  # [C] each
    cap = ko_ref.shape[0]
    bh = k_ref.shape[1]
    length = len_ref[()]
    cols = jnp.arange(bh)[None, :]
    lanes = jnp.arange(block_s)
    first_h = pl.program_id(2) == 0

    # Mask mode stops at the length (nothing past it is kept); index mode reads every entry.
    n_blocks = (length + block_s - 1) // block_s if by_mask else bk.cdiv(n_sel, block_s)

    def body(i, base):
        e = i * block_s + lanes  # [bs] entry: slot (mask) or index position (indices)
        live = e < n_sel
        if by_mask:
            words = bk.load(sel_ref.at[e // 32], mask=live, other=0)
            bit = (words >> (e % 32).astype(jnp.uint32)) & 1
            src = e
            ok = live & (bit == 1) & (src < length)
        else:
            src = bk.load(sel_ref.at[pl.ds(i * block_s, block_s)], mask=live, other=-1)
            ok = live & (src >= 0) & (src < length)
        flag = ok.astype(jnp.int32)
        dst = base + jnp.cumsum(flag) - flag  # exclusive prefix: order preserved
        ok = ok & (dst < cap)
        # Dead lanes get distinct out-of-range slots, so no store can collide with a live one.
        src = jnp.where(ok, src, 0)
        dst = jnp.where(ok, dst, cap + lanes)
        k = bk.load(k_ref.at[src[:, None], cols], mask=ok[:, None], other=0)
        v = bk.load(v_ref.at[src[:, None], cols], mask=ok[:, None], other=0)
        vecs = [bk.load(r.at[src], mask=ok & first_h, other=0) for r in vec_refs]
        if barrier:  # in place: every warp reads its slots before any warp overwrites them
            bk.debug_barrier()
        bk.store(ko_ref.at[dst[:, None], cols], k, mask=ok[:, None])
        bk.store(vo_ref.at[dst[:, None], cols], v, mask=ok[:, None])
        for r, x in zip(vec_out, vecs, strict=True):
            bk.store(r.at[dst], x, mask=ok & first_h)
        return base + flag.sum()

    count = jax.lax.fori_loop(0, n_blocks, body, jnp.int32(0))
    new_len = jnp.minimum(count, cap)
    if barrier:
        bk.debug_barrier()

    def fill(i, carry):
        slots = i * block_s + lanes
        dead = (slots >= new_len) & (slots < cap)
        rows = pl.ds(i * block_s, block_s)
        bk.store(ko_ref.at[rows, :], jnp.zeros((block_s, bh), ko_ref.dtype), mask=dead[:, None])
        bk.store(vo_ref.at[rows, :], jnp.zeros((block_s, bh), vo_ref.dtype), mask=dead[:, None])
        for r, pad in zip(vec_out, fills, strict=True):
            bk.store(r.at[rows], jnp.full((block_s,), pad, r.dtype), mask=dead & first_h)
        return carry

    jax.lax.fori_loop(new_len // block_s, bk.cdiv(cap, block_s), fill, 0)


def _validate(k, v, lengths, keep_mask, keep_indices, capacity, vecs):
    if k.ndim != 4 or v.shape != k.shape:
        raise ValueError(f"{k.shape=} {v.shape=}: expected equal [B, K, S, H]")
    if v.dtype != k.dtype:
        raise ValueError(f"{k.dtype=} {v.dtype=}: expected the same storage dtype")
    b, kh, s, h = k.shape
    if not bk.is_pow2(h):
        raise ValueError(f"{k.shape=}: H={h} must be a power of two")
    if lengths.shape != (b, kh) or not jnp.issubdtype(lengths.dtype, jnp.integer):
        raise ValueError(f"{lengths.shape=} {lengths.dtype=}: expected int32 [{b}, {kh}]")
    if (keep_mask is None) == (keep_indices is None):
        raise ValueError("pass exactly one of keep_mask [B, K, ceil(S/32)] and keep_indices")
    if keep_mask is not None:
        if keep_mask.shape != (b, kh, bk.cdiv(s, 32)) or keep_mask.dtype != jnp.uint32:
            raise ValueError(
                f"{keep_mask.shape=} {keep_mask.dtype=}: expected uint32 [{b}, {kh}, "
                f"{bk.cdiv(s, 32)}] (see pack_mask)"
            )
        cap = s if capacity is None else capacity
    else:
        if keep_indices.ndim != 3 or keep_indices.shape[:2] != (b, kh):
            raise ValueError(f"{keep_indices.shape=}: expected [{b}, {kh}, C]")
        if not jnp.issubdtype(keep_indices.dtype, jnp.integer):
            raise ValueError(f"{keep_indices.dtype=}: expected int32")
        cap = keep_indices.shape[2] if capacity is None else capacity
        if cap != keep_indices.shape[2]:
            raise ValueError(f"{capacity=} {keep_indices.shape=}: C must match the indices")
    if not isinstance(cap, int) or not 1 <= cap <= s:
        raise ValueError(f"capacity={cap!r}: expected a static int in [1, S={s}]")
    for name, x in vecs.items():
        if x is not None and x.shape != (b, kh, s):
            raise ValueError(f"{name}.shape={x.shape}: expected [{b}, {kh}, {s}]")
    return cap


@functools.partial(
    jax.jit,
    static_argnames=("capacity", "block_s", "block_h", "num_warps", "backend", "interpret"),
)
def kv_compact(
    k,
    v,
    lengths,
    *,
    keep_mask=None,
    keep_indices=None,
    capacity: int | None = None,
    k_scale=None,
    v_scale=None,
    positions=None,
    block_s: int = 32,
    block_h: int = 64,
    num_warps: int = 4,
    backend: str = "triton",
    interpret: bool | None = None,
) -> Compacted:
    """Moves the kept slots of each (row, kv head) to the front of a cache of capacity C.

    Args:
      k, v: [B, K, S, H] cache, any storage dtype (FP8 included).
      lengths: [B, K] int32 valid input lengths; slots at or past them are never kept.
      keep_mask: [B, K, ceil(S/32)] uint32 packed keep bits (see `pack_mask`), or
      keep_indices: [B, K, C] int32 kept slots, strictly ascending among the valid entries;
        entries outside [0, len) are skipped (pad with -1 or S).
      capacity: output slots C (static); default S for a mask, the indices' C otherwise.
        With C == S the outputs alias the inputs: donate them to compact in place.
      k_scale, v_scale: [B, K, S] optional FP8 scales, moved with their slots.
      positions: [B, K, S] optional int32 original positions, moved with their slots.
      block_s: slots per step (power of two); block_h: columns per program (power of two).
      num_warps: Triton compiler parameter.
      backend: "triton".
      interpret: run in the Pallas interpreter; None means "on CPU".

    Returns:
      `Compacted(k, v, lengths, k_scale, v_scale, positions)`: new lengths = min(kept, C); slots
      past them hold 0 (K, V, scales) and -1 (positions); absent optional arrays stay None.

    Raises:
      ValueError: on a shape, dtype, block size or backend that does not fit.
    """
    bk.check_backend(backend)
    interpret = bk.resolve_interpret(interpret)
    vecs = {"k_scale": k_scale, "v_scale": v_scale, "positions": positions}
    cap = _validate(k, v, lengths, keep_mask, keep_indices, capacity, vecs)
    bk.check_block("block_s", block_s)
    bk.check_block("block_h", block_h)
    b, kh, s, h = k.shape
    block_h = min(block_h, h)
    by_mask = keep_mask is not None
    sel = keep_mask if by_mask else keep_indices.astype(jnp.int32)
    given = [x for x in vecs.values() if x is not None]
    if positions is not None:
        given[-1] = positions.astype(jnp.int32)
    lengths = jnp.clip(lengths.astype(jnp.int32), 0, s)

    per_kv = lambda *blk: pl.BlockSpec((None, None, *blk), lambda i, j, c: (i, j) + (0,) * len(blk))
    cols = lambda n: pl.BlockSpec((None, None, n, block_h), lambda i, j, c: (i, j, 0, c))
    in_specs = [
        per_kv(sel.shape[2]),  # selection of this (row, kv head)
        per_kv(),  # its length
        cols(s),  # K: all slots, one column block
        cols(s),  # V
    ] + [per_kv(s) for _ in given]  # vectors: whole rows (only h == 0 programs write them)
    out_specs = [cols(cap), cols(cap)] + [per_kv(cap) for _ in given]
    out_shape = [jax.ShapeDtypeStruct((b, kh, cap, h), jnp.uint8 if k.dtype == bk.FP8 else k.dtype)]
    out_shape = out_shape * 2 + [jax.ShapeDtypeStruct((b, kh, cap), x.dtype) for x in given]
    # In place when C == S: input 2 + i (K, V, vectors) is output i.
    aliases = {2 + i: i for i in range(len(out_shape))} if cap == s else {}
    kernel = functools.partial(
        kv_compact_kernel,
        by_mask=by_mask,
        n_sel=s if by_mask else sel.shape[2],
        fills=tuple(-1 if name == "positions" else 0 for name, x in vecs.items() if x is not None),
        block_s=block_s,
        barrier=not interpret,
    )
    outs = pl.pallas_call(
        kernel,
        grid=(b, kh, h // block_h),
        in_specs=in_specs,
        out_specs=out_specs,
        out_shape=out_shape,
        input_output_aliases=aliases,
        compiler_params=bk.compiler_params(num_warps, 1),
        interpret=interpret,
        name="jkv_kv_compact",
    )(sel, lengths, bk.to_bits(k), bk.to_bits(v), *given)
    new_k, new_v, *rest = outs
    rest = iter(rest)
    moved = {name: (next(rest) if x is not None else None) for name, x in vecs.items()}
    counts = _kept_counts(lengths, keep_mask, keep_indices, s)
    return Compacted(
        k=bk.from_bits(new_k, k.dtype),
        v=bk.from_bits(new_v, v.dtype),
        lengths=jnp.minimum(counts, cap),
        **moved,
    )


def _kept_counts(lengths, keep_mask, keep_indices, s):
    if keep_mask is not None:
        keep = unpack_mask(keep_mask, s) & (jnp.arange(s) < lengths[..., None])
        return keep.sum(axis=-1, dtype=jnp.int32)
    idx = keep_indices.astype(jnp.int32)
    return ((idx >= 0) & (idx < lengths[..., None])).sum(axis=-1, dtype=jnp.int32)


@jax.jit
def pack_mask(keep):
    """bool [B, K, S] -> uint32 [B, K, ceil(S/32)]; bit j of word w is slot 32*w + j."""
    b, kh, s = keep.shape
    w = bk.cdiv(s, 32)
    bits = jnp.pad(keep.astype(jnp.uint32), ((0, 0), (0, 0), (0, 32 * w - s)))
    bits = bits.reshape(b, kh, w, 32) << jnp.arange(32, dtype=jnp.uint32)
    return jnp.bitwise_or.reduce(bits, axis=-1)


@functools.partial(jax.jit, static_argnames=("s",))
def unpack_mask(words, s: int):
    """uint32 [B, K, ceil(S/32)] -> bool [B, K, S] (inverse of `pack_mask`)."""
    bits = (words[..., None] >> jnp.arange(32, dtype=jnp.uint32)) & 1
    return bits.reshape(*words.shape[:-1], -1)[..., :s].astype(bool)


@functools.partial(jax.jit, static_argnames=("capacity",))
def mask_to_indices(keep, capacity: int):
    """bool [B, K, S] -> int32 [B, K, C]: kept slots ascending, padded with S (stable)."""
    s = keep.shape[-1]
    order = jnp.argsort(~keep, axis=-1, stable=True).astype(jnp.int32)  # kept slots first
    n = keep.sum(axis=-1, keepdims=True)
    idx = jnp.where(jnp.arange(s) < n, order, s)
    if capacity <= s:
        return idx[..., :capacity]
    return jnp.pad(idx, ((0, 0), (0, 0), (0, capacity - s)), constant_values=s)


@functools.partial(jax.jit, static_argnames=("capacity",))
def kv_compact_reference(
    k,
    v,
    lengths,
    *,
    keep_mask=None,
    keep_indices=None,
    capacity: int | None = None,
    k_scale=None,
    v_scale=None,
    positions=None,
) -> Compacted:
    """Plain-jnp `kv_compact` (a gather through a stable argsort of the keep flags)."""
    vecs = {"k_scale": k_scale, "v_scale": v_scale, "positions": positions}
    cap = _validate(k, v, lengths, keep_mask, keep_indices, capacity, vecs)
    b, kh, s, h = k.shape
    lengths = jnp.clip(lengths.astype(jnp.int32), 0, s)
    if keep_mask is not None:
        keep = unpack_mask(keep_mask, s) & (jnp.arange(s) < lengths[..., None])
        src = mask_to_indices(keep, cap)  # [B, K, C], S where nothing is kept
    else:
        idx = keep_indices.astype(jnp.int32)
        ok = (idx >= 0) & (idx < lengths[..., None])
        order = jnp.argsort(~ok, axis=-1, stable=True)
        src = jnp.where(jnp.take_along_axis(ok, order, -1), jnp.take_along_axis(idx, order, -1), s)
    new_len = jnp.minimum(_kept_counts(lengths, keep_mask, keep_indices, s), cap)
    live = jnp.arange(cap) < new_len[..., None]  # [B, K, C]
    src = jnp.where(live, src, 0)

    def gather(x, fill):
        if x is None:
            return None
        g = jnp.take_along_axis(x, src.reshape(*src.shape, *([1] * (x.ndim - 3))), axis=2)
        m = live.reshape(*live.shape, *([1] * (x.ndim - 3)))
        return jnp.where(m, g, jnp.zeros((), x.dtype) + fill)

    return Compacted(
        k=gather(k, 0),
        v=gather(v, 0),
        lengths=new_len,
        k_scale=gather(k_scale, 0),
        v_scale=gather(v_scale, 0),
        positions=gather(None if positions is None else positions.astype(jnp.int32), -1),
    )
