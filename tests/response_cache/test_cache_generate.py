"""jkv.generate and jkv.stream through the response cache: levels, keys that follow the
settings and what the model reads (token ids: whitespace the tokenizer keeps is another key),
groups."""

from __future__ import annotations

import threading

import numpy as np
import pytest
from tokenizers import Tokenizer as HFTokenizer
from tokenizers import pre_tokenizers

import jkv
from jkv.embedding import ModelEmbedder, fit_clusters
from jkv.response_cache import front
from jkv.tokenizer import Tokenizer


@pytest.fixture(scope="module")
def params(tiny_params):
    return tiny_params("llama")


def test_l1_then_model_and_settings_in_the_key(params):
    cache = jkv.ResponseCache()
    first = jkv.generate(params, "w1  w2\n w3", max_new_tokens=5, cache=cache)
    # a whitespace variant this word-level tokenizer reads as the same ids: the same key
    again = jkv.generate(params, " w1 w2 w3 ", max_new_tokens=5, cache=cache)
    assert first.cache is None and again.cache == "l1"
    assert again.tokens == first.tokens and again.text == first.text
    assert again.tokens == jkv.generate(params, "w1 w2 w3", max_new_tokens=5).tokens
    for kwargs in (
        dict(max_new_tokens=6),
        dict(max_new_tokens=5, kv_dtype="bfloat16"),
        dict(max_new_tokens=5, kv_policy="snapkv", kv_budget=4),
        dict(max_new_tokens=5, temperature=0.7, seed=1),
    ):
        assert jkv.generate(params, "w1 w2 w3", cache=cache, **kwargs).cache is None
    renamed = params.replace(name="other-model")
    assert jkv.generate(renamed, "w1 w2 w3", max_new_tokens=5, cache=cache).cache is None


def test_batch_generates_only_misses(params):
    cache = jkv.ResponseCache()
    jkv.generate(params, "w4 w5 w6", max_new_tokens=4, cache=cache)
    out = jkv.generate(params, ["w4 w5 w6", "w7 w8"], max_new_tokens=4, cache=cache)
    assert [r.cache for r in out] == ["l1", None]
    assert out[1].tokens == jkv.generate(params, "w7 w8", max_new_tokens=4).tokens
    assert cache.stats()["generations"] == 2  # every fill of a generated answer counts


def test_two_nodes_share_l2(params, redis_url):
    a = jkv.ResponseCache(redis_url, node_id="node-a")
    b = jkv.ResponseCache(redis_url, node_id="node-b")
    try:
        made = jkv.generate(params, [5, 9, 12], max_new_tokens=4, cache=a)
        seen = jkv.generate(params, [5, 9, 12], max_new_tokens=4, cache=b)
        assert made.cache is None and seen.cache == "l2" and seen.tokens == made.tokens
        assert jkv.generate(params, [5, 9, 12], max_new_tokens=4, cache=b).cache == "l1"
    finally:
        a.close()
        b.close()


def test_knowledge_groups_from_the_model(params, redis_url):
    embedder = ModelEmbedder(params)
    rng = np.random.default_rng(0)
    samples = [" ".join(f"w{i}" for i in rng.integers(0, 120, size=8)) for _ in range(12)]
    clusterer = fit_clusters(embedder, samples, k=3)
    cache = jkv.ResponseCache(redis_url, embedder=embedder, clusterer=clusterer)
    try:
        res = jkv.generate(params, samples[0], max_new_tokens=3, cache=cache)
        group = clusterer.assign(embedder(samples[0]))
        hit = jkv.generate(params, samples[0], max_new_tokens=3, cache=cache)
        assert hit.cache == "l1" and hit.stats["cache_group"] == group
        assert cache.invalidate_group(params.name, group) >= 1
        assert jkv.generate(params, samples[0], max_new_tokens=3, cache=cache).cache is None
        assert res.tokens == hit.tokens
    finally:
        cache.close()


def test_embedder_errors(params):
    with pytest.raises(ValueError, match=r"max_tokens=0 must be a positive integer"):
        ModelEmbedder(params, max_tokens=0)
    with pytest.raises(ValueError, match=r"2 sample prompts cannot make k=3 clusters"):
        fit_clusters(ModelEmbedder(params), ["w1", "w2"], k=3)


