"""SnapKV segment rebuild: the segmentation rule against a plain-numpy reference, the low-rank
store's ranks, attention over the rebuilt cache against its dense reconstruction (XLA path)."""

from __future__ import annotations

import functools
import math
import re
from fractions import Fraction

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from policy_refs import context, random_layer

from jkv import kv as kvlib
from jkv.core import attention as attn
from jkv.core.backends import ops
from jkv.policies import SnapKV, SnapKVSegments, resolve, segment_report
from jkv.policies.segments import (
    EMPTY,
    MIDDLE,
    TRANSITION,
    WHOLE,
    SegmentCapacity,
    anchor_scores,
    reconstruct,
)
from jkv_kernels import kv_compact_reference, quantize_reference

attend = jax.jit(attn.cached_attention_reference)  # eager, every op compiles on its own


@functools.lru_cache
def planner(policy):
    """policy.plan as one jitted call (eager, its bisection loop recompiles every time)."""
    return jax.jit(lambda layer: policy.plan(layer, context(layer, policy).budgets[:, None]))


@functools.lru_cache
def rebuilder(policy, cap):
    return jax.jit(lambda layer: policy.rebuild(0, layer, context(layer, policy), cap, ops("xla")))


def np_scores(votes, n, decay):
    """The entropy x decay score in float64: -a log a (a clipped to 1/e) * exp(-decay * dist)."""
    v = votes[:n].astype(np.float64)
    a = np.minimum(v / v.sum(), 1 / math.e)
    with np.errstate(divide="ignore", invalid="ignore"):
        ent = np.where(a > 0, -a * np.log(a), 0.0)
    return ent * np.exp(-decay * (n - 1 - np.arange(n)))


def np_classes(order, k, n, radius, trans):
    out = []
    for s in range(n):
        d = min((abs(s - a) for a in order[:k]), default=1 << 30)
        out.append(WHOLE if d <= radius else TRANSITION if d <= radius + trans else MIDDLE)
    return out


def np_runs(cls, merge: Fraction):
    """Ordinary slots as [start, count] runs: whole tokens alone, transition segments grouped."""
    runs, j = [], None
    group = lambda x: (x * merge.denominator) // merge.numerator
    for s, c in enumerate(cls):
        if c == WHOLE:
            runs.append([s, 1])
        if c != TRANSITION:
            j = None
            continue
        j = 0 if j is None else j + 1
        if j == 0 or group(j) != group(j - 1):
            runs.append([s, 1])
        else:
            runs[-1][1] += 1
    return runs


def np_plan(scores, n, budget, p: SnapKVSegments):
    """The rule of jkv.policies.segments, one (row, kv head), by brute force over k."""

    def key(s):
        if s < p.sink:
            return (0, s, s)
        if s >= n - p.window:
            return (1, -s, s)
        return (2, -scores[s], s)

    order = sorted(range(n), key=key)
    cap = n if p.n_anchors is None else min(n, p.n_anchors)
    plans = [np_classes(order, k, n, p.anchor_radius, p.transition_len) for k in range(cap + 1)]
    k = max(k for k in range(cap + 1) if len(np_runs(plans[k], p.merge_ratio)) <= budget)
    return order[:k], plans[k]


SETTINGS = {
    "defaults_b12": (12, dict(window=5)),
    "ratio_merge2": (0.4, dict(window=4, merge=2, anchor_radius=0, transition_len=3)),
    "n_anchors3_merge3": (20, dict(window=2, sink=2, n_anchors=3, merge=3.0)),
    "wide_b6": (6, dict(window=8, anchor_radius=2, transition_len=1, decay=0.1)),
}


