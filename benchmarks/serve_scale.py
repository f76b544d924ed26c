"""Scaling out on one machine: `jkv serve demo --replicas 2` behind sglang-router against one
replica behind the same router, cache-aware routing against round robin, and the response
cache's L2 hit on one Redis against a Redis Cluster.

    python benchmarks/serve_scale.py [--quick] [--out benchmarks/results]

Replicas: `jkv serve demo --replicas 2` (the launcher, its cache-aware router), with
`--no-response-cache` so that every request reaches an engine, and one API key per run (each
run its own tenant, so no run finds another's prefixes cached). Beside the launcher's router,
two more routers over the same replicas, started with the launcher's own flags
(`jkv.serve.replicas.router_argv`): one over replica 0 alone (1 replica), one round robin.
Each replica is first warmed on both workloads at the full and lower concurrencies (untimed),
so most compilation stays out of the timed runs.

Workloads, streamed chat completions, client side timings as in serve_load.py:
- chat mix: serve_load.py's (a shared system message, 1-8 facts and a question, greedy,
  max_tokens 16-48), closed loop at concurrency 16;
- long shared prefixes: 16 "documents" (a ~220-token system message each) with 4 short
  questions each, shuffled, at concurrency 6, max_tokens 8.
Every run is done twice (the same requests, new tenants, so nothing is cached again): the
first pass may still meet shapes the warm-up did not compile; the table quotes the second.
Prefix hit rate: prompt tokens served from cached pages (`usage.prompt_tokens_details`) over
prompt tokens.

L2: 2,000 entries written through one `ResponseCache`, then read by another whose L1 holds
one entry (every read goes to Redis), one Redis server and a 3-primary Redis Cluster read in
turn, call by call; P50 / P99 of `perf_counter_ns` per `get`.

On a 2-core machine two replicas share the two cores one replica already uses (XLA runs a
step on both), so the 1 vs 2 replica ratio measures the router's and the split's cost, not
scale-out: that needs a machine (or machines) with cores, or accelerators, for each replica.
What it can show: routing (hit rates, TTFT from prefixes found) and the router's overhead.
Writes serve_scale.json and serve_scale.png.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import random
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx
import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "benchmarks"), str(ROOT / "tests"), str(ROOT / "tests/serve")]

from redis_proc import RedisClusterProcs, RedisServer  # noqa: E402
from replicas_harness import free_run  # noqa: E402
from serve_load import free_port, summarise, workload  # noqa: E402

from jkv.serve.replicas import router_argv  # noqa: E402

WORDS = ("the farmer baker teacher child dog cat bird horse fox sailor river market house "
         "garden forest hill village school kitchen bridge road field lake town old young small "
         "big red green blue saw found carried painted opened bought sold").split()  # fmt: skip


def long_prefix_workload(seed: int, docs: int = 16, per_doc: int = 4) -> list[dict]:
    rng = random.Random(seed)
    heads = [" ".join(rng.choice(WORDS) for _ in range(110)) for _ in range(docs)]
    items = [
        {"messages": [{"role": "system", "content": h},
                      {"role": "user", "content": f"who {rng.choice(WORDS)} the {rng.choice(WORDS)}"}],
         "max_tokens": 8}
        for h in heads for _ in range(per_doc)
    ]  # fmt: skip
    rng.shuffle(items)
    return [{**item, "id": i} for i, item in enumerate(items)]


async def request(client, url, key, item) -> dict:
    body = {"model": "jkv-demo", "messages": item["messages"], "max_tokens": item["max_tokens"],
            "temperature": 0, "stream": True, "stream_options": {"include_usage": True}}  # fmt: skip
    rec = {"ok": False, "status": None, "ttft": None, "chunks": [], "tokens": 0, "prompt": 0,
           "cached": 0}  # fmt: skip
    t0 = time.perf_counter()
    try:
        headers = {"Authorization": f"Bearer {key}"}
        async with client.stream("POST", url + "/v1/chat/completions", json=body,
                                 headers=headers) as r:  # fmt: skip
            rec["status"] = r.status_code
            async for line in r.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                data = json.loads(line[6:])
                if usage := data.get("usage"):
                    rec["tokens"] = usage["completion_tokens"]
                    rec["prompt"] = usage["prompt_tokens"]
                    rec["cached"] = (usage.get("prompt_tokens_details") or {}).get(
                        "cached_tokens", 0
                    )
                for choice in data.get("choices") or []:
                    if (choice.get("delta") or {}).get("content"):
                        rec["chunks"].append(time.perf_counter() - t0)
        rec["ok"] = r.status_code == 200
    except (httpx.HTTPError, ValueError) as e:
        rec["error"] = f"{type(e).__name__}: {e}"
    rec["e2e"] = time.perf_counter() - t0
    rec["ttft"] = rec["chunks"][0] if rec["chunks"] else None
    return rec


async def closed_loop(url, key, items, concurrency) -> tuple[list[dict], float]:
    queue = list(reversed(items))
    results = []
    async with httpx.AsyncClient(timeout=600, limits=httpx.Limits(max_connections=256)) as c:

        async def worker():
            while queue:
                results.append(await request(c, url, key, queue.pop()))

        t0 = time.perf_counter()
        await asyncio.gather(*[worker() for _ in range(concurrency)])
        return results, time.perf_counter() - t0


def blocks_looked_up(urls) -> list[float]:
    out = []
    for url in urls:
        text = httpx.get(url + "/metrics", timeout=10).text
        out.append(next(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
                        if line.startswith("jkv:prefix_cache_queries_total")))  # fmt: skip
    return out


def wait_health(url: str, proc: subprocess.Popen, timeout: float = 600) -> None:
    deadline = time.monotonic() + timeout
    while True:
        try:
            if httpx.get(url + "/health", timeout=2).status_code == 200:
                return
        except httpx.TransportError:
            pass
        if proc.poll() is not None or time.monotonic() > deadline:
            raise RuntimeError(f"{url} did not come up")
        time.sleep(0.5)


def router(workers_port: int, replicas: int, policy: str) -> tuple[subprocess.Popen, str]:
    port = free_port()
    args = argparse.Namespace(host="127.0.0.1", port=workers_port, replicas=replicas,
                              router_host=None, router_port=port, router_policy=policy,
                              router_health_interval=2, router_metrics_port=free_port(),
                              router_args="")  # fmt: skip
    proc = subprocess.Popen(router_argv(args), stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL, env={**os.environ, "HF_HUB_OFFLINE": "1"})  # fmt: skip
    url = f"http://127.0.0.1:{port}"
    wait_health(url, proc, 30)
    time.sleep(2)  # its workers registered
    return proc, url


def serve_rows(n_chat: int, keys: list[str], tmp: Path) -> list[dict]:
    base = free_run(2)
    keys_file = tmp / "keys.txt"
    keys_file.write_text("".join(f"{k} {k}\n" for k in keys))
    launcher_port = free_port()
    launcher = subprocess.Popen(
        [sys.executable, "-m", "jkv.cli", "serve", "demo", "--replicas", "2", "--port", str(base),
         "--router-port", str(launcher_port), "--api-keys-file", str(keys_file),
         "--no-response-cache", "--log-level", "warning"],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True,
    )  # fmt: skip
    procs = []
    try:
        replicas = [f"http://127.0.0.1:{base + i}" for i in range(2)]
        cache_aware = f"http://127.0.0.1:{launcher_port}"
        wait_health(cache_aware, launcher)
        chat = workload(n_chat, seed=1)
        long = long_prefix_workload(seed=2)
        for url in replicas:  # compiled shapes (a replica behind 2 sees half the load), untimed
            for conc in (16, 8, 4):
                asyncio.run(closed_loop(url, keys[0], workload(n_chat, seed=9 + conc), conc))
            for conc in (6, 3):
                asyncio.run(closed_loop(url, keys[0], long_prefix_workload(seed=9 + conc), conc))
        one, one_url = router(base, 1, "cache_aware")
        rr, rr_url = router(base, 2, "round_robin")
        procs += [one, rr]
        rows, k = [], 1
        runs = [(traffic, items, conc, name, url, rep)
                for rep in ("first", "second")
                for traffic, items, conc in (("chat mix", chat, 16), ("long shared prefixes", long, 6))
                for name, url in (("1 replica", one_url), ("2 replicas, cache-aware", cache_aware),
                                  ("2 replicas, round robin", rr_url))]  # fmt: skip
        for traffic, items, conc, name, url, rep in runs:
            before = blocks_looked_up(replicas)
            results, seconds = asyncio.run(closed_loop(url, keys[k], items, conc))
            k += 1
            split = [round(a - b) for a, b in zip(blocks_looked_up(replicas), before,
                                                    strict=True)]  # fmt: skip
            ok = [r for r in results if r["ok"]]
            rate = sum(r["cached"] for r in ok) / max(1, sum(r["prompt"] for r in ok))
            stats = summarise(results, seconds)
            rows.append({"traffic": traffic, "run": name, "pass": rep, "concurrency": conc,
                         "prefix_hit_rate": round(rate, 3), "blocks_per_replica": split,
                         **{f: stats[f] for f in ("requests", "completed", "errors",
                            "req_per_s", "out_tok_per_s", "ttft_p50_ms", "ttft_p99_ms")}})  # fmt: skip
            r = rows[-1]
            print(f"{rep:<6} {traffic:<21} {name:<24} {r['completed']:>3}/{r['requests']:<3} "
                  f"{r['req_per_s']:>6} req/s {r['out_tok_per_s']:>7} tok/s  TTFT p50/p99 "
                  f"{r['ttft_p50_ms']}/{r['ttft_p99_ms']} ms  prefix hit "
                  f"{r['prefix_hit_rate']:.3f}  blocks/replica {split}", flush=True)  # fmt: skip
        return rows
    finally:
        for p in procs:
            p.kill()
            p.wait(10)
        launcher.send_signal(signal.SIGTERM)
        try:
            launcher.wait(60)
        except subprocess.TimeoutExpired:
            pass
        try:
            os.killpg(launcher.pid, signal.SIGKILL)  # the replicas and router, whatever is left
        except ProcessLookupError:
            pass


def l2_rows(entries: int, reps: int, tmp: Path) -> dict:
    from jkv.response_cache import ResponseCache

    (tmp / "single").mkdir()
    (tmp / "cluster").mkdir()
    single = RedisServer(tmp / "single")
    cluster = RedisClusterProcs(tmp / "cluster")
    caches = []
    try:
        single.start()
        cluster.start()
        settings = {"temperature": 0.0, "max_new_tokens": 32}
        answer = {"text": "A cached answer. " * 8, "tokens": list(range(32)),
                  "finish_reason": "stop"}  # fmt: skip
        prompts = [f"prompt {i}: " + " ".join(random.Random(i).choices(WORDS, k=40))
                   for i in range(entries)]  # fmt: skip
        readers = {}
        for name, url in (("redis", single.url), ("redis cluster", cluster.url)):
            fill = ResponseCache(url, node_id=f"fill-{name}", l1_max_entries=1)
            reader = ResponseCache(url, node_id=f"read-{name}", l1_max_entries=1)
            caches += [fill, reader]
            for p in prompts:
                fill.get_or_generate("bench", "v1", p, settings, lambda: answer)
            readers[name] = reader
        rng = random.Random(3)
        seq = [rng.randrange(entries) for _ in range(reps)]
        seq = [i for j, i in enumerate(seq) if j == 0 or i != seq[j - 1]]  # no L1 hit
        times = {name: [] for name in readers}
        for turn, i in enumerate(seq):
            order = list(readers) if turn % 2 else list(reversed(readers))
            for name in order:
                t0 = time.perf_counter_ns()
                hit = readers[name].get("bench", "v1", prompts[i], settings)
                times[name].append(time.perf_counter_ns() - t0)
                assert hit.level == "l2" and hit.record.text == answer["text"], (name, hit.level)
        out = {name: {f"p{q}_us": round(float(np.percentile(t[100:], q)) / 1000, 1)
                      for q in (50, 99)} for name, t in times.items()}  # fmt: skip
        for q in (50, 99):
            out[f"cluster_over_single_p{q}"] = round(
                out["redis cluster"][f"p{q}_us"] / out["redis"][f"p{q}_us"], 2)  # fmt: skip
        out["reads"] = len(seq) - 100
        for name in readers:
            print(f"L2 hit  {name:<14} p50 {out[name]['p50_us']:>7} us  p99 "
                  f"{out[name]['p99_us']:>7} us", flush=True)  # fmt: skip
        print(f"L2 hit  cluster / single: p50 {out['cluster_over_single_p50']}x, p99 "
              f"{out['cluster_over_single_p99']}x")  # fmt: skip
        return out
    finally:
        for c in caches:
            c.close()
        single.kill()
        cluster.stop()


def plot(rows: list[dict], l2: dict, path: Path) -> None:
    import matplotlib

    rows = [r for r in rows if r["pass"] == "second"]

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(15, 4.2))
    for ax, field, label in ((axes[0], "prefix_hit_rate", "prefix hit rate (tokens)"),
                             (axes[1], "ttft_p50_ms", "TTFT P50 (ms)")):  # fmt: skip
        traffics = sorted({r["traffic"] for r in rows})
        runs = [r["run"] for r in rows if r["traffic"] == traffics[0]]
        for j, run in enumerate(runs):
            values = [next(r[field] for r in rows if r["traffic"] == t and r["run"] == run)
                      for t in traffics]  # fmt: skip
            ax.bar(np.arange(len(traffics)) + 0.27 * (j - 1), values, 0.27, label=run)
        ax.set_xticks(range(len(traffics)), traffics)
        ax.set_ylabel(label)
    axes[0].legend(fontsize=8)
    names = ["redis", "redis cluster"]
    for j, q in enumerate((50, 99)):
        axes[2].bar(np.arange(2) + 0.35 * (j - 0.5), [l2[n][f"p{q}_us"] for n in names], 0.35,
                    label=f"P{q}")  # fmt: skip
    axes[2].set_xticks(range(2), names)
    axes[2].set_ylabel("L2 hit latency (us)")
    axes[2].legend(fontsize=8)
    fig.suptitle(f"serve_scale.py on {os.cpu_count()} cores (demo model)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="fewer requests and reads")
    ap.add_argument("--out", default=str(ROOT / "benchmarks" / "results"))
    args = ap.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="jkv-serve-scale-") as tmp:
        keys = [f"tenant-{i}" for i in range(14)]
        rows = serve_rows(48 if args.quick else 96, keys, Path(tmp))
        l2 = l2_rows(500 if args.quick else 2000, 1000 if args.quick else 5000, Path(tmp))
    result = {"machine": {"cpus": os.cpu_count(), "platform": platform.platform(),
                          "python": platform.python_version()},
              "command": "python benchmarks/serve_scale.py" + (" --quick" if args.quick else ""),
              "serve": rows, "l2_hit": l2}  # fmt: skip
    (out / "serve_scale.json").write_text(json.dumps(result, indent=1))
    plot(rows, l2, out / "serve_scale.png")
    print(f"wrote {out / 'serve_scale.json'} and {out / 'serve_scale.png'}")


if __name__ == "__main__":
    main()
