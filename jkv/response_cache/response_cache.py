"""The response cache: L1 -> L2 (fill L1) -> the caller's model (fill both), single-flight.

`ResponseCache` is the one object the rest of jkv touches. It knows nothing of JAX and never
calls the model: `lookup` answers a hit or returns a `Miss`, the caller generates, and
`Miss.fill` stores the answer (text, tokens, finish reason, optionally kv_bytes and stats,
which the record keeps for hits to report). Requests never fail because of the cache: Redis
errors degrade to L1 and the model (see `l2.py`), values that do not decode are misses, and a
model whose generation counter is unreadable bypasses the cache; only bad input raises
(`ValueError`), and only the admin operations (`invalidate_*`) raise when Redis is unreachable.

Levels a lookup reports: "l1", "l2", "coalesced" (this call waited for another thread's
identical request) or None (this call generated).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping
from typing import Any

from jkv.response_cache import keys as K
from jkv.response_cache.clusters import ClusterIdFn
from jkv.response_cache.codec import Record, decode, encode, fields_of
from jkv.response_cache.config import CacheConfig, MiB
from jkv.response_cache.invalidation import (
    CleanupJob,
    Generations,
    Invalidator,
    Listener,
    check_cluster_id,
)
from jkv.response_cache.l1 import L1Cache
from jkv.response_cache.l2 import RedisTier
from jkv.response_cache.metrics import Metrics, RateLimitedLog
from jkv.response_cache.miss import Lookup, Miss
from jkv.response_cache.singleflight import SingleFlight, wait_for_peer

_NAMES_MEMO_MAX = 1024
_WATCH_NS = 1_000_000_000  # how often requests check that the listener thread lives


class ResponseCache:
    """Two-tier cache of deterministic LLM responses.

    Args:
        redis_url: L2 location (redis://, rediss://, unix://); None for L1 only.
        namespace: the tenant; part of every key's hash.
        l1_max_entries: L1 capacity in entries.
        l1_max_bytes: L1 capacity in encoded bytes.
        ttl: L2 time to live in whole seconds.
        l1_ttl: L1 time to live in seconds.
        max_value_bytes: larger responses are returned but not cached.
        node_id: this process's identity (default: host-pid-random).
        embedder: prompt -> vector; with `clusterer`, gives each entry its group id.
        clusterer: vector -> cluster id (e.g. a fitted `KMeansClusterer`).
        **options: further `CacheConfig` fields (timeouts, lease and refresh intervals...).

    Raises:
        ValueError: any bad setting, named.
    """

    def __init__(
        self,
        redis_url: str | None = None,
        *,
        namespace: str = "default",
        l1_max_entries: int = 1000,
        l1_max_bytes: int = 64 * MiB,
        ttl: int = 3600,
        l1_ttl: float = 300.0,
        max_value_bytes: int = 1 * MiB,
        node_id: str | None = None,
        embedder: Callable[[Any], Any] | None = None,
        clusterer: Any = None,
        **options: Any,
    ) -> None:
        unknown = set(options) - set(CacheConfig.__dataclass_fields__)
        if unknown:
            raise ValueError(f"unknown ResponseCache options {sorted(unknown)}")
        config = CacheConfig(
            redis_url=redis_url,
            namespace=namespace,
            l1_max_entries=l1_max_entries,
            l1_max_bytes=l1_max_bytes,
            ttl=ttl,
            l1_ttl=l1_ttl,
            max_value_bytes=max_value_bytes,
            node_id=node_id,
            **options,
        )
        if (embedder is None) != (clusterer is None):
            raise ValueError(
                f"embedder={embedder!r} and clusterer={clusterer!r}: give both or neither"
            )
        if clusterer is not None and not callable(getattr(clusterer, "assign", None)):
            raise ValueError(f"clusterer={clusterer!r} has no assign(vector) method")
        self.config = config
        self._namespace = config.namespace  # read on every request: one attribute, not two
        self._group_fn = ClusterIdFn(embedder, clusterer) if embedder is not None else None
        self._metrics = Metrics()
        self._errlog = RateLimitedLog(config.log_interval)
        self._l1 = L1Cache(config.l1_max_entries, config.l1_max_bytes, config.l1_ttl)
        self._l2 = RedisTier(config, self._metrics, self._errlog) if config.redis_url else None
        self._gens = Generations(self._l2)
        self._inv = Invalidator(config, self._l1, self._l2, self._gens, self._metrics)
        self._flights = SingleFlight()
        self._hasher = K.KeyHasher(config.normalize_whitespace)
        self._names: set[str] = set()
        self._closed = False
        self._listener = None
        self._watch_at = 0
        if self._l2 is not None:
            self._listener = Listener(self._l2, self._inv, config, self._metrics, self._errlog)
            self._listener.start()

    # -- keys ----------------------------------------------------------------------------

    def settings(self, settings: Mapping[str, Any]) -> K.Settings:
        """The validated, encoded form of `settings`: pass it instead of the mapping to skip
        that work on every call with the same settings.

        Raises:
            ValueError: a setting of an unsupported type, a non-str key, or NaN/inf.
        """
        return self._hasher.settings(settings)

    def _check_name(self, model_name: str) -> None:
        if model_name not in self._names:
            K.check_model_name(model_name)
            if len(self._names) < _NAMES_MEMO_MAX:
                self._names.add(model_name)

    def _key(
        self,
        model_name: str,
        model_version: str,
        prompt: K.Prompt,
        settings: Mapping[str, Any],
        now: int,
    ) -> tuple[str, int] | None:
        """A request's key and generation; None (and counted) when it is not cached: not
        deterministic, or the model's generation unknown. `now` is the request's
        `perf_counter_ns`, for the listener's health check.

        One method on purpose: it is most of an L1 hit, where each call level costs.
        """
        if self._closed:
            self._check_open()
        if now >= self._watch_at:
            self._watch_at = now + _WATCH_NS
            self._watch()
        if type(settings) is not K.Settings:
            settings = self._hasher.settings(settings)
        if model_name not in self._names:
            self._check_name(model_name)
        if type(model_version) is not str:
            K.check_model_version(model_version)
        if not settings.cacheable:
            self._metrics.inc("uncacheable")
            return None
        digest = self._hasher.digest(self._namespace, model_version, prompt, settings)
        gen = self._gens[model_name]
        if gen is None:
            self._metrics.inc("bypassed")
            return None
        return K.RESPONSE_KEY.format(model_name, int(digest[:2], 16) % K.BUCKETS, gen, digest), gen

    def key(
        self, model_name: str, model_version: str, prompt: K.Prompt, settings: Mapping[str, Any]
    ) -> str | None:
        """The Redis key this request maps to now (for inspection and tests); None when it is
        not cached (not deterministic, or the model's generation counter in Redis is
        unreadable).

        Raises:
            ValueError: bad model name, version, prompt or settings.
        """
        keyed = self._key(model_name, model_version, prompt, settings, time.perf_counter_ns())
        return None if keyed is None else keyed[0]

    def _watch(self) -> None:
        if self._listener is not None:
            self._listener.revive()

    # -- lookups -------------------------------------------------------------------------

    def get(
        self, model_name: str, model_version: str, prompt: K.Prompt, settings: Mapping[str, Any]
    ) -> Lookup | None:
        """Looks a request up in L1, then L2 (filling L1). Never generates.

        Args:
            model_name: the served model's name (jkv passes `params.name`).
            model_version: the model's identity (jkv passes `params.identity`: weights,
                tokenizer and config).
            prompt: token ids, or a str (exact; whitespace-normalised when the cache was
                built with `normalize_whitespace=True`).
            settings: every output-affecting setting (see `keys.py`), a mapping or a
                `Settings` (faster).

        Returns:
            The hit, or None on a miss, for a non-deterministic request, or while the model's
            generation is unknown.

        Raises:
            ValueError: bad model name, version, prompt or settings.
        """
        t0 = time.perf_counter_ns()
        keyed = self._key(model_name, model_version, prompt, settings, t0)
        if keyed is None:
            return None
        found = self._lookup(keyed[0], model_name, t0)
        if found is None:
            self._metrics.inc("misses")
        return found

    def _lookup(self, key: str, model_name: str, t0: int) -> Lookup | None:
        """L1, then L2 (filling L1); counts the hit and the lookup's latency."""
        record, level, event = self._l1.get(key), "l1", "l1_hits"
        if record is None:
            record, level, event = self._l2_fetch(key, model_name), "l2", "l2_hits"
        if record is None:
            self._metrics.observe("get_seconds", time.perf_counter_ns() - t0)
            return None
        self._metrics.inc_observe(event, "get_seconds", time.perf_counter_ns() - t0)
        return Lookup(record, level)

    def _l2_fetch(self, key: str, model_name: str) -> Record | None:
        if self._l2 is None:
            return None
        data = self._l2.get(key)
        if data is None:
            return None
        try:
            record = decode(data)
        except Exception as e:  # CodecError, or any surprise: stored bytes never fail a request
            self._metrics.inc("decode_failures")
            self._errlog.warning("decode", f"dropping unreadable value at {key}: {e}")
            self._l2.delete(key)
            return None
        self._l1.put(key, record, len(data), model_name)
        return record

    # -- fills ---------------------------------------------------------------------------

    def put(
        self,
        model_name: str,
        model_version: str,
        prompt: K.Prompt,
        settings: Mapping[str, Any],
        result: Any,
        *,
        group_id: int | None = None,
    ) -> Record:
        """Stores a generated response in L1 and L2.

        Args:
            model_name, model_version, prompt, settings: as in `get`.
            result: a mapping or object with `text`, `tokens`, `finish_reason` and optionally
                `kv_bytes` and `stats` (kept for hits to report).
            group_id: the entry's knowledge group; default: from the embedder, else None.

        Returns:
            The record (also when it was not stored: non-deterministic, too large, or the
            model's generation unknown).

        Raises:
            ValueError: bad input or a malformed result.
        """
        keyed = self._key(model_name, model_version, prompt, settings, time.perf_counter_ns())
        record = self._record(prompt, model_version, result, group_id, embed=keyed is not None)
        if keyed is not None:
            self._store(*keyed, model_name, record)
        return record

    def _record(
        self, prompt: Any, model_version: str, result: Any, group_id: Any, embed: bool = True
    ) -> Record:
        text, tokens, finish_reason, kv_bytes, stats = fields_of(result)
        if group_id is not None:
            check_cluster_id(group_id)
        elif embed and self._group_fn is not None:  # an uncached answer needs no group
            try:
                group_id = check_cluster_id(self._group_fn(prompt))
            except Exception as e:  # a broken embedder costs grouping, never the answer
                self._metrics.error("embedder")
                self._errlog.warning("embedder", f"group id failed: {type(e).__name__}: {e}")
                group_id = None
        return Record(
            text, tokens, finish_reason, model_version, group_id, time.time(), kv_bytes, stats
        )

    def _store(self, key: str, gen: int, model_name: str, record: Record) -> None:
        data = encode(record)
        if len(data) > self.config.max_value_bytes:
            self._metrics.inc("not_cached_size")
            return
        self._l1.put(key, record, len(data), model_name)
        if self._l2 is not None:
            gid = record.group_id
            bucket = K.bucket_of(key[-64:])  # the digest ends the key
            group = K.group_key(model_name, gen, gid, bucket) if gid is not None else None
            self._l2.put(key, data, group)

    # -- lookup, then fill: the generation happens between them, in the caller -------------

    def lookup(
        self,
        model_name: str,
        model_version: str,
        prompt: K.Prompt,
        settings: Mapping[str, Any],
        *,
        coalesce: bool = True,
        group_id: int | None = None,
    ) -> Lookup | Miss:
        """Looks a request up; on a miss, returns the `Miss` to fill once the caller has
        generated the answer. The cache never calls the model.

        With `coalesce`, identical concurrent misses generate once: the first caller gets the
        `Miss`, the others wait for its fill (their `Lookup` says "coalesced"); across nodes a
        Redis lease lets one node generate while the others wait for its L2 write. The caller
        of a coalescing `Miss` must fill or abandon it (`with miss:` abandons on an
        exception); `coalesce=False` (a stream, a batch, a server that must not block)
        joins no flight.

        Args:
            model_name, model_version, prompt, settings: as in `get`.
            coalesce: join (or lead) this key's flight.
            group_id: the entry's knowledge group (as in `put`).

        Returns:
            `Lookup(record, level)` (level "l1", "l2" or "coalesced"), or a `Miss`.

        Raises:
            ValueError: bad input.
            Exception: what the leader of a coalesced flight abandoned it with.
        """
        t0 = time.perf_counter_ns()
        keyed = self._key(model_name, model_version, prompt, settings, t0)

        def record(result) -> Record:  # a fill's record, stored when the request is cached
            made = self._record(prompt, model_version, result, group_id, embed=keyed is not None)
            if keyed is not None:
                self._store(*keyed, model_name, made)
            return made

        miss = Miss(record, self._metrics, cached=keyed is not None)
        if keyed is None:  # not cacheable, or the generation unknown: the caller generates
            return miss
        key = keyed[0]
        # L2 before joining a flight: a hit then costs no flight bookkeeping, and a
        # thundering herd only costs parallel GETs, never a second generation.
        found = self._lookup(key, model_name, t0)
        if found is not None:
            return found
        if not coalesce:
            self._metrics.inc("misses")
            return miss
        flight, leader = self._flights.begin(key)
        if not leader:
            self._metrics.inc("coalesced")
            return Lookup(flight.wait().record, "coalesced")
        miss.on_release(lambda result, error: self._flights.finish(key, flight, result, error))
        try:
            found = self._claim(miss, key, model_name)
        except BaseException as e:  # Redis, a bug: the waiters learn of it too
            miss.abandon(e)
            raise
        if found is not None:
            miss.abandon(found=found)
        return miss if found is None else found

    def _claim(self, miss: Miss, key: str, model_name: str) -> Lookup | None:
        """The leader's checks before it generates: a flight that finished since the miss
        filled L1; a peer node holding the lease fills L2 (waited for). None: generate."""
        record = self._l1.get(key)
        if record is not None:
            self._metrics.inc("l1_hits")
            return Lookup(record, "l1")
        self._metrics.inc("misses")
        if self._l2 is None:
            return None
        lkey, owner = K.lease_key(key), self.config.node_id
        try_lease = lambda: self._l2.acquire_lease(lkey, owner, self.config.lease_ms)
        got = try_lease()
        if got is False:
            self._metrics.inc("lease_waits")
            record, got = wait_for_peer(
                lambda: self._l2_fetch(key, model_name), try_lease, self.config.lease_wait
            )
            if record is not None:
                self._metrics.inc("l2_hits")
                return Lookup(record, "l2")
        if got:  # the previous holder may have filled L2 just before releasing
            miss.on_release(lambda *_: self._l2.release_lease(lkey, owner))
            record = self._l2_fetch(key, model_name)
            if record is not None:
                self._metrics.inc("l2_hits")
                return Lookup(record, "l2")
        return None

    def get_or_generate(
        self,
        model_name: str,
        model_version: str,
        prompt: K.Prompt,
        settings: Mapping[str, Any],
        generate_fn: Callable[[], Any],
        *,
        group_id: int | None = None,
    ) -> Lookup:
        """`lookup`, then on a miss `generate_fn()` and the fill: for callers whose model is
        a plain function (jkv's own callers generate between `lookup` and `Miss.fill`).

        Args:
            model_name, model_version, prompt, settings: as in `get`.
            generate_fn: () -> mapping or object with `text`, `tokens`, `finish_reason`.
            group_id: as in `put`.

        Returns:
            `Lookup(record, level)`, level "l1" / "l2" / None (generated now) / "coalesced".

        Raises:
            ValueError: bad input or a malformed generate result.
            Exception: whatever `generate_fn` raised (also raised in every waiter of the
                same flight; nothing is cached).
        """
        found = self.lookup(model_name, model_version, prompt, settings, group_id=group_id)
        if isinstance(found, Lookup):
            return found
        with found:
            return Lookup(found.fill(generate_fn()), None)

    # -- invalidation ---------------------------------------------------------------------

    def invalidate_model(self, model_name: str) -> CleanupJob:
        """Makes every cached response of a model unreachable now, on every node.

        Bumps the model's generation (INCR), drops L1 everywhere (Pub/Sub), and deletes the
        old keys in a background thread (SCAN + UNLINK); `.wait()` on the returned job to
        block until they are gone.

        Raises:
            ValueError: a bad model name.
            CacheUnavailableError: Redis unreachable (this node's L1 is still dropped).
        """
        self._check_open()
        return self._inv.invalidate_model(model_name)

    def invalidate_group(self, model_name: str, cluster_id: int) -> int:
        """Deletes one embedding group's responses from L2 and every node's L1.

        Returns:
            How many L2 keys were unlinked.

        Raises:
            ValueError: a bad model name or cluster id.
            CacheUnavailableError: Redis unreachable (this node's L1 is still dropped).
        """
        self._check_open()
        return self._inv.invalidate_group(model_name, cluster_id)

    # -- introspection and lifetime ----------------------------------------------------------

    def stats(self) -> dict:
        """Counters, errors by kind, L1 occupancy and latency histograms as a plain dict.

        `stats()["redis"]["listener_alive"]` is the health of the invalidation listener (a
        dead one is restarted here and by requests; `listener_restarts` counts that).
        """
        if not self._closed:
            self._watch()
        listener = self._listener
        return self._metrics.report(
            node_id=self.config.node_id,
            l1=self._l1,
            tiers="l1+l2" if self._l2 is not None else "l1",
            redis={
                "subscribed": bool(listener and listener.connected),
                "available": bool(self._l2 and self._l2.available),
                "listener_alive": bool(listener and listener.alive),
                "listener_restarts": listener.restarts if listener else 0,
            },
        )

    def _check_open(self) -> None:
        if self._closed:
            raise RuntimeError("this ResponseCache is closed")

    def close(self, timeout: float = 5.0) -> None:
        """Stops the listener, waits (bounded) for cleanups, closes connections. Idempotent."""
        if self._closed:
            return
        self._closed = True
        if self._listener is not None:
            self._listener.stop()
        self._inv.wait_cleanups(timeout)
        if self._l2 is not None:
            self._l2.close()

    def __enter__(self) -> ResponseCache:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
