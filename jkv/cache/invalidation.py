"""Invalidation: model generations, group drops, and the Pub/Sub listener.

Model weights updated (`invalidate_model`):
  1. `INCR llm:gen:{model}`. Every key carries the model's generation, so from this moment
     no node that knows the new generation can read or write an old entry.
  2. The issuing node drops the model's L1 entries and PUBLISHes `{"op": "model", ...}` on
     the channel; every listening node adopts the new generation and drops its L1 entries.
  3. A background thread deletes the old generations' keys and group sets: SCAN MATCH by
     the model's prefix, COUNT `cleanup_batch`, one UNLINK per page. Never KEYS, never
     FLUSHDB; Redis only ever runs short commands. Repeating it is harmless (idempotent).

How nodes learn generations: a node reads a model's counter from Redis the first time it
sees the model, then keeps it in memory. Pub/Sub events update it at once; as a fallback
the listener thread re-reads all known counters every `generation_refresh` seconds (1 s by
default), which bounds staleness when an event is lost. Lookups never wait on Redis for it.

Knowledge refresh (`invalidate_group`): each stored response is SADDed (in the same MULTI as
its SET) to `llm:group:{model}:<generation>:<cluster_id>`, a set with its own TTL. The set is
RENAMEd aside, its members UNLINKed page by page (SSCAN), and `{"op": "group", ...}` is
published so every node drops that group's L1 entries.

Lost channel: when the listener's connection breaks it resubscribes with backoff and, once
subscribed again, re-reads the generations and flushes the whole L1, since events may have
been missed meanwhile. Until then L1 keeps serving; `l1_ttl` caps how stale it can be.
"""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Callable

from jkv.cache import keys as K
from jkv.cache.config import CacheConfig
from jkv.cache.l1 import L1Cache
from jkv.cache.l2 import CacheUnavailableError, RedisTier
from jkv.cache.metrics import Metrics, RateLimitedLog, log

EVENT_VERSION = 1


def check_cluster_id(cluster_id: object) -> int:
    """Validates an embedding-cluster id: an int >= 0.

    Raises:
        ValueError: anything else (bools included).
    """
    if isinstance(cluster_id, bool) or not isinstance(cluster_id, int) or cluster_id < 0:
        raise ValueError(f"cluster_id={cluster_id!r} must be an integer >= 0")
    return cluster_id


class Generations:
    """This node's view of each model's generation counter."""

    def __init__(self, l2: RedisTier | None) -> None:
        self._l2 = l2
        self._gens: dict[str, int] = {}
        self._epoch = 0  # bumped by every event, so a refresh can tell it raced one

    def current(self, model: str) -> int:
        """The model's generation; the first sight of a model reads Redis (0 if unavailable)."""
        gen = self._gens.get(model)
        if gen is not None:
            return gen
        if self._l2 is None:
            return self._gens.setdefault(model, 0)
        values = self._l2.generations([K.generation_key(model)])
        if values is None:
            return 0  # not remembered: the next lookup asks again
        return self._gens.setdefault(model, values[0])

    def adopt(self, model: str, gen: int) -> None:
        """Takes the generation an event carries. Events arrive in publish order, and a lower
        number than ours means Redis was reset, so the event wins either way."""
        self._epoch += 1
        self._gens[model] = gen

    def refresh(self) -> list[str]:
        """Re-reads every known counter from Redis (the truth, even if lower than ours).

        A round during which an event arrived is discarded: its MGET may predate the event.

        Returns:
            The models whose generation changed.
        """
        models = list(self._gens)
        if self._l2 is None or not models:
            return []
        epoch = self._epoch
        values = self._l2.generations([K.generation_key(m) for m in models])
        if values is None or epoch != self._epoch:
            return []
        fresh = dict(zip(models, values, strict=True))
        changed = [m for m, g in fresh.items() if self._gens.get(m) != g]
        for m in changed:
            self._gens[m] = fresh[m]
        return changed

    def bump_local(self, model: str) -> int:
        """L1-only mode: a process-local counter stands in for Redis INCR."""
        gen = self._gens.get(model, 0) + 1
        self._gens[model] = gen
        return gen

    def forget(self) -> None:
        """Drops every remembered generation (they are re-read on next use)."""
        self._epoch += 1
        self._gens.clear()


