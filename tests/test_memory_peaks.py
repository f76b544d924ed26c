"""`jkv.memory`'s predicted peaks against XLA's own numbers.

For each setting the programs a request compiles are lowered with abstract shapes (nothing is
allocated) and compiled for this machine: the prefill step over the cache prefill holds, the
eviction after each chunk (policies that compress as the prompt streams in), the compression
after prefill, and the decode loop. XLA's peak of a program is `memory_analysis()`'s argument +
output - aliased + temporary bytes, weights excluded; prefill's is the largest of its programs'.
The model shape and settings here are not the ones the prediction's working-set terms were read
from (a 4- and a 12-layer model, 2,000 and 8,000 tokens, budgets of 25%)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

import jkv

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))

from long_context import nbytes, xla_peaks  # noqa: E402

from jkv_models.llama import param_shapes  # noqa: E402


@pytest.fixture(scope="module")
def cfg():  # 3 layers, 6 query heads over 2 kv heads, float32 weights
    return jkv.load("demo").config.replace(
        num_layers=3, hidden_size=192, num_heads=6, num_kv_heads=2, intermediate_size=640
    )


@pytest.mark.parametrize(
    "policy, dtype, seq_len, batch, chunk",
    [
        (None, "bfloat16", 12000, 1, 512),
        (jkv.SnapKV(budget=0.1), "float8_e4m3fn", 6000, 2, 512),
        (jkv.StreamingLLM(budget=0.2), "bfloat16", 6000, 1, 256),
        (jkv.H2O(budget=0.3), "float32", 3000, 3, 512),
        (jkv.PyramidKV(budget=0.2), "float32", 5000, 1, 512),
        (jkv.KVzip(budget=0.25), "float32", 3000, 2, 512),
    ],
    ids=["full-bf16-12K", "snapkv10-fp8-6K-b2", "streaming20-bf16-6K-c256", "h2o30-f32-3K-b3",
         "pyramid20-f32-5K", "kvzip25-f32-3K-b2"],
)  # fmt: skip
def test_predicted_peaks_are_within_10_percent_of_xla(cfg, policy, dtype, seq_len, batch, chunk):
    got = jkv.memory(cfg, batch, seq_len, kv_dtype=dtype, kv_policy=policy, chunk=chunk)
    prefill, decode_peak = xla_peaks(cfg, batch, seq_len, 64, dtype, policy, chunk)
    print(f"prefill {got.prefill_peak / prefill:.3f}, decode {got.decode_peak / decode_peak:.3f}")
    assert got.prefill_peak == pytest.approx(prefill, rel=0.10)
    if dtype == "float32":
        assert got.decode_peak == pytest.approx(decode_peak, rel=0.10)
    else:  # XLA:CPU's copy of the cache around a decode step's scatter: counted whole, an
        assert decode_peak <= got.decode_peak <= 1.3 * decode_peak  # upper bound
    assert got.prefill_peak > got.total and got.weights == nbytes(param_shapes(cfg))


def test_the_peaks_follow_the_budget_not_the_prompt():
    """StreamingLLM at a fixed budget: prefill streams the prompt through budget + one chunk, so
    the predicted peaks do not grow with the prompt; the full cache's grow linearly."""
    ring = [jkv.memory("llama-3.1-8b", 1, n, kv_policy="streaming", kv_budget=4096)
            for n in (16384, 131072)]  # fmt: skip
    assert ring[0].prefill_peak == ring[1].prefill_peak
    assert ring[0].decode_peak == ring[1].decode_peak
    full = [jkv.memory("llama-3.1-8b", 1, n) for n in (16384, 131072)]
    grown = full[1].prefill_peak - full[0].prefill_peak
    assert 1.0 <= grown / (full[1].total - full[0].total) < 1.2  # the cache, and a bit
