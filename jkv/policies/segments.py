"""SnapKV segment rebuild: anchors kept whole, transitions merged, the middle low-rank.

After prefill, the prompt cache of each (row, kv head), tokens s = 0..n-1 (a fresh prefill: slot
s holds token s), is rebuilt:

1. Score: attention entropy x position decay. With v_s SnapKV's pooled observation-window votes
   (`snapkv.window_vote`) and a_s = v_s / sum(v) their distribution, token s's term of the
   window's attention entropy is e_s = -a_s log a_s, with a_s clipped to 1/e (where the term
   peaks) so that more attention never scores lower; score_s = e_s * exp(-decay * (n - 1 - s)).
2. Anchors: the first k tokens of the priority order "the `sink` first tokens (oldest first),
   the observation window (last `window` tokens, newest first), the rest by score (ties: lower
   slot)", sorted by position. k is the largest count (at most `n_anchors` when set) whose
   rebuilt cache keeps at most `budget_tokens(n)` ordinary slots (bisection on k).
3. Segments, by a token's distance d to the nearest anchor: anchor segment (d <= anchor_radius)
   kept whole, one slot per token; transition (d <= anchor_radius + transition_len): each
   maximal run of transition tokens is cut into groups, token j (from 0) joining group
   floor(j / merge) (merge 2.5: groups of 3 and 2, a 2.5x merge), each group one slot with
   the mean key and value and a log(count) logit bias (`jkv_kernels.segment_merge`);
   middle (farther): low-rank.
4. Middle tokens, in position order, are packed into groups of `segment_len`; per group a
   truncated SVD of the keys and separately of the values, uncentred (no mean vector to store
   or add back: the keys' large common component is simply the first direction), at the
   smallest rank whose squared singular values reach `variance` of their sum, at most
   `max_rank`: coefficients U_r S_r [L, r] and basis V_r^T [r, H], never reconstructed.
   Packing, not one SVD per gap between anchors: a basis costs r*H, as much as r tokens, and
   gaps are often a few tokens long; per-gap factors would outweigh the tokens they replace and
   make the static store scale with the number of gaps.

Sizes (host side, n: the longest prompt's bucket): ordinary slots bucket(budget_tokens(n)) plus
decode headroom, as SnapKV; the low-rank store M = ceil(max_middle / segment_len) segments of
segment_len x R, R = min(max_rank, H, segment_len). max_middle: if k anchors fit the budget and
k + 1 do not, the k + 1 first need > budget slots, hence > budget non-middle tokens, and one
anchor turns at most 2*(radius + transition_len) + 1 tokens non-middle, so at most
n - budget + 2*(radius + transition_len) tokens stay middle (n - n_anchors when that cap binds).
"""

from __future__ import annotations

import dataclasses
import functools
import math
from fractions import Fraction
from typing import ClassVar

import jax
import jax.numpy as jnp
import numpy as np

from jkv import kv as kvlib
from jkv.policies.base import check_int
from jkv.policies.snapkv import SnapKV

WHOLE, TRANSITION, MIDDLE, EMPTY = 0, 1, 2, 3
_BIG = 1 << 30


class SegmentCapacity(int):
    """An int, the ordinary slots of a layer (what every policy's capacity is), that also carries
    the static shape of the low-rank store, so `compress` and `jkv.memory` size it from the same
    host-side numbers."""

    def __new__(cls, slots: int, *, segments: int, segment_len: int, max_rank: int | None):
        obj = super().__new__(cls, slots)
        obj.segments, obj.segment_len, obj.max_rank = segments, segment_len, max_rank
        return obj

    def _key(self):
        return (int(self), self.segments, self.segment_len, self.max_rank)

    def __eq__(self, other):
        if isinstance(other, SegmentCapacity):
            return self._key() == other._key()
        return int(self) == other

    def __hash__(self):
        return hash(self._key())

    def __repr__(self):
        return (
            f"SegmentCapacity({int(self)}, segments={self.segments}, "
            f"segment_len={self.segment_len}, max_rank={self.max_rank})"
        )

    def store_shape(self, head_dim: int) -> tuple[int, int, int]:
        """(M, L, R) of the low-rank store; max_rank None means head_dim // 8."""
        r = head_dim // 8 if self.max_rank is None else self.max_rank
        return self.segments, self.segment_len, max(1, min(r, head_dim, self.segment_len))


