"""Generated tables of decode speed, the kernels on a GPU, and README's headline figures."""

from __future__ import annotations

from tables_fmt import gb, load, md, num, one, table


def _decode_cpu_rows(d):
    return [
        [
            r["config"],
            r["batch"],
            num(r["prompt"]),
            r["new_tokens"],
            r.get("jkv_weights", "float32"),
            num(r["jkv_decode_tok_s"], 1),
            num(r["hf_decode_tok_s"], 1),
            f"{r['decode_ratio']:.2f}x",
            r["rows_identical"],
        ]
        for r in d["rows"]
    ]


DECODE_HEADER = ["config", "B", "prompt", "new", "jkv weights", "jkv decode tok/s"]
DECODE_HEADER += ["transformers tok/s", "ratio", "same tokens"]


@table("decode_cpu")
def decode_cpu(results):
    return md(DECODE_HEADER, _decode_cpu_rows(load(results, "decode_cpu")))


@table("decode_cpu_smollm2")
def decode_cpu_smollm2(results):
    d = load(results, "decode_cpu_smollm2")
    note = f"Read bandwidth measured beside it: {num(d['read_bandwidth_gb_s'], 1)} GB/s."
    rows = [
        [*row, f"{num(r['jkv_weight_gb_s'], 1)} GB/s ({r['jkv_weight_gb_s'] / bw:.0%})",
         _llamacpp(r)]
        for row, r, bw in zip(_decode_cpu_rows(d), d["rows"],
                              [d["read_bandwidth_gb_s"]] * len(d["rows"]), strict=True)
    ]  # fmt: skip
    header = [*DECODE_HEADER, "jkv weight reads (of the bandwidth)",
              "llama.cpp on the GGUF tok/s (jkv's ratio; same tokens)"]  # fmt: skip
    return md(header, rows) + ["", note]


def _llamacpp(r: dict) -> str:
    if r.get("llamacpp_decode_tok_s") is None:
        return "—"
    same = f"{r['llamacpp_same_tokens']}/{r['new_tokens']}"
    return f"{num(r['llamacpp_decode_tok_s'], 1)} ({r['llamacpp_ratio']:.2f}x; {same})"


def _k(s):
    return f"{s // 1024}K"


@table("gpu_decode")
def gpu_decode(results):
    run = load(results, "gpu_check")["run1"]
    rows = []
    for r in run["decode"]:
        if r["S"] < 32768:
            continue
        if r.get("pallas_GBps") is None:
            rows.append([r["dtype"], r["B"], _k(r["S"]), "crashed (see below)", "—", "—"])
            continue
        us = num(r["pallas_device_s"] * 1e6)
        gqa = num(r["jax_gqa_GBps"]) if r.get("jax_gqa_GBps") else "—"
        cells = [f"{num(r['pallas_GBps'])} ({us} µs)", num(r["xla_reference_GBps"]), gqa]
        rows.append([r["dtype"], r["B"], _k(r["S"]), *cells])
    header = ["storage", "B", "S", "jkv `decode_attention` GB/s", "XLA reference"]
    copy = f"A device-to-device copy in the same run: {num(run['copy']['GBps'])} GB/s (wall clock)."
    return md(header + ["jax `gqa` (with its transpose)"], rows) + ["", copy]


@table("gpu_decode_fp8_native")
def gpu_decode_fp8_native(results):
    run = load(results, "gpu_check")["run4"]
    rows = [
        [r["B"], _k(r["S"]), num(r["pallas_GBps"]), num(r["pallas_native_GBps"])]
        for r in run["decode"]
        if r["dtype"] == "fp8"
    ]
    bf16 = {(r["B"], r["S"]): r["pallas_GBps"] for r in run["decode"] if r["dtype"] == "bf16"}
    for row, r in zip(rows, [r for r in run["decode"] if r["dtype"] == "fp8"], strict=True):
        row.append(num(bf16[(r["B"], r["S"])]))
    return md(["B", "S", "fp8 GB/s", "fp8_native=True GB/s", "bf16 GB/s"], rows)


@table("gpu_prefill")
def gpu_prefill(results):
    rows = []
    for r in load(results, "gpu_check")["run2"]["prefill"]:
        ref = num(r["xla_reference_TFLOPs"], 1) if "xla_reference_TFLOPs" in r else "—"
        us = r["pallas_device_s"] * 1e6
        time = f"{num(us)} µs" if us < 1000 else f"{num(us / 1000, 2)} ms"
        cells = [f"{num(r['pallas_TFLOPs'])} ({time})", num(r["xla_blocked_TFLOPs"], 1), ref]
        rows.append([r["B"], _k(r["S"]), *cells])
    header = ["B", "S", "jkv `prefill_attention` TFLOP/s", "XLA blocked path (`xla`)"]
    return md(header + ["XLA reference (materialised)"], rows)


@table("gpu_paged")
def gpu_paged(results):
    rows = [
        [
            r["B"],
            _k(r["S"]),
            num(r["paged_GBps"]),
            num(r["dense_GBps"]),
            f"{1 - r['paged_GBps'] / r['dense_GBps']:.1%}",
        ]
        for r in load(results, "gpu_check")["run2"]["paged"]
    ]
    return md(["B", "S", "paged GB/s", "dense GB/s", "cost of the page table"], rows)


@table("gpu_checks")
def gpu_checks(results):
    d = load(results, "gpu_check")
    rows = []
    for name in ("run1", "run2", "run3", "run4"):
        run = d[name]
        ok = sum(c["ok"] for c in run["checks"])
        failed = ", ".join(run["failed"]) or "—"
        m = run["meta"]
        rows.append([name, m["device"], m["jax"], f"{ok} / {len(run['checks'])}", failed])
    return md(["call", "device", "jax", "checks passed", "failed"], rows)