class CleanupJob:
    """The background deletion of a model's old generations.

    Attributes:
        model: the model name.
        generation: the new generation; keys of lower generations are deleted.
        removed: keys unlinked so far (final once `done`).
    """

    def __init__(self, model: str, generation: int, work: Callable[[], int] | None) -> None:
        self.model = model
        self.generation = generation
        self.removed = 0
        self._error: BaseException | None = None
        self._done = threading.Event()
        if work is None:
            self._done.set()
            return
        self._thread = threading.Thread(
            target=self._run, args=(work,), name=f"jkv-cache-cleanup-{model}", daemon=True
        )
        self._thread.start()

    def _run(self, work: Callable[[], int]) -> None:
        try:
            self.removed = work()
        except BaseException as e:  # reported through wait(); the thread must not die loudly
            self._error = e
            log.warning("jkv.cache cleanup of %s failed: %s", self.model, e)
        finally:
            self._done.set()

    @property
    def done(self) -> bool:
        return self._done.is_set()

    def wait(self, timeout: float | None = None) -> int:
        """Waits for the cleanup.

        Returns:
            How many keys were unlinked.

        Raises:
            TimeoutError: not finished within `timeout`.
            CacheUnavailableError: Redis failed during the cleanup.
        """
        if not self._done.wait(timeout):
            raise TimeoutError(f"cleanup of {self.model!r} not finished after {timeout} s")
        if self._error is not None:
            raise self._error
        return self.removed


class Invalidator:
    """Issues and receives invalidations for one cache instance."""

    def __init__(
        self,
        config: CacheConfig,
        l1: L1Cache,
        l2: RedisTier | None,
        gens: Generations,
        metrics: Metrics,
    ) -> None:
        self._config = config
        self._l1 = l1
        self._l2 = l2
        self._gens = gens
        self._metrics = metrics
        self._jobs: list[CleanupJob] = []

    def invalidate_model(self, model: str) -> CleanupJob:
        """Bumps the model's generation everywhere and deletes its old keys in the background.

        Raises:
            ValueError: a bad model name.
            CacheUnavailableError: Redis unreachable (the local L1 is still dropped).
        """
        K.check_model_name(model)
        self._l1.drop_model(model)
        self._metrics.inc("invalidations_model")
        if self._l2 is None:
            return CleanupJob(model, self._gens.bump_local(model), None)
        l2, batch = self._l2, self._config.cleanup_batch
        gen = l2.incr(K.generation_key(model))
        self._gens.adopt(model, gen)
        self._l1.drop_model(model)  # again: a lookup may have refilled it before adopt
        l2.publish(self._config.channel, self._event("model", model, gen))

        def work() -> int:
            def old(key: bytes, n: int) -> bool:
                g = K.generation_of(key.decode("utf-8", "replace"), n)
                return g is not None and g < gen

            resp = K.response_pattern(model)
            groups = K.group_pattern(model)
            removed = l2.scan_unlink(resp, lambda k: old(k, len(resp) - 1), batch)
            l2.scan_unlink(groups, lambda k: old(k, len(groups) - 1), batch)
            self._metrics.inc("l2_keys_unlinked", removed)
            return removed

        job = CleanupJob(model, gen, work)
        self._jobs = [j for j in self._jobs if not j.done] + [job]
        return job

    def invalidate_group(self, model: str, cluster_id: int) -> int:
        """Deletes one embedding group's entries in L2 and on every node's L1.

        Returns:
            How many L2 keys were unlinked.

        Raises:
            ValueError: a bad model name or cluster id.
            CacheUnavailableError: Redis unreachable (the local L1 is still dropped).
        """
        K.check_model_name(model)
        check_cluster_id(cluster_id)
        self._l1.drop_group(model, cluster_id)
        self._metrics.inc("invalidations_group")
        if self._l2 is None:
            return 0
        gen = self._l2.read_int(K.generation_key(model))
        removed = self._l2.drain_set(
            K.group_key(model, gen, cluster_id), self._config.cleanup_batch
        )
        self._l1.drop_group(model, cluster_id)
        self._l2.publish(self._config.channel, self._event("group", model, gen, cluster_id))
        self._metrics.inc("l2_keys_unlinked", removed)
        return removed

    def _event(self, op: str, model: str, gen: int, group: int | None = None) -> str:
        event = {"v": EVENT_VERSION, "op": op, "model": model, "gen": gen}
        if group is not None:
            event["group"] = group
        event["node"] = self._config.node_id
        return json.dumps(event, separators=(",", ":"))

    def handle(self, data: bytes | str) -> None:
        """Applies one received event to this node (its own events are harmless repeats)."""
        try:
            event = json.loads(data)
            op, model = event["op"], K.check_model_name(event["model"])
            gen = int(event["gen"])
            if event.get("v") != EVENT_VERSION or op not in ("model", "group"):
                raise ValueError(f"unknown event {event!r}")
            group = check_cluster_id(event["group"]) if op == "group" else None
        except (ValueError, KeyError, TypeError) as e:
            self._metrics.inc("events_ignored")
            log.warning("jkv.cache ignored invalidation event %r: %s", data[:200], e)
            return
        self._metrics.inc("events_received")
        if op == "model":
            self._gens.adopt(model, gen)
            self._l1.drop_model(model)
        else:
            self._l1.drop_group(model, group)

    def on_subscribed(self) -> None:
        """After (re)subscribing: events may have been missed, so re-learn and flush L1."""
        self._gens.forget()
        self._l1.clear()

    def tick(self) -> None:
        """Periodic fallback: re-read generations, drop L1 of models whose one changed."""
        for model in self._gens.refresh():
            self._l1.drop_model(model)
            self._metrics.inc("generation_changes_seen")

    def wait_cleanups(self, timeout: float | None = None) -> None:
        """Waits for running cleanups (best effort, errors already logged)."""
        deadline = None if timeout is None else time.monotonic() + timeout
        for job in self._jobs:
            left = None if deadline is None else max(0.0, deadline - time.monotonic())
            job._done.wait(left)


