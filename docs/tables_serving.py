"""Generated tables of the engine, the server and the response cache (docs/render_tables.py)."""

from __future__ import annotations

from tables_fmt import load, md, num, table


@table("engine_capacity")
def engine_capacity(results):
    d = load(results, "engine_capacity")
    rows = [
        [
            r["config"],
            r["admission"],
            num(r["pages"]),
            r["peak_requests"],
            num(r["x_peak"], 2),
            num(r["mean_requests"], 2),
            num(r["x_requests"], 2),
            r["preemptions"],
            num(r["tokens_per_s"]),
            r["equal_to_generate"],
        ]
        for r in d["rows"]
    ]
    header = ["config", "admission", "pages", "peak requests", "x full", "mean requests"]
    header += ["x full", "preemptions", "tokens/s", "tokens = generate"]
    return md(header, rows)


@table("serve_compression_tuned_memory16")
def serve_compression_tuned_memory16(results):
    d = load(results, "serve_compression_tuned_memory16")
    rows = [
        [
            "full cache" if r["config"] == "full" else "SnapKV 25% (tuned)",
            "fp8" if r["kv_dtype"].startswith("float8") else r["kv_dtype"],
            num(r["pages"]),
            r["peak_requests"],
            num(r["mean_requests"], 2),
            num(r["x_requests"], 2),
            num(r["tokens_per_s"], 2),
            num(r["x_tokens_per_s"], 2),
            f"{num(r['ttft_p50_s'], 1)} / {num(r['ttft_p99_s'], 1)}",
            num(r["tpot_p50_ms"]),
            r["correct"],
            r["prefix_hits"],
        ]
        for r in d["rows"]
    ]
    floor = d["prefill_floor"]
    rows.append(["the prompts alone (1 token each)", floor["kv_dtype"], "", "", "", "", "", "",
                 f"{num(floor['seconds'], 1)} s in all", "", "",
                 f"ceiling {num(floor['ceiling_x_tokens_per_s'], 2)}x"])  # fmt: skip
    header = ["config", "kv", "pages", "peak requests", "mean", "x full", "tokens/s", "x full"]
    header += ["TTFT P50 / P99 s", "TPOT P50 ms", "right", "prefix hits"]
    return md(header, rows)


def _kv(r) -> str:
    return "fp8" if r["kv_dtype"].startswith("float8") else r["kv_dtype"]


def _config(r) -> str:
    return "full cache" if r["config"] == "full" else f"{r['config']} 25%"


@table("serve_compression_all8_fp8")
def serve_compression_all8_fp8(results):
    d = load(results, "serve_compression_all8_fp8")
    rows = [
        [_config(r), _kv(r), r["rows"], num(r["step_ms"], 1), num(r["x_step"], 2),
         num(r["tokens_per_s"], 1), num(r["held_mean"], 1)]
        for r in d["rows"] if r["view"] == "same batch"
    ]  # fmt: skip
    header = ["config", "kv", "rows", "decode step ms", "x full", "tokens/s", "held per head"]
    return md(header, rows)


@table("engine_host")
def engine_host(results):
    rows = []
    for stem, label in (("engine_host_before", "before"), ("engine_host", "now")):
        d = load(results, stem)
        for r in d["rows"]:
            ms = [num(r[k], 3) for k in ("schedule_ms", "pack_ms", "finish_ms", "total_ms")]
            rows.append([f"{label}: {d['code']}", num(r["prompt"]), *ms])
    header = ["code", "prompt", "schedule ms", "pack ms", "finish ms", "total ms per step"]
    return md(header, rows)


@table("engine_step")
def engine_step(results):
    rows = []
    for stem, label in (
        ("engine_step_demo_before", "before (gathering step), demo shape"),
        ("engine_step_demo", "flattened step (ragged XLA path), demo shape"),
        ("engine_step_125m", "flattened step, 125M shape"),
    ):
        d = load(results, stem)
        ms = d["ms"]
        cols = [f"{num(ms[k], 2)} ms" for k in ("16 x 32", "1 x 1000", "16 x 32 + 1 x 1000")]
        rows.append([label, *cols, num(d["ratio"], 2)])
    header = ["engine", "16 x 32", "1 x 1000", "16 x 32 + 1 x 1000", "mixed / (short + long)"]
    return md(header, rows)


