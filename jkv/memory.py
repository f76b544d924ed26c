"""The KV-cache calculator: bytes for a model, batch, context, dtype and policy.

Per layer, K and V hold `2 * batch * slots * n_kv_heads * head_dim * dtype_bytes` (GQA: kv heads,
not query heads); fp8 storage adds a bfloat16 scale per (row, kv head, slot) for each of K and
V. The SnapKV segment rebuild adds a float32 logit bias per slot and its low-rank factors
(`segments`, in the total) and their counts, ranks and positions (bookkeeping).
`slots` is what `jkv.generate` allocates for a longest prompt of `seq_len` tokens and
`max_new_tokens` (the same defaults as generate's, 64): the prompt's bucket plus the decode
headroom's bucket for the full cache, the policy's `capacities` otherwise, so
`result.kv_bytes == memory(...)` for the same settings.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from jkv import kv as kvlib
from jkv import policies
from jkv.params import Params
from jkv_models.config import ModelConfig, preset


def step_tokens(longest: int, chunk: int, policy) -> int:
    """Prompt tokens per prefill step: `chunk`, at least an observation window (SnapKV's last W
    prompt tokens must be in the last step), at most the prompt's bucket (a short prompt is one
    step)."""
    window = getattr(policy, "window", 0) or 0
    return min(max(chunk, kvlib.bucket(window)), kvlib.bucket(longest))


@dataclasses.dataclass(frozen=True)
class PrefillPlan:
    """The shapes a fresh request's prefill allocates (what `jkv.prefill.prepare` builds)."""

    step: int  # prompt tokens per model step
    capacity: tuple[int, ...]  # slots per layer while the prompt streams in
    evict_to: tuple[int, ...] | None  # slots per layer each chunk is cut back to, if it is
    final: tuple[int, ...]  # slots per layer after prefill: the cache decode runs on


def prefill_plan(
    num_layers: int, lengths, max_new_tokens: int, policy, chunk: int = kvlib.PREFILL_CHUNK
) -> PrefillPlan:
    """The plan for rows of `lengths` prompt tokens: the full cache holds the prompt's bucket plus
    the decode headroom's; a policy's cache holds the prompt's bucket until it compresses once,
    or, for a policy that compresses as the prompt streams in (evicting ones, `chunked=True`),
    its final capacities plus one step whenever that is smaller."""
    t = kvlib.bucket(max(lengths))
    step = step_tokens(max(lengths), chunk, policy)
    if policy is None:
        full = (t + kvlib.headroom(max_new_tokens),) * num_layers
        return PrefillPlan(step=step, capacity=full, evict_to=None, final=full)
    final = tuple(policy.capacities(num_layers, lengths, max_new_tokens))
    as_it_arrives = policy.evicts or getattr(policy, "chunked", False)
    if as_it_arrives and max(final) + step < t:
        evict_to = tuple(c + step for c in final)
        return PrefillPlan(step=step, capacity=evict_to, evict_to=evict_to, final=final)
    return PrefillPlan(step=step, capacity=(t,) * num_layers, evict_to=None, final=final)


@dataclasses.dataclass(frozen=True)
class MemoryReport:
    """Bytes of a KV state. `int(report)` is `report.total`."""

    total: int  # K + V + fp8 scales, all layers
    per_layer: tuple[int, ...]
    kv: int  # K and V alone
    scales: int  # fp8 scales
    slots: tuple[int, ...]  # allocated slots per layer
    bookkeeping: int  # positions and lengths (int32), not in `total`
    segments: int = 0  # slot biases + low-rank factors (SnapKV segment rebuild), in `total`
    # Predicted peaks of the XLA backend's programs (`peaks`), weights excluded:
    prefill_peak: int = 0  # a prefill step over the largest cache, or the compression after it
    decode_peak: int = 0  # a decode step over the cache after prefill
    weights: int = 0  # the model's weights, beside either peak

    def __int__(self) -> int:
        return self.total


