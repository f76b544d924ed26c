"""Invalidation paths that need no second process: lost events, bad events, L1-only mode."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
from pathlib import Path

import pytest

from jkv.response_cache import ResponseCache
from jkv.response_cache import keys as K

pytestmark = pytest.mark.timeout(60)
SETTINGS = {"temperature": 0.0}
ANSWER = {"text": "t", "tokens": [1], "finish_reason": "stop"}


def test_a_lost_event_is_caught_by_the_generation_refresh(redis_url, redis_client, poll):
    with ResponseCache(redis_url, generation_refresh=0.2) as cache:
        cache.put("demo", "v1", "q", SETTINGS, ANSWER)
        assert cache.get("demo", "v1", "q", SETTINGS).level == "l1"
        redis_client.incr(K.generation_key("demo"))  # a bump whose event never arrived
        assert poll(lambda: cache.get("demo", "v1", "q", SETTINGS) is None, within=2)
        assert cache.key("demo", "v1", "q", SETTINGS).split("}:")[1].startswith("1:")
        assert cache.stats()["invalidations"]["generation_changes_seen"] == 1


def test_malformed_events_are_ignored_and_counted(redis_url, redis_client, poll):
    with ResponseCache(redis_url) as cache:
        cache.put("demo", "v1", "q", SETTINGS, ANSWER)
        for bad in [b"not json", b"{}", json.dumps({"v": 9, "op": "model", "model": "demo"})]:
            redis_client.publish(cache.config.channel, bad)
        good = {"v": 1, "op": "group", "model": "other", "gen": 0, "group": 1, "node": "x"}
        redis_client.publish(cache.config.channel, json.dumps(good))
        assert poll(lambda: cache.stats()["invalidations"]["events_received"] == 1, within=2)
        assert cache.stats()["invalidations"]["events_ignored"] == 3
        assert cache.get("demo", "v1", "q", SETTINGS).level == "l1"


def test_group_sets_carry_a_ttl_and_old_generations_are_cleaned(redis_url, redis_client):
    with ResponseCache(redis_url, ttl=120) as cache:
        cache.put("demo", "v1", "q", SETTINGS, ANSWER, group_id=3)
        key = cache.key("demo", "v1", "q", SETTINGS)
        group = K.group_key("demo", 0, 3, K.bucket_of(key[-64:]))
        assert redis_client.smembers(group) == {key.encode()}
        assert 0 < redis_client.ttl(group) <= 120
        assert cache.invalidate_model("demo").wait(30) == 1
        assert redis_client.exists(group) == 0


def test_l1_only_invalidation():
    with ResponseCache() as cache:
        cache.put("demo", "v1", "a", SETTINGS, ANSWER, group_id=1)
        cache.put("demo", "v1", "b", SETTINGS, ANSWER, group_id=2)
        assert cache.invalidate_group("demo", 1) == 0  # no L2 keys to count
        assert cache.get("demo", "v1", "a", SETTINGS) is None
        assert cache.get("demo", "v1", "b", SETTINGS).level == "l1"
        assert cache.invalidate_model("demo").generation == 1
        assert cache.get("demo", "v1", "b", SETTINGS) is None
        with pytest.raises(ValueError, match="cluster_id"):
            cache.invalidate_group("demo", -1)


def test_importing_jkv_cache_loads_neither_redis_nor_jax():
    root = Path(__file__).resolve().parents[2]
    code = (
        "import sys, types; stub = types.ModuleType('jkv'); "
        f"stub.__path__ = [{str(root / 'jkv')!r}]; sys.modules['jkv'] = stub; "
        "import jkv.response_cache; "
        "bad = {'redis', 'jax', 'torch'} & set(sys.modules); "
        "assert not bad, bad"
    )
    env = dict(os.environ, PYTHONPATH=str(root))
    subprocess.run([sys.executable, "-c", code], check=True, env=env, timeout=60)


# --------------------------------------------------------------------------- bad Redis content
def test_a_poisoned_generation_is_bypassed_until_invalidate_model_repairs_it(
    redis_url, redis_client, poll
):
    model, gen_key = "jkv-demo", K.generation_key("jkv-demo")
    fresh = {"text": "fresh", "tokens": [2], "finish_reason": "stop"}
    with ResponseCache(redis_url, node_id="a", generation_refresh=0.1) as a:
        a.put(model, "v1", "q", SETTINGS, ANSWER)
        assert a.get(model, "v1", "q", SETTINGS).level == "l1"
        redis_client.set(gen_key, "oops")
        assert poll(lambda: a.get(model, "v1", "q", SETTINGS) is None, within=3)  # L1 dropped
        assert a.get_or_generate(model, "v1", "q", SETTINGS, lambda: fresh).level is None
        assert len(redis_client.keys("llm:response:*")) == 1  # nothing written blind
        with ResponseCache(redis_url, node_id="b") as b:  # a node that starts meanwhile
            assert b.get_or_generate(model, "v1", "q", SETTINGS, lambda: fresh).level is None
            job = a.invalidate_model(model)
            assert int(redis_client.get(gen_key)) == job.generation > 0  # repaired
            job.wait(30)
            assert a.get_or_generate(model, "v1", "q", SETTINGS, lambda: fresh).level is None
            assert poll(lambda: b.get(model, "v1", "q", SETTINGS) is not None, within=3)
            assert b.get(model, "v1", "q", SETTINGS).record.text == "fresh"
        stats = a.stats()
        assert stats["redis"]["listener_alive"] and stats["bad_generation_values"] >= 1
        assert stats["bypassed"] >= 2


def test_group_invalidation_with_a_poisoned_generation(redis_url, redis_client):
    with ResponseCache(redis_url) as cache:
        cache.put("demo", "v1", "q", SETTINGS, ANSWER, group_id=4)
        redis_client.set(K.generation_key("demo"), b"\xff")
        assert cache.invalidate_group("demo", 4) == 1
        assert redis_client.keys("llm:response:*") == []


def test_the_listener_survives_every_message(redis_url, redis_client, poll):
    bad = [
        b"\xff\xfe",
        json.dumps({"v": 1, "op": "model", "model": "demo", "gen": 1e999}),  # inf: OverflowError
        json.dumps({"v": 1, "op": "model", "model": "demo", "gen": "x"}),
        json.dumps({"v": 1, "op": "group", "model": "demo", "gen": 0, "group": True}),
        json.dumps([1, 2]),
        "[" * 100_000 + "]" * 100_000,  # RecursionError in the JSON parser
    ]
    with ResponseCache(redis_url) as cache:
        cache.put("demo", "v1", "q", SETTINGS, ANSWER)
        for message in bad:
            redis_client.publish(cache.config.channel, message)
        good = {"v": 1, "op": "model", "model": "demo", "gen": 5, "node": "x"}
        redis_client.publish(cache.config.channel, json.dumps(good))
        assert poll(lambda: cache.get("demo", "v1", "q", SETTINGS) is None, within=3)
        assert cache.key("demo", "v1", "q", SETTINGS).split("}:")[1].startswith("5:")
        stats = cache.stats()
        assert stats["invalidations"]["events_ignored"] == len(bad)
        assert stats["redis"]["listener_alive"]


@pytest.mark.filterwarnings("ignore::pytest.PytestUnhandledThreadExceptionWarning")
def test_a_dead_listener_is_restarted_and_l1_flushed(redis_url, poll):
    import ctypes

    before = set(threading.enumerate())
    with ResponseCache(redis_url, node_id="a") as a:
        (thread,) = [t for t in set(threading.enumerate()) - before if "listener" in t.name]
        a.put("demo", "v1", "q", SETTINGS, ANSWER)
        ident = ctypes.c_ulong(thread.ident)
        # SystemExit raised inside the thread: the death no `except Exception` can stop.
        assert ctypes.pythonapi.PyThreadState_SetAsyncExc(ident, ctypes.py_object(SystemExit))
        thread.join(5)
        assert not thread.is_alive()
        assert poll(lambda: a.stats()["redis"]["listener_alive"], within=3)
        assert a.stats()["redis"]["listener_restarts"] >= 1
        assert a.get("demo", "v1", "q", SETTINGS).level == "l2"  # L1 flushed: events were lost
        a.put("demo", "v1", "q", SETTINGS, ANSWER)
        with ResponseCache(redis_url, node_id="b") as b:
            b.invalidate_model("demo").wait(30)
        assert poll(lambda: a.get("demo", "v1", "q", SETTINGS) is None, within=3)
