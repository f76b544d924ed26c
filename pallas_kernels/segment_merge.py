"""Segment merge (SnapKV segment rebuild): runs of adjacent cache slots become one slot each.

A run is described per output slot c of row b, kv head k by its first source slot and length:
s0 = start[b,k,c], n = count[b,k,c] (n = 0: an empty output slot). Maths:

    out_k[c] = (1/n) * sum_{j<n} K[b,k,s0+j] * k_scale[b,k,s0+j]    (scales: FP8 storage only)
    out_v[c] = (1/n) * sum_{j<n} V[b,k,s0+j] * v_scale[b,k,s0+j]
    bias[c]  = log(n)                                                 (0 for n <= 1)
    pos[c]   = positions[b,k,s0+n-1]        the run's last token: a causal mask stays conservative
    n = 0:     K, V 0, bias 0, position -1

Why log(n): n tokens with equal keys k receive softmax mass n * e^{q.k} = e^{q.k + log n} from a
query q, which is what the mean key with a log(n) logit bias receives: exact for equal keys,
first order otherwise (e^{mean} vs mean of e^). Runs of length 1 copy a slot unchanged, so one
call builds the whole rebuilt cache: kept slots and merged runs, compacted in order.

Output storage is the input's: float32/bfloat16 get the float32 mean cast once; FP8 is
re-quantised with a fresh per-slot scale (`kv_quantize`'s rule) in the same pass. Sums
accumulate in float32 in the order j = 0, 1, ... (the reference adds in the same order).

The grid is (B, K, C / block_c): a program gathers block_c runs, stepping j up to the longest
run of its block with masked row loads.

Bytes per call: read sum(count) * (2*H*itemsize + FP8 scale bytes + 4 positions) + 8*C (runs);
write C * (2*H*itemsize + 4 bias + 4 positions + FP8 scale bytes), per (row, kv head).
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from jkv_kernels import _backend as bk
from jkv_kernels.kv_quantize import quantize_block, quantize_reference

_STORAGE = (jnp.dtype(jnp.float32), jnp.dtype(jnp.bfloat16), bk.FP8)


class Merged(NamedTuple):
    k: jax.Array  # [B, K, C, H] storage dtype
    v: jax.Array  # [B, K, C, H]
    bias: jax.Array  # [B, K, C] float32 log(count), 0 for single and empty slots
    lengths: jax.Array  # [B, K] int32 output slots with count > 0
    k_scale: jax.Array | None  # [B, K, C] FP8 storage only
    v_scale: jax.Array | None  # [B, K, C]
    positions: jax.Array | None  # [B, K, C] int32 last position of each run, -1 if empty


def segment_merge_kernel(*refs, fp8: bool, has_pos: bool, n_slots: int, block_c: int):
    refs = list(refs)
    start_ref = refs.pop(0)  # [bc] first source slot of each run of this block
    count_ref = refs.pop(0)  # [bc] tokens in each run (0: empty output slot)
    k_ref = refs.pop(0)  # [S, H] source keys of one (row, kv head); uint8 bits when FP8
    v_ref = refs.pop(0)  # [S, H] source values, same storage
    ks_ref = refs.pop(0) if fp8 else None  # [S] key scales
    vs_ref = refs.pop(0) if fp8 else None  # [S] value scales
    pos_ref = refs.pop(0) if has_pos else None  # [S] int32 source positions
    ko_ref = refs.pop(0)  # [bc, H] merged keys out
    vo_ref = refs.pop(0)  # [bc, H] merged values out
    bias_ref = refs.pop(0)  # [bc] float32 log(count)
    kso_ref = refs.pop(0) if fp8 else None  # [bc] fresh key scales
    vso_ref = refs.pop(0) if fp8 else None  # [bc] fresh value scales
    poso_ref = refs.pop(0) if has_pos else None  # [bc] int32 last position of each run

    h = k_ref.shape[1]
    c_ok = pl.program_id(2) * block_c + jnp.arange(block_c) < n_slots
    starts = bk.load(start_ref, mask=c_ok, other=0)
    counts = jnp.where(c_ok, bk.load(count_ref, mask=c_ok, other=0), 0)
    cols = jnp.arange(h)[None, :]

    def decode(bits):
        return bk.fp8_bits_to_f32(bits) if fp8 else bits.astype(jnp.float32)

    def body(j, carry):
        ksum, vsum = carry
        ok = j < counts
        src = jnp.where(ok, starts + j, 0)
        kb = decode(bk.load(k_ref.at[src[:, None], cols], mask=ok[:, None], other=0))
        vb = decode(bk.load(v_ref.at[src[:, None], cols], mask=ok[:, None], other=0))
        if fp8:
            kb = kb * bk.load(ks_ref.at[src], mask=ok, other=0).astype(jnp.float32)[:, None]
            vb = vb * bk.load(vs_ref.at[src], mask=ok, other=0).astype(jnp.float32)[:, None]
        return ksum + kb, vsum + vb

    zero = jnp.zeros((block_c, h), jnp.float32)
    ksum, vsum = jax.lax.fori_loop(0, counts.max(), body, (zero, zero))
    n = jnp.maximum(counts, 1).astype(jnp.float32)[:, None]
    kmean, vmean = ksum / n, vsum / n
    if fp8:
        kbits, kscale = quantize_block(kmean, kso_ref.dtype)
        vbits, vscale = quantize_block(vmean, vso_ref.dtype)
        bk.store(ko_ref, kbits, mask=c_ok[:, None])
        bk.store(vo_ref, vbits, mask=c_ok[:, None])
        bk.store(kso_ref, kscale, mask=c_ok)
        bk.store(vso_ref, vscale, mask=c_ok)
    else:
        bk.store(ko_ref, kmean.astype(ko_ref.dtype), mask=c_ok[:, None])
        bk.store(vo_ref, vmean.astype(vo_ref.dtype), mask=c_ok[:, None])
    live = counts > 0
    bias = jnp.where(live, jnp.log(jnp.maximum(counts, 1).astype(jnp.float32)), 0.0)
    bk.store(bias_ref, bias, mask=c_ok)
    if has_pos:
        last = jnp.where(live, starts + counts - 1, 0)
        pos = bk.load(pos_ref.at[last], mask=live, other=-1)
        bk.store(poso_ref, jnp.where(live, pos, -1), mask=c_ok)


def _validate(k, v, starts, counts, k_scale, v_scale, positions):
    if k.ndim != 4 or v.shape != k.shape:
        raise ValueError(f"{k.shape=} {v.shape=}: expected equal [B, K, S, H]")
    if k.dtype not in _STORAGE or v.dtype != k.dtype:
        raise ValueError(f"{k.dtype=} {v.dtype=}: expected one of float32, bfloat16, float8_e4m3fn")
    b, kh, s, h = k.shape
    if not bk.is_pow2(h):
        raise ValueError(f"{k.shape=}: H={h} must be a power of two")
    if starts.ndim != 3 or starts.shape[:2] != (b, kh) or counts.shape != starts.shape:
        raise ValueError(f"{starts.shape=} {counts.shape=}: expected equal [{b}, {kh}, C]")
    for name, x in (("starts", starts), ("counts", counts)):
        if not jnp.issubdtype(x.dtype, jnp.integer):
            raise ValueError(f"{name}.dtype={x.dtype}: expected int32")
    fp8 = k.dtype == bk.FP8
    if fp8 != (k_scale is not None) or fp8 != (v_scale is not None):
        raise ValueError(
            f"{k.dtype=} k_scale={k_scale is not None} v_scale={v_scale is not None}: "
            "FP8 storage needs both scales, other storage neither"
        )
    for name, x in (("k_scale", k_scale), ("v_scale", v_scale), ("positions", positions)):
        if x is not None and x.shape != (b, kh, s):
            raise ValueError(f"{name}.shape={x.shape}: expected [{b}, {kh}, {s}]")
    for name, x in (("k_scale", k_scale), ("v_scale", v_scale)):
        if x is not None and x.dtype not in (jnp.float32, jnp.bfloat16):
            raise ValueError(f"{name}.dtype={x.dtype}: expected float32 or bfloat16")


@functools.partial(
    jax.jit, static_argnames=("block_c", "num_warps", "num_stages", "backend", "interpret")
)
def segment_merge(
    k,
    v,
    starts,
    counts,
    *,
    k_scale=None,
    v_scale=None,
    positions=None,
    block_c: int = 32,
    num_warps: int = 4,
    num_stages: int = 1,
    backend: str = "triton",
    interpret: bool | None = None,
) -> Merged:
    """Merges runs of adjacent slots of a [B, K, S, H] cache into C slots (mean K, V; log bias).

    Args:
      k, v: [B, K, S, H] cache, float32, bfloat16 or float8_e4m3fn.
      starts: [B, K, C] int32 first source slot of each output slot's run.
      counts: [B, K, C] int32 run lengths (0: empty output slot). Runs must lie inside the
        valid slots; live output slots should come first (`lengths` counts them).
      k_scale, v_scale: [B, K, S] float32/bfloat16 scales, exactly for FP8 storage; the output
        scales have the same dtype.
      positions: [B, K, S] optional int32 source positions.
      block_c: output slots per program (power of two).
      num_warps, num_stages: Triton compiler parameters.
      backend: "triton".
      interpret: run in the Pallas interpreter; None means "on CPU".

    Returns:
      `Merged(k, v, bias, lengths, k_scale, v_scale, positions)`, K and V in the input storage.

    Raises:
      ValueError: on a shape, dtype, block size or backend that does not fit.
    """
    bk.check_backend(backend)
    interpret = bk.resolve_interpret(interpret)
    _validate(k, v, starts, counts, k_scale, v_scale, positions)
    bk.check_block("block_c", block_c)
    b, kh, s, h = k.shape
    c = starts.shape[2]
    block_c = min(block_c, bk.next_pow2(c))
    fp8 = k.dtype == bk.FP8
    has_pos = positions is not None
    starts = starts.astype(jnp.int32)
    counts = jnp.maximum(counts.astype(jnp.int32), 0)

    runs = pl.BlockSpec((None, None, block_c), lambda i, j, t: (i, j, t))
    whole = lambda *blk: pl.BlockSpec((None, None, *blk), lambda i, j, t: (i, j) + (0,) * len(blk))
    args = [starts, counts, bk.to_bits(k), bk.to_bits(v)]
    in_specs = [
        runs,  # starts: a block of output slots' runs
        runs,  # counts
        whole(s, h),  # K: the whole (row, kv head); the kernel gathers the runs' rows
        whole(s, h),  # V
    ]
    if fp8:
        args += [k_scale, v_scale]
        in_specs += [whole(s), whole(s)]
    if has_pos:
        args.append(positions.astype(jnp.int32))
        in_specs.append(whole(s))
    slots = pl.BlockSpec((None, None, block_c, h), lambda i, j, t: (i, j, t, 0))
    store = jnp.uint8 if fp8 else k.dtype
    out_shape = [
        jax.ShapeDtypeStruct((b, kh, c, h), store),
        jax.ShapeDtypeStruct((b, kh, c, h), store),
        jax.ShapeDtypeStruct((b, kh, c), jnp.float32),
    ]
    out_specs = [slots, slots, runs]  # merged K, V, bias of a block of output slots
    if fp8:
        out_shape += [jax.ShapeDtypeStruct((b, kh, c), x.dtype) for x in (k_scale, v_scale)]
        out_specs += [runs, runs]
    if has_pos:
        out_shape.append(jax.ShapeDtypeStruct((b, kh, c), jnp.int32))
        out_specs.append(runs)
    outs = pl.pallas_call(
        functools.partial(
            segment_merge_kernel, fp8=fp8, has_pos=has_pos, n_slots=c, block_c=block_c
        ),
        grid=(b, kh, bk.cdiv(c, block_c)),
        in_specs=in_specs,
        out_specs=out_specs,
        out_shape=out_shape,
        compiler_params=bk.compiler_params(num_warps, num_stages),
        interpret=interpret,
        name="jkv_segment_merge",
    )(*args)
    outs = list(outs)
    new_k, new_v, bias = outs.pop(0), outs.pop(0), outs.pop(0)
    ks, vs = (outs.pop(0), outs.pop(0)) if fp8 else (None, None)
    return Merged(
        k=bk.from_bits(new_k, k.dtype),
        v=bk.from_bits(new_v, v.dtype),
        bias=bias,
        lengths=(counts > 0).sum(axis=-1, dtype=jnp.int32),
        k_scale=ks,
        v_scale=vs,
        positions=outs.pop(0) if has_pos else None,
    )


@jax.jit
def segment_merge_reference(
    k, v, starts, counts, *, k_scale=None, v_scale=None, positions=None
) -> Merged:
    """Plain-jnp `segment_merge` (float32 sums in the kernel's order, then the same storage)."""
    _validate(k, v, starts, counts, k_scale, v_scale, positions)
    starts = starts.astype(jnp.int32)
    counts = jnp.maximum(counts.astype(jnp.int32), 0)
    kf, vf = k.astype(jnp.float32), v.astype(jnp.float32)
    if k_scale is not None:
        kf = kf * k_scale.astype(jnp.float32)[..., None]
        vf = vf * v_scale.astype(jnp.float32)[..., None]

    def gather(x, idx):
        return jnp.take_along_axis(x, idx.reshape(*idx.shape, *([1] * (x.ndim - 3))), axis=2)

    def body(j, carry):
        ksum, vsum = carry
        ok = (j < counts)[..., None]
        src = jnp.where(j < counts, starts + j, 0)
        # select, never multiply: a poisoned (NaN) slot outside every run must not leak
        return ksum + jnp.where(ok, gather(kf, src), 0.0), vsum + jnp.where(
            ok, gather(vf, src), 0.0
        )

    zero = jnp.zeros((*starts.shape, k.shape[-1]), jnp.float32)
    ksum, vsum = jax.lax.fori_loop(0, counts.max(), body, (zero, zero))
    n = jnp.maximum(counts, 1).astype(jnp.float32)[..., None]
    kmean, vmean = ksum / n, vsum / n
    ks = vs = None
    if k.dtype == bk.FP8:
        kmean, ks = quantize_reference(kmean, scale_dtype=k_scale.dtype)
        vmean, vs = quantize_reference(vmean, scale_dtype=v_scale.dtype)
    live = counts > 0
    pos = None
    if positions is not None:
        last = gather(positions.astype(jnp.int32), jnp.where(live, starts + counts - 1, 0))
        pos = jnp.where(live, last, -1)
    return Merged(
        k=kmean.astype(k.dtype),
        v=vmean.astype(v.dtype),
        bias=jnp.where(live, jnp.log(jnp.maximum(counts, 1).astype(jnp.float32)), 0.0),
        lengths=live.sum(axis=-1, dtype=jnp.int32),
        k_scale=ks,
        v_scale=vs,
        positions=pos,
    )
