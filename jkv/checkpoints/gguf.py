"""GGUF file (llama.cpp's format) -> jkv params, by a name table, one tensor at a time.

A GGUF file holds the config as metadata (`llama.block_count`, ...), the tokenizer as metadata
(`tokenizer.ggml.tokens`, `.merges`, `.token_type`, ...), the chat template, and the tensors,
each in its own type (F32, F16, BF16, Q8_0, Q4_1, the K-quants, ...). Each tensor is read
through the `gguf` package, dequantised to float32 (every type the package can dequantise),
renamed to its Hugging Face name by `TABLE`, un-permuted where llama.cpp permuted it, then
converted exactly as `checkpoints/hf.py` converts that HF tensor (its rule and shape check).

llama.cpp stores a Llama's (and Mistral's) Q and K projections with the rows of each head
interleaved for its RoPE layout (`convert_hf_to_gguf.py`'s `permute`); `_unpermute` undoes it
so the rotate-half RoPE of the HF layout applies. Qwen2 is stored unpermuted.

The `gguf` package is imported where it is used: `import jkv` does not load it.
"""

from __future__ import annotations

import re
from pathlib import Path

import jax.numpy as jnp
import numpy as np

from jkv.checkpoints import hf
from jkv.checkpoints.gguf_tokenizer import build_tokenizer
from jkv.checkpoints.names import choose_name
from jkv.params import Params, combine_digests
from jkv.tokenizer import Tokenizer
from jkv_models.config import ModelConfig

# general.architecture -> (HF architecture, are Q/K stored permuted). llama.cpp writes Mistral
# models as "llama" (without a sliding window, which Mistral 7B v0.1 alone used).
ARCHITECTURES = {
    "llama": ("LlamaForCausalLM", True),
    "mistral": ("MistralForCausalLM", True),
    "qwen2": ("Qwen2ForCausalLM", False),
}

# (metadata key after "{arch}.", HF config.json key, required)
CONFIG_KEYS = (
    ("block_count", "num_hidden_layers", True),
    ("embedding_length", "hidden_size", True),
    ("feed_forward_length", "intermediate_size", True),
    ("attention.head_count", "num_attention_heads", True),
    ("attention.head_count_kv", "num_key_value_heads", False),
    ("attention.key_length", "head_dim", False),
    ("context_length", "max_position_embeddings", True),
    ("attention.layer_norm_rms_epsilon", "rms_norm_eps", True),
    ("rope.freq_base", "rope_theta", False),
    ("attention.sliding_window", "sliding_window", False),
    ("vocab_size", "vocab_size", False),
)

# (GGUF name, HF name, un-permute: the config field counting the heads of dim 0, or None)
_B, _L = "blk.{i}.", "model.layers.{i}."
TABLE = (
    ("token_embd.weight", "model.embed_tokens.weight", None),
    ("output_norm.weight", "model.norm.weight", None),
    ("output.weight", "lm_head.weight", None),
    (_B + "attn_norm.weight", _L + "input_layernorm.weight", None),
    (_B + "ffn_norm.weight", _L + "post_attention_layernorm.weight", None),
    (_B + "attn_q.weight", _L + "self_attn.q_proj.weight", "num_heads"),
    (_B + "attn_k.weight", _L + "self_attn.k_proj.weight", "num_kv_heads"),
    (_B + "attn_v.weight", _L + "self_attn.v_proj.weight", None),
    (_B + "attn_q.bias", _L + "self_attn.q_proj.bias", "num_heads"),
    (_B + "attn_k.bias", _L + "self_attn.k_proj.bias", "num_kv_heads"),
    (_B + "attn_v.bias", _L + "self_attn.v_proj.bias", None),
    (_B + "attn_output.weight", _L + "self_attn.o_proj.weight", None),
    (_B + "attn_output.bias", _L + "self_attn.o_proj.bias", None),
    (_B + "ffn_gate.weight", _L + "mlp.gate_proj.weight", None),
    (_B + "ffn_up.weight", _L + "mlp.up_proj.weight", None),
    (_B + "ffn_down.weight", _L + "mlp.down_proj.weight", None),
    (_B + "ffn_gate.bias", _L + "mlp.gate_proj.bias", None),
    (_B + "ffn_up.bias", _L + "mlp.up_proj.bias", None),
    (_B + "ffn_down.bias", _L + "mlp.down_proj.bias", None),
)


def _pattern(template: str) -> re.Pattern:
    return re.compile(re.escape(template).replace(r"\{i\}", r"(?P<i>\d+)") + "$")


_BY_GGUF = [(_pattern(rule[0]), rule) for rule in TABLE]
_BY_HF = [(_pattern(rule[1]), rule) for rule in TABLE]


def to_hf(gguf_name: str) -> tuple[str, str | None] | None:
    """The HF name and the un-permute head count field of a GGUF tensor name, or None."""
    for pattern, (_, hf_name, heads) in _BY_GGUF:
        m = pattern.match(gguf_name)
        if m:
            return hf_name.format(**m.groupdict()), heads
    return None


