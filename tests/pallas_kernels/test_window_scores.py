"""window_scores (SnapKV voting) against its float32 reference, in interpret mode."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jkv_kernels import window_scores, window_scores_reference

DTYPES = {"f32": np.float32, "bf16": jnp.bfloat16}
TOL = {"f32": 1e-5, "bf16": 1e-2}

# (B, S, G, W, H, dtype, pool, kernel size)
CASES = [
    (3, 100, 4, 8, 64, "f32", "avg", 7),
    (1, 257, 1, 16, 128, "bf16", "max", 5),
    (3, 257, 8, 4, 64, "bf16", "avg", 1),
    (3, 100, 1, 32, 128, "f32", "max", 3),
]


def case_id(b, s, g, w, h, dtype, pool, size):
    return f"B={b}_S={s}_G={g}_W={w}_H={h}_{dtype}_{pool}{size}"


@pytest.mark.parametrize("b,s,g,w,h,dtype,pool,size", CASES, ids=[case_id(*c) for c in CASES])
def test_matches_reference(
    b, s, g, w, h, dtype, pool, size, rng, rel_err, ragged_lengths, poison_past
):
    kh = 2 if b > 1 else 3
    lengths = ragged_lengths(rng, b, kh, s)  # 0 and 1 are shorter than W: missing queries
    q = rng.standard_normal((b, kh * g, w, h)).astype(DTYPES[dtype])
    k = poison_past(rng.standard_normal((b, kh, s, h)).astype(np.float32), lengths)
    k = k.astype(DTYPES[dtype])
    kw = dict(pool=pool, kernel_size=size)
    got = window_scores(q, k, lengths, **kw, block_r=16, block_s=32, num_splits=3, interpret=True)
    want = window_scores_reference(q, k, lengths, **kw)
    got = np.asarray(got)
    assert got.shape == (b, kh, s) and got.dtype == np.float32
    assert not np.isnan(got).any()
    assert rel_err(got, want) <= TOL[dtype]
    assert np.all(got[np.arange(s) >= lengths[..., None]] == 0)
    if size == 1:  # unpooled: every existing query spreads probability 1 over its slots
        np.testing.assert_allclose(got.sum(-1), g * np.minimum(lengths, w), rtol=1e-3)


@pytest.mark.parametrize(
    "change,match",
    [
        (dict(kernel_size=4), "odd"),
        (dict(pool="sum"), "pool"),
        (dict(k=np.zeros((2, 2, 40, 64), jnp.float8_e4m3fn)), "dtype"),
        (dict(q=np.zeros((2, 5, 4, 64), np.float32)), "q.shape"),
        (dict(block_r=8), "block_r"),
        (dict(backend="triton_gpu"), "backend"),
    ],
    ids=["even_kernel", "pool", "fp8", "heads", "block_r", "backend"],
)
def test_rejects_bad_input(change, match):
    args = dict(
        q=np.zeros((2, 8, 4, 64), np.float32),
        k=np.zeros((2, 2, 40, 64), np.float32),
        lengths=np.zeros((2, 2), np.int32),
    )
    args.update((name, change.pop(name)) for name in list(change) if name in args)
    with pytest.raises(ValueError, match=match):
        window_scores(*args.values(), interpret=True, **change)


@pytest.mark.parametrize("pool", ["avg", "max"])
def test_lowers_to_triton(pool, lower_for_cuda):
    spec = jax.ShapeDtypeStruct
    b, kh, g, w, s, h = 1, 8, 4, 32, 4096, 128
    args = (
        spec((b, kh * g, w, h), jnp.bfloat16),
        spec((b, kh, s, h), jnp.bfloat16),
        spec((b, kh), jnp.int32),
    )
    lower_for_cuda(functools.partial(window_scores, pool=pool, interpret=False), *args)
