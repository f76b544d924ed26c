"""Finiteness at load: one NaN or Inf weight makes every logit NaN, and greedy decoding then
emits token 0 forever without a word. Each tensor is checked once, as it is loaded, and a bad
one is named with its file.

IEEE formats are checked on their bits (exponent all ones = Inf or NaN), chunk by chunk: as
fast for bfloat16 as for float32, and with a bounded temporary.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from jkv.params import path_str
from jkv_models.llama import LAYERS

_CHUNK = 1 << 22  # elements per step: bounds the temporaries to a few MB
_EXPONENT_BITS = {  # dtype -> (unsigned view, exponent mask)
    "float16": (np.uint16, 0x7C00),
    "bfloat16": (np.uint16, 0x7F80),
    "float32": (np.uint32, 0x7F80_0000),
    "float64": (np.uint64, 0x7FF0_0000_0000_0000),
}


def count_nonfinite(array: np.ndarray) -> int:
    """How many elements of a host array are NaN or +-Inf (0 for non-float arrays)."""
    spec = _EXPONENT_BITS.get(array.dtype.name)
    if spec is None:
        if not jnp.issubdtype(array.dtype, jnp.floating):
            return 0
        return int(np.count_nonzero(~np.isfinite(array)))
    uint, mask = spec
    bits = np.ascontiguousarray(array).reshape(-1).view(uint)
    return sum(
        int(np.count_nonzero((bits[i : i + _CHUNK] & mask) == mask))
        for i in range(0, bits.size, _CHUNK)
    )


def check_tensor(array: np.ndarray, where: str, tensor: str) -> None:
    """Raises when a tensor holds NaN or Inf.

    Args:
        array: the tensor, on the host.
        where: the file it came from.
        tensor: its name in that file.

    Raises:
        ValueError: naming the file, the tensor and how many values are not finite.
    """
    _refuse(count_nonfinite(array), array.size, where, tensor)


def check_tree(weights, where: str) -> None:
    """`check_tensor` on every leaf of a weights tree, shard by shard (each host checks the
    shards it holds; replicas once).

    Raises:
        ValueError: as `check_tensor`, the tensor named by its parameter path.
    """
    for path, leaf in jax.tree_util.tree_flatten_with_path(weights)[0]:
        shards = getattr(leaf, "addressable_shards", None)  # host arrays are one piece
        parts = [leaf] if shards is None else [s.data for s in shards if s.replica_id == 0]
        bad = sum(count_nonfinite(np.asarray(part)) for part in parts)
        name = path_str(path)
        if bad and name.startswith(LAYERS + "/"):  # name the first layer's tensor, as files do
            host = np.asarray(leaf)
            i = next(i for i in range(host.shape[0]) if count_nonfinite(host[i]))
            name, bad, size = (
                f"layers_{i}{name[len(LAYERS) :]}",
                count_nonfinite(host[i]),
                host[i].size,
            )
            _refuse(bad, size, where, name)
        _refuse(bad, leaf.size, where, name)


def _refuse(bad: int, size: int, where: str, tensor: str) -> None:
    if bad:
        raise ValueError(
            f"{where}: tensor {tensor!r} holds {bad} NaN/Inf value{'s' * (bad > 1)} of {size}; "
            "expected finite weights (the checkpoint is corrupt)"
        )
