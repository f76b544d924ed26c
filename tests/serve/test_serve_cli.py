"""`jkv serve` as a user starts it: one command, a real process; SIGTERM under load stops
admitting and lets the in-flight stream finish before the process exits cleanly."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time

import httpx


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_sigterm_finishes_in_flight_streams_then_exits(tmp_path):
    port = _free_port()
    env = dict(os.environ)
    if os.environ.get("JKV_TEST_COMPILE_CACHE_DIR"):  # the test run's compiled programs
        env["JKV_COMPILE_CACHE"] = os.environ["JKV_TEST_COMPILE_CACHE_DIR"]
    proc = subprocess.Popen(
        [sys.executable, "-m", "jkv.cli", "serve", "demo", "--port", str(port), "--max-running",
         "4", "--num-pages", "256", "--no-response-cache", "--shutdown-timeout", "300"],
        env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
    )  # fmt: skip
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 120
        while True:
            assert proc.poll() is None, proc.stdout.read()
            try:
                if httpx.get(url + "/health", timeout=1).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            assert time.monotonic() < deadline, "jkv serve did not come up"
            time.sleep(0.2)
        body = {"model": "jkv-demo", "prompt": "The code for Mara is", "max_tokens": 120,
                "temperature": 0, "stream": True, "stream_options": {"include_usage": True}}  # fmt: skip
        events: list[str] = []
        first = threading.Event()

        def read():
            with httpx.stream("POST", url + "/v1/completions", json=body, timeout=120) as r:
                for line in r.iter_lines():
                    if line:
                        events.append(line)
                        first.set()

        reader = threading.Thread(target=read)
        reader.start()
        assert first.wait(60), "no first chunk"
        proc.send_signal(signal.SIGTERM)
        reader.join(120)
        assert events[-1] == "data: [DONE]"
        usage = json.loads(events[-2][len("data: ") :])["usage"]
        assert usage["completion_tokens"] == 120  # the in-flight request finished whole
        assert proc.wait(60) == 0
        log = proc.stdout.read()
        lines = [json.loads(x) for x in log.splitlines() if x.startswith("{")]
        done = [x for x in lines if x.get("event") == "request"]
        assert len(done) == 1 and done[0]["completion_tokens"] == 120, log
        try:  # no longer admitting
            httpx.get(url + "/health", timeout=1)
            raise AssertionError("the server still answers after SIGTERM")
        except httpx.TransportError:
            pass
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)
