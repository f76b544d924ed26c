"""API keys and server-side tenants: without a valid bearer key a request is 401 (OpenAI's
error JSON); the key decides the tenant, and a tenant's response cache and prefix cache are its
own: another tenant sending the same prompt, or the same `cache_salt`, gets neither."""

from __future__ import annotations

import httpx
import openai
import pytest
from server_harness import Running, small_engine

import jkv
from jkv.serve import auth
from jkv.serve.server import Server

KEYS = {"sk-alice-1": "alice", "sk-alice-2": "alice", "sk-bob": "bob"}
PROMPT = "The code for Valentin is 9 3 3 7 8 . The code for Mara is 1 2 4 4 0 ." * 3


@pytest.fixture(scope="module")
def running(demo_params):
    cache = jkv.ResponseCache()
    server = Running(Server(demo_params, small_engine(demo_params), response_cache=cache,
                            api_keys=KEYS))  # fmt: skip
    yield server
    server.stop()
    cache.close()


def ask(running, key, **body):
    body = {"model": "jkv-demo", "prompt": PROMPT, "max_tokens": 3, "temperature": 0, **body}
    headers = {} if key is None else {"authorization": f"Bearer {key}"}
    return httpx.post(running.url + "/v1/completions", json=body, headers=headers, timeout=120)


@pytest.mark.parametrize(
    "headers",
    [{}, {"authorization": "Bearer sk-wrong"}, {"authorization": "sk-bob"},
     {"authorization": "Basic c2stYm9i"}, {"authorization": "Bearer"}],
    ids=["none", "wrong", "no-scheme", "basic", "empty"],
)  # fmt: skip
def test_no_valid_key_is_401_on_every_api_path(running, headers):
    for method, path in (("POST", "/v1/completions"), ("POST", "/v1/chat/completions"),
                         ("GET", "/v1/models"), ("GET", "/openapi.json")):  # fmt: skip
        r = httpx.request(method, running.url + path, headers=headers, timeout=60,
                          json={"model": "jkv-demo", "prompt": "x"})  # fmt: skip
        assert r.status_code == 401, r.text
        assert r.headers["www-authenticate"].startswith("Bearer")
        error = r.json()["error"]
        assert (error["type"], error["code"]) == ("invalid_request_error", "invalid_api_key")
    assert httpx.get(running.url + "/health", timeout=60).status_code == 200  # open by default
    assert httpx.get(running.url + "/metrics", timeout=60).status_code == 200


def test_the_official_client_with_a_key(running):
    client = openai.OpenAI(base_url=running.url + "/v1", api_key="sk-bob", max_retries=0)
    assert [m.id for m in client.models.list().data] == ["jkv-demo"]
    got = client.completions.create(model="jkv-demo", prompt="The code", max_tokens=2,
                                    temperature=0)  # fmt: skip
    assert got.usage.completion_tokens == 2
    bob = {"authorization": "Bearer sk-bob"}
    schema = httpx.get(running.url + "/openapi.json", headers=bob).json()
    assert "/v1/chat/completions" in schema["paths"]
    for path in ("/docs", "/redoc"):  # not served
        assert httpx.get(running.url + path, headers=bob).status_code == 404
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=running.url + "/v1", api_key="sk-eve", max_retries=0).models.list()


def test_tenants_have_their_own_response_and_prefix_caches(running):
    def cache_of(key, **body):
        r = ask(running, key, **body)
        assert r.status_code == 200, r.text
        return r.headers["x-jkv-cache"], r.json()["usage"]["prompt_tokens_details"]["cached_tokens"]

    assert cache_of("sk-alice-1", cache_salt="shared") == ("miss", 0)
    assert cache_of("sk-alice-1", cache_salt="shared")[0] == "l1"
    assert cache_of("sk-alice-2", cache_salt="shared")[0] == "l1"  # alice's other key
    # bob sends alice's prompt and salt: he gets neither her answer nor her pages
    assert cache_of("sk-bob", cache_salt="shared") == ("miss", 0)
    assert cache_of("sk-bob", cache_salt="shared")[0] == "l1"
    # a salt narrows within a tenant: alice's other salt is a miss, her pages stay hers
    hit, cached = cache_of("sk-alice-1", cache_salt="other", max_tokens=4)
    assert hit == "miss" and cached == 0
    # without a salt, each tenant shares one cache of its own
    assert cache_of("sk-alice-1", max_tokens=5) == ("miss", 0)
    hit, cached = cache_of("sk-alice-2", max_tokens=6)
    assert hit == "miss" and cached >= 32  # alice's pages, a full page or more of them
    assert cache_of("sk-bob", max_tokens=6) == ("miss", 0)


def test_health_and_metrics_can_need_a_key(demo_params, serve):
    running = serve(Server(demo_params, small_engine(demo_params), api_keys=KEYS,
                           protect_health_metrics=True))  # fmt: skip
    for path in ("/health", "/metrics"):
        assert httpx.get(running.url + path, timeout=60).status_code == 401
        r = httpx.get(running.url + path, headers={"authorization": "Bearer sk-bob"}, timeout=60)
        assert r.status_code == 200


def test_keys_from_flags_the_environment_and_a_file(tmp_path):
    assert auth.load() is None
    path = tmp_path / "keys"
    path.write_text("# key tenant\nsk-a1 alice\n\nsk-a2 alice  \nsk-b bob\n")
    keys = auth.load(["sk-flag"], path, {"JKV_API_KEY": "sk-env"})
    assert keys.tenants == {"alice", "bob", auth.default_tenant("sk-flag"),
                            auth.default_tenant("sk-env")}  # fmt: skip
    assert keys.tenant("Bearer sk-a2") == "alice" and keys.tenant("bearer  sk-b") == "bob"
    assert auth.default_tenant("sk-flag").startswith("key-") and "flag" not in keys.tenants
    for text, words in (
        ("sk-a alice extra\n", ":1: expected 'KEY TENANT'"),
        ("sk-a\n", ":1: expected 'KEY TENANT'"),
        ("sk-a alice\nsk-a bob\n", ":2: this key is already the key of tenant 'alice'"),
        ("sk-a ali{ce\n", ":1: expected 'KEY TENANT'"),
    ):
        path.write_text(text)
        with pytest.raises(ValueError, match=words):
            auth.load((), path)
    with pytest.raises(ValueError, match="cannot read the API keys file"):
        auth.load((), tmp_path / "missing")
    with pytest.raises(ValueError, match="non-empty string without whitespace"):
        auth.load(["two words"])


def test_cache_salts_never_cross_tenants():
    salts = {auth.cache_salt(t, s) for t in ("alice", "bob", None) for s in ("x", "y", None)}
    assert len(salts) == 9 and auth.cache_salt(None, None) is None
    assert auth.cache_salt("alice", None) != auth.cache_salt(None, "alice")