def gguf_name(path: str) -> str:
    """The GGUF tensor name of one of our parameter paths (for error messages)."""
    hf_name = hf.to_hf_name(path)
    for pattern, (name, _, _) in _BY_HF:
        m = pattern.match(hf_name)
        if m:
            return name.format(**m.groupdict())
    return hf_name


def _unpermute(x: np.ndarray, heads: int) -> np.ndarray:
    """Undoes llama.cpp's `permute(w, n_head)`, which took each head's rows as (2, H/2) to
    (H/2, 2): here (H/2, 2) -> (2, H/2), the rotate-half layout."""
    half = x.shape[0] // heads // 2
    return x.reshape(heads, half, 2, *x.shape[1:]).swapaxes(1, 2).reshape(x.shape)


def is_gguf(path: str | Path) -> bool:
    """A file ending in .gguf, or any file that starts with GGUF's magic bytes."""
    file = Path(path)
    if not file.is_file():
        return False
    if file.suffix == ".gguf":
        return True
    with open(file, "rb") as f:
        return f.read(4) == b"GGUF"


def open_reader(path: Path):
    """A `gguf.GGUFReader` over the file, or ValueError naming it."""
    try:
        import gguf
    except ImportError as e:
        raise ValueError(
            f"{path}: reading GGUF files needs the gguf package ({e}): pip install gguf"
        ) from None
    try:
        return gguf.GGUFReader(str(path))
    except Exception as e:  # truncated or not GGUF: the reader raises many kinds; name the file
        raise ValueError(f"{path}: not a readable GGUF file ({type(e).__name__}: {e})") from None


def metadata(reader) -> dict:
    """Every metadata field as a Python value (str, int, float, bool, or a list of them)."""
    return {key: field.contents() for key, field in reader.fields.items()}


def hf_config(meta: dict, tensor_names: set[str], source: str) -> dict:
    """The Hugging Face config.json equivalent of a GGUF file's metadata."""
    arch = meta.get("general.architecture")
    if arch not in ARCHITECTURES:
        raise ValueError(
            f"{source}: general.architecture={arch!r} is not supported; expected one of "
            f"{sorted(ARCHITECTURES)}"
        )
    out: dict = {"architectures": [ARCHITECTURES[arch][0]], "hidden_act": "silu"}
    for key, hf_key, required in CONFIG_KEYS:
        value = meta.get(f"{arch}.{key}")
        if value is None:
            if required:
                raise ValueError(f"{source}: metadata lacks {arch}.{key!s}, required for {arch}")
            continue
        out[hf_key] = value
    if "vocab_size" not in out:
        tokens = meta.get("tokenizer.ggml.tokens")
        if tokens is None:
            raise ValueError(f"{source}: metadata lacks {arch}.vocab_size and tokenizer tokens")
        out["vocab_size"] = len(tokens)
    head_dim = out.get("head_dim") or out["hidden_size"] // out["num_attention_heads"]
    rotary = meta.get(f"{arch}.rope.dimension_count", head_dim)
    if rotary != head_dim:
        raise ValueError(
            f"{source}: {arch}.rope.dimension_count={rotary} rotates part of each head "
            f"(head_dim={head_dim}); only full rotary embeddings are supported"
        )
    scaling = meta.get(f"{arch}.rope.scaling.type", "none")
    if scaling == "linear":
        out["rope_scaling"] = {"rope_type": "linear", "factor": meta[f"{arch}.rope.scaling.factor"]}
    elif scaling != "none":
        raise ValueError(
            f"{source}: {arch}.rope.scaling.type={scaling!r} is not supported; expected "
            "'none' or 'linear'"
        )
    if "rope_freqs.weight" in tensor_names:
        raise ValueError(
            f"{source}: holds rope_freqs.weight (per-dimension RoPE factors, Llama 3.1 style), "
            "which jkv cannot read from GGUF; load the Hugging Face folder instead"
        )
    out["tie_word_embeddings"] = "output.weight" not in tensor_names
    out["attention_bias"] = "blk.0.attn_q.bias" in tensor_names
    return out


def read_config(meta: dict, tensor_names: set[str], source: str, dtype=None) -> ModelConfig:
    """The model's config from a GGUF file's metadata and tensor names; ValueError naming
    what is missing or unsupported."""
    config = ModelConfig.from_hf_config(
        hf_config(meta, tensor_names, source), dtype=dtype or "float32", source=source
    )
    bos = meta.get("tokenizer.ggml.bos_token_id")
    eos = [meta.get(f"tokenizer.ggml.{k}_token_id") for k in ("eos", "eot", "eom")]
    eos_ids = tuple(dict.fromkeys(int(e) for e in eos if e is not None))
    return config.replace(
        bos_token_id=None if bos is None else int(bos),
        eos_token_ids=eos_ids or config.eos_token_ids,
        o_bias="blk.0.attn_output.bias" in tensor_names,
        mlp_bias="blk.0.ffn_up.bias" in tensor_names,
    )


