"""`jkv.chat`: messages rendered by the model's own chat template (the renderer the server
uses), checked against transformers' `apply_chat_template`; SmolLM2 answers a real question."""

from __future__ import annotations

import pytest
import transformers
from tiny_gguf import BPE_VOCAB, write_tiny_gguf
from tiny_hf import write_tiny_checkpoint

import jkv
from jkv.chat import chat_prompt

QUESTION = [{"role": "user", "content": "What is the capital of France?"}]
CONVERSATION = [
    {"role": "system", "content": "You answer in one word."},
    {"role": "user", "content": "Name a colour."},
    {"role": "assistant", "content": "Blue."},
    {"role": "user", "content": "Another — ünïcode too?"},
]


@pytest.fixture(scope="module")
def tiny_gguf_file(tmp_path_factory):
    folder = write_tiny_checkpoint(
        tmp_path_factory.mktemp("chat_src"), "llama", vocab_size=BPE_VOCAB
    )
    return write_tiny_gguf(tmp_path_factory.mktemp("chat") / "m.gguf", folder, "llama")


def test_rendering_matches_transformers_apply_chat_template(tiny_gguf_file):
    params = jkv.load(tiny_gguf_file)
    ref = transformers.AutoTokenizer.from_pretrained(
        str(tiny_gguf_file.parent), gguf_file=tiny_gguf_file.name
    )
    for messages in (QUESTION, CONVERSATION):
        want = ref.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
        assert (
            params.tokenizer.decode(chat_prompt(params, messages), skip_special_tokens=False)
            == want
        )
        assert chat_prompt(params, messages) == ref.encode(want, add_special_tokens=False)


def test_chat_is_generate_of_the_rendered_prompt_and_batches(tiny_gguf_file):
    params = jkv.load(tiny_gguf_file)
    one = jkv.chat(params, QUESTION, max_new_tokens=6)
    assert (
        one.tokens == jkv.generate(params, chat_prompt(params, QUESTION), max_new_tokens=6).tokens
    )
    both = jkv.chat(params, [QUESTION, CONVERSATION], max_new_tokens=6)
    assert both[0].tokens == one.tokens
    assert both[1].tokens == jkv.chat(params, CONVERSATION, max_new_tokens=6).tokens


@pytest.mark.parametrize(
    "messages, message",
    [([], "non-empty list"), ([{"role": "robot", "content": "hi"}], "messages\\[0\\].role='robot'"),
     ([{"role": "user", "content": 3}], "messages\\[0\\].content=3"), ("hello", "non-empty list")],
)  # fmt: skip
def test_bad_messages_are_refused(tiny_gguf_file, messages, message):
    params = jkv.load(tiny_gguf_file)
    with pytest.raises(ValueError, match=message):
        jkv.chat(params, messages)


def test_smollm2_answers_a_real_question(smollm2):
    out = jkv.chat(smollm2, QUESTION, max_new_tokens=24)
    assert out.text == "The capital of France is Paris."
    assert out.finish_reason == "stop"  # <|im_end|>, the model's eos
