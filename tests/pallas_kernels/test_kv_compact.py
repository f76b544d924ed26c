"""kv_compact against its reference (pure data movement: bit-exact), plus mask helpers."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from jkv_kernels import (
    Compacted,
    kv_compact,
    kv_compact_reference,
    mask_to_indices,
    pack_mask,
    unpack_mask,
)

DTYPES = {"f32": np.float32, "bf16": jnp.bfloat16, "fp8": jnp.float8_e4m3fn}

# (B, S, C, H, dtype, selection, with per-slot vectors); C == S runs in place (aliased).
CASES = [
    (3, 100, 100, 64, "f32", "mask", True),
    (1, 257, 257, 128, "bf16", "mask", False),
    (3, 257, 257, 64, "fp8", "mask", True),
    (3, 100, 64, 128, "bf16", "mask", True),
    (3, 257, 100, 64, "f32", "indices", True),
    (1, 100, 100, 64, "fp8", "indices", False),
]


def case_id(b, s, c, h, dtype, sel, vecs):
    return f"B={b}_S={s}_C={c}_H={h}_{dtype}_by_{sel}" + ("_vectors" if vecs else "")


def f32(x):
    return None if x is None else np.asarray(x).astype(np.float32)


@pytest.mark.parametrize("b,s,c,h,dtype,sel,vecs", CASES, ids=[case_id(*x) for x in CASES])
def test_matches_reference(b, s, c, h, dtype, sel, vecs, rng, ragged_lengths, poison_past):
    kh = 2 if b > 1 else 3
    lengths = ragged_lengths(rng, b, kh, s)
    k = poison_past(rng.standard_normal((b, kh, s, h)).astype(np.float32), lengths)
    v = poison_past(rng.standard_normal((b, kh, s, h)).astype(np.float32), lengths)
    k, v = k.astype(DTYPES[dtype]), v.astype(DTYPES[dtype])
    extra = {}
    if vecs:
        scale = poison_past(rng.uniform(0.1, 1, (b, kh, s)).astype(np.float32), lengths)
        pos = np.broadcast_to(np.arange(s, dtype=np.int32) * 3 + 1, (b, kh, s))
        pos = poison_past(pos, lengths, np.iinfo(np.int32).min)
        extra = dict(k_scale=scale, v_scale=scale * 2, positions=pos)
    keep = rng.random((b, kh, s)) < 0.6
    keep |= np.arange(s) >= lengths[..., None]  # bits past the length are set: must be ignored
    if sel == "mask":
        extra["keep_mask"] = np.asarray(pack_mask(keep))
        extra["capacity"] = c
    else:  # ascending valid slots padded with -1 (and some past-length slots mixed in)
        idx = np.asarray(mask_to_indices(keep, c))
        extra["keep_indices"] = np.where(idx == s, -1, idx).astype(np.int32)
    got = kv_compact(k, v, lengths, **extra, block_s=16, block_h=32, interpret=True)
    want = kv_compact_reference(k, v, lengths, **extra)
    assert isinstance(got, Compacted)
    for name in Compacted._fields:
        g, w = f32(getattr(got, name)), f32(getattr(want, name))
        if w is None:
            assert g is None, name
            continue
        assert g.shape == w.shape, name
        assert not np.isnan(g).any(), name  # poison past the lengths never moved
        np.testing.assert_array_equal(g, w, err_msg=name)
    kept = (keep & (np.arange(s) < lengths[..., None])).sum(-1)
    np.testing.assert_array_equal(np.asarray(got.lengths), np.minimum(kept, c))
    if vecs:  # slots past the new length hold position -1
        dead = np.arange(c) >= np.asarray(got.lengths)[..., None]
        assert np.all(np.asarray(got.positions)[dead] == -1)


@settings(max_examples=8, deadline=None)
@given(st.integers(1, 70), st.integers(0, 2**31 - 1))
def test_mask_helpers_roundtrip(s, seed):
    keep = np.random.default_rng(seed).random((2, 3, s)) < 0.5
    words = pack_mask(keep)
    assert words.shape == (2, 3, -(-s // 32)) and words.dtype == jnp.uint32
    np.testing.assert_array_equal(np.asarray(unpack_mask(words, s)), keep)
    idx = np.asarray(mask_to_indices(keep, s))
    for b, k in np.ndindex(2, 3):
        want = np.flatnonzero(keep[b, k])
        np.testing.assert_array_equal(idx[b, k, : len(want)], want)
        assert np.all(idx[b, k, len(want) :] == s)


def _args():
    k = np.zeros((2, 2, 40, 64), np.float32)
    return k, k, np.zeros((2, 2), np.int32)


@pytest.mark.parametrize(
    "extra,match",
    [
        (dict(), "exactly one"),
        (dict(keep_mask=np.zeros((2, 2, 1), np.uint32)), "keep_mask.shape"),
        (dict(keep_mask=np.zeros((2, 2, 2), np.int32)), "uint32"),
        (dict(keep_mask=np.zeros((2, 2, 2), np.uint32), capacity=41), "capacity"),
        (dict(keep_indices=np.zeros((2, 2, 8), np.int32), capacity=9), "C must match"),
        (dict(keep_indices=np.zeros((2, 2, 8), np.int32), positions=np.zeros((2, 2))), "positions"),
        (dict(keep_indices=np.zeros((2, 2, 8), np.int32), backend="mosaic_gpu"), "implemented"),
    ],
    ids=["no_selection", "mask_shape", "mask_dtype", "capacity", "indices_c", "vector", "backend"],
)
def test_rejects_bad_input(extra, match):
    with pytest.raises(ValueError, match=match):
        kv_compact(*_args(), interpret=True, **extra)


LOWERINGS = ["mask_fp8_in_place_vectors", "mask_bf16_C<S", "indices_bf16_C<S_vectors"]


@pytest.mark.parametrize("config", LOWERINGS)
def test_lowers_to_triton(config, lower_for_cuda):
    spec = jax.ShapeDtypeStruct
    b, kh, s, h, c = 2, 8, 1024, 128, 512
    dtype = jnp.float8_e4m3fn if "fp8" in config else jnp.bfloat16
    kw = {}
    if config.startswith("mask"):
        kw["keep_mask"] = spec((b, kh, s // 32), jnp.uint32)
        fn = functools.partial(kv_compact, capacity=None if "in_place" in config else c)
    else:
        kw["keep_indices"] = spec((b, kh, c), jnp.int32)
        fn = kv_compact
    if config.endswith("vectors"):
        kw.update(
            k_scale=spec((b, kh, s), jnp.float32),
            v_scale=spec((b, kh, s), jnp.float32),
            positions=spec((b, kh, s), jnp.int32),
        )
    cache = spec((b, kh, s, h), dtype)
    lower_for_cuda(
        functools.partial(fn, interpret=False), cache, cache, spec((b, kh), jnp.int32), **kw
    )
