"""XLA's own memory figures for the Llama-3.1-8B-shaped chunked prefill step, compiled (never run)
on whatever device JAX has, with 1, 2, 4 and 32 layers: 131,072-token cache, SnapKV 10% + FP8,
chunks of 512, batch 1, the Pallas backend on a GPU ("xla" elsewhere).

benchmarks/long_context.py part 2 predicts the whole model's prefill peak from ONE layer compiled
on CPU (32 x the layer's cache + the step's temporaries + bf16 weights); this checks the
per-layer growth of the temporaries on the device itself, and the full 32-layer step's
argument + output - alias + temp bytes against that prediction.

    python benchmarks/gpu_memory_check.py [--layers 1 2 4 32] [--out DIR]
Writes DIR/gpu_memory_check.json.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import jax
import jax.numpy as jnp

sys.path.insert(0, str(Path(__file__).parent))
from long_context import analysis, state_spec  # noqa: E402

import jkv  # noqa: E402
from jkv import kv as kvlib  # noqa: E402
from jkv.prefill import prefill_step  # noqa: E402
from jkv_models.config import preset  # noqa: E402
from jkv_models.llama import param_shapes  # noqa: E402


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--layers", type=int, nargs="+", default=[1, 2, 4, 32])
    ap.add_argument("--tokens", type=int, default=131072)
    ap.add_argument("--out", default=str(Path(__file__).parent / "results"))
    args = ap.parse_args(argv)
    dev = jax.devices()[0]
    backend = "pallas" if dev.platform == "gpu" else "xla"
    policy = jkv.SnapKV(budget=0.1)
    spec = jax.ShapeDtypeStruct
    rows = []
    for n_layers in args.layers:
        cfg = preset("llama-3.1-8b").replace(num_layers=n_layers)
        kv = state_spec(cfg, kvlib.bucket(args.tokens), "float8_e4m3fn", policy)
        weights = param_shapes(cfg)
        w_bytes = sum(x.size * x.dtype.itemsize for x in jax.tree_util.tree_leaves(weights))
        kv_bytes = sum(x.size * x.dtype.itemsize for x in jax.tree_util.tree_leaves(kv))
        t0 = time.perf_counter()
        lowered = prefill_step.lower(
            weights, cfg, spec((1, 512), jnp.int32), spec((1,), jnp.int32), kv,
            backend=backend, policy=policy.jit_key(),
        )  # fmt: skip
        m = analysis(lowered.compile())
        peak = m["arguments"] + m["output"] - m["alias"] + m["temp"]
        row = dict(layers=n_layers, weights=w_bytes, kv_state=kv_bytes, **m, peak=peak,
                   compile_s=round(time.perf_counter() - t0, 1))  # fmt: skip
        rows.append(row)
        print(json.dumps(row), flush=True)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    report = dict(device=dev.device_kind, platform=dev.platform, jax=jax.__version__,
                  backend=backend, tokens=args.tokens, rows=rows)  # fmt: skip
    (out / "gpu_memory_check.json").write_text(json.dumps(report, indent=1) + "\n")
    gb = 1e9
    print(f"{dev.device_kind} ({backend}): layers | temp GB | peak GB (args + out - alias + temp)")
    for r in rows:
        print(f"  {r['layers']:3d} | {r['temp'] / gb:8.2f} | {r['peak'] / gb:8.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
