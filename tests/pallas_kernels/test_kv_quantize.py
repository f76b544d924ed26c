"""FP8 quantisation kernels against their references (bit-exact in interpret mode)."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

from jkv_kernels import _backend as bk
from jkv_kernels import (
    dequantize_reference,
    quantize,
    quantize_append,
    quantize_append_reference,
    quantize_reference,
)

FP8 = jnp.float8_e4m3fn
DTYPES = {"f32": np.float32, "bf16": jnp.bfloat16}


def bits(x):
    return np.asarray(x).view(np.uint8)


def test_fp8_bit_codec_matches_astype():
    codes = np.arange(256, dtype=np.uint8)
    want = codes.view(ml_dtypes.float8_e4m3fn).astype(np.float32)
    got = np.asarray(jax.jit(bk.fp8_bits_to_f32)(codes))
    finite = ~np.isnan(want)
    np.testing.assert_array_equal(got[finite], want[finite])
    rng = np.random.default_rng(0)
    ladder = np.sort(want[finite])
    x = np.concatenate(
        [
            ladder,
            (ladder[1:] + ladder[:-1]) / 2,  # ties: round half to even
            rng.uniform(-448, 448, 20000),
            rng.standard_normal(20000) * 2.0**-7,  # subnormal range
            [0.0, -0.0, 448.0, -448.0, 447.99, 2.0**-6, 2.0**-10, 1e-40],
        ]
    ).astype(np.float32)
    got = np.asarray(jax.jit(bk.f32_to_fp8_bits)(x))
    np.testing.assert_array_equal(got, bits(x.astype(ml_dtypes.float8_e4m3fn)))


CASES = [(1, 1, 64, "f32", "f32"), (3, 37, 128, "bf16", "f32"), (3, 100, 64, "f32", "bf16")]


def case_id(b, t, h, dtype, scale):
    return f"B={b}_T={t}_H={h}_{dtype}_scale={scale}"


@pytest.mark.parametrize("b,t,h,dtype,scale", CASES, ids=[case_id(*c) for c in CASES])
def test_quantize_matches_reference(b, t, h, dtype, scale, rng, rel_err, record_property):
    x = (rng.standard_normal((b, 2, t, h)) * rng.uniform(0.01, 100, (b, 2, t, 1))).astype(
        np.float32
    )
    x[0, 0, 0] = 0.0  # all-zero token: tiny scale, zero codes
    if t > 1:
        x[0, 1, 1, 3] = 1e6  # an outlier saturates at 448, never NaN
    x = x.astype(DTYPES[dtype])
    values, scales = quantize(x, scale_dtype=DTYPES[scale], block_t=16, interpret=True)
    ref_values, ref_scales = quantize_reference(x, scale_dtype=DTYPES[scale])
    assert values.dtype == FP8 and values.shape == x.shape
    assert scales.dtype == DTYPES[scale] and scales.shape == x.shape[:3]
    np.testing.assert_array_equal(bits(values), bits(ref_values))
    np.testing.assert_array_equal(np.asarray(scales), np.asarray(ref_scales))
    assert not np.isnan(np.asarray(values).astype(np.float32)).any()
    assert np.asarray(scales).astype(np.float32)[0, 0, 0] == np.float32(bk.MIN_SCALE)
    assert not bits(values)[0, 0, 0].any()
    err = rel_err(dequantize_reference(values, scales), np.asarray(x).astype(np.float32))
    record_property("fp8_quantize_rel_err", err)
    print(f"{case_id(b, t, h, dtype, scale)}: dequantised vs input rel err {err:.4f}")
    assert err <= 0.05


APPEND = [
    (3, 100, 5, 64, "bf16", "f32"),
    (1, 257, 1, 128, "f32", "bf16"),
    (3, 40, 20, 64, "f32", "f32"),
]


@pytest.mark.parametrize(
    "b,s,t,h,dtype,scale",
    APPEND,
    ids=[f"B={c[0]}_S={c[1]}_T={c[2]}_H={c[3]}_{c[4]}_scale={c[5]}" for c in APPEND],
)
def test_quantize_append_matches_reference(b, s, t, h, dtype, scale, rng, ragged_lengths):
    kh = 2 if b > 1 else 3
    cache = np.full((b, kh, s, h), np.nan, np.float32).astype(FP8)  # poisoned: NaN codes
    cache_scale = np.full((b, kh, s), np.nan, DTYPES[scale])
    new = rng.standard_normal((b, kh, t, h)).astype(DTYPES[dtype])
    start = ragged_lengths(rng, b, kh, s)  # 0, 1 and S (no room: everything dropped)
    start.reshape(-1)[-1] = max(s - 2, 0)  # room for two tokens only
    n_new = rng.integers(0, t + 1, b).astype(np.int32)
    n_new[-1] = t
    got = quantize_append(cache, cache_scale, new, start, n_new, block_t=4, interpret=True)
    want = quantize_append_reference(cache, cache_scale, new, start, n_new)
    np.testing.assert_array_equal(bits(got[0]), bits(want[0]))
    f32 = lambda x: np.asarray(x).astype(np.float32)  # NaN == NaN for numpy floats
    np.testing.assert_array_equal(f32(got[1]), f32(want[1]))
    # Exactly the appended slots changed; the rest still holds the poison.
    written = ~np.isnan(np.asarray(got[1]).astype(np.float32))
    slot = np.arange(s)
    n = np.minimum(n_new[:, None, None], s - start[..., None])
    expect = (slot >= start[..., None]) & (slot < start[..., None] + n)
    np.testing.assert_array_equal(written, expect)
    # n_new=None appends all T.
    got_all = quantize_append(cache, cache_scale, new, start, interpret=True)
    want_all = quantize_append_reference(cache, cache_scale, new, start)
    np.testing.assert_array_equal(bits(got_all[0]), bits(want_all[0]))


@pytest.mark.parametrize(
    "call,match",
    [
        (lambda: quantize(np.zeros((2, 2, 4, 48), np.float32)), "power of two"),
        (lambda: quantize(np.zeros((2, 4, 64), np.float32)), "x.shape"),
        (lambda: quantize(np.zeros((2, 2, 4, 64), np.int32)), "x.dtype"),
        (lambda: quantize(np.zeros((2, 2, 4, 64), np.float32), scale_dtype=np.int8), "scale_dtype"),
        (lambda: quantize(np.zeros((2, 2, 4, 64), np.float32), backend="pallas"), "backend"),
        (
            lambda: quantize_append(
                np.zeros((2, 2, 8, 64), np.float32),
                np.zeros((2, 2, 8), np.float32),
                np.zeros((2, 2, 1, 64), np.float32),
                np.zeros((2, 2), np.int32),
            ),
            "float8_e4m3fn",
        ),
        (
            lambda: quantize_append(
                np.zeros((2, 2, 8, 64), FP8),
                np.zeros((2, 2, 8), np.float32),
                np.zeros((2, 2, 1, 64), np.float32),
                np.zeros((2,), np.int32),
            ),
            "start.shape",
        ),
    ],
    ids=["H", "rank", "dtype", "scale_dtype", "backend", "cache_dtype", "start"],
)
def test_rejects_bad_input(call, match):
    with pytest.raises(ValueError, match=match):
        call()


LOWERINGS = ["quantize_bf16", "quantize_f32_scale_bf16", "append_bf16", "append_f32_scale_bf16"]


@pytest.mark.parametrize("config", LOWERINGS)
def test_lowers_to_triton(config, lower_for_cuda):
    spec = jax.ShapeDtypeStruct
    x_dtype = jnp.float32 if "f32" in config else jnp.bfloat16
    scale = jnp.bfloat16 if config.endswith("scale_bf16") else jnp.float32
    b, kh, s, t, h = 2, 8, 1024, 16, 128
    if config.startswith("quantize"):
        fn = functools.partial(quantize, scale_dtype=scale, interpret=False)
        lower_for_cuda(fn, spec((b, kh, t, h), x_dtype))
    else:
        fn = functools.partial(quantize_append, interpret=False)
        args = (
            spec((b, kh, s, h), FP8),
            spec((b, kh, s), scale),
            spec((b, kh, 1, h), x_dtype),
            spec((b, kh), jnp.int32),
            spec((b,), jnp.int32),
        )
        lower_for_cuda(fn, *args)
