"""paged_window_scores_xla (the engine's XLA path) and paged_window_scores (the Pallas kernels,
interpret mode, and lowered for CUDA) against their float32 reference; the reference against a
numpy loop of its own and against the dense `window_scores` on the same keys.

Pools are built like the engine's: each (row, kv head) gets pages drawn shuffled from the pool,
slot i of an uncompressed prompt holds text position i, the window's queries are the row's last
tokens; every slot no head reads is poisoned (NaN keys and scales, a far-away position).
"""

from __future__ import annotations

import functools

import jax.numpy as jnp
import numpy as np
import pytest

from jkv_kernels.kv_quantize import quantize_reference
from jkv_kernels.paged_window_scores import (
    paged_window_scores,
    paged_window_scores_reference,
    paged_window_scores_xla,
)
from jkv_kernels.window_scores import window_scores_reference

KH, G, H = 2, 2, 16
POISON_POS = 1 << 30


def make_case(rng, windows, page, m, dtype):
    """Rows whose last `windows[r]` tokens are its queries; returns the kernel's arguments."""
    r = len(windows)
    p = r * KH * m + 8
    lengths = np.zeros((r, KH), np.int32)
    table = rng.integers(0, p, (r, KH, m)).astype(np.int32)  # arbitrary past a head's pages
    free = iter(rng.permutation(np.arange(1, p)))
    pos = np.full((p, page), POISON_POS, np.int32)
    live = np.zeros((p, page), bool)
    q_pos = []
    for i, w in enumerate(windows):
        ctx = int(rng.integers(max(w, 1), m * page + 1))  # the prompt, its window last
        for k in range(KH):
            lengths[i, k] = ctx
            for j in range(-(-ctx // page)):
                table[i, k, j] = next(free)
            for s in range(ctx):
                pos[table[i, k, s // page], s % page] = s
                live[table[i, k, s // page], s % page] = True
        q_pos += list(range(ctx - w, ctx))
    k = rng.standard_normal((p, page, H)).astype(np.float32) * 2
    k[~live] = np.nan
    t = sum(windows)
    args = dict(
        q=rng.standard_normal((t + 3, KH * G, H)).astype(np.float32),  # 3 tokens of no row
        page_table=table,
        lengths=lengths,
        q_start=np.cumsum([0, *windows[:-1]]).astype(np.int32),
        q_len=np.asarray(windows, np.int32),
        q_positions=np.asarray(q_pos + [0, 0, 0], np.int32),
        pos_pages=pos,
    )
    if dtype == "fp8":
        k8, ks = quantize_reference(k[None], scale_dtype=jnp.bfloat16)
        k, ks = np.asarray(k8[0]), np.array(ks[0])
        ks[~live] = np.nan
        return dict(args, k_pages=k, k_scale=ks)
    if dtype == "bf16":
        k = k.astype(jnp.bfloat16)
    return dict(args, k_pages=k)


def numpy_reference(a, pool, kernel, window=None):
    """The module docstring's maths one query at a time in float64, then the pooling."""
    q = np.asarray(a["q"], np.float64)
    k = np.asarray(jnp.asarray(a["k_pages"]).astype(jnp.float32), np.float64)
    if "k_scale" in a:
        k = k * np.asarray(jnp.asarray(a["k_scale"]).astype(jnp.float32))[..., None]
    page = k.shape[1]
    r, _, m = a["page_table"].shape
    out = np.zeros((r, KH, m * page))
    for row, (s0, n) in enumerate(zip(a["q_start"], a["q_len"], strict=True)):
        for kv in range(KH):
            length = a["lengths"][row, kv]
            pages = [a["page_table"][row, kv, s // page] for s in range(length)]
            kk = np.stack([k[pg, s % page] for s, pg in enumerate(pages)])
            pos = np.array([a["pos_pages"][pg, s % page] for s, pg in enumerate(pages)])
            for t in range(s0, s0 + n):
                ok = pos <= a["q_positions"][t]
                if window is not None:
                    ok &= a["q_positions"][t] - pos < window
                for g in range(G):
                    z = kk[ok] @ q[t, kv * G + g] * H**-0.5
                    w = np.exp(z - z.max())
                    out[row, kv, :length][ok] += w / w.sum()
            half = kernel // 2
            padded = np.pad(out[row, kv], half)
            windows = [padded[i : i + kernel] for i in range(m * page)]
            pooled = [x.sum() / kernel if pool == "avg" else x.max() for x in windows]
            out[row, kv] = np.where(np.arange(m * page) < length, pooled, 0.0)
    return out


CASES = [  # (window queries per row, page, pages per row, dtype, pool, kernel)
    ([4, 1, 7], 4, 5, "f32", "avg", 3),
    ([8, 8], 8, 3, "f32", "max", 5),
    ([3, 17, 2], 4, 7, "bf16", "avg", 7),
    ([5, 2, 6, 1], 4, 5, "fp8", "max", 1),
]
EVERY_CASE = pytest.mark.parametrize(
    "windows, page, m, dtype, pool, kernel",
    CASES,
    ids=[f"R={len(c[0])}_W={max(c[0])}_page={c[1]}_M={c[2]}_{c[3]}_{c[4]}{c[5]}" for c in CASES],
)


@EVERY_CASE
def test_xla_path_matches_the_reference(rng, rel_err, windows, page, m, dtype, pool, kernel):
    a = make_case(rng, windows, page, m, dtype)
    ref = paged_window_scores_reference(**a, pool=pool, kernel_size=kernel)
    assert rel_err(ref, numpy_reference(a, pool, kernel)) < 1e-5  # what the docstring says
    out = paged_window_scores_xla(**a, pool=pool, kernel_size=kernel, q_tile=4,
                                  pages_per_step=2)  # fmt: skip
    assert not np.isnan(np.asarray(out)).any()
    assert rel_err(out, ref) < 1e-5  # the same stored values, float32 maths


def test_the_reference_is_dense_window_scores_on_an_uncompressed_prompt(rng, rel_err):
    """One window of the same width per row: the dense `window_scores` of the rows' keys
    (slot i at position i, queries the last W slots) gives the same pooled scores."""
    a = make_case(rng, [5, 5, 5], 4, 6, "f32")
    ref = paged_window_scores_reference(**a, pool="avg", kernel_size=3)
    page = a["k_pages"].shape[1]
    dense_k = np.nan_to_num(np.asarray(a["k_pages"])[a["page_table"]].reshape(3, KH, -1, H))
    q = np.asarray(a["q"][:15]).reshape(3, 5, KH * G, H).transpose(0, 2, 1, 3)  # [B, N, W, H]
    dense = window_scores_reference(q, dense_k, a["lengths"], pool="avg", kernel_size=3)
    assert rel_err(ref, dense) < 1e-5 and page == 4


@EVERY_CASE
def test_pallas_kernel_matches_the_reference(rng, rel_err, windows, page, m, dtype, pool, kernel):
    """Interpret mode, the statistics poisoned with NaN: every query's are written, and every
    slot of every row gets a score."""
    a = make_case(rng, windows, page, m, dtype)
    if dtype == "bf16":  # the kernel computes in q's dtype when the pool is stored in it
        a["q"] = jnp.asarray(a["q"]).astype(jnp.bfloat16)
    ref = np.asarray(paged_window_scores_reference(**a, pool=pool, kernel_size=kernel))
    out = np.asarray(paged_window_scores(**a, pool=pool, kernel_size=kernel, q_tile=4,
                                         interpret=True, _fill=float("nan")))  # fmt: skip
    assert not np.isnan(out).any(), "a score was left unwritten"
    tol = {"f32": 1e-5, "bf16": 2e-2, "fp8": 1e-2}[dtype]  # bf16/fp8: low-precision dots
    assert rel_err(out, ref) < tol


def test_rows_without_queries_score_nothing(rng):
    a = make_case(rng, [3, 0, 2], 4, 4, "f32")
    for out in (paged_window_scores(**a, q_tile=4, interpret=True),
                paged_window_scores_xla(**a, q_tile=4, pages_per_step=2)):  # fmt: skip
        out = np.asarray(out)
        assert (out[1] == 0).all() and (out[0].sum(axis=-1) > 0).all()


@pytest.mark.parametrize("dtype", ["f32", "fp8"])
def test_a_sliding_window_hides_older_slots(rng, rel_err, dtype):
    """With a sliding window (H2O's mass on Mistral): the XLA path and the kernel (kernel 1:
    no pooling) see only the last `window` positions, as the numpy loop does."""
    a = make_case(rng, [6, 3, 1], 4, 6, dtype)
    ref = paged_window_scores_reference(**a, pool="avg", kernel_size=1, window=5)
    assert rel_err(ref, numpy_reference(a, "avg", 1, window=5)) < 1e-5
    assert rel_err(ref, paged_window_scores_reference(**a, pool="avg", kernel_size=1)) > 1e-2
    xla = paged_window_scores_xla(**a, kernel_size=1, window=5, q_tile=4, pages_per_step=2)
    assert rel_err(xla, ref) < 1e-5
    got = paged_window_scores(**a, kernel_size=1, window=5, q_tile=4, interpret=True)
    assert rel_err(got, ref) < {"f32": 1e-5, "fp8": 1e-2}[dtype]


@pytest.mark.parametrize("dtype", ["bf16", "fp8"])
def test_pallas_kernel_lowers_for_cuda(rng, lower_for_cuda, dtype):
    a = make_case(rng, [8, 1, 3], 8, 4, dtype)
    a["q"] = jnp.asarray(a["q"]).astype(jnp.bfloat16)
    a = {name: jnp.asarray(x) for name, x in a.items()}
    text = lower_for_cuda(functools.partial(paged_window_scores, interpret=False), **a)
    assert "jkv_paged_window_stats" in text and "jkv_paged_window_probs" in text


def test_bad_arguments_raise(rng):
    a = make_case(rng, [2, 2], 4, 3, "f32")
    with pytest.raises(ValueError, match="kernel_size=4"):
        paged_window_scores_xla(**a, kernel_size=4)
    with pytest.raises(ValueError, match="lengths.shape"):
        paged_window_scores_reference(**{**a, "lengths": a["lengths"][:1]})
    with pytest.raises(ValueError, match="FP8 keys need their scales"):
        paged_window_scores(**{**a, "k_pages": a["k_pages"].astype(jnp.float8_e4m3fn)})
