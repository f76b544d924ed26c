"""Property-based fuzzing of both endpoints (hypothesis): bodies built from the fields OpenAI
and jkv define, each drawn as a plausible value or as any JSON at all, plus bodies that are not
JSON objects. Whatever comes in: no 5xx, OpenAI's error JSON on every 4xx, a well-formed answer
on every 200 (SSE ending with [DONE] when streamed), and a correct answer afterwards."""

from __future__ import annotations

import json

import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from server_harness import Running, small_engine

import jkv
from jkv.serve.server import Server

EXAMPLES = 250  # per endpoint: ~1 minute for both on 2 busy cores

scalars = (
    st.none() | st.booleans() | st.integers(-(2**63), 2**63) | st.text(max_size=12)
    | st.floats(allow_nan=True, allow_infinity=True)
)  # fmt: skip
anything = st.recursive(
    scalars, lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=6), inner, max_size=3),
    max_leaves=6,
)  # fmt: skip
# short prompts, few policies: each new step shape compiles (seconds), which no fuzzing needs
words = st.lists(st.sampled_from(["The", "code", "for", "Mara", "is", "1", "2", "."]), min_size=1,
                 max_size=6).map(" ".join)  # fmt: skip
part = st.fixed_dictionaries({"type": st.just("text"), "text": words})
message = st.fixed_dictionaries(
    {"role": st.sampled_from(["system", "user", "assistant"]),
     "content": words | st.lists(part, min_size=1, max_size=2)},
    optional={"name": words},
)  # fmt: skip
KV = st.sampled_from([{}, {"kv_policy": {"name": "snapkv", "window": 8, "pool": "max"},
                          "kv_budget": 0.5}])  # fmt: skip
# Each field at a value the server must accept (OpenAI's defaults included)
COMMON = {
    "temperature": st.floats(0, 2),
    "top_p": st.floats(0.05, 1),
    "top_k": st.sampled_from([-1, 1, 5, 40]),
    "min_p": st.floats(0, 1),
    "seed": st.integers(0, 2**31 - 1),
    "stop": words | st.lists(words, min_size=1, max_size=4),
    "stream": st.booleans(),
    "stream_options": st.fixed_dictionaries({}, optional={"include_usage": st.booleans()}),
    "n": st.just(1),
    "logprobs": st.just(False),
    "presence_penalty": st.sampled_from([0, 0.0]),
    "user": words,
    "cache_salt": words,
    "logit_keep_ratio": st.floats(0.1, 1),
}
VALID = {
    "/v1/completions": st.fixed_dictionaries(
        {"model": st.just("jkv-demo"), "max_tokens": st.integers(1, 4),
         "prompt": words | st.lists(st.integers(3, 390), min_size=1, max_size=8)},
        optional={"echo": st.just(False), "suffix": st.just(""), **COMMON},
    ),
    "/v1/chat/completions": st.fixed_dictionaries(
        {"model": st.just("jkv-demo"), "max_completion_tokens": st.integers(1, 4),
         "messages": st.lists(message, min_size=1, max_size=2)},
        optional={"tool_choice": st.just("none"),
                  "response_format": st.just({"type": "text"}), **COMMON},
    ),
}  # fmt: skip
FIELDS = sorted({*COMMON, "model", "prompt", "messages", "kv_policy", "kv_budget", "echo", "max_tokens",
                 "tools", "logprobs", "response_format", "max_completion_tokens"})  # fmt: skip


def bodies(path):
    """Valid bodies, valid ones with one field at any JSON value, and any JSON object."""
    valid = st.tuples(VALID[path], KV).map(lambda t: {**t[0], **t[1]})
    mutated = st.tuples(valid, st.sampled_from(FIELDS), anything).map(
        lambda t: {**t[0], t[1]: t[2]}
    )
    return valid | mutated | st.dictionaries(st.sampled_from(FIELDS), anything, max_size=6)


NOT_OBJECTS = st.binary(max_size=40) | anything.map(lambda v: json.dumps(v).encode())
CONTENT_TYPES = st.sampled_from(["application/json"] * 6 + ["text/plain", "application/xml", None])
SEEN: dict[int, int] = {}  # status -> how many answers had it


@pytest.fixture(scope="module")
def running(demo_params):
    cache = jkv.ResponseCache()
    server = Running(Server(demo_params, small_engine(demo_params), response_cache=cache))
    yield server
    server.stop()
    cache.close()


def check(r: httpx.Response, streamed: bool) -> None:
    SEEN[r.status_code] = SEEN.get(r.status_code, 0) + 1
    assert r.status_code < 500, (r.status_code, r.text[:300])
    if r.status_code != 200:
        error = r.json()["error"]
        assert set(error) == {"message", "type", "param", "code"} and error["message"], r.text
        assert error["param"] is None or isinstance(error["param"], str)
        return
    if not streamed:
        assert r.json()["choices"][0]["finish_reason"] in ("stop", "length"), r.text
        return
    events = [line for line in r.text.split("\n") if line]
    assert events[-1] == "data: [DONE]" and all(e.startswith("data: ") for e in events), r.text
    for e in events[:-1]:
        assert "error" not in json.loads(e[len("data: ") :]), e


def post(client, path, raw: bytes, content_type=None) -> httpx.Response:
    headers = {} if content_type is None else {"content-type": content_type}
    return client.post(path, content=raw, headers=headers)


@pytest.mark.parametrize("path", sorted(VALID))
def test_fuzzed_bodies_never_get_a_5xx(running, path):
    with httpx.Client(base_url=running.url, timeout=120) as client:

        @settings(max_examples=EXAMPLES, deadline=None, database=None,
                  suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])  # fmt: skip
        @given(body=bodies(path) | NOT_OBJECTS, content_type=CONTENT_TYPES)
        def fuzz(body, content_type):
            raw = body if isinstance(body, bytes) else json.dumps(body).encode()
            streamed = isinstance(body, dict) and body.get("stream") is True
            check(post(client, path, raw, content_type), streamed)

        SEEN.clear()
        fuzz()
        assert SEEN.get(200, 0) >= EXAMPLES // 10, SEEN  # the fuzzing reached the engine too
        # and the server still answers correctly
        ok = client.post(path, json={"model": "jkv-demo", "max_tokens": 3, "temperature": 0,
                                     **({"prompt": "The code for Mara is"} if "chat" not in path else
                                        {"messages": [{"role": "user", "content": "The code"}]})})  # fmt: skip
        assert ok.status_code == 200, ok.text
    want = jkv.generate(running.server.params, "The code for Mara is", max_new_tokens=3)
    if "chat" not in path:
        assert ok.json()["choices"][0]["text"] == want.text
    stats = running.server.engine.stats()
    assert (stats["running"], stats["waiting"], running.server.in_flight) == (0, 0, 0)
