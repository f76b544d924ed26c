"""Next-token choice: greedy, temperature, top-k, top-p, min-p and the logit keep ratio.

`Sampling` is one request's validated settings (host side). Inside jit every setting is a
per-row array (`SamplingArrays`), so requests with different settings share one compiled step
and a new temperature never recompiles. The filters compose in the order keep-ratio -> top-k ->
top-p -> min-p on temperature-scaled logits, as in Hugging Face.

Row b's n-th token draws from `fold_in(key(seed_b), n)`: a row's samples depend on its own seed
and token index only, never on its place in a batch or on the step the batch is at.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np

SEED_RANGE = (0, 2**64)  # a seed is a 64-bit unsigned integer (two uint32 words of key data)


@dataclasses.dataclass(frozen=True, kw_only=True)
class Sampling:
    temperature: float = 0.0  # 0: greedy
    top_k: int | None = None
    top_p: float | None = None
    min_p: float | None = None
    logit_keep_ratio: float | None = None  # keep only the top fraction of the vocab

    def __post_init__(self):
        t = self.temperature
        if not isinstance(t, int | float) or isinstance(t, bool) or not math.isfinite(t) or t < 0:
            raise ValueError(f"temperature={t!r} must be a finite number >= 0")
        k = self.top_k
        if k is not None and (isinstance(k, bool) or not isinstance(k, int) or not 1 <= k < 2**31):
            raise ValueError(f"top_k={k!r} must be a positive integer (< 2**31) or None")
        for name in ("top_p", "min_p", "logit_keep_ratio"):
            value = getattr(self, name)
            if value is not None and not (
                isinstance(value, int | float) and not isinstance(value, bool) and 0 < value <= 1
            ):
                raise ValueError(f"{name}={value!r} must be in (0, 1] or None")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0 or self.top_k == 1


def check_seed(seed) -> int:
    lo, hi = SEED_RANGE
    if isinstance(seed, bool) or not isinstance(seed, int | np.integer) or not lo <= seed < hi:
        raise ValueError(f"seed={seed!r} must be an integer in [0, 2**64)")
    return int(seed)


def seed_key_data(seed: int) -> np.ndarray:
    """The uint32 `[2]` threefry key data of `jax.random.PRNGKey(seed)`, built on the host."""
    seed = check_seed(seed)
    return np.array([seed >> 32, seed & 0xFFFFFFFF], np.uint32)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class SamplingArrays:
    """Per-row sampling settings, traced data inside jit."""

    temperature: jax.Array  # [B] float32, 0: greedy
    top_k: jax.Array  # [B] int32, 0: off
    top_p: jax.Array  # [B] float32, 1: off
    min_p: jax.Array  # [B] float32, 0: off
    keep_ratio: jax.Array  # [B] float32, 1: off
    key: jax.Array  # [B, 2] uint32 threefry key data of each row's seed

    @staticmethod
    def build(settings: Sequence[Sampling], seeds: Sequence[int]) -> SamplingArrays:
        """One row per (settings, seed) pair, on the host."""

        def col(fn, dtype):
            return jnp.asarray(np.array([fn(s) for s in settings], dtype))

        return SamplingArrays(
            temperature=col(lambda s: s.temperature, np.float32),
            top_k=col(lambda s: s.top_k or 0, np.int32),
            top_p=col(lambda s: 1.0 if s.top_p is None else s.top_p, np.float32),
            min_p=col(lambda s: s.min_p or 0.0, np.float32),
            keep_ratio=col(
                lambda s: 1.0 if s.logit_keep_ratio is None else s.logit_keep_ratio, np.float32
            ),
            key=jnp.asarray(np.stack([seed_key_data(x) for x in seeds])),
        )

    def greedy_rows(self) -> jax.Array:
        return (self.temperature == 0.0) | (self.top_k == 1)


def filter_logits(logits: jax.Array, s: SamplingArrays) -> jax.Array:
    """Applies each row's keep-ratio, top-k, top-p and min-p to `[B, V]` float32 logits."""
    vocab = logits.shape[-1]
    order = -jnp.sort(-logits, axis=-1)  # [B, V] descending
    k = jnp.clip(jnp.ceil(vocab * s.keep_ratio).astype(jnp.int32), 1, vocab)
    k = jnp.where(s.top_k > 0, jnp.minimum(k, s.top_k), k)  # [B]
    kth = jnp.take_along_axis(order, (k - 1)[:, None], axis=-1)  # [B, 1]
    logits = jnp.where(logits < kth, -jnp.inf, logits)
    # top-p on what top-k left: the smallest prefix whose mass reaches top_p (the token that
    # crosses it included).
    kept = jnp.where(jnp.arange(vocab) < k[:, None], order, -jnp.inf)
    probs = jax.nn.softmax(kept, axis=-1)
    before = jnp.cumsum(probs, axis=-1) - probs
    cut = jnp.sum(before < s.top_p[:, None], axis=-1, keepdims=True) - 1
    cutoff = jnp.take_along_axis(kept, jnp.maximum(cut, 0), axis=-1)
    logits = jnp.where((s.top_p[:, None] < 1.0) & (logits < cutoff), -jnp.inf, logits)
    probs = jax.nn.softmax(logits, axis=-1)
    floor = s.min_p[:, None] * jnp.max(probs, axis=-1, keepdims=True)
    return jnp.where(probs < floor, -jnp.inf, logits)


def sample(logits: jax.Array, s: SamplingArrays, index: jax.Array) -> jax.Array:
    """One token per row from `[B, V]` float32 logits; `index` `[B]` is the token's index in
    its row's generation. Returns `[B]` int32."""
    greedy = jnp.argmax(logits, axis=-1).astype(jnp.int32)

    def draw():
        temp = jnp.where(s.temperature > 0, s.temperature, 1.0)[:, None]
        z = filter_logits(logits / temp, s)
        keys = jax.vmap(lambda kd, i: jax.random.fold_in(jax.random.wrap_key_data(kd), i))(
            s.key, index
        )
        return jax.vmap(jax.random.categorical)(keys, z).astype(jnp.int32)

    # All-greedy batches skip the sort: `cond` runs one branch.
    is_greedy = s.greedy_rows()
    sampled = jax.lax.cond(jnp.all(is_greedy), lambda: greedy, draw)
    return jnp.where(is_greedy, greedy, sampled)
