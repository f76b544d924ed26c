"""Response-cache hit latency against its floor, on a realistic mix of prompts, in one process.

    python benchmarks/cache.py [--redis-url URL] [--prompts 50000] [--reps 20000] [--zipf 1.1]
                               [--out benchmarks/results/cache.json]

Workload: `--prompts` distinct prompts of ~1 KB (words with irregular whitespace, so
normalisation has work to do); requests draw them Zipf-distributed (rank k with probability
~ 1/k^zipf), the same sequence for every case, each call with a fresh copy of the prompt (an
equal str whose hash is not cached yet) and of the settings dict, as a server would. Every
prompt's entry is stored beforehand, so every timed lookup is a hit, but over many distinct
strings and entries: no memo of one hot prompt flatters the figures.

Figures (p50 / p99 of per-call `time.perf_counter_ns`):
- jkv L1 hit (`get_or_generate`) vs bare normalise + SHA-256 of the prompt (goal: p50 ratio
  <= 1.5);
- jkv L2 hit (a one-entry L1, no request repeating the previous one, so every call reads Redis)
  vs a raw redis-py GET + msgpack unpack of the same keys (goal: p50 ratio <= 1.3);
- both hits again with the settings resolved once (`cache.settings`, as `jkv.generate` does
  through its own memo) rather than packed from a fresh dict on every call;
- an L1 hit through `jkv.generate(..., cache=)` on the demo model vs the raw `cache.get` of the
  same request (goal: p50 ratio < 2);
- jkv's key computation alone; the L1 structure alone (jkv's `L1Cache.get` vs
  `cachetools.TTLCache` under a lock); GPTCache's exact-match cache when installed;
- one demo-model generation vs the same call answered by L1 and by L2.
Cases run interleaved call by call, in an order rotating from turn to turn, so machine noise
hits them alike; besides the ratio of p50s, the median over turns of the paired ratio (the two
calls of one turn) is reported, which a changing load on a shared machine moves less.
`gc.freeze()` after setup
keeps collections off the setup's objects. Every case is checked for correctness (a hit returns
the stored value) before it is timed. Starts its own redis-server on a free loopback port
unless --redis-url is given.
"""

from __future__ import annotations

import argparse
import atexit
import gc
import hashlib
import json
import os
import platform
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import msgpack  # noqa: E402
import numpy as np  # noqa: E402
import redis  # noqa: E402

from jkv.response_cache import Record, ResponseCache  # noqa: E402
from jkv.response_cache.codec import encode  # noqa: E402
from jkv.response_cache.keys import KeyHasher  # noqa: E402
from jkv.response_cache.l1 import L1Cache  # noqa: E402

MODEL = f"bench-{os.getpid()}-{time.time_ns() % 10**9}"  # fresh keys even on a shared Redis
VERSION = "model-identity-0123456789abcdef"
SETTINGS = {
    "temperature": 0.0,
    "top_k": None,
    "top_p": None,
    "min_p": None,
    "logit_keep_ratio": None,
    "seed": 0,
    "max_new_tokens": 128,
    "stop": [],
    "kv_policy": {"name": "snapkv", "budget": 512, "window": 32},
    "kv_dtype": "float8_e4m3fn",
    "backend": "xla",
}
STATS = {
    "prefill_s": 0.0123,
    "decode_s": 0.0456,
    "decode_tokens_per_s": 2800.0,
    "kv_bytes_used": 262144,
    "kv_bookkeeping_bytes": 1024,
    "kv_capacity": [512, 512, 512, 512],
    "kv_policy": {"name": "snapkv", "budget": 512, "window": 32},
    "batch_size": 1,
    "prompt_tokens": 230,
    "generated_tokens": 64,
}
ANSWER = {
    "text": "A cached answer. " * 16,
    "tokens": list(range(64)),
    "finish_reason": "stop",
    "kv_bytes": 294912,
    "stats": STATS,
}
GOALS = {"l1_hit_over_bare_hash_p50": 1.5, "l2_hit_over_raw_get_p50": 1.3}
GOALS_BELOW = {"generate_l1_hit_over_raw_cache_get_p50": 2.0}


