"""What OpenAI's clients send: fields at their default values are accepted (the answer is the
one without them); other values of fields jkv does not implement get 400 naming the field;
types are checked strictly (no coercion); jkv's `kv_policy` takes a policy's fields as the
Python API does, and its errors name `kv_policy` / `kv_budget`."""

from __future__ import annotations

import httpx
import openai
import pytest
from server_harness import Running, small_engine

import jkv
from jkv.policies import KVzip, SnapKV, SnapKVSegments
from jkv.serve.server import Server

PROMPT = "The code for Valentin is 9 3 3 7 8 . The code for Mara is 1 2 4 4 0 ."
MESSAGES = [{"role": "user", "content": "what is the code for Mara"}]


@pytest.fixture(scope="module")
def running(demo_params):
    server = Running(Server(demo_params, small_engine(demo_params)))
    yield server
    server.stop()


def post(running, path, body):
    return httpx.post(running.url + path, json=body, timeout=120)


# every field as the official clients and common SDKs send it when asking for the default
DEFAULTS = dict(
    n=1, logprobs=False, top_logprobs=0, presence_penalty=0, frequency_penalty=0.0,
    logit_bias={}, response_format={"type": "text"}, tools=[], tool_choice="none",
    parallel_tool_calls=True, store=False, service_tier="auto", user="someone", metadata={},
    modalities=["text"], stream_options={"include_usage": False}, seed=None, stop=None,
)  # fmt: skip


def test_fields_at_their_defaults_are_accepted_and_change_nothing(running):
    client = running.client()
    plain = client.chat.completions.create(
        model="jkv-demo", messages=MESSAGES, max_tokens=6, temperature=0
    )
    extra = {k: v for k, v in DEFAULTS.items() if k not in ("stream_options",)}
    full = client.chat.completions.create(
        model="jkv-demo", messages=MESSAGES, max_tokens=6, temperature=0, **extra
    )
    assert full.choices[0].message.content == plain.choices[0].message.content
    completion = dict(DEFAULTS, echo=False, best_of=1, suffix="", logprobs=None)
    for name in ("tools", "tool_choice", "parallel_tool_calls", "response_format", "modalities"):
        completion.pop(name)  # chat-only fields
    got = post(running, "/v1/completions", {"model": "jkv-demo", "prompt": PROMPT,
                                            "max_tokens": 5, "temperature": 0, **completion})  # fmt: skip
    assert got.status_code == 200, got.text
    streamed = client.chat.completions.create(
        model="jkv-demo", messages=MESSAGES, max_tokens=6, temperature=0, stream=True,
        stream_options={"include_usage": False}, logprobs=False, n=1,
    )  # fmt: skip
    text = "".join(c.choices[0].delta.content or "" for c in streamed if c.choices)
    assert text == plain.choices[0].message.content


NON_DEFAULT = [
    ("n", 2),
    ("logprobs", True),
    ("top_logprobs", 3),
    ("presence_penalty", 0.5),
    ("frequency_penalty", -1),
    ("logit_bias", {"5": 10}),
    ("response_format", {"type": "json_object"}),
    ("tools", [{"type": "function", "function": {"name": "f"}}]),
    ("tool_choice", "required"),
    ("store", True),
    ("service_tier", "flex"),
    ("audio", {"voice": "alloy", "format": "mp3"}),
]


@pytest.mark.parametrize("field, value", NON_DEFAULT, ids=[f for f, _ in NON_DEFAULT])
def test_other_values_of_unimplemented_fields_are_400_naming_the_field(running, field, value):
    body = {"model": "jkv-demo", "messages": MESSAGES, "max_tokens": 2, field: value}
    r = post(running, "/v1/chat/completions", body)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"] == field and "not supported" in error["message"], error


