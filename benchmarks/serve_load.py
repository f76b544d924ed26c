"""Load and chaos benchmark of `jkv serve`, side by side with `transformers serve` (continuous
batching) on the same exported model, driven by one async client.

Workload (seeded): streamed chat completions on the demo model, greedy. Each request: a shared
system message (a fixed ~40-token instruction, so the prefix cache has something to share), then
a user message of 1-8 random facts "The code for <name> is d d d d d ." and a question about
one of them; prompts ~40-170 tokens; `max_tokens` uniform in [16, 48] (the model may stop
earlier at its eos). Both servers render the same chat template (the export carries jkv's
default one), so both see the same tokens.

Metrics are client side, as `vllm bench serve` defines them: TTFT = first content chunk - send;
ITL = every later gap between content chunks, pooled; TPOT = (E2E - TTFT) / (output tokens - 1)
per request (output tokens from the final usage chunk when the server sends one, else the
content chunks); goodput = requests/s meeting TTFT <= 2 s and TPOT <= 100 ms. Percentiles
P50/P90/P99.

Runs: closed loop at concurrency 1, 16, 64, 256 (jkv; the peer at the same levels unless
--peer-levels), open-loop Poisson arrivals; then, with a pool so small the full cache must
recycle and preempt (`--num-pages 96`, optimistic admission), full cache vs SnapKV 25% + fp8,
and the recycling rules (lazy LRU, the seed's 15% watermark, a 5% admission headroom); then the
chaos rows: Redis killed and restarted under load (response cache on, L2 in Redis), a burst of
2x the queue limit, 100 clients leaving mid-stream (pool pages back to their baseline), SIGTERM
under load (in-flight requests complete).

    python benchmarks/serve_load.py [--quick] [--out benchmarks/results]
Writes serve_load.json and serve_load.png.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import random
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx
import numpy as np

ROOT = Path(__file__).resolve().parents[1]
SYSTEM = (
    "You answer questions about codes. Every fact says the code for a name; the answer is the "
    "five digits of the code for the name asked about, nothing else."
)
NAMES = ["Mara", "Valentin", "Ines", "Tomas", "Lena", "Oskar", "Nadia", "Felix", "Ruth", "Emil",
         "Greta", "Hugo", "Clara", "Anton", "Vera", "Paul"]  # fmt: skip
SLO = {"ttft_s": 2.0, "tpot_s": 0.1}


def workload(n: int, seed: int) -> list[dict]:
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        names = rng.sample(NAMES, rng.randint(1, 8))
        facts = " ".join(
            f"The code for {name} is {' '.join(str(rng.randrange(10)) for _ in range(5))} ."
            for name in names
        )
        asked = rng.choice(names)
        messages = [{"role": "system", "content": SYSTEM},
                    {"role": "user", "content": f"{facts} What is the code for {asked}"}]  # fmt: skip
        out.append({"id": len(out), "messages": messages, "max_tokens": rng.randint(16, 48)})
    return out


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Proc:
    """A server process on a free port, up when /health (or /v1/models) answers."""

    def __init__(self, cmd: list[str], health: str | None, env=None, timeout: float = 600):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        cmd = [c.replace("{port}", str(self.port)) for c in cmd]
        self.log = tempfile.NamedTemporaryFile("w+", suffix=".log", delete=False)
        self.proc = subprocess.Popen(cmd, stdout=self.log, stderr=subprocess.STDOUT,
                                     env={**os.environ, **(env or {})})  # fmt: skip
        deadline = time.monotonic() + timeout
        while True:
            if self.proc.poll() is not None:
                raise RuntimeError(f"{cmd[:4]} exited: {Path(self.log.name).read_text()[-2000:]}")
            try:  # health None: any HTTP answer means up
                code = httpx.get(self.url + (health or "/"), timeout=2).status_code
                if code == 200 or health is None:
                    return
            except httpx.TransportError:
                pass
            if time.monotonic() > deadline:
                raise RuntimeError(f"{cmd[:4]} did not come up")
            time.sleep(0.5)

    def stop(self, sig=signal.SIGTERM, timeout: float = 60) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)
        return self.proc.returncode


def jkv_server(model: str, *extra: str, warmup: bool = True) -> Proc:
    cmd = [sys.executable, "-m", "jkv.cli", "serve", model, "--port", "{port}",
           "--max-running", "32", "--log-level", "warning", *extra]  # fmt: skip
    if warmup:
        cmd.append("--warmup")
    return Proc(cmd, "/health")


def peer_server(model: str, exe: str | None = None) -> Proc:
    exe = exe or shutil.which("transformers", path=str(Path(sys.executable).parent))
    exe = exe or "transformers"
    cmd = [exe, "serve", "--continuous-batching", "--device", "cpu", "--port", "{port}",
           "--log-level", "warning"]  # fmt: skip
    # its /v1/models scans the Hub cache (absent offline: 500), so any answer means up
    proc = Proc(cmd, None, env={"HF_HUB_OFFLINE": "1"})
    # the model loads on its first request: one untimed request
    asyncio.run(one_untimed(proc.url, model))
    return proc


async def one_untimed(url, model):
    async with httpx.AsyncClient(timeout=600) as client:
        await request(client, url, model, workload(1, 99)[0])


async def request(client, url, model, item, leave_after: int | None = None, extra=None) -> dict:
    """One streamed chat completion; client-side timings."""
    body = {"model": model, "messages": item["messages"], "max_tokens": item["max_tokens"],
            "temperature": 0, "stream": True, "stream_options": {"include_usage": True},
            **(extra or {})}  # fmt: skip
    t0 = time.perf_counter()
    rec = {"id": item.get("id"), "ok": False, "status": None, "ttft": None, "chunks": [],
           "tokens": 0, "text": ""}  # fmt: skip
    try:
        async with client.stream("POST", url + "/v1/chat/completions", json=body) as r:
            rec["status"] = r.status_code
            if r.status_code != 200:
                await r.aread()
                rec["e2e"] = time.perf_counter() - t0
                return rec
            async for line in r.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                data = json.loads(line[6:])
                if data.get("usage"):
                    rec["tokens"] = data["usage"].get("completion_tokens") or rec["tokens"]
                for choice in data.get("choices") or []:
                    piece = (choice.get("delta") or {}).get("content")
                    if piece:
                        now = time.perf_counter() - t0
                        rec["chunks"].append(now)
                        rec["text"] += piece
                        if leave_after is not None and len(rec["chunks"]) >= leave_after:
                            rec["left"] = True
                            return rec
        rec["ok"] = True
    except (httpx.HTTPError, ValueError) as e:
        rec["error"] = f"{type(e).__name__}: {e}"
    rec["e2e"] = time.perf_counter() - t0
    if rec["chunks"]:
        rec["ttft"] = rec["chunks"][0]
    rec["tokens"] = rec["tokens"] or len(rec["chunks"])
    return rec


async def closed_loop(url, model, items, concurrency, extra=None) -> tuple[list[dict], float]:
    queue = list(items)
    results = []
    async with httpx.AsyncClient(timeout=600, limits=httpx.Limits(max_connections=1024)) as c:

        async def worker():
            while queue:
                results.append(await request(c, url, model, queue.pop(), extra=extra))

        t0 = time.perf_counter()
        await asyncio.gather(*[worker() for _ in range(concurrency)])
        return results, time.perf_counter() - t0


async def open_loop(url, model, items, rate, seed=0) -> tuple[list[dict], float]:
    rng = np.random.default_rng(seed)
    async with httpx.AsyncClient(timeout=600, limits=httpx.Limits(max_connections=1024)) as c:
        t0 = time.perf_counter()
        tasks = []
        for item in items:
            tasks.append(asyncio.ensure_future(request(c, url, model, item)))
            await asyncio.sleep(rng.exponential(1 / rate))
        results = await asyncio.gather(*tasks)
        return list(results), time.perf_counter() - t0


def summarise(results: list[dict], seconds: float) -> dict:
    ok = [r for r in results if r["ok"]]
    ttft = [r["ttft"] for r in ok if r["ttft"] is not None]
    itl = [b - a for r in ok for a, b in zip(r["chunks"], r["chunks"][1:], strict=False)]
    tpot = [(r["e2e"] - r["ttft"]) / (r["tokens"] - 1) for r in ok if r["tokens"] > 1]
    good = [
        r for r in ok
        if r["ttft"] is not None and r["ttft"] <= SLO["ttft_s"]
        and (r["tokens"] <= 1 or (r["e2e"] - r["ttft"]) / (r["tokens"] - 1) <= SLO["tpot_s"])
    ]  # fmt: skip

    def pct(xs, q):
        return round(float(np.percentile(xs, q)) * 1000, 2) if xs else None

    return {
        "requests": len(results),
        "completed": len(ok),
        "errors": sum(1 for r in results if not r["ok"] and r["status"] != 503),
        "first_error": next(
            (
                r.get("error") or f"HTTP {r['status']}"
                for r in results
                if not r["ok"] and r["status"] != 503
            ),
            None,
        ),  # fmt: skip
        "rejected_503": sum(1 for r in results if r["status"] == 503),
        "seconds": round(seconds, 2),
        "req_per_s": round(len(ok) / seconds, 2),
        "out_tok_per_s": round(sum(r["tokens"] for r in ok) / seconds, 1),
        "goodput_req_per_s": round(len(good) / seconds, 2),
        **{f"ttft_p{q}_ms": pct(ttft, q) for q in (50, 90, 99)},
        **{f"tpot_p{q}_ms": pct(tpot, q) for q in (50, 90, 99)},
        **{f"itl_p{q}_ms": pct(itl, q) for q in (50, 90, 99)},
    }


def scrape(url) -> dict:
    out = {}
    for line in httpx.get(url + "/metrics").text.splitlines():
        if line.startswith("jkv:") and "_bucket" not in line:
            name, value = line.rsplit(" ", 1)
            out[name.split("{")[0] + ("{" + name.split("{")[1] if "reason=" in name else "")] = (
                float(value)
            )
    return out


def peer_version(exe: str | None) -> str:
    """`transformers` version of the peer's environment."""
    exe = exe or shutil.which("transformers", path=str(Path(sys.executable).parent))
    python = Path(exe).parent / "python"
    out = subprocess.run([str(python), "-c", "import transformers as t; print(t.__version__)"],
                         capture_output=True, text=True)  # fmt: skip
    return f"transformers {out.stdout.strip() or '?'} serve --continuous-batching"


