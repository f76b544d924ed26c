"""L2: the shared Redis tier (one server or a Redis Cluster), never allowed to fail or stall a
request.

Request-path calls (`get`, `put`, `delete`, leases, generation reads) swallow Redis errors:
they count the error by kind, log it at a bounded rate, and open a small circuit breaker so
that while Redis is down requests skip L2 at once instead of each paying a connect timeout.
The breaker lets one call through after a pause (0.25 s doubling to 2 s); the first success
closes it, so reconnection is automatic and needs no restart. redis-py's own retries are
off: a slow Redis must cost at most one short socket timeout.

Admin calls (`incr_generation`, `publish`, the cleanups) raise `CacheUnavailableError`
instead: an invalidation that silently did nothing would serve stale answers.

Values read from Redis are never trusted: a generation counter that is not a decimal integer
(anyone can `SET llm:gen:{model} oops`) reads as unknown (None), is counted and logged, and
`incr_generation` overwrites it.

Redis Cluster (`redis+cluster://` URLs, `connect.py`): the same calls through redis-py's
`RedisCluster`, which follows MOVED redirects and re-reads the slot map after a connection
error. Differences, all kept here:
- one breaker per hash tag (`{model:bucket}`), not one for the whole tier: a dead shard
  skips only the buckets it serves, the others keep their hits;
- admin calls retry connection errors for up to `admin_retry` seconds (15 by default): a
  killed primary's replica takes over within the cluster's node timeout plus an election;
- `incr_generation` runs `WAIT 1` after the INCR on the same connection, so a bump survives
  its primary's failover (asynchronous replication would otherwise lose it, and the old
  entries would become readable again); a bump no replica acknowledged is logged;
- invalidation events go over sharded Pub/Sub (SPUBLISH / SSUBSCRIBE, Redis 7): to the shard
  of the channel's slot only, not broadcast over the whole cluster bus;
- SCAN walks every primary (`scan_iter`), and multi-key UNLINK / MGET are split by slot.

`redis` is imported here, lazily, so `import jkv.response_cache` stays light.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable
from typing import Any

from jkv.response_cache.config import CacheConfig
from jkv.response_cache.connect import ShardedPubSub, connect, is_cluster
from jkv.response_cache.keys import parse_generation
from jkv.response_cache.metrics import Metrics, RateLimitedLog

_BREAKER_MAX_S = 2.0
_FAILED = object()
# Compare-and-delete: only the lease's owner may release it.
_RELEASE_LUA = """
if redis.call("GET", KEYS[1]) == ARGV[1] then
  return redis.call("DEL", KEYS[1])
end
return 0
"""
# INCR, or, when the value cannot be counted (not an integer, negative, another type), SET it
# to ARGV[1]: an invalidation must also repair the counter. Returns {generation, repaired}.
_INCR_LUA = """
local n = redis.pcall("INCR", KEYS[1])
if type(n) == "number" and n >= 0 then
  return {n, 0}
