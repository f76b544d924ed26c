"""`make demo`: the main job end to end on this machine, offline.

Until the trained demo model is bundled, this writes a tiny RANDOMLY INITIALISED Hugging Face
Llama checkpoint with transformers, converts it with `jkv convert`, and generates from it: the
text is meaningless, the pipeline (HF checkpoint -> jkv folder -> jit prefill + decode loop,
KV accounting) is real.
"""

from __future__ import annotations

import argparse
import tempfile
from pathlib import Path

import jkv


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--workdir", default=None, help="where to write the checkpoints")
    args = parser.parse_args(argv)
    from models.tiny_hf import write_tiny_checkpoint

    work = Path(args.workdir or tempfile.mkdtemp(prefix="jkv-demo-"))
    hf_dir = write_tiny_checkpoint(
        work / "hf-random-llama",
        "llama",
        hidden_size=128,
        num_layers=4,
        num_heads=4,
        num_kv_heads=2,
        intermediate_size=256,
        max_position_embeddings=1024,
    )
    print(f"[demo] wrote a tiny RANDOMLY INITIALISED HF Llama checkpoint to {hf_dir}")
    out_dir = jkv.convert(hf_dir, work / "jkv-random-llama", progress=False, overwrite=True)
    params = jkv.load(out_dir)
    cfg = params.config
    print(
        f"[demo] converted to {out_dir}: {cfg.num_params():,} parameters, {cfg.num_layers} "
        f"layers, {cfg.num_heads} heads / {cfg.num_kv_heads} kv heads"
    )
    prompts = ["w1 w2 w3 w4 w5 w6 w7 w8", "w9 w10 w11", "w42 " * 40]
    for kv_dtype in ("float32", "bfloat16"):
        results = jkv.generate(params, prompts, max_new_tokens=24, kv_dtype=kv_dtype)
        results = jkv.generate(params, prompts, max_new_tokens=24, kv_dtype=kv_dtype)  # warm
        print(f"\n[demo] batch of {len(prompts)} ragged prompts, greedy, kv_dtype={kv_dtype}")
        for prompt, r in zip(prompts, results, strict=True):
            print(f"  prompt {prompt[:24]!r:<28} -> {r.text[:60]!r} ({r.finish_reason})")
        s = results[0].stats
        print(
            f"  KV state {results[0].kv_bytes:,} bytes, "
            f"decode {s['decode_tokens_per_s']:.0f} tokens/s, prefill {s['prefill_s'] * 1e3:.1f} ms"
        )
    cache = jkv.ResponseCache()  # L1 only; pass a redis:// URL to share it between nodes
    first = jkv.generate(params, prompts[0], max_new_tokens=24, cache=cache)
    again = jkv.generate(params, "  " + prompts[0].replace(" ", "  ") + "\n", max_new_tokens=24,
                         cache=cache)
    print(f"\n[demo] response cache: first call answered by {first.cache or 'the model'}, a "
          f"whitespace variant by {again.cache} (same text: {again.text == first.text})")
    print("\n[demo] streaming: ", end="")
    for piece in jkv.stream(params, "w1 w2 w3", max_new_tokens=12):
        print(piece, end="", flush=True)
    print("\n[demo] (random weights: the words are noise; the trained demo model replaces this)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
