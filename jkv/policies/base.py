"""The KV policy interface: one frozen keyword-only dataclass per policy, one file each.

A policy acts at two moments:
  after prefill   `keep` selects, per layer, the slots of the prompt's cache to keep; the
                  compaction (`jkv.kv.compact`, a bit-packed keep mask) then copies them
                  into a smaller cache: what is dropped is gone from device memory;
  during decode   `write_slots` says where each new token goes (an evicting policy frees a
                  slot once the cache is full), `cache_positions` may re-rotate keys, and
                  `observe` records what the policy scores by (attention mass, window scores).

Budgets are a token count (int >= 1) or a ratio of each row's prompt (float in (0, 1)). A row
keeps `budget_tokens(len)` prompt tokens; an evicting policy's budget is also the size of the
row's cache while decoding, whatever the prompt (`row_limit`). Physical capacities (static,
shared by the batch) are buckets (`jkv.kv.capacity_bucket`) of the largest row's need, plus decode
headroom for policies that do not evict; every row keeps and evicts by its own budget, so a
row of a batch holds exactly what it would hold alone. Sizes are plain Python (host side);
selections run inside jit, where the budget is per-row data (`Context.budgets`,
`KVState.limit`) and the policy object is its `jit_key()`: a new budget never recompiles.
"""

from __future__ import annotations

import collections
import copy
import dataclasses
import math
from collections.abc import Sequence
from typing import ClassVar

import jax
import jax.numpy as jnp
import numpy as np

from jkv import kv as kvlib

MAX_BUDGET = 2**31 - 1  # budgets travel into compiled code as int32


def check_budget(budget) -> None:
    if isinstance(budget, bool) or not isinstance(budget, int | float):
        raise ValueError(f"budget={budget!r} must be a token count (int >= 1) or a ratio in (0, 1)")
    if isinstance(budget, int) and not 1 <= budget <= MAX_BUDGET:
        raise ValueError(f"budget={budget} must be in [1, {MAX_BUDGET}] tokens")
    if isinstance(budget, float) and not 0.0 < budget < 1.0:
        raise ValueError(f"budget={budget} must be a ratio in (0, 1) (or an int token count)")


def check_int(name: str, value, low: int = 0) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < low:
        raise ValueError(f"{name}={value!r} must be an integer >= {low}")


@dataclasses.dataclass(frozen=True)
class Context:
    """What `keep` knows about the batch being compressed (all traced arrays)."""

    prompt_lengths: jax.Array  # [B] int32 real tokens per row
    budgets: jax.Array  # [B] int32 tokens each row keeps
    now: jax.Array  # [B] int32 position of each row's last token
    num_layers: int
    sensitivity: jax.Array | None = None  # [B, L, K] float32 (EffiCache)
    layers: tuple | None = None  # every layer's LayerKV (KVzip ranks all layers together)
    # A float32 scalar the layer's rebuild must read before it factors (the previous layer's
    # factorisation, so no two run at once: see `segments.lowrank_store`)
    after: jax.Array | None = None


# name -> policy class (None: the full cache), as each policy's module defines it
REGISTRY: dict[str, type | None] = {"full": None}


