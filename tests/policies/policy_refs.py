"""Random KV states and plain-numpy references of each policy's selection rule."""

from __future__ import annotations

import math

import jax.numpy as jnp
import numpy as np

from jkv import kv as kvlib
from jkv.policies.base import Context


def random_layer(rng, b=3, kh=2, s=40, h=8, *, lengths=None, shuffled=False):
    """A LayerKV with random keys and scores, ragged lengths, positions 0..len-1 in slot order
    (a fresh prefill) or shuffled (a cache an evicting policy has rewritten)."""
    if lengths is None:
        lengths = rng.integers(s // 3, s + 1, size=(b, 1)).repeat(kh, axis=1)
    positions = np.full((b, kh, s), -1, np.int32)
    for i in range(b):
        for j in range(kh):
            n = lengths[i, j]
            pos = np.arange(n) if not shuffled else rng.permutation(3 * n)[:n]
            positions[i, j, :n] = pos
    k = rng.standard_normal((b, kh, s, h)).astype(np.float32)
    k *= rng.uniform(0.1, 10.0, size=(1, kh, 1, 1)).astype(np.float32)  # heads' norms differ
    return kvlib.LayerKV(
        k=jnp.asarray(k),
        v=jnp.asarray(rng.standard_normal((b, kh, s, h)), jnp.float32),
        lengths=jnp.asarray(lengths, jnp.int32),
        positions=jnp.asarray(positions),
        scores=jnp.asarray(rng.random((b, kh, s)), jnp.float32),
    )


def traced_budgets(policy, n):
    """`policy.row_budgets` for traced lengths `n` `[B]` (the host rule, in jnp)."""
    if policy.budget is None:
        return n
    if isinstance(policy.budget, float):
        return jnp.clip(jnp.ceil(policy.budget * n).astype(jnp.int32), 1, n)
    return jnp.minimum(n, policy.budget)


def context(layer, policy, num_layers=4, sensitivity=None):
    n = layer.lengths[:, 0]
    return Context(
        prompt_lengths=n,
        budgets=traced_budgets(policy, n),
        now=n - 1,
        num_layers=num_layers,
        sensitivity=sensitivity,
    )


def np_keep(scores, positions, length, n_keep, n_recent, n_sink=0):
    """The kept slot set of one (row, kv head): n_recent newest, n_sink oldest, then the highest
    scores (ties to the lower slot) until n_keep."""
    idx = list(range(length))
    n_recent = min(n_recent, n_keep)
    n_sink = min(n_sink, n_keep - n_recent)
    kept = set(sorted(idx, key=lambda s: (-positions[s], s))[:n_recent])
    kept |= set(sorted(idx, key=lambda s: (positions[s], s))[:n_sink])
    rest = [s for s in sorted(idx, key=lambda s: (-scores[s], s)) if s not in kept]
    return kept | set(rest[: max(0, n_keep - len(kept))])


def budget_tokens(budget, n):
    if isinstance(budget, float):
        return max(1, min(n, math.ceil(budget * n)))
    return min(n, budget)


def kept_sets(mask, layer):
    """{(b, k): set of kept slots} from a `[B, K, S]` mask (valid slots only)."""
    mask = np.asarray(mask)
    lengths = np.asarray(layer.lengths)
    return {
        (i, j): {int(s) for s in np.flatnonzero(mask[i, j, : lengths[i, j]])}
        for i in range(mask.shape[0])
        for j in range(mask.shape[1])
    }