@pytest.mark.parametrize("name", SETTINGS)
def test_segmentation_matches_numpy_reference(rng, name):
    budget, kw = SETTINGS[name]
    layer = random_layer(rng, b=3, kh=2, s=40)
    policy = SnapKVSegments(budget=budget, **kw)
    ctx = context(layer, policy)
    cls, n_anchors, flags = (np.asarray(x) for x in planner(policy)(layer))
    scores = np.asarray(anchor_scores(layer.scores, layer.lengths, policy.decay))
    votes, lengths = np.asarray(layer.scores), np.asarray(layer.lengths)
    for i, j in np.ndindex(3, 2):
        n, b = lengths[i, j], int(ctx.budgets[i])
        np.testing.assert_allclose(scores[i, j, :n], np_scores(votes[i, j], n, policy.decay), 1e-5)
        anchors, want = np_plan(scores[i, j], n, b, policy)
        assert n_anchors[i, j] == len(anchors)
        np.testing.assert_array_equal(cls[i, j, :n], want)
        assert np.all(cls[i, j, n:] == EMPTY)
        runs = np_runs(want, policy.merge_ratio)
        np.testing.assert_array_equal(np.flatnonzero(flags[i, j]), [r[0] for r in runs])
        # invariants: the budget holds; anchors (sinks, window first) are kept whole
        assert len(runs) <= b
        assert all(cls[i, j, a] == WHOLE for a in anchors)
        sinks = set(range(min(policy.sink, n)))
        window = set(range(max(0, n - policy.window), n)) - sinks
        assert set(anchors[: len(sinks)]) <= sinks
        assert set(anchors[len(sinks) : len(sinks) + len(window)]) <= window
        if len(anchors) >= len(sinks) + len(window):
            assert sinks | window <= set(anchors)


def test_ragged_rows_are_independent(rng):
    layer = random_layer(rng, b=3, kh=2, s=40, lengths=np.array([[40, 40], [17, 17], [29, 29]]))
    policy = SnapKVSegments(budget=10, window=4)
    cls = np.asarray(planner(policy)(layer)[0])
    for i in range(3):
        row = jax.tree.map(lambda x, i=i: x[i : i + 1], layer)
        alone = np.asarray(planner(policy)(row)[0])
        np.testing.assert_array_equal(alone[0], cls[i])


# One policy for most tests, so their jitted rebuilds compile once per dtype.
POLICY = SnapKVSegments(budget=10, window=3, segment_len=16, max_rank=8)


def _rebuilt(rng, policy, *, dtype="float32", b=3, kh=2, s=40, h=16, low_rank_keys=True):
    """A freshly prefilled layer (low-rank-ish keys: a real model's are) and its rebuild."""
    layer = random_layer(rng, b=b, kh=kh, s=s, h=h)
    if low_rank_keys:
        basis = rng.standard_normal((kh, 3, h)).astype(np.float32)
        coef = rng.standard_normal((b, kh, s, 3)).astype(np.float32)
        noise = 0.1 * rng.standard_normal((b, kh, s, h)).astype(np.float32)
        layer = layer.replace(k=jnp.asarray(np.einsum("bksr,krh->bksh", coef, basis) + noise))
    if dtype == "float8_e4m3fn":
        (k, ks), (v, vs) = (
            quantize_reference(x, scale_dtype=jnp.bfloat16) for x in (layer.k, layer.v)
        )
        layer = layer.replace(k=k, v=v, k_scale=ks, v_scale=vs)
    elif dtype != "float32":
        layer = layer.replace(k=layer.k.astype(dtype), v=layer.v.astype(dtype))
    cap = policy.capacities(1, [s], 4)[0]
    return layer, rebuilder(policy, cap)(layer), cap


def test_low_rank_store_packs_the_middle_and_reaches_the_variance(rng):
    policy = POLICY
    layer, new, cap = _rebuilt(rng, policy)
    cls = np.asarray(planner(policy)(layer)[0])
    lr = new.lowrank
    m, seg_len, r = cap.store_shape(16)
    assert lr.coef_k.shape == (3, 2, m, seg_len, r) and lr.basis_v.shape == (3, 2, m, r, 16)
    for i, j in np.ndindex(3, 2):
        middle = np.flatnonzero(cls[i, j] == MIDDLE)
        counts = np.asarray(lr.counts[i, j])
        assert counts.sum() == len(middle)  # no middle token dropped: M is a true bound
        pos = np.asarray(lr.positions[i, j])
        for g in range(m):
            toks = middle[g * seg_len : (g + 1) * seg_len]
            assert counts[g] == len(toks)
            np.testing.assert_array_equal(pos[g, : len(toks)], toks)
            for x, coef, basis, ranks in (
                (layer.k, lr.coef_k, lr.basis_k, lr.rank_k),
                (layer.v, lr.coef_v, lr.basis_v, lr.rank_v),
            ):
                rank = int(ranks[i, j, g])
                if not len(toks):
                    assert rank == 0
                    continue
                x = np.asarray(x[i, j], np.float64)[toks]
                sv = np.linalg.svd(x, compute_uv=False) ** 2
                frac = np.cumsum(sv) / sv.sum()
                assert 1 <= rank <= r
                assert rank == r or frac[rank - 1] >= 0.85 - 1e-4  # the target is reached...
                assert rank == 1 or frac[rank - 2] < 0.85 + 1e-4  # ...by the smallest rank
                rec = np.asarray(coef[i, j, g], np.float64) @ np.asarray(basis[i, j, g])
                err = np.linalg.norm(rec[: len(toks)] - x) ** 2 / sv.sum()
                assert err <= 1 - frac[rank - 1] + 1e-4  # the truncated SVD's residual
                assert np.all(rec[len(toks) :] == 0)