class Listener:
    """The Pub/Sub listener thread: applies events, resubscribes, runs the periodic tick.

    Args:
        l2: the Redis tier (its pool settings are reused for the subscription).
        invalidator: applies events and reacts to (re)subscription.
        config: channel name, refresh interval.
        metrics: counts subscriptions and errors.
        errlog: rate-limited error log.
    """

    def __init__(
        self,
        l2: RedisTier,
        invalidator: Invalidator,
        config: CacheConfig,
        metrics: Metrics,
        errlog: RateLimitedLog,
    ) -> None:
        self._l2 = l2
        self._inv = invalidator
        self._config = config
        self._metrics = metrics
        self._errlog = errlog
        self._stop = threading.Event()
        self._pubsub = None
        self.connected = False
        self._thread = threading.Thread(target=self._run, name="jkv-cache-listener", daemon=True)

    def start(self) -> None:
        """Subscribes once synchronously (bounded by the connect timeout), then runs."""
        self._subscribe()
        self._thread.start()

    def _subscribe(self) -> bool:
        pubsub = self._l2.pubsub()
        try:
            pubsub.subscribe(self._config.channel)
        except Exception as e:  # redis errors and OSError; keep the thread alive
            self._metrics.error("pubsub")
            self._errlog.warning("pubsub", f"subscribe failed: {type(e).__name__}: {e}")
            _close_quietly(pubsub)
            return False
        self._pubsub = pubsub
        self._inv.on_subscribed()
        self.connected = True
        self._metrics.inc("pubsub_subscribes")
        return True

    def _run(self) -> None:
        pause = 0.05
        next_tick = time.monotonic() + self._config.generation_refresh
        while not self._stop.is_set():
            if self._pubsub is None:
                if self._subscribe():
                    pause = 0.05
                else:
                    self._stop.wait(pause)
                    pause = min(pause * 2, 1.0)
            else:
                try:
                    message = self._pubsub.get_message(timeout=0.1)
                except Exception as e:  # a lost connection: resubscribe and flush
                    self.connected = False
                    self._metrics.error("pubsub")
                    self._errlog.warning("pubsub", f"connection lost: {type(e).__name__}: {e}")
                    _close_quietly(self._pubsub)
                    self._pubsub = None
                    continue
                if message is not None and message.get("type") == "message":
                    self._inv.handle(message["data"])
            if time.monotonic() >= next_tick:
                self._inv.tick()
                next_tick = time.monotonic() + self._config.generation_refresh
        if self._pubsub is not None:
            _close_quietly(self._pubsub)
        self.connected = False

    def stop(self, timeout: float = 2.0) -> None:
        """Stops the thread (it notices within about 0.1 s)."""
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout)


def _close_quietly(pubsub) -> None:
    try:
        pubsub.close()
    except Exception:  # closing a broken connection may raise; nothing to do about it
        pass


__all__ = [
    "CacheUnavailableError",
    "CleanupJob",
    "Generations",
    "Invalidator",
    "Listener",
    "check_cluster_id",
]
