"""H2O, heavy-hitter oracle (Zhang et al., 2023): keep the tokens that have received the most
attention, plus the most recent ones; evict the lowest every decode step at a fixed budget.

Attention mass is accumulated per slot from the prompt's queries and then from every decode
step (the `return_mass` output of `jkv_kernels.decode_attention`, read in the same pass as
the attention itself). With `scorer="importance"` the mass is normalised by how many queries
could see each token and the first `protect` tokens are kept.
"""

from __future__ import annotations

import dataclasses
from typing import ClassVar

import jax.numpy as jnp

from jkv.policies.base import KVPolicy, Ring, check_int, keep_recent_and_top, valid_slots
from jkv.policies.importance import token_importance


@dataclasses.dataclass(frozen=True, kw_only=True)
class H2O(KVPolicy):
    """`budget` tokens: the `recent` newest + the heaviest hitters by accumulated attention."""

    name: ClassVar[str] = "h2o"
    wants_mass: ClassVar[bool] = True
    observes: ClassVar[bool] = True
    evicts: ClassVar[bool] = True

    budget: int | float = 256
    recent: int = 32
    scorer: str = "mass"  # or "importance" (jkv.policies.importance)
    protect: int = 4  # first tokens always kept under scorer="importance"

    def __post_init__(self):
        super().__post_init__()
        check_int("recent", self.recent)
        check_int("protect", self.protect)
        if self.scorer not in ("mass", "importance"):
            raise ValueError(f"scorer={self.scorer!r} must be 'mass' or 'importance'")

    def _scores(self, layer, now):
        if self.scorer == "mass":
            return layer.scores
        return token_importance(layer.scores, layer.positions, now, protect=self.protect)

    def keep(self, layer_index, layer, ctx):
        b = ctx.budgets[:, None]
        now = ctx.now[:, None, None]
        return keep_recent_and_top(self._scores(layer, now), layer, b, jnp.minimum(self.recent, b))

    def write_slots(self, layer, q_pos, limit):
        b = q_pos.shape[0]
        return lightest_slots(layer, q_pos, limit, recent=jnp.full((b,), self.recent),
                              protect=jnp.full((b,), self.protect),
                              importance=jnp.full((b,), self.scorer == "importance"))  # fmt: skip

    def ring(self, limit):
        return MassRing(limit, (self.recent, self.protect, self.scorer == "importance"))


class MassRing(Ring):
    """H2O's ring in `jkv.Engine`: a new token takes a free slot while there is one; once full,
    the device picks each head's lightest slot by the attention mass the pool keeps
    (`lightest_slots` with `mass_rule`, inside the step), so the host only counts."""

    def __init__(self, limit: int, mass_rule: tuple[int, int, bool]):
        self.mass_rule = mass_rule  # (recent, protect, importance) per row, as data
        super().__init__(limit)

    def write(self, position):
        if self.count < self.limit:
            self.count += 1
            return self.count - 1, self.count, 0, False
        return self.limit, self.limit, 0, True


def lightest_slots(layer, q_pos, limit, *, recent, protect, importance):
    """`[B, K]` slot for each row's new token at `q_pos` `[B]` under H2O's rule, with the
    settings per row (`recent`, `protect` `[B]` int32, `importance` `[B]` bool: the scorer):
    the next free slot below `limit` `[B]`, else the lightest slot outside the protected ones.
    The protected window and first tokens are clamped so at least one slot is evictable: with
    a budget at or below `recent` the heavy-hitter part is empty and the oldest token leaves.
    Shared by `H2O.write_slots` (the one-shot path) and the engine's flattened step."""
    now = q_pos[:, None, None]
    recent = jnp.minimum(recent, limit - 1)[:, None, None]
    evictable = valid_slots(layer) & (layer.positions < now - recent)
    imp = importance[:, None, None]
    first = protect[:, None, None]  # scored first (inf); evictable from the clamped count on
    evictable &= ~imp | (layer.positions >= jnp.minimum(first, limit[:, None, None] - 1 - recent))
    score = jnp.where(imp, token_importance(layer.scores, layer.positions, now, protect=first),
                      layer.scores)  # fmt: skip
    # Finite for every evictable slot (protected-first scores are inf), so argmin never lands
    # on a slot outside `evictable`.
    score = jnp.minimum(score, jnp.finfo(jnp.float32).max)
    light = jnp.argmin(jnp.where(evictable, score, jnp.inf), axis=-1)
    full = layer.lengths >= limit[:, None]
    return jnp.where(full, light, layer.lengths).astype(jnp.int32)
