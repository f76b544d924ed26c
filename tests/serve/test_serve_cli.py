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
import pytest


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start(*flags: str, env=None) -> tuple[subprocess.Popen, str]:
    """`jkv serve demo FLAGS` on a free port, once its /health answers: (process, url)."""
    port = _free_port()
    env = {**os.environ, **(env or {})}
    if os.environ.get("JKV_TEST_COMPILE_CACHE_DIR"):  # the test run's compiled programs
        env["JKV_COMPILE_CACHE"] = os.environ["JKV_TEST_COMPILE_CACHE_DIR"]
    proc = subprocess.Popen(
        [sys.executable, "-m", "jkv.cli", "serve", "demo", "--port", str(port), *flags],
        env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
    )  # fmt: skip
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 120
    while True:
        assert proc.poll() is None, proc.stdout.read()
        try:
            if httpx.get(url + "/health", timeout=1).status_code in (200, 401):
                return proc, url
        except httpx.TransportError:
            pass
        assert time.monotonic() < deadline, "jkv serve did not come up"
        time.sleep(0.2)


def stop(proc: subprocess.Popen) -> str:
    """SIGTERM, then the process's output once it exited 0."""
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(60) == 0
    return proc.stdout.read()


def test_sigterm_finishes_in_flight_streams_then_exits():
    proc, url = start("--max-running", "4", "--num-pages", "256", "--no-response-cache",
                      "--shutdown-timeout", "300")  # fmt: skip
    try:
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
        assert first.wait(240), "no first chunk"  # a compile, on a machine that may be busy
        proc.send_signal(signal.SIGTERM)
        reader.join(120)
        assert events[-1] == "data: [DONE]"
        usage = json.loads(events[-2][len("data: ") :])["usage"]
        assert usage["completion_tokens"] == 120  # the in-flight request finished whole
        assert proc.wait(60) == 0
        log = proc.stdout.read()
        lines = [json.loads(x) for x in log.splitlines() if x.startswith("{")]
        warned = [x for x in lines if x["level"] == "warning" and "no API key" in x["message"]]
        assert len(warned) == 1, log  # a server without keys says so at start
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


def jkv_cli(capsys, *argv: str) -> tuple[int, str]:
    """`jkv ARGV` in this process: (exit code, stdout + stderr)."""
    from jkv.cli import main

    code = main(list(argv))
    out = capsys.readouterr()
    return code, out.out + out.err


def test_plain_jkv_lists_serve_and_serve_help_shows_the_defaults(capsys):
    code, text = jkv_cli(capsys)
    assert code == 2 and "serve" in text.split("a command is required:")[1]
    with pytest.raises(SystemExit):
        jkv_cli(capsys, "serve", "--help")
    text = " ".join(capsys.readouterr().out.split())
    assert "--host HOST the address to listen on (default: 127.0.0.1)" in text
    assert "--port PORT the port to listen on (default: 8000)" in text
    assert "float8_e4m3fn (fp8)" in text and "(default: 30.0)" in text
    assert "'smollm2' (SmolLM2-135M-Instruct" in text and "a GGUF file (.gguf)" in text
    assert "--request-timeout REQUEST_TIMEOUT seconds a client has to send" in text


@pytest.mark.parametrize(
    "flags, words",
    [  # refused as the HTTP body's fields are, before the model loads
        (["--kv-budget", "0.5"], "kv_budget=0.5 needs a compressing kv_policy"),
        (["--kv-policy", "snapkv", "--kv-budget", "-2"], "budget=-2"),
        (["--kv-policy", "magic"], "kv_policy='magic' is unknown"),
        (["--kv-policy", '{"name": "snapkv", "windw": 16}'], "kv_policy.windw"),
        (["--kv-policy", '{"name": "snapkv"'], "not a JSON object"),
        (["--kv-budget", "lots"], "invalid number 'lots'"),
        (["--port", "70000"], "invalid port '70000'"),
        (["--shutdown-timeout", "-1"], "seconds >= 0"),
        (["--request-timeout", "0"], "invalid '0': seconds > 0"),
        (["--kv-dtype", "fp9"], "kv_dtype='fp9' is not supported"),
        (["--max-queued-requests", "0"], "max_queued_requests=0"),
        (["--redis-url", "redis+cluster://h"], "node 'h' is not host:port"),
        (["--redis-url", "http://h:1"], "redis_url='http://h:1' must start with"),
        (["--kv-events-endpoint", "127.0.0.1:5557"], "kv_events_endpoint='127.0.0.1:5557'"),
        (
            ["--kv-events-endpoint", "tcp://127.0.0.1:1", "--kv-events-replay-endpoint", "x"],
            "kv_events_replay_endpoint='x'",
        ),  # fmt: skip
        (["--num-processes", "2"], "--num-processes needs --coordinator HOST:PORT"),
        (["--coordinator", "127.0.0.1:1", "--replicas", "2"], "--replicas and --coordinator"),
        (
            ["--coordinator", "nohost", "--num-processes", "2", "--process-id", "0"],
            "--coordinator 'nohost': expected HOST:PORT",
        ),  # fmt: skip
        (
            ["--coordinator", "127.0.0.1:5000", "--num-processes", "2", "--process-id", "3"],
            "--process-id 3: expected an int in [0, 1]",
        ),  # fmt: skip
        (["--tensor-parallel", "9"], "--tensor-parallel 9: expected 1 to the 1 devices"),
    ],
)
def test_bad_flags_exit_2_naming_them(capsys, flags, words):
    code, text = jkv_cli(capsys, "serve", "demo", *flags)
    assert code == 2 and words in text, text
    assert "Traceback" not in text


