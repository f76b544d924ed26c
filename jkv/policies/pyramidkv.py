"""PyramidKV (Cai et al., 2024): more cache in lower layers, less in higher ones.

Attention funnels from broad in early layers to a few tokens in deep ones, so layer l keeps
`f_l * budget` tokens with f falling linearly from 2*beta/(beta+1) at the first layer to
2/(beta+1) at the last (mean 1: the model-wide total matches SnapKV's at the same budget, and
the first layer keeps beta times what the last keeps). Selection inside a layer is SnapKV's.
Layers physically hold different capacities.
"""

from __future__ import annotations

import dataclasses
import math
from typing import ClassVar

import jax.numpy as jnp

from jkv.policies.snapkv import SnapKV


def layer_factor(layer: int, num_layers: int, beta: float) -> float:
    if num_layers == 1:
        return 1.0
    top, bottom = 2 * beta / (beta + 1), 2 / (beta + 1)
    return top - (top - bottom) * layer / (num_layers - 1)


@dataclasses.dataclass(frozen=True, kw_only=True)
class PyramidKV(SnapKV):
    name: ClassVar[str] = "pyramidkv"

    beta: float = 20.0

    def __post_init__(self):
        super().__post_init__()
        if not isinstance(self.beta, int | float) or self.beta < 1:
            raise ValueError(f"beta={self.beta!r} must be a number >= 1")

    def layer_budget(self, layer, num_layers, budget):
        return max(
            1, min(budget * 2, math.ceil(layer_factor(layer, num_layers, self.beta) * budget))
        )

    def layer_budgets(self, layer_index, ctx):
        f = layer_factor(layer_index, ctx.num_layers, self.beta)
        b = jnp.ceil(f * ctx.budgets.astype(jnp.float32)).astype(jnp.int32)
        return jnp.clip(b, 1, ctx.prompt_lengths)[:, None]
