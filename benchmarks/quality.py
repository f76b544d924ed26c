"""What KV compression costs, measured on the demo model, beside kvpress on the same prompts.

For each policy x budget (kept fraction of the context) x context length:
  - retrieval accuracy on haystack documents, question-agnostic (the context is compressed
    by `jkv.prefill` before the question exists, then `generate(question, kv_state=...)`:
    kvpress's protocol) and query-aware (the whole prompt, question included, is compressed);
  - agreement with the full-cache output on free-text continuation: ROUGE-L and BLEU;
  - perplexity change on held-out filler continued from the compressed context;
  - KV bytes and decode tokens/s.
Also the seed's 2.4 table (logit top-k ratio while sampling: BLEU / ROUGE-L against the
unpruned output) and StreamingLLM's perplexity far past the trained context.
With `--peer kvpress`, kvpress's presses run on the HF export of the same model, same prompts.

    python benchmarks/quality.py [--model demo] [--docs 100] [--peer kvpress] [--tiny]
Writes quality.json, quality.md, quality.png and quality_streaming_ppl.png under --out.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault(
    "XLA_FLAGS", "--xla_cpu_multi_thread_eigen=true intra_op_parallelism_threads=2"
)
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from policy_specs import kvpress_for, policy_kw, press_label  # noqa: E402

POLICIES = ["streaming", "snapkv", "h2o", "pyramidkv", "adakv", "efficache", "quantile"]
RATIOS = [0.05, 0.1, 0.25, 0.5]


# ---------------------------------------------------------------------------- data
def haystack_examples(seed: int, n: int, context: int, facts: int):
    """`n` (context, question, answer) triples: each prompt split at its last "Question :"."""
    from jkv.demo.haystack import split_examples

    return split_examples(seed, n, context, facts)


def filler_texts(seed: int, n: int, context: int, continuation: int):
    """(prompt, held-out continuation) pairs of plain filler."""
    import numpy as np

    from jkv.demo.haystack import make_filler

    rng = np.random.default_rng(seed)
    out = []
    for _ in range(n):
        words = make_filler(rng, context + continuation).split()
        out.append((" ".join(words[:context]), " ".join(words[context:])))
    return out


# ---------------------------------------------------------------------------- scores
def rouge_l(hyp: str, ref: str) -> float:
    from rouge_score import rouge_scorer

    class Words:  # keep the word tokens as they are (digits and punctuation included)
        def tokenize(self, text):
            return text.split()

    scorer = rouge_scorer.RougeScorer(["rougeL"], tokenizer=Words())
    return scorer.score(ref, hyp)["rougeL"].fmeasure


def bleu(hyp: str, ref: str) -> float:
    import sacrebleu

    return sacrebleu.sentence_bleu(hyp, [ref], tokenize="none").score / 100.0


def exact(text: str, answer: str) -> bool:
    return text.split()[: len(answer.split())] == answer.split()


# ---------------------------------------------------------------------------- jkv runs
def _batches(items, size):
    for i in range(0, len(items), size):
        yield items[i : i + size]


def jkv_accuracy(params, examples, policy, ratio, mode, *, batch=16):
    """Exact-match accuracy, KV bytes and decode tokens/s of one setting."""
    import jkv

    right, kv_bytes, speeds = 0, [], []
    for chunk in _batches(examples, batch):
        kw = dict(max_new_tokens=6, **policy_kw(policy, ratio))
        if mode == "agnostic":
            state = jkv.prefill(
                params,
                [c for c, _, _ in chunk],
                **{k: v for k, v in kw.items() if k != "max_new_tokens"},
            )
            out = jkv.generate(params, [q for _, q, _ in chunk], kv_state=state, max_new_tokens=6)
        else:
            out = jkv.generate(params, [c + " " + q for c, q, _ in chunk], **kw)
        right += sum(exact(r.text, a) for r, (_, _, a) in zip(out, chunk, strict=True))
        kv_bytes.append(out[0].kv_bytes)  # a row's share of the batch's allocation
        speeds.append(out[0].stats["decode_tokens_per_s"])
    return {
        "accuracy": right / len(examples),
        "kv_bytes_per_row": sum(kv_bytes) / len(kv_bytes),
        "decode_tokens_per_s": sum(speeds) / len(speeds),
    }


def jkv_free_text(params, fillers, policy, ratio, reference, *, new_tokens=32):
    import jkv

    kw = policy_kw(policy, ratio)
    out = jkv.generate(params, [p for p, _ in fillers], max_new_tokens=new_tokens, **kw)
    texts = [r.text for r in out]
    if reference is None:
        return texts, {}
    n = len(texts)
    return texts, {
        "rouge_l": sum(rouge_l(h, r) for h, r in zip(texts, reference, strict=True)) / n,
        "bleu": sum(bleu(h, r) for h, r in zip(texts, reference, strict=True)) / n,
    }


def jkv_perplexity(params, fillers, policy, ratio):
    """exp(mean NLL) of the held-out continuations given the (compressed) prompt."""
    import numpy as np

    import jkv
    from jkv.scoring import score

    nll = []
    for prompt, cont in fillers:
        kw = policy_kw(policy, ratio)
        state = jkv.prefill(params, prompt, **kw)
        nll.extend(-score(params, cont, kv_state=state))
    return float(math.exp(np.mean(nll)))


def logit_keep_table(params, fillers, keep_ratios, *, new_tokens=32, seed=7):
    """The seed's 2.4 table: sampled continuations with the logit keep ratio vs without."""
    import jkv

    prompts = [p for p, _ in fillers]
    base = [
        r.text
        for r in jkv.generate(
            params, prompts, max_new_tokens=new_tokens, temperature=1.0, seed=seed
        )
    ]
    rows = []
    for keep in keep_ratios:
        out = [
            r.text
            for r in jkv.generate(
                params,
                prompts,
                max_new_tokens=new_tokens,
                temperature=1.0,
                seed=seed,
                logit_keep_ratio=keep,
            )
        ]
        n = len(out)
        rows.append(
            {
                "logit_keep_ratio": keep,
                "rouge_l": sum(rouge_l(h, r) for h, r in zip(out, base, strict=True)) / n,
                "bleu": sum(bleu(h, r) for h, r in zip(out, base, strict=True)) / n,
            }
        )
    return rows


