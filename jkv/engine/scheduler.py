"""Continuous batching over the page pool: which tokens of which sequences run in the next model
step, and who gives their pages back. Plain Python on ints (vLLM v1's scheduler, nano-vllm's).

Each step has a token budget. Running sequences go first, oldest first (a decoding sequence
needs one token; one still prefilling its next chunk), then waiting ones in arrival order
(preempted ones at the front), each new admission taking its prompt's cached prefix from the
pool and then a chunk of at most `chunk` tokens (more where the step would otherwise pad to its
compiled size: `Scheduler._fill`). When a running sequence cannot get the pages
for its tokens, the newest running sequence is preempted: its pages go back and it waits to be
recomputed. A request that could never fit in the pool is refused when it is added.
"""

from __future__ import annotations

import dataclasses
import itertools
from collections import deque

from jkv.engine.page_pool import OutOfPages, PagePool, block_hashes
from jkv.engine.plan import RowPlan, bucket, most_tokens, row_plan, token_bucket
from jkv.engine.sequence import EPOCHS, Sequence, Status

ADMISSIONS = ("reserve", "optimistic")


@dataclasses.dataclass
class Scheduled:
    """One sequence's share of a step: tokens `start .. start + n` of `seq.tokens` are computed;
    `samples` when they reach the end of its known tokens (the step's logits give the next one).
    `row`: the same, as plain data fixed when planned (what the runner packs); `seq`: the live
    sequence, for the engine's and the scheduler's bookkeeping once the step has run."""

    seq: Sequence
    start: int
    n: int
    row: RowPlan

    @property
    def samples(self) -> bool:
        return self.row.samples


@dataclasses.dataclass
class StepPlan:
    scheduled: list[Scheduled]
    preempted: list[Sequence]
    # Admitted with a KV context (`Sequence.context`): its slots go into its prefix first
    contexts: list[Sequence] = dataclasses.field(default_factory=list)

    @property
    def num_tokens(self) -> int:
        return sum(s.n for s in self.scheduled)


