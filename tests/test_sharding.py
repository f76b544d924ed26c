"""Sharded generation on 4 forced CPU devices equals unsharded generation."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

SCRIPT = textwrap.dedent(
    """
    import sys
    import jax
    import numpy as np
    from jax.sharding import Mesh

    import jkv
    from jkv.sharding import shard_kv

    assert len(jax.devices()) == 4, jax.devices()
    folder = sys.argv[1]
    mesh = Mesh(np.array(jax.devices()).reshape(2, 2), ("data", "model"))
    plain = jkv.load(folder)
    sharded = jkv.load(folder, mesh=mesh)
    q = sharded.weights["layers"]["self_attn"]["q_proj"]["kernel"]  # [L, D, N, H]
    assert q.sharding.spec == jax.sharding.PartitionSpec(None, None, "model", None), q.sharding
    assert len(q.addressable_shards) == 4
    prompts = [[5, 9, 11, 3, 7], [4, 8, 15, 16, 23, 42, 7, 9, 10]]
    a = jkv.generate(plain, prompts, max_new_tokens=16)
    b = jkv.generate(sharded, prompts, max_new_tokens=16)
    for x, y in zip(a, b):
        assert x.tokens == y.tokens, (x.tokens, y.tokens)
    # A compressed context continued on the mesh: the state keeps its policy and budgets.
    for policy in (jkv.SnapKV(budget=0.5, window=4), jkv.H2O(budget=6, recent=2)):
        states = [jkv.prefill(p, prompts, kv_policy=policy) for p in (plain, sharded)]
        assert states[1].policy == states[0].policy == policy.jit_key(), states[1].policy
        placed = shard_kv(states[0].state, mesh)
        assert placed.policy == states[0].policy and placed.dtype == states[0].dtype
        np.testing.assert_array_equal(placed.limit, states[0].state.limit)
        a = jkv.generate(plain, [[3, 4], [5, 6, 7]], kv_state=states[0], max_new_tokens=8)
        b = jkv.generate(sharded, [[3, 4], [5, 6, 7]], kv_state=states[1], max_new_tokens=8)
        for x, y in zip(a, b):
            assert x.tokens == y.tokens, (policy, x.tokens, y.tokens)
    ids = np.array([[3, 4, 5, 6, 7, 8]] * 2)
    np.testing.assert_allclose(jkv.logits(plain, ids), jkv.logits(sharded, ids), atol=1e-5)
    print("SHARDED-OK")
    """
)


def test_sharded_generation_equals_unsharded(hf_checkpoint, tmp_path):
    folder = hf_checkpoint("llama")
    script = tmp_path / "sharded.py"
    script.write_text(SCRIPT)
    env = {
        **os.environ,
        "XLA_FLAGS": os.environ["XLA_FLAGS"] + " --xla_force_host_platform_device_count=4",
        "JAX_PLATFORMS": "cpu",
        "PYTHONPATH": str(Path(__file__).resolve().parents[1]),
    }
    proc = subprocess.run(
        [sys.executable, str(script), str(folder)],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "SHARDED-OK" in proc.stdout


def test_rules_replicate_what_the_mesh_does_not_divide():
    import jax
    import numpy as np
    from jax.sharding import Mesh, PartitionSpec

    from jkv import sharding

    mesh = Mesh(np.array(jax.devices()[:1]).reshape(1, 1), ("data", "model"))
    assert sharding.spec(("embed", "kv_heads", "head_dim"), (8, 2, 4), mesh) == PartitionSpec(
        None, "model", None
    )
    fake = type("M", (), {"shape": {"data": 2, "model": 4}})()
    # 2 kv heads on a 4-way model axis: replicated; 8 heads: split.
    assert sharding.spec(("kv_heads",), (2,), fake) == PartitionSpec(None)
    assert sharding.spec(("heads",), (8,), fake) == PartitionSpec("model")
    assert sharding.param_axes(("layers_3", "mlp", "down_proj", "kernel")) == ("mlp", "embed")
