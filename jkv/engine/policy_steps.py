"""The prompts a KV policy compresses (mixed into `Engine`): they run on the flattened step like a
full cache's; after the step that ends one, its policy selects over the pool (`_select`,
`jkv.engine.select`) and the selection is made physical (`_compress`): each head's kept tokens
in the fewest pages, a ring (StreamingLLM, H2O) in its budget's slots."""

from __future__ import annotations

import jax
import numpy as np

from jkv import kv as kvlib
from jkv.engine.runner import compact
from jkv.engine.select import pack_select, paged_select
from jkv.policies.efficache import head_sensitivity
from jkv.sharding import to_host

sensitivity_pass = jax.jit(head_sensitivity, static_argnames=("config",))


class PolicySteps:
    def _ends_compression(self, r) -> bool:
        """Whether `r`'s step (on the flattened step) ends a prompt its policy compresses (its
        selection follows the step, `_select`)."""
        policy = self._rows[r.seq.request_id].req.policy
        return policy is not None and not r.seq.compressed and r.start + r.n == len(r.seq.prompt)

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
        first = to_host(first) if policy.raw_keys else None  # StreamingLLM's ring positions
        for i, r in enumerate(ending):
            c = counts[i].reshape(-1).tolist()
            ring = None if first is None else first[i, : c[0]].tolist()
            kept[r.seq.request_id] = (src, i, c, ring)

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
