"""A policy reports its own extra bytes and statistics: jkv.memory and generate's stats ask the
policy (`extra_bytes`, `report`), so a new policy needs only its own file. Checked with a policy
defined here, which jkv has never seen."""

from __future__ import annotations

import dataclasses
from typing import ClassVar

import numpy as np

import jkv
from jkv.policies import SnapKV


@dataclasses.dataclass(frozen=True, kw_only=True)
class Labelled(SnapKV):
    """SnapKV that claims 1,000 extra bytes (and 7 of bookkeeping) per layer and reports its
    row count and the tokens appended after compression."""

    name: ClassVar[str] = "labelled"

    def extra_bytes(self, capacity, *, batch, num_kv_heads, head_dim, kv_dtype):
        return 1000, 7

    def report(self, state, appended):
        return {"labelled": {"rows": state.batch_size, "appended": np.asarray(appended).tolist()}}


def test_memory_counts_a_policys_extra_bytes():
    plain = jkv.memory("llama-3.2-1b", 1, seq_len=256, kv_policy=SnapKV(budget=64))
    extra = jkv.memory("llama-3.2-1b", 1, seq_len=256, kv_policy=Labelled(budget=64))
    layers = len(plain.per_layer)
    assert extra.total - plain.total == 1000 * layers
    assert extra.bookkeeping - plain.bookkeeping == 7 * layers
    assert extra.per_layer == tuple(x + 1000 for x in plain.per_layer)


def test_generate_stats_carry_the_policys_report():
    params = jkv.load("demo")
    out = jkv.generate(
        params, ["what is the code", "the code"], max_new_tokens=4, kv_policy=Labelled(budget=8)
    )
    for row in out:
        assert row.stats["labelled"]["rows"] == 2
        assert row.stats["labelled"]["appended"] == [len(r.tokens) - 1 for r in out]
    plain = jkv.generate(params, "what is the code", max_new_tokens=4, kv_policy=SnapKV(budget=8))
    assert "labelled" not in plain.stats and "kv_segments" not in plain.stats
