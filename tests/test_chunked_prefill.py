"""Chunked prefill: the prompt goes through the model `chunk` tokens per step, each step over
the cache so far plus itself. Checked against transformers (an independent implementation) and
against one step over the whole prompt; the cut is checked against a plain list reference; the
step's temporaries are measured by XLA (no [T, S] score tensor)."""

from __future__ import annotations

import functools
import importlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
import transformers

import jkv
from jkv.kv import bucket
from jkv.prefill import chunks, empty_state, prefill_step, prepare
from jkv.scoring import chunk_score
from jkv_models.llama import param_shapes


def test_chunks_end_at_each_rows_last_token():
    rng = np.random.default_rng(0)
    prompts = [list(rng.integers(3, 50, n)) for n in (1, 15, 16, 17, 40, 33)]
    steps = list(chunks(prompts, 16))
    assert len(steps) == 3  # ceil(40 / 16)
    for b, p in enumerate(prompts):
        got = [t for tokens, n in steps for t in tokens[b, : n[b]]]
        assert got == p  # every token once, in order
        assert steps[-1][1][b] == min(len(p), 16)  # the last step ends the row
        for tokens, n in steps:
            assert np.all(tokens[b, n[b] :] == 0)  # padding after the real tokens


@pytest.mark.parametrize("kind", ["llama", "mistral", "qwen2"])
def test_chunked_prefill_matches_transformers(kind, hf_checkpoint, tiny_params):
    """Last-token logits after a 100-token prompt prefilled 16 tokens at a time (7 steps, the
    first partial), and the greedy continuation, equal transformers' (float32)."""
    params = tiny_params(kind)
    hf = transformers.AutoModelForCausalLM.from_pretrained(
        hf_checkpoint(kind), dtype=torch.float32
    ).eval()
    rng = np.random.default_rng(7)
    prompts = [rng.integers(3, params.config.vocab_size, n).tolist() for n in (100, 37)]
    logits, _ = prepare(
        params, prompts, policy=None, kv_dtype="float32", backend="xla", max_new_tokens=8, chunk=16
    )
    for row, p in enumerate(prompts):
        with torch.no_grad():
            ref = hf(torch.tensor([p])).logits[0, -1].numpy()
        got = np.asarray(logits[row])
        assert np.abs(got - ref).max() <= 1e-4 * max(1.0, np.abs(ref).max())


def _prepare(params, prompts, chunk, policy=None, kv_dtype="float32", backend="xla"):
    return prepare(
        params,
        prompts,
        policy=policy,
        kv_dtype=kv_dtype,
        backend=backend,
        max_new_tokens=4,
        chunk=chunk,
    )


def _rel(a, b):
    a, b = np.asarray(a, np.float32), np.asarray(b, np.float32)
    return float(np.abs(a - b).max() / max(np.abs(b).max(), 1e-30))


@pytest.mark.parametrize("policy", [None, "snapkv", "adakv", "pyramidkv", "snapkv_segments"])
def test_chunked_equals_one_step_for_every_policy(policy):
    """The demo model, two rows of 150 and 90 tokens: chunks of 32 keep the same slots (exactly)
    and the same values (float32 rounding) as one step over the whole prompt. SnapKV's window
    falls in the last chunk."""
    params = jkv.load("demo")
    rng = np.random.default_rng(3)
    prompts = [rng.integers(3, params.config.vocab_size, n).tolist() for n in (150, 90)]
    pol = jkv.policies.resolve(policy, 0.3 if policy else None)
    one_logits, one = _prepare(params, prompts, 4096, pol)
    got_logits, got = _prepare(params, prompts, 32, pol)
    assert _rel(got_logits, one_logits) <= 1e-5
    for a, b in zip(got.layers, one.layers, strict=True):
        np.testing.assert_array_equal(np.asarray(a.lengths), np.asarray(b.lengths))
        np.testing.assert_array_equal(np.asarray(a.positions), np.asarray(b.positions))
        valid = np.arange(a.capacity) < np.asarray(a.lengths)[..., None]
        assert _rel(np.asarray(a.k)[valid], np.asarray(b.k)[valid]) <= 1e-5
        assert _rel(np.asarray(a.v)[valid], np.asarray(b.v)[valid]) <= 1e-5
    np.testing.assert_array_equal(np.asarray(got.next_position), [150, 90])


