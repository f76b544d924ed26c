"""Every way a request can fail answers OpenAI's error JSON (`{"error": {message, type, param,
code}}`), the connection stays usable and the next request is answered: unknown paths (404),
wrong methods (405), a failed engine step (500; streamed: an error event, then [DONE]), an
unhealthy engine (/health 503)."""

from __future__ import annotations

import json

import httpx
import openai
import pytest
from server_harness import Running, small_engine

from jkv.serve.server import Server

BODY = {"model": "jkv-demo", "prompt": "The code for Mara is", "max_tokens": 4, "temperature": 0}


@pytest.fixture(scope="module")
def running(demo_params):
    engine = small_engine(demo_params)
    server = Running(Server(demo_params, engine))
    yield server
    server.stop()


def openai_error(r: httpx.Response, status: int) -> dict:
    assert r.status_code == status, r.text
    assert r.headers["content-type"].startswith("application/json")
    error = r.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["message"], error
    assert "Traceback" not in r.text
    return error


@pytest.mark.parametrize(
    "method, path, status",
    [
        ("GET", "/v1/nothing", 404),
        ("POST", "/v2/completions", 404),
        ("GET", "/v1/completions", 405),
        ("DELETE", "/v1/chat/completions", 405),
        ("POST", "/health", 405),
    ],
)
def test_unknown_paths_and_methods_answer_openai_errors(running, method, path, status):
    error = openai_error(httpx.request(method, running.url + path, timeout=60), status)
    assert error["type"] == "invalid_request_error"
    assert path in error["message"]


class FailOnce:
    """The engine's step, failing the first `n` times it runs (a device error, say)."""

    def __init__(self, step, n=1):
        self.step, self.left = step, n

    def __call__(self):
        if self.left > 0:
            self.left -= 1
            raise RuntimeError("injected step failure")
        return self.step()


def test_a_failed_engine_step_is_a_500_and_the_server_recovers(running, monkeypatch):
    engine = running.server.engine
    with httpx.Client(base_url=running.url, timeout=120) as client:
        monkeypatch.setattr(engine, "step", FailOnce(engine.step))
        error = openai_error(client.post("/v1/completions", json=BODY), 500)
        assert (error["type"], error["code"]) == ("server_error", "engine_error")
        assert "injected" not in error["message"]  # the cause is logged, not sent
        # the same connection is answered next, and the engine serves again
        ok = client.post("/v1/completions", json=BODY)
        assert ok.status_code == 200 and ok.json()["usage"]["completion_tokens"] == 4
    stats = engine.stats()
    assert (stats["running"], stats["waiting"]) == (0, 0)


class FailNth:
    """The engine's step, failing its `n`-th call from now (mid-stream)."""

    def __init__(self, step, n):
        self.step, self.n = step, n

    def __call__(self):
        self.n -= 1
        if self.n == 0:
            raise RuntimeError("injected step failure")
        return self.step()


def test_a_failed_step_mid_stream_sends_an_error_event_then_done(running, monkeypatch):
    engine = running.server.engine
    step = engine.step
    body = {**BODY, "max_tokens": 12, "stream": True}
    monkeypatch.setattr(engine, "step", FailNth(step, 3))
    with httpx.stream("POST", running.url + "/v1/completions", json=body, timeout=120) as r:
        assert r.status_code == 200
        events = [line for line in r.iter_lines() if line]
    assert events[-1] == "data: [DONE]"
    error = json.loads(events[-2][len("data: ") :])["error"]
    assert (error["type"], error["code"]) == ("server_error", "engine_error")
    assert len(events) >= 3  # the first chunks came before the failure
    # the official client raises it as an error, after the chunks it got
    monkeypatch.setattr(engine, "step", FailNth(step, 3))
    got = []
    with pytest.raises(openai.APIError, match="engine failed"):
        for chunk in running.client().completions.create(**body):
            got.append(chunk)
    assert got
    monkeypatch.undo()
    assert running.client().completions.create(**BODY).usage.completion_tokens == 4


def test_health_is_503_while_the_engine_is_unhealthy(running, monkeypatch):
    assert httpx.get(running.url + "/health", timeout=60).json() == {"status": "ok"}
    monkeypatch.setattr(running.server.engine, "healthy", False, raising=False)
    error = openai_error(httpx.get(running.url + "/health", timeout=60), 503)
    assert error["type"] == "server_error"
    monkeypatch.undo()
    assert httpx.get(running.url + "/health", timeout=60).status_code == 200
