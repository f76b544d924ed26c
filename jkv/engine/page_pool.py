"""The page pool: fixed pages, reference counts, the prefix cache and recycling, on plain ints.

A page holds `page_size` tokens of ONE kv head of ONE layer (K, V and, under fp8, their scales),
so a head that keeps fewer tokens after compression holds fewer pages and the others go back to
the pool (KV-Compress's layout; vLLM's pages hold every head of a layer). Page 0 is never handed
out: page tables are padded with it.

Prefix cache (vLLM's block hashing): the prompt is cut into blocks of `page_size` tokens; block
j's hash chains the hash of block j-1, its tokens and, in the first block only, the extra keys
(weights fingerprint, kv dtype, tenant `cache_salt`), so two tenants never share a page. A full
block of an uncompressed prompt is one *group* of `num_layers * num_kv_heads` pages, cached and
shared as a whole. Compressed pages are never cached: their content no longer matches a hash.

Recycling: a page whose last user lets go keeps its content if it is cached and waits in an LRU
queue; `recycle="lazy"` (vLLM) evicts the least recently used cached page only when an
allocation needs one; `recycle="watermark"` (the seed's rule) also evicts, after every release,
until at least `recycle_below` of the pool is free of cached pages. `admission_headroom` is the
share of the pool a new request must leave free to be admitted (vLLM measured ~5% best).
"""

from __future__ import annotations

import dataclasses
import hashlib
from collections import OrderedDict, deque
from collections.abc import Sequence

NULL_PAGE = 0
RECYCLE_MODES = ("lazy", "watermark")


class OutOfPages(RuntimeError):
    """An allocation needs more pages than are free or evictable."""