def test_generate_is_the_same_through_chunks():
    """Greedy tokens of the demo model on a 600-token prompt (two steps of the default chunk of
    512) equal those of one step (a chunk as large as the prompt), full cache and SnapKV."""
    params = jkv.load("demo")
    rng = np.random.default_rng(5)
    prompt = rng.integers(3, params.config.vocab_size, 600).tolist()
    for policy in (None, jkv.SnapKV(budget=0.25)):
        req = dict(policy=policy, kv_dtype="float32", backend="xla", max_new_tokens=8)
        a, _ = prepare(params, [prompt], **req, chunk=512)
        b, _ = prepare(params, [prompt], **req, chunk=1024)
        assert int(np.argmax(a[0])) == int(np.argmax(b[0]))
        assert _rel(a, b) <= 1e-5
    out = jkv.generate(params, prompt, max_new_tokens=6, allow_beyond_context=True)
    assert out.tokens and out.stats["prompt_tokens"] == 600  # through two chunks


@pytest.mark.parametrize("kv_dtype", ["float8_e4m3fn"])
def test_chunked_prefill_on_the_pallas_kernels(kv_dtype):
    """The prefill kernels (interpreted; fp8, so the quantising append too) in every chunk: same
    logits as the XLA path."""
    params = jkv.load("demo")
    rng = np.random.default_rng(11)
    prompts = [rng.integers(3, params.config.vocab_size, n).tolist() for n in (70, 33)]
    a, _ = _prepare(params, prompts, 32, jkv.H2O(budget=32), kv_dtype, "pallas_interpret")
    b, _ = _prepare(params, prompts, 32, jkv.H2O(budget=32), kv_dtype, "xla")
    assert _rel(a, b) <= (1e-5 if kv_dtype == "float32" else 2e-2)


@functools.lru_cache
def _step_temp(capacity: int, chunk: int, kv_dtype: str = "float32") -> int:
    cfg = jkv.load("demo").config
    kv = jax.eval_shape(lambda: empty_state(cfg, 1, capacity, kv_dtype))
    spec = jax.ShapeDtypeStruct
    lowered = prefill_step.lower(
        param_shapes(cfg), cfg, spec((1, chunk), jnp.int32), spec((1,), jnp.int32), kv
    )
    return lowered.compile().memory_analysis().temp_size_in_bytes


def test_a_chunk_step_needs_no_prompt_by_prompt_memory():
    """XLA's own count of a 64-token chunk's temporaries over caches of 1K, 4K and 16K slots:
    at most linear in the cache (a [T, S] float32 score tensor of 64 x 16K per head would be
    quadratic in the prompt: T = S when the prompt is one step)."""
    t1, t4, t16 = (_step_temp(bucket(n), 64) for n in (1024, 4096, 16384))
    assert t16 / t4 <= 4.5 and t4 / t1 <= 4.5, (t1, t4, t16)
    one_step = _step_temp(4096, 4096)  # the whole prompt as one chunk
    assert one_step > 8 * t4, (one_step, t4)


@pytest.mark.parametrize("kv_dtype", ["bfloat16", "float8_e4m3fn"])
def test_a_chunk_step_holds_no_float32_copy_of_a_narrow_cache(kv_dtype):
    """XLA:CPU widens a bfloat16 / fp8 buffer to float32 around a float scatter or slice: a
    float32 copy of every layer's K and V for a write of one chunk. The cache write and the
    key-block reads move such storage as its bits instead; a float32 copy of one layer's K and
    V alone is 512 bytes per slot for the demo model (4 layers: 2,048)."""
    t512, t4k = (_step_temp(n, 64, kv_dtype) for n in (512, 4096))
    per_slot = (t4k - t512) / (4096 - 512)
    # Measured with 64-token chunks: before, 1,902 (bf16) and 1,073 (fp8) bytes per slot; now
    # 878 and 389 (what is left is XLA:CPU's own copies around the bitcasts).
    assert per_slot < {"bfloat16": 1024, "float8_e4m3fn": 600}[kv_dtype], per_slot


def _kept_positions(state):
    layer = state.layers[0]
    pos, lengths = np.asarray(layer.positions), np.asarray(layer.lengths)
    return [sorted(pos[b, 0, : lengths[b, 0]].tolist()) for b in range(pos.shape[0])]


