"""lowrank_attention against its reference in interpret mode; joined to decode_attention through
the log-sum-exps it equals one softmax over both parts; CUDA lowering."""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jkv_kernels import (
    combine_attention,
    decode_attention,
    lowrank_attention,
    lowrank_attention_reference,
)

DTYPES = {"f32": np.float32, "bf16": jnp.bfloat16}
TOL = {"f32": 1e-5, "bf16": 1e-2}


def case_id(b, g, m, seg_len, r, h, dtype):
    return f"B={b}_G={g}_M={m}_L={seg_len}_R={r}_H={h}_{dtype}"


# R below 16 and not a power of two: the kernel pads it to 16 columns with masked loads.
CASES = [
    (3, 4, 3, 16, 2, 16, "f32"),
    (1, 7, 2, 32, 20, 64, "bf16"),
    (3, 1, 4, 64, 16, 128, "bf16"),
    (1, 8, 5, 16, 32, 64, "f32"),
]


def make_inputs(rng, b, g, m, seg_len, r, h, dtype):
    """Random factors with ragged counts (0 and L among them) and ranks (0 and R among them);
    NaN planted past every count and rank."""
    kh = 2 if b > 1 else 3
    f = lambda *shape: rng.standard_normal(shape).astype(np.float32) / math.sqrt(shape[-1])
    ck, cv = f(b, kh, m, seg_len, r), f(b, kh, m, seg_len, r)
    bk_, bv = f(b, kh, m, r, h), f(b, kh, m, r, h)
    counts = rng.integers(0, seg_len + 1, (b, kh, m)).astype(np.int32)
    counts.flat[:2] = [0, seg_len]
    rank_k = rng.integers(0, r + 1, (b, kh, m)).astype(np.int32)
    rank_v = rng.integers(0, r + 1, (b, kh, m)).astype(np.int32)
    rank_k.flat[:3] = [r, 0, r]
    past_count = np.arange(seg_len) >= counts[..., None]  # [B, K, M, L]
    for c, rank in ((ck, rank_k), (cv, rank_v)):
        c[past_count] = np.nan
        c[np.arange(r) >= rank[..., None, None] + np.zeros((seg_len, 1))] = np.nan
    for base, rank in ((bk_, rank_k), (bv, rank_v)):
        base[np.arange(r)[:, None] >= rank[..., None, None] + np.zeros((1, h))] = np.nan
    cast = lambda x: np.asarray(x).astype(DTYPES[dtype])
    q = cast(rng.standard_normal((b, kh * g, h)).astype(np.float32))
    pos = np.sort(rng.integers(0, 200, (b, kh, m, seg_len)), -1).astype(np.int32)
    return (q, cast(ck), cast(bk_), cast(cv), cast(bv), counts, rank_k, rank_v), pos


@pytest.mark.parametrize("b,g,m,seg_len,r,h,dtype", CASES, ids=[case_id(*c) for c in CASES])
def test_matches_reference(b, g, m, seg_len, r, h, dtype, rng, rel_err):
    args, _ = make_inputs(rng, b, g, m, seg_len, r, h, dtype)
    out, lse = lowrank_attention(*args, interpret=True)
    ref, ref_lse = lowrank_attention_reference(*args)
    assert out.shape == args[0].shape and out.dtype == jnp.float32 and lse.shape == out.shape[:2]
    assert not np.isnan(np.asarray(out)).any() and not np.isnan(np.asarray(lse)).any()
    assert rel_err(out, ref) <= TOL[dtype]
    live = np.isfinite(np.asarray(ref_lse))
    np.testing.assert_array_equal(np.isfinite(np.asarray(lse)), live)
    np.testing.assert_allclose(np.asarray(lse)[live], np.asarray(ref_lse)[live], atol=TOL[dtype])


def test_sliding_window_and_causal_mask(rng, rel_err):
    args, pos = make_inputs(rng, 3, 4, 3, 16, 8, 64, "f32")
    q_pos = np.array([150, 90, 199], np.int32)
    kw = dict(positions=pos, q_positions=q_pos, sliding_window=60)
    out, lse = lowrank_attention(*args, **kw, interpret=True)
    ref, ref_lse = lowrank_attention_reference(*args, **kw)
    assert rel_err(out, ref) <= 1e-5
    assert rel_err(lowrank_attention_reference(*args)[0], ref) > 1e-3  # the mask masks something


