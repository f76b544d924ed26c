"""`window_set`: writing T consecutive slots per (row, kv head) of a cache, in place.

On CPU an 8- or 16-bit float buffer is written with one dynamic_update_slice per (row, head)
(XLA:CPU copies such a buffer around any scatter); elsewhere a scatter. Both are checked
against a numpy loop, and the in-place claim against XLA's own buffer assignment."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jkv import kv as kvlib
from jkv_kernels import quantize_append_xla, window_set, window_set_in_place, window_set_scatter

FP8 = jnp.float8_e4m3fn


def numpy_window_set(buf, start, values, n_new):
    out = np.array(buf, copy=True)
    b, kh, s = out.shape[:3]
    for r in range(b):
        for k in range(kh):
            for t in range(values.shape[2] if n_new is None else int(n_new[r])):
                if start[r, k] + t < s:
                    out[r, k, start[r, k] + t] = values[r, k, t]
    return out


@pytest.mark.parametrize(  # tail (8,): K or V [B, K, S, H]; (): fp8 scales [B, K, S]
    "dtype, tail, t",
    [(jnp.bfloat16, (8,), 5), (FP8, (8,), 16), (FP8, (), 1), (jnp.bfloat16, (), 16),
     (jnp.float32, (8,), 5)],
)  # fmt: skip
def test_every_way_writes_what_numpy_writes(dtype, tail, t):
    rng = np.random.default_rng(t + len(tail))
    b, kh, s = 3, 2, 24
    buf = jnp.asarray(rng.normal(size=(b, kh, s, *tail)), dtype)
    values = jnp.asarray(rng.normal(size=(b, kh, t, *tail)), jnp.float32)
    # starts at 0, inside, and where the window runs past the end (clamped, the rest dropped)
    start = jnp.asarray([[0, s - t], [s - 1, 3], [s - t + 2, s]], jnp.int32)
    for n_new in (None, jnp.asarray([t, 0, max(t - 2, 1)], jnp.int32)):
        want = numpy_window_set(
            np.asarray(buf.astype(jnp.float32)),
            np.asarray(start),
            np.asarray(values.astype(dtype).astype(jnp.float32)),
            None if n_new is None else np.asarray(n_new),
        )
        for fn in (window_set, window_set_in_place, window_set_scatter):
            got = jax.jit(fn)(buf, start, values, n_new)
            assert got.dtype == buf.dtype
            np.testing.assert_array_equal(np.asarray(got.astype(jnp.float32)), want, fn.__name__)


@pytest.mark.parametrize("dtype", ["bfloat16", "float8_e4m3fn"])
def test_an_append_to_a_narrow_cache_makes_no_copy_of_it(dtype):
    """A donated layer gets a chunk of 64 tokens: XLA's temporaries stay far below the layer's
    size (with a scatter, XLA:CPU copied the whole K and V, widened or as their bits)."""
    state = kvlib.init_state(
        num_layers=1, batch=2, num_kv_heads=2, head_dim=32, capacity=4096, dtype=dtype
    )
    quantize = quantize_append_xla if dtype == "float8_e4m3fn" else None

    def append(layer, k, positions, n_new):
        return kvlib.append(layer, k, k, positions, n_new, quantize_append=quantize)

    layer = state.layers[0]
    spec = jax.ShapeDtypeStruct
    compiled = (
        jax.jit(append, donate_argnums=0)
        .lower(
            layer,
            spec((2, 64, 2, 32), jnp.float32),
            spec((2, 64), jnp.int32),
            spec((2,), jnp.int32),
        )  # fmt: skip
        .compile()
    )
    cache = layer.k.nbytes + layer.v.nbytes
    temp = compiled.memory_analysis().temp_size_in_bytes
    assert temp < cache / 8, (temp, cache)


def test_lowers_for_cuda_as_a_scatter():
    spec = jax.ShapeDtypeStruct
    args = (spec((2, 2, 64, 8), jnp.bfloat16), spec((2, 2), jnp.int32),
            spec((2, 2, 4, 8), jnp.float32), spec((2,), jnp.int32))  # fmt: skip
    text = jax.jit(window_set).trace(*args).lower(lowering_platforms=("cuda",)).as_text()
    assert "scatter" in text and "dynamic_update_slice" not in text
