"""Next-token choice: greedy, temperature, top-k, top-p, min-p and the logit keep ratio.

`Sampling` is static under jit (hashable); the filters compose in the order
keep-ratio -> top-k -> top-p -> min-p on temperature-scaled logits, as in Hugging Face.
"""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp


@dataclasses.dataclass(frozen=True, kw_only=True)
class Sampling:
    temperature: float = 0.0  # 0: greedy
    top_k: int | None = None
    top_p: float | None = None
    min_p: float | None = None
    logit_keep_ratio: float | None = None  # seed 2.4: keep only the top fraction of the vocab

    def __post_init__(self):
        t = self.temperature
        if not isinstance(t, int | float) or isinstance(t, bool) or not math.isfinite(t) or t < 0:
            raise ValueError(f"temperature={t!r} must be a finite number >= 0")
        if self.top_k is not None and (not isinstance(self.top_k, int) or self.top_k < 1):
            raise ValueError(f"top_k={self.top_k!r} must be a positive integer or None")
        for name in ("top_p", "min_p", "logit_keep_ratio"):
            value = getattr(self, name)
            if value is not None and not (isinstance(value, int | float) and 0 < value <= 1):
                raise ValueError(f"{name}={value!r} must be in (0, 1] or None")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0 or self.top_k == 1


def _mask_below(logits: jax.Array, threshold: jax.Array) -> jax.Array:
    return jnp.where(logits < threshold, -jnp.inf, logits)


def filter_logits(logits: jax.Array, s: Sampling) -> jax.Array:
    """Applies the keep-ratio, top-k, top-p and min-p filters to `[B, V]` float32 logits."""
    vocab = logits.shape[-1]
    k = vocab
    if s.logit_keep_ratio is not None:
        k = max(1, math.ceil(vocab * s.logit_keep_ratio))
    if s.top_k is not None:
        k = min(k, s.top_k)
    if k < vocab:
        kth = jax.lax.top_k(logits, k)[0][:, -1:]
        logits = _mask_below(logits, kth)
    if s.top_p is not None and s.top_p < 1.0:
        order = jnp.sort(logits, axis=-1)[:, ::-1]
        probs = jax.nn.softmax(order, axis=-1)
        # Keep the smallest prefix whose mass reaches top_p (the token that crosses it included).
        before = jnp.cumsum(probs, axis=-1) - probs
        cutoff_index = jnp.sum(before < s.top_p, axis=-1, keepdims=True) - 1
        cutoff = jnp.take_along_axis(order, cutoff_index, axis=-1)
        logits = _mask_below(logits, cutoff)
    if s.min_p is not None:
        probs = jax.nn.softmax(logits, axis=-1)
        floor = s.min_p * jnp.max(probs, axis=-1, keepdims=True)
        logits = jnp.where(probs < floor, -jnp.inf, logits)
    return logits


def sample(logits: jax.Array, key: jax.Array, s: Sampling) -> jax.Array:
    """Picks one token per row from `[B, V]` float32 logits. Returns `[B]` int32.

    Rows draw from independent streams `fold_in(key, row)`.
    """
    if s.greedy:  # every filter keeps the top token, so greedy ignores them
        return jnp.argmax(logits, axis=-1).astype(jnp.int32)
    logits = filter_logits(logits / s.temperature, s)
    keys = jax.vmap(jax.random.fold_in, (None, 0))(key, jnp.arange(logits.shape[0]))
    return jax.vmap(jax.random.categorical)(keys, logits).astype(jnp.int32)
