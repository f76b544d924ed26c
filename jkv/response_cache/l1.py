"""L1: the in-process LRU with a TTL, bounded by entries and by bytes.

An `OrderedDict` under one lock gives O(1) get / put / evict (`move_to_end`, `popitem`).
Two small indexes (model -> keys, (model, group) -> keys) make dropping a model or an
embedding group proportional to what is dropped, not to the cache size. A hand-written LRU
rather than `cachetools.TTLCache`: this one is 3-4x faster on a hit (benchmarks/cache.py,
`l1_struct_*` rows) and needs the side indexes anyway.

Expired entries are removed lazily, when looked up or when LRU order reaches them.
"""

from __future__ import annotations

import threading
import time
from collections import OrderedDict
from collections.abc import Callable

from jkv.response_cache.codec import Record


class _Entry:
    __slots__ = ("record", "nbytes", "expires", "model", "group")

    def __init__(self, record: Record, nbytes: int, expires: float, model: str) -> None:
        self.record = record
        self.nbytes = nbytes
        self.expires = expires
        self.model = model
        self.group = record.group_id


class L1Cache:
    """Thread-safe LRU of decoded records with a TTL.

    Args:
        max_entries: most entries kept.
        max_bytes: most encoded-value bytes kept (the size a value has in L2).
        ttl: seconds an entry lives.
        clock: monotonic time source (tests pass a fake one).
    """

    def __init__(
        self,
        max_entries: int,
        max_bytes: int,
        ttl: float,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._max_entries = max_entries
        self._max_bytes = max_bytes
        self._ttl = ttl
        self._clock = clock
        self._lock = threading.Lock()
        self._data: OrderedDict[str, _Entry] = OrderedDict()
        self._by_model: dict[str, set[str]] = {}
        self._by_group: dict[tuple[str, int], set[str]] = {}
        self._bytes = 0
        self.evictions = 0
        self.expirations = 0
        self.flushes = 0

    def get(self, key: str) -> Record | None:
        """The live record under `key` (and marks it recently used), else None.

        A hit takes no lock: `OrderedDict.get` and `move_to_end` are single C calls, atomic
        under the GIL, and a key that a writer evicted in between is simply not moved.
        """
        entry = self._data.get(key)
        if entry is None:
            return None
        if entry.expires <= self._clock():
            with self._lock:
                if self._data.get(key) is entry:
                    self._remove(key, entry)
                    self.expirations += 1
            return None
        try:
            self._data.move_to_end(key)
        except KeyError:
            pass
        return entry.record

    def put(self, key: str, record: Record, nbytes: int, model: str) -> bool:
        """Stores a record, evicting least recently used entries to stay within bounds.

        Args:
            key: the response key.
            record: the decoded value.
            nbytes: its encoded size.
            model: the model name (for `drop_model`).

        Returns:
            False when the value alone exceeds the byte bound (not stored).
        """
        if nbytes > self._max_bytes:
            return False
        entry = _Entry(record, nbytes, self._clock() + self._ttl, model)
        with self._lock:
            old = self._data.get(key)
            if old is not None:
                self._remove(key, old)
            self._data[key] = entry
            self._bytes += nbytes
            keys = self._by_model.get(model)
            if keys is None:
                keys = self._by_model[model] = set()
            keys.add(key)
            if entry.group is not None:
                self._by_group.setdefault((model, entry.group), set()).add(key)
            while len(self._data) > self._max_entries or self._bytes > self._max_bytes:
                old_key, old_entry = self._data.popitem(last=False)
                self._unindex(old_key, old_entry)
                self.evictions += 1
        return True

    def drop_model(self, model: str) -> int:
        """Removes every entry of one model (all generations). Returns how many."""
        with self._lock:
            keys = self._by_model.get(model, ())
            return self._drop_keys(list(keys))

    def drop_group(self, model: str, group: int) -> int:
        """Removes every entry of one model's embedding group. Returns how many."""
        with self._lock:
            keys = self._by_group.get((model, group), ())
            return self._drop_keys(list(keys))

    def discard(self, key: str) -> None:
        """Removes one key if present."""
        with self._lock:
            entry = self._data.get(key)
            if entry is not None:
                self._remove(key, entry)

    def clear(self) -> int:
        """Removes everything (after a lost invalidation channel). Returns how many."""
        with self._lock:
            n = len(self._data)
            self._data.clear()
            self._by_model.clear()
            self._by_group.clear()
            self._bytes = 0
            self.flushes += 1
            return n

    def __len__(self) -> int:
        return len(self._data)

    @property
    def nbytes(self) -> int:
        """Encoded bytes currently held."""
        return self._bytes

    def _drop_keys(self, keys: list[str]) -> int:
        for key in keys:
            self._remove(key, self._data[key])
        return len(keys)

    def _remove(self, key: str, entry: _Entry) -> None:
        del self._data[key]
        self._unindex(key, entry)

    def _unindex(self, key: str, entry: _Entry) -> None:
        self._bytes -= entry.nbytes
        keys = self._by_model.get(entry.model)
        if keys is not None:
            keys.discard(key)
            if not keys:
                del self._by_model[entry.model]
        if entry.group is not None:
            gkey = (entry.model, entry.group)
            keys = self._by_group.get(gkey)
            if keys is not None:
                keys.discard(key)
                if not keys:
                    del self._by_group[gkey]