@dataclasses.dataclass(frozen=True, kw_only=True)
class KVPolicy:
    """Base: keeps everything; subclasses override what they change."""

    name: ClassVar[str] = "full"
    wants_mass: ClassVar[bool] = False  # accumulate attention mass into `LayerKV.scores`
    observes: ClassVar[bool] = False  # fills `LayerKV.scores` during prefill
    evicts: ClassVar[bool] = False  # fixed size during decode (frees a slot per token)
    needs_sensitivity: ClassVar[bool] = False  # EffiCache: head sensitivity by jax.grad
    needs_replay: ClassVar[bool] = False  # KVzip: scored by replaying the context (jkv.replay)
    keeps_by_key_norms: ClassVar[bool] = False  # Quantile: its scores are the keys' norms
    raw_keys: ClassVar[bool] = False  # keys stored before RoPE, rotated by `cache_positions`
    factorises: ClassVar[bool] = False  # its rebuild runs an SVD (`compress_alone`)
    # jkv.Engine serves it: by default a policy that selects once (`keep`), or one that evicts
    # while decoding and gives the engine its ring (`ring`); not one that rebuilds the cache
    # unless it says so (the segment rebuild: `jkv.engine.rebuild`)
    served: ClassVar[bool] = True

    @property
    def rebuilds(self) -> bool:
        """Its `rebuild` replaces the cache (the segment rebuild), rather than `keep` choosing
        slots of it."""
        return type(self).rebuild is not KVPolicy.rebuild

    def __init_subclass__(cls, **kwargs):
        """A subclass naming itself (`name`) is a policy by that name (`jkv.policies.POLICIES`,
        `kv_policy="<name>"`): one file under jkv/policies/ is a plugin."""
        super().__init_subclass__(**kwargs)
        if "served" not in cls.__dict__:
            ringed = not cls.evicts or cls.ring is not KVPolicy.ring
            cls.served = ringed and cls.rebuild is KVPolicy.rebuild
        if "name" in cls.__dict__:
            taken = REGISTRY.get(cls.name)
            if cls.name == "full" or (taken is not None and taken.__qualname__ != cls.__qualname__):
                raise ValueError(
                    f"KV policy name {cls.name!r}: taken by {taken.__qualname__ if taken else 'the full cache'}"
                )
            REGISTRY[cls.name] = cls

    @classmethod
    def from_budget(cls, kv_budget) -> KVPolicy:
        """The policy with its defaults and `kv_budget` (`kv_policy="<name>", kv_budget=...`)."""
        return cls(budget=kv_budget)

    budget: int | float | None = None

    def __post_init__(self):
        if self.budget is not None:
            check_budget(self.budget)
        elif self.evicts:
            raise ValueError(f"budget=None: {type(self).__name__} evicts to a budget; give one")

    def jit_key(self) -> KVPolicy:
        """The policy as compiled functions see it: its budget, which travels as per-row data,
        cleared, so policies that differ only in budget share compiled code."""
        key = copy.copy(self)
        object.__setattr__(key, "budget", None)
        return key

    # ---------------------------------------------------------------- sizes (host side)
    def row_limit(self, prompt_len: int) -> int:
        """A row's budget in tokens: the int budget, or ceil(ratio * prompt_len). For an
        evicting policy, the slots the row holds while decoding."""
        if self.budget is None:
            return prompt_len
        if isinstance(self.budget, float):
            return max(1, math.ceil(self.budget * prompt_len))
        return self.budget

    def budget_tokens(self, prompt_len: int) -> int:
        """Prompt tokens a row of `prompt_len` keeps after prefill."""
        return min(prompt_len, self.row_limit(prompt_len))

    def row_budgets(self, prompt_lengths: Sequence[int]) -> np.ndarray:
        """`[B]` int32 `budget_tokens` of each row (host side; passed into jit as data)."""
        return np.array([self.budget_tokens(n) for n in prompt_lengths], np.int32)

    def row_limits(self, prompt_lengths: Sequence[int]) -> np.ndarray:
        """`[B]` int32 `KVState.limit` of each row."""
        if not self.evicts:
            return np.full(len(prompt_lengths), kvlib.NO_LIMIT, np.int32)
        return np.array([self.row_limit(n) for n in prompt_lengths], np.int32)

    def layer_budget(self, layer: int, num_layers: int, budget: int) -> int:
        """A layer's share of a row's budget (PyramidKV overrides)."""
        return budget

    def capacities(
        self, num_layers: int, prompt_lengths: Sequence[int], max_new_tokens: int
    ) -> tuple[int, ...]:
        """Slots each layer allocates after compression for rows of `prompt_lengths`."""
        if self.evicts:
            return (kvlib.capacity_bucket(max(self.row_limits(prompt_lengths))),) * num_layers
        b = int(max(self.row_budgets(prompt_lengths)))
        extra = kvlib.headroom(max_new_tokens)
        return tuple(
            kvlib.capacity_bucket(self.layer_budget(i, num_layers, b)) + extra
            for i in range(num_layers)
        )

    def describe(self) -> dict:
        return {"name": self.name, **dataclasses.asdict(self)}

    def extra_bytes(self, capacity, *, batch, num_kv_heads, head_dim, kv_dtype) -> tuple[int, int]:
        """(bytes attention reads beside K, V and scales, bookkeeping bytes) one layer of
        `capacity` allocates for this policy: (0, 0) unless the policy stores more (the segment
        rebuild's slot biases and low-rank factors). `jkv.memory` adds them."""
        return 0, 0

    def report(self, state: kvlib.KVState, appended) -> dict:
        """Statistics of the compression achieved in `state` for a result's `stats` (`appended`
        `[B]`: tokens written after compression); {} unless the policy has some to tell."""
        return {}

    # ---------------------------------------------------------------- inside jit
    def keep(self, layer_index: int, layer: kvlib.LayerKV, ctx: Context) -> jax.Array:
        """`[B, K, S]` bool: the slots to keep after prefill."""
        return valid_slots(layer)

    def rebuild(self, layer_index, layer, ctx, capacity, kernels) -> kvlib.LayerKV | None:
        """A policy that restructures the cache instead of selecting slots (the SnapKV segment
        rebuild) returns the new layer of `capacity` slots; None: `keep`, then compact. `kernels`
        is the backend's `jkv.core.backends.Ops`."""
        return None

    def write_slots(self, layer: kvlib.LayerKV, q_pos: jax.Array, limit: jax.Array):
        """`[B, K]` slot for each row's new decode token (query position `q_pos` `[B]`, row
        budgets `limit` `[B]`), or None to append after the valid slots (a non-evicting policy
        with headroom)."""
        return None

    def cache_positions(self, layer: kvlib.LayerKV, q_pos: jax.Array):
        """For a `raw_keys` policy: (slot positions `[B, K, S]`, query positions `[B, T]`) that
        keys and queries are rotated by, given the layer after the new tokens (at original
        positions `q_pos` `[B, T]`) were written."""
        raise NotImplementedError(f"{type(self).__name__} stores rotated keys")

    def ring(self, limit: int) -> Ring | None:
        """An evicting policy's ring in `jkv.Engine` for one request of `limit` slots per kv
        head (its rule of `write_slots`, on the host); None: the engine does not serve it."""
        return None

    def observe(self, layer_index, layer, q, positions, n_new, mass, kernels):
        """Records what the policy scores by, after a layer's attention (`kernels`: the
        backend's `jkv.core.backends.Ops`); returns the layer."""
        if self.wants_mass and mass is not None and layer.scores is not None:
            return layer.replace(scores=layer.scores + mass)
        return layer


