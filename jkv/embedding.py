"""The response cache's default embedder: the served model's mean-pooled hidden state.

`ModelEmbedder(params)` maps a prompt to the mean of its final-norm hidden states (one causal
pass, no cache); `fit_clusters` fits k-means centroids (`jkv.response_cache.KMeansClusterer`) on
sample prompts. Handed to `jkv.ResponseCache(embedder=..., clusterer=...)`, they give every cached
answer the id of its nearest centroid, its "knowledge group": `cache.invalidate_group(model, id)`
then drops every answer about that topic on every node after the knowledge behind it changes.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

from jkv.kv import bucket
from jkv.params import Params
from jkv.prompt import encode_prompts
from jkv.response_cache.clusters import KMeansClusterer
from jkv_models.llama import hidden_states


@functools.partial(jax.jit, static_argnames=("config",))
def _mean_hidden(weights, config, tokens, n):
    t = tokens.shape[1]
    positions = jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), tokens.shape)
    h = hidden_states(weights, config, tokens, positions).astype(jnp.float32)  # [B, T, D]
    real = (jnp.arange(t)[None, :] < n[:, None])[..., None]
    return jnp.sum(jnp.where(real, h, 0.0), axis=1) / jnp.maximum(n, 1)[:, None]


class ModelEmbedder:
    """prompt (str or token ids) -> `[D]` float32: the mean of the model's final hidden states
    over the prompt's first `max_tokens` tokens."""

    def __init__(self, params: Params, *, max_tokens: int = 512):
        if not isinstance(params, Params):
            raise ValueError(f"params is a {type(params).__name__}; expected jkv.Params")
        if not isinstance(max_tokens, int) or max_tokens < 1:
            raise ValueError(f"max_tokens={max_tokens!r} must be a positive integer")
        self.params, self.max_tokens = params, max_tokens

    def embed_batch(self, prompts) -> np.ndarray:
        rows, _ = encode_prompts(self.params, list(prompts))
        rows = [r[: self.max_tokens] for r in rows]
        t = bucket(max(len(r) for r in rows))
        tokens = np.zeros((len(rows), t), np.int32)
        for i, r in enumerate(rows):
            tokens[i, : len(r)] = r
        n = jnp.asarray([len(r) for r in rows], jnp.int32)
        return np.asarray(
            _mean_hidden(self.params.weights, self.params.config, jnp.asarray(tokens), n)
        )

    def __call__(self, prompt) -> np.ndarray:
        return self.embed_batch([prompt])[0]


def fit_clusters(
    embedder: ModelEmbedder, sample_prompts, k: int, *, seed: int = 0, batch: int = 16
) -> KMeansClusterer:
    """k-means centroids over the embeddings of `sample_prompts` (the knowledge groups)."""
    prompts = list(sample_prompts)
    if len(prompts) < k:
        raise ValueError(f"{len(prompts)} sample prompts cannot make k={k} clusters")
    vectors = np.concatenate(
        [embedder.embed_batch(prompts[i : i + batch]) for i in range(0, len(prompts), batch)]
    )
    return KMeansClusterer.fit(vectors, k, seed=seed)