# --------------------------------------------------------------------------- the workload
def make_prompts(n: int, nbytes: int, seed: int) -> list[str]:
    """`n` distinct prompts of ~`nbytes` characters: words from a 4,096-word vocabulary with
    irregular whitespace (runs of spaces, tabs, newlines)."""
    rng = np.random.default_rng(seed)
    letters = np.array(list("abcdefghijklmnopqrstuvwxyz"))
    lengths = rng.integers(2, 10, size=4096)
    vocab = ["".join(rng.choice(letters, size=k)) for k in lengths]
    seps = np.array([" ", " ", " ", "  ", "\n", " \t"])
    words = nbytes // 6 + 8
    out = []
    for i in range(n):
        ids = rng.integers(0, len(vocab), size=words)
        gaps = rng.integers(0, len(seps), size=words)
        text = "".join(vocab[w] + seps[g] for w, g in zip(ids, gaps, strict=True))
        out.append(f"{i} {text}"[:nbytes])  # the index makes every prompt distinct
    return out


def zipf_sequence(n_items: int, length: int, s: float, seed: int, no_repeat: bool = False):
    """`length` indices into `n_items`, rank k drawn with probability ~ 1/k^s (ranks shuffled
    over the items); with `no_repeat`, no index equals the one before it."""
    rng = np.random.default_rng(seed)
    weights = 1.0 / np.arange(1, n_items + 1) ** s
    order = rng.permutation(n_items)
    seq = order[rng.choice(n_items, size=length, p=weights / weights.sum())]
    if no_repeat:
        for i in range(1, length):
            while seq[i] == seq[i - 1]:
                seq[i] = order[rng.choice(n_items, p=weights / weights.sum())]
    return seq.tolist()


def fresh(text: str) -> str:
    """An equal str that is a new object, so its hash is not cached yet (as for a request)."""
    return text.encode().decode()


def bare_hash(prompt: str) -> str:
    return hashlib.sha256(" ".join(prompt.split()).encode()).hexdigest()


# --------------------------------------------------------------------------- timing
Case = tuple[Callable[[int], object], Callable[[object], object]]  # (make input i, timed call)


def percentiles(samples: list[int]) -> dict:
    s = sorted(samples)
    pick = lambda q: s[min(len(s) - 1, int(q * len(s)))] / 1000
    return {"p50_us": round(pick(0.5), 2), "p99_us": round(pick(0.99), 2), "n": len(s)}


def run_interleaved(cases: dict[str, Case], reps: int) -> dict[str, list[int]]:
    """Times each case once per turn, so machine noise hits every case alike; the order
    rotates from turn to turn, since the first call after a pause runs slower (cold caches).

    Returns:
        Each case's per-call nanoseconds, turn by turn (sample i of every case: turn i).
    """
    samples: dict[str, list[int]] = {name: [] for name in cases}
    names = list(cases)
    clock = time.perf_counter_ns
    chunk = 1000  # inputs are made ahead, untimed, a chunk at a time
    for start in range(0, reps, chunk):
        n = min(chunk, reps - start)
        inputs = {name: [make(start + i) for i in range(n)] for name, (make, _) in cases.items()}
        for i in range(n):
            turn = (start + i) % len(names)
            for name in names[turn:] + names[:turn]:
                arg = inputs[name][i]
                fn = cases[name][1]
                t0 = clock()
                fn(arg)
                samples[name].append(clock() - t0)
    return samples


def paired_ratio(a: list[int], b: list[int]) -> float:
    """The median over turns of a's time over b's in the same turn: robust to the load of a
    shared machine changing during the run, which moves both calls of a turn alike."""
    return round(statistics.median(x / y for x, y in zip(a, b, strict=True)), 3)


def warm(cases: dict[str, Case], n: int) -> None:
    for make, fn in cases.values():
        for i in range(n):
            fn(make(i))


# --------------------------------------------------------------------------- peers
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


def gptcache_case(prompts: list[str], seq: list[int]) -> Case | None:
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
    for i in sorted(set(seq)):
        api.put(prompts[i], ANSWER["text"], cache_obj=cache)
    assert api.get(prompts[seq[0]], cache_obj=cache) == ANSWER["text"], "GPTCache hit is wrong"
    return (lambda i: fresh(prompts[seq[i]]), lambda p: api.get(p, cache_obj=cache))


def l1_structure_cases() -> dict[str, Case]:
    record = Record("t", (1,), "stop", "v", None, 0.0)
    ours = L1Cache(1000, 1 << 26, 300.0)
    ours.put("k", record, 10, "m")
    cases: dict[str, Case] = {"l1_struct_jkv": (lambda i: "k", ours.get)}
    try:
        import cachetools
    except ImportError:
        return cases
    theirs, lock = cachetools.TTLCache(maxsize=1000, ttl=300.0), threading.Lock()
    theirs["k"] = record

    def cachetools_get(key):
        with lock:
            return theirs.get(key)

    cases["l1_struct_cachetools"] = (lambda i: "k", cachetools_get)
    return cases


