"""Timings for `gpu_check.py` on a GPU: decode attention (our kernel vs the jitted XLA reference
vs JAX's Pallas `gqa` op), one prefill chunk, paged decode against dense, and a device-to-device
copy for scale. Warm-up, then the median of per-call wall times with inputs rotated so L2 cannot
hold them, and device time per call from a `jax.profiler` trace (kernels summed per jitted
module). Run through `bash benchmarks/gpu_check.sh`, which checks correctness first.
"""

from __future__ import annotations

import glob
import gzip
import json
import math
import shutil
import statistics
import time
from collections import defaultdict
from pathlib import Path

import jax
import jax.numpy as jnp

import jkv_kernels as pk

FP8 = jnp.float8_e4m3fn
L2_BYTES = 256 << 20  # rotate inputs until at least this much is cycled through
DECODE_S, DECODE_B = (1024, 8192, 32768, 131072), (1, 8, 32)
PREFILL_SHAPE, PREFILL_S, PREFILL_B = (8, 4, 128, 512), (4096, 32768), (1, 4)  # K, G, H, T
PAGED_SHAPE, PAGED_S, PAGED_B = (8, 4, 128, 16), (8192, 32768), (8, 32)  # K, G, H, page


def named_jit(name, fn):
    """jax.jit with a chosen function name, so its trace events carry hlo_module=jit_<name>."""

    def wrapper(*args):
        return fn(*args)

    wrapper.__name__ = wrapper.__qualname__ = name
    return jax.jit(wrapper)


def wall_median(fn, inputs, iters):
    times = []
    for i in range(iters):
        args = inputs[i % len(inputs)]
        t0 = time.perf_counter()
        jax.block_until_ready(fn(*args))
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def device_seconds(trace_dir: Path) -> dict[str, dict]:
    """Per jitted module: device time (s) summed over the kernels of a perfetto trace."""
    files = sorted(glob.glob(str(trace_dir / "**" / "perfetto_trace.json.gz"), recursive=True))
    if not files:
        return {}
    with gzip.open(files[-1]) as f:
        data = json.load(f)
    events = data["traceEvents"] if isinstance(data, dict) else data
    procs, threads = {}, {}
    for e in events:
        if e.get("ph") == "M" and e.get("name") == "process_name":
            procs[e["pid"]] = e["args"]["name"]
        if e.get("ph") == "M" and e.get("name") == "thread_name":
            threads[(e["pid"], e.get("tid"))] = e["args"]["name"]
    gpu = {pid for pid, name in procs.items() if "GPU" in name or "gpu" in name}
    # Raw kernels live on the "Stream #n" lines; "XLA Ops"/"XLA Modules" repeat them, so one
    # kind of line is summed: streams when the trace has them, XLA ops otherwise.
    lines: dict[str, list] = defaultdict(list)
    for e in events:
        module = (e.get("args") or {}).get("hlo_module")
        if e.get("ph") == "X" and e.get("pid") in gpu and module:
            thread = threads.get((e["pid"], e.get("tid")), "")
            kind = "stream" if "Stream" in thread else "ops" if "XLA Ops" in thread else "other"
            lines[kind].append((module, e))
    out: dict[str, dict] = defaultdict(lambda: dict(seconds=0.0, kernels=defaultdict(float)))
    for module, e in lines["stream"] or lines["ops"]:
        out[module]["seconds"] += e["dur"] * 1e-6
        out[module]["kernels"][e["name"][:80]] += e["dur"] * 1e-6
    return out


def decode_impls(b, kh, s, h, g, dtype):
    """The decode implementations to time for one shape: name -> (fn, make_args)."""
    tag = f"{dtype}_B{b}_S{s}"
    impls = {
        "pallas": named_jit(f"pallas_{tag}", lambda *a: pk.decode_attention(*a[:4], **a[4])),
        "xla_reference": named_jit(
            f"xla_{tag}", lambda *a: pk.decode_attention_reference(*a[:4], **a[4])
        ),
    }
    if dtype == "fp8":  # float8 loads converted by the compiler instead of decoding the bits
        impls["pallas_native"] = named_jit(
            f"native_{tag}", lambda *a: pk.decode_attention(*a[:4], **a[4], fp8_native=True)
        )
    if dtype == "bf16":
        try:
            from jax.experimental.pallas.ops.gpu import decode_attention as jax_ops

            impls["jax_gqa"] = named_jit(
                f"jaxgqa_{tag}", lambda q, k, v, lens, _: jax_ops.gqa(q, k, v, kv_seq_len=lens)
            )
        except Exception:  # absent or moved in this jax: the peer is optional
            pass
    return impls


