"""KVzip: the replay's slot scores against kvpress's `KVzipPress` on the same weights, the
selection against numpy, and the policy through `jkv.prefill` / `jkv.generate`."""

from __future__ import annotations

import math
import sys
from pathlib import Path

import jax.numpy as jnp
import numpy as np
import pytest

import jkv
from jkv import kv as kvlib
from jkv.kv import fine_bucket
from jkv.policies import KVzip
from jkv.policies.base import Context
from jkv.prefill import empty_state, prefill_chunked
from jkv.replay import chat_frame, replay, requests

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))


def replayed(params, prompts, policy):
    """The prefilled state of `prompts` with KVzip's replay scores (before any selection)."""
    lengths = [len(p) for p in prompts]
    kv = empty_state(params.config, len(prompts), kvlib.bucket(max(lengths)), "float32",
                     policy=policy.jit_key(), limit=policy.row_limits(lengths))  # fmt: skip
    _, kv = prefill_chunked(params, prompts, kv, backend="xla", policy=policy.jit_key(),
                            chunk=kvlib.bucket(max(lengths)))  # fmt: skip
    return replay(params, prompts, kv, policy, "xla")


@pytest.fixture(scope="module")
def demo_hf(tmp_path_factory):
    """(jkv params of a random demo-vocabulary Llama, its HF model, its HF tokenizer)."""
    import quality
    import quality_kvpress as qk

    params, _ = quality.load_model("random")
    folder = jkv.export_hf(params, tmp_path_factory.mktemp("kvzip") / "hf")
    model, tok = qk.load_hf(folder, attn_implementation="sdpa")
    return params, model, tok


def test_replay_scores_equal_kvpress(demo_hf):
    """kvpress's KVzipPress replays the same request over the same weights (no chat template:
    the request is "Repeat the previous context exactly." + "\\n" + the context); its per-slot
    scores before selection equal jkv's to float32 rounding, in every layer and kv head."""
    import kvpress
    import torch
    from transformers import DynamicCache

    params, model, tok = demo_hf
    text = " ".join(["the code for alice is 4 1 7 2 9 .", "bob has a red ball ."] * 6)
    ids = params.tokenizer.encode(text)
    got_kvpress = []

    class Capture(kvpress.KVzipPress):
        def compress_post(self, model):
            got_kvpress.append(self.score_val[:, 0].float().numpy().copy())  # [L, K, n]
            super().compress_post(model)

    press = Capture(compression_ratio=0.5)
    with torch.no_grad(), press(model):
        model(input_ids=torch.tensor([ids]), past_key_values=DynamicCache())
    kvp = got_kvpress[0]
    policy = KVzip(budget=0.5)
    state = replayed(params, [ids], policy)
    ours = np.stack([np.asarray(x.scores[0, :, : len(ids)]) for x in state.layers])
    assert ours.shape == kvp.shape
    assert kvp.max() - kvp.min() > 1e-3  # slots differ (a random model attends broadly)
    np.testing.assert_allclose(ours, kvp, atol=1e-7, rtol=1e-4)


def test_replay_scores_equal_kvpress_on_a_chat_in_pieces(tmp_path):
    """A chat model (a tiny GGUF with ChatML): the chat's prefix is not replayed and scores 0,
    the context is replayed in pieces of 32 tokens, each pass's softmax over its piece, the
    sinks and itself; every slot past the sinks scores what kvpress's KVzipPress gives it."""
    import kvpress
    import torch
    from tiny_gguf import tiny_chat_case
    from transformers import DynamicCache

    params, model, prefix, ids = tiny_chat_case(tmp_path)
    body = ids[len(prefix) :]
    assert len(prefix) > 2 and 64 < len(body) <= 128  # several pieces
    got = []

    class Capture(kvpress.KVzipPress):
        def compress_post(self, model):
            got.append(self.score_val[:, 0].float().numpy().copy())
            super().compress_post(model)

    with torch.no_grad(), Capture(compression_ratio=0.5, chunk_size=32, n_sink=2)(model):
        model(input_ids=torch.tensor([ids]), past_key_values=DynamicCache())
    state = replayed(params, [ids], KVzip(budget=0.5, chunk=32, sink=2))
    ours = np.stack([np.asarray(x.scores[0, :, : len(ids)]) for x in state.layers])
    assert (ours[:, :, 2 : len(prefix)] == 0).all() and (ours[:, :, len(prefix) :] > 0).all()
    np.testing.assert_allclose(ours[:, :, 2:], got[0][:, :, 2:], atol=1e-7, rtol=1e-4)


