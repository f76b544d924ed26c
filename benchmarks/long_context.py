"""Long-context prefill: temporary memory and wall time, chunked vs one step with the scores
materialised (what jkv ran before chunked prefill), and jkv vs transformers.

Part 1, memory (XLA's own numbers, `jitted.lower(...).compile().memory_analysis()`, compiled for
CPU, never run): the temporary bytes of prefilling a T-token prompt into ONE layer of a
demo-shaped and a Llama-3.1-8B-shaped model (batch 1, float32 demo / bfloat16 8B, full cache):
  one step    the whole prompt in one model step, attention over a materialised
              [B, K, G, T, S] float32 score tensor (the pre-chunking path, rebuilt here from
              jkv's public pieces: `kv.append` + `core.attention.cached_attention_reference`);
  chunked     `jkv.prefill.prefill_step` on one chunk of C tokens over a cache of T slots (every
              chunk of a prompt is the same compiled step; its temporaries are the prefill's).
Part 2: the 8B-shaped layer at 131,072 tokens, SnapKV 10% + FP8, chunked: compiles on CPU; the
whole model's predicted prefill peak = 32 x (the layer's cache arguments) + the step's temporaries
+ bf16 weights, against one H200's 141 GB.
Part 3, wall time: the demo model prefilling a T-token prompt on CPU (jkv.prefill, chunked) and
`transformers` (sdpa) on the same exported checkpoint and token ids, in the same process.
Part 4, perplexity past the trained context: StreamingLLM token by token (`stream_score`) and
chunk by chunk, evicting after each chunk (`chunk_score`), and the full cache both ways.
Part 5, SnapKV selecting once (its definition) vs compressing each chunk as it arrives
(`SnapKV(chunked=True)`): exact-match accuracy on held-out 4-fact demo haystacks.
Part 6, `jkv.memory`'s predicted prefill and decode peaks against XLA's numbers for the programs
a request compiles (`xla_peaks`, compiled for CPU, never run), weights excluded: the demo model,
an 8B-shaped layer and the whole 32-layer Llama-3.1-8B at 131,072 tokens.

    python benchmarks/long_context.py [--quick] [--out benchmarks/results]
Writes long_context.json and long_context.png.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import platform
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault(
    "XLA_FLAGS", "--xla_cpu_multi_thread_eigen=true intra_op_parallelism_threads=2"
)

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

import jkv  # noqa: E402
from jkv import kv as kvlib  # noqa: E402
from jkv.core.attention import cached_attention_reference  # noqa: E402
from jkv.core.sampling import SamplingArrays  # noqa: E402
from jkv.decode import DecodeState, decode  # noqa: E402
from jkv.memory import REQUEST_TOKENS, prefill_plan  # noqa: E402
from jkv.policies.compress import compress  # noqa: E402
from jkv.prefill import PREFILL_CHUNK, empty_state, prefill_step  # noqa: E402
from jkv.replay import replay_pass  # noqa: E402
from jkv.request import Request  # noqa: E402
from jkv_models.config import preset  # noqa: E402
from jkv_models.llama import forward, param_shapes, rope  # noqa: E402

GIB = 2**30
H200_BYTES = 141e9


def shapes():
    demo = jkv.load("demo").config
    return {
        "demo": demo.replace(num_layers=1),
        "8b": preset("llama-3.1-8b").replace(num_layers=1),
    }


def materialised_attention(n_new, inv_freq):
    """The pre-chunking prefill attention: append, then softmax over a materialised
    [B, K, G, T, S] score tensor."""

    def attention(layer_index, q, k, v, positions, layer, carry):
        k = rope(k, positions[:, :, None], inv_freq)
        layer = kvlib.append(layer, k, v, positions, n_new)
        q = rope(q, positions[:, :, None], inv_freq)
        q_valid = jnp.arange(q.shape[1])[None, :] < n_new[:, None]
        return cached_attention_reference(q, positions, layer, q_valid=q_valid), layer, carry

    attention.rotates_qk = True
    return attention


@functools.partial(jax.jit, static_argnames=("config",))
def one_step(weights, config, tokens, n_new, kv):
    positions = kv.next_position[:, None] + jnp.arange(tokens.shape[1], dtype=jnp.int32)
    attend = materialised_attention(n_new, jnp.asarray(config.inv_freq()))
    logits, layers = forward(
        weights, config, tokens, positions, kv.layers, attend, logits_at=n_new - 1
    )
    return logits, kv.replace(layers=layers)


def analysis(compiled) -> dict:
    m = compiled.memory_analysis()
    return {
        "temp": int(m.temp_size_in_bytes),
        "arguments": int(m.argument_size_in_bytes),
        "output": int(m.output_size_in_bytes),
        "alias": int(m.alias_size_in_bytes),
    }


def state_spec(cfg, capacity, kv_dtype, policy=None):
    key = None if policy is None else policy.jit_key()
    return jax.eval_shape(lambda: empty_state(cfg, 1, capacity, kv_dtype, policy=key))


def prefill_memory(cfg, t, *, chunk, mode, kv_dtype, policy=None) -> dict:
    weights = param_shapes(cfg)
    spec = jax.ShapeDtypeStruct
    cap = kvlib.bucket(t)
    kv = state_spec(cfg, cap, kv_dtype, policy)
    n_new = spec((1,), jnp.int32)
    if mode == "one step":
        lowered = one_step.lower(weights, cfg, spec((1, cap), jnp.int32), n_new, kv)
    else:
        key = None if policy is None else policy.jit_key()
        lowered = prefill_step.lower(
            weights, cfg, spec((1, chunk), jnp.int32), n_new, kv, policy=key
        )
    return analysis(lowered.compile())


def part1(lengths, chunk) -> list[dict]:
    rows = []
    for name, cfg in shapes().items():
        kv_dtype = "float32" if name == "demo" else "bfloat16"
        cfg = cfg.replace(dtype=kv_dtype)
        for mode in ("one step", "chunked"):
            for t in lengths:
                t0 = time.perf_counter()
                try:
                    m = prefill_memory(cfg, t, chunk=chunk, mode=mode, kv_dtype=kv_dtype)
                    err = None
                except Exception as e:  # noqa: BLE001 - reported in the table
                    m, err = {}, f"{type(e).__name__}: {str(e)[:120]}"
                row = {"shape": name, "mode": mode, "tokens": t, "chunk": chunk, **m}
                row["compile_s"] = round(time.perf_counter() - t0, 1)
                if err:
                    row["error"] = err
                rows.append(row)
                temp = f"{m['temp'] / GIB:10.3f}" if m else "    failed"
                print(f"{name:5} {mode:9} T={t:6d}: temp {temp} GiB ({row['compile_s']} s)")
    return rows


def ratios(rows) -> dict:
    out = {}
    for name in {r["shape"] for r in rows}:
        for mode in ("one step", "chunked"):
            by_t = {
                r["tokens"]: r.get("temp") for r in rows if (r["shape"], r["mode"]) == (name, mode)
            }
            if by_t.get(16384) and by_t.get(4096):
                out[f"{name} {mode} temp(16K)/temp(4K)"] = by_t[16384] / by_t[4096]
    return out


def part2(chunk) -> dict:
    cfg = preset("llama-3.1-8b").replace(num_layers=1)
    full = preset("llama-3.1-8b")
    t = 131072
    policy = jkv.SnapKV(budget=0.1)
    t0 = time.perf_counter()
    m = prefill_memory(cfg, t, chunk=chunk, mode="chunked", kv_dtype="float8_e4m3fn", policy=policy)
    layer = state_spec(cfg, kvlib.bucket(t), "float8_e4m3fn", policy).layers[0]
    layer_cache = sum(  # K, V and their scales (shapes only: nothing is allocated)
        int(np.prod(x.shape)) * x.dtype.itemsize
        for x in (layer.k, layer.v, layer.k_scale, layer.v_scale)
    )
    # The compression after prefill (SnapKV's window votes were taken in the last chunk): one
    # layer's selection and compaction, compiled the same way.
    spec = jax.ShapeDtypeStruct
    kv = state_spec(cfg, kvlib.bucket(t), "float8_e4m3fn", policy)
    comp = compress.lower(
        param_shapes(cfg),
        cfg,
        kv,
        spec((1, kvlib.bucket(t)), jnp.int32),
        spec((1,), jnp.int32),
        spec((1,), jnp.int32),
        policy=policy.jit_key(),
        capacities=policy.capacities(1, [t], 0),
    )
    c = analysis(comp.compile())
    weights = full.num_params() * 2  # bfloat16
    peak = full.num_layers * layer_cache + max(m["temp"], c["temp"] + c["output"]) + weights
    stored = jkv.memory(full, 1, t, kv_dtype="float8_e4m3fn", kv_policy=policy).total
    out = {
        "tokens": t,
        "chunk": chunk,
        "compile_s": round(time.perf_counter() - t0, 1),
        "step_temp": m["temp"],
        "compress_layer_temp": c["temp"],
        "compress_layer_output": c["output"],
        "layer_cache_before_compression": layer_cache,
        "weights_bf16": weights,
        "predicted_prefill_peak": peak,
        "kv_after_compression": stored,
        "h200_bytes": H200_BYTES,
        "fits_h200": peak < H200_BYTES,
    }
    print(
        f"8B x 32 layers, 131,072 tokens, SnapKV 10% + FP8, chunk {chunk}: step temp "
        f"{m['temp'] / GIB:.2f} GiB, compression temp (a layer) {c['temp'] / GIB:.2f} GiB, "
        f"cache before compression {32 * layer_cache / 1e9:.1f} GB, "
        f"weights {weights / 1e9:.1f} GB -> predicted prefill peak {peak / 1e9:.1f} GB "
        f"(H200: 141 GB); KV after compression {stored / 1e9:.2f} GB"
    )
    return out


def part3(lengths, chunk) -> list[dict]:
    import torch
    import transformers

    torch.set_num_threads(2)
    params = jkv.load("demo")
    rows = []
    with tempfile.TemporaryDirectory() as d:
        jkv.export_hf(params, d)
        hf = transformers.AutoModelForCausalLM.from_pretrained(d, attn_implementation="sdpa")
        hf.eval()
        rng = np.random.default_rng(0)
        for t in lengths:
            ids = rng.integers(3, params.config.vocab_size, size=t).tolist()
            kw = dict(allow_beyond_context=True)
            jkv.prefill(params, ids[:chunk], **kw)  # compile the chunk step (not timed)
            timings = {}
            try:
                state = jkv.prefill(params, ids, **kw)  # compiles the step for this capacity
                jax.block_until_ready(state.state)
                t0 = time.perf_counter()
                state = jkv.prefill(params, ids, **kw)
                jax.block_until_ready(state.state)
                timings["jkv_s"] = time.perf_counter() - t0
            except Exception as e:  # noqa: BLE001
                timings["jkv_error"] = f"{type(e).__name__}: {str(e)[:120]}"
            try:
                with torch.no_grad():
                    x = torch.tensor([ids])
                    t0 = time.perf_counter()
                    hf(x, use_cache=True, logits_to_keep=1)
                    timings["hf_s"] = time.perf_counter() - t0
            except Exception as e:  # noqa: BLE001
                timings["hf_error"] = f"{type(e).__name__}: {str(e)[:120]}"
            row = {"tokens": t, "chunk": chunk, **timings}
            if "jkv_s" in row and "hf_s" in row:
                row["ratio_hf_over_jkv"] = row["hf_s"] / row["jkv_s"]
            rows.append(row)
            print(f"demo prefill T={t}: {json.dumps(row)}")
    return rows


def part4(times: int, chunk: int) -> dict:
    """Perplexity of `times` x the trained context of demo filler: StreamingLLM fed token by
    token (`stream_score`) and chunk by chunk, evicting after each chunk (`chunk_score`), at the
    same budget (trained context - chunk, so positions re-ranked within budget + chunk stay
    inside the trained context), and the full cache both ways for contrast."""
    from jkv.demo.haystack import make_filler
    from jkv.scoring import chunk_score, stream_score

    params = jkv.load("demo")
    trained = params.config.max_position_embeddings
    text = make_filler(np.random.default_rng(4000), trained * times - 1)  # + <s>
    budget = trained - chunk
    ppl = lambda lp: float(np.exp(-np.mean(lp)))  # noqa: E731
    runs = {}
    for name, fn in (
        ("full, token by token", lambda: stream_score(params, text)),
        ("full, chunked", lambda: chunk_score(params, text, chunk=chunk)),
        (
            "streaming, token by token",
            lambda: stream_score(params, text, policy=jkv.StreamingLLM(budget=budget)),
        ),
        (
            "streaming, chunked",
            lambda: chunk_score(params, text, policy=jkv.StreamingLLM(budget=budget), chunk=chunk),
        ),
    ):
        t0 = time.perf_counter()
        logp = fn()
        runs[name] = {
            "in_context_ppl": ppl(logp[: trained - 1]),
            "past_context_ppl": ppl(logp[trained - 1 :]),
            "seconds": round(time.perf_counter() - t0, 1),
        }
    base = runs["full, token by token"]["in_context_ppl"]
    for name, run in runs.items():
        run["past_vs_in_context"] = run["past_context_ppl"] / base
        print(
            f"{name:26} ppl in context {run['in_context_ppl']:.3f}, past it "
            f"{run['past_context_ppl']:.3f} ({run['past_vs_in_context']:.3f}x)"
        )
    return {"tokens": trained * times, "trained_context": trained, "budget": budget,
            "chunk": chunk, "runs": runs}  # fmt: skip


def part5(n: int, chunk: int) -> dict:
    """SnapKV selecting once after the whole context (its definition) against compressing each
    `chunk` as it arrives (`SnapKV(chunked=True)`, bounded memory), question-agnostic: the
    context of a held-out 4-fact, 512-token demo haystack is prefilled and compressed, then the
    question is appended and the 5-digit answer decoded greedily (exact match), on the same
    `n` prompts and budgets."""
    from jkv.demo.haystack import split_examples

    params = jkv.load("demo")
    examples = split_examples(9000, n, 512, 4)
    out = {"prompts": n, "chunk": chunk, "facts": 4, "tokens": 512, "rows": []}
    for ratio in (0.25, 0.5):
        row = {"kept": ratio}
        for name, chunked in (("once", False), ("chunked", True)):
            right = 0
            for i in range(0, n, 8):
                part = examples[i : i + 8]
                state = jkv.prefill(
                    params,
                    [c for c, _, _ in part],
                    kv_policy=jkv.SnapKV(budget=ratio, chunked=chunked),
                    chunk=chunk,
                )
                res = jkv.generate(
                    params, [q for _, q, _ in part], kv_state=state, max_new_tokens=6
                )
                right += sum(
                    r.text.split()[:5] == a.split() for r, (_, _, a) in zip(res, part, strict=True)
                )
            row[name] = right / n
        out["rows"].append(row)
        print(
            f"SnapKV {ratio:.0%} agnostic, {n} prompts: selected once {row['once']:.2f}, "
            f"chunked ({chunk}-token chunks) {row['chunked']:.2f}"
        )
    return out


def nbytes(tree) -> int:
    return sum(int(np.prod(x.shape)) * x.dtype.itemsize for x in jax.tree.leaves(tree))


def xla_peak(compiled, weights: int) -> int:
    """A program's peak by XLA: argument + output - aliased + temporary bytes, less `weights`."""
    m = compiled.memory_analysis()
    net = m.argument_size_in_bytes + m.output_size_in_bytes - m.alias_size_in_bytes
    return net + m.temp_size_in_bytes - weights


