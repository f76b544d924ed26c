"""`jkv.prefill`'s context as a portable value (`jkv.KVContext`): its bytes hold what its rows
hold and nothing of the capacity's padding (counted here from the lengths alone, with numpy),
they round-trip to the same answers, and a context from other weights, another schema or cut
short is refused with a clear error."""

from __future__ import annotations

import jax
import numpy as np
import pytest

import jkv
from jkv.kv_context import MAGIC, KVContext


def _ids(params, n, seed):
    rng = np.random.default_rng(seed)
    return rng.integers(3, params.config.vocab_size, size=n).tolist()


@pytest.fixture(scope="module")
def params(tiny_params):
    return tiny_params("llama")


def _held_bytes(ctx: KVContext) -> int:
    """What the rows hold, from each (row, layer, kv head)'s length: K and V, fp8 scales, the
    position and any score or bias of each held slot, plus the counters and low-rank factors."""
    state = ctx.state
    total = 2 * state.batch_size * 4  # next_position, limit: int32 per row
    for layer in state.layers:
        n = int(np.asarray(layer.lengths).sum())
        h = layer.k.shape[3]
        per_slot = 2 * h * np.dtype(layer.k.dtype).itemsize + 4  # K, V, position
        per_slot += 0 if layer.k_scale is None else 2 * 2  # bfloat16 scales of K and V
        per_slot += 0 if layer.scores is None else 4
        per_slot += 0 if layer.bias is None else 4
        total += n * per_slot + np.asarray(layer.lengths).nbytes
        if layer.lowrank is not None:  # the segment rebuild's factors: written whole
            total += sum(np.asarray(x).nbytes for x in jax.tree.leaves(layer.lowrank))
    return total


@pytest.mark.parametrize(
    "settings",
    [
        dict(),
        dict(kv_policy="snapkv", kv_budget=0.25, kv_dtype="float8_e4m3fn"),
        dict(kv_policy="h2o", kv_budget=12),
        dict(kv_policy="adakv", kv_budget=0.25),
        dict(kv_policy="snapkv_segments", kv_budget=0.5),
    ],
    ids=["full", "snapkv-fp8", "h2o", "adakv", "segments"],
)
def test_context_round_trips_through_bytes_to_the_same_answers(params, settings):
    contexts = [_ids(params, 70, seed=1), _ids(params, 45, seed=2)]
    ctx = jkv.prefill(params, contexts, **settings)
    assert ctx.tokens == tuple(map(tuple, contexts)) and ctx.weights == params.version
    data = ctx.to_bytes()
    assert ctx.nbytes == _held_bytes(ctx)
    assert 0 < len(data) - ctx.nbytes < 4096 + 4 * sum(map(len, contexts))  # the header
    back = KVContext.from_bytes(data)
    assert back.policy == ctx.policy and back.dtype == ctx.dtype and back.tokens == ctx.tokens
    for a, b in zip(ctx.layers, back.layers, strict=True):
        assert a.capacity == b.capacity  # the same compiled shapes
        lengths = np.asarray(a.lengths)
        np.testing.assert_array_equal(lengths, np.asarray(b.lengths))
        held = np.arange(a.capacity) < lengths[..., None]
        for name in ("k", "v", "positions", "k_scale", "scores", "bias"):
            x, y = getattr(a, name), getattr(b, name)
            assert (x is None) == (y is None), name
            if x is not None:
                x, y = np.asarray(x, np.float32), np.asarray(y, np.float32)
                np.testing.assert_array_equal(x[held], y[held], err_msg=name)
    questions = [_ids(params, 6, seed=3), _ids(params, 9, seed=4)]
    want = jkv.generate(params, questions, kv_state=ctx, max_new_tokens=6)
    got = jkv.generate(params, questions, kv_state=back, max_new_tokens=6)
    assert [r.tokens for r in got] == [r.tokens for r in want]


def test_a_compressed_context_is_small(params):
    context = _ids(params, 200, seed=5)
    full = jkv.prefill(params, context)
    quarter = jkv.prefill(params, context, kv_policy="snapkv", kv_budget=0.25)
    assert quarter.nbytes < 0.3 * full.nbytes, (quarter.nbytes, full.nbytes)
    assert len(quarter.to_bytes()) < 0.3 * len(full.to_bytes())


def test_a_context_from_other_weights_or_bytes_is_refused(params, tiny_params):
    ctx = jkv.prefill(params, _ids(params, 20, seed=6))
    other = tiny_params("llama", seed=1)  # same shape, other weights
    assert other.version != params.version
    with pytest.raises(ValueError, match="computed by other weights"):
        jkv.generate(other, [5, 6], kv_state=ctx, max_new_tokens=2)
    with pytest.raises(ValueError, match="kv_dtype='bfloat16' differs"):
        jkv.generate(params, [5, 6], kv_state=ctx, max_new_tokens=2, kv_dtype="bfloat16")
    data = ctx.to_bytes()
    with pytest.raises(ValueError, match="not a jkv KV context"):
        KVContext.from_bytes(b"x" + data)
    with pytest.raises(ValueError, match="cut short"):
        KVContext.from_bytes(data[:-1])
    with pytest.raises(ValueError, match="bytes past its last array"):
        KVContext.from_bytes(data + b"\0")
    head = len(MAGIC) + 8
    schema2 = data.replace(b"\xa6schema\x01", b"\xa6schema\x02", 1)
    assert schema2 != data and schema2[:head] == data[:head]
    with pytest.raises(ValueError, match="schema 2; this jkv reads schema 1"):
        KVContext.from_bytes(schema2)
