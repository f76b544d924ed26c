"""What each select-once policy keeps through `jkv.Engine`, checked per (layer, kv head) against
an independent reference on the same weights (transformers' model): kvpress's own press where
the method is kvpress's (SnapKV, StreamingLLM, Ada-KV: the press's kept slots), kvpress's
SnapKV scores ranked at jkv's layer budgets for PyramidKV (whose layer budgets are jkv's own
formula, not kvpress's), and numpy over transformers' keys for Quantile (L1 norms: kvpress's
Knorm ranks by L2, another method). KVzip's are in test_engine_kvzip.py."""

from __future__ import annotations

import numpy as np
import pytest

from jkv.engine.engine import Engine
from jkv.policies import AdaKV, PyramidKV, Quantile, SnapKV, StreamingLLM

TEXT = " ".join(["the code for alice is 4 1 7 2 9 .", "bob has a red ball ."] * 11)


class Kept(Engine):
    """Records each head's kept text positions when a prompt's selection is made physical."""

    def __init__(self, *args, **kw):
        super().__init__(*args, **kw)
        self.kept = {}

    def _compress(self, seq, src, row, counts, ring=None):
        cfg = self.params.config
        at = np.asarray(src)[row]  # [L, K, S] pool tokens, each head's kept first
        where = np.asarray(self.device.positions).reshape(-1)  # every pool token's position
        self.kept[seq.request_id] = [
            [sorted(where[at[i, k, : counts[i * cfg.num_kv_heads + k]]].tolist())
             for k in range(cfg.num_kv_heads)]
            for i in range(cfg.num_layers)
        ]  # fmt: skip
        return super()._compress(seq, src, row, counts, ring)


def engine_kept(params, ids, policy):
    engine = Kept(params, num_pages=1200, page_size=8, token_budget=128, chunk=64,
                  kv_dtype="float32")  # fmt: skip
    engine.generate([ids], kv_policy=policy, max_new_tokens=2)
    return engine.kept["req-0"]


def hf_keys(model, ids, press=None):
    """Each layer's cached keys `[K, n', H]` after a forward over `ids` (under `press`)."""
    import contextlib

    import quality_kvpress as qk
    import torch
    from transformers import DynamicCache

    cache = DynamicCache()
    ctx = press(model) if press is not None else contextlib.nullcontext()
    with torch.no_grad(), ctx, qk.layer_masks(model):
        model(input_ids=torch.tensor([ids]), past_key_values=cache)
    return [layer.keys[0].float().numpy() for layer in cache.layers]


def positions_of(kept_keys, full_keys):
    """The positions of a press's kept keys: each matched to the full forward's key it equals."""
    out = []
    for kept, full in zip(kept_keys, full_keys, strict=True):
        heads = []
        for k in range(full.shape[0]):
            d = ((kept[k][:, None, :] - full[k][None, :, :]) ** 2).sum(-1)
            assert np.allclose(d.min(1), 0.0, atol=1e-8)  # every kept key is one of the prompt's
            heads.append(sorted(d.argmin(1).tolist()))
        out.append(heads)
    return out


@pytest.mark.parametrize("name,policy", [("snapkv", SnapKV(budget=0.3)),
                                         ("streaming", StreamingLLM(budget=0.3))])  # fmt: skip
def test_the_engine_keeps_what_kvpress_keeps(demo_hf, name, policy):
    import quality_kvpress as qk

    params, model = demo_hf
    ids = params.tokenizer.encode(TEXT)
    press = qk.press_for(name, 0.3, len(ids), qk.match_jkv(name))
    want = positions_of(hf_keys(model, ids, press), hf_keys(model, ids))
    got = engine_kept(params, ids, policy)
    assert got == want
    assert {len(h) for layer in got for h in layer} == {policy.budget_tokens(len(ids))}


@pytest.mark.parametrize("alpha", [0.2, 1.0])
def test_adakv_keeps_what_kvpress_adakv_keeps(demo_hf, alpha):
    """Ada-KV's budgets move between a layer's heads above each head's floor (`alpha` of the
    budget, its own best; at 1.0 the floor is the whole budget and nothing moves): each head
    keeps what kvpress's AdaKVPress leaves unmasked."""
    import kvpress
    import quality_kvpress as qk

    params, model = demo_hf
    ids = params.tokenizer.encode(TEXT)
    n = len(ids)
    masked = {}

    class Capture(kvpress.AdaKVPress):
        def compress(self, module, *args):
            out = super().compress(module, *args)
            _, heads, slots = module.masked_key_indices
            masked[module.layer_idx] = list(zip(heads.tolist(), slots.tolist(), strict=True))
            return out

    inner = kvpress.SnapKVPress(compression_ratio=0.0, **{
        k: v for k, v in qk.match_jkv("snapkv").items()})  # fmt: skip
    press = Capture(press=inner, alpha_safeguard=alpha)
    press.compression_ratio = qk.press_for("adakv", 0.3, n).compression_ratio
    hf_keys(model, ids, press)
    kh = params.config.num_kv_heads
    want = [[sorted(set(range(n)) - {s for h, s in masked[layer] if h == k}) for k in range(kh)]
            for layer in range(params.config.num_layers)]  # fmt: skip
    got = engine_kept(params, ids, AdaKV(budget=0.3, alpha_safeguard=alpha))
    assert got == want
    moved = len({len(h) for layer in got for h in layer}) > 1
    assert moved == (alpha < 1.0)


def test_pyramidkv_keeps_kvpress_snapkv_ranking_at_its_layer_budgets(demo_hf):
    """PyramidKV's layer budgets are jkv's (more in lower layers: beta 2 gives 4/3 and 2/3 of
    the budget over two layers); inside a layer it keeps the top of kvpress's SnapKV scores."""
    import kvpress
    import quality_kvpress as qk

    params, model = demo_hf
    ids = params.tokenizer.encode(TEXT)
    n = len(ids)
    scores = {}

    class Capture(kvpress.SnapKVPress):
        def score(self, module, *args):
            out = super().score(module, *args)
            scores[module.layer_idx] = out[0].float().numpy()
            return out

    hf_keys(model, ids, Capture(compression_ratio=0.5, **qk.match_jkv("snapkv")))
    policy = PyramidKV(budget=0.3, beta=2.0)
    got = engine_kept(params, ids, policy)
    nl = params.config.num_layers
    budgets = [policy.layer_budget(layer, nl, policy.budget_tokens(n)) for layer in range(nl)]
    assert budgets[0] > budgets[-1] > policy.window
    want = [[sorted(np.argsort(-s, kind="stable")[: budgets[layer]].tolist())
             for s in scores[layer]] for layer in range(nl)]  # fmt: skip
    assert got == want


@pytest.mark.parametrize("keep", ["high", "low"])
def test_quantile_keeps_each_heads_keys_by_l1_norm(demo_hf, keep):
    """numpy over transformers' keys: per head, the `1 - q` fraction with the highest (or
    lowest) L1 norm."""
    params, model = demo_hf
    ids = params.tokenizer.encode(TEXT)
    policy = Quantile(q=0.7, keep_norms=keep)
    b = policy.budget_tokens(len(ids))
    sign = -1.0 if keep == "high" else 1.0
    want = [[sorted(np.argsort(sign * np.abs(h).sum(-1), kind="stable")[:b].tolist())
             for h in layer] for layer in hf_keys(model, ids)]  # fmt: skip
    assert engine_kept(params, ids, policy) == want
