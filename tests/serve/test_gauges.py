"""`/metrics`' request gauges while a step holds the engine (one compiling a new shape can hold
it for a minute): a request whose client left counts neither as running nor as waiting, and
its abort is taken in as soon as the step ends, with no other request to wake the engine."""

from __future__ import annotations

import asyncio
import re
import time

import httpx
from server_harness import small_engine

from jkv.serve.server import Server

BODY = {"model": "jkv-demo", "prompt": "The code for Mara is", "max_tokens": 200,
        "temperature": 0.8, "seed": 1, "stream": True}  # fmt: skip


def gauges(url: str) -> tuple[float, float]:
    text = httpx.get(url + "/metrics", timeout=60).text
    found = dict(re.findall(r"^jkv:num_requests_(running|waiting)\{[^}]*\} (\S+)", text, re.M))
    return float(found["running"]), float(found["waiting"])


def wait_until(done, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while not done() and time.monotonic() < deadline:
        time.sleep(0.02)


def test_clients_that_leave_during_a_step_are_not_counted(demo_params, serve):
    engine = small_engine(demo_params)
    running = serve(Server(demo_params, engine, response_cache=None))
    baseline = engine.stats()["pages_used"]

    async def cut_before_the_first_token(client):
        try:
            async with client.stream("POST", running.url + "/v1/completions", json=BODY,
                                     timeout=0.3) as r:  # fmt: skip
                async for _ in r.aiter_lines():
                    pass
        except httpx.TimeoutException:
            pass

    async def cut_after_two_chunks(client, reading: asyncio.Event, leave: asyncio.Event):
        async with client.stream("POST", running.url + "/v1/completions", json=BODY) as r:
            got = 0
            async for line in r.aiter_lines():
                got += line.startswith("data: ")
                if got == 2:
                    reading.set()
                    await leave.wait()
                    return

    # 8 requests added and abandoned while a step holds the engine: their adds and aborts wait
    # in its inbox together
    engine._lock.acquire()  # a step in progress
    try:

        async def early():
            async with httpx.AsyncClient() as client:
                await asyncio.gather(*[cut_before_the_first_token(client) for _ in range(8)])

        asyncio.run(early())
        wait_until(lambda: not running.server.in_flight, timeout=10)
        assert running.server.in_flight == 0 and len(engine._inbox) == 16
        stats = engine.stats()
        assert (stats["running"], stats["waiting"]) == (0, 0)
        assert gauges(running.url) == (0, 0)
    finally:
        engine._lock.release()
    wait_until(lambda: not engine.has_work, timeout=20)
    assert not engine.has_work and engine.stats()["pages_used"] == baseline

    # 4 requests running (max_running) whose clients leave while the next step holds the engine
    async def mid():
        async with httpx.AsyncClient(timeout=60) as client:
            reading, leave = [asyncio.Event() for _ in range(4)], asyncio.Event()
            tasks = [asyncio.create_task(cut_after_two_chunks(client, r, leave)) for r in reading]
            await asyncio.gather(*[r.wait() for r in reading])
            await asyncio.to_thread(engine._lock.acquire)
            leave.set()
            await asyncio.gather(*tasks)

    try:
        asyncio.run(mid())
        wait_until(lambda: not running.server.in_flight, timeout=10)
        assert running.server.in_flight == 0
        assert engine.stats()["running"] + engine.stats()["waiting"] == 0
        assert gauges(running.url) == (0, 0)
    finally:
        engine._lock.release()
    # the step ends: its aborts are taken in, the pages go back, no new request needed
    wait_until(lambda: not engine.has_work, timeout=5)
    stats = engine.stats()
    assert (stats["running"], stats["waiting"], stats["pages_used"]) == (0, 0, baseline)
