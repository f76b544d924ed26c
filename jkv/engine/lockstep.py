"""A step's device work as data: what a multi-process group's followers run (`jkv.serve.group`).

Every program the engine runs on its pool goes through `run` (and every read of a device value
back to the host through `read`). Alone, that is the call itself. In a group, the leader's
engine first hands the call to its link, which sends it to every follower as a frame: the
function by name, its arguments with each device array replaced by a `Ref` (the model's
weights, the pool, the last sampled tokens, or an output of an earlier call of the same step),
host values (page-table rows, token ids, sampling settings) as they are. A follower runs the
frames in order on its own shard of the same arrays (`Replayer`) and never schedules: it has no
plan of its own to differ from the leader's (nano-vllm's and tpu-inference's way: one
scheduler, every process runs its batch). A read is a frame too, because reading a sharded
array gathers it from every process (a collective all of them must enter).
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass

import jax

from jkv.engine import programs
from jkv.sharding import to_host


@dataclass(frozen=True)
class Ref:
    """A device array in a frame: leaf `leaf` of a persistent value ("weights", "pool",
    "last") or of the output of the step's call number `of`."""

    of: str | int
    leaf: int


class _Mesh:
    """The engine's mesh in a frame (each process has its own `Mesh` object)."""


def run(link, fn, *args, **kwargs):
    """`fn(*args, **kwargs)` on the device (through its kept program, `programs.call`, when it
    is jitted); with a group's leader as `link`, first sent to the followers."""
    if link is not None:
        link.call(fn, args, kwargs)
    out = _call(fn, args, kwargs)
    if link is not None:
        link.made(out)
    return out


def read(link, x):
    """`x`'s value on the host (`jkv.sharding.to_host`); with a group's leader as `link`,
    every follower reads it too (a sharded array is gathered by all processes)."""
    if link is not None:
        link.read(x)
    return to_host(x)


def _call(fn, args, kwargs):
    if hasattr(fn, "lower"):  # jitted
        return programs.call(fn, *args, **kwargs)
    return fn(*args, **kwargs)


def persistent(engine) -> dict:
    """The device values that outlive a step: the model's weights, the pool, the last tokens."""
    return {"weights": engine.params.weights, "pool": engine.device, "last": engine._last_tok}


def signature(engine) -> str:
    """What must be equal in every process of a group for the leader's calls to run on each:
    the shapes and dtypes of the weights and the pool, and the engine's kv dtype and backend."""
    shapes = jax.tree.map(lambda x: (tuple(x.shape), str(x.dtype)), persistent(engine))
    return repr((shapes, engine.kv_dtype, engine.backend, engine.pool.page_size))


class Recorder:
    """The leader's side: turns the step's calls into frames."""

    def __init__(self):
        self._refs: dict[int, Ref] = {}
        self._held: list = []  # the step's outputs, alive so that no id is reused in the step
        self._mesh = None

    def begin(self, engine) -> None:
        """A step starts: its refs are the persistent values'."""
        self._refs, self._held, self._mesh = {}, [], engine.mesh
        for name, tree in persistent(engine).items():
            for i, leaf in enumerate(jax.tree.leaves(tree)):
                self._refs[id(leaf)] = Ref(name, i)

    def call(self, fn, args, kwargs) -> tuple:
        name = f"{fn.__module__}:{fn.__qualname__}"
        return ("call", name, self.encode((args, kwargs)))

    def made(self, out) -> None:
        k = len(self._held)
        self._held.append(out)
        for i, leaf in enumerate(jax.tree.leaves(out)):
            self._refs[id(leaf)] = Ref(k, i)

    def end(self, engine) -> tuple:
        """The step's last frame: which of its arrays are the pool and the last tokens now."""
        kept = {k: v for k, v in persistent(engine).items() if k != "weights"}
        frame = ("end", self.encode(kept))
        self._refs, self._held = {}, []
        return frame

    def encode(self, tree):
        def one(x):
            if isinstance(x, jax.Array):
                ref = self._refs.get(id(x))
                if ref is not None:
                    return ref
                if x.is_fully_addressable:  # made on this host: its value
                    return to_host(x)
                raise ValueError(
                    f"a device array of shape {x.shape} spans the group's processes but came "
                    "from no call of this step (pass device values through jkv.engine.lockstep.run)"
                )
            if self._mesh is not None and x is self._mesh:
                return _Mesh()
            return x

        return jax.tree.map(one, tree)


class Replayer:
    """A follower's side: runs the leader's frames on this process's engine's arrays."""

    def __init__(self, engine):
        self.engine = engine
        self._leaves: dict = {}
        self._made = 0

    def begin(self) -> None:
        self._leaves = {k: jax.tree.leaves(v) for k, v in persistent(self.engine).items()}
        self._made = 0

    def call(self, name: str, encoded) -> None:
        module, _, qualname = name.partition(":")
        fn = importlib.import_module(module)
        for part in qualname.split("."):
            fn = getattr(fn, part)
        args, kwargs = self.decode(encoded)
        self._leaves[self._made] = jax.tree.leaves(_call(fn, args, kwargs))
        self._made += 1

    def read(self, encoded) -> None:
        to_host(self.decode(encoded))

    def end(self, encoded) -> None:
        kept = self.decode(encoded)
        self.engine.device, self.engine._last_tok = kept["pool"], kept["last"]
        self._leaves = {}

    def decode(self, tree):
        def one(x):
            if isinstance(x, Ref):
                return self._leaves[x.of][x.leaf]
            if isinstance(x, _Mesh):
                return self.engine.mesh
            return x

        return jax.tree.map(one, tree, is_leaf=lambda x: isinstance(x, Ref | _Mesh))