def xla_peaks(cfg, batch, seq_len, max_new, dtype, policy, chunk=PREFILL_CHUNK):
    """(prefill peak, decode peak) in bytes, weights excluded, of the programs a request of
    `batch` rows of `seq_len` tokens compiles, by XLA's buffer assignment: the prefill step over
    the cache prefill holds, the eviction after each chunk (policies that compress as the prompt
    streams in), KVzip's replay (with the state it is cut from, live beside it), the compression
    after prefill (prefill's peak: the largest of these), and the decode loop over the cache after
    prefill."""
    weights = param_shapes(cfg)
    w = nbytes(weights)  # read by the model steps (and EffiCache's compression) only
    # The one-shot path runs its layers one by one over the stacked weights; XLA:CPU copies each
    # layer's slice before its matmuls (all of them at once, or hoisted out of the decode loop),
    # where a GPU's dynamic-slice fusion reads them in place: a platform's cost, not the cache's.
    if jax.default_backend() == "cpu":
        w += nbytes(weights["layers"])
    lengths = [seq_len] * batch
    plan = prefill_plan(cfg.num_layers, lengths, max_new, policy, chunk)
    key = None if policy is None else policy.jit_key()
    limits = None if policy is None else policy.row_limits(lengths)
    kv = jax.eval_shape(
        lambda: empty_state(cfg, batch, plan.capacity, dtype, policy=key, limit=limits)
    )
    spec = jax.ShapeDtypeStruct
    ints = lambda *shape: spec(shape, jnp.int32)  # noqa: E731
    n = ints(batch)
    step = prefill_step.lower(weights, cfg, ints(batch, plan.step), n, kv, policy=key)
    prefill = [xla_peak(step.compile(), w)]
    if policy is not None and policy.needs_replay:  # KVzip: over the state cut to the prompt
        p = kvlib.fine_bucket(seq_len)
        r = kvlib.fine_bucket(min(seq_len, policy.chunk) + REQUEST_TOKENS)
        work = jax.eval_shape(lambda: empty_state(cfg, batch, p, dtype, policy=key, limit=limits))
        again = replay_pass.lower(weights, cfg, work, ints(batch, r), n, backend="xla",
                                  policy=policy.replay_key())  # fmt: skip
        prefill.append(xla_peak(again.compile(), w) + nbytes(kv))  # + the state it was cut from
    w_compress = w if policy is not None and policy.needs_sensitivity else 0
    if plan.evict_to is not None:
        evict = compress.lower(weights, cfg, kv, ints(batch, plan.step), n, n, policy=key,
                               capacities=plan.evict_to, keep_scores=True)  # fmt: skip
        prefill.append(xla_peak(evict.compile(), w_compress))
    if policy is not None:
        once = compress.lower(weights, cfg, kv, ints(batch, kvlib.bucket(seq_len)), n, n,
                              policy=key, capacities=plan.final)  # fmt: skip
        prefill.append(xla_peak(once.compile(), w_compress))
        kv = jax.eval_shape(lambda: empty_state(cfg, batch, plan.final, dtype, policy=key))
        if not policy.wants_mass:
            kv = kv.replace(layers=tuple(x.replace(scores=None) for x in kv.layers))
    sampling = Request.build(jkv.load("demo")).sampling
    state = jax.eval_shape(
        lambda: DecodeState(
            kv=kv,
            tokens=jnp.zeros((batch, kvlib.bucket(max_new)), jnp.int32),
            count=jnp.zeros((batch,), jnp.int32),
            max_new=jnp.zeros((batch,), jnp.int32),
            done=jnp.zeros((batch,), bool),
            last=jnp.zeros((batch,), jnp.int32),
            sampling=SamplingArrays.build([sampling] * batch, [0] * batch),
            step=jnp.zeros((), jnp.int32),
        )
    )
    loop = decode.lower(weights, cfg, state, spec((), jnp.int32), eos_ids=(2,))
    return max(prefill), xla_peak(loop.compile(), w)


