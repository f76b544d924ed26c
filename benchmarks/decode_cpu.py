"""CPU decode speed: jkv against Hugging Face transformers (torch), side by side in one process.

Both run the same random float32 checkpoint (written by transformers, loaded by both), greedy,
prompt 512, 128 new tokens, 2 threads each. Correctness first: the two must produce the same
tokens. Reported per config and batch size:
  decode tokens/s   (generated tokens after the first) / (time of the 128-token run minus a
                    1-token run), i.e. the decode loop alone, prefill excluded, for both;
  end-to-end tok/s  all generated tokens / whole call (prefill included);
  ratio             jkv / transformers.

  python benchmarks/decode_cpu.py [--quick] [--profile DIR] [--out benchmarks/results]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path

# tests/tiny_hf.py, the tests' fixture writer of tiny random Hugging Face checkpoints (it
# imports torch and transformers only when it writes one).
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
from tiny_hf import write_tiny_checkpoint  # noqa: E402

THREADS = 2
os.environ.setdefault(
    "XLA_FLAGS",
    f"--xla_cpu_multi_thread_eigen=true intra_op_parallelism_threads={THREADS}",
)

CONFIGS = {
    # ~3M parameters
    "small-3M": dict(
        hidden_size=256,
        num_layers=4,
        num_heads=8,
        num_kv_heads=2,
        intermediate_size=688,
        vocab_size=512,
    ),
    # ~125M parameters
    "base-125M": dict(
        hidden_size=768,
        num_layers=12,
        num_heads=12,
        num_kv_heads=4,
        intermediate_size=2048,
        vocab_size=32000,
    ),
}


def timed(fn, *args) -> float:
    t0 = time.perf_counter()
    fn(*args)
    return time.perf_counter() - t0


def bench_config(
    name: str,
    spec: dict,
    batches,
    prompt_len: int,
    new_tokens: int,
    repeats: int,
    workdir: Path,
    profile_dir: str | None,
):
    import numpy as np
    import torch
    import transformers

    import jkv

    folder = write_tiny_checkpoint(
        workdir / name, "llama", max_position_embeddings=2048, initializer_range=0.02, **spec
    )
    params = jkv.load(folder)
    hf = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    n_params = params.config.num_params()
    rows = []
    rng = np.random.default_rng(0)
    for batch in batches:
        prompts = rng.integers(3, spec["vocab_size"], size=(batch, prompt_len))
        ids = torch.tensor(prompts)

        def run_jkv(n, prompts=prompts):
            return jkv.generate(params, prompts.tolist(), max_new_tokens=n)

        def run_hf(n, ids=ids):
            with torch.no_grad():
                return hf.generate(ids, max_new_tokens=n, min_new_tokens=n, do_sample=False)

        # correctness first: identical greedy tokens
        ours = run_jkv(new_tokens)
        theirs = run_hf(new_tokens)[:, prompt_len:].tolist()
        agree = sum(r.tokens == t for r, t in zip(ours, theirs, strict=True))
        run_jkv(1)  # compile both shapes before timing
        run_hf(1)
        # Interleaved rounds, so a noisy neighbour slows both sides alike; medians per side.
        times = {"jkv_full": [], "jkv_one": [], "hf_full": [], "hf_one": []}
        for _ in range(repeats):
            for key, fn, n in (
                ("jkv_full", run_jkv, new_tokens),
                ("hf_full", run_hf, new_tokens),
                ("jkv_one", run_jkv, 1),
                ("hf_one", run_hf, 1),
            ):
                times[key].append(timed(fn, n))
        med = {k: statistics.median(v) for k, v in times.items()}
        jkv_full, jkv_one, hf_full, hf_one = (
            med[k] for k in ("jkv_full", "jkv_one", "hf_full", "hf_one")
        )
        # Decode time per round: that round's full run minus its 1-token run (paired).
        jkv_dec = statistics.median(
            a - b for a, b in zip(times["jkv_full"], times["jkv_one"], strict=True)
        )
        hf_dec = statistics.median(
            a - b for a, b in zip(times["hf_full"], times["hf_one"], strict=True)
        )
        decoded = batch * (new_tokens - 1)
        row = {
            "config": name,
            "params": n_params,
            "batch": batch,
            "prompt": prompt_len,
            "new_tokens": new_tokens,
            "rows_identical": f"{agree}/{batch}",
            "jkv_decode_tok_s": decoded / max(jkv_dec, 1e-9),
            "hf_decode_tok_s": decoded / max(hf_dec, 1e-9),
            "jkv_e2e_tok_s": batch * new_tokens / jkv_full,
            "hf_e2e_tok_s": batch * new_tokens / hf_full,
            "jkv_prefill_s": jkv_one,
            "hf_prefill_s": hf_one,
        }
        row["decode_ratio"] = row["jkv_decode_tok_s"] / row["hf_decode_tok_s"]
        # Every decode step streams all weights once: the bandwidth each side achieves.
        steps = {k: row[f"{k}_decode_tok_s"] / batch for k in ("jkv", "hf")}
        for k, per_s in steps.items():
            row[f"{k}_weight_gb_s"] = n_params * 4 * per_s / 1e9
        row["e2e_ratio"] = row["jkv_e2e_tok_s"] / row["hf_e2e_tok_s"]
        rows.append(row)
        print(
            f"  {name} B={batch}: jkv {row['jkv_decode_tok_s']:.1f} tok/s, transformers "
            f"{row['hf_decode_tok_s']:.1f} tok/s (decode x{row['decode_ratio']:.2f})",
            flush=True,
        )
        if profile_dir and batch == batches[0]:
            profile(params, prompts.tolist(), new_tokens, Path(profile_dir) / f"{name}-B{batch}")
    return rows


def read_bandwidth_gb_s(mb: int = 400) -> float:
    """Bytes/s of a jitted sum over a large float32 array: the ceiling for weight streaming."""
    import jax
    import jax.numpy as jnp

    x = jnp.ones((mb * 1024 * 1024 // 4,), jnp.float32)
    total = jax.jit(jnp.sum)
    total(x).block_until_ready()
    best = min(timed(lambda: total(x).block_until_ready()) for _ in range(5))
    return x.nbytes / best / 1e9


def profile(params, prompts, new_tokens, trace_dir: Path, top: int = 15) -> None:
    """Writes a jax.profiler trace of one generate call and prints the costliest ops."""
    import jax

    import jkv

    trace_dir.mkdir(parents=True, exist_ok=True)
    with jax.profiler.trace(str(trace_dir)):
        jkv.generate(params, prompts, max_new_tokens=new_tokens)
    files = sorted(trace_dir.rglob("*.xplane.pb"))
    if not files:
        print(f"  (no xplane file under {trace_dir})")
        return
    data = jax.profiler.ProfileData.from_file(str(files[-1]))
    totals: dict[str, float] = {}
    for plane in data.planes:
        for line in plane.lines:
            if not line.name.startswith("tf_XLA"):  # XLA's worker threads: one event per op
                continue
            for event in line.events:
                if not event.name.startswith("ThunkExecutor"):
                    totals[event.name] = totals.get(event.name, 0.0) + event.duration_ns
    print(f"  trace: {files[-1]}")
    print(f"  {'op':<60} {'ms':>10}")
    for op, ns in sorted(totals.items(), key=lambda kv: -kv[1])[:top]:
        print(f"  {op[:60]:<60} {ns / 1e6:>10.2f}")


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--quick", action="store_true", help="small config only, fewer repeats")
    parser.add_argument("--configs", nargs="*", default=None, choices=sorted(CONFIGS))
    parser.add_argument("--batches", nargs="*", type=int, default=[1, 8])
    parser.add_argument("--prompt", type=int, default=512)
    parser.add_argument("--new-tokens", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--profile", default=None, help="write jax.profiler traces here")
    parser.add_argument("--out", default=str(Path(__file__).parent / "results"))
    args = parser.parse_args(argv)

    import jax
    import torch

    torch.set_num_threads(THREADS)
    configs = args.configs or (["small-3M"] if args.quick else list(CONFIGS))
    repeats = 1 if args.quick else args.repeats
    ceiling = read_bandwidth_gb_s()
    print(f"read bandwidth (jitted sum over 400 MB): {ceiling:.1f} GB/s", flush=True)
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for name in configs:
            rows += bench_config(
                name,
                CONFIGS[name],
                args.batches,
                args.prompt,
                args.new_tokens,
                repeats,
                Path(tmp),
                args.profile,
            )

    header = (
        f"{'config':<10} {'B':>3} {'same':>5} {'jkv dec/s':>10} {'hf dec/s':>10} "
        f"{'x':>6} {'jkv e2e/s':>10} {'hf e2e/s':>10} {'x':>6}"
    )
    print("\n" + header + "\n" + "-" * len(header))
    for r in rows:
        print(
            f"{r['config']:<10} {r['batch']:>3} {r['rows_identical']:>5} "
            f"{r['jkv_decode_tok_s']:>10.1f} {r['hf_decode_tok_s']:>10.1f} "
            f"{r['decode_ratio']:>6.2f} {r['jkv_e2e_tok_s']:>10.1f} {r['hf_e2e_tok_s']:>10.1f} "
            f"{r['e2e_ratio']:>6.2f}"
        )
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    path = out / ("decode_cpu_quick.json" if args.quick else "decode_cpu.json")
    path.write_text(
        json.dumps(
            {
                "benchmark": "decode_cpu",
                "threads": THREADS,
                "python": sys.version.split()[0],
                "jax": jax.__version__,
                "torch": torch.__version__,
                "machine": platform.machine(),
                "cpu_count": os.cpu_count(),
                "rows": rows,
            },
            indent=2,
        )
        + "\n"
    )
    print(f"\nwrote {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