STRICT = [  # (endpoint, field, value, param): no value is coerced to the expected type
    ("chat", "stream_options", {"include_usage": "no"}, "stream_options.include_usage"),
    ("chat", "messages", [{"role": "user", "content": [{"type": "text", "text": 5}]}],
     "messages[0].content[0].text"),
    ("chat", "messages", [{"role": "user", "content": [{"type": "text"}]}],
     "messages[0].content[0].text"),
    ("chat", "messages", [{"role": "user", "content": "hi", "name": 3}], "messages[0].name"),
    ("chat", "logprobs", 0, "logprobs"),
    ("chat", "n", "1", "n"),
    ("chat", "presence_penalty", False, "presence_penalty"),
    ("chat", "user", 5, "user"),
    ("chat", "temperature", "0", "temperature"),
    ("chat", "max_tokens", 5.0, "max_tokens"),
    ("chat", "stream", 1, "stream"),
    ("completion", "echo", 0, "echo"),
    ("completion", "seed", 1.5, "seed"),
    ("completion", "kv_budget", True, "kv_budget"),
    ("completion", "kv_policy", ["snapkv"], "kv_policy"),
    ("completion", "logit_keep_ratio", "0.5", "logit_keep_ratio"),
]  # fmt: skip


@pytest.mark.parametrize("kind, field, value, param", STRICT, ids=[s[3] for s in STRICT])
def test_types_are_strict(running, kind, field, value, param):
    path = "/v1/chat/completions" if kind == "chat" else "/v1/completions"
    body = {"model": "jkv-demo", "max_tokens": 2, field: value}
    body.setdefault(
        "messages" if kind == "chat" else "prompt", MESSAGES if kind == "chat" else PROMPT
    )
    r = post(running, path, body)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param, r.json()


def test_kv_policy_takes_the_policys_fields(running, demo_params):
    prompt = PROMPT * 2  # ~60 tokens: half of them kept
    fields = {"name": "snapkv", "window": 16, "kernel": 11, "pool": "max", "budget": 0.5}
    r = post(running, "/v1/completions", {"model": "jkv-demo", "prompt": prompt, "max_tokens": 8,
                                          "temperature": 0, "kv_policy": fields})  # fmt: skip
    assert r.status_code == 200, r.text
    policy = SnapKV(budget=0.5, window=16, kernel=11, pool="max")
    want = jkv.generate(demo_params, prompt, max_new_tokens=8, kv_policy=policy)
    assert r.json()["choices"][0]["text"] == want.text
    # the same policy by name and kv_budget, its fields beside
    client = running.client()
    again = client.completions.create(
        model="jkv-demo", prompt=prompt, max_tokens=8, temperature=0,
        extra_body={"kv_policy": {k: v for k, v in fields.items() if k != "budget"},
                    "kv_budget": 0.5},
    )  # fmt: skip
    assert again.choices[0].text == want.text


def test_kvzip_is_served_with_the_tokens_of_the_request_alone(running, demo_params):
    """KVzip's replay runs in the server's engine, over the request's own pages: the answer is
    `jkv.generate`'s for the same request alone (at 20% of this prompt, keeping the most recent
    slots answers otherwise); a field the engine does not honour is 400."""
    prompt = PROMPT + " what is the code for Mara ?"
    r = post(running, "/v1/completions", {"model": "jkv-demo", "prompt": prompt, "max_tokens": 8,
                                          "temperature": 0, "kv_policy": "kvzip",
                                          "kv_budget": 0.2})  # fmt: skip
    assert r.status_code == 200, r.text
    want = jkv.generate(demo_params, prompt, max_new_tokens=8, kv_policy=KVzip(budget=0.2))
    assert r.json()["choices"][0]["text"] == want.text
    bad = post(running, "/v1/completions", {"model": "jkv-demo", "prompt": prompt,
                                            "kv_policy": {"name": "kvzip", "replaying": True}})  # fmt: skip
    assert bad.status_code == 400 and "replaying=True" in bad.json()["error"]["message"], bad.text


