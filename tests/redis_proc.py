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
