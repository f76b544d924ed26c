"""Every policy in jkv.generate: ragged batches, bf16 and fp8 KV, XLA and Pallas (interpreted);
continuation from jkv.prefill; StreamingLLM past the trained context; bytes = jkv.memory."""

from __future__ import annotations

import importlib

import numpy as np
import pytest

import jkv
from jkv import kv as kvlib
from jkv.request import Request

gen = importlib.import_module("jkv.generate")
NAMES = [
    "streaming",
    "snapkv",
    "snapkv_segments",
    "h2o",
    "pyramidkv",
    "adakv",
    "efficache",
    "quantile",
]
BUDGET = {"quantile": 0.5}


def _prompts(params, lengths, seed=0):
    rng = np.random.default_rng(seed)
    return [rng.integers(3, params.config.vocab_size, size=n).tolist() for n in lengths]


@pytest.fixture(scope="module")
def params(tiny_params):
    return tiny_params("llama")


@pytest.mark.parametrize("kv_dtype", ["bfloat16", "float8_e4m3fn"])
@pytest.mark.parametrize("name", NAMES)
def test_policy_generates_on_ragged_batch(params, name, kv_dtype):
    prompts = _prompts(params, [40, 23, 31])
    budget = BUDGET.get(name, 16)
    out = jkv.generate(
        params, prompts, max_new_tokens=6, kv_policy=name, kv_budget=budget, kv_dtype=kv_dtype
    )
    full = jkv.generate(params, prompts, max_new_tokens=6, kv_dtype=kv_dtype)
    for row in out:
        assert len(row.tokens) == 6
        assert row.stats["kv_bytes_used"] <= row.kv_bytes < full[0].kv_bytes
        assert row.stats["kv_policy"]["name"] == name
    want = jkv.memory(
        params, 3, 40, max_new_tokens=6, kv_dtype=kv_dtype, kv_policy=name, kv_budget=budget
    )
    assert out[0].stats["batch_kv_bytes"] == want.total == sum(r.kv_bytes for r in out)
    assert out[0].stats["kv_capacity"] == list(want.slots)


def _live_kv_bytes(state) -> int:
    """K, V, fp8 scales, slot biases and low-rank factors, read off the arrays themselves."""
    total = 0
    for layer in state.layers:
        for x in (layer.k, layer.v, layer.k_scale, layer.v_scale, layer.bias):
            total += 0 if x is None else x.size * x.dtype.itemsize
        lr = layer.lowrank
        if lr is not None:
            total += sum(
                x.size * x.dtype.itemsize for x in (lr.coef_k, lr.basis_k, lr.coef_v, lr.basis_v)
            )
    return total


@pytest.mark.parametrize("kv_dtype", ["float32", "bfloat16", "float8_e4m3fn"])
@pytest.mark.parametrize("name", ["full", "streaming", "snapkv_segments", "h2o", "pyramidkv"])
def test_kv_bytes_are_the_live_arrays_and_memory_predicts_them(params, name, kv_dtype):
    """Same request settings (generate's defaults included), same bytes: no hand-picked
    arguments for jkv.memory."""
    prompts = _prompts(params, [37, 11, 25], seed=4)
    kw = dict(kv_dtype=kv_dtype, kv_policy=name)
    if name != "full":
        kw["kv_budget"] = 0.4
    req = Request.build(params, **kw)
    session = gen.Session(params, prompts, req)
    session.run()
    result = session.results()[0]
    assert result.stats["batch_kv_bytes"] == _live_kv_bytes(session.state.kv)
    assert result.kv_bytes * len(prompts) == result.stats["batch_kv_bytes"]
    predicted = jkv.memory(params, len(prompts), max(map(len, prompts)), **kw)
    assert predicted.total == result.stats["batch_kv_bytes"]
    assert list(predicted.slots) == result.stats["kv_capacity"]


# PyramidKV is SnapKV with per-layer budgets (data to the same kernels): SnapKV's case runs them
@pytest.mark.parametrize("name", [n for n in NAMES if n != "pyramidkv"])
def test_pallas_interpret_matches_xla(params, name):
    prompts = _prompts(params, [40, 23], seed=1)
    kw = dict(
        max_new_tokens=5, kv_policy=name, kv_budget=BUDGET.get(name, 16), kv_dtype="float8_e4m3fn"
    )
    xla = jkv.generate(params, prompts, backend="xla", **kw)
    pallas = jkv.generate(params, prompts, backend="pallas_interpret", **kw)
    for a, b in zip(xla, pallas, strict=True):
        assert a.tokens == b.tokens and a.kv_bytes == b.kv_bytes


