"""`jkv serve` over real HTTP: the official `openai` client, streaming and not, against the demo
model; answers equal `jkv.generate` (the one-shot path, an independent route through the
model); bad input gets 400 with OpenAI's error JSON and the server keeps serving; the response
cache answers repeats (never across tenants); a full queue answers 503 with Retry-After; a
client that leaves gives its pages back; metrics, traces and log lines say what happened."""

from __future__ import annotations

import asyncio
import json
import logging
import random
import threading
import time

import httpx
import openai
import pytest
from opentelemetry import trace
from prometheus_client.parser import text_string_to_metric_families
from server_harness import Running, small_engine

import jkv
from jkv.serve.metrics import ITL_BUCKETS, TTFT_BUCKETS
from jkv.serve.server import Server

PROMPT = "The code for Valentin is 9 3 3 7 8 . The code for Mara is 1 2 4 4 0 ."


@pytest.fixture(scope="module")
def shared(demo_params):
    """One server (with an L1 response cache) for the tests that need nothing special."""
    cache = jkv.ResponseCache()
    running = Running(Server(demo_params, small_engine(demo_params), response_cache=cache))
    yield running
    running.stop()
    cache.close()


def expected(params, prompt, n, **settings):
    return jkv.generate(params, prompt, max_new_tokens=n, temperature=0.0, **settings).text


def test_completions_and_chat_equal_generate_streamed_or_not(shared, demo_params):
    client = shared.client()
    assert [m.id for m in client.models.list().data] == ["jkv-demo"]
    assert httpx.get(shared.url + "/health").json() == {"status": "ok"}

    got = client.completions.create(model="jkv-demo", prompt=PROMPT, max_tokens=12,
                                    temperature=0)  # fmt: skip
    assert got.choices[0].text == expected(demo_params, PROMPT, 12)
    assert got.choices[0].finish_reason == "length"
    n_prompt = len(demo_params.tokenizer.encode(PROMPT))
    assert (got.usage.prompt_tokens, got.usage.completion_tokens) == (n_prompt, 12)

    pieces = client.completions.create(model="jkv-demo", prompt=PROMPT + " The", max_tokens=9,
                                       temperature=0, stream=True)  # fmt: skip
    text = "".join(c.choices[0].text for c in pieces)
    assert text == expected(demo_params, PROMPT + " The", 9)

    # chat: the default template renders "user: ...\nassistant:" (no template in the demo)
    messages = [{"role": "user", "content": "what is the code for Mara"}]
    rendered = "user: what is the code for Mara\nassistant:"
    chat = client.chat.completions.create(model="jkv-demo", messages=messages, max_tokens=10,
                                          temperature=0, extra_body={"cache_salt": "chat-a"})  # fmt: skip
    assert chat.choices[0].message.content == expected(demo_params, rendered, 10)
    assert chat.choices[0].message.role == "assistant"
    stream = client.chat.completions.create(
        model="jkv-demo", messages=messages, max_tokens=10, temperature=0, stream=True,
        stream_options={"include_usage": True}, extra_body={"cache_salt": "chat-b"},
    )  # fmt: skip
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == (
        chat.choices[0].message.content
    )
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 10
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"

    # the wire: server-sent events ending with data: [DONE]
    body = {"model": "jkv-demo", "prompt": "The code", "max_tokens": 3, "temperature": 0,
            "stream": True, "seed": 5}  # fmt: skip
    with httpx.stream("POST", shared.url + "/v1/completions", json=body, timeout=120) as r:
        assert r.headers["content-type"].startswith("text/event-stream")
        events = [line for line in r.iter_lines() if line]
    assert events[-1] == "data: [DONE]" and all(e.startswith("data: ") for e in events)


def test_sampling_and_stop_strings_follow_generate(shared, demo_params):
    client = shared.client()
    settings = dict(temperature=0.9, top_p=0.8, seed=11)
    got = client.completions.create(model="jkv-demo", prompt=PROMPT, max_tokens=16, **settings,
                                    extra_body={"top_k": 20, "cache_salt": "s"})  # fmt: skip
    ref = jkv.generate(demo_params, PROMPT, max_new_tokens=16, top_k=20, **settings)
    assert got.choices[0].text == ref.text
    stop = ref.text.split()[3]  # a word the answer holds: the text ends before it
    cut = client.completions.create(model="jkv-demo", prompt=PROMPT, max_tokens=16, stop=[stop],
                                    **settings, extra_body={"top_k": 20})  # fmt: skip
    assert cut.choices[0].finish_reason == "stop"
    assert cut.choices[0].text == ref.text[: ref.text.index(stop)]


