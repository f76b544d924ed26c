"""Fixtures for the response-cache tests: a real redis-server on a free loopback port, and
cache nodes running in separate processes (`_cache_node.py`)."""

from __future__ import annotations

import json
import os
import select
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
NODE_SCRIPT = Path(__file__).with_name("_cache_node.py")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _pong(port: int) -> bool:
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=0.2) as s:
            s.sendall(b"PING\r\n")
            return s.recv(16).startswith(b"+PONG")
    except OSError:
        return False


class RedisServer:
    """One redis-server process on 127.0.0.1, no persistence, killable and restartable."""

    def __init__(self, workdir: Path) -> None:
        binary = shutil.which("redis-server")
        if binary is None:
            pytest.fail(
                "redis-server is not installed; the cache tests need a real one "
                "(`make redis`, or `apt-get install redis-server`)",
                pytrace=False,
            )
        self.binary = binary
        self.workdir = workdir
        self.port = 0
        self.proc: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def start(self, port: int | None = None) -> None:
        """Starts on `port`, or on a free one (retrying if another test took it first)."""
        for _ in range(5):
            self.port = port or _free_port()
            self.proc = subprocess.Popen(
                [self.binary, "--port", str(self.port), "--bind", "127.0.0.1"]
                + ["--save", "", "--appendonly", "no", "--dir", str(self.workdir)],
                stdout=subprocess.DEVNULL,
                stderr=subprocess.DEVNULL,
            )
            deadline = time.monotonic() + 10
            while time.monotonic() < deadline and self.proc.poll() is None:
                if _pong(self.port):
                    return
                time.sleep(0.02)
            self.stop()
            if port is not None:
                break
        raise RuntimeError(f"redis-server did not answer PING on port {self.port}")

    def kill(self) -> None:
        """SIGKILL: the server vanishes mid-traffic, as in a crash."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGCONT)  # a paused server must die too
            self.proc.send_signal(signal.SIGKILL)
            self.proc.wait(10)

    def pause(self) -> None:
        """SIGSTOP: the server hangs (connections stay open, nothing answers)."""
        self.proc.send_signal(signal.SIGSTOP)

    def resume(self) -> None:
        self.proc.send_signal(signal.SIGCONT)

    def restart(self) -> None:
        """Starts a fresh (empty) server on the same port."""
        self.kill()
        self.start(self.port)

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)


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
def redis_server(tmp_path):
    server = RedisServer(tmp_path)
    server.start()
    yield server
    server.kill()


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