def dequantize(tensor, source: str) -> np.ndarray:
    """One tensor as float32 in numpy order ([out, in] for a matrix, as Hugging Face stores
    it); ValueError naming the tensor and its type when the gguf package cannot dequantise it."""
    from gguf import GGMLQuantizationType, quants

    qtype = GGMLQuantizationType(tensor.tensor_type)
    try:
        values = quants.dequantize(np.asarray(tensor.data), qtype)
    except NotImplementedError:
        can = ["F32", "F16"] + sorted(t.name for t in quants._type_traits)
        raise ValueError(
            f"{source}: tensor {tensor.name!r} is stored as {qtype.name}, which the gguf package "
            f"cannot dequantise; expected one of {can}"
        ) from None
    return values.reshape(tuple(int(d) for d in reversed(tensor.shape)))


def _entries(tensors: dict, config: ModelConfig, source: str):
    """(GGUF tensor, our path, HF rule, un-permute heads field) of every tensor the model uses;
    ValueError naming a foreign or misshapen tensor."""
    needed = hf.expected_paths(config)
    for tensor_name, tensor in tensors.items():
        found = to_hf(tensor_name)
        if found is None:
            raise ValueError(
                f"{source}: unexpected tensor {tensor_name!r} for {config.architecture}"
            )
        hf_name, heads = found
        path, rule = hf.to_path(hf_name)
        if path == "lm_head/kernel" and config.tie_word_embeddings:
            continue
        if path not in needed:
            raise ValueError(
                f"{source}: tensor {tensor_name!r} does not belong to this config "
                f"({config.num_layers} layers)"
            )
        want = tuple(rule[2](config))
        shape = tuple(int(d) for d in reversed(tensor.shape))
        if shape != want:
            raise ValueError(f"{source}: tensor {tensor_name!r} has shape {shape}; expected {want}")
        yield tensor, path, rule, heads


def check_headers(path: str | Path) -> ModelConfig:
    """What `jkv info` reports: the config from the metadata, every tensor's name and shape
    checked (no tensor data read). Raises ValueError naming what is wrong."""
    source = str(path)
    reader = open_reader(Path(path))
    tensors = {t.name: t for t in reader.tensors}
    config = read_config(metadata(reader), set(tensors), source)
    found = [p for _, p, _, _ in _entries(tensors, config, source)]
    hf.check_complete(source, config, found, name_of=gguf_name)
    return config


def load_gguf(
    path: str | Path,
    *,
    dtype: str | None = None,
    name: str | None = None,
    mesh=None,
    progress: bool = False,
) -> Params:
    """Loads a GGUF file (llama, mistral or qwen2 architecture).

    Args:
      path: the `.gguf` file.
      dtype: "float32" (default: what dequantisation gives) or "bfloat16".
      name: the model's name (cache keys); default: made from the file's name without
        `.gguf` ("SmolLM2-135M-Instruct.Q4_1").
      mesh: a `jax.sharding.Mesh` to shard the weights over (see `jkv.sharding`).
      progress: show a progress bar.

    Raises:
      ValueError: naming the file and what is wrong: unreadable or truncated, an unsupported
        architecture or tokenizer, a tensor that is missing, misshapen, unexpected, in a type
        the gguf package cannot dequantise, or holding NaN / Inf.
    """
    from tqdm import tqdm

    path = Path(path)
    source = str(path)
    reader = open_reader(path)
    meta = metadata(reader)
    tensors = {t.name: t for t in reader.tensors}
    config = read_config(meta, set(tensors), source, dtype)
    name = choose_name(name, path.name.removesuffix(".gguf"))
    permuted = ARCHITECTURES[meta["general.architecture"]][1]
    target = jnp.dtype(config.dtype)
    weights: dict = {}
    digests: dict[str, str] = {}
    bar = tqdm(desc=f"converting {path.name}", unit="tensor", disable=not progress,
               total=len(tensors))  # fmt: skip
    for tensor, path_, (_, _, _, transform), heads in _entries(tensors, config, source):
        raw = dequantize(tensor, source)
        if permuted and heads is not None:
            raw = _unpermute(raw, getattr(config, heads))
        hf.place(weights, digests, path_, transform(raw, config), target, mesh, source, tensor.name)
        del raw
        bar.update(1)
    bar.close()
    hf.check_complete(source, config, digests, name_of=gguf_name)
    tokenizer = None
    if "tokenizer.ggml.model" in meta:
        tokenizer = Tokenizer(
            build_tokenizer(meta, source),
            bos_token_id=config.bos_token_id,
            eos_token_ids=config.eos_token_ids,
            source=source,
            chat_template=meta.get("tokenizer.chat_template"),
        )
    return Params(
        weights=weights,
        config=config,
        tokenizer=tokenizer,
        name=name,
        mesh=mesh,
        version=combine_digests(digests),
    )
