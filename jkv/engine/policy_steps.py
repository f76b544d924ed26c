"""The rows a KV policy shapes (mixed into `Engine`): a prompt a select-once policy compresses
runs on the flattened step, then its selection runs over the pool (`_select`, `jkv.engine.
select`) and is made physical (`_compress`); the rings of evicting policies run the gathering
step (`runner.paged_step`: each row's pages in a dense copy, whose rules the policies are
written over)."""

from __future__ import annotations

import jax
import numpy as np

from jkv import kv as kvlib
from jkv.engine.runner import compact, pack, paged_step, write_mass, write_pages
from jkv.engine.select import pack_select, paged_select
from jkv.policies.efficache import head_sensitivity
from jkv.sharding import to_host

sensitivity_pass = jax.jit(head_sensitivity, static_argnames=("config",))


def _gathers(policy) -> bool:
    """Whether `policy`'s rows run the gathering step (H2O: its slot choice needs the attention
    mass every query adds, which the ragged kernels do not return)."""
    return policy is not None and policy.evicts and policy.wants_mass


class PolicySteps:
    def _policy_key(self, r):
        """The policy a step of `r` runs the gathering step with (None: the flattened step):
        H2O's, in every step (its eviction needs the attention mass each query adds)."""
        policy = self._rows[r.seq.request_id].req.policy
        return policy.jit_key() if _gathers(policy) else None

    def _ends_compression(self, r) -> bool:
        """Whether `r`'s step (on the flattened step) ends a prompt its policy compresses (its
        selection follows the step, `_select`)."""
        policy = self._rows[r.seq.request_id].req.policy
        return (
            policy is not None
            and not _gathers(policy)
            and not r.seq.compressed
            and r.start + r.n == len(r.seq.prompt)
        )

    def _select(self, ending, policy, kept) -> None:
        """The selection of `policy` (a jit key) over the pool for rows whose prompt ended in
        the step just run (`jkv.engine.select`); what each keeps goes to `kept` for
        `_compress`."""
        window = getattr(policy, "window", 0) if policy.observes else 0
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
        src, counts, first = paged_select(
            self.params.weights, self.params.config, self.device, rows, tokens, positions,
            budgets, sensitivity, backend=self.backend, dtype=self.kv_dtype, policy=policy,
        )  # fmt: skip
        counts = to_host(counts)
        first = to_host(first) if policy.evicts else None  # a ring's positions, slot by slot
        for i, r in enumerate(ending):
            c = counts[i].reshape(-1).tolist()
            ring = None if first is None else first[i, : c[0]].tolist()
            kept[r.seq.request_id] = (src, i, c, ring)

    def _run(self, scheduled, policy, kept) -> dict[str, int]:
        cfg = self.params.config
        rows, tokens, n_new, start = pack(
            scheduled, self.rows, self.scheduler.group, self.scheduler.chunk
        )
        b = len(n_new)
        reqs = [self._rows[r.seq.request_id].req for r in scheduled]
        budgets = np.zeros((b,), np.int32)
        limits = np.full((b,), kvlib.NO_LIMIT, np.int32)
        limits[: len(scheduled)] = [
            kvlib.NO_LIMIT if r.seq.limit is None else r.seq.limit for r in scheduled
        ]
        ending = [i for i, r in enumerate(scheduled) if r.start + r.n == len(r.seq.prompt)]
        sensitivity = None
        if policy is not None:
            budgets[: len(scheduled)] = [
                q.policy.budget_tokens(len(r.seq.prompt))
                for q, r in zip(reqs, scheduled, strict=True)
            ]
            if policy.needs_sensitivity:
                sensitivity = self._sensitivity(scheduled, ending, b)
        sampling, index = self._sampling(scheduled, b)
        tok, writes, selection, mass = paged_step(
            self.params.weights, cfg, self.device, rows, tokens, n_new, start, sampling,
            index, budgets, limits, sensitivity, backend=self.backend, dtype=self.kv_dtype,
            policy=policy,
        )  # fmt: skip
        self.device = write_pages(self.device, writes)
        if mass is not None:
            self.device = write_mass(self.device, *mass)
        if selection is not None and ending:
            src, counts = selection
            counts = to_host(counts)
            for i in ending:
                kept[scheduled[i].seq.request_id] = (src, i, counts[i].reshape(-1).tolist(), None)
        tok = to_host(tok)
        return {r.seq.request_id: int(tok[i]) for i, r in enumerate(scheduled) if r.samples}

    def _sensitivity(self, rows, ending, b: int) -> np.ndarray:
        """`[b, L, K]` float32: EffiCache's head sensitivity of each row whose prompt ends in
        this step, by one gradient pass over its whole prompt (padded to its bucket, as
        `jkv.generate` pads it); zeros elsewhere."""
        cfg = self.params.config
        out = np.zeros((b, cfg.num_layers, cfg.num_kv_heads), np.float32)
        for i in ending:
            prompt = rows[i].seq.prompt
            tokens = np.zeros((1, kvlib.bucket(len(prompt))), np.int32)
            tokens[0, : len(prompt)] = prompt
            n = np.array([len(prompt)], np.int32)
            out[i] = to_host(sensitivity_pass(self.params.weights, cfg, tokens, n))[0]
        return out

    def _compress(self, seq, src, row, counts, ring=None) -> None:
        """The policy's selection made physical: each head's kept tokens move into the fewest
        pages (`Scheduler.compress`), the rest go back to the pool; `ring`: a StreamingLLM
        ring's kept positions in slot order (its host side starts from them)."""
        if self.scheduler.compress_or_preempt(seq, counts) is None:
            return  # preempted for lack of pages: recomputed later
        if ring is not None:
            seq.start_ring(ring)
        self._sync_rows()
        table = np.zeros(self.rows.width, np.int32)
        table[: len(seq.blocks)] = seq.blocks
        g = self.scheduler.group
        self.device = compact(self.device, src[row].reshape(g, -1), table,
                              np.asarray(counts, np.int32))  # fmt: skip
