"""ModelConfig: presets by shape, Hugging Face config in both key styles, RoPE frequencies."""

from __future__ import annotations

import jax
import numpy as np
import pytest
import torch
import transformers

from jkv_models.config import PRESETS, ModelConfig, preset
from jkv_models.llama import param_shapes

# Published parameter counts of the real checkpoints.
PUBLISHED = {
    "llama-2-7b": 6_738_415_616,
    "llama-3.2-1b": 1_235_814_400,
    "llama-3.1-8b": 8_030_261_248,
    "tinyllama-1.1b": 1_100_048_384,
    "smollm2-135m": 134_515_008,
    "qwen2.5-0.5b": 494_032_768,
    "mistral-7b": 7_241_732_096,
}


@pytest.mark.parametrize("name", sorted(PRESETS))
def test_preset_shapes_via_eval_shape(name):
    cfg = preset(name)
    shapes = param_shapes(cfg)
    leaves = jax.tree_util.tree_leaves(shapes)
    assert sum(int(np.prod(x.shape)) for x in leaves) == PUBLISHED[name] == cfg.num_params()
    assert {str(x.dtype) for x in leaves} == {"bfloat16"}
    attn = shapes["layers"]["self_attn"]  # the decoder layers stacked on a leading axis
    n, d, h = cfg.num_layers, cfg.hidden_size, cfg.head_dim
    assert attn["q_proj"]["kernel"].shape == (n, d, cfg.num_heads, h)
    assert attn["k_proj"]["kernel"].shape == (n, d, cfg.num_kv_heads, h)
    assert ("lm_head" in shapes) == (not cfg.tie_word_embeddings)


def test_unknown_preset():
    with pytest.raises(ValueError, match=r"preset='gpt-5' is unknown; expected one of"):
        preset("gpt-5")


def _hf_llama3(**rope):
    return transformers.LlamaConfig(
        vocab_size=100,
        hidden_size=256,
        intermediate_size=512,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=1,
        max_position_embeddings=4096,
        rope_parameters={
            "rope_type": "llama3",
            "rope_theta": 500000.0,
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 512,
            **rope,
        },
    )


def test_llama3_inv_freq_matches_transformers():
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    hf = _hf_llama3()
    want, _ = ROPE_INIT_FUNCTIONS["llama3"](hf, torch.device("cpu"))
    cfg = ModelConfig.from_hf_config(hf.to_dict())
    np.testing.assert_allclose(cfg.inv_freq(), want.numpy(), rtol=1e-6)
    assert cfg.rope_scaling.rope_type == "llama3"


def test_old_and_new_rope_keys_agree():
    new = _hf_llama3().to_dict()
    old = {k: v for k, v in new.items() if k != "rope_parameters"}
    rope = dict(new["rope_parameters"])
    old["rope_theta"] = rope.pop("rope_theta")
    old["rope_scaling"] = {**rope, "type": rope.pop("rope_type")}
    assert ModelConfig.from_hf_config(old) == ModelConfig.from_hf_config(new)


def test_hf_config_round_trip():
    for name, cfg in PRESETS.items():
        back = ModelConfig.from_hf_config(cfg.to_hf_config())
        assert back == cfg, name


@pytest.mark.parametrize(
    "change, match",
    [
        (dict(num_heads=6, num_kv_heads=4), r"num_heads=6 must be a multiple of num_kv_heads=4"),
        (dict(head_dim=7), r"head_dim=7 must be even"),
        (dict(vocab_size=0), r"vocab_size=0 must be a positive integer"),
        (dict(architecture="GPT2"), r"architecture='GPT2' is not supported"),
        (dict(sliding_window=0), r"sliding_window=0 must be positive"),
    ],
)
def test_config_validation(change, match):
    base = preset("smollm2-135m")
    with pytest.raises(ValueError, match=match):
        base.replace(**change)
