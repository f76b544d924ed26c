"""The XLA attention path, poisoned the way the Pallas kernels are tested: slots past each row's
length hold NaN and must not reach the output."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest

from jkv import kv as kvlib
from jkv.core.attention import cached_attention_reference


def _layer(rng, lengths, s=24, kh=2, h=8, poison=np.nan):
    b = len(lengths)
    k = rng.standard_normal((b, kh, s, h)).astype(np.float32)
    v = rng.standard_normal((b, kh, s, h)).astype(np.float32)
    positions = np.tile(np.arange(s, dtype=np.int32), (b, kh, 1))
    for i, n in enumerate(lengths):
        k[i, :, n:] = poison
        v[i, :, n:] = poison
        positions[i, :, n:] = -1
    lengths = np.repeat(np.asarray(lengths, np.int32)[:, None], kh, 1)
    return kvlib.LayerKV(
        k=jnp.asarray(k),
        v=jnp.asarray(v),
        lengths=jnp.asarray(lengths),
        positions=jnp.asarray(positions),
    )


def _np_attention(q, layer, q_pos):
    """float64 numpy: softmax over each row's valid, causal slots."""
    k, v = np.asarray(layer.k, np.float64), np.asarray(layer.v, np.float64)
    b, t, n, h = q.shape
    kh = k.shape[1]
    out = np.zeros((b, t, n, h))
    for i in range(b):
        for j in range(t):
            for head in range(n):
                g = head // (n // kh)
                m = int(np.asarray(layer.lengths)[i, g])
                keep = [s for s in range(m) if np.asarray(layer.positions)[i, g, s] <= q_pos[i, j]]
                z = k[i, g, keep] @ q[i, j, head] / np.sqrt(h)
                p = np.exp(z - z.max())
                out[i, j, head] = (p / p.sum()) @ v[i, g, keep]
    return out


@pytest.mark.parametrize("t", [1, 3])
def test_nan_past_the_length_never_reaches_the_output(t):
    rng = np.random.default_rng(t)
    lengths = [5, 17, 24]
    layer = _layer(rng, lengths)
    q = rng.standard_normal((3, t, 4, 8)).astype(np.float32)
    q_pos = np.array([[n - t + j for j in range(t)] for n in lengths], np.int32)
    out, mass = cached_attention_reference(
        jnp.asarray(q), jnp.asarray(q_pos), layer, return_mass=True
    )
    assert np.isfinite(np.asarray(out)).all() and np.isfinite(np.asarray(mass)).all()
    np.testing.assert_allclose(np.asarray(out), _np_attention(q, layer, q_pos), atol=2e-5)
