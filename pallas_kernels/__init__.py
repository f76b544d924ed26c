"""Pallas GPU kernels of jkv, one per file, each beside a float32 plain-jnp `*_reference`.

Axis alphabet: B batch, T new tokens, S cached slots, N query heads, K kv heads,
G = N // K query heads per kv head, H head dim, W observation-window queries, C capacity;
for low-rank segments M segments, L tokens per segment, R rank.
The KV cache is K, V [B, K, S, H] with valid lengths [B, K] (slots 0..len-1 are valid).

This package never imports `jkv` or `models`: every kernel is usable and testable alone.
"""

from jkv_kernels._backend import (
    as_narrow_bits,
    bits_take,
    scatter_set,
    window_set,
    window_set_in_place,
    window_set_scatter,
)
from jkv_kernels.decode_attention import decode_attention, decode_attention_reference
from jkv_kernels.kv_compact import (
    Compacted,
    kv_compact,
    kv_compact_reference,
    mask_to_indices,
    pack_mask,
    unpack_mask,
)
from jkv_kernels.kv_quantize import (
    dequantize_reference,
    quantize,
    quantize_append,
    quantize_append_reference,
    quantize_append_xla,
    quantize_reference,
)
from jkv_kernels.lowrank_attention import (
    combine_attention,
    lowrank_attention,
    lowrank_attention_reference,
)
from jkv_kernels.paged_decode_attention import (
    gather_pages,
    paged_decode_attention,
    paged_decode_attention_reference,
)
from jkv_kernels.paged_window_scores import (
    paged_window_scores,
    paged_window_scores_reference,
    paged_window_scores_xla,
)
from jkv_kernels.prefill_attention import prefill_attention, prefill_attention_reference
from jkv_kernels.prefill_attention_blocked import (
    prefill_attention_blocked,
    prefill_attention_mass_blocked,
)
from jkv_kernels.prefill_attention_mass import (
    prefill_attention_mass,
    prefill_attention_mass_reference,
)
from jkv_kernels.ragged_paged_attention import (
    ragged_paged_attention,
    ragged_paged_attention_reference,
)
from jkv_kernels.ragged_paged_attention_xla import ragged_paged_attention_xla
from jkv_kernels.segment_merge import Merged, segment_merge, segment_merge_reference
from jkv_kernels.window_scores import window_scores, window_scores_reference

__all__ = [
    "ragged_paged_attention",
    "ragged_paged_attention_reference",
    "ragged_paged_attention_xla",
    "scatter_set",
    "as_narrow_bits",
    "bits_take",
    "window_set",
    "window_set_in_place",
    "window_set_scatter",
    "gather_pages",
    "paged_decode_attention",
    "paged_decode_attention_reference",
    "paged_window_scores",
    "paged_window_scores_reference",
    "paged_window_scores_xla",
    "prefill_attention",
    "prefill_attention_blocked",
    "prefill_attention_mass_blocked",
    "prefill_attention_mass",
    "prefill_attention_mass_reference",
    "prefill_attention_reference",
    "Compacted",
    "Merged",
    "combine_attention",
    "decode_attention",
    "decode_attention_reference",
    "dequantize_reference",
    "kv_compact",
    "kv_compact_reference",
    "lowrank_attention",
    "lowrank_attention_reference",
    "mask_to_indices",
    "pack_mask",
    "quantize",
    "quantize_append",
    "quantize_append_reference",
    "quantize_append_xla",
    "quantize_reference",
    "segment_merge",
    "segment_merge_reference",
    "unpack_mask",
    "window_scores",
    "window_scores_reference",
]
