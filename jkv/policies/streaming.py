"""StreamingLLM (Xiao et al., 2023): attention sinks + a sliding window, as a ring buffer.

The first `sink` tokens and the most recent `budget - sink` stay; once the cache is full each new
token overwrites the oldest non-sink slot, so memory is constant however long generation runs.
Keys are stored before RoPE and rotated on read to their positions *within the cache* (sinks
0..sink-1, then the window contiguously), and so is the query: relative distances never exceed
the cache size, which is what lets generation continue far past the model's trained context.
Angles stay small however far the text has run (no re-rotation of rotated keys by large
negative deltas, which loses float32 precision past a million tokens).

Several new tokens at once (a prefill chunk, a continued state) attend as contiguous text after
the cache, then the cache is cut back to its budget: eviction per chunk; one token at a time it
is the paper's rule exactly.
"""

from __future__ import annotations

import collections
import dataclasses
from typing import ClassVar

import jax.numpy as jnp

from jkv.policies.base import KVPolicy, Ring, check_int, keep_recent_and_top, valid_slots

_BIG = jnp.iinfo(jnp.int32).max


@dataclasses.dataclass(frozen=True, kw_only=True)
class StreamingLLM(KVPolicy):
    """Keeps `sink` attention sinks and a window of recent tokens; `budget` is their total."""

    name: ClassVar[str] = "streaming"
    evicts: ClassVar[bool] = True
    raw_keys: ClassVar[bool] = True

    budget: int | float = 256
    sink: int = 4

    def __post_init__(self):
        super().__post_init__()
        check_int("sink", self.sink)
        if isinstance(self.budget, int) and self.budget <= self.sink:
            raise ValueError(
                f"budget={self.budget} must exceed sink={self.sink} (room for a window)"
            )

    def keep(self, layer_index, layer, ctx):
        b = ctx.budgets[:, None]
        sink = jnp.minimum(self.sink, b)
        return keep_recent_and_top(jnp.zeros(layer.positions.shape), layer, b, b - sink, sink)

    def write_slots(self, layer, q_pos, limit):
        # Full: overwrite the oldest token that is not a sink (positions of sinks are < sink);
        # a budget of `sink` or less keeps `limit - 1` sinks, so one slot always turns over.
        sink = jnp.minimum(self.sink, limit - 1)[:, None, None]
        evictable = valid_slots(layer) & (layer.positions >= sink)
        oldest = jnp.argmin(jnp.where(evictable, layer.positions, _BIG), axis=-1)
        full = layer.lengths >= limit[:, None]
        return jnp.where(full, oldest, layer.lengths).astype(jnp.int32)

    def ring(self, limit):
        return SinkRing(limit, self.sink)

    def cache_positions(self, layer, q_pos):
        # The window is contiguous text: its rank is sink + (position - oldest window position).
        valid = valid_slots(layer)
        window = valid & (layer.positions >= self.sink)
        w_min = jnp.min(jnp.where(window, layer.positions, _BIG), axis=-1)  # [B, K]
        w_min = jnp.where(w_min == _BIG, self.sink, w_min)  # no window yet: identity
        ranks = jnp.where(
            layer.positions < self.sink,
            layer.positions,
            self.sink + layer.positions - w_min[..., None],
        )
        # Every kv head holds the same tokens (the rule ignores content): head 0 speaks for all.
        w0 = w_min[:, :1]  # [B, 1]
        q_rank = jnp.where(q_pos < self.sink, q_pos, self.sink + q_pos - w0)
        return jnp.where(valid, ranks, 0), q_rank


class SinkRing(Ring):
    """StreamingLLM's ring in `jkv.Engine` (`write_slots`' rule on the host): a new token takes
    a free slot while there is one, else the oldest token's past the sinks; the window ranks as
    contiguous text after the sinks (`cache_positions`' ranks). The engine stores every key
    rotated at its text position: the window's distances to a query are then its ranks', and
    the sinks are turned on read by the shift (`jkv_kernels.ragged_paged_attention`)."""

    def __init__(self, limit: int, sink: int):
        self.rank_sink = sink
        super().__init__(limit)

    def reset(self) -> None:
        self.count = 0
        self.window: collections.deque[tuple[int, int]] = collections.deque()  # past the sinks

    def start(self, positions):
        """The ring holds `positions` in slot order (the sinks, then the most recent,
        ascending)."""
        self.count = len(positions)
        first = min(self.rank_sink, self.limit - 1)  # a token from here on may be evicted
        self.window = collections.deque((p, s) for s, p in enumerate(positions) if p >= first)

    def write(self, position):
        """(its slot, the slots held after it, the rank shift: a key past the sinks sits at rank
        position - shift, so the window reads as contiguous text after the sinks, False)."""
        first = min(self.rank_sink, self.limit - 1)
        if self.count < self.limit:
            slot = self.count
            self.count += 1
        else:
            _, slot = self.window.popleft()
        if position >= first:
            self.window.append((position, slot))
        window = (p for p, _ in self.window if p >= self.rank_sink)
        oldest = next(window, None)
        return slot, self.count, 0 if oldest is None else oldest - self.rank_sink, False
