"""An evicting policy's budget is its cache size whatever the prompt; H2O evicts the lightest
or oldest token, never a fixed slot; a batch row holds (and generates) what it would alone."""

from __future__ import annotations

import importlib

import numpy as np
import pytest

import jkv
from jkv.request import Request

gen = importlib.import_module("jkv.generate")


@pytest.fixture(scope="module")
def params(tiny_params):
    return tiny_params("llama")


def _prompts(seed, lengths, vocab):
    rng = np.random.default_rng(seed)
    return [rng.integers(3, vocab, size=n).tolist() for n in lengths]


def _session(params, prompts, **kw):
    req = Request.build(params, **kw)
    return gen.Session(params, prompts, req)


@pytest.mark.parametrize("policy", [jkv.StreamingLLM(budget=256), jkv.H2O(budget=256)])
def test_an_evicting_budget_is_the_cache_size_whatever_the_prompt(params, policy):
    prompt = _prompts(0, [4], params.config.vocab_size)[0]
    out = jkv.generate(params, prompt, max_new_tokens=100, kv_policy=policy)
    full = jkv.generate(params, prompt, max_new_tokens=100)
    # 103 tokens are cached (the last generated is never fed back) and fit a 256-token budget:
    # nothing is evicted, so nothing differs.
    assert out.tokens == full.tokens
    assert all(c >= 256 for c in out.stats["kv_capacity"])
    s = _session(params, [prompt], max_new_tokens=100, kv_policy=policy)
    s.run()
    for layer in s.state.kv.layers:
        assert np.asarray(layer.lengths).tolist() == [[103] * params.config.num_kv_heads]


def test_h2o_at_a_budget_below_recent_keeps_the_newest_tokens(params):
    """budget <= recent: the heavy-hitter part is empty, the cache is a sliding window."""
    prompt = _prompts(1, [20], params.config.vocab_size)[0]
    s = _session(params, [prompt], max_new_tokens=30, kv_policy=jkv.H2O(budget=8, recent=32))
    s.run()
    n = 20 + int(np.asarray(s.state.count)[0]) - 1  # tokens written (the last is not fed)
    for layer in s.state.kv.layers:
        length = np.asarray(layer.lengths)[0]
        positions = np.asarray(layer.positions)[0]
        for k in range(params.config.num_kv_heads):
            assert length[k] == 8
            assert sorted(positions[k, :8].tolist()) == list(range(n - 8, n))


@pytest.mark.parametrize("recent", [4, 32])
def test_h2o_a_token_lives_until_it_is_the_lightest_or_oldest(params, recent):
    """Step by step: the token each step evicts is the lightest outside the protected recent
    window (numpy's rule on the scores before the step), and every other token stays."""
    budget = 12
    prompt = _prompts(2, [10], params.config.vocab_size)[0]
    s = _session(
        params, [prompt], max_new_tokens=24, kv_policy=jkv.H2O(budget=budget, recent=recent)
    )
    evictions = 0
    while not s.finished:
        before = [
            (np.asarray(x.positions)[0], np.asarray(x.scores)[0], np.asarray(x.lengths)[0])
            for x in s.state.kv.layers
        ]
        now = int(np.asarray(s.state.kv.next_position)[0])
        s.advance(1)
        for (pos, score, length), layer in zip(before, s.state.kv.layers, strict=True):
            after = np.asarray(layer.positions)[0]
            for k in range(pos.shape[0]):
                old = set(pos[k, : length[k]].tolist())
                new = set(after[k, : np.asarray(layer.lengths)[0, k]].tolist())
                assert now in new
                gone = old - new
                if length[k] < budget:
                    assert not gone
                    continue
                protected = min(recent, budget - 1)
                candidates = [
                    (score[k, j], j) for j in range(length[k]) if pos[k, j] < now - protected
                ]
                expect = pos[k, min(candidates)[1]]
                assert gone == {expect}, (gone, expect)
                evictions += 1
    assert evictions > 0


POLICIES = [
    None,
    jkv.StreamingLLM(budget=0.3, sink=2),
    jkv.H2O(budget=0.3, recent=4),
    jkv.SnapKV(budget=0.4, window=4),
]


@pytest.mark.parametrize("policy", POLICIES, ids=lambda p: "full" if p is None else p.name)
def test_every_row_of_a_mixed_batch_equals_the_request_alone(params, policy):
    prompts = _prompts(3, [7, 13, 23, 30], params.config.vocab_size)  # two prompt buckets
    kw = dict(max_new_tokens=16, temperature=1.0, top_p=0.95, seed=1234, kv_policy=policy)
    batch = jkv.generate(params, prompts, **kw)
    for prompt, row in zip(prompts, batch, strict=True):
        alone = jkv.generate(params, prompt, **kw)
        assert row.tokens == alone.tokens
