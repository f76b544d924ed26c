"""KV policies in jkv.Engine: a policy that compresses once, after the prompt (and the rings,
StreamingLLM and H2O), runs on the engine's pages and gives the tokens `jkv.generate` gives that
request alone (float32, bfloat16 or fp8 storage), and its compression frees pages: each (layer,
kv head) keeps only the pages its kept tokens fill."""

from __future__ import annotations

import random

import numpy as np
import pytest

import jkv
from jkv.compile_time import programs_built
from jkv.engine.engine import Engine
from jkv.engine.runner import compact
from jkv.policies import (
    H2O,
    AdaKV,
    EffiCache,
    PyramidKV,
    Quantile,
    SnapKV,
    SnapKVSegments,
    StreamingLLM,
)


@pytest.fixture(scope="module")
def demo(tiny_params):
    return tiny_params("llama")


def alone(params, ids, **settings):
    return list(jkv.generate(params, ids, **settings).tokens)


SNAPKV = SnapKV(budget=12, window=8, kernel=3, pool="max")
EFFICACHE = EffiCache(budget=0.3, window=8, short_window=4)  # its gradient pass changes tokens
HEAVY = H2O(budget=20, recent=6)  # a ring evicting the lightest by the mass kept in the pool
PYRAMID, ADA = PyramidKV(budget=0.3, window=8), AdaKV(budget=0.25, window=8)
QUANTILE = Quantile(q=0.6, window=4)
RING = StreamingLLM(budget=24, sink=4)  # a ring of 24 slots from the prompt's end
FILLING = StreamingLLM(budget=40, sink=4)  # short prompts fill up while decoding, then ring
RUNS = {  # kv dtype -> the policies of its requests, in arrival order: every policy runs in one
    # dtype (float32 for the exact selections; the narrow ones move scales and mass with tokens)
    "float32": [SNAPKV, FILLING, QUANTILE],  # the full cache beside them: float8 below
    "float8_e4m3fn": [HEAVY, None, RING, ADA],
    "bfloat16": [PYRAMID, EFFICACHE],  # the full cache alone: tests/engine/test_engine.py
}


