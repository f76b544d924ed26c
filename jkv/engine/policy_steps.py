"""The prompts a KV policy compresses (mixed into `Engine`): they run on the flattened step like a
full cache's; after the step that ends one, its policy selects over the pool (`_select`,
`jkv.engine.select`) and the selection is made physical (`_compress`): each head's kept tokens
in the fewest pages, a ring (StreamingLLM, H2O) in its budget's slots; or the segment rebuild
builds its slots and low-rank pages (`_rebuild_segments`, `jkv.engine.rebuild`) and writes them."""

from __future__ import annotations

import numpy as np

from jkv import kv as kvlib
from jkv.engine import programs
from jkv.engine.lockstep import read, run
from jkv.engine.rebuild import Rebuilt, paged_rebuild, policy_rank, rebuild_rows, write_rebuilt
from jkv.engine.replay import REPLAY_CHUNK, pack_replay, replay_piece, replay_span, replay_tokens
from jkv.engine.runner import compact
from jkv.engine.select import (
    SELECT_ROWS,
    pack_select,
    paged_select,
    vote_window,
    window_queries,
)
from jkv.engine.sequence import Status
from jkv.policies import POLICIES
from jkv.policies.compress import factoring
from jkv.policies.efficache import head_sensitivity

sensitivity_pass = programs.jit(head_sensitivity, static_argnames=("config",))


def sensitivity_buckets(max_len: int) -> list[int]:
    """The prompt lengths EffiCache's gradient pass compiles for: powers of 4 from 16, up to
    the bucket of `max_len` (a prompt padded by less than 4x; few programs)."""
    top = kvlib.bucket(max_len)
    return sorted({min(16 * 4**i, top) for i in range(top.bit_length())})


def sensitivity_bucket(n: int, max_len: int) -> int:
    return next(s for s in sensitivity_buckets(max(max_len, n)) if s >= n)


def served() -> list[str]:
    """The policies `jkv.Engine` serves, by name (`KVPolicy.served`: those that select once,
    the rings StreamingLLM and H2O, and the segment rebuild, `jkv.engine.rebuild`)."""
    return sorted(n for n, cls in POLICIES.items() if cls is not None and cls.served)


