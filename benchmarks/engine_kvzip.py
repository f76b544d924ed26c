"""KVzip served by `jkv.Engine` on SmolLM2-135M-Instruct, beside `jkv.generate`'s one-shot KVzip
in the same process: a chat prompt of about 1K tokens of real text (Python's own help topics),
16 greedy new tokens, KVzip at 25%.

    python benchmarks/engine_kvzip.py     # prints the table, writes results/engine_kvzip.json

Rows: the engine's warmup with KVzip's programs (its replay pieces' programs timed apiece), the
engine's KVzip request (run twice: the second is the warm figure), the engine's full-cache
request, the one-shot KVzip path (twice), the programs the engine built after its warmup
(expected 0) and whether the engine's tokens equal the one-shot path's. Wall seconds on this
machine: the ratios mean more than the seconds.
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
import time
from pathlib import Path

import jkv
from jkv.chat import chat_prompt
from jkv.compile_time import programs_built
from jkv.engine.engine import Engine
from jkv.policies import KVzip


def prompt_ids(params, chars: int) -> list[int]:
    import pydoc_data.topics as topics

    text = " ".join(topics.topics.values())[:chars]
    message = text + "\nSummarise the text above in one sentence."
    return chat_prompt(params, [{"role": "user", "content": message}])


def timed(fn):
    t0 = time.perf_counter()
    out = fn()
    return out, time.perf_counter() - t0


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="smollm2")
    ap.add_argument("--chars", type=int, default=4000, help="characters of text in the prompt")
    ap.add_argument("--new-tokens", type=int, default=16)
    ap.add_argument("--budget", type=float, default=0.25)
    ap.add_argument("--out", default=str(Path(__file__).parent / "results"))
    args = ap.parse_args(argv)

    params = jkv.load(args.model)
    ids = prompt_ids(params, args.chars)
    policy = KVzip(budget=args.budget)
    engine = Engine(params, max_running=4)
    replay, last = {}, [0.0]

    def progress(done, total, label, seconds):  # seconds: since the warmup began
        if label.startswith("kvzip replay"):
            replay[label] = round(seconds - last[0], 2)
        last[0] = seconds

    _, warmup_s = timed(lambda: engine.warmup(kv_policies=["kvzip"], progress=progress))
    built = programs_built()
    run = lambda **kw: engine.generate([ids], max_new_tokens=args.new_tokens, **kw)[0]  # noqa: E731
    cold, cold_s = timed(lambda: run(kv_policy=policy))
    warm, warm_s = timed(lambda: run(kv_policy=policy))
    _, full_s = timed(lambda: run())
    after = programs_built() - built
    one = lambda: list(jkv.generate(params, ids, kv_policy=policy,  # noqa: E731
                                    max_new_tokens=args.new_tokens).tokens)  # fmt: skip
    _, one_cold_s = timed(one)
    ref, one_s = timed(one)
    rows = [
        ("engine warmup, every program KVzip needs (s)", round(warmup_s, 1)),
        ("  of which KVzip's replay pieces (s)", round(sum(replay.values()), 1)),
        ("engine KVzip request, first after warmup (s)", round(cold_s, 2)),
        ("engine KVzip request, again (s)", round(warm_s, 2)),
        ("engine full-cache request (s)", round(full_s, 2)),
        ("jkv.generate KVzip, first (compiles) (s)", round(one_cold_s, 2)),
        ("jkv.generate KVzip, again (s)", round(one_s, 2)),
        ("engine / jkv.generate, warm", round(warm_s / one_s, 2)),
        ("programs the engine built after warmup", after),
        ("engine tokens == jkv.generate tokens", cold == warm == ref),
    ]
    print(f"KVzip {args.budget:g} on {args.model}, a {len(ids)}-token chat prompt, "
          f"{args.new_tokens} new tokens")  # fmt: skip
    print("| measure | value |\n|---|---|")
    for name, value in rows:
        print(f"| {name} | {value} |")
    report = {
        "model": args.model, "prompt_tokens": len(ids), "new_tokens": args.new_tokens,
        "budget": args.budget, "rows": dict(rows), "replay_programs_s": replay,
        "text": params.tokenizer.decode(warm), "machine": platform.platform(),
        "python": sys.version.split()[0],
    }  # fmt: skip
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "engine_kvzip.json").write_text(json.dumps(report, indent=1) + "\n")
    print(f"wrote {out / 'engine_kvzip.json'}")
    return 0 if after == 0 and cold == warm == ref else 1


if __name__ == "__main__":
    sys.exit(main())
