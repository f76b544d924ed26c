"""Response-cache hit latency against its floor and against GPTCache, in one process.

    python benchmarks/cache.py [--redis-url URL] [--reps 20000] [--out benchmarks/results/cache.json]

Figures (all for a 1 KB prompt, p50 / p99 of per-call `time.perf_counter_ns`):
- jkv L1 hit vs bare normalise + SHA-256 of the prompt (goal: p50 ratio <= 1.5);
- jkv L2 hit (L1 holds one entry, two prompts alternate, so every call misses L1) vs a raw
  redis-py GET + msgpack unpack of the same value (goal: p50 ratio <= 1.3);
- GPTCache's exact-match cache (map data manager, ExactMatchEvaluation, no embedding model)
  on the same prompt;
- jkv's key computation on first sight of a prompt (digest memo disabled);
- the L1 structure alone: jkv's `L1Cache.get` vs `cachetools.TTLCache` under a lock.
Each call gets a fresh copy of the prompt (an equal str whose hash is not cached yet) and of
the settings dict, as a server would. Cases run interleaved call by call, so machine noise
hits them alike; `gc.freeze()` after setup keeps collections off the imported modules. Every
case is checked for correctness (the hit returns the stored value) before it is timed.
Starts its own redis-server on a free loopback port unless --redis-url is given.
"""

from __future__ import annotations

import argparse
import atexit
import gc
import hashlib
import json
import os
import platform
import random
import shutil
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import msgpack  # noqa: E402
import redis  # noqa: E402

from jkv.cache import Record, ResponseCache  # noqa: E402
from jkv.cache.keys import KeyHasher  # noqa: E402
from jkv.cache.l1 import L1Cache  # noqa: E402

MODEL = f"bench-{os.getpid()}-{time.time_ns() % 10**9}"  # fresh keys even on a shared Redis
VERSION = "weights-fingerprint-0123456789ab"
SETTINGS = {
    "temperature": 0.0,
    "top_k": None,
    "top_p": None,
    "min_p": None,
    "logit_keep_ratio": None,
    "seed": None,
    "max_new_tokens": 128,
    "stop": [],
    "kv_policy": {"name": "snapkv", "budget": 512, "window": 32},
    "kv_dtype": "float8_e4m3fn",
}
ANSWER = {"text": "A cached answer. " * 16, "tokens": list(range(64)), "finish_reason": "stop"}


def make_prompt(nbytes: int, seed: int) -> str:
    """~nbytes of words with irregular whitespace (so normalisation has work to do)."""
    rng = random.Random(seed)
    out = []
    while sum(len(w) for w in out) < nbytes:
        out.append(
            "".join(rng.choice("abcdefghijklmnopqrstuvwxyz") for _ in range(rng.randint(2, 9)))
        )
        out.append(rng.choice([" ", " ", " ", "  ", "\n", " \t"]))
    return "".join(out)[:nbytes]


def bare_hash(prompt: str) -> str:
    return hashlib.sha256(" ".join(prompt.split()).encode()).hexdigest()


def percentiles(samples: list[int]) -> dict:
    s = sorted(samples)
    pick = lambda q: s[min(len(s) - 1, int(q * len(s)))] / 1000
    return {"p50_us": round(pick(0.5), 2), "p99_us": round(pick(0.99), 2), "n": len(s)}


def fresh(text: str) -> str:
    """An equal str that is a new object, so its hash is not cached yet (as for a request)."""
    return text.encode().decode()


Case = tuple[Callable[[], object], Callable[[object], object]]  # (make input, timed call)


def run_interleaved(cases: dict[str, Case], reps: int) -> dict:
    """Times each case once per turn, round-robin, so machine noise hits every case alike."""
    samples: dict[str, list[int]] = {name: [] for name in cases}
    clock = time.perf_counter_ns
    chunk = 1000  # inputs are made ahead, untimed, a chunk at a time
    for start in range(0, reps, chunk):
        n = min(chunk, reps - start)
        inputs = {name: [make() for _ in range(n)] for name, (make, _) in cases.items()}
        for i in range(n):
            for name, (_, fn) in cases.items():
                arg = inputs[name][i]
                t0 = clock()
                fn(arg)
                samples[name].append(clock() - t0)
    return {name: percentiles(s) for name, s in samples.items()}


def warm(cases: dict[str, Case], n: int) -> None:
    for make, fn in cases.values():
        for _ in range(n):
            fn(make())


