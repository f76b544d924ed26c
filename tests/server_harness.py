"""The server tests' helpers: a small engine, and a `Server` run by uvicorn in a thread on a
free loopback port."""

from __future__ import annotations

import threading
import time

import uvicorn

import jkv
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
        config = uvicorn.Config(server.app, host="127.0.0.1", port=0, log_level="warning",
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