@table("engine_offline")
def engine_offline(results):
    demo, big = load(results, "engine_offline"), load(results, "engine_offline_125m")
    theirs = {r["system"]: r for r in big["rows"]}  # a row the 125M run lacks: not run on it
    rows = []
    for a in demo["rows"]:
        b = theirs.get(a["system"])
        cells = [num(a["seconds"], 2), num(a["tokens_per_s"]), num(a["vs_sequential"], 2)]
        cells += (["not run"] * 3 if b is None else
                  [num(b["seconds"], 1), num(b["tokens_per_s"], 1), num(b["vs_sequential"], 2)])  # fmt: skip
        rows.append([a["system"].replace("|", "/"), *cells])
    header = ["system", "demo: seconds", "tokens/s", "x one at a time"]
    header += ["125M: seconds", "tokens/s", "x one at a time"]
    extra = [
        "",
        f"Engine warm-up: {num(demo['engine_warmup_s'])} s (demo), "
        f"{num(big['engine_warmup_s'])} s (125M); engine tokens equal one at a time: "
        f"{demo['engine_equals_sequential']} / {big['engine_equals_sequential']}; transformers' "
        f"tokens equal jkv's for {num(demo['transformers_agreement'] * 100, 1)}% / "
        f"{num(big['transformers_agreement'] * 100, 1)}% of the requests.",
    ]
    return md(header, rows) + extra


@table("engine_offline_steps")
def engine_offline_steps(results):
    rows = []
    for shape, name in (("demo", "engine_offline"), ("125M", "engine_offline_125m")):
        for mode, sp in load(results, name).get("engine_steps", {}).items():
            rows.append([shape, mode, str(sp["steps"]), num(sp["ms_per_step"], 2),
                         num(sp["host_waiting_ms_per_step"], 2),
                         num(sp["host_busy_ms_per_step"], 2),
                         f"{num(sp['device_waited_share'] * 100)}%"])  # fmt: skip
    header = ["shape", "engine", "steps", "ms per step", "host waits for the device (ms)",
              "host busy (ms)", "steps dispatched to an idle device"]  # fmt: skip
    return md(header, rows)


def _run_name(r):
    who = "jkv" if r["system"] == "jkv" else "transformers serve"
    if r.get("concurrency") is None:
        return f"{who}, Poisson {num(r['rate'])} req/s"
    return f"{who}, {r['concurrency']} client" + ("s" if r["concurrency"] > 1 else "")


def _ms(r, key, digits):
    return f"{num(r[key + '_p50_ms'], digits)} / {num(r[key + '_p99_ms'], digits)}"


@table("serve_load")
def serve_load(results):
    d = load(results, "serve_load")
    rows = [
        [
            _run_name(r),
            f"{r['completed']} / {r['requests']}",
            num(r["out_tok_per_s"]),
            _ms(r, "ttft", 0),
            _ms(r, "tpot", 1),
            "" if "same_text_as_jkv" not in r else f"{r['same_text_as_jkv']:.0%}",
        ]
        for r in d["rows"]
        if r["part"] in ("load", "peer")
    ]
    header = ["run", "completed", "tok/s", "TTFT P50 / P99 ms", "TPOT P50 / P99 ms"]
    return md(header + ["same text as jkv"], rows)


@table("serve_pressure")
def serve_pressure(results):
    d = load(results, "serve_load")
    rows = [
        [
            r["run"].removeprefix("pressure "),
            num(r["out_tok_per_s"]),
            r["preemptions"],
            num(r["prefix_hit_rate"], 2),
            num(r["ttft_p99_ms"]),
            num(r["tpot_p99_ms"], 1),
        ]
        for r in d["rows"]
        if r["part"] == "pressure"
    ]
    header = ["run", "tok/s", "preemptions", "prefix hit rate", "TTFT P99 ms", "TPOT P99 ms"]
    return md(header, rows)


def _chaos_detail(r):
    if "aborted" in r:
        return (
            f"{num(r['aborted'])} aborted, {num(r['running_after'])} running afterwards, "
            f"KV usage {r['usage_before']} before, {r['usage_after']} after"
        )
    if "in_flight_at_sigterm" in r:
        return f"{r['in_flight_at_sigterm']} in flight at the signal, exit code {r['exit_code']}"
    if "accepted_all_completed" in r:
        return f"every accepted request completed: {r['accepted_all_completed']}"
    return ""


@table("serve_chaos")
def serve_chaos(results):
    d = load(results, "serve_load")
    rows = [
        [
            r["run"].removeprefix("chaos: "),
            r["requests"],
            r["completed"],
            r["errors"],
            r["rejected_503"],
            _chaos_detail(r),
        ]
        for r in d["rows"]
        if r["part"] == "chaos"
    ]
    header = ["chaos", "requests", "completed", "errors", "503", "afterwards"]
    return md(header, rows)


