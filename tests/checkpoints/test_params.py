"""`Params`: the weights fingerprint follows the arrays, whatever made them; the dtype too."""

from __future__ import annotations

import json

import jax
import jax.numpy as jnp

import jkv
from jkv.params import Params, fingerprint


def test_version_follows_a_tree_map(tiny_params):
    params = tiny_params("llama")
    halved = jax.tree.map(lambda x: x * 0.5, params)
    assert halved.version == fingerprint(halved.weights) != params.version
    same = jax.tree.map(lambda x: x, params)  # the same arrays: the memo answers
    assert same.version == params.version == fingerprint(params.weights)
    assert params.replace(name="renamed").version == params.version


def test_a_jkv_folder_s_stored_version_is_not_trusted(tiny_params, tmp_path):
    params = tiny_params("llama")
    out = jkv.save(params, tmp_path / "saved")
    meta = json.loads((out / "jkv.json").read_text())
    meta["version"] = "stale-fingerprint"
    (out / "jkv.json").write_text(json.dumps(meta))
    assert jkv.load(out).version == params.version


def test_dtype_is_the_weights_and_not_the_config(tiny_params):
    params = tiny_params("llama")
    assert params.dtype == "float32"
    cast = jax.tree.map(lambda x: x.astype(jnp.bfloat16), params)
    assert cast.dtype == "bfloat16" and cast.config.dtype == "float32"


def test_a_given_version_seeds_the_memo_of_exactly_those_arrays(tiny_params):
    params = tiny_params("llama")
    weights = jax.tree.map(jnp.copy, params.weights)  # arrays no one has fingerprinted
    seeded = Params(weights, params.config, version="given-by-the-loader")
    assert seeded.version == "given-by-the-loader"
    assert seeded.replace(name="other").version == "given-by-the-loader"
    copied = jax.tree.map(jnp.copy, seeded)  # equal bytes, other arrays: hashed
    assert copied.version == params.version
