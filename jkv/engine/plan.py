"""A step's plan as plain data: what the runner needs of each scheduled row, fixed when the
scheduler plans the step (`Scheduler.schedule`), so that packing the step's arrays
(`jkv.engine.ragged.pack_ragged`) reads no live `Sequence` and changes none. The host goes on
with the sequences while the device runs the step (async scheduling books placeholders,
a read-back ends a request), and none of that reaches a plan already made.

A row's layout in its page-table row (the prefix+tail layout of a compressed prompt, an
evicting policy's ring) is worked out here, once: `row_plan` is where a ring's token takes its
slot (`jkv.policies.base.Ring.write`, the policy's rule), as the scheduler plans the step that
writes it.

The sizes a step compiles for are plain arithmetic too (`bucket`, `token_buckets`,
`token_bucket`): the scheduler fills a step up to its size (`Scheduler._fill`) and the runner
pads it to the same one (`jkv.engine.ragged.pack_ragged`).
"""

from __future__ import annotations

from typing import NamedTuple

from jkv import kv as kvlib


def bucket(n: int, low: int = 1) -> int:
    """The power of two >= max(n, low) (`jkv.kv.bucket`, from 1)."""
    return kvlib.bucket(n, low)


def token_buckets(rows: int, most: int) -> list[int]:
    """The token counts a step of `rows` rows (a power of two) compiles for, up to `most`:
    `rows` itself (every row decoding one token), then powers of 4 above it and `most` (a step
    with prefill chunks pads its tokens by less than 4x; few programs to compile)."""
    sizes = {rows, most} | {4**i for i in range(1, most.bit_length()) if rows < 4**i < most}
    return sorted(s for s in sizes if s <= max(rows, most))


def most_tokens(rows: int, token_budget: int, chunk: int) -> int:
    """The most tokens a step of `rows` rows (a bucket) can hold, as a power of two: the
    budget's, or one chunk per row when that is less."""
    return bucket(min(token_budget, rows * chunk))


def token_bucket(t: int, rows: int, most: int) -> int:
    """The smallest of `token_buckets(rows, most)` that holds `t` tokens."""
    return next(s for s in token_buckets(rows, max(most, bucket(t))) if s >= t)


class RowPlan(NamedTuple):
    """One scheduled row of a step, as the runner packs it (a named tuple: immutable, and
    built per row per step at a tuple's cost, where a frozen dataclass cost the scheduler
    several times its own work: `benchmarks/engine_host.py`)."""

    request_id: str
    epoch: int  # the sequence's block list's generation (`RowTables.sync`)
    blocks: tuple[int, ...]  # its page table: block ids
    start: int  # the text position of its first token this step
    tokens: tuple[int, ...]  # the token ids it computes (a placeholder: one not read back yet)
    samples: bool  # the step's logits give its next token
    computed: int  # tokens it had computed before the step (decode rows run longest first)
    sampled: int  # tokens it had sampled before the step (its sampling index)
    first: int  # the slot of its first new token in each head's row
    held: int  # slots each head attends over past `base` (prefix) after the step
    base: tuple[int, ...] | int = 0  # a compressed prompt's kept tokens per head, or a ring's
    n_prefix: int = 0  # a compressed prompt's leading blocks
    n_lowrank: int = 0  # of them, the last ones: low-rank pages (the segment rebuild)
    rank_sink: int | None = None  # StreamingLLM: the sinks its window ranks after
    shift: int = 0  # StreamingLLM: the rank shift of the ring's window
    mass_rule: tuple[int, int, bool] | None = None  # H2O's (recent, protect, importance)
    evict: bool = False  # H2O's ring is full: each head's lightest slot takes the token
    limit: int = 1  # a ring's slots

    @property
    def n(self) -> int:
        return len(self.tokens)


def row_plan(seq, start: int, n: int, page: int) -> RowPlan:
    """The plain row of `seq` computing its tokens `start .. start + n` (a ring's token takes
    its slot here: `Ring.write`, the evicting policy's rule)."""
    first = seq.n_prefix * page + seq.tail  # the first new token's tail slot
    base, n_prefix = (tuple(seq.base), seq.n_prefix) if seq.compressed else (0, 0)
    n_lowrank = seq.n_lowrank if seq.compressed else 0
    held, shift, evict, limit = seq.tail + n, 0, False, 1
    ring = seq.ring
    if seq.in_ring:  # one token into the ring: a free slot, the rule's, or (H2O) the device's
        first, base, shift, evict = ring.write(start)
        held, limit = 0, ring.limit
    return RowPlan(
        request_id=seq.request_id, epoch=seq.epoch, blocks=seq.plan_blocks(), start=start,
        tokens=tuple(seq.token_slice(start, n)), samples=start + n == seq.num_tokens,
        computed=seq.num_computed, sampled=len(seq.output), first=first, held=held, base=base,
        n_prefix=n_prefix, n_lowrank=n_lowrank, rank_sink=None if ring is None else ring.rank_sink,
        shift=shift, mass_rule=None if ring is None else ring.mass_rule, evict=evict, limit=limit,
    )  # fmt: skip