BAD = [
    ("not json", b"{model: demo", None),
    ("a list", b"[1, 2]", None),
    ("unknown model", {"model": "gpt-5", "prompt": "hi"}, "model"),
    ("temperature", {"temperature": 5}, "temperature"),
    ("top_p", {"top_p": 0}, "top_p"),
    ("max_tokens", {"max_tokens": 0}, "max_tokens"),
    ("n", {"n": 3}, "n"),
    ("stop", {"stop": ["a", "b", "c", "d", "e"]}, "stop"),
    ("empty prompt", {"prompt": "  "}, "prompt"),
    ("token id", {"prompt": [1, 5, 100000]}, "prompt"),
    ("prompt too long", {"prompt": "The code " * 300}, "prompt"),
    ("max_tokens past context", {"max_tokens": 400}, "max_tokens"),
    ("unknown policy", {"kv_policy": "magic"}, None),
    ("bad budget", {"kv_policy": "snapkv", "kv_budget": -2}, None),
    ("segment rebuild", {"kv_policy": "snapkv_segments", "kv_budget": 0.5}, None),
    ("stream", {"stream": "yes"}, "stream"),
    ("messages", {"messages": []}, "messages"),
    ("cache_salt", {"cache_salt": 7}, "cache_salt"),
]


@pytest.mark.parametrize("name, body, param", BAD, ids=[b[0] for b in BAD])
def test_bad_input_gets_400_with_openai_error_json(shared, name, body, param):
    path = "/v1/chat/completions" if name == "messages" else "/v1/completions"
    if isinstance(body, dict):
        body = json.dumps({"model": "jkv-demo", "prompt": "The code", **body}).encode()
    r = httpx.post(
        shared.url + path, content=body, headers={"content-type": "application/json"}, timeout=120
    )
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["type"] == "invalid_request_error" and error["message"]
    if param is not None:
        assert error["param"] == param, error


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
def test_a_lone_surrogate_in_stop_is_400(shared, path, stream):
    """Greedy, so the response cache is asked: its key once failed to pack (500)."""
    body = {"model": "jkv-demo", "temperature": 0, "stream": stream, "stop": ["x", "\ud800"],
            "prompt": "The code", "messages": [{"role": "user", "content": "The"}]}  # fmt: skip
    del body["messages" if path == "/v1/completions" else "prompt"]
    r = httpx.post(shared.url + path, content=json.dumps(body).encode(),  # "\ud800" escaped
                   headers={"content-type": "application/json"}, timeout=120)  # fmt: skip
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"] == "stop" and "lone surrogate" in error["message"], error


def test_bad_input_leaves_the_server_serving(shared):
    client = shared.client()
    with pytest.raises(openai.BadRequestError, match="temperature"):
        client.completions.create(model="jkv-demo", prompt="x", temperature=-1)
    ok = client.completions.create(model="jkv-demo", prompt="The code", max_tokens=2,
                                   temperature=0)  # fmt: skip
    assert ok.usage.completion_tokens == 2


