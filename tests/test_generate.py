"""The generation ladder: batches, sampling, stop conditions, streaming."""

from __future__ import annotations

import importlib

import numpy as np
import pytest

import jkv

gen = importlib.import_module("jkv.generate")  # the module; jkv.generate is the function
pre = importlib.import_module("jkv.prefill")


@pytest.fixture(scope="module")
def params(tiny_params):
    return tiny_params("llama")


def _prompts(seed, lengths, vocab):
    rng = np.random.default_rng(seed)
    return [rng.integers(3, vocab, size=n).tolist() for n in lengths]


def test_ragged_batch_rows_equal_alone(params):
    prompts = _prompts(0, [5, 23, 17, 40], params.config.vocab_size)
    batch = jkv.generate(params, prompts, max_new_tokens=12)
    assert isinstance(batch, list) and len(batch) == 4
    for prompt, row in zip(prompts, batch, strict=True):
        alone = jkv.generate(params, prompt, max_new_tokens=12)
        assert row.tokens == alone.tokens
        assert row.stats["prompt_tokens"] == len(prompt)


def test_sampling_reproducible_and_seed_sensitive(params):
    prompt = _prompts(1, [10], params.config.vocab_size)[0]
    kw = dict(max_new_tokens=16, temperature=1.0, top_p=0.95)
    a = jkv.generate(params, prompt, seed=3, **kw)
    b = jkv.generate(params, prompt, seed=3, **kw)
    c = jkv.generate(params, prompt, seed=4, **kw)
    assert a.tokens == b.tokens
    assert a.tokens != c.tokens


def test_top_k_one_equals_greedy(params):
    prompt = _prompts(2, [9], params.config.vocab_size)[0]
    greedy = jkv.generate(params, prompt, max_new_tokens=16)
    top1 = jkv.generate(params, prompt, max_new_tokens=16, temperature=0.8, top_k=1, seed=5)
    assert top1.tokens == greedy.tokens


def test_text_prompt_and_stream_agree(params):
    text = "w3 w7 w1 w9 w4"
    result = jkv.generate(params, text, max_new_tokens=10)
    pieces = list(jkv.stream(params, text, max_new_tokens=10))
    assert len(pieces) > 1
    assert "".join(pieces) == result.text
    assert result.stats["generated_tokens"] == 10
    assert result.kv_bytes > 0


def test_eos_stops_row(tiny_params, hf_checkpoint):
    params = tiny_params("llama")
    prompt = _prompts(3, [8], params.config.vocab_size)[0]
    free = jkv.generate(params, prompt, max_new_tokens=12)
    # Make the 4th generated token an eos: the row must stop right there.
    eos = free.tokens[3]
    stopping = params.replace(config=params.config.replace(eos_token_ids=(eos,)))
    out = jkv.generate(stopping, prompt, max_new_tokens=12)
    first = free.tokens.index(eos)
    assert out.tokens == free.tokens[: first + 1]
    assert out.finish_reason == "stop"


def test_stop_string_cuts_text(params):
    prompt = "w1 w2 w3"
    free = jkv.generate(params, prompt, max_new_tokens=20)
    words = free.text.split()
    stop = words[5]
    first = words.index(stop)
    out = jkv.generate(params, prompt, max_new_tokens=20, stop=[stop])
    assert out.finish_reason == "stop"
    assert out.text == " ".join(words[:first]) + " "
    assert out.tokens == free.tokens[: first + 1]
    streamed = "".join(jkv.stream(params, prompt, max_new_tokens=20, stop=stop))
    assert streamed == out.text


def test_max_new_tokens_one(params):
    out = jkv.generate(params, [5, 6, 7], max_new_tokens=1)
    assert len(out.tokens) == 1 and out.finish_reason == "length"


def test_prefill_buckets_bound_recompiles(params):
    before = pre.prefill_step._cache_size()
    for n in (17, 20, 25, 31, 32):  # one bucket: 32
        jkv.generate(params, list(range(3, 3 + n)), max_new_tokens=2)
    assert pre.prefill_step._cache_size() - before <= 1
    assert gen.bucket(17) == gen.bucket(32) == 32 and gen.bucket(1) == 16


def test_kv_bytes_reports_allocated_state(params):
    cfg = params.config
    out = jkv.generate(params, [5] * 20, max_new_tokens=8)
    capacity = gen.bucket(20) + gen.bucket(8)  # prompt bucket + decode headroom bucket
    itemsize = 4  # float32 params -> float32 cache
    assert (
        out.kv_bytes == 2 * cfg.num_layers * cfg.num_kv_heads * capacity * cfg.head_dim * itemsize
    )
    bf16 = jkv.generate(params, [5] * 20, max_new_tokens=8, kv_dtype="bfloat16")
    assert bf16.kv_bytes * 2 == out.kv_bytes


def test_each_rows_kv_bytes_are_its_own_in_a_ragged_batch(params):
    """A row reports its share of the batch's allocation (the batch's over B: every row gets
    the longest row's capacity) and the bytes its own kept slots hold, which equal the row's
    alone when the row alone gets the same capacity."""
    rows = [[5] * 20, [7] * 9, [9] * 31]
    batch = jkv.generate(params, rows, max_new_tokens=8, kv_policy="snapkv", kv_budget=0.5)
    whole = batch[0].stats["batch_kv_bytes"]
    assert [r.kv_bytes for r in batch] == [whole // 3] * 3 and whole % 3 == 0
    used = [r.stats["kv_bytes_used"] for r in batch]
    assert len(set(used)) == 3  # ragged: each row keeps its own budget's slots
    cfg = params.config
    per_slot = 2 * cfg.num_kv_heads * cfg.head_dim * 4 * cfg.num_layers
    for row, r in zip(rows, batch, strict=True):
        kept = r.stats["kv_bytes_used"] // per_slot  # slots this row holds in each layer & head
        assert r.stats["kv_bytes_used"] == kept * per_slot
        assert kept == -(-len(row) // 2) + 8 - 1  # half the prompt (rounded up), then decoded
    alone = jkv.generate(params, rows[2], max_new_tokens=8, kv_policy="snapkv", kv_budget=0.5)
    assert alone.stats["kv_bytes_used"] == batch[2].stats["kv_bytes_used"]
    assert alone.kv_bytes == batch[2].kv_bytes  # the longest row sets the batch's capacity
