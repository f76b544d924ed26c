"""Each policy's selection equals a plain-numpy reference of its rule on random states."""

from __future__ import annotations

import math

import jax.numpy as jnp
import numpy as np
import pytest
from policy_refs import budget_tokens, context, kept_sets, np_keep, random_layer

from jkv.policies import H2O, AdaKV, EffiCache, PyramidKV, Quantile, SnapKV, StreamingLLM
from jkv.policies.efficache import attention_entropy
from jkv.policies.pyramidkv import layer_factor


@pytest.mark.parametrize("budget", [10, 0.3])
@pytest.mark.parametrize("shuffled", [False, True], ids=["fresh", "rewritten"])
def test_streaming(rng, budget, shuffled):
    layer = random_layer(rng, shuffled=shuffled)
    policy = StreamingLLM(budget=budget, sink=4)
    got = kept_sets(policy.keep(0, layer, context(layer, policy)), layer)
    pos, lengths = np.asarray(layer.positions), np.asarray(layer.lengths)
    for (i, j), kept in got.items():
        b = budget_tokens(budget, lengths[i, 0])
        want = np_keep(np.zeros(40), pos[i, j], lengths[i, j], b, b - min(4, b), min(4, b))
        assert kept == want
        # sinks and window: the 4 oldest and the newest always there
        order = sorted(range(lengths[i, j]), key=lambda s: pos[i, j, s])
        assert set(order[:4]) <= kept and order[-1] in kept and len(kept) == b


@pytest.mark.parametrize("cls", [SnapKV, PyramidKV], ids=["snapkv", "pyramidkv"])
@pytest.mark.parametrize("budget", [12, 0.25])
def test_snapkv_family(rng, cls, budget):
    layer = random_layer(rng)
    policy = cls(budget=budget, window=5)
    scores, pos, lengths = (np.asarray(x) for x in (layer.scores, layer.positions, layer.lengths))
    for li in range(4):
        got = kept_sets(policy.keep(li, layer, context(layer, policy)), layer)
        for (i, j), kept in got.items():
            n = lengths[i, j]
            b = budget_tokens(budget, n)
            if cls is PyramidKV:
                b = min(max(1, math.ceil(layer_factor(li, 4, 20.0) * b)), n)
            assert kept == np_keep(scores[i, j], pos[i, j], n, b, min(5, b))
            assert {n - 1 - w for w in range(min(5, b))} <= kept  # the window


def test_pyramid_budgets_shrink_with_depth_and_average_the_budget():
    p = PyramidKV(budget=100, beta=5.0)
    caps = p.capacities(8, [1000], 0)
    assert list(caps) == sorted(caps, reverse=True) and caps[0] > caps[-1]
    assert abs(sum(p.layer_budget(i, 8, 100) for i in range(8)) / 8 - 100) < 2


@pytest.mark.parametrize("scorer", ["mass", "importance"])
def test_h2o(rng, scorer):
    layer = random_layer(rng, shuffled=True)
    policy = H2O(budget=9, recent=3, scorer=scorer, protect=2)
    got = kept_sets(policy.keep(0, layer, context(layer, policy)), layer)
    scores, pos, lengths = (np.asarray(x) for x in (layer.scores, layer.positions, layer.lengths))
    for (i, j), kept in got.items():
        n = lengths[i, j]
        s = scores[i, j].copy()
        if scorer == "importance":
            now = n - 1
            s = s / np.maximum(now - pos[i, j] + 1, 1)
            s[(pos[i, j] >= 0) & (pos[i, j] < 2)] = np.inf
        assert kept == np_keep(s, pos[i, j], n, min(9, n), 3)


