"""Bounded requests: a body past --max-body-bytes is refused (413) before the rest is read,
a compressed or non-JSON one is 415, JSON nested past the limit is a 400 (not a 500 and a reset
connection), a prompt past what the context could hold is a 400 before it is tokenised; and
while a large body is refused, /health answers and a running stream does not pause."""

from __future__ import annotations

import gzip
import json
import statistics
import subprocess
import sys
import threading
import time

import httpx
import pytest
from server_harness import Running, small_engine

from jkv.serve.body import MAX_BODY_BYTES, MAX_DEPTH
from jkv.serve.server import Server
from jkv.tokenizer import Tokenizer

BODY = {"model": "jkv-demo", "prompt": "The code for Mara is", "max_tokens": 3, "temperature": 0}


class CountingTokenizer(Tokenizer):
    """The demo's tokenizer, counting the characters it was given to encode."""

    chars = 0

    def encode(self, text, **kwargs):
        CountingTokenizer.chars += len(text)
        return super().encode(text, **kwargs)


@pytest.fixture(scope="module")
def running(demo_params):
    tok = demo_params.tokenizer
    counting = CountingTokenizer(tok.inner, bos_token_id=tok.bos_token_id,
                                 eos_token_ids=tok.eos_token_ids)  # fmt: skip
    params = demo_params.replace(tokenizer=counting)
    server = Running(Server(params, small_engine(params)))
    yield server
    server.stop()


def error_of(r: httpx.Response, status: int) -> dict:
    assert r.status_code == status, r.text[:500]
    error = r.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}, error
    return error


