"""One request inside the engine: its tokens, how far the model has computed them, and its pages.

Plain Python on ints. Every (layer, kv head) has its own page table and token count (`heads`,
`held`, indexed `layer * num_kv_heads + head`): uncompressed they are all equal; after a KV
policy compresses, each head keeps its own number of tokens on its own number of pages.
"""

from __future__ import annotations

import dataclasses
import enum


class Status(enum.Enum):
    WAITING = "waiting"  # not admitted yet, or preempted (its pages freed, to be recomputed)
    RUNNING = "running"  # admitted: holds pages, prefilling or decoding
    FINISHED = "finished"  # done or aborted: holds nothing


@dataclasses.dataclass(eq=False)
class Sequence:
    request_id: str
    prompt: list[int]
    max_tokens: int
    arrival: int  # admission order key (smaller: older)
    eos_ids: tuple[int, ...] = ()
    extra_keys: tuple = ()  # prefix-cache keys of the first block (weights, kv dtype, tenant)
    cacheable: bool = True  # its full prompt blocks may be published (no compression)
    output: list[int] = dataclasses.field(default_factory=list)
    status: Status = Status.WAITING
    num_computed: int = 0  # leading tokens whose K and V are in the pages
    num_cached: int = 0  # leading prompt tokens that came from the prefix cache (this admission)
    heads: list[list[int]] = dataclasses.field(default_factory=list)  # page table per head
    held: list[int] = dataclasses.field(default_factory=list)  # tokens stored per head
    shared_blocks: int = 0  # leading blocks whose pages belong to the prefix cache
    published: int = 0  # leading prompt blocks this sequence has published
    compresses: bool = False  # a KV policy compresses its prompt once it is in the pages
    window: int = 0  # prompt tokens the policy's last prefill step must hold (SnapKV's window)
    keep: int = 0  # tokens a head holds at most once compressed, generated ones included
    limit: int | None = None  # an evicting policy's slots per head once compressed (a ring)
    compressed: bool = False
    finish_reason: str | None = None
    preemptions: int = 0
    first_scheduled: float | None = None  # time.monotonic() of the first step that ran it

    @property
    def tokens(self) -> list[int]:
        return self.prompt + self.output

    @property
    def num_tokens(self) -> int:
        return len(self.prompt) + len(self.output)

    @property
    def to_compute(self) -> int:
        """Known tokens not yet in the cache (a decoding sequence: its last sampled token)."""
        return self.num_tokens - self.num_computed

    @property
    def prefilling(self) -> bool:
        return self.num_computed < len(self.prompt)

    @property
    def awaits_compression(self) -> bool:
        """Its whole prompt is in the pages and its policy has not compressed it yet."""
        return self.compresses and not self.compressed and self.num_computed >= len(self.prompt)

    def after(self, held: int, n: int) -> int:
        """Tokens a head holding `held` holds after `n` more: an evicting policy's compressed
        sequence overwrites its oldest tokens at its limit."""
        if self.limit is not None and self.compressed:
            return min(held + n, self.limit)
        return held + n

    def pages(self) -> list[int]:
        return [p for table in self.heads for p in table]