class Ring:
    """One request's ring in `jkv.Engine`, the per-request state of an evicting policy: once its
    prompt is compressed the request holds `limit` slots per kv head, and each new token (one a
    step) takes a free slot while there is one, else overwrites the one this rule picks. The
    engine makes it with the request (`KVPolicy.ring`), starts it when the prompt's selection is
    in the pages and asks it, as it plans each step, where the step's token goes
    (`jkv.engine.plan.row_plan`). Every kv head holds the same tokens here (a rule by position).

    The base rule: first in, first out (the oldest token leaves). A policy's own rule overrides
    `start` and `write`; StreamingLLM's keeps its sinks (`jkv.policies.streaming.SinkRing`),
    H2O's leaves the choice to the device (`jkv.policies.h2o.MassRing`).
    """

    rank_sink: int | None = None  # the sinks a window ranked as contiguous text follows
    mass_rule: tuple[int, int, bool] | None = None  # H2O's rule's settings (the device's choice)

    def __init__(self, limit: int):
        self.limit = limit
        self.reset()

    def reset(self) -> None:
        """Empty (the request is recomputed)."""
        self.count = 0  # slots held
        self.order: collections.deque[int] = collections.deque()  # slots, oldest token first

    def start(self, positions: list[int]) -> None:
        """The ring holds the text `positions` in slot order (the prompt's kept tokens)."""
        self.count = len(positions)
        self.order = collections.deque(sorted(range(self.count), key=positions.__getitem__))

    def write(self, position: int) -> tuple[int, int, int, bool]:
        """The token at `position` enters: (its slot, the slots held after it, the rank shift of
        the window past the sinks (0 here), whether the device picks the slot instead)."""
        if self.count < self.limit:
            slot = self.count
            self.count += 1
        else:
            slot = self.order.popleft()
        self.order.append(slot)
        return slot, self.count, 0, False


