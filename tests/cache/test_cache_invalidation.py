"""Invalidation paths that need no second process: lost events, bad events, L1-only mode."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from jkv.cache import ResponseCache
from jkv.cache import keys as K

pytestmark = pytest.mark.timeout(60)
SETTINGS = {"temperature": 0.0}
ANSWER = {"text": "t", "tokens": [1], "finish_reason": "stop"}


def test_a_lost_event_is_caught_by_the_generation_refresh(redis_url, redis_client, poll):
    with ResponseCache(redis_url, generation_refresh=0.2) as cache:
        cache.put("demo", "v1", "q", SETTINGS, ANSWER)
        assert cache.get("demo", "v1", "q", SETTINGS).level == "l1"
        redis_client.incr(K.generation_key("demo"))  # a bump whose event never arrived
        assert poll(lambda: cache.get("demo", "v1", "q", SETTINGS) is None, within=2)
        assert cache.key("demo", "v1", "q", SETTINGS).startswith("llm:response:{demo}:1:")
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
        group = K.group_key("demo", 0, 3)
        assert redis_client.smembers(group) == {cache.key("demo", "v1", "q", SETTINGS).encode()}
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
        "import jkv.cache; "
        "bad = {'redis', 'jax', 'torch'} & set(sys.modules); "
        "assert not bad, bad"
    )
    env = dict(os.environ, PYTHONPATH=str(root))
    subprocess.run([sys.executable, "-c", code], check=True, env=env, timeout=60)
