"""The engine's pool holds what it says (device bytes = pages x bytes per page, and a request's
pages are written in full), prefix blocks never mix key layouts, and the host's work per step
does not grow with layers x kv heads."""

from __future__ import annotations

import random
import re

import numpy as np
import pytest

import jkv
from jkv.engine.engine import Engine
from jkv.engine.page_pool import PagePool
from jkv.engine.ragged import pack_ragged
from jkv.engine.runner import RowTables
from jkv.engine.scheduler import Scheduler
from jkv.engine.sequence import Sequence
from jkv.policies import StreamingLLM


@pytest.fixture(scope="module")
def demo(tiny_params):
    return tiny_params("llama")


def alone(params, ids, **settings):
    return list(jkv.generate(params, ids, **settings).tokens)


@pytest.mark.parametrize(
    "kv_dtype, item, scales, mass",
    [("float32", 4, 0, False), ("bfloat16", 2, 0, True), ("float8_e4m3fn", 1, 4, False)],
)
def test_the_pool_holds_what_it_says(demo, kv_dtype, item, scales, mass):
    """N pages are N x (page_size tokens of one kv head of one layer: K and V, fp8 scales, an
    int32 position, H2O's float32 mass), and a request's pages are all written: the bytes it
    occupies are the bytes its tokens need."""
    cfg = demo.config
    heads = cfg.num_layers * cfg.num_kv_heads
    engine = Engine(demo, num_pages=41, page_size=8, kv_dtype=kv_dtype, attention_mass=mass)
    per_page = 8 * (2 * cfg.head_dim * item + scales + 4 + (4 if mass else 0))
    assert engine.device.page_nbytes() == 41 * per_page == engine.stats()["pool_bytes"]
    assert engine.stats()["page_bytes"] == per_page == engine.page_bytes
    prompt = [random.Random(0).randrange(3, cfg.vocab_size) for _ in range(64)]
    rid = engine.add_request(prompt, max_new_tokens=1, kv_dtype=kv_dtype)
    while engine.has_work:
        engine.step()
    written = np.any(np.asarray(engine.device.k, np.float32) != 0, axis=(1, 2))
    assert written.sum() == 8 * heads  # 64 tokens: 8 blocks of 8, one page per head each
    assert written[0] == 0 and rid  # the null page is never written


def test_streaming_and_full_cache_share_a_prefix(demo):
    """StreamingLLM's keys are stored as the full cache's (rotated at their text positions; a
    ring's sinks are turned on read): a shared 64-token prefix is taken by either from the
    other, in either order, and every request gives generate's tokens alone (whose StreamingLLM
    stores keys before RoPE and rotates them at their rank)."""
    rng = random.Random(4)
    head = [rng.randrange(3, demo.config.vocab_size) for _ in range(64)]
    a, b = (head + [rng.randrange(3, demo.config.vocab_size) for _ in range(5)] for _ in "ab")
    ring = StreamingLLM(budget=24, sink=4)
    for first, second in [(ring, None), (None, ring), (ring, ring)]:
        engine = Engine(demo, num_pages=200, page_size=8, chunk=64, token_budget=128)
        engine.generate([a], max_new_tokens=4, kv_policy=first)
        rid = engine.add_request(b, max_new_tokens=4, kv_policy=second)
        toks, cached = [], None
        while engine.has_work:
            for out in engine.step():
                if out.request_id == rid:
                    toks += out.new_tokens
                    cached = out.cached_tokens if cached is None else cached
        assert cached == 64, (first, second)
        assert toks == alone(demo, b, max_new_tokens=4, kv_policy=second), (first, second)


def _decode_workload(num_layers: int, num_kv_heads: int):
    """The host side alone (scheduler, page tables, packing) for 8 rows of 100 prompt tokens
    decoding 40 tokens each; returns what it touched: block-table entries written, the length
    of each row's table, Python objects kept per row."""
    group = num_layers * num_kv_heads
    pool = PagePool(8 * 9 * group + 1, 16, group)
    sched = Scheduler(pool, num_layers=num_layers, num_kv_heads=num_kv_heads, token_budget=1024,
                      chunk=128, max_running=8)  # fmt: skip
    tables = RowTables(8, 10)
    for i in range(8):
        sched.add(Sequence(f"r{i}", list(range(1, 101)), 40, arrival=0))
    written = 0
    while sched.has_work:
        plan = sched.schedule()
        before = tables.table.copy()
        pack_ragged([s.row for s in plan.scheduled], tables, group, 16, most=1024)
        written += int((before != tables.table).sum())
        sched.finish_step(plan, {s.seq.request_id: 7 for s in plan.scheduled if s.samples})
        tables.keep_only({s.request_id for s in sched.running})
    return written, [len(s.blocks) for s in sched.by_id.values()]


def test_host_work_per_step_does_not_grow_with_layers_and_heads():
    """A model of 2 x 2 heads and one of 64 layers x 16 kv heads: the same block-table
    entries written (a row gains one id per 16 tokens for all its heads), so packing a step is
    O(rows + changed blocks) whatever the shape."""
    assert _decode_workload(2, 2) == _decode_workload(64, 16)
    written, _ = _decode_workload(2, 2)
    assert written == 8 * 9  # 139 tokens of each of 8 rows: 9 blocks, each written once


@pytest.mark.parametrize("kv_dtype", ["float8_e4m3fn", "bfloat16"])
def test_a_step_never_widens_the_whole_pool(demo, kv_dtype, monkeypatch):
    """The compiled flattened step over a narrow-float pool holds no float32 or float16 copy of
    the pool's pages or scales: XLA:CPU widened the whole fp8 pool to float16 (and its
    bfloat16 scales to float32) around each layer's write and page gather, a cost that grew
    with the pool, not with the tokens attended (an fp8 step 350x float32's at 262K pages);
    the layers now carry the pool as its bits (`jkv.core.paged.as_bits`)."""
    from jkv.engine import ragged

    pages = 3072  # a count no other dimension of the demo model has
    engine = Engine(demo, num_pages=pages, page_size=16, kv_dtype=kv_dtype, max_running=4,
                    async_scheduling=False)  # fmt: skip
    for i in range(2):
        engine.add_request([5 + i] * 40, max_new_tokens=4)
    seen, call = {}, ragged.programs.call

    def spy(fn, *args, **kwargs):
        if fn is ragged.flat_logits:
            seen["args"], seen["kwargs"] = args, kwargs
        return call(fn, *args, **kwargs)

    monkeypatch.setattr(ragged.programs, "call", spy)
    while engine.has_work:
        engine.step()
    hlo = ragged.flat_logits.lower(*seen["args"], **seen["kwargs"]).compile().as_text()
    h = demo.config.head_dim
    wide = ["f16", "f32"] + (["bf16"] if kv_dtype == "float8_e4m3fn" else [])
    pattern = re.compile(
        rf"(?<![\w])({'|'.join(wide)})\[{pages},16,{h}\]|(?<![\w])f32\[{pages},16\]"
    )
    found = [line.strip()[:160] for line in hlo.splitlines()
             if pattern.search(line) and "parameter(" not in line]  # fmt: skip
    assert not found, found
