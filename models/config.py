"""Model configuration: one frozen dataclass, built from a Hugging Face `config.json` or a preset.

Axis alphabet used across jkv (declared once, here):
  B batch, T query tokens, S cached tokens (slots), N query heads, K kv heads,
  G = N // K query heads per kv head, H head dim, D model dim, F MLP dim, V vocab, L layers.
"""

from __future__ import annotations

import dataclasses
import json
import math
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np

SUPPORTED_ARCHITECTURES = ("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM")
_MODEL_TYPES = {
    "LlamaForCausalLM": "llama",
    "MistralForCausalLM": "mistral",
    "Qwen2ForCausalLM": "qwen2",
}
DTYPES = ("float32", "bfloat16")


@dataclasses.dataclass(frozen=True, kw_only=True)
class RopeScaling:
    """RoPE frequency scaling (`rope_type` "llama3" or "linear"), as in Hugging Face configs."""

    rope_type: str
    factor: float
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192


@dataclasses.dataclass(frozen=True, kw_only=True)
class ModelConfig:
    """A Llama-family decoder's shape and numerics. Hashable: used as a static jit argument."""

    architecture: str = "LlamaForCausalLM"
    vocab_size: int  # V
    hidden_size: int  # D
    intermediate_size: int  # F
    num_layers: int  # L
    num_heads: int  # N
    num_kv_heads: int  # K
    head_dim: int  # H
    rms_norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    rope_scaling: RopeScaling | None = None
    max_position_embeddings: int = 2048
    tie_word_embeddings: bool = False
    qkv_bias: bool = False  # Qwen2: bias on q/k/v projections
    o_bias: bool = False  # Llama `attention_bias` also puts a bias on o_proj
    mlp_bias: bool = False
    sliding_window: int | None = None  # Mistral: a query sees the last `sliding_window` keys
    dtype: str = "float32"  # parameter (and compute) dtype
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()

    def __post_init__(self):
        if self.architecture not in SUPPORTED_ARCHITECTURES:
            raise ValueError(
                f"architecture={self.architecture!r} is not supported; expected one of "
                f"{SUPPORTED_ARCHITECTURES}"
            )
        for name in (
            "vocab_size",
            "hidden_size",
            "intermediate_size",
            "num_layers",
            "num_heads",
            "num_kv_heads",
            "head_dim",
            "max_position_embeddings",
        ):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                raise ValueError(f"{name}={value!r} must be a positive integer")
        if self.num_heads % self.num_kv_heads:
            raise ValueError(
                f"num_heads={self.num_heads} must be a multiple of num_kv_heads={self.num_kv_heads}"
            )
        if self.head_dim % 2:
            raise ValueError(f"head_dim={self.head_dim} must be even for rotary embeddings")
        if self.dtype not in DTYPES:
            raise ValueError(f"dtype={self.dtype!r} is not supported; expected one of {DTYPES}")
        if self.sliding_window is not None and self.sliding_window <= 0:
            raise ValueError(f"sliding_window={self.sliding_window} must be positive or None")

    @property
    def q_per_kv(self) -> int:
        """G: query heads sharing one kv head."""
        return self.num_heads // self.num_kv_heads

    def replace(self, **changes: Any) -> ModelConfig:
        return dataclasses.replace(self, **changes)

    def inv_freq(self) -> np.ndarray:
        """RoPE inverse frequencies `[H // 2]` float32, with Llama-3 or linear scaling applied."""
        dim = self.head_dim
        inv = 1.0 / (
            self.rope_theta ** (np.arange(0, dim, 2, dtype=np.int64).astype(np.float32) / dim)
        )
        inv = inv.astype(np.float32)
        scaling = self.rope_scaling
        if scaling is None:
            return inv
        if scaling.rope_type == "linear":
            return (inv / scaling.factor).astype(np.float32)
        # Llama 3.1: low frequencies divided by `factor`, a smooth ramp between the two bands.
        old_len = scaling.original_max_position_embeddings
        low_wavelen = old_len / scaling.low_freq_factor
        high_wavelen = old_len / scaling.high_freq_factor
        wavelen = 2 * math.pi / inv
        scaled = np.where(wavelen > low_wavelen, inv / scaling.factor, inv)
        smooth = (old_len / wavelen - scaling.low_freq_factor) / (
            scaling.high_freq_factor - scaling.low_freq_factor
        )
        smoothed = (1 - smooth) * scaled / scaling.factor + smooth * scaled
        medium = ~(wavelen < high_wavelen) & ~(wavelen > low_wavelen)
        return np.where(medium, smoothed, scaled).astype(np.float32)

    def num_params(self) -> int:
        """Parameter count (embeddings counted once when tied)."""
        d, f, n, k, h = (
            self.hidden_size,
            self.intermediate_size,
            self.num_heads,
            self.num_kv_heads,
            self.head_dim,
        )
        attn = d * n * h + 2 * d * k * h + n * h * d
        if self.qkv_bias:
            attn += n * h + 2 * k * h
        if self.o_bias:
            attn += d
        mlp = 3 * d * f + (2 * f + d if self.mlp_bias else 0)
        per_layer = attn + mlp + 2 * d
        embed = self.vocab_size * d * (1 if self.tie_word_embeddings else 2)
        return self.num_layers * per_layer + embed + d

    # ------------------------------------------------------------------ Hugging Face
    @classmethod
    def from_hf_config(
        cls, hf: Mapping[str, Any], *, dtype: str | None = None, source: str = "config.json"
    ) -> ModelConfig:
        """Builds a config from a Hugging Face `config.json` mapping.

        Accepts both the transformers 4 keys (`rope_theta`, `rope_scaling`) and the
        transformers 5 `rope_parameters` dict.

        Args:
          hf: the parsed `config.json`.
          dtype: parameter dtype; default: the checkpoint's `torch_dtype`/`dtype` if float32 or
            bfloat16, else float32.
          source: named in error messages.

        Raises:
          ValueError: unknown architecture, missing key, unsupported activation or RoPE type.
        """
        archs = hf.get("architectures") or []
        by_type = {t: a for a, t in _MODEL_TYPES.items()}
        arch = archs[0] if archs else by_type.get(hf.get("model_type"))
        if arch not in SUPPORTED_ARCHITECTURES:
            raise ValueError(
                f"{source}: architectures={archs!r} is not supported; expected one of "
                f"{SUPPORTED_ARCHITECTURES}"
            )

        def need(key: str) -> Any:
            if key not in hf:
                raise ValueError(f"{source}: missing key {key!r} required for {arch}")
            return hf[key]

        act = hf.get("hidden_act", "silu")
        if act != "silu":
            raise ValueError(f"{source}: hidden_act={act!r} is not supported; expected 'silu'")
        num_heads = int(need("num_attention_heads"))
        hidden = int(need("hidden_size"))
        head_dim = hf.get("head_dim") or hidden // num_heads

        rope = dict(hf.get("rope_parameters") or {})
        if not rope and hf.get("rope_scaling"):
            rope = dict(hf["rope_scaling"])
        rope_theta = float(rope.get("rope_theta", hf.get("rope_theta", 10000.0)))
        rope_type = rope.get("rope_type", rope.get("type", "default"))
        if rope.get("partial_rotary_factor", 1.0) != 1.0:
            raise ValueError(f"{source}: partial_rotary_factor is not supported")
        if rope_type == "default":
            scaling = None
        elif rope_type == "llama3":
            scaling = RopeScaling(
                rope_type="llama3",
                factor=float(rope["factor"]),
                low_freq_factor=float(rope["low_freq_factor"]),
                high_freq_factor=float(rope["high_freq_factor"]),
                original_max_position_embeddings=int(rope["original_max_position_embeddings"]),
            )
        elif rope_type == "linear":
            scaling = RopeScaling(rope_type="linear", factor=float(rope["factor"]))
        else:
            raise ValueError(
                f"{source}: rope_type={rope_type!r} is not supported; expected 'default', "
                f"'llama3' or 'linear'"
            )

        if dtype is None:
            declared = hf.get("dtype") or hf.get("torch_dtype")
            dtype = declared if declared in DTYPES else "float32"

        sliding = None
        if arch == "MistralForCausalLM":
            sliding = hf.get("sliding_window")
        elif arch == "Qwen2ForCausalLM" and hf.get("use_sliding_window"):
            # Qwen2 windows only the layers from max_window_layers on; we window none or all.
            if hf.get("max_window_layers", 0) > 0:
                raise ValueError(
                    f"{source}: Qwen2 use_sliding_window with max_window_layers>0 is not supported"
                )
            sliding = hf.get("sliding_window")

        eos = hf.get("eos_token_id")
        eos_ids = tuple(eos) if isinstance(eos, list) else (() if eos is None else (int(eos),))
        attention_bias = bool(hf.get("attention_bias", False))
        is_qwen2 = arch == "Qwen2ForCausalLM"
        return cls(
            architecture=arch,
            vocab_size=int(need("vocab_size")),
            hidden_size=hidden,
            intermediate_size=int(need("intermediate_size")),
            num_layers=int(need("num_hidden_layers")),
            num_heads=num_heads,
            num_kv_heads=int(hf.get("num_key_value_heads") or num_heads),
            head_dim=int(head_dim),
            rms_norm_eps=float(hf.get("rms_norm_eps", 1e-6 if is_qwen2 else 1e-5)),
            rope_theta=rope_theta,
            rope_scaling=scaling,
            max_position_embeddings=int(hf.get("max_position_embeddings", 2048)),
            tie_word_embeddings=bool(hf.get("tie_word_embeddings", False)),
            qkv_bias=True if is_qwen2 else attention_bias,
            o_bias=False if is_qwen2 else attention_bias,
            mlp_bias=bool(hf.get("mlp_bias", False)),
            sliding_window=int(sliding) if sliding else None,
            dtype=dtype,
            bos_token_id=hf.get("bos_token_id"),
            eos_token_ids=eos_ids,
        )

    @classmethod
    def from_hf_file(cls, path: str | Path, *, dtype: str | None = None) -> ModelConfig:
        path = Path(path)
        try:
            hf = json.loads(path.read_text())
        except FileNotFoundError:
            raise ValueError(f"{path}: no such file; expected a Hugging Face config.json") from None
        except json.JSONDecodeError as e:
            raise ValueError(f"{path}: not valid JSON ({e})") from None
        return cls.from_hf_config(hf, dtype=dtype, source=str(path))

    def to_hf_config(self) -> dict[str, Any]:
        """The Hugging Face `config.json` mapping for this config (transformers 4 and 5 keys)."""
        model_type = _MODEL_TYPES[self.architecture]
        rope: dict[str, Any] = {"rope_type": "default", "rope_theta": self.rope_theta}
        if self.rope_scaling is not None:
            rope = {"rope_theta": self.rope_theta, **dataclasses.asdict(self.rope_scaling)}
        hf: dict[str, Any] = {
            "architectures": [self.architecture],
            "model_type": model_type,
            "vocab_size": self.vocab_size,
            "hidden_size": self.hidden_size,
            "intermediate_size": self.intermediate_size,
            "num_hidden_layers": self.num_layers,
            "num_attention_heads": self.num_heads,
            "num_key_value_heads": self.num_kv_heads,
            "head_dim": self.head_dim,
            "hidden_act": "silu",
            "rms_norm_eps": self.rms_norm_eps,
            "rope_theta": self.rope_theta,
            "rope_parameters": rope,
            "rope_scaling": None if self.rope_scaling is None else rope,
            "max_position_embeddings": self.max_position_embeddings,
            "tie_word_embeddings": self.tie_word_embeddings,
            "torch_dtype": self.dtype,
            "bos_token_id": self.bos_token_id,
            "eos_token_id": list(self.eos_token_ids)
            if len(self.eos_token_ids) > 1
            else (self.eos_token_ids[0] if self.eos_token_ids else None),
        }
        if model_type == "llama":
            hf["attention_bias"] = self.qkv_bias
            hf["mlp_bias"] = self.mlp_bias
        if model_type == "mistral":
            hf["sliding_window"] = self.sliding_window
        if model_type == "qwen2":
            hf["use_sliding_window"] = self.sliding_window is not None
            hf["sliding_window"] = self.sliding_window
            hf["max_window_layers"] = 0
        return hf


