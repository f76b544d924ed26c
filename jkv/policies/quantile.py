"""Intra-head quantile pruning: each head keeps the slots above its own
q-quantile of key L1 norm, never one threshold shared by all heads.

Key norms differ by an order of magnitude between heads; a global threshold would empty some
heads and leave others whole. Per head, the top `1 - q` fraction by norm stays (`keep="high"`,
the default). `keep="low"` keeps the smallest norms instead, the rule of kvpress's Knorm
(low-norm keys tend to draw more attention, Devoto et al., 2024). Optional sinks and a recent
window are protected.
"""

from __future__ import annotations

import dataclasses
from typing import ClassVar

import jax.numpy as jnp

from jkv import kv as kvlib
from jkv.policies.base import KVPolicy, check_int, keep_recent_and_top


def key_l1_norms(layer):
    """`[B, K, S]` float32 L1 norm of each stored key (fp8 dequantised)."""
    k, _ = kvlib.dequantised(layer, jnp.float32)
    return jnp.sum(jnp.abs(k), axis=-1)


@dataclasses.dataclass(frozen=True, kw_only=True)
class Quantile(KVPolicy):
    name: ClassVar[str] = "quantile"
    keeps_by_key_norms: ClassVar[bool] = True

    q: float = 0.3  # prune below the 30% quantile: keep 70%
    keep_norms: str = "high"
    window: int = 0
    sink: int = 0
    budget: int | float | None = None  # derived: the kept fraction 1 - q

    def __post_init__(self):
        if isinstance(self.q, bool) or not isinstance(self.q, int | float) or not 0 <= self.q < 1:
            raise ValueError(f"q={self.q!r} must be a quantile in [0, 1)")
        if self.budget is not None and self.budget != 1.0 - float(self.q):
            raise ValueError(f"budget={self.budget!r}: Quantile's budget is 1 - q; set q instead")
        if self.keep_norms not in ("high", "low"):
            raise ValueError(f"keep_norms={self.keep_norms!r} must be 'high' or 'low'")
        check_int("window", self.window)
        check_int("sink", self.sink)
        object.__setattr__(self, "budget", 1.0 - float(self.q) if self.q > 0 else None)
        super().__post_init__()

    @classmethod
    def from_budget(cls, kv_budget) -> Quantile:
        """`kv_budget`: the kept fraction (1 - q)."""
        if not isinstance(kv_budget, float) or not 0 < kv_budget <= 1:
            raise ValueError(f"kv_budget={kv_budget!r}: quantile keeps a fraction in (0, 1]")
        return cls(q=1.0 - kv_budget)

    def jit_key(self):
        key = super().jit_key()
        object.__setattr__(key, "q", 0.0)  # q only sets the budget, which is per-row data
        return key

    def keep(self, layer_index, layer, ctx):
        # the engine's selection over its pages hands the norms in as the scores (no keys)
        norms = key_l1_norms(layer) if layer.k is not None else layer.scores
        score = norms if self.keep_norms == "high" else -norms
        b = ctx.budgets[:, None]
        return keep_recent_and_top(score, layer, b, jnp.minimum(self.window, b), self.sink)
