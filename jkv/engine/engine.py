"""`jkv.Engine`: requests come and go while others decode, sharing one paged KV pool.

    engine = jkv.Engine(params, num_pages=2048, page_size=16)
    rid = engine.add_request("The capital of France is", max_new_tokens=16)
    while engine.has_work:
        for out in engine.step():        # one model step for every scheduled request
            print(out.request_id, out.new_tokens, out.finished)

The scheduler (plain Python) decides which tokens run; the runner gathers their pages, runs THE
model step and samples. Per-request settings (sampling values, seed, max_new_tokens, stop
strings) are per-row data: requests with different settings share a step.

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

import asyncio
import dataclasses
import functools
import itertools
import threading
import time

import jax
import numpy as np

from jkv import kv as kvlib
from jkv.core.sampling import SamplingArrays
from jkv.engine.page_pool import PagePool
from jkv.engine.runner import (
    bucket,
    compaction_moves,
    copy_slots,
    empty_pool,
    pack,
    paged_step,
    pool_bytes,
    write_mass,
    write_pages,
)
from jkv.engine.scheduler import Scheduler
from jkv.engine.sequence import Sequence, Status
from jkv.limits import available_bytes
from jkv.output import RowOutput
from jkv.params import Params
from jkv.policies import resolve
from jkv.policies.base import KVPolicy
from jkv.policies.efficache import head_sensitivity
from jkv.prompt import prompt_ids
from jkv.request import Request

SERVED = "snapkv, pyramidkv, adakv, efficache, quantile, streaming, h2o"


@dataclasses.dataclass
class RequestOutput:
    """What one step did for one request."""

    request_id: str
    new_tokens: list[int]
    finished: bool
    finish_reason: str | None  # "stop" (eos or a stop string), "length" or None while running
    cached_tokens: int  # prompt tokens taken from the prefix cache
    text: str = ""  # new text no later token can change (all of the rest once finished)
    scheduled_at: float | None = None  # time.monotonic() when a step first ran its prompt
    pages: int = 0  # pages it held in this step (all heads)
    preemptions: int = 0  # times it was preempted (its pages freed, its tokens recomputed)


class _Row:
    """One request's text and stop strings, and how much of both was handed out."""

    def __init__(self, out: RowOutput | None):
        self.out = out
        self.tokens = 0  # tokens handed out
        self.chars = 0  # characters of text handed out

    @property
    def stopped(self) -> bool:
        return self.out is not None and self.out.hit is not None

    def take(self, new: list[int], seq, final: bool) -> tuple[list[int], str]:
        """The new tokens (none past a stop string) and the new settled text."""
        if self.out is None:
            self.tokens += len(new)
            return new, ""
        self.out.push(new)
        upto = self.out.hit[1] if self.out.hit is not None else len(seq.output)
        tokens = seq.output[self.tokens : upto]
        self.tokens = max(self.tokens, upto)
        text = self.out.text if final or self.stopped else self.out.settled()
        delta, self.chars = text[self.chars :], max(self.chars, len(text))
        return tokens, delta


def _locked(method):
    @functools.wraps(method)
    def run(self, *args, **kwargs):
        with self._lock:
            return method(self, *args, **kwargs)

    return run


