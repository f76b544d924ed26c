"""KVzip in jkv.Engine: its replay runs over the row's own pages after the prompt
(`jkv.engine.replay`); the slot scores equal kvpress's `KVzipPress` on the same weights (one
pass in two pieces of the engine's replay, and a chat replayed in several passes), the kept
counts per head equal numpy's ranking of kvpress's scores, and the tokens are the request's
alone, in a batch beside other requests, with warmup compiling everything first."""

from __future__ import annotations

import random

import numpy as np
import pytest

import jkv
from jkv.compile_time import programs_built
from jkv.engine.engine import Engine
from jkv.policies import KVzip, SnapKV


def kvpress_scores(model, ids, **press):
    """kvpress's KVzipPress slot scores `[L, K, n]` before its selection."""
    import kvpress
    import torch
    from transformers import DynamicCache

    got = []

    class Capture(kvpress.KVzipPress):
        def compress_post(self, model):
            got.append(self.score_val[:, 0].float().numpy().copy())
            super().compress_post(model)

    with torch.no_grad(), Capture(compression_ratio=0.5, **press)(model):
        model(input_ids=torch.tensor([ids]), past_key_values=DynamicCache())
    return got[0]


class Recording(Engine):
    """Keeps what the replay scored and what each head kept; replays in pieces of 64 tokens."""

    replay_chunk = 64

    def __init__(self, *args, **kw):
        super().__init__(*args, **kw)
        self.scores, self.kept = {}, {}

    def _replay(self, ending):
        best = super()._replay(ending)
        for i, r in enumerate(ending):
            self.scores[r.seq.request_id] = np.asarray(best[i])
        return best

    def _compress(self, seq, src, row, counts, ring=None):
        self.kept[seq.request_id] = list(counts)
        return super()._compress(seq, src, row, counts, ring)


def top_counts(scores, budget: int, sink: int) -> list[int]:
    """numpy: slots kept per (layer, kv head) when every slot of every head is ranked together
    (the `sink` first always), `budget` per head on average (KVzip's default selection)."""
    s = scores.astype(np.float64).copy()
    s[:, :, :sink] = np.inf
    flat = s.reshape(-1)
    order = np.argsort(-flat, kind="stable")[: budget * s.shape[0] * s.shape[1]]
    kept = np.zeros(flat.shape, bool)
    kept[order] = True
    return kept.reshape(s.shape).sum(-1).reshape(-1).tolist()


def test_the_engines_replay_scores_and_selection_equal_kvpress(demo_hf):
    """A context longer than a replay piece (`Engine.replay_chunk`): the engine's slot scores equal
    kvpress's to float32 rounding in every layer and kv head, each head keeps what numpy's
    ranking of kvpress's scores keeps, and the tokens are generate's alone."""
    params, model = demo_hf
    text = " ".join(["the code for alice is 4 1 7 2 9 .", "bob has a red ball ."] * 6)
    ids = params.tokenizer.encode(text)
    assert len(ids) > Recording.replay_chunk  # two pieces
    want = kvpress_scores(model, ids)
    engine = Recording(params, num_pages=1200, page_size=8, token_budget=128, chunk=64,
                       kv_dtype="float32")  # fmt: skip
    policy = KVzip(budget=0.25)
    [got] = engine.generate([ids], kv_policy=policy, max_new_tokens=6)
    ours = engine.scores["req-0"][:, :, : len(ids)]
    assert want.max() - want.min() > 1e-3
    np.testing.assert_allclose(ours, want, atol=1e-7, rtol=1e-4)
    assert engine.kept["req-0"] == top_counts(want, policy.budget_tokens(len(ids)), policy.sink)
    assert got == list(jkv.generate(params, ids, kv_policy=policy, max_new_tokens=6,
                                    kv_dtype="float32").tokens)  # fmt: skip
    assert engine.pool.used_pages == 0


def test_a_chat_replayed_in_several_passes_scores_as_kvpress(tmp_path):
    """A chat model (a tiny GGUF with ChatML), the context in pieces of 32 tokens: the chat's
    prefix is not replayed (scores 0), every slot past the sinks scores what kvpress gives."""
    from tiny_gguf import tiny_chat_case

    params, model, prefix, ids = tiny_chat_case(tmp_path)
    want = kvpress_scores(model, ids, chunk_size=32, n_sink=2)
    engine = Recording(params, num_pages=600, page_size=8, token_budget=64, chunk=64,
                       kv_dtype="float32")  # fmt: skip
    engine.generate([ids], kv_policy=KVzip(budget=0.5, chunk=32, sink=2), max_new_tokens=2)
    ours = engine.scores["req-0"][:, :, : len(ids)]
    assert (ours[:, :, 2 : len(prefix)] == 0).all() and (ours[:, :, len(prefix) :] > 0).all()
    np.testing.assert_allclose(ours[:, :, 2:], want[:, :, 2:], atol=1e-7, rtol=1e-4)


def test_kvzip_in_a_batch_with_other_requests_equals_each_alone(tiny_params):
    """KVzip requests arriving while others (SnapKV, the full cache) run, in a pool small
    enough that the replay's room preempts: each gives the tokens it gives alone; every page
    comes back."""
    demo = tiny_params("llama")
    rng = random.Random(3)
    prompts = [[rng.randrange(3, demo.config.vocab_size) for _ in range(rng.randint(30, 50))]
               for _ in range(4)]  # fmt: skip
    policies = [KVzip(budget=0.3), SnapKV(budget=10, window=8), None, KVzip(budget=12, sink=2)]
    engine = Engine(demo, num_pages=126, page_size=4, token_budget=32, chunk=16, max_running=3,
                    kv_dtype="float32", admission="optimistic")  # fmt: skip
    got, pending = {}, list(range(4))
    while pending or engine.has_work:
        if pending:
            i = pending.pop(0)
            got[engine.add_request(prompts[i], max_new_tokens=6, kv_policy=policies[i])] = (i, [])
        for out in engine.step():
            got[out.request_id][1].extend(out.new_tokens)
        engine.pool.check()
    for i, toks in got.values():
        want = jkv.generate(demo, prompts[i], max_new_tokens=6, kv_policy=policies[i],
                            kv_dtype="float32")  # fmt: skip
        assert toks == list(want.tokens), i
    assert engine.scheduler.num_preemptions > 0
    assert engine.pool.used_pages == 0


def test_nothing_compiles_after_warmup_with_kvzip(tiny_params):
    demo = tiny_params("llama")
    engine = Engine(demo, num_pages=64, page_size=16, chunk=8, max_running=2, max_model_len=48)
    engine.warmup(kv_policies=["kvzip"])
    before = programs_built()
    rng = random.Random(2)
    for budget in (0.5, 4):
        prompts = [[rng.randrange(3, 100) for _ in range(rng.randint(9, 20))] for _ in range(2)]
        engine.generate(prompts, max_new_tokens=3, kv_policy=KVzip(budget=budget))
    assert programs_built() == before


def test_a_prompt_whose_replay_does_not_fit_a_row_is_refused(tiny_params):
    engine = Engine(tiny_params("llama"), num_pages=64, page_size=16, max_model_len=48)
    with pytest.raises(ValueError, match="kv_policy='kvzip': a prompt of 41 tokens and its "):
        engine.add_request(list(range(3, 44)), kv_policy="kvzip", max_new_tokens=2)
    with pytest.raises(ValueError, match="replaying=True"):
        engine.add_request([3, 4, 5], kv_policy={"name": "kvzip", "replaying": True})
    assert not engine.has_work
