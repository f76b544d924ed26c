"""A failed step fails its requests and nothing else: failures injected before the model call,
after the donated page write, inside the compaction and inside the host's bookkeeping each
leave a valid pool and an engine whose next requests give generate's tokens; one it cannot
recover from makes it unhealthy. Adds and aborts are messages: they never wait for a step, and
streams that leave at any moment leave nothing behind."""

from __future__ import annotations

import asyncio
import random
import threading

import pytest

import jkv
from jkv.engine import ahead, policy_steps
from jkv.engine import engine as engine_module
from jkv.engine.engine import Engine, RequestFailed
from jkv.engine.page_pool import PagePool
from jkv.engine.scheduler import Scheduler
from jkv.engine.sequence import Sequence, Status


@pytest.fixture(scope="module")
def demo(tiny_params):
    return tiny_params("llama")


@pytest.fixture(scope="module")
def prompts(demo):
    rng = random.Random(21)
    return [[rng.randrange(3, demo.config.vocab_size) for _ in range(rng.randint(9, 30))]
            for _ in range(4)]  # fmt: skip


@pytest.fixture(scope="module")
def engine(demo):
    return Engine(demo, num_pages=160, page_size=8, token_budget=64, chunk=32, max_running=4)


def alone(params, ids, **settings):
    return list(jkv.generate(params, ids, **settings).tokens)


def run(engine, prompts, **settings):
    """Adds the prompts, steps to the end; (tokens, finish reason, error) per request."""
    rids = [engine.add_request(p, **settings) for p in prompts]
    got = {rid: ([], None, None) for rid in rids}
    while engine.has_work:
        for out in engine.step():
            toks, _, _ = got[out.request_id]
            got[out.request_id] = (toks + out.new_tokens, out.finish_reason, out.error)
    return [got[rid] for rid in rids]


def once(real, after: bool):
    """`real`, raising once: before calling it, or after (its donated input already gone)."""
    state = {"armed": True}

    def wrapper(*args, **kwargs):
        if state["armed"] and not after:
            state["armed"] = False
            raise RuntimeError("injected")
        out = real(*args, **kwargs)
        if state["armed"]:
            state["armed"] = False
            raise RuntimeError("injected")
        return out

    return wrapper


def fail_then_recover(engine, demo, prompts, monkeypatch, target, after, **settings):
    monkeypatch.setattr(*target(once(getattr(*target(None)[:2]), after)))
    results = run(engine, prompts[:2], max_new_tokens=5, **settings)
    monkeypatch.undo()
    assert [r[1] for r in results] == ["error", "error"]
    assert all("injected" in r[2] for r in results)
    engine.pool.check()
    assert engine.pool.used_pages == 0 and not engine.scheduler.running
    again = run(engine, prompts[2:], max_new_tokens=5, **settings)  # the next ones succeed
    assert [t for t, _, _ in again] == [alone(demo, p, max_new_tokens=5, **settings)
                                        for p in prompts[2:]]  # fmt: skip
    assert engine.healthy


@pytest.mark.parametrize(
    "where, after",
    # before the model call; after the step that donated the pool (its buffers gone); inside
    # the host's books; reading back a step dispatched ahead (async scheduling: the step after
    # it is on the device already)
    [("ragged_step", False), ("ragged_step", True), ("finish_step", True), ("read", False)],
)
def test_a_failed_step_fails_its_requests_and_the_next_ones_succeed(
    engine, demo, prompts, monkeypatch, where, after
):
    failures = engine.failures

    def target(fn):
        if where == "finish_step":
            return (engine.scheduler, "finish_step", fn)
        if where == "read":  # of a step dispatched ahead (`jkv.engine.lockstep.read`)
            return (ahead, "read", fn)
        return (engine_module, where, fn)

    fail_then_recover(engine, demo, prompts, monkeypatch, target, after)
    assert engine.failures == failures + 1


@pytest.mark.parametrize(
    "where, policy",
    [("paged_select", jkv.SnapKV(budget=8, window=4)), ("compact", jkv.SnapKV(budget=8, window=4)),
     ("compact", jkv.StreamingLLM(budget=12, sink=2))],
    ids=["selection", "compaction", "ring-compaction"],
)  # fmt: skip
def test_a_failed_policy_step_or_compaction_leaves_a_valid_pool(
    engine, demo, prompts, monkeypatch, where, policy
):
    """A compressing request's selection over the pool (after the flattened step donated the
    pool) or its compaction (a StreamingLLM ring's too) raises after donating it."""

    def target(fn):
        return (policy_steps, where, fn)

    fail_then_recover(engine, demo, prompts, monkeypatch, target, True, kv_policy=policy)


def test_a_lost_pool_drops_the_prefix_cache(demo, prompts, monkeypatch):
    """The donated pool is lost while a request's prompt blocks are cached: the cache forgets
    them (their bytes are gone), and the same prompt later recomputes to generate's tokens."""
    engine = Engine(demo, num_pages=160, page_size=8, token_budget=64, chunk=32)
    long = prompts[0] * 2
    run(engine, [long], max_new_tokens=3)  # publishes its blocks
    assert engine.pool.cached_idle_pages > 0
    monkeypatch.setattr(engine_module, "ragged_step", once(engine_module.ragged_step, True))
    assert run(engine, [prompts[1]], max_new_tokens=3)[0][1] == "error"
    monkeypatch.undo()
    assert engine.pool.cached_idle_pages == 0
    (toks, reason, _), = run(engine, [long], max_new_tokens=3)  # fmt: skip
    assert reason == "length" and toks == alone(demo, long, max_new_tokens=3)