def start_redis(workdir: str) -> tuple[subprocess.Popen, str]:
    binary = shutil.which("redis-server")
    if binary is None:
        sys.exit("redis-server is not installed (make redis), or pass --redis-url")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    proc = subprocess.Popen(
        [binary, "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no"]
        + ["--dir", workdir],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    url = f"redis://127.0.0.1:{port}/0"
    client = redis.Redis.from_url(url)
    for _ in range(500):
        try:
            client.ping()
            return proc, url
        except redis.ConnectionError:
            time.sleep(0.01)
    proc.kill()
    sys.exit(f"redis-server did not start on port {port}")


def gptcache_case(prompt: str) -> Callable[[str], object] | None:
    try:
        from gptcache import Cache
        from gptcache.adapter import api
        from gptcache.manager import get_data_manager
        from gptcache.processor.pre import get_prompt
        from gptcache.similarity_evaluation import ExactMatchEvaluation
    except ImportError:
        print("gptcache not installed (pip install -e '.[bench]'): its row is left out")
        return None
    gpt_dir = tempfile.mkdtemp(prefix="jkv-gptcache-")
    atexit.register(shutil.rmtree, gpt_dir, True)  # LIFO: runs after GPTCache's own flush
    cache = Cache()
    cache.init(
        pre_embedding_func=get_prompt,
        data_manager=get_data_manager(data_path=os.path.join(gpt_dir, "map.txt")),
        similarity_evaluation=ExactMatchEvaluation(),
    )
    api.put(prompt, ANSWER["text"], cache_obj=cache)
    assert api.get(prompt, cache_obj=cache) == ANSWER["text"], "GPTCache hit is wrong"
    return lambda p: api.get(p, cache_obj=cache)


def l1_structure_cases() -> dict[str, Case]:
    record = Record("t", (1,), "stop", "v", None, 0.0)
    ours = L1Cache(1000, 1 << 26, 300.0)
    ours.put("k", record, 10, "m")
    cases: dict[str, Case] = {"l1_struct_jkv": (lambda: "k", ours.get)}
    try:
        import cachetools
    except ImportError:
        return cases
    theirs, lock = cachetools.TTLCache(maxsize=1000, ttl=300.0), threading.Lock()
    theirs["k"] = record

    def cachetools_get(key):
        with lock:
            return theirs.get(key)

    cases["l1_struct_cachetools"] = (lambda: "k", cachetools_get)
    return cases


def load_model():
    """The bundled demo model (models/demo)."""
    import jkv

    return jkv.load("demo"), "demo"


def hit_vs_generation(redis_url: str, reps: int = 5) -> dict:
    """One jkv.generate call on the model vs the same call answered by L1 and by L2."""
    import jkv

    params, label = load_model()
    import numpy as np

    from models.haystack import make_example

    ctx = params.config.max_position_embeddings
    prompt = make_example(np.random.default_rng(0), ctx, 1).prompt  # a full-context haystack
    kw = dict(max_new_tokens=6)  # the 5 digits and </s>
    jkv.generate(params, prompt, **kw)  # compile
    gen = sorted(timed_once(lambda: jkv.generate(params, prompt, **kw)) for _ in range(reps))
    node_a = ResponseCache(redis_url, node_id="bench-a")
    node_b = ResponseCache(redis_url, node_id="bench-b")
    try:
        made = jkv.generate(params, prompt, cache=node_a, **kw)
        assert made.cache is None
        l1 = sorted(
            timed_once(lambda: jkv.generate(params, prompt, cache=node_a, **kw)) for _ in range(200)
        )
        l2 = []
        for _ in range(200):
            node_b._l1.clear()  # a cold L1: the hit must come from Redis
            l2.append(timed_once(lambda: jkv.generate(params, prompt, cache=node_b, **kw)))
        l2.sort()
        node_a.invalidate_model(params.name).wait(60)
    finally:
        node_a.close()
        node_b.close()
    med = lambda xs: xs[len(xs) // 2] * 1e6
    return {
        "model": label,
        "generation_us": med(gen),
        "l1_hit_us": med(l1),
        "l2_hit_us": med(l2),
        "generation_over_l1_hit": med(gen) / med(l1),
        "generation_over_l2_hit": med(gen) / med(l2),
    }


def timed_once(fn) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--redis-url", help="use this Redis instead of starting one")
    parser.add_argument("--reps", type=int, default=20000, help="timed calls per case")
    parser.add_argument("--out", default=str(Path(__file__).parent / "results" / "cache.json"))
    args = parser.parse_args()

    workdir = tempfile.mkdtemp(prefix="jkv-cache-bench-")
    proc = None
    url = args.redis_url
    if url is None:
        proc, url = start_redis(workdir)
    try:
        results = bench(url, args.reps)
    finally:
        if proc is not None:
            proc.kill()
            proc.wait()
        shutil.rmtree(workdir, ignore_errors=True)

    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(results, indent=2) + "\n")
    print_table(results)
    print(f"\nwrote {args.out}")


def bench(url: str, reps: int) -> dict:
    prompt, other = make_prompt(1024, 0), make_prompt(1024, 1)
    l1_cache = ResponseCache(url, node_id="bench-l1", ttl=600)
    first = l1_cache.get_or_generate(MODEL, VERSION, prompt, SETTINGS, lambda: ANSWER)
    hit = l1_cache.get_or_generate(MODEL, VERSION, fresh(prompt), dict(SETTINGS), None)
    assert first.level is None and hit.level == "l1" and hit.record.text == ANSWER["text"]

    l2_cache = ResponseCache(url, node_id="bench-l2", l1_max_entries=1, ttl=600)
    l2_cache.put(MODEL, VERSION, other, SETTINGS, ANSWER)
    turn = [prompt, other]
    for p in turn * 2:  # each call evicts the other prompt from the one-entry L1
        found = l2_cache.get_or_generate(MODEL, VERSION, p, SETTINGS, None)
        assert found.level == "l2" and found.record.text == ANSWER["text"], found.level

    def next_turn() -> tuple[str, dict]:
        turn.reverse()
        return fresh(turn[0]), dict(SETTINGS)

    raw = redis.Redis.from_url(url)
    key = l1_cache.key(MODEL, VERSION, prompt, SETTINGS)
    assert msgpack.unpackb(raw.get(key)[1:])[0] == ANSWER["text"]
    no_memo = KeyHasher(max_entries=0)
    assert no_memo.digest("default", VERSION, prompt, SETTINGS) == key.rsplit(":", 1)[1]

    request = lambda: (fresh(prompt), dict(SETTINGS))
    fast: dict[str, Case] = {
        "bare_normalise_sha256": (lambda: fresh(prompt), bare_hash),
        "jkv_l1_hit": (
            request,
            lambda a: l1_cache.get_or_generate(MODEL, VERSION, a[0], a[1], None),
        ),
        "jkv_key_without_memo": (
            request,
            lambda a: no_memo.digest("default", VERSION, a[0], a[1]),
        ),
        **l1_structure_cases(),
    }
    gpt = gptcache_case(prompt)
    if gpt is not None:
        fast["gptcache_exact_hit"] = (lambda: fresh(prompt), gpt)
    slow: dict[str, Case] = {
        "raw_redis_get_unpack": (lambda: key, lambda k: msgpack.unpackb(raw.get(k)[1:])),
        "jkv_l2_hit": (
            next_turn,
            lambda a: l2_cache.get_or_generate(MODEL, VERSION, a[0], a[1], None),
        ),
    }
    warm(fast, 1000)
    warm(slow, 200)
    gc.collect()
    gc.freeze()  # JAX came in with jkv: keep collections to the benchmark's own objects
    timings = run_interleaved(fast, reps)
    timings.update(run_interleaved(slow, max(1000, reps // 4)))
    gc.unfreeze()
    assert l2_cache.stats()["generations"] == 0 and l1_cache.stats()["generations"] == 1

    ratio = lambda a, b, q: round(timings[a][q] / timings[b][q], 3)
    demo = hit_vs_generation(url)
    l1_cache.invalidate_model(MODEL).wait(60)  # leave a shared Redis as it was
    for c in (l1_cache, l2_cache):
        c.close()
    return {
        "what": "response-cache hit latency, 1 KB prompt, microseconds per call",
        "machine": {
            "python": platform.python_version(),
            "platform": platform.platform(),
            "cpus": os.cpu_count(),
            "redis": raw.info("server")["redis_version"],
        },
        "prompt_bytes": len(prompt.encode()),
        "timings": timings,
        "ratios": {
            "l1_hit_over_bare_hash_p50": ratio("jkv_l1_hit", "bare_normalise_sha256", "p50_us"),
            "l1_hit_over_bare_hash_p99": ratio("jkv_l1_hit", "bare_normalise_sha256", "p99_us"),
            "l2_hit_over_raw_get_p50": ratio("jkv_l2_hit", "raw_redis_get_unpack", "p50_us"),
            "l2_hit_over_raw_get_p99": ratio("jkv_l2_hit", "raw_redis_get_unpack", "p99_us"),
        },
        "goals": {"l1_hit_over_bare_hash_p50": 1.5, "l2_hit_over_raw_get_p50": 1.3},
        "demo_model_hit_vs_generation": demo,
    }


def print_table(results: dict) -> None:
    print(f"{'case':<26}{'p50 us':>10}{'p99 us':>10}{'n':>9}")
    for name, t in results["timings"].items():
        print(f"{name:<26}{t['p50_us']:>10.2f}{t['p99_us']:>10.2f}{t['n']:>9}")
    print()
    for name, value in results["ratios"].items():
        goal = results["goals"].get(name)
        print(f"{name:<34}{value:>7.3f}" + (f"   (goal <= {goal})" if goal else ""))
    d = results["demo_model_hit_vs_generation"]
    print(
        f"\nmodel {d['model']}: generation {d['generation_us'] / 1e3:.1f} ms, L1 hit "
        f"{d['l1_hit_us']:.1f} us ({d['generation_over_l1_hit']:.0f}x), L2 hit "
        f"{d['l2_hit_us']:.1f} us ({d['generation_over_l2_hit']:.0f}x)"
    )


if __name__ == "__main__":
    main()
