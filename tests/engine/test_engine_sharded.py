"""`jkv.Engine` over a mesh on 4 forced CPU devices: the pool sharded over kv heads on the
"model" axis (each device holding its 1 / tp of the pages), the greedy tokens of one device for
a mixed workload arriving at random steps, at tp 1, 2 and 4 on a model with 2 kv heads (tp 4
repeats each kv head twice), and clear errors for a "model" axis that cannot split the heads.

One subprocess for every case (the devices are forced before JAX starts); compiles dominate,
so the shapes are tiny and the suite runs the full cache in float32 only (about 3.5 minutes on
2 cores). JKV_SHARDED_ALL=1 runs every policy the engine serves (SnapKV, StreamingLLM,
Quantile, PyramidKV in float32; H2O, Ada-KV, EffiCache and the full cache in fp8) at tp 1, 2
and 4 (about 10 minutes more)."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

SCRIPT = textwrap.dedent(
    """
    import os
    import random
    import sys
    import time

    import jax
    import numpy as np
    from jax.sharding import Mesh

    import jkv
    from jkv.engine.engine import Engine
    from jkv.policies import H2O, AdaKV, EffiCache, PyramidKV, Quantile, SnapKV, StreamingLLM
    from jkv.sharding import repeat_kv_heads

    T0 = time.perf_counter()
    assert len(jax.devices()) == 4, jax.devices()
    folder = sys.argv[1]
    plain = jkv.load(folder)
    assert plain.config.num_kv_heads == 2 and plain.config.num_heads == 4
    # kv dtype -> the requests' policies in arrival order, and the tps they run at. By
    # default the full cache (what fits the suite's time); JKV_SHARDED_ALL=1: every policy the
    # engine serves, in float32 and fp8, at every tp (about 10 minutes more on 2 cores).
    RUNS = {"float32": ([None, None, None], (1, 2, 4))}
    if os.environ.get("JKV_SHARDED_ALL") == "1":
        snapkv = SnapKV(budget=8, window=4, kernel=3, pool="max")
        RUNS = {
            "float32": ([None, snapkv, StreamingLLM(budget=10, sink=2), None,
                         Quantile(q=0.6, window=4), PyramidKV(budget=0.4, window=4)], (1, 2, 4)),
            "float8_e4m3fn": ([H2O(budget=10, recent=3), None, AdaKV(budget=0.4, window=4),
                               EffiCache(budget=0.4, window=4, short_window=2)], (1, 2, 4)),
        }


    def mesh(tp):
        return Mesh(np.array(jax.devices()[:tp]).reshape(1, tp), ("data", "model"))


    def serve(params, kv_dtype, mesh=None):
        # Arrivals at random steps: the same steps for every engine (the host is deterministic).
        policies = RUNS[kv_dtype][0]
        rng = random.Random(7)
        engine = Engine(params, num_pages=64, page_size=16, token_budget=8, chunk=8,
                        max_running=2, kv_dtype=kv_dtype, attention_mass=True, mesh=mesh)
        prompts = [[rng.randrange(3, params.config.vocab_size) for _ in range(rng.randint(9, 14))]
                   for _ in policies]
        pending, got = list(range(len(policies))), {}
        while pending or engine.has_work:
            for _ in range(rng.randint(0, 2)):
                if pending:
                    i = pending.pop(0)
                    rid = engine.add_request(prompts[i], max_new_tokens=4,
                                             kv_policy=policies[i], kv_dtype=kv_dtype)
                    got[rid] = (i, [])
            for out in engine.step():
                got[out.request_id][1].extend(out.new_tokens)
            engine.pool.check()  # every head's pages in its device's segment
        tp = 1 if mesh is None else mesh.shape["model"]
        for name in engine.device.token_arrays():  # each device holds 1 / tp of the pages
            x = getattr(engine.device, name)
            shards = x.addressable_shards
            assert len({s.device for s in shards}) == tp, (name, x.sharding)
            assert all(s.data.shape[0] == x.shape[0] // tp for s in shards), (name, x.sharding)
        assert engine.pool.used_pages == 0
        print(kv_dtype, tp, round(time.perf_counter() - T0, 1), file=sys.stderr, flush=True)
        return [t for _, t in sorted(got.values())]


    for kv_dtype, (policies, tps) in RUNS.items():
        one = serve(plain, kv_dtype)
        for tp in tps:
            got = serve(jkv.load(folder, mesh=mesh(tp)), kv_dtype, mesh(tp))
            if tp == 4 and any(policies):
                # tp 4 over 2 kv heads: each repeated twice; the full cache's tokens are the
                # model's, but a policy selects per kv head: the repeated model's selection.
                full = [i for i, p in enumerate(policies) if p is None]
                assert [got[i] for i in full] == [one[i] for i in full], (kv_dtype, got, one)
                one4 = serve(repeat_kv_heads(plain, 2), kv_dtype)
                assert got == one4, (kv_dtype, tp, got, one4)
            else:
                assert got == one, (kv_dtype, tp, got, one)
        print(kv_dtype, "OK", flush=True)

    for tp, match in ((3, "num_heads=4 and num_kv_heads=2"), (2, "num_pages=7")):
        try:
            Engine(plain, num_pages=7, mesh=mesh(tp))
        except ValueError as err:
            assert match in str(err), err
        else:
            raise AssertionError(f"tp={tp}: no error")
    print("SHARDED-ENGINE-OK")
    """
)


def test_sharded_engine_gives_one_devices_tokens(hf_checkpoint, tmp_path):
    folder = hf_checkpoint("llama")
    script = tmp_path / "sharded_engine.py"
    script.write_text(SCRIPT)
    root = Path(__file__).resolve().parents[2]
    env = {
        **os.environ,
        "XLA_FLAGS": os.environ["XLA_FLAGS"] + " --xla_force_host_platform_device_count=4",
        "JAX_PLATFORMS": "cpu",
        "PYTHONPATH": os.pathsep.join([str(root), os.environ.get("PYTHONPATH", "")]),
    }
    proc = subprocess.run(
        [sys.executable, str(script), str(folder)],
        env=env,
        capture_output=True,
        text=True,
        timeout=1800 if os.environ.get("JKV_SHARDED_ALL") == "1" else 600,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "SHARDED-ENGINE-OK" in proc.stdout
