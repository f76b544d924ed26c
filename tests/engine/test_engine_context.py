"""`Engine.add_request(kv_state=)`: a request continues a `jkv.KVContext` (`jkv.prefill`) whose
kept slots are written into its first pages when it is admitted, and again after a preemption,
never recomputed. A full-cache context answers as the whole prompt does on the engine's own
path; compressed ones (SnapKV, KVzip with uneven heads, fp8) as `jkv.generate` continues
them; the pool holds exactly the context's slots (read back with numpy); a context the engine
cannot continue is refused with a clear error."""

from __future__ import annotations

import dataclasses
import random

import numpy as np
import pytest

import jkv
from jkv.compile_time import programs_built
from jkv.engine.engine import Engine
from jkv.policies import KVzip, SnapKV


def _ids(rng, n, vocab):
    return [rng.randrange(3, vocab) for _ in range(n)]


@pytest.fixture(scope="module")
def demo(tiny_params):
    return tiny_params("llama")


def _engine(demo, **kw):
    settings = dict(num_pages=160, page_size=4, token_budget=32, chunk=16, max_running=4,
                    kv_dtype="float32")  # fmt: skip
    return Engine(demo, **{**settings, **kw})


def test_a_full_context_answers_as_the_whole_prompt(demo):
    """The context's 45 tokens are not recomputed (the output counts them as cached), and the
    tokens equal the engine's own run of context + question, and jkv.generate's continuation."""
    rng = random.Random(1)
    doc, question = _ids(rng, 45, demo.config.vocab_size), _ids(rng, 7, demo.config.vocab_size)
    ctx = jkv.prefill(demo, doc, kv_dtype="float32")
    engine = _engine(demo)
    rid = engine.add_request(question, kv_state=ctx, max_new_tokens=8)
    got, cached = [], set()
    while engine.has_work:
        for out in engine.step():
            got += out.new_tokens
            cached.add(out.cached_tokens)
    [whole] = engine.generate([doc + question], max_new_tokens=8)
    assert got == whole
    assert got == list(jkv.generate(demo, question, kv_state=ctx, max_new_tokens=8).tokens)
    assert cached == {45} and rid == "req-0"
    assert engine.pool.used_pages == 0


