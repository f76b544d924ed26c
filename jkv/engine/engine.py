"""`jkv.Engine`: requests come and go while others decode, sharing one paged KV pool.

    engine = jkv.Engine(params, num_pages=2048, page_size=16)
    rid = engine.add_request("The capital of France is", max_new_tokens=16)
    while engine.has_work:
        for out in engine.step():        # one model step for every scheduled request
            print(out.request_id, out.new_tokens, out.finished)

The scheduler (plain Python) decides which tokens run; the runner maps their pages, runs THE
model step and samples. Per-request settings (sampling values, seed, max_new_tokens, stop
strings) are per-row data: requests with different settings share a step.

`add_request` and `abort` are messages: from any thread (or the event loop) they are checked and
queued, never waiting for a running step; each step starts by taking them in (vLLM's
EngineCore input queue). When no step runs, they are taken in at once.

A step that raises fails the requests it ran (their outputs say `finish_reason="error"`; a
stream raises `RequestFailed`), and the engine goes on: a pool whose buffers the failed step
donated is re-created (the prefix cache's blocks that lived in it are forgotten and running
requests recompute), books that no longer add up are rebuilt. Only when that fails too is the
engine unhealthy (`healthy` False): every request is refused from then on.

A KV policy that selects once, after the prompt (SnapKV, PyramidKV, Ada-KV, EffiCache,
Quantile), is a per-request setting: the step that ends a prompt runs with the policy (its window
votes and its selection; EffiCache's head sensitivity comes from one gradient pass over the
whole prompt just before), then each head's kept tokens move into the fewest pages and the rest
go back to the pool. StreamingLLM and H2O compress the same way at the prompt's end, then keep a
ring of their budget's slots: each new token overwrites the oldest non-sink one (StreamingLLM)
or the lightest by attention mass outside the recent window (H2O, whose mass per stored token
lives in the pool: `Engine(attention_mass=True)`). The segment rebuild stays on the one-shot
path (ValueError here). The kv dtype (float32, bfloat16, or fp8 with a bfloat16 scale per
token) is one per engine.
"""

from __future__ import annotations

import collections
import dataclasses
import itertools
import threading
import time

import jax
import numpy as np

from jkv import kv as kvlib
from jkv.core.paged import PagedRows
from jkv.core.sampling import SamplingArrays
from jkv.engine.page_pool import PagePool
from jkv.engine.ragged import order, pack_ragged, ragged_step
from jkv.engine.runner import (
    Rows,
    RowTables,
    bucket,
    compact,
    empty_pool,
    pack,
    paged_step,
    set_rows,
    write_mass,
    write_pages,
)
from jkv.engine.scheduler import Scheduler
from jkv.engine.sequence import Sequence, Status
from jkv.engine.streams import RequestFailed, Streams
from jkv.limits import available_bytes
from jkv.memory import page_bytes
from jkv.output import RowOutput
from jkv.params import Params
from jkv.policies import resolve
from jkv.policies.base import KVPolicy
from jkv.policies.efficache import head_sensitivity
from jkv.prompt import prompt_ids
from jkv.request import Request

SERVED = "snapkv, pyramidkv, adakv, efficache, quantile, streaming, h2o"
__all__ = ["Engine", "RequestFailed", "RequestOutput"]


@dataclasses.dataclass
class RequestOutput:
    """What one step did for one request."""

    request_id: str
    new_tokens: list[int]
    finished: bool
    finish_reason: str | None  # "stop", "length", "abort", "error"; None while running
    cached_tokens: int  # prompt tokens taken from the prefix cache
    text: str = ""  # new text no later token can change (all of the rest once finished)
    scheduled_at: float | None = None  # time.monotonic() when a step first ran its prompt
    pages: int = 0  # pages it held in this step (all heads)
    preemptions: int = 0  # times it was preempted (its pages freed, its tokens recomputed)
    error: str | None = None  # finish_reason "error": what failed