def factor_dtype(kv_dtype) -> jnp.dtype:
    """float32 factors for a float32 cache, bfloat16 for every other storage (fp8 included)."""
    return jnp.dtype(jnp.float32 if jnp.dtype(kv_dtype) == jnp.float32 else jnp.bfloat16)


def store_bytes(cap: SegmentCapacity, *, batch, num_kv_heads, head_dim, kv_dtype) -> tuple:
    """(slot biases + low-rank factors, low-rank bookkeeping) bytes one layer allocates."""
    m, seg_len, r = cap.store_shape(head_dim)
    item = 4 if kv_dtype == "float32" else 2
    per = batch * num_kv_heads
    data = per * (int(cap) * 4 + 2 * m * (seg_len * r + r * head_dim) * item)
    return data, per * m * (3 + seg_len) * 4


# ------------------------------------------------------------------ the segmentation rule
def anchor_scores(votes, lengths, decay: float):
    """`[B, K, S]` float32 entropy x decay score of each slot (-inf past the length)."""
    idx = jnp.arange(votes.shape[-1])
    valid = idx < lengths[..., None]
    v = jnp.where(valid, votes.astype(jnp.float32), 0.0)
    total = v.sum(-1, keepdims=True)
    a = jnp.minimum(jnp.where(total > 0, v / jnp.where(total > 0, total, 1.0), 0.0), 1 / math.e)
    ent = jnp.where(a > 0, -a * jnp.log(jnp.where(a > 0, a, 1.0)), 0.0)
    dist = (lengths[..., None] - 1 - idx).astype(jnp.float32)
    return jnp.where(valid, ent * jnp.exp(-decay * dist), -jnp.inf)


def priority_rank(scores, lengths, sink: int, window: int):
    """`[B, K, S]` int32 place of each slot in the anchor order (sinks, window, by score)."""
    idx = jnp.arange(scores.shape[-1])
    n = lengths[..., None]
    valid = idx < n
    is_sink = valid & (idx < sink)
    is_win = valid & ~is_sink & (idx >= n - window)
    group = jnp.where(is_sink, 0, jnp.where(is_win, 1, jnp.where(valid, 2, 3)))
    within = jnp.where(is_sink, idx, jnp.where(is_win, -idx, -scores)).astype(jnp.float32)
    first = jnp.argsort(within, axis=-1, stable=True)  # ties: lower slot
    order = jnp.take_along_axis(
        first, jnp.argsort(jnp.take_along_axis(group, first, -1), axis=-1, stable=True), -1
    )
    return jnp.argsort(order, axis=-1, stable=True).astype(jnp.int32)


def classify(rank, lengths, n_anchors, radius: int, transition: int):
    """`[B, K, S]` int8 class of each slot when the first `n_anchors` `[B, K]` are anchors."""
    idx = jnp.arange(rank.shape[-1])
    valid = idx < lengths[..., None]
    anchor = valid & (rank < n_anchors[..., None])
    prev = jax.lax.cummax(jnp.where(anchor, idx, -_BIG), axis=2)
    nxt = jax.lax.cummin(jnp.where(anchor, idx, _BIG), axis=2, reverse=True)
    d = jnp.minimum(idx - prev, nxt - idx)
    cls = jnp.where(d <= radius, WHOLE, jnp.where(d <= radius + transition, TRANSITION, MIDDLE))
    return jnp.where(valid, cls, EMPTY).astype(jnp.int8)


def slot_starts(cls, merge: Fraction):
    """`[B, K, S]` bool: slot s opens a new ordinary slot (a whole token or a merged group)."""
    idx = jnp.arange(cls.shape[-1])
    trans = cls == TRANSITION
    first = trans & ~jnp.pad(trans, ((0, 0), (0, 0), (1, 0)))[..., :-1]
    j = idx - jax.lax.cummax(jnp.where(first, idx, -1), axis=2)
    group = lambda x: (x * merge.denominator) // merge.numerator
    return (cls == WHOLE) | (trans & (group(j) != group(j - 1)))


# ------------------------------------------------------------------ the rebuilt state
def _runs(cls, flags, capacity):
    """Ordinary slots as runs: starts, counts `[B, K, C]` (count 0: empty slot)."""
    b, kh, s = cls.shape
    bi, ki = jnp.arange(b)[:, None, None], jnp.arange(kh)[None, :, None]
    sid = jnp.cumsum(flags, axis=-1) - 1
    kept = (cls == WHOLE) | (cls == TRANSITION)
    starts = jnp.zeros((b, kh, capacity), jnp.int32)
    starts = starts.at[bi, ki, jnp.where(flags, sid, capacity)].set(jnp.arange(s), mode="drop")
    counts = jnp.zeros((b, kh, capacity), jnp.int32)
    counts = counts.at[bi, ki, jnp.where(kept, sid, capacity)].add(1, mode="drop")
    return starts, counts


