"""The server's KV contexts (`POST /v1/contexts`): a prompt prefilled once, compressed by its KV
policy, answered after many times (`context: "<id>"` in a completion's or chat's body).

Plain Python, thread-safe. A context belongs to its API key's tenant (another tenant's id is
not found) and lives until its `ttl` runs out or it is deleted. Its KV (a `jkv.KVContext`) is
kept in host RAM, least recently used first out when the store passes `host_bytes`; a context
whose KV left RAM keeps its token ids and KV settings, so the next request that names it
prefills it again (`Entry.kv` None: only slower, never lost while its TTL lasts). Each tenant's
contexts count against `tenant_bytes` by their KV's bytes, wherever the KV is.
"""

from __future__ import annotations

import dataclasses
import secrets
import threading
import time
from collections import OrderedDict

from jkv.serve import openai as oa

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
    recomputed: int = 0  # ... found evicted, prefilled again
    evicted: int = 0  # KVs dropped from host RAM for room
    expired: int = 0


class ContextStore:
    def __init__(self, host_bytes: int, tenant_bytes: int | None = None, clock=time.time):
        for name, value in (("host_bytes", host_bytes), ("tenant_bytes", tenant_bytes)):
            if value is not None and (isinstance(value, bool) or not isinstance(value, int)
                                      or value < 0):  # fmt: skip
                raise ValueError(f"{name}={value!r}: expected an int >= 0")
        self.host_bytes, self.tenant_bytes, self.clock = host_bytes, tenant_bytes, clock
        self._entries: dict[str, Entry] = {}
        self._in_ram: OrderedDict[str, int] = OrderedDict()  # id -> bytes, least recent first
        self._lock = threading.Lock()
        self.stats = ContextStats()

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
        return entry

    def get(self, context_id, tenant) -> Entry:
        """The tenant's context `context_id` (404 if it has none of that id, or it expired)."""
        with self._lock:
            self._expire()
            entry = self._entries.get(context_id) if isinstance(context_id, str) else None
            if entry is None or entry.tenant != tenant:
                raise oa.APIError(
                    404,
                    f"context {context_id!r:.80} not found (never created, deleted, expired, or "
                    "another API key's)",
                    param="context",
                    code="context_not_found",
                )
            if entry.kv is not None:
                self._in_ram.move_to_end(entry.id)
            return entry

    def take(self, entry: Entry):
        """`entry`'s KV if it is in host RAM (a hit), else None (the caller prefills it
        again and `put`s it back)."""
        with self._lock:
            kv = entry.kv
            if kv is not None:
                self.stats.hits += 1
                if entry.id in self._in_ram:
                    self._in_ram.move_to_end(entry.id)
            else:
                self.stats.recomputed += 1
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
