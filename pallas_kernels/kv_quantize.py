"""FP8 (E4M3) quantisation of new K/V tokens, fused with their append into the cache.

Maths, per row b, kv head k, token t (one scale per token, shared by its H values):

    scale[b,k,t] = max(max_h |x[b,k,t,h]| / 448, tiny)        (tiny: smallest normal float32;
                   rounded to the scale storage dtype, then used as stored)
    q[b,k,t,h]   = e4m3(clip(x[b,k,t,h] / scale[b,k,t], -448, 448))    round to nearest even
    x ~ q.astype(f32) * scale

An all-zero token gets the tiny scale and quantises to zeros; clipping keeps rounding near 448
from producing NaN (E4M3 "fn" has no infinity). `quantize_append` writes token t at slot
start[b,k] + t of the cache, only for t < n_new[b] and slots < S (tokens that would land at or
past S are dropped, never wrapped). The cache and scale buffers are aliased to the outputs
(`input_output_aliases`), so inside a jit that donates them the append happens in place and the
rest of the cache is never touched.

Bytes per call: read B*K*T*H*itemsize(x); write B*K*T*(H + scale itemsize) (values + scales).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from jkv_kernels import _backend as bk

_IN_DTYPES = (jnp.dtype(jnp.float32), jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16))
_SCALE_DTYPES = (jnp.dtype(jnp.float32), jnp.dtype(jnp.bfloat16))


def quantize_block(x, scale_dtype):
    """x [bt, H] -> (uint8 E4M3 bits [bt, H], scale [bt] in scale_dtype)."""
    x = x.astype(jnp.float32)
    absmax = jnp.max(jnp.abs(x), axis=1)
    scale = jnp.maximum(absmax / bk.FP8_MAX, bk.MIN_SCALE).astype(scale_dtype)
    y = x / scale.astype(jnp.float32)[:, None]
    return bk.f32_to_fp8_bits(jnp.clip(y, -bk.FP8_MAX, bk.FP8_MAX)), scale


def quantize_kernel(x_ref, q_ref, s_ref, *, n_tokens: int, block_t: int):
    # x_ref: [bt, H] tokens t0..t0+bt-1 of one (row, kv head); rows >= T are masked
    # q_ref: [bt, H] uint8 E4M3 bits out
    # s_ref: [bt] scales out
    t = pl.program_id(2) * block_t + jnp.arange(block_t)
    ok = t < n_tokens
    bits, scale = quantize_block(bk.load(x_ref, mask=ok[:, None], other=0), s_ref.dtype)
    bk.store(q_ref, bits, mask=ok[:, None])
    bk.store(s_ref, scale, mask=ok)


def quantize_append_kernel(
    cache_in, scale_in, new_ref, start_ref, n_ref, cache_ref, scale_ref, *, n_tokens, block_t
):
    # cache_in, scale_in: aliased to cache_ref, scale_ref; never read (only appended to)
    # new_ref:   [bt, H] new tokens t0..t0+bt-1 of one (row, kv head)
    # start_ref: [] first slot of this (row, kv head)'s new tokens, in [0, S]
    # n_ref:     [] how many of the T tokens of this row are real
    # cache_ref: [S, H] uint8 E4M3 bits of this (row, kv head)
    # scale_ref: [S] per-slot scales of this (row, kv head)
    del cache_in, scale_in
    s_total = cache_ref.shape[0]
    t0 = pl.program_id(2) * block_t
    t = t0 + jnp.arange(block_t)
    start = start_ref[()]
    ok = (t < n_tokens) & (t < n_ref[()]) & (start + t < s_total)
    bits, scale = quantize_block(bk.load(new_ref, mask=ok[:, None], other=0), scale_ref.dtype)
    rows = pl.ds(start + t0, block_t)
    bk.store(cache_ref.at[rows, :], bits, mask=ok[:, None])
    bk.store(scale_ref.at[rows], scale, mask=ok)


def _check_new(x, name="x"):
    if x.ndim != 4:
        raise ValueError(f"{name}.shape={x.shape}: expected [B, K, T, H]")
    if x.dtype not in _IN_DTYPES:
        raise ValueError(f"{name}.dtype={x.dtype}: expected float32, bfloat16 or float16")
    h = x.shape[-1]
    if not bk.is_pow2(h):
        raise ValueError(f"{name}.shape={x.shape}: H={h} must be a power of two")


def _check_scale_dtype(scale_dtype):
    if jnp.dtype(scale_dtype) not in _SCALE_DTYPES:
        raise ValueError(f"{scale_dtype=}: expected float32 or bfloat16")


@functools.partial(
    jax.jit,
    static_argnames=("scale_dtype", "block_t", "num_warps", "num_stages", "backend", "interpret"),
)
def quantize(
    x,
    *,
    scale_dtype=jnp.float32,
    block_t: int = 16,
    num_warps: int = 4,
    num_stages: int = 1,
    backend: str = "triton",
    interpret: bool | None = None,
):
    """Quantises K or V tokens to FP8 E4M3 with one scale per (row, kv head, token).

    Args:
      x: [B, K, T, H] float32/bfloat16/float16.
      scale_dtype: float32 (default) or bfloat16 storage of the scales.
      block_t: tokens per program (power of two).
      num_warps, num_stages: Triton compiler parameters.
      backend: "triton".
      interpret: run in the Pallas interpreter; None means "on CPU".

    Returns:
      (values [B, K, T, H] float8_e4m3fn, scales [B, K, T] scale_dtype).

    Raises:
      ValueError: on a shape, dtype, block size or backend that does not fit.
    """
    bk.check_backend(backend)
    interpret = bk.resolve_interpret(interpret)
    _check_new(x)
    _check_scale_dtype(scale_dtype)
    bk.check_block("block_t", block_t)
    b, kh, t, h = x.shape
    block_t = min(block_t, bk.next_pow2(t))
    grid = (b, kh, bk.cdiv(t, block_t))
    tokens = pl.BlockSpec((None, None, block_t, h), lambda i, j, c: (i, j, c, 0))
    bits, scales = pl.pallas_call(
        functools.partial(quantize_kernel, n_tokens=t, block_t=block_t),
        grid=grid,
        in_specs=[tokens],  # x: a block of tokens of one (row, kv head); ragged edge masked
        out_specs=[tokens, pl.BlockSpec((None, None, block_t), lambda i, j, c: (i, j, c))],
        out_shape=[
            jax.ShapeDtypeStruct(x.shape, jnp.uint8),
            jax.ShapeDtypeStruct((b, kh, t), jnp.dtype(scale_dtype)),
        ],
        compiler_params=bk.compiler_params(num_warps, num_stages),
        interpret=interpret,
        name="jkv_quantize",
    )(x)
    return bk.from_bits(bits, bk.FP8), scales


@functools.partial(
    jax.jit, static_argnames=("block_t", "num_warps", "num_stages", "backend", "interpret")
)
def quantize_append(
    cache,
    cache_scale,
    new,
    start,
    n_new=None,
    *,
    block_t: int = 16,
    num_warps: int = 4,
    num_stages: int = 1,
    backend: str = "triton",
    interpret: bool | None = None,
):
    """Quantises T new tokens and writes them into an FP8 cache at per-(row, kv head) offsets.

    Token t of (b, k) lands at slot start[b, k] + t when t < n_new[b] and the slot is < S;
    other tokens are dropped (never wrapped). Every other slot keeps its value. The cache and
    scale buffers are aliased to the outputs: donate them at the enclosing jit boundary
    (`donate_argnames`) and XLA updates them in place; otherwise XLA copies them first.

    Args:
      cache: [B, K, S, H] float8_e4m3fn.
      cache_scale: [B, K, S] float32 or bfloat16 per-slot scales.
      new: [B, K, T, H] float32/bfloat16/float16 new tokens (pre-quantisation).
      start: [B, K] int32 first slot of the new tokens (usually the current lengths);
        clipped to [0, S].
      n_new: [B] int32 count of real tokens per row (the rest is padding), or None for all T.
      block_t: tokens per program (power of two).
      num_warps, num_stages: Triton compiler parameters.
      backend: "triton".
      interpret: run in the Pallas interpreter; None means "on CPU".

    Returns:
      (cache, cache_scale) updated, same shapes and dtypes.

    Raises:
      ValueError: on a shape, dtype, block size or backend that does not fit.
    """
    bk.check_backend(backend)
    interpret = bk.resolve_interpret(interpret)
    _check_append(cache, cache_scale, new, start, n_new)
    bk.check_block("block_t", block_t)
    b, kh, t, h = new.shape
    s = cache.shape[2]
    block_t = min(block_t, bk.next_pow2(t))
    if n_new is None:
        n_new = jnp.full((b,), t, jnp.int32)
    start = jnp.clip(start.astype(jnp.int32), 0, s)
    whole = lambda *blk: pl.BlockSpec((None, None, *blk), lambda i, j, c: (i, j) + (0,) * len(blk))
    cache_bits, scales = pl.pallas_call(
        functools.partial(quantize_append_kernel, n_tokens=t, block_t=block_t),
        grid=(b, kh, bk.cdiv(t, block_t)),
        in_specs=[
            whole(s, h),  # cache bits (aliased to output 0; only appended slots are written)
            whole(s),  # cache scales (aliased to output 1)
            pl.BlockSpec((None, None, block_t, h), lambda i, j, c: (i, j, c, 0)),  # new tokens
            whole(),  # start: one scalar per (row, kv head)
            pl.BlockSpec((None,), lambda i, j, c: (i,)),  # n_new: one scalar per row
        ],
        out_specs=[whole(s, h), whole(s)],  # the kernel stores at start + t itself
        out_shape=[
            jax.ShapeDtypeStruct(cache.shape, jnp.uint8),
            jax.ShapeDtypeStruct(cache_scale.shape, cache_scale.dtype),
        ],
        input_output_aliases={0: 0, 1: 1},
        compiler_params=bk.compiler_params(num_warps, num_stages),
        interpret=interpret,
        name="jkv_quantize_append",
    )(bk.to_bits(cache), cache_scale, new, start, n_new.astype(jnp.int32))
    return bk.from_bits(cache_bits, bk.FP8), scales


def _check_append(cache, cache_scale, new, start, n_new):
    _check_new(new, "new")
    b, kh, t, h = new.shape
    if cache.ndim != 4 or cache.dtype != bk.FP8 or cache.shape[:2] != (b, kh):
        raise ValueError(
            f"{cache.shape=} {cache.dtype=}: expected float8_e4m3fn [B={b}, K={kh}, S, H={h}]"
        )
    if cache.shape[3] != h:
        raise ValueError(f"{cache.shape=} {new.shape=}: H differs")
    if cache_scale.shape != cache.shape[:3] or cache_scale.dtype not in _SCALE_DTYPES:
        raise ValueError(
            f"{cache_scale.shape=} {cache_scale.dtype=}: expected float32/bfloat16 "
            f"{cache.shape[:3]}"
        )
    if start.shape != (b, kh) or not jnp.issubdtype(start.dtype, jnp.integer):
        raise ValueError(f"{start.shape=} {start.dtype=}: expected int32 [{b}, {kh}]")
    if n_new is not None and (n_new.shape != (b,) or not jnp.issubdtype(n_new.dtype, jnp.integer)):
        raise ValueError(f"{n_new.shape=} {n_new.dtype=}: expected int32 [{b}]")


@functools.partial(jax.jit, static_argnames=("scale_dtype",))
def quantize_reference(x, *, scale_dtype=jnp.float32):
    """Plain-jnp float32 `quantize`: (values float8_e4m3fn, scales scale_dtype)."""
    _check_new(x)
    _check_scale_dtype(scale_dtype)
    x = x.astype(jnp.float32)
    absmax = jnp.max(jnp.abs(x), axis=-1)
    scale = jnp.maximum(absmax / bk.FP8_MAX, bk.MIN_SCALE).astype(scale_dtype)
    y = jnp.clip(x / scale.astype(jnp.float32)[..., None], -bk.FP8_MAX, bk.FP8_MAX)
    return y.astype(bk.FP8), scale


@jax.jit
def dequantize_reference(values, scales):
    """values [..., H] float8_e4m3fn, scales [...] -> float32 values * scales."""
    return values.astype(jnp.float32) * scales.astype(jnp.float32)[..., None]


@jax.jit
def quantize_append_reference(cache, cache_scale, new, start, n_new=None):
    """Plain-jnp `quantize_append` (an XLA scatter that drops out-of-range slots)."""
    _check_append(cache, cache_scale, new, start, n_new)
    b, kh, t, _ = new.shape
    s = cache.shape[2]
    values, scales = quantize_reference(new, scale_dtype=cache_scale.dtype)
    offs = jnp.arange(t, dtype=jnp.int32)
    slots = jnp.clip(start.astype(jnp.int32), 0, s)[:, :, None] + offs  # [B, K, T]
    if n_new is not None:
        slots = jnp.where(offs < n_new[:, None, None], slots, s)
    bi = jnp.arange(b)[:, None, None]
    ki = jnp.arange(kh)[None, :, None]
    cache = bk.scatter_set(cache, (bi, ki, slots), values)
    return cache, bk.scatter_set(cache_scale, (bi, ki, slots), scales)


@jax.jit
def quantize_append_xla(cache, cache_scale, new, start, n_new=None):
    """`quantize_append` on XLA without the kernel: `quantize_append_reference`'s result,
    written with `window_set` (in place on CPU, where a scatter copies an fp8 cache)."""
    _check_append(cache, cache_scale, new, start, n_new)
    values, scales = quantize_reference(new, scale_dtype=cache_scale.dtype)
    start = jnp.clip(start.astype(jnp.int32), 0, cache.shape[2])
    cache = bk.window_set(cache, start, values, n_new)
    return cache, bk.window_set(cache_scale, start, scales, n_new)
