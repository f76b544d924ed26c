"""Times the XLA reference path of every kernel on CPU: the code the CPU default actually runs.

    python benchmarks/kernels_cpu.py [--out benchmarks/results/kernels_cpu.json] [--iters 10]

Each shape: compile, warm up, then the median of `iters` calls with block_until_ready. Decode
attention also reports GB/s of K and V (and FP8 scales) read. Prints a table, writes JSON.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
import jkv_kernels as pk  # noqa: E402

KH, G, W = 8, 4, 32  # kv heads, query heads per kv head, SnapKV window
DTYPES = {"f32": jnp.float32, "bf16": jnp.bfloat16, "fp8": jnp.float8_e4m3fn}


def median_seconds(fn, args, iters, carry=0):
    """Median seconds per call; the first `carry` args are donated state fed back each call."""
    times = []
    for i in range(iters + 2):  # compile, warm-up, then timed calls
        t0 = time.perf_counter()
        out = jax.block_until_ready(fn(*args))
        if i >= 2:
            times.append(time.perf_counter() - t0)
        if carry:
            args = (*out[:carry], *args[carry:])
    return statistics.median(times)


def cache(rng, b, s, h, dtype):
    k = rng.standard_normal((b, KH, s, h), np.float32)
    v = rng.standard_normal((b, KH, s, h), np.float32)
    if dtype == "fp8":
        (k, ks), (v, vs) = pk.quantize_reference(k), pk.quantize_reference(v)
        return k, v, dict(k_scale=ks, v_scale=vs)
    return jnp.asarray(k, DTYPES[dtype]), jnp.asarray(v, DTYPES[dtype]), {}


def cases(rng):
    """(kernel, shape label, fn, args, bytes read or None)."""
    for dtype in ("f32", "bf16", "fp8"):
        for h in (64, 128):
            for b in (1, 8):
                for s in (512, 2048):
                    k, v, scales = cache(rng, b, s, h, dtype)
                    q_dtype = jnp.float32 if dtype == "f32" else jnp.bfloat16
                    q = jnp.asarray(rng.standard_normal((b, KH * G, h)), q_dtype)
                    lengths = jnp.full((b, KH), s, jnp.int32)
                    fn = jax.jit(
                        lambda q, k, v, n, sc: pk.decode_attention_reference(q, k, v, n, **sc)
                    )
                    nbytes = k.nbytes + v.nbytes + sum(x.nbytes for x in scales.values())
                    label = f"B={b}_S={s}_H={h}_{dtype}"
                    yield "decode_attention", label, fn, (q, k, v, lengths, scales), nbytes
    h = 128
    for b in (1, 8):
        for t in (1, 2048):
            x = jnp.asarray(rng.standard_normal((b, KH, t, h)), jnp.bfloat16)
            yield "quantize", f"B={b}_T={t}_H={h}_bf16", pk.quantize_reference, (x,), x.nbytes
        s = 2048
        k, _, sc = cache(rng, b, s, h, "fp8")
        new = jnp.asarray(rng.standard_normal((b, KH, 1, h)), jnp.bfloat16)
        start = jnp.full((b, KH), s // 2, jnp.int32)
        args = (k, sc["k_scale"], new, start)
        # Donated like the decode step's cache state, so the scatter updates it in place.
        fn = jax.jit(pk.quantize_append_reference.__wrapped__, donate_argnums=(0, 1))
        yield "quantize_append", f"B={b}_S={s}_T=1_H={h}_donated", fn, args, None
        k, v, _ = cache(rng, b, s, h, "bf16")
        lengths = jnp.full((b, KH), s, jnp.int32)
        mask = pk.pack_mask(jnp.asarray(rng.random((b, KH, s)) < 0.5))
        for c in (s // 2, s):
            fn = jax.jit(
                lambda k, v, n, m, c=c: pk.kv_compact_reference(k, v, n, keep_mask=m, capacity=c)
            )
            yield "kv_compact", f"B={b}_S={s}_C={c}_H={h}_bf16", fn, (k, v, lengths, mask), None
        for s in (512, 2048):
            k, _, _ = cache(rng, b, s, h, "bf16")
            q = jnp.asarray(rng.standard_normal((b, KH * G, W, h)), jnp.bfloat16)
            lengths = jnp.full((b, KH), s, jnp.int32)
            label = f"B={b}_S={s}_W={W}_H={h}_bf16"
            yield "window_scores", label, pk.window_scores_reference, (q, k, lengths), None


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default=str(Path(__file__).parent / "results" / "kernels_cpu.json"))
    ap.add_argument("--iters", type=int, default=10)
    args = ap.parse_args(argv)
    jax.config.update("jax_platforms", "cpu")
    rng = np.random.default_rng(0)
    rows = []
    print(f"{'kernel':18s} {'shape':28s} {'median ms':>10s} {'GB/s':>7s}")
    for kernel, label, fn, fargs, nbytes in cases(rng):
        t = median_seconds(fn, fargs, args.iters, carry=2 if kernel == "quantize_append" else 0)
        row = dict(kernel=kernel, shape=label, median_ms=round(t * 1e3, 3))
        if nbytes:
            row["GBps"] = round(nbytes / t / 1e9, 2)
        rows.append(row)
        print(
            f"{kernel:18s} {label:28s} {row['median_ms']:10.3f} {row.get('GBps', ''):>7}",
            flush=True,
        )
    report = dict(
        meta=dict(
            jax=jax.__version__,
            python=platform.python_version(),
            machine=platform.machine(),
            cpus=jax.devices()[0].device_kind,
            kv_heads=KH,
            q_per_kv=G,
            iters=args.iters,
            note="XLA reference path (decode_attention_reference etc.), median per call",
        ),
        rows=rows,
    )
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=1) + "\n")
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