def _capacities_while_prefilling(monkeypatch, params, prompt, policy):
    """(the cache capacities every prefill step of 32-token chunks saw, the final state)."""
    seen = []

    def spy(*args, **kw):
        seen.append(args[4].layers[0].capacity)
        return prefill_step(*args, **kw)

    with monkeypatch.context() as m:
        m.setattr(importlib.import_module("jkv.prefill"), "prefill_step", spy)
        _, state = _prepare(params, [prompt], 32, policy)
    return seen, state


def test_evicting_policies_evict_as_the_prompt_streams_in(monkeypatch):
    """StreamingLLM and H2O with a budget of 40 tokens, chunks of 32: the cache allocates
    budget + one chunk (64 + 32 slots) for a 150-token and a 600-token prompt alike, where the
    one-step prefill allocates the prompt's bucket (256, 1024). StreamingLLM keeps exactly its
    sinks and the newest tokens, as the one-step prefill does; H2O keeps its budget, the recent
    window among it."""
    params = jkv.load("demo")
    rng = np.random.default_rng(9)
    for n in (150, 600):
        prompt = rng.integers(3, params.config.vocab_size, n).tolist()
        for policy in (jkv.StreamingLLM(budget=40, sink=4), jkv.H2O(budget=40, recent=8)):
            _, one = _prepare(params, [prompt], 4096, policy)
            seen, got = _capacities_while_prefilling(monkeypatch, params, prompt, policy)
            assert set(seen) == {64 + 32}, seen  # the cache while prefilling, whatever n
            assert got.layers[0].capacity == one.layers[0].capacity == 64  # after
            kept = _kept_positions(got)[0]
            assert len(kept) == 40
            if isinstance(policy, jkv.StreamingLLM):
                assert kept == [0, 1, 2, 3, *range(n - 36, n)] == _kept_positions(one)[0]
            else:
                assert kept[-8:] == list(range(n - 8, n))


def test_chunk_score_matches_transformers_and_evicts_to_its_budget(hf_checkpoint, tiny_params):
    """`chunk_score` with the full cache equals transformers' log-probabilities (independent);
    under StreamingLLM(budget=48) in chunks of 16 the tokens before the first eviction score as
    with the full cache, and the later ones differ (they no longer see the evicted middle)."""
    params = tiny_params("llama")
    hf = transformers.AutoModelForCausalLM.from_pretrained(
        hf_checkpoint("llama"), dtype=torch.float32
    ).eval()
    rng = np.random.default_rng(2)
    ids = rng.integers(3, params.config.vocab_size, 120).tolist()
    full = chunk_score(params, ids, chunk=16)
    with torch.no_grad():
        logp = torch.log_softmax(hf(torch.tensor([ids])).logits[0], -1).numpy()
    ref = logp[np.arange(len(ids) - 1), ids[1:]]
    np.testing.assert_allclose(full, ref, atol=1e-4)
    streamed = chunk_score(params, ids, policy=jkv.StreamingLLM(budget=48, sink=4), chunk=16)
    assert streamed.shape == full.shape
    # chunks are aligned at the end: 120 = 8 + 7 x 16, the first eviction after 56 tokens
    np.testing.assert_allclose(streamed[:55], full[:55], atol=1e-5)
    assert np.abs(streamed[56:] - full[56:]).max() > 1e-3


def test_snapkv_chunked_compresses_each_chunk_as_it_arrives(monkeypatch):
    """SnapKV(budget=40, chunked=True), chunks of 32: the cache holds the final capacity + one
    chunk while prefilling, for a 300- and a 900-token prompt alike; every row ends with its
    budget, the last window among it; the default (chunked=False) allocates the prompt's bucket
    and selects once. The segment rebuild refuses chunked=True."""
    params = jkv.load("demo")
    rng = np.random.default_rng(12)
    for n in (300, 900):
        prompt = rng.integers(3, params.config.vocab_size, n).tolist()
        for chunked, during in ((True, {64 + 16 + 32}), (False, {bucket(n)})):
            policy = jkv.SnapKV(budget=40, chunked=chunked)
            seen, state = _capacities_while_prefilling(monkeypatch, params, prompt, policy)
            assert set(seen) == during, (chunked, seen)
            kept = _kept_positions(state)[0]
            assert len(kept) == 40 and kept[-32:] == list(range(n - 32, n))
    with pytest.raises(ValueError, match="chunked=True: the segment rebuild runs once"):
        jkv.SnapKVSegments(budget=40, chunked=True)