def _dense_attention(q, q_pos, layer):
    """Softmax over the reconstructed slots and low-rank tokens with the log-count biases."""
    k, v, bias, pos, valid = reconstruct(layer)
    b, t, n, h = q.shape
    kh = k.shape[1]
    qg = np.asarray(q, np.float64).reshape(b, t, kh, n // kh, h)
    z = np.einsum("btkgh,bksh->bkgts", qg, k) / math.sqrt(h) + bias[:, :, None, None, :]
    seen = valid[:, :, None, :] & (pos[:, :, None, :] <= np.asarray(q_pos)[:, None, :, None])
    z = np.where(seen[:, :, None], z, -np.inf)
    p = np.exp(z - z.max(-1, keepdims=True))
    p /= p.sum(-1, keepdims=True)
    return np.einsum("bkgts,bksh->btkgh", p, v).reshape(b, t, n, h)


@pytest.mark.parametrize(
    "dtype, t", [("float32", 1), ("bfloat16", 3), ("float8_e4m3fn", 2)], ids=lambda x: str(x)
)
def test_attention_equals_dense_reconstruction(rng, dtype, t):
    policy = POLICY
    layer, new, _ = _rebuilt(rng, policy, dtype=dtype)
    assert new.k.dtype == layer.k.dtype and (new.k_scale is None) == (layer.k_scale is None)
    q = rng.standard_normal((3, t, 4, 16)).astype(np.float32)
    q_pos = np.asarray(layer.lengths[:, :1]) + np.arange(t)  # after the prompt...
    q_pos[0] = 5 + np.arange(t)  # ...but row 0's: the causal mask reaches low-rank tokens too
    got = attend(jnp.asarray(q), jnp.asarray(q_pos), new)
    want = _dense_attention(q, q_pos, new)
    np.testing.assert_allclose(np.asarray(got), want, rtol=1e-5, atol=1e-5)


def test_lossless_settings_reproduce_the_original_attention(rng):
    """merge=1 and variance=1 at full rank rebuild the cache exactly: the whole pipeline (plan,
    merge kernel reference, packing, SVD, biased low-rank attention) is checked end to end."""
    policy = SnapKVSegments(budget=9, window=3, merge=1, variance=1.0, max_rank=16, segment_len=16)
    layer, new, _ = _rebuilt(rng, policy, low_rank_keys=False)
    assert int(np.asarray(new.lowrank.counts).sum()) > 0 and np.all(np.asarray(new.bias) == 0)
    q = jnp.asarray(rng.standard_normal((3, 1, 4, 16)), jnp.float32)
    q_pos = layer.lengths[:, :1]
    got = attend(q, q_pos, new)
    want = attend(q, q_pos, layer)
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-4, atol=1e-5)


def test_closer_to_the_full_cache_than_snapkv_at_the_same_budget(rng):
    policy = POLICY
    layer, new, _ = _rebuilt(rng, policy)
    snap = SnapKV(budget=10, window=3)
    keep = snap.keep(0, layer, context(layer, snap))
    evicted = kvlib.compact(layer, keep, 16, compact_fn=kv_compact_reference)
    q = jnp.asarray(rng.standard_normal((3, 1, 4, 16)), jnp.float32)
    out = {
        name: np.asarray(attend(q, layer.lengths[:, :1], x))
        for name, x in (("full", layer), ("segments", new), ("snapkv", evicted))
    }
    err = {k: np.linalg.norm(out[k] - out["full"]) / np.linalg.norm(out["full"]) for k in out}
    print(f"attention rel err vs full: segments {err['segments']:.3f}, snapkv {err['snapkv']:.3f}")
    assert err["segments"] < err["snapkv"]


