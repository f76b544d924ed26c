"""KVzip (Kim et al., 2025, "KVzip: Query-Agnostic KV Cache Compression with Context
Reconstruction"): a KV pair matters as much as the model needs it to repeat the context.

After the prompt is prefilled, the model is fed a reconstruction request ("Repeat the previous
context exactly.", the chat's turn change, then the context itself, teacher-forced) over the
prompt's cache. Slot s of kv head k in layer l scores the most attention any query of that
replay gives it, over the replay's queries and the G query heads of k:

    score[l, k, s] = max_{t, g} softmax_s'(q[t, g] . k[s'] / sqrt(H))[s]

the softmax running over the piece of the context being replayed, the `sink` first tokens and
the replay's own earlier tokens (causal), as kvpress computes it. The question plays no part, so
one compressed context can serve any question (the question-agnostic protocol). Long contexts
are replayed in pieces of `chunk` tokens (each piece's request names the 8 tokens before it, as
the paper's code does). The context is the prompt after the chat's own prefix (system turn, user
header): the prefix is never replayed and scores 0, but for the `sink` first tokens, which are
always kept.

Selection: `layerwise=False` (the paper's and kvpress's default) ranks every (layer, kv head,
slot) of the row together, so layers and heads that need more keep more; `layerwise=True` gives
each layer `budget` slots per kv head, shared across its heads. With `max_factor` set no head
holds more than `max_factor * budget` slots (as in Ada-KV: the kept set is the best
`budget * heads` entries among each head's best `max_factor * budget`), which bounds the dense
layout's allocation; by default (None) a head may keep up to its whole prompt, as kvpress's: on
SmolLM2 a cap of 4x the budget lost needles at 10% that the uncapped rule kept (7/10 against
10/10 on selection prompts, seed 1 of `benchmarks/quality_real.py`). The dense one-shot state
then allocates the prompt for every head (`kv_bytes_used` reports what is kept).

The replay costs about one more prefill of the prompt (`jkv.reconstruct`). In the notation of
the reference implementation (github.com/snu-mllab/KVzip, kvpress's `KVzipPress`), without its
KVzip+ normalisation.
"""

from __future__ import annotations

import dataclasses
import math
from typing import ClassVar

import jax
import jax.numpy as jnp

from jkv import kv as kvlib
from jkv.policies.base import KVPolicy, check_int, top_n, valid_slots

REPEAT = "\n\nRepeat the previous context exactly."
REPEAT_PART = "\n\nRepeat the part of the previous context exactly, starting with"
OVERLAP = 8  # tokens of the piece before, named in a later piece's request