def test_response_cache_answers_repeats_never_across_tenants(demo_params, serve, redis_server):
    caches = [jkv.ResponseCache(redis_server.url) for _ in range(2)]
    engine = small_engine(demo_params)
    a = serve(Server(demo_params, engine, response_cache=caches[0]))

    def ask(running, **body):
        body = {"model": "jkv-demo", "prompt": PROMPT, "max_tokens": 6, **body}
        r = httpx.post(running.url + "/v1/completions", json=body, timeout=120)
        assert r.status_code == 200, r.text
        return r.headers["x-jkv-cache"], r.json()["usage"]["jkv_cache"], r.json()

    first = ask(a, temperature=0)
    assert first[:2] == ("miss", None)
    again = ask(a, temperature=0)
    assert again[:2] == ("l1", "l1")
    assert again[2]["choices"][0]["text"] == first[2]["choices"][0]["text"]
    assert ask(a, temperature=0, cache_salt="tenant-b")[:2] == ("miss", None)  # other tenant
    assert ask(a, temperature=0, cache_salt="tenant-b")[:2] == ("l1", "l1")
    assert ask(a, temperature=0, max_tokens=5)[0] == "miss"  # other settings
    assert ask(a, temperature=0.7)[0] == "miss"  # sampled without a seed: never cached
    assert ask(a, temperature=0.7)[0] == "miss"
    assert ask(a, temperature=0.7, seed=3)[0] == "miss"
    assert ask(a, temperature=0.7, seed=3)[0] == "l1"
    # another server on the same Redis: its L1 is empty, L2 answers
    b = serve(Server(demo_params, engine, response_cache=caches[1]))
    assert ask(b, temperature=0)[:2] == ("l2", "l2")
    text = json.dumps(httpx.get(a.url + "/metrics", timeout=60).text)
    assert 'jkv:response_cache_hits_total{level=\\"l1\\",model_name=\\"jkv-demo\\"} 3.0' in text
    # streamed hits say so too
    with httpx.stream("POST", b.url + "/v1/completions", timeout=120, json={
        "model": "jkv-demo", "prompt": PROMPT, "max_tokens": 6, "temperature": 0, "stream": True,
    }) as r:  # fmt: skip
        assert r.headers["x-jkv-cache"] == "l1"
        lines = [x for x in r.iter_lines() if x]
    assert lines[-1] == "data: [DONE]"
    assert json.loads(lines[0][6:])["choices"][0]["text"] == first[2]["choices"][0]["text"]
    for cache in caches:
        cache.close()


def test_servers_of_another_kv_dtype_never_share_answers(demo_params, serve, redis_server):
    """Two servers on one Redis, one storing its KV cache in bfloat16 (--kv-dtype): neither
    answers from the other's entries (the key took the weights' dtype, float32 for both)."""
    caches = [jkv.ResponseCache(redis_server.url, namespace="kvdtype") for _ in range(3)]
    f32 = serve(Server(demo_params, small_engine(demo_params), response_cache=caches[0]))
    bf16 = serve(Server(demo_params, small_engine(demo_params, kv_dtype="bfloat16"),
                        response_cache=caches[1]))  # fmt: skip
    again = serve(Server(demo_params, small_engine(demo_params), response_cache=caches[2]))

    def ask(running):
        body = {"model": "jkv-demo", "prompt": PROMPT, "max_tokens": 6, "temperature": 0}
        r = httpx.post(running.url + "/v1/completions", json=body, timeout=120)
        assert r.status_code == 200, r.text
        return r.headers["x-jkv-cache"]

    assert ask(f32) == "miss"
    assert ask(bf16) == "miss"  # float32's answer is not bfloat16's
    assert ask(again) == "l2"  # a float32 server on the same Redis does share it
    for cache in caches:
        cache.close()


def test_prefix_cache_hits_are_reported_per_tenant(shared):
    client = shared.client()
    prompt = PROMPT * 3  # several full pages

    def cached(n, salt):
        r = client.completions.create(model="jkv-demo", prompt=prompt, max_tokens=n,
                                      temperature=0, extra_body={"cache_salt": salt})  # fmt: skip
        return r.usage.prompt_tokens_details.cached_tokens

    assert cached(2, "p") == 0
    assert cached(3, "p") >= 32  # the same prompt's full pages come from the prefix cache
    assert cached(4, "q") == 0  # another tenant's pages are not shared


def test_a_burst_past_the_queue_limit_gets_503_for_the_excess_only(demo_params, serve):
    limit = 3
    running = serve(Server(demo_params, small_engine(demo_params), max_queued_requests=limit))
    n = 2 * limit + 2

    async def burst():
        async with httpx.AsyncClient(timeout=120) as client:
            body = {"model": "jkv-demo", "prompt": PROMPT, "max_tokens": 8, "temperature": 0}
            return await asyncio.gather(
                *[client.post(running.url + "/v1/completions", json=body) for _ in range(n)]
            )

    replies = asyncio.run(burst())
    codes = sorted(r.status_code for r in replies)
    assert set(codes) <= {200, 503}, codes
    refused = [r for r in replies if r.status_code == 503]
    assert refused, "the burst was never refused"
    assert codes.count(200) >= limit  # the limit's worth was admitted
    for r in refused:
        assert r.headers["retry-after"] == "1"
        assert r.json()["error"]["code"] == "queue_full"
    answers = {r.json()["choices"][0]["text"] for r in replies if r.status_code == 200}
    assert answers == {expected(demo_params, PROMPT, 8)}  # every accepted request completed
    scrape = httpx.get(running.url + "/metrics", timeout=60).text
    rejected = [
        s.value
        for f in text_string_to_metric_families(scrape)
        for s in f.samples
        if s.name == "jkv:requests_rejected_total" and s.labels["reason"] == "queue_full"
    ]
    assert rejected == [len(refused)]
    assert running.server.queued_requests == 0 and running.server.queued_tokens == 0