# ---------------------------------------------------------------------------- report
def beyond_context(params, trained: int, times: int, *, window: int = 64, seed: int = 4000):
    """Perplexity over `times` x the trained context of plain filler, decoded token by token:
    StreamingLLM at a budget of the trained context vs the full cache. Per-window perplexities
    (every `window` tokens) and in-context vs past-context summaries."""
    import numpy as np

    from jkv.demo.haystack import make_filler
    from jkv.policies import StreamingLLM
    from jkv.scoring import stream_score

    text = make_filler(np.random.default_rng(seed), trained * times - 1)  # + <s>
    out = {"trained_context": trained, "tokens": trained * times, "window": window, "runs": {}}
    for name, policy in (("full", None), ("streaming", StreamingLLM(budget=trained, sink=4))):
        logp = stream_score(params, text, policy=policy)
        ppl = lambda lp: float(np.exp(-np.mean(lp)))  # noqa: E731
        out["runs"][name] = {
            "positions": [i + window for i in range(0, len(logp), window)],
            "window_ppl": [ppl(logp[i : i + window]) for i in range(0, len(logp), window)],
            "in_context_ppl": ppl(logp[: trained - 1]),
            "past_context_ppl": ppl(logp[trained - 1 :]),
        }
    base = out["runs"]["full"]["in_context_ppl"]
    for run in out["runs"].values():
        run["past_vs_in_context"] = run["past_context_ppl"] / base
    return out


