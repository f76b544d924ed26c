"""A prefilled context as a value: what `jkv.prefill` returns, to answer after it many times.

`KVContext` holds a `KVState` (each row's kept slots per layer and kv head, their positions,
fp8 scales, slot biases and low-rank segments where its policy made them; the policy that shaped
it), the token ids it was computed from, and the fingerprint of the weights that computed it
(`Params.version`). `jkv.generate(params, question, kv_state=ctx)` refuses a context from other
weights, another model's shape or another KV dtype, with an error naming both.

Bytes. `nbytes` counts what the rows hold: slot i of (row b, layer l, kv head k) for
i < lengths[b, k] (its K and V, fp8 scales, its position and, if present, its bias and score),
plus the per-row and per-head counters and any low-rank segments whole; never the empty slots
a state's capacity bucket pads with. `to_bytes()` writes exactly those arrays after a msgpack
header (schema version, model shape, dtype, policy, tokens, weights fingerprint, each array's
dtype and shape): a 25% context writes about a quarter of the full cache's bytes.
`KVContext.from_bytes` rebuilds the state at its original capacities (same compiled shapes)
and refuses data of another schema, or cut short, with a clear error.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import ClassVar

import jax.numpy as jnp
import msgpack
import numpy as np

from jkv import kv as kvlib
from jkv import policies

MAGIC = b"JKVCTX\n"
SCHEMA = 1
# Per-slot arrays of a layer ([B, K, S, ...]) and what an empty slot holds
SLOT_FIELDS = {"k": 0, "v": 0, "positions": -1, "k_scale": 1, "v_scale": 1, "scores": 0, "bias": 0}


@dataclasses.dataclass(frozen=True, eq=False)
class KVContext:
    """A context's KV state with where it came from (module docstring)."""

    state: kvlib.KVState
    tokens: tuple[tuple[int, ...], ...]  # each row's token ids the state was computed from
    weights: str  # `Params.version` of the weights that computed it

    schema: ClassVar[int] = SCHEMA

    @property
    def batch_size(self) -> int:
        return self.state.batch_size

    @property
    def dtype(self) -> str:
        return self.state.dtype

    @property
    def policy(self):
        return self.state.policy

    @property
    def layers(self) -> tuple[kvlib.LayerKV, ...]:
        return self.state.layers

    @property
    def nbytes(self) -> int:
        """Bytes of what the rows hold (module docstring): `to_bytes()`'s arrays."""
        return sum(a.nbytes for _, a in _arrays(self.state))

    def check(self, params, batch: int, kv_dtype: str | None) -> kvlib.KVState:
        """Its state, once it is known to fit `params` and `batch` rows (ValueError otherwise)."""
        check_shape(self.state, params.config, batch, kv_dtype)
        if self.weights != params.version:
            raise ValueError(
                f"kv_state was computed by other weights (fingerprint {self.weights[:16]}...); "
                f"these params are {params.version[:16]}..."
            )
        return self.state

    def pool_slots(self) -> tuple[np.ndarray, dict[str, np.ndarray]]:
        """Its one row as the engine's pool takes it (`jkv.engine.runner.write_context`): the
        slots each head holds `[L * K]` int32 (head h = layer * K + kv head), and the per-slot
        arrays by the pool's names, `k`, `v` `[L * K, S, H]`, `positions` and fp8 scales
        `[L * K, S]`, S the most any head holds as a power of two (few compiled shapes).
        Made once per context (every request that continues it takes the same arrays)."""
        return self._pool_slots

    @functools.cached_property
    def _pool_slots(self) -> tuple[np.ndarray, dict[str, np.ndarray]]:
        layers = self.state.layers
        counts = np.concatenate([np.asarray(layer.lengths)[0] for layer in layers])
        s = kvlib.bucket(max(1, int(counts.max())))  # what the heads hold, not the capacity
        scaled = layers[0].k_scale is not None
        names = ["k", "v", "positions"] + (["k_scale", "v_scale"] if scaled else [])
        slots = {}
        for name in names:
            parts = [np.asarray(getattr(layer, name))[0] for layer in layers]  # [K, S_l, ...]
            out = np.zeros((len(counts), s, *parts[0].shape[2:]), parts[0].dtype)
            at = 0
            for part in parts:
                n = min(s, part.shape[1])  # a layer's capacity may be smaller (PyramidKV)
                out[at : at + part.shape[0], :n] = part[:, :n]
                at += part.shape[0]
            slots[name] = out
        return counts.astype(np.int32), slots

    def to_bytes(self) -> bytes:
        """The context as bytes: a msgpack header, then each held array's raw bytes."""
        arrays = list(_arrays(self.state))
        state = self.state
        header = {
            "schema": SCHEMA,
            "weights": self.weights,
            "tokens": [list(t) for t in self.tokens],
            "dtype": state.dtype,
            "policy": None if state.policy is None else state.policy.describe(),
            "shape": _model_shape(state),
            "capacities": [layer.capacity for layer in state.layers],
            "scores": state.layers[0].scores is not None,
            "bias": state.layers[0].bias is not None,
            "lowrank": state.layers[0].lowrank is not None,
            "arrays": [[name, str(a.dtype), list(a.shape)] for name, a in arrays],
        }
        head = msgpack.packb(header, use_bin_type=True)
        parts = [MAGIC, len(head).to_bytes(8, "little"), head]
        parts += [np.ascontiguousarray(a).tobytes() for _, a in arrays]
        return b"".join(parts)

    @classmethod
    def from_bytes(cls, data: bytes) -> KVContext:
        """The context `to_bytes()` wrote (ValueError: not one, another schema, cut short)."""
        data = memoryview(bytes(data))
        if bytes(data[: len(MAGIC)]) != MAGIC:
            raise ValueError("data is not a jkv KV context (KVContext.to_bytes): no JKVCTX magic")
        at = len(MAGIC) + 8
        n = int.from_bytes(data[len(MAGIC) : at], "little")
        if at + n > len(data):
            raise ValueError(
                f"KV context data cut short: a {n}-byte header, {len(data)} bytes in all"
            )
        header = msgpack.unpackb(data[at : at + n], raw=False)
        at += n
        if header.get("schema") != SCHEMA:
            raise ValueError(
                f"KV context schema {header.get('schema')!r}; this jkv reads schema {SCHEMA}"
            )
        arrays = {}
        for name, dtype, shape in header["arrays"]:
            dt = jnp.dtype(dtype)
            size = int(np.prod(shape, dtype=np.int64)) * dt.itemsize
            if at + size > len(data):
                raise ValueError(
                    f"KV context data cut short at array {name!r}: {len(data)} bytes, "
                    f"{at + size} needed"
                )
            arrays[name] = np.frombuffer(data[at : at + size], dt).reshape(shape)
            at += size
        if at != len(data):
            raise ValueError(f"KV context data has {len(data) - at} bytes past its last array")
        state = _state(header, arrays)
        tokens = tuple(tuple(int(x) for x in t) for t in header["tokens"])
        return cls(state=state, tokens=tokens, weights=header["weights"])


