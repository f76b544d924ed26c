"""jkv.generate through the response cache: levels, keys that follow the settings, groups."""

from __future__ import annotations

import numpy as np
import pytest

import jkv
from jkv.embedding import ModelEmbedder, fit_clusters


@pytest.fixture(scope="module")
def params(tiny_params):
    return tiny_params("llama")


def test_l1_then_model_and_settings_in_the_key(params):
    cache = jkv.ResponseCache()
    first = jkv.generate(params, "w1  w2\n w3", max_new_tokens=5, cache=cache)
    again = jkv.generate(params, " w1 w2 w3 ", max_new_tokens=5, cache=cache)  # whitespace variant
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
    assert cache.stats()["generations"] == 1  # the batch's miss is put, not counted as a flight


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