def part6() -> list[dict]:
    demo = jkv.load("demo").config
    layer8b = preset("llama-3.1-8b").replace(num_layers=1)
    runs = [
        ("demo", demo, None, "float32", 16384, 1),
        ("demo", demo, "snapkv", "bfloat16", 16384, 4),
        ("demo", demo, "streaming", "float8_e4m3fn", 65536, 1),
        ("demo", demo, "h2o", "float32", 4096, 8),
        ("8b layer", layer8b, None, "bfloat16", 32768, 1),
        ("8b layer", layer8b, "snapkv", "float8_e4m3fn", 131072, 1),
        ("8b", preset("llama-3.1-8b"), "snapkv", "float8_e4m3fn", 131072, 1),
    ]
    rows = []
    for name, cfg, policy, dtype, t, b in runs:
        budget = None if policy is None else 0.1
        got = jkv.memory(cfg, b, t, kv_dtype=dtype, kv_policy=policy, kv_budget=budget)
        t0 = time.perf_counter()
        prefill, decode_peak = xla_peaks(cfg, b, t, 64, dtype, jkv.policies.resolve(policy, budget))
        row = {
            "model": name, "policy": policy or "full", "kv_dtype": dtype, "tokens": t, "batch": b,
            "predicted_prefill_peak": got.prefill_peak, "xla_prefill_peak": prefill,
            "predicted_decode_peak": got.decode_peak, "xla_decode_peak": decode_peak,
            "kv_after_prefill": got.total, "weights": got.weights,
            "compile_s": round(time.perf_counter() - t0, 1),
        }  # fmt: skip
        rows.append(row)
        print(
            f"{name:8} {row['policy']:9} {dtype:13} T={t:6d} B={b}: prefill peak predicted "
            f"{got.prefill_peak / GIB:8.3f} GiB, XLA {prefill / GIB:8.3f} "
            f"({got.prefill_peak / prefill:.3f}x); decode {got.decode_peak / GIB:8.3f} GiB, "
            f"XLA {decode_peak / GIB:8.3f} ({got.decode_peak / decode_peak:.3f}x); weights "
            f"{got.weights / GIB:.2f} GiB beside ({row['compile_s']} s)"
        )
    return rows


