"""Compiling every step shape before the first request (mixed into `Engine`), so that no
request waits for a compile: the flattened step at every (rows, tokens) bucket, and for each KV
policy asked its selection, the compaction and EffiCache's gradient pass."""

from __future__ import annotations

import itertools
import time

import jax
import numpy as np

from jkv import kv as kvlib
from jkv.core.paged import MassRows, PagedRows
from jkv.core.sampling import SamplingArrays
from jkv.engine.policy_steps import sensitivity_pass
from jkv.engine.ragged import ragged_step
from jkv.engine.runner import bucket, compact, set_rows
from jkv.engine.select import paged_select
from jkv.policies import resolve
from jkv.request import Request


class Warmup:
    def warmup(self, kv_policies=()) -> float:
        """Compiles every step shape a request can need, so that no request compiles later:
        the flattened step at every (rows, tokens) bucket (rows: powers of two up to
        max_running; tokens: up to the token budget's or, when fewer, the rows' chunks'); for
        each of `kv_policies` (names or `jkv.policies.KVPolicy` objects; budgets do not matter,
        they are data) its selection over the pool (rows) and its compaction, and the
        flattened step with StreamingLLM's or H2O's rows in it; every block-row update size.
        Returns the seconds it took."""
        t0 = time.perf_counter()
        cfg = self.params.config
        g = self.scheduler.group
        rows = [1 << i for i in range(bucket(self.scheduler.max_running).bit_length())]
        keys = []  # the full cache runs the flattened step only
        for p in kv_policies:
            policy = resolve(p, None) if isinstance(p, str) else p
            self._check_policy(policy)
            keys.append(policy.jit_key())
        z = lambda *shape: np.zeros(shape, np.int32)  # noqa: E731
        for key, b in itertools.product(keys, rows):
            self._warm_select(key, b)
        # the flattened step with StreamingLLM's rows in it, H2O's, both
        rings = [False, True] if any(k.raw_keys for k in keys) else [False]
        heavy = [False, True] if any(k.wants_mass for k in keys) else [False]
        for ring, mass in itertools.product(rings, heavy):
            self._warm_flat(rows, rings=ring, mass=mass)
        for n in (1 << i for i in range(bucket(self.pool.num_blocks).bit_length())):
            ids = np.full(n, self.pool.num_blocks, np.int32)  # every row dropped
            self.device = set_rows(self.device, ids, z(n, g))
        if any(k.needs_sensitivity for k in keys):  # every prompt bucket
            top = kvlib.bucket(self.max_model_len)
            for n in sorted({kvlib.bucket(1 << i) for i in range(top.bit_length())}):
                x = np.zeros((1, n), np.int32)
                sensitivity_pass(
                    self.params.weights, cfg, x, np.ones(1, np.int32)
                ).block_until_ready()
        jax.block_until_ready(self.device)
        return time.perf_counter() - t0

    def _warm_select(self, key, b: int) -> None:
        """The selection of `key` (a select-once policy) over `b` rows, and (for one row) the
        compaction of what it keeps."""
        cfg, g = self.params.config, self.scheduler.group
        window = getattr(key, "window", 0) if key.observes else 0
        t = max(b * (bucket(window) if window else 0), 1)
        z = lambda *shape: np.zeros(shape, np.int32)  # noqa: E731
        idle = PagedRows(z(b, self.rows.width), z(b, g), z(b), z(b), z(b), z(b),
                         np.full(t, b, np.int32), z(t), np.int32(0), np.int32(0))  # fmt: skip
        sens = None
        if key.needs_sensitivity:
            sens = np.zeros((b, cfg.num_layers, cfg.num_kv_heads), np.float32)
        src, counts, _ = paged_select(
            self.params.weights, cfg, self.device, idle, z(t), z(t), z(b), sens,
            backend=self.backend, dtype=self.kv_dtype, policy=key,
        )  # fmt: skip
        if b == 1:
            self.device = compact(self.device, src[0].reshape(g, -1), z(self.rows.width), z(g))
        counts.block_until_ready()

    def _warm_flat(self, rows, rings: bool = False, mass: bool = False) -> None:
        """The flattened step at every (rows, tokens) bucket a step can have: tokens from the
        rows' count (one each) to the token budget's bucket; `rings`: with rows whose keys are
        stored before RoPE (`PagedRows.raw`); `mass`: with H2O's rows (`PagedRows.mass`)."""
        cfg, g = self.params.config, self.scheduler.group
        probe = Request.build(self.params)
        sched = self.scheduler
        for b in rows:  # b rows (more than b / 2 of them real) hold at most b chunks
            most = bucket(min(sched.token_budget, b * sched.chunk))
            for t in (1 << i for i in range(b.bit_length() - 1, most.bit_length())):
                z = lambda *shape: np.zeros(shape, np.int32)  # noqa: E731
                idle = PagedRows(
                    z(b, self.rows.width), z(b, g), z(b), z(b), z(b), z(b),
                    np.full(t, b, np.int32), z(t), np.int32(0), np.int32(0),
                    *((np.zeros(b, bool), z(b), z(b)) if rings else (None, None, None)),
                    MassRows(np.zeros(b, bool), np.zeros(b, bool), np.ones(b, np.int32), z(b),
                             z(b), np.zeros(b, bool)) if mass else None,
                )  # fmt: skip
                sampling = SamplingArrays.build([probe.sampling] * b, [probe.seed] * b)
                self._last_tok, self.device = ragged_step(
                    self.params.weights, cfg, self.device, idle, z(t), z(t), sampling, z(b),
                    self._last_tok, np.full(t, -1, np.int32), backend=self.backend,
                    dtype=self.kv_dtype, mesh=self.mesh,
                )  # fmt: skip
                self._last_tok.block_until_ready()
