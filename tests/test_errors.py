"""Every bad input gets a clear error naming the value and what was expected."""

from __future__ import annotations

import json

import numpy as np
import pytest

import jkv
from jkv_models.config import ModelConfig


@pytest.fixture(scope="module")
def params(tiny_params):
    return tiny_params("llama")


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(max_new_tokens=0), r"max_new_tokens=0 must be a positive integer"),
        (dict(max_new_tokens=2.5), r"max_new_tokens=2.5"),
        (dict(temperature=-1.0), r"temperature=-1.0 must be a finite number >= 0"),
        (dict(temperature=float("nan")), r"temperature=nan"),
        (dict(top_k=0), r"top_k=0 must be a positive integer"),
        (dict(top_p=1.5), r"top_p=1.5 must be in \(0, 1\]"),
        (dict(min_p=0.0), r"min_p=0.0 must be in \(0, 1\]"),
        (dict(logit_keep_ratio=2), r"logit_keep_ratio=2 must be in \(0, 1\]"),
        (dict(seed="x"), r"seed='x' must be an integer"),
        (dict(stop=[""]), r"stop=\[''\] must be a non-empty string"),
        (dict(kv_dtype="int4"), r"kv_dtype='int4' is not supported"),
        (dict(backend="cuda-magic"), r"backend='cuda-magic' is not supported"),
    ],
)
def test_generate_rejects_bad_settings(params, kwargs, match):
    with pytest.raises(ValueError, match=match):
        jkv.generate(params, [5, 6], **kwargs)


@pytest.mark.parametrize(
    "prompt, match",
    [
        ([], r"prompt=\[\] is empty"),
        ("", r"prompt='' is empty or only whitespace"),
        ([5, 999], r"prompt holds token id 999; expected ids in \[0, 128\)"),
        ([5, -1], r"token id -1"),
        ([[5, 6], []], r"prompt\[1\] is empty"),
        ([1.5, 2.0], r"must be a str or a list of token ids"),
        (None, r"prompt=None must be a str or a list of token ids"),
    ],
)
def test_generate_rejects_bad_prompts(params, prompt, match):
    with pytest.raises(ValueError, match=match):
        jkv.generate(params, prompt)


def test_generate_rejects_non_params():
    with pytest.raises(ValueError, match=r"params is a dict; expected jkv.Params"):
        jkv.generate({"a": 1}, "hi")


def test_text_without_tokenizer(params):
    bare = params.replace(tokenizer=None)
    with pytest.raises(ValueError, match="prompt is text but the params carry no tokenizer"):
        jkv.generate(bare, "w1 w2")


def test_stream_rejects_batch(params):
    with pytest.raises(ValueError, match="stream takes one prompt; got a batch of 2"):
        list(jkv.stream(params, ["w1", "w2"]))


@pytest.mark.parametrize(
    "ids, match",
    [
        ([[1, 2], [3]], r"rows differ in length"),
        (np.zeros((1, 0), np.int32), r"expected \[B, T\] with T >= 1"),
        ([[1, 500]], r"token_ids holds id 500"),
        ([[0.5, 1.0]], r"must be integer ids"),
    ],
)
def test_logits_rejects_bad_ids(params, ids, match):
    with pytest.raises(ValueError, match=match):
        jkv.logits(params, ids)


# ------------------------------------------------------------------ loading
def test_load_missing_path(tmp_path):
    with pytest.raises(ValueError, match=r"does not exist; expected a checkpoint folder"):
        jkv.load(tmp_path / "nope")


def test_load_folder_without_checkpoint(tmp_path):
    with pytest.raises(ValueError, match=r"holds neither a Hugging Face checkpoint"):
        jkv.load(tmp_path)


def _copy(folder, tmp_path):
    import shutil

    dst = tmp_path / "ckpt"
    shutil.copytree(folder, dst)
    return dst


def test_unknown_architecture(hf_checkpoint, tmp_path):
    folder = _copy(hf_checkpoint("llama"), tmp_path)
    cfg = json.loads((folder / "config.json").read_text())
    cfg["architectures"] = ["GPT2LMHeadModel"]
    (folder / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match=r"architectures=\['GPT2LMHeadModel'\] is not supported"):
        jkv.load(folder)


def test_missing_tensor(hf_checkpoint, tmp_path):
    from safetensors.torch import load_file, save_file

    folder = _copy(hf_checkpoint("llama"), tmp_path)
    tensors = load_file(folder / "model.safetensors")
    del tensors["model.layers.1.mlp.up_proj.weight"]
    save_file(tensors, folder / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(ValueError, match=r"lacks tensor 'model.layers.1.mlp.up_proj.weight'"):
        jkv.load(folder)


def test_misshapen_tensor(hf_checkpoint, tmp_path):
    from safetensors.torch import load_file, save_file

    folder = _copy(hf_checkpoint("llama"), tmp_path)
    tensors = load_file(folder / "model.safetensors")
    tensors["model.layers.0.self_attn.k_proj.weight"] = tensors[
        "model.layers.0.self_attn.k_proj.weight"
    ][:16].clone()
    save_file(tensors, folder / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(
        ValueError,
        match=r"model.safetensors: tensor "
        r"'model.layers.0.self_attn.k_proj.weight' has shape \(16, 64\); "
        r"expected \(32, 64\)",
    ):
        jkv.load(folder)


def test_corrupt_safetensors(hf_checkpoint, tmp_path):
    folder = _copy(hf_checkpoint("llama"), tmp_path)
    data = (folder / "model.safetensors").read_bytes()
    (folder / "model.safetensors").write_bytes(data[: len(data) // 3])
    with pytest.raises(
        ValueError, match=r"model.safetensors: (not a readable safetensors|cannot read)"
    ):
        jkv.load(folder)


def test_garbage_config(hf_checkpoint, tmp_path):
    folder = _copy(hf_checkpoint("llama"), tmp_path)
    (folder / "config.json").write_text("{not json")
    with pytest.raises(ValueError, match=r"config.json: not valid JSON"):
        jkv.load(folder)


def test_unsupported_rope_type():
    hf = {
        "architectures": ["LlamaForCausalLM"],
        "vocab_size": 10,
        "hidden_size": 8,
        "intermediate_size": 16,
        "num_hidden_layers": 1,
        "num_attention_heads": 2,
        "rope_parameters": {"rope_type": "yarn", "factor": 4.0},
    }
    with pytest.raises(ValueError, match=r"rope_type='yarn' is not supported"):
        ModelConfig.from_hf_config(hf)


def test_missing_config_key():
    hf = {
        "architectures": ["LlamaForCausalLM"],
        "vocab_size": 10,
        "hidden_size": 8,
        "num_attention_heads": 2,
        "num_hidden_layers": 1,
    }
    with pytest.raises(ValueError, match=r"missing key 'intermediate_size'"):
        ModelConfig.from_hf_config(hf)


def test_unsupported_dtype(hf_checkpoint):
    with pytest.raises(ValueError, match=r"dtype='float16' is not supported"):
        jkv.load(hf_checkpoint("llama"), dtype="float16")


def test_save_refuses_non_empty_folder(params, tmp_path):
    (tmp_path / "x").write_text("keep me")
    with pytest.raises(ValueError, match="exists and is not empty"):
        jkv.save(params, tmp_path)
    assert (tmp_path / "x").read_text() == "keep me"