def plot(rows, out: Path) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib not installed: no PNG")
        return
    fig, axes = plt.subplots(1, 2, figsize=(10, 4))
    for ax, name in zip(axes, ("demo", "8b"), strict=True):
        for mode in ("one step", "chunked"):
            pts = [
                (r["tokens"], r["temp"])
                for r in rows
                if (r["shape"], r["mode"]) == (name, mode) and "temp" in r
            ]
            if pts:
                x, y = zip(*pts, strict=True)
                ax.loglog(x, np.array(y) / GIB, "o-", label=mode)
        ax.set_title(f"{name}-shaped layer: prefill temporaries")
        ax.set_xlabel("prompt tokens")
        ax.set_ylabel("GiB (XLA memory_analysis)")
        ax.legend()
    fig.tight_layout()
    fig.savefig(out / "long_context.png", dpi=110)
    print(f"wrote {out / 'long_context.png'}")


def main(argv=None) -> int:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--quick", action="store_true", help="1K-16K only, wall time at 4K")
    p.add_argument("--chunk", type=int, default=PREFILL_CHUNK)
    p.add_argument(
        "--parts", nargs="+", type=int, default=[1, 2, 3, 4, 5, 6], choices=[1, 2, 3, 4, 5, 6]
    )
    p.add_argument("--out", default=str(Path(__file__).parent / "results"))
    args = p.parse_args(argv)
    lengths = [1024, 4096, 16384] if args.quick else [1024, 4096, 16384, 65536]
    wall = [4096] if args.quick else [4096, 16384, 32768]
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    path = out / "long_context.json"
    old = json.loads(path.read_text()) if path.exists() else {}
    keys = ("memory", "ratios", "llama_8b_131k", "wall", "streaming_ppl", "snapkv_chunked", "peaks")
    rows, r, big, walls, ppl, snap, peaks = (old.get(k) for k in keys)
    if 1 in args.parts:
        rows = part1(lengths, args.chunk)
        r = ratios(rows)
    for k, v in sorted((r or {}).items()):
        print(f"{k}: {v:.2f}")
    if 2 in args.parts:
        big = part2(args.chunk)
    if 3 in args.parts:
        walls = part3(wall, args.chunk)
    if 4 in args.parts:
        ppl = part4(2 if args.quick else 4, 64)
    if 5 in args.parts:
        snap = part5(8 if args.quick else 48, 64)
    if 6 in args.parts:
        peaks = part6()
    result = {
        "benchmark": "long_context",
        "python": platform.python_version(),
        "jax": jax.__version__,
        "machine": platform.machine(),
        "cpu_count": os.cpu_count(),
        "memory": rows,
        "ratios": r,
        "llama_8b_131k": big,
        "wall": walls,
        "streaming_ppl": ppl,
        "snapkv_chunked": snap,
        "peaks": peaks,
    }
    path.write_text(json.dumps(result, indent=2))
    print(f"wrote {path} (parts {args.parts} measured now; the others kept from the last run)")
    if rows:
        plot(rows, out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
