"""The server's KV contexts (`POST /v1/contexts`): a prompt prefilled once, compressed by its KV
policy, answered after many times (`context: "<id>"` in a completion's or chat's body).

Plain Python, thread-safe. A context belongs to its API key's tenant (another tenant's id is
not found) and lives until its `ttl` runs out or it is deleted. Its KV (a `jkv.KVContext`) is
kept in host RAM, least recently used first out when the store passes `host_bytes`; a context
whose KV left RAM keeps its token ids and KV settings, so the next request that names it
prefills it again (`Entry.kv` None: only slower, never lost while its TTL lasts). Each tenant's
contexts count against `tenant_bytes` by their KV's bytes, wherever the KV is (this server's
contexts: replicas count their own).

With Redis (`RedisContexts`, `jkv serve --redis-url`, a Redis Cluster too), every context is
also written there when it is made: its description (token ids, settings, expiry, the weights'
fingerprint, the KV's size and SHA-256) and its KV's bytes (`KVContext.to_bytes`) in chunks of
`CHUNK` bytes, all with the context's TTL, the tenant in the key. A context not in this
server's RAM is read from there (a replica answers a context another one made), checked
against its size, checksum and weights; a value cut short, corrupted or missing, or Redis down,
is a miss: the context is prefilled again from its token ids. Redis failing never fails a
request (it is logged and counted).
"""

from __future__ import annotations

import dataclasses
import hashlib
import logging
import secrets
import threading
import time
from collections import OrderedDict

import msgpack

from jkv.kv_context import KVContext
from jkv.response_cache.connect import connect
from jkv.serve import openai as oa

LOG = logging.getLogger("jkv.serve")
CHUNK = 8 << 20  # bytes per Redis value of a context's KV (Redis allows 512 MB)

DEFAULT_TTL_S = 3600
MAX_TTL_S = 7 * 24 * 3600


@dataclasses.dataclass
class Entry:
    id: str
    tenant: str | None
    tokens: tuple[int, ...]  # the prompt's token ids (recomputed from them when evicted)
    settings: dict  # the KV settings it was prefilled with (kv_policy, kv_budget)
    kv_policy: str  # the policy's name ("full": none)
    nbytes: int  # its KV's bytes (`KVContext.nbytes`)
    created: int  # Unix seconds
    expires_at: int  # Unix seconds
    kv: object = None  # the `jkv.KVContext` while it is in host RAM, else None
    remote: dict | None = None  # its description as Redis holds it (read there, or written)

    def describe(self) -> dict:
        """The API's context object."""
        return {
            "id": self.id,
            "object": "context",
            "created": self.created,
            "tokens": len(self.tokens),
            "bytes": self.nbytes,
            "kv_policy": self.kv_policy,
            "expires_at": self.expires_at,
        }


@dataclasses.dataclass
class ContextStats:
    created: int = 0
    hits: int = 0  # a request's context found in host RAM
    redis_hits: int = 0  # ... read from Redis
    recomputed: int = 0  # ... in neither: prefilled again
    evicted: int = 0  # KVs dropped from host RAM for room
    expired: int = 0
    refused: int = 0  # Redis values cut short, corrupted or of other weights
    redis_errors: int = 0  # Redis calls that failed (the request went on without it)


