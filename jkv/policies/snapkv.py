"""SnapKV (Li et al., 2024): the prompt's last `window` queries vote for the slots to keep.

Votes are the queries' softmax attention summed over the window and over the G query heads of
each kv head, smoothed by 1-D pooling (`kernel`, avg or max) so neighbours of a hit survive
with it (`jkv_kernels.window_scores`). Each kv head keeps its own top slots; the window
itself is always kept.
"""

from __future__ import annotations

import dataclasses
from typing import ClassVar

import jax.numpy as jnp

from jkv import kv as kvlib
from jkv.policies.base import KVPolicy, check_int, keep_recent_and_top


def window_queries(q, n_new, window: int):
    """The last `window` real queries of each row: q `[B, T, N, H]` -> `[B, N, W, H]`.

    A row shorter than the window repeats its first query in the missing places; the scorer
    ignores those (their slot would be negative)."""
    idx = jnp.clip(n_new[:, None] - window + jnp.arange(window), 0, q.shape[1] - 1)  # [B, W]
    qw = jnp.take_along_axis(q, idx[:, :, None, None], axis=1)  # [B, W, N, H]
    return jnp.swapaxes(qw, 1, 2)


def window_vote(layer, q, n_new, *, window, kernel, pool, score_fn):
    """Pooled window scores `[B, K, S]` float32 of a freshly prefilled layer, by `score_fn`
    (`jkv_kernels.window_scores` or its reference)."""
    k, _ = kvlib.dequantised(layer, q.dtype)  # the scorer reads float keys
    qw = window_queries(q, n_new, window)
    return score_fn(qw, k, layer.lengths, pool=pool, kernel_size=kernel)


@dataclasses.dataclass(frozen=True, kw_only=True)
class SnapKV(KVPolicy):
    """Per-kv-head top-`budget` by observation-window votes; the window always kept.

    `chunked=True` compresses each prefill chunk as it arrives (kvpress calls this chunked
    compression): after every chunk a row keeps its budget's share of the tokens seen so far,
    chosen by the votes of that chunk's last `window` queries, so the cache holds budget + one
    chunk whatever the prompt's length. The default selects once, after the whole prompt, by the
    prompt's last `window` queries (SnapKV's definition)."""

    name: ClassVar[str] = "snapkv"
    observes: ClassVar[bool] = True

    budget: int | float = 256
    window: int = 32
    kernel: int = 7
    pool: str = "avg"
    chunked: bool = False

    def __post_init__(self):
        super().__post_init__()
        check_int("window", self.window, 1)
        if not isinstance(self.chunked, bool):
            raise ValueError(f"chunked={self.chunked!r} must be True or False")
        check_int("kernel", self.kernel, 1)
        if self.kernel % 2 == 0:
            raise ValueError(f"kernel={self.kernel} must be odd (pooling keeps slots centred)")
        if self.pool not in ("avg", "max"):
            raise ValueError(f"pool={self.pool!r} must be 'avg' or 'max'")

    def observe(self, layer_index, layer, q, positions, n_new, mass, kernels):
        if q.shape[1] == 1 or layer.scores is None:  # votes come from the prompt only
            return layer
        votes = window_vote(
            layer,
            q,
            n_new,
            window=self.window,
            kernel=self.kernel,
            pool=self.pool,
            score_fn=kernels.window_scores,
        )
        return layer.replace(scores=votes)

    def keep(self, layer_index, layer, ctx):
        b = self.layer_budgets(layer_index, ctx)
        return keep_recent_and_top(layer.scores, layer, b, jnp.minimum(self.window, b))

    def layer_budgets(self, layer_index, ctx):
        """`[B, 1]` int32 tokens each row keeps in this layer."""
        return ctx.budgets[:, None]
