"""Whether a smaller KV cache pays in serving: `jkv.Engine` on SmolLM2-135M-Instruct with the full
cache beside SnapKV (kvpress's settings, and tuned: window 16, max-pool 21), StreamingLLM and KVzip
keeping 25% of each prompt (`--policies ... Segments`:
the segment rebuild too, its 25% ordinary slots plus low-rank pages for the rest; and, with
`--fp8`, each again with fp8 pages), on requests of real text with a planted number (RULER's niah_single:
`jkv.demo.real_text`), so accuracy is measured in the same run.

Two views, one run:
  same batch   every request in the engine at once (a pool that holds them all), greedy with no
               end-of-sequence token so no row stops: once every row decodes, `--decode-steps`
               steps are timed one by one; the median step, and tokens/s = rows / median step;
               the prompt tokens each (layer, kv head) holds (mean, max); `--profile DIR`: a
               jax.profiler trace of one more step per configuration, read back (the ms XLA's
               threads were busy, the longest thunks).
  same memory  one pool of the bytes of `--fit` full-cache requests in the model's kv dtype
               (float32 on CPU; fp8 pages: as many as those bytes hold); every request queued
               at once, `--new-tokens` each whatever they say (no stop at end of sequence):
               requests holding pages after each step (peak, mean), preemptions, throughput,
               TTFT and TPOT (P50, P99), and accuracy (the answer's number) beside the full
               cache's; `--floor`: the prompts alone too (1 new token each), the run no
               configuration can beat.
Each view builds its engine once per kv dtype and warms it up for every policy first (its
seconds are printed); nothing timed compiles (the programs built while timing are counted).

    python benchmarks/serve_compression.py [--requests 16] [--tokens 2000] [--fp8]
Writes serve_compression.json under --out. Wall seconds on this machine: the ratios mean more.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import platform
import statistics
import sys
import time
from pathlib import Path

import jax
import numpy as np

import jkv
from jkv.compile_time import programs_built
from jkv.demo.real_text import answered, make_needle
from jkv.engine.engine import Engine
from jkv.engine.runner import pool_bytes

# a configuration: a policy's name, or its name and settings (`SnapKV-tuned`: the settings
# docs/quality.md chose on other prompts, window 16 and a max-pool of 21, which keep the needle
# as often as the full cache at 10% of 1K and 2K when the question is in the prompt)
POLICIES = {"full": None, "SnapKV": "snapkv", "SnapKV-tuned": ("snapkv", dict(window=16, kernel=21, pool="max")),
            "StreamingLLM": "streaming", "KVzip": "kvzip", "Segments": "snapkv_segments"}  # fmt: skip
DEFAULT = [
    "full",
    "SnapKV",
    "SnapKV-tuned",
    "StreamingLLM",
    "KVzip",
]  # the segment rebuild when asked for
PAGE = 16
RUNS = itertools.count()  # same-memory runs, each with its own prefix-cache salt


def percentile(xs, q: float) -> float:
    return float(np.percentile(xs, q)) if xs else float("nan")


def needles(params, n: int, tokens: int):
    """`n` prompts of about `tokens` context tokens, the number planted at spread depths."""
    rng = np.random.default_rng(0)
    return [make_needle(params, tokens, d, rng) for d in np.linspace(0.1, 0.9, n)]


def settings(policy, budget: float) -> dict:
    """`add_request`'s policy keywords for a configuration (`POLICIES`' values)."""
    if policy is None:
        return dict(kv_policy=None, kv_budget=None)
    if isinstance(policy, str):
        return dict(kv_policy=policy, kv_budget=budget)
    name, fields = policy
    return dict(kv_policy=jkv.policies.POLICIES[name](budget=budget, **fields), kv_budget=None)


def engine_for(params, kv_dtype, num_pages, rows, policies, budget_tokens):
    engine = Engine(params, num_pages=num_pages, page_size=PAGE, token_budget=budget_tokens,
                    chunk=min(512, budget_tokens), max_running=rows, kv_dtype=kv_dtype,
                    admission_headroom=0.0)  # fmt: skip
    t0 = time.perf_counter()
    engine.warmup(kv_policies=[settings(p, 0.5)["kv_policy"] for p in policies if p is not None])
    return engine, time.perf_counter() - t0


def same_batch(engine, prompts, policy, budget, decode_steps: int, profile=None) -> dict:
    """Every prompt in the engine at once; the decode steps timed once every row decodes."""
    engine.eos_ids = ()  # no row stops early: every row decodes in the timed steps
    longest = max(map(len, prompts))
    warm = -(-len(prompts) * longest // engine.scheduler.token_budget) + 2 * len(prompts)
    new = min(warm + decode_steps + 8, engine.max_model_len - longest)
    rids = [engine.add_request(p, max_new_tokens=new, **settings(policy, budget)) for p in prompts]
    settle = 0
    for _ in range(10 * new):
        engine.step()
        running = engine.scheduler.running
        if len(running) == len(prompts) and not any(s.prefilling for s in running):
            settle += 1  # a step past the last prompt (its compaction or replay) first
            if settle == 2:
                break
    else:
        raise RuntimeError("the rows never all decoded together")
    # what each (layer, kv head) holds: a policy's kept prompt tokens (its mean is the budget;
    # its largest head is what a step's attention runs up to on XLA:CPU, block by block)
    held = np.concatenate([np.asarray(s.base) if s.compressed else
                           np.full(1, s.num_computed)
                           for s in engine.scheduler.running])  # fmt: skip
    # the pages each row holds (a rebuilt row's low-rank pages included): its memory
    pages = [s.pages for s in engine.scheduler.running]
    built, times = programs_built(), []
    for _ in range(decode_steps):
        t0 = time.perf_counter()
        engine.step()
        times.append(time.perf_counter() - t0)
    decoding = sum(not s.prefilling for s in engine.scheduler.running)
    built = programs_built() - built
    trace = profile_step(engine, profile) if profile is not None else None
    for rid in rids:
        engine.abort(rid)
    while engine.has_work:
        engine.step()
    step = statistics.median(times)
    return dict(rows=decoding, step_ms=round(1e3 * step, 1),
                tokens_per_s=round(decoding / step, 1), built=built,
                held_mean=round(float(held.mean()), 1), held_max=int(held.max()),
                pages_mean=round(float(np.mean(pages)), 1),
                steps_ms=[round(1e3 * t, 1) for t in times], profile=trace)  # fmt: skip


def profile_step(engine, where: Path) -> dict:
    """One more `engine.step()` under `jax.profiler.trace` (written under `where`, for
    TensorBoard's or XProf's trace viewer; under async scheduling the device runs the step
    dispatched before while the host plans this one), read back: the call's wall ms, the ms
    XLA's threads were busy running thunks (the compiled programs' work; overlapping threads
    and nested thunks counted once), and the thunks that ran longest, by name."""
    where.mkdir(parents=True, exist_ok=True)
    before = set(where.rglob("*.xplane.pb"))
    with jax.profiler.trace(str(where)):
        t0 = time.perf_counter()
        engine.step()
        wall = time.perf_counter() - t0
        # what the step dispatched runs inside the trace (async scheduling returns before it;
        # a tiny model's step could end after the trace, leaving it empty)
        jax.block_until_ready(engine.device)
    (path,) = set(where.rglob("*.xplane.pb")) - before
    spans, thunks = [], {}
    for plane in jax.profiler.ProfileData.from_file(str(path)).planes:
        for line in plane.lines:
            if not line.name.startswith("tf_XLA"):  # XLA:CPU's threads (Eigen, PjRt client)
                continue
            for ev in line.events:
                spans.append((ev.start_ns, ev.end_ns))
                if not ev.name.startswith("ThunkExecutor"):
                    thunks[ev.name] = thunks.get(ev.name, 0.0) + ev.duration_ns / 1e6
    busy, end = 0, None
    for a, b in sorted(spans):
        if end is None or a > end:
            busy, end = busy + (b - a), b
        elif b > end:
            busy, end = busy + (b - end), b
    top = sorted(thunks.items(), key=lambda kv: -kv[1])[:6]
    return dict(trace=str(path), step_ms=round(1e3 * wall, 1), xla_busy_ms=round(busy / 1e6, 3),
                top=[(name, round(ms, 3)) for name, ms in top])  # fmt: skip


def same_memory(engine, needles_, policy, budget, new_tokens: int) -> dict:
    """Every request queued at once into the fixed pool, run to the end; no request stops at
    an end-of-sequence token, so every configuration decodes the same tokens (the answer is the
    first number in them)."""
    engine.eos_ids = ()
    tok = engine.params.tokenizer
    # a salt of its own: no run takes the prompt pages an earlier configuration left in the
    # prefix cache (a pool with room for them all would answer every prompt from the cache)
    salt = f"run-{next(RUNS)}"
    given = dict(max_new_tokens=new_tokens, cache_salt=salt, **settings(policy, budget))
    built, hits = programs_built(), engine.stats()["prefix_hits"]
    t0 = time.perf_counter()
    rids = [engine.add_request(n.context_ids + n.question_ids, **given) for n in needles_]
    got = {r: [] for r in rids}
    first, last = {}, {}
    holding = []
    while engine.has_work:
        outs = engine.step()
        now = time.perf_counter()
        for out in outs:
            if out.new_tokens:
                first.setdefault(out.request_id, now)
                last[out.request_id] = now
                got[out.request_id] += out.new_tokens
        holding.append(len(engine.scheduler.running))
    seconds = time.perf_counter() - t0
    ttft = [first[r] - t0 for r in rids]
    tpot = [(last[r] - first[r]) / (len(got[r]) - 1) for r in rids if len(got[r]) > 1]
    right = sum(answered(tok.decode(got[r]), n.answer) for r, n in zip(rids, needles_, strict=True))
    return dict(
        peak_requests=max(holding), mean_requests=round(sum(holding) / len(holding), 2),
        preemptions=engine.scheduler.num_preemptions, seconds=round(seconds, 2),
        tokens_per_s=round(sum(map(len, got.values())) / seconds, 2),
        ttft_p50_s=round(percentile(ttft, 50), 2), ttft_p99_s=round(percentile(ttft, 99), 2),
        tpot_p50_ms=round(1e3 * percentile(tpot, 50), 1),
        tpot_p99_ms=round(1e3 * percentile(tpot, 99), 1),
        correct=f"{right}/{len(rids)}", built=programs_built() - built,
        prefix_hits=engine.stats()["prefix_hits"] - hits,
    )  # fmt: skip


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="smollm2")
    ap.add_argument("--requests", type=int, default=16)
    ap.add_argument("--tokens", type=int, default=2000, help="context tokens per request")
    ap.add_argument("--budget", type=float, default=0.25, help="the fraction a policy keeps")
    ap.add_argument("--policies", nargs="+", default=DEFAULT, choices=list(POLICIES))
    ap.add_argument("--fp8", action="store_true", help="each configuration with fp8 pages too")
    ap.add_argument(
        "--kv-dtype",
        default=None,
        help="the pages' dtype of the base rows (default: the model's, float32 on CPU)",
    )
    ap.add_argument("--fit", type=int, default=4, help="full requests the same-memory pool holds")
    ap.add_argument("--decode-steps", type=int, default=8)
    ap.add_argument("--new-tokens", type=int, default=12)
    ap.add_argument("--token-budget", type=int, default=2048, help="tokens per engine step")
    ap.add_argument("--views", nargs="+", default=["batch", "memory"], choices=["batch", "memory"])
    ap.add_argument("--floor", action="store_true",
                    help="same memory: also the prompts alone (1 new token each, full cache), "
                    "the run no configuration can beat: the ceiling of its tokens/s ratio")  # fmt: skip
    ap.add_argument("--out", default=str(Path(__file__).parent / "results"))
    ap.add_argument("--tag", default="", help="writes serve_compression_<tag>.json")
    ap.add_argument("--profile", default=None,
                    help="same batch: a jax.profiler trace of one more decode step per "
                    "configuration under this folder, read back into the JSON")  # fmt: skip
    args = ap.parse_args(argv)

    params = jkv.load(args.model)
    cfg = params.config
    heads = cfg.num_layers * cfg.num_kv_heads
    ns = needles(params, args.requests, args.tokens)
    prompts = [n.context_ids + n.question_ids for n in ns]
    longest = max(map(len, prompts))
    policies = [POLICIES[p] for p in args.policies]
    # the model's kv dtype: float32 on CPU, where bfloat16 pages made SmolLM2's decode step
    # ~20x slower (2.84 s against 0.15 s, 4 rows of 1.1K tokens: docs/engine.md)
    base_dtype = args.kv_dtype or str(params.kv_dtype)
    dtypes = [base_dtype] + (["float8_e4m3fn"] if args.fp8 else [])
    rows, warmups, prefill_floor = [], [], None
    if "batch" in args.views:  # room for every request, KVzip's replay past its prompt included
        per_request = -(-(2 * longest + 2 * args.decode_steps + 512) // PAGE) * heads
        for dtype in dtypes:
            engine, warm_s = engine_for(params, dtype, per_request * args.requests + 1,
                                        args.requests, policies, args.token_budget)  # fmt: skip
            warmups.append(dict(view="same batch", kv_dtype=dtype, warmup_s=round(warm_s, 1)))
            for name, policy in zip(args.policies, policies, strict=True):
                where = Path(args.profile) / f"{name}-{dtype}" if args.profile else None
                r = same_batch(engine, prompts, policy, args.budget, args.decode_steps, where)
                rows.append(dict(view="same batch", config=name, kv_dtype=dtype, **r))
                print(rows[-1], flush=True)
            del engine
    if "memory" in args.views:
        full_pages = -(-(longest + args.new_tokens) // PAGE) * heads * args.fit + 1
        pool = pool_bytes(cfg, full_pages, PAGE, base_dtype)
        for dtype in dtypes:
            pages = pool // pool_bytes(cfg, 1, PAGE, dtype)
            engine, warm_s = engine_for(params, dtype, pages, args.requests, policies,
                                        args.token_budget)  # fmt: skip
            warmups.append(dict(view="same memory", kv_dtype=dtype, warmup_s=round(warm_s, 1)))
            for name, policy in zip(args.policies, policies, strict=True):
                engine.scheduler.num_preemptions = 0
                r = same_memory(engine, ns, policy, args.budget, args.new_tokens)
                rows.append(dict(view="same memory", config=name, kv_dtype=dtype, pages=pages,
                                 pool_mib=round(pool / 2**20, 1), **r))  # fmt: skip
                print(rows[-1], flush=True)
            if dtype == base_dtype and args.floor:  # the prompts alone: no policy runs faster
                floor = same_memory(engine, ns, None, args.budget, 1)
                prefill_floor = dict(kv_dtype=dtype, seconds=floor["seconds"])
                print(f"prompts alone (1 new token each): {floor['seconds']} s", flush=True)
            del engine
    for r in rows:  # ratios to the full cache in the model's kv dtype, same view
        base = next((b for b in rows if b["view"] == r["view"] and b["config"] == "full"
                     and b["kv_dtype"] == base_dtype), None)  # fmt: skip
        if base is None:
            continue
        r["x_tokens_per_s"] = round(r["tokens_per_s"] / base["tokens_per_s"], 2)
        if r["view"] == "same batch":
            r["x_step"] = round(base["step_ms"] / r["step_ms"], 2)
        else:
            r["x_requests"] = round(r["mean_requests"] / base["mean_requests"], 2)

    print(f"\n{args.model}: {args.requests} requests of {min(map(len, prompts))}-{longest} "
          f"prompt tokens (real text, a number planted), policies keep {args.budget:.0%}; "
          f"CPU ({os.cpu_count()} cores)")  # fmt: skip
    print(f"\nsame batch: every request decoding, {args.decode_steps} steps timed")
    print(f"{'config':14s} {'kv':>8s} {'rows':>5s} {'step ms':>8s} {'x step':>7s} "
          f"{'tok/s':>7s} {'built':>6s} {'held/head mean':>15s} {'max':>6s} "
          f"{'pages/row':>9s}")  # fmt: skip
    for r in (r for r in rows if r["view"] == "same batch"):
        print(
            f"{r['config']:14s} {r['kv_dtype'][:8]:>8s} {r['rows']:5d} {r['step_ms']:8.1f} "
            f"{r.get('x_step', float('nan')):7.2f} {r['tokens_per_s']:7.1f} {r['built']:6d} "
            f"{r['held_mean']:15.1f} {r['held_max']:6d} {r['pages_mean']:9.1f}"
        )
    for r in (r for r in rows if r["view"] == "same batch" and r["profile"]):
        p = r["profile"]
        print(f"profile {r['config']} {r['kv_dtype']}: step {p['step_ms']} ms, XLA busy "
              f"{p['xla_busy_ms']} ms; longest thunks (ms): {p['top']}; {p['trace']}")  # fmt: skip
    print(
        f"\nsame memory: a pool of {args.fit} full requests' bytes, {args.new_tokens} new "
        "tokens each, all queued at once"
    )
    print(f"{'config':14s} {'kv':>8s} {'pages':>7s} {'peak':>5s} {'mean':>6s} {'x mean':>7s} "
          f"{'preempt':>8s} {'tok/s':>7s} {'x tok/s':>8s} {'TTFT p50':>9s} {'p99':>6s} "
          f"{'TPOT p50':>9s} {'p99':>7s} {'right':>6s} {'built':>6s}")  # fmt: skip
    for r in (r for r in rows if r["view"] == "same memory"):
        print(f"{r['config']:14s} {r['kv_dtype'][:8]:>8s} {r['pages']:7d} {r['peak_requests']:5d} "
              f"{r['mean_requests']:6.2f} {r.get('x_requests', float('nan')):7.2f} "
              f"{r['preemptions']:8d} {r['tokens_per_s']:7.2f} "
              f"{r.get('x_tokens_per_s', float('nan')):8.2f} {r['ttft_p50_s']:9.2f} "
              f"{r['ttft_p99_s']:6.2f} {r['tpot_p50_ms']:9.1f} {r['tpot_p99_ms']:7.1f} "
              f"{r['correct']:>6s} {r['built']:6d}")  # fmt: skip
    full = next((r for r in rows if r["view"] == "same memory" and r["config"] == "full"
                 and r["kv_dtype"] == base_dtype), None)  # fmt: skip
    if prefill_floor and full:
        # a compressed cache runs the same prompts through the same prefill: its run is no
        # shorter than theirs alone, so its tokens/s is at most full's x (full's s / floor's s)
        prefill_floor["ceiling_x_tokens_per_s"] = round(
            full["seconds"] / prefill_floor["seconds"], 2
        )
        print(f"the prompts alone take {prefill_floor['seconds']} s of the full cache's "
              f"{full['seconds']} s: no configuration's tokens/s can pass "
              f"{prefill_floor['ceiling_x_tokens_per_s']}x the full cache's here")  # fmt: skip
    print("warmup (s): " + ", ".join(f"{w['view']} {w['kv_dtype']} {w['warmup_s']}"
                                     for w in warmups))  # fmt: skip
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    report = dict(
        model=args.model, requests=args.requests, context_tokens=args.tokens,
        prompt_tokens=[min(map(len, prompts)), longest], budget=args.budget, fit=args.fit,
        decode_steps=args.decode_steps, new_tokens=args.new_tokens,
        token_budget=args.token_budget, page_size=PAGE, rows=rows, warmups=warmups,
        prefill_floor=prefill_floor,
        machine=dict(python=platform.python_version(), cpus=os.cpu_count()),
    )  # fmt: skip
    name = f"serve_compression_{args.tag}.json" if args.tag else "serve_compression.json"
    (out / name).write_text(json.dumps(report, indent=1) + "\n")
    print(f"wrote {out / name}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
