"""Redis URLs: one server (`redis://`, `rediss://`, `unix://`) or a Redis Cluster
(`redis+cluster://host:port,host:port/?password=...`, `rediss+cluster://` for TLS).

A cluster URL lists startup nodes: any live one is enough for redis-py's `RedisCluster` to
learn the whole topology (CLUSTER SLOTS) and follow it through failovers. Credentials go in
the netloc of the first node (`redis+cluster://user:pass@h1:7000,h2:7001`) and apply to all.
A database number is refused: a cluster has only database 0.

`redis` is imported only by `connect`, so validating a URL stays light.
"""

from __future__ import annotations

from typing import Any, NamedTuple
from urllib.parse import parse_qs, unquote, urlsplit

SINGLE_SCHEMES = ("redis", "rediss", "unix")
CLUSTER_SCHEMES = ("redis+cluster", "rediss+cluster")
_EXAMPLE = "redis://localhost:6379/0 or redis+cluster://h1:7000,h2:7001"


class ClusterURL(NamedTuple):
    """A parsed cluster URL."""

    nodes: list[tuple[str, int]]
    ssl: bool
    username: str | None
    password: str | None


def is_cluster(url: str) -> bool:
    """Whether `url` names a Redis Cluster (a `+cluster` scheme)."""
    return url.split("://", 1)[0] in CLUSTER_SCHEMES


def check_redis_url(url: object) -> str:
    """Validates a Redis URL's shape (not its reachability).

    Raises:
        ValueError: not a str, an unknown scheme, no host, a bad port; for a cluster, a node
            that is not host:port, or a database other than 0.
    """
    if not isinstance(url, str):
        raise ValueError(f"redis_url={url!r} must be a str such as {_EXAMPLE}")
    scheme = url.split("://", 1)[0] if "://" in url else ""
    if scheme in CLUSTER_SCHEMES:
        parse_cluster_url(url)
        return url
    parts = urlsplit(url)
    if parts.scheme not in SINGLE_SCHEMES:
        raise ValueError(
            f"redis_url={url!r} must start with redis://, rediss://, unix://, "
            f"redis+cluster:// or rediss+cluster:// (got scheme {parts.scheme!r})"
        )
    if parts.scheme != "unix" and not parts.hostname:
        raise ValueError(f"redis_url={url!r} has no host")
    if parts.scheme == "unix" and not parts.path:
        raise ValueError(f"redis_url={url!r} has no socket path")
    if parts.scheme != "unix" and "," in parts.netloc:
        raise ValueError(f"redis_url={url!r} lists several hosts: a cluster is redis+cluster://")
    try:
        parts.port  # noqa: B018 -- raises on a bad port
    except ValueError:
        raise ValueError(f"redis_url={url!r} has an invalid port") from None
    return url


def parse_cluster_url(url: str) -> ClusterURL:
    """`redis+cluster://[user:pass@]h1:p1,h2:p2[/0][?password=...]` -> its parts.

    Raises:
        ValueError: naming the URL and the part that does not parse.
    """
    scheme, _, rest = url.partition("://")
    netloc, _, tail = rest.partition("/")
    path, _, query = tail.partition("?")
    if "?" in netloc:  # no path: the query follows the hosts
        netloc, _, query = netloc.partition("?")
    if path not in ("", "0"):
        raise ValueError(f"redis_url={url!r}: a cluster has only database 0 (got /{path})")
    username = password = None
    if "@" in netloc:
        cred, _, netloc = netloc.rpartition("@")
        user, sep, pw = cred.partition(":")
        username, password = (unquote(user) or None), (unquote(pw) if sep else None)
    options = parse_qs(query)
    if "password" in options:
        password = options["password"][-1]
    nodes = []
    for item in netloc.split(","):
        host, sep, port = item.rpartition(":")
        host = host.strip("[]")
        if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
            raise ValueError(f"redis_url={url!r}: node {item!r} is not host:port (e.g. {_EXAMPLE})")
        nodes.append((host, int(port)))
    return ClusterURL(nodes, scheme == "rediss+cluster", username, password)


def connect(url: str, **options: Any) -> Any:
    """A redis-py client for `url`: `redis.Redis` for one server, `redis.cluster.RedisCluster`
    for a cluster (its slot map is read from the first startup node that answers).

    Args:
        url: as `check_redis_url` accepts.
        **options: socket timeouts, `retry`, `max_connections`... passed to the client (and,
            for a cluster, to every node's pool).

    Raises:
        ValueError: a malformed URL.
        redis.RedisError: a cluster none of whose startup nodes answered.
    """
    import redis

    check_redis_url(url)
    if not is_cluster(url):
        return redis.Redis.from_url(url, **options)
    from redis.cluster import ClusterNode, RedisCluster

    parsed = parse_cluster_url(url)
    # Built with redis-py's default retries: its start (COMMAND on a default node) then skips
    # a dead startup node. The caller's retry policy applies from then on.
    retry = options.pop("retry", None)
    client = RedisCluster(
        startup_nodes=[ClusterNode(h, p) for h, p in parsed.nodes],
        ssl=parsed.ssl,
        username=parsed.username,
        password=parsed.password,
        # A dead shard must not stop the others: keys on live slots keep working.
        require_full_coverage=False,
        **options,
    )
    if retry is not None:
        client.set_retry(retry)
    return client


class ShardedPubSub:
    """A cluster's `ClusterPubSub` behind the calls the listener makes on a plain PubSub:
    `subscribe` is SSUBSCRIBE (a connection to the primary of the channel's slot),
    `get_message` returns its sharded messages with type "message", subscribe replies
    dropped. A connection error is raised, as a plain PubSub raises it."""

    def __init__(self, pubsub: Any) -> None:
        self._pubsub = pubsub

    def subscribe(self, channel: str) -> None:
        self._pubsub.ssubscribe(channel)

    def get_message(self, timeout: float = 0.0) -> dict | None:
        message = self._pubsub.get_sharded_message(ignore_subscribe_messages=True, timeout=timeout)
        if message is None or message.get("type") != "smessage":
            return None
        return {**message, "type": "message"}

    def close(self) -> None:
        self._pubsub.close()
