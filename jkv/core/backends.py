"""One table from attention backend to the Pallas kernels or their float32 references.

  "xla"               plain jnp (the CPU default): every operation through the kernels' jnp
                      references (attention itself through `jkv.core.attention`'s jnp path);
  "pallas"            the Pallas Triton kernels (the GPU default);
  "pallas_interpret"  the same kernels in the Pallas interpreter, on any machine (slow: tests).

Everything that picks a kernel by backend asks `ops(backend)`; nothing else branches on the name.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable

import jax

from jkv_kernels import (
    decode_attention,
    kv_compact,
    kv_compact_reference,
    lowrank_attention,
    paged_window_scores,
    paged_window_scores_xla,
    prefill_attention,
    prefill_attention_blocked,
    prefill_attention_mass,
    prefill_attention_mass_blocked,
    quantize_append,
    quantize_append_xla,
    ragged_paged_attention,
    ragged_paged_attention_xla,
    segment_merge,
    segment_merge_reference,
    window_scores,
    window_scores_reference,
)

BACKENDS = ("xla", "pallas", "pallas_interpret")


@dataclasses.dataclass(frozen=True)
class Ops:
    """The operations of one backend. `decode_attention` / `lowrank_attention` are None on
    "xla", whose decode attention is the jnp path of `jkv.core.attention`; prefill attention
    (T > 1 queries) is the flash kernel on Pallas and its key-blocked jnp twin on "xla"."""

    name: str
    prefill_attention: Callable
    prefill_attention_mass: Callable
    quantize_append: Callable
    kv_compact: Callable
    window_scores: Callable
    segment_merge: Callable
    decode_attention: Callable | None
    lowrank_attention: Callable | None
    # the engine's flattened step: a ragged batch of queries over the paged pool
    ragged_attention: Callable = ragged_paged_attention_xla
    # the engine's selection: the window votes of a few queries per row, over the pool
    paged_window_scores: Callable = paged_window_scores_xla


def _kernels(name: str, interpret: bool) -> Ops:
    def k(fn):
        return functools.partial(fn, interpret=interpret)

    return Ops(
        name=name,
        prefill_attention=k(prefill_attention),
        prefill_attention_mass=k(prefill_attention_mass),
        quantize_append=k(quantize_append),
        kv_compact=k(kv_compact),
        window_scores=k(window_scores),
        segment_merge=k(segment_merge),
        decode_attention=k(decode_attention),
        lowrank_attention=k(lowrank_attention),
        ragged_attention=k(ragged_paged_attention),
        paged_window_scores=k(paged_window_scores),
    )


_TABLE = {
    "xla": Ops(
        name="xla",
        prefill_attention=prefill_attention_blocked,
        prefill_attention_mass=prefill_attention_mass_blocked,
        quantize_append=quantize_append_xla,
        kv_compact=kv_compact_reference,
        window_scores=window_scores_reference,
        segment_merge=segment_merge_reference,
        decode_attention=None,
        lowrank_attention=None,
    ),
    "pallas": _kernels("pallas", interpret=False),
    "pallas_interpret": _kernels("pallas_interpret", interpret=True),
}


def validate_backend(backend: str | None) -> str:
    """Resolves None to the platform default and rejects unknown names."""
    if backend is None:
        return "pallas" if jax.default_backend() == "gpu" else "xla"
    if backend not in BACKENDS:
        raise ValueError(f"backend={backend!r} is not supported; expected one of {BACKENDS}")
    return backend


def ops(backend: str) -> Ops:
    """The operations of `backend` (a name from `BACKENDS`)."""
    return _TABLE[validate_backend(backend)]