def test_requests_without_max_tokens_are_admitted_for_what_they_need(demo_params, serve):
    """A chat without max_tokens may run to the end of the context; admission reserves
    `reserve_tokens` for it (not the rest of the context, which let 2 of 4 run at once in
    this pool), and a request that outgrows its reserve takes pages as it goes."""
    engine = small_engine(demo_params)  # 255 pages: the rest of the context is 128 of them
    running = serve(Server(demo_params, engine, reserve_tokens=32))
    peak, done = [0], []

    def watch():
        while not done:
            peak[0] = max(peak[0], engine.stats()["running"])
            time.sleep(0.002)

    watcher = threading.Thread(target=watch)
    watcher.start()
    body = {"model": "jkv-demo", "messages": [{"role": "user", "content": PROMPT}],
            "temperature": 0}  # fmt: skip

    async def main():
        async with httpx.AsyncClient(timeout=120) as client:
            return await asyncio.gather(*[
                client.post(running.url + "/v1/chat/completions", json=body) for _ in range(4)
            ])  # fmt: skip

    replies = asyncio.run(main())
    done.append(True)
    watcher.join()
    assert [r.status_code for r in replies] == [200] * 4
    assert peak[0] == 4  # max_running: all four at once
    assert engine.stats()["pages_used"] == 0


def test_clients_hanging_up_at_once_leave_nothing_running(demo_params, serve):
    """40 clients that hang up within 50 ms of sending (before their request reached the
    engine, or after): 2 s later nothing runs or waits, the pool is at its baseline, and the
    next request takes about what it took before them (abandoned requests would keep running
    up to their 200 tokens, ahead of it). The engine is warmed up (as `jkv serve --warmup`): a
    step compiling a new shape would hold everything for seconds."""
    engine = small_engine(demo_params, token_budget=16, chunk=16)
    engine.warmup()
    running = serve(Server(demo_params, engine, response_cache=None))
    body = {"model": "jkv-demo", "prompt": PROMPT, "max_tokens": 200, "temperature": 0.8,
            "seed": 3}  # fmt: skip
    quick = {**body, "max_tokens": 4}
    with httpx.Client(timeout=60) as client:
        client.post(running.url + "/v1/completions", json=quick)  # compiles what it needs
        t0 = time.monotonic()
        assert client.post(running.url + "/v1/completions", json=quick).status_code == 200
        before = time.monotonic() - t0
    baseline = engine.stats()["pages_used"]
    rng = random.Random(0)

    async def hang_up(client):
        try:
            await client.post(running.url + "/v1/completions", json=body,
                              timeout=rng.uniform(0.001, 0.05))  # fmt: skip
        except httpx.TimeoutException:
            pass

    async def main():
        async with httpx.AsyncClient() as client:
            await asyncio.gather(*[hang_up(client) for _ in range(40)])

    asyncio.run(main())
    time.sleep(2.0)
    stats = engine.stats()
    assert (stats["running"], stats["waiting"], stats["pages_used"]) == (0, 0, baseline)
    with httpx.Client(timeout=60) as client:
        t0 = time.monotonic()
        assert client.post(running.url + "/v1/completions", json=quick).status_code == 200
        after = time.monotonic() - t0
    assert after <= max(10 * before, 1.0), (before, after)


