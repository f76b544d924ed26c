"""Fixtures of the engine's tests that compare it with kvpress on the same weights."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

import jkv

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))


@pytest.fixture(scope="module")
def demo_hf(tmp_path_factory):
    """(jkv params of a random demo-vocabulary Llama with a tokenizer, its HF model (sdpa))."""
    import quality
    import quality_kvpress as qk

    params, _ = quality.load_model("random")
    folder = jkv.export_hf(params, tmp_path_factory.mktemp("demo_hf") / "hf")
    model, _ = qk.load_hf(folder, attn_implementation="sdpa")
    return params, model
