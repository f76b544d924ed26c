"""ResponseCache in one process: the tier flow, bad values, single-flight, invalidation."""

from __future__ import annotations

import threading
import time

import msgpack
import pytest

from jkv.response_cache import KMeansClusterer, Record, ResponseCache
from jkv.response_cache import keys as K
from jkv.response_cache.codec import FORMAT_VERSION, encode

pytestmark = pytest.mark.timeout(120)
SETTINGS = {"temperature": 0.0, "max_new_tokens": 8, "kv_policy": {"name": "snapkv", "k": 64}}


class Model:
    """A counting stand-in for the model, optionally slow or failing."""

    def __init__(self, delay: float = 0.0, fail: bool = False) -> None:
        self.calls = 0
        self.delay = delay
        self.fail = fail
        self._lock = threading.Lock()

    def __call__(self, prompt: str = "p"):
        def generate():
            with self._lock:
                self.calls += 1
            time.sleep(self.delay)
            if self.fail:
                raise RuntimeError("model exploded")
            return {"text": f"answer:{prompt}", "tokens": [7, 8], "finish_reason": "stop"}

        return generate


@pytest.fixture(params=["l1_only", "redis"])
def cache(request):
    url = request.getfixturevalue("redis_url") if request.param == "redis" else None
    with ResponseCache(url, node_id="test") as c:
        yield c


def test_flow_model_then_l1(cache):
    model = Model()
    first = cache.get_or_generate("demo", "v1", "Hello  there", SETTINGS, model("x"))
    again = cache.get_or_generate("demo", "v1", "Hello  there", SETTINGS, model("x"))
    assert (first.level, again.level, model.calls) == (None, "l1", 1)
    assert again.record == first.record
    assert first.record.text == "answer:x" and first.record.tokens == (7, 8)
    assert first.record.model_version == "v1" and first.record.group_id is None
    stats = cache.stats()
    assert stats["hits"]["l1"] == 1 and stats["misses"] == 1 and stats["generations"] == 1
    assert stats["latency"]["get_seconds"]["count"] == 2


def test_text_is_keyed_exactly_unless_normalisation_is_asked_for():
    model = Model()
    with ResponseCache() as exact, ResponseCache(normalize_whitespace=True) as loose:
        for cache, level in ((exact, None), (loose, "l1")):
            cache.get_or_generate("demo", "v1", "Hello  there", SETTINGS, model("x"))
            found = cache.get_or_generate("demo", "v1", "\tHello there\n", SETTINGS, model("y"))
            assert found.level == level
    assert model.calls == 3  # twice by the exact cache, once by the normalising one
    with pytest.raises(ValueError, match="normalize_whitespace=1"):
        ResponseCache(normalize_whitespace=1)


def test_lookup_then_fill_is_get_or_generate_without_the_call(cache):
    found = cache.lookup("demo", "v1", [5, 6, 7], SETTINGS)
    assert found.cached and not found.done
    waiter = []
    thread = threading.Thread(
        target=lambda: waiter.append(cache.lookup("demo", "v1", [5, 6, 7], SETTINGS))
    )
    thread.start()  # an identical lookup waits for the fill (a coalescing miss leads)
    time.sleep(0.05)
    assert thread.is_alive()
    record = found.fill({"text": "t", "tokens": [1], "finish_reason": "stop"})
    thread.join(10)
    assert waiter[0].level == "coalesced" and waiter[0].record == record
    assert cache.lookup("demo", "v1", [5, 6, 7], SETTINGS).level == "l1"
    # abandoned: the waiters raise, nothing is cached
    miss = cache.lookup("demo", "v1", [8], SETTINGS)
    with pytest.raises(RuntimeError, match="exploded"):
        with miss:
            raise RuntimeError("exploded")
    again = cache.lookup("demo", "v1", [8], SETTINGS)
    assert miss.done and not isinstance(again, tuple)  # a miss again: nothing was cached
    again.abandon()
    # not deterministic: a miss to fill that stores nothing
    sampled = cache.lookup("demo", "v1", [9], {**SETTINGS, "temperature": 0.7})
    assert not sampled.cached
    sampled.fill({"text": "s", "tokens": [2], "finish_reason": "stop"})
    assert (
        not sampled.cached
        and cache.get("demo", "v1", [9], {**SETTINGS, "temperature": 0.7}) is None
    )


