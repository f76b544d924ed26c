"""KV-cache bytes per policy (shapes only) and CPU decode speed per policy vs generated length.

Part 1, memory: `jkv.memory` (the same sizing `jkv.generate` allocates with) for the
Llama-3.1-8B preset at contexts 1K..128K, batch 1 and 32, per policy and KV dtype; the seed's
2.1 worked example checked; the savings goals (FP8 >= 49%, SnapKV 10% + FP8 >= 94.5%) checked.
Part 2, speed: greedy decode tokens/s on a small random model for growing generation lengths,
full cache vs policies (StreamingLLM should stay flat, the full cache should fall).

    python benchmarks/kv_memory.py [--quick] [--out benchmarks/results]
Writes kv_memory.json, kv_memory.png and kv_decode.png.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
from pathlib import Path

# tests/tiny_hf.py, the tests' fixture writer of tiny random Hugging Face checkpoints (it
# imports torch and transformers only when it writes one).
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
from tiny_hf import write_tiny_checkpoint  # noqa: E402

os.environ.setdefault(
    "XLA_FLAGS", "--xla_cpu_multi_thread_eigen=true intra_op_parallelism_threads=2"
)

CONTEXTS = [1024, 2048, 4096, 8192, 16384, 32768, 65536, 131072]
# (label, kv_dtype, kv_policy, kv_budget)
SETTINGS = [
    ("full bf16", "bfloat16", None, None),
    ("full fp8", "float8_e4m3fn", None, None),
    ("streaming 10%", "bfloat16", "streaming", 0.1),
    ("snapkv 10%", "bfloat16", "snapkv", 0.1),
    ("snapkv 10% + fp8", "float8_e4m3fn", "snapkv", 0.1),
    ("snapkv_segments 10%", "bfloat16", "snapkv_segments", 0.1),
    ("pyramidkv 10%", "bfloat16", "pyramidkv", 0.1),
    ("h2o 10%", "bfloat16", "h2o", 0.1),
    ("adakv 10% (allocated)", "bfloat16", "adakv", 0.1),
    ("efficache 10%", "bfloat16", "efficache", 0.1),
    ("quantile q=0.3", "bfloat16", "quantile", 0.7),
]


def memory_table(model: str = "llama-3.1-8b"):
    import jkv

    rows = []
    for batch in (1, 32):
        for label, dtype, policy, budget in SETTINGS:
            for ctx in CONTEXTS:
                r = jkv.memory(
                    model, batch, ctx, kv_dtype=dtype, kv_policy=policy, kv_budget=budget
                )
                rows.append(
                    {
                        "setting": label,
                        "batch": batch,
                        "context": ctx,
                        "bytes": r.total,
                        "slots_layer0": r.slots[0],
                    }
                )
    return rows


def check_goals(rows):
    import jkv

    # the seed example counts the context alone: no decode headroom
    seed = jkv.memory("llama-2-7b", 8, 2048, max_new_tokens=0, kv_dtype="float16")
    by = {(r["setting"], r["batch"], r["context"]): r["bytes"] for r in rows}
    full = by[("full bf16", 1, 131072)]
    fp8_saving = 1 - by[("full fp8", 1, 131072)] / full
    snap_saving = 1 - by[("snapkv 10% + fp8", 1, 131072)] / full
    return {
        "seed_example_bytes_per_layer": seed.per_layer[0],
        "seed_example_ok": seed.per_layer[0] == 268_435_456,
        "fp8_saving": fp8_saving,
        "fp8_goal_met": fp8_saving >= 0.49,
        "snapkv10_fp8_saving": snap_saving,
        "snapkv10_fp8_goal_met": snap_saving >= 0.945,
    }


def decode_speed(lengths, prompt_len: int, settings):
    """tokens/s of greedy decoding per setting and generated length (small random model)."""
    import numpy as np

    import jkv

    with tempfile.TemporaryDirectory() as tmp:
        folder = write_tiny_checkpoint(
            Path(tmp) / "m",
            "llama",
            hidden_size=256,
            num_layers=4,
            num_heads=8,
            num_kv_heads=2,
            intermediate_size=688,
            vocab_size=512,
            max_position_embeddings=8192,
            initializer_range=0.02,
        )
        params = jkv.load(folder)
    prompt = np.random.default_rng(0).integers(3, 512, size=prompt_len).tolist()
    rows = []
    for label, policy, budget in settings:
        for n in lengths:
            kw = dict(max_new_tokens=n, kv_policy=policy, kv_budget=budget)
            jkv.generate(params, prompt, **kw)  # compile
            best = max(
                jkv.generate(params, prompt, **kw).stats["decode_tokens_per_s"] for _ in range(2)
            )
            res = jkv.generate(params, prompt, **kw)
            rows.append(
                {"setting": label, "generated": n, "tokens_per_s": best, "kv_bytes": res.kv_bytes}
            )
            print(
                f"  decode {label:<16} {n:>6} tokens: {best:8.1f} tok/s, KV {res.kv_bytes:,} bytes",
                flush=True,
            )
    return rows


def plot(mem_rows, dec_rows, out: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(13, 5), sharey=False)
    for ax, batch in zip(axes, (1, 32), strict=True):
        for label, *_ in SETTINGS:
            pts = [
                (r["context"], r["bytes"])
                for r in mem_rows
                if r["setting"] == label and r["batch"] == batch
            ]
            ax.plot([p[0] for p in pts], [p[1] / 2**30 for p in pts], marker="o", label=label)
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel("context tokens")
        ax.set_ylabel("KV cache GiB")
        ax.set_title(f"Llama-3.1-8B KV bytes, batch {batch}")
        ax.grid(True, which="both", alpha=0.3)
    axes[1].legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(out / "kv_memory.png", dpi=120)
    plt.close(fig)

    if dec_rows:
        fig, ax = plt.subplots(figsize=(6.5, 4.5))
        for label in dict.fromkeys(r["setting"] for r in dec_rows):
            pts = [(r["generated"], r["tokens_per_s"]) for r in dec_rows if r["setting"] == label]
            ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=label)
        ax.set_xscale("log", base=2)
        ax.set_xlabel("generated tokens")
        ax.set_ylabel("decode tokens/s (CPU, 2 threads)")
        ax.set_title("decode speed vs generated length")
        ax.grid(True, alpha=0.3)
        ax.legend()
        fig.tight_layout()
        fig.savefig(out / "kv_decode.png", dpi=120)
        plt.close(fig)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--quick", action="store_true", help="memory table + a short decode run")
    parser.add_argument("--out", default=str(Path(__file__).parent / "results"))
    args = parser.parse_args(argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)

    mem = memory_table()
    goals = check_goals(mem)
    print(f"{'setting':<24} {'B':>3} " + " ".join(f"{c // 1024:>7}K" for c in CONTEXTS))
    for batch in (1, 32):
        for label, *_ in SETTINGS:
            cells = [
                r["bytes"] / 2**30 for r in mem if r["setting"] == label and r["batch"] == batch
            ]
            print(f"{label:<24} {batch:>3} " + " ".join(f"{c:>8.3f}" for c in cells))
    print("(GiB of KV cache, Llama-3.1-8B: 32 layers, 8 kv heads, head dim 128)")
    print(
        f"seed 2.1 example (b=8, L=2048, 32 heads, d=128, fp16): "
        f"{goals['seed_example_bytes_per_layer']:,} bytes per layer "
        f"({'ok' if goals['seed_example_ok'] else 'MISMATCH'})"
    )
    print(
        f"FP8 saves {goals['fp8_saving']:.1%} (goal >= 49%, seed 47.2%); SnapKV 10% + FP8 saves "
        f"{goals['snapkv10_fp8_saving']:.1%} (goal >= 94.5%)"
    )

    lengths = [64, 256] if args.quick else [128, 512, 2048]
    settings = [
        ("full", None, None),
        ("streaming 128", "streaming", 128),
        ("snapkv 128", "snapkv", 128),
        ("snapkv_segments 128", "snapkv_segments", 128),
        ("h2o 128", "h2o", 128),
    ]
    dec = decode_speed(lengths, 256, settings)
    plot(mem, dec, out)
    path = out / ("kv_memory_quick.json" if args.quick else "kv_memory.json")
    path.write_text(
        json.dumps(
            {"benchmark": "kv_memory", "goals": goals, "memory": mem, "decode": dec}, indent=2
        )
        + "\n"
    )
    print(f"wrote {path}, {out / 'kv_memory.png'}, {out / 'kv_decode.png'}")
    ok = goals["seed_example_ok"] and goals["fp8_goal_met"] and goals["snapkv10_fp8_goal_met"]
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
