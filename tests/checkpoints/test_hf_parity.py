"""Numerics against Hugging Face transformers on tiny random checkpoints of every family."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import transformers
from tiny_hf import KINDS, write_tiny_checkpoint

import jkv

NEW_TOKENS = 32
# Fixed per kind (a hash() seed differs every run): a failure reproduces.
PARITY_SEEDS = {kind: 100 + i for i, kind in enumerate(sorted(KINDS))}


def _hf_model(folder):
    return transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()


def _check_parity(params, folder, seed):
    hf = _hf_model(folder)
    print(f"parity seed {seed}")
    rng = np.random.default_rng(seed)
    ids = rng.integers(0, params.config.vocab_size, size=(2, 40))
    ours = np.asarray(jkv.logits(params, ids))
    with torch.no_grad():
        ref = hf(torch.tensor(ids)).logits.numpy()
    assert ours.shape == ref.shape
    assert np.abs(ours - ref).max() <= 1e-4

    prompt = rng.integers(3, params.config.vocab_size, size=24).tolist()
    result = jkv.generate(params, prompt, max_new_tokens=NEW_TOKENS)
    with torch.no_grad():
        out = hf.generate(torch.tensor([prompt]), max_new_tokens=NEW_TOKENS, do_sample=False)
    assert result.tokens == out[0, len(prompt) :].tolist()
    assert result.finish_reason == "length"


@pytest.mark.parametrize("kind", sorted(KINDS))
def test_load_hf_matches_transformers(kind, hf_checkpoint, tiny_params):
    _check_parity(tiny_params(kind), hf_checkpoint(kind), seed=PARITY_SEEDS[kind])


@pytest.mark.parametrize("kind", ["llama", "qwen2"])
def test_convert_then_load_matches_transformers(kind, hf_checkpoint, tmp_path):
    folder = hf_checkpoint(kind)
    out = jkv.convert(folder, tmp_path / "converted", progress=False)
    params = jkv.load(out)
    assert params.name == folder.name
    assert params.version == jkv.load(folder).version
    _check_parity(params, folder, seed=7)


def test_sharded_safetensors_with_index(tmp_path):
    folder = write_tiny_checkpoint(tmp_path / "sharded", "llama")
    hf = _hf_model(folder)
    hf.save_pretrained(tmp_path / "resharded", max_shard_size="40KB")
    (tmp_path / "resharded" / "tokenizer.json").write_text((folder / "tokenizer.json").read_text())
    files = sorted(p.name for p in (tmp_path / "resharded").glob("*.safetensors"))
    assert len(files) > 1 and (tmp_path / "resharded" / "model.safetensors.index.json").is_file()
    a, b = jkv.load(folder), jkv.load(tmp_path / "resharded")
    assert a.version == b.version
    ids = np.arange(3, 40)[None]
    np.testing.assert_array_equal(np.asarray(jkv.logits(a, ids)), np.asarray(jkv.logits(b, ids)))


def test_bfloat16_load(hf_checkpoint):
    folder = hf_checkpoint("llama")
    params = jkv.load(folder, dtype="bfloat16")
    leaves = [x.dtype for x in jax_leaves(params.weights)]
    assert set(map(str, leaves)) == {"bfloat16"}
    ref = jkv.load(folder)
    ids = np.arange(3, 40)[None]
    got, want = np.asarray(jkv.logits(params, ids)), np.asarray(jkv.logits(ref, ids))
    assert got.dtype == np.float32
    assert np.linalg.norm(got - want) / np.linalg.norm(want) < 5e-2
    assert params.version != ref.version


def jax_leaves(tree):
    import jax

    return jax.tree_util.tree_leaves(tree)


def test_name_override_and_tokenizer(hf_checkpoint):
    params = jkv.load(hf_checkpoint("llama"), name="my-llama")
    assert params.name == "my-llama"
    assert params.tokenizer is not None
    result = jkv.generate(params, "w1 w2 w3 w4", max_new_tokens=5)
    assert len(result.tokens) == 5
    assert result.text == params.tokenizer.decode(result.tokens)
