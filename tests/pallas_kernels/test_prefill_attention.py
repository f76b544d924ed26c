"""prefill_attention (kernel in interpret mode, and the blocked jnp path) against the reference."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jkv_kernels.kv_compact import pack_mask
from jkv_kernels.kv_quantize import quantize_reference
from jkv_kernels.prefill_attention import prefill_attention, prefill_attention_reference
from jkv_kernels.prefill_attention_blocked import (
    prefill_attention_blocked,
    prefill_attention_mass_blocked,
)
from jkv_kernels.prefill_attention_mass import (
    prefill_attention_mass,
    prefill_attention_mass_reference,
)

DTYPES = {"f32": np.float32, "bf16": jnp.bfloat16, "fp8": jnp.float8_e4m3fn}
TOL = {"f32": 1e-5, "bf16": 1e-2, "fp8": 1e-5}  # fp8: against the same quantised cache
# The blocked path does float32 maths for every storage dtype; a bf16 output may still round one
# ulp away from the reference's (relative 2**-8 of the largest element).
BLOCKED_TOL = {"f32": 1e-5, "bf16": 2**-8, "fp8": 1e-5}
FP8_BOUND = 0.1  # fp8 against the unquantised float32 reference
KERNEL = dict(block_q=8, block_s=16, interpret=True)  # small blocks: many of them, ragged edges


def case_id(b, t, s, kh, g, h, dtype):
    return f"B={b}_T={t}_S={s}_K={kh}_G={g}_H={h}_{dtype}"


def rope_freqs(h):
    return (1.0 / 10000.0 ** (np.arange(0, h, 2) / h)).astype(np.float32)


def make_inputs(rng, b, t, s, kh, g, h, dtype, ragged_lengths, poison_past, *, shuffle=False,
                keep=False, bias=False):  # fmt: skip
    """Random inputs, poisoned with NaN wherever the kernel must not read (or must mask).

    Lengths include 0, 1 and S; q_lengths are ragged (row 0 full, the others T/2..T-1); query 0
    of every row sits before every slot (sees nothing); keep drops random slots and the whole
    second key block. FP8 NaN codes decode to 480 in the kernel: its NaN-poisoned scales catch
    a wrong read there.
    """
    q = rng.standard_normal((b, t, kh * g, h), np.float32)
    k = rng.standard_normal((b, kh, s, h), np.float32)
    v = rng.standard_normal((b, kh, s, h), np.float32)
    lengths = ragged_lengths(rng, b, kh, s)
    q_lengths = rng.integers(t // 2, t, b).astype(np.int32)
    q_lengths[0] = t
    pos = np.sort(rng.integers(0, 2 * s, (b, kh, s)), axis=-1).astype(np.int32)
    if shuffle:  # evicted and merged caches: slots are not in position order
        pos = np.take_along_axis(pos, rng.permuted(np.tile(np.arange(s), (b, kh, 1)), axis=-1), -1)
    q_pos = np.sort(rng.integers(0, 2 * s, (b, t)), axis=-1).astype(np.int32)
    q_pos[:, 0] = -1
    dead = np.arange(s) >= lengths[..., None]  # [B, K, S]
    kw = {}
    if keep:
        kept = rng.random((b, kh, s)) < 0.7
        kept[:, :, 16:32] = False  # a fully dropped key block (KERNEL block_s = 16)
        kw["keep_mask"] = np.asarray(pack_mask(jnp.asarray(kept)))
        dead = dead | ~kept
    if bias:
        kw["slot_bias"] = np.log(rng.integers(1, 4, (b, kh, s))).astype(np.float32)
    exact = dict(k=k.copy(), v=v.copy())
    if dtype == "fp8":
        (k, ks), (v, vs) = (quantize_reference(x, scale_dtype=jnp.bfloat16) for x in (k, v))
        kw["k_scale"], kw["v_scale"] = np.array(ks), np.array(vs)
    else:
        k, v, q = (np.asarray(x).astype(DTYPES[dtype]) for x in (k, v, q))
    k, v = np.array(k), np.array(v)
    k[dead], v[dead] = np.nan, np.nan
    for name in ("k_scale", "v_scale", "slot_bias"):
        if name in kw:
            kw[name][dead] = np.nan
    q = np.array(q)
    q[np.arange(t)[None, :] >= q_lengths[:, None]] = np.nan  # padded queries
    pos = poison_past(pos, lengths, -1000)  # visible to everyone if the length were ignored
    return dict(
        args=(q, k, v, lengths, pos, q_pos),
        kw=dict(q_lengths=q_lengths, **kw),
        exact=exact,
        dead=dead,
    )


def check_out(out, ref, x, dtype, rel_err, tol=None):
    """out matches ref, has no NaN, and is exactly 0 for padded and blind queries."""
    q, _, _, lengths, _, _ = x["args"]
    out = np.asarray(out).astype(np.float32)
    assert out.shape == q.shape and not np.isnan(out).any()
    err = rel_err(out, ref)
    assert err <= (tol or TOL[dtype]), err
    t = q.shape[1]
    padded = np.arange(t)[None, :] >= x["kw"]["q_lengths"][:, None]  # [B, T]
    assert np.all(out[padded] == 0) and np.all(out[:, 0] == 0)  # query 0 sees nothing
    return err


def check_lse(lse, ref_lse, atol):
    lse, ref_lse = np.asarray(lse), np.asarray(ref_lse)
    assert lse.dtype == np.float32 and not np.isnan(lse).any()
    np.testing.assert_array_equal(np.isfinite(lse), np.isfinite(ref_lse))
    live = np.isfinite(ref_lse)
    np.testing.assert_allclose(lse[live], ref_lse[live], atol=atol)
    assert np.all(lse[:, 0] == -np.inf)


CASES = [
    (2, 40, 100, 2, 2, 32, "f32"),  # T, S not multiples of the blocks
    (1, 24, 70, 3, 4, 64, "bf16"),
    (2, 17, 130, 2, 1, 64, "fp8"),
    (3, 33, 96, 1, 4, 32, "bf16"),  # K=1 (MQA): rows of 0, 1 and S slots
]


@pytest.mark.parametrize("b,t,s,kh,g,h,dtype", CASES, ids=[case_id(*c) for c in CASES])
def test_matches_reference(
    b, t, s, kh, g, h, dtype, rng, rel_err, ragged_lengths, poison_past, record_property
):
    x = make_inputs(rng, b, t, s, kh, g, h, dtype, ragged_lengths, poison_past)
    ref, ref_lse = prefill_attention_reference(*x["args"], **x["kw"], return_lse=True)
    out, lse = prefill_attention(*x["args"], **x["kw"], return_lse=True, **KERNEL)
    assert out.dtype == x["args"][0].dtype
    err = check_out(out, ref, x, dtype, rel_err)
    atol = 1e-4 if x["args"][0].dtype == np.float32 else 2e-2
    check_lse(lse, ref_lse, atol)
    out_b, lse_b = prefill_attention_blocked(*x["args"], **x["kw"], return_lse=True, block_s=32)
    err_b = check_out(out_b, ref, x, dtype, rel_err, tol=BLOCKED_TOL[dtype])
    check_lse(lse_b, ref_lse, 1e-4)
    print(f"{case_id(b, t, s, kh, g, h, dtype)}: kernel {err:.2e} blocked {err_b:.2e}")
    record_property(f"rel_err_{dtype}", err)
    if dtype == "fp8":
        q, _, _, *rest = x["args"]
        exact = prefill_attention_reference(q, x["exact"]["k"], x["exact"]["v"], *rest,
                                             q_lengths=x["kw"]["q_lengths"])  # fmt: skip
        err = rel_err(out, exact)
        record_property("fp8_rel_err", err)
        print(f"fp8 vs unquantised f32 rel err {err:.4f}")
        assert err <= FP8_BOUND


FEATURES = {
    "window": dict(sliding_window=40),
    "bias": dict(bias=True),
    "keep": dict(keep=True),
    "shuffled": dict(shuffle=True),
    "rope": dict(rope=True),
    "rope_bf16_H=64_default_positions": dict(rope="default", dtype="bf16", h=64),
}


@pytest.mark.parametrize("feature", FEATURES)
def test_feature(feature, rng, rel_err, ragged_lengths, poison_past):
    """Each option alone, kernel and blocked path vs the reference; the option must matter."""
    opts = dict(FEATURES[feature])
    dtype, h = opts.pop("dtype", "f32"), opts.pop("h", 32)
    window, rope = opts.pop("sliding_window", None), opts.pop("rope", False)
    x = make_inputs(rng, 2, 24, 80, 2, 2, h, dtype, ragged_lengths, poison_past, **opts)
    kw = dict(x["kw"], sliding_window=window)
    if rope:
        kw["rope_inv_freq"] = rope_freqs(h)
    if rope is True:  # the keys' RoPE positions differ from the text positions (compacted)
        kw["rope_positions"] = rng.integers(0, 200, x["args"][4].shape).astype(np.int32)
    ref = prefill_attention_reference(*x["args"], **kw)
    check_out(prefill_attention(*x["args"], **kw, **KERNEL), ref, x, dtype, rel_err)
    blocked = prefill_attention_blocked(*x["args"], **kw, block_s=16)
    check_out(blocked, ref, x, dtype, rel_err, BLOCKED_TOL[dtype])
    # The option matters: the reference without it is far away (NaN where it unpoisons slots).
    plain = {n: a for n, a in x["kw"].items() if n in ("q_lengths", "slot_bias", "keep_mask")}
    if feature == "shuffled":  # sorted positions paired with the same keys
        args = list(x["args"])
        args[4] = np.sort(np.where(x["dead"], 10**6, args[4]), axis=-1)
        other = prefill_attention_reference(*args, **plain)
    else:
        dropped = {"bias": "slot_bias", "keep": "keep_mask"}.get(feature)
        plain = {n: a for n, a in plain.items() if n != dropped}
        other = prefill_attention_reference(*x["args"], **plain)
    assert not rel_err(other, ref) <= 5 * TOL[dtype]


def test_everything_at_once_fp8(rng, rel_err, ragged_lengths, poison_past, record_property):
    """FP8 + RoPE on read + window + bias + keep mask + shuffled positions + lse + mass."""
    x = make_inputs(
        rng, 2, 40, 100, 2, 4, 32, "fp8", ragged_lengths, poison_past,
        shuffle=True, keep=True, bias=True,
    )  # fmt: skip
    kw = dict(x["kw"], sliding_window=60, rope_inv_freq=rope_freqs(32))
    ref, ref_lse = prefill_attention_reference(*x["args"], **kw, return_lse=True)
    out, lse = prefill_attention(*x["args"], **kw, return_lse=True, **KERNEL)
    check_out(out, ref, x, "fp8", rel_err)
    check_lse(lse, ref_lse, 1e-4)
    q, k, _, *rest = x["args"]
    mkw = {n: a for n, a in kw.items() if n != "v_scale"}
    mass = prefill_attention_mass(q, k, *rest, lse, **mkw, **KERNEL)
    ref_mass = prefill_attention_mass_reference(q, k, *rest, ref_lse, **mkw)
    assert rel_err(mass, ref_mass) <= 1e-5
    assert np.all(np.asarray(mass)[x["dead"]] == 0)
    out_b = prefill_attention_blocked(*x["args"], **kw, block_s=32)
    check_out(out_b, ref, x, "fp8", rel_err)
    plain = {n: a for n, a in kw.items() if n not in ("k_scale", "v_scale")}
    exact = prefill_attention_reference(q, x["exact"]["k"], x["exact"]["v"], *rest, **plain)
    err = rel_err(out, exact)
    record_property("fp8_rel_err_everything", err)
    print(f"fp8 + rope + window + bias + keep vs unquantised f32 rel err {err:.4f}")
    assert err <= FP8_BOUND


MASS_CASES = [
    (2, 40, 100, 2, 2, 32, "f32"),
    (1, 24, 70, 3, 4, 64, "bf16"),
    (2, 17, 130, 2, 1, 32, "fp8"),
]


@pytest.mark.parametrize("b,t,s,kh,g,h,dtype", MASS_CASES, ids=[case_id(*c) for c in MASS_CASES])
def test_mass(b, t, s, kh, g, h, dtype, rng, rel_err, ragged_lengths, poison_past):
    x = make_inputs(rng, b, t, s, kh, g, h, dtype, ragged_lengths, poison_past, keep=True)
    q, k, _, lengths, *rest = x["args"]
    kw = {n: a for n, a in x["kw"].items() if n != "v_scale"}
    _, lse = prefill_attention(*x["args"], **x["kw"], return_lse=True, **KERNEL)
    _, ref_lse = prefill_attention_reference(*x["args"], **x["kw"], return_lse=True)
    mass = prefill_attention_mass(q, k, lengths, *rest, lse, **kw, **KERNEL)
    ref_mass = prefill_attention_mass_reference(q, k, lengths, *rest, ref_lse, **kw)
    mass = np.asarray(mass)
    assert mass.shape == (b, kh, s) and mass.dtype == np.float32 and not np.isnan(mass).any()
    assert rel_err(mass, ref_mass) <= (1e-5 if q.dtype == np.float32 else 1e-2)
    assert np.all(mass[x["dead"]] == 0)  # past the length and in dropped slots
    # Every real query that sees something spreads probability 1 over the slots of each head.
    seeing = np.isfinite(np.asarray(ref_lse)).reshape(b, t, kh, g).sum(axis=(1, 3))
    np.testing.assert_allclose(mass.sum(-1), seeing, rtol=1e-3, atol=1e-4)


@pytest.mark.parametrize("b,t,s,kh,g,h,dtype", MASS_CASES, ids=[case_id(*c) for c in MASS_CASES])
@pytest.mark.parametrize("block_s", [16, 48])
def test_mass_blocked(b, t, s, kh, g, h, dtype, block_s, rng, rel_err, ragged_lengths, poison_past):
    """The jnp key-block mass (XLA's path), blocks that divide S or not (a last block that
    overlaps the one before), against the reference."""
    x = make_inputs(rng, b, t, s, kh, g, h, dtype, ragged_lengths, poison_past, keep=True)
    q, k, _, lengths, *rest = x["args"]
    kw = {n: a for n, a in x["kw"].items() if n != "v_scale"}
    _, lse = prefill_attention_blocked(*x["args"], **x["kw"], return_lse=True, block_s=block_s)
    _, ref_lse = prefill_attention_reference(*x["args"], **x["kw"], return_lse=True)
    mass = prefill_attention_mass_blocked(q, k, lengths, *rest, lse, **kw, block_s=block_s)
    ref_mass = prefill_attention_mass_reference(q, k, lengths, *rest, ref_lse, **kw)
    mass = np.asarray(mass)
    assert mass.shape == (b, kh, s) and mass.dtype == np.float32 and not np.isnan(mass).any()
    assert rel_err(mass, ref_mass) <= 1e-5
    assert np.all(mass[x["dead"]] == 0)


def _temp_bytes(b, t, kh, g, s, h, block_s):
    spec = jax.ShapeDtypeStruct
    args = (
        spec((b, t, kh * g, h), jnp.float32),
        spec((b, kh, s, h), jnp.float32),
        spec((b, kh, s, h), jnp.float32),
        spec((b, kh), jnp.int32),
        spec((b, kh, s), jnp.int32),
        spec((b, t), jnp.int32),
    )
    fn = functools.partial(prefill_attention_blocked, block_s=block_s)
    return jax.jit(fn).lower(*args).compile().memory_analysis().temp_size_in_bytes


def test_blocked_memory_is_linear():
    """No [T, S] score tensor: temporaries do not grow with S at fixed T, linearly with T = S.

    float32 storage: XLA:CPU widens bfloat16 operands to float32 before the loop (a CPU-only
    normalisation that adds a linear float32 copy of the cache), which would blur the figures.
    """
    b, kh, g, h, bs = 1, 2, 2, 64, 128
    fixed = {s: _temp_bytes(b, 256, kh, g, s, h, bs) for s in (1024, 4096)}
    square = {s: _temp_bytes(b, s, kh, g, s, h, bs) for s in (1024, 4096)}
    print(f"blocked temp bytes: T=256 {fixed}, T=S {square}")
    scores = lambda t, s: 4 * b * kh * g * t * s  # one float32 [B, K, G, T, S]
    # At fixed T the loop state and one block's tensors do not depend on S (slack: [B, K, S]
    # vectors, 16 bytes a slot).
    assert fixed[4096] - fixed[1024] <= 16 * b * kh * 3072
    assert fixed[4096] < scores(256, 4096) / 4
    # T = S: 4x the tokens, about 4x the bytes (quadratic would be 16x).
    assert square[4096] <= 4.5 * square[1024]
    assert square[4096] < scores(4096, 4096) / 4


def _small():
    q = np.zeros((2, 8, 4, 32), np.float32)
    k = np.zeros((2, 2, 40, 32), np.float32)
    pos = np.zeros((2, 2, 40), np.int32)
    return dict(q=q, k=k, v=k, lengths=np.zeros((2, 2), np.int32), positions=pos,
                q_positions=np.zeros((2, 8), np.int32))  # fmt: skip


@pytest.mark.parametrize(
    "change,match",
    [
        (dict(q=np.zeros((2, 8, 3, 32))), "multiple of K"),
        (dict(q=np.zeros((2, 8, 4, 48))), "k, v"),
        (dict(k=np.zeros((2, 2, 40, 32), np.int8)), "k.dtype"),
        (dict(k_scale=np.ones((2, 2, 40))), "scale"),
        (dict(q_positions=np.zeros((2, 7), np.int32)), "q_positions.shape"),
        (dict(q_lengths=np.zeros((2, 1), np.int32)), "q_lengths.shape"),
        (dict(keep_mask=np.zeros((2, 2, 1), np.int32)), "keep_mask"),
        (dict(rope_positions=np.zeros((2, 2, 40), np.int32)), "rope_inv_freq"),
        (dict(slot_bias=np.zeros((2, 2, 39), np.float32)), "slot_bias.shape"),
        (dict(sliding_window=0), "sliding_window"),
        (dict(block_s=48), "block_s"),
        (dict(block_q=3), "block_q"),
        (dict(backend="mosaic_gpu"), "not implemented"),
    ],
    ids=lambda x: x if isinstance(x, str) else None,
)
def test_rejects_bad_input(change, match):
    arrays = _small()
    for name in list(arrays):
        arrays[name] = change.pop(name, arrays[name])
    with pytest.raises(ValueError, match=match):
        prefill_attention(*arrays.values(), interpret=True, **change)


def _lowering_args(dtype):
    """Shapes only: lowering needs no data."""
    b, t, kh, g, s, h = 2, 256, 8, 4, 1024, 128
    spec = jax.ShapeDtypeStruct
    q = spec((b, t, kh * g, h), jnp.float32 if dtype == "f32" else jnp.bfloat16)
    k = spec((b, kh, s, h), DTYPES[dtype])
    ints = lambda *shape: spec(shape, jnp.int32)
    kw = dict(q_lengths=ints(b))
    if dtype == "fp8":
        kw.update(k_scale=spec((b, kh, s), jnp.bfloat16), v_scale=spec((b, kh, s), jnp.bfloat16))
    extra = dict(
        keep_mask=spec((b, kh, s // 32), jnp.uint32),
        rope_positions=ints(b, kh, s),
        slot_bias=spec((b, kh, s), jnp.float32),
    )
    lse = spec((b, t, kh * g), jnp.float32)
    return (q, k, k, ints(b, kh), ints(b, kh, s), ints(b, t)), kw, extra, lse


LOWERINGS = {
    "f32": dict(),
    "bf16": dict(),
    "fp8": dict(),
    "bf16_keep_rope": dict(keep=True, rope=True),
    "fp8_keep_rope": dict(keep=True, rope=True),
    "fp8_keep_rope_window_bias_lse": dict(keep=True, rope=True, bias=True, window=True, lse=True),
    "mass_f32": dict(mass=True),
    "mass_fp8_keep_rope_window_bias": dict(mass=True, keep=True, rope=True, bias=True, window=True),
}


@pytest.mark.parametrize("config", LOWERINGS)
def test_lowers_to_triton(config, lower_for_cuda):
    opts = dict(LOWERINGS[config])
    mass = opts.pop("mass", False)
    dtype = config.split("_")[1 if mass else 0]
    args, kw, extra, lse = _lowering_args(dtype)
    if opts.pop("keep", False):
        kw["keep_mask"] = extra["keep_mask"]
    if opts.pop("rope", False):
        kw.update(rope_positions=extra["rope_positions"], rope_inv_freq=rope_freqs(128))
    if opts.pop("bias", False):
        kw["slot_bias"] = extra["slot_bias"]
    static = dict(interpret=False)
    if opts.pop("window", False):
        static["sliding_window"] = 512
    if opts.pop("lse", False):
        static["return_lse"] = True
    if mass:
        kw.pop("v_scale", None)
        q, k, _, *rest = args
        fn = functools.partial(prefill_attention_mass, **static)
        lower_for_cuda(fn, q, k, *rest, lse, **kw)
    else:
        lower_for_cuda(functools.partial(prefill_attention, **static), *args, **kw)