class Scheduler:
    def __init__(
        self,
        pool: PagePool,
        *,
        num_layers: int,
        num_kv_heads: int,
        token_budget: int = 512,
        chunk: int = 512,
        max_running: int = 64,
        admission: str = "reserve",
    ):
        if pool.group_size != num_layers * num_kv_heads:
            raise ValueError(
                f"pool.group_size={pool.group_size}: expected num_layers * num_kv_heads = "
                f"{num_layers * num_kv_heads}"
            )
        for name, value in (("token_budget", token_budget), ("chunk", chunk),
                            ("max_running", max_running)):  # fmt: skip
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name}={value!r}: expected an int >= 1")
        if admission not in ADMISSIONS:
            raise ValueError(f"admission={admission!r}: expected one of {ADMISSIONS}")
        self.admission = admission
        self.pool = pool
        self.group = num_layers * num_kv_heads  # pages per block
        self.token_budget, self.chunk, self.max_running = token_budget, chunk, max_running
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.by_id: dict[str, Sequence] = {}
        self._arrivals = itertools.count()
        self.num_preemptions = 0

    # ------------------------------------------------------------------ requests

    def pages_for(self, tokens: int) -> int:
        """Pages one uncompressed sequence of `tokens` tokens holds, all heads together."""
        return -(-tokens // self.pool.page_size) * self.group

    def add(self, seq: Sequence) -> None:
        """Queues a request. Raises ValueError if its id is taken or if its prompt plus
        max_tokens could never fit in the pool, even alone."""
        if seq.request_id in self.by_id:
            raise ValueError(f"request_id={seq.request_id!r} is already in the engine")
        if not seq.prompt:
            raise ValueError("the prompt is empty: expected at least one token")
        need = self.need(seq)
        if need > self.pool.usable:
            raise ValueError(
                f"a prompt of {len(seq.prompt)} tokens plus max_tokens={seq.max_tokens} needs "
                f"{need} pages ({self.group} per {self.pool.page_size} tokens), more than the "
                f"pool's {self.pool.usable}; shorten it or give the engine more pages"
            )
        seq.arrival = next(self._arrivals)
        seq.page_size, seq.group = self.pool.page_size, self.group
        self.by_id[seq.request_id] = seq
        self.waiting.append(seq)

    def need(self, seq: Sequence) -> int:
        """Pages `seq` holds at most, alone: its prompt and max_tokens, or, compressed, the
        whole prompt beside the kept tokens' pages (a ring stops growing there)."""
        if seq.context is not None:  # its context's pages, then its own tokens' blocks
            return self._context_pages(seq) + self.pages_for(
                len(seq.prompt) - seq.covered + seq.max_tokens
            )
        need = self.pages_for(len(seq.prompt) + seq.max_tokens)
        if seq.compresses:
            both = self.pages_for(len(seq.prompt) + seq.scratch) + self.pages_for(seq.keep)
            need = both if seq.limit is not None else max(need, both)
        return need

    def _context_pages(self, seq: Sequence) -> int:
        page = self.pool.page_size
        return sum(-(-k // page) for k in seq.context)

    def abort(self, request_id: str) -> Sequence | None:
        """Stops a request wherever it is; its pages go back. None if it is not here."""
        seq = self.by_id.pop(request_id, None)
        if seq is None:
            return None
        self._leave(seq)
        seq.status, seq.finish_reason = Status.FINISHED, "abort"
        return seq

    def _leave(self, seq: Sequence) -> None:
        """Takes `seq` out of the running or waiting queue and frees its pages."""
        if seq.status is Status.RUNNING:
            self.running.remove(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)
        self._free(seq)

    @property
    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    # ------------------------------------------------------------------ pages

    def _grow(self, seq: Sequence, n: int) -> bool:
        """Gives `seq` room for `n` more tokens (at most one block per page_size tokens for all
        its heads); False (taking nothing) if the pool cannot."""
        need = seq.blocks_after(n) - len(seq.blocks)
        if need <= 0:
            return True
        try:
            seq.blocks += self.pool.allocate_blocks(need)
        except OutOfPages:
            return False
        return True

    def _free(self, seq: Sequence) -> None:
        # Last block first: a prompt's last block reaches the LRU queue first, so it is evicted
        # before the blocks it depends on (vLLM frees in reverse order too).
        self.pool.release(seq.blocks[::-1])
        seq.blocks, seq.epoch = [], next(EPOCHS)
        seq.n_prefix, seq.base, seq.prefix_pages, seq.n_lowrank = 0, None, 0, 0
        seq.num_computed = seq.num_cached = seq.shared_blocks = seq.published = 0
        seq.compressed = False  # recomputed from its tokens, it is compressed again
        if seq.ring is not None:
            seq.ring.reset()

    def _preempt(self, seq: Sequence) -> None:
        self.running.remove(seq)
        self._free(seq)
        seq.status = Status.WAITING
        seq.preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(seq)

    def preempt_all(self) -> None:
        """Every running sequence back to waiting, its pages freed (a pool being rebuilt)."""
        for seq in list(self.running):
            self._preempt(seq)

    def _hashes(self, seq: Sequence, blocks: int) -> list[bytes]:
        """The hashes of the prompt's first `blocks` full blocks, computed once per sequence."""
        have = len(seq.hashes)
        if have < blocks:
            parent = seq.hashes[-1] if have else b""
            seq.hashes += block_hashes(
                seq.prompt[: blocks * self.pool.page_size], self.pool.page_size,
                seq.extra_keys, parent, have,
            )  # fmt: skip
        return seq.hashes[:blocks]

    def _take_prefix(self, seq: Sequence) -> int:
        """Starts an admission from the longest cached prefix of the prompt (never the whole
        prompt: its last token must run to give the first logits; nor a compressing policy's
        observation window). Returns the blocks it looked up (counted once admitted)."""
        page = self.pool.page_size
        if not seq.cacheable:
            return 0
        # A compressing policy's window of queries must run (not come from the cache).
        tail = max(1, min(seq.window, len(seq.prompt))) if seq.compresses else 1
        hashes = self._hashes(seq, (len(seq.prompt) - tail) // page)
        blocks = self.pool.lookup(hashes, count=False)
        seq.blocks, seq.epoch = blocks, next(EPOCHS)
        seq.shared_blocks = seq.published = len(blocks)
        seq.num_computed = seq.num_cached = len(blocks) * page
        return len(hashes)

    def _take_context(self, seq: Sequence) -> None:
        """Starts the admission of a sequence that begins with a KV context: fresh blocks for
        its prefix, each head's kept slots in its own column (`compress`'s layout), its
        `covered` tokens counted as computed. The engine writes the slots before the step
        runs (`StepPlan.contexts`). Raises OutOfPages, taking nothing, if the pool lacks them."""
        page, pool = self.pool.page_size, self.pool
        kept = seq.context
        n_prefix = -(-max(kept) // page) if max(kept) else 0
        cols = [[k > j * page for k in kept] for j in range(n_prefix)]
        pages = pool.allocate_columns([h for c in cols for h, on in enumerate(c) if on])
        if n_prefix > pool.free_block_ids:
            pool.release_pages(pages)
            raise OutOfPages(f"{n_prefix} block ids asked, {pool.free_block_ids} free")
        fresh = iter(pages)
        seq.blocks = [pool.new_block([next(fresh) if on else 0 for on in c]) for c in cols]
        seq.epoch = next(EPOCHS)
        seq.n_prefix, seq.base, seq.n_lowrank = n_prefix, list(kept), 0
        seq.prefix_pages = len(pages)
        seq.compressed, seq.shared_blocks, seq.published = True, 0, 0
        seq.num_computed = seq.num_cached = seq.covered

    # ------------------------------------------------------------------ steps

    def _to_finish(self, seq: Sequence) -> int:
        """Pages `seq` still has to take to run to max_tokens (or, when it reserves less, to
        its reserve; past it, to its next block): before its policy compresses, to the larger
        of the whole prompt and what it keeps plus its new tokens."""
        if seq.compresses and not seq.compressed:
            most = max(len(seq.prompt) + seq.scratch, seq.keep)
            return max(0, self.pages_for(most) - self.pages_for(
                len(seq.blocks) * self.pool.page_size))  # fmt: skip
        goal = seq.max_tokens
        if seq.reserve is not None:
            goal = min(goal, max(seq.reserve, len(seq.output) + self.pool.page_size))
        rest = max(0, len(seq.prompt) + goal - 1 - seq.num_computed)  # the last is not written
        return max(0, seq.blocks_after(rest) - len(seq.blocks)) * self.group

    def _room_to_finish(self, seq: Sequence) -> bool:
        """`admission="reserve"`: admits `seq` only if the pool can take what it and every
        running sequence still need to finish (no preemption while all run to max_tokens).
        `"optimistic"` (vLLM's): its first chunk fitting is enough; running out later
        preempts."""
        if self.admission == "optimistic":
            return True
        need = self._to_finish(seq) + sum(self._to_finish(s) for s in self.running)
        return need <= self.pool.free_pages

    def _chunk_for(self, seq: Sequence, budget: int, chunk: int | None = None) -> int:
        """Tokens of `seq` for this step: at most a chunk (`chunk`, else the scheduler's) and
        the budget left. A sequence whose
        policy compresses its prompt stops a step at the prompt's end (compression happens
        there, before its generated tokens are written) and leaves its last prompt step at
        least the policy's window (SnapKV's observation queries vote in one step); 0 when that
        cannot be met this step."""
        n = min(seq.to_compute, budget, self.chunk if chunk is None else chunk)
        if seq.in_ring:
            return min(n, 1)  # a ring evicts one token per step (recomputed ones too)
        if not (seq.compresses and seq.prefilling):
            return n
        rest = len(seq.prompt) - seq.num_computed
        window = min(seq.window, len(seq.prompt))
        if n >= rest:
            return rest
        return n if rest - n >= window else max(0, rest - window)

    def schedule(self) -> StepPlan:
        """The next step: running sequences first, then admissions, within the token budget."""
        budget = self.token_budget
        out: list[Scheduled] = []
        preempted: list[Sequence] = []
        contexts: list[Sequence] = []  # admitted with a KV context: written before the step
        i = 0
        while i < len(self.running) and budget > 0:
            seq = self.running[i]
            n = self._chunk_for(seq, budget)
            if n == 0:  # its policy's window does not fit in what is left of this step
                i += 1
                continue
            while not self._grow(seq, n):
                victim = self.running[-1]
                self._preempt(victim)
                preempted.append(victim)
                if victim is seq:
                    break
            if seq.status is not Status.RUNNING:
                break  # it preempted itself: everything after it is gone too
            out.append(self._scheduled(seq, n))
            budget -= n
            i += 1
        while self.waiting and budget > 0 and len(self.running) < self.max_running:
            seq = self.waiting[0]
            if preempted and seq in preempted:
                break  # freed this very step for lack of pages: not back before the next one
            looked = 0
            if seq.context is None:
                looked = self._take_prefix(seq)
            else:
                try:
                    self._take_context(seq)
                except OutOfPages:
                    break  # the next step tries again
            n = self._chunk_for(seq, budget)
            new_pages = (seq.blocks_after(n) - len(seq.blocks)) * self.group
            if (
                n == 0
                or not self.pool.can_admit(new_pages)
                or not self._room_to_finish(seq)
                or not self._grow(seq, n)
            ):
                self._free(seq)  # gives the prefix back; the next step tries again
                break
            self.pool.count_lookup(looked, seq.shared_blocks)  # once per admission
            self.waiting.popleft()
            seq.status = Status.RUNNING
            self.running.append(seq)
            out.append(self._scheduled(seq, n))
            if seq.context is not None:
                contexts.append(seq)
            budget -= n
        self._fill(out)
        return StepPlan(out, preempted, contexts)

    def _fill(self, out: list[Scheduled]) -> None:
        """Gives the tokens a step would pad to its compiled size (`token_bucket`: 7 decoding
        rows and a 512-token chunk run as 1,024 tokens) to the prompts it prefills, past their
        chunk: more of a prompt in the same step, whose model work is the padded size's anyway.
        Never past the token budget, a prompt's end or a policy's window rule (`_chunk_for`),
        nor with a page it cannot take without preempting; the step's rows and compiled shape
        stay the same."""
        t = sum(s.n for s in out)
        rows = bucket(len(out))
        size = token_bucket(t, rows, most_tokens(rows, self.token_budget, self.chunk))
        room = min(size, self.token_budget) - t
        for k, s in enumerate(out):
            seq = s.seq
            if room <= 0:
                return
            if not seq.prefilling or seq.in_ring or seq.status is not Status.RUNNING:
                continue
            n = self._chunk_for(seq, s.n + room, chunk=s.n + room)
            if n > s.n and self._grow(seq, n):
                out[k] = self._scheduled(seq, n)
                room -= n - s.n

    def _scheduled(self, seq: Sequence, n: int) -> Scheduled:
        start = seq.num_computed
        return Scheduled(seq, start, n, row_plan(seq, start, n, self.pool.page_size))

    def finish_step(self, plan: StepPlan, sampled: dict[str, int]) -> list[Sequence]:
        """Records a step the model ran: the scheduled tokens are in the pages, and each
        sequence that sampled got `sampled[request_id]`. Returns the sequences that finished
        (their pages are back in the pool)."""
        done = []
        for s in plan.scheduled:
            seq = s.seq
            if seq.status is not Status.RUNNING:
                continue  # aborted since the plan was made
            seq.num_computed += s.n
            self._publish(seq)
            if not s.samples or seq.prefill_only:
                continue
            tok = sampled[seq.request_id]
            seq.output.append(tok)
            if tok in seq.eos_ids:
                seq.finish_reason = "stop"
            elif len(seq.output) >= seq.max_tokens:
                seq.finish_reason = "length"
            if seq.finish_reason:
                self.finish(seq)
                done.append(seq)
        return done

    def finish(self, seq: Sequence, reason: str | None = None) -> None:
        """Ends a sequence (a stop string found by the caller, say), also one preempted since
        its token was sampled (it waits to be recomputed: it leaves the queue)."""
        seq.finish_reason = reason or seq.finish_reason
        self._leave(seq)
        self.by_id.pop(seq.request_id, None)
        seq.status = Status.FINISHED

    def _publish(self, seq: Sequence) -> None:
        """Caches the prompt's full blocks computed so far (uncompressed sequences only)."""
        if not seq.cacheable or seq.compressed:
            return
        full = min(seq.num_computed, len(seq.prompt)) // self.pool.page_size
        if full <= seq.published:
            return
        hashes, page = self._hashes(seq, full), self.pool.page_size
        for j in range(seq.published, full):
            parent, tokens = (hashes[j - 1] if j else None), seq.prompt[j * page : (j + 1) * page]
            self.pool.publish(hashes[j], seq.blocks[j], parent, tokens)
        seq.published = full

    def compress(
        self, seq: Sequence, kept, *, reclaim: bool = False, lowrank=None
    ) -> tuple[list[int], list[int]]:
        """A KV policy kept `kept[h]` tokens of head h (h = layer * num_kv_heads + kv head):
        the first blocks become its prefix, each head's kept tokens in order in its own column
        (an evicting policy's ring: `limit` slots in every column), holes where a head keeps
        fewer; the rest goes back. A block the sequence alone holds and the prefix cache does
        not know is reused in place (the runner reads every kept token before it writes); a
        shared one is copied on write into a fresh block, and so is a cached one, unless
        `reclaim`: then a cached block only this sequence holds leaves the prefix cache and is
        reused.

        `lowrank`: the segment rebuild's low-rank pages per head; they take the blocks after
        the kept tokens' (`n_lowrank` of them, a head's j-th page in the j-th), still the prefix.

        Returns (old blocks, new blocks) for the runner's copy. Raises OutOfPages, changing
        nothing, if the pool cannot give the fresh pages."""
        kept = [int(k) for k in kept]
        if len(kept) != self.group or not all(0 <= k <= seq.num_computed for k in kept):
            raise ValueError(
                f"kept={kept}: expected {self.group} counts, each <= {seq.num_computed}"
            )
        page, pool, old = self.pool.page_size, self.pool, seq.blocks
        slots = [seq.limit] * self.group if seq.limit is not None else kept
        lowrank = [0] * self.group if lowrank is None else [int(x) for x in lowrank]
        n_kept, n_low = -(-max(slots) // page), max(lowrank)
        n_prefix = n_kept + n_low
        cols = [[s > j * page for s in slots] for j in range(n_kept)]  # per prefix block
        cols += [[x > j for x in lowrank] for j in range(n_low)]
        reuse = [
            j < len(old) and pool.refs[old[j]] == 1 and (reclaim or not pool.is_cached(old[j]))
            for j in range(n_prefix)
        ]
        copies = [j for j in range(n_prefix) if not reuse[j]]
        pages = pool.allocate_columns([h for j in copies for h, c in enumerate(cols[j]) if c])
        if len(copies) > pool.free_block_ids:  # (breaking free blocks up freed ids too)
            pool.release_pages(pages)
            raise OutOfPages(f"{len(copies)} block ids asked, {pool.free_block_ids} free")
        fresh = iter(pages)
        new = []
        for j in range(n_prefix):
            if reuse[j]:
                block = old[j]
                pool.uncache(block)
                row = pool.row(block)
                pool.release_pages([p for p, c in zip(row, cols[j], strict=True) if not c])
                pool.set_pages(block, [p if c else 0 for p, c in zip(row, cols[j], strict=True)])
            else:
                block = pool.new_block([next(fresh) if c else 0 for c in cols[j]])
            new.append(block)
        reused = {old[j] for j in range(n_prefix) if reuse[j]}
        pool.release([b for b in old[::-1] if b not in reused])
        seq.blocks, seq.epoch = new, next(EPOCHS)
        seq.n_prefix, seq.base, seq.n_lowrank = n_prefix, kept, n_low
        seq.prefix_pages = sum(sum(c) for c in cols)
        seq.compressed, seq.shared_blocks, seq.covered = True, 0, len(seq.prompt)
        return old, new

    def make_room(self, seq: Sequence, tokens: int) -> bool:
        """Blocks for `tokens` past `seq`'s prompt before it is compressed (KVzip's replay writes
        there; the compaction gives them back), preempting the newest other running sequences
        while the pool lacks them. False if `seq` itself had to wait (recomputed later)."""
        page = self.pool.page_size
        while (need := -(-(len(seq.prompt) + tokens) // page) - len(seq.blocks)) > 0:
            try:
                seq.blocks += self.pool.allocate_blocks(need)
            except OutOfPages:
                victim = next((s for s in reversed(self.running) if s is not seq), seq)
                self._preempt(victim)
                if victim is seq:
                    return False
        return True

    def compress_or_preempt(self, seq: Sequence, kept, lowrank=None):
        """`compress`, preempting the newest other running sequences while the pool lacks the
        fresh pages; with none left to preempt, `seq` itself waits to be recomputed. Returns the
        (old, new) blocks, or None if `seq` was preempted. Short of pages it first gives up the
        prefix cache's copies of blocks only it holds (`reclaim`), which needs no fresh page."""
        while True:
            try:
                return self.compress(seq, kept, lowrank=lowrank)
            except OutOfPages:
                pass
            try:
                return self.compress(seq, kept, reclaim=True, lowrank=lowrank)
            except OutOfPages:
                victim = next((s for s in reversed(self.running) if s is not seq), seq)
                self._preempt(victim)
                if victim is seq:
                    return None
