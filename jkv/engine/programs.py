"""The engine's compiled programs, by signature, kept in this process and (with the persistent
compilation cache on, as `jkv serve` has it) on disk as serialized executables.

JAX's own persistent cache saves XLA's work but not tracing and lowering, which every program
still pays on each start (about 0.3 s for a 30-layer flattened step); a warm `jkv serve
--warmup` spent most of its time there. Here `compile` keeps the `Compiled` program itself, and
a restart loads it back in milliseconds (`jax.experimental.serialize_executable`), so nothing is
traced again. `call` runs the program of a call's signature when there is one, else the jitted
function as usual (it compiles on first use, as without this module).

A program on disk is keyed by everything it was built from: the function, its static values
(the model's config, the policy...), every argument's shape, dtype and tree, the JAX and XLA
versions and flags, the device, this host's CPU features and the source of jkv itself. Engines
over a mesh do not use it (their programs are sharded; jit keeps them).
"""

from __future__ import annotations

import functools
import hashlib
import inspect
import logging
import os
import pickle
import threading
from pathlib import Path

import jax
import jaxlib
import numpy as np
from jax._src import config as jax_config  # its cache switch as a per-thread context

import jkv_kernels
import jkv_models

_table: dict[tuple, object] = {}
_static: dict[object, tuple[str, ...]] = {}  # jitted function -> its static parameters
_lock = threading.Lock()
_folder: list[Path | None] = [None]


def store_in(folder: Path | None) -> None:
    """Where programs are saved and read back (None: kept in this process only)."""
    _folder[0] = folder


@functools.cache
def _statics(fn) -> tuple[str, ...]:
    """Names of `fn`'s parameters, in order, and which are static (a jitted function)."""
    return tuple(inspect.signature(fn).parameters)


def _split(fn, args, kwargs):
    """(dynamic arguments in order, static ones by name) of a call of jitted `fn`."""
    names = _statics(fn)
    static = set(_static.get(fn, ()))
    bound = dict(zip(names, args, strict=False)) | kwargs
    dynamic = tuple(bound[n] for n in names if n in bound and n not in static)
    return dynamic, {n: bound[n] for n in names if n in static and n in bound}


def _aval(x):
    if isinstance(x, jax.ShapeDtypeStruct | jax.Array | np.ndarray | np.generic):
        return (tuple(x.shape), str(x.dtype))
    return (type(x).__name__,)  # a Python scalar: traced, weakly typed


def _key(fn, dynamic, static) -> tuple:
    leaves, tree = jax.tree.flatten(dynamic)
    return (fn.__name__, tuple(sorted((n, repr(v)) for n, v in static.items())), str(tree),
            tuple(_aval(x) for x in leaves))  # fmt: skip


@functools.cache
def _salt() -> str:
    """What a saved program also depends on: versions, flags, device, CPU, jkv's source."""
    h = hashlib.sha256()
    dev = jax.devices()[0]
    for part in (jax.__version__, jaxlib.__version__, dev.platform, dev.device_kind,
                 dev.client.platform_version, os.environ.get("XLA_FLAGS", "")):  # fmt: skip
        h.update(f"{part}|".encode())
    try:
        flags = [line for line in Path("/proc/cpuinfo").read_text().splitlines()
                 if line.startswith("flags")][:1]  # fmt: skip
        h.update(repr(flags).encode())
    except OSError:
        pass
    jkv_root = Path(__file__).resolve().parents[1]
    for root in (jkv_root, *(Path(p.__file__).parent for p in (jkv_models, jkv_kernels))):
        for path in sorted(root.rglob("*.py")):
            h.update(path.relative_to(root).as_posix().encode() + path.read_bytes())
    return h.hexdigest()[:24]


def _path(key) -> Path | None:
    folder = _folder[0]
    if folder is None:
        return None
    digest = hashlib.sha256(f"{_salt()}|{key!r}".encode()).hexdigest()[:40]
    return folder / f"{key[0]}-{digest}.bin"


def compile(fn, *args, **kwargs) -> None:  # noqa: A001 - what it does
    """Builds the program of `fn(*args, **kwargs)` (arguments may be `ShapeDtypeStruct`s) and
    keeps it: read back from disk when saved before, else compiled (and saved)."""
    from jax.experimental.serialize_executable import deserialize_and_load, serialize

    dynamic, static = _split(fn, args, kwargs)
    key = _key(fn, dynamic, static)
    if key in _table:
        return
    path = _path(key)
    compiled = None
    if path is not None and path.is_file():
        try:
            compiled = deserialize_and_load(*pickle.loads(path.read_bytes()))
        except Exception as err:  # noqa: BLE001 - a stale or torn file: compiled again
            logging.getLogger("jkv.engine").warning("program %s not loaded (%s)", path, err)
    if compiled is None:
        if path is None:
            compiled = fn.lower(*args, **kwargs).compile()
        else:  # compiled here, not read from JAX's own cache: see `_fresh`
            with _fresh():
                compiled = fn.lower(*args, **kwargs).compile()
            path.parent.mkdir(parents=True, exist_ok=True)
            tmp = path.with_suffix(f".{os.getpid()}.tmp")
            tmp.write_bytes(pickle.dumps(serialize(compiled)))
            tmp.replace(path)  # whole or not at all
    with _lock:
        _table[key] = compiled


def _fresh():
    """JAX's persistent compilation cache off in this thread while a program to be saved is
    built: an XLA:CPU executable JAX read back from its cache serializes without some of its
    functions ("NOT_FOUND: Function wrapped_iota not found" when the saved program runs, in
    every process that loads it; jax 0.10.2), so a saved program is always XLA's own output."""
    return jax_config.enable_compilation_cache(False)


def call(fn, *args, **kwargs):
    """`fn(*args, **kwargs)` through the kept program of its signature, if there is one."""
    if not _table or kwargs.get("mesh") is not None:
        return fn(*args, **kwargs)
    dynamic, static = _split(fn, args, kwargs)
    compiled = _table.get(_key(fn, dynamic, static))
    return fn(*args, **kwargs) if compiled is None else compiled(*dynamic)


def jit(fn=None, *, static_argnames=(), donate_argnames=()):
    """`jax.jit`, remembering the static parameters for `call` and `compile`."""
    if fn is None:
        return functools.partial(jit, static_argnames=static_argnames,
                                 donate_argnames=donate_argnames)  # fmt: skip
    jitted = jax.jit(fn, static_argnames=static_argnames, donate_argnames=donate_argnames)
    _static[jitted] = tuple(static_argnames)
    return jitted
