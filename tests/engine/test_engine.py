"""jkv.Engine on a tiny random Llama (2 layers, no eos: every request runs to max_new_tokens)
and a Mistral with a sliding window: requests arriving while others decode give the tokens
`jkv.generate` gives each of them alone; prefix hits change nothing; no step compiles after
`warmup`."""

from __future__ import annotations

import asyncio
import random

import pytest

import jkv
from jkv.compile_time import programs_built
from jkv.engine.engine import Engine
from jkv.limits import available_bytes


@pytest.fixture(scope="module")
def demo(tiny_params):
    return tiny_params("llama")


def alone(params, ids, **settings):
    return list(jkv.generate(params, ids, **settings).tokens)


def random_prompts(rng, n, vocab, low=3, high=60):
    return [[rng.randrange(3, vocab) for _ in range(rng.randint(low, high))] for _ in range(n)]


@pytest.mark.parametrize(
    "kind, kv_dtype, backend",
    [
        ("llama", "float32", "xla"),
        ("llama", "bfloat16", "xla"),
        ("mistral", "float32", "xla"),
        # the flattened step through the Pallas ragged kernel (interpreted: fp8 scales and a
        # sliding window), generate on xla
        ("mistral", "fp8", "pallas_interpret"),
    ],
)
def test_requests_arriving_at_random_steps_match_generate_alone(tiny_params, kind, kv_dtype,
                                                                backend):  # fmt: skip
    demo = tiny_params(kind, **({"sliding_window": 16} if kind == "mistral" else {}))
    rng = random.Random(3)
    # 20 usable pages, 4 per 16 tokens (2 layers x 2 kv heads): room for one and a half
    # requests, so pages are recycled and requests preempted
    engine = Engine(demo, num_pages=21, page_size=16, token_budget=32, chunk=16, max_running=2,
                    kv_dtype=kv_dtype, admission="optimistic", backend=backend)  # fmt: skip
    prompts = random_prompts(rng, 5, demo.config.vocab_size, 17, 32)  # one prompt bucket
    lengths = [rng.randint(5, 8) for _ in prompts]  # one decode bucket for generate
    pending = list(range(len(prompts)))
    got = {}
    while pending or engine.has_work:
        for _ in range(rng.randint(0, 2)):  # requests arrive while others decode
            if pending:
                i = pending.pop(0)
                rid = engine.add_request(prompts[i], max_new_tokens=lengths[i], kv_dtype=kv_dtype,
                                         backend=backend)  # fmt: skip
                got[rid] = (i, [])
        for out in engine.step():
            got[out.request_id][1].extend(out.new_tokens)
    assert engine.pool.used_pages == 0 and engine.scheduler.num_preemptions > 0
    for i, toks in got.values():
        want = alone(demo, prompts[i], max_new_tokens=lengths[i], kv_dtype=kv_dtype)
        assert toks == want, i


def test_different_sampling_settings_share_a_step(demo):
    rng = random.Random(5)
    prompts = random_prompts(rng, 3, demo.config.vocab_size, 5, 20)
    settings = [dict(temperature=0.9, seed=11), dict(temperature=0.7, top_k=20, seed=12), {}]
    engine = Engine(demo, num_pages=128, page_size=8, chunk=32)
    rids = [
        engine.add_request(p, max_new_tokens=6, **s) for p, s in zip(prompts, settings, strict=True)
    ]
    got = {rid: [] for rid in rids}
    sizes = []
    while engine.has_work:
        outs = engine.step()
        sizes.append(len(outs))
        for out in outs:
            got[out.request_id] += out.new_tokens
    assert max(sizes) == 3  # all three in one step
    for rid, p, s in zip(rids, prompts, settings, strict=True):
        assert got[rid] == alone(demo, p, max_new_tokens=6, **s)


def test_a_prefix_hit_gives_the_same_tokens(demo):
    rng = random.Random(9)
    (prompt,) = random_prompts(rng, 1, demo.config.vocab_size, 40, 40)
    engine = Engine(demo, num_pages=128, page_size=8, chunk=64)
    (first,) = engine.generate([prompt], max_new_tokens=5)
    rid = engine.add_request(prompt, max_new_tokens=5)
    toks, cached = [], None
    while engine.has_work:
        for out in engine.step():
            toks += out.new_tokens
            cached = out.cached_tokens if cached is None else cached
    assert cached == 32 and toks == first == alone(demo, prompt, max_new_tokens=5)
    other = engine.add_request(prompt, max_new_tokens=5, cache_salt="tenant-2")
    outs = []
    while engine.has_work:
        outs += engine.step()
    assert [o.cached_tokens for o in outs if o.request_id == other][:1] == [0]  # another tenant
    assert rid != other