def check_shape(state: kvlib.KVState, cfg, batch: int, kv_dtype: str | None) -> None:
    """ValueError unless `state` has `batch` rows, the model's shape and `kv_dtype` (if given)."""
    if state.batch_size != batch:
        raise ValueError(f"kv_state holds {state.batch_size} rows but {batch} prompts were given")
    got = tuple(_model_shape(state))
    want = (cfg.num_layers, cfg.num_kv_heads, cfg.head_dim)
    if got != want:
        raise ValueError(
            "kv_state was made by another model: it holds (layers, kv heads, head dim) = "
            f"{got}; these params expect {want}"
        )
    if kv_dtype is not None and kv_dtype != state.dtype:
        raise ValueError(f"kv_dtype={kv_dtype!r} differs from the kv_state's {state.dtype!r}")


def _model_shape(state: kvlib.KVState) -> list[int]:
    k = state.layers[0].k
    return [len(state.layers), k.shape[1], k.shape[3]]


def _arrays(state: kvlib.KVState):
    """(name, numpy array) of everything the rows hold: per-slot arrays cut to each (row, kv
    head)'s valid slots (row-major over row, head, slot), counters and low-rank segments whole."""
    yield "next_position", np.asarray(state.next_position)
    yield "limit", np.asarray(state.limit)
    for i, layer in enumerate(state.layers):
        lengths = np.asarray(layer.lengths)
        held = np.arange(layer.capacity) < lengths[..., None]  # [B, K, S]
        yield f"{i}.lengths", lengths
        for name in SLOT_FIELDS:
            a = getattr(layer, name)
            if a is not None:
                yield f"{i}.{name}", np.asarray(a)[held]
        if layer.lowrank is not None:
            for f in dataclasses.fields(layer.lowrank):
                yield f"{i}.lowrank.{f.name}", np.asarray(getattr(layer.lowrank, f.name))


def _state(header: dict, arrays: dict) -> kvlib.KVState:
    b = arrays["next_position"].shape[0]
    num_layers, num_kv_heads, head_dim = header["shape"]
    layers = []
    for i, s in enumerate(header["capacities"]):
        lengths = arrays[f"{i}.lengths"]
        held = np.arange(s) < lengths[..., None]
        parts = {"lengths": jnp.asarray(lengths)}
        for name, empty in SLOT_FIELDS.items():
            got = arrays.get(f"{i}.{name}")
            if got is None:
                continue
            full = np.full((b, num_kv_heads, s, *got.shape[1:]), empty, got.dtype)
            full[held] = got
            parts[name] = jnp.asarray(full)
        if header["lowrank"]:
            names = [f.name for f in dataclasses.fields(kvlib.LowRank)]
            parts["lowrank"] = kvlib.LowRank(
                **{n: jnp.asarray(arrays[f"{i}.lowrank.{n}"]) for n in names}
            )
        layers.append(kvlib.LayerKV(**parts))
    if len(layers) != num_layers or layers[0].k.shape[3] != head_dim:
        raise ValueError(f"KV context header's shape {header['shape']} differs from its arrays")
    return kvlib.KVState(
        layers=tuple(layers),
        next_position=jnp.asarray(arrays["next_position"]),
        limit=jnp.asarray(arrays["limit"]),
        dtype=header["dtype"],
        policy=_policy(header["policy"]),
    )


def _policy(described: dict | None):
    """The policy `KVPolicy.describe()` wrote (lists back to the tuples its fields hold)."""
    if described is None:
        return None
    fields = dict(described)
    name = fields.pop("name")
    cls = policies.POLICIES.get(name)
    if cls is None:
        raise ValueError(
            f"KV context made with kv_policy {name!r}, unknown here; known: {sorted(policies.POLICIES)}"
        )
    names = {f.name for f in dataclasses.fields(cls)}
    if set(fields) != names:
        raise ValueError(
            f"KV context's kv_policy {name!r} has fields {sorted(fields)}; this jkv's has "
            f"{sorted(names)}"
        )
    # The state's policy is `KVPolicy.jit_key()` (its budget None, validated when it was made),
    # rebuilt the way jit_key copies it: without __post_init__'s check of a budget.
    tuples = lambda x: tuple(tuples(y) for y in x) if isinstance(x, list) else x  # noqa: E731
    policy = object.__new__(cls)
    for k, v in fields.items():
        object.__setattr__(policy, k, tuples(v))
    return policy