def test_an_unreachable_redis_cluster_or_a_taken_events_port_exit_naming_them(capsys):
    port = _free_port()
    code, text = jkv_cli(
        capsys, "serve", "demo", "--redis-url", f"redis+cluster://127.0.0.1:{port}"
    )
    assert code == 1 and f"127.0.0.1:{port}" in text and "Traceback" not in text
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        endpoint = f"tcp://127.0.0.1:{taken.getsockname()[1]}"
        code, text = jkv_cli(capsys, "serve", "demo", "--kv-events-endpoint", endpoint)
    assert code == 2 and "cannot be bound" in text and endpoint in text, text


def test_fp8_a_policy_by_its_fields_and_api_keys_start_a_server(tmp_path):
    policy = json.dumps({"name": "snapkv", "window": 16, "kernel": 11, "pool": "max"})
    keys = tmp_path / "keys"
    keys.write_text("sk-file alice\n")
    proc, url = start("--kv-dtype", "fp8", "--kv-policy", policy, "--kv-budget", "0.5",
                      "--num-pages", "256", "--no-response-cache", "--api-key", "sk-flag",
                      "--api-keys-file", str(keys), env={"JKV_API_KEY": "sk-env"})  # fmt: skip
    try:
        assert httpx.get(url + "/v1/models", timeout=10).status_code == 401
        for key in ("sk-flag", "sk-file", "sk-env"):
            r = httpx.get(url + "/v1/models", headers={"authorization": f"Bearer {key}"})
            assert r.json()["data"][0]["id"] == "jkv-demo"
    finally:
        log = stop(proc)
    assert "no API key" not in log and "3 API keys, 3 tenants" in log


def test_requests_still_running_at_the_shutdown_timeout_are_told_so():
    """A stop whose grace period runs out (an engine compiling new step shapes can take
    longer than --shutdown-timeout: finding 6 of issue 28) ends each request with a 503
    `server_shutdown` (a stream: an error event, then [DONE]), never a silent cut."""
    proc, url = start("--max-running", "1", "--num-pages", "256", "--no-response-cache",
                      "--shutdown-timeout", "0.3")  # fmt: skip
    body = {"model": "jkv-demo", "prompt": "The code for Mara is", "max_tokens": 400,
            "temperature": 0.9, "seed": 1}  # fmt: skip
    ends: dict[int, object] = {}
    first = threading.Event()

    def stream(i):
        events = []
        with httpx.stream("POST", url + "/v1/completions", json={**body, "stream": True},
                          timeout=120) as r:  # fmt: skip
            if r.status_code != 200:
                ends[i] = (r.status_code, json.loads(r.read())["error"])
                return
            for line in r.iter_lines():
                if line:
                    events.append(line)
                    first.set()
        ends[i] = events

    def whole(i):
        r = httpx.post(url + "/v1/completions", json=body, timeout=120)
        ends[i] = (r.status_code, r.json().get("error"))

    try:
        readers = [threading.Thread(target=stream, args=(0,))]
        readers[0].start()
        assert first.wait(240), "no first chunk"  # a compile, on a machine that may be busy
        readers += [threading.Thread(target=f, args=(i,)) for i, f in ((1, stream), (2, whole))]
        for t in readers[1:]:
            t.start()
        time.sleep(0.2)  # both queued behind the first (--max-running 1)
        proc.send_signal(signal.SIGTERM)
        for t in readers:
            t.join(60)
        assert proc.wait(60) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)
    events = ends[0]
    assert events[-1] == "data: [DONE]"
    error = json.loads(events[-2][len("data: ") :])["error"]
    assert (error["type"], error["code"]) == ("server_error", "server_shutdown")
    for i in (1, 2):  # queued: a 503 that says why (retry elsewhere)
        status, error = ends[i]
        assert status == 503 and error["code"] == "server_shutdown", ends[i]
    log = proc.stdout.read()
    assert "stopping: 3 requests still running end with 503" in log, log
