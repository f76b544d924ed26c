"""Soak of `jkv serve`: `--minutes` of mixed traffic against one real server process.

Traffic (seeded): `--clients` closed-loop clients with API keys of two tenants; completions and
chat, streamed and not, every policy the engine serves (full, snapkv, pyramidkv, adakv,
efficache, quantile, streaming, h2o), greedy / seeded / sampled, `max_tokens` 4-32, prompts of
1-6 facts (~15-120 tokens). 5% of the clients leave at a random point (a stream after 0-5
chunks, a whole answer after 0.05-0.5 s). Redis (the response cache's L2) is killed and
restarted at a third and at two thirds of the run. Each minute, a burst of twice the queue
limit arrives at once.

Checks: no 5xx (the burst's deliberate 503 `queue_full` are counted apart); every accepted
request completes (a whole JSON answer, or a stream ending in [DONE] with no error event)
unless its client left; at the end, with the server idle, its RSS and the KV pool's usage
against their values after the warm-up (the growth in the table).

    python benchmarks/serve_soak.py [--minutes 20] [--clients 8] [--out benchmarks/results]
Writes serve_soak.json.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import shutil
import subprocess
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path

import httpx
from serve_load import Proc, free_port, scrape

POLICIES = [None, "snapkv", "pyramidkv", "adakv", "efficache", "quantile", "streaming", "h2o"]
BUDGETS = {"quantile": 0.5, "streaming": 48, "h2o": 48}  # others: 0.5 of the prompt
NAMES = ["Mara", "Valentin", "Ines", "Tomas", "Lena", "Oskar", "Nadia", "Felix"]
KEYS = {"sk-soak-a1": "tenant-a", "sk-soak-a2": "tenant-a", "sk-soak-b": "tenant-b"}
MAX_QUEUED = 16


def body(rng: random.Random) -> tuple[str, dict]:
    facts = [f"The code for {n} is {' '.join(str(rng.randrange(10)) for _ in range(5))} ."
             for n in rng.sample(NAMES, rng.randint(1, 6))]  # fmt: skip
    question = f"What is the code for {rng.choice(NAMES)}"
    policy = rng.choice(POLICIES)
    out = {"model": "jkv-demo", "max_tokens": rng.randint(4, 32), "stream": rng.random() < 0.5}
    mode = rng.random()
    out["temperature"] = 0 if mode < 0.3 else 0.8
    if 0.3 <= mode < 0.6:
        out["seed"] = rng.randrange(4)  # seeded: the response cache answers repeats
    if policy is not None:
        out["kv_policy"], out["kv_budget"] = policy, BUDGETS.get(policy, 0.5)
    if out["stream"]:
        out["stream_options"] = {"include_usage": True}
    if rng.random() < 0.5:
        return "/v1/completions", {**out, "prompt": " ".join(facts) + " " + question}
    messages = [{"role": "user", "content": " ".join(facts) + " " + question}]
    return "/v1/chat/completions", {**out, "messages": messages}


async def one(client, url: str, rng: random.Random, leave: bool) -> tuple[str, str | None]:
    """(outcome, the response cache's level): ok, left, 503, 4xx:code, 5xx, broken:why."""
    path, payload = body(rng)
    headers = {"authorization": f"Bearer {rng.choice(list(KEYS))}"}
    try:
        if not payload["stream"]:
            timeout = rng.uniform(0.05, 0.5) if leave else 120
            r = await client.post(url + path, json=payload, headers=headers, timeout=timeout)
            if r.status_code != 200:
                return status_of(r), None
            ok = r.json()["choices"][0]["finish_reason"] in ("stop", "length")
            return ("ok" if ok else "broken:finish"), r.headers.get("x-jkv-cache")
        async with client.stream("POST", url + path, json=payload, headers=headers,
                                 timeout=120) as r:  # fmt: skip
            if r.status_code != 200:
                await r.aread()
                return status_of(r), None
            stop_after = rng.randint(0, 5) if leave else None
            events = []
            async for line in r.aiter_lines():
                if line:
                    events.append(line)
                if stop_after is not None and len(events) > stop_after:
                    return "left", None
            if events[-1:] != ["data: [DONE]"]:
                return "broken:no-done", None
            if any('"error"' in e for e in events):
                return "broken:error-event", None
            return "ok", r.headers.get("x-jkv-cache")
    except httpx.TimeoutException:
        return ("left" if leave else "broken:timeout"), None
    except httpx.TransportError as e:
        return f"broken:{type(e).__name__}", None


def status_of(r: httpx.Response) -> str:
    if r.status_code == 503 and r.json()["error"]["code"] == "queue_full":
        return "503"
    if r.status_code >= 500:
        return "5xx"
    return f"4xx:{r.json()['error'].get('code') or r.status_code}"


def rss_mb(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return float("nan")


async def soak(url: str, minutes: float, clients: int, redis, seed: int, pid: int) -> dict:
    outcomes: Counter = Counter()
    levels: Counter = Counter()
    end = time.monotonic() + minutes * 60
    restarts = []

    async with httpx.AsyncClient(limits=httpx.Limits(max_connections=256)) as client:

        async def worker(i):
            rng = random.Random(seed * 1000 + i)
            while time.monotonic() < end:
                outcome, level = await one(client, url, rng, leave=rng.random() < 0.05)
                outcomes[outcome] += 1
                levels[level or "miss"] += outcome == "ok"

        async def bursts():
            rng = random.Random(seed)
            n = 0
            while time.monotonic() + 60 < end:
                await asyncio.sleep(60)
                got = await asyncio.gather(*[one(client, url, rng, leave=False)
                                             for _ in range(2 * MAX_QUEUED)])  # fmt: skip
                n += 1
                for outcome, _ in got:
                    outcomes["burst " + outcome] += 1
            return n

        async def chaos():
            for at in (1 / 3, 2 / 3):
                await asyncio.sleep(max(0.0, end - minutes * 60 * (1 - at) - time.monotonic()))
                await asyncio.to_thread(redis.restart)
                restarts.append(round(time.monotonic() - (end - minutes * 60), 1))

        rss = []  # the server's RSS each minute (compiled step shapes grow it early on)

        async def sample():
            while time.monotonic() < end:
                rss.append(round(rss_mb(pid), 1))
                await asyncio.sleep(min(60.0, max(0.0, end - time.monotonic())))

        _, n_bursts, _, _ = await asyncio.gather(
            asyncio.gather(*[worker(i) for i in range(clients)]), bursts(), chaos(), sample()
        )
    return {"outcomes": dict(outcomes), "cache_levels": dict(levels), "bursts": n_bursts,
            "redis_restarts_at_s": restarts, "rss_mb_each_minute": rss}  # fmt: skip


class Redis:
    def __init__(self):
        self.binary = shutil.which("redis-server")
        if self.binary is None:
            raise SystemExit("redis-server is not installed (make redis)")
        self.port = free_port()
        self.proc = None
        self.start()

    def start(self):
        self.proc = subprocess.Popen([self.binary, "--port", str(self.port), "--bind", "127.0.0.1", "--save", "",
                                      "--appendonly", "no"], stdout=subprocess.DEVNULL)  # fmt: skip
        time.sleep(0.5)

    def restart(self):
        self.proc.kill()
        self.proc.wait(10)
        time.sleep(1.0)  # a second without Redis
        self.start()

    def stop(self):
        self.proc.kill()
        self.proc.wait(10)


def idle_stats(url: str, key: str, timeout: float = 120) -> dict:
    deadline = time.monotonic() + timeout
    headers = {"authorization": f"Bearer {key}"}
    while True:
        m = scrape(url)
        if (m["jkv:num_requests_running"], m["jkv:num_requests_waiting"]) == (0, 0):
            return m
        if time.monotonic() > deadline:
            return m
        httpx.get(url + "/health", headers=headers)
        time.sleep(0.5)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--minutes", type=float, default=20.0)
    parser.add_argument("--clients", type=int, default=8)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", default=str(Path(__file__).parent / "results"))
    args = parser.parse_args()

    redis = Redis()
    keys = tempfile.NamedTemporaryFile("w", suffix=".keys", delete=False)
    keys.write("".join(f"{k} {t}\n" for k, t in KEYS.items()))
    keys.close()
    cmd = [sys.executable, "-m", "jkv.cli", "serve", "demo", "--port", "{port}", "--log-level",
           "warning", "--redis-url", f"redis://127.0.0.1:{redis.port}/0", "--api-keys-file",
           keys.name, "--attention-mass", "--num-pages", "512", "--max-running", "16",
           "--max-queued-requests", str(MAX_QUEUED)]  # fmt: skip
    server = Proc(cmd, "/health")
    try:
        rng = random.Random(args.seed)

        async def warm():  # every policy once, so the baseline has its compiled steps
            async with httpx.AsyncClient() as client:
                for _ in range(3 * len(POLICIES)):
                    await one(client, server.url, rng, leave=False)

        asyncio.run(warm())
        base = idle_stats(server.url, next(iter(KEYS)))
        base_rss = rss_mb(server.proc.pid)
        t0 = time.monotonic()
        result = asyncio.run(
            soak(server.url, args.minutes, args.clients, redis, args.seed, server.proc.pid)
        )
        seconds = time.monotonic() - t0
        end = idle_stats(server.url, next(iter(KEYS)))
        end_rss = rss_mb(server.proc.pid)
        rc = server.stop()
    finally:
        if server.proc.poll() is None:
            server.stop()
        redis.stop()
    o = result["outcomes"]
    served = sum(v for k, v in o.items() if not k.startswith("burst"))
    broken = {k: v for k, v in o.items() if "broken" in k or "5xx" in k}
    row = {
        "minutes": round(seconds / 60, 1), "clients": args.clients, "requests": served,
        "ok": o.get("ok", 0), "left": o.get("left", 0), "queue_full_503": o.get("503", 0),
        "burst_ok": o.get("burst ok", 0), "burst_503": o.get("burst 503", 0),
        "bursts": result["bursts"], "redis_restarts_at_s": result["redis_restarts_at_s"],
        "4xx": {k: v for k, v in o.items() if "4xx" in k}, "5xx_or_broken": broken,
        "cache_levels": result["cache_levels"],
        "rss_mb": [round(base_rss, 1), round(end_rss, 1), round(end_rss - base_rss, 1)],
        "rss_mb_each_minute": result["rss_mb_each_minute"],
        "kv_usage": [base["jkv:kv_cache_usage_perc"], end["jkv:kv_cache_usage_perc"]],
        "running_waiting_end": [end["jkv:num_requests_running"], end["jkv:num_requests_waiting"]],
        "exit_code": rc,
    }  # fmt: skip
    print(json.dumps(row, indent=1))
    print()
    minutes_rss = result["rss_mb_each_minute"]
    half = minutes_rss[len(minutes_rss) // 2] if minutes_rss else float("nan")
    print("| minutes | requests | ok | left | 503 (bursts) | 5xx / broken | RSS MB start -> end "
          "(growth) | RSS MB half-time -> end | KV usage start -> end |")  # fmt: skip
    print("|---|---|---|---|---|---|---|---|---|")
    print(
        f"| {row['minutes']} | {served + o.get('burst ok', 0) + o.get('burst 503', 0)} | "
        f"{row['ok'] + row['burst_ok']} | {row['left']} | "
        f"{row['queue_full_503'] + row['burst_503']} ({row['bursts']}) | "
        f"{sum(broken.values())} | {row['rss_mb'][0]} -> {row['rss_mb'][1]} "
        f"({row['rss_mb'][2]:+}) | {half} -> {row['rss_mb'][1]} | "
        f"{row['kv_usage'][0]:.3f} -> {row['kv_usage'][1]:.3f} |"
    )
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "serve_soak.json").write_text(json.dumps(row, indent=1))
    if broken or row["running_waiting_end"] != [0.0, 0.0]:
        sys.exit(1)


if __name__ == "__main__":
    main()
