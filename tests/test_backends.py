"""The attention backends agree: Pallas kernels (interpreted) vs the XLA path, fp8 KV storage."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

import jkv
from jkv.scoring import score

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.parametrize("kind", ["llama", "mistral"])  # mistral: the sliding-window path
@pytest.mark.parametrize("kv_dtype", ["float32", "bfloat16", "float8_e4m3fn"])
def test_pallas_interpret_matches_xla(tiny_params, kind, kv_dtype):
    params = tiny_params(kind)
    rng = np.random.default_rng(11)
    prompts = [rng.integers(3, params.config.vocab_size, size=n).tolist() for n in (7, 20)]
    xla = jkv.generate(params, prompts, max_new_tokens=8, kv_dtype=kv_dtype, backend="xla")
    pallas = jkv.generate(
        params, prompts, max_new_tokens=8, kv_dtype=kv_dtype, backend="pallas_interpret"
    )
    for a, b in zip(xla, pallas, strict=True):
        assert a.tokens == b.tokens
        assert a.kv_bytes == b.kv_bytes


def test_fp8_kv_bytes_at_head_dim_128(tiny_params):
    params = tiny_params("llama", hidden_size=256, num_heads=2, num_kv_heads=1)
    assert params.config.head_dim == 128
    prompt = list(range(3, 40))
    bf16 = jkv.generate(params, prompt, max_new_tokens=4, kv_dtype="bfloat16")
    fp8 = jkv.generate(params, prompt, max_new_tokens=4, kv_dtype="float8_e4m3fn")
    ratio = fp8.kv_bytes / bf16.kv_bytes
    print(f"fp8 / bf16 KV bytes at H=128 (scales counted): {ratio:.4f}")
    assert ratio <= 0.51
    f32 = jkv.generate(params, prompt, max_new_tokens=4, kv_dtype="float32")
    assert bf16.kv_bytes * 2 == f32.kv_bytes


# Teacher-forced log-probabilities of a continuation over a compressed-storage context, against
# the float32 cache: the largest difference seen on this model is 0.01 (bf16) and 0.16 (fp8).
BOUNDS = {"bfloat16": 0.03, "float8_e4m3fn": 0.25}


@pytest.mark.parametrize("kv_dtype", sorted(BOUNDS))
def test_compressed_storage_stays_within_a_stated_bound(tiny_params, kv_dtype):
    params = tiny_params("llama")
    rng = np.random.default_rng(5)
    context = rng.integers(3, params.config.vocab_size, size=60).tolist()
    text = rng.integers(3, params.config.vocab_size, size=40).tolist()
    want = score(params, text, kv_state=jkv.prefill(params, context, kv_dtype="float32"))
    got = score(params, text, kv_state=jkv.prefill(params, context, kv_dtype=kv_dtype))
    err = float(np.abs(got - want).max())
    full = jkv.generate(params, context, max_new_tokens=32, kv_dtype="float32")
    low = jkv.generate(params, context, max_new_tokens=32, kv_dtype=kv_dtype)
    same = next(
        (i for i, (a, b) in enumerate(zip(full.tokens, low.tokens, strict=False)) if a != b), 32
    )
    print(
        f"{kv_dtype}: max |log p - log p(float32)| = {err:.4f}; greedy tokens identical for "
        f"the first {same} of 32"
    )
    assert err <= BOUNDS[kv_dtype]


# gpu_check.sh's checks whose options cover every check function and kernel option (the other
# ten repeat these functions with fewer options; the kernel tests run every variant anyway)
GPU_CHECKS = ["decode_fp8_native_rope_window_mass", "decode_fp8_bias_lse", "decode_bf16_mass",
              "lowrank", "segment_merge", "quantize", "compact", "window_scores_max",
              "prefill_fp8_rope_window", "prefill_mass_bf16_keep", "paged_decode_fp8",
              "ragged_paged_fp8_window", "paged_votes_fp8"]  # fmt: skip


def test_gpu_check_cpu_mode(tmp_path):
    """The GPU check script runs (interpret mode) and passes: a GPU session is not spent on it."""
    env = {**os.environ, "PYTHON": sys.executable}
    cmd = ["bash", str(ROOT / "benchmarks" / "gpu_check.sh"), "--cpu", "--out", str(tmp_path)]
    proc = subprocess.run(cmd + ["--checks", *GPU_CHECKS], capture_output=True, text=True,
                          env=env, timeout=600, cwd=ROOT)  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    checks = json.loads((tmp_path / "gpu_check_cpu.json").read_text())["checks"]
    names = {c["name"] for c in checks}
    assert {"prefill_fp8_rope_window", "prefill_mass_bf16_keep", "paged_decode_fp8"} <= names
    assert {"quantize", "quantize_append", "paged_decode_bf16_mass"} <= names
    assert {"ragged_paged_fp8_window", "paged_votes_fp8"} <= names
    assert all(c["ok"] for c in checks) and len(checks) == 16, sorted(names)


@pytest.mark.parametrize("kind", ["llama", "mistral"])
@pytest.mark.parametrize("kv_dtype", ["float32", "bfloat16", "float8_e4m3fn"])
def test_generation_steps_lower_for_cuda(tiny_params, kind, kv_dtype):
    """prefill and the decode loop with backend="pallas" lower for CUDA here, without a GPU:
    the kernels in exactly the configurations generation calls them."""
    import importlib

    import jax.numpy as jnp

    from jkv import kv as kvlib

    pre = importlib.import_module("jkv.prefill")
    params = tiny_params(kind)
    cfg = params.config
    state = kvlib.init_state(
        num_layers=cfg.num_layers,
        batch=2,
        num_kv_heads=cfg.num_kv_heads,
        head_dim=cfg.head_dim,
        capacity=48,
        dtype=kv_dtype,
    )
    tokens = jnp.zeros((2, 16), jnp.int32)
    n_new = jnp.array([16, 9], jnp.int32)
    prefill = pre.prefill_step.trace(params.weights, cfg, tokens, n_new, state, backend="pallas")
    text = prefill.lower(lowering_platforms=("cuda",)).as_text()
    # every layer's prefill attention is the flash kernel; fp8 appends go through theirs
    assert text.count("jkv_prefill_attention") >= cfg.num_layers
    assert ("jkv_quantize_append" in text) == (kv_dtype == "float8_e4m3fn")
    text = _decode_for_cuda(params, cfg, state)
    assert text.count("jkv_decode_attention") >= cfg.num_layers


@pytest.mark.parametrize("kv_dtype", ["bfloat16", "float8_e4m3fn"])
def test_segment_rebuild_steps_lower_for_cuda(tiny_params, kv_dtype):
    """The SnapKV segment rebuild (segment_merge kernel + SVD) and a decode loop over its state
    (decode_attention with slot biases and lse, joined to lowrank_attention) lower for CUDA."""

    import jax
    import jax.numpy as jnp

    from jkv import kv as kvlib
    from jkv.policies import SnapKVSegments
    from jkv.policies.compress import compress

    params = tiny_params("llama")
    cfg = params.config
    policy = SnapKVSegments(budget=16, window=4, segment_len=16)
    state = kvlib.init_state(
        num_layers=cfg.num_layers,
        batch=2,
        num_kv_heads=cfg.num_kv_heads,
        head_dim=cfg.head_dim,
        capacity=32,
        dtype=kv_dtype,
        scores=True,
    )
    caps = policy.capacities(cfg.num_layers, [30, 20], 8)
    tokens, n_new = jnp.zeros((2, 32), jnp.int32), jnp.array([30, 20], jnp.int32)
    budgets = jnp.asarray(policy.row_budgets([30, 20]))
    kw = dict(policy=policy.jit_key(), capacities=caps, backend="pallas")
    rebuild = compress.trace(params.weights, cfg, state, tokens, n_new, budgets, **kw)
    text = rebuild.lower(lowering_platforms=("cuda",)).as_text()
    assert text.count("jkv_segment_merge") == cfg.num_layers
    shapes = jax.eval_shape(
        lambda s: compress(params.weights, cfg, s, tokens, n_new, budgets, **kw), state
    )
    kv = jax.tree.map(lambda x: jnp.zeros(x.shape, x.dtype), shapes)
    assert kv.policy == policy.jit_key() and kv.layers[0].lowrank is not None
    text = _decode_for_cuda(params, cfg, kv)
    assert text.count("jkv_decode_attention") >= cfg.num_layers
    assert text.count("jkv_lowrank_attention") >= cfg.num_layers


def _decode_for_cuda(params, cfg, kv):
    """The decode loop over KV state `kv` (batch 2), lowered for CUDA with the Pallas backend."""
    import jax.numpy as jnp

    from jkv.core.sampling import Sampling, SamplingArrays
    from jkv.decode import DecodeState, decode

    loop_state = DecodeState(
        kv=kv,
        tokens=jnp.zeros((2, 16), jnp.int32),
        count=jnp.ones((2,), jnp.int32),
        max_new=jnp.full((2,), 8, jnp.int32),
        done=jnp.zeros((2,), bool),
        last=jnp.zeros((2,), jnp.int32),
        sampling=SamplingArrays.build([Sampling(temperature=0.7, top_p=0.9)] * 2, [0, 1]),
        step=jnp.zeros((), jnp.int32),
    )
    traced = decode.trace(
        params.weights,
        cfg,
        loop_state,
        jnp.int32(4),
        eos_ids=(),
        backend="pallas",
    )
    return traced.lower(lowering_platforms=("cuda",)).as_text()