class RedisContexts:
    """Contexts in Redis (module docstring): `jkv:ctx:{<id>}:<tenant>` holds the description,
    `...:<i>` the KV's chunks (one hash slot per context: its keys live on one cluster node)."""

    def __init__(self, url: str, weights: str, timeout_s: float = 2.0):
        self.client = connect(url, socket_timeout=timeout_s, socket_connect_timeout=timeout_s)
        self.weights = weights

    @staticmethod
    def _key(context_id: str, tenant) -> str:
        who = hashlib.blake2b(repr(tenant).encode(), digest_size=8).hexdigest()
        return f"jkv:ctx:{{{context_id}}}:{who}"

    def save(self, entry: Entry, blob: bytes, ttl: int) -> None:
        key = self._key(entry.id, entry.tenant)
        chunks = [blob[i : i + CHUNK] for i in range(0, len(blob), CHUNK)] or [b""]
        meta = dict(tokens=list(entry.tokens), settings=entry.settings, kv_policy=entry.kv_policy,
                    nbytes=entry.nbytes, created=entry.created, expires_at=entry.expires_at,
                    weights=self.weights, size=len(blob), chunks=len(chunks),
                    sha256=hashlib.sha256(blob).hexdigest())  # fmt: skip
        pipe = self.client.pipeline(transaction=False)
        for i, chunk in enumerate(chunks):
            pipe.set(f"{key}:{i}", chunk, ex=ttl)
        pipe.set(key, msgpack.packb(meta, use_bin_type=True), ex=ttl)  # last: whole once seen
        pipe.execute()
        entry.remote = meta

    def describe(self, context_id: str, tenant) -> Entry | None:
        """The context's description from Redis (None: not there, or of other weights)."""
        raw = self.client.get(self._key(context_id, tenant))
        if raw is None:
            return None
        meta = msgpack.unpackb(raw, raw=False)
        if meta.get("weights") != self.weights:
            return None
        entry = Entry(
            id=context_id, tenant=tenant, tokens=tuple(meta["tokens"]), settings=meta["settings"],
            kv_policy=meta["kv_policy"], nbytes=meta["nbytes"], created=meta["created"],
            expires_at=meta["expires_at"],
        )  # fmt: skip
        entry.remote = meta
        return entry

    def load(self, entry: Entry) -> bytes | None:
        """The context's KV bytes, whole and as written (None: missing; ValueError: cut short
        or corrupted)."""
        meta = entry.remote
        key = self._key(entry.id, entry.tenant)
        pipe = self.client.pipeline(transaction=False)
        for i in range(meta["chunks"]):
            pipe.get(f"{key}:{i}")
        parts = pipe.execute()
        if any(p is None for p in parts):
            return None
        blob = b"".join(parts)
        if len(blob) != meta["size"] or hashlib.sha256(blob).hexdigest() != meta["sha256"]:
            raise ValueError(f"{len(blob)} bytes whose SHA-256 is not the one written")
        return blob

    def delete(self, entry: Entry) -> None:
        key = self._key(entry.id, entry.tenant)
        chunks = (entry.remote or {}).get("chunks", 1 + entry.nbytes // CHUNK + 1)
        self.client.delete(key, *(f"{key}:{i}" for i in range(chunks)))


class ContextStore:
    def __init__(self, host_bytes: int, tenant_bytes: int | None = None, clock=time.time,
                 redis: RedisContexts | None = None):  # fmt: skip
        for name, value in (("host_bytes", host_bytes), ("tenant_bytes", tenant_bytes)):
            if value is not None and (isinstance(value, bool) or not isinstance(value, int)
                                      or value < 0):  # fmt: skip
                raise ValueError(f"{name}={value!r}: expected an int >= 0")
        self.host_bytes, self.tenant_bytes, self.clock = host_bytes, tenant_bytes, clock
        self._entries: dict[str, Entry] = {}
        self._in_ram: OrderedDict[str, int] = OrderedDict()  # id -> bytes, least recent first
        self._lock = threading.Lock()
        self.stats = ContextStats()
        self.redis = redis

    @property
    def ram_bytes(self) -> int:
        """Bytes of the KVs in host RAM."""
        with self._lock:
            return sum(self._in_ram.values())

    def __len__(self) -> int:
        with self._lock:
            self._expire()
            return len(self._entries)

    def add(self, tenant, tokens, settings, kv_policy: str, kv, ttl: int) -> Entry:
        """Stores a prefilled context (`kv`, a `jkv.KVContext`) for `ttl` seconds; 429 past the
        tenant's byte quota."""
        now = int(self.clock())
        entry = Entry(
            id=f"ctx-{secrets.token_hex(12)}", tenant=tenant, tokens=tuple(tokens),
            settings=dict(settings), kv_policy=kv_policy, nbytes=int(kv.nbytes), created=now,
            expires_at=now + ttl,
        )  # fmt: skip
        with self._lock:
            self._expire()
            if self.tenant_bytes is not None:
                held = sum(e.nbytes for e in self._entries.values() if e.tenant == tenant)
                if held + entry.nbytes > self.tenant_bytes:
                    raise oa.APIError(
                        429,
                        f"this context's KV is {entry.nbytes} bytes and the tenant's contexts "
                        f"hold {held} of its {self.tenant_bytes} "
                        "(--max-context-bytes-per-tenant); delete some or wait for their ttl",
                        type="insufficient_quota",
                        code="context_quota_exceeded",
                    )
            self._entries[entry.id] = entry
            self._keep(entry, kv)
            self.stats.created += 1
        if self.redis is not None:
            self._redis(lambda: self.redis.save(entry, kv.to_bytes(), ttl), "write")
        return entry

    def _redis(self, call, what: str):
        """A Redis call; None (logged, counted) when it fails: Redis never fails a request."""
        try:
            return call()
        except Exception as err:  # noqa: BLE001 - a down or broken Redis is a miss
            self.stats.redis_errors += 1
            LOG.warning("contexts: Redis %s failed (%s: %s)", what, type(err).__name__, err)
            return None

    def get(self, context_id, tenant) -> Entry:
        """The tenant's context `context_id`, from this server or Redis (404 if neither has
        one of that id for this tenant, or it expired)."""
        with self._lock:
            self._expire()
            entry = self._entries.get(context_id) if isinstance(context_id, str) else None
            if entry is not None and entry.tenant == tenant:
                if entry.kv is not None:
                    self._in_ram.move_to_end(entry.id)
                return entry
        entry = None
        if self.redis is not None and isinstance(context_id, str) and context_id.startswith("ctx-"):
            entry = self._redis(lambda: self.redis.describe(context_id, tenant), "read")
        with self._lock:
            if entry is not None and entry.expires_at > self.clock():
                return self._entries.setdefault(entry.id, entry)
        raise oa.APIError(
            404,
            f"context {context_id!r:.80} not found (never created, deleted, expired, or "
            "another API key's)",
            param="context",
            code="context_not_found",
        )

    def take(self, entry: Entry):
        """`entry`'s KV: from host RAM, else from Redis (back into RAM), else None (the caller
        prefills it again and `put`s it back). Call it in a worker thread (Redis)."""
        with self._lock:
            kv = entry.kv
            if kv is not None:
                self.stats.hits += 1
                if entry.id in self._in_ram:
                    self._in_ram.move_to_end(entry.id)
                return kv
        if self.redis is not None and entry.remote is not None:
            kv = self._from_redis(entry)
            if kv is not None:
                self.stats.redis_hits += 1
                self.put(entry, kv)
                return kv
        self.stats.recomputed += 1
        return None

    def _from_redis(self, entry: Entry):
        try:
            blob = self.redis.load(entry)
            if blob is None:
                return None
            kv = KVContext.from_bytes(blob)
        except ValueError as err:  # cut short, corrupted, not a context
            self.stats.refused += 1
            LOG.warning("contexts: %s's KV in Redis refused (%s)", entry.id, err)
            return None
        except Exception as err:  # noqa: BLE001 - Redis down: a miss
            self.stats.redis_errors += 1
            LOG.warning("contexts: Redis read failed (%s: %s)", type(err).__name__, err)
            return None
        if kv.weights != self.redis.weights or kv.tokens != (entry.tokens,):
            self.stats.refused += 1
            return None
        return kv

    def put(self, entry: Entry, kv) -> None:
        """A recomputed KV back into host RAM (if the context still exists)."""
        with self._lock:
            if self._entries.get(entry.id) is entry:
                self._keep(entry, kv)

    def delete(self, context_id, tenant) -> None:
        entry = self.get(context_id, tenant)
        with self._lock:
            self._drop(entry)
        if self.redis is not None:
            self._redis(lambda: self.redis.delete(entry), "delete")

    def _keep(self, entry: Entry, kv) -> None:
        """`kv` into host RAM as `entry`'s, the least recently used others out for room (the
        lock held). A KV larger than the whole store is not kept (recomputed each time)."""
        self._in_ram.pop(entry.id, None)
        entry.kv = None
        if entry.nbytes > self.host_bytes:
            return
        while self._in_ram and sum(self._in_ram.values()) + entry.nbytes > self.host_bytes:
            old, _ = self._in_ram.popitem(last=False)
            self._entries[old].kv = None
            self.stats.evicted += 1
        entry.kv = kv
        self._in_ram[entry.id] = entry.nbytes

    def _drop(self, entry: Entry) -> None:
        self._entries.pop(entry.id, None)
        self._in_ram.pop(entry.id, None)
        entry.kv = None

    def _expire(self) -> None:
        now = self.clock()
        for entry in [e for e in self._entries.values() if e.expires_at <= now]:
            self._drop(entry)
            self.stats.expired += 1


def ttl_of(body: dict) -> int:
    """A body's `ttl` (seconds, default 3600, at most a week), or 400."""
    ttl = body.get("ttl", DEFAULT_TTL_S)
    if isinstance(ttl, bool) or not isinstance(ttl, int) or not 1 <= ttl <= MAX_TTL_S:
        raise oa.bad("ttl", f"ttl={ttl!r:.60}: expected whole seconds in [1, {MAX_TTL_S}]")
    return ttl
