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


def test_per_layer_trees_are_stacked_with_the_same_version(tiny_params, tmp_path):
    """A tree with one subtree per layer (checkpoint files' layout, and jkv folders of format 1,
    saved before the layers were stacked) loads as the stacked model with the same fingerprint
    and the same logits."""
    import numpy as np
    import orbax.checkpoint as ocp

    from jkv_models.llama import unstack_layers

    params = tiny_params("llama")
    per_layer = jax.tree.map(jnp.copy, unstack_layers(params.weights))
    assert Params(per_layer, params.config).version == params.version
    out = jkv.save(params, tmp_path / "v1")
    meta = json.loads((out / "jkv.json").read_text())
    with ocp.StandardCheckpointer() as ckptr:
        ckptr.save(tmp_path / "v1-weights", per_layer, force=True)
    (out / "weights").rename(tmp_path / "v2-weights")
    (tmp_path / "v1-weights").rename(out / "weights")
    (out / "jkv.json").write_text(json.dumps({**meta, "format": 1}))
    old = jkv.load(out)
    assert "layers" in old.weights and old.version == params.version
    ids = [[5, 9, 11, 3]]
    np.testing.assert_array_equal(jkv.logits(old, ids), jkv.logits(params, ids))
