"""A failed step fails its requests and nothing else (mixed into `Engine`): the requests it ran
end with `finish_reason="error"`, a pool whose buffers the failed step had donated is re-created
(the prefix cache's blocks that lived in it forgotten, running requests recomputed from their
tokens), books that no longer add up are rebuilt; only if that fails too is the engine
unhealthy."""

from __future__ import annotations

import jax

from jkv.engine.page_pool import PagePool
from jkv.engine.request_output import RequestOutput


class Recovery:
    def _recover(self, plan, err: Exception) -> list[RequestOutput]:
        """After a step raised: its requests (every running one if scheduling itself failed)
        and those of a dispatched step not read back yet fail, and the engine is made whole
        for the next: a pool whose buffers were donated is re-created (cached blocks
        forgotten, running requests recompute), books that no longer add up are rebuilt. If that
        fails too, the engine is unhealthy."""
        self.failures += 1
        message = f"{type(err).__name__}: {err}"
        seqs = [r.seq for r in plan.scheduled] if plan is not None else list(self.scheduler.running)
        if self._pending is not None:  # a dispatched step whose tokens were not read back
            seqs += [r.seq for r in self._pending.scheduled]  # (its pool went to this one)
            self._pending = None
        outs = []
        for seq in {s.request_id: s for s in seqs}.values():  # (one may be in both)
            with self._known_lock:
                if seq.request_id not in self._known:
                    continue  # aborted by its client before the failure
            if seq.request_id in self.scheduler.by_id:  # (else it finished, undelivered)
                self.scheduler.abort(seq.request_id)
            seq.finish_reason, seq.error = "error", message
            self._forget(seq.request_id)
            outs.append(self._failed_output(seq.request_id, message))
        try:
            lost = any(x.is_deleted() for x in jax.tree.leaves(self.device))
            if lost or not self._books_add_up():
                self._rebuild(lost)
        except Exception as again:  # noqa: BLE001 - nothing left to try
            self.healthy = False
            self.health_error = f"{message}; recovery failed: {type(again).__name__}: {again}"
        return outs

    @staticmethod
    def _failed_output(rid: str, error: str) -> RequestOutput:
        return RequestOutput(rid, [], True, "error", 0, error=error)

    def _books_add_up(self) -> bool:
        try:
            self.pool.check()
        except AssertionError:
            return False
        held = sum(s.pages for s in self.scheduler.running)
        return held <= self.pool.used_pages

    def _rebuild(self, lost: bool) -> None:
        """Every running request back to waiting (recomputed from its tokens), the prefix
        cache forgotten; the pool's books re-created, and its device arrays if `lost`."""
        self.scheduler.preempt_all()
        if self.pool.used_pages or not self._books_add_up():
            self.pool.clear_cache()  # its cached blocks die with it: `kv_events` hears so
            self.pool = PagePool(**self._pool_settings)
            self.scheduler.pool = self.pool
            lost = True
        else:
            self.pool.clear_cache()
        self.rows.clear()
        if lost:
            self.device = self._empty_device()
            self.pool.take_dirty()
