"""Generated tables of compression quality, memory and long prompts (docs/render_tables.py)."""

from __future__ import annotations

from tables_fmt import gb, gib, load, md, num, one, pct, table

QUALITY_COLUMNS = [
    ("jkv", "full", "jkv full cache"),
    ("jkv", "snapkv", "jkv SnapKV"),
    ("kvpress", "snapkv", "kvpress SnapKV"),
    ("jkv", "snapkv:window=16,kernel=11,pool=max", "jkv SnapKV w16 max-11"),
    ("kvpress", "snapkv window_size=16 kernel_size=11", "kvpress SnapKV w16 k11"),
    ("jkv", "streaming", "jkv StreamingLLM"),
    ("kvpress", "streaming", "kvpress StreamingLLM"),
]


def _acc(acc, **match):
    return num(one(acc, **match)["accuracy"], 2)


@table("quality_512_aware")
def quality_512_aware(results):
    d = load(results, "quality")
    acc = d["accuracy"]
    rows = []
    for ratio in d["ratios"]:
        for facts in d["facts"]:
            where = dict(mode="aware", context=512, facts=facts)
            cells = [
                _acc(acc, peer=p, method=m, ratio=1.0 if m == "full" else ratio, **where)
                for p, m, _ in QUALITY_COLUMNS
            ]
            rows.append([pct(ratio), facts, *cells])
    return md(["kept", "facts", *(c[2] for c in QUALITY_COLUMNS)], rows)


@table("quality_free_text")
def quality_free_text(results):
    d = load(results, "quality")
    rows = []
    for peer, method, label in QUALITY_COLUMNS[1:]:
        for ratio in d["ratios"]:
            r = one(d["free_text"], peer=peer, method=method, ratio=ratio, context=512)
            ppl = "—" if r.get("ppl_ratio") is None else num(r["ppl_ratio"], 3)
            rows.append([label, pct(ratio), num(r["rouge_l"], 3), num(r["bleu"], 3), ppl])
    return md(["method", "kept", "ROUGE-L", "BLEU", "perplexity ratio"], rows)


@table("quality_policies")
def quality_policies(results):
    d = load(results, "quality_policies")
    acc, methods = d["accuracy"], []
    for a in acc:
        if a["method"] not in methods and a["method"] != "full":
            methods.append(a["method"])
    rows = []
    for method in methods:
        for mode in ("aware", "agnostic"):
            cells = [_acc(acc, method=method, ratio=r, mode=mode) for r in d["ratios"]]
            free = one(d["free_text"], method=method, ratio=0.1)
            rows.append([method, mode, *cells, num(free["ppl_ratio"], 3)])
    full = [_acc(acc, method="full", ratio=1.0, mode=m) for m in ("aware", "agnostic")]
    rows.append(["full cache", "aware / agnostic", *[" / ".join(full)] * len(d["ratios"]), "1"])
    header = ["policy", "mode", *(pct(r) for r in d["ratios"]), "perplexity ratio at 10%"]
    return md(header, rows)


@table("quality_snapkv100")
def quality_snapkv100(results):
    d = load(results, "quality_snapkv100")
    rows = [[a["method"], pct(a["ratio"]), a["mode"], num(a["accuracy"], 2)] for a in d["accuracy"]]
    return md(["policy", "kept", "mode", f"exact match ({d['docs']} prompts)"], rows)


# quality_real's runs, in the order the docs tell them
QUALITY_REAL = ("quality_real_1k_single", "quality_real_1k_single_tuned", "quality_real_kvzip_1k",
                "quality_real_pairs_1k", "quality_real_pairs_1k_b", "quality_real_pairs_1k_more",
                "quality_real_kvzip_2k", "quality_real_2k_tuned", "quality_real_4k_tuned",
                "quality_real_multikey_1k", "quality_real_multikey_1k_tuned")  # fmt: skip


def _verdict(a: dict, b: dict) -> str:
    """Level, ahead or behind beyond one standard error of the difference (quality_real.py's)."""
    diff = a["rate"] - b["rate"]
    if abs(diff) <= (a["se"] ** 2 + b["se"] ** 2) ** 0.5:
        return "level"
    return "ahead" if diff > 0 else "behind"


