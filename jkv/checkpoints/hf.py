"""Hugging Face safetensors checkpoint -> jkv params, by a name table, one tensor at a time.

Peak host memory stays near the output size: each tensor is read, reshaped, cast, hashed and
placed on its device before the next is read.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from jkv import sharding
from jkv.checkpoints.finite import check_tensor
from jkv.checkpoints.names import choose_name
from jkv.params import Params, combine_digests, path_str, tensor_digest
from jkv.tokenizer import Tokenizer, read_special_ids
from jkv_models.config import ModelConfig
from jkv_models.llama import param_shapes, unstack_layers

# (HF name, our path, HF shape(config), transform(array, config)); `{i}` is the layer index.
_Rule = tuple[
    str,
    str,
    Callable[[ModelConfig], tuple[int, ...]],
    Callable[[np.ndarray, ModelConfig], np.ndarray],
]


def _same(x, c):
    return x


def _linear(x, c):  # HF Linear [out, in] -> kernel [in, out]
    return x.T


def _split_heads(count: str):
    """q/k/v: HF [count*H, D] -> kernel [D, count, H]; bias [count*H] -> [count, H]."""

    def kernel(x, c):
        return x.T.reshape(c.hidden_size, getattr(c, count), c.head_dim)

    def bias(x, c):
        return x.reshape(getattr(c, count), c.head_dim)

    return kernel, bias


_q, _q_bias = _split_heads("num_heads")
_kv, _kv_bias = _split_heads("num_kv_heads")


def _o(x, c):  # HF [D, N*H] -> kernel [N, H, D]
    return x.T.reshape(c.num_heads, c.head_dim, c.hidden_size)


_L = "model.layers.{i}."
_P = "layers_{i}/"
TABLE: tuple[_Rule, ...] = (
    (
        "model.embed_tokens.weight",
        "embed_tokens/embedding",
        lambda c: (c.vocab_size, c.hidden_size),
        _same,
    ),
    ("model.norm.weight", "norm/scale", lambda c: (c.hidden_size,), _same),
    ("lm_head.weight", "lm_head/kernel", lambda c: (c.vocab_size, c.hidden_size), _linear),
    (
        _L + "input_layernorm.weight",
        _P + "input_layernorm/scale",
        lambda c: (c.hidden_size,),
        _same,
    ),
    (
        _L + "post_attention_layernorm.weight",
        _P + "post_attention_layernorm/scale",
        lambda c: (c.hidden_size,),
        _same,
    ),
    (
        _L + "self_attn.q_proj.weight",
        _P + "self_attn/q_proj/kernel",
        lambda c: (c.num_heads * c.head_dim, c.hidden_size),
        _q,
    ),
    (
        _L + "self_attn.k_proj.weight",
        _P + "self_attn/k_proj/kernel",
        lambda c: (c.num_kv_heads * c.head_dim, c.hidden_size),
        _kv,
    ),
    (
        _L + "self_attn.v_proj.weight",
        _P + "self_attn/v_proj/kernel",
        lambda c: (c.num_kv_heads * c.head_dim, c.hidden_size),
        _kv,
    ),
    (
        _L + "self_attn.q_proj.bias",
        _P + "self_attn/q_proj/bias",
        lambda c: (c.num_heads * c.head_dim,),
        _q_bias,
    ),
    (
        _L + "self_attn.k_proj.bias",
        _P + "self_attn/k_proj/bias",
        lambda c: (c.num_kv_heads * c.head_dim,),
        _kv_bias,
    ),
    (
        _L + "self_attn.v_proj.bias",
        _P + "self_attn/v_proj/bias",
        lambda c: (c.num_kv_heads * c.head_dim,),
        _kv_bias,
    ),
    (
        _L + "self_attn.o_proj.weight",
        _P + "self_attn/o_proj/kernel",
        lambda c: (c.hidden_size, c.num_heads * c.head_dim),
        _o,
    ),
    (_L + "self_attn.o_proj.bias", _P + "self_attn/o_proj/bias", lambda c: (c.hidden_size,), _same),
    (
        _L + "mlp.gate_proj.weight",
        _P + "mlp/gate_proj/kernel",
        lambda c: (c.intermediate_size, c.hidden_size),
        _linear,
    ),
    (
        _L + "mlp.up_proj.weight",
        _P + "mlp/up_proj/kernel",
        lambda c: (c.intermediate_size, c.hidden_size),
        _linear,
    ),
    (
        _L + "mlp.down_proj.weight",
        _P + "mlp/down_proj/kernel",
        lambda c: (c.hidden_size, c.intermediate_size),
        _linear,
    ),
    (_L + "mlp.gate_proj.bias", _P + "mlp/gate_proj/bias", lambda c: (c.intermediate_size,), _same),
    (_L + "mlp.up_proj.bias", _P + "mlp/up_proj/bias", lambda c: (c.intermediate_size,), _same),
    (_L + "mlp.down_proj.bias", _P + "mlp/down_proj/bias", lambda c: (c.hidden_size,), _same),
)
IGNORED = re.compile(r".*rotary_emb\.inv_freq$")  # recomputed from the config


def _pattern(template: str) -> re.Pattern:
    return re.compile(re.escape(template).replace(r"\{i\}", r"(?P<i>\d+)") + "$")


_BY_HF = [(_pattern(rule[0]), rule) for rule in TABLE]
_BY_PATH = [(_pattern(rule[1]), rule) for rule in TABLE]


def expected_paths(config: ModelConfig) -> set[str]:
    """Every parameter path the model needs, one per layer as files hold them (from the model
    definition, not the table)."""

    leaves = jax.tree_util.tree_flatten_with_path(unstack_layers(param_shapes(config)))[0]
    return {path_str(p) for p, _ in leaves}


def _lookup(name: str, index) -> tuple[dict, _Rule] | None:
    for pattern, rule in index:
        m = pattern.match(name)
        if m:
            return m.groupdict(), rule
    return None


def to_path(hf_name: str) -> tuple[str, _Rule] | None:
    """Our parameter path and rule for an HF tensor name, or None."""
    found = _lookup(hf_name, _BY_HF)
    return None if found is None else (found[1][1].format(**found[0]), found[1])


def to_hf_name(path: str) -> str:
    """The HF tensor name of one of our parameter paths."""
    found = _lookup(path, _BY_PATH)
    if found is None:
        raise ValueError(f"parameter {path!r} has no Hugging Face name in the table")
    return found[1][0].format(**found[0])


def _tensor_files(folder: Path) -> list[Path]:
    index = folder / "model.safetensors.index.json"
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (json.JSONDecodeError, KeyError) as e:
            raise ValueError(f"{index}: not a valid safetensors index ({e!r})") from None
        files = sorted({folder / f for f in weight_map.values()})
        missing = [str(f) for f in files if not f.is_file()]
        if missing:
            raise ValueError(f"{index}: lists {missing[0]}, which does not exist")
        return files
    files = sorted(folder.glob("*.safetensors"))
    if not files:
        other = [p.name for p in folder.glob("*.bin")] + [p.name for p in folder.glob("*.pt*")]
        hint = f" (found {other[0]}: only safetensors is supported)" if other else ""
        raise ValueError(f"{folder}: no *.safetensors files{hint}")
    return files


def _set(tree: dict, path: str, value) -> None:
    *parents, leaf = path.split("/")
    for key in parents:
        tree = tree.setdefault(key, {})
    tree[leaf] = value


def _entries(files: list[Path], config: ModelConfig):
    """(file, open handle, HF name, our path, rule) of every tensor the model uses, in file
    order; raises ValueError naming the file for an unreadable file or a foreign tensor."""
    from safetensors import safe_open

    needed = expected_paths(config)
    for file in files:
        try:
            handle = safe_open(str(file), framework="flax")
        except Exception as e:  # safetensors raises its own error types; name the file
            raise ValueError(f"{file}: not a readable safetensors file ({e})") from None
        with handle as f:
            for tensor_name in f.keys():
                found = to_path(tensor_name)
                if found is None:
                    if IGNORED.match(tensor_name):
                        continue
                    raise ValueError(
                        f"{file}: unexpected tensor {tensor_name!r} for {config.architecture}"
                    )
                path, rule = found
                if path == "lm_head/kernel" and config.tie_word_embeddings:
                    continue  # tied: the embedding serves as the output projection
                if path not in needed:
                    raise ValueError(
                        f"{file}: tensor {tensor_name!r} does not belong to this config "
                        f"({config.num_layers} layers, qkv_bias={config.qkv_bias})"
                    )
                yield file, f, tensor_name, path, rule


def place(weights: dict, digests: dict, path: str, value, target, mesh, source: str, tensor_name):
    """Casts one converted tensor to `target`, refuses NaN / Inf (naming `source` and
    `tensor_name`), hashes it into `digests` and puts it on its device(s) at `path`."""
    value = np.ascontiguousarray(value).astype(target)
    check_tensor(value, source, tensor_name)
    digests[path] = tensor_digest(value)
    if mesh is not None:
        placed = jax.device_put(
            value, sharding.param_sharding(tuple(path.split("/")), value.shape, mesh)
        )
    else:
        placed = jax.device_put(value)
    _set(weights, path, placed)


def check_complete(source, config: ModelConfig, found, name_of=None) -> None:
    """Raises ValueError naming the first tensor the model needs that is not in `found` (our
    paths), by its name in the file (`name_of(path)`; default: the Hugging Face name)."""
    missing = sorted(expected_paths(config) - set(found))
    if missing:
        name = (name_of or to_hf_name)(missing[0])
        raise ValueError(
            f"{source}: checkpoint lacks tensor {name!r} ({len(missing)} missing in all)"
        )


def check_headers(folder: str | Path) -> ModelConfig:
    """Reads what `jkv info` reports: config.json and every safetensors header (names and
    shapes, no tensor data). Returns the config; raises ValueError naming what is wrong."""
    folder = Path(folder)
    config = ModelConfig.from_hf_file(folder / "config.json")
    found = []
    for file, f, tensor_name, path, (_, _, shape_fn, _) in _entries(_tensor_files(folder), config):
        try:
            shape = tuple(f.get_slice(tensor_name).get_shape())
        except Exception as e:
            raise ValueError(f"{file}: cannot read tensor {tensor_name!r} ({e})") from None
        want = tuple(shape_fn(config))
        if shape != want:
            raise ValueError(f"{file}: tensor {tensor_name!r} has shape {shape}; expected {want}")
        found.append(path)
    check_complete(folder, config, found)
    return config


def load_hf(
    folder: str | Path,
    *,
    dtype: str | None = None,
    name: str | None = None,
    mesh=None,
    progress: bool = True,
) -> Params:
    """Loads a Hugging Face Llama / Mistral / Qwen2 checkpoint folder.

    Args:
      folder: holds `config.json`, `*.safetensors` (with `model.safetensors.index.json` when
        sharded), `tokenizer.json` (optional) and `generation_config.json` (optional).
      dtype: "float32" or "bfloat16"; default: the checkpoint's declared dtype.
      name: the model's name (cache keys); default: made from the folder's name
        (`jkv.response_cache.keys.derive_model_name`: "demo copy" -> "demo-copy").
      mesh: a `jax.sharding.Mesh` to shard the weights over (see `jkv.sharding`).
      progress: show a progress bar.

    Raises:
      ValueError: naming the file or tensor that is missing, misshapen, unexpected or corrupt
        (NaN or Inf values included), or a `name` keys cannot hold.
    """
    from tqdm import tqdm

    folder = Path(folder)
    name = choose_name(name, folder.resolve().name)
    config = ModelConfig.from_hf_file(folder / "config.json", dtype=dtype)
    bos, eos = read_special_ids(folder)
    config = config.replace(
        bos_token_id=bos if bos is not None else config.bos_token_id,
        eos_token_ids=eos or config.eos_token_ids,
    )
    target = jnp.dtype(config.dtype)
    needed = expected_paths(config)
    weights: dict = {}
    digests: dict[str, str] = {}
    files = _tensor_files(folder)
    bar = tqdm(
        desc=f"converting {folder.name}", unit="tensor", disable=not progress, total=len(needed)
    )
    for file, f, tensor_name, path, (_, _, shape_fn, transform) in _entries(files, config):
        try:
            raw = np.asarray(f.get_tensor(tensor_name))
        except Exception as e:
            raise ValueError(f"{file}: cannot read tensor {tensor_name!r} ({e})") from None
        want = tuple(shape_fn(config))
        if raw.shape != want:
            raise ValueError(
                f"{file}: tensor {tensor_name!r} has shape {raw.shape}; expected {want}"
            )
        place(weights, digests, path, transform(raw, config), target, mesh, str(file), tensor_name)
        del raw
        bar.update(1)
    bar.close()
    check_complete(folder, config, digests)

    tokenizer = Tokenizer.from_folder(
        folder, bos_token_id=config.bos_token_id, eos_token_ids=config.eos_token_ids
    )
    return Params(
        weights=weights,
        config=config,
        tokenizer=tokenizer,
        name=name,
        mesh=mesh,
        version=combine_digests(digests),  # hashed while streaming: seeds the memo
    )