def test_one_softmax_with_decode_attention(rng, rel_err, ragged_lengths):
    """decode_attention (slot biases, lse) + lowrank_attention, combined: exactly the softmax
    over the union of the slots (with their biases) and the reconstructed low-rank tokens."""
    args, _ = make_inputs(rng, 3, 4, 3, 16, 8, 64, "f32")
    q, ck, bk_, cv, bv, counts, rank_k, rank_v = args
    b, kh, s = 3, 2, 50
    k = rng.standard_normal((b, kh, s, 64)).astype(np.float32)
    v = rng.standard_normal((b, kh, s, 64)).astype(np.float32)
    lengths = ragged_lengths(rng, b, kh, s)
    counts[0, 0] = 0  # (0, 0): no slot (length 0) and no low-rank token: output 0
    bias = np.log(rng.integers(1, 4, (b, kh, s))).astype(np.float32)
    out1, lse1 = decode_attention(
        q, k, v, lengths, slot_bias=bias, return_lse=True, block_s=16, interpret=True
    )
    out2, lse2 = lowrank_attention(*args, interpret=True)
    got = np.asarray(combine_attention(out1, lse1, out2, lse2))
    # the dense union in float64
    r_ok = lambda rank: np.arange(8) < rank[..., None]
    expand = lambda c, base, rank: np.einsum(
        "bkmlr,bkmrh->bkmlh",
        np.nan_to_num(np.where(r_ok(rank)[..., None, :], c, 0.0)),
        np.nan_to_num(np.where(r_ok(rank)[..., None], base, 0.0)),
    ).reshape(b, kh, -1, 64)
    keys = np.concatenate([k, expand(ck, bk_, rank_k)], axis=2)
    vals = np.concatenate([v, expand(cv, bv, rank_v)], axis=2)
    valid = np.concatenate(
        [np.arange(s) < lengths[..., None], (np.arange(16) < counts[..., None]).reshape(b, kh, -1)],
        axis=2,
    )
    z = np.einsum("bkgh,bksh->bkgs", q.reshape(b, kh, 4, 64).astype(np.float64), keys) / 8.0
    z = z + np.concatenate([bias, np.zeros((b, kh, 48))], axis=2)[:, :, None]
    z = np.where(valid[:, :, None], z, -np.inf)
    top = np.max(z, -1, keepdims=True)
    e = np.exp(z - np.where(np.isfinite(top), top, 0))
    den = e.sum(-1, keepdims=True)
    want = np.einsum("bkgs,bksh->bkgh", e / np.where(den > 0, den, 1), vals).reshape(b, 8, 64)
    assert not np.isnan(got).any()
    assert rel_err(got, want) <= 1e-5
    assert np.all(got[0, :4] == 0)


@pytest.mark.parametrize(
    "change,match",
    [
        (dict(q=np.zeros((2, 7, 64), np.float32)), r"multiple of K"),
        (dict(coef_k=np.zeros((2, 2, 3, 24, 4)), coef_v=np.zeros((2, 2, 3, 24, 4))), r"L=24"),
        (dict(basis_v=np.zeros((2, 2, 3, 5, 64), np.float32)), r"basis_v.shape"),
        (dict(counts=np.zeros((2, 2), np.int32)), r"counts.shape"),
        (dict(coef_v=np.zeros((2, 2, 3, 16, 4), np.float16)), r"coef_v.dtype"),
        (dict(sliding_window=8), r"q_positions"),
        (dict(backend="mosaic_gpu"), r"not implemented"),
    ],
    ids=["N", "L", "basis", "counts", "dtype", "window", "backend"],
)
def test_rejects_bad_input(change, match):
    c = np.zeros((2, 2, 3, 16, 4), np.float32)
    base = np.zeros((2, 2, 3, 4, 64), np.float32)
    n = np.zeros((2, 2, 3), np.int32)
    args = dict(q=np.zeros((2, 8, 64), np.float32), coef_k=c, basis_k=base, coef_v=c)
    args.update(basis_v=base, counts=n, rank_k=n, rank_v=n)
    for name in list(args):
        args[name] = change.pop(name, args[name])
    with pytest.raises(ValueError, match=match):
        lowrank_attention(*args.values(), interpret=True, **change)


LOWERINGS = {"bf16_R16": (16, False), "f32_R2": (2, False), "bf16_R12_window": (12, True)}


@pytest.mark.parametrize("config", LOWERINGS)
def test_lowers_to_triton(config, lower_for_cuda):
    spec = jax.ShapeDtypeStruct
    b, kh, g, m, seg_len, h = 2, 8, 4, 29, 64, 128
    r, windowed = LOWERINGS[config]
    dtype = jnp.float32 if config.startswith("f32") else jnp.bfloat16
    coef, basis = spec((b, kh, m, seg_len, r), dtype), spec((b, kh, m, r, h), dtype)
    ints = spec((b, kh, m), jnp.int32)
    kw = {}
    if windowed:
        kw = dict(positions=spec((b, kh, m, seg_len), jnp.int32), q_positions=spec((b,), jnp.int32))
    fn = functools.partial(
        lowrank_attention, interpret=False, sliding_window=4096 if windowed else None
    )
    q = spec((b, kh * g, h), dtype)
    lower_for_cuda(fn, q, coef, basis, coef, basis, ints, ints, ints, **kw)
