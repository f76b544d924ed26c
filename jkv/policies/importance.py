"""Token importance: how much attention a token receives, fairly counted.

Under causal attention token i can only be attended by the queries at or after it, so raw
accumulated mass favours early tokens; dividing by the number of queries that could see it
gives the average attention it receives. The first `protect` tokens (attention sinks) are
always ranked first: evicting them breaks softmax normalisation (Xiao et al., 2023).
"""

from __future__ import annotations

import jax.numpy as jnp


def token_importance(mass, positions, now, *, protect: int = 4):
    """Importance `[B, K, S]` from accumulated attention `mass` `[B, K, S]` (summed over the
    queries at positions <= `now`, broadcastable to `[B, K, S]`) and slot `positions`."""
    observers = jnp.maximum(now - positions + 1, 1).astype(jnp.float32)
    score = mass / observers
    return jnp.where((positions >= 0) & (positions < protect), jnp.inf, score)
