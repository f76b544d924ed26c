"""What the model's identity in a cache key covers: the weights as they are now (not as they were
loaded), the tokenizer, the generation config; and model names that every folder can have."""

from __future__ import annotations

import json
import shutil

import jax
import jax.numpy as jnp
import pytest

import jkv
from jkv.checkpoints import default_name
from jkv.request import Request
from jkv.response_cache.front import request_settings

PROMPT = "w1 w2 w3 w4"


def _copy(src, dst):
    shutil.copytree(src, dst)
    return dst


def _twin(params, prompt, other, **kw):
    """(cached answer of `other` after `params` filled the cache, `other`'s uncached answer)."""
    cache = jkv.ResponseCache()
    jkv.generate(params, prompt, cache=cache, **kw)
    return jkv.generate(other, prompt, cache=cache, **kw), jkv.generate(other, prompt, **kw)


def test_scaled_weights_are_another_model(tiny_params):
    params = tiny_params("llama")
    scaled = jax.tree.map(lambda x: x * 0.5, params)
    got, want = _twin(params, PROMPT, scaled, max_new_tokens=8)
    assert want.tokens != jkv.generate(params, PROMPT, max_new_tokens=8).tokens  # precondition
    assert got.cache is None and got.tokens == want.tokens
    assert scaled.version != params.version


def test_dtype_follows_the_weights_and_sets_the_key_kv_dtype(tiny_params):
    params = tiny_params("llama")
    cast = jax.tree.map(lambda x: x.astype(jnp.bfloat16), params)
    assert params.dtype == "float32" and cast.dtype == "bfloat16"
    assert cast.config.dtype == "float32"  # the static config did not follow the cast
    req = Request.build(cast)
    assert request_settings(req, cast)["kv_dtype"] == "bfloat16"


def _permuted_tokenizer(folder):
    """Same words, other ids: "w1" now encodes as the id "w2" had, and so on."""
    path = folder / "tokenizer.json"
    data = json.loads(path.read_text())
    vocab = data["model"]["vocab"]
    words = [w for w in vocab if w.startswith("w")]
    ids = [vocab[w] for w in words]
    vocab.update(zip(words, ids[1:] + ids[:1], strict=True))
    path.write_text(json.dumps(data))


def test_tokenizer_is_part_of_the_identity(hf_checkpoint, tmp_path):
    src = hf_checkpoint("llama")
    a = jkv.load(_copy(src, tmp_path / "a"), name="same")
    other = _copy(src, tmp_path / "b")
    _permuted_tokenizer(other)
    b = jkv.load(other, name="same")
    assert a.version == b.version  # same weights, same name
    got, want = _twin(a, PROMPT, b, max_new_tokens=6)
    assert want.text != jkv.generate(a, PROMPT, max_new_tokens=6).text  # precondition
    assert got.cache is None and got.text == want.text


def test_generation_config_is_part_of_the_identity(hf_checkpoint, tmp_path):
    src = hf_checkpoint("llama")
    a = jkv.load(src, name="same")
    first = jkv.generate(a, PROMPT, max_new_tokens=6).tokens[0]
    other = _copy(src, tmp_path / "eos")
    (other / "generation_config.json").write_text(json.dumps({"eos_token_id": first}))
    b = jkv.load(other, name="same")
    got, want = _twin(a, PROMPT, b, max_new_tokens=6)
    assert want.tokens == [first] and want.finish_reason == "stop"  # precondition
    assert got.cache is None and got.tokens == want.tokens


def test_a_folder_name_that_cannot_be_a_key_gets_a_valid_name(hf_checkpoint, tmp_path):
    folder = _copy(hf_checkpoint("llama"), tmp_path / "demo copy")
    params = jkv.load(folder)
    assert params.name == "demo-copy" == default_name(folder)
    res = jkv.generate(params, PROMPT, max_new_tokens=3, cache=jkv.ResponseCache())
    assert res.cache is None
    out = jkv.convert(folder, tmp_path / "converted", progress=False)
    assert jkv.load(out).name == "demo-copy" == default_name(out)
    assert default_name("demo") == jkv.load("demo").name


def test_a_name_that_cannot_be_a_key_is_refused_with_the_way_out(hf_checkpoint):
    with pytest.raises(ValueError, match=r"name='demo copy' .*expected"):
        jkv.load(hf_checkpoint("llama"), name="demo copy")
    params = jkv.load(hf_checkpoint("llama")).replace(name="demo copy")
    with pytest.raises(ValueError, match=r"jkv\.load\(\.\.\., name='demo-copy'\)"):
        jkv.generate(params, PROMPT, max_new_tokens=3, cache=jkv.ResponseCache())