def token_bytes(cfg: ModelConfig, kv_dtype: str) -> int:
    """Bytes one token occupies in one layer's cache: K and V of every kv head (2 * K * H
    * itemsize), plus their bfloat16 scales under fp8 storage."""
    item = jnp.dtype(kv_dtype).itemsize
    scales = 2 * jnp.dtype(kvlib.SCALE_DTYPE).itemsize if kv_dtype == "float8_e4m3fn" else 0
    return cfg.num_kv_heads * (2 * cfg.head_dim * item + scales)


def page_bytes(cfg: ModelConfig, page_size: int, kv_dtype: str, *, mass: bool = False) -> int:
    """Device bytes of one page of `jkv.Engine`'s pool: `page_size` tokens of ONE kv head of
    ONE layer, each with K and V (2 * H * itemsize), their bfloat16 scales under fp8, its int32
    position and, in a pool that keeps attention mass (H2O), a float32. A pool of N pages holds
    exactly N times this (page 0 is the null page tables are padded with)."""
    item = jnp.dtype(kv_dtype).itemsize
    scales = 2 * jnp.dtype(kvlib.SCALE_DTYPE).itemsize if kv_dtype == "float8_e4m3fn" else 0
    return page_size * (2 * cfg.head_dim * item + scales + 4 + (4 if mass else 0))


def _config(model) -> ModelConfig:
    if isinstance(model, ModelConfig):
        return model
    if isinstance(model, Params):
        return model.config
    if isinstance(model, str):
        return preset(model)
    raise ValueError(f"model={model!r:.60} must be a preset name, a ModelConfig or jkv.Params")


def memory(
    model,
    batch: int,
    seq_len: int,
    *,
    max_new_tokens: int = 64,
    kv_dtype: str | None = None,
    kv_policy=None,
    kv_budget=None,
    chunk: int = kvlib.PREFILL_CHUNK,
) -> MemoryReport:
    """KV-cache bytes for `batch` rows of a `seq_len`-token context.

    Args:
      model: a preset name ("llama-3.1-8b", ...), a `ModelConfig`, or loaded params.
      batch: rows.
      seq_len: prompt tokens of the longest row.
      max_new_tokens: tokens each row may generate, as in `jkv.generate` (policies that evict
        keep a fixed size instead).
      kv_dtype: "float32", "bfloat16", "float8_e4m3fn" or "float16" (a common serving dtype);
        default: the model's dtype.
      kv_policy, kv_budget: as in `jkv.generate`.
      chunk: prompt tokens per prefill step, as in `jkv.prefill`.

    Returns:
      The stored bytes after prefill (`total`, `slots`, ...), the predicted `prefill_peak` and
      `decode_peak` (weights excluded; `peaks`), and `weights`.

    Raises:
      ValueError: naming a bad argument.
    """
    cfg = _config(model)
    for name, value, low in (
        ("batch", batch, 1),
        ("seq_len", seq_len, 1),
        ("max_new_tokens", max_new_tokens, 0),
    ):
        if isinstance(value, bool) or not isinstance(value, int) or value < low:
            raise ValueError(f"{name}={value!r} must be an integer >= {low}")
    dtype = kv_dtype or (model.kv_dtype if isinstance(model, Params) else cfg.dtype)
    if dtype != "float16":
        kvlib.validate_kv_dtype(dtype)
    policy = policies.resolve(kv_policy, kv_budget)
    plan = prefill_plan(cfg.num_layers, [seq_len], max_new_tokens, policy, chunk)
    report = stored(cfg, batch, plan.final, dtype, policy)
    weights_dtype = model.dtype if isinstance(model, Params) else cfg.dtype
    prefill_peak, decode_peak = peaks(
        cfg, batch, plan, max_new_tokens, dtype, policy, weights_dtype=weights_dtype,
        prompt=seq_len,
    )  # fmt: skip
    weights = (
        sum(x.nbytes for x in jax.tree.leaves(model.weights))
        if isinstance(model, Params)
        else cfg.num_params() * jnp.dtype(cfg.dtype).itemsize
    )
    return dataclasses.replace(
        report, prefill_peak=prefill_peak, decode_peak=decode_peak, weights=int(weights)
    )