@table("quality_real")
def quality_real(results):
    rows, full = [], set()
    for stem in QUALITY_REAL:
        if not (results / f"{stem}.json").exists():
            continue
        got = [r for r in load(results, stem)["rows"] if r["kind"] == "needle"]
        for r in got:
            key = (r["task"], r["context"])
            if r["who"] != "jkv" or (r["policy"] == "full" and key in full):
                continue
            if r["policy"] == "full":
                full.add(key)
            peer = [p for p in got if p["who"] == "kvpress" and p["policy"] == r["policy"]]
            peer = [p for p in peer if p["ratio"] == r["ratio"] and p["mode"] == r["mode"]]
            jkv_cell = f"{r['right']}/{r['n']} ({num(r['rate'], 2)} ± {num(r['se'], 2)})"
            peer_cell = f"{peer[0]['right']}/{peer[0]['n']}" if peer else "—"
            side = _verdict(r, peer[0]) if peer else "—"
            kept = pct(r["ratio"])
            rows.append([r["task"], r["context"], r["policy"], kept, r["mode"], jkv_cell,
                         peer_cell, side])  # fmt: skip
    header = ["task", "context", "policy", "kept", "mode", "jkv right (rate ± s.e.)", "kvpress",
              "jkv vs kvpress"]  # fmt: skip
    return md(header, rows)


@table("quality_real_text")
def quality_real_text(results):
    """(b) and (c) of quality_real: perplexity after a compressed context, as a ratio to the full
    cache's, and the continuation's ROUGE-L against the full cache's, jkv beside kvpress."""
    rows = []
    for stem in QUALITY_REAL:
        if not (results / f"{stem}.json").exists():
            continue
        got = [r for r in load(results, stem)["rows"] if r["kind"] == "text"]
        for r in got:
            if r["who"] != "jkv" or r["policy"] == "full":
                continue
            peer = [p for p in got if p["who"] == "kvpress" and p["policy"] == r["policy"]
                    and p["ratio"] == r["ratio"]]  # fmt: skip
            cells = [
                f"{num(r['ppl_ratio'], 3)}",
                f"{num(r['rouge_l'], 2)} ± {num(r['rouge_se'], 2)}",
            ]
            cells += ([f"{num(peer[0]['ppl_ratio'], 3)}",
                       f"{num(peer[0]['rouge_l'], 2)} ± {num(peer[0]['rouge_se'], 2)}"]
                      if peer else ["—", "—"])  # fmt: skip
            rows.append([r["context"], r["policy"], pct(r["ratio"]), r["n"], *cells])
    header = ["context", "policy", "kept", "texts", "jkv perplexity / full", "jkv ROUGE-L vs full",
              "kvpress perplexity / full", "kvpress ROUGE-L vs full"]  # fmt: skip
    return md(header, rows)


@table("snapkv_vs_kvpress")
def snapkv_vs_kvpress(results):
    d = load(results, "snapkv_vs_kvpress")
    acc = [a for a in d["accuracy"] if a["method"] != "full"]
    ratios = sorted({a["ratio"] for a in acc})
    rows = []
    for mode in ("agnostic", "aware"):
        for method in ("snapkv", "streaming"):
            cells = [
                f"{_acc(acc, peer='jkv', method=method, ratio=r, mode=mode)} / "
                f"{_acc(acc, peer='kvpress', method=method, ratio=r, mode=mode)}"
                for r in ratios
            ]
            rows.append([mode, method, *cells])
    header = ["mode", "method", *(f"{pct(r)} jkv / kvpress" for r in ratios)]
    overlap = [
        [k["kvpress"], str(k["overrides"] or "—"), pct(k["ratio"]), f"{k['overlap']:.1%}"]
        for k in d["kept_indices"]
    ]
    lines = md(header, rows) + [""]
    return lines + md(["kvpress settings", "overrides", "kept", "same slots kept"], overlap)


SHAPES = {"demo": "demo-shaped (f32)", "8b": "Llama-3.1-8B-shaped (bf16)"}


@table("long_context_memory")
def long_context_memory(results):
    d = load(results, "long_context")
    tokens = sorted({m["tokens"] for m in d["memory"]})
    rows = []
    for shape, label in SHAPES.items():
        for mode in ("one step", "chunked"):
            temps = {
                m["tokens"]: m["temp"]
                for m in d["memory"]
                if (m["shape"], m["mode"]) == (shape, mode)
            }
            cells = [gib(temps[t], 3 if temps[t] < 2**30 else 2) for t in tokens]
            rows.append([f"{label}, {mode}", *cells, num(temps[16384] / temps[4096], 2)])
    header = ["layer", *(f"T = {t // 1024}K (GiB)" for t in tokens), "temp(16K) / temp(4K)"]
    return md(header, rows)


@table("long_context_8b_131k")
def long_context_8b_131k(results):
    r = load(results, "long_context")["llama_8b_131k"]
    rows = [
        ["the chunk step's temporaries", gib(r["step_temp"], 2) + " GiB"],
        ["bf16 weights", gb(r["weights_bf16"], 1) + " GB"],
        ["predicted prefill peak", gb(r["predicted_prefill_peak"], 1) + " GB"],
        ["KV kept after compression", gb(r["kv_after_compression"], 2) + " GB"],
        ["fits one H200 (141 GB)", str(r["fits_h200"])],
    ]
    return md([f"Llama-3.1-8B, {num(r['tokens'])} tokens, SnapKV 10% + FP8", "value"], rows)