def replay_scores(layer: kvlib.LayerKV, q, positions, n_new, tile: int = 64) -> jnp.ndarray:
    """`[B, K, S]` float32: the most attention any of the replay's queries (q `[B, T, N, H]`
    rotated, at `positions` `[B, T]`, the first `n_new` `[B]` real) gives each slot of
    `layer` (which already holds the replay's own tokens), over the G heads of each kv head.
    The softmax runs over the slots whose `layer.scores` is >= 0 (the pass's piece of the
    context, the sinks and the replay itself: kvpress's `_compute_cross_attention`); the others
    score -1. Queries go `tile` at a time (T a multiple of it, or all at once), so the scores
    never fill a `[T, S]` array per head.

    In the log domain: max_t softmax(z_t)[s] = exp(max_t (z[t, s] - lse_t)), so each query's
    log-sum-exp is its one pass over the slots' exponentials, and a slot's score one exp at
    the end (a third less time on SmolLM2's 2K replay than normalising every probability)."""
    b, t, n, h = q.shape
    kh = layer.k.shape[1]
    g = n // kh
    k, _ = kvlib.dequantised(layer, jnp.float32)
    part = valid_slots(layer) & (layer.scores >= 0)  # [B, K, S]
    # A slot outside the part is never seen: its position past every query's.
    seen_from = jnp.where(part, layer.positions, jnp.iinfo(jnp.int32).max)  # [B, K, S]
    tile = tile if t % tile == 0 else t
    # A tile's queries of kv head k as one [G * tile, H] matrix: one plain matmul per kv head
    # (SmolLM2's 2K replay: 1.4x faster than the einsum over [tile, K, G, H] queries)
    qg = (q.astype(jnp.float32) * h**-0.5).reshape(b, t // tile, tile, kh, g, h)
    qg = jnp.transpose(qg, (1, 0, 3, 4, 2, 5)).reshape(t // tile, b, kh, g * tile, h)
    last = jnp.where(jnp.arange(t) < n_new[:, None], positions, -1)  # padding sees nothing
    last = jnp.moveaxis(last.reshape(b, t // tile, tile), 1, 0)

    def one(args):  # a tile of queries -> [B, K, S]: the most z - lse any of them gives
        qt, lt = args
        z = jnp.einsum("bkqh,bksh->bkqs", qt, k, precision="highest").reshape(b, kh, g, tile, -1)
        seen = seen_from[:, :, None, :] <= lt[:, None, :, None]  # [B, K, T, S]
        z = jnp.where(seen[:, :, None], z, -jnp.inf)
        top = jnp.max(z, axis=-1, keepdims=True)
        top = jnp.where(jnp.isfinite(top), top, 0.0)
        total = jnp.sum(jnp.exp(z - top), axis=-1, keepdims=True)
        lse = top + jnp.log(jnp.maximum(total, 1e-30))
        return jnp.max(z - lse, axis=(2, 3))

    return jnp.where(part, jnp.exp(jnp.max(jax.lax.map(one, (qg, last)), axis=0)), -1.0)


@dataclasses.dataclass(frozen=True, kw_only=True)
class KVzip(KVPolicy):
    """Keeps the slots the model attends to most while repeating the context."""

    name: ClassVar[str] = "kvzip"
    observes: ClassVar[bool] = True  # the state carries a score per slot
    needs_replay: ClassVar[bool] = True  # scored by `jkv.reconstruct` after the prompt

    budget: int | float = 256
    sink: int = 4
    layerwise: bool = False
    max_factor: float | None = None  # None: a head may keep its whole prompt
    chunk: int = 2048  # context tokens replayed per pass
    replaying: bool = False  # the jit key of the replay pass (its queries score the slots)

    def __post_init__(self):
        super().__post_init__()
        check_int("sink", self.sink)
        check_int("chunk", self.chunk, 16)
        for name in ("layerwise", "replaying"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name}={getattr(self, name)!r} must be True or False")
        if self.max_factor is not None and (
            isinstance(self.max_factor, bool)
            or not isinstance(self.max_factor, int | float)
            or self.max_factor < 1
        ):
            raise ValueError(f"max_factor={self.max_factor!r} must be None or a number >= 1")

    def replay_key(self) -> KVzip:
        """The jit key of the replay pass: its attention scores the prompt's slots."""
        key = self.jit_key()
        object.__setattr__(key, "replaying", True)
        return key

    def layer_budget(self, layer, num_layers, budget):
        return budget if self.max_factor is None else math.ceil(self.max_factor * budget)

    def capacities(self, num_layers, prompt_lengths, max_new_tokens):
        if self.max_factor is not None:
            return super().capacities(num_layers, prompt_lengths, max_new_tokens)
        # any head may keep its whole prompt: the dense layout allocates it for every head
        whole = kvlib.capacity_bucket(max(prompt_lengths)) + kvlib.headroom(max_new_tokens)
        return (whole,) * num_layers

    def observe(self, layer_index, layer, q, positions, n_new, mass, kernels):
        if not self.replaying or layer.scores is None:  # the prompt's own prefill: nothing
            return layer
        return layer.replace(scores=replay_scores(layer, q, positions, n_new))

    def keep(self, layer_index, layer, ctx):
        if ctx.layers is None:
            raise ValueError("KVzip selects over every layer at once: compress with ctx.layers")
        if self.layerwise:
            return self._layer_keep(layer_index, ctx)
        return self.keep_all(ctx)[:, layer_index]

    def keep_all(self, ctx) -> jnp.ndarray:
        """`[B, L, K, S]` bool: every layer's kept slots at once (the engine's selection)."""
        if self.layerwise:
            return jnp.stack([self._layer_keep(i, ctx) for i in range(len(ctx.layers))], 1)
        scores, candidates = self._candidates(ctx)
        b = scores.shape[0]
        flat = scores.reshape(b, 1, -1)
        n = scores.shape[1] * scores.shape[2]
        chosen = top_n(flat, candidates.reshape(flat.shape), (ctx.budgets * n)[:, None])
        return chosen.reshape(scores.shape)

    def _candidates(self, ctx):
        """(`[B, L, K, S]` scores, the sinks' infinite; the slots each head may keep: its best
        `cap`)."""
        scores = jnp.stack([x.scores for x in ctx.layers], axis=1)  # [B, L, K, S]
        b, nl, kh, s = scores.shape
        valid = jnp.stack([valid_slots(x) for x in ctx.layers], axis=1)
        positions = jnp.stack([x.positions for x in ctx.layers], axis=1)
        sinks = valid & (positions < self.sink)
        scores = jnp.where(sinks, jnp.inf, scores)
        # A head holds at most `cap` slots: only each head's best `cap` are candidates.
        cap = ctx.prompt_lengths
        if self.max_factor is not None:
            cap = jnp.minimum(jnp.ceil(self.max_factor * ctx.budgets).astype(jnp.int32), cap)
        candidates = top_n(
            scores.reshape(b, nl * kh, s), valid.reshape(b, nl * kh, s), cap[:, None]
        ).reshape(scores.shape)
        return scores, candidates

    def _layer_keep(self, layer_index, ctx):
        scores, candidates = self._candidates(ctx)
        b, _, kh, s = scores.shape
        flat = scores[:, layer_index].reshape(b, 1, kh * s)
        allowed = candidates[:, layer_index].reshape(flat.shape)
        return top_n(flat, allowed, (ctx.budgets * kh)[:, None]).reshape(b, kh, s)
