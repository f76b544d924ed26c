"""ragged_paged_attention_xla (the engine's XLA path) and ragged_paged_attention (the Pallas
kernel, interpret mode, and lowered for CUDA) against their float32 reference, and the
reference against the dense decode reference and a numpy loop of its own.

Pools are built like the engine's: each (row, kv head) gets pages drawn shuffled from the pool;
rows are a mix of one-query decode rows and chunks of several queries whose tokens are in the
pool already; compressed heads have a gap (slots between the end of their prefix and the start
of their tail); every slot no head reads is poisoned (NaN K, V and scales, a far-away position).
"""

from __future__ import annotations

import functools

import jax.numpy as jnp
import numpy as np
import pytest

from jkv_kernels.decode_attention import decode_attention_reference
from jkv_kernels.kv_quantize import quantize_reference
from jkv_kernels.ragged_paged_attention import (
    WEIGHT_SHIFT,
    ragged_paged_attention,
    ragged_paged_attention_reference,
)
from jkv_kernels.ragged_paged_attention_xla import ragged_paged_attention_xla

KH, G, H = 2, 2, 16
POISON_POS = 1 << 30


def make_case(rng, q_lens, page, m, dtype, gaps: bool, uneven: bool = False):
    """Rows with `q_lens` queries each (1: decode); returns the kernel's arguments. `uneven`:
    a row's kv heads hold different counts of its tokens (KVzip's and Ada-KV's kept slots),
    its first head all of them."""
    r = len(q_lens)
    p = r * KH * m + 8
    lengths = np.zeros((r, KH), np.int32)
    gap = np.zeros((r, KH, 2), np.int32)
    table = rng.integers(0, p, (r, KH, m)).astype(np.int32)  # arbitrary past a head's pages
    free = iter(rng.permutation(np.arange(1, p)))
    pos = np.full((p, page), POISON_POS, np.int32)
    live = np.zeros((p, page), bool)
    q_pos = []
    for i, n in enumerate(q_lens):
        ctx = int(rng.integers(n, m * page - page + 1))  # the row's tokens, its queries last
        if uneven:  # its first head holds most of the blocks, the others a quarter at most
            ctx = int(rng.integers(max(n, (m - 2) * page), m * page - page + 1))
        # text positions increasing with the slot (evicted tokens leave holes in the text),
        # the same for every head of the row
        text = np.cumsum(rng.integers(1, 3, m * page))
        for k in range(KH):
            held = int(rng.integers(1, ctx // 4 + 1)) if uneven and k else ctx
            lo = hi = 0
            if gaps and i % 2:  # a compressed head: prefix, gap to the next page, then a tail
                base = int(rng.integers(0, 2 * page))
                hi = -(-max(base, 1) // page) * page
                lo = base
                held = hi + ctx - min(ctx, page)  # tail tokens after the gap
            need = -(-held // page)
            if need > m:
                held, need = m * page, m
            lengths[i, k] = held
            gap[i, k] = (lo, hi)
            for j in range(need):
                table[i, k, j] = next(free)
            slots = [s for s in range(held) if not lo <= s < hi]
            for s, x in zip(slots, text, strict=False):
                pos[table[i, k, s // page], s % page] = x
                live[table[i, k, s // page], s % page] = True
        # the row's queries: its last n tokens (the last one at the latest position any head
        # holds)
        last = max(int(text[len([s for s in range(lengths[i, k]) if not gap[i, k, 0] <= s
                                 < gap[i, k, 1]]) - 1]) for k in range(KH))  # fmt: skip
        q_pos += list(range(last - n + 1, last + 1))
    k = rng.standard_normal((p, page, H)).astype(np.float32)
    v = rng.standard_normal((p, page, H)).astype(np.float32)
    k[~live], v[~live] = np.nan, np.nan
    t = sum(q_lens)
    q_start = np.cumsum([0, *q_lens[:-1]]).astype(np.int32)
    args = dict(
        q=rng.standard_normal((t + 3, KH * G, H)).astype(np.float32),  # 3 tokens of no row
        page_table=table,
        lengths=lengths,
        q_start=q_start,
        q_len=np.asarray(q_lens, np.int32),
        q_positions=np.asarray(q_pos + [0, 0, 0], np.int32),
        pos_pages=pos,
        gaps=gap if gaps else None,
    )
    scales = {}
    if dtype == "fp8":
        (k8, ks), (v8, vs) = (quantize_reference(x[None], scale_dtype=jnp.bfloat16) for x in (k, v))
        k, v = np.array(k8[0]), np.array(v8[0])
        scales = dict(k_scale=np.array(ks[0]), v_scale=np.array(vs[0]))
        scales["k_scale"][~live] = np.nan
        scales["v_scale"][~live] = np.nan
    elif dtype == "bf16":
        k, v = k.astype(jnp.bfloat16), v.astype(jnp.bfloat16)
    return dict(args, k_pages=k, v_pages=v, **scales)


def with_rope(rng, a):
    """`a` with some rows StreamingLLM's rings, their sinks and shifts random."""
    r = len(a["q_len"])
    raw = rng.random(r) < 0.6
    raw[:2] = [True, False]
    sink = rng.integers(4, 12, r).astype(np.int32)  # positions start at 1 or 2
    shift = rng.integers(5, 30, r).astype(np.int32)
    inv_freq = (1e4 ** -(np.arange(H // 2) * 2 / H)).astype(np.float32)
    return {**a, "rope": (raw, sink, shift, inv_freq)}


def rotated(x, rank, inv_freq):
    """numpy RoPE (rotate-half) of one key `[H]` at `rank`."""
    ang = np.concatenate([rank * inv_freq, rank * inv_freq]).astype(np.float64)
    return x * np.cos(ang) + np.concatenate([-x[H // 2 :], x[: H // 2]]) * np.sin(ang)


def numpy_reference(a, window=None):
    """The maths of the module docstring, one query at a time, in float64."""
    q = np.asarray(a["q"], np.float64)
    k = np.asarray(jnp.asarray(a["k_pages"]).astype(jnp.float32), np.float64)
    v = np.asarray(jnp.asarray(a["v_pages"]).astype(jnp.float32), np.float64)
    if "k_scale" in a:
        k = k * np.asarray(jnp.asarray(a["k_scale"]).astype(jnp.float32))[..., None]
        v = v * np.asarray(jnp.asarray(a["v_scale"]).astype(jnp.float32))[..., None]
    page = k.shape[1]
    out = np.zeros(q.shape)
    for r, (s0, n) in enumerate(zip(a["q_start"], a["q_len"], strict=True)):
        for t in range(s0, s0 + n):
            for kv in range(KH):
                lo, hi = a["gaps"][r, kv] if a["gaps"] is not None else (0, 0)
                slots = [s for s in range(a["lengths"][r, kv]) if not lo <= s < hi]
                pages = [a["page_table"][r, kv, s // page] for s in slots]
                offs = [s % page for s in slots]
                pos = np.array(
                    [a["pos_pages"][pg, o] for pg, o in zip(pages, offs, strict=True)], np.int64
                )
                log_w = np.zeros(len(pos))
                if a.get("weights"):  # a merged slot: weight - 1 above WEIGHT_SHIFT
                    log_w = np.log((pos >> WEIGHT_SHIFT) + 1.0)
                    pos = pos % (1 << WEIGHT_SHIFT)
                ok = pos <= a["q_positions"][t]
                if window is not None:
                    ok &= a["q_positions"][t] - pos < window
                kk = np.stack([k[pg, o] for pg, o in zip(pages, offs, strict=True)] or [k[0, 0]])
                kk, vv = (
                    kk[: len(pages)],
                    np.stack([v[pg, o] for pg, o in zip(pages, offs, strict=True)] or [v[0, 0]])[
                        : len(pages)
                    ],
                )
                if a.get("rope") is not None and a["rope"][0][r]:
                    _, sink, shift, inv_freq = a["rope"]
                    turn = np.where(pos < sink[r], shift[r], 0)  # the sinks: to their rank
                    kk = np.stack([rotated(x, y, inv_freq) for x, y in zip(kk, turn, strict=True)])
                kk, vv, log_w = kk[ok], vv[ok], log_w[ok]
                if a.get("lowrank") is not None:  # each low-rank page's tokens: C^T.T @ B
                    start, count = a["lowrank"]
                    rank = a["lowrank_rank"]
                    for i in range(count[r]):
                        pg = a["page_table"][r, kv, start[r] + i]
                        held = a["pos_pages"][pg, 0]
                        kk = np.concatenate([kk, (k[pg, rank:].T @ k[pg, :rank])[:held]])
                        vv = np.concatenate([vv, (v[pg, rank:].T @ v[pg, :rank])[:held]])
                        log_w = np.concatenate([log_w, np.zeros(held)])
                if not len(kk):
                    continue
                for g in range(G):
                    z = kk @ q[t, kv * G + g] * H**-0.5 + log_w
                    w = np.exp(z - z.max())
                    out[t, kv * G + g] = (w / w.sum()) @ vv
    return out


def with_segments(rng, a, rank):
    """`a` (built with gaps) as the segment rebuild leaves rows: in each row with a gap, some
    prefix slots are merged (weight 2 or 3, in their positions) and 1-3 low-rank pages sit in
    its gap before the tail (a basis of `rank` rows, then the coefficients of H tokens, the
    columns past the page's count poisoned)."""
    page = a["k_pages"].shape[1]
    assert page == 2 * rank  # one block of coefficients: H tokens a page
    r, kh, m = a["page_table"].shape
    k, v = (np.asarray(jnp.asarray(a[x]).astype(jnp.float32)) for x in ("k_pages", "v_pages"))
    if "k_scale" in a:
        k = k * np.asarray(jnp.asarray(a["k_scale"]).astype(jnp.float32))[..., None]
        v = v * np.asarray(jnp.asarray(a["v_scale"]).astype(jnp.float32))[..., None]
    pos = a["pos_pages"].copy()
    poison = []  # (page, first unheld token) of each low-rank page
    count = np.where(a["gaps"][:, 0, 1] > 0, rng.integers(1, 4, r), 0).astype(np.int32)
    count[np.argmax(a["gaps"][:, 0, 1] > 0)] = 3  # a row with three
    start = (a["gaps"][:, :, 1].max(axis=1) // page).astype(np.int32)  # the row's prefix end
    width = m + int(count.max()) + int((start[:, None] - a["gaps"][:, :, 1] // page).max())
    table = np.zeros((r, kh, width), np.int32)
    lengths, gaps = a["lengths"].copy(), a["gaps"].copy()
    new_k, new_v, new_pos = [k], [v], [pos]
    p = k.shape[0]
    for i in range(r):
        for j in range(kh):
            lo, hi = gaps[i, j]
            col = hi // page
            # the prefix ends at the row's longest head's: pages of nothing up to there
            extra = list(rng.integers(0, p, start[i] - col))
            for _ in range(count[i]):
                kp, vp = (rng.standard_normal((page, H)).astype(np.float32) for _ in range(2))
                held = int(rng.integers(1, H + 1))
                poison.append((p, held))
                pp = np.full((page,), POISON_POS, np.int32)
                pp[0] = held
                new_k.append(kp[None]), new_v.append(vp[None]), new_pos.append(pp[None])
                extra.append(p)
                p += 1
            row = list(a["page_table"][i, j, :col]) + extra + list(a["page_table"][i, j, col:])
            table[i, j] = row + [0] * (width - len(row))
            if hi > 0:
                gaps[i, j, 1] = (start[i] + count[i]) * page
                lengths[i, j] += gaps[i, j, 1] - hi
                merged = [s for s in range(lo) if rng.random() < 0.4]
                for s in merged:
                    pg, o = a["page_table"][i, j, s // page], s % page
                    pos[pg, o] += int(rng.integers(1, 3)) << WEIGHT_SHIFT
    k, v = np.concatenate(new_k), np.concatenate(new_v)
    pos = np.concatenate(new_pos)
    out = dict(a, page_table=table, lengths=lengths, gaps=gaps, pos_pages=pos, weights=True,
               lowrank=(start, count), lowrank_rank=rank)  # fmt: skip
    if "k_scale" in a:  # fp8: every page quantised as the pool stores tokens (a scale a row)
        (k8, ks), (v8, vs) = (quantize_reference(x[None], scale_dtype=jnp.bfloat16) for x in (k, v))
        k, v = np.array(k8[0]), np.array(v8[0])
        out.update(k_scale=np.asarray(ks[0]), v_scale=np.asarray(vs[0]))
    else:
        k, v = k.astype(a["k_pages"].dtype), v.astype(a["k_pages"].dtype)
    for pg, held in poison:  # the coefficients of tokens a page does not hold
        k[pg, rank:, held:] = np.nan
        v[pg, rank:, held:] = np.nan
    return dict(out, k_pages=k, v_pages=v)


CASES = [  # (query lengths per row, page, pages per row, dtype, gaps, window)
    ([1, 1, 1], 4, 5, "f32", False, None),
    ([1, 5, 1, 9], 4, 6, "f32", True, None),
    ([3, 1, 17], 8, 4, "bf16", True, None),
    ([1, 1, 6, 2], 4, 5, "fp8", True, None),
    ([1, 7, 1], 4, 6, "f32", False, 5),
]


EVERY_CASE = pytest.mark.parametrize(
    "q_lens, page, m, dtype, gaps, window",
    CASES,
    ids=[
        f"R={len(c[0])}_Q={max(c[0])}_page={c[1]}_M={c[2]}_{c[3]}_gaps={c[4]}_w={c[5]}"
        for c in CASES
    ],  # fmt: skip
)


@EVERY_CASE
def test_xla_path_matches_the_reference(rng, rel_err, q_lens, page, m, dtype, gaps, window):
    a = make_case(rng, q_lens, page, m, dtype, gaps)
    ref = ragged_paged_attention_reference(**a, sliding_window=window)
    want = numpy_reference(a, window)
    assert rel_err(ref, want) < 1e-5  # the reference is what the docstring says
    n_dec = sum(1 for n in q_lens if n == 1)
    order = np.argsort([n != 1 for n in q_lens], kind="stable")  # decode rows first
    b = {**a}
    for name in ("page_table", "lengths", "q_start", "q_len"):
        b[name] = a[name][order]
    if gaps:
        b["gaps"] = a["gaps"][order]
    out = ragged_paged_attention_xla(**b, num_decode=n_dec, num_rows=len(q_lens),
                                     sliding_window=window, q_tile=4, row_tile=2, pages_per_step=2)  # fmt: skip
    tol = {"f32": 1e-5, "bf16": 1e-5, "fp8": 1e-5}[dtype]  # same stored values as the reference
    assert not np.isnan(np.asarray(out)).any()
    assert rel_err(out, ref) < tol
    assert np.all(np.asarray(out)[-3:] == 0)  # tokens of no row


def test_xla_path_with_uneven_heads(rng, rel_err):
    """Decode rows whose kv heads hold very different counts (one head many blocks, the others
    a few: KVzip, Ada-KV): a head's blocks past its own count hold nothing it attends to; every
    head's output is the reference's."""
    q_lens = [1, 1, 1, 1, 1, 4]
    a = make_case(rng, q_lens, 4, 10, "f32", False, uneven=True)
    blocks = -(-a["lengths"][:5] // 4)  # pages_per_step=1: a block is a page
    assert (blocks.max(axis=1) - blocks.min(axis=1) >= 4).all()  # every row uneven
    ref = ragged_paged_attention_reference(**a)
    out = ragged_paged_attention_xla(**a, num_decode=5, num_rows=6, q_tile=4, row_tile=2,
                                     pages_per_step=1)  # fmt: skip
    assert not np.isnan(np.asarray(out)).any()
    assert rel_err(out, ref) < 1e-5
    assert rel_err(ref, numpy_reference(a, None)) < 1e-5


def test_the_reference_is_dense_decode_attention_on_one_query_rows(rng, rel_err):
    a = make_case(rng, [1, 1, 1, 1], 4, 5, "f32", False)
    ref = ragged_paged_attention_reference(**a)
    page = a["k_pages"].shape[1]
    dense_k = np.asarray(a["k_pages"])[a["page_table"]].reshape(4, KH, -1, H)
    dense_v = np.asarray(a["v_pages"])[a["page_table"]].reshape(4, KH, -1, H)
    dense = decode_attention_reference(a["q"][:4], dense_k, dense_v, a["lengths"])
    assert rel_err(ref[:4], dense) < 1e-5 and page == 4


@EVERY_CASE
def test_pallas_kernel_matches_the_reference(rng, rel_err, q_lens, page, m, dtype, gaps, window):
    """Interpret mode, the output poisoned with NaN: every token a row owns is written."""
    a = make_case(rng, q_lens, page, m, dtype, gaps)
    ref = np.asarray(ragged_paged_attention_reference(**a, sliding_window=window))
    if dtype == "bf16":  # the kernel computes in q's dtype when the pool is stored in it
        a["q"] = jnp.asarray(a["q"]).astype(jnp.bfloat16)
        ref = np.asarray(ragged_paged_attention_reference(**a, sliding_window=window))
    out = ragged_paged_attention(**a, sliding_window=window, q_tile=4, interpret=True,
                                 _fill=float("nan"))  # fmt: skip
    out = np.asarray(jnp.asarray(out).astype(jnp.float32))
    t = int(np.sum(q_lens))
    assert not np.isnan(out[:t]).any(), "a token of a row was left unwritten"
    assert np.isnan(out[t:]).all(), "a token of no row was written"
    tol = {"f32": 1e-5, "bf16": 2e-2, "fp8": 1e-2}[dtype]  # bf16/fp8: low-precision dots
    assert rel_err(out[:t], ref[:t]) < tol
    zero = ragged_paged_attention(**a, sliding_window=window, q_tile=4, interpret=True)
    assert np.all(np.asarray(zero)[t:] == 0)  # tokens of no row, as the reference says


@pytest.mark.parametrize("dtype", ["f32", "fp8"])
def test_ring_keys_are_rotated_on_read(rng, rel_err, dtype):
    """A StreamingLLM ring's sinks (pos below `sink`) are turned on read by the ring's shift
    (its window ranks at pos - shift, the query at its text position: the sinks' distance is
    then their rank's), by the XLA path and the Pallas kernel, as the numpy loop does; its
    window and the other rows are read as they are stored."""
    a = with_rope(rng, make_case(rng, [1, 1, 6, 1, 3], 4, 5, dtype, True))
    ref = ragged_paged_attention_reference(**a)
    assert rel_err(ref, numpy_reference(a)) < 1e-5
    assert rel_err(ref, ragged_paged_attention_reference(**{**a, "rope": None})) > 1e-2
    n_dec = 3
    order = np.argsort([n != 1 for n in a["q_len"]], kind="stable")
    b = {**a, "rope": tuple(x[order] for x in a["rope"][:3]) + (a["rope"][3],)}
    for name in ("page_table", "lengths", "q_start", "q_len", "gaps"):
        b[name] = a[name][order]
    out = ragged_paged_attention_xla(**b, num_decode=n_dec, num_rows=5, q_tile=4, row_tile=2,
                                     pages_per_step=2)  # fmt: skip
    assert rel_err(out, ref) < 1e-5
    got = ragged_paged_attention(**a, q_tile=4, interpret=True, _fill=float("nan"))
    t = int(np.sum(a["q_len"]))
    assert rel_err(np.asarray(got)[:t], np.asarray(ref)[:t]) < {"f32": 1e-5, "fp8": 1e-2}[dtype]


def test_ring_rotation_lowers_for_cuda(rng, lower_for_cuda):
    a = with_rope(rng, make_case(rng, [1, 1, 9, 1], 8, 4, "bf16", True))
    a["q"] = jnp.asarray(a["q"]).astype(jnp.bfloat16)
    a = {name: (jnp.asarray(x) if isinstance(x, np.ndarray) else x) for name, x in a.items()}
    a["rope"] = tuple(jnp.asarray(x) for x in a["rope"])
    text = lower_for_cuda(functools.partial(ragged_paged_attention, interpret=False), **a)
    assert "jkv_ragged_paged_attention" in text


@pytest.mark.parametrize("dtype, gaps, window", [("bf16", True, None), ("fp8", True, 64)])
def test_pallas_kernel_lowers_for_cuda(rng, lower_for_cuda, dtype, gaps, window):
    a = make_case(rng, [1, 1, 9, 1], 8, 4, dtype, gaps)
    a["q"] = jnp.asarray(a["q"]).astype(jnp.bfloat16)
    a = {name: (jnp.asarray(x) if x is not None else None) for name, x in a.items()}
    text = lower_for_cuda(functools.partial(ragged_paged_attention, sliding_window=window,
                                            interpret=False), **a)  # fmt: skip
    assert "jkv_ragged_paged_attention" in text


@pytest.mark.parametrize("dtype", ["f32", "fp8"])
def test_merged_slots_and_low_rank_pages(rng, rel_err, dtype):
    """The segment rebuild's rows: merged prefix slots weigh their tokens (log weight added to
    their logits) and low-rank pages in the gap join each head's softmax, expanded from their
    factors (tokens past a page's count, poisoned, never read), by the reference and the XLA
    path as the numpy loop says; without the weights or the pages the output differs."""
    a = with_segments(rng, make_case(rng, [1, 1, 1, 6, 1, 3], 8, 5, dtype, True), rank=4)
    assert a["lowrank"][1].max() == 3 and a["lowrank"][1].sum() > 3
    ref = ragged_paged_attention_reference(**a)
    assert not np.isnan(np.asarray(ref)).any()
    assert rel_err(ref, numpy_reference(a)) < 1e-5
    plain = {**a, "weights": False}
    assert rel_err(ref, numpy_reference(plain)) > 1e-2  # the weights change the output
    assert rel_err(ref, numpy_reference({**a, "lowrank": None})) > 1e-2  # and the pages
    n_dec = 4
    order = np.argsort([n != 1 for n in a["q_len"]], kind="stable")
    b = {**a, "lowrank": tuple(x[order] for x in a["lowrank"])}
    for name in ("page_table", "lengths", "q_start", "q_len", "gaps"):
        b[name] = a[name][order]
    out = ragged_paged_attention_xla(**b, num_decode=n_dec, num_rows=6, q_tile=4, row_tile=2,
                                     pages_per_step=2)  # fmt: skip
    assert not np.isnan(np.asarray(out)).any()
    assert rel_err(out, ref) < 1e-5
    got = ragged_paged_attention(**a, q_tile=4, interpret=True, _fill=float("nan"))
    t = int(np.sum(a["q_len"]))
    got = np.asarray(got)
    assert not np.isnan(got[:t]).any(), "a token of a row was left unwritten"
    assert rel_err(got[:t], np.asarray(ref)[:t]) < {"f32": 1e-5, "fp8": 1e-2}[dtype]


def test_merged_slots_and_low_rank_pages_lower_for_cuda(rng, lower_for_cuda):
    a = with_segments(rng, make_case(rng, [1, 1, 9, 1], 16, 4, "bf16", True), rank=8)
    a["q"] = jnp.asarray(a["q"]).astype(jnp.bfloat16)
    a = {n: (jnp.asarray(x) if isinstance(x, np.ndarray) else x) for n, x in a.items()}
    a["lowrank"] = tuple(jnp.asarray(x) for x in a["lowrank"])
    static = {n: a.pop(n) for n in ("weights", "lowrank_rank")}
    text = lower_for_cuda(functools.partial(ragged_paged_attention, interpret=False, **static),
                          **a)  # fmt: skip
    assert "jkv_ragged_paged_attention" in text