def make_timing_inputs(key, b, kh, s, h, g, dtype, copies):
    @jax.jit
    def one(key):
        kq, kk, kv, ks = jax.random.split(key, 4)
        q = jax.random.normal(kq, (b, kh * g, h), jnp.bfloat16)
        shape = (b, kh, s, h)
        lengths = jnp.full((b, kh), s, jnp.int32)
        if dtype == "fp8":  # values in fp8 range, per-slot scales as the quantiser makes them
            k = jax.random.normal(kk, shape, jnp.float32).astype(FP8)
            v = jax.random.normal(kv, shape, jnp.float32).astype(FP8)
            sc = jax.random.uniform(ks, (2, b, kh, s), jnp.float32, 0.5, 1.5)
            return q, k, v, lengths, dict(k_scale=sc[0], v_scale=sc[1])
        k = jax.random.normal(kk, shape, jnp.bfloat16)
        return q, k, jax.random.normal(kv, shape, jnp.bfloat16), lengths, {}

    return [one(kk) for kk in jax.random.split(key, copies)]


def time_decode(budget_end, trace_root: Path, save) -> list[dict]:
    kh, g, h = 8, 4, 128
    dev = jax.devices()[0]
    limit = (dev.memory_stats() or {}).get("bytes_limit", 80 << 30)
    rows = []
    for s in DECODE_S:
        for b in DECODE_B:
            for dtype in ("bf16", "fp8"):  # interleaved: a spent budget still leaves both
                row = dict(dtype=dtype, B=b, S=s, K=kh, G=g, H=h)
                itemsize = 2 if dtype == "bf16" else 1
                kv_bytes = 2 * b * kh * s * h * itemsize
                read = kv_bytes + (2 * b * kh * s * 4 if dtype == "fp8" else 0)
                row["bytes_read"] = read
                if time.monotonic() > budget_end:
                    rows.append(dict(row, skipped="time budget"))
                    continue
                # The XLA reference holds float32 copies of K and V and the scores.
                if read + 4 * 2 * b * kh * s * h + 12 * b * kh * g * s > 0.6 * limit:
                    rows.append(dict(row, skipped="does not fit in memory"))
                    continue
                copies = max(1, min(16, math.ceil(L2_BYTES / read)))
                rows.append(time_one(row, b, kh, s, h, g, dtype, copies, read, trace_root))
                print(json.dumps(rows[-1]), flush=True)
                save(rows)  # a run cut short still leaves every finished row on disk
    return rows


def time_one(row, b, kh, s, h, g, dtype, copies, read, trace_root):
    inputs = make_timing_inputs(jax.random.key(s + b), b, kh, s, h, g, dtype, copies)
    impls = decode_impls(b, kh, s, h, g, dtype)
    iters = 20 if read < (1 << 30) else 8
    per_impl = {}
    for name in impls:
        ins = inputs
        if name == "jax_gqa":  # its cache layout is [B, S, K, H]: transpose outside the timing
            ins = [
                (q, jnp.swapaxes(k, 1, 2), jnp.swapaxes(v, 1, 2), ln[:, 0], e)
                for q, k, v, ln, e in inputs
            ]
        per_impl[name] = ins
    time_impls(row, impls, per_impl, iters, trace_root, f"{dtype}_B{b}_S{s}")
    for name in impls:
        t = row.get(f"{name}_device_s") or row.get(f"{name}_wall_s")
        if t:
            row[f"{name}_GBps"] = round(read / t / 1e9, 1)
    del inputs, per_impl
    return row


