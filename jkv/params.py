"""The loaded-model bundle: weights (the pytree's leaves) + config, tokenizer, name.

What derives from the weights is computed from the weights, never carried beside them:
`jax.tree.map` (a cast, a scaling) keeps the static fields as they were, so a stored
fingerprint or dtype would describe the old arrays. `version` (the weights fingerprint) is
computed from the leaves when asked and memoised on the arrays' identity: new arrays, new
fingerprint; `params.replace(name=...)` or a second `Params` around the same arrays reuse it.
`dtype` and `identity` are memoised per `Params` instance; like JAX arrays, the weights are
treated as immutable (build new params with `jax.tree.map` or `replace`, never edit the dict).
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import math
import threading
import weakref
from collections import Counter
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from jkv import sharding
from jkv.kv import KV_DTYPES
from jkv.tokenizer import Tokenizer
from jkv_models.config import ModelConfig
from jkv_models.llama import LAYERS, stack_layers

_FINGERPRINTS: dict[tuple, tuple[str, list]] = {}  # (treedef, leaf ids) -> (digest, weakrefs)
_FINGERPRINTS_LOCK = threading.Lock()
_TOKENIZER_DIGESTS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True, init=False)
class Params:
    """What `jkv.load` returns and `jkv.generate` takes.

    Only `weights` are pytree leaves; the rest is static metadata, so a `Params` can cross a
    jit boundary or be mapped over with `jax.tree.map` (e.g. to cast dtypes).

    Args:
        weights: nested dict of arrays, models.llama layout (the decoder layers stacked under
            `layers`; a tree with one `layers_i` subtree per layer is stacked here).
        config: the model's shape and numerics.
        tokenizer: text <-> ids; None for token-id prompts only.
        name: the model's name in response-cache keys (see `jkv.response_cache.keys`).
        mesh: the `jax.sharding.Mesh` the weights are placed on, if any.
        version: the fingerprint of exactly these arrays when the caller computed it already
            (a loader that hashed each tensor while streaming it); seeds the memo of `version`
            for these arrays only, so a copy or a cast is hashed afresh. None: computed on use.

    Raises:
        ValueError: `version` is not a str.
    """

    weights: Any  # nested dict of arrays, models.llama layout
    config: ModelConfig = dataclasses.field(metadata=dict(static=True))
    tokenizer: Tokenizer | None = dataclasses.field(default=None, metadata=dict(static=True))
    name: str = dataclasses.field(default="model", metadata=dict(static=True))
    mesh: Any = dataclasses.field(default=None, metadata=dict(static=True))

    def __init__(
        self,
        weights: Any,
        config: ModelConfig,
        tokenizer: Tokenizer | None = None,
        name: str = "model",
        mesh: Any = None,
        *,
        version: str | None = None,
    ) -> None:
        if isinstance(weights, dict) and LAYERS not in weights:
            weights = stack_layers(weights)
            if mesh is not None:  # each stacked tensor placed as its layers' slices were
                weights = sharding.shard_params(weights, mesh)
        for field, value in (
            ("weights", weights),
            ("config", config),
            ("tokenizer", tokenizer),
            ("name", name),
            ("mesh", mesh),
        ):
            object.__setattr__(self, field, value)
        object.__setattr__(self, "_derived", {})
        if version is not None:
            if not isinstance(version, str):
                raise ValueError(f"version={version!r} must be a str (a weights fingerprint)")
            seed_fingerprint(weights, version)

    def replace(self, **changes) -> Params:
        return dataclasses.replace(self, **changes)

    @property
    def version(self) -> str:
        """The weights fingerprint: same paths, dtypes, shapes and bytes, same string."""
        return fingerprint(self.weights)

    @property
    def dtype(self) -> str:
        """The floating dtype of the weights (the one most elements hold), e.g. "bfloat16";
        it follows a cast where `config.dtype` does not."""
        found = self._derived.get("dtype")  # spelled out: read on every cached request
        if found is None:
            found = self._derived["dtype"] = weights_dtype(self.weights)
        return found

    @property
    def kv_dtype(self) -> str:
        """The KV storage dtype of a request that names none: the weights' own, float32 when
        KV storage does not offer it (float16 weights)."""
        return self.dtype if self.dtype in KV_DTYPES else "float32"

    @property
    def identity(self) -> str:
        """What this model's answer to a prompt string depends on: the weights (`version`),
        the tokenizer and the config (eos and bos ids, RoPE, norms, dtype...); 32 hex digits.
        The response cache's model version."""
        found = self._derived.get("identity")
        if found is None:
            found = model_identity(self.version, self.tokenizer, self.config)
            self._derived["identity"] = found
        return found


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


