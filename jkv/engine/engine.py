"""`jkv.Engine`: requests come and go while others decode, sharing one paged KV pool.

    engine = jkv.Engine(params, num_pages=2048, page_size=16)
    rid = engine.add_request("The capital of France is", max_new_tokens=16)
    while engine.has_work:
        for out in engine.step():        # one model step for every scheduled request
            print(out.request_id, out.new_tokens, out.finished)

The scheduler (plain Python) decides which tokens run; the runner maps their pages, runs THE
model step and samples. Per-request settings (sampling values, seed, max_new_tokens, stop
strings) are per-row data: requests with different settings share a step. With async
scheduling (the default) a step is dispatched before the step before's tokens are read, and
those come back from the next `step()` call (`jkv.engine.ahead`).

`add_request` and `abort` are messages: from any thread they are checked and queued, never
waiting for a running step; each step (or, when none runs, the call) takes them in.

A step that raises fails the requests it ran (their outputs say `finish_reason="error"`; a
stream raises `RequestFailed`), and the engine goes on: a pool whose buffers the failed step
donated is re-created (its prefix-cache blocks forgotten, running requests recompute), books
that no longer add up rebuilt; if that fails too, `healthy` is False and all are refused.

A KV policy that selects once, after the prompt (SnapKV, PyramidKV, Ada-KV, EffiCache,
Quantile), is a per-request setting: the prompt runs on the flattened step like a full cache's,
then the policy selects over the pool (`jkv.engine.select`: its window votes through the page
table; EffiCache's head sensitivity comes from one gradient pass over the whole prompt), then
each head's kept tokens move into the fewest pages and the rest go back to the pool.
An evicting policy (StreamingLLM, H2O, or a plugin's: `KVPolicy.ring`) compresses the same way
at the prompt's end, then keeps a ring of its budget's slots, the policy's per-request state on
the host (`jkv.policies.base.Ring`): each new token overwrites the slot its rule picks, the
oldest non-sink one for StreamingLLM, or, per head, the lightest by attention mass outside the
recent window (H2O, chosen in the step; every query of an H2O row adds the attention it pays to
the mass of each slot, a float32 per stored token in the pool: `Engine(attention_mass=True)`). KVzip's replay of the context runs over the row's own pages
after its prompt (`jkv.engine.replay`), then it selects like the others. The segment rebuild
writes ordinary slots and low-rank pages (`jkv.engine.rebuild`). The kv dtype (float32,
bfloat16, or fp8 with a bfloat16 scale per token) is one per engine.

Over a mesh (params loaded with `mesh=`, or `Engine(..., mesh=)`), the pool is sharded over kv
heads on the "model" axis: each device stores one segment of the pages, a kv head's pages come
from the segment of the device holding its weights (`page_pool`), and each layer writes and
attends on its own heads in `shard_map` (`jkv.core.paged`); kv heads are repeated when the axis
is larger than them (`jkv.sharding.kv_head_parallel`). `num_pages` must be a multiple of it.
"""

from __future__ import annotations

import collections
import concurrent.futures
import dataclasses
import itertools
import threading
import time

import jax
import jax.numpy as jnp
import numpy as np

from jkv.core.sampling import SamplingArrays
from jkv.engine.ahead import PLACEHOLDER, Ahead, AsyncSteps
from jkv.engine.context_steps import ContextSteps
from jkv.engine.lockstep import read, run
from jkv.engine.page_pool import PagePool
from jkv.engine.plan import bucket, most_tokens
from jkv.engine.policy_steps import PolicySteps
from jkv.engine.pool_size import describe, pages_for_memory
from jkv.engine.ragged import order, pack_ragged, ragged_step
from jkv.engine.rebuild import lowrank_slots
from jkv.engine.recovery import Recovery
from jkv.engine.replay import scratch_tokens
from jkv.engine.request_output import RequestOutput, Row
from jkv.engine.runner import RowTables, empty_pool, set_rows
from jkv.engine.scheduler import Scheduler
from jkv.engine.sequence import Sequence, Status
from jkv.engine.streams import RequestFailed, Streams
from jkv.engine.warmup import Warmup
from jkv.memory import page_bytes
from jkv.output import RowOutput
from jkv.params import Params
from jkv.prompt import prompt_ids
from jkv.request import Request
from jkv.sharding import kv_head_parallel

