"""Checks the jkv Pallas kernels against their references; on a GPU, gpu_timing.py then times them.

Correctness first (every kernel, fresh random inputs, NaN planted past every valid length and
in the buffers the kernels update in place, lengths 0, 1 and S). Then, on a GPU, decode attention
(our kernel) vs the jitted XLA reference vs JAX's Pallas `gqa` op (when present) over S in
{1K, 8K, 32K, 128K}, B in {1, 8, 32}, K=8, G=4, H=128, bfloat16 and FP8 storage: warm-up, then
the median of per-call wall times with inputs rotated so L2 cannot hold them, and device time
per call from a `jax.profiler` trace (kernels summed per jitted module). GB/s counts the bytes
of K, V and scales read, beside a device-to-device copy measured in the same run.

    bash benchmarks/gpu_check.sh [--cpu] [--out DIR] [--budget-s SECONDS]

Writes DIR/gpu_check.json (DIR/gpu_check_cpu.json with --cpu); exits 1 if a check fails.
"""

from __future__ import annotations

import argparse
import json
import math
import platform
import sys
import time
from pathlib import Path

import gpu_ragged as ragged  # benchmarks/gpu_ragged.py, beside this script
import gpu_timing as timing  # benchmarks/gpu_timing.py, beside this script
import jax
import jax.numpy as jnp
import numpy as np

import jkv_kernels as pk

FP8 = jnp.float8_e4m3fn


def rel_err(out, ref) -> float:
    out = np.asarray(out).astype(np.float64)
    ref = np.asarray(ref).astype(np.float64)
    return float(np.linalg.norm(out - ref) / max(np.linalg.norm(ref), 1e-30))


def f32(x):
    return np.asarray(x).astype(np.float32)


# ---------------------------------------------------------------- correctness checks


def make_cache(rng, b, kh, s, h, g, dtype):
    """Random q, K, V with lengths 0, 1, S among them and NaN planted past every length."""
    lengths = rng.integers(0, s + 1, (b, kh)).astype(np.int32)
    lengths.reshape(-1)[:3] = [0, 1, s][: b * kh]
    dead = np.arange(s) >= lengths[..., None]
    q = rng.standard_normal((b, kh * g, h)).astype(np.float32)
    k = rng.standard_normal((b, kh, s, h)).astype(np.float32)
    v = rng.standard_normal((b, kh, s, h)).astype(np.float32)
    extra = {}
    if dtype == "fp8":
        (k, ks), (v, vs) = pk.quantize_reference(k), pk.quantize_reference(v)
        k, v, ks, vs = (np.array(x) for x in (k, v, ks, vs))
        ks[dead] = np.nan
        vs[dead] = np.nan
        extra = dict(k_scale=ks, v_scale=vs)
        q = q.astype(jnp.bfloat16)
    else:
        dt = np.float32 if dtype == "f32" else jnp.bfloat16
        q, k, v = q.astype(dt), k.astype(dt), v.astype(dt)
    k[dead] = np.nan
    v[dead] = np.nan
    pos = np.sort(rng.integers(0, 4 * s, (b, kh, s)), axis=-1).astype(np.int32)
    return q, k, v, lengths, extra, pos