def test_l2_hit_fills_l1(redis_url):
    with ResponseCache(redis_url, node_id="a") as a, ResponseCache(redis_url, node_id="b") as b:
        a.get_or_generate("demo", "v1", "q", SETTINGS, Model()("q"))
        assert b.get("demo", "v1", "q", SETTINGS).level == "l2"
        assert b.get("demo", "v1", "q", SETTINGS).level == "l1"


def test_other_version_tenant_or_settings_miss(redis_url):
    model = Model()
    with ResponseCache(redis_url, node_id="a") as a:
        a.get_or_generate("demo", "v1", "q", SETTINGS, model())
        assert a.get("demo", "v2", "q", SETTINGS) is None
        assert a.get("demo", "v1", "q", {**SETTINGS, "max_new_tokens": 9}) is None
        assert a.get("other", "v1", "q", SETTINGS) is None
    with ResponseCache(redis_url, namespace="tenant-b") as b:
        assert b.get("demo", "v1", "q", SETTINGS) is None


def test_sampled_requests_are_never_cached(cache):
    model = Model()
    sampled = {"temperature": 0.7}
    for _ in range(2):
        assert cache.get_or_generate("demo", "v1", "q", sampled, model()).level is None
    assert model.calls == 2 and cache.get("demo", "v1", "q", sampled) is None
    seeded = {"temperature": 0.7, "seed": 3}
    cache.get_or_generate("demo", "v1", "q", seeded, model())
    assert cache.get_or_generate("demo", "v1", "q", seeded, model()).level == "l1"
    assert cache.stats()["uncacheable"] == 3


def test_corrupt_l2_values_are_misses_and_deleted(redis_url, redis_client):
    good = encode(Record("t", (1,), "stop", "v1", None, 1.0))
    corrupt = [
        bytes([FORMAT_VERSION + 1]) + good[1:],  # another format version
        good[:-3],  # truncated
        b"\x01\xc1garbage",  # never-used msgpack byte
        b"",
    ]
    with ResponseCache(redis_url, node_id="a") as cache:
        for i, value in enumerate(corrupt):
            key = cache.key("demo", "v1", f"p{i}", SETTINGS)
            redis_client.set(key, value)
            assert cache.get("demo", "v1", f"p{i}", SETTINGS) is None
            assert redis_client.exists(key) == 0
            found = cache.get_or_generate("demo", "v1", f"p{i}", SETTINGS, Model()(f"p{i}"))
            assert found.level is None and found.record.text == f"answer:p{i}"
        assert cache.stats()["decode_failures"] == len(corrupt)


def test_values_of_the_previous_schema_are_misses_and_deleted(redis_url, redis_client):
    old = b"\x01" + msgpack.packb(["t", b"\x01\0\0\0", "stop", "v1", None, 1.0])
    with ResponseCache(redis_url, node_id="a") as cache:
        key = cache.key("demo", "v1", "old", SETTINGS)
        redis_client.set(key, old)
        assert cache.get("demo", "v1", "old", SETTINGS) is None
        assert redis_client.exists(key) == 0


def test_records_carry_the_generation_s_kv_bytes_and_stats(redis_url):
    made = {"text": "t", "tokens": [1], "finish_reason": "stop", "kv_bytes": 96}
    made["stats"] = {"prompt_tokens": 3, "prefill_s": 0.25}
    with ResponseCache(redis_url, node_id="a") as a, ResponseCache(redis_url, node_id="b") as b:
        a.get_or_generate("demo", "v1", "q", SETTINGS, lambda: made)
        for found in (a.get("demo", "v1", "q", SETTINGS), b.get("demo", "v1", "q", SETTINGS)):
            assert found.record.kv_bytes == 96 and found.record.stats == made["stats"]


