"""A checkpoint whose tensors hold NaN or Inf is refused at load, naming the tensor and file."""

from __future__ import annotations

import shutil

import jax
import numpy as np
import pytest
from safetensors.numpy import load_file, save_file

import jkv


@pytest.mark.parametrize("bad", [np.nan, np.inf, -np.inf], ids=["nan", "inf", "-inf"])
def test_hf_tensor_with_non_finite_values(hf_checkpoint, tmp_path, bad):
    folder = tmp_path / "broken"
    shutil.copytree(hf_checkpoint("llama"), folder)
    tensors = load_file(folder / "model.safetensors")
    name = "model.layers.1.mlp.up_proj.weight"
    tensors[name][3, 5] = bad
    save_file(tensors, folder / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(ValueError, match=rf"model\.safetensors: tensor '{name}' holds 1 NaN/Inf"):
        jkv.load(folder)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_jkv_folder_with_non_finite_values(hf_checkpoint, tmp_path, dtype):
    params = jkv.load(hf_checkpoint("llama"), dtype=dtype)
    weights = jax.tree.map(lambda x: x, params.weights)  # fresh dicts, same arrays
    norm = weights["layers"]["input_layernorm"]  # stacked: layer 0's is row 0
    norm["scale"] = norm["scale"].at[0, 0].set(np.nan)
    out = jkv.save(params.replace(weights=weights), tmp_path / "saved")
    match = r"saved/weights: tensor 'layers_0/input_layernorm/scale' holds 1 NaN/Inf"
    with pytest.raises(ValueError, match=match):
        jkv.load(out)


def test_finite_checkpoints_still_load(tiny_params, tmp_path):
    params = tiny_params("llama")
    back = jkv.load(jkv.save(params, tmp_path / "ok"))
    assert back.version == params.version
