"""The compression-quality harness runs end to end on a tiny setting."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))

import policy_specs  # noqa: E402
import quality  # noqa: E402


def test_harness_tiny_end_to_end(tmp_path):
    assert (
        quality.main(["--model", "random", "--tiny", "--contexts", "64", "--out", str(tmp_path)])
        == 0
    )
    res = json.loads((tmp_path / "quality_tiny.json").read_text())
    modes = {(r["method"], r["mode"]) for r in res["accuracy"]}
    assert ("full", "agnostic") in modes and ("streaming", "aware") in modes
    for row in res["accuracy"]:
        assert 0.0 <= row["accuracy"] <= 1.0 and row["kv_bytes_per_row"] > 0
    for row in res["free_text"]:
        assert 0.0 <= row["rouge_l"] <= 1.0 and row["ppl_ratio"] > 0
    assert (tmp_path / "quality_tiny.md").read_text().startswith("# Compression quality")
    assert (tmp_path / "quality_tiny.png").stat().st_size > 0
    beyond = res["beyond_context"]
    assert set(beyond["runs"]) == {"full", "streaming"} and beyond["tokens"] == 128
    for run in beyond["runs"].values():
        assert run["in_context_ppl"] > 1 and run["past_context_ppl"] > 1
    assert (tmp_path / "quality_tiny_streaming_ppl.png").stat().st_size > 0


def test_scores():
    assert quality.exact("4 0 9 1 7 </s>", "4 0 9 1 7")
    assert not quality.exact("4 0 9 1", "4 0 9 1 7")
    assert quality.rouge_l("a b c", "a b c") == 1.0 and quality.bleu("a b c d", "a b c d") > 0.99


def test_policy_specs_name_fields_and_their_kvpress_peer():
    import jkv

    spec = "snapkv:window=16,kernel=11,pool=max"
    assert policy_specs.policy_spec(spec) == ("snapkv", {"window": 16, "kernel": 11, "pool": "max"})
    assert policy_specs.policy_kw(spec, 0.1) == {
        "kv_policy": jkv.SnapKV(budget=0.1, window=16, kernel=11, pool="max")
    }
    assert policy_specs.policy_kw("h2o", 0.25) == {"kv_policy": "h2o", "kv_budget": 0.25}
    # Quantile's budget is 1 - q: with fields it is built from q, as resolve() builds it bare
    assert policy_specs.policy_kw("quantile:keep_norms=low", 0.25) == {
        "kv_policy": jkv.policies.Quantile(q=0.75, keep_norms="low")
    }
    assert policy_specs.policy_kw(None, 1.0) == {}
    # kvpress's SnapKV has the window and kernel (it pools by average only)
    assert policy_specs.kvpress_for(spec) == ("snapkv", {"window_size": 16, "kernel_size": 11})
    assert policy_specs.kvpress_for("adakv") == ("adakv", {})
    assert policy_specs.kvpress_for("kvzip:layerwise=true,max_factor=1.5") == (
        "kvzip", {"layerwise": True})  # fmt: skip
    assert policy_specs.policy_spec("kvzip:max_factor=1.5")[1] == {"max_factor": 1.5}
    assert policy_specs.kvpress_for("efficache") is None
    with pytest.raises(ValueError, match="'window' in 'snapkv:window' must be key=value"):
        policy_specs.policy_spec("snapkv:window")