# --------------------------------------------------------------------------- what a hit returns
DOCUMENTED_STATS = {"prompt_tokens", "generated_tokens", "prefill_s", "decode_tokens_per_s"}
DOCUMENTED_STATS |= {"kv_bytes_used", "cache"}


def test_hits_report_the_generation_that_made_them(params, redis_url):
    a = jkv.ResponseCache(redis_url, node_id="node-a")
    b = jkv.ResponseCache(redis_url, node_id="node-b")
    try:
        made = jkv.generate(params, "w9 w8 w7", max_new_tokens=4, cache=a)
        l1 = jkv.generate(params, "w9 w8 w7", max_new_tokens=4, cache=a)
        l2 = jkv.generate(params, "w9 w8 w7", max_new_tokens=4, cache=b)
    finally:
        a.close()
        b.close()
    assert made.cache is None and made.stats["cache"] is None and made.kv_bytes > 0
    for hit, level in ((l1, "l1"), (l2, "l2")):
        assert hit.cache == level == hit.stats["cache"]
        assert hit.kv_bytes == made.kv_bytes
        assert DOCUMENTED_STATS <= set(hit.stats)
        assert hit.stats["prompt_tokens"] == made.stats["prompt_tokens"]
        assert hit.stats["kv_bytes_used"] == made.stats["kv_bytes_used"]