def test_merged_slots_hold_means_and_log_counts(rng):
    policy = POLICY
    layer, new, _ = _rebuilt(rng, policy)
    cls, _, flags = (np.asarray(x) for x in planner(policy)(layer))
    k, bias, lengths = np.asarray(layer.k), np.asarray(new.bias), np.asarray(new.lengths)
    for i, j in np.ndindex(3, 2):
        runs = np_runs(list(cls[i, j, : int(layer.lengths[i, j])]), policy.merge_ratio)
        assert lengths[i, j] == len(runs) == flags[i, j].sum()
        for c, (s0, cnt) in enumerate(runs):
            np.testing.assert_allclose(
                np.asarray(new.k[i, j, c]), k[i, j, s0 : s0 + cnt].mean(0), 1e-5, 1e-6
            )
            assert bias[i, j, c] == pytest.approx(math.log(cnt))
            assert new.positions[i, j, c] == s0 + cnt - 1
    report = segment_report(
        kvlib.KVState(layers=(new,), next_position=layer.lengths[:, 0], limit=layer.lengths[:, 0])
    )
    total = int(np.asarray(layer.lengths).sum())
    parts = report["anchor"]["tokens"] + report["transition"]["tokens"] + report["middle"]["tokens"]
    assert parts == total
    assert (
        report["transition"]["ratio"]
        == report["transition"]["tokens"] / report["transition"]["slots"]
    )


def test_state_fields_follow_append_grow_compact_and_bytes(rng):
    policy = POLICY
    _, new, cap = _rebuilt(rng, policy)
    state = kvlib.KVState(
        layers=(new,), next_position=jnp.full((3,), 40, jnp.int32), limit=jnp.full((3,), 40)
    )
    m, seg_len, r = cap.store_shape(16)
    factors = 2 * 3 * 2 * m * (seg_len * r + r * 16) * 4
    assert kvlib.nbytes(state) == new.k.nbytes * 2 + new.bias.nbytes + factors
    assert kvlib.used_bytes(state) <= kvlib.nbytes(state)
    k_new = jnp.ones((3, 1, 2, 16), jnp.float32)
    grown = kvlib.pad_slots(new, 2)
    assert grown.capacity == new.capacity + 2 and grown.lowrank.coef_k is not new.lowrank.coef_k
    appended = kvlib.append(
        grown.replace(bias=grown.bias + 5.0),
        k_new,
        k_new,
        jnp.full((3, 1), 99),
        jnp.ones(3, jnp.int32),
    )
    slot = np.asarray(new.lengths)
    got = np.take_along_axis(np.asarray(appended.bias), slot[..., None], 2)
    assert np.all(got == 0)  # a decode token is one ordinary slot
    keep = jnp.arange(grown.capacity) % 2 == 0
    small = kvlib.compact(
        new,
        jnp.broadcast_to(keep[: new.capacity], new.positions.shape),
        8,
        compact_fn=kv_compact_reference,
    )
    np.testing.assert_array_equal(np.asarray(small.bias)[..., :4], np.asarray(new.bias)[..., 0:8:2])
    np.testing.assert_array_equal(small.lowrank.coef_k, new.lowrank.coef_k)
    from jax.sharding import Mesh

    from jkv.sharding import shard_kv

    mesh = Mesh(np.array(jax.devices()[:1]).reshape(1, 1), ("data", "model"))
    placed = shard_kv(state, mesh).layers[0]
    assert placed.lowrank.coef_k.sharding.mesh.shape == mesh.shape
    np.testing.assert_array_equal(placed.bias, new.bias)


def test_capacities_are_static_and_match_memory():
    p = SnapKVSegments(budget=256, segment_len=64)
    cap = p.capacities(2, [2048], 32)[0]
    assert isinstance(cap, SegmentCapacity) and cap == 256 + 32 and int(cap) == 288
    assert cap.store_shape(128) == (-(-(2048 - 256 + 10) // 64), 64, 16)
    assert (
        hash(cap) != hash(p.capacities(2, [1024], 32)[0]) or cap != p.capacities(2, [1024], 32)[0]
    )
    assert p.capacities(1, [100], 0)[0] == SnapKVSegments(budget=256).capacities(1, [100], 0)[0]
    assert resolve("snapkv_segments", 0.25) == SnapKVSegments(budget=0.25)


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(merge=0.5), r"merge=0.5 must be a number >= 1"),
        (dict(variance=0.0), r"variance=0.0 must be in \(0, 1\]"),
        (dict(segment_len=48), r"segment_len=48 must be a power of two >= 16"),
        (dict(max_rank=0), r"max_rank=0 must be an integer >= 1"),
        (dict(decay=-1), r"decay=-1 must be a number >= 0"),
        (dict(n_anchors=0), r"n_anchors=0 must be an integer >= 1"),
        (dict(anchor_radius=-1), r"anchor_radius=-1 must be an integer >= 0"),
    ],
)
def test_bad_settings(kwargs, match):
    with pytest.raises(ValueError, match=match):
        SnapKVSegments(**kwargs)