end
redis.call("SET", KEYS[1], ARGV[1])
return {tonumber(ARGV[1]), 1}
"""


class CacheUnavailableError(ConnectionError):
    """Redis could not be reached for an operation that must not silently do nothing."""


class RedisTier:
    """A pooled redis-py client with short timeouts, error accounting and a breaker.

    Args:
        config: the cache settings (URL, timeouts, pool size, breaker pause, log interval).
        metrics: where errors are counted.
        errlog: the rate-limited logger.
    """

    def __init__(self, config: CacheConfig, metrics: Metrics, errlog: RateLimitedLog) -> None:
        import redis
        from redis.backoff import NoBackoff
        from redis.retry import Retry

        self._config = config
        self._metrics = metrics
        self._errlog = errlog
        self._redis_mod = redis
        self.cluster = is_cluster(config.redis_url)
        try:  # one server connects lazily; a cluster reads its slot map now
            self.client = connect(
                config.redis_url,
                socket_connect_timeout=config.connect_timeout,
                socket_timeout=config.op_timeout,
                retry=Retry(NoBackoff(), 0),
                max_connections=config.max_connections,
            )
        except (redis.RedisError, redis.exceptions.RedisClusterException) as e:
            raise CacheUnavailableError(
                f"redis_url={config.redis_url!r}: no node of this Redis Cluster answered with "
                f"its slot map ({type(e).__name__}: {e})"
            ) from None
        self._pool = None if self.cluster else self.client.connection_pool
        self._release = self.client.register_script(_RELEASE_LUA)
        self._incr = self.client.register_script(_INCR_LUA)
        # The breakers: hash tag (None: the whole tier, one server) -> [retry_at, pause].
        self._open: dict[str | None, list[float]] = {}

    # -- error handling ------------------------------------------------------------------

    def _kind(self, exc: BaseException) -> str:
        r = self._redis_mod
        if isinstance(exc, r.TimeoutError | TimeoutError):
            return "timeout"
        if isinstance(exc, r.ConnectionError | ConnectionError | OSError):
            return "connection"
        if isinstance(exc, r.exceptions.ClusterDownError | r.exceptions.SlotNotCoveredError):
            return "cluster_down"
        if isinstance(exc, r.ResponseError):
            return "response"
        return "redis"

    def _tag(self, key: str | bytes) -> str | None:
        """The breaker a key belongs to: its hash tag on a cluster, None on one server."""
        if not self.cluster:
            return None
        if isinstance(key, bytes):
            key = key.decode("utf-8", "replace")
        start = key.find("{")
        end = key.find("}", start + 1)
        return key[start : end + 1] if start >= 0 and end > start + 1 else key

    def _failed(self, op: str, exc: BaseException, tag: str | None = None) -> str:
        kind = self._kind(exc)
        self._metrics.error(kind)
        if kind in ("timeout", "connection", "cluster_down"):
            state = self._open.setdefault(tag, [0.0, self._config.breaker_backoff])
            state[0] = time.monotonic() + state[1]
            state[1] = min(state[1] * 2, _BREAKER_MAX_S)
        self._errlog.warning(kind, f"redis {op} failed: {type(exc).__name__}: {exc}")
        return kind

    def _ok(self, tag: str | None = None) -> None:
        if self._open:
            self._open.pop(tag, None)

    def _closed(self, tag: str | None) -> bool:
        state = self._open.get(tag)
        return state is None or time.monotonic() >= state[0]

    @property
    def available(self) -> bool:
        """False while a breaker is open (Redis, or on a cluster one shard, recently failed)."""
        now = time.monotonic()
        return all(now >= state[0] for state in list(self._open.values()))

    def _safe(self, op: str, fn: Callable[[], Any], default: Any = None, tag=None) -> Any:
        if self._open and not self._closed(tag):
            self._metrics.inc("l2_skipped")
            return default
        try:
            value = fn()
        except (self._redis_mod.RedisError, OSError) as e:
            self._failed(op, e, tag)
            return default
        self._ok(tag)
        return value

    def _must(self, op: str, fn: Callable[[], Any]) -> Any:
        """An admin call: raises CacheUnavailableError when Redis fails; on a cluster it first
        retries connection errors for up to `admin_retry` seconds (a failover)."""
        r = self._redis_mod
        deadline = time.monotonic() + (self._config.admin_retry if self.cluster else 0.0)
        while True:
            try:
                value = fn()
                break
            except (r.RedisError, OSError) as e:
                kind = self._failed(op, e)
                retry = kind in ("timeout", "connection", "cluster_down") or isinstance(
                    e, r.exceptions.MovedError
                )
                if not retry or time.monotonic() >= deadline:
                    raise CacheUnavailableError(
                        f"redis {op} failed ({kind}) at {self._config.redis_url}: {e}"
                    ) from None
                self.refresh_topology()
                time.sleep(0.2)
        self._ok()
        return value

    def refresh_topology(self) -> None:
        """A cluster re-reads its slot map (after a failover); nothing on one server."""
        if self.cluster:
            try:
                self.client.nodes_manager.initialize()
            except (self._redis_mod.RedisError, OSError):
                pass  # no startup node answered: the next call tries again

    # -- request path --------------------------------------------------------------------

    def get(self, key: str) -> bytes | None:
        """The stored bytes, or None on a miss or when Redis is unavailable."""
        if self._open or self.cluster:  # a breaker was tripped, or a cluster: the generic path
            return self._safe("GET", lambda: self._get(key), tag=self._tag(key))
        try:
            return self._get(key)
        except (self._redis_mod.RedisError, OSError) as e:
            self._failed("GET", e)
            return None

    def _get(self, key: str) -> bytes | None:
        """GET on a pooled connection, as `Redis.execute_command` does it minus the retry
        wrapper (retries are off) and the event hooks: a third of an L2 hit's cost on a
        loopback Redis. The pool still checks a connection before lending it. A cluster
        routes the key itself."""
        pool = self._pool
        if pool is None:
            return self.client.get(key)
        conn = pool.get_connection()
        try:
            conn.send_command("GET", key)
            return conn.read_response()
        except BaseException:
            conn.disconnect()  # a half-read reply must never answer the next command
            raise
        finally:
            pool.release(conn)

    def put(self, key: str, value: bytes, group_key: str | None) -> bool:
        """SET with EX, and SADD to the group set (with its own EX) in one MULTI.

        Returns:
            Whether Redis accepted it.
        """
        ttl = self._config.ttl

        def write() -> bool:
            pipe = self.client.pipeline(transaction=group_key is not None)
            pipe.set(key, value, ex=ttl)
            if group_key is not None:
                pipe.sadd(group_key, key)
                pipe.expire(group_key, ttl)
            pipe.execute()
            return True

        return bool(self._safe("SET", write, False, tag=self._tag(key)))

    def delete(self, key: str) -> None:
        """UNLINK one key (a value that failed to decode)."""
        self._safe("UNLINK", lambda: self.client.unlink(key), tag=self._tag(key))

    def acquire_lease(self, key: str, owner: str, ttl_ms: int) -> bool | None:
        """`SET key owner NX PX ttl_ms`. Returns True/False, None when Redis is unavailable."""
        lease = lambda: self.client.set(key, owner, nx=True, px=ttl_ms)
        got = self._safe("SET NX", lease, _FAILED, tag=self._tag(key))
        return None if got is _FAILED else bool(got)

    def release_lease(self, key: str, owner: str) -> None:
        """Deletes the lease only if `owner` still holds it."""
        release = lambda: self._release(keys=[key], args=[owner])
        self._safe("EVALSHA", release, tag=self._tag(key))

    def generations(self, keys: list[str]) -> list[int | None] | None:
        """MGET of generation counters: absent is 0, an unreadable value None (counted and
        logged); the whole answer is None when Redis (a cluster: any counter's shard) is
        unavailable."""
        mget = self.client.mget_nonatomic if self.cluster else self.client.mget
        tag = self._tag(keys[0]) if len(keys) == 1 else None
        values = self._safe("MGET", lambda: mget(keys), tag=tag)
        if values is None:
            return None
        return [self._generation(key, value) for key, value in zip(keys, values, strict=True)]

    def _generation(self, key: str, value: bytes | None) -> int | None:
        gen = parse_generation(value)
        if gen is None:
            self._metrics.inc("bad_generation_values")
            self._errlog.warning(
                "generation",
                f"{key} holds {value[:40]!r}, not a generation counter: the model's cache is "
                "bypassed until invalidate_model repairs it",
            )
        return gen

    def ping(self) -> bool:
        """Whether Redis answers now (ignores the breaker)."""
        try:
            self.client.ping()
        except (self._redis_mod.RedisError, OSError):
            return False
        self._ok()
        return True

    # -- admin path (raises CacheUnavailableError) -----------------------------------------

    def incr_generation(self, key: str, repair: int) -> tuple[int, bool]:
        """INCR a generation counter; one INCR cannot count is SET to `repair` instead.

        Returns:
            (the new generation, whether the counter was repaired).
        """
        if not self.cluster:
            gen, repaired = self._must("INCR", lambda: self._incr(keys=[key], args=[repair]))
            return int(gen), bool(repaired)
        (gen, repaired), acked = self._must("INCR+WAIT", lambda: self._incr_wait(key, repair))
        if not acked:
            self._metrics.error("unreplicated")
            self._errlog.warning(
                "unreplicated",
                f"{key} = {gen}: no replica acknowledged it; a failover of its primary now "
                "could lose this invalidation (run it again after one)",
            )
        return int(gen), bool(repaired)

    def _incr_wait(self, key: str, repair: int) -> tuple[list, int]:
        """The INCR script and `WAIT 1 <ms>` in one pipeline on the key's primary: WAIT counts
        the replicas that have this connection's writes."""
        node = self.client.get_node_from_key(key)
        pipe = self.client.get_redis_connection(node).pipeline(transaction=False)
        pipe.eval(_INCR_LUA, 1, key, repair)
        pipe.execute_command("WAIT", 1, max(1, int(self._config.op_timeout * 750)))
        counted, acked = pipe.execute()
        return counted, int(acked)

    def read_generation(self, key: str) -> int | None:
        """GET a generation counter (absent = 0; unreadable = None, counted and logged)."""
        return self._generation(key, self._must("GET", lambda: self.client.get(key)))

    def publish(self, channel: str, message: str) -> int:
        """PUBLISH (a cluster: SPUBLISH), returning how many subscribers received it."""
        send = self.client.spublish if self.cluster else self.client.publish
        return int(self._must("PUBLISH", lambda: send(channel, message)))

    def scan_unlink(self, pattern: str, doomed: Callable[[bytes], bool], batch: int) -> int:
        """UNLINKs every key matching `pattern` for which `doomed(key)` holds.

        SCAN pages of COUNT `batch` (on a cluster, on every primary), doomed keys UNLINKed
        `batch` at a time, so Redis never runs a long command (never KEYS, never FLUSHDB).

        Returns:
            How many keys were unlinked.
        """

        def run() -> int:
            removed, doomed_keys = 0, []
            for key in self.client.scan_iter(match=pattern, count=batch):  # every primary
                if doomed(key):
                    doomed_keys.append(key)
                if len(doomed_keys) >= batch:
                    removed += self._unlink(doomed_keys)
                    doomed_keys = []
            return removed + self._unlink(doomed_keys)

        return int(self._must("SCAN/UNLINK", run))

    def scan_keys(self, pattern: str, batch: int) -> list[str]:
        """Every key matching `pattern`, SCAN page by page (COUNT `batch`)."""

        def run() -> list[str]:
            found = self.client.scan_iter(match=pattern, count=batch)
            return [k.decode("utf-8", "replace") for k in found]

        return self._must("SCAN", run)

    def drain_set(self, set_key: str, batch: int) -> int:
        """UNLINKs every member of a set and then the set, SSCAN page by page.

        The set is first RENAMEd to a private name, so members added meanwhile go to a
        fresh set and are not lost from tracking.

        Returns:
            How many member keys were unlinked.
        """
        r = self._redis_mod

        def run() -> int:
            private = f"{set_key}:draining:{self._config.node_id}:{time.time_ns()}"
            try:
                self.client.rename(set_key, private)
            except r.ResponseError:  # no such key: nothing tracked
                return 0
            removed, cursor = 0, 0
            while True:
                cursor, members = self.client.sscan(private, cursor=cursor, count=batch)
                removed += self._unlink(members)
                if cursor == 0:
                    break
            self.client.unlink(private)
            return removed

        return int(self._must("SSCAN/UNLINK", run))

    def _unlink(self, keys: Iterable[bytes]) -> int:
        keys = list(keys)
        return int(self.client.unlink(*keys)) if keys else 0

    def pubsub(self) -> Any:
        """A new redis-py PubSub on this pool's settings; a cluster's speaks sharded Pub/Sub
        behind the same `subscribe` / `get_message` (`connect.ShardedPubSub`)."""
        if self.cluster:
            return ShardedPubSub(self.client.pubsub())
        return self.client.pubsub(ignore_subscribe_messages=True)

    def close(self) -> None:
        """Closes the pool's connections."""
        try:
            self.client.close()
        except (self._redis_mod.RedisError, OSError):
            pass