@pytest.mark.parametrize("name", ["snapkv", "h2o"])
def test_ragged_rows_are_independent(params, name):
    prompts = _prompts(params, [40, 17, 29], seed=2)
    batch = jkv.generate(params, prompts, max_new_tokens=8, kv_policy=name, kv_budget=12)
    for prompt, row in zip(prompts, batch, strict=True):
        alone = jkv.generate(params, prompt, max_new_tokens=8, kv_policy=name, kv_budget=12)
        assert row.tokens == alone.tokens


def test_continuation_equals_one_prompt(params):
    context, question = _prompts(params, [30, 7], seed=3)
    state = jkv.prefill(params, context)
    cont = jkv.generate(params, question, max_new_tokens=8, kv_state=state)
    whole = jkv.generate(params, context + question, max_new_tokens=8)
    assert cont.tokens == whole.tokens


def test_compressed_context_serves_many_questions(params):
    context = _prompts(params, [60], seed=4)[0]
    state = jkv.prefill(params, context, kv_policy="snapkv", kv_budget=16)
    assert [x.capacity for x in state.layers] == [16, 16]
    q1, q2 = _prompts(params, [5, 9], seed=5)
    a = jkv.generate(params, q1, max_new_tokens=4, kv_state=state)
    b = jkv.generate(params, q2, max_new_tokens=4, kv_state=state)
    again = jkv.generate(params, q1, max_new_tokens=4, kv_state=state)
    assert a.tokens == again.tokens and len(b.tokens) == 4  # the state was not consumed
    assert int(state.layers[0].lengths[0, 0]) == 16


def test_streaming_past_trained_context_compiles_once_constant_bytes(tiny_params):
    params = tiny_params("llama", max_position_embeddings=64)
    steps = 4 * params.config.max_position_embeddings
    settings = dict(max_new_tokens=steps, backend="xla", kv_policy=jkv.StreamingLLM(budget=24))
    req = Request.build(params, **settings)
    session = gen.Session(params, [list(range(3, 13))], req)
    sizes = set()
    before = gen.decode._cache_size()
    while not session.finished:
        session.advance(1)
        sizes.add(kvlib.nbytes(session.state.kv))
    assert int(session.state.kv.next_position[0]) >= steps
    assert len(sizes) == 1  # constant memory
    assert gen.decode._cache_size() - before <= 1  # one compiled decode loop
    layer = session.state.kv.layers[0]
    pos = np.asarray(layer.positions[0, 0])[: int(layer.lengths[0, 0])]
    assert len(pos) == 24  # the budget, not the (bucketed) capacity
    assert sorted(pos)[:4] == [0, 1, 2, 3] and pos.max() == steps + 10 - 2  # sinks + window


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(kv_policy="lru"), r"kv_policy='lru' is unknown"),
        (dict(kv_budget=16), r"kv_budget=16 needs a compressing kv_policy"),
        (dict(kv_policy=jkv.SnapKV(budget=8), kv_budget=16), r"given beside a policy object"),
        (dict(kv_policy="snapkv", kv_budget=-3), r"budget=-3 must be in \[1, 2147483647\]"),
        (dict(kv_policy="quantile", kv_budget=3), r"quantile keeps a fraction"),
    ],
)
def test_bad_policy_arguments(params, kwargs, match):
    with pytest.raises(ValueError, match=match):
        jkv.generate(params, [5, 6, 7], **kwargs)


def test_kv_state_errors(params):
    state = jkv.prefill(params, [[5, 6, 7], [8, 9]])
    with pytest.raises(ValueError, match=r"kv_state holds 2 rows but 1 prompts were given"):
        jkv.generate(params, [5, 6], kv_state=state)
    with pytest.raises(ValueError, match=r"kv_policy given beside kv_state"):
        jkv.generate(params, [[5], [6]], kv_state=state, kv_policy="snapkv")
    with pytest.raises(ValueError, match=r"kv_state is a dict"):
        jkv.generate(params, [5], kv_state={})