def _np_dtype(name: str):
    import ml_dtypes  # ships with jax; numpy itself has no bfloat16 / float8

    table = {
        "float32": np.float32,
        "float16": np.float16,
        "bfloat16": ml_dtypes.bfloat16,
        "float8_e4m3fn": ml_dtypes.float8_e4m3fn,
    }
    if name not in table:
        raise ValueError(f"dtype={name!r} is not supported; expected one of {tuple(table)}")
    return table[name]


# Shape-only presets: enough to build params with jax.eval_shape and to size KV caches.
PRESETS: dict[str, ModelConfig] = {
    "llama-3.2-1b": ModelConfig(
        vocab_size=128256,
        hidden_size=2048,
        intermediate_size=8192,
        num_layers=16,
        num_heads=32,
        num_kv_heads=8,
        head_dim=64,
        rope_theta=500000.0,
        rope_scaling=RopeScaling(rope_type="llama3", factor=32.0),
        max_position_embeddings=131072,
        tie_word_embeddings=True,
        dtype="bfloat16",
    ),
    # Multi-head attention (32 kv heads): the classic worked example of KV bytes.
    "llama-2-7b": ModelConfig(
        vocab_size=32000,
        hidden_size=4096,
        intermediate_size=11008,
        num_layers=32,
        num_heads=32,
        num_kv_heads=32,
        head_dim=128,
        max_position_embeddings=4096,
        dtype="bfloat16",
    ),
    "llama-3.1-8b": ModelConfig(
        vocab_size=128256,
        hidden_size=4096,
        intermediate_size=14336,
        num_layers=32,
        num_heads=32,
        num_kv_heads=8,
        head_dim=128,
        rope_theta=500000.0,
        rope_scaling=RopeScaling(rope_type="llama3", factor=8.0),
        max_position_embeddings=131072,
        dtype="bfloat16",
    ),
    "tinyllama-1.1b": ModelConfig(
        vocab_size=32000,
        hidden_size=2048,
        intermediate_size=5632,
        num_layers=22,
        num_heads=32,
        num_kv_heads=4,
        head_dim=64,
        max_position_embeddings=2048,
        dtype="bfloat16",
    ),
    "smollm2-135m": ModelConfig(
        vocab_size=49152,
        hidden_size=576,
        intermediate_size=1536,
        num_layers=30,
        num_heads=9,
        num_kv_heads=3,
        head_dim=64,
        rope_theta=100000.0,
        max_position_embeddings=8192,
        tie_word_embeddings=True,
        dtype="bfloat16",
    ),
    "qwen2.5-0.5b": ModelConfig(
        architecture="Qwen2ForCausalLM",
        vocab_size=151936,
        hidden_size=896,
        intermediate_size=4864,
        num_layers=24,
        num_heads=14,
        num_kv_heads=2,
        head_dim=64,
        rms_norm_eps=1e-6,
        rope_theta=1000000.0,
        max_position_embeddings=32768,
        tie_word_embeddings=True,
        qkv_bias=True,
        dtype="bfloat16",
    ),
    "mistral-7b": ModelConfig(
        architecture="MistralForCausalLM",
        vocab_size=32000,
        hidden_size=4096,
        intermediate_size=14336,
        num_layers=32,
        num_heads=32,
        num_kv_heads=8,
        head_dim=128,
        max_position_embeddings=32768,
        sliding_window=4096,
        dtype="bfloat16",
    ),
}


def preset(name: str) -> ModelConfig:
    """Returns the shape-only preset `name` (case-insensitive)."""
    key = name.lower()
    if key not in PRESETS:
        raise ValueError(f"preset={name!r} is unknown; expected one of {sorted(PRESETS)}")
    return PRESETS[key]