def _ancestors(hlo: str) -> dict[str, set[str]]:
    """Each instruction of an HLO module's entry computation -> every instruction it reads,
    directly or not."""
    entry = hlo[hlo.index("\nENTRY ") :]
    entry = entry[: entry.index("\n}")]
    reads = {}
    for line in entry.splitlines()[1:]:
        name, _, rhs = line.strip().removeprefix("ROOT ").partition(" = ")
        reads[name.lstrip("%")] = set(re.findall(r"%([\w.\-]+)", rhs))
    seen: dict[str, set[str]] = {}

    def up(name):
        if name not in seen:
            seen[name] = set()
            for r in reads.get(name, ()):
                if r in reads:
                    seen[name] |= {r} | up(r)
        return seen[name]

    for name in reads:
        up(name)
    return seen


def _compress_args(tiny_params):
    """A 64-slot float32 state of the tiny llama and the segment rebuild's `compress` args."""
    params = tiny_params("llama")
    cfg = params.config
    policy = SnapKVSegments(budget=16, window=4, segment_len=16)
    state = kvlib.init_state(
        num_layers=cfg.num_layers,
        batch=2,
        num_kv_heads=cfg.num_kv_heads,
        head_dim=cfg.head_dim,
        capacity=64,
        dtype="float32",
        scores=True,
    )
    caps = policy.capacities(cfg.num_layers, [60, 40], 8)
    tokens, n_new = jnp.zeros((2, 64), jnp.int32), jnp.array([60, 40], jnp.int32)
    budgets = jnp.asarray(policy.row_budgets([60, 40]))
    kw = dict(policy=policy.jit_key(), capacities=caps, backend="xla")
    return (params.weights, cfg, state, tokens, n_new, budgets), kw


def test_no_two_factorisations_can_run_at_once(tiny_params):
    """jaxlib's CPU SVD holds a pool thread while its batch runs on the others: two SVDs at once
    deadlock a 2-thread pool (CI's `make test` hung on it). XLA:CPU runs independent thunks
    concurrently and drops optimization barriers first, so each layer's SVD must read the
    previous layer's factors: in the compiled program every SVD depends on another but one."""
    from jkv.policies.compress import compress

    args, kw = _compress_args(tiny_params)
    assert args[1].num_layers >= 2
    hlo = compress.trace(*args, **kw).lower(lowering_platforms=("cpu",)).compile().as_text()
    calls = re.findall(r"%([\w.\-]+) = [^\n]*custom_call_target=\"(\w+)\"", hlo)
    svds = {name for name, target in calls if "gesdd" in target or "gesvd" in target}
    assert len(svds) == args[1].num_layers, calls
    up = _ancestors(hlo)
    ordered = sorted(svds, key=lambda s: len(up[s] & svds))
    for i, s in enumerate(ordered):
        assert up[s] & svds == set(ordered[:i]), f"{s} may run beside another SVD"


def test_factorising_programs_run_one_at_a_time(tiny_params):
    """Between programs: `compress_alone` (what `jkv.generate` and `jkv.prefill` call) waits for
    the process's factorising program to end before it starts one, and returns it finished."""
    import threading

    from jkv.policies import compress as compress_mod

    args, kw = _compress_args(tiny_params)
    compress_mod.compress_alone(*args, **kw)  # compiled: a second call takes milliseconds
    done = []
    with compress_mod._FACTORING:  # another program of the process factoring
        worker = threading.Thread(
            target=lambda: done.append(compress_mod.compress_alone(*args, **kw))
        )
        worker.start()
        worker.join(timeout=3)
        assert worker.is_alive() and not done
    worker.join(timeout=60)
    assert done and all(x.is_ready() for x in jax.tree.leaves(done[0]))
