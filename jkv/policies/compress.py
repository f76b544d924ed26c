"""Apply a policy to a prefilled state: select per layer, compact into the smaller capacity."""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import threading

import jax
import jax.numpy as jnp

from jkv import kv as kvlib
from jkv.core.backends import ops
from jkv.policies.base import Context
from jkv.policies.efficache import head_sensitivity


# Not donated: the compacted arrays are smaller, so XLA could not reuse the prompt's buffers;
# the caller drops its reference and they are freed right after.
@functools.partial(
    jax.jit, static_argnames=("config", "policy", "capacities", "backend", "keep_scores")
)
def compress(
    weights,
    config,
    state: kvlib.KVState,
    tokens,
    n_prompt,
    budgets,
    *,
    policy,
    capacities: tuple[int, ...],
    backend: str = "xla",
    keep_scores: bool = False,
) -> kvlib.KVState:
    """Keeps each row's budget of its cache and frees the rest.

    Args:
      weights, config: the model (EffiCache differentiates it over the prompt).
      state: the prefilled state; its slots hold the prompt in order.
      tokens: `[B, T]` the prompt (padded), `n_prompt` `[B]` its real lengths.
      budgets: `[B]` int32 slots each row keeps (`policy.row_budgets`, or an evicting
        policy's `KVState.limit` when a continued state is cut back to size).
      policy: the `KVPolicy.jit_key()`.
      capacities: slots per layer after compression (`policy.capacities(...)`).
      backend: "xla" (jnp compaction) or a Pallas backend (the `kv_compact` kernel).
      keep_scores: keep the per-slot score array (more prompt chunks follow, whose votes it
        receives); otherwise only a policy that accumulates attention mass keeps it.

    Returns:
      The compressed state, its `policy` set so decode steps keep applying it.
    """
    sensitivity = None
    if policy.needs_sensitivity:
        sensitivity = head_sensitivity(weights, config, tokens, n_prompt)
    ctx = Context(
        prompt_lengths=n_prompt,
        budgets=budgets,
        now=state.next_position - 1,
        num_layers=len(state.layers),
        sensitivity=sensitivity,
        layers=state.layers,
    )
    kernels = ops(backend)
    layers = []
    for i, layer in enumerate(state.layers):
        new = policy.rebuild(i, layer, ctx, capacities[i], kernels)
        if new is not None and new.lowrank is not None:  # one factorisation at a time
            ctx = dataclasses.replace(ctx, after=new.lowrank.rank_k.sum().astype(jnp.float32))
        if new is None:
            new = kvlib.compact(
                layer, policy.keep(i, layer, ctx), capacities[i], compact_fn=kernels.kv_compact
            )
        layers.append(new if policy.wants_mass or keep_scores else new.replace(scores=None))
    return state.replace(layers=tuple(layers), policy=policy)


# jaxlib's CPU SVD holds a pool thread while its batch runs on the others, so two SVDs at once
# deadlock a 2-thread pool: `compress` orders the SVDs of one program, this lock the programs.
_FACTORING = threading.Lock()


@contextlib.contextmanager
def factoring(policy):
    """Holds the process's factoring lock while a program of `policy` that factors the cache
    (an SVD) on the CPU runs; the caller waits for its results inside."""
    if not (policy.factorises and jax.default_backend() == "cpu"):
        yield
        return
    with _FACTORING:
        yield


def compress_alone(weights, config, state, *args, policy, **kw) -> kvlib.KVState:
    """`compress`; when the policy factors the cache (an SVD) on the CPU, one such program at a
    time in this process, waited for before the next may start."""
    with factoring(policy):
        return jax.block_until_ready(compress(weights, config, state, *args, policy=policy, **kw))
