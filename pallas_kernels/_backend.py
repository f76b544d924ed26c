"""Shared bits of the jkv Pallas kernels: backend switch, Triton params, block sizes, FP8 bits.

Triton's rules, which every kernel here follows:
  * every array value inside a kernel has a power-of-two size;
  * every dimension of a `dot` is at least 16;
  * refs are raw pointers: a load or store past a ragged edge must be masked.

FP8 (E4M3, "fn": no infinities, max 448) is moved through the kernels as its raw uint8 bits and
decoded/encoded with integer ops. Triton casts float8_e4m3fn natively only on sm_89+ (Ada,
Hopper); the bit codec below runs on Ampere too and is bit-exact with `astype`, so the CPU
interpret tests check the very arithmetic the GPU runs.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

try:  # The Triton backend is deprecated from jax 0.11 on and may disappear later.
    from jax.experimental.pallas import triton as plgpu
except ImportError:  # pragma: no cover - depends on the installed jax
    plgpu = None

BACKENDS = ("triton",)
FP8 = jnp.dtype(jnp.float8_e4m3fn)
FP8_MAX = 448.0
# Smallest positive normal float32: the floor of every FP8 scale, so a scale is never zero.
MIN_SCALE = float(jnp.finfo(jnp.float32).tiny)
# Triton's dot needs every dimension >= 16.
MIN_DOT = 16


def check_backend(backend: str) -> None:
    """Raises ValueError unless `backend` names a kernel backend this package implements."""
    if backend == "mosaic_gpu":
        raise ValueError(f"{backend=} is not implemented yet; use backend='triton'")
    if backend not in BACKENDS:
        raise ValueError(f"{backend=} is unknown; expected one of {BACKENDS}")
    if plgpu is None:  # pragma: no cover
        raise ValueError(f"{backend=} needs jax.experimental.pallas.triton ({jax.__version__=})")


def resolve_interpret(interpret: bool | None) -> bool:
    """None means: interpret on CPU (there is no Triton there), compile elsewhere."""
    if interpret is None:
        return jax.default_backend() == "cpu"
    return bool(interpret)


def compiler_params(num_warps: int = 4, num_stages: int = 2):
    return plgpu.CompilerParams(num_warps=num_warps, num_stages=num_stages)


def next_pow2(n: int) -> int:
    """Smallest power of two >= n (1 for n <= 1)."""
    return 1 if n <= 1 else 1 << (int(n) - 1).bit_length()


def is_pow2(n: int) -> bool:
    return n >= 1 and (n & (n - 1)) == 0


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


def block_size(n: int, cap: int, floor: int = 1) -> int:
    """Power-of-two block covering `n` elements, clamped to [floor, cap]."""
    return max(floor, min(cap, next_pow2(n)))


def check_block(name: str, value: int, floor: int = 1) -> None:
    if not is_pow2(value) or value < floor:
        raise ValueError(f"{name}={value} must be a power of two >= {floor}")


def paged_blocks(q_shape, pages_shape, q_tile: int, pages_per_block: int | None) -> int:
    """The key block (slots) of a kernel over the paged pool, `pages_per_block` pages of
    `pages_shape` `[P, page_size, H]` (None: 64 slots' worth) for queries `q_shape` `[T, N, H]`
    tiled by `q_tile`; ValueError naming what Triton's rules refuse."""
    h, page_size = q_shape[2], pages_shape[1]
    if not is_pow2(h) or h < MIN_DOT:
        raise ValueError(f"{q_shape=}: H={h} must be a power of two >= {MIN_DOT}")
    if not is_pow2(page_size):
        raise ValueError(f"{pages_shape=}: page_size={page_size} must be a power of two")
    check_block("q_tile", q_tile)
    if pages_per_block is None:
        pages_per_block = max(1, 64 // page_size)
    block_s = pages_per_block * page_size
    if not is_pow2(block_s) or block_s < MIN_DOT:
        raise ValueError(
            f"{pages_per_block=} * {page_size=} = {block_s} must be a power of two >= {MIN_DOT}"
        )
    return block_s


def dot(a, b, *, trans_b: bool = False):
    """a @ b (or a @ b.T) accumulated in float32; float32 inputs stay IEEE (no TF32)."""
    precision = lax.Precision.HIGHEST if a.dtype == jnp.float32 else None
    # plgpu.dot is the home of the Triton dot from jax 0.10 on; pl.dot before.
    fn = getattr(plgpu, "dot", None) or pl.dot
    return fn(a, b, trans_b=trans_b, precision=precision)


def load(ref, mask=None, other=None):
    return plgpu.load(ref, mask=mask, other=other)


def store(ref, value, mask=None):
    plgpu.store(ref, value, mask=mask)


def debug_barrier():
    """__syncthreads: orders the global-memory accesses of all warps of a program."""
    plgpu.debug_barrier()


def fp8_bits_to_f32(bits):
    """uint8 E4M3 bits -> float32, exact, via the float16 with the same sign/exponent/mantissa.

    E4M3 bits s.eeee.mmm placed at float16 bits s.0eeee.mmm0000000 give the value / 2**8
    (bias 15 vs 7), subnormals included; the float16 -> float32 cast is exact and 2**8 rescales.
    Codes 0x7f/0xff (NaN) decode to 480: the quantiser never writes them.
    """
    b = bits.astype(jnp.uint16)
    half = ((b & 0x80) << 8) | ((b & 0x7F) << 7)
    return lax.bitcast_convert_type(half, jnp.float16).astype(jnp.float32) * 256.0


def f32_to_fp8_bits(y):
    """float32 in [-448, 448] -> uint8 E4M3 bits, rounded to nearest even like `astype`."""
    a = jnp.abs(y)
    sign = (lax.bitcast_convert_type(y, jnp.uint32) >> 24) & 0x80
    # Subnormal range (|y| < 2**-6): the code is round-half-even(|y| * 2**9); 8 is 2**-6 itself.
    t = a * 512.0
    f = jnp.floor(t)
    frac = t - f
    fi = f.astype(jnp.uint32)
    up = (frac > 0.5) | ((frac == 0.5) & ((fi & 1) == 1))
    sub = fi + up.astype(jnp.uint32)
    # Normal range: round the float32 mantissa to 3 bits (half to even), then rebias 127 -> 7.
    u = lax.bitcast_convert_type(a, jnp.uint32)
    rounded = u + 0x7FFFF + ((u >> 20) & 1)
    normal = (rounded >> 20) - (120 << 3)
    code = jnp.where(a < 2.0**-6, sub, normal)
    return (code | sign).astype(jnp.uint8)


# On an H200 (jax 0.11.2) decode attention over an FP8 K of 2**32 elements hit an illegal memory
# access, while 2**31 FP8 elements and 2**32 bfloat16 ones ran (benchmarks/gpu_probe_large.py,
# 2026-11-30; the bitcast alone ran too): the kernels refuse such arrays instead.
MAX_FP8_ELEMENTS = 2**32 - 1


def scatter_set(buf, index, values):
    """`buf.at[index].set(values, mode="drop")` with float storage of 8 or 16 bits moved as its
    bits: XLA:CPU otherwise widens the whole buffer to float32 around a float scatter (a full
    float32 copy of the cache for a write of a few tokens)."""
    values = values.astype(buf.dtype)
    if not jnp.issubdtype(buf.dtype, jnp.floating) or buf.dtype.itemsize > 2:
        return buf.at[index].set(values, mode="drop")
    bits = jnp.uint8 if buf.dtype.itemsize == 1 else jnp.uint16
    out = (
        lax.bitcast_convert_type(buf, bits)
        .at[index]
        .set(lax.bitcast_convert_type(values, bits), mode="drop")
    )
    return lax.bitcast_convert_type(out, buf.dtype)


def window_set(buf, start, values, n_new=None):
    """Writes `values` `[B, K, T, ...]` into `buf` `[B, K, S, ...]` at slots `start[b, k] + t`
    for t < n_new[b] (every t without `n_new`), dropping slots at or past S: the result of
    `scatter_set` for a window of T consecutive slots per (row, kv head).

    On CPU, a window of several tokens (a prefill chunk) into an 8- or 16-bit float buffer is
    written in place (`window_set_in_place`): XLA:CPU copies such a buffer around any scatter
    (widened to float32, or as its bits: a whole copy of the cache per layer for a write of a
    few tokens). One token (a decode step) stays a scatter, copy included: the loop of
    per-(row, head) updates made a bfloat16 decode step 2.3x slower at batch 8. Elsewhere, and
    for wider dtypes, a scatter (`window_set_scatter`, in place)."""
    values = values.astype(buf.dtype)
    narrow = jnp.issubdtype(buf.dtype, jnp.floating) and buf.dtype.itemsize <= 2
    if not narrow or not 1 < values.shape[2] <= buf.shape[2]:
        return window_set_scatter(buf, start, values, n_new)
    return lax.platform_dependent(
        buf, start, values, n_new, cpu=window_set_in_place, default=window_set_scatter
    )


def _window_live(values, n_new):
    b, kh, t = values.shape[:3]
    if n_new is None:
        return jnp.ones((b, kh, t), bool)
    return jnp.arange(t)[None, None, :] < n_new[:, None, None]


def window_set_scatter(buf, start, values, n_new=None):
    """`window_set` as one scatter."""
    b, kh, s = buf.shape[:3]
    t = values.shape[2]
    slots = jnp.where(_window_live(values, n_new), start[:, :, None] + jnp.arange(t), s)
    index = (jnp.arange(b)[:, None, None], jnp.arange(kh)[None, :, None], slots)
    return scatter_set(buf, index, values)


def window_set_in_place(buf, start, values, n_new=None):
    """`window_set` as one `dynamic_update_slice` per (row, head) of the window merged with its
    old contents, read before any write (T <= S): XLA updates the buffer in place."""
    b, kh, s = buf.shape[:3]
    t = values.shape[2]
    start = start.astype(jnp.int32)
    tail = (1,) * (buf.ndim - 3)
    offs = jnp.arange(t, dtype=jnp.int32)
    s0 = jnp.clip(start, 0, s - t)  # the window starts where dynamic_update_slice clamps it
    src = offs + (s0 - start)[:, :, None]  # [B, K, T]: the new token each window slot gets
    idx = jnp.clip(src, 0, t - 1)
    fresh = (src >= 0) & (src < t) & jnp.take_along_axis(_window_live(values, n_new), idx, 2)
    old = jnp.take_along_axis(buf, (s0[:, :, None] + offs).reshape(b, kh, t, *tail), axis=2)
    new = jnp.take_along_axis(values.astype(buf.dtype), idx.reshape(b, kh, t, *tail), axis=2)
    merged = jnp.where(fresh.reshape(b, kh, t, *tail), new, old)
    zeros = (0,) * (buf.ndim - 3)

    def write(i, buf):
        row, head = i // kh, i % kh
        window = lax.dynamic_slice(merged, (row, head, 0, *zeros), (1, 1, *merged.shape[2:]))
        return lax.dynamic_update_slice(buf, window, (row, head, s0[row, head], *zeros))

    return lax.fori_loop(0, b * kh, write, buf)


def narrow_bits(dtype):
    """The unsigned integer type of an 8- or 16-bit float's bits; None for any other dtype."""
    dtype = jnp.dtype(dtype)
    if not jnp.issubdtype(dtype, jnp.floating) or dtype.itemsize > 2:
        return None
    return jnp.uint8 if dtype.itemsize == 1 else jnp.uint16


def as_narrow_bits(x):
    """`x` as its bits if an 8- or 16-bit float (a free bitcast), else as it is."""
    bits = narrow_bits(x.dtype)
    return x if bits is None else lax.bitcast_convert_type(x, bits)


def bits_slice(x, start, n, *, axis):
    """`lax.dynamic_slice_in_dim` with 8- and 16-bit floats sliced as their bits: sliced as
    floats, XLA:CPU widens (and hoists out of a loop) the whole buffer to float32 first."""
    bits = narrow_bits(x.dtype)
    if bits is None:
        return lax.dynamic_slice_in_dim(x, start, n, axis=axis)
    part = lax.dynamic_slice_in_dim(lax.bitcast_convert_type(x, bits), start, n, axis=axis)
    return lax.bitcast_convert_type(part, x.dtype)


def bits_take(x, index):
    """`x[index]` with 8- and 16-bit floats gathered as their bits: gathered as floats, XLA:CPU
    first widens the whole operand (a paged pool: every page, each call) to a wider float."""
    bits = narrow_bits(x.dtype)
    if bits is None:
        return x[index]
    return lax.bitcast_convert_type(lax.bitcast_convert_type(x, bits)[index], x.dtype)


def to_bits(x):
    """FP8 arrays travel as uint8 (a free bitcast); others unchanged."""
    if x.dtype != FP8:
        return x
    if x.size > MAX_FP8_ELEMENTS:
        raise ValueError(
            f"float8_e4m3fn array of shape {x.shape} ({x.size} elements): the kernels take FP8 "
            f"arrays of at most 2**32 - 1 elements (larger ones crashed on a GPU); split the batch"
        )
    return lax.bitcast_convert_type(x, jnp.uint8)


def from_bits(x, dtype):
    return lax.bitcast_convert_type(x, FP8) if jnp.dtype(dtype) == FP8 else x


# --- In-kernel pieces of the attention kernels (flash / flash-decoding) -----------------------


def to_f32(x, fp8: bool):
    """A loaded block as float32: FP8 decoded from its bits, other storage cast."""
    return fp8_bits_to_f32(x) if fp8 else x.astype(jnp.float32)


def visible_slots(valid, pos, qpos, *, causal: bool, window):
    """[bs] slots one query at `qpos` sees: valid, not after it (causal), inside the window."""
    keep = valid
    if causal:
        keep = keep & (pos <= qpos)
    if window:
        keep = keep & (qpos - pos < window)
    return keep


def softmax_start(rows: int, h: int):
    """The online softmax's carry for `rows` query rows: (o [rows, H], max m, sum l)."""
    return (
        jnp.zeros((rows, h), jnp.float32),
        jnp.full((rows,), -jnp.inf, jnp.float32),
        jnp.zeros((rows,), jnp.float32),
    )


def softmax_update(carry, z, values, compute_dtype, value_scale=None):
    """One key block of the online softmax (Milakov & Gimelshein; flash attention).

    carry (o [R, H], m [R], l [R]); z [R, bs] float32 logits, -inf where masked; values [bs, H]
    float32 (0 where dead: masked loads); value_scale [bs] FP8 scales, folded into p so the dot
    reads the decoded bits as they are.
    """
    o, m, lsum = carry
    m_new = jnp.maximum(m, z.max(axis=1))
    m_use = jnp.where(m_new == -jnp.inf, 0.0, m_new)  # all dead so far: keep exp finite
    alpha = jnp.exp(m - m_use)
    p = jnp.exp(z - m_use[:, None])  # [R, bs]
    lsum = alpha * lsum + p.sum(axis=1)
    if value_scale is not None:
        p = p * value_scale[None, :]
    o = alpha[:, None] * o + dot(p.astype(compute_dtype), values.astype(compute_dtype))
    return o, m_new, lsum