@table("serve_soak")
def serve_soak(results):
    d = load(results, "serve_soak")
    fivexx = sum(v for k, v in d["5xx_or_broken"].items() if "5xx" in k)
    broken = {k: v for k, v in d["5xx_or_broken"].items() if "5xx" not in k}
    kinds = ", ".join(f"{k} {v}" for k, v in broken.items())
    rss = d["rss_mb"]
    half = d["rss_mb_each_minute"][len(d["rss_mb_each_minute"]) // 2]
    row = [
        num(d["minutes"], 1),
        num(d["requests"] + d["burst_ok"] + d["burst_503"]),
        num(d["ok"] + d["burst_ok"]),
        num(d["left"]),
        num(d["queue_full_503"] + d["burst_503"]),
        fivexx,
        f"{sum(broken.values())} ({kinds})" if broken else "0",
        f"{num(rss[0])} -> {num(rss[1])} (+{num(rss[1] - rss[0])})",
        f"{num(half)} -> {num(rss[1])} (+{num(rss[1] - half)})",
        f"{d['kv_usage'][0]:.3f} -> {d['kv_usage'][1]:.3f}",
    ]
    header = ["minutes", "requests", "completed", "left by their client"]
    header += [f"503 queue_full ({d['bursts']} bursts)", "5xx", "broken"]
    header += ["RSS MB after warm-up -> end", "RSS MB at half-time -> end", "KV usage"]
    return md(header, [row])


CACHE_CASES = [
    ("bare_normalise_sha256", "bare normalise + SHA-256 of the prompt (the floor)"),
    ("jkv_key", "jkv's key alone"),
    ("jkv_l1_hit", "jkv L1 hit"),
    ("jkv_l1_hit_settings", "jkv L1 hit, settings resolved once"),
    ("l1_struct_jkv", "L1 structure alone (jkv)"),
    ("l1_struct_cachetools", "L1 structure alone (cachetools.TTLCache + lock)"),
    ("raw_cache_get", "raw `cache.get` of a request"),
    ("generate_l1_hit", "`jkv.generate(..., cache=)` answered by L1"),
    ("raw_redis_get_unpack", "raw redis-py GET + msgpack unpack (the floor)"),
    ("jkv_l2_hit", "jkv L2 hit"),
    ("jkv_l2_hit_settings", "jkv L2 hit, settings resolved once"),
]


@table("cache")
def cache(results):
    d = load(results, "cache")
    t = d["timings"]
    rows = [[label, num(t[k]["p50_us"], 2), num(t[k]["p99_us"], 2)] for k, label in CACHE_CASES]
    lines = md(["call", "p50 µs", "p99 µs"], rows)
    goals = [
        [k.removesuffix("_p50").replace("_", " "), num(d["ratios"][k], 2), f"<= {v}"]
        for k, v in d["goals"].items()
    ]
    return lines + [""] + md(["ratio (p50)", "measured", "goal"], goals)


@table("serve_scale")
def serve_scale(results):
    d = load(results, "serve_scale")
    rows = [
        [
            r["traffic"],
            r["run"],
            f"{r['completed']} / {r['requests']}",
            num(r["out_tok_per_s"]),
            f"{num(r['ttft_p50_ms'], 0)} / {num(r['ttft_p99_ms'], 0)}",
            f"{r['prefix_hit_rate']:.3f}",
            " / ".join(str(b) for b in r["blocks_per_replica"]),
        ]
        for r in d["serve"]
        if r["pass"] == "second"  # the first may still compile a shape (serve_scale.py)
    ]
    header = ["traffic", "run", "completed", "tok/s", "TTFT P50 / P99 ms", "prefix hit rate",
              "blocks looked up per replica"]  # fmt: skip
    lines = md(header, rows)
    l2 = d["l2_hit"]
    names = ("redis", "redis cluster")
    l2_rows = [[n, num(l2[n]["p50_us"], 1), num(l2[n]["p99_us"], 1)] for n in names]
    l2_rows.append(["cluster / single", f"{l2['cluster_over_single_p50']:.2f}x",
                    f"{l2['cluster_over_single_p99']:.2f}x"])  # fmt: skip
    return lines + [""] + md(["L2 hit (`ResponseCache.get`)", "P50 µs", "P99 µs"], l2_rows)
