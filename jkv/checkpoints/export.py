"""jkv params -> a Hugging Face folder (config.json, model.safetensors, tokenizer.json,
generation_config.json) that `transformers` loads as LlamaForCausalLM / MistralForCausalLM /
Qwen2ForCausalLM, through the converter's own name table run backwards."""

from __future__ import annotations

import json
from pathlib import Path

import jax
import numpy as np

from jkv.checkpoints import hf
from jkv.params import Params, file_tensors


def _to_hf(path: str, value: np.ndarray, config) -> tuple[str, np.ndarray]:
    name = hf.to_hf_name(path)
    _, (_, _, shape_fn, forward) = hf.to_path(name)
    shape = tuple(shape_fn(config))
    if forward is hf._same:
        out = value
    elif len(shape) == 1:  # head-split biases
        out = value.reshape(shape)
    else:  # every weight rule is "transpose, then split heads": undo both
        out = value.reshape(shape[::-1]).T
    if out.shape != shape:
        raise ValueError(f"parameter {path} has shape {value.shape}; expected HF {name} {shape}")
    return name, np.ascontiguousarray(out)


def export_hf(params: Params, folder: str | Path, *, overwrite: bool = False) -> Path:
    """Writes `params` as a Hugging Face checkpoint folder.

    Raises:
      ValueError: the folder exists and is not empty (without `overwrite`).
    """
    from safetensors.flax import save_file

    if not isinstance(params, Params):
        raise ValueError(f"params is a {type(params).__name__}; expected jkv.Params")
    folder = Path(folder)
    if folder.exists() and any(folder.iterdir()) and not overwrite:
        raise ValueError(f"{folder}: exists and is not empty; pass overwrite=True to replace it")
    folder.mkdir(parents=True, exist_ok=True)
    cfg = params.config
    tensors = {}
    for path, leaf in file_tensors(params.weights):
        name, value = _to_hf(path, np.asarray(leaf), cfg)
        tensors[name] = jax.numpy.asarray(value)
    save_file(tensors, str(folder / "model.safetensors"), metadata={"format": "pt"})
    hf_config = cfg.to_hf_config()
    (folder / "config.json").write_text(json.dumps(hf_config, indent=2) + "\n")
    generation = {"bos_token_id": cfg.bos_token_id, "eos_token_id": hf_config["eos_token_id"]}
    (folder / "generation_config.json").write_text(json.dumps(generation, indent=2) + "\n")
    # safetensors writes through a private temp file (0600); give it its siblings' mode
    (folder / "model.safetensors").chmod((folder / "config.json").stat().st_mode & 0o777)
    if params.tokenizer is not None:
        params.tokenizer.save(folder / "tokenizer.json")
        (folder / "tokenizer_config.json").write_text(
            json.dumps(_tokenizer_config(params.tokenizer, cfg), indent=2) + "\n"
        )
    return folder


def _tokenizer_config(tokenizer, cfg) -> dict:
    """What `transformers.AutoTokenizer` needs beside tokenizer.json."""
    inner = tokenizer.inner

    def token(i):
        return None if i is None else inner.id_to_token(int(i))

    eos = cfg.eos_token_ids[0] if cfg.eos_token_ids else None
    return {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": token(cfg.bos_token_id),
        "eos_token": token(eos),
        "unk_token": token(inner.token_to_id("<unk>")),
        "model_max_length": cfg.max_position_embeddings,
        "clean_up_tokenization_spaces": False,
    }