def big_body(n_bytes: int) -> bytes:
    return json.dumps({**BODY, "prompt": "The code " * (n_bytes // 9)}).encode()


def test_a_body_past_the_limit_is_413_and_the_connection_serves_on(running):
    with httpx.Client(base_url=running.url, timeout=120) as client:
        r = client.post("/v1/completions", content=big_body(4 * 2**20),
                        headers={"content-type": "application/json"})  # fmt: skip
        error = error_of(r, 413)
        assert error["code"] == "request_too_large" and f"{MAX_BODY_BYTES:,}" in error["message"]

        def chunks():  # no Content-Length: refused once the limit is passed while it streams
            for _ in range(64):
                yield b" " * 2**16
            yield json.dumps(BODY).encode()

        error_of(client.post("/v1/completions", content=chunks()), 413)
        assert client.post("/v1/completions", json=BODY).json()["usage"]["completion_tokens"] == 3
    assert CountingTokenizer.chars < 10_000  # the large prompts were never tokenised


def test_compressed_or_non_json_bodies_are_415(running):
    raw = json.dumps(BODY).encode()
    r = httpx.post(running.url + "/v1/completions", content=gzip.compress(raw), timeout=60,
                   headers={"content-encoding": "gzip", "content-type": "application/json"})  # fmt: skip
    assert "gzip" in error_of(r, 415)["message"]
    r = httpx.post(running.url + "/v1/completions", content=raw, timeout=60,
                   headers={"content-type": "multipart/form-data; boundary=x"})  # fmt: skip
    assert "multipart/form-data" in error_of(r, 415)["message"]
    # curl -d's default type, with a JSON body: read as JSON
    r = httpx.post(running.url + "/v1/completions", content=raw, timeout=120,
                   headers={"content-type": "application/x-www-form-urlencoded"})  # fmt: skip
    assert r.status_code == 200, r.text


@pytest.mark.parametrize(
    "raw",
    [
        b"[" * 100_000,
        b'{"model": "jkv-demo", "prompt": ' + b"[" * 100_000 + b"]" * 100_000 + b"}",
        json.dumps({**BODY, "metadata": json.loads("[" * (MAX_DEPTH + 1) + "]" * (MAX_DEPTH + 1))}).encode(),
    ],
    ids=["unclosed", "closed", "just-past-the-limit"],
)  # fmt: skip
def test_deeply_nested_json_is_400_and_the_connection_serves_on(running, raw):
    with httpx.Client(base_url=running.url, timeout=120) as client:
        r = client.post(
            "/v1/completions", content=raw, headers={"content-type": "application/json"}
        )
        assert "nests deeper than" in error_of(r, 400)["message"]
        assert client.post("/v1/completions", json=BODY).status_code == 200


def test_a_prompt_past_the_context_is_refused_before_it_is_tokenised(running):
    limit = running.server.max_prompt_chars
    before = CountingTokenizer.chars
    for path, body, param in (
        ("/v1/completions", {**BODY, "prompt": "x" * (limit + 1)}, "prompt"),
        ("/v1/completions", {**BODY, "prompt": [5] * (limit + 1)}, "prompt"),
        ("/v1/chat/completions", {"model": "jkv-demo", "max_tokens": 2, "messages": [
            {"role": "user", "content": "y" * (limit // 2)},
            {"role": "user", "content": [{"type": "text", "text": "z" * (limit // 2 + 1)}]},
        ]}, "messages"),
    ):  # fmt: skip
        error = error_of(httpx.post(running.url + path, json=body, timeout=60), 400)
        assert (error["param"], error["code"]) == (param, "context_length_exceeded"), error
    assert CountingTokenizer.chars == before


STALL = 0.5  # seconds: a stream gap a loaded machine may show (the old code's stalls: ~2 s)
# A client process posting `n` bodies of `size` bytes, one every ~50 ms: prints
# [status, sent, answered] per body (time.monotonic() is one clock for every process).
REFUSER = """
import json, time, httpx
body = json.dumps({{"model": "jkv-demo", "prompt": "The code " * ({size} // 9)}}).encode()
with httpx.Client(timeout=60) as client:
    for _ in range({n}):
        t0 = time.monotonic()
        r = client.post("{url}/v1/completions", content=body,
                        headers={{"content-type": "application/json"}})
        print(json.dumps([r.status_code, t0, time.monotonic()]), flush=True)
        time.sleep(0.05)
"""


def test_the_event_loop_never_waits_while_a_large_body_is_refused(running):
    """The issue's bounds while 4 MiB bodies are refused: /health within 100 ms (its median;
    none past 0.5 s), the stream's gaps within 5x their median. On a machine busy with other
    work a bound is the larger of that, twice what the same measure gives with no body in
    flight, and `STALL` (a quarter of the old stalls): that is noise, not the server. (On the code
    before this test, every refusal held the loop ~2 s: each probe and gap near one did.)"""
    body = {"model": "jkv-demo", "prompt": "The code for Mara is", "max_tokens": 200,
            "temperature": 1.0, "seed": 3, "stream": True}  # fmt: skip

    def stream() -> list[float]:
        """When each chunk of one stream arrived."""
        stamps = []
        with httpx.stream("POST", running.url + "/v1/completions", json=body, timeout=120) as r:
            for line in r.iter_lines():
                if line.startswith("data: {"):
                    stamps.append(time.monotonic())
        return stamps

    stream()  # once to compile the step shapes it grows through; the same stream from then on
    streams, done = [], threading.Event()
    reader = threading.Thread(
        target=lambda: [streams.append(stream()) for _ in iter(done.is_set, True)]
    )
    reader.start()
    while not streams:
        time.sleep(0.01)
    windows, refused = [], []  # (start, end) of each refusal, its status

    def refuse(n):  # one 4 MiB body at a time, every ~50 ms, from another process (a client)
        script = REFUSER.format(url=running.url, n=n, size=4 * 2**20)
        out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                             timeout=120, check=True).stdout  # fmt: skip
        for line in out.splitlines():
            status, t0, t1 = json.loads(line)
            refused.append(status)
            windows.append((t0, t1))

    probes = []  # /health's (sent, answered)
    sender = threading.Thread(target=refuse, args=(12,))
    with httpx.Client(base_url=running.url, timeout=60) as probe:
        for phase in ("before", "during"):
            if phase == "during":
                sender.start()
            end = time.monotonic() + 0.8
            while sender.is_alive() if phase == "during" else time.monotonic() < end:
                h0 = time.monotonic()
                assert probe.get("/health").status_code == 200
                probes.append((h0, time.monotonic()))
    sender.join()
    done.set()
    reader.join(120)
    gaps = [(a, b) for stamps in streams for a, b in zip(stamps, stamps[1:], strict=False)]
    assert len(gaps) > 100, len(gaps)
    median = statistics.median(b - a for a, b in gaps)
    overlaps = lambda a, b: any(s < b and e > a for s, e in windows)  # noqa: E731
    health = {True: [], False: []}  # during a refusal or not -> /health's latencies
    for a, b in probes:
        health[overlaps(a, b)].append(b - a)
    during = [b - a for a, b in gaps if overlaps(a, b)]
    elsewhere = [b - a for a, b in gaps if not overlaps(a, b)]
    assert during and health[True] and health[False]
    # /health: typically within 100 ms, none held for long (main: every one waited ~2 s)
    assert statistics.median(health[True]) < 0.1, health
    assert max(health[True]) < max(0.5, 2 * max(health[False])), health
    # a loaded CI machine stalled one gap 0.12 s; the old code held the loop ~2 s per refusal
    bound = max(5 * median, 2 * max(elsewhere), STALL)
    assert max(during) <= bound, (median, sorted(during)[-5:], max(elsewhere))
    assert set(refused) == {413}, refused


def test_a_client_leaving_during_a_long_engine_step_does_not_hold_the_loop(running, monkeypatch):
    """A step can take seconds (compiling a new shape); a client that leaves meanwhile aborts
    its request, and that abort must wait for the step off the event loop: /health answers."""
    import jkv.engine.engine as engine_module

    step = engine_module.ragged_step
    slow = threading.Event()

    def long_step(*args, **kwargs):  # the runner's step, taking 2 s once armed
        if slow.is_set():
            slow.clear()
            time.sleep(2.0)
        return step(*args, **kwargs)

    monkeypatch.setattr(engine_module, "ragged_step", long_step)
    body = {**BODY, "max_tokens": 200, "temperature": 1.0, "seed": 5, "stream": True}
    with httpx.Client(base_url=running.url, timeout=60) as client:
        with client.stream("POST", "/v1/completions", json=body) as r:
            lines = r.iter_lines()
            for _ in range(3):
                next(lines)
            slow.set()
            time.sleep(0.2)  # the long step runs
        # the client left during it
        latencies = []
        end = time.monotonic() + 1.5
        while time.monotonic() < end:
            t0 = time.monotonic()
            assert client.get("/health").status_code == 200
            latencies.append(time.monotonic() - t0)
    assert max(latencies) < 0.5, latencies
    engine = running.server.engine
    deadline = time.monotonic() + 30
    while engine.has_work and time.monotonic() < deadline:  # its pages come back after the step
        time.sleep(0.05)
    assert not engine.has_work and running.server.in_flight == 0
