"""Async scheduling (mixed into `Engine`), as vLLM v1's: a flattened step is dispatched (JAX
runs it while the host goes on), the scheduler books it at once with a placeholder token for
each row that samples, and the next step is scheduled and packed while the device still runs
this one; its decode rows take their input token from this step's output on the device
(`ragged_step`'s `last_tok`). The host reads a step's tokens after dispatching the next
(`_read_back`): an eos or a stop string found then ends the request one step late, the token
computed for it in the meantime thrown away. Steps that need the host between them (the end of
a prompt a policy compresses) read back first and run as before, as does a group of processes
(`lockstep`), whose followers replay the steps."""

from __future__ import annotations

import dataclasses

from jkv.engine.lockstep import read
from jkv.engine.ragged import order
from jkv.engine.sequence import Status

PLACEHOLDER = -1  # a sampled token the host has not read back yet


@dataclasses.dataclass
class Ahead:
    """A flattened step dispatched and booked, its tokens not read back yet."""

    scheduled: list  # its rows, in `order` (row i of its output)
    tok: object  # its `[P]` int32 output on the device (`_last_tok` until the next dispatch)
    samplers: dict  # request id -> its row, for the rows that sampled
    rows: dict  # request id -> its `Row` then (another, or none, once it ended or left)
    at: dict  # request id -> the index of its placeholder in `seq.output`
    cached: dict  # request id -> prompt tokens from the prefix cache
    held: dict  # request id -> pages held in the step
    finished: set  # request ids booking finished (max_tokens reached)


class AsyncSteps:
    def _awaited(self) -> bool:
        """Whether the dispatched step's tokens are still wanted by a request in the engine."""
        ahead = self._pending
        return ahead is not None and any(
            self._rows.get(rid) is row for rid, row in ahead.rows.items()
        )

    def _overlaps(self, plan) -> bool:
        """Whether `plan` can run ahead of the host: no row ends a prompt its policy compresses
        (the compaction needs the host) or one whose KV is read out (`Engine.prefill`)."""
        return (
            self.async_scheduling
            and self.lockstep is None
            and not any(self._ends_compression(r) or self._ends_prefill(r) for r in plan.scheduled)
        )

    def _ahead(self, plan) -> Ahead:
        """Dispatches `plan` as one flattened step without reading its tokens; books it with
        placeholders (rows that reach max_tokens finish now: that needs no token's value)."""
        self._start(plan)
        scheduled = order(plan.scheduled)
        # the rows that sample, as planned (a row's plan is plain data: booking changes none)
        samplers = {r.seq.request_id: i for i, r in enumerate(scheduled) if r.samples}
        tok = self._dispatch_flat(scheduled)
        self._last_samplers = samplers  # the next plan's placeholders: these rows of `tok`
        cached = {r.seq.request_id: r.seq.num_cached for r in scheduled}
        held = {r.seq.request_id: r.seq.pages for r in scheduled}
        booked = self.scheduler.finish_step(plan, dict.fromkeys(samplers, PLACEHOLDER))
        at = {r.seq.request_id: len(r.seq.output) - 1 for r in scheduled
              if r.seq.request_id in samplers}  # fmt: skip
        rows = {rid: self._rows[rid] for rid in samplers}
        return Ahead(scheduled, tok, samplers, rows, at, cached, held,
                     {s.request_id for s in booked})  # fmt: skip

    def _read_back(self) -> list:
        """The dispatched step's tokens, read (waiting for the device) and handed out: each
        placeholder filled in; an eos or a stop string ends its request here."""
        ahead = self._pending
        if ahead is None:
            return []
        tok = read(self.lockstep, ahead.tok)
        outs = []
        for r in ahead.scheduled:
            seq, rid = r.seq, r.seq.request_id
            i = ahead.samplers.get(rid)
            if i is None or self._rows.get(rid) is not ahead.rows[rid]:
                continue  # it sampled nothing; or it was aborted, failed or ended since
            finished, at = rid in ahead.finished, ahead.at[rid]
            seq.output[at] = token = int(tok[i])
            if token in seq.eos_ids:
                del seq.output[at + 1 :]  # the placeholder of a step that ran on without it
                if finished:
                    seq.finish_reason = "stop"
                else:
                    self.scheduler.finish(seq, "stop")
                    finished = True
            outs.append(self._output(seq, finished, ahead.cached[rid], ahead.held[rid], at + 1))
        self._pending = None  # (kept until here: if reading fails, its requests fail too)
        return outs

    def _still_running(self, plan):
        """`plan` less the rows a read-back just ended (an eos, a stop string)."""
        plan.scheduled = [r for r in plan.scheduled if r.seq.status is Status.RUNNING]
        return plan
