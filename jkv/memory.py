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

import jax.numpy as jnp

from jkv import kv as kvlib
from jkv import policies
from jkv.params import Params
from jkv_models.config import ModelConfig, preset


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

    def __int__(self) -> int:
        return self.total


def token_bytes(cfg: ModelConfig, kv_dtype: str) -> int:
    """Bytes one token occupies in one layer's cache: K and V of every kv head (2 * K * H
    * itemsize), plus their bfloat16 scales under fp8 storage."""
    item = jnp.dtype(kv_dtype).itemsize
    scales = 2 * jnp.dtype(kvlib.SCALE_DTYPE).itemsize if kv_dtype == "float8_e4m3fn" else 0
    return cfg.num_kv_heads * (2 * cfg.head_dim * item + scales)


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
    if policy is None:
        slots = (kvlib.bucket(seq_len) + kvlib.headroom(max_new_tokens),) * cfg.num_layers
    else:
        slots = policy.capacities(cfg.num_layers, [seq_len], max_new_tokens)
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
