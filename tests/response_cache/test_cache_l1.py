"""L1: LRU order, both bounds, TTL, drops by model and group, thread safety."""

from __future__ import annotations

import threading

from jkv.response_cache.codec import Record
from jkv.response_cache.l1 import L1Cache


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def rec(text: str = "t", group: int | None = None) -> Record:
    return Record(text, (1,), "stop", "v", group, 0.0)


def test_lru_order_and_entry_bound():
    l1 = L1Cache(max_entries=3, max_bytes=10**6, ttl=60)
    for k in "abc":
        l1.put(k, rec(k), 10, "m")
    assert l1.get("a").text == "a"  # a is now most recent
    l1.put("d", rec("d"), 10, "m")
    assert l1.get("b") is None and l1.get("a") and l1.get("c") and l1.get("d")
    assert (len(l1), l1.evictions, l1.nbytes) == (3, 1, 30)


def test_byte_bound():
    l1 = L1Cache(max_entries=100, max_bytes=100, ttl=60)
    for i in range(5):
        l1.put(str(i), rec(), 30, "m")
    assert len(l1) == 3 and l1.nbytes == 90
    assert l1.put("huge", rec(), 101, "m") is False and len(l1) == 3
    l1.put("1", rec(), 60, "m")  # replacing re-counts its bytes
    assert l1.nbytes <= 100 and l1.get("1") is not None


def test_ttl():
    clock = Clock()
    l1 = L1Cache(max_entries=10, max_bytes=1000, ttl=5, clock=clock)
    l1.put("a", rec(), 1, "m")
    clock.now = 4.9
    assert l1.get("a") is not None
    clock.now = 5.0
    assert l1.get("a") is None and l1.expirations == 1 and l1.nbytes == 0


def test_drop_by_model_and_group():
    l1 = L1Cache(max_entries=100, max_bytes=10**6, ttl=60)
    l1.put("m1-g1", rec(group=1), 1, "m1")
    l1.put("m1-g2", rec(group=2), 1, "m1")
    l1.put("m1-none", rec(), 1, "m1")
    l1.put("m2-g1", rec(group=1), 1, "m2")
    assert l1.drop_group("m1", 1) == 1
    assert l1.get("m1-g1") is None and l1.get("m2-g1") is not None
    assert l1.drop_model("m1") == 2
    assert [k for k in ("m1-g2", "m1-none", "m2-g1") if l1.get(k)] == ["m2-g1"]
    assert l1.drop_model("nothing") == 0 and l1.drop_group("m2", 9) == 0
    assert l1.clear() == 1 and len(l1) == 0 and l1.nbytes == 0
    assert l1._by_model == {} and l1._by_group == {}  # indexes do not leak


def test_indexes_follow_evictions():
    l1 = L1Cache(max_entries=2, max_bytes=10**6, ttl=60)
    for i in range(10):
        l1.put(str(i), rec(group=i % 3), 1, f"m{i % 2}")
    assert sum(len(v) for v in l1._by_model.values()) == 2
    assert sum(len(v) for v in l1._by_group.values()) == 2


def test_concurrent_use_keeps_the_books_balanced():
    l1 = L1Cache(max_entries=50, max_bytes=2000, ttl=60)

    def work(seed: int) -> None:
        for i in range(2000):
            k = str((i * 7 + seed) % 120)
            if i % 3:
                l1.put(k, rec(group=i % 4), 1 + i % 50, f"m{i % 2}")
            elif i % 5:
                l1.get(k)
            else:
                l1.drop_group(f"m{i % 2}", i % 4)

    threads = [threading.Thread(target=work, args=(s,)) for s in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(l1) <= 50 and l1.nbytes <= 2000
    assert l1.nbytes == sum(e.nbytes for e in l1._data.values())
    assert sum(len(v) for v in l1._by_model.values()) == len(l1)
