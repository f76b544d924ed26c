"""`POST /v1/contexts` over real HTTP (the official `openai` client for the questions): a
context is prefilled once by the engine, compressed by its KV policy, and answers questions that
name it (`extra_body={"context": id}`) as jkv.generate answers the context's tokens followed by
the question's (the full cache), or continues jkv.prefill's compressed state (SnapKV); its
tokens count as cached; it belongs to its API key's tenant; its KV leaves host RAM past
`context_host_bytes` and is prefilled again when named (same answers); a tenant's quota, a
context's TTL and bad bodies answer with OpenAI's error JSON."""

from __future__ import annotations

import time

import httpx
import openai
import pytest
from server_harness import small_engine

import jkv
from jkv.serve.server import Server

DOC = "The code for Valentin is 9 3 3 7 8 . The code for Mara is 1 2 4 4 0 . " * 2
OTHER = "Anna has a red ball and Bob has a blue box . The box is under the tree . " * 2
QUESTION = " The code for Mara is"
KEYS = {"sk-alice": "alice", "sk-bob": "bob"}


def _post(running, key, **body):
    return httpx.post(running.url + "/v1/contexts", json={"model": "jkv-demo", **body},
                      headers={"authorization": f"Bearer {key}"}, timeout=120)  # fmt: skip


def _client(running, key):
    return openai.OpenAI(base_url=running.url + "/v1", api_key=key, max_retries=0)


def _ids(params, text, special=True):
    return params.tokenizer.encode(text, add_special_tokens=special)


def test_a_context_answers_as_the_whole_prompt_and_stays_its_tenants(serve, demo_params):
    running = serve(Server(demo_params, small_engine(demo_params), api_keys=KEYS))
    before = time.time()
    made = _post(running, "sk-alice", prompt=DOC, ttl=60)
    assert made.status_code == 200, made.text
    ctx = made.json()
    doc = _ids(demo_params, DOC)
    assert ctx["object"] == "context" and ctx["tokens"] == len(doc) and ctx["kv_policy"] == "full"
    assert ctx["bytes"] > 0 and before + 59 <= ctx["expires_at"] <= time.time() + 61
    alice = _client(running, "sk-alice")
    question = _ids(demo_params, QUESTION, special=False)
    got = alice.completions.create(model="jkv-demo", prompt=QUESTION, max_tokens=8,
                                   temperature=0, extra_body={"context": ctx["id"]})  # fmt: skip
    want = jkv.generate(demo_params, doc + question, max_new_tokens=8, temperature=0.0)
    assert got.choices[0].text == want.text
    assert got.usage.prompt_tokens == len(doc) + len(question)
    assert got.usage.prompt_tokens_details.cached_tokens == len(doc)
    # a chat after the same context: its rendered messages follow the context's tokens
    messages = [{"role": "user", "content": "what is the code for Mara"}]
    chat = alice.chat.completions.create(model="jkv-demo", messages=messages, max_tokens=6,
                                         temperature=0, extra_body={"context": ctx["id"]})  # fmt: skip
    # (the template opens with the bos token: the context has it already)
    rendered = _ids(demo_params, "user: what is the code for Mara\nassistant:", special=False)
    want = jkv.generate(demo_params, doc + rendered, max_new_tokens=6, temperature=0.0)
    assert chat.choices[0].message.content == want.text
    got = httpx.get(f"{running.url}/v1/contexts/{ctx['id']}",
                    headers={"authorization": "Bearer sk-alice"})  # fmt: skip
    assert got.json() == ctx
    # bob cannot see, use or delete alice's context
    bob = {"authorization": "Bearer sk-bob"}
    for r in (httpx.get(f"{running.url}/v1/contexts/{ctx['id']}", headers=bob),
              httpx.delete(f"{running.url}/v1/contexts/{ctx['id']}", headers=bob)):  # fmt: skip
        assert r.status_code == 404 and r.json()["error"]["code"] == "context_not_found"
    with pytest.raises(openai.NotFoundError, match="not found"):
        _client(running, "sk-bob").completions.create(
            model="jkv-demo", prompt=QUESTION, max_tokens=2, extra_body={"context": ctx["id"]}
        )
    gone = httpx.delete(f"{running.url}/v1/contexts/{ctx['id']}",
                        headers={"authorization": "Bearer sk-alice"})  # fmt: skip
    assert gone.json() == {"id": ctx["id"], "object": "context.deleted", "deleted": True}
    with pytest.raises(openai.NotFoundError):
        alice.completions.create(model="jkv-demo", prompt=QUESTION, max_tokens=2,
                                 extra_body={"context": ctx["id"]})  # fmt: skip
    assert running.server.engine.pool.used_pages == 0


