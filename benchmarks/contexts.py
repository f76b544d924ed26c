"""A document compressed once, asked many questions: what a KV context (`jkv.KVContext`) saves.

    python benchmarks/contexts.py                        # SmolLM2, a 4,000-token document
    python benchmarks/contexts.py --tokens 2000 --fp8    # + each configuration with fp8 pages

The document is real English (CPython's docs, `jkv.demo.real_text`) with `--questions` planted
facts ("One of the special magic numbers for <key> is: <5 digits>.") at spread depths, in
SmolLM2's chat; question i asks for fact i. For the full cache, SnapKV 25% and KVzip 25%
(question-agnostic: the document is compressed before any question), on one `jkv.Engine`:

- the context made by the engine (`Engine.prefill`), its seconds and `nbytes`;
- its bytes written and read (`to_bytes` / `KVContext.from_bytes`, GB/s: the payload a Redis
  tier would move, without the network);
- TTFT of each question asked after the context kept in host RAM (`add_request(kv_state=)`:
  its slots written into the pool, the question prefilled after them), one after another, and
  all of them at once; against TTFT of recomputing the document with the question (a fresh
  prefix-cache salt per request: nothing reused), `--recompute` questions;
- answers right out of the questions, against the full cache recomputed each time;
- the peer: `transformers` (the same weights, exported) prefilling document + question, timed
  the same way (a forward pass to the first token), `--recompute` questions.

Compiles are excluded (one context made and one question asked per configuration first).
Prints a table and writes benchmarks/results/contexts.json. Not measured here: a context's
pages kept in the pool between requests, a Redis tier, another replica (not built yet).
"""

from __future__ import annotations

import argparse
import itertools
import json
import platform
import statistics
import sys
import time
from pathlib import Path

import jax
import numpy as np

import jkv
from jkv.chat import render, special_tokens
from jkv.demo import real_text as rt
from jkv.engine.engine import Engine

RESULTS = Path(__file__).resolve().parent / "results"
SALTS = itertools.count()  # prefix-cache salts: never one twice in a process
PAGE = 16
CONFIGS = {"full": {}, "SnapKV 25%": dict(kv_policy="snapkv", kv_budget=0.25),
           "KVzip 25%": dict(kv_policy="kvzip", kv_budget=0.25)}  # fmt: skip


def document(params, tokens: int, n: int, seed: int = 0):
    """(context ids, [(question ids, answer)]): `n` facts planted at spread depths in about
    `tokens` tokens of real text, one question per fact."""
    rng = np.random.default_rng(seed)
    tok = params.tokenizer
    keys = [rt.KEYS[i % len(rt.KEYS)] + ("" if i < len(rt.KEYS) else str(i)) for i in range(n)]
    values = [str(int(v)) for v in rng.integers(10_000, 100_000, size=n)]
    text = list(rt._haystack(tok, tokens, rng))
    spots = [round(d * len(text)) for d in np.linspace(0.05, 0.95, n)]
    for spot, key, value in sorted(zip(spots, keys, values, strict=True), reverse=True):
        text.insert(spot, rt.NEEDLE.format(key=key, value=value))
    body = f"{rt.INTRO}\n\n{' '.join(text)}"
    context, questions = None, []
    for key, value in zip(keys, values, strict=True):
        content = f"{body}{rt._SPLIT}\n\n{rt.QUESTION.format(key=key)}"
        rendered = render([{"role": "user", "content": content}], tok.chat_template,
                          special_tokens(params))  # fmt: skip
        head, tail = rendered.split(rt._SPLIT)
        context = tok.encode(head, add_special_tokens=False)
        tail += rt.ANSWER_PREFIX.format(key=key)
        questions.append((tok.encode(tail, add_special_tokens=False), value))
    return context, questions


def ttfts(engine, prompts, new_tokens: int, settings):
    """Adds every prompt at once; (TTFT per prompt in seconds, its text)."""
    t0 = time.perf_counter()
    rids = [engine.add_request(p, max_new_tokens=new_tokens, temperature=0.0, **settings(i))
            for i, p in enumerate(prompts)]  # fmt: skip
    first, tokens = {}, {r: [] for r in rids}
    while engine.has_work:
        for out in engine.step():
            if out.new_tokens and out.request_id not in first:
                first[out.request_id] = time.perf_counter() - t0
            tokens[out.request_id] += out.new_tokens
    texts = [engine.params.tokenizer.decode(tokens[r]) for r in rids]
    return [first[r] for r in rids], texts