def _flatten(weights) -> tuple[list, tuple]:
    flat, treedef = jax.tree_util.tree_flatten_with_path(weights)
    return flat, (treedef, tuple(id(leaf) for _, leaf in flat))


def file_tensors(weights):
    """Yields (path, tensor) of every tensor as checkpoint files hold them: one per layer
    (`layers_3/mlp/up_proj/kernel`, a slice of the stacked layers' host copy), the rest as they
    are; one stacked tensor on the host at a time."""
    for path, leaf in jax.tree_util.tree_flatten_with_path(weights)[0]:
        name = path_str(path)
        if name.startswith(LAYERS + "/"):
            host = np.asarray(leaf)
            for i in range(host.shape[0]):
                yield f"layers_{i}{name[len(LAYERS) :]}", host[i]
        else:
            yield name, leaf


def fingerprint(weights) -> str:
    """The version string of a weights tree: same names, dtypes, shapes and bytes, same string.

    Memoised on the identity of the leaves (and the tree's structure): the same arrays are
    hashed once, new arrays (a `jax.tree.map`) always afresh. Converters compute it tensor by
    tensor while streaming (`tensor_digest`), with the same result as hashing the finished tree:
    the tensors are hashed as the files hold them, one per layer (`file_tensors`).
    """
    flat, memo = _flatten(weights)
    found = _FINGERPRINTS.get(memo)
    if found is not None:
        return found[0]
    digest = combine_digests({p: tensor_digest(leaf) for p, leaf in file_tensors(weights)})
    _remember(memo, [leaf for _, leaf in flat], digest)
    return digest


def seed_fingerprint(weights, digest: str) -> None:
    """Records `digest` as the fingerprint of exactly these arrays, unless one is known."""
    flat, memo = _flatten(weights)
    if memo not in _FINGERPRINTS:
        _remember(memo, [leaf for _, leaf in flat], digest)


def _remember(memo: tuple, leaves: list, digest: str) -> None:
    def forget(_ref) -> None:  # a leaf died: its id may soon name another array
        _FINGERPRINTS.pop(memo, None)

    try:
        refs = [weakref.ref(leaf, forget) for leaf in leaves]
    except TypeError:  # a leaf without weak references (a Python scalar): no memo
        return
    with _FINGERPRINTS_LOCK:
        _FINGERPRINTS.setdefault(memo, (digest, refs))


def weights_dtype(weights) -> str:
    """The floating dtype most elements of the weights hold, as a name ("float32", ...).

    Raises:
        ValueError: the tree holds no floating-point array.
    """
    elements: Counter[str] = Counter()
    for leaf in jax.tree_util.tree_leaves(weights):
        dtype = jnp.dtype(leaf.dtype)
        if jnp.issubdtype(dtype, jnp.floating):
            elements[dtype.name] += math.prod(leaf.shape)
    if not elements:
        raise ValueError("the weights hold no floating-point arrays; expected a model's weights")
    return elements.most_common(1)[0][0]


def tokenizer_digest(tokenizer: Tokenizer | None) -> str:
    """SHA-256 of a tokenizer's full definition and special ids (memoised per tokenizer)."""
    if tokenizer is None:
        return "none"
    found = _TOKENIZER_DIGESTS.get(tokenizer)
    if found is None:
        h = hashlib.sha256(tokenizer.to_str().encode("utf-8"))
        h.update(f"|{tokenizer.bos_token_id}|{list(tokenizer.eos_token_ids)}".encode())
        found = _TOKENIZER_DIGESTS[tokenizer] = h.hexdigest()
    return found


def model_identity(version: str, tokenizer: Tokenizer | None, config: ModelConfig) -> str:
    """The hash of everything that turns a prompt string into an answer, but the settings."""
    config_json = json.dumps(dataclasses.asdict(config), sort_keys=True, default=str)
    h = hashlib.sha256(b"jkv-model-v1")
    for part in (version, tokenizer_digest(tokenizer), config_json):
        h.update(len(part).to_bytes(8, "little") + part.encode("utf-8"))
    return h.hexdigest()[:32]
