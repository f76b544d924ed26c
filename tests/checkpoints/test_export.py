"""jkv -> Hugging Face export: transformers loads it with identical logits; round trip exact."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import transformers
from tiny_hf import KINDS

import jkv
from jkv.cli import main


@pytest.mark.parametrize("kind", sorted(KINDS))
def test_export_loads_in_transformers_with_identical_logits(kind, tiny_params, tmp_path):
    params = tiny_params(kind)
    out = jkv.export_hf(params, tmp_path / "hf")
    hf = transformers.AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    ids = np.random.default_rng(0).integers(0, params.config.vocab_size, size=(2, 33))
    with torch.no_grad():
        ref = hf(torch.tensor(ids)).logits.numpy()
    np.testing.assert_allclose(np.asarray(jkv.logits(params, ids)), ref, atol=1e-4)
    back = jkv.load(out)
    assert back.version == params.version and back.config == params.config


def test_export_cli_and_errors(hf_checkpoint, tmp_path, capsys):
    src = hf_checkpoint("llama")
    assert main(["export-hf", str(src), str(tmp_path / "out")]) == 0
    assert (tmp_path / "out" / "model.safetensors").is_file()
    assert main(["export-hf", str(src), str(tmp_path / "out")]) == 2
    assert "exists and is not empty" in capsys.readouterr().err
