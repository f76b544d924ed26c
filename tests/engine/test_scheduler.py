"""The scheduler against a fake device that writes token ids into pages: every head of every
running sequence must read back exactly its computed tokens through its page table, no step may
write into a page someone else holds, and the pool must return to empty."""

from __future__ import annotations

import random

import pytest

from jkv.engine.page_pool import OutOfPages, PagePool
from jkv.engine.scheduler import Scheduler
from jkv.engine.sequence import Sequence, Status

LAYERS, KV_HEADS = 2, 2
GROUP = LAYERS * KV_HEADS


class FakeDevice:
    """Pages as lists of (head, token id); the 'model' samples (sum of the last 3 tokens) %
    vocab. Writing the head index too makes a page read by the wrong head show. It keeps its
    own copy of the pool's block rows, told of changes as the runner tells the device: before
    each step, and after a compaction has read its sources."""

    def __init__(self, pool: PagePool, vocab: int = 50):
        self.pool, self.vocab = pool, vocab
        self.pages = {p: [None] * pool.page_size for p in range(pool.num_pages)}
        self.rows = [pool.row(b) for b in range(pool.num_blocks)]

    def sync(self):
        for b, row in zip(*self.pool.take_dirty(), strict=True):
            self.rows[b] = row

    def locate(self, seq: Sequence, head: int, slot: int) -> tuple[int, int]:
        """(page, offset) of slot `slot` of head `head` (the layout of jkv.engine.sequence,
        written again here as the reference)."""
        ps = self.pool.page_size
        if seq.compressed and not seq.in_ring and slot >= seq.base[head]:
            t = slot - seq.base[head]
            block = seq.blocks[seq.n_prefix + t // ps]
            return int(self.rows[block][head]), t % ps
        return int(self.rows[seq.blocks[slot // ps]][head]), slot % ps

    def run(self, plan) -> dict[str, int]:
        self.sync()
        for s in plan.scheduled:
            seq = s.seq
            held = seq.held(GROUP)
            for head in range(GROUP):
                for i in range(s.n):
                    slot = held[head] + i
                    assert not seq.in_ring, "the fake device has no ring"
                    page, off = self.locate(seq, head, slot)
                    assert page != 0, "a write into the null page"
                    block = seq.blocks[self.block_index(seq, head, slot)]
                    assert self.pool.refs[block] == 1, f"write into shared block {block}"
                    assert not self.pool.is_cached(block) or seq.compressed is False
                    self.pages[page][off] = (head, seq.tokens[s.start + i])
        return {
            s.seq.request_id: sum(s.seq.tokens[-3:]) % self.vocab
            for s in plan.scheduled
            if s.samples
        }

    def block_index(self, seq, head, slot):
        ps = self.pool.page_size
        if seq.compressed and not seq.in_ring and slot >= seq.base[head]:
            return seq.n_prefix + (slot - seq.base[head]) // ps
        return slot // ps

    def compact(self, seq: Sequence, old: list[int], order) -> None:
        """The runner's compaction: head h's kept slots `order[h]` (old slot ids, in order)
        read through the old rows, then written in order into the new prefix."""
        ps = self.pool.page_size
        cells = [
            [self.pages[int(self.rows[old[s // ps]][h])][s % ps] for s in order[h]]
            for h in range(GROUP)
        ]
        self.sync()
        for h in range(GROUP):
            for i, cell in enumerate(cells[h]):
                self.pages[int(self.rows[seq.blocks[i // ps]][h])][i % ps] = cell

    def read(self, seq: Sequence, head: int) -> list:
        """The token ids head `head` of `seq` reads through its table (None: another head's)."""
        cells = []
        for slot in range(seq.held(GROUP)[head]):
            page, off = self.locate(seq, head, slot)
            cells.append(self.pages[page][off])
        return [c[1] if c is not None and c[0] == head else None for c in cells]


def make(pages=200, page_size=4, **kw):
    pool = PagePool(pages, page_size, GROUP, **{k: kw.pop(k) for k in list(kw) if k in (
        "recycle", "recycle_below", "admission_headroom")})  # fmt: skip
    return pool, Scheduler(pool, num_layers=LAYERS, num_kv_heads=KV_HEADS, **kw), FakeDevice(pool)


def seq(rid, prompt, max_tokens=5, **kw):
    return Sequence(rid, list(prompt), max_tokens, arrival=0, **kw)


def run_all(sched, dev, max_steps=10_000, on_step=None):
    finished, steps = [], 0
    while sched.has_work:
        plan = sched.schedule()
        assert plan.num_tokens <= sched.token_budget
        finished += sched.finish_step(plan, dev.run(plan))
        for s in sched.running:  # every head reads back exactly its computed tokens
            for h in range(GROUP):
                assert dev.read(s, h) == s.tokens[: s.num_computed]
        sched.pool.check()
        if on_step:
            on_step(plan)
        steps += 1
        assert steps < max_steps, "no progress"
    return finished, steps


def test_one_request_prefills_in_chunks_then_decodes():
    pool, sched, dev = make(token_budget=16, chunk=8)
    sched.add(seq("a", range(1, 21), max_tokens=4))
    sizes = []
    finished, _ = run_all(sched, dev, on_step=lambda p: sizes.append([s.n for s in p.scheduled]))
    assert sizes == [[8], [8], [4], [1], [1], [1]]  # 20 prompt tokens, then 3 more decodes
    (a,) = finished
    assert len(a.output) == 4 and a.finish_reason == "length" and a.status is Status.FINISHED
    assert pool.used_pages == 0


def test_a_steps_padding_goes_to_the_prompt_it_prefills():
    """3 decoding rows and a 16-token chunk (19 tokens) run as 64 (`token_bucket` for 4 rows,
    a budget of 64): the prompt takes the 45 padded tokens too (16 before), and no step is
    padded past what its rows need while a prompt still has tokens to run."""
    from jkv.engine.plan import bucket, most_tokens, token_bucket

    pool, sched, dev = make(pages=1000, token_budget=64, chunk=16)
    for rid in "abc":
        sched.add(seq(rid, [1, 2, 3], max_tokens=40))
    first = sched.schedule()
    sched.finish_step(first, dev.run(first))  # a, b, c prefilled: now decoding
    sched.add(seq("long", range(1, 201), max_tokens=2))
    sizes, padded = [], []

    def on_step(plan):
        n = {s.seq.request_id: s.n for s in plan.scheduled}
        sizes.append(n)
        rows = bucket(len(n))
        size = token_bucket(plan.num_tokens, rows, most_tokens(rows, 64, 16))
        prefilling = any(s.seq.prefilling for s in plan.scheduled)
        padded.append(prefilling and plan.num_tokens < size)

    run_all(sched, dev, on_step=on_step)
    assert sizes[0] == {"a": 1, "b": 1, "c": 1, "long": 61}
    assert sum(s.get("long", 0) for s in sizes) == 200 + 1  # the prompt, then one decode
    assert not any(padded[:3])  # 61 + 61 + 61 + 17: only the prompt's last step is short


def test_decodes_go_first_and_a_long_prompt_never_stalls_them():
    pool, sched, dev = make(token_budget=8, chunk=8)
    sched.add(seq("short", [1, 2, 3], max_tokens=30))
    sched.add(seq("long", range(1, 101), max_tokens=2))
    seen = []
    run_all(sched, dev, on_step=lambda p: seen.append({s.seq.request_id: s.n for s in p.scheduled}))
    decoding = [s for s in seen if s.get("short") == 1]
    assert len(decoding) >= 29
    # while "short" decodes, every step has its token and at most a chunk of "long"
    start = next(i for i, s in enumerate(seen) if s.get("short") == 1)
    for s in seen[start : start + 12]:
        assert s.get("short") == 1 and s.get("long", 0) <= 7


def test_a_request_that_can_never_fit_is_refused():
    pool, sched, _ = make(pages=17, page_size=4)  # 16 usable pages: 4 tokens per head
    with pytest.raises(ValueError, match=r"needs 20 pages .* more than the pool's 16"):
        sched.add(seq("big", range(10), max_tokens=8))
    with pytest.raises(ValueError, match="empty"):
        sched.add(seq("none", []))
    sched.add(seq("ok", range(10), max_tokens=6))
    with pytest.raises(ValueError, match="already in the engine"):
        sched.add(seq("ok", range(3)))


def test_out_of_pages_preempts_the_newest_and_everyone_finishes():
    pool, sched, dev = make(
        pages=49, page_size=4, token_budget=64, chunk=16, admission="optimistic"
    )  # 48 pages; admits past what can finish
    for i in range(6):
        sched.add(seq(f"r{i}", range(1 + i, 11 + i), max_tokens=20))  # 30 tokens: 32 pages

    def newest_first(plan):
        for victim in plan.preempted:  # every victim arrived after every sequence still running
            assert all(victim.arrival > s.arrival for s in sched.running)

    finished, _ = run_all(sched, dev, on_step=newest_first)
    assert sorted(s.request_id for s in finished) == [f"r{i}" for i in range(6)]
    assert all(len(s.output) == 20 for s in finished)
    assert sched.num_preemptions > 0 and pool.used_pages == 0


def test_reserving_admission_never_preempts_requests_that_run_to_max_tokens():
    """The default admits a request only if it and every running one can finish: the pool of
    the test above runs the same six requests with no preemption, one at a time where needed,
    while the optimistic rule preempts."""
    runs = {}
    for admission in ("reserve", "optimistic"):
        pool, sched, dev = make(pages=49, page_size=4, token_budget=64, chunk=16,
                                admission=admission)  # fmt: skip
        for i in range(6):
            sched.add(seq(f"r{i}", range(1 + i, 11 + i), max_tokens=20))
        peak = []

        def count(plan, peak=peak, sched=sched):
            peak.append(len(sched.running))

        finished, _ = run_all(sched, dev, on_step=count)
        assert len(finished) == 6 and pool.used_pages == 0
        runs[admission] = (
            sched.num_preemptions,
            max(peak),
            {s.request_id: s.output for s in finished},
        )
    assert runs["reserve"][0] == 0 and runs["optimistic"][0] > 0
    assert runs["reserve"][1] == 1  # 48 pages hold one 30-token request's 32, not two
    assert runs["reserve"][2] == runs["optimistic"][2]


def test_preempted_requests_recompute_to_the_same_tokens():
    """Greedy 'sampling' depends only on the tokens: a preempted request ends as unpreempted."""
    _, roomy, dev1 = make(pages=400)
    _, tight, dev2 = make(pages=49, token_budget=64, chunk=16, admission="optimistic")
    for sched in (roomy, tight):
        for i in range(6):
            sched.add(seq(f"r{i}", range(1 + i, 11 + i), max_tokens=20))
    a, _ = run_all(roomy, dev1)
    b, _ = run_all(tight, dev2)
    assert tight.num_preemptions > 0
    assert {s.request_id: s.output for s in a} == {s.request_id: s.output for s in b}


def test_a_second_identical_prompt_hits_the_prefix_cache():
    pool, sched, dev = make(token_budget=64, chunk=64)
    prompt = list(range(1, 19))  # 18 tokens: 4 full blocks of 4
    sched.add(seq("a", prompt, max_tokens=3, extra_keys=("w", "tenant-1")))
    (a,), _ = run_all(sched, dev)
    sched.add(seq("b", prompt, max_tokens=3, extra_keys=("w", "tenant-1")))
    sched.add(seq("c", prompt, max_tokens=3, extra_keys=("w", "tenant-2")))
    first = sched.schedule()
    n = {s.seq.request_id: (s.start, s.n) for s in first.scheduled}
    assert n["b"] == (16, 2) and n["c"] == (0, 18)  # b skips 4 cached blocks; c is another tenant
    assert sched.by_id["b"].num_cached == 16 and sched.by_id["c"].num_cached == 0
    sched.finish_step(first, dev.run(first))
    finished, _ = run_all(sched, dev)
    outs = {s.request_id: s.output for s in finished}
    assert outs["b"] == outs["c"] == a.output
    assert pool.stats.prefix_hits >= 4 and pool.used_pages == 0


def test_compression_frees_pages_and_copies_shared_ones():
    pool, sched, dev = make(token_budget=64, chunk=64)
    prompt = list(range(1, 17))
    sched.add(seq("a", prompt, max_tokens=2))
    run_all(sched, dev)  # publishes the prompt's blocks
    sched.add(seq("b", prompt + [5, 5, 5, 5], max_tokens=8))
    plan = sched.schedule()
    sched.finish_step(plan, dev.run(plan))
    b = sched.by_id["b"]
    assert b.shared_blocks == 4 and b.num_computed == 20 and len(b.blocks) == 5
    before = pool.used_pages
    kept = [5, 9, 1, 20]  # per (layer, head): as many as a per-head policy keeps
    order = [list(range(20))[-k:] for k in kept]  # each head keeps its last k tokens
    old, new = sched.compress(b, kept)
    dev.compact(b, old, order)
    # its 5 prompt blocks are cached (4 from a, 1 it published): they stay there, copied on
    # write into fresh blocks. 20 tokens of 4 heads held 20 pages; the kept ones 2+3+1+5
    assert before == 20 and pool.used_pages == sum(-(-k // 4) for k in kept)
    assert all(pool.is_cached(x) for x in old) and not set(old) & set(new) and b.n_prefix == 5
    assert b.held(GROUP) == kept and b.compressed
    for h in range(GROUP):
        assert dev.read(b, h) == [b.tokens[i] for i in order[h]]
    plan = sched.schedule()  # decoding goes on: one more token on every head, in a new block
    assert [s.n for s in plan.scheduled] == [1]
    sched.finish_step(plan, dev.run(plan))
    assert b.held(GROUP) == [k + 1 for k in kept] and len(b.blocks) == 6
    for h in range(GROUP):
        assert dev.read(b, h) == [b.tokens[i] for i in order[h]] + [b.tokens[20]]
    pool.check()
    sched.abort("b")
    assert pool.used_pages == 0 and sched.abort("b") is None
    pool.check()


@pytest.mark.parametrize("recycle", ["lazy", "watermark"])
def test_200_random_requests_with_aborts_leak_no_page(recycle):
    rng = random.Random(7)
    pool, sched, dev = make(pages=161, page_size=4, token_budget=48, chunk=16, max_running=12,
                            recycle=recycle, admission_headroom=0.05)  # fmt: skip
    shared = [rng.randint(1, 40) for _ in range(12)]  # a system prompt many requests start with
    pending = []
    for i in range(200):
        body = [rng.randint(1, 40) for _ in range(rng.randint(1, 40))]
        prompt = (shared if rng.random() < 0.5 else []) + body
        tenant = rng.choice(["a", "b"])
        pending.append(seq(f"q{i}", prompt, max_tokens=rng.randint(1, 12), eos_ids=(0,),
                           extra_keys=("w", tenant)))  # fmt: skip
    aborted, finished = set(), []
    while pending or sched.has_work:
        for _ in range(rng.randint(0, 3)):
            if pending:
                sched.add(pending.pop(0))
        if sched.by_id and rng.random() < 0.1:
            rid = rng.choice(sorted(sched.by_id))
            sched.abort(rid)
            aborted.add(rid)
        plan = sched.schedule()
        finished += sched.finish_step(plan, dev.run(plan))
        for s in sched.running:
            for h in range(GROUP):
                assert dev.read(s, h) == s.tokens[: s.num_computed]
        pool.check()
    assert len(finished) + len(aborted) == 200
    assert all(s.finish_reason in ("stop", "length") for s in finished)
    assert all(len(s.output) == s.max_tokens or s.output[-1] == 0 for s in finished)
    assert pool.used_pages == 0 and not sched.by_id
    assert pool.stats.prefix_hits > 0


def test_compression_short_of_pages_takes_back_its_own_cached_pages():
    """A pool with no room for copies: the compressing sequence's prompt blocks are cached but
    only it holds them, so they leave the prefix cache and it compacts into them in place (no
    preemption, no fresh page)."""
    pool, sched, dev = make(pages=21, page_size=4, token_budget=64, chunk=64)  # 20 usable
    sched.add(seq("a", list(range(1, 17)), max_tokens=3))  # 16 tokens: 4 blocks x 4 heads
    plan = sched.schedule()
    sched.finish_step(plan, dev.run(plan))
    a = sched.by_id["a"]
    assert all(pool.is_cached(b) for b in a.blocks) and pool.free_pages == 4
    with pytest.raises(OutOfPages):
        sched.compress(a, [9, 5, 16, 1])  # copies would need 3 + 2 + 4 + 1 fresh pages
    assert pool.used_pages == 16 and all(pool.is_cached(b) for b in a.blocks)  # unchanged
    old = list(a.blocks)
    moved = sched.compress_or_preempt(a, [9, 5, 16, 1])
    assert moved is not None and sched.num_preemptions == 0
    assert moved[1] == old and a.n_prefix == 4  # every block reused in place, holes in it
    assert pool.row(old[3]) == [0, 0, pool.row(old[3])[2], 0] and pool.row(old[3])[2]
    assert pool.stats.uncached > 0 and not any(pool.is_cached(b) for b in a.blocks)
    assert pool.used_pages == 10
    pool.check()


def test_a_request_without_a_limit_reserves_what_it_is_likely_to_need():
    """`reserve`: admission counts that many output tokens (not all of max_tokens, which a
    server sets to the rest of the context when a client gives none), so more such requests
    run at once; one that outgrows its reserve takes pages as they come (preempted by the
    usual rule when they run out) and ends as it would alone."""
    runs = {}
    for reserve in (None, 8):
        pool, sched, dev = make(pages=161, page_size=4, token_budget=64, chunk=16,
                                max_running=16)  # fmt: skip
        for i in range(16):
            sched.add(seq(f"r{i}", range(1 + i, 11 + i), max_tokens=60, reserve=reserve))
        peak = []
        finished, _ = run_all(
            sched, dev, on_step=lambda p, s=sched, k=peak: k.append(len(s.running))
        )
        assert len(finished) == 16 and pool.used_pages == 0
        runs[reserve] = max(peak), {s.request_id: s.output for s in finished}
    assert runs[None][0] == 2  # 70 tokens reserved: 18 blocks x 4 pages of 160
    assert runs[8][0] >= 6  # 10 + 8 tokens: 5 blocks
    assert runs[None][1] == runs[8][1]


def test_a_reused_request_id_gets_its_own_page_table_row():
    """A request id used again after its request finished: the new sequence's table row is its
    own blocks, not the finished one's (both reached one block replacement, taking a prefix;
    rows were matched by id and that count, so the stale row, now prefix-cache blocks, stayed)."""
    from jkv.engine.runner import RowTables

    pool, sched, dev = make(token_budget=64, chunk=64)
    rows = RowTables(4, 16)
    prompt = list(range(1, 19))
    sched.add(seq("x", prompt, max_tokens=2))
    plan = sched.schedule()
    rows.sync(sched.by_id["x"])
    old = list(sched.by_id["x"].blocks)
    run_all(sched, dev)  # "x" finished; its prompt blocks stay in the prefix cache
    sched.add(seq("x", [7] * 18, max_tokens=2))  # another prompt: no prefix to share
    plan = sched.schedule()
    (s,) = plan.scheduled
    rows.keep_only({q.request_id for q in sched.running})  # `Engine._start`'s order
    row = rows.sync(s.seq)
    assert list(rows.table[row, : len(s.seq.blocks)]) == s.seq.blocks != old[: len(s.seq.blocks)]
    assert not rows.table[row, len(s.seq.blocks) :].any()


def test_a_waiting_request_counts_its_prefix_lookup_once():
    """A head-of-line request that cannot be admitted yet looks its prefix up every step, but
    `prefix_hits` counts it once, when it is admitted (3 -> 6 -> 9 -> 12 before)."""
    # 56 pages: "b" waits for room while "big" runs, its prefix blocks idle in the cache
    pool, sched, dev = make(pages=56, token_budget=64, chunk=64)
    prompt = list(range(1, 19))  # 4 full blocks of 4
    sched.add(seq("a", prompt, max_tokens=1))
    run_all(sched, dev)  # publishes the prompt's blocks
    sched.add(seq("big", range(100, 124), max_tokens=8))  # 24 tokens + 8: the pool's room
    sched.finish_step(first := sched.schedule(), dev.run(first))  # "big" admitted (a miss)
    base = (pool.stats.prefix_queries, pool.stats.prefix_hits)
    sched.add(seq("b", prompt, max_tokens=4))
    waited = 0
    while sched.has_work:
        plan = sched.schedule()
        if "b" not in {q.request_id for q in sched.running}:
            waited += 1
            assert (pool.stats.prefix_queries, pool.stats.prefix_hits) == base
        sched.finish_step(plan, dev.run(plan))
    assert waited >= 5
    assert pool.stats.prefix_hits - base[1] == 4
    assert pool.stats.prefix_queries - base[0] == 4
