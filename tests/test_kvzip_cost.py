"""benchmarks/kvzip_cost.py end to end on a tiny GGUF model: each row's compression is KVzip's
prefill less the full one, both timed, and the JSON holds every run."""

from __future__ import annotations

import json
import sys
from pathlib import Path

from tiny_gguf import BPE_VOCAB, write_tiny_gguf
from tiny_hf import write_tiny_checkpoint

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))

import kvzip_cost  # noqa: E402


def test_kvzip_cost_tiny_run(tmp_path):
    src = write_tiny_checkpoint(tmp_path / "src", "llama", vocab_size=BPE_VOCAB,
                                max_position_embeddings=2048)  # fmt: skip
    model = write_tiny_gguf(tmp_path / "m.gguf", src, "llama")
    out = tmp_path / "out"
    argv = ["--model", str(model), "--tokens", "60,120", "--repeats", "2", "--out", str(out)]
    assert kvzip_cost.main(argv) == 0
    rows = json.loads((out / "kvzip_cost.json").read_text())["rows"]
    assert [r["tokens"] for r in rows] == [60, 120]
    for r in rows:
        assert len(r["runs"]["full"]) == len(r["runs"]["kvzip"]) == 2, r
        assert 0 < r["prefill_s"] and 0 < r["kvzip_s"], r
        assert abs(r["compression_s"] - (r["kvzip_s"] - r["prefill_s"])) < 2e-3, r
