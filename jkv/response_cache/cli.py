"""`jkv cache ...`: inspect the shared cache and invalidate a model or an embedding group.

    jkv cache stats [--redis-url URL]        (URL: redis://h:p/0 or redis+cluster://h:p,h:p)
    jkv cache invalidate-model MODEL --redis-url URL
    jkv cache invalidate-group MODEL CLUSTER_ID --redis-url URL

Exit codes: 0 done, 2 bad input (one line naming the value), 1 Redis unreachable (one
line). Results are printed as one JSON object.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import sys
from typing import Any

from jkv.response_cache import keys as K
from jkv.response_cache.config import CacheConfig, check_redis_url
from jkv.response_cache.connect import connect
from jkv.response_cache.invalidation import check_cluster_id
from jkv.response_cache.l2 import CacheUnavailableError
from jkv.response_cache.response_cache import ResponseCache

_SCAN_COUNT = 1000


def add_subcommands(subparsers: Any) -> argparse.ArgumentParser:
    """Registers `cache` and its subcommands on an argparse subparsers object.

    Args:
        subparsers: what `ArgumentParser.add_subparsers()` returned.

    Returns:
        The `cache` parser (its default `func` is `run`).
    """
    cache = subparsers.add_parser("cache", help="inspect or invalidate the response cache")
    sub = cache.add_subparsers(dest="cache_command", required=True, metavar="COMMAND")
    stats = sub.add_parser("stats", help="generations and key counts per model in Redis")
    stats.add_argument("--redis-url", help="e.g. redis://localhost:6379/0; omit for defaults")
    model = sub.add_parser("invalidate-model", help="drop every cached response of a model")
    model.add_argument("model", help="model name, as in the keys (params.name)")
    model.add_argument("--redis-url", required=True, help="e.g. redis://localhost:6379/0")
    group = sub.add_parser("invalidate-group", help="drop one embedding cluster's responses")
    group.add_argument("model", help="model name, as in the keys (params.name)")
    group.add_argument("cluster_id", help="embedding-cluster id, an integer >= 0")
    group.add_argument("--redis-url", required=True, help="e.g. redis://localhost:6379/0")
    cache.set_defaults(func=run)
    return cache


def run(args: argparse.Namespace) -> int:
    """Runs a parsed `jkv cache ...` command.

    Returns:
        0 on success, 2 on bad input, 1 when Redis is unreachable.
    """
    quiet = logging.getLogger("jkv.response_cache")
    level, quiet.level = quiet.level, logging.ERROR  # failures are reported below, once
    try:
        if args.cache_command == "stats":
            result = _stats(args.redis_url)
        elif args.cache_command == "invalidate-model":
            result = _invalidate_model(args.model, args.redis_url)
        else:
            result = _invalidate_group(args.model, args.cluster_id, args.redis_url)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except (CacheUnavailableError, ConnectionError, TimeoutError) as e:
        print(f"error: Redis unreachable at {args.redis_url}: {_one_line(e)}", file=sys.stderr)
        return 1
    finally:
        quiet.setLevel(level)
    print(json.dumps(result, indent=2, sort_keys=True))
    return 0


def _one_line(e: BaseException) -> str:
    return " ".join(str(e).split()) or type(e).__name__


def _invalidate_model(model: str, url: str) -> dict:
    K.check_model_name(model)
    check_redis_url(url)
    with ResponseCache(url, node_id="jkv-cli") as cache:
        job = cache.invalidate_model(model)
        removed = job.wait()
    return {"model": model, "generation": job.generation, "removed": removed}


def _invalidate_group(model: str, cluster_id: str, url: str) -> dict:
    K.check_model_name(model)
    if not cluster_id.isdigit():
        raise ValueError(f"cluster_id={cluster_id!r} must be an integer >= 0")
    gid = check_cluster_id(int(cluster_id))
    check_redis_url(url)
    with ResponseCache(url, node_id="jkv-cli") as cache:
        removed = cache.invalidate_group(model, gid)
    return {"model": model, "cluster_id": gid, "removed": removed}


def _stats(url: str | None) -> dict:
    defaults = dataclasses.asdict(CacheConfig(node_id="jkv-cli"))
    defaults.pop("node_id")
    if url is None:
        return {"redis": None, "defaults": defaults}
    check_redis_url(url)
    import redis

    client = connect(url, socket_connect_timeout=1.0, socket_timeout=5.0)
    try:
        models: dict[str, dict] = {}
        for raw in client.scan_iter(match="llm:gen:*", count=_SCAN_COUNT):
            name = raw.decode("utf-8", "replace")[len("llm:gen:{") : -1]
            # None: a value no node can read (the model's cache is bypassed until repaired)
            models.setdefault(name, {})["generation"] = K.parse_generation(client.get(raw))
        for raw in client.scan_iter(match=K.PREFIX + "*", count=_SCAN_COUNT):
            tag, sep, rest = raw.decode("utf-8", "replace")[len(K.PREFIX) + 1 :].partition("}:")
            name, colon, _bucket = tag.rpartition(":")
            if not sep or not colon:  # not a key jkv wrote: nothing to count it under
                continue
            counts = models.setdefault(name, {}).setdefault("keys_by_generation", {})
            gen = rest.split(":", 1)[0]
            counts[gen] = counts.get(gen, 0) + 1
        memory = _used_memory(client.info("memory"))
    except (redis.ConnectionError, redis.TimeoutError, redis.exceptions.ClusterError) as e:
        raise CacheUnavailableError(_one_line(e)) from None
    finally:
        client.close()
    for entry in models.values():
        entry.setdefault("generation", 0)
        entry.setdefault("keys_by_generation", {})
    return {"redis": url, "used_memory_bytes": memory, "models": models, "defaults": defaults}


def _used_memory(info: dict) -> int:
    """`INFO memory`'s used_memory; a cluster answers per node ({node: info}): their sum."""
    if "used_memory" in info:
        return int(info["used_memory"])
    return sum(int(v.get("used_memory", 0)) for v in info.values() if isinstance(v, dict))
