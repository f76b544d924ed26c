"""The page pool: allocation, reference counts, the prefix cache, LRU and watermark recycling."""

from __future__ import annotations

import random

import pytest

from jkv.engine.page_pool import NULL_PAGE, OutOfPages, PagePool, block_hashes


def test_pages_are_handed_out_once_and_come_back():
    pool = PagePool(9, 4, 2)
    a = pool.allocate(5)
    assert NULL_PAGE not in a and len(set(a)) == 5 and pool.used_pages == 5
    b = pool.allocate(3)
    assert not set(a) & set(b) and pool.free_pages == 0
    with pytest.raises(OutOfPages):
        pool.allocate(1)
    pool.release(a)
    assert pool.used_pages == 3 and pool.usage == 3 / 8
    pool.check()
    with pytest.raises(ValueError, match="released more often"):
        pool.release([a[0]])


def test_a_failed_allocation_takes_nothing():
    pool = PagePool(5, 4, 1)
    pool.allocate(3)
    with pytest.raises(OutOfPages, match="2 pages asked, 1 free"):
        pool.allocate(2)
    assert pool.free_pages == 1
    pool.check()


def test_block_hashes_chain_and_separate_tenants():
    toks = list(range(10))
    h = block_hashes(toks, 4, ("w", "bf16", "tenant-a"))
    assert len(h) == 2  # the partial tail has no hash
    assert h == block_hashes(toks[:8] + [99], 4, ("w", "bf16", "tenant-a"))
    assert block_hashes(toks, 4, ("w", "bf16", "tenant-b"))[0] != h[0]
    # the chain: the same second block after a different first block hashes differently
    other = block_hashes([7, 7, 7, 7] + toks[4:8], 4, ("w", "bf16", "tenant-a"))
    assert other[1] != h[1]


def _publish_prompt(pool, tokens, extra=()):
    hashes = block_hashes(tokens, pool.page_size, extra)
    groups = [pool.allocate(pool.group_size) for _ in hashes]
    for hsh, g in zip(hashes, groups, strict=True):
        assert pool.publish(hsh, g)
    return hashes, groups


def test_prefix_lookup_shares_pages_and_counts_hits():
    pool = PagePool(17, 2, 3)
    hashes, groups = _publish_prompt(pool, [1, 2, 3, 4, 5, 6])
    found = pool.lookup(block_hashes([1, 2, 3, 4, 9, 9], 2))
    assert found == [tuple(groups[0]), tuple(groups[1])]
    assert all(pool.refs[p] == 2 for g in found for p in g)
    assert (pool.stats.prefix_queries, pool.stats.prefix_hits) == (3, 2)
    pool.check()


def test_idle_cached_pages_are_evicted_lazily_least_recent_first():
    pool = PagePool(7, 2, 2)  # 6 usable pages: three groups
    _, (g1, g2, g3) = _publish_prompt(pool, [1, 2, 3, 4, 5, 6])
    pool.release(g2)
    pool.release(g1)
    pool.release(g3)  # LRU: g2, g1, g3 (all cached and idle)
    assert pool.free_pages == 6 and pool.cached_idle_pages == 6
    pool.allocate(1)  # evicts g2's first page, and g2 leaves the cache as a whole
    assert pool.stats.recycled_lazy == 2
    assert pool.lookup(block_hashes([1, 2, 3, 4], 2)) == [tuple(g1)]
    assert not any(pool.is_cached(p) for p in g2)
    pool.check()


def test_a_hit_takes_idle_pages_out_of_the_lru_queue():
    pool = PagePool(5, 2, 2)
    hashes, (g,) = _publish_prompt(pool, [1, 2])
    pool.release(g)
    assert pool.lookup(hashes) == [tuple(g)] and pool.cached_idle_pages == 0
    pool.allocate(2)  # the two uncached pages, not the held cached ones
    with pytest.raises(OutOfPages):
        pool.allocate(1)
    pool.check()


def test_watermark_recycling_keeps_a_share_of_the_pool_uncached():
    pool = PagePool(11, 2, 2, recycle="watermark", recycle_below=0.5)  # 10 usable
    _, groups = _publish_prompt(pool, list(range(8)))  # 8 pages in 4 groups
    for g in groups:
        pool.release(g)
    # 2 plain free + 8 idle cached; the watermark wants 5 plain free: groups go, oldest first
    assert pool.stats.recycled_watermark == 4  # two groups, both pages of each
    assert pool.free_pages - pool.cached_idle_pages >= 5
    assert pool.lookup(block_hashes(list(range(8)), 2)) == []  # the first block went first
    pool.check()


def test_admission_headroom():
    pool = PagePool(101, 4, 1, admission_headroom=0.05)
    pool.allocate(90)
    assert pool.can_admit(5) and not pool.can_admit(6)


@pytest.mark.parametrize("recycle", ["lazy", "watermark"])
def test_random_use_keeps_the_books(recycle):
    rng = random.Random(0)
    pool = PagePool(64, 2, 3, recycle=recycle, recycle_below=0.2)
    held = []
    for _ in range(2000):
        r = rng.random()
        if r < 0.35 and pool.free_pages >= 3:
            held.append(pool.allocate(rng.randint(1, 3)))
        elif r < 0.5:
            toks = [rng.randint(0, 3) for _ in range(rng.choice([2, 4, 6]))]
            hashes = block_hashes(toks, 2)
            found = pool.lookup(hashes)
            held.extend(list(g) for g in found)
            for hsh in hashes[len(found) :]:
                if pool.free_pages < 3:
                    break
                g = pool.allocate(3)
                pool.publish(hsh, g)
                held.append(g)
        elif held:
            pool.release(held.pop(rng.randrange(len(held))))
        pool.check()
    for g in held:
        pool.release(g)
    pool.check()
    assert pool.used_pages == 0
