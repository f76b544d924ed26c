"""kvpress peer runner: same prompt tokens and same greedy output as jkv, every press runs."""

from __future__ import annotations

import math
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))

import quality  # noqa: E402
import quality_kvpress as qk  # noqa: E402


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """(jkv params, HF model, HF tokenizer) of one random demo-vocabulary Llama."""
    import jkv

    params, _ = quality.load_model("random")
    folder = jkv.export_hf(params, tmp_path_factory.mktemp("kvpress") / "hf")
    model, tok = qk.load_hf(folder)
    return params, model, tok


@pytest.fixture(scope="module")
def tiny_sdpa(tiny, tmp_path_factory):
    """The same model with sdpa attention (the masking presses refuse eager)."""
    import jkv

    params, _, _ = tiny
    folder = jkv.export_hf(params, tmp_path_factory.mktemp("kvpress-sdpa") / "hf")
    model, tok = qk.load_hf(folder, attn_implementation="sdpa")
    return params, model, tok


@pytest.fixture(scope="module")
def examples():
    return qk.haystack_examples(seed=0, n=2, context=120, facts=2)


def test_examples_split_at_the_last_question(examples):
    for context, question, answer in examples:
        assert question.startswith("Question : what is the code for ")
        name = question.split()[7]  # ... the code for <name> ? The code for <name>
        assert question.endswith(f"{name} ? The code for {name}") and "Question" not in context
        assert len(answer.split()) == 5


@pytest.mark.parametrize("mode", qk.MODES)
def test_kvpress_sees_jkv_tokens(tiny, examples, mode):
    params, model, tok = tiny
    context, question, _ = examples[0]
    text = context + " " + question
    if mode == "aware":
        context, question = text, ""
    c_ids, q_ids = qk.prompt_ids(model, tok, context, question)
    got = c_ids[0].tolist() + q_ids[0].tolist()
    assert got == params.tokenizer.encode(text)
    assert got[0] == 1 and got.count(1) == 1  # one <s>, no chat template, no "\n" token
    assert q_ids.shape[1] == (0 if mode == "aware" else len(question.split()))


def test_full_cache_greedy_equals_jkv(tiny, examples):
    import jkv

    params, model, tok = tiny
    context, question, _ = examples[0]
    text = context + " " + question
    want = jkv.generate(params, text, max_new_tokens=8).tokens
    assert len(set(want)) > 1  # a varied continuation, so the comparison means something
    for ctx, q in ((text, ""), (context, question)):  # aware and agnostic feeding, no press
        c_ids, q_ids = qk.prompt_ids(model, tok, ctx, q)
        got, kept = qk.generate_ids(model, c_ids, q_ids, None, 8)
        assert got == want
        assert kept == [c_ids.shape[1]] * params.config.num_layers


@pytest.mark.parametrize("name", ["snapkv", "streaming"])
def test_driver_matches_kvpress_pipeline(tiny, examples, name):
    _, model, tok = tiny
    context, question, _ = examples[1]
    c_ids, q_ids = qk.prompt_ids(model, tok, context, question)
    ids, _ = qk.generate_ids(model, c_ids, q_ids, qk.press_for(name, 0.5, c_ids.shape[1]), 8)
    pipe = qk._pipeline(model, tok)
    press = qk.press_for(name, 0.5, c_ids.shape[1])
    answer = pipe(context, question=question, press=press, max_new_tokens=8)["answer"]
    assert tok.decode(ids, skip_special_tokens=True) == answer


@pytest.mark.parametrize("name", sorted(qk.PRESSES))
def test_every_press_runs(tiny, tiny_sdpa, examples, name):
    _, model, tok = tiny_sdpa if qk.ATTENTION.get(name) == "sdpa" else tiny
    for mode in qk.MODES:
        row = qk.accuracy(model, tok, examples, name, 0.5, mode=mode)
        assert "error" not in row, row
        assert row["peer"] == "kvpress" and row["method"] == name and row["mode"] == mode
        assert row["n"] == 2 and 0.0 <= row["accuracy"] <= 1.0 and row["seconds"] > 0
        # jkv's budget: ceil(0.5 * n) of the compressed text, in every layer on average
        n = len(tok.encode(examples[0][0] + (" " + examples[0][1] if mode == "aware" else "")))
        assert row["kept"] == pytest.approx(math.ceil(0.5 * n) / n, abs=0.01)