class Reading(Engine):
    """Reads each context request's prefix pages back after its context is written."""

    def __init__(self, *args, **kw):
        super().__init__(*args, **kw)
        self.prefixes = {}

    def _write_contexts(self, seqs):
        super()._write_contexts(seqs)
        k, pos = np.asarray(self.device.k), np.asarray(self.device.positions)
        page = self.pool.page_size
        for seq in seqs:
            rows = [self.pool.row(b) for b in seq.blocks[: seq.n_prefix]]
            heads = []
            for h, n in enumerate(seq.base):
                at = [(rows[i // page][h], i % page) for i in range(n)]
                heads.append((np.array([k[p, o] for p, o in at]), [int(pos[p, o]) for p, o in at]))
            self.prefixes.setdefault(seq.request_id, []).append(heads)


def test_compressed_contexts_in_a_batch_with_preemption_equal_generate(demo):
    """SnapKV and KVzip contexts (KVzip's heads keep different counts: holes in the prefix), one
    of them asked twice, beside a plain request, in a pool small enough to preempt: each
    gives jkv.generate's continuation of its context; each admission's prefix pages hold the
    context's kept slots (K and positions, compared with numpy); every page comes back."""
    rng = random.Random(2)
    vocab = demo.config.vocab_size
    policies = [SnapKV(budget=0.25, window=4), KVzip(budget=0.25)]
    contexts = [jkv.prefill(demo, _ids(rng, rng.randint(40, 60), vocab), kv_policy=p,
                            kv_dtype="float32") for p in policies]  # fmt: skip
    asks = [(0, _ids(rng, 5, vocab)), (1, _ids(rng, 9, vocab)), (None, _ids(rng, 30, vocab)),
            (0, _ids(rng, 11, vocab))]  # fmt: skip
    engine = Reading(demo, num_pages=64, page_size=4, token_budget=32, chunk=16, max_running=4,
                     kv_dtype="float32", admission="optimistic")  # fmt: skip
    got = {}
    for i, (c, q) in enumerate(asks):
        state = None if c is None else contexts[c]
        got[engine.add_request(q, kv_state=state, max_new_tokens=12)] = (i, [])
    while engine.has_work:
        for out in engine.step():
            got[out.request_id][1].extend(out.new_tokens)
        engine.pool.check()
    assert engine.scheduler.num_preemptions > 0
    assert engine.pool.used_pages == 0
    for rid, (i, toks) in got.items():
        c, q = asks[i]
        if c is None:
            assert toks == list(jkv.generate(demo, q, max_new_tokens=12, kv_dtype="float32").tokens)
            continue
        ctx = contexts[c]
        assert toks == list(jkv.generate(demo, q, kv_state=ctx, max_new_tokens=12).tokens), i
        for heads in engine.prefixes[rid]:  # every admission of it
            for h, (keys, positions) in enumerate(heads):
                layer, kv = divmod(h, demo.config.num_kv_heads)
                n = int(np.asarray(ctx.layers[layer].lengths)[0, kv])
                assert len(positions) == n
                np.testing.assert_array_equal(keys, np.asarray(ctx.layers[layer].k)[0, kv, :n])
                assert positions == np.asarray(ctx.layers[layer].positions)[0, kv, :n].tolist()
    counts = [np.asarray(layer.lengths)[0] for layer in contexts[1].layers]
    assert len({int(x) for c in counts for x in c}) > 1  # KVzip's heads differ: holes


def test_an_fp8_context_continues_on_an_fp8_engine_without_new_programs(demo):
    """fp8 pages with their scales: each continuation equals jkv.generate's; once a context
    ran, another of another length (the same capacity bucket) compiles nothing."""
    rng = random.Random(3)
    vocab = demo.config.vocab_size
    engine = _engine(demo, kv_dtype="float8_e4m3fn")
    before = None
    for i, (n, budget) in enumerate(((50, 0.25), (57, 0.25))):
        if i == 1:
            before = programs_built()
        ctx = jkv.prefill(demo, _ids(rng, n, vocab), kv_policy=SnapKV(budget=budget, window=4),
                          kv_dtype="float8_e4m3fn")  # fmt: skip
        q = _ids(rng, 6, vocab)
        mark = programs_built()
        [got] = engine.generate([q], kv_state=ctx, max_new_tokens=8)
        built = programs_built() - mark
        assert got == list(jkv.generate(demo, q, kv_state=ctx, max_new_tokens=8).tokens)
        if before is not None:
            assert built == 0, (n, budget)


def test_contexts_the_engine_cannot_continue_are_refused(demo):
    rng = random.Random(4)
    vocab = demo.config.vocab_size
    doc = _ids(rng, 30, vocab)
    engine = _engine(demo)
    ctx = jkv.prefill(demo, doc, kv_dtype="float32")
    cases = [
        (ctx.state, "kv_state is a KVState; expected the jkv.KVContext"),
        (jkv.prefill(demo, [doc, doc], kv_dtype="float32"), "kv_state holds 2 rows; a request"),
        (dataclasses.replace(ctx, weights="0" * 64), "kv_state was computed by other weights"),
        (jkv.prefill(demo, doc, kv_dtype="bfloat16"), "differs from the kv_state's 'bfloat16'"),
        (jkv.prefill(demo, doc, kv_policy="streaming", kv_budget=12, kv_dtype="float32"),
         "kv_policy=.streaming., which evicts as it decodes"),
        (jkv.prefill(demo, doc, kv_policy="snapkv_segments", kv_budget=0.5, kv_dtype="float32"),
         "merged or low-rank slots"),
    ]  # fmt: skip
    for state, message in cases:
        with pytest.raises(ValueError, match=message):
            engine.add_request([5, 6], kv_state=state, max_new_tokens=2)
    with pytest.raises(ValueError, match="kv_policy='snapkv' given beside kv_state"):
        engine.add_request([5, 6], kv_state=ctx, kv_policy="snapkv", kv_budget=8)
    with pytest.raises(ValueError, match="past the model's trained context"):
        engine.add_request([5] * demo.config.max_position_embeddings, kv_state=ctx)
    assert not engine.has_work


def test_the_engine_prefills_a_context_as_transformers_and_jkv_prefill_do(demo_hf):
    """`Engine.prefill`: the prompt through the engine's step, its KV read out of the pages.
    A full cache holds transformers' keys and values (DynamicCache) at positions 0..n-1; SnapKV
    and KVzip contexts hold what jkv.prefill's hold (counts and positions per head, K and V to
    float32 rounding) and continue to the same tokens, also through bytes and on the engine; a
    turn appended to the KVzip one reads out as its slots then the turn's; every page comes
    back."""
    import torch
    from transformers import DynamicCache

    params, model = demo_hf
    rng = random.Random(5)
    doc = _ids(rng, 52, params.config.vocab_size)
    question = _ids(rng, 6, params.config.vocab_size)
    engine = _engine(params, num_pages=200)
    full = engine.prefill(doc)
    cache = DynamicCache()
    with torch.no_grad():
        model(input_ids=torch.tensor([doc]), past_key_values=cache)
    for layer, theirs in zip(full.layers, cache.layers, strict=True):
        assert np.asarray(layer.lengths).tolist() == [[len(doc)] * params.config.num_kv_heads]
        assert (np.asarray(layer.positions)[0, :, : len(doc)] == np.arange(len(doc))).all()
        for ours, want in ((layer.k, theirs.keys), (layer.v, theirs.values)):
            np.testing.assert_allclose(np.asarray(ours)[0, :, : len(doc)],
                                       want[0].float().numpy(), atol=2e-5, rtol=1e-4)  # fmt: skip
    for policy in (None, SnapKV(budget=0.25, window=8), KVzip(budget=0.25)):
        ours = full if policy is None else engine.prefill(doc, kv_policy=policy)
        theirs = jkv.prefill(params, doc, kv_policy=policy, kv_dtype="float32")
        assert ours.tokens == theirs.tokens and ours.policy == theirs.policy
        for a, b in zip(ours.layers, theirs.layers, strict=True):
            lengths = np.asarray(a.lengths)
            np.testing.assert_array_equal(lengths, np.asarray(b.lengths))
            for kv in range(lengths.shape[1]):
                n = lengths[0, kv]
                np.testing.assert_array_equal(np.asarray(a.positions)[0, kv, :n],
                                              np.asarray(b.positions)[0, kv, :n])  # fmt: skip
                np.testing.assert_allclose(np.asarray(a.k)[0, kv, :n], np.asarray(b.k)[0, kv, :n],
                                           atol=2e-5, rtol=1e-4)  # fmt: skip
        want = list(jkv.generate(params, question, kv_state=theirs, max_new_tokens=8).tokens)
        assert engine.generate([question], kv_state=ours, max_new_tokens=8) == [want]
        if isinstance(policy, SnapKV):  # through bytes
            back = jkv.KVContext.from_bytes(ours.to_bytes())
            assert (
                list(jkv.generate(params, question, kv_state=back, max_new_tokens=8).tokens) == want
            )
        if not isinstance(policy, KVzip):
            continue
        # a turn more: the question appended after the context (read out of its tail, after
        # heads of uneven lengths)
        more = engine.prefill(question, kv_state=ours)
        assert more.tokens == (tuple(doc + question),) and more.policy == theirs.policy
        for a, b in zip(more.layers, theirs.layers, strict=True):
            n = np.asarray(b.lengths)[0]
            np.testing.assert_array_equal(np.asarray(a.lengths)[0], n + len(question))
            for kv in range(len(n)):
                want_positions = [
                    *np.asarray(b.positions)[0, kv, : n[kv]],
                    *range(len(doc), len(doc) + len(question)),
                ]
                assert (
                    np.asarray(a.positions)[0, kv, : n[kv] + len(question)].tolist()
                    == want_positions
                )
        last = doc[:5]
        want = list(jkv.generate(params, question + last, kv_state=theirs, max_new_tokens=8).tokens)
        assert list(jkv.generate(params, last, kv_state=more, max_new_tokens=8).tokens) == want
    assert engine.pool.used_pages == 0
    with pytest.raises(ValueError, match="kv_policy='streaming' with prefill_only"):
        engine.prefill(doc, kv_policy="streaming", kv_budget=16)
