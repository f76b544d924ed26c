"""jkv.scoring.stream_score: token-by-token perplexity through the decode path, with a policy."""

from __future__ import annotations

import numpy as np
import pytest

import jkv
from jkv import scoring
from jkv.scoring import score, stream_score


@pytest.fixture(scope="module")
def ids(tiny_params):
    rng = np.random.default_rng(3)
    return rng.integers(3, tiny_params("llama").config.vocab_size, 150).tolist()


def test_full_cache_equals_one_prefill(tiny_params, ids):
    params = tiny_params("llama")
    np.testing.assert_allclose(stream_score(params, ids), score(params, ids), atol=1e-4)


def test_streaming_window(tiny_params, ids):
    params = tiny_params("llama")
    full = score(params, ids)
    got = stream_score(params, ids, policy=jkv.StreamingLLM(budget=48, sink=4))
    assert got.shape == full.shape and np.isfinite(got).all()
    # Until the cache is full nothing is evicted: the same numbers; past it, other numbers.
    np.testing.assert_allclose(got[:47], full[:47], atol=1e-4)
    assert np.abs(got[60:] - full[60:]).max() > 1e-3
    roomy = stream_score(params, ids, policy=jkv.StreamingLLM(budget=256, sink=4))
    np.testing.assert_allclose(roomy, full, atol=1e-4)


def test_bad_policy_and_text(tiny_params, ids):
    params = tiny_params("llama")
    with pytest.raises(ValueError, match="fixed integer budget"):
        stream_score(params, ids, policy=jkv.StreamingLLM(budget=0.5))
    with pytest.raises(ValueError, match="at least 2"):
        stream_score(params, ids[:1])
    with pytest.raises(ValueError, match="one text"):
        stream_score(params, [ids, ids])


def test_score_goes_through_the_text_a_chunk_per_step(tiny_params, ids, monkeypatch):
    """`score(chunk=16)` runs 16-token steps (never the whole text's logits at once) and gives
    what one step over the whole text gives, also continuing a prefilled state."""
    params = tiny_params("llama")
    whole = score(params, ids)  # 150 tokens: one step of the default 512-token chunk
    context = jkv.prefill(params, ids[:40])
    after = score(params, ids[40:], kv_state=context)
    steps = []
    real = scoring.prefill_step

    def spy(weights, config, tokens, *args, **kwargs):
        steps.append(tokens.shape)
        return real(weights, config, tokens, *args, **kwargs)

    monkeypatch.setattr(scoring, "prefill_step", spy)
    np.testing.assert_allclose(score(params, ids, chunk=16), whole, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(
        score(params, ids[40:], kv_state=context, chunk=16), after, rtol=1e-5, atol=1e-5
    )
    assert set(steps) == {(1, 16)} and len(steps) == 10 + 7
    with pytest.raises(ValueError, match="chunk=24 must be a power of two"):
        score(params, ids, chunk=24)
