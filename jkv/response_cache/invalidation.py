"""Invalidation: model generations, group drops, and the Pub/Sub listener.

Model weights updated (`invalidate_model`):
  1. `INCR llm:gen:{model}` (on a cluster, then `WAIT 1` on that primary: see l2.py). Every key
     carries the model's generation, so from this moment no
     node that knows the new generation can read or write an old entry.
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
its SET) to `llm:group:{model:<bucket>}:<generation>:<cluster_id>`, a set with its own TTL,
in the response's bucket (so one slot holds both). Each bucket's set is RENAMEd aside, its
members UNLINKed page by page (SSCAN), and `{"op": "group", ...}` is published so every node
drops that group's L1 entries.

Lost channel: when the listener's connection breaks it resubscribes with backoff and, once
subscribed again, re-reads the generations and flushes the whole L1, since events may have
been missed meanwhile. Until then L1 keeps serving; `l1_ttl` caps how stale it can be.

On a Redis Cluster the channel is sharded (SSUBSCRIBE on the primary of its slot). A failover
of that primary breaks every listener's connection at once: each re-reads the slot map and
resubscribes to the new primary (within the failover time plus at most 1 s of backoff), and
flushes its L1 as above. So an event lost in a failover leaves a node stale for at most that
long: model invalidations sooner still, since the generation refresh reads the counter from
its own shard every `generation_refresh` seconds whatever happens to the channel; `l1_ttl`
remains the bound if the cluster never recovers. An invalidation whose PUBLISH failed raises
(`CacheUnavailableError`, after `admin_retry` seconds): run it again.

Bad content: a generation counter that is not an integer makes the model's generation
unknown (None): the node drops the model's L1 entries and bypasses both tiers for it (a key
needs the generation) until the counter reads well again; `invalidate_model` repairs it. A
message that does not parse is counted and ignored. Whatever still escapes restarts the
listener's loop (with a resubscription, hence an L1 flush); should the thread itself die,
`Listener.revive` starts a new one (the cache calls it from requests and `stats()`).
"""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Callable

from jkv.response_cache import keys as K
from jkv.response_cache.config import CacheConfig
from jkv.response_cache.l1 import L1Cache
from jkv.response_cache.l2 import CacheUnavailableError, RedisTier
from jkv.response_cache.metrics import Metrics, RateLimitedLog, log

EVENT_VERSION = 1
_UNSEEN = object()


def check_cluster_id(cluster_id: object) -> int:
    """Validates an embedding-cluster id: an int >= 0.

    Raises:
        ValueError: anything else (bools included).
    """
    if isinstance(cluster_id, bool) or not isinstance(cluster_id, int) or cluster_id < 0:
        raise ValueError(f"cluster_id={cluster_id!r} must be an integer >= 0")
    return cluster_id