__all__ = ["Engine", "RequestFailed", "RequestOutput"]


class Engine(Streams, AsyncSteps, PolicySteps, ContextSteps, Recovery, Warmup):
    def __init__(
        self,
        params: Params,
        *,
        num_pages: int | None = None,
        page_size: int = 16,
        memory_fraction: float | None = None,
        token_budget: int = 256,
        chunk: int = 128,
        max_running: int = 16,
        max_model_len: int | None = None,
        kv_dtype: str | None = None,
        backend: str | None = None,
        recycle: str = "lazy",
        recycle_below: float = 0.15,
        admission_headroom: float = 0.05,
        admission: str = "reserve",
        attention_mass: bool = False,
        mesh=None,
        kv_events=None,
        async_scheduling: bool = True,
    ):
        if not isinstance(params, Params):
            raise ValueError(
                f"params is a {type(params).__name__}; expected jkv.Params (from jkv.load)"
            )
        self.mesh = params.mesh if mesh is None else mesh
        self.tp = 1
        if self.mesh is not None:  # the pool sharded over kv heads on the "model" axis
            params, self.tp = kv_head_parallel(params, self.mesh)
        probe = Request.build(params, kv_dtype=kv_dtype, backend=backend)
        self.kv_dtype = probe.kv_dtype or params.kv_dtype
        self.backend = probe.backend
        self.params = params
        cfg = params.config
        self.max_model_len = cfg.max_position_embeddings if max_model_len is None else max_model_len
        if (
            isinstance(self.max_model_len, bool)
            or not isinstance(self.max_model_len, int)
            or (self.max_model_len < 1)
        ):
            raise ValueError(f"max_model_len={max_model_len!r}: expected an int >= 1")
        self.attention_mass = bool(attention_mass)
        if num_pages is None:  # a share of the free memory (`jkv.engine.pool_size`)
            num_pages = pages_for_memory(cfg, page_size, self.kv_dtype, mass=self.attention_mass,
                                         shards=self.tp, max_model_len=self.max_model_len,
                                         max_running=max_running,
                                         fraction=memory_fraction)  # fmt: skip
        elif memory_fraction is not None:
            raise ValueError(f"{num_pages=} and {memory_fraction=}: give one or the other")
        self.page_bytes = page_bytes(cfg, page_size, self.kv_dtype, mass=self.attention_mass)
        self._pool_settings = dict(
            num_pages=num_pages,
            page_size=page_size,
            group_size=cfg.num_layers * cfg.num_kv_heads,
            recycle=recycle,
            recycle_below=recycle_below,
            admission_headroom=admission_headroom,
            shards=self.tp,
            num_kv_heads=cfg.num_kv_heads,
            events=kv_events,  # told of every prefix-cache change (page_pool.py, "Events")
        )
        if isinstance(num_pages, int) and num_pages % self.tp:
            raise ValueError(
                f"num_pages={num_pages}: the pool is split over {self.tp} devices of the "
                "'model' axis; expected a multiple of that"
            )
        self.pool = PagePool(**self._pool_settings)
        self.scheduler = Scheduler(
            self.pool,
            num_layers=cfg.num_layers,
            num_kv_heads=cfg.num_kv_heads,
            token_budget=token_budget,
            chunk=chunk,
            max_running=max_running,
            admission=admission,
        )
        self.rows = RowTables(max_running, -(-self.max_model_len // page_size) + 2)
        # Several processes' engines over one mesh (`jkv.serve.group`): the leader's link, told
        # of each step and of its device work (`jkv.engine.lockstep`). None: alone.
        self.lockstep = None
        # The pool's zeros are written (a first touch of every page: seconds for GiBs) while
        # warmup traces its programs against the pool's shapes; the first use waits for it.
        self._making, self._spec = concurrent.futures.Future(), None
        # Over a mesh it is made here (sharded arrays; a process ending while a thread made
        # them aborted inside XLA); otherwise in a daemon thread.
        if self.mesh is not None:
            self._make_device()
        else:
            threading.Thread(target=self._make_device, daemon=True, name="jkv-pool").start()
        # Async scheduling: the flattened step dispatched, its tokens not read yet (`Ahead`),
        # and the last one's sampled tokens on the device (the next step's decode inputs).
        self.async_scheduling = bool(async_scheduling)
        self._pending: Ahead | None = None
        self._last_tok = jnp.zeros(bucket(max_running), jnp.int32)  # as a step's output is
        self._last_samplers: dict[str, int] = {}  # request id -> its row of `_last_tok`
        self.eos_ids = tuple(sorted(set(cfg.eos_token_ids)))
        self._rows: dict[str, Row] = {}
        self._ids = itertools.count()
        self._lock = threading.Lock()  # steps (and taking messages in): one at a time
        self._inbox: collections.deque = collections.deque()  # add / abort messages
        self._known: set[str] = set()  # request ids added and not finished
        self._known_lock = threading.Lock()
        self._steps = 0
        self.healthy, self.health_error = True, None
        self.failures = 0  # steps that raised
        Streams.__init__(self)

    @property
    def device(self):
        """The pool's arrays (`jkv.engine.runner.PagedKV`)."""
        if self._making is not None:
            self._device, self._making = self._making.result(), None
        return self._device

    @device.setter
    def device(self, value) -> None:
        self._device, self._making = value, None

    def _make_device(self) -> None:
        try:
            self._making.set_result(self._empty_device())
        except BaseException as err:  # noqa: BLE001 - raised where the pool is first used
            self._making.set_exception(err)

    def pool_spec(self):
        """The pool's shapes and dtypes (what compiling needs), without waiting for it."""
        if self._making is not None and self.mesh is None:
            if self._spec is None:
                self._spec = jax.eval_shape(self._empty_device)
            return self._spec
        return self.device

    def _empty_device(self):
        cfg, s = self.params.config, self._pool_settings
        rows = np.frombuffer(self.pool.rows, np.int32).reshape(-1, self.scheduler.group)
        return run(self.lockstep, empty_pool, cfg, s["num_pages"], s["page_size"], self.kv_dtype,
                   rows, self.attention_mass, self.mesh)  # fmt: skip

    @property
    def has_work(self) -> bool:
        return bool(self._inbox) or self.scheduler.has_work or self._awaited()

    def describe_pool(self) -> str:
        """What the pool holds, in tokens and in full-context requests (the server's startup
        line)."""
        return describe(self.pool.num_pages, self.pool.page_size, self.scheduler.group,
                        self.page_bytes, self.max_model_len)  # fmt: skip

    # ------------------------------------------------------------------ messages

    def add_request(
        self, prompt, *, request_id: str | None = None, cache_salt=None, reserve=None,
        kv_state=None, prefill_only: bool = False, **settings,
    ):  # fmt: skip
        """Queues a prompt (text, UTF-8 bytes or token ids) with `jkv.generate`'s settings;
        `cache_salt` keeps a tenant's prefix-cache pages its own; `reserve`: the output tokens
        admission reserves pages for (default: all of max_new_tokens; past them it grows as
        pages allow, preempted by the usual rule when they run out); `kv_state`: a one-row
        `jkv.KVContext` (`jkv.prefill`) the prompt continues, as `jkv.generate(kv_state=)` does:
        its kept slots are written into the request's first pages when it is admitted (again
        after a preemption), never recomputed, and the prompt (encoded without special tokens)
        runs after them; `prefill_only`: the request ends at its prompt's end, once its KV
        policy compressed it, sampling nothing: its last output (`finish_reason` "context")
        carries its KV as a `jkv.KVContext` (`RequestOutput.context`, what `Engine.prefill`
        returns). Returns the request id. Never waits for a running step.

        Raises:
          ValueError: a bad setting, a prompt past the model's context, one that could never
            fit in the pool, a request id in use, a setting the engine does not serve, or a
            context of other weights, shape or kv dtype, or one the engine cannot continue.
          RuntimeError: the engine is unhealthy (a failed step it could not recover from).
        """
        if not self.healthy:
            raise RuntimeError(f"the engine is unhealthy: {self.health_error}")
        req = Request.build(self.params, **settings)
        if prefill_only:  # one step's logits, never a token: no output to reserve pages for
            req = dataclasses.replace(req, max_new_tokens=1)
            policy = req.policy
            if policy is not None and (policy.evicts or policy.raw_keys or policy.rebuilds):
                raise ValueError(
                    f"kv_policy={policy.name!r} with prefill_only: a context is read out of the "
                    "engine for policies that select once (SnapKV, KVzip, ...) or a full cache; "
                    "prefill this one with jkv.prefill"
                )
        if kv_state is not None and req.policy is not None:
            raise ValueError(
                f"kv_policy={req.policy.name!r} given beside kv_state: the context was "
                "compressed when it was prefilled; pass neither kv_policy nor kv_budget"
            )
        self._check_policy(req.policy)
        if req.stop and self.params.tokenizer is None:
            raise ValueError(f"stop={req.stop!r}: stop strings need a model with a tokenizer")
        if req.kv_dtype not in (None, self.kv_dtype) or req.backend != self.backend:
            raise ValueError(
                f"kv_dtype={req.kv_dtype!r} backend={req.backend!r}: the engine's are "
                f"{self.kv_dtype!r} and {self.backend!r}, one per engine"
            )
        if reserve is not None and (
            isinstance(reserve, bool) or not isinstance(reserve, int) or reserve < 1
        ):
            raise ValueError(f"reserve={reserve!r}: expected an int >= 1 or None")
        ids = prompt_ids(self.params, prompt, None, special=kv_state is None)
        context = None
        if kv_state is not None:
            context = self._context(kv_state)
            ids = list(kv_state.tokens[0]) + ids
        self._check_length(ids, req)
        rid = f"req-{next(self._ids)}" if request_id is None else request_id
        if not isinstance(rid, str) or not rid:
            raise ValueError(f"request_id={request_id!r}: expected a non-empty str")
        seq = self._sequence(rid, ids, req, cache_salt, reserve)
        if context is not None:
            seq.context, seq.covered = context[0].tolist(), len(kv_state.tokens[0])
            seq.cacheable = False
        seq.prefill_only = bool(prefill_only)
        need = self.scheduler.need(seq)
        if need > self.pool.usable:
            raise ValueError(
                f"a prompt of {len(ids)} tokens plus max_tokens={seq.max_tokens} needs {need} "
                f"pages ({self.scheduler.group} per {self.pool.page_size} tokens), more than the "
                f"pool's {self.pool.usable}; shorten it or give the engine more pages"
            )
        with self._known_lock:
            if rid in self._known:
                raise ValueError(f"request_id={rid!r} is already in the engine")
            self._known.add(rid)
        tok = self.params.tokenizer
        row = Row(req, RowOutput(tok, req.stop) if tok is not None else None)
        row.context = context
        if prefill_only:  # the policy its context is read out with: the request's or its context's
            policy = req.policy if kv_state is None else kv_state.policy
            row.context_policy = None if policy is None else policy.jit_key()
        self._post(("add", seq, row))
        return rid

    def _check_length(self, ids, req) -> None:
        context = self.params.config.max_position_embeddings
        longest = len(ids) + req.max_new_tokens - 1
        if longest > context and not req.allow_beyond_context:
            raise ValueError(
                f"a prompt of {len(ids)} tokens plus max_new_tokens={req.max_new_tokens} runs "
                f"past the model's trained context ({context}); shorten it or pass "
                "allow_beyond_context=True"
            )
        if longest > self.max_model_len:
            raise ValueError(
                f"a prompt of {len(ids)} tokens plus max_new_tokens={req.max_new_tokens} needs "
                f"{longest} positions, more than this engine's max_model_len={self.max_model_len}"
            )

    def _sequence(self, rid, ids, req, cache_salt, reserve) -> Sequence:
        policy = req.policy
        # Everything that changes what a cached block's bytes mean is in its key: the weights,
        # the kv dtype and the tenant (every row's keys are stored rotated at their positions,
        # StreamingLLM's too). Attention mass is a request's own (H2O never shares).
        seq = Sequence(
            rid,
            ids,
            req.max_new_tokens,
            arrival=0,
            eos_ids=self.eos_ids,
            extra_keys=(self.params.version, self.kv_dtype, cache_salt),
            reserve=reserve,
        )
        if policy is not None:
            layers, kept = self.params.config.num_layers, policy.budget_tokens(len(ids))
            most = max(policy.layer_budget(i, layers, kept) for i in range(layers))
            seq.compresses, seq.window = True, getattr(policy, "window", 0)
            seq.keep = min(len(ids), most) + req.max_new_tokens
            if policy.rebuilds:  # and its low-rank pages
                seq.keep += lowrank_slots(policy, len(ids), self.params.config, self.pool.page_size)
            if policy.evicts:  # a ring of `limit` slots per head once the prompt is in
                seq.ring = policy.ring(policy.row_limit(len(ids)))
                seq.keep = min(seq.limit, len(ids) + req.max_new_tokens)
            seq.cacheable = not policy.wants_mass
            if policy.needs_replay:  # KVzip: its replay is written after the prompt
                seq.scratch = scratch_tokens(self.params, ids, policy)
                room = self.rows.width * self.pool.page_size
                if len(ids) + seq.scratch > room:
                    raise ValueError(
                        f"kv_policy='kvzip': a prompt of {len(ids)} tokens and its replay "
                        f"({seq.scratch} tokens, chunk={policy.chunk}) need "
                        f"{len(ids) + seq.scratch} positions, more than a row's {room} here; "
                        "shorten the prompt or give KVzip a smaller chunk"
                    )
        return seq

    def abort(self, request_id: str) -> bool:
        """Stops a request; its pages go back to the pool (at once when no step runs, else
        when the next one starts). False if it is not in the engine. Never waits."""
        with self._known_lock:
            found = request_id in self._known
        if found:
            self._post(("abort", request_id))
        return found

    def _post(self, message) -> None:
        self._inbox.append(message)
        if self._lock.acquire(blocking=False):  # no step runs: take it in now
            self._deliver(self._drain())
            self._release()

    def _release(self) -> None:
        """Releases the step lock, taking in what was posted while it was held: a poster that
        found the lock taken left its message to the holder, so the holder looks once more
        after letting go (and takes it in unless someone else took the lock meanwhile)."""
        while True:
            self._lock.release()
            if not self._inbox or not self._lock.acquire(blocking=False):
                return
            self._deliver(self._drain())

    def _drain(self) -> list[RequestOutput]:
        """Takes in every queued message (the lock held). Returns the aborted requests' last
        outputs."""
        outs = []
        while self._inbox:
            kind, *body = self._inbox.popleft()
            if kind == "add":
                seq, row = body
                try:
                    self.scheduler.add(seq)
                except ValueError as err:  # checked when added: only a pool rebuilt since
                    self._forget(seq.request_id)
                    outs.append(self._failed_output(seq.request_id, str(err)))
                    continue
                self._rows[seq.request_id] = row
            elif self.scheduler.abort(body[0]) is not None:
                self._forget(body[0])
                outs.append(RequestOutput(body[0], [], True, "abort", 0))
        return outs

    def _forget(self, rid: str) -> None:
        self._rows.pop(rid, None)
        with self._known_lock:
            self._known.discard(rid)

    # ------------------------------------------------------------------ steps

    def step(self) -> list[RequestOutput]:
        """Takes in queued adds and aborts, then runs one scheduled model step. Returns an
        output for every request that sampled a token (or finished, or failed) in it; with
        async scheduling, a flattened step's tokens come back from the next call (see
        `_ahead`). A streamed request's outputs also reach its stream, whoever calls."""
        outs = self._step()
        self._deliver(outs)
        return outs

    def _step(self) -> list[RequestOutput]:
        self._lock.acquire()
        try:
            self._deliver(self._drain())
            if self.lockstep is not None:  # the group's other engines run the step's calls
                self.lockstep.tick()
            if not self.scheduler.has_work and not self._awaited():
                self._pending = None  # nobody waits for its tokens
                return []
            plan = None
            try:
                plan = self.scheduler.schedule() if self.scheduler.has_work else None
                if plan is not None and plan.contexts:
                    self._write_contexts(plan.contexts)
                if plan is not None and self._overlaps(plan):
                    ahead = self._ahead(plan)
                    outs = self._read_back()
                    self._pending = ahead
                    return outs
                outs = self._read_back()
                if plan is not None:
                    outs += self._run_step(self._still_running(plan))
                return outs
            except Exception as err:  # noqa: BLE001 - one failure fails one step
                return self._recover(plan, err)
        finally:
            if self.lockstep is not None:
                self.lockstep.stepped()
            self._release()

    def _start(self, plan) -> None:
        """A step begins: counted, its rows' first-scheduled times and block rows set."""
        self._steps += 1
        now = time.monotonic()
        for r in plan.scheduled:
            if r.seq.first_scheduled is None:
                r.seq.first_scheduled = now
        self.rows.keep_only({s.request_id for s in self.scheduler.running})
        self._sync_rows()

    def _run_step(self, plan) -> list[RequestOutput]:
        """Runs `plan` and reads its tokens back before returning (a step that ends a prompt a
        policy compresses, and every step without async scheduling)."""
        self._start(plan)
        sampled: dict[str, int] = {}
        kept: dict[str, tuple] = {}  # what a policy keeps of prompts that end in this step
        ending = {}  # rows whose prompt a policy compresses after the step, by the policy
        for r in plan.scheduled:
            if self._ends_compression(r):
                policy = self._rows[r.seq.request_id].req.policy
                ending.setdefault(policy.jit_key(), []).append(r)
        sampled.update(self._run_flat(order(plan.scheduled)))
        for key, rows in ending.items():
            self._select(rows, key, kept)
        # before any frees: prefix-cache hits and pages held
        cached = {r.seq.request_id: r.seq.num_cached for r in plan.scheduled}
        held = {r.seq.request_id: r.seq.pages for r in plan.scheduled}
        finished = {s.request_id for s in self.scheduler.finish_step(plan, sampled)}
        for r in plan.scheduled:
            if r.seq.status is Status.RUNNING and r.seq.awaits_compression:
                self._compress(r.seq, *kept[r.seq.request_id])
        contexts = {}  # prefill-only requests whose prompt (compressed) is in the pages
        for r in plan.scheduled:
            seq = r.seq
            if seq.prefill_only and seq.status is Status.RUNNING and not seq.prefilling:
                if not seq.awaits_compression:
                    contexts[seq.request_id] = self._read_context(seq)
                    self.scheduler.finish(seq, "context")
                    finished.add(seq.request_id)
        outs = [
            self._output(
                r.seq,
                r.seq.request_id in finished,
                cached[r.seq.request_id],
                held[r.seq.request_id],
            )  # fmt: skip
            for r in plan.scheduled
            if r.seq.request_id in sampled
        ]
        for out in outs:
            out.context = contexts.get(out.request_id)
        return outs

    def _output(self, seq, finished: bool, cached: int, held: int, end=None) -> RequestOutput:
        """What a step did for `seq`: the tokens it sampled since the last output (of its first
        `end` only: those read back); a stop string among them ends the request here (also if
        it was preempted in this step)."""
        rid = seq.request_id
        row = self._rows[rid]
        tokens, text = row.take(seq, finished, end)
        if row.stopped and not finished:
            if end is not None:
                del seq.output[end:]  # the placeholder of a step that ran on without it
            self.scheduler.finish(seq, "stop")
            finished = True
        reason = "stop" if row.stopped else seq.finish_reason
        if finished:
            self._forget(rid)
        return RequestOutput(rid, tokens, finished, reason, cached, text, seq.first_scheduled,
                             held, seq.preemptions)  # fmt: skip

    def _sync_rows(self) -> None:
        """Tells the device the block rows the host changed since the last call."""
        ids, rows = self.pool.take_dirty()
        if ids:
            n = bucket(len(ids))
            pad_ids = np.full(n, self.pool.num_blocks, np.int32)
            pad_ids[: len(ids)] = ids
            pad_rows = np.zeros((n, self.scheduler.group), np.int32)
            pad_rows[: len(ids)] = rows
            self.device = run(self.lockstep, set_rows, self.device, pad_ids, pad_rows)

    def _sampling(self, scheduled, b: int):
        reqs = [self._rows[r.seq.request_id].req for r in scheduled]
        reqs += [reqs[0]] * (b - len(scheduled))  # padding rows sample and are ignored
        index = np.zeros((b,), np.int32)
        index[: len(scheduled)] = [r.row.sampled for r in scheduled]
        return SamplingArrays.build([q.sampling for q in reqs], [q.seed for q in reqs]), index

    def _run_flat(self, scheduled) -> dict[str, int]:
        """The step's rows, in one flattened step over the pool."""
        tok = read(self.lockstep, self._dispatch_flat(scheduled))
        self._last_samplers = {}  # read back now: no plan waits for these tokens
        return {r.seq.request_id: int(tok[i]) for i, r in enumerate(scheduled) if r.samples}

    def _dispatch_flat(self, scheduled):
        """Dispatches the flattened step over `scheduled` (in `order`); its `[P]` sampled
        tokens on the device. A placeholder among the inputs (a token not read back when the
        step was planned) is the last dispatched step's, taken from its output on the device
        (`_last_tok`), read back since or not."""
        sched = self.scheduler
        most = most_tokens(bucket(len(scheduled)), sched.token_budget, sched.chunk)
        plan_rows = [r.row for r in scheduled]
        rows, tokens, positions = pack_ragged(
            plan_rows, self.rows, sched.group, self.pool.page_size, most, self.attention_mass
        )
        from_last = np.full(len(tokens), -1, np.int32)
        for t in np.flatnonzero(tokens == PLACEHOLDER):
            from_last[t] = self._last_samplers[plan_rows[rows.tok_row[t]].request_id]
        sampling, index = self._sampling(scheduled, len(rows.q_len))
        self._last_tok, self.device = run(
            self.lockstep, ragged_step, self.params.weights, self.params.config, self.device,
            rows, tokens, positions, sampling, index, self._last_tok, from_last,
            backend=self.backend, dtype=self.kv_dtype, mesh=self.mesh,
        )  # fmt: skip
        return self._last_tok

    # ------------------------------------------------------------------ the rest

    def stats(self) -> dict:
        """Counters for monitoring (read without waiting for a step): pages (total usable,
        used by requests, free, cached and idle) and the share in use, the pool's device bytes
        and bytes per page, prefix-cache lookups and hits (blocks) and hit rate, pages recycled
        (lazily, by the watermark), preemptions, requests running and waiting, steps, failed
        steps and health. A request whose abort is queued counts in neither (a step, compiling
        maybe, may hold the messages for long); a queued add counts as waiting."""
        pool, s = self.pool, self.pool.stats
        adds, aborts = set(), set()
        for kind, *body in tuple(self._inbox):  # a copy: other threads post meanwhile
            if kind == "add":
                adds.add(body[0].request_id)
            else:
                aborts.add(body[0])
        staying = lambda seqs: sum(q.request_id not in aborts for q in tuple(seqs))  # noqa: E731
        return dict(
            pages_total=pool.usable,
            pages_used=pool.used_pages,
            pages_free=pool.free_pages - pool.cached_idle_pages,
            pages_cached_idle=pool.cached_idle_pages,
            usage=pool.usage,
            pool_bytes=pool.num_pages * self.page_bytes,
            page_bytes=self.page_bytes,
            table_bytes=len(pool.rows) * pool.rows.itemsize,
            prefix_queries=s.prefix_queries,
            prefix_hits=s.prefix_hits,
            prefix_hit_rate=s.prefix_hits / s.prefix_queries if s.prefix_queries else 0.0,
            recycled_lazy=s.recycled_lazy,
            recycled_watermark=s.recycled_watermark,
            preemptions=self.scheduler.num_preemptions,
            running=staying(self.scheduler.running),
            waiting=staying(self.scheduler.waiting) + len(adds - aborts),
            steps=self._steps,
            failures=self.failures,
            healthy=self.healthy,
        )

    def generate(self, prompts, **settings) -> list[list[int]]:
        """Every prompt through the engine at once; each one's generated token ids, in order.
        Raises RequestFailed if a step fails one of them."""
        rids = [self.add_request(p, **settings) for p in prompts]
        got: dict[str, list[int]] = {rid: [] for rid in rids}
        while self.has_work:
            for out in self.step():
                if out.error is not None and out.request_id in got:
                    raise RequestFailed(out.request_id, out.error)
                if out.request_id in got:
                    got[out.request_id] += out.new_tokens
        return [got[rid] for rid in rids]
