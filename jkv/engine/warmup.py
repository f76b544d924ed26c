"""Compiling every program a request can need before the first one (mixed into `Engine`), so
that no request waits for a compile: the flattened step at every (rows, tokens) bucket (one
program per shape serves every policy: which rows are StreamingLLM's or H2O's is data), and for
each KV policy asked its selection (the window queries shared by the policies that vote, then
the policy's own small program), the compaction, the block-row updates and EffiCache's
gradient pass. Each is compiled ahead of time (`jit(f).lower(...).compile()`, which the later
calls with the same shapes find): nothing runs, nothing is written."""

from __future__ import annotations

import dataclasses
import time

import jax
import numpy as np

from jkv.core.paged import MassRows, PagedRows
from jkv.core.sampling import SamplingArrays
from jkv.engine import programs
from jkv.engine.plan import bucket, most_tokens, token_buckets
from jkv.engine.policy_steps import sensitivity_buckets, sensitivity_pass
from jkv.engine.ragged import flat_logits, sample_rows
from jkv.engine.rebuild import paged_rebuild, rebuild_buckets, write_rebuilt
from jkv.engine.replay import pack_replay, replay_piece, replay_span
from jkv.engine.runner import compact, set_rows
from jkv.engine.select import SELECT_ROWS, paged_select, vote_window, window_queries
from jkv.policies import resolve
from jkv.request import Request