def test_no_step_compiles_after_warmup(demo):
    """Warmup compiles the flattened step at each (rows, tokens) bucket a step can have and no
    other: 1 row holds at most one chunk of 16 tokens (1, 4, 16), 2 rows the budget's 32 (2, 4,
    16, 32); requests after it compile nothing. (61 pages: shapes no other test compiles.)"""
    engine = Engine(demo, num_pages=61, page_size=16, token_budget=32, chunk=16, max_running=2,
                    max_model_len=32)  # fmt: skip
    steps = [label for label, _ in engine.warmup_jobs() if label.startswith("step")]
    assert steps == ["step 1 rows x 1 tokens", "step 1 rows x 4 tokens", "step 1 rows x 16 tokens",
                     "step 2 rows x 2 tokens", "step 2 rows x 4 tokens", "step 2 rows x 16 tokens",
                     "step 2 rows x 32 tokens"]  # fmt: skip
    start = programs_built()
    seconds = engine.warmup()
    assert seconds > 0
    before = programs_built()
    assert before - start >= len(engine.warmup_jobs())  # each job a program (and small ones)
    rng = random.Random(1)
    prompts = random_prompts(rng, 5, demo.config.vocab_size, 1, 20)
    engine.generate(prompts, max_new_tokens=12, temperature=0.5)
    assert programs_built() == before


def test_requests_the_engine_cannot_serve_get_clear_errors(demo):
    engine = Engine(demo, num_pages=9, page_size=8, max_model_len=128)
    with pytest.raises(ValueError, match="max_model_len=128"):
        engine.add_request([5] * 100, max_new_tokens=40)
    with pytest.raises(ValueError, match="more than the pool's 8"):
        engine.add_request([5] * 20, max_new_tokens=10)
    with pytest.raises(ValueError, match="unknown setting 'temprature'"):
        engine.add_request([5, 6], temprature=1.0)
    assert engine.pool.used_pages == 0 and not engine.has_work


