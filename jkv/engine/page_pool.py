"""The page pool: pages, blocks of pages, reference counts, the prefix cache and recycling, on
plain ints.

A *page* holds `page_size` tokens of ONE kv head of ONE layer (K, V, positions and, under fp8,
their scales): the device stores exactly the pool's pages, `[num_pages, page_size, H]`, page 0
being the null page tables are padded with. A *block* is `page_size` token positions of a
sequence over every (layer, kv head): a row of `group_size = num_layers * num_kv_heads` page
ids, `row(block)[layer * num_kv_heads + head]` (vLLM's block, with KV-Compress's pages
inside; the rows are one flat int32 `array`, the host copy of the device's `block_pages`).
A sequence's page table is its list of block ids: one table for every head, however
many layers the model has. Once a KV policy makes heads differ, a block may have holes (page 0
where a head keeps nothing) and its pages are handed back one by one.

Free storage is kept as whole free blocks (their page rows intact, reused with no change on the
device) and loose pages (from blocks with holes, or blocks broken up for a compression's
pages). A block formed anew from loose pages changes its row: the rows changed
since the last `take_dirty()` are what the runner writes to the device.

Prefix cache (vLLM's block hashing): the prompt is cut into blocks of `page_size` tokens; block
j's hash chains the hash of block j-1, its tokens and, in the first block only, the extra keys
(weights fingerprint, kv dtype, key layout, tenant), so two tenants or two key layouts never
share a block. Only full blocks of uncompressed prompts are cached.

Recycling: a cached block whose last user lets go keeps its content and waits in an LRU queue;
`recycle="lazy"` (vLLM) evicts the least recently used one only when an allocation needs it;
`recycle="watermark"` (the seed's rule) also evicts, after every release, until at least
`recycle_below` of the pool is free of cached pages. `admission_headroom` is the share of the
pool a new request must leave free to be admitted (vLLM measured ~5% best).

Sharded over kv heads (`shards` > 1, the engine's tensor-parallel degree): the pages are
`shards` equal segments, segment s the pages `[s * P / shards, (s + 1) * P / shards)` that
device s of the "model" axis stores, its first page that device's null page. Column j of a
block (kv head `j % num_kv_heads`) always gets its page from the segment of the device that
owns its head, so a head's pages live with its weights; loose pages are kept per segment.

Events (optional, `events=`): an object told of every change to the prefix cache, so that a
router can index this replica (`jkv serve --kv-events-endpoint`, vLLM's KV events):
`stored(block_hash, parent_hash, token_ids, block_size)` when a block is cached (parent None
for a prompt's first block), `removed(block_hash)` when one is forgotten (recycled, or taken
back by its holder), `cleared()` when all are (`clear_cache`). Called inline: keep it cheap.
"""

from __future__ import annotations

import dataclasses
import hashlib
from array import array
from collections import OrderedDict
from collections.abc import Sequence

NULL_PAGE = 0
NULL_BLOCK = 0
RECYCLE_MODES = ("lazy", "watermark")


class OutOfPages(RuntimeError):
    """An allocation needs more pages (or block ids) than are free or evictable."""