def via_redis(url: str, weights: str, ctx, blob: bytes, engine, qs, new_tokens: int) -> dict:
    """The context written to Redis and read back (`jkv.serve.contexts.RedisContexts`, GB/s),
    and TTFT of a question whose context comes from Redis (read, checked, decoded, written into
    the pool), `len(qs)` questions."""
    from jkv.serve.contexts import Entry, RedisContexts

    store = RedisContexts(url, weights, timeout_s=30.0)
    now = int(time.time())
    entry = Entry(id=f"ctx-bench-{now}", tenant=None, tokens=ctx.tokens[0], settings={},
                  kv_policy="bench", nbytes=ctx.nbytes, created=now, expires_at=now + 600)  # fmt: skip
    t0 = time.perf_counter()
    store.save(entry, blob, ttl=600)
    save_s = time.perf_counter() - t0
    t0 = time.perf_counter()
    assert store.load(entry) == blob
    load_s = time.perf_counter() - t0
    ttft = []
    for q in qs:  # a fresh read each time: nothing of the last one's decoding is kept
        t0 = time.perf_counter()
        back = jkv.KVContext.from_bytes(store.load(entry))
        read_s = time.perf_counter() - t0
        t, _ = ttfts(engine, [q], new_tokens, settings=lambda i, back=back: dict(kv_state=back))
        ttft.append(read_s + t[0])
    store.delete(entry)
    return dict(redis_save_gbps=len(blob) / save_s / 1e9, redis_load_gbps=len(blob) / load_s / 1e9,
                ttft_redis_p50=statistics.median(ttft), ttft_redis=ttft)  # fmt: skip


def one_config(engine, doc, questions, settings: dict, new_tokens: int, recompute: int,
               redis_url: str | None = None) -> dict:  # fmt: skip
    salt = SALTS  # a fresh prefix-cache salt per request: nothing reused
    engine.prefill(doc, cache_salt=f"c{next(salt)}", **settings)  # compiles: excluded
    t0 = time.perf_counter()
    ctx = engine.prefill(doc, cache_salt=f"c{next(salt)}", **settings)
    made_s = time.perf_counter() - t0
    t0 = time.perf_counter()
    blob = ctx.to_bytes()
    save_s = time.perf_counter() - t0
    t0 = time.perf_counter()
    back = jkv.KVContext.from_bytes(blob)
    jax.block_until_ready(back.layers[-1].k)
    load_s = time.perf_counter() - t0
    qs = [q for q, _ in questions]
    for q in qs:  # compiles (each question's own shapes)
        ttfts(engine, [q], 2, settings=lambda i: dict(kv_state=ctx))
    seq, texts = [], []
    for q in qs:  # one after another
        t, text = ttfts(engine, [q], new_tokens, settings=lambda i: dict(kv_state=ctx))
        seq += t
        texts += text
    ttfts(engine, qs, 2, settings=lambda i: dict(kv_state=ctx))  # compiles
    together, _ = ttfts(engine, qs, new_tokens, settings=lambda i: dict(kv_state=ctx))
    again = []
    for q in qs[:recompute]:  # compiles (a question's last chunk may be another bucket)
        ttfts(engine, [doc + q], 2, settings=lambda i: dict(cache_salt=f"w{next(salt)}", **settings))  # fmt: skip
    for q in qs[:recompute]:  # the document recomputed with the question, nothing reused
        t, _ = ttfts(engine, [doc + q], 2, settings=lambda i: dict(cache_salt=f"r{next(salt)}", **settings))  # fmt: skip
        again += t
    remote = {}
    if redis_url is not None:
        remote = via_redis(redis_url, engine.params.version, ctx, blob, engine, qs[:recompute],
                           new_tokens)  # fmt: skip
    right = sum(
        rt.answered(text, answer) for text, (_, answer) in zip(texts, questions, strict=True)
    )
    return dict(
        context_s=made_s, bytes=ctx.nbytes, blob_bytes=len(blob),
        save_gbps=len(blob) / save_s / 1e9, load_gbps=len(blob) / load_s / 1e9,
        ttft_cached_p50=statistics.median(seq), ttft_cached=seq,
        ttft_together_p50=statistics.median(together), ttft_together_max=max(together),
        ttft_recompute_p50=statistics.median(again), ttft_recompute=again,
        speedup=statistics.median(again) / statistics.median(seq),
        right=right, questions=len(questions), answers=texts, **remote,
    )  # fmt: skip