def test_an_unrecoverable_failure_makes_the_engine_unhealthy(demo, prompts, monkeypatch):
    engine = Engine(demo, num_pages=160, page_size=8, token_budget=64, chunk=32)
    monkeypatch.setattr(engine_module, "ragged_step", once(engine_module.ragged_step, True))

    def broken(lost):
        raise OSError("no device")

    monkeypatch.setattr(engine, "_rebuild", broken)
    assert run(engine, prompts[:1], max_new_tokens=3)[0][1] == "error"
    assert not engine.healthy and "no device" in engine.health_error
    assert engine.stats()["healthy"] is False
    with pytest.raises(RuntimeError, match="unhealthy"):
        engine.add_request(prompts[1])


def test_a_stream_whose_step_fails_raises_and_others_go_on(engine, demo, prompts, monkeypatch):
    monkeypatch.setattr(engine_module, "ragged_step", once(engine_module.ragged_step, False))

    async def one(prompt):
        return [t async for out in engine.stream(prompt, max_new_tokens=4) for t in out.new_tokens]

    async def main():
        with pytest.raises(RequestFailed, match="injected"):
            await one(prompts[0])
        return await one(prompts[1])

    assert asyncio.run(main()) == alone(demo, prompts[1], max_new_tokens=4)


def test_a_request_preempted_in_the_step_its_stop_string_ends_it_finishes():
    """The scheduler ends a sequence preempted since its token was sampled (a stop string
    found after another's compaction took its pages): it leaves the waiting queue."""
    pool = PagePool(64, 4, 4)
    sched = Scheduler(pool, num_layers=2, num_kv_heads=2, token_budget=64, chunk=64)
    sched.add(Sequence("a", [1, 2, 3, 4, 5], 8, arrival=0))
    sched.add(Sequence("b", [6, 7, 8], 8, arrival=0))
    plan = sched.schedule()
    sched.finish_step(plan, {"a": 9, "b": 9})
    b = sched.by_id["b"]
    sched._preempt(b)  # as a compression short of pages does
    assert b.status is Status.WAITING
    sched.finish(b, "stop")
    assert b.status is Status.FINISHED and b not in sched.waiting and "b" not in sched.by_id
    assert pool.used_pages == 2 * 4  # a's 6 tokens: 2 blocks
    pool.check()


def test_the_engine_finishes_a_request_preempted_as_its_stop_string_arrives(
    demo, prompts, monkeypatch
):
    """End to end: request b's first token is its stop string, sampled in the step where a's
    SnapKV compression preempts it (the pool short of pages, forced here)."""
    prompt = next(p for p in prompts if jkv.generate(demo, p, max_new_tokens=1).text.strip())
    stop = jkv.generate(demo, prompt, max_new_tokens=1).text.strip()
    engine = Engine(demo, num_pages=160, page_size=8, token_budget=128, chunk=64)
    a = engine.add_request(
        prompts[0] * 2, max_new_tokens=4, kv_policy=jkv.SnapKV(budget=8, window=4)
    )
    b = engine.add_request(prompt, max_new_tokens=4, stop=stop)
    real = engine.scheduler.compress_or_preempt

    def short_of_pages(seq, kept):
        victim = engine.scheduler.by_id[b]
        if victim.status is Status.RUNNING:
            engine.scheduler._preempt(victim)
        return real(seq, kept)

    monkeypatch.setattr(engine.scheduler, "compress_or_preempt", short_of_pages)
    outs = {}
    while engine.has_work:
        for out in engine.step():
            outs.setdefault(out.request_id, []).append(out)
    assert outs[b][-1].finish_reason == "stop" and outs[b][-1].finished
    assert outs[a][-1].finish_reason == "length"
    assert engine.pool.used_pages == 0 and not engine.has_work


def test_adds_and_aborts_never_wait_for_a_step(engine, prompts):
    """With a step holding the engine (its lock held by this thread), another thread's add
    and abort return; the next step takes both in."""
    done = threading.Event()
    got = {}

    def other():
        got["rid"] = engine.add_request(prompts[0], max_new_tokens=3)
        got["abort"] = engine.abort(got["rid"])
        done.set()

    with engine._lock:
        t = threading.Thread(target=other)
        t.start()
        assert done.wait(30), "add_request or abort waited for the step"
        assert engine.has_work and not engine.scheduler.has_work  # queued, not taken in
    t.join()
    assert got["abort"] is True
    assert engine.step() == [] and not engine.has_work and engine.pool.used_pages == 0


def test_streams_that_leave_at_any_moment_leave_nothing(engine, demo, prompts):
    """40 streams of 200 tokens cancelled 0-50 ms after they start (before, during or after
    their first output): within a few steps nothing runs or waits (left running, they would
    take hundreds), the pool is back at its baseline, and the next request gives generate's
    tokens."""
    baseline = engine.pool.used_pages
    rng = random.Random(3)

    async def drain(agen):
        async for _ in agen:
            pass

    async def main():
        tasks = []
        for i in range(40):
            task = asyncio.ensure_future(drain(engine.stream(prompts[i % 4], max_new_tokens=200)))
            tasks.append(task)
            await asyncio.sleep(0)
            asyncio.get_running_loop().call_later(rng.uniform(0, 0.05), task.cancel)
        await asyncio.gather(*tasks, return_exceptions=True)
        steps = engine.stats()["steps"]
        while engine.has_work:  # the driver takes the aborts in
            await asyncio.sleep(0.01)
        after = engine.stats()["steps"] - steps
        toks = [t async for out in engine.stream(prompts[1], max_new_tokens=4)
                for t in out.new_tokens]  # fmt: skip
        return after, toks

    after, toks = asyncio.run(main())
    assert after <= 3, f"{after} steps ran after every client had left"
    assert not engine.scheduler.running and not engine.scheduler.waiting
    assert engine.pool.used_pages == baseline
    assert toks == alone(demo, prompts[1], max_new_tokens=4)
