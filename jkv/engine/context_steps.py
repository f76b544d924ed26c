"""Requests that start from a KV context or end as one (mixed into `Engine`): a one-row
`jkv.KVContext` continued (`add_request(kv_state=)`: its slots written into the request's fresh
prefix pages at each admission, `runner.write_context`) and a prompt read out as one once its
policy compressed it (`prefill`, `add_request(prefill_only=True)`: `runner.read_row`)."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np

from jkv import kv as kvlib
from jkv.engine.lockstep import read, run
from jkv.engine.plan import bucket
from jkv.engine.runner import read_row, write_context
from jkv.engine.streams import RequestFailed
from jkv.kv_context import KVContext


class ContextSteps:
    def _context(self, ctx) -> tuple[np.ndarray, dict]:
        """`ctx`'s slots as the pool takes them (`KVContext.pool_slots`), once it is known to be
        a one-row context of these weights, shape and kv dtype that the engine can continue."""
        if not isinstance(ctx, KVContext):
            raise ValueError(
                f"kv_state is a {type(ctx).__name__}; expected the jkv.KVContext that "
                "jkv.prefill returned"
            )
        if ctx.batch_size != 1:
            raise ValueError(
                f"kv_state holds {ctx.batch_size} rows; a request continues one (jkv.prefill of "
                "one prompt)"
            )
        ctx.check(self.params, 1, self.kv_dtype)
        policy, layer = ctx.policy, ctx.layers[0]
        if policy is not None and (policy.evicts or policy.raw_keys):
            raise ValueError(
                f"kv_state was prefilled with kv_policy={policy.name!r}, which evicts as it "
                "decodes; the engine continues contexts of policies that select once (SnapKV, "
                "KVzip, ...) or of a full cache"
            )
        if layer.lowrank is not None or layer.bias is not None:
            raise ValueError(
                f"kv_state was prefilled with kv_policy={policy.name!r}, whose merged or "
                "low-rank slots the engine's pages do not hold; continue it with jkv.generate"
            )
        if int(np.asarray(ctx.state.next_position)[0]) != len(ctx.tokens[0]):
            raise ValueError(
                f"kv_state's next position {int(np.asarray(ctx.state.next_position)[0])} is "
                f"not its {len(ctx.tokens[0])} tokens: a context that was continued already"
            )
        return ctx.pool_slots()

    def _ends_prefill(self, r) -> bool:
        """Whether `r`'s step ends a prefill-only prompt (its KV is read out after it)."""
        return r.seq.prefill_only and r.start + r.n == len(r.seq.prompt)

    def _read_context(self, seq) -> KVContext:
        """`seq`'s held slots (its prompt's, compressed or not) as a `jkv.KVContext`: each
        layer's kept K, V, positions and fp8 scales per kv head, as `jkv.prefill` returns them."""
        cfg, group = self.params.config, self.scheduler.group
        self._sync_rows()
        table = np.zeros(self.rows.width, np.int32)
        table[: len(seq.blocks)] = seq.blocks
        base = np.asarray(seq.base if seq.compressed else [0] * group, np.int32)
        n_prefix = seq.n_prefix if seq.compressed else 0
        held = seq.held(group)
        out = run(self.lockstep, read_row, self.device, table, base, np.int32(n_prefix),
                  np.int32(seq.tail), slots=bucket(max(held)))  # fmt: skip
        out = {name: read(self.lockstep, x) for name, x in out.items()}
        lengths = np.asarray(held, np.int32).reshape(cfg.num_layers, 1, cfg.num_kv_heads)
        layers = []
        for layer in range(cfg.num_layers):
            part = {n: jnp.asarray(np.expand_dims(np.split(x, cfg.num_layers)[layer], 0))
                    for n, x in out.items()}  # fmt: skip
            layers.append(kvlib.LayerKV(lengths=jnp.asarray(lengths[layer]), **part))
        n = len(seq.prompt)
        state = kvlib.KVState(
            layers=tuple(layers),
            next_position=jnp.asarray([n], jnp.int32),
            limit=jnp.asarray([kvlib.NO_LIMIT], jnp.int32),
            dtype=self.kv_dtype,
            policy=self._rows[seq.request_id].context_policy,
        )
        return KVContext(state=state, tokens=(tuple(seq.prompt),), weights=self.params.version)

    def prefill(self, prompt, **settings) -> KVContext:
        """`prompt` through the engine (with `add_request`'s settings: a KV policy and budget,
        a `kv_state` it continues), its KV read out once its policy compressed it: the
        `jkv.KVContext` `jkv.prefill` would return, from the engine's step. Runs the engine's
        other requests meanwhile (as `generate` does). Raises RequestFailed if a step fails it."""
        rid = self.add_request(prompt, prefill_only=True, **settings)
        while True:
            for out in self.step():
                if out.request_id != rid or not out.finished:
                    continue
                if out.error is not None or out.context is None:
                    raise RequestFailed(rid, out.error or f"it ended ({out.finish_reason})")
                return out.context

    def _write_contexts(self, seqs) -> None:
        """The KV contexts of the sequences just admitted with one, into their prefixes (before
        the step that reads them: the pool's updates run in order)."""
        self._sync_rows()
        for seq in seqs:
            counts, slots = self._rows[seq.request_id].context
            table = np.zeros(self.rows.width, np.int32)
            table[: len(seq.blocks)] = seq.blocks
            self.device = run(self.lockstep, write_context, self.device, table, counts, slots)
