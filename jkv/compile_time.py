"""Seconds this thread spent compiling (tracing, lowering, XLA), from JAX's monitoring events.

`result.stats["compile_s"]` comes from here, so `prefill_s`, `decode_s` and
`decode_tokens_per_s` measure running, not compiling; `compile_cache_hits` counts programs read
from JAX's persistent compilation cache instead of compiled (the CLI turns that cache on).
"""

from __future__ import annotations

import os
import threading
from pathlib import Path

import jax

DURATIONS = (
    "/jax/core/compile/jaxpr_trace_duration",
    "/jax/core/compile/jaxpr_to_mlir_module_duration",
    "/jax/core/compile/backend_compile_duration",
)
CACHE_HIT = "/jax/compilation_cache/cache_hits"

BACKEND_COMPILE = "/jax/core/compile/backend_compile_duration"

_local = threading.local()
_install_lock = threading.Lock()
_installed = False
_programs = [0]  # programs built in this process (any thread): compiled or read from the cache


def _on_duration(event: str, duration: float, **_) -> None:
    if event in DURATIONS:
        _local.seconds = getattr(_local, "seconds", 0.0) + duration
    if event == BACKEND_COMPILE:
        _programs[0] += 1


def _on_event(event: str, **_) -> None:
    if event == CACHE_HIT:
        _local.hits = getattr(_local, "hits", 0) + 1
        _programs[0] += 1


def _install() -> None:
    global _installed
    with _install_lock:
        if not _installed:
            jax.monitoring.register_event_duration_secs_listener(_on_duration)
            jax.monitoring.register_event_listener(_on_event)
            _installed = True


def totals() -> tuple[float, int]:
    """(seconds compiling, persistent-cache hits) of this thread so far."""
    _install()
    return getattr(_local, "seconds", 0.0), getattr(_local, "hits", 0)


def programs_built() -> int:
    """Programs this process built so far, in any thread: compiled by XLA or read from the
    persistent compilation cache (what a test counts to see that nothing compiles)."""
    _install()
    return _programs[0]


def compile_cache_dir() -> Path | None:
    """Where the CLI keeps compiled programs: $JKV_COMPILE_CACHE (0: nowhere), else the user's
    cache dir."""
    if os.environ.get("JKV_COMPILE_CACHE") == "0":
        return None
    if os.environ.get("JKV_COMPILE_CACHE"):
        return Path(os.environ["JKV_COMPILE_CACHE"])
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base) / "jkv" / "xla"


def use_compile_cache() -> None:
    """JAX's persistent compilation cache: a second `jkv generate` reads its programs."""
    folder = compile_cache_dir()
    if folder is None:
        return
    jax.config.update("jax_compilation_cache_dir", str(folder))
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)