@table("gpu_memory_check")
def gpu_memory_check(results):
    d = load(results, "gpu_memory_check")
    rows = [
        [r["layers"], gb(r["weights"]), gb(r["kv_state"]), gb(r["temp"], 3), gb(r["peak"], 1)]
        for r in d["rows"]
    ]
    header = ["layers", "weights GB", "KV state GB", "temporaries GB", "peak GB"]
    return md(header, rows) + ["", f"{d['device']}, jax {d['jax']}, {num(d['tokens'])} tokens."]


@table("long_context_wall")
def long_context_wall(results):
    rows = [
        [num(w["tokens"]), num(w["jkv_s"], 2), num(w["hf_s"], 2), num(w["ratio_hf_over_jkv"], 2)]
        for w in load(results, "long_context")["wall"]
    ]
    return md(
        ["prompt tokens", "jkv.prefill s", "transformers s", "jkv speed / transformers"], rows
    )


@table("long_context_streaming_ppl")
def long_context_streaming_ppl(results):
    d = load(results, "long_context")["streaming_ppl"]
    rows = [
        [
            name,
            num(r["in_context_ppl"], 3),
            num(r["past_context_ppl"], 3),
            num(r["past_vs_in_context"], 3),
        ]
        for name, r in d["runs"].items()
    ]
    header = ["run", "perplexity in context", f"past {d['trained_context']} tokens", "ratio"]
    return md(header, rows)


@table("long_context_snapkv_chunked")
def long_context_snapkv_chunked(results):
    d = load(results, "long_context")["snapkv_chunked"]
    rows = [[pct(r["kept"]), num(r["once"], 2), num(r["chunked"], 2)] for r in d["rows"]]
    return md(["kept", "select once", f"chunked ({d['chunk']}-token chunks)"], rows)


@table("long_context_peaks")
def long_context_peaks(results):
    rows = []
    for p in load(results, "long_context")["peaks"]:
        policy = p["policy"] if p["policy"] == "full" else f"{p['policy']} 10%"
        pre = f"{gb(p['predicted_prefill_peak'], 3)} / {gb(p['xla_prefill_peak'], 3)} ({num(p['predicted_prefill_peak'] / p['xla_prefill_peak'], 3)})"
        dec = f"{gb(p['predicted_decode_peak'], 3)} / {gb(p['xla_decode_peak'], 3)} ({num(p['predicted_decode_peak'] / p['xla_decode_peak'], 3)})"
        shape = f"{p['tokens'] // 1024}K x {p['batch']}"
        rows.append([p["model"], f"{policy}, {p['kv_dtype']}", shape, pre, dec])
    header = ["model", "policy, kv dtype", "tokens x rows"]
    header += ["prefill peak GB predicted / XLA", "decode peak GB predicted / XLA"]
    return md(header, rows)


@table("kv_memory")
def kv_memory(results):
    d = load(results, "kv_memory")
    full = one(d["memory"], setting="full bf16", batch=1, context=131072)["bytes"]
    rows = [
        [m["setting"], gb(m["bytes"]), num(m["slots_layer0"]), f"{1 - m['bytes'] / full:.1%}"]
        for m in d["memory"]
        if m["batch"] == 1 and m["context"] == 131072
    ]
    header = ["Llama-3.1-8B, 128K tokens, batch 1", "KV GB", "slots (layer 0)", "saved vs bf16"]
    return md(header, rows)


@table("kv_decode")
def kv_decode(results):
    d = load(results, "kv_memory")["decode"]
    lengths = sorted({r["generated"] for r in d})
    settings = list(dict.fromkeys(r["setting"] for r in d))
    rows = [
        [s, *(num(one(d, setting=s, generated=n)["tokens_per_s"]) for n in lengths)]
        for s in settings
    ]
    return md(["setting", *(f"{n} tokens: tok/s" for n in lengths)], rows)


@table("kvzip_cost")
def kvzip_cost(results):
    d = load(results, "kvzip_cost")
    rows = [
        [f"{r['tokens']:,}", num(r["prefill_s"], 2), num(r["kvzip_s"], 2),
         num(r["compression_s"], 2), f"{num(r['x_prefill'], 2)}x"]
        for r in d["rows"]
    ]  # fmt: skip
    return md(["context tokens", "prefill s", "KVzip prefill s", "its compression s",
               "x the prefill"], rows)  # fmt: skip