def block_hashes(tokens: Sequence[int], page_size: int, extra_keys: tuple = ()) -> list[bytes]:
    """The chained hash of every FULL block of `page_size` tokens (a partial tail has none)."""
    out, parent = [], b""
    for j in range(len(tokens) // page_size):
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
    """`num_pages` pages (page 0 reserved) of `page_size` tokens; groups of `group_size` pages
    (one per layer and kv head) make one cached prompt block."""

    def __init__(
        self,
        num_pages: int,
        page_size: int,
        group_size: int,
        *,
        recycle: str = "lazy",
        recycle_below: float = 0.15,
        admission_headroom: float = 0.0,
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
        self.num_pages, self.page_size, self.group_size = num_pages, page_size, group_size
        self.recycle, self.recycle_below = recycle, recycle_below
        self.admission_headroom = admission_headroom
        self.refs = [0] * num_pages
        self.page_hash: list[bytes | None] = [None] * num_pages
        # Pages nobody holds. Uncached ones are handed out first (most recently freed first);
        # cached ones wait in LRU order (oldest first) until an allocation or the watermark
        # evicts them.
        self._free: deque[int] = deque(range(num_pages - 1, 0, -1))
        self._lru: OrderedDict[int, None] = OrderedDict()
        self._groups: dict[bytes, tuple[int, ...]] = {}  # block hash -> its pages
        self.stats = PoolStats()

    # ------------------------------------------------------------------ capacity

    @property
    def usable(self) -> int:
        """Pages that can ever be handed out (all but the null page)."""
        return self.num_pages - 1

    @property
    def free_pages(self) -> int:
        """Pages an allocation can take now: free, or cached and unused (evictable)."""
        return len(self._free) + len(self._lru)

    @property
    def cached_idle_pages(self) -> int:
        return len(self._lru)

    @property
    def used_pages(self) -> int:
        return self.usable - self.free_pages

    @property
    def usage(self) -> float:
        """Share of the pool held by requests (vLLM's kv_cache_usage_perc, 0..1)."""
        return self.used_pages / self.usable

    def can_admit(self, pages: int) -> bool:
        """Whether a new request needing `pages` leaves the admission headroom free."""
        return pages <= self.free_pages - int(self.admission_headroom * self.usable)

    # ------------------------------------------------------------------ pages

    def allocate(self, n: int) -> list[int]:
        """`n` pages, reference count 1 each; evicts least recently used cached pages when the
        free ones run out. Raises OutOfPages (taking nothing) when fewer than `n` exist."""
        if n > self.free_pages:
            raise OutOfPages(f"{n} pages asked, {self.free_pages} free or evictable")
        pages = []
        for _ in range(n):
            if self._free:
                page = self._free.pop()
            else:
                page, _ = self._lru.popitem(last=False)
                self.stats.recycled_lazy += 1 + self._forget(page)
            self.refs[page] = 1
            pages.append(page)
        return pages

    def release(self, pages: Sequence[int]) -> None:
        """Lets go of one reference to each page; a page nobody holds becomes free (cached:
        kept, at the LRU tail, in the given order; else handed out again first)."""
        for page in pages:
            if page == NULL_PAGE:
                continue
            if self.refs[page] <= 0:
                raise ValueError(f"page {page} released more often than it was held")
            self.refs[page] -= 1
            if self.refs[page] == 0:
                if self.page_hash[page] is not None:
                    self._lru[page] = None
                else:
                    self._free.append(page)
        if self.recycle == "watermark":
            self._restore_watermark()

    def _restore_watermark(self) -> None:
        want = int(self.recycle_below * self.usable)
        while len(self._free) < want and self._lru:
            page, _ = self._lru.popitem(last=False)
            self.stats.recycled_watermark += 1 + self._forget(page)
            self._free.appendleft(page)  # behind the pages freed more recently

    def _forget(self, page: int) -> int:
        """Drops a page's cached content: its whole group leaves the prefix cache. Returns how
        many of the group's other pages were idle (they become plain free pages)."""
        h = self.page_hash[page]
        group = self._groups.pop(h, ())
        mates = 0
        for p in group:
            self.page_hash[p] = None
            if p != page and p in self._lru:  # the group's other idle pages are plain free now
                del self._lru[p]
                self._free.appendleft(p)
                mates += 1
        return mates

    # ------------------------------------------------------------------ prefix cache

    def lookup(self, hashes: Sequence[bytes]) -> list[tuple[int, ...]]:
        """The groups of the longest run of leading blocks that are cached, each taken (one more
        reference per page; idle pages leave the LRU queue)."""
        found = []
        for h in hashes:
            self.stats.prefix_queries += 1
            group = self._groups.get(h)
            if group is None:
                break
            self.stats.prefix_hits += 1
            for p in group:
                if self.refs[p] == 0:
                    del self._lru[p]
                self.refs[p] += 1
            found.append(group)
        # A miss ends the prefix: the blocks after it are not looked up (not counted either).
        return found

    def publish(self, block_hash: bytes, group: Sequence[int]) -> bool:
        """Caches one full prompt block's pages (held by the caller) under its hash. Returns
        False, changing nothing, when the hash is already cached (the first copy stays)."""
        if len(group) != self.group_size:
            raise ValueError(f"a group has {self.group_size} pages, got {len(group)}")
        if block_hash in self._groups:
            return False
        if any(self.page_hash[p] is not None or self.refs[p] <= 0 for p in group):
            raise ValueError(f"pages {tuple(group)} are cached already or not held")
        self._groups[block_hash] = tuple(group)
        for p in group:
            self.page_hash[p] = block_hash
        return True

    def uncache(self, page: int) -> None:
        """Drops a held page's block from the prefix cache (its whole group), so its holder
        may overwrite it; the group's idle pages become plain free pages."""
        if self.page_hash[page] is not None:
            self.stats.uncached += 1 + self._forget(page)

    def is_cached(self, page: int) -> bool:
        return self.page_hash[page] is not None

    def check(self) -> None:
        """Internal consistency (tests): every usable page is held, free or idle-cached, once."""
        free, lru = set(self._free), set(self._lru)
        assert len(free) == len(self._free) and not (free & lru), "a page is queued twice"
        for p in range(1, self.num_pages):
            held = self.refs[p] > 0
            assert held + (p in free) + (p in lru) == 1, f"page {p}: held/free/idle mismatch"
            assert (p in lru) <= (self.page_hash[p] is not None), f"page {p}: idle but uncached"
        for h, group in self._groups.items():
            assert all(self.page_hash[p] == h for p in group), "a group lost its hash"
