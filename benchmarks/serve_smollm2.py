"""`jkv serve smollm2` on the real model: start-up, a burst of mixed-policy chats, and load beside
`transformers serve` (continuous batching) on the same weights.

Parts (`--parts`, default all):
  start   `jkv serve smollm2 --warmup` from a cold compilation cache (a new folder) and again
          from the warm one: seconds from launch to /health answering 200, the programs warmup
          built (/metrics `jkv:programs_built`).
  burst   64 streamed chat requests sent at once, each a passage of real English text (CPython's
          `pydoc_data.topics`, 150-400 tokens) with a number planted in it and a question about
          it, `max_tokens` 24, greedy, the KV policy cycling through the full cache, SnapKV,
          PyramidKV, Ada-KV, Quantile and StreamingLLM at a 50% budget (EffiCache, served too, is
          left out: its gradient pass over each prompt costs seconds on a CPU, `--burst-policies`
          adds it): completed, TTFT P50 / P99, programs built while serving (0 after warmup).
  load    closed loop at 64 clients (`--clients`), 128 requests of the same kind (full cache):
          jkv vs `transformers serve --continuous-batching` on SmolLM2 exported to a Hugging
          Face folder (the same float32 weights and chat template), output tok/s and the ratio.

    python benchmarks/serve_smollm2.py [--parts start,burst,load] [--peer-exe .venv-peer/bin/transformers]
Writes benchmarks/results/serve_smollm2.json.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import random
import sys
import tempfile
import time
from pathlib import Path

import httpx
from serve_load import Proc, closed_loop, peer_server, scrape, summarise

ROOT = Path(__file__).resolve().parents[1]
BURST_POLICIES = ["none", "snapkv", "pyramidkv", "adakv", "quantile", "streaming"]


def passages(n: int, seed: int) -> list[dict]:
    """Chat requests: a passage of real text with a planted number, and a question about it."""
    import pydoc_data.topics

    text = " ".join(" ".join(pydoc_data.topics.topics.values()).split())
    rng = random.Random(seed)
    out = []
    for i in range(n):
        start = rng.randrange(0, len(text) - 3000)
        words = text[start : start + rng.randint(700, 1800)].split(" ")[1:-1]
        number = rng.randrange(1000, 9999)
        words.insert(len(words) // 2, f"(The secret number is {number}.)")
        ask = "What is the secret number in the text above? Answer with the number only."
        out.append({"id": i, "number": number, "max_tokens": 24,
                    "messages": [{"role": "user", "content": " ".join(words) + "\n\n" + ask}]})  # fmt: skip
    return out


def ready_seconds(cache: Path, extra=()) -> tuple[float, Proc]:
    """Launches `jkv serve smollm2 --warmup` with its compilation cache in `cache`; returns the
    seconds until /health answered and the running process."""
    t0 = time.perf_counter()
    proc = Proc(
        [sys.executable, "-m", "jkv.cli", "serve", "smollm2", "--port", "{port}",
         "--warmup", "--max-running", "32", "--no-response-cache", "--log-level", "warning",
         *extra],
        "/health",
        env={"JKV_COMPILE_CACHE": str(cache)},
    )  # fmt: skip
    return time.perf_counter() - t0, proc


def part_start(out: dict) -> None:
    with tempfile.TemporaryDirectory(prefix="jkv-cache-") as cache:
        rows = []
        for label in ("cold", "warm"):
            seconds, proc = ready_seconds(Path(cache))
            built = scrape(proc.url).get("jkv:programs_built_total")
            proc.stop()
            rows.append({"start": label, "ready_s": round(seconds, 1), "programs": built})
            print(f"  {label}: ready after {seconds:.1f} s, {built:.0f} programs")
    out["start"] = rows


async def burst(url: str, items: list[dict], policies: list[str]) -> list[dict]:
    from serve_load import request

    async with httpx.AsyncClient(timeout=1200, limits=httpx.Limits(max_connections=256)) as c:
        tasks = []
        for item in items:
            name = policies[item["id"] % len(policies)]
            extra = {} if name == "none" else {"kv_policy": name, "kv_budget": 0.5}
            tasks.append(request(c, url, "smollm2", item, extra=extra))
        return list(await asyncio.gather(*tasks))


def part_burst(out: dict, policies: list[str], cache: Path) -> None:
    _, proc = ready_seconds(cache)
    try:
        before = scrape(proc.url)["jkv:programs_built_total"]
        items = passages(64, seed=1)
        t0 = time.perf_counter()
        results = asyncio.run(burst(proc.url, items, policies))
        seconds = time.perf_counter() - t0
        after = scrape(proc.url)["jkv:programs_built_total"]
    finally:
        proc.stop()
    stats = summarise(results, seconds)
    right = sum(str(i["number"]) in r["text"] for i, r in zip(items, results, strict=True))
    stats.update(policies=policies, programs_built_while_serving=after - before,
                 answers_with_the_number=right)  # fmt: skip
    stats["ttft_p99_over_p50"] = round(stats["ttft_p99_ms"] / stats["ttft_p50_ms"], 2)
    out["burst"] = stats
    print(f"  burst: {stats['completed']}/{stats['requests']} completed, TTFT P50 "
          f"{stats['ttft_p50_ms']:.0f} ms, P99 {stats['ttft_p99_ms']:.0f} ms "
          f"({stats['ttft_p99_over_p50']}x), {after - before:.0f} programs built while serving, "
          f"{right} answers name the number")  # fmt: skip


def part_load(out: dict, clients: int, requests: int, peer_exe, cache: Path) -> None:
    import jkv

    items = passages(requests, seed=2)
    rows = []
    _, proc = ready_seconds(cache)
    try:
        asyncio.run(closed_loop(proc.url, "smollm2", items[:4], 4))  # a first pass
        res, secs = asyncio.run(closed_loop(proc.url, "smollm2", items, clients))
        rows.append({"server": "jkv serve", **summarise(res, secs)})
    finally:
        proc.stop()
    with tempfile.TemporaryDirectory(prefix="smollm2-hf-") as folder:
        hf = Path(folder) / "SmolLM2-135M-Instruct"
        jkv.export_hf(jkv.load("smollm2"), hf)
        peer = peer_server(str(hf), peer_exe)
        try:
            res, secs = asyncio.run(closed_loop(peer.url, str(hf), items, clients))
            rows.append({"server": "transformers serve", **summarise(res, secs)})
        finally:
            peer.stop()
    ratio = rows[0]["out_tok_per_s"] / max(rows[1]["out_tok_per_s"], 1e-9)
    out["load"] = {"clients": clients, "rows": rows, "jkv_over_peer": round(ratio, 2)}
    for r in rows:
        print(f"  {r['server']:20s} {r['completed']}/{r['requests']} completed, "
              f"{r['out_tok_per_s']} tok/s, TTFT P50 {r['ttft_p50_ms']} ms")  # fmt: skip
    print(f"  jkv / transformers: {ratio:.2f}x")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--parts", default="start,burst,load")
    ap.add_argument("--burst-policies", default=",".join(BURST_POLICIES))
    ap.add_argument("--clients", type=int, default=64)
    ap.add_argument("--requests", type=int, default=128)
    ap.add_argument("--peer-exe", default=str(ROOT / ".venv-peer" / "bin" / "transformers"))
    ap.add_argument("--out", default=str(ROOT / "benchmarks" / "results"))
    args = ap.parse_args()
    parts = args.parts.split(",")
    out = {"machine": platform.processor() or platform.machine(), "cpus": os.cpu_count()}
    with tempfile.TemporaryDirectory(prefix="jkv-cache-") as cache:
        if "start" in parts:
            part_start(out)
        if "burst" in parts:
            part_burst(out, args.burst_policies.split(","), Path(cache))
        if "load" in parts:
            part_load(out, args.clients, args.requests, args.peer_exe, Path(cache))
    path = Path(args.out) / "serve_smollm2.json"
    path.parent.mkdir(parents=True, exist_ok=True)  # a new --out folder
    old = json.loads(path.read_text()) if path.is_file() else {}
    path.write_text(json.dumps({**old, **out}, indent=2) + "\n")
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