class PolicySteps:
    replay_chunk = REPLAY_CHUNK  # KVzip's replay tokens one program takes

    def served_policies(self) -> list[str]:
        """The KV policies (by name) this engine serves: H2O only with the attention mass."""
        return [n for n in served() if not POLICIES[n].wants_mass or self.attention_mass]

    def _check_policy(self, policy) -> None:
        """The policies the engine serves (H2O only with the pool's attention mass; the
        segment rebuild at the settings its low-rank pages hold), each with an observation
        window that fits one step."""
        if policy is None:
            return
        if policy.wants_mass and not self.attention_mass:
            raise ValueError(
                f"kv_policy={policy.name!r} evicts by attention mass, which this engine does not "
                "keep: build it with jkv.Engine(..., attention_mass=True) (a float32 per stored "
                "token)"
            )
        if not policy.served:
            raise ValueError(
                f"kv_policy={policy.name!r} runs on the one-shot path (jkv.generate) only; the "
                f"engine serves {', '.join(served())}"
            )
        if getattr(policy, "chunked", False):  # it was accepted and ignored
            raise ValueError(
                f"kv_policy={policy.name!r} chunked=True: compressing each prefill chunk runs on "
                "the one-shot path (jkv.generate) only; the engine compresses a prompt once, at "
                "its end (chunked=False)"
            )
        if policy.rebuilds:
            self._check_rebuild(policy)
        if getattr(policy, "replaying", False):
            raise ValueError(
                f"kv_policy={policy.name!r} replaying=True: the replay pass's own key, not a "
                "setting; leave it False"
            )
        window = getattr(policy, "window", 0)
        room = min(
            self.scheduler.chunk, self.scheduler.token_budget - self.scheduler.max_running + 1
        )
        if window > room:
            raise ValueError(
                f"kv_policy={policy.name!r} window={window}: its observation window must run in "
                f"one step, at most {room} tokens here (chunk={self.scheduler.chunk}, "
                f"token_budget={self.scheduler.token_budget} less one per other running request)"
            )

    def _check_rebuild(self, policy) -> None:
        """The segment rebuild's settings the engine's low-rank pages hold: a segment of
        `head_dim` tokens a page, factored at a rank of at most half a page; on models without
        a sliding window (a low-rank token's position is not kept)."""
        cfg, page = self.params.config, self.pool.page_size
        if cfg.sliding_window is not None:
            raise ValueError(
                f"kv_policy={policy.name!r}: the engine's low-rank pages keep no positions, so "
                f"a sliding window ({cfg.sliding_window}) cannot mask them; use jkv.generate"
            )
        if policy.segment_len != cfg.head_dim:
            raise ValueError(
                f"kv_policy={policy.name!r} segment_len={policy.segment_len}: the engine's "
                f"low-rank pages hold {cfg.head_dim} tokens (head_dim); set "
                f"segment_len={cfg.head_dim}"
            )
        rank = policy_rank(policy, cfg.head_dim)
        if rank > page // 2:
            raise ValueError(
                f"kv_policy={policy.name!r} max_rank={policy.max_rank} (rank {rank}): a low-rank "
                f"page of {page} rows holds a rank of at most {page // 2} (page_size // 2)"
            )

    def _ends_compression(self, r) -> bool:
        """Whether `r`'s step (on the flattened step) ends a prompt its policy compresses (its
        selection follows the step, `_select`)."""
        policy = self._rows[r.seq.request_id].req.policy
        return policy is not None and not r.seq.compressed and r.start + r.n == len(r.seq.prompt)

    def _select(self, ending, policy, kept) -> None:
        """The selection of `policy` (a jit key) over the pool for rows whose prompt ended in
        the step just run (`jkv.engine.select`), `SELECT_ROWS` at a time (few programs: 1, 2
        or 4 rows); what each keeps goes to `kept` for `_compress`."""
        for i in range(0, len(ending), SELECT_ROWS):
            self._select_rows(ending[i : i + SELECT_ROWS], policy, kept)

    def _select_rows(self, ending, policy, kept) -> None:
        if policy.rebuilds:  # the segment rebuild: a row at a time (its dense temporaries)
            for r in ending:
                self._rebuild_segments(r, policy, kept)
            return
        replayed = self._replay(ending) if policy.needs_replay else None
        if not ending:
            return  # every row waits: the replay's room preempted them
        window = vote_window(policy)
        rows, tokens, positions = pack_select(
            ending, self.rows, self.scheduler.group, self.pool.page_size, window
        )
        b = len(rows.held)
        budgets = np.zeros((b,), np.int32)
        budgets[: len(ending)] = [
            self._rows[r.seq.request_id].req.policy.budget_tokens(len(r.seq.prompt)) for r in ending
        ]
        sensitivity = None
        if policy.needs_sensitivity:
            sensitivity = self._sensitivity(ending, range(len(ending)), b)
        queries = None
        if window:
            queries = run(self.lockstep, window_queries, self.params.weights, self.params.config,
                          self.device, rows, tokens, positions, backend=self.backend,
                          dtype=self.kv_dtype)  # fmt: skip
        src, counts, first = run(
            self.lockstep, paged_select, self.params.config, self.device, rows, queries, positions, budgets,
            sensitivity, replayed, backend=self.backend, policy=policy,
        )  # fmt: skip
        counts = read(self.lockstep, counts)
        first = read(self.lockstep, first) if policy.evicts else None  # a ring's positions
        for i, r in enumerate(ending):
            c = counts[i].reshape(-1).tolist()
            ring = None if first is None else first[i, : c[0]].tolist()
            kept[r.seq.request_id] = (src, i, c, ring)

    def _rebuild_segments(self, r, policy, kept) -> None:
        """The segment rebuild of `r`'s prompt (`jkv.engine.rebuild`), its ordinary slots and
        low-rank pages per head into `kept` for `_compress`."""
        rows, tokens, positions = pack_select(
            [r], self.rows, self.scheduler.group, self.pool.page_size, policy.window
        )
        own = self._rows[r.seq.request_id].req.policy
        budgets = np.zeros((len(rows.held),), np.int32)
        budgets[0] = own.budget_tokens(len(r.seq.prompt))
        queries = run(self.lockstep, window_queries, self.params.weights, self.params.config,
                      self.device, rows, tokens, positions, backend=self.backend,
                      dtype=self.kv_dtype)  # fmt: skip
        rows = rebuild_rows(rows, len(r.seq.prompt), self.pool.page_size)
        with factoring(policy):
            built = run(self.lockstep, paged_rebuild, self.params.config, self.device, rows,
                        queries, positions, budgets, backend=self.backend, policy=policy)  # fmt: skip
            counts = read(self.lockstep, built.counts)[0]
            segments = read(self.lockstep, built.segments)[0]
        kept[r.seq.request_id] = (built, counts.reshape(-1).tolist(), segments.reshape(-1).tolist())

    def _replay(self, ending):
        """`[SELECT_ROWS, L, K, W]` float32: KVzip's slot scores of each row in `ending` by
        its replay (`jkv.engine.replay`), over its own pages. Each row first takes room for
        the replay past its prompt; a row that had to wait for it leaves `ending` (with the
        rows preempted to make room: they are recomputed)."""
        cfg, page = self.params.config, self.pool.page_size
        for r in ending:
            if r.seq.status is Status.RUNNING:
                self.scheduler.make_room(r.seq, r.seq.scratch)
        ending[:] = [r for r in ending if r.seq.status is Status.RUNNING]
        self._sync_rows()
        width = self.rows.width * page
        best = np.zeros((SELECT_ROWS, cfg.num_layers, cfg.num_kv_heads, width), np.float32)
        for i, r in enumerate(ending):
            seq = r.seq
            policy = self._rows[seq.request_id].req.policy
            table = self.rows.table[self.rows.sync(seq)]
            n = len(seq.prompt)
            for ids, lo, hi in replay_tokens(self.params, seq.prompt, policy):
                piece = np.array([lo, hi, policy.sink, n], np.int32)
                for done in range(0, len(ids), self.replay_chunk):
                    part = ids[done : done + self.replay_chunk]
                    rows, tokens, positions = pack_replay(table, self.scheduler.group, n, done,
                                                          part, self.replay_chunk)  # fmt: skip
                    span = replay_span(n + done + len(part), width)
                    best, self.device = run(
                        self.lockstep, replay_piece, self.params.weights, cfg, self.device, rows, tokens,
                        positions, piece, best, np.int32(i), backend=self.backend,
                        dtype=self.kv_dtype, span=span,
                    )  # fmt: skip
        return best

    def _sensitivity(self, rows, ending, b: int) -> np.ndarray:
        """`[b, L, K]` float32: EffiCache's head sensitivity of each row whose prompt ends in
        this step, by one gradient pass over its whole prompt (padded to its bucket, as
        `jkv.generate` pads it); zeros elsewhere."""
        cfg = self.params.config
        out = np.zeros((b, cfg.num_layers, cfg.num_kv_heads), np.float32)
        for i in ending:
            prompt = rows[i].seq.prompt
            tokens = np.zeros((1, sensitivity_bucket(len(prompt), self.max_model_len)), np.int32)
            tokens[0, : len(prompt)] = prompt
            n = np.array([len(prompt)], np.int32)
            grads = run(self.lockstep, sensitivity_pass, self.params.weights, cfg, tokens, n)
            out[i] = read(self.lockstep, grads)[0]
        return out

    def _compress(self, seq, *kept) -> None:
        if isinstance(kept[0], Rebuilt):
            self._write_rebuilt(seq, *kept)
        else:
            self._compact(seq, *kept)

    def _write_rebuilt(self, seq, built, counts, segments) -> None:
        """A segment rebuild made physical: its ordinary slots in the fewest blocks, then its
        low-rank pages (`Scheduler.compress`), the rest back to the pool."""
        if self.scheduler.compress_or_preempt(seq, counts, lowrank=segments) is None:
            return  # preempted for lack of pages: recomputed later
        self._sync_rows()
        table = np.zeros(self.rows.width, np.int32)
        table[: len(seq.blocks)] = seq.blocks
        n_ordinary = np.int32(seq.n_prefix - seq.n_lowrank)
        self.device = run(self.lockstep, write_rebuilt, self.device, built, np.int32(0), table,
                          n_ordinary, dtype=self.kv_dtype)  # fmt: skip

    def _compact(self, seq, src, row, counts, ring=None) -> None:
        """The policy's selection made physical: each head's kept tokens move into the fewest
        pages (`Scheduler.compress`), the rest go back to the pool; `ring`: an evicting
        policy's kept positions in slot order (its ring starts from them, `Ring.start`)."""
        if self.scheduler.compress_or_preempt(seq, counts) is None:
            return  # preempted for lack of pages: recomputed later
        if ring is not None:
            seq.ring.start(ring)
        self._sync_rows()
        table = np.zeros(self.rows.width, np.int32)
        table[: len(seq.blocks)] = seq.blocks
        self.device = run(self.lockstep, compact, self.device, src, table,
                          np.asarray(counts, np.int32), np.int32(row))  # fmt: skip
