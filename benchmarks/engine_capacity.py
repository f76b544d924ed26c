"""How many requests one fixed KV pool holds at once, and the throughput that follows: the full
cache vs SnapKV keeping 25% of each prompt vs SnapKV 25% with fp8 pages, all in the same bytes.

The pool is sized in bytes for `--fit` full-cache requests of the longest prompt plus its new
tokens in bfloat16 pages; the fp8 configurations get as many pages as those bytes hold (per
token a page spends K, V, an int32 position and, under fp8, two bfloat16 scales: at this
model's head_dim of 32, 132 bytes in bfloat16 and 72 in fp8, so fp8 holds 1.83x the tokens,
less than the 2x of the values alone). Every request is queued at once (more than fit) and
up to four prompts start per step (`token_budget=2048`, `chunk=512`), so the pool, not
`max_running` or the rate of admissions, limits how many run; the engine admits, compresses after each
prompt (each kv head's kept tokens move into fewer pages, the rest go back), preempts when
it must. Concurrency is counted after every step: requests holding pages (peak and mean over
the steps), and requests decoding at once. Each configuration runs twice, the second timed
(the first compiles). Correctness: the first `--check` requests' greedy tokens are compared
with `jkv.generate` of each alone with the same settings (reported here;
tests/engine/test_engine_policies.py asserts it in float32, bfloat16 and fp8).

Model: a random checkpoint of the demo model's shape with a 1,024-token context,
written by transformers. Requests: prompts of 384-448 random ids, 32 new tokens, greedy.

    python benchmarks/engine_capacity.py [--requests 128] [--fit 8] [--out benchmarks/results]
Writes engine_capacity.json and engine_capacity.png.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import platform
import random
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
from tiny_hf import write_tiny_checkpoint  # noqa: E402

os.environ.setdefault(
    "XLA_FLAGS", "--xla_cpu_multi_thread_eigen=true intra_op_parallelism_threads=2"
)

import jkv  # noqa: E402
from jkv.engine.runner import pool_bytes  # noqa: E402
from jkv.memory import page_bytes  # noqa: E402

SHAPE = dict(hidden_size=128, num_layers=4, num_heads=4, num_kv_heads=2, intermediate_size=512,
             vocab_size=392, max_position_embeddings=1024)  # fmt: skip
PROMPT = (384, 448)
NEW_TOKENS = 32
PAGE = 16
CONFIGS = [  # name, kv_policy, kv_budget, kv_dtype
    ("full cache", None, None, "bfloat16"),
    ("full cache + fp8", None, None, "float8_e4m3fn"),
    ("SnapKV 25%", "snapkv", 0.25, "bfloat16"),
    ("SnapKV 25% + fp8", "snapkv", 0.25, "float8_e4m3fn"),
]


def run(params, prompts, num_pages, policy, budget, kv_dtype, admission):
    """One pass: every prompt queued at once. Returns (tokens per request, seconds, concurrency
    counts per step, preemptions)."""
    # admission_headroom=0: the whole pool packs requests (the engine's default keeps 5% free)
    engine = jkv.Engine(params, num_pages=num_pages, page_size=PAGE, token_budget=2048,
                        chunk=512, max_running=128, kv_dtype=kv_dtype, admission=admission,
                        admission_headroom=0.0)  # fmt: skip
    settings = dict(max_new_tokens=NEW_TOKENS, kv_policy=policy, kv_budget=budget)
    rids = [engine.add_request(p, **settings) for p in prompts]
    got = {rid: [] for rid in rids}
    holding, decoding = [], []
    t0 = time.perf_counter()
    while engine.has_work:
        for out in engine.step():
            got[out.request_id] += out.new_tokens
        running = engine.scheduler.running
        holding.append(len(running))
        decoding.append(sum(not s.prefilling for s in running))
    seconds = time.perf_counter() - t0
    device = engine.device.page_nbytes()
    assert device == pool_bytes(params.config, num_pages, PAGE, kv_dtype), "the pool's bytes"
    return (
        [got[r] for r in rids],
        seconds,
        holding,
        decoding,
        engine.scheduler.num_preemptions,
        device,
    )


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--requests", type=int, default=128)
    ap.add_argument("--fit", type=int, default=8, help="full-cache requests the pool is sized for")
    ap.add_argument("--check", type=int, default=3, help="requests compared with generate alone")
    ap.add_argument("--admission", nargs="+", default=["reserve", "optimistic"],
                    help="the engine's admission rules to compare")  # fmt: skip
    ap.add_argument("--out", default=str(Path(__file__).parent / "results"))
    args = ap.parse_args(argv)
    rng = random.Random(0)
    prompts = [[rng.randrange(3, SHAPE["vocab_size"]) for _ in range(rng.randint(*PROMPT))]
               for _ in range(args.requests)]  # fmt: skip
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        params = jkv.load(write_tiny_checkpoint(Path(tmp) / "m", "llama", **SHAPE))
        cfg = params.config
        heads = cfg.num_layers * cfg.num_kv_heads
        full_pages = -(-(PROMPT[1] + NEW_TOKENS) // PAGE) * heads * args.fit + 1
        budget_bytes = pool_bytes(cfg, full_pages, PAGE, "bfloat16")
        for (name, policy, budget, kv_dtype), admission in itertools.product(
            CONFIGS, args.admission
        ):
            num_pages = budget_bytes // pool_bytes(cfg, 1, PAGE, kv_dtype)
            config = (params, prompts, num_pages, policy, budget, kv_dtype, admission)
            run(*config)  # compiles
            toks, seconds, holding, decoding, preempted, device = run(*config)
            same = 0
            for p, t in zip(prompts[: args.check], toks, strict=False):
                want = jkv.generate(params, p, max_new_tokens=NEW_TOKENS, kv_policy=policy,
                                    kv_budget=budget, kv_dtype=kv_dtype).tokens  # fmt: skip
                same += t == list(want)
            rows.append(dict(
                config=name, admission=admission, kv_dtype=kv_dtype, pages=num_pages,
                device_bytes=device, bytes_per_token=page_bytes(cfg, 1, kv_dtype) * heads,
                peak_requests=max(holding), mean_requests=round(sum(holding) / len(holding), 2),
                peak_decoding=max(decoding), preemptions=preempted, steps=len(holding),
                seconds=round(seconds, 2),
                tokens_per_s=round(NEW_TOKENS * len(prompts) / seconds, 1),
                equal_to_generate=f"{same}/{min(args.check, len(prompts))}",
            ))  # fmt: skip
            print(rows[-1], flush=True)
    for r in rows:
        base = next(b for b in rows if b["admission"] == r["admission"])
        r["x_requests"] = round(r["mean_requests"] / base["mean_requests"], 2)
        r["x_peak"] = round(r["peak_requests"] / base["peak_requests"], 2)
        r["x_throughput"] = round(r["tokens_per_s"] / base["tokens_per_s"], 2)
    print(f"\none pool of {budget_bytes / 2**20:.2f} MiB of device memory, measured (bfloat16 pages for {args.fit} full "
          f"requests of {PROMPT[1]}+{NEW_TOKENS} tokens); {args.requests} requests of "
          f"{PROMPT[0]}-{PROMPT[1]} prompt tokens, {NEW_TOKENS} new tokens each, all queued at "
          f"once; demo-shaped random float32 model, CPU ({os.cpu_count()} cores)")  # fmt: skip
    head = (f"{'config':18s} {'admission':>10s} {'pages':>6s} {'B/token':>8s} {'peak req':>9s} {'x peak':>7s} {'mean req':>9s} "
            f"{'x mean':>7s} {'peak dec':>9s} {'preempt':>8s} {'tok/s':>7s} {'x tok/s':>8s}")  # fmt: skip
    print(head)
    for r in rows:
        print(f"{r['config']:18s} {r['admission']:>10s} {r['pages']:6d} {r['bytes_per_token']:8d} "
              f"{r['peak_requests']:9d} {r['x_peak']:7.2f} {r['mean_requests']:9.2f} {r['x_requests']:7.2f} "
              f"{r['peak_decoding']:9d} {r['preemptions']:8d} {r['tokens_per_s']:7.1f} "
              f"{r['x_throughput']:8.2f}")  # fmt: skip
    print(
        "B/token: bytes the pool spends per token of all layers and kv heads (K, V, an int32 "
        "position per head, and under fp8 two bfloat16 scales); pages: one kv head of one layer, "
        f"{PAGE} tokens; greedy tokens equal to jkv.generate alone: "
        + ", ".join(f"{r['config']} ({r['admission']}) {r['equal_to_generate']}" for r in rows)
    )
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    report = dict(
        requests=args.requests, new_tokens=NEW_TOKENS, prompt_tokens=list(PROMPT),
        page_size=PAGE, pool_bytes=budget_bytes, sized_for_full_requests=args.fit,
        model=SHAPE, rows=rows, checked_against_generate=args.check,
        machine=dict(python=platform.python_version(), cpus=os.cpu_count()),
    )  # fmt: skip
    (out / "engine_capacity.json").write_text(json.dumps(report, indent=1) + "\n")
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(10, 4))
    names = [f"{r['config']} ({r['admission']})" for r in rows][::-1]
    axes[0].barh(names, [r["mean_requests"] for r in rows][::-1])
    axes[0].set_xlabel("requests holding pages (mean over steps)")
    axes[1].barh(names, [r["tokens_per_s"] for r in rows][::-1])
    axes[1].set_xlabel("generated tokens / s (CPU)")
    axes[1].set_yticks([])
    fig.suptitle(f"one {budget_bytes / 2**20:.1f} MiB KV pool, {args.requests} requests")
    fig.tight_layout()
    fig.savefig(out / "engine_capacity.png", dpi=110)
    print(f"wrote {out / 'engine_capacity.json'} and engine_capacity.png")
    return 0


if __name__ == "__main__":
    sys.exit(main())
