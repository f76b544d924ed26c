"""paged_decode_attention against its float32 reference, in interpret mode, plus CUDA lowering.

Every pool is built like the engine's: each (row, kv head) gets its own pages, drawn shuffled
from the pool, optionally sharing its first full pages with the row before (prefix caching);
table entries past a head's pages are random pool ids. Every pool slot no head references below
its length is poisoned (NaN K, V and scales, a far-away position), so a kernel reading a wrong
page or slot turns NaN or wrong. (FP8 NaN bits decode to 480 in the kernel; the NaN scales are
what catch an FP8 misread.)
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jkv_kernels.decode_attention import decode_attention_reference
from jkv_kernels.kv_quantize import quantize_reference
from jkv_kernels.paged_decode_attention import (
    gather_pages,
    paged_decode_attention,
    paged_decode_attention_reference,
)

DTYPES = {"f32": np.float32, "bf16": jnp.bfloat16, "fp8": jnp.float8_e4m3fn}
TOL = {"f32": 1e-5, "bf16": 1e-2, "fp8": 1e-5}  # fp8: against the same quantised pool
FP8_BOUND = 0.1  # fp8 against the unquantised float32 reference
KH = 2  # kv heads
MAX_PAGES = 5
POISON_POS = 1 << 30


def case_id(b, p, page, g, h, dtype):
    return f"B={b}_P={p}_page={page}_G={g}_H={h}_{dtype}"


def rope_freqs(h):
    return (1.0 / 10000.0 ** (np.arange(0, h, 2) / h)).astype(np.float32)


def make_pool(rng, b, p, page, g, h, dtype, *, share=True):
    """A random paged pool, table and ragged lengths (0, 1, full, a page multiple among them)."""
    s = MAX_PAGES * page
    lengths = rng.integers(0, s + 1, size=b * KH).astype(np.int32)
    lengths[:4] = [0, 1, s, page * int(rng.integers(1, MAX_PAGES))]
    lengths = lengths.reshape(b, KH)
    n_pages = -(-lengths // page)
    table = rng.integers(0, p, (b, KH, MAX_PAGES)).astype(np.int32)  # arbitrary past the end
    free = iter(rng.permutation(p))
    for i in range(b):
        for k in range(KH):
            shared = 0
            if share and i > 0:  # prefix caching: only full pages are shared
                shared = min(lengths[i - 1, k] // page, lengths[i, k] // page, 2)
                table[i, k, :shared] = table[i - 1, k, :shared]
            for j in range(shared, n_pages[i, k]):
                table[i, k, j] = next(free)
    # Increasing text positions per head with gaps (evicted tokens); shared pages get the
    # later row's, which both rows then read.
    pos = np.full((p, page), POISON_POS, np.int32)
    live = np.zeros((p, page), bool)
    for i in range(b):
        for k in range(KH):
            t = np.arange(lengths[i, k])
            pages, offs = table[i, k, t // page], t % page
            pos[pages, offs] = np.cumsum(rng.integers(1, 4, lengths[i, k]))
            live[pages, offs] = True
    kv = {
        "q": rng.standard_normal((b, KH * g, h), np.float32),
        "k": rng.standard_normal((p, page, h), np.float32),
        "v": rng.standard_normal((p, page, h), np.float32),
    }
    exact = dict(kv)
    scales = {}
    if dtype == "fp8":
        (k8, ks), (v8, vs) = (
            quantize_reference(kv[n][None], scale_dtype=jnp.bfloat16) for n in "kv"
        )
        kv["k"], kv["v"] = np.array(k8[0]), np.array(v8[0])
        scales = dict(k_scale_pages=np.array(ks[0]), v_scale_pages=np.array(vs[0]))
    else:
        kv = {n: np.asarray(x).astype(DTYPES[dtype]) for n, x in kv.items()}
    dead = ~live
    for x in (kv["k"], kv["v"], *scales.values()):
        x[dead] = np.asarray(np.nan).astype(x.dtype)
    return dict(
        args=(kv["q"], kv["k"], kv["v"], table, lengths),
        exact=(exact["q"], exact["k"], exact["v"], table, lengths),
        scales=scales,
        pos=pos,
        g=g,
    )


def check_out(out, ref, x, tol, rel_err):
    q, lengths = x["args"][0], x["args"][4]
    assert out.shape == q.shape and out.dtype == q.dtype
    out = np.asarray(out).astype(np.float32)
    assert not np.isnan(out).any()
    err = rel_err(out, ref)
    assert err <= tol, err
    # Length-0 (row, kv head) pairs output exactly 0.
    assert np.all(out[np.repeat(lengths == 0, x["g"], axis=1)] == 0)
    return err


CASES = [
    (3, 40, 16, 2, 64, "f32"),
    (2, 24, 32, 4, 32, "f32"),
    (3, 40, 16, 1, 32, "bf16"),
    (2, 24, 32, 4, 64, "bf16"),
    (3, 40, 16, 4, 64, "fp8"),
    (2, 24, 32, 1, 32, "fp8"),
]


@pytest.mark.parametrize("b,p,page,g,h,dtype", CASES, ids=[case_id(*c) for c in CASES])
def test_matches_reference(b, p, page, g, h, dtype, rng, rel_err, record_property):
    x = make_pool(rng, b, p, page, g, h, dtype)
    # 2 pages of 16 or 1 of 32 per step; 2 splits over 5 pages leave a ragged last block.
    ppb = 2 if page == 16 else 1
    out = paged_decode_attention(
        *x["args"], **x["scales"], pages_per_block=ppb, num_splits=2, interpret=True
    )
    ref = paged_decode_attention_reference(*x["args"], **x["scales"])
    err = check_out(out, ref, x, TOL[dtype], rel_err)
    record_property("rel_err", err)
    print(f"{case_id(b, p, page, g, h, dtype)}: rel err vs reference {err:.2e}")
    if dtype == "fp8":
        exact = paged_decode_attention_reference(*x["exact"])
        err = rel_err(out, exact)
        record_property("fp8_rel_err", err)
        print(f"{case_id(b, p, page, g, h, dtype)}: fp8 vs unquantised f32 rel err {err:.4f}")
        assert err <= FP8_BOUND


def test_reference_matches_dense(rng, rel_err):
    """The paged reference is the dense one on the gathered cache (and gather_pages is right)."""
    x = make_pool(rng, 3, 40, 16, 2, 32, "f32")
    q, k, v, table, lengths = x["args"]
    dense_k = gather_pages(k, table)
    assert dense_k.shape == (3, KH, MAX_PAGES * 16, 32)
    for i, kk, t in [(0, 1, 37), (2, 0, 79), (1, 1, 16)]:
        np.testing.assert_array_equal(dense_k[i, kk, t], k[table[i, kk, t // 16], t % 16])
    ref = paged_decode_attention_reference(*x["args"])
    dense = decode_attention_reference(q, dense_k, gather_pages(v, table), lengths)
    assert rel_err(ref, dense) <= 1e-6


MASS_CASES = [(3, 40, 16, 2, 64, "f32"), (2, 24, 32, 4, 32, "bf16"), (3, 40, 16, 1, 32, "fp8")]


@pytest.mark.parametrize("b,p,page,g,h,dtype", MASS_CASES, ids=[case_id(*c) for c in MASS_CASES])
def test_mass(b, p, page, g, h, dtype, rng, rel_err):
    x = make_pool(rng, b, p, page, g, h, dtype)
    out, mass = paged_decode_attention(
        *x["args"], **x["scales"], return_mass=True, pages_per_block=1, num_splits=3, interpret=True
    )
    ref, ref_mass = paged_decode_attention_reference(*x["args"], **x["scales"], return_mass=True)
    tol = TOL[dtype] if x["args"][0].dtype == np.float32 else 1e-2
    check_out(out, ref, x, tol, rel_err)
    lengths = x["args"][4]
    assert mass.shape == lengths.shape + (MAX_PAGES * page,) and mass.dtype == jnp.float32
    mass = np.asarray(mass)
    assert not np.isnan(mass).any()
    assert rel_err(mass, ref_mass) <= tol
    # Each head's probabilities sum to 1, so a group's mass sums to G (0 for empty heads).
    np.testing.assert_allclose(mass.sum(-1), np.where(lengths > 0, g, 0), rtol=1e-4, atol=1e-5)
    assert np.all(mass[np.arange(mass.shape[-1]) >= lengths[..., None]] == 0)


def streaming_positions(x, page, shift, sink):
    """StreamingLLM positions: token i at i below the sink, at i + shift[b, k] after it."""
    q, k, v, table, lengths = x["args"]
    pos = np.full_like(x["pos"], POISON_POS)
    for i in range(table.shape[0]):
        for kk in range(KH):
            t = np.arange(lengths[i, kk])
            pos[table[i, kk, t // page], t % page] = np.where(t < sink, t, t + shift[i, kk])
    return pos


ROPE_CASES = [(3, 40, 16, 2, 64, "f32"), (2, 24, 32, 4, 32, "bf16"), (2, 24, 16, 2, 16, "f32")]


@pytest.mark.parametrize("b,p,page,g,h,dtype", ROPE_CASES, ids=[case_id(*c) for c in ROPE_CASES])
def test_rope_on_read_with_shift_and_sink(b, p, page, g, h, dtype, rng, rel_err):
    """Keys stored unrotated at text positions i (+shift past the sink) rotate to position i."""
    x = make_pool(rng, b, p, page, g, h, dtype, share=False)  # shifts differ per head
    shift = rng.integers(5, 50, (b, KH)).astype(np.int32)
    sink = 4
    pos = streaming_positions(x, page, shift, sink)
    kw = dict(pos_pages=pos, rope_inv_freq=rope_freqs(h), rope_shift=shift, rope_sink=sink)
    out = paged_decode_attention(*x["args"], **kw, interpret=True)  # default block and splits
    ref = paged_decode_attention_reference(*x["args"], **kw)
    check_out(out, ref, x, TOL[dtype], rel_err)
    # The shifted window is contiguous after the sinks: dense RoPE at the slot index agrees.
    q, k, v, table, lengths = x["args"]
    s = MAX_PAGES * page
    dense = dict(positions=np.broadcast_to(np.arange(s, dtype=np.int32), lengths.shape + (s,)))
    slot_rope = decode_attention_reference(
        q, gather_pages(k, table), gather_pages(v, table), lengths, **dense,
        rope_inv_freq=rope_freqs(h),
    )  # fmt: skip
    assert rel_err(ref, slot_rope) <= TOL[dtype]
    # Rotating and shifting must both matter.
    assert rel_err(paged_decode_attention_reference(*x["args"]), ref) > 5 * TOL[dtype]
    no_shift = paged_decode_attention_reference(
        *x["args"], pos_pages=pos, rope_inv_freq=rope_freqs(h)
    )
    assert rel_err(no_shift, ref) > 5 * TOL[dtype]


def test_sliding_window(rng, rel_err):
    x = make_pool(rng, 3, 40, 16, 2, 64, "f32")
    q_pos = x["pos"][x["pos"] < POISON_POS].max() - 3  # the newest slots are "in the future"
    kw = dict(pos_pages=x["pos"], q_positions=np.full((3,), q_pos, np.int32), sliding_window=60)
    out = paged_decode_attention(*x["args"], **kw, pages_per_block=1, num_splits=3, interpret=True)
    ref = paged_decode_attention_reference(*x["args"], **kw)
    check_out(out, ref, x, 1e-5, rel_err)
    assert rel_err(paged_decode_attention_reference(*x["args"]), ref) > 1e-3  # it masks


def test_everything_at_once_fp8(rng, rel_err, record_property):
    """FP8 + RoPE on read with shift and sink + sliding window + mass: the serving decode path."""
    b, page, h = 3, 16, 64
    x = make_pool(rng, b, 40, page, 2, h, "fp8", share=False)
    shift = rng.integers(5, 50, (b, KH)).astype(np.int32)
    pos = streaming_positions(x, page, shift, 4)
    q_pos = np.full((b,), pos[pos < POISON_POS].max(), np.int32)
    kw = dict(
        pos_pages=pos,
        rope_inv_freq=rope_freqs(h),
        rope_shift=shift,
        rope_sink=4,
        q_positions=q_pos,
        sliding_window=70,
    )
    out, mass = paged_decode_attention(
        *x["args"], **x["scales"], **kw, return_mass=True, pages_per_block=2, interpret=True
    )
    ref, ref_mass = paged_decode_attention_reference(
        *x["args"], **x["scales"], **kw, return_mass=True
    )
    check_out(out, ref, x, 1e-5, rel_err)
    assert rel_err(mass, ref_mass) <= 1e-5
    exact = paged_decode_attention_reference(*x["exact"], **kw)
    err = rel_err(out, exact)
    record_property("fp8_rel_err_rope_window", err)
    print(f"fp8 + rope + shift + window vs unquantised f32 rel err {err:.4f}")
    assert err <= FP8_BOUND


def _small():
    q = np.zeros((2, 8, 64), np.float32)
    k = np.zeros((10, 16, 64), np.float32)
    return dict(
        q=q, k=k, v=k, table=np.zeros((2, 2, 3), np.int32), lengths=np.zeros((2, 2), np.int32)
    )


@pytest.mark.parametrize(
    "change,match",
    [
        (dict(q=np.zeros((2, 7, 64))), "multiple of K"),
        (dict(q=np.zeros((2, 8, 48))), "k_pages, v_pages"),
        (dict(k=np.zeros((10, 12, 64)), v=np.zeros((10, 12, 64))), "page_size=12"),
        (dict(table=np.zeros((3, 2, 3), np.int32)), "page_table.shape"),
        (dict(table=np.zeros((2, 2, 3), np.float32)), "page_table.dtype"),
        (dict(lengths=np.zeros((2,), np.int32)), "lengths.shape"),
        (dict(k=np.zeros((10, 16, 64), np.int8)), "k_pages.dtype"),
        (dict(k_scale_pages=np.ones((10, 16))), "scale"),
        (dict(pos_pages=np.zeros((10, 8), np.int32)), "pos_pages.shape"),
        (dict(rope_inv_freq=np.ones((32,))), "pos_pages"),
        (dict(rope_shift=np.zeros((2, 2), np.int32)), "rope_inv_freq"),
        (dict(sliding_window=8), "q_positions"),
        (dict(rope_sink=-1), "rope_sink"),
        (dict(pages_per_block=3), "power of two"),
        (dict(backend="cuda"), "backend"),
        (dict(backend="mosaic_gpu"), "not implemented"),
    ],
    ids=lambda x: x if isinstance(x, str) else None,
)
def test_rejects_bad_input(change, match):
    arrays = _small()
    for name in list(arrays):
        arrays[name] = change.pop(name, arrays[name])
    with pytest.raises(ValueError, match=match):
        paged_decode_attention(*arrays.values(), interpret=True, **change)


def _lowering_args(dtype, p=4096):
    """Shapes only: lowering needs no data."""
    b, kh, g, page, h = 2, 8, 4, 16, 128
    spec = jax.ShapeDtypeStruct
    q = spec((b, kh * g, h), jnp.float32 if dtype == "f32" else jnp.bfloat16)
    k = spec((p, page, h), DTYPES[dtype])
    table = spec((b, kh, 64), jnp.int32)
    lengths = spec((b, kh), jnp.int32)
    kw = {}
    if dtype == "fp8":
        kw = dict(
            k_scale_pages=spec((p, page), jnp.bfloat16), v_scale_pages=spec((p, page), jnp.bfloat16)
        )
    extra = dict(
        pos_pages=spec((p, page), jnp.int32),
        rope_shift=spec((b, kh), jnp.int32),
        q_positions=spec((b,), jnp.int32),
    )
    return (q, k, k, table, lengths), kw, extra


LOWERINGS = {
    "f32": dict(),
    "bf16": dict(),
    "fp8": dict(),
    "bf16_rope_mass": dict(rope=True, return_mass=True),
    "fp8_rope_window_mass": dict(rope=True, window=True, return_mass=True),
    "bf16_pool_over_4GiB": dict(p=1 << 21),  # 64-bit page offsets
}


@pytest.mark.parametrize("config", LOWERINGS)
def test_lowers_to_triton(config, lower_for_cuda):
    dtype = config.split("_")[0]
    opts = dict(LOWERINGS[config])
    args, kw, extra = _lowering_args(dtype, opts.pop("p", 4096))
    if opts.pop("rope", False):
        kw.update(
            pos_pages=extra["pos_pages"],
            rope_inv_freq=rope_freqs(128),
            rope_shift=extra["rope_shift"],
        )
        opts["rope_sink"] = 4
    if opts.pop("window", False):
        kw.update(pos_pages=extra["pos_pages"], q_positions=extra["q_positions"])
        opts["sliding_window"] = 4096
    fn = functools.partial(paged_decode_attention, interpret=False, **opts)
    lower_for_cuda(fn, *args, **kw)