def test_compressed_contexts_leave_host_ram_and_come_back_with_the_same_answers(serve, demo_params):
    """SnapKV 25% contexts answer as jkv.generate continues jkv.prefill's; a host store that
    holds one KV drops the older for the newer and prefills it again when asked (the same
    answer); a tenant's quota, the TTL and bad bodies get OpenAI's error JSON."""
    probe = jkv.prefill(demo_params, _ids(demo_params, DOC), kv_policy="snapkv", kv_budget=0.25)
    server = Server(demo_params, small_engine(demo_params), api_keys=KEYS,
                    context_host_bytes=int(probe.nbytes * 1.5),
                    max_context_bytes_per_tenant=int(probe.nbytes * 2.5))  # fmt: skip
    running = serve(server)
    alice = _client(running, "sk-alice")
    question = _ids(demo_params, QUESTION, special=False)

    def ask(context_id):
        return alice.completions.create(model="jkv-demo", prompt=QUESTION, max_tokens=8,
                                        temperature=0, extra_body={"context": context_id})  # fmt: skip

    answers = {}
    ids = {}
    for text in (DOC, OTHER):
        made = _post(running, "sk-alice", prompt=text, kv_policy="snapkv", kv_budget=0.25)
        assert made.status_code == 200, made.text
        ids[text] = made.json()["id"]
        assert made.json()["kv_policy"] == "snapkv"
        state = jkv.prefill(demo_params, _ids(demo_params, text), kv_policy="snapkv",
                            kv_budget=0.25)  # fmt: skip
        assert made.json()["bytes"] == state.nbytes
        want = jkv.generate(demo_params, question, kv_state=state, max_new_tokens=8,
                            temperature=0.0)  # fmt: skip
        answers[text] = ask(ids[text]).choices[0].text
        assert answers[text] == want.text
    stats = server.contexts.stats
    assert stats.evicted == 1 and stats.recomputed == 0  # DOC's KV left for OTHER's
    assert ask(ids[DOC]).choices[0].text == answers[DOC]
    assert stats.recomputed == 1 and server.contexts.ram_bytes <= int(probe.nbytes * 1.5)

    over = _post(running, "sk-alice", prompt=DOC + OTHER, kv_policy="snapkv", kv_budget=0.25)
    assert over.status_code == 429 and over.json()["error"]["code"] == "context_quota_exceeded"
    assert (
        _post(running, "sk-bob", prompt=DOC, kv_policy="snapkv", kv_budget=0.25).status_code == 200
    )
    bad = [
        (dict(prompt=DOC, ttl=0), "ttl"),
        (dict(prompt=DOC, kv_policy="streaming", kv_budget=8), "kv_policy"),
        (dict(prompt=DOC, kv_policy="nope"), "kv_policy"),
        (dict(prompt=DOC, model="gpt-4"), "model"),
        (dict(prompt=""), "prompt"),
    ]
    for body, param in bad:
        r = _post(running, "sk-alice", **body)
        assert r.status_code == 400 and r.json()["error"]["param"] == param, (body, r.text)
    with pytest.raises(openai.BadRequestError, match="kv_policy given beside context"):
        alice.completions.create(model="jkv-demo", prompt=QUESTION, max_tokens=2,
                                 extra_body={"context": ids[DOC], "kv_policy": "snapkv"})  # fmt: skip
    with pytest.raises(openai.NotFoundError, match="not found"):
        ask("ctx-nothing")
    server.contexts.clock = lambda: time.time() + 7200  # past the default hour
    with pytest.raises(openai.NotFoundError):
        ask(ids[OTHER])
    assert len(server.contexts) == 0 and server.contexts.ram_bytes == 0
    assert server.engine.pool.used_pages == 0


def test_two_servers_on_one_redis_share_contexts_and_survive_its_failures(
    serve, demo_params, redis_server
):
    """A context made on server A is answered by server B from Redis, without prefilling it
    (the same answer); a corrupted chunk is refused by its checksum and B prefills it again;
    Redis killed: A still makes and answers contexts, B prefills what it had read, no request
    fails; another tenant's id is not found on B either."""
    import redis

    a = serve(Server(demo_params, small_engine(demo_params), api_keys=KEYS,
                     context_redis_url=redis_server.url))  # fmt: skip
    b = serve(Server(demo_params, small_engine(demo_params), api_keys=KEYS,
                     context_redis_url=redis_server.url))  # fmt: skip
    made = _post(a, "sk-alice", prompt=DOC, kv_policy="snapkv", kv_budget=0.25)
    assert made.status_code == 200, made.text
    cid = made.json()["id"]
    question = _ids(demo_params, QUESTION, special=False)
    state = jkv.prefill(demo_params, _ids(demo_params, DOC), kv_policy="snapkv", kv_budget=0.25)
    want = jkv.generate(demo_params, question, kv_state=state, max_new_tokens=8, temperature=0.0)

    def ask(running, key="sk-alice"):
        return _client(running, key).completions.create(
            model="jkv-demo", prompt=QUESTION, max_tokens=8, temperature=0,
            extra_body={"context": cid},
        ).choices[0].text  # fmt: skip

    assert ask(b) == want.text
    got = httpx.get(f"{b.url}/v1/contexts/{cid}", headers={"authorization": "Bearer sk-alice"})
    assert got.json() == made.json()
    sb = b.server.contexts.stats
    assert (sb.redis_hits, sb.recomputed) == (1, 0)
    with pytest.raises(openai.NotFoundError):
        ask(b, "sk-bob")

    # a corrupted chunk: refused by its checksum, prefilled again, the same answer
    client = redis.Redis.from_url(redis_server.url)
    [chunk] = [k for k in client.keys(f"jkv:ctx:{{{cid}}}:*:0")]
    client.setrange(chunk, 100, b"\x00garbage\x00")
    b.server.contexts.get(cid, "alice").kv = None  # out of B's RAM: read Redis again
    b.server.contexts._in_ram.clear()
    assert ask(b) == want.text
    assert (sb.refused, sb.recomputed) == (1, 1)

    # Redis killed: nothing fails
    redis_server.kill()
    other = _post(a, "sk-alice", prompt=OTHER)  # made, Redis's write logged and skipped
    assert other.status_code == 200
    assert ask(a) == want.text and ask(b) == want.text
    assert a.server.contexts.stats.redis_errors >= 1
    assert a.server.engine.pool.used_pages == 0 and b.server.engine.pool.used_pages == 0
