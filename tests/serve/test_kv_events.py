"""KV events in vLLM's format from the engine's prefix cache (jkv/serve/kv_events.py), read by
a subscriber that decodes them with vLLM's own message declarations (kv_event_subscriber.py)."""

from __future__ import annotations

import random
import socket
import time

import pytest
from kv_event_subscriber import Subscriber
from server_harness import small_engine

from jkv.engine.page_pool import block_hashes
from jkv.serve.kv_events import KVEventPublisher

pytestmark = pytest.mark.timeout(300)


def _endpoint() -> str:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return f"tcp://127.0.0.1:{s.getsockname()[1]}"


@pytest.fixture
def publisher():
    made = []

    def make(**options) -> KVEventPublisher:
        made.append(KVEventPublisher(_endpoint(), _endpoint(), **options))
        return made[-1]

    yield make
    for pub in made:
        pub.close()


def _settled(pub: KVEventPublisher, sub: Subscriber) -> bool:
    deadline = time.monotonic() + 10
    while pub._pending and time.monotonic() < deadline:
        time.sleep(0.01)
    time.sleep(3 * pub._interval)  # the batch being sent
    return sub.wait_for(pub.seq - 1)


def _workload(engine, rng: random.Random, n: int) -> None:
    """`n` prompts over a few shared prefixes (so blocks are shared and recycled), 4 at once."""
    vocab = engine.params.config.vocab_size
    prefixes = [
        [rng.randrange(3, vocab) for _ in range(rng.choice((32, 48, 64)))] for _ in range(5)
    ]
    prompts = [
        rng.choice(prefixes) + [rng.randrange(3, vocab) for _ in range(rng.randrange(1, 40))]
        for _ in range(n)
    ]
    for i in range(0, n, 4):
        engine.generate(prompts[i : i + 4], max_new_tokens=2, temperature=0.0)


def test_a_subscriber_rebuilds_the_cached_blocks_after_a_random_workload(demo_params, publisher):
    pub = publisher()
    sub = Subscriber(pub.endpoint, pub.replay_endpoint)
    time.sleep(0.2)  # the SUB connects (PUB drops what goes out before: replay would fill it)
    engine = small_engine(demo_params, num_pages=200, kv_events=pub)
    page = engine.pool.page_size
    try:
        _workload(engine, random.Random(0), 24)
        assert engine.pool.stats.recycled_lazy > 0, "the workload evicted nothing"
        assert _settled(pub, sub), f"subscriber at {sub.last_seq}, publisher at {pub.seq}"
        assert not sub.errors, sub.errors
        cached = set(engine.pool._cached)
        assert cached and sub.blocks == cached
        for h in cached:  # the token ids an event carried hash (with the parent) to the block
            parent = sub.parents[h]
            if parent is not None:
                tokens = [0] * page + list(sub.tokens[h])
                assert block_hashes(tokens, page, parent=parent, first=1) == [h]

        engine.pool.clear_cache()  # what a pool rebuilt after a failed step does
        assert _settled(pub, sub) and sub.blocks == set() == set(engine.pool._cached)
        _workload(engine, random.Random(1), 8)
        assert _settled(pub, sub) and sub.blocks == set(engine.pool._cached)
    finally:
        sub.close()


def test_an_indexer_killed_under_traffic_catches_up_by_replay(demo_params, publisher):
    """The subscriber dies mid-workload: the engine never waits for it (requests finish as
    usual); one started later replays every batch from 0 and holds the engine's set."""
    pub = publisher()
    engine = small_engine(demo_params, num_pages=200, kv_events=pub)
    first = Subscriber(pub.endpoint, pub.replay_endpoint)
    rng = random.Random(2)
    _workload(engine, rng, 8)
    first.close()  # the indexer is gone; the replica goes on
    t0 = time.monotonic()
    _workload(engine, rng, 24)
    assert time.monotonic() - t0 < 120
    assert engine.pool.stats.recycled_lazy > 0
    late = Subscriber(pub.endpoint, pub.replay_endpoint)
    try:
        time.sleep(0.2)
        late.replay(0)  # everything it missed, from the buffer
        assert late.replays == 1 and late.last_seq == pub.seq - 1
        assert late.blocks == set(engine.pool._cached)
        _workload(engine, rng, 4)  # and it follows the live stream from there
        assert _settled(pub, late) and late.blocks == set(engine.pool._cached)
        assert not late.errors, late.errors
    finally:
        late.close()


def test_a_gap_in_the_sequence_is_filled_from_the_replay_socket(demo_params, publisher):
    pub = publisher()
    engine = small_engine(demo_params, num_pages=200, kv_events=pub)
    _workload(engine, random.Random(3), 4)  # no one listens: these batches are only buffered
    deadline = time.monotonic() + 10
    while (pub._pending or pub.seq == 0) and time.monotonic() < deadline:
        time.sleep(0.01)
    assert pub.seq > 0
    sub = Subscriber(pub.endpoint, pub.replay_endpoint)
    try:
        time.sleep(0.2)
        _workload(engine, random.Random(4), 4)
        assert _settled(pub, sub), f"subscriber at {sub.last_seq}, publisher at {pub.seq}"
        assert sub.replays >= 1 and sub.blocks == set(engine.pool._cached)
    finally:
        sub.close()


def test_bad_endpoints_are_named():
    for bad in ("127.0.0.1:5557", "tcp://127.0.0.1", "tcp://:5557", "udp://x:1", 5557):
        with pytest.raises(ValueError, match="kv_events_endpoint="):
            KVEventPublisher(bad)
    taken = _endpoint()
    pub = KVEventPublisher(taken)
    try:
        with pytest.raises(ValueError, match="cannot be bound"):
            KVEventPublisher(taken)
        with pytest.raises(ValueError, match="kv_events_replay_endpoint="):
            KVEventPublisher(_endpoint(), "nope")
    finally:
        pub.close()