class Engine:
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
        self.pool = PagePool(
            num_pages,
            page_size,
            cfg.num_layers * cfg.num_kv_heads,
            recycle=recycle,
            recycle_below=recycle_below,
            admission_headroom=admission_headroom,
        )
        self.scheduler = Scheduler(
            self.pool,
            num_layers=cfg.num_layers,
            num_kv_heads=cfg.num_kv_heads,
            token_budget=token_budget,
            chunk=chunk,
            max_running=max_running,
            admission=admission,
        )
        self.device = empty_pool(cfg, num_pages, page_size, self.kv_dtype, self.attention_mass)
        self.eos_ids = tuple(sorted(set(cfg.eos_token_ids)))
        self._requests: dict[str, Request] = {}
        self._rows: dict[str, _Row] = {}
        self._ids = itertools.count()
        self._lock = threading.RLock()  # add_request / abort / step: one at a time
        self._queues: dict[str, asyncio.Queue] = {}  # request id -> its stream's outputs
        self._driver: asyncio.Task | None = None
        self._steps = 0

    @property
    def has_work(self) -> bool:
        return self.scheduler.has_work

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
        per_page = pool_bytes(self.params.config, 1, page_size, self.kv_dtype, self.attention_mass)
        pages = int(free * fraction) // per_page
        if pages < 2:
            raise ValueError(
                f"memory_fraction={fraction}: {free * fraction / 2**20:.1f} MiB holds {pages} "
                f"pages of {per_page} bytes; at least 2 are needed"
            )
        return pages

    @_locked
    def add_request(self, prompt, *, request_id: str | None = None, cache_salt=None, **settings):
        """Queues a prompt (text, UTF-8 bytes or token ids) with `jkv.generate`'s settings;
        `cache_salt` keeps a tenant's prefix-cache pages its own. Returns the request id.

        Raises:
          ValueError: a bad setting, a prompt past the model's context, one that could never
            fit in the pool, or a setting the engine does not serve yet (kv_policy).
        """
        req = Request.build(self.params, **settings)
        self._check_policy(req.policy)
        if req.stop and self.params.tokenizer is None:
            raise ValueError(f"stop={req.stop!r}: stop strings need a model with a tokenizer")
        if req.kv_dtype not in (None, self.kv_dtype) or req.backend != self.backend:
            raise ValueError(
                f"kv_dtype={req.kv_dtype!r} backend={req.backend!r}: the engine's are "
                f"{self.kv_dtype!r} and {self.backend!r}, one per engine"
            )
        ids = prompt_ids(self.params, prompt, None)
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
        rid = str(next(self._ids)) if request_id is None else request_id
        if not isinstance(rid, str) or not rid:
            raise ValueError(f"request_id={request_id!r}: expected a non-empty str")
        seq = Sequence(
            rid,
            ids,
            req.max_new_tokens,
            arrival=0,
            eos_ids=self.eos_ids,
            extra_keys=(self.params.version, self.kv_dtype, cache_salt),
        )
        if req.policy is not None:
            layers, kept = self.params.config.num_layers, req.policy.budget_tokens(len(ids))
            most = max(req.policy.layer_budget(i, layers, kept) for i in range(layers))
            seq.compresses, seq.window = True, getattr(req.policy, "window", 0)
            seq.keep = min(len(ids), most) + req.max_new_tokens
            if req.policy.evicts:  # a ring of `limit` slots per head once the prompt is in
                seq.limit = req.policy.row_limit(len(ids))
                seq.keep = min(seq.limit, len(ids) + req.max_new_tokens)
            # Attention mass is this request's own, from its own queries: its pages are neither
            # taken from the prefix cache nor given to it.
            seq.cacheable = not req.policy.wants_mass
        self.scheduler.add(seq)
        self._requests[rid] = req
        tok = self.params.tokenizer
        self._rows[rid] = _Row(RowOutput(tok, req.stop) if tok is not None else None)
        return rid

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

    @_locked
    def abort(self, request_id: str) -> bool:
        """Stops a request; its pages go back to the pool. False if it is not in the engine."""
        self._requests.pop(request_id, None)
        self._rows.pop(request_id, None)
        found = self.scheduler.abort(request_id) is not None
        queue = self._queues.get(request_id)
        if found and queue is not None:  # its stream ends
            queue.put_nowait(RequestOutput(request_id, [], True, "abort", 0))
        return found

    @_locked
    def step(self) -> list[RequestOutput]:
        """Runs one scheduled model step. Returns an output for every request that sampled a
        token (or finished) in it."""
        plan = self.scheduler.schedule()
        self._steps += 1
        now = time.monotonic()
        for r in plan.scheduled:
            if r.seq.first_scheduled is None:
                r.seq.first_scheduled = now
        sampled: dict[str, int] = {}
        kept: dict[str, tuple] = {}  # what a policy keeps of prompts that end in this step
        groups: dict[object, list] = {}  # decodes, then prefill chunks by the policy they feed
        for r in plan.scheduled:
            key = self._policy_key(r)
            # One token per row (a decode step) unless a policy is still to compress the
            # prompt: that step must be a prompt step (SnapKV votes; a ring appends, not evicts)
            one = r.n == 1 and not (r.seq.compresses and not r.seq.compressed)
            groups.setdefault((one, key), []).append(r)
        for (_, key), rows in groups.items():
            sampled.update(self._run(rows, key, kept))
        # before any frees: prefix-cache hits and pages held
        cached = {r.seq.request_id: r.seq.num_cached for r in plan.scheduled}
        held = {r.seq.request_id: len(r.seq.pages()) for r in plan.scheduled}
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
            tokens, text = row.take([sampled[rid]], r.seq, rid in finished)
            if row.stopped and rid not in finished:  # a stop string: the request ends here
                self.scheduler.finish(r.seq, "stop")
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
                self._requests.pop(rid, None)
                self._rows.pop(rid, None)
        return outs

    def _policy_key(self, r):
        """The policy a prefill chunk feeds: the request's, until its prompt is compressed."""
        policy = self._requests[r.seq.request_id].policy
        compressing = policy is not None and r.seq.prefilling and not r.seq.compressed
        # an evicting policy rotates keys and evicts in every step
        return policy.jit_key() if compressing or (policy and policy.evicts) else None

    def _run(self, rows, policy, kept) -> dict[str, int]:
        cfg = self.params.config
        tables, held, tokens, n_new, start = pack(
            rows, cfg.num_layers, cfg.num_kv_heads, self.pool.page_size, self.scheduler.chunk
        )
        b = len(n_new)
        reqs = [self._requests[r.seq.request_id] for r in rows]
        budgets = np.zeros((b,), np.int32)
        limits = np.full((b,), kvlib.NO_LIMIT, np.int32)
        limits[: len(rows)] = [kvlib.NO_LIMIT if r.seq.limit is None else r.seq.limit for r in rows]
        ending = [i for i, r in enumerate(rows) if r.start + r.n == len(r.seq.prompt)]
        sensitivity = None
        if policy is not None:
            budgets[: len(rows)] = [
                q.policy.budget_tokens(len(r.seq.prompt)) for q, r in zip(reqs, rows, strict=True)
            ]
            if policy.needs_sensitivity:
                sensitivity = self._sensitivity(rows, ending, b)
        reqs += [reqs[0]] * (b - len(rows))  # padding rows sample and are ignored
        sampling = SamplingArrays.build([q.sampling for q in reqs], [q.seed for q in reqs])
        index = np.zeros((b,), np.int32)
        index[: len(rows)] = [len(r.seq.output) for r in rows]
        tok, writes, selection, mass = paged_step(
            self.params.weights, cfg, self.device, tables, held, tokens, n_new, start, sampling,
            index, budgets, limits, sensitivity, backend=self.backend, dtype=self.kv_dtype,
            policy=policy,
        )  # fmt: skip
        self.device = write_pages(self.device, writes)
        if mass is not None:
            self.device = write_mass(self.device, tables, *mass)
        if selection is not None and ending:
            order, counts = (np.asarray(x) for x in selection)
            for i in ending:
                kept[rows[i].seq.request_id] = (order[i], counts[i].reshape(-1).tolist())
        tok = np.asarray(tok)
        return {r.seq.request_id: int(tok[i]) for i, r in enumerate(rows) if r.samples}

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

    def _compress(self, seq, order, counts) -> None:
        """The policy's selection made physical: each head's kept tokens move into the fewest
        pages (`Scheduler.compress`), the rest go back to the pool."""
        moves = self.scheduler.compress_or_preempt(seq, counts)
        if moves is None:
            return  # preempted for lack of pages: recomputed later
        arrays = compaction_moves(
            moves, counts, order, self.pool.page_size, self.params.config.num_kv_heads,
            self.pool.num_pages,
        )  # fmt: skip
        self.device = copy_slots(self.device, arrays)

    def warmup(self, kv_policies=()) -> float:
        """Compiles every step shape a request can need (rows: powers of two up to
        max_running; new tokens: 1 or the chunk; pages per head: powers of two up to
        max_model_len's), for the full cache and for each of `kv_policies` (names or
        `jkv.policies.KVPolicy` objects; budgets do not matter, they are data), and every
        compaction size, so that no request compiles later. Returns the seconds it took."""
        t0 = time.perf_counter()
        cfg = self.params.config
        page = self.pool.page_size
        rows = [1 << i for i in range(bucket(self.scheduler.max_running).bit_length())]
        pages = [1 << i for i in range(bucket(-(-self.max_model_len // page)).bit_length())]
        keys = [None]
        for p in kv_policies:
            policy = resolve(p, None) if isinstance(p, str) else p
            self._check_policy(policy)
            keys.append(policy.jit_key())
        probe = self._requests_probe()
        heads = (cfg.num_layers, cfg.num_kv_heads)
        for key, b, t, m in itertools.product(keys, rows, (1, self.scheduler.chunk), pages):
            z = lambda *shape: np.zeros(shape, np.int32)  # noqa: E731
            sampling = SamplingArrays.build([probe.sampling] * b, [probe.seed] * b)
            sens = None
            if key is not None and key.needs_sensitivity:
                sens = np.zeros((b, *heads), np.float32)
            tok, writes, _, mass = paged_step(
                self.params.weights, cfg, self.device, z(b, *heads, m), z(b, *heads), z(b, t),
                z(b), z(b), sampling, z(b), z(b), z(b), sens, backend=self.backend,
                dtype=self.kv_dtype, policy=key,
            )  # fmt: skip
            self.device = write_pages(self.device, writes)  # nothing written: n_new is 0
            if mass is not None:
                self.device = write_mass(self.device, z(b, *heads, m), *mass)
            tok.block_until_ready()
        if any(k is not None and k.needs_sensitivity for k in keys):  # every prompt bucket
            top = kvlib.bucket(self.max_model_len)
            for n in sorted({kvlib.bucket(1 << i) for i in range(top.bit_length())}):
                z = np.zeros((1, n), np.int32)
                _sensitivity(self.params.weights, cfg, z, np.ones(1, np.int32)).block_until_ready()
        if len(keys) > 1:  # compactions move up to every token of a request's heads
            most = bucket(cfg.num_layers * cfg.num_kv_heads * self.max_model_len)
            for n in (1 << i for i in range(most.bit_length())):
                idle = np.zeros(n, np.int32), np.full(n, self.pool.num_pages, np.int32)
                arrays = (idle[0], idle[0], idle[0], idle[1], idle[0])  # every write dropped
                self.device = copy_slots(self.device, arrays)
        jax.block_until_ready(self.device)
        return time.perf_counter() - t0

    def _requests_probe(self) -> Request:
        return Request.build(self.params)

    @_locked
    def stats(self) -> dict:
        """Counters for monitoring: pages (total usable, used by requests, free, cached and
        idle), the share in use, prefix-cache lookups and hits (blocks) and hit rate, pages
        recycled (lazily, by the watermark), preemptions, requests running and waiting, steps."""
        pool, s = self.pool, self.pool.stats
        return dict(
            pages_total=pool.usable,
            pages_used=pool.used_pages,
            pages_free=pool.free_pages - pool.cached_idle_pages,
            pages_cached_idle=pool.cached_idle_pages,
            usage=pool.usage,
            prefix_queries=s.prefix_queries,
            prefix_hits=s.prefix_hits,
            prefix_hit_rate=s.prefix_hits / s.prefix_queries if s.prefix_queries else 0.0,
            recycled_lazy=s.recycled_lazy,
            recycled_watermark=s.recycled_watermark,
            preemptions=self.scheduler.num_preemptions,
            running=len(self.scheduler.running),
            waiting=len(self.scheduler.waiting),
            steps=self._steps,
        )

    async def stream(self, prompt, **settings):
        """Adds a request and yields its `RequestOutput`s as the engine steps, for asyncio
        callers: many streams share the engine's steps, which run in a worker thread so the
        event loop stays free. Leaving the iteration early aborts the request (its pages go
        back once a running step ends: the abort waits for it in a worker thread, not on the
        loop). Takes `add_request`'s arguments; the request is added in a worker thread too
        (it waits for a running step)."""
        rid = settings.pop("request_id", None)
        rid = f"stream-{next(self._ids)}" if rid is None else rid
        queue = self._queues[rid] = asyncio.Queue()  # before the request: no output is missed
        try:
            await asyncio.to_thread(self.add_request, prompt, request_id=rid, **settings)
        except BaseException:
            self._queues.pop(rid, None)
            raise
        if self._driver is None or self._driver.done():
            self._driver = asyncio.get_running_loop().create_task(self._drive())
        finished = False
        try:
            while not finished:
                out = await queue.get()
                if isinstance(out, BaseException):
                    raise out
                finished = out.finished
                yield out
        finally:
            self._queues.pop(rid, None)
            if not finished:  # off the loop: abort waits for a running step's lock
                try:
                    asyncio.get_running_loop().run_in_executor(None, self.abort, rid)
                except RuntimeError:  # no running loop, or its executor is shut down
                    self.abort(rid)

    async def _drive(self) -> None:
        """Steps the engine while streams wait, handing each output to its stream's queue."""
        try:
            while self._queues and self.has_work:
                for out in await asyncio.to_thread(self.step):
                    queue = self._queues.get(out.request_id)
                    if queue is not None:
                        queue.put_nowait(out)
        except Exception as err:  # every waiting stream learns of it, none hangs
            for queue in self._queues.values():
                queue.put_nowait(err)
            raise

    def generate(self, prompts, **settings) -> list[list[int]]:
        """Every prompt through the engine at once; each one's generated token ids, in order."""
        rids = [self.add_request(p, **settings) for p in prompts]
        got: dict[str, list[int]] = {rid: [] for rid in rids}
        while self.has_work:
            for out in self.step():
                if out.request_id in got:
                    got[out.request_id] += out.new_tokens
        return [got[rid] for rid in rids]


_sensitivity = jax.jit(head_sensitivity, static_argnames=("config",))