def stored(cfg: ModelConfig, batch: int, slots, dtype: str, policy) -> MemoryReport:
    """The bytes of a state of `slots` per layer (no peaks)."""
    per_token = token_bytes(cfg, dtype)
    kv_part = 2 * cfg.num_kv_heads * cfg.head_dim * jnp.dtype(dtype).itemsize
    kv = [batch * s * kv_part for s in slots]
    scales = [batch * s * (per_token - kv_part) for s in slots]
    per_slot = batch * cfg.num_kv_heads
    extra = [(0, 0)] * len(slots)
    if policy is not None:
        extra = [
            policy.extra_bytes(
                s, batch=batch, num_kv_heads=cfg.num_kv_heads, head_dim=cfg.head_dim, kv_dtype=dtype
            )
            for s in slots
        ]
    per_layer = tuple(a + b + e[0] for a, b, e in zip(kv, scales, extra, strict=True))
    bookkeeping = sum(per_slot * (s * 4 + 4) for s in slots) + batch * 8  # + positions, limit
    return MemoryReport(
        total=sum(per_layer),
        per_layer=per_layer,
        kv=sum(kv),
        scales=sum(scales),
        slots=tuple(int(s) for s in slots),
        bookkeeping=bookkeeping + sum(e[1] for e in extra),
        segments=sum(e[0] for e in extra),
    )


def state_bytes(cfg: ModelConfig, batch: int, slots, dtype: str, policy, *, scores: bool) -> int:
    """Every byte of a `KVState` of `slots` per layer: K, V, scales, what the policy adds,
    positions, lengths and, with `scores`, the per-slot float32 score array."""
    report = stored(cfg, batch, slots, dtype, policy)
    return (
        report.total
        + report.bookkeeping
        + (4 * batch * cfg.num_kv_heads * sum(slots) if scores else 0)
    )


F32 = 4
REQUEST_TOKENS = 32  # KVzip's replay request around its piece of the context, at most


