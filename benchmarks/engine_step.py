"""One engine step's time when rows differ in length: 16 decoding rows of 32 tokens, one
decoding row of 1,000 tokens, and both in one step (issue 27's goal: the mixed step <= 1.5x
the two alone, added).

    python benchmarks/engine_step.py [--model demo|125m] [--steps 30]

Each case builds an engine (pages of 16, float32), adds its requests, steps until every row is
decoding, then times `--steps` more `engine.step()` calls (median; host work included: it is
what a request waits for); the cases run interleaved `--repeats` times, the best median kept. Random float32 checkpoints written by transformers, no eos. The
script runs unchanged on the engine before issue 27 (commit 03c7c01, every row gathered into
a dense copy padded to the longest row), which gives the "before" rows.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import random
import statistics
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

SHAPES = {
    "demo": dict(hidden_size=128, num_layers=4, num_heads=4, num_kv_heads=2,
                 intermediate_size=512, vocab_size=392, max_position_embeddings=2048),
    "125m": dict(hidden_size=1024, num_layers=6, num_heads=16, num_kv_heads=4,
                 intermediate_size=4096, vocab_size=16384, max_position_embeddings=2048),
}  # fmt: skip
CASES = {"16 x 32": [32] * 16, "1 x 1000": [1000], "16 x 32 + 1 x 1000": [32] * 16 + [1000]}


def time_case(params, lengths, steps: int) -> float:
    """Median ms of a decode step with rows of `lengths` tokens (prompts; they stay within a
    few tokens of it while timed)."""
    engine = jkv.Engine(params, num_pages=8192, page_size=16, token_budget=1024, chunk=1024,
                        max_running=32, max_model_len=2048)  # fmt: skip
    rng = random.Random(len(lengths))
    vocab = params.config.vocab_size
    for n in lengths:
        engine.add_request(
            [rng.randrange(3, vocab) for _ in range(n)], max_new_tokens=2 * steps + 8
        )
    while any(s.prefilling for s in engine.scheduler.running) or engine.scheduler.waiting:
        engine.step()
    for _ in range(3):  # compiles this shape
        engine.step()
    times = []
    for _ in range(steps):
        t0 = time.perf_counter()
        outs = engine.step()
        times.append((time.perf_counter() - t0) * 1e3)
        assert len(outs) == len(lengths)
    return statistics.median(times)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", choices=list(SHAPES), default="demo")
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--repeats", type=int, default=3, help="rounds over the cases (noisy CPUs)")
    ap.add_argument("--out", default=str(Path(__file__).parent / "results"))
    ap.add_argument("--stem", default=None)
    args = ap.parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        params = jkv.load(write_tiny_checkpoint(Path(tmp) / "m", "llama", **SHAPES[args.model]))
        runs = {name: [] for name in CASES}
        for _ in range(args.repeats):  # the cases interleaved; the best median of each
            for name, lengths in CASES.items():
                runs[name].append(time_case(params, lengths, args.steps))
        ms = {name: min(v) for name, v in runs.items()}
    ratio = ms["16 x 32 + 1 x 1000"] / (ms["16 x 32"] + ms["1 x 1000"])
    print(f"decode step, model {args.model}, CPU ({os.cpu_count()} cores), best of "
          f"{args.repeats} medians of {args.steps} steps (host work included)")  # fmt: skip
    for name, v in ms.items():
        print(f"{name:>20s}  {v:8.2f} ms")
    print(f"{'mixed / (short + long)':>20s}  {ratio:8.2f}   (goal <= 1.5)")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    stem = args.stem or f"engine_step_{args.model}"
    report = dict(model=args.model, shape=SHAPES[args.model], steps=args.steps, ms=ms, runs=runs,
                  ratio=round(ratio, 3),
                  machine=dict(python=platform.python_version(), cpus=os.cpu_count()))  # fmt: skip
    (out / f"{stem}.json").write_text(json.dumps(report, indent=1) + "\n")
    print(f"wrote {out / (stem + '.json')}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