def test_stop_strings_end_a_request_as_generate_does(demo):
    rng = random.Random(4)
    prompts = random_prompts(rng, 3, demo.config.vocab_size, 5, 12)
    full = [jkv.generate(demo, p, max_new_tokens=12) for p in prompts]
    stops = [r.text[len(r.text) // 2 : len(r.text) // 2 + 3] for r in full]  # mid-answer
    engine = Engine(demo, num_pages=64, page_size=8, chunk=16)
    rids = [
        engine.add_request(p, max_new_tokens=12, stop=s)
        for p, s in zip(prompts, stops, strict=True)
    ]
    got = {rid: ([], "", None) for rid in rids}
    while engine.has_work:
        for out in engine.step():
            toks, text, _ = got[out.request_id]
            got[out.request_id] = (toks + out.new_tokens, text + out.text, out.finish_reason)
    for rid, p, s in zip(rids, prompts, stops, strict=True):
        want = jkv.generate(demo, p, max_new_tokens=12, stop=s)
        assert want.finish_reason == "stop" and s not in want.text
        assert got[rid] == (list(want.tokens), want.text, "stop")
    assert engine.pool.used_pages == 0


def test_aborts_and_preemptions_return_every_page(demo):
    """A random run on the real engine: requests arrive, some are aborted (waiting, prefilling
    or decoding), the pool is small enough to preempt; afterwards no page is held, and the
    requests that ran to the end match generate alone."""
    rng = random.Random(12)
    engine = Engine(demo, num_pages=21, page_size=16, token_budget=32, chunk=16, max_running=2,
                    admission="optimistic")  # fmt: skip
    prompts = random_prompts(rng, 12, demo.config.vocab_size, 17, 32)
    pending = list(range(len(prompts)))
    got, aborted = {}, set()
    while pending or engine.has_work:
        for _ in range(2):
            if pending and rng.random() < 0.7:
                i = pending.pop(0)
                got[engine.add_request(prompts[i], max_new_tokens=10)] = (i, [])
        live = sorted(set(got) - aborted)
        if live and rng.random() < 0.15:
            rid = rng.choice(live)
            assert engine.abort(rid) in (True, False)
            aborted.add(rid)
        for out in engine.step():
            got[out.request_id][1].extend(out.new_tokens)
        engine.pool.check()
    assert engine.pool.used_pages == 0 and engine.scheduler.num_preemptions > 0
    done = [(i, toks) for rid, (i, toks) in got.items() if rid not in aborted]
    assert aborted and done
    for i, toks in done[:3]:
        assert toks == alone(demo, prompts[i], max_new_tokens=10)


def test_a_pool_sized_by_a_fraction_of_free_memory(demo):
    per_page = 16 * (2 * demo.config.head_dim * 4 + 4)  # one head's K, V float32 + positions
    free = available_bytes()
    engine = Engine(demo, page_size=16, memory_fraction=1e-4)
    assert abs(engine.pool.num_pages - free * 1e-4 / per_page) <= 0.02 * free * 1e-4 / per_page
    assert engine.device.page_nbytes() == engine.pool.num_pages * per_page
    assert engine.generate([[5, 6, 7]], max_new_tokens=2) == [
        alone(demo, [5, 6, 7], max_new_tokens=2)
    ]
    for bad in (0, 1.5, True):
        with pytest.raises(ValueError, match="memory_fraction"):
            Engine(demo, memory_fraction=bad)
    group = demo.config.num_layers * demo.config.num_kv_heads
    tiny = Engine(demo, page_size=16, memory_fraction=1e-12, max_model_len=200)
    assert tiny.pool.num_pages == 13 * group + 1  # never less than one full-context request
    assert "hold 208 tokens: 1 requests of the full 200-token context" in tiny.describe_pool()
    with pytest.raises(ValueError, match="give one or the other"):
        Engine(demo, num_pages=64, memory_fraction=0.5)


def test_the_default_pool_is_a_share_of_free_memory_capped_on_a_cpu(demo):
    """Without num_pages: a quarter of the host's available memory, at most 2 GiB on a CPU,
    and at most two full-context requests per running row (the test model's context is small:
    that bound decides here)."""
    per_page = 16 * (2 * demo.config.head_dim * 4 + 4)
    group = demo.config.num_layers * demo.config.num_kv_heads
    engine = Engine(demo, page_size=16, max_running=4, max_model_len=2**20)
    want = min(available_bytes() * 0.25, 2 * 2**30) // per_page
    assert abs(engine.pool.num_pages - want) <= 0.05 * want
    engine = Engine(demo, page_size=16, max_running=4, max_model_len=320)
    assert engine.pool.num_pages == 2 * 4 * 20 * group + 1
    assert engine.device.page_nbytes() == engine.pool.num_pages * per_page


def test_streams_share_steps_and_end_as_generate_does(demo):
    """Three asyncio streams at once: each yields generate's tokens alone, they share steps,
    and a stream left early (or a request aborted while streaming) gives its pages back."""
    rng = random.Random(8)
    prompts = random_prompts(rng, 3, demo.config.vocab_size, 5, 20)
    engine = Engine(demo, num_pages=128, page_size=8, chunk=32)

    async def one(prompt):
        toks = []
        async for out in engine.stream(prompt, max_new_tokens=6):
            toks += out.new_tokens
        return toks, out.finish_reason

    async def main():
        return await asyncio.gather(*(one(p) for p in prompts))

    got = asyncio.run(main())
    assert got == [(alone(demo, p, max_new_tokens=6), "length") for p in prompts]
    stats = engine.stats()
    assert stats["steps"] <= 7 and stats["pages_used"] == 0  # 1 prefill step + 5 decode steps

    async def leave_early():
        async for _ in engine.stream(prompts[0], max_new_tokens=30):
            assert engine.pool.used_pages > 0
            break

    async def aborted():
        outs = []
        async for out in engine.stream(prompts[1], max_new_tokens=30, request_id="x"):
            outs.append(out)
            engine.abort("x")
        return outs

    asyncio.run(leave_early())
    assert engine.pool.used_pages == 0 and not engine.has_work
    outs = asyncio.run(aborted())
    assert [o.finish_reason for o in outs] == [None, "abort"] and engine.pool.used_pages == 0


def test_a_stream_gets_every_output_whoever_steps(demo):
    """A stream's request stepped by `generate` (the event loop blocked meanwhile): every one
    of its tokens still reaches the stream (generate dropped them: the stream never ended); a
    second stream with the same live id is refused and the first goes on."""
    rng = random.Random(9)
    first, other = random_prompts(rng, 2, demo.config.vocab_size, 5, 20)
    engine = Engine(demo, num_pages=128, page_size=8, chunk=32)

    async def main():
        stream = engine.stream(first, max_new_tokens=8, request_id="s")
        out = await anext(stream)
        toks = list(out.new_tokens)
        with pytest.raises(ValueError, match="'s' is already streaming"):
            await anext(engine.stream(other, max_new_tokens=2, request_id="s"))
        got_other = engine.generate([other], max_new_tokens=3)  # steps "s" to its end too
        async for out in stream:
            toks += out.new_tokens
        return toks, out.finish_reason, got_other

    toks, reason, (got_other,) = asyncio.run(asyncio.wait_for(main(), 120))
    assert (toks, reason) == (alone(demo, first, max_new_tokens=8), "length")
    assert got_other == alone(demo, other, max_new_tokens=3)
    assert engine.pool.used_pages == 0 and not engine.has_work


def test_stats_count_pages_prefix_hits_and_requests(demo):
    engine = Engine(demo, num_pages=64, page_size=8, chunk=32)
    prompt = list(range(3, 30))  # 27 tokens: 3 full blocks
    engine.generate([prompt], max_new_tokens=2)
    engine.add_request(prompt, max_new_tokens=4)
    engine.add_request([5, 6, 7], max_new_tokens=4)
    engine.step()
    s = engine.stats()
    heads = demo.config.num_layers * demo.config.num_kv_heads
    assert s["running"] == 2 and s["waiting"] == 0 and s["steps"] == 3  # 2 + this one
    assert s["prefix_hits"] == 3 and s["prefix_hit_rate"] == 3 / s["prefix_queries"]
    assert s["pages_used"] == 4 * heads + heads  # 28 tokens and 3 tokens in pages of 8
    assert s["pages_used"] + s["pages_free"] + s["pages_cached_idle"] == s["pages_total"] == 63
    assert s["usage"] == s["pages_used"] / 63
