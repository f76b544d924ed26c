"""EffiCache-style head pruning: heads that matter little and attend diffusely keep
only attention sinks and a short window; the others keep a SnapKV budget.

Two criteria per (layer, kv head), per row:
  sensitivity  |dL/dg| summed over the head's G query heads, where g gates each query head's
               output and L is the prompt's next-token loss (first-order Taylor importance,
               Michel et al., 2019), from one `jax.grad` of the model over the prompt;
  entropy      of the head's observation-window attention (SnapKV's votes over the prompt,
               normalised to a distribution): diffuse heads spread their mass thin.
Heads are ranked by low sensitivity and by high entropy; the `prune_ratio` of each layer's kv
heads with the best combined rank are pruned. With `grad_threshold` and `entropy_threshold` set,
the absolute rule applies instead: prune where sensitivity < grad_threshold AND entropy >
entropy_threshold (absolute thresholds depend on the model and prompt; ranks do not). With the
dense `[B, K, S, H]` layout a layer allocates
the unpruned heads' budget for all of its heads; the pruned heads' savings show in
`kv_bytes_used` (real per-head savings need the paged pool).
"""

from __future__ import annotations

import dataclasses
from typing import ClassVar

import jax
import jax.numpy as jnp

from jkv.policies.base import check_int, keep_recent_and_top, valid_slots
from jkv.policies.snapkv import SnapKV
from jkv_models.llama import causal_attention, forward


def head_sensitivity(weights, config, tokens, n_prompt):
    """`[B, L, K]` float32: |d loss / d head gate| per kv head (summed over its query heads)."""
    b, t = tokens.shape
    nl, n, kh = config.num_layers, config.num_heads, config.num_kv_heads
    positions = jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), (b, t))
    real = jnp.arange(t)[None, :] < n_prompt[:, None]

    def loss(gates):  # [B, L, N], all ones
        def attention(layer, q, k, v, pos, cache, carry):
            out = causal_attention(
                q, k, v, pos, pos, sliding_window=config.sliding_window, k_valid=real
            )
            return out * gates[:, layer, None, :, None].astype(out.dtype), cache, carry

        # a layer's activations at a time (a long prompt's whole-model ones do not fit)
        logits, _ = forward(weights, config, tokens, positions, None, attention, remat=True)
        logp = jax.nn.log_softmax(logits[:, :-1], axis=-1)
        nll = -jnp.take_along_axis(logp, tokens[:, 1:, None], axis=-1)[..., 0]
        return jnp.sum(jnp.where(real[:, 1:], nll, 0.0))

    grads = jax.grad(loss)(jnp.ones((b, nl, n), jnp.float32))
    return jnp.abs(grads).reshape(b, nl, kh, n // kh).sum(-1)


def attention_entropy(scores, valid):
    """`[B, K]` entropy of each head's vote distribution over its valid slots."""
    s = jnp.where(valid, jnp.maximum(scores, 0.0), 0.0)
    p = s / jnp.maximum(jnp.sum(s, axis=-1, keepdims=True), 1e-30)
    return -jnp.sum(jnp.where(p > 0, p * jnp.log(jnp.where(p > 0, p, 1.0)), 0.0), axis=-1)


def prune_heads(sensitivity, entropy, prune_ratio: float):
    """`[B, K]` bool: the kv heads to prune (low sensitivity and high entropy ranked together)."""
    kh = sensitivity.shape[-1]
    n_prune = int(round(prune_ratio * kh))
    rank_sens = jnp.argsort(jnp.argsort(sensitivity, axis=-1, stable=True), axis=-1, stable=True)
    rank_ent = jnp.argsort(jnp.argsort(-entropy, axis=-1, stable=True), axis=-1, stable=True)
    combined = rank_sens + rank_ent  # small: unimportant and diffuse
    order = jnp.argsort(combined, axis=-1, stable=True)
    return jnp.argsort(order, axis=-1, stable=True) < n_prune


@dataclasses.dataclass(frozen=True, kw_only=True)
class EffiCache(SnapKV):
    name: ClassVar[str] = "efficache"
    needs_sensitivity: ClassVar[bool] = True

    prune_ratio: float = 0.5
    sink: int = 4
    short_window: int = 16
    grad_threshold: float | None = None
    entropy_threshold: float | None = None

    def __post_init__(self):
        super().__post_init__()
        if not 0.0 <= self.prune_ratio <= 1.0:
            raise ValueError(f"prune_ratio={self.prune_ratio} must be in [0, 1]")
        check_int("sink", self.sink)
        check_int("short_window", self.short_window)
        if (self.grad_threshold is None) != (self.entropy_threshold is None):
            raise ValueError(
                f"grad_threshold={self.grad_threshold} and entropy_threshold="
                f"{self.entropy_threshold}: give both (the absolute rule) or neither"
            )

    def keep(self, layer_index, layer, ctx):
        full = super().keep(layer_index, layer, ctx)  # SnapKV's selection for kept heads
        valid = valid_slots(layer)
        sens = ctx.sensitivity[:, layer_index]
        entropy = attention_entropy(layer.scores, valid)
        if self.grad_threshold is not None:
            pruned = (sens < self.grad_threshold) & (entropy > self.entropy_threshold)
        else:
            pruned = prune_heads(
                sens,
                entropy,
                self.prune_ratio,
            )
        b = ctx.budgets[:, None]
        sink = jnp.minimum(self.sink, b)
        win = jnp.minimum(self.short_window, b - sink)
        short = keep_recent_and_top(jnp.zeros(layer.positions.shape), layer, sink + win, win, sink)
        return jnp.where(pruned[:, :, None], short, full)