def test_coalesced_callers_are_not_generations(params):
    cache = jkv.ResponseCache()
    barrier = threading.Barrier(16)
    results = []

    def ask():
        barrier.wait()
        results.append(jkv.generate(params, "w3 w1 w4 w1 w5", max_new_tokens=11, cache=cache))

    threads = [threading.Thread(target=ask) for _ in range(16)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    levels = [r.cache for r in results]
    assert levels.count(None) == 1 and "coalesced" in levels
    assert set(levels) <= {None, "coalesced", "l1"}
    assert cache.stats()["generations"] == 1
    made = next(r for r in results if r.cache is None)
    for r in results:
        assert r.tokens == made.tokens and r.kv_bytes == made.kv_bytes
        assert DOCUMENTED_STATS <= set(r.stats) and r.stats["cache"] == r.cache


# --------------------------------------------------------------------------- the prompt the model sees
@pytest.fixture(scope="module")
def spaced(params):
    """The params with a tokenizer that splits on spaces only: a newline is part of a word (an
    unknown one), so whitespace changes what the model reads."""
    inner = HFTokenizer.from_str(params.tokenizer.to_str())
    inner.pre_tokenizer = pre_tokenizers.Split(" ", behavior="removed")
    tok = params.tokenizer
    spaced = Tokenizer(inner, bos_token_id=tok.bos_token_id, eos_token_ids=tok.eos_token_ids)
    return params.replace(tokenizer=spaced)


def test_whitespace_the_tokenizer_keeps_is_another_key(spaced):
    raw, flat = "w1\nw2 w3  w4", "w1 w2 w3 w4"
    want = {p: jkv.generate(spaced, p, max_new_tokens=6).tokens for p in (raw, flat)}
    assert want[raw] != want[flat]  # precondition: the model reads them differently
    cache = jkv.ResponseCache()
    got = jkv.generate(spaced, raw, max_new_tokens=6, cache=cache)
    assert got.cache is None and got.tokens == want[raw]
    other = jkv.generate(spaced, flat, max_new_tokens=6, cache=cache)
    assert other.cache is None and other.tokens == want[flat]  # not raw's answer
    again = jkv.generate(spaced, raw, max_new_tokens=6, cache=cache)
    assert again.cache == "l1" and again.tokens == want[raw]
    # a tokenizer that sees some whitespace gets exact keys: a run of spaces it would drop
    # is a needless miss, never a wrong hit
    assert jkv.generate(spaced, "w1 w2  w3 w4", max_new_tokens=6, cache=cache).cache is None


class CountingTokenizer(Tokenizer):
    """The real tokenizer, counting how often a prompt is encoded."""

    encoded = 0

    def encode(self, text, **kwargs):
        CountingTokenizer.encoded += 1
        return super().encode(text, **kwargs)


def test_a_tokenizer_blind_to_whitespace_keys_normalised_text_and_hits_do_not_tokenise(params):
    tok = params.tokenizer  # word-level, split at whitespace: it cannot see any
    counting = CountingTokenizer(tok.inner, bos_token_id=tok.bos_token_id,
                                 eos_token_ids=tok.eos_token_ids)  # fmt: skip
    blind = params.replace(tokenizer=counting)
    chars, _ = front.blind_whitespace(counting)
    assert " " in chars and "\n" in chars and "\x1c" not in chars  # str.split's, not its
    cache = jkv.ResponseCache()
    made = jkv.generate(blind, "w5 w6", max_new_tokens=3, cache=cache)
    before = CountingTokenizer.encoded
    assert jkv.generate(blind, " w5 \n w6\t", max_new_tokens=3, cache=cache).cache == "l1"
    batch = jkv.generate(blind, ["w5 w6", "w5\u3000w6"], max_new_tokens=3, cache=cache)
    assert [r.cache for r in batch] == ["l1", "l1"] and batch[1].tokens == made.tokens
    assert CountingTokenizer.encoded == before
    # U+001C splits for str.split, not for this tokenizer: normalising it would change ids
    odd = "w5\x1cw6"
    assert jkv.generate(blind, odd, max_new_tokens=3).tokens != made.tokens  # precondition
    assert jkv.generate(blind, odd, max_new_tokens=3, cache=cache).cache is None


def test_batch_rows_keep_their_text_and_equal_keys_generate_once(spaced):
    raw = "w7\nw8 w9"
    cache = jkv.ResponseCache()
    out = jkv.generate(spaced, [raw, "w2 w3", "w2 w3"], max_new_tokens=5, cache=cache)
    assert [r.cache for r in out] == [None, None, "coalesced"]
    assert out[0].tokens == jkv.generate(spaced, raw, max_new_tokens=5).tokens
    assert out[2].tokens == out[1].tokens and out[2].kv_bytes == out[1].kv_bytes
    flat = jkv.generate(spaced, "w7 w8 w9", max_new_tokens=5, cache=cache)
    assert (
        flat.cache is None
        and flat.tokens == jkv.generate(spaced, "w7 w8 w9", max_new_tokens=5).tokens
    )


def test_batch_errors_name_the_row(params):
    cache = jkv.ResponseCache()
    jkv.generate(params, "w1 w2", max_new_tokens=3, cache=cache)
    with pytest.raises(ValueError, match=r"prompt\[2\]"):
        jkv.generate(params, ["w1 w2", "w3", ""], max_new_tokens=3, cache=cache)
    with pytest.raises(ValueError, match=r"prompt\[1\].*holds token id 100000"):
        jkv.generate(params, [[5, 6], [5, 100000]], max_new_tokens=3, cache=cache)


# --------------------------------------------------------------------------- streaming
def _drain(gen):
    pieces = []
    while True:
        try:
            pieces.append(next(gen))
        except StopIteration as stop:
            return pieces, stop.value


def test_a_stream_streams_a_miss_and_answers_a_hit_in_one_piece(params, redis_url):
    want = jkv.generate(params, "w4 w4 w2", max_new_tokens=6)
    with jkv.ResponseCache(redis_url, node_id="s1") as a, jkv.ResponseCache(redis_url) as b:
        pieces, made = _drain(jkv.stream(params, "w4 w4 w2", max_new_tokens=6, cache=a))
        assert len(pieces) > 1 and "".join(pieces) == want.text and made.cache is None
        for cache, level in ((a, "l1"), (b, "l2")):
            stream = jkv.stream(params, " w4 w4\nw2", max_new_tokens=6, cache=cache)
            pieces, hit = _drain(stream)
            assert pieces == [want.text] and hit.cache == level and hit.tokens == want.tokens
        # one key for generate and stream: the stream's answer is generate's hit
        assert jkv.generate(params, "w4 w4 w2", max_new_tokens=6, cache=a).cache == "l1"


def test_a_stream_closed_early_stores_nothing(params):
    cache = jkv.ResponseCache()
    stream = jkv.stream(params, "w6 w6 w6", max_new_tokens=6, cache=cache)
    next(stream)
    stream.close()
    assert jkv.generate(params, "w6 w6 w6", max_new_tokens=6, cache=cache).cache is None
