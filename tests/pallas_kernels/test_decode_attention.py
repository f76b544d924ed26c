"""decode_attention against its float32 reference, in interpret mode, plus CUDA lowering."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jkv_kernels import decode_attention, decode_attention_reference, quantize_reference

DTYPES = {"f32": np.float32, "bf16": jnp.bfloat16, "fp8": jnp.float8_e4m3fn}
TOL = {"f32": 1e-5, "bf16": 1e-2, "fp8": 1e-5}  # fp8: against the same quantised cache
FP8_BOUND = 0.1  # fp8 against the unquantised float32 reference


def case_id(b, s, g, h, dtype):
    return f"B={b}_S={s}_G={g}_H={h}_{dtype}"


CASES = [
    (3, 257, 4, 128, "f32"),
    (1, 100, 7, 64, "f32"),  # G=7: a demo preset (14 heads over 2)
    (3, 100, 8, 64, "bf16"),
    (1, 257, 4, 128, "bf16"),
    (3, 100, 1, 128, "bf16"),
    (3, 257, 4, 64, "fp8"),
    (1, 100, 8, 128, "fp8"),
]


def make_inputs(rng, b, s, g, h, dtype, ragged_lengths, poison_past):
    """Random q, cache and lengths (0, 1 and S among them); NaN planted past every length."""
    kh = 2 if b > 1 else 3  # B=1 still gets lengths 0, 1 and S
    q = rng.standard_normal((b, kh * g, h), np.float32)
    k = rng.standard_normal((b, kh, s, h), np.float32)
    v = rng.standard_normal((b, kh, s, h), np.float32)
    lengths = ragged_lengths(rng, b, kh, s)
    exact = dict(k=k, v=v)  # unquantised float32 cache
    scales = {}
    if dtype == "fp8":
        (k, ks), (v, vs) = quantize_reference(k), quantize_reference(v)
        scales = dict(k_scale=poison_past(ks, lengths), v_scale=poison_past(vs, lengths))
    else:
        k, v, q = (np.asarray(x).astype(DTYPES[dtype]) for x in (k, v, q))
    pos = np.sort(rng.integers(0, 4 * s, (b, kh, s)), axis=-1).astype(np.int32)
    return dict(
        q=q,
        k=poison_past(k, lengths),
        v=poison_past(v, lengths),
        lengths=lengths,
        scales=scales,
        exact=exact,
        positions=pos,
    )


@pytest.mark.parametrize("b,s,g,h,dtype", CASES, ids=[case_id(*c) for c in CASES])
def test_matches_reference(
    b, s, g, h, dtype, rng, rel_err, ragged_lengths, poison_past, record_property
):
    x = make_inputs(rng, b, s, g, h, dtype, ragged_lengths, poison_past)
    args = (x["q"], x["k"], x["v"], x["lengths"])
    out = decode_attention(*args, **x["scales"], block_s=32, num_splits=3, interpret=True)
    ref = decode_attention_reference(*args, **x["scales"])
    assert out.shape == x["q"].shape and out.dtype == x["q"].dtype
    assert not np.isnan(np.asarray(out).astype(np.float32)).any()
    assert rel_err(out, ref) <= TOL[dtype]
    # Length-0 (row, kv head) pairs output exactly 0.
    dead = np.repeat(np.asarray(x["lengths"]) == 0, g, axis=1)
    assert np.all(np.asarray(out).astype(np.float32)[dead] == 0)
    if dtype == "fp8":
        exact = decode_attention_reference(x["q"], x["exact"]["k"], x["exact"]["v"], x["lengths"])
        err = rel_err(out, exact)
        record_property("fp8_rel_err", err)
        print(f"{case_id(b, s, g, h, dtype)}: fp8 vs unquantised f32 rel err {err:.4f}")
        assert err <= FP8_BOUND


MASS_CASES = [(3, 257, 4, 64, "f32"), (1, 100, 8, 128, "bf16"), (3, 100, 1, 64, "fp8")]


@pytest.mark.parametrize("b,s,g,h,dtype", MASS_CASES, ids=[case_id(*c) for c in MASS_CASES])
def test_mass(b, s, g, h, dtype, rng, rel_err, ragged_lengths, poison_past):
    x = make_inputs(rng, b, s, g, h, dtype, ragged_lengths, poison_past)
    args = (x["q"], x["k"], x["v"], x["lengths"])
    out, mass = decode_attention(
        *args, **x["scales"], return_mass=True, block_s=16, num_splits=4, interpret=True
    )
    ref, ref_mass = decode_attention_reference(*args, **x["scales"], return_mass=True)
    tol = TOL[dtype] if x["q"].dtype == jnp.float32 else 1e-2
    assert rel_err(out, ref) <= tol
    assert mass.shape == x["lengths"].shape + (s,) and mass.dtype == jnp.float32
    assert not np.isnan(np.asarray(mass)).any()
    assert rel_err(mass, ref_mass) <= tol
    # Each head's probabilities sum to 1, so a group's mass sums to G (0 for empty rows).
    want = np.where(np.asarray(x["lengths"]) > 0, g, 0)
    np.testing.assert_allclose(np.asarray(mass).sum(-1), want, rtol=1e-4, atol=1e-5)
    assert np.all(np.asarray(mass)[np.arange(s) >= np.asarray(x["lengths"])[..., None]] == 0)


def rope_freqs(h):
    return (1.0 / 10000.0 ** (np.arange(0, h, 2) / h)).astype(np.float32)


ROPE_CASES = [(3, 100, 4, 64, "f32"), (1, 257, 8, 128, "bf16"), (3, 100, 4, 16, "f32")]


@pytest.mark.parametrize("b,s,g,h,dtype", ROPE_CASES, ids=[case_id(*c) for c in ROPE_CASES])
def test_rope_on_read(b, s, g, h, dtype, rng, rel_err, ragged_lengths, poison_past):
    x = make_inputs(rng, b, s, g, h, dtype, ragged_lengths, poison_past)
    args = (x["q"], x["k"], x["v"], x["lengths"])
    kw = dict(positions=x["positions"], rope_inv_freq=rope_freqs(h))
    out = decode_attention(*args, **kw, block_s=32, interpret=True)
    ref = decode_attention_reference(*args, **kw)
    assert rel_err(out, ref) <= TOL[dtype]
    # Rotating the keys must matter: the unrotated reference is far away.
    assert rel_err(decode_attention_reference(*args), ref) > 5 * TOL[dtype]


def test_sliding_window(rng, rel_err, ragged_lengths, poison_past):
    x = make_inputs(rng, 3, 257, 4, 64, "f32", ragged_lengths, poison_past)
    args = (x["q"], x["k"], x["v"], x["lengths"])
    q_pos = x["positions"].max(axis=(1, 2)) - 3  # the newest slots are "in the future"
    kw = dict(positions=x["positions"], q_positions=q_pos, sliding_window=200)
    out = decode_attention(*args, **kw, block_s=32, num_splits=2, interpret=True)
    ref = decode_attention_reference(*args, **kw)
    assert rel_err(out, ref) <= 1e-5
    assert rel_err(decode_attention_reference(*args), ref) > 1e-3  # the window masks something


@pytest.mark.parametrize("native", [False, True], ids=["fp8_bits", "fp8_native"])
def test_everything_at_once_fp8(native, rng, rel_err, ragged_lengths, poison_past, record_property):
    """FP8 storage + RoPE on read + sliding window + mass: the H2O/StreamingLLM decode path,
    with FP8 decoded from its bits or loaded as float8 (fp8_native)."""
    x = make_inputs(rng, 3, 100, 4, 64, "fp8", ragged_lengths, poison_past)
    args = (x["q"], x["k"], x["v"], x["lengths"])
    q_pos = x["positions"].max(axis=(1, 2))
    kw = dict(
        positions=x["positions"],
        q_positions=q_pos,
        sliding_window=150,
        rope_inv_freq=rope_freqs(64),
    )
    out, mass = decode_attention(
        *args, **x["scales"], **kw, return_mass=True, fp8_native=native, interpret=True
    )
    ref, ref_mass = decode_attention_reference(*args, **x["scales"], **kw, return_mass=True)
    assert rel_err(out, ref) <= 1e-5 and rel_err(mass, ref_mass) <= 1e-5
    exact = decode_attention_reference(x["q"], x["exact"]["k"], x["exact"]["v"], x["lengths"], **kw)
    err = rel_err(out, exact)
    record_property("fp8_rel_err_rope_window", err)
    print(f"fp8 + rope + window vs unquantised f32 rel err {err:.4f}")
    assert err <= FP8_BOUND


BIAS_CASES = [(3, 100, 4, 64, "f32"), (1, 257, 8, 128, "bf16"), (3, 100, 1, 64, "fp8")]


@pytest.mark.parametrize("b,s,g,h,dtype", BIAS_CASES, ids=[case_id(*c) for c in BIAS_CASES])
def test_slot_bias_and_lse(b, s, g, h, dtype, rng, rel_err, ragged_lengths, poison_past):
    """Merged slots' log-count biases join the logits; lse is the log-sum-exp of each head's."""
    x = make_inputs(rng, b, s, g, h, dtype, ragged_lengths, poison_past)
    args = (x["q"], x["k"], x["v"], x["lengths"])
    bias = poison_past(np.log(rng.integers(1, 4, x["lengths"].shape + (s,))), x["lengths"])
    kw = dict(**x["scales"], slot_bias=bias.astype(np.float32))
    out, mass, lse = decode_attention(
        *args, **kw, return_mass=True, return_lse=True, block_s=16, num_splits=3, interpret=True
    )
    ref, ref_mass, ref_lse = decode_attention_reference(
        *args, **kw, return_mass=True, return_lse=True
    )
    tol = TOL[dtype] if x["q"].dtype == jnp.float32 else 1e-2
    assert not np.isnan(np.asarray(lse)).any() and lse.shape == x["q"].shape[:2]
    assert rel_err(out, ref) <= tol and rel_err(mass, ref_mass) <= tol
    live = np.repeat(np.asarray(x["lengths"]) > 0, g, axis=1)
    np.testing.assert_array_equal(np.isfinite(np.asarray(lse)), live)
    np.testing.assert_allclose(np.asarray(lse)[live], np.asarray(ref_lse)[live], atol=tol)
    # the bias matters, and lse alone (no mass) gives the same numbers
    assert rel_err(decode_attention_reference(*args, **x["scales"]), ref) > 2 * tol
    out2, lse2 = decode_attention(*args, **kw, return_lse=True, block_s=16, interpret=True)
    assert rel_err(out2, ref) <= tol
    np.testing.assert_allclose(np.asarray(lse2)[live], np.asarray(ref_lse)[live], atol=tol)


def _small():
    q = np.zeros((2, 8, 64), np.float32)
    k = np.zeros((2, 2, 40, 64), np.float32)
    return q, k, k, np.zeros((2, 2), np.int32)


@pytest.mark.parametrize(
    "change,match",
    [
        (dict(q=np.zeros((2, 7, 64))), "multiple of K"),
        (dict(q=np.zeros((2, 8, 48))), "k, v"),
        (dict(lengths=np.zeros((2,), np.int32)), "lengths.shape"),
        (dict(k=np.zeros((2, 2, 40, 64), np.int8)), "k.dtype"),
        (dict(k_scale=np.ones((2, 2, 40))), "scale"),
        (dict(backend="cuda"), "backend"),
        (dict(backend="mosaic_gpu"), "not implemented"),
        (dict(block_s=48), "block_s"),
        (dict(sliding_window=8), "q_positions"),
        (dict(rope_inv_freq=np.ones((32,))), "positions"),
        (dict(slot_bias=np.zeros((2, 2, 39), np.float32)), "slot_bias.shape"),
    ],
    ids=lambda x: x if isinstance(x, str) else None,
)
def test_rejects_bad_input(change, match):
    q, k, v, lengths = _small()
    arrays = dict(q=q, k=k, v=v, lengths=lengths)
    for name in ("q", "k", "v", "lengths"):
        arrays[name] = change.pop(name, arrays[name])
    with pytest.raises(ValueError, match=match):
        decode_attention(*arrays.values(), interpret=True, **change)


def _lowering_args(dtype):
    """Shapes only: lowering needs no data."""
    b, kh, g, s, h = 2, 8, 4, 1024, 128
    spec = jax.ShapeDtypeStruct
    q = spec((b, kh * g, h), jnp.float32 if dtype == "f32" else jnp.bfloat16)
    k = spec((b, kh, s, h), DTYPES[dtype])
    lengths = spec((b, kh), jnp.int32)
    scales = {}
    if dtype == "fp8":
        scales = dict(k_scale=spec((b, kh, s), jnp.float32), v_scale=spec((b, kh, s), jnp.float32))
    return (q, k, k, lengths), scales, spec((b, kh, s), jnp.int32)


LOWERINGS = {
    "f32": dict(),
    "bf16": dict(),
    "fp8": dict(),
    "bf16_mass": dict(return_mass=True),
    "fp8_mass": dict(return_mass=True),
    "bf16_rope": dict(rope=True),
    "fp8_rope": dict(rope=True),
    "fp8_rope_window_mass": dict(rope=True, window=True, return_mass=True),
    "bf16_bias_lse": dict(bias=True, return_lse=True),
    "fp8_bias_lse_mass_window": dict(bias=True, window=True, return_lse=True, return_mass=True),
    "fp8_native": dict(fp8_native=True),
    "fp8_native_rope_window_mass": dict(rope=True, window=True, return_mass=True, fp8_native=True),
}


@pytest.mark.parametrize("config", LOWERINGS)
def test_lowers_to_triton(config, lower_for_cuda):
    dtype = config.split("_")[0]
    args, scales, pos = _lowering_args(dtype)
    opts = dict(LOWERINGS[config])
    kw = dict(scales)
    if opts.pop("rope", False):
        kw.update(positions=pos, rope_inv_freq=rope_freqs(128))
    if opts.pop("bias", False):
        kw.update(slot_bias=jax.ShapeDtypeStruct(pos.shape, jnp.float32))
    if opts.pop("window", False):
        kw.update(positions=pos, q_positions=jax.ShapeDtypeStruct((2,), jnp.int32))
        opts["sliding_window"] = 4096
    fn = functools.partial(decode_attention, interpret=False, **opts)
    lower_for_cuda(fn, *args, **kw)


def test_refuses_fp8_caches_past_what_ran_on_a_gpu():
    """An FP8 K of 2**32 elements crashed decode attention on an H200 (illegal address); the
    kernels refuse it with a clear error instead. Shapes only: nothing is allocated."""
    spec = jax.ShapeDtypeStruct
    b, kh, g, h = 32, 8, 4, 128

    def trace(s):
        q = spec((b, kh * g, h), jnp.bfloat16)
        k = spec((b, kh, s, h), jnp.float8_e4m3fn)
        sc = spec((b, kh, s), jnp.float32)
        f = functools.partial(decode_attention, backend="triton", interpret=False)
        return jax.eval_shape(lambda *a: f(*a[:4], k_scale=a[4], v_scale=a[5]),
                              q, k, k, spec((b, kh), jnp.int32), sc, sc)  # fmt: skip

    assert trace(131072 - 8).shape == (b, kh * g, h)  # just under 2**32 elements: accepted
    with pytest.raises(ValueError, match=r"float8_e4m3fn array of shape \(32, 8, 131072, 128\)"):
        trace(131072)