# ------------------------------------------------------------------- selection helpers
def valid_slots(layer: kvlib.LayerKV) -> jax.Array:
    """`[B, K, S]` bool: slot < length."""
    return jnp.arange(layer.capacity)[None, None, :] < layer.lengths[:, :, None]


def recency_rank(layer: kvlib.LayerKV) -> jax.Array:
    """`[B, K, S]` int32: 0 for the most recent valid slot (highest position), 1 for the next...;
    invalid slots rank after every valid one."""
    key = jnp.where(valid_slots(layer), -layer.positions, jnp.iinfo(jnp.int32).max)
    order = jnp.argsort(key, axis=-1, stable=True)
    return jnp.argsort(order, axis=-1, stable=True).astype(jnp.int32)


def age_rank(layer: kvlib.LayerKV) -> jax.Array:
    """`[B, K, S]` int32: 0 for the oldest valid slot (lowest position); invalid slots last."""
    pos = jnp.where(valid_slots(layer), layer.positions, jnp.iinfo(jnp.int32).max)
    order = jnp.argsort(pos, axis=-1, stable=True)
    return jnp.argsort(order, axis=-1, stable=True).astype(jnp.int32)


def top_n(scores: jax.Array, allowed: jax.Array, n: jax.Array) -> jax.Array:
    """`[B, K, S]` bool: the `n` (broadcast to `[B, K]`) highest `scores` among `allowed`.

    Ties go to the lower slot index (a stable sort), so a numpy reference can match exactly.
    """
    s = jnp.where(allowed, scores.astype(jnp.float32), -jnp.inf)
    order = jnp.argsort(-s, axis=-1, stable=True)
    rank = jnp.argsort(order, axis=-1, stable=True)
    n = jnp.broadcast_to(jnp.asarray(n, jnp.int32), scores.shape[:2])
    return allowed & (rank < n[:, :, None])


def keep_recent_and_top(scores, layer, n_keep, n_recent, n_sink=0):
    """Keep the `n_sink` oldest and `n_recent` newest valid slots, then the highest `scores`
    among the rest until `n_keep` slots are kept (all per (row, kv head), broadcast)."""
    valid = valid_slots(layer)
    n_keep = jnp.broadcast_to(jnp.asarray(n_keep, jnp.int32), layer.lengths.shape)
    n_recent = jnp.minimum(jnp.broadcast_to(jnp.asarray(n_recent, jnp.int32), n_keep.shape), n_keep)
    n_sink = jnp.minimum(
        jnp.broadcast_to(jnp.asarray(n_sink, jnp.int32), n_keep.shape), n_keep - n_recent
    )
    protected = valid & (
        (recency_rank(layer) < n_recent[:, :, None]) | (age_rank(layer) < n_sink[:, :, None])
    )
    rest = n_keep - jnp.sum(protected, axis=-1)
    return protected | top_n(scores, valid & ~protected, rest)
