"""The seed's end-to-end figure on one GPU: a Llama-3.1-8B-shaped model (random bfloat16
weights made on the device, nothing downloaded) through `jkv.Engine`, N concurrent requests of
P prompt + G new tokens (the seed's section 4.4: 256 x 512 + 256), for a bfloat16 pool, an FP8
pool and SnapKV keeping 25% of each prompt in FP8; beside `transformers`' continuous batching
(`generate_batch`, torch) on the same shape and requests, run first in a child process so the
two never share the device's memory.

Per configuration: peak KV bytes (pages in use x bytes per page, read after every step), output
tokens/s, TPOT P50/P99 (each request's (last token time - first token time) / (tokens - 1)),
TTFT P50, and each decode-only step's bandwidth bound (weight bytes + the KV bytes its rows
hold, over a device-to-device copy's measured GB/s) against its measured time. Every
configuration first runs the same requests with 8 new tokens, untimed (it compiles the step
shapes the timed run needs; its seconds are reported). Greedy; no eos (every request runs to G).

    python benchmarks/gpu_serve.py [--cpu] [--requests 256] [--prompt 512] [--new 256]
                                   [--skip-transformers] [--out DIR]

--cpu: a tiny model of the same kind and 16 requests of 48 + 16 tokens (a smoke run of the
script itself, any machine). Writes DIR/gpu_serve.json (gpu_serve_cpu.json with --cpu).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import random
import statistics
import subprocess
import sys
import time
from pathlib import Path

SHAPES = {
    "llama-3.1-8b": dict(vocab_size=128256, hidden_size=4096, intermediate_size=14336,
                         num_layers=32, num_heads=32, num_kv_heads=8, head_dim=128,
                         rope_theta=500000.0, max_position_embeddings=8192),
    "tiny": dict(vocab_size=512, hidden_size=128, intermediate_size=256, num_layers=2,
                 num_heads=4, num_kv_heads=2, head_dim=32, max_position_embeddings=1024),
}  # fmt: skip
CONFIGS = [  # name, kv_policy, kv_budget, kv_dtype
    ("bf16 pool", None, None, "bfloat16"),
    ("fp8 pool", None, None, "float8_e4m3fn"),
    ("SnapKV 25% + fp8", "snapkv", 0.25, "float8_e4m3fn"),
]
PAGE = 16


def prompts_for(args, vocab):
    rng = random.Random(0)
    return [[rng.randrange(3, vocab) for _ in range(args.prompt)] for _ in range(args.requests)]


def pct(values, q):
    values = sorted(values)
    return values[min(len(values) - 1, int(round(q / 100 * (len(values) - 1))))]


# ---------------------------------------------------------------- transformers (child process)


def transformers_run(args, shape) -> dict:
    import torch
    import transformers

    device = "cuda" if torch.cuda.is_available() and not args.cpu else "cpu"
    cfg = transformers.LlamaConfig(
        vocab_size=shape["vocab_size"], hidden_size=shape["hidden_size"],
        intermediate_size=shape["intermediate_size"], num_hidden_layers=shape["num_layers"],
        num_attention_heads=shape["num_heads"], num_key_value_heads=shape["num_kv_heads"],
        head_dim=shape["head_dim"], rope_theta=shape.get("rope_theta", 10000.0),
        max_position_embeddings=shape["max_position_embeddings"], eos_token_id=None,
        pad_token_id=0,
    )  # fmt: skip
    torch.manual_seed(0)
    with torch.device(device):
        model = transformers.LlamaForCausalLM(cfg).to(torch.bfloat16).eval()
    model.config._attn_implementation = "paged|sdpa"
    prompts = prompts_for(args, shape["vocab_size"])
    gen = transformers.GenerationConfig(
        max_new_tokens=args.new, do_sample=False, eos_token_id=None, pad_token_id=0,
        block_size=PAGE, max_batch_tokens=args.token_budget,
    )  # fmt: skip
    warm = transformers.GenerationConfig(**{**gen.to_dict(), "max_new_tokens": 8})
    t0 = time.perf_counter()
    model.generate_batch(prompts, generation_config=warm, progress_bar=False)
    warm_s = time.perf_counter() - t0
    if device == "cuda":
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
    t0 = time.perf_counter()
    out = model.generate_batch(prompts, generation_config=gen, progress_bar=False)
    seconds = time.perf_counter() - t0
    tokens = sum(len(o.generated_tokens) for o in out.values())
    row = dict(system="transformers generate_batch (paged|sdpa)", device=device,
               transformers=transformers.__version__, torch=torch.__version__,
               seconds=round(seconds, 2), output_tokens=tokens,
               tokens_per_s=round(tokens / seconds, 1), compile_pass_s=round(warm_s, 1))  # fmt: skip
    if device == "cuda":
        row["peak_memory_bytes"] = torch.cuda.max_memory_allocated()
    return row


# ---------------------------------------------------------------- jkv


def copy_gbps():
    import jax
    import jax.numpy as jnp

    x = jnp.zeros((1 << 30,) if jax.default_backend() == "gpu" else (1 << 24,), jnp.uint8)
    copy = jax.jit(lambda a: jnp.copy(a))
    jax.block_until_ready(copy(x))
    times = []
    for _ in range(10):
        t0 = time.perf_counter()
        jax.block_until_ready(copy(x))
        times.append(time.perf_counter() - t0)
    return 2 * x.size / statistics.median(times) / 1e9


def engine_pass(params, prompts, new, policy, budget, kv_dtype, args, bandwidth=None):
    """One run of every request through a fresh engine; returns its measurements."""
    import jax

    import jkv
    from jkv.kv import bucket

    cfg = params.config
    blocks = cfg.num_layers * cfg.num_kv_heads * math.ceil((args.prompt + new) / PAGE)
    engine = jkv.Engine(params, num_pages=len(prompts) * blocks + 64, page_size=PAGE,
                        token_budget=args.token_budget, chunk=args.chunk,
                        max_running=len(prompts), max_model_len=bucket(args.prompt + new),
                        kv_dtype=kv_dtype)  # fmt: skip
    settings = dict(max_new_tokens=new, kv_dtype=kv_dtype)
    if policy:
        settings.update(kv_policy=policy, kv_budget=budget)
    t0 = time.perf_counter()
    times = {engine.add_request(p, **settings): [] for p in prompts}
    weight_bytes = sum(x.nbytes for x in jax.tree_util.tree_leaves(params.weights))
    peak_pages, steps = 0, []
    while engine.has_work:
        if time.monotonic() > args.deadline:
            return dict(cut="time budget (--budget-s)")
        s0 = time.perf_counter()
        outs = engine.step()
        now = time.perf_counter()
        used = engine.stats()["pages_used"]
        peak_pages = max(peak_pages, used)
        decoding = all(len(t) > 0 for t in times.values())
        for out in outs:
            times[out.request_id] += [now] * len(out.new_tokens)
        if decoding and outs:
            steps.append((now - s0, weight_bytes + used * engine.page_bytes))
    seconds = time.perf_counter() - t0
    tpot = [(t[-1] - t[0]) / (len(t) - 1) for t in times.values() if len(t) > 1]
    ttft = [t[0] - t0 for t in times.values() if t]
    row = dict(seconds=round(seconds, 2), output_tokens=sum(len(t) for t in times.values()),
               peak_kv_bytes=peak_pages * engine.page_bytes, page_bytes=engine.page_bytes,
               tpot_p50_ms=round(1e3 * pct(tpot, 50), 2), tpot_p99_ms=round(1e3 * pct(tpot, 99), 2),
               ttft_p50_s=round(pct(ttft, 50), 3), preemptions=engine.scheduler.num_preemptions)  # fmt: skip
    row["tokens_per_s"] = round(row["output_tokens"] / seconds, 1)
    if steps and bandwidth:
        step_s = statistics.median(s for s, _ in steps)
        bound_s = statistics.median(b for _, b in steps) / (bandwidth * 1e9)
        row.update(decode_step_ms=round(1e3 * step_s, 2), bound_step_ms=round(1e3 * bound_s, 2),
                   of_bound=round(bound_s / step_s, 3))  # fmt: skip
    return row


def jkv_run(args, shape) -> tuple[list[dict], dict]:
    import functools

    import jax

    import jkv
    from jkv_models.config import ModelConfig
    from jkv_models.llama import init_params

    cfg = ModelConfig(**shape, dtype="bfloat16")
    weights = jax.jit(functools.partial(init_params, cfg))(jax.random.key(0))
    params = jkv.Params(weights, cfg, name="random-" + args.model)
    prompts = prompts_for(args, cfg.vocab_size)
    bandwidth = copy_gbps()
    meta = dict(device=jax.devices()[0].device_kind, jax=jax.__version__, copy_GBps=round(bandwidth, 1),
                weight_bytes=sum(x.nbytes for x in jax.tree_util.tree_leaves(weights)))  # fmt: skip
    rows = []
    for name, policy, budget, kv_dtype in CONFIGS:
        if time.monotonic() > args.deadline:
            rows.append(dict(system=f"jkv.Engine, {name}", cut="time budget (--budget-s)"))
            continue
        t0 = time.perf_counter()
        engine_pass(params, prompts, 8, policy, budget, kv_dtype, args)  # compiles
        warm_s = time.perf_counter() - t0
        row = engine_pass(params, prompts, args.new, policy, budget, kv_dtype, args, bandwidth)
        row = dict(system=f"jkv.Engine, {name}", compile_pass_s=round(warm_s, 1), **row)
        rows.append(row)
        print(json.dumps(row), flush=True)
    return rows, meta


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--cpu", action="store_true", help="tiny model, 16 x (48 + 16): a smoke run")
    ap.add_argument("--requests", type=int, default=None)
    ap.add_argument("--prompt", type=int, default=None)
    ap.add_argument("--new", type=int, default=None)
    ap.add_argument("--token-budget", type=int, default=4096)
    ap.add_argument("--chunk", type=int, default=512)
    ap.add_argument("--skip-transformers", action="store_true")
    ap.add_argument("--budget-s", type=float, default=450.0,
                    help="configurations not finished by then are reported as cut")  # fmt: skip
    ap.add_argument("--transformers-only", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--out", default=str(Path(__file__).parent / "results"))
    args = ap.parse_args(argv)
    args.deadline = time.monotonic() + args.budget_s
    args.model = "tiny" if args.cpu else "llama-3.1-8b"
    args.requests = args.requests or (16 if args.cpu else 256)
    args.prompt = args.prompt or (48 if args.cpu else 512)
    args.new = args.new or (16 if args.cpu else 256)
    if args.cpu:
        args.token_budget, args.chunk = min(args.token_budget, 256), min(args.chunk, 64)
    shape = SHAPES[args.model]
    if args.transformers_only:
        print(json.dumps(transformers_run(args, shape)))
        return 0
    peer = None
    if not args.skip_transformers:  # first, alone on the device
        child = subprocess.run([sys.executable, __file__, "--transformers-only", *(argv or sys.argv[1:])],
                               capture_output=True, text=True)  # fmt: skip
        lines = child.stdout.strip().splitlines()
        try:
            peer = json.loads(lines[-1])
        except (IndexError, json.JSONDecodeError):
            peer = dict(system="transformers generate_batch", error=child.stderr[-2000:])
    if args.cpu:
        os.environ.setdefault("JAX_PLATFORMS", "cpu")
    rows, meta = jkv_run(args, shape)
    if peer:
        rows.append(peer)
    bf16 = rows[0] if "peak_kv_bytes" in rows[0] else {"peak_kv_bytes": math.nan}
    print(f"\n{args.requests} requests x ({args.prompt} prompt + {args.new} new tokens), "
          f"{args.model}, random bf16 weights, {meta['device']}; copy {meta['copy_GBps']} GB/s")  # fmt: skip
    print(f"{'system':40s} {'tok/s':>9s} {'peak KV GiB':>12s} {'x bf16':>7s} {'TPOT P50':>9s} "
          f"{'P99 ms':>7s} {'step/bound':>11s}")  # fmt: skip
    for r in rows:
        kv = r.get("peak_kv_bytes")
        gib = f"{kv / 2**30:.2f}" if kv else "-"
        rel = f"{kv / bf16['peak_kv_bytes']:.2f}" if kv else "-"
        print(f"{r['system'][:40]:40s} {r.get('tokens_per_s', '-')!s:>9s} {gib:>12s} {rel:>7s} "
              f"{r.get('tpot_p50_ms', '-')!s:>9s} {r.get('tpot_p99_ms', '-')!s:>7s} "
              f"{r.get('of_bound', '-')!s:>11s}")  # fmt: skip
        if "error" in r or "cut" in r:
            print(f"  {r.get('cut') or r['error'][-300:]}")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    path = out / ("gpu_serve_cpu.json" if args.cpu else "gpu_serve.json")
    report = dict(meta=dict(meta, python=platform.python_version(), model=args.model, shape=shape,
                            requests=args.requests, prompt=args.prompt, new=args.new),
                  rows=rows)  # fmt: skip
    path.write_text(json.dumps(report, indent=1) + "\n")
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