def truncated_svd(x, variance: float, rank: int):
    """x `[..., L, H]` float32 -> coef `[..., L, R]`, basis `[..., R, H]` (zero past the
    achieved rank), achieved rank `[...]` int32 (0 for an all-zero x)."""
    u, sv, vt = jnp.linalg.svd(x, full_matrices=False)
    energy = sv * sv
    total = energy.sum(-1, keepdims=True)
    need = jnp.sum(jnp.cumsum(energy, -1) < variance * total, -1) + 1
    r = jnp.where(total[..., 0] > 0, jnp.minimum(need, rank), 0).astype(jnp.int32)
    live = jnp.arange(rank) < r[..., None]  # [..., R]
    coef = jnp.where(live[..., None, :], u[..., :rank] * sv[..., None, :rank], 0.0)
    return coef, jnp.where(live[..., None], vt[..., :rank, :], 0.0), r


def lowrank_store(layer, cls, shape, variance: float, after=None) -> kvlib.LowRank:
    """Packs the middle tokens into M groups of L and factors each group's keys and values.
    `after`: a finite float32 scalar computed from an earlier factorisation, which this one
    then waits for."""
    m, seg_len, rank = shape
    b, kh, _, h = layer.k.shape
    bi, ki = jnp.arange(b)[:, None, None], jnp.arange(kh)[None, :, None]
    middle = cls == MIDDLE
    order = jnp.cumsum(middle, axis=-1) - 1
    grp, j = jnp.where(middle, order // seg_len, m), order % seg_len
    k, v = kvlib.dequantised(layer, jnp.float32)
    zeros = jnp.zeros((2, b, kh, m, seg_len, h), jnp.float32)
    groups = zeros.at[:, bi, ki, grp, j].set(jnp.stack([k, v]), mode="drop")
    # jaxlib's CPU SVD blocks a pool thread while its batch runs on the others, so two SVDs
    # running at once deadlock a 2-thread pool (seen: `make test` hung in CI). Hence one SVD
    # call for K and V, and a real data dependency on the previous layer's factors: XLA:CPU
    # runs independent thunks concurrently and drops optimization barriers before it
    # schedules them. (x * 0.0 is not folded for floats; `after` is finite, so it adds 0.)
    if after is not None:
        groups = groups + after * 0.0
    (ck, cv), (bk_, bv), (rk, rv) = truncated_svd(groups, variance, rank)
    dtype = factor_dtype(layer.k.dtype)
    pos = jnp.full((b, kh, m, seg_len), -1, jnp.int32)
    return kvlib.LowRank(
        coef_k=ck.astype(dtype),
        basis_k=bk_.astype(dtype),
        coef_v=cv.astype(dtype),
        basis_v=bv.astype(dtype),
        counts=jnp.zeros((b, kh, m), jnp.int32).at[bi, ki, grp].add(1, mode="drop"),
        rank_k=rk,
        rank_v=rv,
        positions=pos.at[bi, ki, grp, j].set(layer.positions, mode="drop"),
    )


@dataclasses.dataclass(frozen=True, kw_only=True)
class SnapKVSegments(SnapKV):
    """SnapKV's votes choose anchors; the prompt cache is rebuilt in anchor, transition
    (merged) and middle (low-rank) segments. `budget`: ordinary slots each (row, kv head) keeps
    for its prompt (anchor segments + merged groups); the middle goes to the low-rank store."""

    name: ClassVar[str] = "snapkv_segments"
    factorises: ClassVar[bool] = True
    served: ClassVar[bool] = True  # jkv.Engine: ordinary slots and low-rank pages (engine.rebuild)

    budget: int | float = 256
    sink: int = 4
    decay: float = 1e-3  # per token of distance from the prompt's end
    n_anchors: int | None = None  # None: as many as the budget fits
    anchor_radius: int = 1
    transition_len: int = 4
    merge: float = 2.5  # transition tokens per merged slot (fractional: alternating groups)
    variance: float = 0.85
    max_rank: int | None = None  # None: head_dim // 8
    segment_len: int = 64

    def __post_init__(self):
        super().__post_init__()
        if self.chunked:
            raise ValueError("chunked=True: the segment rebuild runs once, on the whole prompt")
        for name in ("sink", "anchor_radius", "transition_len"):
            check_int(name, getattr(self, name))
        if self.n_anchors is not None:
            check_int("n_anchors", self.n_anchors, 1)
        if self.max_rank is not None:
            check_int("max_rank", self.max_rank, 1)
        if (
            isinstance(self.decay, bool)
            or not isinstance(self.decay, int | float)
            or self.decay < 0
        ):
            raise ValueError(f"decay={self.decay!r} must be a number >= 0")
        if (
            isinstance(self.merge, bool)
            or not isinstance(self.merge, int | float)
            or self.merge < 1
        ):
            raise ValueError(f"merge={self.merge!r} must be a number >= 1 (tokens per slot)")
        if not isinstance(self.variance, int | float) or not 0 < self.variance <= 1:
            raise ValueError(f"variance={self.variance!r} must be in (0, 1]")
        sl = self.segment_len
        if isinstance(sl, bool) or not isinstance(sl, int) or sl < 16 or sl & (sl - 1):
            raise ValueError(f"segment_len={sl!r} must be a power of two >= 16 (kernel tiles)")

    @property
    def merge_ratio(self) -> Fraction:
        return Fraction(self.merge).limit_denominator(64)

    # ---------------------------------------------------------------- sizes (host side)
    def max_middle(self, context_len: int) -> int:
        """Most middle tokens a row of up to `context_len` tokens can hold (module docstring)."""
        n, b = context_len, self.budget_tokens(context_len)
        if b >= n:
            return 0
        bound = n - b + 2 * (self.anchor_radius + self.transition_len)
        if self.n_anchors is not None:
            bound = max(bound, n - self.n_anchors)
        return max(0, min(n, bound))

    def capacities(self, num_layers, prompt_lengths, max_new_tokens):
        # The bucket bounds every row's middle (n - budget_tokens(n) never falls as n grows)
        # and keeps the store's shape, hence compilation, to one per bucket.
        n = kvlib.bucket(max(prompt_lengths))
        m = max(1, -(-self.max_middle(n) // self.segment_len))
        return tuple(
            SegmentCapacity(s, segments=m, segment_len=self.segment_len, max_rank=self.max_rank)
            for s in super().capacities(num_layers, prompt_lengths, max_new_tokens)
        )

    # ---------------------------------------------------------------- inside jit
    def plan(self, layer, budgets):
        """(classes `[B, K, S]` int8, anchors `[B, K]` int32, slot starts `[B, K, S]` bool) for a
        freshly prefilled layer whose `scores` hold the window votes; `budgets` `[B, 1]`."""
        lengths = layer.lengths
        rank = priority_rank(
            anchor_scores(layer.scores, lengths, self.decay), lengths, self.sink, self.window
        )
        cut = functools.partial(
            classify, rank, lengths, radius=self.anchor_radius, transition=self.transition_len
        )

        def step(_, carry):  # invariant: lo anchors fit the budget, hi do not (or hi = cap + 1)
            lo, hi = carry
            mid = (lo + hi) // 2
            fits = slot_starts(cut(mid), self.merge_ratio).sum(-1) <= budgets
            go = hi - lo > 1
            return jnp.where(go & fits, mid, lo), jnp.where(go & ~fits, mid, hi)

        cap = lengths if self.n_anchors is None else jnp.minimum(lengths, self.n_anchors)
        iters = (layer.capacity + 1).bit_length()
        lo, _ = jax.lax.fori_loop(0, iters, step, (jnp.zeros_like(cap), cap + 1))
        cls = cut(lo)
        return cls, lo, slot_starts(cls, self.merge_ratio)

    def extra_bytes(self, capacity, *, batch, num_kv_heads, head_dim, kv_dtype):
        return store_bytes(
            capacity, batch=batch, num_kv_heads=num_kv_heads, head_dim=head_dim, kv_dtype=kv_dtype
        )

    def report(self, state, appended):
        return {"kv_segments": segment_report(state, appended)}

    def rebuild(self, layer_index, layer, ctx, capacity, kernels):
        if not isinstance(capacity, SegmentCapacity):
            raise ValueError(f"{capacity=}: expected the SegmentCapacity of policy.capacities")
        cls, _, flags = self.plan(layer, self.layer_budgets(layer_index, ctx))
        starts, counts = _runs(cls, flags, int(capacity))
        out = kernels.segment_merge(
            layer.k,
            layer.v,
            starts,
            counts,
            k_scale=layer.k_scale,
            v_scale=layer.v_scale,
            positions=layer.positions,
        )
        shape = capacity.store_shape(layer.k.shape[-1])
        return kvlib.LayerKV(
            k=out.k,
            v=out.v,
            lengths=out.lengths,
            positions=out.positions,
            k_scale=out.k_scale,
            v_scale=out.v_scale,
            bias=out.bias,
            lowrank=lowrank_store(layer, cls, shape, self.variance, ctx.after),
        )


# ------------------------------------------------------------------ inspection (host side)
def reconstruct(layer: kvlib.LayerKV):
    """The dense equivalent of a rebuilt layer (float32 numpy, for tests and reports):
    k, v `[B, K, S + M*L, H]`, bias, positions and valid `[B, K, S + M*L]`."""
    k, v = (np.asarray(x, np.float32) for x in (layer.k, layer.v))
    if layer.k_scale is not None:
        k = k * np.asarray(layer.k_scale, np.float32)[..., None]
        v = v * np.asarray(layer.v_scale, np.float32)[..., None]
    s = layer.capacity
    valid = np.arange(s) < np.asarray(layer.lengths)[..., None]
    bias = np.zeros(valid.shape, np.float32) if layer.bias is None else np.asarray(layer.bias)
    parts = [(k, v, bias, np.asarray(layer.positions), valid)]
    lr = layer.lowrank
    if lr is not None:
        b, kh, m, seg_len, _ = lr.coef_k.shape
        expand = lambda c, base: np.einsum(
            "bkmlr,bkmrh->bkmlh", np.asarray(c, np.float32), np.asarray(base, np.float32)
        ).reshape(b, kh, m * seg_len, -1)
        live = np.arange(seg_len) < np.asarray(lr.counts)[..., None]
        parts.append(
            (
                expand(lr.coef_k, lr.basis_k),
                expand(lr.coef_v, lr.basis_v),
                np.zeros((b, kh, m * seg_len), np.float32),
                np.asarray(lr.positions).reshape(b, kh, -1),
                live.reshape(b, kh, -1),
            )
        )
    return tuple(np.concatenate(x, axis=2) for x in zip(*parts, strict=True))


def segment_report(state: kvlib.KVState, appended=None) -> dict:
    """Compression achieved per segment type, over every layer, row and kv head.

    anchor: whole tokens (1.0x); transition: tokens / merged slots; middle: the bytes its tokens
    would take as ordinary slots / the bytes of their factors at the achieved ranks.
    `appended` `[B]`: tokens written after the rebuild (decode), left out of the anchor count.
    """
    whole = t_slots = t_tokens = m_tokens = token_bytes = factor_bytes = 0
    for layer in state.layers:
        kh, h = layer.k.shape[1], layer.k.shape[-1]
        valid = np.arange(layer.capacity) < np.asarray(layer.lengths)[..., None]
        bias = np.zeros(valid.shape) if layer.bias is None else np.asarray(layer.bias)
        merged = valid & (bias > 0)
        whole += int((valid & ~merged).sum())
        if appended is not None:
            whole -= int(np.asarray(appended).sum()) * kh
        t_slots += int(merged.sum())
        t_tokens += int(np.rint(np.exp(bias[merged])).sum())
        per_token = 2 * h * layer.k.dtype.itemsize
        per_token += 0 if layer.k_scale is None else 2 * layer.k_scale.dtype.itemsize
        if layer.lowrank is not None:
            n = int(np.asarray(layer.lowrank.counts).sum())
            m_tokens += n
            token_bytes += n * per_token
            factor_bytes += layer.lowrank.used_bytes()
    ratio = lambda a, b: float(a / b) if b else None
    return {
        "anchor": {"tokens": max(whole, 0), "slots": max(whole, 0), "ratio": 1.0},
        "transition": {"tokens": t_tokens, "slots": t_slots, "ratio": ratio(t_tokens, t_slots)},
        "middle": {
            "tokens": m_tokens,
            "token_bytes": token_bytes,
            "factor_bytes": factor_bytes,
            "ratio": ratio(token_bytes, factor_bytes),
        },
    }
