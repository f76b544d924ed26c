"""Logical axes for params and KV state, mapped to a `jax.sharding.Mesh` by one rules table.

Tensor parallel over heads and the MLP dim (mesh axis "model"), data parallel over the batch
(mesh axis "data"). An array dim whose size the mesh axis does not divide stays replicated, so
any mesh works for any model (e.g. 2 kv heads on a 4-way "model" axis).

Multi-host: call `jax.distributed.initialize()` on every host first, build the mesh over
`jax.devices()` (all hosts' devices), then `jkv.load(path, mesh=mesh)`; the same rules apply.
"""

from __future__ import annotations

from collections.abc import Mapping

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import multihost_utils
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from jkv_models.llama import LAYERS

# logical axis -> mesh axis (None: replicated)
RULES: Mapping[str, str | None] = {
    "batch": "data",
    "heads": "model",
    "kv_heads": "model",
    "mlp": "model",
    "vocab": "model",
    "embed": None,
    "head_dim": None,
    "seq": None,
}

# parameter leaf name -> logical axes of its dims
PARAM_AXES: Mapping[tuple[str, str], tuple[str, ...]] = {
    ("embed_tokens", "embedding"): ("vocab", "embed"),
    ("q_proj", "kernel"): ("embed", "heads", "head_dim"),
    ("k_proj", "kernel"): ("embed", "kv_heads", "head_dim"),
    ("v_proj", "kernel"): ("embed", "kv_heads", "head_dim"),
    ("q_proj", "bias"): ("heads", "head_dim"),
    ("k_proj", "bias"): ("kv_heads", "head_dim"),
    ("v_proj", "bias"): ("kv_heads", "head_dim"),
    ("o_proj", "kernel"): ("heads", "head_dim", "embed"),
    ("o_proj", "bias"): ("embed",),
    ("gate_proj", "kernel"): ("embed", "mlp"),
    ("up_proj", "kernel"): ("embed", "mlp"),
    ("down_proj", "kernel"): ("mlp", "embed"),
    ("gate_proj", "bias"): ("mlp",),
    ("up_proj", "bias"): ("mlp",),
    ("down_proj", "bias"): ("embed",),
    ("lm_head", "kernel"): ("embed", "vocab"),
}

KV_AXES = {
    "k": ("batch", "kv_heads", "seq", "head_dim"),
    "v": ("batch", "kv_heads", "seq", "head_dim"),
    "lengths": ("batch", "kv_heads"),
    "positions": ("batch", "kv_heads", "seq"),
    "k_scale": ("batch", "kv_heads", "seq"),
    "v_scale": ("batch", "kv_heads", "seq"),
    "bias": ("batch", "kv_heads", "seq"),
}
# The SnapKV segment rebuild's low-rank store (`LayerKV.lowrank`): segments stay with their head.
LOWRANK_AXES = {
    "coef_k": ("batch", "kv_heads", None, None, None),
    "basis_k": ("batch", "kv_heads", None, None, "head_dim"),
    "coef_v": ("batch", "kv_heads", None, None, None),
    "basis_v": ("batch", "kv_heads", None, None, "head_dim"),
    "counts": ("batch", "kv_heads", None),
    "rank_k": ("batch", "kv_heads", None),
    "rank_v": ("batch", "kv_heads", None),
    "positions": ("batch", "kv_heads", None, None),
}


def to_host(x) -> np.ndarray:
    """A device array's value on this host, also when it spans other processes' devices
    (multi-host): a replicated one from this process's copy, a sharded one gathered from every
    process (a collective: every process reads it at the same point, as the engine's lockstep
    processes do)."""
    if not isinstance(x, jax.Array) or x.is_fully_addressable:
        return np.asarray(x)
    if x.is_fully_replicated:
        return np.asarray(x.addressable_data(0))
    return np.asarray(multihost_utils.process_allgather(x, tiled=True))


def param_axes(path: tuple[str, ...]) -> tuple[str, ...]:
    """Logical axes of the parameter at `path` (e.g. ("layers_0", "mlp", "up_proj", "kernel"));
    the stacked layers' (`("layers", ...)`) have their leading layer axis unsharded."""
    layers = (None,) if path[0] == LAYERS else ()
    if path[-1] == "scale":  # RMSNorm weights
        return (*layers, "embed")
    key = tuple(path[-2:])
    if key not in PARAM_AXES:
        raise ValueError(f"parameter {'/'.join(path)} has no logical axes in jkv.sharding")
    return (*layers, *PARAM_AXES[key])