def test_the_request_follows_the_chat_template():
    """A chat model's replay request: the repeat instruction, the template's turn change, then
    the context without the chat's own prefix; long contexts in pieces naming the 8 tokens
    before them."""
    if not _smollm2():
        pytest.skip("SmolLM2 is not installed (make installs it)")
    params = jkv.load("smollm2")
    tok = params.tokenizer

    def text(ids):
        return tok.decode(ids, skip_special_tokens=False)

    prefix, suffix = chat_frame(params)
    assert text(prefix).endswith("<|im_start|>user\n")
    assert text(suffix) == "<|im_end|>\n<|im_start|>assistant\n"
    body = tok.encode(" The quick brown fox jumps over the lazy dog." * 40,
                      add_special_tokens=False)  # fmt: skip
    n = len(prefix)
    passes = requests(params, prefix + body, chunk=128)
    assert len(passes) == math.ceil(len(body) / 128)
    assert [(lo, hi) for _, lo, hi in passes[:2]] == [(n, n + 128), (n + 128, n + 256)]
    first, second = passes[0][0], passes[1][0]
    assert text(first).startswith("\n\nRepeat the previous context exactly.<|im_end|>")
    assert first[-128:] == body[:128] and second[-128:] == body[128:256]
    ask = tok.encode("\n\nRepeat the part of the previous context exactly, starting with",
                     add_special_tokens=False)  # fmt: skip
    assert second[: len(ask) + 8] == ask + body[120:128]
    # A prompt that does not start with the chat's prefix is replayed whole.
    assert requests(params, body[:50], chunk=128) == [(passes[0][0][:-128] + body[:50], 0, 50)]


def _smollm2() -> bool:
    from jkv.checkpoints import smollm2_installed

    return smollm2_installed()


def np_kvzip(scores, lengths, positions, budget, sink, cap, layerwise):
    """numpy: sinks forced, each head's best `cap` candidates, then the best budget * heads
    entries of the row (or of each layer), ties to the lower (layer, head, slot)."""
    nl, kh, s = scores.shape
    keep = np.zeros(scores.shape, bool)
    entries = []
    for layer in range(nl):
        for head in range(kh):
            n = lengths[layer, head]
            sc = [math.inf if positions[layer, head, j] < sink else scores[layer, head, j]
                  for j in range(n)]  # fmt: skip
            best = sorted(range(n), key=lambda j: (-sc[j], j))[:cap]
            entries += [(-sc[j], layer, head, j) for j in best]
    groups = [entries] if not layerwise else [[e for e in entries if e[1] == i] for i in range(nl)]
    for group in groups:
        want = budget * kh * (nl if not layerwise else 1)
        for _, layer, head, j in sorted(group)[:want]:
            keep[layer, head, j] = True
    return keep