def export_model(folder: Path) -> Path:
    """The demo model as a Hugging Face folder carrying jkv's default chat template."""
    from jkv.chat import DEFAULT_CHAT_TEMPLATE

    subprocess.run([sys.executable, "-m", "jkv.cli", "export-hf", "demo", str(folder),
                    "--overwrite"], check=True, stdout=subprocess.DEVNULL)  # fmt: skip
    config = folder / "tokenizer_config.json"
    data = json.loads(config.read_text())
    data["chat_template"] = DEFAULT_CHAT_TEMPLATE
    config.write_text(json.dumps(data, indent=1))
    return folder


def row(table, name, stats, **extra):
    table.append({"run": name, **stats, **extra})
    s = stats
    print(f"{name:<44} {s['completed']:>5}/{s['requests']:<5} err {s['errors']:>3} 503 "
          f"{s['rejected_503']:>4} {s['req_per_s']:>7} req/s {s['out_tok_per_s']:>8} tok/s "
          f"TTFT p50/p99 {s['ttft_p50_ms']}/{s['ttft_p99_ms']} ms  TPOT p50/p99 "
          f"{s['tpot_p50_ms']}/{s['tpot_p99_ms']} ms  {extra or ''}", flush=True)  # fmt: skip


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="fewer requests per level")
    ap.add_argument("--levels", default="1,16,64,256")
    ap.add_argument("--peer-levels", default=None, help="default: --levels")
    ap.add_argument("--no-peer", action="store_true")
    ap.add_argument("--peer-exe", default=None,
                    help="the `transformers` executable to run (default: this environment's)")  # fmt: skip
    ap.add_argument("--peer-requests", type=int, default=None,
                    help="requests per peer level (default: as jkv's)")  # fmt: skip
    ap.add_argument("--rate", type=float, default=8.0, help="Poisson arrivals per second")
    ap.add_argument("--out", default=str(ROOT / "benchmarks" / "results"))
    ap.add_argument("--parts", default="load,peer,pressure,chaos",
                    help="what to run; the other parts' rows are kept from the last JSON")  # fmt: skip
    args = ap.parse_args()
    parts = args.parts.split(",")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    kept, old_meta = [], {}
    if (out / "serve_load.json").exists():
        old = json.loads((out / "serve_load.json").read_text())
        kept = [r for r in old["rows"] if r.get("part") not in parts]
        old_meta = old.get("meta", {})
    levels = [int(x) for x in args.levels.split(",")]
    peer_levels = [int(x) for x in (args.peer_levels or args.levels).split(",")]
    scale = 1 if args.quick else 2
    count = lambda c: max(16, min(4 * c, 256)) * scale  # noqa: E731
    tmp = Path(tempfile.mkdtemp(prefix="serve_load_"))
    model_dir = export_model(tmp / "demo-hf")
    model = str(model_dir)
    name = "demo-hf"
    table: list[dict] = []
    meta = {"machine": platform.machine(), "cpus": os.cpu_count(), "python": sys.version.split()[0],
            "slo": SLO, "workload": "streamed chat, shared system message, 1-8 facts, "
            "max_tokens U[16,48], greedy"}  # fmt: skip
    meta = {**old_meta, **meta}
    print(f"{'run':<44} done/sent  errors, 503s, throughput, latencies")

    def save(part):
        for r in table:
            r.setdefault("part", part)
        rows = kept + table
        (out / "serve_load.json").write_text(json.dumps({"meta": meta, "rows": rows}, indent=1))
        plot(rows, out / "serve_load.png")

    # 1. jkv at each concurrency, then Poisson arrivals
    texts: dict[int, dict] = {}  # concurrency -> request id -> jkv's answer
    # a pool that holds --max-running (32) requests of this workload at once (16 MiB here)
    big = ["--num-pages", "4096", "--no-response-cache"]
    server = jkv_server(model, *big) if "load" in parts else None
    try:
        for c in levels if server else ():
            items = workload(count(c), seed=c)
            res = asyncio.run(closed_loop(server.url, name, items, c))
            texts[c] = {r["id"]: r["text"] for r in res[0] if r["ok"]}
            row(table, f"jkv c={c}", summarise(*res), system="jkv", concurrency=c)
        if server:
            items = workload(count(32), seed=7)
            row(table, f"jkv poisson {args.rate}/s",
                summarise(*asyncio.run(open_loop(server.url, name, items, args.rate))),
                system="jkv", rate=args.rate)  # fmt: skip
    finally:
        if server:
            server.stop()
    save("load")

    # 2. the peer on the same model and requests
    if not args.no_peer and "peer" in parts:
        try:
            peer = peer_server(model, args.peer_exe)
            meta["peer"] = peer_version(args.peer_exe)
        except Exception as e:  # say why, keep going
            meta["peer_error"] = str(e)[-500:]
            print("transformers serve did not run:", meta["peer_error"])
        else:
            try:
                for c in peer_levels:
                    n = count(c) if args.peer_requests is None else max(c, args.peer_requests)
                    items = workload(n, seed=c)
                    res = asyncio.run(closed_loop(peer.url, model, items, c))
                    same = [texts.get(c, {}).get(r["id"]) == r["text"] for r in res[0]
                            if r["ok"] and r["id"] in texts.get(c, {})]  # fmt: skip
                    row(table, f"transformers serve c={c}", summarise(*res),
                        system="transformers", concurrency=c,
                        same_text_as_jkv=round(sum(same) / len(same), 3) if same else None)  # fmt: skip
                items = workload(
                    count(32) if args.peer_requests is None else args.peer_requests, seed=7
                )
                row(table, f"transformers serve poisson {args.rate}/s",
                    summarise(*asyncio.run(open_loop(peer.url, model, items, args.rate))),
                    system="transformers", rate=args.rate)  # fmt: skip
            finally:
                peer.stop()
    save("peer")

    # 3. memory pressure: full cache vs SnapKV 25% + fp8; recycling rules
    # 256 pages of 16 tokens: 8 per 16 tokens of a request (4 layers x 2 kv heads), so about
    # four full-cache requests of this workload at once for 64 clients
    small = ["--num-pages", "256", "--admission", "optimistic", "--no-response-cache"]
    runs = [
        ("pressure full cache, lazy", ["--admission-headroom", "0"]),
        (
            "pressure SnapKV 25% + fp8, lazy",
            [
                "--kv-policy",
                "snapkv",
                "--kv-budget",
                "0.25",
                "--kv-dtype",
                "float8_e4m3fn",
                "--admission-headroom",
                "0",
            ],
        ),  # fmt: skip
        (
            "pressure full cache, watermark 15%",
            ["--recycle", "watermark", "--recycle-below", "0.15", "--admission-headroom", "0"],
        ),  # fmt: skip
        ("pressure full cache, headroom 5%", ["--admission-headroom", "0.05"]),
    ]
    for label, extra in runs if "pressure" in parts else ():
        # compiled by one untimed pass of other requests (warming every shape up front with
        # --warmup for SnapKV + fp8 as well ran this machine's compiler out of memory)
        server = jkv_server(model, *small, *extra, warmup=False)
        try:
            asyncio.run(closed_loop(server.url, name, workload(count(64) // 2, seed=640), 64))
            before = scrape(server.url)
            items = workload(count(64), seed=64)
            stats = summarise(*asyncio.run(closed_loop(server.url, name, items, 64)))
            after = scrape(server.url)
            delta = {k: after.get(k, 0) - before.get(k, 0) for k in after}
            q = delta.get("jkv:prefix_cache_queries_total", 0)
            row(table, label, stats, system="jkv", concurrency=64,
                preemptions=int(delta.get("jkv:num_preemptions_total", 0)),
                prefix_hit_rate=round(delta.get("jkv:prefix_cache_hits_total", 0) / q, 3) if q else 0)  # fmt: skip
        finally:
            server.stop()

    save("pressure")

    # 4. chaos
    if "chaos" in parts:
        chaos(table, model, name, scale)
    save("chaos")
    print(f"wrote {out / 'serve_load.json'} and serve_load.png")
    shutil.rmtree(tmp, ignore_errors=True)


def chaos(table, model, name, scale) -> None:
    # Redis killed and restarted under load: the response cache's L2 goes away and comes back
    redis_bin = shutil.which("redis-server")
    if redis_bin:
        rport = free_port()
        start = lambda: subprocess.Popen([redis_bin, "--port", str(rport), "--save", "",  # noqa: E731
                                          "--appendonly", "no"], stdout=subprocess.DEVNULL)  # fmt: skip
        redis = start()
        time.sleep(0.5)
        server = jkv_server(model, "--redis-url", f"redis://127.0.0.1:{rport}/0")
        try:
            items = workload(64 * scale, seed=5) * 2  # every prompt twice: hits and misses

            async def run():
                work = asyncio.ensure_future(closed_loop(server.url, name, items, 64))
                await asyncio.sleep(1.0)
                redis.kill()
                await asyncio.sleep(1.0)
                nonlocal_redis.append(start())
                return await work

            nonlocal_redis: list = []
            row(table, "chaos: Redis killed + restarted, c=64", summarise(*asyncio.run(run())),
                system="jkv", concurrency=64)  # fmt: skip
            for p in nonlocal_redis:
                p.kill()
        finally:
            server.stop()
            redis.kill()

    # a burst of 2x the queue limit: 503 for the excess only, every accepted request completes
    limit = 64
    server = jkv_server(model, "--no-response-cache", "--max-queued-requests", str(limit))
    try:
        res = asyncio.run(closed_loop(server.url, name, workload(2 * limit, seed=9), 2 * limit))
        stats = summarise(*res)
        row(table, f"chaos: burst of {2 * limit} at queue limit {limit}", stats, system="jkv",
            accepted_all_completed=stats["completed"] + stats["rejected_503"] == 2 * limit)  # fmt: skip

    finally:
        server.stop()

    # 100 clients leaving mid-stream: pages back to the baseline
    server = jkv_server(model, "--no-response-cache")
    try:
        base = scrape(server.url)

        async def leave():
            async with httpx.AsyncClient(timeout=600) as c:
                items = workload(100, seed=11)
                for it in items:
                    it["max_tokens"] = 200
                return await asyncio.gather(*[request(c, server.url, name, it, leave_after=2)
                                              for it in items])  # fmt: skip

        t0 = time.perf_counter()
        left = asyncio.run(leave())
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            now = scrape(server.url)
            if now["jkv:num_requests_running"] == 0 and now["jkv:num_requests_waiting"] == 0:
                break
            time.sleep(0.1)
        after = scrape(server.url)
        stats = summarise(left, time.perf_counter() - t0)
        stats["errors"] = sum(1 for r in left if not r["ok"] and not r.get("left"))  # not left
        row(table, "chaos: 100 clients leave mid-stream", stats,
            system="jkv", left=sum(1 for r in left if r.get("left")),
            running_after=after["jkv:num_requests_running"],
            usage_before=base["jkv:kv_cache_usage_perc"],
            usage_after=after["jkv:kv_cache_usage_perc"],
            aborted=after.get("jkv:requests_aborted_total", 0))  # fmt: skip
    finally:
        server.stop()

    # SIGTERM under load: in-flight requests complete, the process exits 0
    server = jkv_server(model, "--no-response-cache")
    try:

        async def term():
            work = asyncio.ensure_future(closed_loop(server.url, name, workload(64, seed=13), 64))
            await asyncio.sleep(1.5)
            server.proc.send_signal(signal.SIGTERM)
            return await work

        res = asyncio.run(term())
        code = server.proc.wait(120)
        stats = summarise(*res)
        late = sum(1 for r in res[0] if r["ok"] and r["e2e"] > 1.5)  # still running at SIGTERM
        row(table, "chaos: SIGTERM under load, c=64", stats, system="jkv", exit_code=code,
            in_flight_at_sigterm=late,
            note="requests sent after SIGTERM are refused by the closed socket (errors)")  # fmt: skip
    finally:
        server.stop()


def plot(table, path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(15, 4))
    for system, style in (("jkv", "o-"), ("transformers", "s--")):
        rows = [r for r in table if r.get("system") == system and "concurrency" in r
                and r["run"].startswith(("jkv c=", "transformers serve c="))]  # fmt: skip
        if not rows:
            continue
        c = [r["concurrency"] for r in rows]
        axes[0].plot(c, [r["out_tok_per_s"] for r in rows], style, label=system)
        axes[1].plot(c, [r["ttft_p99_ms"] for r in rows], style, label=system)
        axes[2].plot(c, [r["tpot_p99_ms"] for r in rows], style, label=system)
    for ax, title in zip(axes, ("output tokens/s", "TTFT P99 (ms)", "TPOT P99 (ms)"), strict=True):
        ax.set_xscale("log", base=2)
        ax.set_xlabel("concurrent clients")
        ax.set_title(title)
        ax.legend()
    fig.suptitle("jkv serve vs transformers serve (continuous batching), demo model, CPU")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


if __name__ == "__main__":
    main()