def test_oversized_values_are_returned_but_not_cached(cache):
    small = ResponseCache(max_value_bytes=64)
    big = {"text": "x" * 100, "tokens": [1], "finish_reason": "length"}
    for c in (small, cache):
        first = c.get_or_generate("demo", "v1", "q", SETTINGS, lambda: big)
        assert first.record.text == "x" * 100
    assert small.get("demo", "v1", "q", SETTINGS) is None
    assert small.stats()["not_cached_size"] == 1
    assert cache.get("demo", "v1", "q", SETTINGS).level == "l1"


def test_32_threads_one_generation(cache):
    model = Model(delay=0.2)
    barrier = threading.Barrier(32)
    results = []

    def ask():
        barrier.wait()
        results.append(cache.get_or_generate("demo", "v1", "same", SETTINGS, model("same")))

    threads = [threading.Thread(target=ask) for _ in range(32)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert model.calls == 1
    assert len(results) == 32 and all(r.record == results[0].record for r in results)
    assert cache.stats()["coalesced"] + cache.stats()["hits"]["l1"] == 31
    levels = [r.level for r in results]
    assert levels.count(None) == 1 and set(levels) <= {None, "l1", "coalesced"}
    assert levels.count("coalesced") == cache.stats()["coalesced"]


def test_generate_errors_reach_every_waiter_and_are_not_cached(cache):
    model = Model(delay=0.2, fail=True)
    barrier = threading.Barrier(8)
    errors = []

    def ask():
        barrier.wait()
        try:
            cache.get_or_generate("demo", "v1", "doomed", SETTINGS, model())
        except RuntimeError as e:
            errors.append(str(e))

    threads = [threading.Thread(target=ask) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == ["model exploded"] * 8 and model.calls == 1
    assert cache.get("demo", "v1", "doomed", SETTINGS) is None
    assert cache.get_or_generate("demo", "v1", "doomed", SETTINGS, Model()()).level is None


def test_two_nodes_one_generation_through_the_lease(redis_url):
    model = Model(delay=0.5)
    nodes = [ResponseCache(redis_url, node_id=f"n{i}") for i in range(3)]
    barrier = threading.Barrier(3)
    levels = []

    def ask(node):
        barrier.wait()
        levels.append(node.get_or_generate("demo", "v1", "shared", SETTINGS, model()).level)

    threads = [threading.Thread(target=ask, args=(n,)) for n in nodes]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert model.calls == 1 and sorted(levels, key=str) == [None, "l2", "l2"]
    assert sum(n.stats()["lease_waits"] for n in nodes) == 2
    for n in nodes:
        n.close()


def test_a_dead_lease_holder_costs_time_not_the_answer(redis_url, redis_client):
    with ResponseCache(redis_url, node_id="n", lease_wait=0.3) as cache:
        key = cache.key("demo", "v1", "orphan", SETTINGS)
        redis_client.set(K.lease_key(key), "crashed-node", px=60_000)
        found = cache.get_or_generate("demo", "v1", "orphan", SETTINGS, Model()("orphan"))
        assert found.level is None and found.record.text == "answer:orphan"
        assert redis_client.get(K.lease_key(key)) == b"crashed-node"  # not ours to delete


def test_embedder_assigns_groups_and_group_invalidation_drops_them(cache):
    vectors = [[1.0, 0.0], [0.9, 0.1], [0.0, 1.0], [0.1, 0.9]]
    clusterer = KMeansClusterer.fit(vectors, 2, seed=0)
    embed = {"cats": [1.0, 0.05], "dogs": [0.95, 0.0], "stocks": [0.0, 1.0]}
    url = cache.config.redis_url
    with ResponseCache(url, embedder=embed.__getitem__, clusterer=clusterer) as c:
        for prompt in embed:
            c.get_or_generate("demo", "v1", prompt, SETTINGS, Model()(prompt))
        group = c.get("demo", "v1", "cats", SETTINGS).record.group_id
        assert group == c.get("demo", "v1", "dogs", SETTINGS).record.group_id
        assert group != c.get("demo", "v1", "stocks", SETTINGS).record.group_id
        c.invalidate_group("demo", group)
        assert c.get("demo", "v1", "cats", SETTINGS) is None
        assert c.get("demo", "v1", "dogs", SETTINGS) is None
        assert c.get("demo", "v1", "stocks", SETTINGS) is not None


def test_broken_embedder_costs_grouping_not_the_answer(cache):
    def broken(prompt):
        raise OSError("embedding service down")

    with ResponseCache(embedder=broken, clusterer=KMeansClusterer([[1.0]])) as c:
        found = c.get_or_generate("demo", "v1", "q", SETTINGS, Model()("q"))
        assert found.record.group_id is None and c.stats()["errors"] == {"embedder": 1}


def test_invalidate_model_in_process(cache):
    cache.get_or_generate("demo", "v1", "q", SETTINGS, Model()())
    job = cache.invalidate_model("demo")
    job.wait(30)
    assert job.generation == 1 and job.done
    assert cache.get("demo", "v1", "q", SETTINGS) is None
    assert cache.key("demo", "v1", "q", SETTINGS).split("}:")[1].startswith("1:")
    again = cache.invalidate_model("demo")  # idempotent: just another generation
    assert again.generation == 2 and again.wait(30) == 0


def test_close_stops_the_listener_and_refuses_use(redis_url):
    before = {t.name for t in threading.enumerate()}
    cache = ResponseCache(redis_url)
    assert "jkv-cache-listener" in {t.name for t in threading.enumerate()} - before
    cache.close()
    cache.close()
    assert "jkv-cache-listener" not in {t.name for t in threading.enumerate()} - before
    with pytest.raises(RuntimeError, match="closed"):
        cache.get("demo", "v1", "q", SETTINGS)


@pytest.mark.parametrize(
    "kwargs, named",
    [
        ({"redis_url": "http://localhost:6379"}, "redis_url='http://localhost:6379'"),
        ({"redis_url": "redis://"}, "redis_url='redis://'"),
        ({"ttl": -1}, "ttl=-1"),
        ({"ttl": 1.5}, "ttl=1.5"),
        ({"l1_max_entries": 0}, "l1_max_entries=0"),
        ({"l1_ttl": float("nan")}, "l1_ttl=nan"),
        ({"namespace": ""}, "namespace=''"),
        ({"op_timeout": 0}, "op_timeout=0"),
        ({"bogus": 1}, "bogus"),
        ({"embedder": len}, "clusterer=None"),
    ],
    ids=lambda v: "-".join(v) if isinstance(v, dict) else None,
)
def test_bad_settings_raise_value_error_naming_the_value(kwargs, named):
    with pytest.raises(ValueError) as err:
        ResponseCache(**kwargs)
    assert named in str(err.value)


@pytest.mark.parametrize(
    "model_name, prompt, settings",
    [
        ("bad:name", "q", SETTINGS),
        ("{x}", "q", SETTINGS),
        ("a*", "q", SETTINGS),
        ("demo", b"bytes", SETTINGS),
        ("demo", [1.5], SETTINGS),
        ("demo", "q", {"temperature": 0.0, "stop": {1: "x"}}),
        ("demo", "q", {"temperature": 0.0, "top_p": float("inf")}),
        ("demo", "q", {"temperature": 0.0, "policy": object()}),
    ],
    ids=["colon", "braces", "glob", "bytes_prompt", "float_tokens", "int_key", "inf", "object"],
)
def test_bad_requests_raise_value_error(model_name, prompt, settings):
    with ResponseCache() as cache, pytest.raises(ValueError):
        cache.get_or_generate(model_name, "v1", prompt, settings, Model()())


def test_malformed_generate_result_is_a_value_error(cache):
    with pytest.raises(ValueError, match="finish_reason"):
        cache.get_or_generate("demo", "v1", "q", SETTINGS, lambda: {"text": "t", "tokens": []})