def spec(axes: tuple[str | None, ...], shape: tuple[int, ...], mesh: Mesh) -> PartitionSpec:
    """The PartitionSpec for logical `axes`, replicating dims the mesh axis does not divide."""
    out = []
    for name, size in zip(axes, shape, strict=True):
        mesh_axis = RULES.get(name) if name else None
        if mesh_axis is not None and (mesh_axis not in mesh.shape or size % mesh.shape[mesh_axis]):
            mesh_axis = None
        out.append(mesh_axis)
    return PartitionSpec(*out)


def param_sharding(path: tuple[str, ...], shape: tuple[int, ...], mesh: Mesh) -> NamedSharding:
    return NamedSharding(mesh, spec(param_axes(path), shape, mesh))


def shard_params(weights, mesh: Mesh):
    """Places every weight by the rules table."""

    def place(path, leaf):
        names = tuple(getattr(p, "key", str(p)) for p in path)
        return jax.device_put(leaf, param_sharding(names, leaf.shape, mesh))

    return jax.tree_util.tree_map_with_path(place, weights)


def shard_kv(state, mesh: Mesh):
    """Places a `KVState` by the rules table (batch over "data", kv heads over "model")."""

    def place(obj, table):
        changes = {}
        for field, axes in table.items():
            value = getattr(obj, field)
            if value is not None:
                changes[field] = jax.device_put(
                    value, NamedSharding(mesh, spec(axes, value.shape, mesh))
                )
        return type(obj)(**{**obj.__dict__, **changes})

    def place_layer(layer):
        layer = place(layer, KV_AXES)
        if layer.lowrank is not None:
            layer = layer.replace(lowrank=place(layer.lowrank, LOWRANK_AXES))
        return layer

    def per_row(x):
        return jax.device_put(x, NamedSharding(mesh, spec(("batch",), x.shape, mesh)))

    # replace, not a new KVState: static fields (dtype, policy) travel unchanged
    return state.replace(
        layers=tuple(place_layer(x) for x in state.layers),
        next_position=per_row(state.next_position),
        limit=per_row(state.limit),
    )


def kv_head_parallel(params, mesh: Mesh):
    """`params` ready for a paged pool sharded over kv heads on `mesh`'s "model" axis (tp
    devices): the weights placed on `mesh` by the rules table, and, when tp is larger than
    the kv heads K, each kv head repeated tp / K times in k_proj and v_proj (tpu-inference's
    rule: one head per device; the repeated model computes the same attention). Returns
    (params, tp).

    Raises:
      ValueError: the mesh has no "model" axis, or tp does not divide the query heads, or
        neither of tp and K divides the other.
    """
    if "model" not in mesh.shape:
        raise ValueError(f"mesh axes {tuple(mesh.shape)}: the engine shards over a 'model' axis")
    tp, cfg = mesh.shape["model"], params.config
    k, n = cfg.num_kv_heads, cfg.num_heads
    if n % tp or (k % tp and tp % k):
        raise ValueError(
            f"a 'model' axis of {tp} devices cannot split num_heads={n} and num_kv_heads={k}: "
            "tp must divide num_heads, and divide num_kv_heads or be a multiple of it"
        )
    if params.mesh != mesh:
        params = params.replace(weights=shard_params(params.weights, mesh), mesh=mesh)
    return (params if tp <= k else repeat_kv_heads(params, tp // k)), tp


def repeat_kv_heads(params, times: int):
    """The same model with each kv head repeated `times` times in k_proj and v_proj
    (interleaved: new head j is old head j // times, so query head n still reads its old
    head): every token's attention is unchanged; placed on `params.mesh` if any."""

    def repeat(path, leaf):
        names = tuple(getattr(p, "key", str(p)) for p in path)
        if len(names) < 2 or names[-2] not in ("k_proj", "v_proj"):
            return leaf
        out = jnp.repeat(leaf, times, axis=leaf.ndim - 2)  # kernel [D, K, H], bias [K, H]
        if params.mesh is None:
            return out
        return jax.device_put(out, param_sharding(names, out.shape, params.mesh))

    weights = jax.tree_util.tree_map_with_path(repeat, params.weights)
    config = params.config.replace(num_kv_heads=params.config.num_kv_heads * times)
    return type(params)(weights, config, params.tokenizer, params.name, params.mesh,
                        version=f"{params.version}-kv-x{times}")  # fmt: skip