def _best(rows, key):
    return max((r for r in rows if r.get(key) is not None), key=lambda r: r[key])


@table("headline")
def headline(results):
    gpu = load(results, "gpu_check")
    dec = _best(gpu["run1"]["decode"], "pallas_GBps")
    fp8 = one(gpu["run1"]["decode"], dtype="fp8", B=dec["B"], S=dec["S"])
    pre = _best(gpu["run2"]["prefill"], "pallas_TFLOPs")
    kv = load(results, "kv_memory")["goals"]
    cap = one(
        load(results, "engine_capacity")["rows"], config="SnapKV 25% + fp8", admission="reserve"
    )
    long = one(load(results, "serve_compression_tuned_memory16")["rows"], view="same memory",
               config="SnapKV-tuned", kv_dtype="float8_e4m3fn")  # fmt: skip
    step2k = one(load(results, "serve_compression_batch2k")["rows"], view="same batch",
                 config="SnapKV")  # fmt: skip
    serve = load(results, "serve_load")["rows"]
    jkv256 = one(serve, system="jkv", concurrency=256, part="load")
    peer256 = one(serve, system="transformers", concurrency=256)
    quality = load(results, "quality")["accuracy"]
    tuned = one(quality, peer="jkv", method="snapkv:window=16,kernel=11,pool=max", ratio=0.1,
                mode="aware", context=512, facts=4)  # fmt: skip
    real = one(load(results, "quality_real_1k_single_tuned")["rows"], kind="needle", ratio=0.1,
               mode="aware")  # fmt: skip
    kvzip = load(results, "quality_real_kvzip_1k")["rows"]
    zip_jkv, zip_peer = (one(kvzip, kind="needle", who=who, ratio=0.25, mode="agnostic")
                         for who in ("jkv", "kvpress"))  # fmt: skip
    offline = one(
        load(results, "engine_offline")["rows"], system="jkv.Engine (continuous batching)"
    )
    host = load(results, "engine_host")["rows"][-1]
    peak = load(results, "long_context")["llama_8b_131k"]["predicted_prefill_peak"]
    h200 = load(results, "gpu_memory_check")["rows"][-1]["peak"]
    rows = [
        ["bf16 decode attention, H200", f"{num(dec['pallas_GBps'])} GB/s", "docs/kernels.md"],
        ["fp8 decode attention, same shape (slower: a miss)", f"{num(fp8['pallas_GBps'])} GB/s",
         "docs/kernels.md"],
        ["prefill attention, 512-token chunk, H200", f"{num(pre['pallas_TFLOPs'])} TFLOP/s "
         f"({num(pre['pallas_TFLOPs'] / pre['xla_blocked_TFLOPs'], 1)}x the XLA path)",
         "docs/kernels.md"],
        ["KV saved, Llama-3.1-8B at 128K, SnapKV 10% + FP8 vs bf16",
         f"{kv['snapkv10_fp8_saving']:.1%}", "docs/generation.md"],
        ["prefill peak, Llama-3.1-8B at 131,072 tokens (predicted / compiled on an H200)",
         f"{gb(peak, 1)} / {gb(h200, 1)} GB", "docs/long-prompts.md"],
        ["requests one KV pool holds (peak) / its throughput, SnapKV 25% + FP8 vs full cache, "
         "demo shape", f"{num(cap['x_peak'], 2)}x / {num(cap['x_throughput'], 2)}x",
         "docs/engine.md"],
        ["SmolLM2 in 4 full requests' memory, SnapKV 25% + fp8 vs full cache: requests held "
         "(mean) / throughput / right, CPU (goals 3x / 2.5x / 95%: throughput missed)",
         f"{num(long['x_requests'], 2)}x / {num(long['x_tokens_per_s'], 2)}x / {long['correct']}",
         "docs/engine.md"],
        ["decode step, 16 SmolLM2 rows of 2K tokens, SnapKV 25% vs full cache, CPU",
         f"{num(step2k['x_step'], 2)}x faster", "docs/engine.md"],
        ["engine vs `jkv.generate` one at a time, demo shape, CPU (goal 3x: missed)",
         f"{num(offline['vs_sequential'], 2)}x", "docs/engine.md"],
        ["engine host work per decode step, 64 rows of 16K tokens", f"{num(host['total_ms'], 3)} ms",
         "docs/engine.md"],
        ["`jkv serve` at 256 clients vs `transformers serve`, CPU",
         f"{num(jkv256['out_tok_per_s'])} vs {num(peer256['out_tok_per_s'])} tok/s",
         "docs/serving.md"],
        ["SnapKV 10% (window 16, max-pool 11), demo 4-fact haystacks, query-aware",
         f"{num(tuned['accuracy'], 2)} (full cache 1.00)", "docs/quality.md"],
        ["SnapKV 10% (window 16, max-pool 21), SmolLM2 needle in 1K tokens, query-aware",
         f"{real['right']}/{real['n']}", "docs/quality.md"],
        ["KVzip 25%, SmolLM2 needle in 1K tokens, before the question (kvpress's KVzip beside)",
         f"{zip_jkv['right']}/{zip_jkv['n']} ({zip_peer['right']}/{zip_peer['n']})",
         "docs/quality.md"],
    ]  # fmt: skip
    return md(["figure", "value", "measured in"], [[a, b, f"[{c}]({c})"] for a, b, c in rows])
