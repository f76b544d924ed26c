"""The page pool: blocks of pages, loose pages, reference counts, the prefix cache, LRU and
watermark recycling."""

from __future__ import annotations

import random

import pytest

from jkv.engine.page_pool import NULL_PAGE, OutOfPages, PagePool, block_hashes


def pages_of(pool, blocks):
    return [p for b in blocks for p in pool.row(b) if p != NULL_PAGE]


def test_blocks_are_handed_out_once_and_come_back():
    pool = PagePool(9, 4, 2)  # 8 usable pages: 4 blocks of 2
    a = pool.allocate_blocks(3)
    assert len(set(a)) == 3 and pool.used_pages == 6
    assert NULL_PAGE not in pages_of(pool, a) and len(set(pages_of(pool, a))) == 6
    (b,) = pool.allocate_blocks(1)
    assert not set(pages_of(pool, a)) & set(pages_of(pool, [b])) and pool.free_pages == 0
    with pytest.raises(OutOfPages):
        pool.allocate_blocks(1)
    pool.release(a)
    assert pool.used_pages == 2 and pool.usage == 2 / 8
    pool.check()
    with pytest.raises(ValueError, match="released more often"):
        pool.release([a[0]])


def test_a_failed_allocation_takes_nothing():
    pool = PagePool(9, 4, 2)
    pool.allocate_blocks(3)
    with pytest.raises(OutOfPages, match="2 blocks of 2 pages asked, 2 pages free"):
        pool.allocate_blocks(2)
    with pytest.raises(OutOfPages, match="3 pages asked, 2 free"):
        pool.allocate_pages(3)
    assert pool.free_pages == 2
    pool.check()


def test_holes_give_pages_back_and_loose_pages_form_new_blocks():
    pool = PagePool(9, 4, 4)  # 8 usable pages: 2 blocks of 4
    x, y = pool.allocate_blocks(2)
    pool.take_dirty()
    row = pool.row(x)
    pool.release_pages([row[1], row[3]])
    row[1] = row[3] = NULL_PAGE
    pool.set_pages(x, row)  # x keeps heads 0 and 2 only
    assert pool.used_pages == 6 and pool.free_pages == 2
    ids, rows = pool.take_dirty()
    assert ids == [x] and rows == [row]
    with pytest.raises(OutOfPages):
        pool.allocate_blocks(1)  # 2 loose pages do not make a block of 4
    pool.release([x])  # a block with holes: its pages go loose, its id is free
    assert pool.free_pages == 4
    (z,) = pool.allocate_blocks(1)  # formed from the loose pages: a changed row
    ids, rows = pool.take_dirty()
    assert ids == [z] and sorted(rows[0]) == sorted(pages_of(pool, [z]))
    assert not set(pages_of(pool, [z])) & set(pages_of(pool, [y]))
    pool.check()
    pool.release([y, z])
    assert pool.used_pages == 0
    pool.check()


def test_device_rows_of_untouched_blocks_never_change():
    """Blocks that are reused whole keep their rows: only formed and holed blocks are dirty."""
    pool = PagePool(33, 4, 4)
    rows = pool.rows.tolist()
    for _ in range(20):
        got = pool.allocate_blocks(random.Random(0).randint(1, 8))
        pool.release(got)
    ids, _ = pool.take_dirty()
    assert ids == [] and rows == pool.rows.tolist()


def test_block_hashes_chain_and_separate_tenants():
    toks = list(range(10))
    h = block_hashes(toks, 4, ("w", "bf16", "tenant-a"))
    assert len(h) == 2  # the partial tail has no hash
    assert h == block_hashes(toks[:8] + [99], 4, ("w", "bf16", "tenant-a"))
    assert block_hashes(toks, 4, ("w", "bf16", "tenant-b"))[0] != h[0]
    # the chain: the same second block after a different first block hashes differently
    other = block_hashes([7, 7, 7, 7] + toks[4:8], 4, ("w", "bf16", "tenant-a"))
    assert other[1] != h[1]
    # a chain continued from its first hash equals the chain made at once
    assert block_hashes(toks, 4, ("w", "bf16", "tenant-a"), h[0], 1) == h[1:]


def _publish_prompt(pool, tokens, extra=()):
    hashes = block_hashes(tokens, pool.page_size, extra)
    blocks = pool.allocate_blocks(len(hashes))
    for hsh, b in zip(hashes, blocks, strict=True):
        assert pool.publish(hsh, b)
    return hashes, blocks


def test_prefix_lookup_shares_blocks_and_counts_hits():
    pool = PagePool(19, 2, 3)
    hashes, blocks = _publish_prompt(pool, [1, 2, 3, 4, 5, 6])
    found = pool.lookup(block_hashes([1, 2, 3, 4, 9, 9], 2))
    assert found == blocks[:2]
    assert all(pool.refs[b] == 2 for b in found)
    assert (pool.stats.prefix_queries, pool.stats.prefix_hits) == (3, 2)
    pool.check()


def test_only_whole_blocks_are_cached():
    pool = PagePool(9, 2, 2)
    (b,) = pool.allocate_blocks(1)
    row = pool.row(b)
    pool.release_pages([row[1]])
    row[1] = NULL_PAGE
    pool.set_pages(b, row)
    with pytest.raises(ValueError, match="holes"):
        pool.publish(b"h", b)