class _Row:
    """One request's settings, text and stop strings, and how much of both was handed out."""

    def __init__(self, req: Request, out: RowOutput | None):
        self.req, self.out = req, out
        self.tokens = 0  # tokens handed out
        self.pushed = 0  # tokens given to the stop-string search
        self.chars = 0  # characters of text handed out

    @property
    def stopped(self) -> bool:
        return self.out is not None and self.out.hit is not None

    def take(self, seq, final: bool) -> tuple[list[int], str]:
        """The tokens `seq` sampled since the last call (none past a stop string) and the new
        settled text."""
        if self.out is None:
            tokens = seq.output[self.tokens :]
            self.tokens = len(seq.output)
            return tokens, ""
        self.out.push(seq.output[self.pushed :])
        self.pushed = len(seq.output)
        upto = self.out.hit[1] if self.out.hit is not None else len(seq.output)
        tokens = seq.output[self.tokens : upto]
        self.tokens = max(self.tokens, upto)
        text = self.out.text if final or self.stopped else self.out.settled()
        delta, self.chars = text[self.chars :], max(self.chars, len(text))
        return tokens, delta


class Engine(Streams):
    def __init__(
        self,
        params: Params,
        *,
        num_pages: int | None = 1024,
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
        kv_events=None,
    ):
        if not isinstance(params, Params):
            raise ValueError(
                f"params is a {type(params).__name__}; expected jkv.Params (from jkv.load)"
            )
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
        if memory_fraction is not None:
            num_pages = self._pages_for_memory(memory_fraction, page_size)
        self.page_bytes = page_bytes(cfg, page_size, self.kv_dtype, mass=self.attention_mass)
        self._pool_settings = dict(
            num_pages=num_pages,
            page_size=page_size,
            group_size=cfg.num_layers * cfg.num_kv_heads,
            recycle=recycle,
            recycle_below=recycle_below,
            admission_headroom=admission_headroom,
            events=kv_events,  # told of every prefix-cache change (page_pool.py, "Events")
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
        self.device = self._empty_device()
        self.eos_ids = tuple(sorted(set(cfg.eos_token_ids)))
        self._rows: dict[str, _Row] = {}
        self._ids = itertools.count()
        self._lock = threading.Lock()  # steps (and taking messages in): one at a time
        self._inbox: collections.deque = collections.deque()  # add / abort messages
        self._known: set[str] = set()  # request ids added and not finished
        self._known_lock = threading.Lock()
        self._steps = 0
        self.healthy, self.health_error = True, None
        self.failures = 0  # steps that raised
        Streams.__init__(self)

    def _empty_device(self):
        cfg, s = self.params.config, self._pool_settings
        rows = np.frombuffer(self.pool.rows, np.int32).reshape(-1, self.scheduler.group)
        return empty_pool(cfg, s["num_pages"], s["page_size"], self.kv_dtype, rows,
                          self.attention_mass)  # fmt: skip

    @property
    def has_work(self) -> bool:
        return bool(self._inbox) or self.scheduler.has_work

    def _pages_for_memory(self, fraction, page_size: int) -> int:
        """Pages that fit in `fraction` of the device's free memory (instead of `num_pages`)."""
        if (
            isinstance(fraction, bool)
            or not isinstance(fraction, int | float)
            or not (0 < fraction < 1)
        ):
            raise ValueError(f"memory_fraction={fraction!r}: expected a number in (0, 1)")
        free = available_bytes()
        if free is None:
            raise ValueError("memory_fraction: this device reports no free memory; pass num_pages")
        per_page = page_bytes(self.params.config, page_size, self.kv_dtype,
                              mass=self.attention_mass)  # fmt: skip
        pages = int(free * fraction) // per_page
        if pages < 2:
            raise ValueError(
                f"memory_fraction={fraction}: {free * fraction / 2**20:.1f} MiB holds {pages} "
                f"pages of {per_page} bytes; at least 2 are needed"
            )
        return pages

    # ------------------------------------------------------------------ messages

    def add_request(
        self, prompt, *, request_id: str | None = None, cache_salt=None, reserve=None, **settings
    ):
        """Queues a prompt (text, UTF-8 bytes or token ids) with `jkv.generate`'s settings;
        `cache_salt` keeps a tenant's prefix-cache pages its own; `reserve`: the output tokens
        admission reserves pages for (default: all of max_new_tokens; past them it grows as
        pages allow, preempted by the usual rule when they run out). Returns the request id.
        Never waits for a running step.

        Raises:
          ValueError: a bad setting, a prompt past the model's context, one that could never
            fit in the pool, a request id in use, or a setting the engine does not serve.
          RuntimeError: the engine is unhealthy (a failed step it could not recover from).
        """
        if not self.healthy:
            raise RuntimeError(f"the engine is unhealthy: {self.health_error}")
        req = Request.build(self.params, **settings)
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
        ids = prompt_ids(self.params, prompt, None)
        self._check_length(ids, req)
        rid = f"req-{next(self._ids)}" if request_id is None else request_id
        if not isinstance(rid, str) or not rid:
            raise ValueError(f"request_id={request_id!r}: expected a non-empty str")
        seq = self._sequence(rid, ids, req, cache_salt, reserve)
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
        self._post(("add", seq, _Row(req, RowOutput(tok, req.stop) if tok is not None else None)))
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
        # the kv dtype, the key layout (a raw_keys policy stores keys before RoPE) and the
        # tenant. Attention mass is a request's own (H2O never shares).
        layout = "pre-rope" if policy is not None and policy.raw_keys else "rotated"
        seq = Sequence(
            rid,
            ids,
            req.max_new_tokens,
            arrival=0,
            eos_ids=self.eos_ids,
            extra_keys=(self.params.version, self.kv_dtype, layout, cache_salt),
            reserve=reserve,
        )
        if policy is not None:
            layers, kept = self.params.config.num_layers, policy.budget_tokens(len(ids))
            most = max(policy.layer_budget(i, layers, kept) for i in range(layers))
            seq.compresses, seq.window = True, getattr(policy, "window", 0)
            seq.keep = min(len(ids), most) + req.max_new_tokens
            if policy.evicts:  # a ring of `limit` slots per head once the prompt is in
                seq.limit = policy.row_limit(len(ids))
                seq.keep = min(seq.limit, len(ids) + req.max_new_tokens)
            seq.cacheable = not policy.wants_mass
        return seq

    def _check_policy(self, policy) -> None:
        """The policies the engine serves: all but the segment rebuild (H2O only with the
        pool's attention mass), each with an observation window that fits one step."""
        if policy is None:
            return
        if policy.wants_mass and not self.attention_mass:
            raise ValueError(
                f"kv_policy={policy.name!r} evicts by attention mass, which this engine does not "
                "keep: build it with jkv.Engine(..., attention_mass=True) (a float32 per stored "
                "token)"
            )
        if type(policy).rebuild is not KVPolicy.rebuild:
            raise ValueError(
                f"kv_policy={policy.name!r}: the segment rebuild runs on the one-shot path "
                f"(jkv.generate) only; the engine serves {SERVED}"
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
        output for every request that sampled a token (or finished, or failed) in it."""
        self._lock.acquire()
        try:
            self._deliver(self._drain())
            if not self.scheduler.has_work:
                return []
            plan = None
            try:
                plan = self.scheduler.schedule()
                return self._run_step(plan)
            except Exception as err:  # noqa: BLE001 - one failure fails one step
                return self._recover(plan, err)
        finally:
            self._release()

    def _run_step(self, plan) -> list[RequestOutput]:
        self._steps += 1
        now = time.monotonic()
        for r in plan.scheduled:
            if r.seq.first_scheduled is None:
                r.seq.first_scheduled = now
        self.rows.keep_only({s.request_id for s in self.scheduler.running})
        self._sync_rows()
        sampled: dict[str, int] = {}
        kept: dict[str, tuple] = {}  # what a policy keeps of prompts that end in this step
        flat, groups = [], {}  # rows with no policy this step; the others by the policy
        for r in plan.scheduled:
            key = self._policy_key(r)
            if key is None:
                flat.append(r)
                continue
            # One token per row (a decode step) unless a policy is still to compress the
            # prompt: that step must be a prompt step (SnapKV votes; a ring appends, not evicts)
            one = r.n == 1 and not (r.seq.compresses and not r.seq.compressed)
            groups.setdefault((one, key), []).append(r)
        if flat:
            sampled.update(self._run_flat(order(flat)))
        for (_, key), rows in groups.items():
            sampled.update(self._run(rows, key, kept))
        # before any frees: prefix-cache hits and pages held
        cached = {r.seq.request_id: r.seq.num_cached for r in plan.scheduled}
        held = {r.seq.request_id: r.seq.pages for r in plan.scheduled}
        finished = {s.request_id for s in self.scheduler.finish_step(plan, sampled)}
        for r in plan.scheduled:
            if r.seq.status is Status.RUNNING and r.seq.awaits_compression:
                self._compress(r.seq, *kept[r.seq.request_id])
        outs = []
        for r in plan.scheduled:
            rid = r.seq.request_id
            if rid not in sampled:
                continue
            row = self._rows[rid]
            tokens, text = row.take(r.seq, rid in finished)
            if row.stopped and rid not in finished:  # a stop string: the request ends here
                self.scheduler.finish(r.seq, "stop")  # (also if preempted in this step)
                finished.add(rid)
            reason = "stop" if row.stopped else r.seq.finish_reason
            outs.append(
                RequestOutput(
                    rid,
                    tokens,
                    rid in finished,
                    reason,
                    cached[rid],
                    text,
                    r.seq.first_scheduled,
                    held[rid],
                    r.seq.preemptions,
                )  # fmt: skip
            )
            if rid in finished:
                self._forget(rid)
        return outs

    def _sync_rows(self) -> None:
        """Tells the device the block rows the host changed since the last call."""
        ids, rows = self.pool.take_dirty()
        if ids:
            n = bucket(len(ids))
            pad_ids = np.full(n, self.pool.num_blocks, np.int32)
            pad_ids[: len(ids)] = ids
            pad_rows = np.zeros((n, self.scheduler.group), np.int32)
            pad_rows[: len(ids)] = rows
            self.device = set_rows(self.device, pad_ids, pad_rows)

    def _policy_key(self, r):
        """The policy a prefill chunk feeds: the request's, until its prompt is compressed."""
        policy = self._rows[r.seq.request_id].req.policy
        compressing = policy is not None and r.seq.prefilling and not r.seq.compressed
        # an evicting policy rotates keys and evicts in every step
        return policy.jit_key() if compressing or (policy and policy.evicts) else None

    def _sampling(self, scheduled, b: int):
        reqs = [self._rows[r.seq.request_id].req for r in scheduled]
        reqs += [reqs[0]] * (b - len(scheduled))  # padding rows sample and are ignored
        index = np.zeros((b,), np.int32)
        index[: len(scheduled)] = [len(r.seq.output) for r in scheduled]
        return SamplingArrays.build([q.sampling for q in reqs], [q.seed for q in reqs]), index

    def _run_flat(self, scheduled) -> dict[str, int]:
        """The rows that need no policy this step, in one flattened step over the pool."""
        rows, tokens, positions = pack_ragged(
            scheduled, self.rows, self.scheduler.group, self.pool.page_size
        )
        sampling, index = self._sampling(scheduled, len(rows.q_len))
        tok, self.device = ragged_step(
            self.params.weights, self.params.config, self.device, rows, tokens, positions,
            sampling, index, backend=self.backend, dtype=self.kv_dtype,
        )  # fmt: skip
        tok = np.asarray(tok)
        return {r.seq.request_id: int(tok[i]) for i, r in enumerate(scheduled) if r.samples}

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
            counts = np.asarray(counts)
            for i in ending:
                kept[scheduled[i].seq.request_id] = (src, i, counts[i].reshape(-1).tolist())
        tok = np.asarray(tok)
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
            out[i] = np.asarray(_sensitivity(self.params.weights, cfg, tokens, n))[0]
        return out

    def _compress(self, seq, src, row, counts) -> None:
        """The policy's selection made physical: each head's kept tokens move into the fewest
        pages (`Scheduler.compress`), the rest go back to the pool."""
        if self.scheduler.compress_or_preempt(seq, counts) is None:
            return  # preempted for lack of pages: recomputed later
        self._sync_rows()
        table = np.zeros(self.rows.width, np.int32)
        table[: len(seq.blocks)] = seq.blocks
        g = self.scheduler.group
        self.device = compact(self.device, src[row].reshape(g, -1), table,
                              np.asarray(counts, np.int32))  # fmt: skip

    # ------------------------------------------------------------------ failures

    def _recover(self, plan, err: Exception) -> list[RequestOutput]:
        """After a step raised: its requests (every running one if scheduling itself failed)
        fail, and the engine is made whole for the next: a pool whose buffers were donated is
        re-created (cached blocks forgotten, running requests recompute), books that no longer
        add up are rebuilt. If that fails too, the engine is unhealthy."""
        self.failures += 1
        message = f"{type(err).__name__}: {err}"
        seqs = [r.seq for r in plan.scheduled] if plan is not None else list(self.scheduler.running)
        outs = []
        for seq in seqs:
            if seq.request_id not in self.scheduler.by_id:
                continue  # finished or aborted before the failure
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

    # ------------------------------------------------------------------ the rest

    def warmup(self, kv_policies=()) -> float:
        """Compiles every step shape a request can need, so that no request compiles later:
        the flattened step at every (rows, tokens) bucket (rows: powers of two up to
        max_running; tokens: up to the token budget's); for each of `kv_policies` (names or
        `jkv.policies.KVPolicy` objects; budgets do not matter, they are data) the gathering
        step (rows; new tokens 1 or the chunk; blocks per row: powers of two up to
        max_model_len's) and every compaction; every block-row update size. Returns the
        seconds it took."""
        t0 = time.perf_counter()
        cfg = self.params.config
        g = self.scheduler.group
        rows = [1 << i for i in range(bucket(self.scheduler.max_running).bit_length())]
        widths = [1 << i for i in range(bucket(self.rows.width).bit_length())]
        keys = []  # the full cache runs the flattened step only
        for p in kv_policies:
            policy = resolve(p, None) if isinstance(p, str) else p
            self._check_policy(policy)
            keys.append(policy.jit_key())
        probe = Request.build(self.params)
        z = lambda *shape: np.zeros(shape, np.int32)  # noqa: E731
        for key, b, t, m in itertools.product(keys, rows, (1, self.scheduler.chunk), widths):
            sampling = SamplingArrays.build([probe.sampling] * b, [probe.seed] * b)
            sens = None
            if key.needs_sensitivity:
                sens = np.zeros((b, cfg.num_layers, cfg.num_kv_heads), np.float32)
            idle = Rows(z(b, m), z(b, g), z(b), z(b), np.zeros(b, bool))
            tok, writes, kept, mass = paged_step(
                self.params.weights, cfg, self.device, idle, z(b, t), z(b), z(b), sampling,
                z(b), z(b), z(b), sens, backend=self.backend, dtype=self.kv_dtype, policy=key,
            )  # fmt: skip
            self.device = write_pages(self.device, writes)  # nothing written: n_new is 0
            if mass is not None:
                self.device = write_mass(self.device, *mass)
            if b == 1:  # one compaction program per dense size
                self.device = compact(self.device, kept[0][0].reshape(g, -1),
                                      z(self.rows.width), z(g))  # fmt: skip
            tok.block_until_ready()
        self._warm_flat(rows)
        for n in (1 << i for i in range(bucket(self.pool.num_blocks).bit_length())):
            ids = np.full(n, self.pool.num_blocks, np.int32)  # every row dropped
            self.device = set_rows(self.device, ids, z(n, g))
        if any(k.needs_sensitivity for k in keys):  # every prompt bucket
            top = kvlib.bucket(self.max_model_len)
            for n in sorted({kvlib.bucket(1 << i) for i in range(top.bit_length())}):
                x = np.zeros((1, n), np.int32)
                _sensitivity(self.params.weights, cfg, x, np.ones(1, np.int32)).block_until_ready()
        jax.block_until_ready(self.device)
        return time.perf_counter() - t0

    def _warm_flat(self, rows) -> None:
        """The flattened step at every (rows, tokens) bucket a step can have: tokens from the
        rows' count (one each) to the token budget's bucket."""
        cfg, g = self.params.config, self.scheduler.group
        probe = Request.build(self.params)
        most = bucket(self.scheduler.token_budget)
        for b in rows:
            for t in (1 << i for i in range(b.bit_length() - 1, most.bit_length())):
                z = lambda *shape: np.zeros(shape, np.int32)  # noqa: E731
                idle = PagedRows(z(b, self.rows.width), z(b, g), z(b), z(b), z(b), z(b),
                                 np.full(t, b, np.int32), z(t), np.int32(0), np.int32(0))  # fmt: skip
                sampling = SamplingArrays.build([probe.sampling] * b, [probe.seed] * b)
                tok, self.device = ragged_step(
                    self.params.weights, cfg, self.device, idle, z(t), z(t), sampling, z(b),
                    backend=self.backend, dtype=self.kv_dtype,
                )  # fmt: skip
                tok.block_until_ready()

    def stats(self) -> dict:
        """Counters for monitoring (read without waiting for a step): pages (total usable,
        used by requests, free, cached and idle) and the share in use, the pool's device bytes
        and bytes per page, prefix-cache lookups and hits (blocks) and hit rate, pages recycled
        (lazily, by the watermark), preemptions, requests running and waiting, steps, failed
        steps and health."""
        pool, s = self.pool, self.pool.stats
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
            running=len(self.scheduler.running),
            waiting=len(self.scheduler.waiting) + len(self._inbox),
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


_sensitivity = jax.jit(head_sensitivity, static_argnames=("config",))