def time_impls(row, impls, inputs, iters, trace_root, tag):
    """Wall median and profiled device time per implementation; inputs[name] is a list of
    argument tuples rotated through."""
    prepared = {}
    for name, fn in impls.items():
        try:
            jax.block_until_ready(fn(*inputs[name][0]))  # compile + warm-up
            jax.block_until_ready(fn(*inputs[name][-1]))
            prepared[name] = inputs[name]
            row[f"{name}_wall_s"] = wall_median(fn, inputs[name], iters)
        except Exception as e:
            row[f"{name}_error"] = f"{type(e).__name__}: {e}"[:500]
    trace_dir = trace_root / tag
    try:
        with jax.profiler.trace(str(trace_dir), create_perfetto_trace=True):
            for name, ins in prepared.items():
                for i in range(5):
                    jax.block_until_ready(impls[name](*ins[i % len(ins)]))
        per_module = device_seconds(trace_dir)
        for name, fn in impls.items():
            mod = per_module.get(f"jit_{fn.__name__}")
            if mod and name in prepared:
                row[f"{name}_device_s"] = mod["seconds"] / 5
                top = sorted(mod["kernels"].items(), key=lambda kv: -kv[1])[:4]
                row[f"{name}_kernels_us"] = {k: round(v / 5 * 1e6, 1) for k, v in top}
    except Exception as e:
        row["trace_error"] = f"{type(e).__name__}: {e}"[:500]
    shutil.rmtree(trace_dir, ignore_errors=True)
    return row


def time_prefill(budget_end, trace_root: Path, save) -> list[dict]:
    """One 512-token prefill chunk over a cache of S slots (the chunk's own keys last): the
    flash kernel vs the XLA blocked path vs the materialising reference (where it fits)."""
    kh, g, h, t = PREFILL_SHAPE
    rows = []
    for s in PREFILL_S:
        for b in PREFILL_B:
            row = dict(T=t, B=b, S=s, K=kh, G=g, H=h, dtype="bf16")
            row["flops"] = 4 * b * t * s * kh * g * h
            if time.monotonic() > budget_end:
                rows.append(dict(row, skipped="time budget"))
                continue

            @jax.jit
            def one(key, b=b, s=s):
                kq, kk, kv = jax.random.split(key, 3)
                q = jax.random.normal(kq, (b, t, kh * g, h), jnp.bfloat16)
                k = jax.random.normal(kk, (b, kh, s, h), jnp.bfloat16)
                v = jax.random.normal(kv, (b, kh, s, h), jnp.bfloat16)
                pos = jnp.broadcast_to(jnp.arange(s, dtype=jnp.int32), (b, kh, s))
                qpos = jnp.broadcast_to(jnp.arange(s - t, s, dtype=jnp.int32), (b, t))
                return q, k, v, jnp.full((b, kh), s, jnp.int32), pos, qpos

            ins = [one(kk) for kk in jax.random.split(jax.random.key(s + b), 2)]
            tag = f"prefill_B{b}_S{s}"
            impls = {
                "pallas": named_jit(f"pallas_{tag}", pk.prefill_attention),
                "xla_blocked": named_jit(f"xla_{tag}", pk.prefill_attention_blocked),
            }
            if b * kh * g * t * s * 4 * 3 < (24 << 30):
                impls["xla_reference"] = named_jit(f"ref_{tag}", pk.prefill_attention_reference)
            time_impls(row, impls, {n: ins for n in impls}, 10, trace_root, tag)
            for name in impls:
                sec = row.get(f"{name}_device_s") or row.get(f"{name}_wall_s")
                if sec:
                    row[f"{name}_TFLOPs"] = round(row["flops"] / sec / 1e12, 1)
            rows.append(row)
            print(json.dumps(row), flush=True)
            save(rows)
            del ins
    return rows