def test_clients_leaving_mid_stream_give_their_pages_back(demo_params, serve):
    engine = small_engine(demo_params)
    running = serve(Server(demo_params, engine))
    baseline = engine.stats()["pages_used"]
    body = {"model": "jkv-demo", "prompt": PROMPT, "max_tokens": 180, "temperature": 0.8,
            "seed": 1, "stream": True}  # fmt: skip

    async def leave_after_two_chunks(client):
        async with client.stream("POST", running.url + "/v1/completions", json=body) as r:
            got = 0
            async for line in r.aiter_lines():
                got += line.startswith("data: ")
                if got == 2:
                    return  # closes the connection mid-stream

    async def main():
        async with httpx.AsyncClient(timeout=60) as client:
            await asyncio.gather(*[leave_after_two_chunks(client) for _ in range(6)])
            # a non-streamed request whose client gives up waiting (180 tokens take longer
            # than 20 ms)
            with pytest.raises(httpx.ReadTimeout):
                await client.post(running.url + "/v1/completions", timeout=0.02,
                                  json={**body, "stream": False})  # fmt: skip

    asyncio.run(main())
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline and (engine.has_work or running.server.in_flight):
        time.sleep(0.05)
    stats = engine.stats()
    assert (stats["running"], stats["waiting"], running.server.in_flight) == (0, 0, 0)
    assert stats["pages_used"] == baseline
    scrape = httpx.get(running.url + "/metrics", timeout=60).text
    assert 'jkv:requests_aborted_total{model_name="jkv-demo"} 7.0' in scrape


def _samples(scrape: str) -> dict:
    out = {}
    for family in text_string_to_metric_families(scrape):
        for s in family.samples:
            out.setdefault(s.name, []).append(s)
    return out


def test_metrics_have_vllm_names_buckets_and_counts(demo_params, serve):
    running = serve(Server(demo_params, small_engine(demo_params), response_cache=None))
    client = running.client()
    usage = [
        client.completions.create(
            model="jkv-demo", prompt=PROMPT * 2 + " ." * i, max_tokens=3 + i, temperature=0
        ).usage  # fmt: skip
        for i in range(3)
    ]
    samples = _samples(httpx.get(running.url + "/metrics", timeout=60).text)
    for name in (
        "jkv:num_requests_running", "jkv:num_requests_waiting", "jkv:kv_cache_usage_perc",
        "jkv:prefix_cache_queries_total", "jkv:prefix_cache_hits_total",
        "jkv:num_preemptions_total", "jkv:pages_recycled_total",
        "jkv:time_to_first_token_seconds_bucket", "jkv:inter_token_latency_seconds_bucket",
        "jkv:e2e_request_latency_seconds_bucket", "jkv:request_queue_time_seconds_bucket",
    ):  # fmt: skip
        assert name in samples, name
        assert all(s.labels["model_name"] == "jkv-demo" for s in samples[name])

    def value(name, **labels):
        return sum(s.value for s in samples[name] if labels.items() <= s.labels.items())

    assert value("jkv:prompt_tokens_total") == sum(u.prompt_tokens for u in usage)
    assert value("jkv:generation_tokens_total") == sum(u.completion_tokens for u in usage)
    assert value("jkv:request_success_total", finished_reason="length") == 3
    assert value("jkv:time_to_first_token_seconds_count") == 3
    # every token after the first: one inter-token gap each
    assert value("jkv:inter_token_latency_seconds_count") == sum(
        u.completion_tokens - 1 for u in usage
    )
    bounds = lambda name: [float(s.labels["le"]) for s in samples[name]][:-1]  # noqa: E731
    assert bounds("jkv:time_to_first_token_seconds_bucket") == list(TTFT_BUCKETS)
    assert bounds("jkv:inter_token_latency_seconds_bucket") == list(ITL_BUCKETS)
    assert value("jkv:num_requests_running") == 0
    # the second and third prompts start with the first one's full pages
    assert value("jkv:prefix_cache_hits_total") > 0
    assert value("jkv:prefix_cache_queries_total") >= value("jkv:prefix_cache_hits_total")


