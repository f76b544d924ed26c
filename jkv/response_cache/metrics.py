"""Counters, fixed-bucket latency histograms and a rate-limited error log.

Histograms use Prometheus-style cumulative `le` buckets in seconds, so a metrics endpoint
can publish `stats()` as is.
"""

from __future__ import annotations

import bisect
import logging
import threading
import time
from collections import Counter, deque
from typing import Any

LATENCY_BUCKETS_S = (
    0.00001,
    0.000025,
    0.00005,
    0.0001,
    0.00025,
    0.0005,
    0.001,
    0.0025,
    0.005,
    0.01,
    0.025,
    0.05,
    0.1,
    0.25,
    0.5,
    1.0,
    2.5,
    5.0,
    10.0,
    30.0,
    60.0,
)

log = logging.getLogger("jkv.response_cache")
_PENDING_MAX = 4096  # events a Metrics holds before folding them in


class Histogram:
    """A fixed-bucket latency histogram fed in nanoseconds. Not locked: `Metrics` locks."""

    def __init__(self, buckets_s: tuple[float, ...] = LATENCY_BUCKETS_S) -> None:
        self._bounds_s = buckets_s
        self._bounds_ns = [round(b * 1e9) for b in buckets_s]
        self._counts = [0] * (len(buckets_s) + 1)  # last slot: +Inf
        self._sum_ns = 0

    def observe_ns(self, ns: int) -> None:
        self._counts[bisect.bisect_left(self._bounds_ns, ns)] += 1
        self._sum_ns += ns

    def snapshot(self) -> dict:
        cumulative, running = {}, 0
        for bound, count in zip((*self._bounds_s, float("inf")), self._counts, strict=True):
            running += count
            cumulative["+Inf" if bound == float("inf") else repr(bound)] = running
        return {"buckets": cumulative, "count": running, "sum": self._sum_ns / 1e9}


class Metrics:
    """Thread-safe counters and histograms of one cache instance.

    `inc_observe`, called on every hit, takes no lock: it appends the event to a deque (one
    atomic C call) and the events are folded into the counters under the lock when read, or
    every `_PENDING_MAX` events. On an L1 hit the lock and the bucket search cost as much as
    the L1 lookup itself.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.counters: Counter[str] = Counter()
        self.errors: Counter[str] = Counter()
        self.histograms = {"get_seconds": Histogram(), "generate_seconds": Histogram()}
        self._pending: deque[tuple[str, str, int]] = deque()

    def inc(self, name: str, n: int = 1) -> None:
        with self._lock:
            self.counters[name] += n

    def inc_observe(self, name: str, histogram: str, ns: int) -> None:
        """Counts one event and records its latency (folded in later, see the class)."""
        pending = self._pending
        pending.append((name, histogram, ns))
        if len(pending) >= _PENDING_MAX:
            self._fold()

    def _fold(self) -> None:
        with self._lock:  # the only consumer: other threads keep appending meanwhile
            pending = self._pending
            for _ in range(len(pending)):
                name, histogram, ns = pending.popleft()
                self.counters[name] += 1
                self.histograms[histogram].observe_ns(ns)

    def observe(self, histogram: str, ns: int) -> None:
        with self._lock:
            self.histograms[histogram].observe_ns(ns)

    def error(self, kind: str) -> None:
        with self._lock:
            self.errors[kind] += 1

    def snapshot(self) -> dict:
        self._fold()
        with self._lock:
            return {
                "counters": dict(self.counters),
                "errors": dict(self.errors),
                "latency": {name: h.snapshot() for name, h in self.histograms.items()},
            }

    def report(self, *, node_id: str, l1: Any, tiers: str, redis: dict) -> dict:
        """The `ResponseCache.stats()` dict: counters, errors, L1 occupancy, histograms.

        Args:
            node_id: the cache's node.
            l1: the L1 cache (occupancy).
            tiers: "l1" or "l1+l2".
            redis: health flags of the Redis side (subscribed, available, listener_alive,
                listener_restarts), reported under "redis" beside the counters kept here.
        """
        snap = self.snapshot()
        c = snap["counters"]
        return {
            "node_id": node_id,
            "tiers": tiers,
            "hits": {"l1": c.get("l1_hits", 0), "l2": c.get("l2_hits", 0)},
            "misses": c.get("misses", 0),
            "generations": c.get("generations", 0),
            "coalesced": c.get("coalesced", 0),
            "uncacheable": c.get("uncacheable", 0),
            "bypassed": c.get("bypassed", 0),
            "not_cached_size": c.get("not_cached_size", 0),
            "decode_failures": c.get("decode_failures", 0),
            "bad_generation_values": c.get("bad_generation_values", 0),
            "lease_waits": c.get("lease_waits", 0),
            "errors": snap["errors"],
            "l1": {
                "entries": len(l1),
                "bytes": l1.nbytes,
                "evictions": l1.evictions,
                "expirations": l1.expirations,
                "flushes": l1.flushes,
            },
            "invalidations": {
                "model": c.get("invalidations_model", 0),
                "group": c.get("invalidations_group", 0),
                "events_received": c.get("events_received", 0),
                "events_ignored": c.get("events_ignored", 0),
                "generation_changes_seen": c.get("generation_changes_seen", 0),
                "l2_keys_unlinked": c.get("l2_keys_unlinked", 0),
                "generation_repairs": c.get("generation_repairs", 0),
            },
            "redis": {
                **redis,
                "subscribes": c.get("pubsub_subscribes", 0),
                "skipped": c.get("l2_skipped", 0),
            },
            "latency": snap["latency"],
        }


class RateLimitedLog:
    """At most one log line per error kind per `interval` seconds, counting what it held back.

    Args:
        interval: seconds between two lines of the same kind.
        logger: where lines go.
    """

    def __init__(self, interval: float, logger: logging.Logger = log) -> None:
        self._interval = interval
        self._logger = logger
        self._lock = threading.Lock()
        self._last: dict[str, float] = {}
        self._held: Counter[str] = Counter()

    def warning(self, kind: str, message: str) -> bool:
        """Logs `message` unless a line of this kind went out within the interval.

        Returns:
            Whether the line was logged.
        """
        now = time.monotonic()
        with self._lock:
            last = self._last.get(kind)
            if last is not None and now - last < self._interval:
                self._held[kind] += 1
                return False
            self._last[kind] = now
            held, self._held[kind] = self._held[kind], 0
        suffix = f" ({held} similar messages suppressed)" if held else ""
        self._logger.warning("jkv.response_cache %s: %s%s", kind, message, suffix)
        return True