def test_pyramidkv_layer_budgets_get_their_own_masks(tiny):
    """At 50% kept kvpress's PyramidKV gives layers different lengths; a question fed as one
    block must then match the same question fed token by token (1-query masks)."""
    import torch
    from transformers import DynamicCache

    _, model, tok = tiny
    context, question, _ = qk.haystack_examples(seed=2, n=1, context=300, facts=2)[0]
    c_ids, q_ids = qk.prompt_ids(model, tok, context, question)
    n, q = c_ids.shape[1], q_ids.shape[1]
    last = []
    with torch.no_grad(), qk.layer_masks(model):
        for step in (q, 1):
            cache = DynamicCache()
            with qk.press_for("pyramidkv", 0.5, n)(model):
                model(input_ids=c_ids, past_key_values=cache)
            lengths = [cache.get_seq_length(i) for i in range(len(cache))]
            for i in range(0, q, step):
                pos = torch.arange(n + i, n + i + step).unsqueeze(0)
                out = model(
                    input_ids=q_ids[:, i : i + step], past_key_values=cache, position_ids=pos
                )
            last.append(out.logits[0, -1])
    assert lengths[0] > lengths[-1] and sum(lengths) == pytest.approx(len(lengths) * n / 2, abs=2)
    torch.testing.assert_close(last[0], last[1], rtol=1e-4, atol=1e-4)
    for mode in qk.MODES:
        row = qk.accuracy(
            model, tok, [(context, question, "0 0 0 0 0")], "pyramidkv", 0.5, mode=mode
        )
        assert "error" not in row and row["kept_per_layer"][0] > row["kept_per_layer"][-1]


def test_full_cache_row(tiny, examples):
    _, model, tok = tiny
    row = qk.accuracy(model, tok, examples, None, 1.0, mode="agnostic")
    assert row["method"] == "full" and row["kept"] == 1.0 and "error" not in row


def test_failing_press_gives_an_error_row(tiny):
    _, model, tok = tiny
    short = qk.haystack_examples(seed=1, n=1, context=40, facts=1)  # < SnapKV's 64-token window
    row = qk.accuracy(model, tok, short, "snapkv", 0.5, mode="agnostic")
    assert "window size" in row["error"] and math.isnan(row["accuracy"])
    row = qk.accuracy(
        model, tok, short, "snapkv", 0.5, mode="agnostic", overrides={"window_size": 8}
    )
    assert "error" not in row and row["overrides"] == {"window_size": 8}


def test_free_text_rows(tiny, examples):
    _, model, tok = tiny
    prompts = [c for c, _, _ in examples]
    full = qk.free_text(model, tok, prompts, None, 1.0, new_tokens=8)
    assert full["rouge_l"] == 1.0 and full["bleu"] == pytest.approx(1.0)
    texts, _, _ = qk.continuations(model, tok, prompts, None, 1.0, new_tokens=8)
    row = qk.free_text(model, tok, prompts, "knorm", 0.25, reference=texts, new_tokens=8)
    assert "error" not in row and row["method"] == "knorm" and row["n"] == 2
    assert 0.0 <= row["rouge_l"] <= 1.0 and 0.0 <= row["bleu"] <= 1.0
    assert qk.rouge_l("4 0 . 9", "4 0 . 9") == 1.0 and qk.rouge_l("a b", "c d") == 0.0


def test_settings_side_by_side():
    sbs = qk.side_by_side("snapkv")
    assert sbs["kvpress"]["press"] == "SnapKVPress" and sbs["jkv"]["policy"] == "SnapKV"
    assert qk.match_jkv("snapkv") == {
        "window_size": sbs["jkv"]["window"],
        "kernel_size": sbs["jkv"]["kernel"],
    }
    assert qk.match_jkv("streaming") == {"n_sink": 4} and qk.match_jkv("knorm") == {}


def test_bad_arguments_raise(tiny, examples):
    _, model, tok = tiny
    with pytest.raises(ValueError, match="mode="):
        qk.accuracy(model, tok, examples, "snapkv", 0.5, mode="both")
    with pytest.raises(ValueError, match="press_name='h2o'"):
        qk.accuracy(model, tok, examples, "h2o", 0.5, mode="aware")
    with pytest.raises(ValueError, match="ratio=0.0"):
        qk.free_text(model, tok, ["a b c"], "snapkv", 0.0)
    with pytest.raises(ValueError, match="len\\(reference\\)"):
        qk.free_text(model, tok, ["a b c"], "snapkv", 0.5, reference=[])