def test_the_segment_rebuild_is_served_with_the_tokens_of_the_request_alone(running, demo_params):
    """snapkv_segments in the server's engine (its ordinary slots and low-rank pages in the
    row's prefix): the answer is `jkv.generate`'s for the same request alone; a segment length
    the engine's pages do not hold is 400 naming it."""
    prompt = (PROMPT + " ") * 3 + "what is the code for Mara ?"
    fields = {"name": "snapkv_segments", "segment_len": 32, "window": 16}
    r = post(running, "/v1/completions", {"model": "jkv-demo", "prompt": prompt, "max_tokens": 8,
                                          "temperature": 0, "kv_policy": fields,
                                          "kv_budget": 0.25})  # fmt: skip
    assert r.status_code == 200, r.text
    policy = SnapKVSegments(budget=0.25, segment_len=32, window=16)
    want = jkv.generate(demo_params, prompt, max_new_tokens=8, kv_policy=policy)
    assert r.json()["choices"][0]["text"] == want.text
    bad = post(running, "/v1/completions", {"model": "jkv-demo", "prompt": prompt,
                                            "kv_policy": {**fields, "segment_len": 64}})  # fmt: skip
    assert bad.status_code == 400 and "segment_len=64" in bad.json()["error"]["message"], bad.text


POLICY_ERRORS = [  # (jkv fields, param, words of the message)
    ({"kv_policy": "snapkv", "kv_budget": -2}, "kv_budget", "budget=-2"),
    ({"kv_budget": 0.5}, "kv_budget", "needs a compressing kv_policy"),
    ({"kv_policy": {"name": "snapkv", "window": 0}}, "kv_policy", "window=0"),
    ({"kv_policy": {"name": "snapkv", "pool": "min"}}, "kv_policy", "pool='min'"),
    ({"kv_policy": {"name": "snapkv", "windw": 16}}, "kv_policy.windw", "no such field"),
    ({"kv_policy": {"name": "magic"}}, "kv_policy.name", "expected one of"),
    ({"kv_policy": {"window": 8}}, "kv_policy.name", "expected one of"),
    ({"kv_policy": {"name": "snapkv", "budget": 0.5}, "kv_budget": 0.5}, "kv_budget", "give one"),
    ({"kv_policy": {"name": "snapkv", "window": 200}}, "kv_policy", "one step"),  # the engine's
]


@pytest.mark.parametrize("fields, param, words", POLICY_ERRORS, ids=[p[2] for p in POLICY_ERRORS])
def test_kv_policy_errors_name_the_field(running, fields, param, words):
    r = post(running, "/v1/completions", {"model": "jkv-demo", "prompt": PROMPT * 2,
                                          "max_tokens": 2, **fields})  # fmt: skip
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"] == param and words in error["message"], error


def test_the_official_client_raises_bad_request_naming_the_field(running):
    with pytest.raises(openai.BadRequestError, match="stream_options.include_usage"):
        running.client().chat.completions.create(
            model="jkv-demo", messages=MESSAGES, max_tokens=2, stream=True,
            stream_options={"include_usage": "no"},
        )  # fmt: skip


def test_kv_dtype_is_the_servers_or_400(running):
    """The pool stores one dtype, the server's (float32 for the demo): a body asking for
    another is refused naming the flag that sets it, never ignored."""
    body = {"model": "jkv-demo", "prompt": PROMPT, "max_tokens": 2, "temperature": 0}
    assert post(running, "/v1/completions", {**body, "kv_dtype": "float32"}).status_code == 200
    for value in ("bfloat16", "fp8", "fp9", 16):
        r = post(running, "/v1/completions", {**body, "kv_dtype": value})
        assert r.status_code == 400, r.text
        error = r.json()["error"]
        assert error["param"] == "kv_dtype" and "jkv serve --kv-dtype" in error["message"]
        assert "float32" in error["message"], error
