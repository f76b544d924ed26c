"""L2: the shared Redis tier, never allowed to fail or stall a request.

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

`redis` is imported here, lazily, so `import jkv.response_cache` stays light.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable
from typing import Any

from jkv.response_cache.config import CacheConfig
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
        self.client = redis.Redis.from_url(
            config.redis_url,
            socket_connect_timeout=config.connect_timeout,
            socket_timeout=config.op_timeout,
            retry=Retry(NoBackoff(), 0),
            max_connections=config.max_connections,
        )
        self._pool = self.client.connection_pool
        self._release = self.client.register_script(_RELEASE_LUA)
        self._incr = self.client.register_script(_INCR_LUA)
        self._retry_at = 0.0
        self._pause = config.breaker_backoff

    # -- error handling ------------------------------------------------------------------

    def _kind(self, exc: BaseException) -> str:
        r = self._redis_mod
        if isinstance(exc, r.TimeoutError | TimeoutError):
            return "timeout"
        if isinstance(exc, r.ConnectionError | ConnectionError | OSError):
            return "connection"
        if isinstance(exc, r.ResponseError):
            return "response"
        return "redis"

    def _failed(self, op: str, exc: BaseException) -> str:
        kind = self._kind(exc)
        self._metrics.error(kind)
        if kind in ("timeout", "connection"):
            self._retry_at = time.monotonic() + self._pause
            self._pause = min(self._pause * 2, _BREAKER_MAX_S)
        self._errlog.warning(kind, f"redis {op} failed: {type(exc).__name__}: {exc}")
        return kind

    def _ok(self) -> None:
        if self._retry_at:
            self._retry_at = 0.0
            self._pause = self._config.breaker_backoff

    @property
    def available(self) -> bool:
        """False while the breaker is open (Redis recently failed)."""
        return not self._retry_at or time.monotonic() >= self._retry_at

    def _safe(self, op: str, fn: Callable[[], Any], default: Any = None) -> Any:
        if not self.available:
            self._metrics.inc("l2_skipped")
            return default
        try:
            value = fn()
        except (self._redis_mod.RedisError, OSError) as e:
            self._failed(op, e)
            return default
        self._ok()
        return value

    def _must(self, op: str, fn: Callable[[], Any]) -> Any:
        try:
            value = fn()
        except (self._redis_mod.RedisError, OSError) as e:
            kind = self._failed(op, e)
            raise CacheUnavailableError(
                f"redis {op} failed ({kind}) at {self._config.redis_url}: {e}"
            ) from None
        self._ok()
        return value

    # -- request path --------------------------------------------------------------------

    def get(self, key: str) -> bytes | None:
        """The stored bytes, or None on a miss or when Redis is unavailable."""
        if self._retry_at:  # the breaker was tripped: the generic path handles it
            return self._safe("GET", lambda: self._get(key))
        try:
            return self._get(key)
        except (self._redis_mod.RedisError, OSError) as e:
            self._failed("GET", e)
            return None

    def _get(self, key: str) -> bytes | None:
        """GET on a pooled connection, as `Redis.execute_command` does it minus the retry
        wrapper (retries are off) and the event hooks: a third of an L2 hit's cost on a
        loopback Redis. The pool still checks a connection before lending it."""
        pool = self._pool
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

        return bool(self._safe("SET", write, False))

    def delete(self, key: str) -> None:
        """UNLINK one key (a value that failed to decode)."""
        self._safe("UNLINK", lambda: self.client.unlink(key))

    def acquire_lease(self, key: str, owner: str, ttl_ms: int) -> bool | None:
        """`SET key owner NX PX ttl_ms`. Returns True/False, None when Redis is unavailable."""
        got = self._safe("SET NX", lambda: self.client.set(key, owner, nx=True, px=ttl_ms), _FAILED)
        return None if got is _FAILED else bool(got)

    def release_lease(self, key: str, owner: str) -> None:
        """Deletes the lease only if `owner` still holds it."""
        self._safe("EVALSHA", lambda: self._release(keys=[key], args=[owner]))

    def generations(self, keys: list[str]) -> list[int | None] | None:
        """MGET of generation counters: absent is 0, an unreadable value None (counted and
        logged); the whole answer is None when Redis is unavailable."""
        values = self._safe("MGET", lambda: self.client.mget(keys))
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
        gen, repaired = self._must("INCR", lambda: self._incr(keys=[key], args=[repair]))
        return int(gen), bool(repaired)

    def read_generation(self, key: str) -> int | None:
        """GET a generation counter (absent = 0; unreadable = None, counted and logged)."""
        return self._generation(key, self._must("GET", lambda: self.client.get(key)))

    def publish(self, channel: str, message: str) -> int:
        """PUBLISH, returning how many subscribers received it."""
        return int(self._must("PUBLISH", lambda: self.client.publish(channel, message)))

    def scan_unlink(self, pattern: str, doomed: Callable[[bytes], bool], batch: int) -> int:
        """UNLINKs every key matching `pattern` for which `doomed(key)` holds.

        One SCAN page (COUNT `batch`) at a time, each page's doomed keys in one UNLINK, so
        Redis never runs a long command (never KEYS, never FLUSHDB).

        Returns:
            How many keys were unlinked.
        """

        def run() -> int:
            removed, cursor = 0, 0
            while True:
                cursor, keys = self.client.scan(cursor=cursor, match=pattern, count=batch)
                removed += self._unlink([k for k in keys if doomed(k)])
                if cursor == 0:
                    return removed

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
        """A new redis-py PubSub on this pool's settings."""
        return self.client.pubsub(ignore_subscribe_messages=True)

    def close(self) -> None:
        """Closes the pool's connections."""
        try:
            self.client.close()
        except (self._redis_mod.RedisError, OSError):
            pass
