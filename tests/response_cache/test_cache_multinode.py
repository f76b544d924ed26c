"""Two cache nodes in separate processes sharing one real Redis."""

from __future__ import annotations

import threading
import time

import pytest

from jkv.response_cache import keys as K
from jkv.response_cache.codec import Record, encode

pytestmark = pytest.mark.timeout(120)


def test_a_result_put_by_one_node_is_an_l2_hit_on_the_other(node_factory):
    a, b = node_factory("a"), node_factory("b")
    first = a.call("get_or_generate", prompt="What is  jkv?")
    assert first["level"] is None and first["text"] == "a:What is  jkv?"
    again = b.call("get_or_generate", prompt="What is  jkv?")
    assert again["level"] == "l2" and again["text"] == "a:What is  jkv?"
    assert b.call("get_or_generate", prompt="What is  jkv?")["level"] == "l1"
    assert b.call("stats")["generated"] == 0


def test_group_invalidation_reaches_the_other_nodes_l1_within_1s(node_factory, poll):
    a, b = node_factory("a"), node_factory("b")
    for prompt, group in (("refund policy", 7), ("shipping times", 8)):
        a.call("get_or_generate", prompt=prompt, group=group)
        assert b.call("get_or_generate", prompt=prompt)["level"] == "l2"
        assert b.call("get", prompt=prompt)["level"] == "l1"
    assert a.call("invalidate_group", group=7)["removed"] == 1
    assert poll(lambda: b.call("get", prompt="refund policy")["level"] is None, within=1.0)
    assert b.call("get", prompt="shipping times")["level"] == "l1"  # other group untouched
    regenerated = b.call("get_or_generate", prompt="refund policy")
    assert regenerated["level"] is None and regenerated["text"] == "b:refund policy"


def test_model_invalidation_reaches_the_other_nodes_l1_within_1s(node_factory, poll):
    a, b = node_factory("a"), node_factory("b")
    b.call("get_or_generate", prompt="hello")
    b.call("get_or_generate", prompt="hello", model="other")
    assert b.call("get", prompt="hello")["level"] == "l1"
    reply = a.call("invalidate_model", wait=True)
    assert reply["generation"] == 1 and reply["removed"] == 1
    assert poll(lambda: b.call("get", prompt="hello")["level"] is None, within=1.0)
    assert b.call("get", prompt="hello", model="other")["level"] == "l1"
    assert b.call("get_or_generate", prompt="hello")["level"] is None


def test_model_cleanup_of_100k_keys_never_blocks_redis(node_factory, redis_client, redis_url):
    n = 100_000
    value = encode(Record("x" * 100, (1, 2, 3), "stop", "v1", 3, 0.0))
    pipe = redis_client.pipeline(transaction=False)
    for i in range(n):
        pipe.set(K.response_key("big", 0, f"{i:064x}"), value, ex=3600)
        if i % 10_000 == 9_999:
            pipe.execute()
    pipe.execute()
    redis_client.sadd(
        K.group_key("big", 0, 3, 0), *[K.response_key("big", 0, f"{i:064x}") for i in range(1000)]
    )
    assert redis_client.dbsize() == n + 1
    a = node_factory("a")
    redis_client.config_resetstat()
    # Log every command with its arguments (threshold 0 us), to check each one's size: a
    # size bound holds on a loaded machine, where a latency bound would not.
    redis_client.config_set("slowlog-log-slower-than", 0)
    redis_client.config_set("slowlog-max-len", 10_000)
    redis_client.slowlog_reset()

    pings, stop = [0], threading.Event()

    def probe():
        import redis

        client = redis.Redis.from_url(redis_url)
        while not stop.is_set():
            client.ping()
            pings[0] += 1
            time.sleep(0.01)
        client.close()

    thread = threading.Thread(target=probe)
    thread.start()
    try:
        reply = a.call("invalidate_model", model="big", wait=True, timeout=110)
    finally:
        stop.set()
        thread.join()
    log = redis_client.slowlog_get(10_000)
    redis_client.config_set("slowlog-log-slower-than", 10_000)
    assert reply["removed"] == n
    assert redis_client.dbsize() == 1  # only the generation counter is left
    assert int(redis_client.get(K.generation_key("big"))) == 1
    commands = redis_client.info("commandstats")
    assert not {"cmdstat_keys", "cmdstat_flushdb", "cmdstat_flushall"} & set(commands)
    # Batched: about one SCAN and one UNLINK per 1000 keys, never one giant command.
    assert commands["cmdstat_scan"]["calls"] >= n // 1000
    assert commands["cmdstat_unlink"]["calls"] >= n // 1000
    unlinks = [_argc(e["command"]) for e in log if e["command"].upper().startswith(b"UNLINK ")]
    scans = [e["command"].split() for e in log if e["command"].upper().startswith(b"SCAN ")]
    assert sum(unlinks) >= n and max(unlinks) <= 1000, max(unlinks)
    assert scans and all(int(s[s.index(b"COUNT") + 1]) <= 1000 for s in scans)
    assert pings[0] > 0  # other clients were served while the cleanup ran


def _argc(command: bytes) -> int:
    """How many arguments a SLOWLOG entry's command had (it lists 31, then "... (N more")."""
    words = command.split()[1:]
    if len(words) >= 5 and words[-4] == b"..." and words[-3].startswith(b"("):
        return len(words) - 4 + int(words[-3][1:])
    return len(words)
