"""segment_merge against its reference (bit-exact) and a numpy mean, in interpret mode; lowering."""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jkv_kernels import Merged, quantize_reference, segment_merge, segment_merge_reference

DTYPES = {"f32": np.float32, "bf16": jnp.bfloat16, "fp8": jnp.float8_e4m3fn}
TOL = {"f32": 1e-5, "bf16": 1e-2, "fp8": 0.1}  # against a float64 mean of the stored cache

# (B, S, C, H, dtype, with positions)
CASES = [
    (3, 40, 24, 16, "f32", True),
    (1, 100, 64, 64, "bf16", False),
    (3, 57, 40, 32, "fp8", True),
    (1, 33, 33, 128, "f32", False),
]


def case_id(b, s, c, h, dtype, pos):
    return f"B={b}_S={s}_C={c}_H={h}_{dtype}" + ("_positions" if pos else "")


def make_runs(rng, lengths, c):
    """Runs of 1..3 adjacent valid slots, in order, some output slots left empty (count 0);
    the first (row, kv head) has no runs, the second takes its slots one by one."""
    b, kh = lengths.shape
    starts = np.zeros((b, kh, c), np.int32)
    counts = np.zeros((b, kh, c), np.int32)
    for t, (i, j) in enumerate(np.ndindex(b, kh)):
        if t == 0:
            continue
        src = 0
        for slot in range(c):
            n = 1 if t == 1 else int(rng.integers(1, 4))
            if rng.random() < 0.15 and t != 1:
                src += n  # a gap: those source slots are dropped
                continue
            n = min(n, lengths[i, j] - src)
            if n <= 0:
                break
            starts[i, j, slot], counts[i, j, slot] = src, n
            src += n
    return starts, counts


@pytest.mark.parametrize("b,s,c,h,dtype,pos", CASES, ids=[case_id(*x) for x in CASES])
def test_matches_reference(b, s, c, h, dtype, pos, rng, rel_err, ragged_lengths, poison_past):
    kh = 2 if b > 1 else 3
    lengths = ragged_lengths(rng, b, kh, s)
    lengths[0, 1 % kh] = s  # the exact-cover (row, kv head) uses every slot
    k = poison_past(rng.standard_normal((b, kh, s, h)).astype(np.float32), lengths)
    v = poison_past(rng.standard_normal((b, kh, s, h)).astype(np.float32), lengths)
    kw = {}
    if dtype == "fp8":
        (k, ks), (v, vs) = (quantize_reference(x, scale_dtype=jnp.bfloat16) for x in (k, v))
        kw = dict(k_scale=poison_past(ks, lengths), v_scale=poison_past(vs, lengths))
    else:
        k, v = k.astype(DTYPES[dtype]), v.astype(DTYPES[dtype])
    if pos:
        kw["positions"] = np.broadcast_to(np.arange(s, dtype=np.int32) * 3 + 1, (b, kh, s))
    starts, counts = make_runs(rng, lengths, c)
    got = segment_merge(k, v, starts, counts, **kw, block_c=16, interpret=True)
    want = segment_merge_reference(k, v, starts, counts, **kw)
    assert isinstance(got, Merged)
    for name in Merged._fields:
        g, w = getattr(got, name), getattr(want, name)
        if w is None:
            assert g is None, name
            continue
        g, w = np.asarray(g).astype(np.float32), np.asarray(w).astype(np.float32)
        assert g.shape == w.shape and not np.isnan(g).any(), name
        np.testing.assert_array_equal(g, w, err_msg=name)  # same sums, same order, same storage
    # and against an independent float64 mean of the stored (dequantised) tokens
    kf = np.asarray(k).astype(np.float64)
    if dtype == "fp8":
        kf = kf * np.asarray(ks, np.float64)[..., None]
    mean = np.zeros((b, kh, c, h))
    for i, j, t in np.ndindex(b, kh, c):
        if counts[i, j, t]:
            mean[i, j, t] = kf[i, j, starts[i, j, t] : starts[i, j, t] + counts[i, j, t]].mean(0)
    out_k = np.asarray(got.k).astype(np.float64)
    if dtype == "fp8":
        out_k = out_k * np.asarray(got.k_scale, np.float64)[..., None]
    assert rel_err(out_k, mean) <= TOL[dtype]
    np.testing.assert_array_equal(np.asarray(got.lengths), (counts > 0).sum(-1))
    np.testing.assert_allclose(np.asarray(got.bias), np.log(np.maximum(counts, 1)), rtol=1e-6)
    if pos:
        last = np.where(counts > 0, (starts + counts - 1) * 3 + 1, -1)
        np.testing.assert_array_equal(np.asarray(got.positions), last)


def test_equal_keys_keep_their_softmax_mass(rng):
    """n equal keys merged into one slot with bias log(n) receive exactly their mass."""
    k = np.repeat(rng.standard_normal((1, 1, 1, 16)).astype(np.float32), 3, axis=2)
    k = np.concatenate([k, rng.standard_normal((1, 1, 1, 16)).astype(np.float32)], axis=2)
    out = segment_merge(k, k, np.array([[[0, 3]]]), np.array([[[3, 1]]]), interpret=True)
    q = rng.standard_normal(16).astype(np.float32)
    z_full = k[0, 0] @ q
    z_merged = np.asarray(out.k[0, 0]) @ q + np.asarray(out.bias[0, 0])
    p_full = np.exp(z_full) / np.exp(z_full).sum()
    p_merged = np.exp(z_merged) / np.exp(z_merged).sum()
    assert p_merged[0] == pytest.approx(p_full[:3].sum(), rel=1e-5)
    assert np.asarray(out.bias[0, 0, 0]) == pytest.approx(math.log(3))


def _args():
    k = np.zeros((2, 2, 40, 64), np.float32)
    runs = np.zeros((2, 2, 8), np.int32)
    return dict(k=k, v=k, starts=runs, counts=runs)


@pytest.mark.parametrize(
    "change,match",
    [
        (dict(k=np.zeros((2, 2, 40, 48), np.float32)), r"k.shape"),
        (dict(counts=np.zeros((2, 2, 9), np.int32)), r"counts.shape"),
        (dict(starts=np.zeros((2, 2, 8), np.float32)), r"starts.dtype"),
        (dict(k_scale=np.ones((2, 2, 40), np.float32)), r"FP8 storage needs both scales"),
        (dict(positions=np.zeros((2, 2, 39), np.int32)), r"positions.shape"),
        (dict(block_c=24), r"block_c=24 must be a power of two"),
        (dict(backend="mosaic_gpu"), r"not implemented"),
    ],
    ids=["H", "counts", "starts_dtype", "scales", "positions", "block", "backend"],
)
def test_rejects_bad_input(change, match):
    args = _args()
    for name in list(args):
        args[name] = change.pop(name, args[name])
    with pytest.raises(ValueError, match=match):
        segment_merge(*args.values(), interpret=True, **change)


@pytest.mark.parametrize("dtype", ["bf16", "fp8"])
def test_lowers_to_triton(dtype, lower_for_cuda):
    spec = jax.ShapeDtypeStruct
    b, kh, s, h, c = 2, 8, 1024, 128, 300
    cache = spec((b, kh, s, h), DTYPES[dtype])
    runs = spec((b, kh, c), jnp.int32)
    kw = dict(positions=spec((b, kh, s), jnp.int32))
    if dtype == "fp8":
        kw.update(k_scale=spec((b, kh, s), jnp.bfloat16), v_scale=spec((b, kh, s), jnp.bfloat16))
    lower_for_cuda(
        functools.partial(segment_merge, interpret=False), cache, cache, runs, runs, **kw
    )
