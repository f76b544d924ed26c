"""`jkv serve demo --replicas N` as a user starts it (a real launcher, real replicas, the real
sglang-router binary), on free loopback ports; prefix-cache counters read from /metrics."""

from __future__ import annotations

import contextlib
import os
import random
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx


def free_run(n: int) -> int:
    """The first of `n` consecutive free loopback ports, below the kernel's ephemeral range: the
    router binds its port a minute after this check (once the replicas are up), and in that
    minute other tests' outgoing connections take ephemeral ports (one took the router's)."""
    low = 32768
    with contextlib.suppress(OSError, ValueError):
        low = int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    for _ in range(200):
        base = random.randrange(10000, max(low, 10000 + 2 * n) - n)
        socks = []
        try:
            for p in range(base, base + n):
                s = socket.socket()
                socks.append(s)
                s.bind(("127.0.0.1", p))
            return base
        except OSError:
            continue
        finally:
            for s in socks:
                s.close()
    raise RuntimeError(f"no {n} consecutive free ports")


def children(pid: int) -> list[int]:
    out = subprocess.run(["pgrep", "-P", str(pid)], capture_output=True, text=True).stdout
    return [int(p) for p in out.split()]


def cmdline(pid: int) -> list[str]:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().decode().split("\0")
    except OSError:
        return []


class Deployment:
    """The launcher process; `replica_pid(i)`, `metrics(i)`, `stop()`."""

    def __init__(self, replicas: int, *flags: str, log_path: Path) -> None:
        self.replicas = replicas
        self.port = free_run(replicas)
        self.router_port = free_run(2)
        env = dict(os.environ)
        if os.environ.get("JKV_TEST_COMPILE_CACHE_DIR"):  # the test run's compiled programs
            env["JKV_COMPILE_CACHE"] = os.environ["JKV_TEST_COMPILE_CACHE_DIR"]
        self.log_path = log_path
        self.log = open(log_path, "w")  # noqa: SIM115 - closed in stop()
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "jkv.cli", "serve", "demo", "--replicas", str(replicas),
             "--port", str(self.port), "--router-port", str(self.router_port),
             "--router-health-interval", "1", "--log-level", "warning", *flags],
            env=env, stdout=self.log, stderr=subprocess.STDOUT, start_new_session=True,
        )  # fmt: skip
        self.url = f"http://127.0.0.1:{self.router_port}"
        deadline = time.monotonic() + 300
        try:
            while not self.ready():
                if self.proc.poll() is not None:
                    raise AssertionError(f"the launcher exited: {log_path.read_text()[-3000:]}")
                if time.monotonic() > deadline:
                    raise AssertionError("the deployment did not come up")
                time.sleep(0.5)
        except BaseException:
            self.stop()
            raise

    def ready(self) -> bool:
        try:
            return httpx.get(self.url + "/health", timeout=1).status_code == 200
        except httpx.TransportError:
            return False

    def replica_url(self, i: int) -> str:
        return f"http://127.0.0.1:{self.port + i}"

    def replica_pid(self, i: int) -> int:
        for pid in children(self.proc.pid):
            if str(self.port + i) in cmdline(pid) and "jkv.cli" in cmdline(pid):
                return pid
        raise LookupError(f"no replica {i}")

    def healthy(self, i: int) -> bool:
        try:
            return httpx.get(self.replica_url(i) + "/health", timeout=1).status_code == 200
        except httpx.TransportError:
            return False

    def metrics(self, i: int) -> dict[str, float]:
        """The replica's prefix-cache counters (queries and hits, blocks) and its requests
        running."""
        text = httpx.get(self.replica_url(i) + "/metrics", timeout=5).text
        out = {}
        for line in text.splitlines():
            for name in (
                "prefix_cache_queries_total",
                "prefix_cache_hits_total",
                "num_requests_running",
            ):
                if line.startswith(f"jkv:{name}"):
                    out[name] = float(line.rsplit(" ", 1)[1])
        return out

    def client(self, key: str, base: str | None = None):
        import openai

        return openai.OpenAI(base_url=(base or self.url) + "/v1", api_key=key, max_retries=0,
                             timeout=120)  # fmt: skip

    def stop(self) -> tuple[int | None, bool]:
        """SIGTERM to the launcher; returns its exit code and whether anything it started was
        still running after it exited (then killed: nothing outlives the fixture)."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(60)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)
        left = True  # the replicas and the router are in the launcher's process group
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            left = False
        self.log.close()
        return self.proc.returncode, left


def shared_prefix_traffic(seed: int, prefixes: int = 8, per_prefix: int = 4) -> list[str]:
    """Prompts of a few long shared prefixes (a system prompt, a document) and short distinct
    questions, shuffled (so round robin cannot keep a prefix on one replica by chance)."""
    rng = random.Random(seed)
    words = ("the farmer baker teacher child dog cat bird horse fox sailor river market house "
             "garden forest hill village school kitchen bridge road field lake town old young "
             "small big red green blue saw found carried painted opened bought sold").split()  # fmt: skip
    names = "Alice Bruno Clara Daniel Elena Felix Greta Hugo Irene Jonas Karla Lucas".split()
    heads = [" ".join(rng.choice(words) for _ in range(64)) for _ in range(prefixes)]
    prompts = [
        f"{h} {names[j % len(names)]} {names[(seed + k) % len(names)]} {rng.choice(words)} ?"
        for k, h in enumerate(heads)
        for j in range(per_prefix)
    ]
    rng.shuffle(prompts)
    return prompts