def peer(params, doc, questions, recompute: int) -> dict:
    """transformers prefilling document + question to its first token (the same weights)."""
    import tempfile

    import torch
    from transformers import AutoModelForCausalLM

    folder = jkv.export_hf(params, Path(tempfile.mkdtemp()) / "hf")
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    times = []
    with torch.no_grad():
        model(input_ids=torch.tensor([doc + questions[0][0]]))  # warm
        for q, _ in questions[:recompute]:
            t0 = time.perf_counter()
            model(input_ids=torch.tensor([doc + q])).logits[0, -1].argmax()
            times.append(time.perf_counter() - t0)
    return dict(ttft_recompute_p50=statistics.median(times), ttft_recompute=times,
                torch=torch.__version__, threads=torch.get_num_threads())  # fmt: skip


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="smollm2")
    ap.add_argument("--tokens", type=int, default=4000, help="the document's tokens (about)")
    ap.add_argument("--questions", type=int, default=10)
    ap.add_argument("--new-tokens", type=int, default=8)
    ap.add_argument("--recompute", type=int, default=2, help="questions timed recomputing it")
    ap.add_argument("--configs", nargs="+", default=list(CONFIGS), choices=list(CONFIGS))
    ap.add_argument("--fp8", action="store_true", help="each configuration in fp8 pages too")
    ap.add_argument("--no-peer", action="store_true")
    ap.add_argument("--redis-url", default=None, help="time the Redis tier there too")
    ap.add_argument("--out", default=str(RESULTS / "contexts.json"))
    args = ap.parse_args(argv)

    params = jkv.load(args.model)
    doc, questions = document(params, args.tokens, args.questions)
    longest = len(doc) + max(len(q) for q, _ in questions) + args.new_tokens
    rows = []
    for dtype in ["float32"] + (["float8_e4m3fn"] if args.fp8 else []):
        pages = 3 * args.questions * (-(-longest // PAGE) + 2) * params.config.num_layers * \
            params.config.num_kv_heads  # fmt: skip
        engine = Engine(params, num_pages=pages, page_size=PAGE, token_budget=512, chunk=512,
                        max_running=args.questions, kv_dtype=dtype,
                        max_model_len=-(-(longest + 8) // PAGE) * PAGE * 2)  # fmt: skip
        for name in args.configs:
            got = one_config(engine, doc, questions, CONFIGS[name], args.new_tokens,
                             args.recompute, args.redis_url)  # fmt: skip
            rows.append(dict(config=name, kv_dtype=dtype, **got))
            print(
                f"  {name} {dtype}: {got['ttft_cached_p50'] * 1e3:.0f} ms cached, "
                f"{got['ttft_recompute_p50'] * 1e3:.0f} ms recomputed",
                flush=True,
            )
    full = next(r for r in rows if r["config"] == "full" and r["kv_dtype"] == "float32")
    for r in rows:
        r["bytes_vs_full"] = r["bytes"] / full["bytes"]
    the_peer = None if args.no_peer else peer(params, doc, questions, args.recompute)
    print(f"\n{args.model}: a {len(doc)}-token document, {args.questions} questions, "
          f"{args.new_tokens} tokens each (jkv {jkv.__version__}, jax {jax.__version__}, "
          f"{platform.machine()})")  # fmt: skip
    print(f"{'config':<12} {'kv':<8} {'KV bytes':>12} {'vs full':>8} {'make s':>7} "
          f"{'save GB/s':>9} {'load GB/s':>9} {'TTFT ms':>8} {'all at once':>11} "
          f"{'recompute':>9} {'x':>6} {'right':>6}")  # fmt: skip
    for r in rows:
        print(f"{r['config']:<12} {r['kv_dtype'][:8]:<8} {r['bytes']:>12,} "
              f"{r['bytes_vs_full']:>8.3f} {r['context_s']:>7.2f} {r['save_gbps']:>9.2f} "
              f"{r['load_gbps']:>9.2f} {r['ttft_cached_p50'] * 1e3:>8.0f} "
              f"{r['ttft_together_max'] * 1e3:>11.0f} {r['ttft_recompute_p50'] * 1e3:>9.0f} "
              f"{r['speedup']:>6.1f} {r['right']:>3}/{r['questions']}")  # fmt: skip
    for r in rows:
        if "redis_load_gbps" in r:
            print(
                f"{r['config']} {r['kv_dtype']}: Redis {r['redis_save_gbps']:.2f} GB/s "
                f"written, {r['redis_load_gbps']:.2f} GB/s read; TTFT with the context "
                f"read from Redis {r['ttft_redis_p50'] * 1e3:.0f} ms, "
                f"{r['ttft_recompute_p50'] / r['ttft_redis_p50']:.1f}x below recomputing"
            )
    if the_peer is not None:
        print(
            f"transformers: document + question to the first token "
            f"{the_peer['ttft_recompute_p50'] * 1e3:.0f} ms (P50 of {args.recompute})"
        )
    out = dict(model=args.model, tokens=len(doc), questions=args.questions,
               new_tokens=args.new_tokens, rows=rows, peer=the_peer, jax=jax.__version__,
               machine=platform.machine(), command=" ".join(sys.argv))  # fmt: skip
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(out, indent=1))
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
