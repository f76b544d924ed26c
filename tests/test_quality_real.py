"""The real-text quality harness (benchmarks/quality_real.py) end to end on a tiny GGUF model:
jkv and kvpress on the same needles and texts, the table's verdicts, the plot."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np
from tiny_gguf import BPE_VOCAB, write_tiny_gguf
from tiny_hf import write_tiny_checkpoint

import jkv
from jkv.demo.real_text import KEYS, answered, make_needle

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))

import quality_real  # noqa: E402


def test_harness_tiny_end_to_end(tmp_path):
    # the tiny tokenizer spends ~5 tokens a word: room for the chat around a 64-token haystack
    src = write_tiny_checkpoint(tmp_path / "src", "llama", vocab_size=BPE_VOCAB,
                                max_position_embeddings=1024)  # fmt: skip
    model = write_tiny_gguf(tmp_path / "m.gguf", src, "llama")
    out = tmp_path / "results"
    argv = ["--model", str(model), "--contexts", "64", "--tasks", "multikey", "--policies",
            "snapkv:window=8,kernel=3", "--ratios", "0.5", "--texts", "1", "--peer", "kvpress",
            "--out", str(out), "--stem", "quality_real_tiny"]  # fmt: skip
    assert quality_real.main(argv) == 0
    rows = json.loads((out / "quality_real_tiny.json").read_text())["rows"]
    cells = {(r["kind"], r["who"], r["policy"], r.get("mode")) for r in rows}
    for who in ("jkv", "kvpress"):
        assert ("needle", who, "full", "full") in cells
        for mode in ("agnostic", "aware"):
            assert ("needle", who, "snapkv:window=8,kernel=3", mode) in cells
        assert ("text", who, "snapkv:window=8,kernel=3", None) in cells
    for r in rows:
        if r["kind"] == "needle":
            assert r["n"] == quality_real.DEPTHS and 0 <= r["right"] <= r["n"]
        elif r["policy"] == "full":
            assert r["ppl_ratio"] == 1.0 and r["rouge_l"] == 1.0
    assert quality_real.main(["--table", "--out", str(out)]) == 0
    table = (out / "quality_real.md").read_text()
    assert "| multikey | 64 | snapkv:window=8,kernel=3 | 50% | agnostic |" in table
    assert (out / "quality_real.png").stat().st_size > 0


def test_needles_are_planted_where_asked_and_scored(tmp_path):
    src = write_tiny_checkpoint(tmp_path / "src", "llama", vocab_size=BPE_VOCAB)
    params = jkv.load(write_tiny_gguf(tmp_path / "m.gguf", src, "llama"))
    rng = np.random.default_rng(0)
    for depth in (0.0, 0.5, 1.0):
        n = make_needle(params, 300, depth, rng, keys=4)
        text = params.tokenizer.decode(n.context_ids, skip_special_tokens=False)
        needle = f"One of the special magic numbers for {n.key} is: {n.answer}."
        at = text.index(needle) / len(text)
        assert abs(at - depth) < 0.2, (depth, at)
        assert sum(f"magic numbers for {k} is:" in text for k in KEYS) == 4
        question = params.tokenizer.decode(n.question_ids, skip_special_tokens=False)
        assert question.endswith(
            f"The special magic number for {n.key} mentioned in the provided text is"
        )
    assert answered(" 43936.", "43936") and answered(" 4 3 9 3 6", "43936")
    assert not answered(" 43922.", "43936") and not answered("none", "43936")
