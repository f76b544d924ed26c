"""jkv: LLM inference for JAX whose KV cache is small, fast and honest about both.

params = jkv.load("path/to/hf-or-jkv-folder")
result = jkv.generate(params, "The capital of France is", max_new_tokens=32)
print(result.text, result.kv_bytes)
"""

from jkv import embedding  # jkv.embedding.ModelEmbedder, fit_clusters
from jkv.checkpoints import convert, load
from jkv.checkpoints import save as _save
from jkv.checkpoints.export import export_hf
from jkv.engine.engine import Engine, RequestOutput
from jkv.generate import chat, generate, stream
from jkv.kv_context import KVContext
from jkv.memory import MemoryReport, memory
from jkv.output import GenerationResult
from jkv.params import Params
from jkv.policies import (
    H2O,
    AdaKV,
    EffiCache,
    KVPolicy,
    KVzip,
    PyramidKV,
    Quantile,
    SnapKV,
    SnapKVSegments,
    StreamingLLM,
)
from jkv.prefill import prefill
from jkv.response_cache import ResponseCache
from jkv.scoring import logits

__version__ = "0.1.0"


def save(params: Params, folder, *, overwrite: bool = False):
    """Writes `params` (weights, config, tokenizer, name, version) to a jkv checkpoint folder."""
    return _save(params, folder, overwrite=overwrite)


__all__ = [
    "H2O",
    "AdaKV",
    "EffiCache",
    "Engine",
    "GenerationResult",
    "KVContext",
    "KVPolicy",
    "Params",
    "KVzip",
    "PyramidKV",
    "Quantile",
    "RequestOutput",
    "ResponseCache",
    "SnapKV",
    "SnapKVSegments",
    "StreamingLLM",
    "chat",
    "convert",
    "embedding",
    "export_hf",
    "generate",
    "load",
    "logits",
    "memory",
    "MemoryReport",
    "prefill",
    "save",
    "stream",
]