def check_decode(rng, interpret, dims, dtype, variant):
    b, kh, s, h, g = dims
    q, k, v, lengths, extra, pos = make_cache(rng, b, kh, s, h, g, dtype)
    kw = dict(extra)
    if "rope" in variant:
        kw.update(
            positions=pos, rope_inv_freq=(1e4 ** -(np.arange(0, h, 2) / h)).astype(np.float32)
        )
    if "window" in variant:
        kw.update(positions=pos, q_positions=pos.max(axis=(1, 2)), sliding_window=s // 2)
    mass = "mass" in variant
    lse = "lse" in variant
    if "bias" in variant:  # the segment rebuild's log-count logit bias per slot
        kw.update(slot_bias=np.log(rng.integers(1, 4, (b, kh, s))).astype(np.float32))
    native = dict(fp8_native=True) if "native" in variant else {}
    got = pk.decode_attention(
        q, k, v, lengths, **kw, **native, return_mass=mass, return_lse=lse, interpret=interpret
    )
    want = pk.decode_attention_reference(q, k, v, lengths, **kw, return_mass=mass, return_lse=lse)
    got, want = (got, want) if mass or lse else ((got,), (want,))
    return compare_parts(got, want)


def compare_parts(got, want):
    """Worst relative error over matching outputs; -inf (an empty row's log-sum-exp) must match
    exactly and is left out of the error; NaN anywhere fails `finite`."""
    errs, finite = [], True
    for a, w in zip(got, want, strict=True):
        a, w = f32(a), f32(w)
        finite &= bool(not np.isnan(a).any() and np.array_equal(np.isinf(a), np.isinf(w)))
        live = np.isfinite(w) & np.isfinite(a)
        errs.append(rel_err(a[live], w[live]))
    return dict(err=max(errs), finite=finite)


def check_lowrank(rng, interpret, dims):
    """lowrank_attention over ragged low-rank segments (counts and ranks 0..max, NaN past them)."""
    b, kh, _, h, g = dims
    m, seg_len, r = (3, 16, 8) if interpret else (16, 64, 32)
    fac = lambda *shape: (rng.standard_normal(shape) / math.sqrt(shape[-1])).astype(np.float32)
    ck, cv = fac(b, kh, m, seg_len, r), fac(b, kh, m, seg_len, r)
    bk, bv = fac(b, kh, m, r, h), fac(b, kh, m, r, h)
    counts = rng.integers(0, seg_len + 1, (b, kh, m)).astype(np.int32)
    counts.flat[:2] = [0, seg_len]
    rank_k, rank_v = (rng.integers(0, r + 1, (b, kh, m)).astype(np.int32) for _ in range(2))
    rank_k.flat[:2] = [r, 0]
    for coef, base, rank in ((ck, bk, rank_k), (cv, bv, rank_v)):
        coef[np.arange(seg_len) >= counts[..., None]] = np.nan
        coef[np.broadcast_to(np.arange(r) >= rank[..., None, None], coef.shape)] = np.nan
        base[np.broadcast_to(np.arange(r)[:, None] >= rank[..., None, None], base.shape)] = np.nan
    bf = lambda x: x.astype(jnp.bfloat16)
    q = bf(rng.standard_normal((b, kh * g, h)).astype(np.float32))
    args = (q, bf(ck), bf(bk), bf(cv), bf(bv), counts, rank_k, rank_v)
    got = pk.lowrank_attention(*args, interpret=interpret)
    want = pk.lowrank_attention_reference(*args)
    return compare_parts(got, want)


def check_merge(rng, interpret, dims):
    """segment_merge on an fp8 cache: runs of 1-3 adjacent valid slots -> one slot each (mean K,
    V, log-count bias); within one fp8 step of the reference (bit-exact when interpreted)."""
    b, kh, s, h, _ = dims
    c = s // 2
    lengths = rng.integers(0, s + 1, (b, kh)).astype(np.int32)
    lengths.reshape(-1)[:3] = [0, 1, s][: b * kh]
    k, v = (rng.standard_normal((b, kh, s, h)).astype(np.float32) for _ in range(2))
    (k, ks), (v, vs) = (pk.quantize_reference(x, scale_dtype=jnp.bfloat16) for x in (k, v))
    starts = np.zeros((b, kh, c), np.int32)
    counts = np.zeros((b, kh, c), np.int32)
    for i, j in np.ndindex(b, kh):
        src = 0
        for slot in range(c):
            n = min(int(rng.integers(1, 4)), int(lengths[i, j]) - src)
            if n <= 0:
                break
            starts[i, j, slot], counts[i, j, slot] = src, n
            src += n
    kw = dict(k_scale=ks, v_scale=vs)
    got = pk.segment_merge(k, v, starts, counts, **kw, interpret=interpret)
    want = pk.segment_merge_reference(k, v, starts, counts, **kw)
    pairs = [(a, w) for a, w in zip(got, want, strict=True) if w is not None]
    same = all(np.array_equal(f32(a), f32(w), equal_nan=True) for a, w in pairs)
    finite = all(not np.isnan(f32(a)).any() for a, _ in pairs)
    # Interpret mode is bit-exact; compiled, float32 rounding may differ (operation order, FMA),
    # moving a code by one fp8 step. err: dequantised K and V; steps: worst code distance.
    deq = lambda m, n: f32(getattr(m, n)) * f32(getattr(m, f"{n}_scale"))[..., None]
    valid = np.arange(c) < f32(want.lengths)[..., None]
    far = max(rel_err(deq(got, n)[valid], deq(want, n)[valid]) for n in "kv")
    step = lambda x: np.asarray(x).view(np.uint8).astype(np.int32)
    signed = lambda x: np.where(step(x) & 0x80, -(step(x) & 0x7F), step(x) & 0x7F)
    steps = max(int(np.abs(signed(got.k) - signed(want.k))[valid].max(initial=0)),
                int(np.abs(signed(got.v) - signed(want.v))[valid].max(initial=0)))  # fmt: skip
    same_k = step(got.k)[valid] == step(want.k)[valid]
    scales_equal = all(np.array_equal(f32(getattr(got, n))[valid], f32(getattr(want, n))[valid])
                       for n in ("k_scale", "v_scale"))  # fmt: skip
    return dict(err=far if steps <= 1 else 1.0, finite=finite, bit_equal=same,
                max_code_steps=steps, k_codes_differing=float(1 - same_k.mean()),
                scales_equal=scales_equal)  # fmt: skip


def check_quantize(rng, interpret, dims):
    b, kh, s, h, _ = dims
    x = rng.standard_normal((b, kh, 37, h)).astype(jnp.bfloat16)
    vals, scales = pk.quantize(x, interpret=interpret)
    rv, rs = pk.quantize_reference(x)
    deq = pk.dequantize_reference(vals, scales)
    err = rel_err(deq, pk.dequantize_reference(rv, rs))  # GPU division may round 1 ulp apart
    fp8_err = rel_err(deq, f32(x))
    return dict(err=err, fp8_vs_input=fp8_err, finite=bool(np.isfinite(f32(deq)).all()))


def check_append(rng, interpret, dims):
    b, kh, s, h, _ = dims
    cache = np.full((b, kh, s, h), np.nan, np.float32).astype(FP8)  # poisoned buffers
    scale = np.full((b, kh, s), np.nan, np.float32)
    new = rng.standard_normal((b, kh, 3, h)).astype(jnp.bfloat16)
    start = rng.integers(0, s + 1, (b, kh)).astype(np.int32)
    start.reshape(-1)[:3] = [0, s, s - 1][: b * kh]  # empty, full, room for one
    c, sc = pk.quantize_append(cache, scale, new, start, interpret=interpret)
    rc, rsc = pk.quantize_append_reference(cache, scale, new, start)
    same_poison = np.array_equal(np.isnan(f32(sc)), np.isnan(f32(rsc)))
    written = ~np.isnan(f32(rsc))
    got = f32(c)[written] * f32(sc)[written][:, None]
    want = f32(rc)[written] * f32(rsc)[written][:, None]
    return dict(err=rel_err(got, want), finite=bool(same_poison))


def check_compact(rng, interpret, dims, by):
    b, kh, s, h, _ = dims
    _, k, v, lengths, extra, pos = make_cache(
        rng, b, kh, s, h, 1, "fp8" if by == "mask" else "bf16"
    )
    keep = rng.random((b, kh, s)) < 0.5
    if by == "mask":
        sel = dict(keep_mask=np.asarray(pk.pack_mask(keep)), positions=pos, **extra)
    else:
        idx = np.asarray(pk.mask_to_indices(keep & (np.arange(s) < lengths[..., None]), s // 2))
        sel = dict(keep_indices=np.where(idx == s, -1, idx), positions=pos)
    got = pk.kv_compact(k, v, lengths, **sel, interpret=interpret)
    want = pk.kv_compact_reference(k, v, lengths, **sel)
    errs, finite = [], True
    for a, w in zip(got, want, strict=True):
        if a is not None:
            errs.append(0.0 if np.array_equal(f32(a), f32(w)) else 1.0)
            finite &= bool(np.isfinite(f32(a)).all())
    return dict(err=max(errs), finite=finite)


def check_window(rng, interpret, dims, pool):
    b, kh, s, h, g = dims
    lengths = rng.integers(0, s + 1, (b, kh)).astype(np.int32)
    lengths.reshape(-1)[:3] = [0, 1, s][: b * kh]
    q = rng.standard_normal((b, kh * g, 16, h)).astype(jnp.bfloat16)
    k = rng.standard_normal((b, kh, s, h)).astype(np.float32)
    k[np.arange(s) >= lengths[..., None]] = np.nan
    k = k.astype(jnp.bfloat16)
    got = pk.window_scores(q, k, lengths, pool=pool, kernel_size=7, interpret=interpret)
    want = pk.window_scores_reference(q, k, lengths, pool=pool, kernel_size=7)
    return dict(err=rel_err(got, want), finite=bool(np.isfinite(f32(got)).all()))


def make_prefill(rng, dims, dtype, variant):
    """A chunk of T queries (ragged q_lengths, query 0 blind) over a ragged cache holding it;
    NaN planted past every length, in dropped slots and in padded queries."""
    b, kh, s, h, g = dims
    t = 40 if s < 1000 else 200  # not a multiple of block_q
    q, k, v, lengths, extra, pos = make_cache(rng, b, kh, s, h, g, dtype)
    q = rng.standard_normal((b, t, kh * g, h)).astype(np.float32)
    q = q.astype(np.float32 if dtype == "f32" else jnp.bfloat16)
    q_lengths = rng.integers(t // 2, t + 1, b).astype(np.int32)
    q_lengths[0] = t
    q_pos = np.sort(rng.integers(0, 4 * s, (b, t)), axis=-1).astype(np.int32)
    q_pos[:, 0] = -1
    kw = dict(extra, q_lengths=q_lengths)
    if "keep" in variant:  # dropped slots hold NaN: only the keep mask hides them
        kept = rng.random((b, kh, s)) < 0.7
        kw["keep_mask"] = np.asarray(pk.pack_mask(kept))
        k, v = np.array(k), np.array(v)
        k[~kept], v[~kept] = np.nan, np.nan
    if "bias" in variant:
        kw["slot_bias"] = np.log(rng.integers(1, 4, (b, kh, s))).astype(np.float32)
    if "rope" in variant:
        kw["rope_inv_freq"] = (1e4 ** -(np.arange(0, h, 2) / h)).astype(np.float32)
    if "window" in variant:
        kw["sliding_window"] = s // 2
    return (q, k, v, lengths, pos, q_pos), kw


def check_prefill(rng, interpret, dims, dtype, variant):
    """prefill_attention (flash, online softmax over key blocks), and with "mass" the second
    pass giving each slot's attention probability, against the float32 references."""
    args, kw = make_prefill(rng, dims, dtype, variant)
    small = dict(block_q=8, block_s=16) if interpret else {}
    if "mass" not in variant:
        got = pk.prefill_attention(*args, **kw, **small, interpret=interpret)
        return compare_parts((got,), (pk.prefill_attention_reference(*args, **kw),))
    kv_kw = {n: x for n, x in kw.items() if n != "v_scale"}
    _, lse = pk.prefill_attention(*args, **kw, return_lse=True, **small, interpret=interpret)
    got = pk.prefill_attention_mass(
        *args[:2], *args[3:], lse, **kv_kw, **small, interpret=interpret
    )
    _, ref_lse = pk.prefill_attention_reference(*args, **kw, return_lse=True)
    want = pk.prefill_attention_mass_reference(*args[:2], *args[3:], ref_lse, **kv_kw)
    return compare_parts((got, lse), (want, ref_lse))


def make_paged(rng, dims, dtype, page):
    """A shuffled pool where each (row, kv head) owns its own pages; every pool slot no head
    reads below its length holds NaN (K, V and scales)."""
    b, kh, s, h, g = dims
    max_pages = -(-s // page)
    n_pool = b * kh * max_pages + 7
    lengths = rng.integers(0, max_pages * page + 1, (b, kh)).astype(np.int32)
    lengths.reshape(-1)[:3] = [0, 1, max_pages * page][: b * kh]
    table = rng.permutation(n_pool)[: b * kh * max_pages].reshape(b, kh, max_pages)
    table = table.astype(np.int32)
    live = np.zeros((n_pool, page), bool)
    for i, j in np.ndindex(b, kh):
        tok = np.arange(lengths[i, j])
        live[table[i, j, tok // page], tok % page] = True
    k, v = (rng.standard_normal((n_pool, page, h)).astype(np.float32) for _ in range(2))
    kw = {}
    if dtype == "fp8":
        (k, ks), (v, vs) = (
            pk.quantize_reference(x[None], scale_dtype=jnp.bfloat16) for x in (k, v)
        )
        k, v = np.array(k[0]), np.array(v[0])
        kw = dict(k_scale_pages=np.array(ks[0]), v_scale_pages=np.array(vs[0]))
        q = rng.standard_normal((b, kh * g, h)).astype(jnp.bfloat16)
    else:
        dt = np.float32 if dtype == "f32" else jnp.bfloat16
        k, v = k.astype(dt), v.astype(dt)
        q = rng.standard_normal((b, kh * g, h)).astype(dt)
    for x in (k, v, *kw.values()):
        x[~live] = np.asarray(np.nan).astype(x.dtype)
    return (q, k, v, table, lengths), kw


def check_paged(rng, interpret, dims, dtype, variant):
    """paged_decode_attention over a shuffled per-head page pool, against its reference."""
    page = 16
    args, kw = make_paged(rng, dims, dtype, page)
    mass = "mass" in variant
    got = pk.paged_decode_attention(*args, **kw, return_mass=mass, interpret=interpret)
    want = pk.paged_decode_attention_reference(*args, **kw, return_mass=mass)
    if mass:  # slots past each head's length are not defined: compare the valid ones
        lengths = args[4]
        valid = np.arange(want[1].shape[-1]) < lengths[..., None]
        got = (got[0], np.where(valid, f32(got[1]), 0.0))
        want = (want[0], np.where(valid, f32(want[1]), 0.0))
    else:
        got, want = (got,), (want,)
    return compare_parts(got, want)


def run_checks(interpret: bool, seed: int, only=()) -> list[dict]:
    dims = (2, 2, 100, 64, 4) if interpret else (4, 8, 3000, 128, 4)  # B, K, S, H, G
    rng = np.random.default_rng(seed)
    bf16_tol = 2e-2
    cases = [
        ("decode_f32", lambda: check_decode(rng, interpret, dims, "f32", ""), 1e-4),
        ("decode_bf16", lambda: check_decode(rng, interpret, dims, "bf16", ""), bf16_tol),
        ("decode_bf16_mass", lambda: check_decode(rng, interpret, dims, "bf16", "mass"), bf16_tol),
        ("decode_bf16_rope", lambda: check_decode(rng, interpret, dims, "bf16", "rope"), bf16_tol),
        ("decode_fp8", lambda: check_decode(rng, interpret, dims, "fp8", ""), bf16_tol),
        (
            "decode_fp8_rope_window_mass",
            lambda: check_decode(rng, interpret, dims, "fp8", "rope_window_mass"),
            bf16_tol,
        ),
        (
            "decode_fp8_bias_lse",
            lambda: check_decode(rng, interpret, dims, "fp8", "bias_lse"),
            bf16_tol,
        ),
        (
            "decode_fp8_native",
            lambda: check_decode(rng, interpret, dims, "fp8", "native"),
            bf16_tol,
        ),
        (
            "decode_fp8_native_rope_window_mass",
            lambda: check_decode(rng, interpret, dims, "fp8", "native_rope_window_mass"),
            bf16_tol,
        ),
        ("lowrank_attention_bf16", lambda: check_lowrank(rng, interpret, dims), bf16_tol),
        ("segment_merge_fp8", lambda: check_merge(rng, interpret, dims), 1e-2),
        ("quantize", lambda: check_quantize(rng, interpret, dims), 1e-3),
        ("quantize_append", lambda: check_append(rng, interpret, dims), 1e-3),
        ("compact_by_mask_fp8_in_place", lambda: check_compact(rng, interpret, dims, "mask"), 0),
        ("compact_by_indices_bf16", lambda: check_compact(rng, interpret, dims, "indices"), 0),
        ("window_scores_avg", lambda: check_window(rng, interpret, dims, "avg"), bf16_tol),
        ("window_scores_max", lambda: check_window(rng, interpret, dims, "max"), bf16_tol),
        ("prefill_f32", lambda: check_prefill(rng, interpret, dims, "f32", ""), 1e-4),
        (
            "prefill_bf16_keep_bias",
            lambda: check_prefill(rng, interpret, dims, "bf16", "keep_bias"),
            bf16_tol,
        ),
        (
            "prefill_fp8_rope_window",
            lambda: check_prefill(rng, interpret, dims, "fp8", "rope_window"),
            bf16_tol,
        ),
        (
            "prefill_mass_bf16_keep",
            lambda: check_prefill(rng, interpret, dims, "bf16", "mass_keep"),
            bf16_tol,
        ),
        ("paged_decode_f32", lambda: check_paged(rng, interpret, dims, "f32", ""), 1e-4),
        (
            "paged_decode_bf16_mass",
            lambda: check_paged(rng, interpret, dims, "bf16", "mass"),
            bf16_tol,
        ),
        ("paged_decode_fp8", lambda: check_paged(rng, interpret, dims, "fp8", ""), bf16_tol),
    ] + [
        (name, lambda d=dtype, w=window: ragged.check_ragged(rng, interpret, d, w), tol)
        for name, dtype, window, tol in ragged.CASES
    ]
    cases += [
        (name, lambda d=dtype: ragged.check_votes(rng, interpret, d), tol)
        for name, dtype, tol in ragged.VOTE_CASES
    ]
    results = []
    for name, fn, tol in cases:
        if only and not any(word in name for word in only):
            continue
        t0 = time.perf_counter()
        try:
            r = fn()
            r["ok"] = bool(r["finite"] and r["err"] <= tol)
        except Exception as e:  # report and continue: one broken kernel must not hide the rest
            r = dict(ok=False, error=f"{type(e).__name__}: {e}"[:2000])
        r.update(name=name, tol=tol, seconds=round(time.perf_counter() - t0, 2))
        results.append(r)
        status = "ok" if r["ok"] else "FAIL"
        detail = r.get("error") or f"rel err {r['err']:.2e} (tol {tol:g})"
        extra = f", fp8 vs input {r['fp8_vs_input']:.4f}" if "fp8_vs_input" in r else ""
        if "max_code_steps" in r:
            extra += f", bit-equal {r['bit_equal']}, K codes differing {r['k_codes_differing']:.2e}"
            extra += f" by <= {r['max_code_steps']} step(s), scales equal {r['scales_equal']}"
        print(f"  {status:4s} {name:32s} {detail}{extra}  [{r['seconds']}s]", flush=True)
    return results


# ---------------------------------------------------------------- timing


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--cpu", action="store_true", help="correctness only, interpret mode, tiny")
    ap.add_argument("--out", default=str(Path(__file__).parent / "results"))
    ap.add_argument(
        "--budget-s", type=float, default=420.0,
        help="stop timing after this (decode: the first 55%%, prefill to 80%%, paged to 90%%, ragged)",
    )  # fmt: skip
    ap.add_argument(
        "--timing", nargs="*", default=["decode", "prefill", "paged", "ragged"],
        choices=["decode", "prefill", "paged", "ragged"], help="which timings to run on a GPU",
    )  # fmt: skip
    ap.add_argument("--decode-s", type=int, nargs="*", help="decode timing: these S only")
    ap.add_argument("--decode-b", type=int, nargs="*", help="decode timing: these B only")
    ap.add_argument("--checks", nargs="*", default=[], help="only checks naming one of these")
    ap.add_argument("--seed", type=int, default=int(time.time()) % (2**31))
    args = ap.parse_args(argv)
    timing.DECODE_S = args.decode_s or timing.DECODE_S
    timing.DECODE_B = args.decode_b or timing.DECODE_B
    start = time.monotonic()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    if args.cpu:
        jax.config.update("jax_platforms", "cpu")
    dev = jax.devices()[0]
    gpu = dev.platform == "gpu"
    print(f"jax {jax.__version__} on {dev.device_kind} ({dev.platform}); seed {args.seed}")
    report = dict(
        meta=dict(
            jax=jax.__version__,
            python=platform.python_version(),
            device=dev.device_kind,
            platform=dev.platform,
            mode="cpu-interpret" if args.cpu else "compiled",
            seed=args.seed,
            started=time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        )
    )
    path = out / ("gpu_check_cpu.json" if args.cpu else "gpu_check.json")

    def save(decode_rows=None):
        if decode_rows is not None:
            copy_gbps = report.get("copy", {}).get("GBps")
            for r in decode_rows:
                if "pallas_GBps" in r and copy_gbps:
                    r["pallas_vs_copy"] = round(r["pallas_GBps"] / copy_gbps, 3)
            report["decode"] = decode_rows
        report["meta"]["seconds"] = round(time.monotonic() - start, 1)
        path.write_text(json.dumps(report, indent=1, default=str) + "\n")

    print("correctness:")
    report["checks"] = run_checks(interpret=args.cpu or not gpu, seed=args.seed, only=args.checks)
    failed = [c["name"] for c in report["checks"] if not c["ok"]]
    report["failed"] = failed
    save()
    if gpu and not args.cpu:
        report["copy"] = timing.time_copy()
        print(f"device-to-device copy: {report['copy']['GBps']} GB/s")
        keep = lambda name: lambda rows: (report.__setitem__(name, rows), save())
        if "decode" in args.timing:
            print("decode attention timing:")
            save(timing.time_decode(start + 0.55 * args.budget_s, out / "traces", save))
        if "prefill" in args.timing:
            print("prefill attention timing (one 512-token chunk):")
            timing.time_prefill(start + 0.8 * args.budget_s, out / "traces", keep("prefill"))
        if "paged" in args.timing:
            print("paged decode attention timing:")
            timing.time_paged(start + 0.9 * args.budget_s, out / "traces", keep("paged"))
        if "ragged" in args.timing:
            print("ragged paged attention timing (the engine's flattened step):")
            ragged.time_ragged(start + args.budget_s, out / "traces", keep("ragged"))
    elif not args.cpu:
        report["decode"] = "skipped: no GPU"
    save()
    timing.print_summary(report)
    print(f"wrote {path}; {len(failed)} failed check(s) {failed if failed else ''}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