@pytest.mark.parametrize("kv_dtype", list(RUNS))
def test_compressed_requests_arriving_at_random_steps_match_generate_alone(demo, kv_dtype):
    """Requests with different policies (and the full cache) arriving while others decode, in
    a pool small enough to run short: each gives generate's tokens alone, and a compressed
    request holds only the pages of what it kept."""
    policies = RUNS[kv_dtype]
    rng = random.Random(len(policies))
    engine = Engine(demo, num_pages=105, page_size=4, token_budget=32, chunk=16, max_running=3,
                    kv_dtype=kv_dtype, admission="optimistic", attention_mass=True)  # fmt: skip
    prompts = [[rng.randrange(3, demo.config.vocab_size) for _ in range(rng.randint(33, 60))]
               for _ in policies]  # fmt: skip
    settings = [dict(kv_policy=p, kv_dtype=kv_dtype) for p in policies]
    pending = list(range(len(policies)))
    got, compressed = {}, set()
    while pending or engine.has_work:
        for _ in range(rng.randint(0, 2)):
            if pending:
                i = pending.pop(0)
                got[engine.add_request(prompts[i], max_new_tokens=6, **settings[i])] = (i, [])
        for out in engine.step():
            got[out.request_id][1].extend(out.new_tokens)
        for seq in engine.scheduler.running:
            if seq.compressed:  # each head holds the pages its kept tokens fill, no more
                compressed.add(seq.request_id)
                ps = engine.pool.page_size
                prefix = np.array([engine.pool.row(b) for b in seq.blocks[: seq.n_prefix]])
                slots = [seq.limit] * len(seq.base) if seq.in_ring else seq.base
                assert (prefix != 0).sum(axis=0).tolist() == [-(-h // ps) for h in slots]
                assert seq.pages == (prefix != 0).sum() + (len(seq.blocks) - seq.n_prefix) * len(
                    seq.base
                )
                assert len(seq.blocks) - seq.n_prefix == (0 if seq.in_ring else -(-seq.tail // ps))
        engine.pool.check()
    assert len(compressed) == sum(p is not None for p in policies)
    assert engine.pool.used_pages == 0
    # the pool ran short: requests were preempted, or compressions took back cached pages
    assert engine.scheduler.num_preemptions + engine.pool.stats.uncached > 0
    for i, toks in got.values():
        assert toks == alone(demo, prompts[i], max_new_tokens=6, **settings[i]), (kv_dtype, i)


def test_compression_frees_pages_per_head(demo):
    """SnapKV keeping 25% of a 64-token prompt: every head drops from 16 pages to the pages of
    its kept tokens, and the pool gets the rest back before decoding starts."""
    engine = Engine(demo, num_pages=200, page_size=4, token_budget=64, chunk=64)
    rng = random.Random(2)
    prompt = [rng.randrange(3, demo.config.vocab_size) for _ in range(64)]
    rid = engine.add_request(prompt, max_new_tokens=3, kv_policy="snapkv", kv_budget=16)
    engine.step()  # the whole prompt, then the compression
    seq = engine.scheduler.by_id[rid]
    heads = demo.config.num_layers * demo.config.num_kv_heads
    assert seq.compressed and seq.held(heads) == [16] * heads
    assert engine.pool.used_pages == heads * 4  # 16 kept tokens: 4 pages per head (was 16)
    rest = []
    while engine.has_work:
        rest += [t for o in engine.step() for t in o.new_tokens]
    assert len(rest) == 2 and engine.pool.used_pages == 0


@pytest.mark.parametrize(
    "policy", [SNAPKV, QUANTILE, RING, HEAVY], ids=["snapkv", "quantile", "ring", "h2o"]
)
def test_a_compressed_prompt_runs_in_place(demo, policy):
    """A prompt of four chunks a policy compresses: every chunk runs on the flattened step (in
    place, as the full cache's; StreamingLLM's keys stored before RoPE and rotated on read;
    H2O's queries adding to each slot's mass); the selection follows the chunk that ends the
    prompt, once, over the pool; the rings then decode past their budget (StreamingLLM's slot
    chosen by the host, H2O's per head on the device); the tokens are generate's."""
    selected = []

    class Recording(Engine):
        def _select(self, ending, policy, kept):
            selected.extend((r.seq.request_id, r.start, r.n) for r in ending)
            return super()._select(ending, policy, kept)

    engine = Recording(demo, num_pages=200, page_size=4, token_budget=64, chunk=16,
                       attention_mass=True)  # fmt: skip
    rng = random.Random(4)
    prompt = [rng.randrange(3, demo.config.vocab_size) for _ in range(64)]
    [toks] = engine.generate([prompt], max_new_tokens=30, kv_policy=policy)
    assert selected == [("req-0", 48, 16)]
    assert toks == alone(demo, prompt, max_new_tokens=30, kv_policy=policy)


@pytest.mark.parametrize("policy", [SNAPKV, RING, HEAVY], ids=["snapkv", "ring", "h2o"])
def test_the_selection_through_the_pallas_kernels_matches_generate(demo, policy):
    """On the "pallas_interpret" backend the flattened step runs the ragged Pallas kernel (a
    StreamingLLM ring's keys rotated on read in it) and the selection the paged window-scores
    kernels (interpreted): the tokens are still generate's (on xla)."""
    engine = Engine(demo, num_pages=200, page_size=4, token_budget=64, chunk=16,
                    backend="pallas_interpret", attention_mass=True)  # fmt: skip
    rng = random.Random(8)
    prompts = [[rng.randrange(3, demo.config.vocab_size) for _ in range(n)] for n in (30, 41)]
    got = engine.generate(prompts, max_new_tokens=6, kv_policy=policy, backend="pallas_interpret")
    assert engine.pool.used_pages == 0
    assert got == [alone(demo, p, max_new_tokens=6, kv_policy=policy) for p in prompts]


def test_a_compressed_request_may_start_from_cached_pages(demo):
    """A prompt whose first blocks are in the prefix cache: the policy's window still runs, the
    shared pages are copied, not written, and the tokens are generate's."""
    rng = random.Random(6)
    prompt = [rng.randrange(3, demo.config.vocab_size) for _ in range(48)]
    engine = Engine(demo, num_pages=200, page_size=4, token_budget=64, chunk=32)
    engine.generate([prompt[:40]], max_new_tokens=2)  # publishes 10 blocks
    rid = engine.add_request(prompt, max_new_tokens=5, kv_policy="snapkv", kv_budget=0.25)
    toks, cached = [], None
    while engine.has_work:
        for out in engine.step():
            toks += out.new_tokens
            cached = out.cached_tokens if cached is None else cached
    # SnapKV's window (32 queries) runs: the cache gives at most the 16 tokens before it
    assert cached == 16
    assert toks == alone(demo, prompt, max_new_tokens=5, kv_policy="snapkv", kv_budget=0.25)
    assert engine.pool.cached_idle_pages > 0 and rid


def test_no_step_compiles_after_warmup_with_policies(demo):
    """Warmed for EffiCache (SnapKV's votes, then its gradient pass per prompt bucket), H2O
    (its mass write-back) and StreamingLLM (the flattened step with rings): requests of each
    and of the full cache, at other budgets, compile nothing; nor does the segment rebuild
    (its rebuild per bucket of the prompt's blocks, and its write)."""
    engine = Engine(demo, num_pages=64, page_size=16, chunk=8, max_running=1, max_model_len=32,
                    attention_mass=True)  # fmt: skip
    segments = SnapKVSegments(window=8, segment_len=16)
    engine.warmup(kv_policies=[H2O(budget=8, recent=2), EffiCache(window=8), RING, segments])
    before = programs_built()
    rng = random.Random(1)
    for policy in (EffiCache(budget=0.5, window=8), EffiCache(budget=5, window=8), None,
                   H2O(budget=6, recent=2), StreamingLLM(budget=7, sink=4),
                   SnapKVSegments(budget=4, window=8, segment_len=16)):  # fmt: skip
        prompts = [[rng.randrange(3, 100) for _ in range(rng.randint(9, 20))] for _ in range(2)]
        engine.generate(prompts, max_new_tokens=4, kv_policy=policy)
    assert programs_built() == before


def test_policies_the_engine_does_not_serve_get_clear_errors(demo):
    engine = Engine(demo, num_pages=64, page_size=8, chunk=16)
    with pytest.raises(ValueError, match=r"kv_policy='h2o' evicts by attention mass.*attention_m"):
        engine.add_request([5, 6, 7], kv_policy="h2o", kv_budget=8)
    with pytest.raises(ValueError, match="window=32: its observation window must run in one"):
        engine.add_request([5, 6, 7], kv_policy="snapkv", kv_budget=8)
    with pytest.raises(ValueError, match="kv_policy='snapkv' chunked=True.*one-shot path"):
        engine.add_request([5, 6, 7], kv_policy={"name": "snapkv", "window": 8, "chunked": True},
                           kv_budget=8)  # fmt: skip
    assert not engine.has_work and engine.pool.used_pages == 0


def test_compaction_moves_each_heads_kept_tokens_into_its_column():
    """`compact` against numpy: kept tokens read from anywhere in the pool (their own
    destination pages included) land in slot order in each head's column of the new blocks,
    every other token untouched."""
    import jax.numpy as jnp

    from jkv.engine.runner import PagedKV

    rng = np.random.default_rng(0)
    pages, page, g, h = 12, 4, 2, 3
    k = rng.normal(size=(pages, page, h)).astype(np.float32)
    pos = rng.integers(0, 100, size=(pages, page)).astype(np.int32)
    rows = np.zeros((4, g), np.int32)
    rows[1] = [1, 2]
    rows[2] = [3, 4]  # the new blocks: head 0 in pages 1 then 3, head 1 in pages 2 then 4
    pool = PagedKV(k=jnp.asarray(k), v=jnp.asarray(-k), positions=jnp.asarray(pos),
                   block_pages=jnp.asarray(rows))  # fmt: skip
    src = np.array([[5, 4, 13, 30, 0], [9, 1, 2, 3, 8]], np.int32)  # pool tokens, kept first
    counts = np.array([5, 2], np.int32)
    table = np.array([1, 2, 0, 0], np.int32)
    out = compact(pool, src, table, counts)
    want_k, want_pos = k.reshape(-1, h).copy(), pos.reshape(-1).copy()
    flat_k, flat_pos = k.reshape(-1, h), pos.reshape(-1)
    for head in range(g):
        for i in range(counts[head]):
            dst = rows[table[i // page], head] * page + i % page
            want_k[dst], want_pos[dst] = flat_k[src[head, i]], flat_pos[src[head, i]]
    assert np.array_equal(np.asarray(out.k).reshape(-1, h), want_k)
    assert np.array_equal(np.asarray(out.v).reshape(-1, h), -want_k)
    assert np.array_equal(np.asarray(out.positions).reshape(-1), want_pos)
