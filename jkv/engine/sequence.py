"""One request inside the engine: its tokens, how far the model has computed them, and its blocks.

Plain Python on ints. A sequence's page table is ONE list of block ids for all its (layer, kv
head) pairs (`jkv.engine.page_pool`). Uncompressed, token t of every head is in block
t // page_size. Once a KV policy compressed it (or it started from a compressed context,
`Engine.add_request(kv_state=)`), the first `n_prefix` blocks hold each head's kept tokens
(`base[h]` of them, head h = layer * num_kv_heads + kv head, with holes where a head keeps
fewer), and the tokens written after them follow in whole blocks (the tail), token t of the
tail in block n_prefix + t // page_size of every head. An evicting policy's ring has no tail:
its prefix blocks hold `limit` slots per head, overwritten in place. So a decode step adds at
most one block to a sequence, whatever the model's shape.
"""

from __future__ import annotations

import dataclasses
import enum
import itertools
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from jkv.policies.base import Ring

EPOCHS = itertools.count(1)  # `Sequence.epoch`'s values, process-wide


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
    extra_keys: tuple = ()  # prefix-cache keys of the first block (weights, dtype, tenant)
    cacheable: bool = True  # its full prompt blocks may be published and taken
    reserve: int | None = None  # tokens admission reserves for its output (None: max_tokens)
    page_size: int = 16  # tokens per block (set by the scheduler)
    group: int = 1  # pages per block: one per (layer, kv head) (set by the scheduler)
    output: list[int] = dataclasses.field(default_factory=list)
    status: Status = Status.WAITING
    num_computed: int = 0  # leading tokens whose K and V are in the pages
    num_cached: int = 0  # leading prompt tokens that came from the prefix cache (this admission)
    blocks: list[int] = dataclasses.field(default_factory=list)  # the page table (block ids)
    # A number no other sequence of this process has had, drawn again whenever `blocks` is
    # replaced rather than appended to: a page table row kept for a finished request (same id,
    # same count of replacements) is never taken for its successor's (`RowTables.sync`).
    epoch: int = dataclasses.field(default_factory=lambda: next(EPOCHS))
    # `blocks` as the last step's plan took them, with their epoch (`plan_blocks`)
    _planned: tuple[int, tuple[int, ...]] = dataclasses.field(default=(0, ()), repr=False)
    n_prefix: int = 0  # compressed: leading blocks holding each head's kept tokens
    n_lowrank: int = 0  # of them, the last ones: the segment rebuild's low-rank pages
    base: list[int] | None = None  # compressed: kept tokens per head (L * K of them)
    prefix_pages: int = 0  # compressed: pages its prefix blocks hold (holes excluded)
    covered: int = 0  # compressed: the leading tokens its prefix stands for
    # A KV context it starts from (`Engine.add_request(kv_state=)`): each head's kept slots,
    # written into its prefix at every admission; its tokens lead the prompt (`covered` of them)
    context: list[int] | None = None
    # Prefill only (`Engine.prefill`): it ends at its prompt's end, once its policy compressed
    # it, sampling nothing; its KV is read out as a `jkv.KVContext`
    prefill_only: bool = False
    hashes: list[bytes] = dataclasses.field(default_factory=list)  # its prompt's block hashes
    shared_blocks: int = 0  # leading blocks taken from the prefix cache
    published: int = 0  # leading prompt blocks in the prefix cache
    compresses: bool = False  # a KV policy compresses its prompt once it is in the pages
    window: int = 0  # prompt tokens the policy's last prefill step must hold (SnapKV's window)
    keep: int = 0  # tokens a head holds at most once compressed, generated ones included
    scratch: int = 0  # tokens its policy writes past the prompt before compressing (KVzip)
    # An evicting policy's ring once compressed (`KVPolicy.ring`: its per-request state)
    ring: Ring | None = None
    compressed: bool = False
    finish_reason: str | None = None
    error: str | None = None  # why it failed (a step that raised)
    preemptions: int = 0
    first_scheduled: float | None = None  # time.monotonic() of the first step that ran it

    @property
    def tokens(self) -> list[int]:
        return self.prompt + self.output

    def token_slice(self, start: int, n: int) -> list[int]:
        """`tokens[start : start + n]` without building the whole list."""
        p = len(self.prompt)
        if start + n <= p:
            return self.prompt[start : start + n]
        if start >= p:
            return self.output[start - p : start - p + n]
        return self.prompt[start:] + self.output[: start + n - p]

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

    @property
    def in_ring(self) -> bool:
        """Compressed by an evicting policy: fixed slots per head, overwritten in place."""
        return self.compressed and self.ring is not None

    @property
    def limit(self) -> int | None:
        """An evicting policy's slots per head once compressed (None: no ring)."""
        return None if self.ring is None else self.ring.limit

    @property
    def rank_sink(self) -> int | None:
        """A ring that ranks its window as contiguous text after its sinks (StreamingLLM): its
        sink count."""
        return None if self.ring is None else self.ring.rank_sink

    @property
    def tail(self) -> int:
        """Tokens in whole blocks after the prefix: all of them uncompressed, those written
        since the compression otherwise (a ring: written since, counted, not stored apart)."""
        return self.num_computed - (self.covered if self.compressed else 0)

    def plan_blocks(self) -> tuple[int, ...]:
        """`blocks` as an immutable tuple for a step's plan, copied again only when they
        changed: within an epoch they only grow, so a tuple of the same epoch and length holds
        the same ids (a long row's thousand blocks are not copied every step)."""
        epoch, planned = self._planned
        if epoch != self.epoch or len(planned) != len(self.blocks):
            planned = tuple(self.blocks)
            self._planned = (self.epoch, planned)
        return planned

    def blocks_after(self, n: int) -> int:
        """Blocks it needs to hold `n` more computed tokens."""
        page = self.page_size
        if self.in_ring:
            return self.n_prefix
        return self.n_prefix + -(-(self.tail + n) // page)

    def held(self, heads: int) -> list[int]:
        """Tokens each of its `heads` (L * K) holds (tests and stats; the device computes the
        same)."""
        if not self.compressed:
            return [self.num_computed] * heads
        if self.limit is None:
            return [b + self.tail for b in self.base]
        return [min(b + self.tail, self.limit) for b in self.base]

    @property
    def pages(self) -> int:
        """Pages it holds: its prefix's and its whole tail blocks'."""
        return self.prefix_pages + (len(self.blocks) - self.n_prefix) * self.group
