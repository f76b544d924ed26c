"""A real redis-server on a free loopback port, killable and restartable (shared by the
response-cache and the server tests; tests/ is on sys.path, as for tiny_hf)."""

from __future__ import annotations

import shutil
import signal
import socket
import subprocess
import time
from pathlib import Path

import pytest


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
        self.extra: list[str] = []

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def start(self, port: int | None = None) -> None:
        """Starts on `port`, or on a free one (retrying if another test took it first)."""
        for _ in range(5):
            self.port = port or _free_port()
            self.proc = subprocess.Popen(
                [self.binary, "--port", str(self.port), "--bind", "127.0.0.1"]
                + ["--save", "", "--appendonly", "no", "--dir", str(self.workdir)]
                + self.extra,
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


def _free_cluster_port() -> int:
    """A free port whose cluster-bus port (port + 10000) is free too."""
    for _ in range(100):
        port = _free_port()
        if port + 10000 > 65535:
            continue
        try:
            with socket.socket() as s:
                s.bind(("127.0.0.1", port + 10000))
        except OSError:
            continue
        return port
    raise RuntimeError("no free port pair (port, port + 10000) on 127.0.0.1")


class RedisClusterProcs:
    """A real Redis Cluster on 127.0.0.1: `primaries` primaries, one replica each.

    Every node runs with `cluster-require-full-coverage no` (a dead shard leaves the other
    slots served), a 2 s node timeout (a killed primary's replica takes over in ~3-5 s) and
    no persistence. `stop()` ends every process it started.
    """

    def __init__(self, workdir: Path, primaries: int = 3, node_timeout_ms: int = 2000) -> None:
        self.workdir = workdir
        self.primaries = primaries
        self.node_timeout_ms = node_timeout_ms
        self.nodes: list[RedisServer] = []

    @property
    def ports(self) -> list[int]:
        return [n.port for n in self.nodes]

    @property
    def url(self) -> str:
        """`redis+cluster://` with every node as a startup node."""
        return "redis+cluster://" + ",".join(f"127.0.0.1:{p}" for p in self.ports)

    def start(self, timeout: float = 30.0) -> None:
        for i in range(2 * self.primaries):
            folder = self.workdir / f"node{i}"
            folder.mkdir(parents=True, exist_ok=True)
            node = _ClusterNode(folder, self.node_timeout_ms)
            node.start(_free_cluster_port())
            self.nodes.append(node)
        create = subprocess.run(
            ["redis-cli", "--cluster", "create", *[f"127.0.0.1:{p}" for p in self.ports],
             "--cluster-replicas", "1", "--cluster-yes"],
            capture_output=True, text=True, timeout=timeout,
        )  # fmt: skip
        if create.returncode != 0:
            self.stop()
            raise RuntimeError(f"redis-cli --cluster create failed: {create.stdout[-2000:]}")
        if not self.wait_ok(timeout):
            self.stop()
            raise RuntimeError(f"the cluster on {self.ports} did not reach cluster_state:ok")

    def info(self, port: int, what: str = "info") -> str:
        out = subprocess.run(["redis-cli", "-p", str(port), "cluster", what],
                             capture_output=True, text=True, timeout=5)  # fmt: skip
        return out.stdout

    def wait_ok(self, timeout: float) -> bool:
        """Every live node says cluster_state:ok with every slot served by a live primary
        (after a kill: the replica took over), and, with no node dead, every primary has a
        replica in sync (so that a killed primary can fail over)."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            live = [n for n in self.nodes if n.proc is not None and n.proc.poll() is None]
            states = [self.info(n.port) for n in live]
            if all("cluster_state:ok" in s and "cluster_slots_ok:16384" in s for s in states):
                alive = {n.port for n in live}
                topo = self.topology()
                served = all(
                    p in alive for p, n in topo.items() if n["role"] == "master" and n["slots"]
                )
                if served and (len(live) < len(self.nodes) or self._replicas_in_sync()):
                    return True
            time.sleep(0.1)
        return False

    def _replicas_in_sync(self) -> bool:
        topo = self.topology()
        primaries = [n["id"] for n in topo.values() if n["role"] == "master" and n["slots"]]
        synced = set()
        for port, node in topo.items():
            if node["role"] == "slave" and not node["failed"]:
                out = subprocess.run(["redis-cli", "-p", str(port), "info", "replication"],
                                     capture_output=True, text=True, timeout=5).stdout  # fmt: skip
                if "master_link_status:up" in out:
                    synced.add(node["primary"])
        return len(primaries) == self.primaries and set(primaries) <= synced

    def heal(self, timeout: float = 30.0) -> None:
        """Restarts every dead node on its port (it rejoins from its nodes.conf, a former
        primary as a replica of the one that replaced it) and waits for a healthy cluster."""
        for node in self.nodes:
            if node.proc is None or node.proc.poll() is not None:
                node.start(node.port)
        if not self.wait_ok(timeout):
            raise RuntimeError(f"the cluster on {self.ports} did not heal: {self.topology()}")

    def flush(self) -> None:
        """FLUSHALL on every primary."""
        for port, node in self.topology().items():
            if node["role"] == "master" and not node["failed"]:
                subprocess.run(["redis-cli", "-p", str(port), "flushall"],
                               capture_output=True, timeout=5, check=True)  # fmt: skip

    def topology(self) -> dict[int, dict]:
        """port -> {"role": "master" | "slave", "id", "primary" (its primary's id), "slots"}
        as the first live node sees it (`CLUSTER NODES`)."""
        live = next(n for n in self.nodes if n.proc is not None and n.proc.poll() is None)
        out = {}
        for line in self.info(live.port, "nodes").splitlines():
            fields = line.split()
            port = int(fields[1].split("@")[0].rsplit(":", 1)[1])
            flags = fields[2].split(",")
            out[port] = {
                "id": fields[0],
                "role": "master" if "master" in flags else "slave",
                "failed": "fail" in flags or "fail?" in flags,
                "primary": fields[3],
                "slots": fields[8:],
            }
        return out

    def node(self, port: int) -> RedisServer:
        return next(n for n in self.nodes if n.port == port)

    def primary_of(self, slot: int) -> int:
        """The port of the primary serving `slot` now."""
        for port, node in self.topology().items():
            if node["role"] != "master" or node["failed"]:
                continue
            for span in node["slots"]:
                lo, _, hi = span.partition("-")
                if span[0] != "[" and int(lo) <= slot <= int(hi or lo):
                    return port
        raise RuntimeError(f"no live primary serves slot {slot}")

    def slots_of(self, port: int) -> set[int]:
        """The slots the node on `port` serves as a primary now."""
        slots = set()
        for span in self.topology()[port]["slots"]:
            if span[0] != "[":  # not a slot being migrated
                lo, _, hi = span.partition("-")
                slots.update(range(int(lo), int(hi or lo) + 1))
        return slots

    def replica_of(self, primary_port: int) -> int:
        topo = self.topology()
        pid = topo[primary_port]["id"]
        return next(p for p, n in topo.items() if n["primary"] == pid)

    def stop(self) -> None:
        for node in self.nodes:
            node.kill()


class _ClusterNode(RedisServer):
    """A redis-server with cluster mode on (its nodes.conf in its own folder)."""

    def __init__(self, workdir: Path, node_timeout_ms: int) -> None:
        super().__init__(workdir)
        self.extra = ["--cluster-enabled", "yes", "--cluster-config-file", "nodes.conf",
                      "--cluster-node-timeout", str(node_timeout_ms),
                      "--cluster-require-full-coverage", "no",
                      "--cluster-allow-reads-when-down", "no"]  # fmt: skip