# --------------------------------------------------------------------------- the cases
def fill_redis(url: str, cache: ResponseCache, prompts: list[str]) -> list[str]:
    """Every prompt's entry in Redis, written in pipelined batches; returns their keys."""
    raw = redis.Redis.from_url(url)
    value = encode(Record(*cache_record_fields()))
    keys = [cache.key(MODEL, VERSION, p, SETTINGS) for p in prompts]
    for start in range(0, len(keys), 5000):
        pipe = raw.pipeline(transaction=False)
        for key in keys[start : start + 5000]:
            pipe.set(key, value, ex=3600)
        pipe.execute()
    raw.close()
    return keys


def cache_record_fields() -> tuple:
    a = ANSWER
    return (a["text"], tuple(a["tokens"]), "stop", VERSION, None, time.time(), a["kv_bytes"], STATS)


def cache_cases(url: str, prompts: list[str], reps: int, zipf: float) -> tuple[dict, dict, list]:
    seq = zipf_sequence(len(prompts), reps, zipf, seed=1)
    l2_seq = zipf_sequence(len(prompts), max(1000, reps // 4), zipf, seed=2, no_repeat=True)
    # text keys, whitespace-normalised (the seed's canonical hash: the workload's irregular
    # whitespace is what normalisation is for)
    norm = dict(ttl=3600, normalize_whitespace=True)
    l1_cache = ResponseCache(url, node_id="bench-l1", l1_max_entries=len(prompts), **norm)
    l2_cache = ResponseCache(url, node_id="bench-l2", l1_max_entries=1, **norm)
    l2s_cache = ResponseCache(url, node_id="bench-l2s", l1_max_entries=1, **norm)
    keys = fill_redis(url, l1_cache, prompts)
    for p in prompts:  # every entry in L1 too (L2 -> L1 fill, as a warm node would have)
        assert l1_cache.get(MODEL, VERSION, p, SETTINGS).level == "l2"
    hit = l1_cache.get_or_generate(MODEL, VERSION, fresh(prompts[seq[0]]), dict(SETTINGS), None)
    assert hit.level == "l1" and hit.record.text == ANSWER["text"] and hit.record.stats == STATS
    for cache in (l2_cache, l2s_cache):
        for i in l2_seq[:3]:
            found = cache.get_or_generate(MODEL, VERSION, prompts[i], SETTINGS, None)
            assert found.level == "l2" and found.record.text == ANSWER["text"], found.level
    raw = redis.Redis.from_url(url)
    assert msgpack.unpackb(raw.get(keys[0])[1:])[0] == ANSWER["text"]
    hasher = KeyHasher(normalize_whitespace=True)
    assert hasher.digest("default", VERSION, prompts[0], SETTINGS) == keys[0].rsplit(":", 1)[1]

    request = lambda i: (fresh(prompts[seq[i]]), dict(SETTINGS))
    resolved = l1_cache.settings(SETTINGS)
    fast: dict[str, Case] = {
        "bare_normalise_sha256": (lambda i: fresh(prompts[seq[i]]), bare_hash),
        "jkv_l1_hit": (
            request,
            lambda a: l1_cache.get_or_generate(MODEL, VERSION, a[0], a[1], None),
        ),
        "jkv_l1_hit_settings": (  # settings resolved once (`cache.settings`), as jkv does
            lambda i: fresh(prompts[seq[i]]),
            lambda p: l1_cache.get_or_generate(MODEL, VERSION, p, resolved, None),
        ),
        "jkv_key": (request, lambda a: hasher.digest("default", VERSION, a[0], a[1])),
        **l1_structure_cases(),
    }
    gpt = gptcache_case(prompts, seq)
    if gpt is not None:
        fast["gptcache_exact_hit"] = gpt
    l2_request = lambda i: (fresh(prompts[l2_seq[i]]), dict(SETTINGS))
    slow: dict[str, Case] = {
        "raw_redis_get_unpack": (
            lambda i: keys[l2_seq[i]],
            lambda k: msgpack.unpackb(raw.get(k)[1:]),
        ),
        "jkv_l2_hit": (
            l2_request,
            lambda a: l2_cache.get_or_generate(MODEL, VERSION, a[0], a[1], None),
        ),
        "jkv_l2_hit_settings": (
            lambda i: fresh(prompts[l2_seq[i]]),
            lambda p: l2s_cache.get_or_generate(MODEL, VERSION, p, resolved, None),
        ),
    }
    caches = [l1_cache, l2_cache, l2s_cache]
    return fast, slow, caches


def generate_cases(url: str, prompts: list[str], reps: int, zipf: float) -> dict[str, Case]:
    """An L1 hit through `jkv.generate(..., cache=)` on the demo model vs the raw `cache.get` of
    the same request, keyed as generate keys it (`front.prompt_key`: the demo's tokenizer
    cannot see whitespace, so the text is normalised). The
    prompts' entries are stored with `put` (generating thousands of answers would take hours);
    one real generation checks that the hit equals it."""
    import jkv
    from jkv.request import Request
    from jkv.response_cache import front
    from jkv.response_cache.front import request_settings

    params = jkv.load("demo")
    kw = dict(max_new_tokens=6)
    req = Request.build(params, **{**kw})
    settings = request_settings(req, params)
    cache = ResponseCache(url, node_id="bench-generate", l1_max_entries=len(prompts))
    made = jkv.generate(params, prompts[0], cache=cache, **kw)
    again = jkv.generate(params, fresh(prompts[0]), cache=cache, **kw)
    assert made.cache is None and again.cache == "l1" and again.tokens == made.tokens
    keyed = [front.prompt_key(params, p) for p in prompts]  # what generate's key holds
    for p in keyed[1:]:
        cache.put(params.name, params.identity, p, settings, ANSWER)
    seq = zipf_sequence(len(prompts), reps, zipf, seed=3)
    hit = jkv.generate(params, prompts[seq[0]], cache=cache, **kw)
    assert hit.cache == "l1", hit.cache
    make = lambda i: fresh(prompts[seq[i]])
    return {
        "raw_cache_get": (
            lambda i: (make(i), dict(settings)),
            lambda a: cache.get(params.name, params.identity, front.prompt_key(params, a[0]), a[1]),
        ),
        "generate_l1_hit": (make, lambda p: jkv.generate(params, p, cache=cache, **kw)),
    }, cache


def hit_vs_generation(redis_url: str, reps: int = 5) -> dict:
    """One jkv.generate call on the model vs the same call answered by L1 and by L2."""
    import jkv
    from jkv.demo.haystack import make_example

    params = jkv.load("demo")
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
        "model": "demo",
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


# --------------------------------------------------------------------------- main
def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--redis-url", help="use this Redis instead of starting one")
    parser.add_argument("--prompts", type=int, default=50_000, help="distinct prompts")
    parser.add_argument("--reps", type=int, default=20_000, help="timed calls per fast case")
    parser.add_argument("--zipf", type=float, default=1.1, help="Zipf exponent of the requests")
    parser.add_argument("--out", default=str(Path(__file__).parent / "results" / "cache.json"))
    args = parser.parse_args()

    workdir = tempfile.mkdtemp(prefix="jkv-cache-bench-")
    proc = None
    url = args.redis_url
    if url is None:
        proc, url = start_redis(workdir)
    try:
        results = bench(url, args.prompts, args.reps, args.zipf)
    finally:
        if proc is not None:
            proc.kill()
            proc.wait()
        shutil.rmtree(workdir, ignore_errors=True)

    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(results, indent=2) + "\n")
    print_table(results)
    print(f"\nwrote {args.out}")


def bench(url: str, n_prompts: int, reps: int, zipf: float) -> dict:
    prompts = make_prompts(n_prompts, 1024, seed=0)
    fast, slow, caches = cache_cases(url, prompts, reps, zipf)
    gen_cases, gen_cache = generate_cases(url, prompts, reps, zipf)
    warm(fast, 1000)
    warm(slow, 200)
    warm(gen_cases, 500)
    gc.collect()
    gc.freeze()  # JAX and the workload came in at setup: keep collections to new objects
    samples = run_interleaved(fast, reps)
    samples.update(run_interleaved(gen_cases, reps))
    samples.update(run_interleaved(slow, max(1000, reps // 4)))
    gc.unfreeze()
    assert all(c.stats()["generations"] == 0 for c in caches)
    timings = {name: percentiles(s) for name, s in samples.items()}

    ratio = lambda a, b, q: round(timings[a][q] / timings[b][q], 3)
    paired = lambda a, b: paired_ratio(samples[a], samples[b])
    demo = hit_vs_generation(url)
    caches[0].invalidate_model(MODEL).wait(600)  # leave a shared Redis as it was
    gen_cache.invalidate_model("jkv-demo").wait(600)
    for c in [*caches, gen_cache]:
        c.close()
    raw = redis.Redis.from_url(url)
    machine = {
        "python": platform.python_version(),
        "platform": platform.platform(),
        "cpus": os.cpu_count(),
        "redis": raw.info("server")["redis_version"],
    }
    raw.close()
    return {
        "what": "response-cache hit latency, ~1 KB prompts, microseconds per call",
        "workload": {
            "distinct_prompts": n_prompts,
            "prompt_bytes": 1024,
            "request_distribution": f"Zipf s={zipf}",
            "timed_calls_fast": reps,
            "timed_calls_l2": max(1000, reps // 4),
        },
        "machine": machine,
        "timings": timings,
        "ratios": {
            "l1_hit_over_bare_hash_p50": ratio("jkv_l1_hit", "bare_normalise_sha256", "p50_us"),
            "l1_hit_over_bare_hash_p99": ratio("jkv_l1_hit", "bare_normalise_sha256", "p99_us"),
            "l1_hit_settings_over_bare_hash_p50": ratio(
                "jkv_l1_hit_settings", "bare_normalise_sha256", "p50_us"
            ),
            "l2_hit_over_raw_get_p50": ratio("jkv_l2_hit", "raw_redis_get_unpack", "p50_us"),
            "l2_hit_over_raw_get_p99": ratio("jkv_l2_hit", "raw_redis_get_unpack", "p99_us"),
            "l2_hit_settings_over_raw_get_p50": ratio(
                "jkv_l2_hit_settings", "raw_redis_get_unpack", "p50_us"
            ),
            "generate_l1_hit_over_raw_cache_get_p50": ratio(
                "generate_l1_hit", "raw_cache_get", "p50_us"
            ),
            "generate_l1_hit_over_raw_cache_get_p99": ratio(
                "generate_l1_hit", "raw_cache_get", "p99_us"
            ),
        },
        "paired_ratios": {  # median over turns of the two calls' ratio in the same turn
            "l1_hit_over_bare_hash": paired("jkv_l1_hit", "bare_normalise_sha256"),
            "l1_hit_settings_over_bare_hash": paired(
                "jkv_l1_hit_settings", "bare_normalise_sha256"
            ),
            "l2_hit_over_raw_get": paired("jkv_l2_hit", "raw_redis_get_unpack"),
            "l2_hit_settings_over_raw_get": paired("jkv_l2_hit_settings", "raw_redis_get_unpack"),
            "generate_l1_hit_over_raw_cache_get": paired("generate_l1_hit", "raw_cache_get"),
        },
        "goals": {**GOALS, **GOALS_BELOW},
        "demo_model_hit_vs_generation": demo,
    }


def print_table(results: dict) -> None:
    w = results["workload"]
    print(
        f"{w['distinct_prompts']:,} distinct prompts of {w['prompt_bytes']} B, "
        f"{w['request_distribution']}\n"
    )
    print(f"{'case':<26}{'p50 us':>10}{'p99 us':>10}{'n':>9}")
    for name, t in results["timings"].items():
        print(f"{name:<26}{t['p50_us']:>10.2f}{t['p99_us']:>10.2f}{t['n']:>9}")
    print()
    for name, value in results["ratios"].items():
        goal = results["goals"].get(name)
        sign = "<" if name in GOALS_BELOW else "<="
        print(f"{name:<42}{value:>7.3f}" + (f"   (goal {sign} {goal})" if goal else ""))
    print("\npaired (median over turns of the same turn's ratio):")
    for name, value in results["paired_ratios"].items():
        print(f"  {name:<40}{value:>7.3f}")
    d = results["demo_model_hit_vs_generation"]
    print(
        f"\nmodel {d['model']}: generation {d['generation_us'] / 1e3:.1f} ms, L1 hit "
        f"{d['l1_hit_us']:.1f} us ({d['generation_over_l1_hit']:.0f}x), L2 hit "
        f"{d['l2_hit_us']:.1f} us ({d['generation_over_l2_hit']:.0f}x)"
    )


if __name__ == "__main__":
    main()
