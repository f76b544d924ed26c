"""The loaded-model bundle: weights (the pytree's leaves) + config, tokenizer, name, version."""

from __future__ import annotations

import dataclasses
import hashlib
from typing import Any

import jax
import numpy as np

from jkv.tokenizer import Tokenizer
from models.config import ModelConfig


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class Params:
    """What `jkv.load` returns and `jkv.generate` takes.

    Only `weights` are pytree leaves; the rest is static metadata, so a `Params` can cross a
    jit boundary or be mapped over with `jax.tree.map` (e.g. to cast dtypes).
    """

    weights: Any  # nested dict of arrays, models.llama layout
    config: ModelConfig = dataclasses.field(metadata=dict(static=True))
    tokenizer: Tokenizer | None = dataclasses.field(default=None, metadata=dict(static=True))
    name: str = dataclasses.field(default="model", metadata=dict(static=True))
    version: str = dataclasses.field(default="", metadata=dict(static=True))
    mesh: Any = dataclasses.field(default=None, metadata=dict(static=True))

    def replace(self, **changes) -> Params:
        return dataclasses.replace(self, **changes)


def tensor_digest(array) -> str:
    """SHA-256 of one tensor's dtype, shape and bytes."""
    a = np.ascontiguousarray(np.asarray(array))
    h = hashlib.sha256(f"{a.dtype}|{a.shape}|".encode())
    h.update(a.view(np.uint8).reshape(-1).data)
    return h.hexdigest()


def combine_digests(digests: dict[str, str]) -> str:
    """The weights' version from per-tensor digests keyed by parameter path ("a/b/kernel")."""
    h = hashlib.sha256(b"jkv-weights-v1")
    for path in sorted(digests):
        h.update(f"{path}={digests[path]};".encode())
    return h.hexdigest()[:16]


def path_str(path) -> str:
    return "/".join(str(getattr(p, "key", p)) for p in path)


def fingerprint(weights) -> str:
    """The version string of a weights tree: same names, dtypes, shapes and bytes, same string.

    Converters compute it tensor by tensor while streaming (`tensor_digest`), with the same
    result as hashing the finished tree.
    """
    leaves = jax.tree_util.tree_flatten_with_path(weights)[0]
    return combine_digests({path_str(p): tensor_digest(leaf) for p, leaf in leaves})
