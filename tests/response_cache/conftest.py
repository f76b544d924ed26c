"""Fixtures for the response-cache tests: a real redis-server on a free loopback port, and
cache nodes running in separate processes (`_cache_node.py`)."""

from __future__ import annotations

import json
import os
import select
import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
NODE_SCRIPT = Path(__file__).with_name("_cache_node.py")


@pytest.fixture
def poll():
    """`poll(predicate, within=seconds)`: True as soon as `predicate()` is, else its last value."""

    def wait(predicate, within: float) -> bool:
        deadline = time.monotonic() + within
        while time.monotonic() < deadline:
            if predicate():
                return True
            time.sleep(0.01)
        return predicate()

    return wait


@pytest.fixture
def redis_url(redis_server) -> str:
    return redis_server.url


@pytest.fixture
def redis_client(redis_server):
    import redis

    client = redis.Redis.from_url(redis_server.url)
    yield client
    client.close()


class Node:
    """A cache node in its own process, driven by JSON lines over stdin/stdout."""

    def __init__(self, redis_url: str, node_id: str) -> None:
        env = dict(os.environ, PYTHONPATH=str(ROOT))
        self.proc = subprocess.Popen(
            [sys.executable, str(NODE_SCRIPT), redis_url, node_id],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
            bufsize=1,
            env=env,
        )
        assert self.call("ping", timeout=60)["ok"]

    def call(self, op: str, timeout: float = 30, **args) -> dict:
        self.proc.stdin.write(json.dumps({"op": op, **args}) + "\n")
        self.proc.stdin.flush()
        ready, _, _ = select.select([self.proc.stdout], [], [], timeout)
        if not ready:
            raise TimeoutError(f"node did not answer {op!r} within {timeout} s")
        line = self.proc.stdout.readline()
        if not line:
            raise RuntimeError(f"node exited (rc={self.proc.poll()}) during {op!r}")
        reply = json.loads(line)
        if "error" in reply:
            raise RuntimeError(f"node failed {op!r}: {reply['error']}")
        return reply

    def close(self) -> None:
        if self.proc.poll() is None:
            try:
                self.call("exit", timeout=10)
            except (OSError, RuntimeError, TimeoutError):
                pass
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)


@pytest.fixture
def node_factory(redis_url):
    nodes: list[Node] = []

    def make(node_id: str) -> Node:
        node = Node(redis_url, node_id)
        nodes.append(node)
        return node

    yield make
    for node in nodes:
        node.close()