@pytest.mark.parametrize("layerwise", [False, True], ids=["global", "layerwise"])
@pytest.mark.parametrize("budget", [5, 0.3])
def test_selection_equals_numpy(rng, layerwise, budget):
    from policy_refs import random_layer

    nl, b = 3, 2
    layers = [random_layer(rng, b=b, kh=2, s=24) for _ in range(nl)]
    n = layers[0].lengths[:, 0]
    layers = [x.replace(lengths=layers[0].lengths) for x in layers]  # one prompt per row
    policy = KVzip(budget=budget, sink=2, layerwise=layerwise, max_factor=1.5)
    budgets = jnp.asarray(policy.row_budgets(np.asarray(n).tolist()))
    ctx = Context(prompt_lengths=n, budgets=budgets, now=n - 1, num_layers=nl,
                  layers=tuple(layers))  # fmt: skip
    got = np.stack([np.asarray(policy.keep(i, layers[i], ctx)) for i in range(nl)], axis=1)
    scores = np.stack([np.asarray(x.scores) for x in layers], axis=1)
    lengths = np.stack([np.asarray(x.lengths) for x in layers], axis=1)
    positions = np.stack([np.asarray(x.positions) for x in layers], axis=1)
    for row in range(b):
        bud = int(budgets[row])
        cap = min(math.ceil(1.5 * bud), int(n[row]))
        want = np_kvzip(scores[row], lengths[row], positions[row], bud, 2, cap, layerwise)
        np.testing.assert_array_equal(got[row], want)
        assert got[row].sum() <= bud * nl * 2
        assert got[row][:, :, :2].all()  # the sinks


def test_prefill_keeps_what_the_replay_ranks_highest(tiny_params):
    """Through `jkv.prefill`: each row keeps at most budget x layers x kv heads slots, sinks
    included, no head past its capacity, and a batch row keeps what it keeps alone."""
    params = tiny_params("llama")
    rng = np.random.default_rng(3)
    prompts = [rng.integers(3, params.config.vocab_size, size=n).tolist() for n in (40, 70)]
    policy = KVzip(budget=0.25, sink=3, max_factor=2.0)
    state = jkv.prefill(params, prompts, kv_policy=policy)
    cfg = params.config
    for row, p in enumerate(prompts):
        budget = math.ceil(0.25 * len(p))
        held = np.stack([np.asarray(x.lengths[row]) for x in state.layers])  # [L, K]
        assert held.sum() <= budget * cfg.num_layers * cfg.num_kv_heads
        assert held.sum() >= budget * cfg.num_layers * cfg.num_kv_heads - cfg.num_kv_heads
        assert held.max() <= math.ceil(policy.max_factor * budget)
        for x in state.layers:
            for head in range(cfg.num_kv_heads):
                pos = np.asarray(x.positions[row, head, : int(x.lengths[row, head])])
                assert set(range(3)) <= set(pos.tolist())
        alone = jkv.prefill(params, p, kv_policy=policy)
        for x, y in zip(state.layers, alone.layers, strict=True):
            n = np.asarray(x.lengths[row])
            np.testing.assert_array_equal(n, np.asarray(y.lengths[0]))
            for head in range(cfg.num_kv_heads):
                np.testing.assert_array_equal(np.asarray(x.positions[row, head, : n[head]]),
                                              np.asarray(y.positions[0, head, : n[head]]))  # fmt: skip


def test_generate_runs_kvzip_and_names_it(tiny_params):
    params = tiny_params("llama")
    out = jkv.generate(params, list(range(3, 60)), max_new_tokens=4, kv_policy="kvzip",
                       kv_budget=0.5)  # fmt: skip
    assert len(out.tokens) == 4 and out.stats["kv_policy"]["name"] == "kvzip"


def test_fine_bucket():
    assert [fine_bucket(n) for n in (1, 128, 129, 1100, 2049, 5000)] == [
        128, 128, 256, 1280, 2560, 5120]  # fmt: skip


@pytest.mark.parametrize(
    "kw, match",
    [
        (dict(max_factor=0.5), "max_factor=0.5 must be None or a number >= 1"),
        (dict(layerwise="yes"), "layerwise='yes' must be True or False"),
        (dict(chunk=8), "chunk=8 must be an integer >= 16"),
        (dict(sink=-1), "sink=-1 must be an integer >= 0"),
    ],
)
def test_bad_settings(kw, match):
    with pytest.raises(ValueError, match=match):
        KVzip(budget=0.5, **kw)
