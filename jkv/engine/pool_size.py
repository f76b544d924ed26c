"""How many pages the engine's KV pool gets when nobody says (vLLM's `gpu_memory_utilization`):
a share of the device's free memory once the weights are loaded (on an accelerator: 90% of
what its allocator has left; on a CPU: a quarter of the host's available RAM, at most
`CPU_CAP` bytes, since the host also runs everything else), never more than twice what its
`max_running` requests can hold at the model's whole context (the rest of that for the prefix
cache), and never less than one request of that context."""

from __future__ import annotations

import jax

from jkv.limits import available_bytes
from jkv.memory import page_bytes

ACCELERATOR_FRACTION = 0.9
CPU_FRACTION = 0.25
CPU_CAP = 2 * 2**30  # bytes


def context_pages(max_model_len: int, page_size: int, group: int) -> int:
    """Pages one request of `max_model_len` tokens holds (one per (layer, kv head) per block),
    and the pool's null page."""
    return -(-max_model_len // page_size) * group + 1


def default_fraction() -> float:
    return CPU_FRACTION if jax.default_backend() == "cpu" else ACCELERATOR_FRACTION


def pages_for_memory(config, page_size: int, kv_dtype: str, *, mass: bool, shards: int,
                     max_model_len: int, max_running: int,
                     fraction: float | None = None) -> int:  # fmt: skip
    """The pool's pages: `fraction` (default: `default_fraction()`) of the free memory (capped
    at `CPU_CAP` on a CPU), a multiple of `shards` (devices of the "model" axis, each holding
    1 / shards of them), at most two full-context requests' per running row, at least one's.

    Raises:
      ValueError: a fraction outside (0, 1), a device that reports no free memory, or too
        little of it for one request of `max_model_len` tokens.
    """
    if fraction is None:
        fraction = default_fraction()
    if isinstance(fraction, bool) or not isinstance(fraction, int | float) or not 0 < fraction < 1:
        raise ValueError(f"memory_fraction={fraction!r}: expected a number in (0, 1)")
    free = available_bytes()
    if free is None:
        raise ValueError("this device reports no free memory; pass num_pages")
    budget = free * fraction
    if jax.default_backend() == "cpu":
        budget = min(budget, CPU_CAP)
    per_page = page_bytes(config, page_size, kv_dtype, mass=mass)
    pages = int(budget) // per_page * shards  # each device holds 1 / shards of them
    group = config.num_layers * config.num_kv_heads
    full = context_pages(max_model_len, page_size, group) - 1
    pages = min(pages, -(-(2 * max_running * full + 1) // shards) * shards)
    floor = -(-(full + 1) // shards) * shards
    if pages < floor:
        if floor * per_page // shards > free:
            raise ValueError(
                f"one request of max_model_len={max_model_len} tokens needs {floor} pages "
                f"({floor * per_page / 2**30:.2f} GiB); this device has "
                f"{free / 2**30:.2f} GiB free: pass a smaller max_model_len or num_pages"
            )
        pages = floor
    return pages


def describe(num_pages: int, page_size: int, group: int, per_page: int,
             max_model_len: int) -> str:  # fmt: skip
    """The startup line: what the pool holds, in tokens and in full-context requests."""
    tokens = (num_pages - 1) // group * page_size
    full = (num_pages - 1) // (context_pages(max_model_len, page_size, group) - 1)
    return (
        f"KV pool: {num_pages} pages of {per_page} bytes ({num_pages * per_page / 2**30:.2f} GiB)"
        f" hold {tokens} tokens: {full} requests of the full {max_model_len}-token context"
    )