class Warmup:
    def warmup(self, kv_policies=(), progress=None) -> float:
        """Compiles every program a request can need, so that no request compiles later: the
        flattened step at every (rows, tokens) bucket (rows: powers of two up to max_running;
        tokens: `jkv.engine.plan.token_buckets`); for each of `kv_policies` (names or
        `jkv.policies.KVPolicy` objects; budgets do not matter, they are data) its selection
        over the pool (1, 2 or 4 rows), its compaction, EffiCache's gradient pass per prompt
        bucket; every block-row update size.

        Args:
          kv_policies: the policies requests may name (the full cache needs none).
          progress: called after each program as `progress(done, total, label, seconds)`.

        Returns the seconds it took.
        """
        t0 = time.perf_counter()
        jobs = self.warmup_jobs(kv_policies)
        for i, (label, run) in enumerate(jobs):
            run()
            if progress is not None:
                progress(i + 1, len(jobs), label, time.perf_counter() - t0)
        jax.block_until_ready(self.device)
        return time.perf_counter() - t0

    def warmup_jobs(self, kv_policies=()) -> list[tuple[str, object]]:
        """(label, callable) of every program `warmup` compiles, in order."""
        keys = []
        for p in kv_policies:
            policy = resolve(p, None) if isinstance(p, str) else p
            try:
                self._check_policy(policy)
            except ValueError:
                if not (isinstance(p, str) and policy.rebuilds):
                    raise
                continue  # by name, at its defaults (segment_len 64), refused on this model

            if policy.jit_key() not in keys:
                keys.append(policy.jit_key())
        rows = [1 << i for i in range(bucket(self.scheduler.max_running).bit_length())]
        sched = self.scheduler
        jobs = [
            (f"step {b} rows x {t} tokens", lambda b=b, t=t: self._warm_flat(b, t))
            for b in rows
            for t in token_buckets(b, most_tokens(b, sched.token_budget, sched.chunk))
        ]
        select_rows = [b for b in rows if b <= SELECT_ROWS]
        windows = sorted({bucket(vote_window(k)) for k in keys if vote_window(k)})
        jobs += [
            (f"window queries {b} rows x {w}", lambda b=b, w=w: self._warm_queries(b, w))
            for w in windows
            for b in select_rows
        ]
        picks = [k for k in keys if not k.rebuilds]
        jobs += [  # the first policy's compacts what it kept, too (every policy's the same)
            (f"{k.name} selection {b} rows", lambda k=k, b=b, i=i: self._warm_select(k, b, i == 0))
            for i, k in enumerate(picks)
            for b in select_rows
        ]
        jobs += [  # the segment rebuild: a row at a time, per bucket of its prompt's blocks
            (f"{k.name} rebuild x {c} blocks", lambda k=k, c=c: self._warm_rebuild(k, c))
            for k in keys
            if k.rebuilds
            for c in rebuild_buckets(self.rows.width)
        ]
        if any(k.needs_replay for k in keys):  # KVzip's replay: one piece per span
            width = self.rows.width * self.pool.page_size
            spans = sorted({replay_span(1 << i, width) for i in range(width.bit_length() + 1)})
            jobs += [(f"kvzip replay x {s} slots", lambda s=s: self._warm_replay(s))
                     for s in spans]  # fmt: skip
        jobs += [
            (f"block rows x {n}", lambda n=n: self._warm_rows(n))
            for n in (1 << i for i in range(bucket(self.pool.num_blocks).bit_length()))
        ]
        if any(k.needs_sensitivity for k in keys):  # every prompt bucket
            jobs += [
                (f"head sensitivity {n} tokens", lambda n=n: self._warm_sensitivity(n))
                for n in sensitivity_buckets(self.max_model_len)
            ]
        return jobs

    def _idle(self, b: int, t: int, **ring) -> PagedRows:
        """`b` rows and `t` tokens that hold and write nothing."""
        z = lambda *shape: np.zeros(shape, np.int32)  # noqa: E731
        return PagedRows(z(b, self.rows.width), z(b, self.scheduler.group), z(b), z(b), z(b),
                         z(b), np.full(t, b, np.int32), z(t), np.int32(0), np.int32(0),
                         **ring)  # fmt: skip

    def _warm_flat(self, b: int, t: int) -> None:
        """The flattened step over `b` rows and `t` tokens."""
        z = lambda *shape: np.zeros(shape, np.int32)  # noqa: E731
        mass = None
        if self.attention_mass:
            mass = MassRows(np.zeros(b, bool), np.zeros(b, bool), np.ones(b, np.int32), z(b),
                            z(b), np.zeros(b, bool))  # fmt: skip
        idle = self._idle(b, t, raw=np.zeros(b, bool), sink=z(b), shift=z(b), mass=mass,
                          lowrank=z(b))  # fmt: skip
        probe = Request.build(self.params)
        sampling = SamplingArrays.build([probe.sampling] * b, [probe.seed] * b)
        args = (self.params.weights, self.params.config, self.pool_spec(), idle, z(t), z(t),
                self._last_tok, np.full(t, -1, np.int32))  # fmt: skip
        kw = dict(backend=self.backend, dtype=self.kv_dtype, mesh=self.mesh)
        programs.compile(flat_logits, *args, **kw)
        if t == b:  # one sampling program per row bucket
            logits = jax.eval_shape(lambda: flat_logits(*args, **kw))[0]
            programs.compile(sample_rows, logits, sampling, z(b), self._last_tok)

    def _queries_args(self, b: int, t: int):
        z = np.zeros(t, np.int32)
        return (self.params.weights, self.params.config, self.pool_spec(), self._idle(b, t), z, z)

    def _warm_queries(self, b: int, window: int) -> None:
        """The window queries of `b` rows of `window` tokens each."""
        programs.compile(window_queries, *self._queries_args(b, b * window),
                         backend=self.backend, dtype=self.kv_dtype)  # fmt: skip

    def _warm_select(self, key, b: int, compacts: bool = False) -> None:
        """The selection of `key` (a select-once policy's jit key) over `b` rows, given the
        window queries' shape; `compacts`: then the compaction of what it keeps."""
        cfg = self.params.config
        window = vote_window(key)
        t = b * bucket(window) if window else 1
        z = lambda *shape: np.zeros(shape, np.int32)  # noqa: E731
        queries = None
        if window:
            queries = jax.eval_shape(
                lambda: window_queries(*self._queries_args(b, t), backend=self.backend,
                                       dtype=self.kv_dtype)
            )  # fmt: skip
        sens = replayed = None
        if key.needs_sensitivity:
            sens = np.zeros((b, cfg.num_layers, cfg.num_kv_heads), np.float32)
        if key.needs_replay:
            replayed = self._replay_scores()
        args = (cfg, self.pool_spec(), self._idle(b, t), queries, z(t), z(b), sens, replayed)
        programs.compile(paged_select, *args, backend=self.backend, policy=key)
        if compacts:
            src = jax.eval_shape(lambda: paged_select(*args, backend=self.backend, policy=key))[0]
            g = self.scheduler.group
            programs.compile(compact, self.pool_spec(), src, z(self.rows.width), z(g), np.int32(0))

    def _warm_rebuild(self, key, cols: int) -> None:
        """The segment rebuild of `key` over one row's `cols` blocks, and its write."""
        t = bucket(key.window)
        z = lambda *shape: np.zeros(shape, np.int32)  # noqa: E731
        queries = jax.eval_shape(
            lambda: window_queries(*self._queries_args(1, t), backend=self.backend,
                                   dtype=self.kv_dtype)
        )  # fmt: skip
        idle = self._idle(1, t)
        rows = dataclasses.replace(idle, tables=idle.tables[:, :cols])
        args = (self.params.config, self.pool_spec(), rows, queries, z(t), z(1))
        programs.compile(paged_rebuild, *args, backend=self.backend, policy=key)
        built = jax.eval_shape(lambda: paged_rebuild(*args, backend=self.backend, policy=key))
        programs.compile(write_rebuilt, self.pool_spec(), built, np.int32(0), z(self.rows.width),
                         np.int32(0), dtype=self.kv_dtype)  # fmt: skip

    def _replay_scores(self):
        cfg, width = self.params.config, self.rows.width * self.pool.page_size
        shape = (SELECT_ROWS, cfg.num_layers, cfg.num_kv_heads, width)
        return jax.ShapeDtypeStruct(shape, np.float32)

    def _warm_replay(self, span: int) -> None:
        """A piece of KVzip's replay whose scores read `span` slots (`jkv.engine.replay`)."""
        rows, tokens, positions = pack_replay(np.zeros(self.rows.width, np.int32),
                                              self.scheduler.group, 0, 0, [],
                                              self.replay_chunk)  # fmt: skip
        programs.compile(replay_piece, self.params.weights, self.params.config,
                         self.pool_spec(), rows, tokens, positions, np.zeros(4, np.int32),
                         self._replay_scores(), np.int32(0), backend=self.backend,
                         dtype=self.kv_dtype, span=span)  # fmt: skip

    def _warm_rows(self, n: int) -> None:
        """A block-row update of `n` rows."""
        ids = np.full(n, self.pool.num_blocks, np.int32)
        programs.compile(set_rows, self.pool_spec(), ids,
                         np.zeros((n, self.scheduler.group), np.int32))  # fmt: skip

    def _warm_sensitivity(self, n: int) -> None:
        """EffiCache's gradient pass over a prompt of `n` tokens (a bucket)."""
        x = np.zeros((1, n), np.int32)
        programs.compile(sensitivity_pass, self.params.weights, self.params.config, x,
                         np.ones(1, np.int32))  # fmt: skip
