"""Redis dies mid-traffic and comes back: requests never fail, nodes never restart."""

from __future__ import annotations

import threading
import time

import pytest

from jkv.response_cache import CacheUnavailableError, ResponseCache

pytestmark = pytest.mark.timeout(120)
SETTINGS = {"temperature": 0.0, "max_new_tokens": 8}


def _answer(prompt: str) -> dict:
    return {"text": f"answer to {prompt}", "tokens": [len(prompt)], "finish_reason": "stop"}


def test_killed_redis_degrades_to_l1_and_comes_back(redis_server, poll):
    a = ResponseCache(redis_server.url, node_id="a")
    b = ResponseCache(redis_server.url, node_id="b")
    hot = [f"hot prompt {i}" for i in range(20)]
    for p in hot:
        a.get_or_generate("demo", "v1", p, SETTINGS, lambda p=p: _answer(p))
    assert all(a.get("demo", "v1", p, SETTINGS).level == "l1" for p in hot)

    failures, levels, stop = [], [], threading.Event()

    def traffic(cache: ResponseCache, fresh_prefix: str) -> None:
        i = 0
        while not stop.is_set():
            i += 1
            p = hot[i % len(hot)] if i % 3 else f"{fresh_prefix} {i}"
            try:
                found = cache.get_or_generate("demo", "v1", p, SETTINGS, lambda p=p: _answer(p))
                assert found.record.text == f"answer to {p}"
                levels.append((p in hot, found.level))
            except Exception as e:  # the test fails below, with what went wrong
                failures.append(repr(e))

    threads = [threading.Thread(target=traffic, args=(c, c.config.node_id)) for c in (a, b)]
    for t in threads:
        t.start()
    try:
        time.sleep(0.3)
        redis_server.kill()
        killed_at = len(levels)
        time.sleep(1.0)
        during = levels[killed_at:]
        assert any(level == "l1" for is_hot, level in during if is_hot)
        assert any(level is None for is_hot, level in during if not is_hot)
        assert a.stats()["errors"], "the outage was not counted"
        with pytest.raises(CacheUnavailableError):
            a.invalidate_model("demo")  # admin operations do report the outage
        a.put("demo", "v1", "only in L1", SETTINGS, _answer("only in L1"))
        assert a.get("demo", "v1", "only in L1", SETTINGS).level == "l1"

        subscribes = a.stats()["redis"]["subscribes"]
        flushes = a.stats()["l1"]["flushes"]
        redis_server.restart()
        assert poll(lambda: a.stats()["redis"]["subscribes"] > subscribes, within=10)
        assert a.stats()["l1"]["flushes"] > flushes
        assert a.get("demo", "v1", "only in L1", SETTINGS) is None  # flushed: may be stale
    finally:
        stop.set()
        for t in threads:
            t.join()
    assert failures == []

    # L2 is back without restarting either node: b's fresh result is an L2 hit on a.
    def shared() -> bool:
        b.put("demo", "v1", "after", SETTINGS, _answer("after"))
        return a.get("demo", "v1", "after", SETTINGS) is not None

    assert poll(shared, within=10)
    regenerated = a.get_or_generate("demo", "v1", "brand new", SETTINGS, lambda: _answer("x"))
    assert regenerated.level is None
    assert b.get("demo", "v1", "brand new", SETTINGS).level == "l2"
    a.close()
    b.close()


def test_hung_redis_costs_one_timeout_then_is_skipped(redis_server, poll):
    with ResponseCache(redis_server.url, node_id="a") as a:
        a.get_or_generate("demo", "v1", "hot", SETTINGS, lambda: _answer("hot"))
        redis_server.pause()
        try:
            assert a.get_or_generate("demo", "v1", "hot", SETTINGS, None).level == "l1"
            fresh = [
                a.get_or_generate("demo", "v1", f"new {i}", SETTINGS, lambda i=i: _answer(str(i)))
                for i in range(20)
            ]
            assert [f.level for f in fresh] == [None] * 20
            stats = a.stats()
            assert stats["errors"].get("timeout", 0) >= 1
            assert stats["redis"]["skipped"] >= 1  # the breaker spared the other requests
        finally:
            redis_server.resume()
        with ResponseCache(redis_server.url, node_id="b") as b:

            def shared() -> bool:
                a.put("demo", "v1", "later", SETTINGS, _answer("later"))
                return b.get("demo", "v1", "later", SETTINGS) is not None

            assert poll(shared, within=10)


def test_no_redis_at_start_serves_from_l1_and_the_model():
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        url = f"redis://127.0.0.1:{s.getsockname()[1]}/0"
    with ResponseCache(url, node_id="lonely") as cache:
        first = cache.get_or_generate("demo", "v1", "q", SETTINGS, lambda: _answer("q"))
        second = cache.get_or_generate("demo", "v1", "q", SETTINGS, lambda: _answer("q"))
        assert (first.level, second.level) == (None, "l1")
        assert cache.stats()["errors"].get("connection", 0) >= 1
