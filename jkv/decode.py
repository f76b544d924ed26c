"""The fused decode loop: sample the first token, then `lax.while_loop` over model steps.

jit sits at `start` and `decode`; the loop state (the KV state inside it) is donated at both,
so the caller's copy is consumed and the new one returned. Rows are independent: each has its
own position clock, settings, budget and stop flag, and a finished row neither writes the cache
nor advances.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp

from jkv import kv as kvlib
from jkv.core.sampling import SamplingArrays, sample
from jkv.core.step import model_step, next_positions
from jkv_models.config import ModelConfig


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class DecodeState:
    """The decode loop's carry. Every per-request setting is a per-row array."""

    kv: kvlib.KVState
    tokens: jax.Array  # [B, M] int32 generated ids (M: the max_new_tokens bucket), -1 where none
    count: jax.Array  # [B] int32 tokens generated so far per row
    max_new: jax.Array  # [B] int32 each row's max_new_tokens (<= M)
    done: jax.Array  # [B] bool: row hit eos / a stop string / its max_new_tokens
    last: jax.Array  # [B] int32 last generated token (input of the next step)
    sampling: SamplingArrays  # per-row settings and seeds
    step: jax.Array  # [] int32 decode steps run so far


def is_stop(tok: jax.Array, eos_ids: tuple[int, ...]) -> jax.Array:
    if not eos_ids:
        return jnp.zeros(tok.shape, bool)
    return jnp.isin(tok, jnp.asarray(eos_ids, jnp.int32))


@functools.partial(jax.jit, static_argnames=("eos_ids", "slots"), donate_argnames=("kv",))
def start(
    logits,
    kv: kvlib.KVState,
    sampling: SamplingArrays,
    max_new,
    *,
    eos_ids: tuple[int, ...],
    slots: int,
) -> DecodeState:
    """Samples each row's first token from the prefill logits and builds the loop state with
    `slots` (the max_new_tokens bucket) places per row."""
    b = logits.shape[0]
    first = sample(logits, sampling, jnp.zeros((b,), jnp.int32))
    tokens = jnp.full((b, slots), -1, jnp.int32).at[:, 0].set(first)
    return DecodeState(
        kv=kv,
        tokens=tokens,
        count=jnp.ones((b,), jnp.int32),
        max_new=max_new,
        done=is_stop(first, eos_ids) | (max_new <= 1),
        last=first,
        sampling=sampling,
        step=jnp.zeros((), jnp.int32),
    )


def decode_step(
    weights,
    config: ModelConfig,
    s: DecodeState,
    *,
    eos_ids: tuple[int, ...],
    backend: str,
) -> DecodeState:
    """One token for every unfinished row (finished rows neither write the cache nor advance)."""
    active = ~s.done
    n_new = active.astype(jnp.int32)
    logits, kv = model_step(
        weights,
        config,
        s.kv,
        s.last[:, None],
        next_positions(s.kv, 1),
        n_new,
        policy=s.kv.policy,
        backend=backend,
        logits_at=jnp.zeros_like(n_new),
    )
    tok = sample(logits, s.sampling, s.count)
    rows = jnp.arange(tok.shape[0])
    # A finished row writes at index M, which the scatter drops.
    tokens = s.tokens.at[rows, jnp.where(active, s.count, s.tokens.shape[1])].set(tok, mode="drop")
    count = s.count + n_new
    done = s.done | (active & is_stop(tok, eos_ids)) | (count >= s.max_new)
    return dataclasses.replace(
        s,
        kv=kv,
        tokens=tokens,
        count=count,
        done=done,
        last=jnp.where(active, tok, s.last),
        step=s.step + 1,
    )


@functools.partial(
    jax.jit,
    static_argnames=("config", "eos_ids", "backend"),
    donate_argnames=("state",),
)
def decode(
    weights,
    config: ModelConfig,
    state: DecodeState,
    limit: jax.Array,
    *,
    eos_ids: tuple[int, ...],
    backend: str = "xla",
) -> DecodeState:
    """Runs decode steps until every row is done or `state.step` reaches `limit`.

    `limit` is traced, so streaming (one step per call) and whole-request decoding share one
    compiled loop; so are the sampling settings, budgets and max_new_tokens of every row.
    """
    step = functools.partial(decode_step, weights, config, eos_ids=eos_ids, backend=backend)
    return jax.lax.while_loop(lambda s: (s.step < limit) & ~jnp.all(s.done), step, state)