def plot_beyond(beyond, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    for name, run in beyond["runs"].items():
        ax.plot(run["positions"], run["window_ppl"], label=name)
    ax.axvline(beyond["trained_context"], color="k", linewidth=0.8, linestyle=":")
    ax.set_yscale("log")
    ax.set_xlabel(f"position (perplexity per {beyond['window']} tokens)")
    ax.set_ylabel("perplexity")
    ax.set_title(f"past the trained context ({beyond['trained_context']} tokens)")
    ax.legend()
    ax.grid(True, alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def _facts(row, results) -> int:
    return row.get("facts", results["facts"][0] if isinstance(results["facts"], list) else 4)


def markdown(results) -> str:
    lines = ["# Compression quality", "", f"model: {results['model']}", ""]
    acc = results["accuracy"]
    grids = dict.fromkeys((r["context"], _facts(r, results)) for r in acc)
    methods = dict.fromkeys(
        (r["peer"], r["method"]) for r in acc if not r["method"].startswith("full")
    )
    for mode in ("agnostic", "aware"):
        lines += [
            f"## Retrieval accuracy, {mode}",
            "",
            "| context | facts | method | "
            + " | ".join(f"{r:.0%}" for r in results["ratios"])
            + " |",
            "|---|---|---|" + "---|" * len(results["ratios"]),
        ]
        for ctx, facts in grids:
            here = [
                r
                for r in acc
                if r["context"] == ctx and _facts(r, results) == facts and r["mode"] == mode
            ]
            for r in here:  # jkv's full cache, and kvpress's (no press)
                if r["method"].startswith("full"):
                    lines.append(
                        f"| {ctx} | {facts} | {r['peer']} full cache | {r['accuracy']:.2f} |"
                        + " |" * (len(results["ratios"]) - 1)
                    )
            for peer, method in methods:
                cells = []
                for ratio in results["ratios"]:
                    row = next(
                        (
                            r
                            for r in here
                            if (r["peer"], r["method"], r["ratio"]) == (peer, method, ratio)
                        ),
                        None,
                    )
                    cells.append(
                        "-"
                        if row is None
                        else ("err" if "error" in row else f"{row['accuracy']:.2f}")
                    )
                lines.append(f"| {ctx} | {facts} | {peer} {method} | " + " | ".join(cells) + " |")
        lines.append("")
    lines += [
        "## Free-text agreement with the full cache (ROUGE-L / BLEU) and perplexity",
        "",
        "| context | method | ratio | ROUGE-L | BLEU | ppl ratio |",
        "|---|---|---|---|---|---|",
    ]
    for r in results["free_text"]:
        ppl = r.get("ppl_ratio")
        lines.append(
            f"| {r['context']} | {r['peer']} {r['method']} | {r['ratio']:.0%} | "
            f"{r['rouge_l']:.3f} | {r['bleu']:.3f} | "
            + ("-" if ppl is None else f"{ppl:.3f}")
            + " |"
        )
    lines += [
        "",
        "## Seed 2.4: logit keep ratio while sampling vs unpruned sampling",
        "",
        "| keep ratio | ROUGE-L | BLEU |",
        "|---|---|---|",
    ]
    for r in results["logit_keep"]:
        lines.append(f"| {r['logit_keep_ratio']} | {r['rouge_l']:.3f} | {r['bleu']:.3f} |")
    beyond = results.get("beyond_context")
    if beyond:
        lines += [
            "",
            f"## Perplexity over {beyond['tokens']} tokens "
            f"({beyond['tokens'] // beyond['trained_context']}x the trained context)",
            "",
            "| cache | in-context ppl | past-context ppl | past / full in-context |",
            "|---|---|---|---|",
        ]
        for name, run in beyond["runs"].items():
            lines.append(
                f"| {name} | {run['in_context_ppl']:.3f} | {run['past_context_ppl']:.3f} | "
                f"{run['past_vs_in_context']:.3f} |"
            )
    return "\n".join(lines) + "\n"


def plot(results, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ctx = max(results["contexts"])
    grid = [_facts(r, results) for r in results["accuracy"] if r["context"] == ctx]
    facts = 4 if 4 in grid else grid[0]
    acc = [r for r in results["accuracy"] if r["context"] == ctx and _facts(r, results) == facts]
    fig, axes = plt.subplots(1, 2, figsize=(12, 4.5), sharey=True)
    methods = dict.fromkeys(
        (r["peer"], r["method"]) for r in acc if not r["method"].startswith("full")
    )
    for ax, mode in zip(axes, ("agnostic", "aware"), strict=True):
        for peer, method in methods:
            pts = sorted(
                (r["ratio"], r["accuracy"])
                for r in acc
                if (r["peer"], r["method"], r["mode"]) == (peer, method, mode) and "error" not in r
            )
            if pts:
                ax.plot(
                    [1 / p[0] for p in pts],
                    [p[1] for p in pts],
                    marker="o",
                    linestyle="-" if peer == "jkv" else "--",
                    label=f"{peer} {method}",
                )
        full = [r["accuracy"] for r in acc if r["method"] == "full" and r["mode"] == mode]
        if full:
            ax.axhline(full[0], color="k", linewidth=0.8, label="full cache")
        ax.set_xscale("log", base=2)
        ax.set_xlabel("compression ratio (context / kept)")
        ax.set_title(f"retrieval accuracy, {mode}, context {ctx}, {facts} facts")
        ax.grid(True, alpha=0.3)
    axes[0].set_ylabel("exact match")
    axes[1].legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


# ---------------------------------------------------------------------------- main
def load_model(name: str):
    import jkv

    if name != "random":
        return jkv.load(name), name
    import jax

    from jkv.demo.tokenizer import build_tokenizer
    from jkv.params import Params, fingerprint
    from jkv.tokenizer import Tokenizer
    from jkv_models.config import ModelConfig
    from jkv_models.llama import init_params

    tok = build_tokenizer()
    cfg = ModelConfig(
        vocab_size=tok.get_vocab_size(),
        hidden_size=64,
        intermediate_size=128,
        num_layers=2,
        num_heads=4,
        num_kv_heads=2,
        head_dim=16,
        max_position_embeddings=256,
        bos_token_id=1,
        eos_token_ids=(2,),
    )
    weights = init_params(cfg, jax.random.key(0))
    params = Params(
        weights=weights,
        config=cfg,
        name="random-tiny",
        version=fingerprint(weights),
        tokenizer=Tokenizer(tok, bos_token_id=1, eos_token_ids=(2,)),
    )
    return params, "random-tiny (untrained: the figures only prove the harness runs)"


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--model", default="demo", help='"demo", a checkpoint, or "random"')
    parser.add_argument("--contexts", type=int, nargs="*", default=None)
    parser.add_argument(
        "--facts",
        type=int,
        nargs="+",
        default=[4],
        help="facts per haystack, one grid each (the question asks for one of them by name)",
    )
    parser.add_argument("--docs", type=int, default=100)
    parser.add_argument("--ratios", type=float, nargs="*", default=RATIOS)
    parser.add_argument(
        "--policies",
        nargs="*",
        default=POLICIES,
        help="jkv policy names, or specs with fields: snapkv:window=16,kernel=11,pool=max",
    )
    parser.add_argument("--peer", choices=["kvpress"], default=None)
    parser.add_argument("--beyond", type=int, default=8, help="x trained context for ppl")
    parser.add_argument("--tiny", action="store_true", help="a minute-long smoke run")
    parser.add_argument("--out", default=str(Path(__file__).parent / "results"))
    parser.add_argument("--stem", default=None, help="file names (quality, or quality_tiny)")
    args = parser.parse_args(argv)
    import jax
    from tqdm import tqdm

    params, label = load_model(args.model)
    trained = params.config.max_position_embeddings
    contexts = args.contexts or [trained // 2, trained]
    if args.tiny:
        contexts, args.docs, args.ratios = [min(contexts)], 4, args.ratios[-1:]
        args.policies = args.policies[:1]
    results = {
        "model": label,
        "contexts": contexts,
        "ratios": args.ratios,
        "docs": args.docs,
        "facts": args.facts,
        "accuracy": [],
        "free_text": [],
        "logit_keep": [],
    }
    hf_dir = peer = None
    if args.peer == "kvpress":
        import quality_kvpress as peer

        import jkv

        hf_dir = jkv.export_hf(params, Path(tempfile.mkdtemp()) / "hf")
        model, tok = peer.load_hf(hf_dir)
    settings = [(p, r) for p in args.policies for r in args.ratios]
    steps = len(contexts) * len(args.facts) * (2 + 2 * len(settings)) * (2 if peer else 1)
    bar = tqdm(total=steps, desc="quality", unit="run")
    t0 = time.time()
    for ctx in contexts:
        # prompt + the 64-token continuation stay inside the trained context
        fillers = filler_texts(2000 + ctx, max(2, args.docs // 4), min(ctx, trained - 64), 64)
        for facts in args.facts:
            # one seed per (context, facts): 4 facts keeps the draws of the earlier runs
            seed = 1000 + ctx + (0 if facts == 4 else 100_000 * facts)
            examples = haystack_examples(seed, args.docs, ctx, facts)
            peer_done = set()
            where = {"context": ctx, "facts": facts}
            for mode in ("agnostic", "aware"):
                row = jkv_accuracy(params, examples, None, 1.0, mode)
                results["accuracy"].append(
                    {"peer": "jkv", "method": "full", "ratio": 1.0, "mode": mode, **where, **row}
                )
                bar.update()
                if peer:
                    row = peer.accuracy(model, tok, examples, None, 1.0, mode=mode)
                    results["accuracy"].append({**row, **where, "method": "full-kvpress"})
                    bar.update()
            for policy, ratio in settings:
                # every setting compiles its own programs: a long run that kept them all ran
                # out of mappable memory in LLVM ("Cannot allocate memory") after ~50 settings
                jax.clear_caches()
                for mode in ("agnostic", "aware"):
                    row = jkv_accuracy(params, examples, policy, ratio, mode)
                    mine = {"peer": "jkv", "method": policy, "ratio": ratio, "mode": mode}
                    results["accuracy"].append({**mine, **where, **row})
                    bar.update()
                    press = kvpress_for(policy) if peer else None
                    if press is None:
                        continue
                    name, overrides = press  # two specs may share a press: run it once
                    label = press_label(name, overrides)
                    if (label, ratio, mode) in peer_done:
                        continue
                    peer_done.add((label, ratio, mode))
                    row = peer.accuracy(
                        model, tok, examples, name, ratio, mode=mode, overrides=overrides
                    )
                    results["accuracy"].append({**row, **where, "method": label})
                    bar.update()
        reference, _ = jkv_free_text(params, fillers, None, 1.0, None)
        base_ppl = jkv_perplexity(params, fillers, None, 1.0)
        for policy, ratio in settings:
            jax.clear_caches()
            _, agree = jkv_free_text(params, fillers, policy, ratio, reference)
            ppl = jkv_perplexity(params, fillers, policy, ratio)
            results["free_text"].append(
                {
                    "peer": "jkv",
                    "method": policy,
                    "ratio": ratio,
                    "context": ctx,
                    **agree,
                    "ppl": ppl,
                    "ppl_ratio": ppl / base_ppl,
                }
            )
        presses = [kvpress_for(p) for p in args.policies] if peer else []
        unique = {(p[0], tuple(p[1].items())) for p in presses if p}
        for name, items in sorted(unique):
            overrides = dict(items)
            label = press_label(name, overrides)
            for ratio in args.ratios:
                agree = peer.free_text(model, tok, [p for p, _ in fillers], name, ratio,
                                       reference=reference, overrides=overrides)  # fmt: skip
                results["free_text"].append(
                    {**agree, "peer": "kvpress", "method": label, "ratio": ratio, "context": ctx}
                )
    results["logit_keep"] = logit_keep_table(
        params,
        # <s> + the filler + 32 sampled tokens stay inside the trained context
        filler_texts(3000, max(2, args.docs // 4), min(min(contexts), trained - 33), 0),
        [1.0, 0.5, 0.2, 0.1, 0.05] if not args.tiny else [0.5],
    )
    results["beyond_context"] = beyond_context(
        params, min(contexts) if args.tiny else trained, 2 if args.tiny else args.beyond
    )
    bar.close()
    results["seconds"] = time.time() - t0
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    stem = args.stem or ("quality_tiny" if args.tiny else "quality")
    (out / f"{stem}.json").write_text(json.dumps(results, indent=2) + "\n")
    (out / f"{stem}.md").write_text(markdown(results))
    plot(results, out / f"{stem}.png")
    plot_beyond(results["beyond_context"], out / f"{stem}_streaming_ppl.png")
    print(markdown(results))
    print(f"wrote {out / (stem + '.json')}, {out / (stem + '.md')}, {out / (stem + '.png')}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