def time_paged(budget_end, trace_root: Path, save) -> list[dict]:
    """Decode over a shuffled per-head page pool (page 16) vs the dense kernel on the same
    tokens laid out contiguously; both read the same bytes."""
    kh, g, h, page = PAGED_SHAPE
    rows = []
    for s in PAGED_S:
        for b in PAGED_B:
            row = dict(B=b, S=s, K=kh, G=g, H=h, page=page, dtype="bf16")
            row["bytes_read"] = read = 2 * b * kh * s * h * 2
            if time.monotonic() > budget_end:
                rows.append(dict(row, skipped="time budget"))
                continue
            n_pages = b * kh * s // page

            @jax.jit
            def one(key, b=b, s=s, n_pages=n_pages):
                kq, kk, kv, kp = jax.random.split(key, 4)
                q = jax.random.normal(kq, (b, kh * g, h), jnp.bfloat16)
                kp_ = jax.random.normal(kk, (n_pages, page, h), jnp.bfloat16)
                vp = jax.random.normal(kv, (n_pages, page, h), jnp.bfloat16)
                table = jax.random.permutation(kp, n_pages).reshape(b, kh, s // page)
                table = table.astype(jnp.int32)
                lengths = jnp.full((b, kh), s, jnp.int32)
                dense_k, dense_v = pk.gather_pages(kp_, table), pk.gather_pages(vp, table)
                return (q, kp_, vp, table, lengths), (q, dense_k, dense_v, lengths)

            copies = max(1, min(8, math.ceil(L2_BYTES / read)))
            both = [one(kk) for kk in jax.random.split(jax.random.key(s * 3 + b), copies)]
            tag = f"paged_B{b}_S{s}"
            impls = {
                "paged": named_jit(f"paged_{tag}", pk.paged_decode_attention),
                "dense": named_jit(f"dense_{tag}", pk.decode_attention),
            }
            inputs = {"paged": [x[0] for x in both], "dense": [x[1] for x in both]}
            time_impls(row, impls, inputs, 20, trace_root, tag)
            for name in impls:
                sec = row.get(f"{name}_device_s") or row.get(f"{name}_wall_s")
                if sec:
                    row[f"{name}_GBps"] = round(read / sec / 1e9, 1)
            rows.append(row)
            print(json.dumps(row), flush=True)
            save(rows)
            del both, inputs
    return rows


def time_copy():
    """Device-to-device copy bandwidth (bytes read + written per second)."""
    x = jnp.zeros((1 << 30,), jnp.uint8)
    copy = named_jit("d2d_copy", lambda a: jnp.copy(a))
    jax.block_until_ready(copy(x))
    t = wall_median(copy, [(x,)], 20)
    return dict(bytes=2 * x.size, wall_s=t, GBps=round(2 * x.size / t / 1e9, 1))


def print_summary(report):
    """The short tables last (a remote run's reply carries the end of the output)."""
    rows = [r for r in report.get("decode") or [] if isinstance(r, dict) and "skipped" not in r]
    if rows:
        print("decode GB/s (device time): dtype B S | pallas pallas_native xla_reference jax_gqa |"
              " pallas/copy")  # fmt: skip
        for r in rows:
            names = ("pallas", "pallas_native", "xla_reference", "jax_gqa")
            cols = [r.get(f"{n}_GBps", "-") for n in names]
            print(f"  {r['dtype']} {r['B']} {r['S']} | {cols} | {r.get('pallas_vs_copy', '-')}")
    for r in report.get("prefill") or []:
        cols = {n: r.get(f"{n}_TFLOPs", r.get(f"{n}_error", "-")) for n in
                ("pallas", "xla_blocked", "xla_reference")}  # fmt: skip
        print(f"prefill TFLOP/s T={r['T']} B={r['B']} S={r['S']}: {cols} {r.get('skipped', '')}")
    for r in report.get("paged") or []:
        cols = {n: r.get(f"{n}_GBps", r.get(f"{n}_error", "-")) for n in ("paged", "dense")}
        print(f"paged decode GB/s B={r['B']} S={r['S']}: {cols} {r.get('skipped', '')}")
    for r in report.get("ragged") or []:
        if "ratio" in r:
            print(f"ragged {r['dtype']} {r['setup']}: {r['ratio']}")
            continue
        cols = {n: r.get(f"{n}_GBps", r.get(f"{n}_error", "-")) for n in ("pallas", "xla")}
        print(f"ragged GB/s {r['dtype']} {r['setup']}: {cols} {r.get('skipped', '')}")
