"""`make demo`: the main job end to end on this machine, offline.

Loads the bundled demo model (a small Llama trained by jkv's own `models/train_demo.py` to find
a 5-digit code hidden in filler text), builds a haystack prompt, and answers it with the full
cache, StreamingLLM, SnapKV and SnapKV + FP8 KV, printing for each the answer, whether it is
right, the KV bytes and the decode speed; then answers again through the response cache.
"""

from __future__ import annotations

import argparse

import numpy as np

import jkv


def _rows(params, prompt: str, answer: str, ratio: float):
    n = len(params.tokenizer.encode(prompt))
    settings = [
        ("full cache", dict()),
        (f"StreamingLLM {ratio:.0%}", dict(kv_policy="streaming", kv_budget=ratio)),
        (f"SnapKV {ratio:.0%}", dict(kv_policy="snapkv", kv_budget=ratio)),
        (
            f"SnapKV {ratio:.0%} + FP8",
            dict(kv_policy="snapkv", kv_budget=ratio, kv_dtype="float8_e4m3fn"),
        ),
    ]
    print(f"\n[demo] prompt: {n} tokens, {prompt[:70]} ... {prompt[-44:]}")
    print(f"[demo] expected answer: {answer}\n")
    print(
        f"{'setting':<22} {'answer':<12} {'right':<6} {'KV bytes':>12} {'vs full':>8} "
        f"{'decode tok/s':>13}"
    )
    full_bytes = None
    for label, kw in settings:
        jkv.generate(params, prompt, max_new_tokens=6, **kw)  # compile once, time the second
        r = jkv.generate(params, prompt, max_new_tokens=6, **kw)
        got = " ".join(r.text.split()[:5])
        full_bytes = full_bytes or r.kv_bytes
        print(
            f"{label:<22} {got:<12} {'yes' if got == answer else 'no':<6} {r.kv_bytes:>12,} "
            f"{r.kv_bytes / full_bytes:>8.1%} {r.stats['decode_tokens_per_s']:>13.0f}"
        )
    print(
        "(a policy that drops the fact's tokens loses the answer; benchmarks/quality.py measures "
        "how often, per policy and budget)"
    )


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--seed", type=int, default=3)
    parser.add_argument("--ratio", type=float, default=0.25, help="kept fraction of the prompt")
    args = parser.parse_args(argv)
    from jkv_models.haystack import make_example, make_filler

    params = jkv.load("demo")
    cfg = params.config
    print(
        f"[demo] {params.name}: {cfg.num_params():,} parameters, {cfg.num_layers} layers, "
        f"{cfg.num_heads} heads / {cfg.num_kv_heads} kv heads, trained context "
        f"{cfg.max_position_embeddings} tokens (models/demo, trained by models/train_demo.py)"
    )
    rng = np.random.default_rng(args.seed)
    # One needle: the model copies a fact's code from any depth but never learned to tell two
    # facts apart by name (models/demo/training.json has its held-out figures).
    ex = make_example(rng, cfg.max_position_embeddings, 1)
    _rows(params, ex.prompt, ex.answer, args.ratio)

    cache = jkv.ResponseCache()  # L1 only; pass a redis:// URL to share it between nodes
    first = jkv.generate(params, ex.prompt, max_new_tokens=6, cache=cache)
    again = jkv.generate(
        params, "  " + ex.prompt.replace(" ", "  ") + "\n", max_new_tokens=6, cache=cache
    )
    print(
        f"\n[demo] response cache: the first call was answered by "
        f"{first.cache or 'the model'} ({first.stats['prefill_s'] * 1e3:.0f} ms prefill), a "
        f"whitespace variant by {again.cache} (same answer: {again.text == first.text})"
    )

    text = make_filler(rng, 24)
    print("\n[demo] free text, streamed: " + text + " ", end="")
    for piece in jkv.stream(params, text, max_new_tokens=24):
        print(piece, end="", flush=True)
    print()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