def test_adakv(rng):
    layer = random_layer(rng, kh=4)
    policy = AdaKV(budget=8, window=2, alpha_safeguard=0.25, max_factor=2.0)
    got = kept_sets(policy.keep(0, layer, context(layer, policy)), layer)
    scores, pos, lengths = (np.asarray(x) for x in (layer.scores, layer.positions, layer.lengths))
    for i in range(3):
        n, b = lengths[i, 0], min(8, lengths[i, 0])
        own = {
            j: np_keep(scores[i, j], pos[i, j], n, max(min(2, b), b // 4), min(2, b))
            for j in range(4)
        }
        free = sorted(
            ((scores[i, j, s], j, s) for j in range(4) for s in range(n) if s not in own[j]),
            key=lambda x: (-x[0], x[1] * 1000 + x[2]),
        )
        rest = b * 4 - sum(len(v) for v in own.values())
        keep = {j: set(own[j]) for j in range(4)}
        for _, j, s in free[:rest]:
            keep[j].add(s)
        cap = min(16, n)
        for j in range(4):
            ranked = sorted(keep[j], key=lambda s: (0 if s in own[j] else 1, -scores[i, j, s], s))
            assert got[(i, j)] == set(ranked[:cap])
        assert sum(len(got[(i, j)]) for j in range(4)) <= 4 * b


def test_efficache(rng):
    layer = random_layer(rng, kh=4)
    sens = jnp.asarray(rng.random((3, 4, 4)), jnp.float32)
    policy = EffiCache(budget=12, window=3, prune_ratio=0.5, sink=2, short_window=3)
    got = kept_sets(policy.keep(1, layer, context(layer, policy, sensitivity=sens)), layer)
    scores, pos, lengths = (np.asarray(x) for x in (layer.scores, layer.positions, layer.lengths))
    valid = np.arange(40)[None, None] < lengths[..., None]
    ent = np.asarray(attention_entropy(layer.scores, jnp.asarray(valid)))
    for i in range(3):
        s = np.asarray(sens)[i, 1]
        rank_s = np.argsort(np.argsort(s, kind="stable"), kind="stable")
        rank_e = np.argsort(np.argsort(-ent[i], kind="stable"), kind="stable")
        pruned = set(np.argsort(rank_s + rank_e, kind="stable")[:2])
        n = lengths[i, 0]
        b = min(12, n)
        for j in range(4):
            if j in pruned:
                want = np_keep(np.zeros(40), pos[i, j], n, 2 + min(3, b - 2), min(3, b - 2), 2)
            else:
                want = np_keep(scores[i, j], pos[i, j], n, b, min(3, b))
            assert got[(i, j)] == want


def test_efficache_seed_thresholds(rng):
    layer = random_layer(rng, kh=4)
    sens = jnp.asarray(rng.random((3, 4, 4)), jnp.float32)
    policy = EffiCache(
        budget=12, window=3, sink=2, short_window=3, grad_threshold=0.5, entropy_threshold=0.0
    )
    got = kept_sets(policy.keep(2, layer, context(layer, policy, sensitivity=sens)), layer)
    lengths = np.asarray(layer.lengths)
    for i in range(3):
        for j in range(4):
            pruned = float(sens[i, 2, j]) < 0.5  # every head's entropy is > 0
            assert len(got[(i, j)]) == (min(5, lengths[i, j]) if pruned else min(12, lengths[i, j]))


@pytest.mark.parametrize("keep_norms", ["high", "low"])
def test_quantile_is_per_head(rng, keep_norms):
    layer = random_layer(rng, kh=3)
    policy = Quantile(q=0.3, keep_norms=keep_norms)
    got = kept_sets(policy.keep(0, layer, context(layer, policy)), layer)
    norms = np.abs(np.asarray(layer.k)).sum(-1)
    lengths = np.asarray(layer.lengths)
    for (i, j), kept in got.items():
        n = lengths[i, j]
        k = math.ceil(0.7 * n)
        head = norms[i, j, :n] if keep_norms == "high" else -norms[i, j, :n]
        thresh = np.sort(head)[::-1][k - 1]  # the head's own quantile
        assert kept == set(np.flatnonzero(head >= thresh))
    # heads' norms differ by up to 100x, yet every head keeps 70%: no global threshold
    counts = [len(v) for v in got.values()]
    assert all(c == math.ceil(0.7 * lengths.reshape(-1)[t]) for t, c in enumerate(counts))


def test_streaming_write_slot_evicts_oldest_non_sink(rng):
    layer = random_layer(rng, b=2, kh=2, s=12, lengths=np.full((2, 2), 12), shuffled=True)
    full = jnp.array([12, 12])
    slot = np.asarray(StreamingLLM(budget=12, sink=4).write_slots(layer, jnp.array([99, 99]), full))
    pos = np.asarray(layer.positions)
    for i in range(2):
        for j in range(2):
            cands = [s for s in range(12) if pos[i, j, s] >= 4]
            assert slot[i, j] == min(cands, key=lambda s: pos[i, j, s])
    not_full = random_layer(rng, b=1, kh=2, s=12, lengths=np.full((1, 2), 7))
    slot = StreamingLLM(budget=12).write_slots(not_full, jnp.array([7]), jnp.array([12]))
    assert np.all(np.asarray(slot) == 7)


def test_h2o_write_slot_evicts_lightest_outside_recent(rng):
    layer = random_layer(rng, b=2, kh=2, s=10, lengths=np.full((2, 2), 10))
    now = jnp.array([10, 10])
    slot = np.asarray(H2O(budget=10, recent=3).write_slots(layer, now, jnp.array([10, 10])))
    scores, pos = np.asarray(layer.scores), np.asarray(layer.positions)
    for i in range(2):
        for j in range(2):
            cands = [s for s in range(10) if pos[i, j, s] < 10 - 3]
            assert slot[i, j] == min(cands, key=lambda s: scores[i, j, s])


@pytest.mark.parametrize(
    "make, match",
    [
        (lambda: SnapKV(budget=0), r"budget=0 must be in \[1, 2147483647\]"),
        (lambda: SnapKV(budget=1.5), r"budget=1.5 must be a ratio in \(0, 1\)"),
        (lambda: SnapKV(budget="x"), r"budget='x' must be a token count"),
        (lambda: SnapKV(kernel=4), r"kernel=4 must be odd"),
        (lambda: SnapKV(pool="mean"), r"pool='mean' must be 'avg' or 'max'"),
        (lambda: StreamingLLM(budget=4, sink=4), r"budget=4 must exceed sink=4"),
        (lambda: H2O(scorer="x"), r"scorer='x' must be 'mass' or 'importance'"),
        (lambda: PyramidKV(beta=0.5), r"beta=0.5 must be a number >= 1"),
        (lambda: AdaKV(alpha_safeguard=2), r"alpha_safeguard=2 must be in \[0, 1\]"),
        (lambda: EffiCache(prune_ratio=-1), r"prune_ratio=-1 must be in \[0, 1\]"),
        (lambda: EffiCache(grad_threshold=0.1), r"give both \(the absolute rule\) or neither"),
        (lambda: Quantile(q=1.0), r"q=1.0 must be a quantile in \[0, 1\)"),
        (lambda: Quantile(keep_norms="mid"), r"keep_norms='mid' must be 'high' or 'low'"),
    ],
)
def test_bad_policy_settings(make, match):
    with pytest.raises(ValueError, match=match):
        make()
