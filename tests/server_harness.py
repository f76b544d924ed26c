"""The server tests' helpers: a small engine, a `Server` run by uvicorn in a thread on a
free loopback port, and `jkv serve` run as a process (`serve_process`)."""

from __future__ import annotations

import threading
import time

import uvicorn

import jkv
from jkv.serve import protocol
from jkv.serve.server import Server


def small_engine(params, **overrides):
    """An engine sized for tests: 4 rows, short contexts, few step shapes to compile."""
    settings = dict(num_pages=256, page_size=16, max_running=4, token_budget=64, chunk=32,
                    max_model_len=256)  # fmt: skip
    return jkv.Engine(params, **{**settings, **overrides})


class Running:
    """A server on 127.0.0.1:<free port> until `stop()`."""

    def __init__(self, server: Server):
        self.server = server
        config = protocol.config(server, host="127.0.0.1", port=0, log_level="warning",
                                 timeout_graceful_shutdown=10)  # fmt: skip
        self.uvicorn = uvicorn.Server(config)
        self.thread = threading.Thread(target=self.uvicorn.run, daemon=True)
        self.thread.start()
        deadline = time.monotonic() + 30
        while not self.uvicorn.started:
            if time.monotonic() > deadline or not self.thread.is_alive():
                raise RuntimeError("the test server did not start")
            time.sleep(0.01)
        port = self.uvicorn.servers[0].sockets[0].getsockname()[1]
        self.url = f"http://127.0.0.1:{port}"

    def client(self, **kwargs):
        import openai

        return openai.OpenAI(base_url=self.url + "/v1", api_key="unused", max_retries=0,
                             **kwargs)  # fmt: skip

    def stop(self) -> None:
        self.uvicorn.should_exit = True
        self.thread.join(30)


def serve_process(model: str, *args: str, timeout: float = 180):
    """`jkv serve MODEL --port P ARGS...` as a user starts it: (the process, its base URL) once
    /health answers (the test run's compiled programs shared through JAX's cache)."""
    import os
    import socket
    import subprocess
    import sys
    import time

    import httpx

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = dict(os.environ)
    if os.environ.get("JKV_TEST_COMPILE_CACHE_DIR"):
        env["JKV_COMPILE_CACHE"] = os.environ["JKV_TEST_COMPILE_CACHE_DIR"]
    proc = subprocess.Popen(
        [sys.executable, "-m", "jkv.cli", "serve", model, "--port", str(port), *args],
        env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
    )  # fmt: skip
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + timeout
    while True:
        if proc.poll() is not None:
            raise AssertionError(f"jkv serve {model} exited: {proc.stdout.read()}")
        try:
            if httpx.get(url + "/health", timeout=1).status_code == 200:
                return proc, url
        except httpx.TransportError:
            pass
        if time.monotonic() > deadline:
            proc.kill()
            raise AssertionError(f"jkv serve {model} did not come up")
        time.sleep(0.3)
