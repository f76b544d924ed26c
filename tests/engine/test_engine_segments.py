"""The segment rebuild (snapkv_segments) served by jkv.Engine: the policy's own rebuild runs on
the row's pages after its prompt; its ordinary slots (merged ones weighted in their positions)
and its low-rank pages (a segment of head_dim tokens per page) go into the row's prefix; the
attention reads the pages as factors. The tokens are `jkv.generate`'s for the request alone
(float32), a row in a batch gives the tokens it gives alone (fp8), and the row holds the pages
of what it kept, no more."""

from __future__ import annotations

import random

import numpy as np
import pytest

import jkv
from jkv.engine.engine import Engine
from jkv.policies import SnapKVSegments

# the tiny llama: head_dim 16, default rank 16 // 8 = 2, low-rank pages of 4 rows (page_size 4)
SEGMENTS = SnapKVSegments(budget=16, window=8, segment_len=16, transition_len=2)


@pytest.fixture(scope="module")
def demo(tiny_params):
    return tiny_params("llama")


def prompts(demo, lengths, seed):
    rng = random.Random(seed)
    return [[rng.randrange(3, demo.config.vocab_size) for _ in range(n)] for n in lengths]


def check_prefix(engine, seq):
    """A rebuilt row holds, per head, the pages of its ordinary slots and of its low-rank
    segments, and nothing in between."""
    page = engine.pool.page_size
    prefix = np.array([engine.pool.row(b) for b in seq.blocks[: seq.n_prefix]])  # [blocks, G]
    ordinary = seq.n_prefix - seq.n_lowrank
    assert seq.n_lowrank > 0
    assert (prefix[:ordinary] != 0).sum(axis=0).tolist() == [-(-b // page) for b in seq.base]
    low = (prefix[ordinary:] != 0).sum(axis=0)
    assert low.max() == seq.n_lowrank and low.min() >= 1
    # the low-rank pages' heads are contiguous from the prefix's end of the ordinary blocks
    assert all(
        list(col) == sorted(col, reverse=True) for col in (prefix[ordinary:] != 0).T.tolist()
    )


def test_the_segment_rebuild_is_served_with_generates_tokens(demo):
    """Two rebuilt requests beside a full-cache one, in float32: each gives `jkv.generate`'s
    tokens alone (which runs the same rebuild over a dense cache), and its prefix holds its
    ordinary slots' pages and low-rank pages only."""
    engine = Engine(demo, num_pages=400, page_size=4, token_budget=64, chunk=32, max_running=3)
    asks = prompts(demo, (90, 61, 40), seed=3)
    policies = [SEGMENTS, SEGMENTS, None]
    rids = [engine.add_request(p, max_new_tokens=8, kv_policy=pol)
            for p, pol in zip(asks, policies, strict=True)]  # fmt: skip
    got, seen = {rid: [] for rid in rids}, set()
    while engine.has_work:
        for out in engine.step():
            got[out.request_id] += out.new_tokens
        for seq in engine.scheduler.running:
            if seq.compressed and seq.request_id not in seen:
                seen.add(seq.request_id)
                check_prefix(engine, seq)
    assert seen == set(rids[:2]) and engine.pool.used_pages == 0
    for rid, p, pol in zip(rids, asks, policies, strict=True):
        want = jkv.generate(demo, p, max_new_tokens=8, kv_policy=pol)
        assert got[rid] == list(want.tokens), rid


def test_a_rebuilt_row_in_a_batch_gives_its_tokens_alone_in_fp8(demo):
    """fp8 pages (the factors' rows quantised as tokens are, where `jkv.generate` keeps its
    factors in bfloat16): a rebuilt row gives the same tokens in a batch as alone."""
    asks = prompts(demo, (70, 52), seed=5)

    def run(which):
        engine = Engine(demo, num_pages=400, page_size=4, token_budget=64, chunk=32,
                        kv_dtype="float8_e4m3fn")  # fmt: skip
        return engine.generate([asks[i] for i in which], max_new_tokens=6, kv_policy=SEGMENTS)

    together = run([0, 1])
    assert together == [run([0])[0], run([1])[0]]


def test_segment_settings_the_engine_does_not_hold_get_clear_errors(demo, tiny_params):
    engine = Engine(demo, num_pages=64, page_size=4, chunk=16)
    with pytest.raises(ValueError, match="segment_len=64: the engine's low-rank pages hold 16"):
        engine.add_request([5, 6, 7], kv_policy=SnapKVSegments(budget=8, window=8))
    too_big = SnapKVSegments(budget=8, window=8, segment_len=16, max_rank=4)
    with pytest.raises(ValueError, match="max_rank=4 .rank 4.: a low-rank page of 4 rows"):
        engine.add_request([5, 6, 7], kv_policy=too_big)
    windowed = Engine(tiny_params("mistral"), num_pages=64, page_size=4, chunk=16)
    with pytest.raises(ValueError, match="sliding window .16. cannot mask them"):
        windowed.add_request([5, 6, 7], kv_policy=SEGMENTS)
    assert not engine.has_work and engine.pool.used_pages == 0


def test_no_method_of_the_engines_parts_hides_another():
    """`Engine` is made of parts (mixins); a method one part defines under a name another part
    also uses silently replaces it (the segment rebuild's `_rebuild` once hid recovery's pool
    rebuild, and a failed step could no longer recover)."""
    import collections

    defined = collections.defaultdict(list)
    for part in Engine.__mro__:
        if part.__module__.startswith("jkv.engine"):
            for name, value in vars(part).items():
                if callable(value) and not name.startswith("__"):
                    defined[name].append(part.__name__)
    assert {n: parts for n, parts in defined.items() if len(parts) > 1} == {}
