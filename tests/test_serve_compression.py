"""benchmarks/serve_compression.py end to end on a tiny GGUF chat model: both views for the full
cache, SnapKV, StreamingLLM and KVzip; what each row says is checked against the run's own
bounds (every row decoding in the timed steps, nothing compiled while timing, every request
answered, a full-cache pool of `fit` requests never holding more). The tiny model is random:
its accuracy is not checked."""

from __future__ import annotations

import json
import sys
from pathlib import Path

from tiny_gguf import BPE_VOCAB, write_tiny_gguf
from tiny_hf import write_tiny_checkpoint

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))

import pytest  # noqa: E402
import serve_compression  # noqa: E402

# the default configurations less kvpress's SnapKV (the tuned one runs the same code)
POLICIES = [p for p in serve_compression.DEFAULT if p != "SnapKV"]


@pytest.mark.slow  # 100 s: two engines warmed up for four policies
def test_serve_compression_tiny_run(tmp_path):
    src = write_tiny_checkpoint(tmp_path / "src", "llama", vocab_size=BPE_VOCAB,
                                max_position_embeddings=2048)  # fmt: skip
    model = write_tiny_gguf(tmp_path / "m.gguf", src, "llama")
    out = tmp_path / "out"
    assert serve_compression.main([
        "--model", str(model), "--requests", "4", "--tokens", "100", "--fit", "3",
        "--decode-steps", "2", "--new-tokens", "3", "--token-budget", "64",
        "--out", str(out), "--profile", str(tmp_path / "traces"), "--floor",
        "--policies", *POLICIES,
    ]) == 0  # fmt: skip
    report = json.loads((out / "serve_compression.json").read_text())
    rows = {(r["view"], r["config"]): r for r in report["rows"]}
    assert len(rows) == 2 * len(POLICIES), sorted(rows)
    for name in POLICIES:
        batch, memory = rows["same batch", name], rows["same memory", name]
        assert batch["rows"] == 4 and batch["built"] == 0, batch
        assert memory["built"] == 0 and memory["correct"].endswith("/4"), memory
        assert Path(batch["profile"]["trace"]).is_file(), batch["profile"]
        assert 0 < batch["profile"]["xla_busy_ms"] and batch["profile"]["top"], batch["profile"]
        if name != "full":  # a 25% budget: each head's mean kept is a quarter of a prompt
            assert batch["held_mean"] * 3 < rows["same batch", "full"]["held_mean"], batch
    floor = report["prefill_floor"]  # the prompts alone: a shorter run than any configuration's
    assert 0 < floor["seconds"] and floor["ceiling_x_tokens_per_s"] > 0, floor
    full = rows["same memory", "full"]
    assert full["peak_requests"] <= 3, full  # the pool holds `fit` full requests