class Generations(dict):
    """This node's view of each model's generation counter: `gens[model]` is the generation,
    or None while Redis holds an unreadable counter for the model (unknown).

    A dict, so the lookup every request makes is one C call; the first sight of a model reads
    Redis (`__missing__`; 0, not remembered, while Redis is unavailable).
    """

    def __init__(self, l2: RedisTier | None) -> None:
        super().__init__()
        self._l2 = l2
        self._epoch = 0  # bumped by every event, so a refresh can tell it raced one

    def __missing__(self, model: str) -> int | None:
        if self._l2 is None:
            return self.setdefault(model, 0)
        values = self._l2.generations([K.generation_key(model)])
        if values is None:
            return 0  # not remembered: the next lookup asks again
        return self.setdefault(model, values[0])

    def current(self, model: str) -> int | None:
        """`self[model]`, spelled as a method for readers."""
        return self[model]

    def adopt(self, model: str, gen: int) -> None:
        """Takes the generation an event carries. Events arrive in publish order, and a lower
        number than ours means Redis was reset, so the event wins either way."""
        self._epoch += 1
        self[model] = gen

    def refresh(self) -> list[str]:
        """Re-reads every known counter from Redis (the truth, even if lower than ours).

        A round during which an event arrived is discarded: its MGET may predate the event.

        Returns:
            The models whose generation changed (to or from unknown included).
        """
        models = list(self)
        if self._l2 is None or not models:
            return []
        epoch = self._epoch
        values = self._l2.generations([K.generation_key(m) for m in models])
        if values is None or epoch != self._epoch:
            return []
        fresh = dict(zip(models, values, strict=True))
        changed = [m for m, g in fresh.items() if self.get(m, _UNSEEN) != g]
        for m in changed:
            self[m] = fresh[m]
        return changed

    def bump_local(self, model: str) -> int:
        """L1-only mode: a process-local counter stands in for Redis INCR."""
        gen = (self.get(model) or 0) + 1
        self[model] = gen
        return gen

    def forget(self) -> None:
        """Drops every remembered generation (they are re-read on next use)."""
        self._epoch += 1
        self.clear()


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
            log.warning("jkv.response_cache cleanup of %s failed: %s", self.model, e)
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
        # A counter INCR cannot count is replaced by the time in ms: above any generation
        # an INCR-ed counter reaches, so every older key is below it and gets cleaned.
        gen, repaired = l2.incr_generation(K.generation_key(model), time.time_ns() // 10**6)
        if repaired:
            self._metrics.inc("generation_repairs")
            log.warning(
                "jkv.response_cache repaired the generation counter of %s (now %d)", model, gen
            )
        self._gens.adopt(model, gen)
        self._l1.drop_model(model)  # again: a lookup may have refilled it before adopt
        l2.publish(self._config.channel, self._event("model", model, gen))

        def work() -> int:
            def old(key: bytes) -> bool:
                g = K.generation_of(key.decode("utf-8", "replace"))
                return g is not None and g < gen

            removed = l2.scan_unlink(K.response_pattern(model), old, batch)
            l2.scan_unlink(K.group_pattern(model), old, batch)
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
        gen = self._l2.read_generation(K.generation_key(model))
        if gen is None:  # the current generation is unknown: drain the group's set in all
            sets = self._l2.scan_keys(
                K.group_pattern(model, cluster_id), self._config.cleanup_batch
            )
        else:
            sets = K.group_keys(model, gen, cluster_id)  # one per bucket
        removed = sum(self._l2.drain_set(key, self._config.cleanup_batch) for key in sets)
        self._l1.drop_group(model, cluster_id)
        self._l2.publish(self._config.channel, self._event("group", model, gen or 0, cluster_id))
        self._metrics.inc("l2_keys_unlinked", removed)
        return removed

    def _event(self, op: str, model: str, gen: int, group: int | None = None) -> str:
        event = {"v": EVENT_VERSION, "op": op, "model": model, "gen": gen}
        if group is not None:
            event["group"] = group
        event["node"] = self._config.node_id
        return json.dumps(event, separators=(",", ":"))

    def handle(self, data: bytes | str) -> None:
        """Applies one received event to this node (its own events are harmless repeats).

        Anyone may publish on the channel: a message that is not a well-formed event (any
        exception while reading it, RecursionError from deep JSON included) is ignored.
        """
        try:
            event = json.loads(data)
            op, model = event["op"], K.check_model_name(event["model"])
            gen = event["gen"]
            if event.get("v") != EVENT_VERSION or op not in ("model", "group"):
                raise ValueError(f"unknown event {event!r:.200}")
            if type(gen) is not int or gen < 0:
                raise ValueError(f"gen={gen!r:.40} must be an integer >= 0")
            group = check_cluster_id(event["group"]) if op == "group" else None
        except Exception as e:
            self._metrics.inc("events_ignored")
            log.warning("jkv.response_cache ignored invalidation event %r: %s", data[:200], e)
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

    Attributes:
        connected: subscribed now.
        restarts: threads started after one died (`revive`).
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
        self._revive_lock = threading.Lock()
        self._pubsub = None
        self._thread = self._new_thread()
        self.connected = False
        self.restarts = 0

    def _new_thread(self) -> threading.Thread:
        return threading.Thread(target=self._run, name="jkv-cache-listener", daemon=True)

    def start(self) -> None:
        """Subscribes once synchronously (bounded by the connect timeout), then runs."""
        self._subscribe()
        self._thread.start()

    @property
    def alive(self) -> bool:
        """Whether the thread runs (the health flag of `ResponseCache.stats()`)."""
        return self._thread.is_alive()

    def revive(self) -> bool:
        """Starts a new thread if the running one died (not if it was stopped).

        Events may have been missed while no thread listened, so the L1 is flushed and the
        generations forgotten at once; the new thread resubscribes.

        Returns:
            Whether a new thread was started.
        """
        with self._revive_lock:  # two requests may notice the death at once
            if self._stop.is_set() or self._thread.is_alive():
                return False
            self._drop_subscription()
            self._inv.on_subscribed()
            self.restarts += 1
            self._errlog.warning("listener", "the listener thread had died: started a new one")
            self._thread = self._new_thread()
            self._thread.start()
            return True

    def _subscribe(self) -> bool:
        pubsub = self._l2.pubsub()
        try:
            pubsub.subscribe(self._config.channel)
        except Exception as e:  # redis errors and OSError; keep the thread alive
            self._metrics.error("pubsub")
            self._errlog.warning("pubsub", f"subscribe failed: {type(e).__name__}: {e}")
            _close_quietly(pubsub)
            self._l2.refresh_topology()  # a cluster's channel may have a new primary
            return False
        self._pubsub = pubsub
        self._inv.on_subscribed()
        self.connected = True
        self._metrics.inc("pubsub_subscribes")
        return True

    def _drop_subscription(self) -> None:
        self.connected = False
        if self._pubsub is not None:
            _close_quietly(self._pubsub)
            self._pubsub = None

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                self._serve()
            except Exception as e:  # a bug or a surprise must not end invalidation
                self._metrics.error("listener")
                self._errlog.warning("listener", f"loop failed: {type(e).__name__}: {e}")
                self._drop_subscription()  # resubscribing flushes L1: events may be lost
                self._stop.wait(0.05)
        self._drop_subscription()

    def _serve(self) -> None:
        """Receives events and ticks until stopped; raises on anything unexpected."""
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
                    self._metrics.error("pubsub")
                    self._errlog.warning("pubsub", f"connection lost: {type(e).__name__}: {e}")
                    self._drop_subscription()
                    continue
                if message is not None and message.get("type") == "message":
                    self._inv.handle(message["data"])
            if time.monotonic() >= next_tick:
                self._inv.tick()
                next_tick = time.monotonic() + self._config.generation_refresh

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