def test_idle_cached_blocks_are_evicted_lazily_least_recent_first():
    pool = PagePool(7, 2, 2)  # 6 usable pages: three blocks
    _, (g1, g2, g3) = _publish_prompt(pool, [1, 2, 3, 4, 5, 6])
    pool.release([g2])
    pool.release([g1])
    pool.release([g3])  # LRU: g2, g1, g3 (all cached and idle)
    assert pool.free_pages == 6 and pool.cached_idle_pages == 6
    pool.allocate_blocks(1)  # evicts g2
    assert pool.stats.recycled_lazy == 2
    assert pool.lookup(block_hashes([1, 2, 3, 4], 2)) == [g1]
    assert not pool.is_cached(g2)
    pages = pool.allocate_pages(1)  # a loose page: g3 is evicted and broken up
    assert not pool.is_cached(g3) and pool.free_pages == 1
    pool.new_block([pages[0], NULL_PAGE])
    pool.check()


def test_a_hit_takes_idle_blocks_out_of_the_lru_queue():
    pool = PagePool(5, 2, 2)
    hashes, (g,) = _publish_prompt(pool, [1, 2])
    pool.release([g])
    assert pool.lookup(hashes) == [g] and pool.cached_idle_pages == 0
    pool.allocate_blocks(1)  # the uncached block, not the held cached one
    with pytest.raises(OutOfPages):
        pool.allocate_blocks(1)
    pool.check()


def test_watermark_recycling_keeps_a_share_of_the_pool_uncached():
    pool = PagePool(11, 2, 2, recycle="watermark", recycle_below=0.5)  # 10 usable
    _, blocks = _publish_prompt(pool, list(range(8)))  # 8 pages in 4 blocks
    for b in blocks:
        pool.release([b])
    # 2 plain free + 8 idle cached; the watermark wants 5 plain free: blocks go, oldest first
    assert pool.stats.recycled_watermark == 4  # two blocks, both pages of each
    assert pool.free_pages - pool.cached_idle_pages >= 5
    assert pool.lookup(block_hashes(list(range(8)), 2)) == []  # the first block went first
    pool.check()


def test_admission_headroom():
    pool = PagePool(101, 4, 1, admission_headroom=0.05)
    pool.allocate_blocks(90)
    assert pool.can_admit(5) and not pool.can_admit(6)


@pytest.mark.parametrize("recycle", ["lazy", "watermark"])
def test_random_use_keeps_the_books(recycle):
    """Blocks, cached blocks, blocks with holes and loose pages at random: every page stays in
    exactly one place, and all come back."""
    rng = random.Random(0)
    pool = PagePool(64, 2, 3, recycle=recycle, recycle_below=0.2)
    held = []
    for _ in range(3000):
        r = rng.random()
        if r < 0.3 and pool.free_pages >= 3:
            try:
                held += pool.allocate_blocks(rng.randint(1, 2))
            except OutOfPages:
                pass
        elif r < 0.45:
            toks = [rng.randint(0, 3) for _ in range(rng.choice([2, 4, 6]))]
            hashes = block_hashes(toks, 2)
            found = pool.lookup(hashes)
            held += found
            for hsh in hashes[len(found) :]:
                try:
                    (b,) = pool.allocate_blocks(1)
                except OutOfPages:
                    break
                pool.publish(hsh, b)
                held.append(b)
        elif r < 0.55 and pool.free_pages >= 2 and pool.free_block_ids:
            pages = pool.allocate_pages(2)  # a block with a hole, as a compression makes
            held.append(pool.new_block([pages[0], NULL_PAGE, pages[1]]))
        elif held:
            pool.release([held.pop(rng.randrange(len(held)))])
        pool.check()
    pool.release(held)
    pool.check()
    assert pool.used_pages == 0


def test_a_sharded_pool_gives_each_heads_pages_from_its_devices_segment():
    """Two segments of 20 pages (2 layers x 2 kv heads: columns 0 and 2 are head 0's, on
    device 0): whole blocks, blocks formed from loose pages and a compression's loose pages
    all come from the segment of the column's head; each segment's first page is its null
    page; a segment that runs out refuses even while the other has pages."""
    pool = PagePool(40, 2, 4, shards=2, num_kv_heads=2)
    assert pool.usable == 38 and pool.free_pages == 38
    assert pool.segment_of_column == [0, 1, 0, 1]

    def on_their_devices(pages, columns):
        return all(
            p // 20 == pool.segment_of_column[j] for p, j in zip(pages, columns, strict=True)
        )

    blocks = pool.allocate_blocks(9)  # 9 whole blocks: 18 pages of each segment
    assert all(on_their_devices(pool.row(b), range(4)) for b in blocks)
    assert 0 not in {p for b in blocks for p in pool.row(b)}
    assert 20 not in {p for b in blocks for p in pool.row(b)}
    loose = pool.allocate_columns([3])  # the last loose page of segment 1
    assert loose == [39]
    with pytest.raises(OutOfPages):
        pool.allocate_columns([3])  # segment 1 is empty, segment 0 still has 1 page
    assert pool.free_pages == 1
    pool.release_pages(loose)
    pool.release(blocks[:2])
    cols = [0, 0, 2, 2, 2, 1]  # breaks a free block up, then takes from the loose pages
    pages = pool.allocate_columns(cols)
    assert on_their_devices(pages, cols)
    pool.release_pages(pages[1:5])
    block = pool.new_block([pages[0], pages[5], 0, 0])  # a compressed block with holes
    assert on_their_devices(pool.row(block)[:2], range(2))
    pool.check()
    with pytest.raises(ValueError, match="shards=2"):
        PagePool(41, 2, 4, shards=2, num_kv_heads=2)