def test_a_traceparent_yields_spans_in_that_trace_and_a_json_log_line(
    demo_params, serve, spans, caplog
):
    running = serve(Server(demo_params, small_engine(demo_params),
                           response_cache=jkv.ResponseCache(), span_exporter=spans))  # fmt: skip
    trace_id, parent = "4bf92f3577b34da6a3ce929d0e0e4736", "00f067aa0ba902b7"
    client = running.client(default_headers={"traceparent": f"00-{trace_id}-{parent}-01"})
    with caplog.at_level(logging.INFO, logger="jkv.serve.requests"):
        got = client.completions.create(model="jkv-demo", prompt=PROMPT, max_tokens=5,
                                        temperature=0, extra_body={"cache_salt": "t1"})  # fmt: skip
    done = spans.get_finished_spans()
    assert {format(s.context.trace_id, "032x") for s in done} == {trace_id}
    server = next(s for s in done if s.kind == trace.SpanKind.SERVER)
    assert server.name == "text_completion jkv-demo"
    assert format(server.parent.span_id, "016x") == parent
    attrs = server.attributes
    assert attrs["gen_ai.operation.name"] == "text_completion"
    assert attrs["gen_ai.request.model"] == "jkv-demo"
    assert attrs["gen_ai.usage.input_tokens"] == got.usage.prompt_tokens
    assert attrs["gen_ai.usage.output_tokens"] == 5
    assert attrs["gen_ai.response.id"] == got.id
    children = {s.name: s for s in done if s.parent and s.parent.span_id == server.context.span_id}
    assert set(children) == {"response_cache.lookup", "queue", "prefill", "decode"}
    assert children["prefill"].end_time <= children["decode"].start_time + 1000
    lines = [json.loads(r.getMessage()) for r in caplog.records if r.name == "jkv.serve.requests"]
    assert len(lines) == 1
    line = lines[0]
    assert line["trace_id"] == trace_id and line["request_id"] == got.id
    assert line["tenant"] and "t1" not in json.dumps(line)  # the salt only as a hash
    assert (line["prompt_tokens"], line["completion_tokens"]) == (got.usage.prompt_tokens, 5)
    assert line["finish_reason"] == "length" and line["cache"] is None and line["pages"] > 0
    assert 0 < line["ttft_ms"] <= line["total_ms"]
    running.server.cache.close()


def test_redis_killed_and_restarted_under_load_fails_no_request(demo_params, serve, redis_server):
    cache = jkv.ResponseCache(redis_server.url)
    running = serve(Server(demo_params, small_engine(demo_params), response_cache=cache))
    prompts = [f"The code for Mara is {i}" for i in range(4)]

    async def load(client, rounds):
        replies = []
        for i in range(rounds):
            body = {"model": "jkv-demo", "prompt": prompts[i % 4], "max_tokens": 4,
                    "temperature": 0}  # fmt: skip
            reply = await client.post(running.url + "/v1/completions", json=body)
            replies.append((prompts[i % 4], reply))
        return replies

    async def main():
        async with httpx.AsyncClient(timeout=60) as client:
            # each worker asks every prompt twice: the second lap may be answered by the cache
            work = asyncio.gather(*[load(client, 8) for _ in range(4)])
            await asyncio.sleep(0.3)
            await asyncio.to_thread(redis_server.kill)
            await asyncio.sleep(0.5)
            await asyncio.to_thread(redis_server.restart)
            return [r for group in await work for r in group]

    replies = asyncio.run(main())
    assert [r.status_code for _, r in replies] == [200] * 32
    texts = {}
    for prompt, r in replies:  # every answer to one prompt is the same, cached or not
        texts.setdefault(prompt, set()).add(r.json()["choices"][0]["text"])
    assert texts == {p: {expected(demo_params, p, 4)} for p in prompts}
    assert {r.headers["x-jkv-cache"] for _, r in replies} >= {"miss", "l1"}
    cache.close()


def test_queued_prompt_tokens_are_bounded_too(demo_params, serve):
    n = len(demo_params.tokenizer.encode(PROMPT))
    running = serve(Server(demo_params, small_engine(demo_params), max_queued_tokens=n + 5))
    body = {"model": "jkv-demo", "prompt": PROMPT, "max_tokens": 4, "temperature": 0}

    async def two():
        async with httpx.AsyncClient(timeout=120) as client:
            url = running.url + "/v1/completions"
            return await asyncio.gather(client.post(url, json=body), client.post(url, json=body))

    codes = sorted(r.status_code for r in asyncio.run(two()))
    assert codes == [200, 503]  # two prompts' tokens do not fit the queue at once
    longer = {**body, "prompt": PROMPT * 2}  # could never fit: a clear 400, not a 503 forever
    r = httpx.post(running.url + "/v1/completions", json=longer, timeout=120)
    assert r.status_code == 400 and "max_queued_tokens" in r.json()["error"]["message"]
