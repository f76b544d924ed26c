"""The bundled demo model: loads offline, answers fixed haystack prompts, exports to HF with the
same logits, and `make demo` (`python -m jkv.demo`) runs end to end."""

from __future__ import annotations

import numpy as np
import pytest

import jkv
from jkv.checkpoints import DEMO_DIR
from jkv.demo.__main__ import main as demo_main
from jkv.demo.haystack import make_example


@pytest.fixture(scope="module")
def demo():
    return jkv.load("demo")


def test_bundled_files_are_small():
    size = sum(p.stat().st_size for p in DEMO_DIR.rglob("*") if p.is_file())
    assert size <= 20 * 2**20, size
    for name in ("config.json", "model.safetensors", "tokenizer.json"):
        assert (DEMO_DIR / name).is_file()


@pytest.mark.parametrize("facts", [1, 8])
def test_answers_fixed_prompts(demo, facts):
    """Greedy answers to held-out haystacks at the trained context (seeded): one needle, and
    eight facts of which the question names one."""
    ctx = demo.config.max_position_embeddings
    assert ctx == 512
    rng = np.random.default_rng(12345)
    examples = [make_example(rng, ctx, facts) for _ in range(4)]
    out = jkv.generate(demo, [e.prompt for e in examples], max_new_tokens=6)
    for ex, r in zip(examples, out, strict=True):
        assert r.text.split()[:5] == ex.answer.split(), (ex.answer, r.text)
        assert r.finish_reason == "stop"


def test_export_round_trip(demo, tmp_path):
    import torch
    from transformers import AutoTokenizer, LlamaForCausalLM

    folder = jkv.export_hf(demo, tmp_path / "hf")
    model = LlamaForCausalLM.from_pretrained(folder, torch_dtype=torch.float32).eval()
    tok = AutoTokenizer.from_pretrained(folder)
    text = make_example(np.random.default_rng(1), 96, 2).prompt
    ids = tok(text)["input_ids"]
    assert ids == demo.tokenizer.encode(text)
    with torch.no_grad():
        want = model(torch.tensor([ids])).logits.numpy()
    got = np.asarray(jkv.logits(demo, [ids]))
    np.testing.assert_allclose(got, want, atol=2e-4, rtol=1e-4)
    again = jkv.load(folder)
    np.testing.assert_array_equal(np.asarray(jkv.logits(again, [ids])), got)


def test_make_demo_runs(capsys):
    """`make demo` runs, and what it shows holds: the full cache, StreamingLLM and SnapKV at the
    demo's budget (with and without FP8) and at the harsh one, each row marked right or wrong
    against the haystack's own answer."""
    assert demo_main([]) == 0
    out = capsys.readouterr().out
    assert "response cache" in out
    rows = {}  # label (30 columns), answer (12), right
    for line in out.splitlines():
        cells = line[44:].split()
        if cells and cells[0] in ("yes", "no"):
            rows[line[:30].strip()] = cells[0]
    assert rows["full cache"] == "yes" and rows["SnapKV 10%"] == "yes", rows
    assert rows["SnapKV 10% + FP8"] == "yes", rows
    assert set(rows) >= {"StreamingLLM 10%", "SnapKV 10%, paper's settings", "SnapKV 5% (harsh)"}


def test_cli_knows_demo(capsys):
    from jkv.cli import main

    assert main(["info", "demo"]) == 0
    assert "LlamaForCausalLM" in capsys.readouterr().out
