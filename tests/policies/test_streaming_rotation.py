"""StreamingLLM attends as if the cache were contiguous text (sinks 0..sink-1, the window after),
at any distance into the text: checked against numpy and against the model run from scratch."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jkv
from jkv import kv as kvlib
from jkv.core.attention import make_attention
from jkv.scoring import score

SINK, BUDGET = 4, 8
H, KH, G = 16, 2, 2


def np_rope(x, pos, inv_freq):
    ang = np.asarray(pos, np.float64)[..., None] * inv_freq.astype(np.float64)
    ang = np.concatenate([ang, ang], -1)
    half = x.shape[-1] // 2
    rot = np.concatenate([-x[..., half:], x[..., :half]], -1)
    return x * np.cos(ang) + rot * np.sin(ang)


def np_streaming_outputs(qs, ks, vs, positions, inv_freq, chunk):
    """Token by token (then one chunk of `chunk` tokens): StreamingLLM's cache and attention in
    float64. Returns the outputs `[n, N, H]`."""
    cache, outs = [], []  # cache: list of (position, k [KH, H], v [KH, H])

    def ranks(entries):
        window = [p for p, _, _ in entries if p >= SINK]
        w_min = min(window) if window else SINK
        return [p if p < SINK else SINK + p - w_min for p, _, _ in entries]

    def attend(q, q_rank, entries, r):
        k = np.stack([np_rope(e[1], rr, inv_freq) for e, rr in zip(entries, r, strict=True)])
        v = np.stack([e[2] for e in entries])  # [S, KH, H]
        qr = np_rope(q, q_rank, inv_freq).reshape(KH, G, H)
        z = np.einsum("kgh,skh->kgs", qr, k) / np.sqrt(H)
        p = np.exp(z - z.max(-1, keepdims=True))
        p /= p.sum(-1, keepdims=True)
        return np.einsum("kgs,skh->kgh", p, v).reshape(KH * G, H)

    n = len(positions)
    for i in range(n - chunk):  # decode: evict the oldest non-sink, write, attend
        if len(cache) >= BUDGET:
            oldest = min((e for e in cache if e[0] >= SINK), key=lambda e: e[0])
            cache.remove(oldest)
        cache.append((positions[i], ks[i], vs[i]))
        r = ranks(cache)
        outs.append(attend(qs[i], r[-1], cache, r))
    if chunk:  # a chunk: appended whole, each query sees the cache and the chunk up to itself
        cache += [(positions[i], ks[i], vs[i]) for i in range(n - chunk, n)]
        r = ranks(cache)
        base = len(cache) - chunk
        for j in range(chunk):
            upto = base + j + 1
            outs.append(attend(qs[n - chunk + j], r[upto - 1], cache[:upto], r[:upto]))
    return np.stack(outs)


@pytest.mark.parametrize("backend", ["xla", "pallas_interpret"])
@pytest.mark.parametrize("offset", [0, 10**6, 10**7])
def test_attention_equals_numpy_at_contiguous_cache_positions(backend, offset):
    rng = np.random.default_rng(offset % 97)
    n_decode, chunk = 14, 3
    n = n_decode + chunk
    positions = list(range(SINK)) + [offset + SINK + i for i in range(n - SINK)]
    qs = rng.standard_normal((n, KH * G, H))
    ks = rng.standard_normal((n, KH, H))
    vs = rng.standard_normal((n, KH, H))
    inv_freq = 1.0 / (10000.0 ** (np.arange(0, H, 2) / H))
    policy = jkv.StreamingLLM(budget=BUDGET, sink=SINK).jit_key()
    limit = jnp.asarray([BUDGET], jnp.int32)
    state = kvlib.init_state(
        num_layers=1,
        batch=1,
        num_kv_heads=KH,
        head_dim=H,
        capacity=BUDGET,
        dtype="float32",
        policy=policy,
        limit=limit,
    )
    layer = state.layers[0]

    def call(i, j, layer, be):
        attend = make_attention(
            jnp.asarray([j - i], jnp.int32),
            sliding_window=None,
            backend=be,
            policy=policy,
            limit=limit,
            inv_freq=jnp.asarray(inv_freq, jnp.float32),
        )
        f32 = lambda x: jnp.asarray(x[None, i:j], jnp.float32)  # noqa: E731
        pos = jnp.asarray([positions[i:j]], jnp.int32)
        out, layer, _ = attend(0, f32(qs), f32(ks), f32(vs), pos, layer, None)
        return out, layer

    got = []
    for i in range(n_decode):
        out, layer = call(i, i + 1, layer, backend)
        got.append(np.asarray(out)[0, 0])
    layer = kvlib.pad_slots(layer, chunk)  # room for the chunk, as a continued state gets
    out, layer = call(n_decode, n, layer, "xla")
    got.extend(np.asarray(out)[0])
    want = np_streaming_outputs(qs, ks, vs, positions, inv_freq, chunk)
    err = np.abs(np.stack(got) - want).max() / np.abs(want).max()
    assert err < 2e-6, f"relative error {err:.2e} at positions from {offset}"


@pytest.fixture(scope="module")
def one_layer(tiny_params):
    """A 1-layer model: a token's K and V depend on the token alone, so StreamingLLM's cache
    equals the model's own cache for the kept tokens at contiguous positions."""
    return tiny_params("llama", num_layers=1)


def _kept(seq, budget=16, sink=SINK):
    return seq if len(seq) <= budget else seq[:sink] + seq[-(budget - sink) :]


def test_decode_equals_the_model_on_the_kept_tokens(one_layer):
    params = one_layer
    rng = np.random.default_rng(5)
    prompt = rng.integers(3, params.config.vocab_size, 24).tolist()
    out = jkv.generate(
        params, prompt, max_new_tokens=30, kv_policy=jkv.StreamingLLM(budget=16, sink=SINK)
    )
    seq = list(prompt)
    want = [int(np.argmax(jkv.logits(params, [seq])[0, -1]))]  # prefill sees the whole prompt
    for _ in range(29):
        seq.append(want[-1])
        want.append(int(np.argmax(jkv.logits(params, [_kept(seq)])[0, -1])))
    assert out.tokens == want


def test_continued_state_equals_the_model_on_the_kept_tokens(one_layer):
    params = one_layer
    rng = np.random.default_rng(6)
    context = rng.integers(3, params.config.vocab_size, 40).tolist()
    question = rng.integers(3, params.config.vocab_size, 6).tolist()
    state = jkv.prefill(params, context, kv_policy=jkv.StreamingLLM(budget=16, sink=SINK))
    got = score(params, question, kv_state=state)
    seq = _kept(context) + question
    logp = np.asarray(jax.nn.log_softmax(jkv.logits(params, [seq])[0], axis=-1))
    want = np.array([logp[15 + i, question[i]] for i in range(1, len(question))])
    np.testing.assert_allclose(got, want, atol=2e-5)


def test_streaming_with_a_sliding_window_model_is_refused(tiny_params):
    params = tiny_params("mistral", sliding_window=8)
    with pytest.raises(ValueError, match="sliding_window=8"):
        jkv.generate(params, [5, 6, 7], kv_policy="streaming", kv_budget=32)
