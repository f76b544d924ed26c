"""The engine's ragged paged attention on the GPU: its correctness checks and its timing.

`make_ragged` builds a step like the engine's: rows of one query (decode) and chunks of several
(prefill) one after another in q, each (row, kv head) with its own pages drawn shuffled from the
pool, compressed heads with a gap between prefix and tail, NaN in every slot no head reads.
`time_ragged` times the Pallas kernel (`ragged_paged_attention`) beside the XLA loop path
(`ragged_paged_attention_xla`) on 16 rows of 32 tokens + one row of 1,000, the short rows alone
and the long row alone (the engine's mixed-length goal: mixed <= 1.5x short + long), and on 32
decode rows of 8K tokens in bf16 and FP8 beside `paged_decode_attention` (the same bytes).
Imported by gpu_check.py (beside it).
"""

from __future__ import annotations

import json
import math
import time

import gpu_timing as timing
import jax.numpy as jnp
import numpy as np

import jkv_kernels as pk

POISON_POS = 1 << 30


def make_ragged(rng, q_lens, ctx_lens, kh, g, h, page, dtype, gaps=True):
    """Arguments of `ragged_paged_attention` (keywords) for rows with `q_lens` queries, the last
    of `ctx_lens` tokens each; odd rows' heads are compressed (a gap) when `gaps`."""
    r = len(q_lens)
    m = max(-(-(c + 2 * page) // page) for c in ctx_lens)
    n_pool = r * kh * m + 8
    free = iter(rng.permutation(np.arange(1, n_pool)))
    table = np.zeros((r, kh, m), np.int32)
    lengths = np.zeros((r, kh), np.int32)
    gap = np.zeros((r, kh, 2), np.int32)
    pos = np.full((n_pool, page), POISON_POS, np.int32)
    live = np.zeros((n_pool, page), bool)
    q_pos = []
    for i, (n, ctx) in enumerate(zip(q_lens, ctx_lens, strict=True)):
        for k in range(kh):
            lo = hi = 0
            if gaps and i % 2:
                lo = int(rng.integers(1, min(ctx, 2 * page) + 1))
                hi = -(-lo // page) * page
            held = ctx + (hi - lo)
            lengths[i, k] = held
            gap[i, k] = (lo, hi)
            for j in range(-(-held // page)):
                table[i, k, j] = next(free)
            slots = [s for s in range(held) if not lo <= s < hi]
            for x, s in enumerate(slots):
                pos[table[i, k, s // page], s % page] = x
                live[table[i, k, s // page], s % page] = True
        q_pos += list(range(ctx - n, ctx))
    k_pages = rng.standard_normal((n_pool, page, h)).astype(np.float32)
    v_pages = rng.standard_normal((n_pool, page, h)).astype(np.float32)
    k_pages[~live], v_pages[~live] = np.nan, np.nan
    kw = {}
    q_dtype = np.float32 if dtype == "f32" else jnp.bfloat16
    if dtype == "fp8":
        (k8, ks), (v8, vs) = (
            pk.quantize_reference(x[None], scale_dtype=jnp.bfloat16) for x in (k_pages, v_pages)
        )
        k_pages, v_pages = np.array(k8[0]), np.array(v8[0])
        kw = dict(k_scale=np.array(ks[0]), v_scale=np.array(vs[0]))
        for x in kw.values():
            x[~live] = np.asarray(np.nan).astype(x.dtype)
    elif dtype == "bf16":
        k_pages, v_pages = k_pages.astype(jnp.bfloat16), v_pages.astype(jnp.bfloat16)
    t = sum(q_lens)
    return dict(
        q=rng.standard_normal((t, kh * g, h)).astype(q_dtype),
        k_pages=k_pages,
        v_pages=v_pages,
        page_table=table,
        lengths=lengths,
        q_start=np.cumsum([0, *q_lens[:-1]]).astype(np.int32),
        q_len=np.asarray(q_lens, np.int32),
        q_positions=np.asarray(q_pos, np.int32),
        pos_pages=pos,
        gaps=gap if gaps else None,
        **kw,
    )


def check_ragged(rng, interpret, dtype, window=None):
    """The Pallas kernel against its float32 reference on a mixed decode + prefill step."""
    kh, g, h, page = (2, 2, 64, 16) if interpret else (8, 4, 128, 16)
    q_lens = [1, 1, 37, 1, 16, 1] if interpret else [1] * 12 + [512, 1, 100, 1]
    ctx = [40, 3, 90, 17, 16, 100] if interpret else [3000] * 12 + [1024, 1, 2000, 700]
    a = make_ragged(rng, q_lens, ctx, kh, g, h, page, dtype)
    got = pk.ragged_paged_attention(**a, sliding_window=window, interpret=interpret)
    want = pk.ragged_paged_attention_reference(**a, sliding_window=window)
    got = np.asarray(jnp.asarray(got).astype(jnp.float32), np.float64)
    want = np.asarray(want, np.float64)
    err = float(np.linalg.norm(got - want) / max(np.linalg.norm(want), 1e-30))
    return dict(err=err, finite=bool(np.isfinite(got).all()))


def check_votes(rng, interpret, dtype):
    """`paged_window_scores` (the engine's selection: SnapKV's votes of each row's last tokens
    through its page table) against its float32 reference, max-pooled."""
    kh, g, h, page = (2, 2, 64, 16) if interpret else (8, 4, 128, 16)
    q_lens = [8, 32, 1, 16] if interpret else [32] * 8 + [64] * 4
    ctx = [40, 90, 17, 100] if interpret else [3000] * 8 + [8000] * 4
    a = make_ragged(rng, q_lens, ctx, kh, g, h, page, dtype, gaps=False)
    names = ("q", "k_pages", "page_table", "lengths", "q_start", "q_len", "q_positions",
             "pos_pages", "k_scale")  # fmt: skip
    b = {n: a[n] for n in names if n in a}
    got = pk.paged_window_scores(**b, pool="max", kernel_size=7, interpret=interpret)
    want = np.asarray(pk.paged_window_scores_reference(**b, pool="max", kernel_size=7))
    got = np.asarray(got, np.float64)
    err = float(np.linalg.norm(got - want) / max(np.linalg.norm(want), 1e-30))
    return dict(err=err, finite=bool(np.isfinite(got).all()))


VOTE_CASES = [("paged_votes_bf16", "bf16", 2e-2), ("paged_votes_fp8", "fp8", 2e-2)]
CASES = [  # (name, dtype, window, tolerance)
    ("ragged_paged_f32", "f32", None, 1e-4),
    ("ragged_paged_bf16", "bf16", None, 2e-2),
    ("ragged_paged_fp8_window", "fp8", 64, 2e-2),
]


def time_ragged(budget_end, trace_root, save, shape=(8, 4, 128, 16), scale=1) -> list[dict]:
    """Mixed-length and long-decode timings (bf16 and FP8 pools; `shape` K, G, H, page;
    `scale` < 1 shrinks every length, for a smoke run)."""
    kh, g, h, page = shape
    rng = np.random.default_rng(0)
    sized = lambda lens: [max(1, int(n * scale)) for n in lens]  # noqa: E731
    setups = {
        "short_16x32": ([1] * 16, [32] * 16),
        "long_1x1000": ([1], [1000]),
        "mixed": ([1] * 16 + [1], [32] * 16 + [1000]),
        "decode_32x8K": ([1] * 32, [8192] * 32),
        "chunk_512_over_4K": ([512], [4096]),
    }
    rows = []
    for dtype in ("bf16", "fp8"):
        for name, (q_lens, ctx) in setups.items():
            q_lens, ctx = [1 if n == 1 else max(1, int(n * scale)) for n in q_lens], sized(ctx)
            row = dict(setup=name, dtype=dtype, rows=len(q_lens), tokens=sum(q_lens))
            if time.monotonic() > budget_end:
                rows.append(dict(row, skipped="time budget"))
                continue
            a = make_ragged(rng, q_lens, ctx, kh, g, h, page, dtype, gaps=False)
            a = {k: (jnp.asarray(v) if v is not None else None) for k, v in a.items()}
            item = 1 if dtype == "fp8" else 2
            row["bytes_read"] = read = 2 * kh * sum(ctx) * h * item
            tag = f"ragged_{name}_{dtype}"
            steps = dict(num_decode=sum(n == 1 for n in q_lens), num_rows=len(q_lens))
            impls = {
                "pallas": timing.named_jit(
                    f"pallas_{tag}", lambda kw: pk.ragged_paged_attention(**kw)
                ),
                "xla": timing.named_jit(
                    f"xla_{tag}", lambda kw, st=steps: pk.ragged_paged_attention_xla(**kw, **st)
                ),
            }
            inputs = {n: [(a,)] for n in impls}
            timing.time_impls(row, impls, inputs, 20, trace_root, tag)
            for n in impls:
                sec = row.get(f"{n}_device_s") or row.get(f"{n}_wall_s")
                if sec:
                    row[f"{n}_GBps"] = round(read / sec / 1e9, 1)
            rows.append(row)
            print(json.dumps(row), flush=True)
            save(rows)
    for dtype in ("bf16", "fp8"):
        by = {r["setup"]: r for r in rows if r["dtype"] == dtype and "skipped" not in r}
        if {"short_16x32", "long_1x1000", "mixed"} <= by.keys():
            sec = lambda r: r.get("pallas_device_s") or r.get("pallas_wall_s") or math.nan  # noqa: E731
            ratio = sec(by["mixed"]) / (sec(by["short_16x32"]) + sec(by["long_1x1000"]))
            rows.append(dict(setup="mixed / (short + long)", dtype=dtype, ratio=round(ratio, 3)))
    save(rows)
    return rows
