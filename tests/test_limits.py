"""What a request may ask for: the trained context, free memory, prompt text, budgets, a foreign
kv_state. Each is refused with a ValueError naming the value, before anything is allocated."""

from __future__ import annotations

import numpy as np
import pytest
from tiny_hf import write_tiny_checkpoint

import jkv
from jkv.limits import available_bytes, request_bytes


@pytest.fixture(scope="module")
def params(tiny_params):
    return tiny_params("llama")  # max_position_embeddings 256


def words(n):
    return [3 + i % 100 for i in range(n)]


@pytest.mark.parametrize(
    "prompt_len, max_new",
    [(4, 10**9), (300, 1), (1000, 1), (250, 50), (251, 7)],
)
def test_past_the_trained_context_is_refused(params, prompt_len, max_new):
    want = rf"needs {prompt_len + max_new - 1} positions, more .*max_position_embeddings=256"
    with pytest.raises(ValueError, match=want):
        jkv.generate(params, words(prompt_len), max_new_tokens=max_new)


def test_prefill_refuses_a_context_past_the_trained_one(params):
    with pytest.raises(ValueError, match="needs 300 positions"):
        jkv.prefill(params, words(300))


def test_past_the_context_when_asked_is_flagged(params):
    inside = jkv.generate(params, words(250), max_new_tokens=7)  # positions 0..255
    assert inside.stats["beyond_context"] is False and len(inside.tokens) == 7
    past = jkv.generate(params, words(250), max_new_tokens=16, allow_beyond_context=True)
    assert past.stats["beyond_context"] is True and len(past.tokens) == 16


def test_streaming_within_the_context_may_run_past_it(params):
    r = jkv.generate(params, words(250), max_new_tokens=16, kv_policy="streaming", kv_budget=64)
    assert r.stats["beyond_context"] is False and len(r.tokens) == 16
    with pytest.raises(ValueError, match="needs 315 positions"):  # a budget past the context
        jkv.generate(params, words(250), max_new_tokens=66, kv_policy="streaming", kv_budget=300)


def test_a_request_larger_than_free_memory_is_refused(params):
    kv, prefill, decode = request_bytes(params, [4], 10**9, policy=None, kv_dtype=params.kv_dtype)
    cfg = params.config
    per_token = 2 * cfg.num_layers * cfg.num_kv_heads * cfg.head_dim * 4
    assert kv >= 10**9 * per_token  # the cache alone, from the config (numpy-free arithmetic)
    assert decode > kv and available_bytes() < kv  # no machine this runs on has that much free
    with pytest.raises(ValueError, match=r"needs about [\d.]+ GiB .* GiB are free"):
        jkv.generate(params, words(4), max_new_tokens=10**9, allow_beyond_context=True)


def test_bytes_prompts_are_utf8_text(params):
    text = "w1 w2 w3"
    assert (
        jkv.generate(params, text.encode(), max_new_tokens=3).tokens
        == jkv.generate(params, text, max_new_tokens=3).tokens
    )
    with pytest.raises(ValueError, match=r"not UTF-8 \(byte 0xff at offset 3\)"):
        jkv.generate(params, b"w1 \xff w2")


@pytest.mark.parametrize(
    "prompt, match",
    [
        ("w1 \udcff w2", r"holds '\\udcff' at index 3, a lone surrogate"),
        ("   \n", r"prompt='   \\n' is empty or only whitespace"),
        (["w1", " "], r"prompt\[1\]=' ' is empty or only whitespace"),
    ],
)
def test_text_that_is_not_a_prompt(params, prompt, match):
    with pytest.raises(ValueError, match=match):
        jkv.generate(params, prompt)


@pytest.mark.parametrize("budget", [10**12, 2**31])
def test_budget_past_int32(params, budget):
    with pytest.raises(ValueError, match=rf"budget={budget} must be in \[1, 2147483647\]"):
        jkv.generate(params, words(8), kv_policy="h2o", kv_budget=budget)


def test_kv_state_of_another_model(params, tmp_path):
    other = jkv.load(write_tiny_checkpoint(tmp_path / "other", num_kv_heads=1), progress=False)
    state = jkv.prefill(other, words(8))
    got = (len(state.layers), state.layers[0].k.shape[1], state.layers[0].k.shape[3])
    cfg = params.config
    want = (cfg.num_layers, cfg.num_kv_heads, cfg.head_dim)
    assert got != want
    with pytest.raises(ValueError, match=r"kv_state was made by another model"):
        jkv.generate(params, words(2), kv_state=state)


def test_seed_range(params):
    with pytest.raises(ValueError, match=r"seed=1180591620717411303424 must be"):
        jkv.generate(params, words(2), seed=2**70)
    assert np.iinfo(np.uint64).max == 2**64 - 1  # the largest seed accepted
    jkv.generate(params, words(2), max_new_tokens=1, seed=2**64 - 1, temperature=1.0)