def block_hashes(
    tokens: Sequence[int], page_size: int, extra_keys: tuple = (), parent: bytes = b"", first=0
) -> list[bytes]:
    """The chained hash of every FULL block of `page_size` tokens (a partial tail has none).
    `parent` and `first`: continue a chain whose blocks before `first` are hashed already."""
    out = []
    for j in range(first, len(tokens) // page_size):
        h = hashlib.blake2b(digest_size=16)
        h.update(parent)
        h.update(b",".join(str(t).encode() for t in tokens[j * page_size : (j + 1) * page_size]))
        if j == 0:
            h.update(repr(tuple(extra_keys)).encode())
        parent = h.digest()
        out.append(parent)
    return out


@dataclasses.dataclass
class PoolStats:
    """Counters since the pool was made (ints; the server exports them)."""

    prefix_queries: int = 0  # blocks looked up
    prefix_hits: int = 0  # blocks found
    recycled_lazy: int = 0  # idle cached pages dropped from the cache for an allocation
    recycled_watermark: int = 0  # idle cached pages dropped to restore the watermark
    uncached: int = 0  # cached pages dropped so that their holder could compact into them


class PagePool:
    """`num_pages` pages (page 0 reserved) of `page_size` tokens, in blocks of `group_size`
    pages (one per layer and kv head); `num_blocks` block ids (0 reserved), by default twice
    the whole blocks the pages make (blocks with holes need ids of their own)."""

    def __init__(
        self,
        num_pages: int,
        page_size: int,
        group_size: int,
        *,
        recycle: str = "lazy",
        recycle_below: float = 0.15,
        admission_headroom: float = 0.0,
        num_blocks: int | None = None,
        shards: int = 1,
        num_kv_heads: int = 1,
        events=None,
    ):
        for name, value, low in (("num_pages", num_pages, 2), ("page_size", page_size, 1),
                                 ("group_size", group_size, 1)):  # fmt: skip
            if isinstance(value, bool) or not isinstance(value, int) or value < low:
                raise ValueError(f"{name}={value!r}: expected an int >= {low}")
        if recycle not in RECYCLE_MODES:
            raise ValueError(f"recycle={recycle!r}: expected one of {RECYCLE_MODES}")
        for name, value in (("recycle_below", recycle_below),
                            ("admission_headroom", admission_headroom)):  # fmt: skip
            if not 0.0 <= value < 1.0:
                raise ValueError(f"{name}={value!r}: expected a fraction in [0, 1)")
        g = group_size
        if num_pages % shards or g % shards or num_kv_heads % shards or g % num_kv_heads:
            raise ValueError(
                f"num_pages={num_pages}, group_size={g}, num_kv_heads={num_kv_heads}: each must "
                f"split into shards={shards} equal parts (and group_size into kv heads)"
            )
        # column j's segment: the device owning kv head j % K; pages [s * seg, (s + 1) * seg)
        self.shards, seg, per = shards, num_pages // shards, g // shards
        self.segment_of_column = [(j % num_kv_heads) * shards // num_kv_heads for j in range(g)]
        whole = (seg - 1) // per
        num_blocks = 2 * whole + 2 if num_blocks is None else num_blocks
        if whole < 1 or num_blocks < whole + 1:
            raise ValueError(
                f"num_pages={num_pages}, num_blocks={num_blocks}: expected at least "
                f"{shards * (per + 1)} pages and {whole + 1} block ids"
            )
        self.num_pages, self.page_size, self.group_size = num_pages, page_size, g
        self.segment_pages = seg
        self.num_blocks = num_blocks
        self.recycle, self.recycle_below = recycle, recycle_below
        self.admission_headroom = admission_headroom
        # block b's pages (page 0: a hole) are rows[b * g : (b + 1) * g]: the host copy of
        # the device's block table
        self.rows = array("i", bytes(4 * num_blocks * g))
        rank = [self.segment_of_column[:j].count(self.segment_of_column[j]) for j in range(g)]
        for b in range(1, whole + 1):  # one shard: pages 1 .. whole * g in row order
            self.rows[b * g : (b + 1) * g] = array(
                "i", (s * seg + 1 + (b - 1) * per + r
                      for s, r in zip(self.segment_of_column, rank, strict=True)),
            )  # fmt: skip
        self.refs = [0] * num_blocks
        self.block_hash: list[bytes | None] = [None] * num_blocks
        # Free whole blocks (uncached, nobody holds them), most recently freed last; loose
        # pages; block ids with no pages; cached blocks nobody holds, in LRU order.
        self._free_blocks: list[int] = list(range(whole, 0, -1))
        self._loose: list[list[int]] = [  # per segment, lowest page last (popped first)
            list(range((s + 1) * seg - 1, s * seg + whole * per, -1)) for s in range(shards)
        ]
        self._free_ids: list[int] = list(range(num_blocks - 1, whole, -1))
        self._lru: OrderedDict[int, None] = OrderedDict()
        self._cached: dict[bytes, int] = {}  # block hash -> block
        self._dirty: set[int] = set()
        self.stats = PoolStats()
        self.events = events

    # ------------------------------------------------------------------ capacity (pages)

    @property
    def usable(self) -> int:
        """Pages that can ever be handed out (all but the null page of each segment)."""
        return self.num_pages - self.shards

    @property
    def free_pages(self) -> int:
        """Pages an allocation can take now: free, or cached and unused (evictable)."""
        loose = sum(len(x) for x in self._loose)
        return self.group_size * (len(self._free_blocks) + len(self._lru)) + loose

    def segment(self, page: int) -> int:
        """The segment (model-axis device) that stores `page`."""
        return page // self.segment_pages

    @property
    def cached_idle_pages(self) -> int:
        return self.group_size * len(self._lru)

    @property
    def used_pages(self) -> int:
        return self.usable - self.free_pages

    @property
    def usage(self) -> float:
        """Share of the pool held by requests (vLLM's kv_cache_usage_perc, 0..1)."""
        return self.used_pages / self.usable

    @property
    def free_block_ids(self) -> int:
        """Block ids `new_block` can still give (a compression's copied blocks)."""
        return len(self._free_ids)

    def can_admit(self, pages: int) -> bool:
        """Whether a new request needing `pages` leaves the admission headroom free."""
        return pages <= self.free_pages - int(self.admission_headroom * self.usable)

    def row(self, block: int) -> list[int]:
        """The pages of `block`, one per (layer, kv head); 0 where it has a hole."""
        g = self.group_size
        return self.rows[block * g : (block + 1) * g].tolist()

    def take_dirty(self) -> tuple[list[int], list[list[int]]]:
        """(block ids, their rows) changed since the last call: what the device's copy of the
        rows must be told."""
        ids = sorted(self._dirty)
        self._dirty.clear()
        return ids, [self.row(b) for b in ids]

    # ------------------------------------------------------------------ blocks

    def allocate_blocks(self, n: int) -> list[int]:
        """`n` whole blocks, reference count 1 each: free ones first, then ones formed from
        loose pages, then least recently used cached ones evicted. Raises OutOfPages (taking
        nothing) when that cannot make `n`."""
        if n <= 0:
            return []
        g, per = self.group_size, self.group_size // self.shards
        formable = min(min(len(x) for x in self._loose) // per, len(self._free_ids))
        if n > len(self._free_blocks) + formable + len(self._lru):
            raise OutOfPages(
                f"{n} blocks of {g} pages asked, {self.free_pages} pages free or evictable"
            )
        out = []
        for _ in range(n):
            if self._free_blocks:
                block = self._free_blocks.pop()
            elif min(len(x) for x in self._loose) >= per and self._free_ids:
                block = self._free_ids.pop()
                self._set_row(block, [self._loose[s].pop() for s in self.segment_of_column])
            else:
                block, _ = self._lru.popitem(last=False)
                self._forget(block)
                self.stats.recycled_lazy += g
            self.refs[block] = 1
            out.append(block)
        return out

    def new_block(self, pages: Sequence[int]) -> int:
        """A block of the given pages (0: a hole), held once; its row is dirty. Raises
        OutOfPages when no block id is free."""
        if not self._free_ids:
            raise OutOfPages(f"all {self.num_blocks - 1} block ids are in use")
        block = self._free_ids.pop()
        self._set_row(block, pages)
        self.refs[block] = 1
        return block

    def set_pages(self, block: int, pages: Sequence[int]) -> None:
        """Rewrites the pages of a block its caller alone holds (a compression's holes)."""
        if self.refs[block] != 1 or self.block_hash[block] is not None:
            raise ValueError(f"block {block} is shared or cached: it cannot change")
        self._set_row(block, pages)

    def _set_row(self, block: int, pages: Sequence[int]) -> None:
        g = self.group_size
        self.rows[block * g : (block + 1) * g] = array("i", pages)
        self._dirty.add(block)

    def allocate_pages(self, n: int) -> list[int]:
        """`n` loose pages of one segment's columns (an unsharded pool's: any column's)."""
        return self.allocate_columns([0] * n)

    def allocate_columns(self, columns: Sequence[int]) -> list[int]:
        """A loose page for each of `columns` (a compressed head's own), from its column's
        segment, breaking free blocks up, and evicting cached ones, when the loose ones run
        out. Raises OutOfPages (taking nothing)."""
        want = [0] * self.shards
        for j in columns:
            want[self.segment_of_column[j]] += 1
        per = self.group_size // self.shards
        breaks = max(-(-(w - len(x)) // per) for w, x in zip(want, self._loose, strict=True))
        if breaks > len(self._free_blocks) + len(self._lru):
            raise OutOfPages(f"{len(columns)} pages asked, {self.free_pages} free or evictable")
        for _ in range(breaks):
            if self._free_blocks:
                block = self._free_blocks.pop()
            else:
                block, _ = self._lru.popitem(last=False)
                self._forget(block)
                self.stats.recycled_lazy += self.group_size
            self._break(block)
        return [self._loose[self.segment_of_column[j]].pop() for j in columns]

    def _break(self, block: int) -> None:
        """An unheld, uncached block's pages become loose and its id free."""
        self.release_pages(reversed(self.row(block)))
        self._free_ids.append(block)

    def release_pages(self, pages: Sequence[int]) -> None:
        """Loose pages back to the pool (a compression's dropped pages)."""
        for p in pages:
            if p != NULL_PAGE:
                self._loose[p // self.segment_pages].append(p)

    def release(self, blocks: Sequence[int]) -> None:
        """Lets go of one reference to each block; a block nobody holds becomes free (cached:
        kept, at the LRU tail, in the given order; whole: reused first; with holes: its pages
        loose)."""
        for block in blocks:
            if block == NULL_BLOCK:
                continue
            if self.refs[block] <= 0:
                raise ValueError(f"block {block} released more often than it was held")
            self.refs[block] -= 1
            if self.refs[block] > 0:
                continue
            if self.block_hash[block] is not None:
                self._lru[block] = None
            elif NULL_PAGE not in self.row(block):
                self._free_blocks.append(block)
            else:
                self._break(block)
        if self.recycle == "watermark":
            self._restore_watermark()

    def _restore_watermark(self) -> None:
        want = int(self.recycle_below * self.usable)
        while self.free_pages - self.cached_idle_pages < want and self._lru:
            block, _ = self._lru.popitem(last=False)
            self._forget(block)
            self.stats.recycled_watermark += self.group_size
            self._free_blocks.insert(0, block)  # behind the blocks freed more recently

    def _forget(self, block: int) -> None:
        self._cached.pop(self.block_hash[block], None)
        if self.events is not None:
            self.events.removed(self.block_hash[block])
        self.block_hash[block] = None

    # ------------------------------------------------------------------ prefix cache

    def lookup(self, hashes: Sequence[bytes], *, count: bool = True) -> list[int]:
        """The blocks of the longest run of leading hashes that are cached, each taken (one
        more reference; idle ones leave the LRU queue). `count=False`: not in `stats` (the
        scheduler counts an admission's lookup once, with `count_lookup`, however many steps
        a waiting request tried)."""
        found = []
        for h in hashes:
            block = self._cached.get(h)
            if block is None:
                break  # a miss ends the prefix: later blocks are neither looked up nor counted
            if self.refs[block] == 0:
                del self._lru[block]
            self.refs[block] += 1
            found.append(block)
        if count:
            self.count_lookup(len(hashes), len(found))
        return found

    def count_lookup(self, looked: int, found: int) -> None:
        """Counts a lookup of `looked` leading hashes that found `found` blocks (the blocks
        looked up: those found, and the first miss)."""
        self.stats.prefix_queries += min(looked, found + 1)
        self.stats.prefix_hits += found

    def publish(self, block_hash: bytes, block: int, parent=None, tokens=()) -> bool:
        """Caches one full prompt block (held by the caller) under its hash. Returns False,
        changing nothing, when the hash is cached already (the first copy stays). `parent`
        (the previous block's hash) and `tokens` (the block's) are for `events`."""
        if block_hash in self._cached:
            return False
        if self.block_hash[block] is not None or self.refs[block] <= 0:
            raise ValueError(f"block {block} is cached already or not held")
        if NULL_PAGE in self.row(block):
            raise ValueError(f"block {block} has holes: only whole blocks are cached")
        self._cached[block_hash] = block
        self.block_hash[block] = block_hash
        if self.events is not None:
            self.events.stored(block_hash, parent, list(tokens), self.page_size)
        return True

    def uncache(self, block: int) -> None:
        """Drops a held block from the prefix cache, so its holder may overwrite it."""
        if self.block_hash[block] is not None:
            self._forget(block)
            self.stats.uncached += self.group_size

    def is_cached(self, block: int) -> bool:
        return self.block_hash[block] is not None

    def clear_cache(self) -> int:
        """Forgets every cached block (their bytes were lost: a pool rebuilt after a failed
        step). Idle ones become free. Returns how many were dropped."""
        n = len(self._cached)
        for block in self._cached.values():
            self.block_hash[block] = None
        self._cached.clear()
        while self._lru:
            block, _ = self._lru.popitem(last=False)
            self._free_blocks.append(block)
        if self.events is not None:
            self.events.cleared()
        return n

    def check(self) -> None:
        """Internal consistency (tests): every usable page belongs to exactly one place (a held
        or idle block, a free block, or the loose pages), every block id to one state."""
        free, lru, ids = set(self._free_blocks), set(self._lru), set(self._free_ids)
        assert len(free) == len(self._free_blocks) and len(ids) == len(self._free_ids)
        assert not (free & lru or free & ids or lru & ids), "a block is queued twice"
        seen = [0] * self.num_pages
        for b in range(1, self.num_blocks):
            held = self.refs[b] > 0
            assert held + (b in free) + (b in lru) + (b in ids) == 1, f"block {b}: state mismatch"
            assert (b in lru) <= (self.block_hash[b] is not None), f"block {b}: idle, uncached"
            for p in self.row(b) if b not in ids else ():
                seen[p] += 1
        for s, loose in enumerate(self._loose):
            for p in loose:
                assert p // self.segment_pages == s, f"page {p} loose in segment {s}"
                seen[p] += 1
        for b in range(1, self.num_blocks):
            for j, p in enumerate(self.row(b) if b not in ids else ()):
                assert p == NULL_PAGE or self.segment(p) == self.segment_of_column[j], (
                    f"block {b}: page {p} of column {j} is not on its head's device"
                )
        null = set(range(0, self.num_pages, self.segment_pages))
        wrong = [p for p in range(1, self.num_pages) if seen[p] != (p not in null)]
        assert not wrong, f"pages owned twice or lost: {wrong[:10]}"
        for h, b in self._cached.items():
            assert self.block_hash[b] == h, "a cached block lost its hash"
