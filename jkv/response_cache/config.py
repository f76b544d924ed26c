"""The response cache's settings, validated once."""

from __future__ import annotations

import dataclasses
import math
import os
import socket
import uuid

from jkv.response_cache.connect import check_redis_url
from jkv.response_cache.keys import check_namespace

MiB = 1 << 20
__all__ = ["CacheConfig", "MiB", "check_redis_url"]


def _positive(name: str, value: object, *, integer: bool = False) -> None:
    ok_type = isinstance(value, int) if integer else isinstance(value, int | float)
    if isinstance(value, bool) or not ok_type or not math.isfinite(value) or value <= 0:
        kind = "a positive integer" if integer else "a positive finite number"
        raise ValueError(f"{name}={value!r} must be {kind}")


@dataclasses.dataclass(frozen=True, kw_only=True)
class CacheConfig:
    """Everything tunable about a `ResponseCache`. Times are in seconds unless named `_ms`.

    Attributes:
        redis_url: L2 location (one server, or a cluster: `redis+cluster://h:p,h:p`, see
            `connect.py`); None means L1 only (embedded mode).
        namespace: the tenant; part of every key's hash.
        normalize_whitespace: hash str prompts whitespace-normalised (the seed's canonical
            hash), for callers whose model cannot see whitespace; default: exactly as given.
        l1_max_entries: L1 capacity in entries (default 1000).
        l1_max_bytes: L1 capacity in encoded-value bytes.
        ttl: L2 time to live, whole seconds (`SET ... EX ttl`), also for group sets.
        l1_ttl: L1 time to live; caps staleness if an invalidation message is missed.
        max_value_bytes: larger encoded values are not cached (counted in stats).
        node_id: this process's identity in leases and invalidation events.
        connect_timeout: Redis socket connect timeout.
        op_timeout: Redis per-operation socket timeout.
        max_connections: connection-pool bound.
        lease_ms: cross-node single-flight lease lifetime.
        lease_wait: how long a node waits for a peer's lease before generating itself.
        generation_refresh: how often the listener re-reads model generation counters.
        breaker_backoff: first pause of L2 after a connection error (doubles up to 2 s).
        log_interval: at most one log line per error kind per this many seconds.
        channel: the Pub/Sub channel of invalidation events.
        cleanup_batch: SCAN COUNT and UNLINK batch size of invalidation cleanups.
        admin_retry: on a cluster, how long admin calls (invalidations) retry through a
            failover before raising (a replica takes over in seconds); one server: no retry.
    """

    redis_url: str | None = None
    namespace: str = "default"
    normalize_whitespace: bool = False
    l1_max_entries: int = 1000
    l1_max_bytes: int = 64 * MiB
    ttl: int = 3600
    l1_ttl: float = 300.0
    max_value_bytes: int = 1 * MiB
    node_id: str | None = None
    connect_timeout: float = 0.1
    op_timeout: float = 0.2
    max_connections: int = 64
    lease_ms: int = 30_000
    lease_wait: float = 30.0
    generation_refresh: float = 1.0
    breaker_backoff: float = 0.25
    log_interval: float = 10.0
    channel: str = "llm:invalidate"
    cleanup_batch: int = 1000
    admin_retry: float = 15.0

    def __post_init__(self) -> None:
        if self.redis_url is not None:
            check_redis_url(self.redis_url)
        check_namespace(self.namespace)
        if not isinstance(self.normalize_whitespace, bool):
            raise ValueError(f"normalize_whitespace={self.normalize_whitespace!r}: True or False")
        for name in ("l1_max_entries", "l1_max_bytes", "ttl", "max_value_bytes"):
            _positive(name, getattr(self, name), integer=True)
        for name in ("max_connections", "lease_ms", "cleanup_batch"):
            _positive(name, getattr(self, name), integer=True)
        for name in ("l1_ttl", "connect_timeout", "op_timeout", "lease_wait"):
            _positive(name, getattr(self, name))
        for name in ("generation_refresh", "breaker_backoff", "log_interval", "admin_retry"):
            _positive(name, getattr(self, name))
        if not isinstance(self.channel, str) or not self.channel:
            raise ValueError(f"channel={self.channel!r} must be a non-empty str")
        if self.node_id is None:
            node = f"{socket.gethostname()}-{os.getpid()}-{uuid.uuid4().hex[:8]}"
            object.__setattr__(self, "node_id", node)
        elif not isinstance(self.node_id, str) or not self.node_id:
            raise ValueError(f"node_id={self.node_id!r} must be a non-empty str or None")