def peaks(
    cfg: ModelConfig,
    batch: int,
    plan: PrefillPlan,
    max_new_tokens: int,
    dtype: str,
    policy,
    *,
    weights_dtype: str = "float32",
    platform: str | None = None,
    prompt: int | None = None,
):
    """(prefill peak, decode peak) in bytes, weights excluded: the live state plus the working set
    of the XLA backend's programs, as XLA:CPU's buffer assignment lays them out (measured with
    `memory_analysis()`; tests/test_memory_peaks.py compares). Each program's state argument is
    donated, except the compression's (its input and its smaller output are both live).

    Working sets, B rows, C prompt tokens per step, S slots, L layers, N query and K kv heads of
    H dims, W SnapKV's window:
      prefill step   B*C*(2*N*256 + 3*N*H + L*N*H) floats (a key block's scores and weights for
                     every query head, the chunk's projections; XLA keeps one per layer), plus one
                     layer's K and V in an 8- or 16-bit cache (XLA:CPU reads such a cache through
                     a copy of its bits), plus an observing policy's window scores over all slots
                     (B*N*W*S floats, twice unless fp8);
      compression    7 (8 with attention mass) floats per slot of every layer and kv head;
      replay         KVzip's (`prompt` tokens): beside the state, its copy cut to the prompt
                     (P slots) and that copy with room for the R replayed tokens, the replay's
                     prefill working set for R tokens at once, or a tile of 128 queries' scores,
                     their exponentials and probabilities over P + R slots for every query head;
      eviction       6 of those, after each chunk of a policy that evicts while the prompt streams;
      decode step    one layer's V (and K, unless stored in float32) in float32 and two B*N*S
                     score arrays; StreamingLLM's keys re-rotated in float32 for every layer at
                     once (XLA:CPU schedules them together); on CPU, an 8- or 16-bit cache's K
                     and V once more (XLA:CPU copies them around the step's scatter; counted
                     whole, an upper bound: XLA measured 13-26% less on the test's settings);
    plus the step's tokens and logits. On CPU (`platform`, default: JAX's backend) weights stored
    in fewer than 32 bits add their float32 copies: XLA:CPU widens every layer's matrices and the
    output projection for its dots and holds them all (the decode loop the embedding too); XLA on
    a GPU does not (an H200 held 0.29 GB of temporaries for Llama-3.1-8B's whole chunk step).
    Not counted: the Pallas backends' kernels (flash tiles instead of a layer's float32 K and V).
    """
    b, n, kh, h, nl = batch, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, cfg.num_layers
    narrow = jnp.dtype(dtype).itemsize < 4
    fp8 = dtype == "float8_e4m3fn"
    observes = policy is not None and policy.observes
    c, s = plan.step, max(plan.capacity)
    before = state_bytes(cfg, b, plan.capacity, dtype, None, scores=observes)  # plain slots

    attention = b * c * (2 * n * min(kvlib.ATTENTION_BLOCK, s) + 3 * n * h + nl * n * h) * F32
    if narrow:
        attention += stored(cfg, b, (s,), dtype, None).total
    if observes and not policy.wants_mass:
        attention += (1 if fp8 else 2) * b * n * getattr(policy, "window", 0) * s * F32
    mlp = b * c * (3 * cfg.intermediate_size + 2 * cfg.hidden_size) * F32
    io = b * (c + 1 + cfg.vocab_size) * F32  # tokens, lengths, logits
    prefill = before + io + max(attention, mlp)
    per_slot = F32 * b * kh * nl
    if plan.evict_to is not None:
        prefill = max(prefill, 2 * before + 6 * per_slot * s)
    after = before
    if policy is not None:
        after = state_bytes(cfg, b, plan.final, dtype, policy, scores=policy.wants_mass)
        select = (8 if policy.wants_mass else 7) * per_slot * s
        prefill = max(prefill, before + after + select)

    if policy is not None and policy.needs_replay:
        p = kvlib.fine_bucket(prompt or s)
        r = kvlib.fine_bucket(min(prompt or s, policy.chunk) + REQUEST_TOKENS)
        work = state_bytes(cfg, b, (p,) * nl, dtype, None, scores=True)
        room = state_bytes(cfg, b, (p + r,) * nl, dtype, None, scores=True)
        step = b * r * (2 * n * min(kvlib.ATTENTION_BLOCK, p + r) + 3 * n * h + nl * n * h) * F32
        tile = 3 * b * n * 128 * (p + r) * F32
        replay_mlp = b * r * (3 * cfg.intermediate_size + 2 * cfg.hidden_size) * F32
        prefill = max(prefill, before + work + room + max(step, tile, replay_mlp))

    s = max(plan.final)
    layer_f32 = b * kh * s * h * F32
    work = layer_f32 * (2 if narrow else 1) + 2 * b * n * s * F32
    if policy is not None and policy.raw_keys:
        work = layer_f32 * (nl + (1 if fp8 else 2)) + 2 * b * n * s * F32
    decode = after + b * (kvlib.bucket(max(max_new_tokens, 1)) + 8) * F32
    decode += work + 4 * b * cfg.vocab_size * F32  # + the sampler's vocabulary-sized arrays
    platform = platform or jax.default_backend()
    if platform == "cpu" and narrow:  # the decode step's scatter copies the cache's K and V
        decode += sum(stored(cfg, b, (cap,), dtype, None).kv for cap in plan.final)
    if platform == "cpu" and jnp.dtype(weights_dtype).itemsize < F32:
        table = cfg.vocab_size * cfg.hidden_size
        tables = 1 if cfg.tie_word_embeddings else 2
        widened = F32 * (cfg.num_params() - (tables - 1) * table)  # layers + output projection
        prefill += widened
        decode += widened + (F32 * table if tables == 2 else 0)
    return int(prefill), int(decode)
