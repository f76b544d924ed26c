"""THE model step: the one place the model runs over a KV state.

`model_step` feeds T new tokens per row (row b's first `n_new[b]` are real, the rest padding)
at the given positions through the model, writing them into the cache as each layer attends,
and returns the logits and the advanced state. Prefill (T = the prompt bucket), each decode step
of the fused loop (T = 1), teacher-forced scoring and continuation of a prefilled state all call
it; the engine's runner will too, with positions from each request on the host.

The policy comes with the step, not from the state: an engine batch may hold states the one-shot
path never built. `jkv.generate` passes the policy its state was compressed by.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jkv import kv as kvlib
from jkv.core.attention import make_attention
from jkv_models.config import ModelConfig
from jkv_models.llama import forward


def model_step(
    weights,
    config: ModelConfig,
    kv: kvlib.KVState,
    tokens: jax.Array,
    positions: jax.Array,
    n_new: jax.Array,
    *,
    policy=None,
    backend: str = "xla",
    logits_at: jax.Array | None = None,
) -> tuple[jax.Array, kvlib.KVState]:
    """Runs `tokens` `[B, T]` at `positions` `[B, T]` over `kv` (traced; call inside jit).

    Args:
      weights, config: the model.
      kv: the state the tokens continue; its `limit` holds each row's budget.
      tokens: `[B, T]` int32 ids; `positions`: `[B, T]` int32 text positions.
      n_new: `[B]` int32 real tokens per row (0: the row neither writes nor advances).
      policy: the KV policy's `jit_key()` (None: the full cache).
      backend: "xla", "pallas" or "pallas_interpret" (`jkv.core.backends`).
      logits_at: `[B]` int32 index of the one token per row whose logits are wanted; None: all.

    Returns:
      (float32 logits `[B, V]` (or `[B, T, V]` without `logits_at`), the state with the real
      tokens written and `next_position` advanced by `n_new`).
    """
    attend = make_attention(
        n_new,
        sliding_window=config.sliding_window,
        backend=backend,
        policy=policy,
        limit=kv.limit,
        inv_freq=jnp.asarray(config.inv_freq()),
    )
    logits, layers = forward(
        weights, config, tokens, positions, kv.layers, attend, logits_at=logits_at
    )
    return logits, kv.replace(layers=layers, next_position=kv.next_position + n_new)


def next_positions(kv: kvlib.KVState, t: int) -> jax.Array:
    """`[B, T]` int32 positions of T tokens that continue each row of `kv`."""
    return kv.next_position[:, None] + jnp.arange(t, dtype=jnp.int32)


def flat_step(weights, config: ModelConfig, tokens, positions, attend, logits_at, pool):
    """THE model over one flattened batch of tokens `[T]` at `positions` `[T]` (the engine's
    rows one after another; `attend` knows which token is whose, `jkv.core.paged`), the page
    `pool` (a dict of arrays) carried from layer to layer. Returns (float32 logits `[R, V]` at
    the `logits_at` `[R]` tokens, what the layers returned as cache entries, stacked, the
    pool)."""
    logits, entries, pool = forward(
        weights, config, tokens[None], positions[None], None, attend, logits_at=logits_at[None],
        carry=pool,
    )  # fmt: skip
    return logits[0], entries, pool
