"""Ada-KV (Feng et al., 2024): a layer's budget is shared across its kv heads by score.

Heads that concentrate attention need few slots, diffuse ones many. Per row and layer the
`budget * K` slots go to the highest window votes over all kv heads together, after each head
is guaranteed `alpha_safeguard * budget` of its own best; a head holds at most `max_factor *
budget` slots (the layer's physical capacity). With the dense `[B, K, S, H]` layout the layer
allocates that capacity for every head: `result.stats` reports allocated and used bytes apart
(real per-head savings need the paged pool).
"""

from __future__ import annotations

import dataclasses
import math
from typing import ClassVar

import jax.numpy as jnp

from jkv.policies.base import recency_rank, top_n, valid_slots
from jkv.policies.snapkv import SnapKV


@dataclasses.dataclass(frozen=True, kw_only=True)
class AdaKV(SnapKV):
    name: ClassVar[str] = "adakv"

    alpha_safeguard: float = 0.2
    max_factor: float = 2.0

    def __post_init__(self):
        super().__post_init__()
        if not 0.0 <= self.alpha_safeguard <= 1.0:
            raise ValueError(f"alpha_safeguard={self.alpha_safeguard} must be in [0, 1]")
        if self.max_factor < 1.0:
            raise ValueError(f"max_factor={self.max_factor} must be >= 1")

    def layer_budget(self, layer, num_layers, budget):
        return math.ceil(self.max_factor * budget)

    def keep(self, layer_index, layer, ctx):
        b = ctx.budgets[:, None]  # [B, 1]
        valid = valid_slots(layer)
        kh = layer.lengths.shape[1]
        window = valid & (recency_rank(layer) < jnp.minimum(self.window, b)[:, :, None])
        floor = jnp.floor(self.alpha_safeguard * b).astype(jnp.int32)
        own = window | top_n(layer.scores, valid & ~window, floor - jnp.sum(window, -1))
        # The rest of the layer's budget, over every head of the row at once.
        rest = b[:, 0] * kh - jnp.sum(own, axis=(1, 2))  # [B]
        free = valid & ~own
        flat = jnp.where(free, layer.scores, -jnp.inf).reshape(free.shape[0], 1, -1)
        shared = top_n(flat, free.reshape(flat.shape), rest[:, None]).reshape(free.shape)
        keep = own | shared
        # A head cannot hold more than the capacity: keep its best `cap`.
        cap = jnp.minimum(
            jnp.ceil(self.max_factor * b).astype(jnp.int32), ctx.prompt_lengths[:, None]
        )
        prio = jnp.where(own, jnp.inf, layer.scores)
        return top_n(prio, keep, cap)
