"""KV compression on a real model and real text: SmolLM2-135M-Instruct, jkv beside kvpress.

The same prompts for both, greedy, float32, on this CPU:
  (a) needles in a real haystack (jkv/demo/real_text.py: RULER's niah_single and
      niah_multikey with 4 keys, planted at 10 depths in CPython's own documentation), at each
      context length, question-agnostic (the context compressed before the question is fed:
      kvpress's protocol) and query-aware (the whole prompt compressed, the question inside);
      the rate of right answers with its standard error sqrt(p (1 - p) / n);
  (b) perplexity of 64 held-out tokens of real text after a compressed context, as a ratio to
      the full cache's (each framework to its own full cache);
  (c) ROUGE-L of a 32-token greedy continuation of real text against the full cache's.
kvpress runs the same weights: jkv's SmolLM2 exported as a Hugging Face folder
(`jkv.export_hf`), loaded by transformers, driven step by step by
`quality_kvpress.generate_ids` (its pipeline's protocol) with presses sized by
`quality_kvpress.press_for` to keep jkv's token count.

    python benchmarks/quality_real.py --contexts 1024 2048 --repeats 1 [--peer kvpress]
        [--policies snapkv:window=64,kernel=5 streaming] [--ratios 0.1 0.25 0.5 0.75]
        [--tasks single multikey] [--texts 4] [--stem quality_real] [--table]
Writes <stem>.json (every row) and, with --table, quality_real.md + quality_real.png from all
quality_real*.json under --out.
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
HERE = Path(__file__).resolve().parent
sys.path[:0] = [str(HERE.parent), str(HERE)]

import policy_specs as specs  # noqa: E402
import quality as q  # noqa: E402  (scores)
import quality_kvpress as qk  # noqa: E402  (kvpress's protocol)

TASKS = {"single": 1, "multikey": 4}  # keys planted
DEPTHS = 10
RATIOS = [0.1, 0.25, 0.5, 0.75]
POLICIES = ["snapkv:window=64,kernel=5", "snapkv:window=16,kernel=11,pool=max", "streaming"]
ANSWER_TOKENS = 8  # " 43936." and the end of turn
PPL_TOKENS, CONT_TOKENS = 64, 32


def se(p: float, n: int) -> float:
    return math.sqrt(max(p * (1 - p), 0.0) / n) if n else float("nan")


def needles(params, task: str, context: int, repeats: int, seed: int):
    import numpy as np

    from jkv.demo.real_text import make_needle

    rng = np.random.default_rng([seed, context, TASKS[task]])
    depths = np.linspace(0.0, 1.0, DEPTHS)
    return [make_needle(params, context, float(d), rng, keys=TASKS[task])
            for _ in range(repeats) for d in depths]  # fmt: skip


def texts(params, context: int, n: int, seed: int):
    """(context ids, held-out ids) of real text: `context` tokens, then PPL_TOKENS."""
    import numpy as np

    from jkv.demo.real_text import sentences

    rng = np.random.default_rng([seed, context, 7])
    pool = sentences()
    out = []
    for _ in range(n):
        start = int(rng.integers(0, len(pool) // 2))
        ids = params.tokenizer.encode(" ".join(pool[start : start + 400]), add_special_tokens=False)
        out.append((ids[:context], ids[context : context + PPL_TOKENS]))
    return out


# ---------------------------------------------------------------------------- jkv
def jkv_needles(params, items, spec, ratio, mode):
    import jkv
    from jkv.demo.real_text import answered

    kw = specs.policy_kw(spec, ratio)
    right, shown = 0, []
    for it in items:
        if mode == "agnostic" and kw:
            state = jkv.prefill(params, it.context_ids, **kw)
            out = jkv.generate(
                params, it.question_ids, kv_state=state, max_new_tokens=ANSWER_TOKENS
            )
        else:
            out = jkv.generate(params, it.context_ids + it.question_ids,
                               max_new_tokens=ANSWER_TOKENS, **kw)  # fmt: skip
        right += answered(out.text, it.answer)
        shown.append(out.text)
    return right, shown


def jkv_text(params, pairs, spec, ratio):
    """(mean NLL of the held-out tokens, greedy continuations) after the compressed context."""
    import numpy as np

    import jkv
    from jkv.scoring import score

    kw = specs.policy_kw(spec, ratio)
    nll, conts = [], []
    for ctx, held in pairs:
        state = jkv.prefill(params, ctx[:-1], **kw)
        nll.extend(-score(params, ctx[-1:] + held, kv_state=state))
        conts.append(
            jkv.generate(params, ctx[-1:], kv_state=state, max_new_tokens=CONT_TOKENS).text
        )
    return float(np.mean(nll)), conts


# ---------------------------------------------------------------------------- kvpress
def _press(spec, ratio, n):
    if spec is None:
        return None
    peer = specs.kvpress_for(spec)
    return qk.press_for(peer[0], ratio, n, peer[1])


def kvpress_needles(model, tok, items, spec, ratio, mode):
    import torch

    from jkv.demo.real_text import answered

    right, shown = 0, []
    for it in items:
        if mode == "agnostic":
            ctx, ques = it.context_ids, it.question_ids
        else:
            ctx, ques = it.context_ids + it.question_ids, []
        ids, _ = qk.generate_ids(model, torch.tensor([ctx]), torch.tensor([ques], dtype=torch.long),
                                 _press(spec, ratio, len(ctx)), ANSWER_TOKENS)  # fmt: skip
        text = tok.decode(ids, skip_special_tokens=True)
        right += answered(text, it.answer)
        shown.append(text)
    return right, shown


def kvpress_text(model, tok, pairs, spec, ratio):
    import contextlib

    import torch
    from transformers import DynamicCache

    nll, conts = [], []
    for ctx, held in pairs:
        press = _press(spec, ratio, len(ctx) - 1)
        cache = DynamicCache()
        n = len(ctx) - 1
        with torch.no_grad(), qk.layer_masks(model):
            with press(model) if press is not None else contextlib.nullcontext():
                model(input_ids=torch.tensor([ctx[:-1]]), past_key_values=cache, logits_to_keep=1)
            feed = torch.tensor([ctx[-1:] + held])
            out = model(input_ids=feed, past_key_values=cache,
                        position_ids=torch.arange(n, n + feed.shape[1]).unsqueeze(0))  # fmt: skip
            logp = torch.log_softmax(out.logits[0, :-1].float(), -1)
            nll.extend((-logp[torch.arange(len(held)), torch.tensor(held)]).tolist())
        ids, _ = qk.generate_ids(model, torch.tensor([ctx[:-1]]), torch.tensor([ctx[-1:]]), press,
                                 CONT_TOKENS)  # fmt: skip
        conts.append(tok.decode(ids, skip_special_tokens=True))
    return sum(nll) / len(nll), conts


# ---------------------------------------------------------------------------- runs
class Loaded:
    """The HF export run by transformers, loaded once per attention implementation: sdpa, or
    eager for the press that reads attention weights (`quality_kvpress.ATTENTION`)."""

    def __init__(self, folder):
        self.folder, self.models = folder, {}

    def for_spec(self, spec):
        peer = None if spec is None else specs.kvpress_for(spec)
        kind = "sdpa" if peer is None else qk.ATTENTION.get(peer[0], "sdpa")
        if kind not in self.models:
            self.models[kind] = qk.load_hf(self.folder, attn_implementation=kind)
        return self.models[kind]


def settings(policies, ratios):
    yield None, 1.0
    for spec in policies:
        for ratio in ratios:
            yield spec, ratio


def run(args, save=lambda rows: None) -> list[dict]:
    """Every row of the grid; `save(rows)` after each (a long run stopped keeps what it did)."""
    import jkv

    params = jkv.load(args.model)
    peers = [("jkv", None, None)]
    if args.peer == "kvpress":
        folder = Path(tempfile.mkdtemp(prefix="jkv-smollm2-hf-"))
        jkv.export_hf(params, folder, overwrite=True)
        peers.append(("kvpress", Loaded(folder), None))
    rows = []
    for context in args.contexts:
        for task in args.tasks:
            items = needles(params, task, context, args.repeats, args.seed)
            for spec, ratio in settings(args.policies, args.ratios):
                for mode in ("agnostic", "aware") if spec else ("full",):
                    for who, loaded, _ in peers:
                        if (
                            who == "kvpress"
                            and spec is not None
                            and specs.kvpress_for(spec) is None
                        ):
                            continue
                        if who == "kvpress":
                            model, tok = loaded.for_spec(spec)
                        t0 = time.perf_counter()
                        if who == "jkv":
                            right, shown = jkv_needles(params, items, spec, ratio, mode)
                        else:
                            right, shown = kvpress_needles(model, tok, items, spec, ratio, mode)
                        n = len(items)
                        row = dict(kind="needle", task=task, context=context, who=who,
                                   policy=spec or "full", ratio=ratio, mode=mode, n=n,
                                   right=right, rate=right / n, se=se(right / n, n),
                                   seconds=time.perf_counter() - t0, answers=shown[:3])  # fmt: skip
                        rows.append(row)
                        save(rows)
                        print(f"{who:<8} {task:<8} {context:>5} {row['policy']:<36} {ratio:>5.0%} "
                              f"{mode:<8} {right:>3}/{n} ({row['rate']:.2f} ± {row['se']:.2f})"
                              f"  {row['seconds']:.0f}s", flush=True)  # fmt: skip
        if args.texts:
            pairs = texts(params, context, args.texts, args.seed)
            full = {}
            for spec, ratio in settings(args.policies, args.ratios):
                for who, loaded, _ in peers:
                    if who == "kvpress" and spec is not None and specs.kvpress_for(spec) is None:
                        continue
                    if who == "kvpress":
                        model, tok = loaded.for_spec(spec)
                    if who == "jkv":
                        nll, conts = jkv_text(params, pairs, spec, ratio)
                    else:
                        nll, conts = kvpress_text(model, tok, pairs, spec, ratio)
                    if spec is None:
                        full[who] = (nll, conts)
                    base_nll, base = full[who]
                    rouge = [q.rouge_l(h, r) for h, r in zip(conts, base, strict=True)]
                    row = dict(kind="text", context=context, who=who, policy=spec or "full",
                               ratio=ratio, n=len(pairs), ppl=math.exp(nll),
                               ppl_ratio=math.exp(nll - base_nll),
                               rouge_l=sum(rouge) / len(rouge),
                               rouge_se=_sd(rouge) / math.sqrt(len(rouge)))  # fmt: skip
                    rows.append(row)
                    save(rows)
                    print(f"{who:<8} text     {context:>5} {row['policy']:<36} {ratio:>5.0%} "
                          f"ppl x{row['ppl_ratio']:.3f}  ROUGE-L {row['rouge_l']:.2f}", flush=True)  # fmt: skip
    return rows


def _sd(xs) -> float:
    m = sum(xs) / len(xs)
    return math.sqrt(sum((x - m) ** 2 for x in xs) / max(len(xs) - 1, 1))


# ---------------------------------------------------------------------------- report
def verdict(a: dict, b: dict) -> str:
    """jkv's rate beside kvpress's: level, ahead or behind beyond one standard error of the
    difference."""
    diff = a["rate"] - b["rate"]
    err = math.sqrt(a["se"] ** 2 + b["se"] ** 2)
    if abs(diff) <= err:
        return "level"
    return "ahead" if diff > 0 else "behind"


def markdown(rows) -> str:
    needle = [r for r in rows if r["kind"] == "needle"]
    peer = {(r["task"], r["context"], r["policy"], r["ratio"], r["mode"]): r
            for r in needle if r["who"] == "kvpress"}  # fmt: skip
    out = ["| task | context | policy | kept | mode | jkv | kvpress | jkv vs kvpress |",
           "|---|---|---|---|---|---|---|---|"]  # fmt: skip
    for r in needle:
        if r["who"] != "jkv":
            continue
        p = peer.get((r["task"], r["context"], r["policy"], r["ratio"], r["mode"]))
        cell = "—" if p is None else f"{p['rate']:.2f} ± {p['se']:.2f}"
        out.append(f"| {r['task']} | {r['context']} | {r['policy']} | {r['ratio']:.0%} | "
                   f"{r['mode']} | {r['rate']:.2f} ± {r['se']:.2f} | {cell} | "
                   f"{'—' if p is None else verdict(r, p)} |")  # fmt: skip
    text = [r for r in rows if r["kind"] == "text"]
    if text:
        out += ["", "| context | policy | kept | who | perplexity / full | ROUGE-L vs full |",
                "|---|---|---|---|---|---|"]  # fmt: skip
        for r in text:
            out.append(f"| {r['context']} | {r['policy']} | {r['ratio']:.0%} | {r['who']} | "
                       f"{r['ppl_ratio']:.3f} | {r['rouge_l']:.2f} ± {r['rouge_se']:.2f} |")  # fmt: skip
    return "\n".join(out) + "\n"


def plot(rows, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    needle = [r for r in rows if r["kind"] == "needle" and r["policy"] != "full"]
    keys = sorted({(r["task"], r["context"], r["mode"]) for r in needle})
    if not keys:
        return
    fig, axes = plt.subplots(1, len(keys), figsize=(4 * len(keys), 3.4), squeeze=False)
    for ax, (task, context, mode) in zip(axes[0], keys, strict=True):
        lines = sorted({(r["who"], r["policy"]) for r in needle})
        for who, policy in lines:
            pts = sorted((r["ratio"], r["rate"], r["se"]) for r in needle if
                         (r["task"], r["context"], r["mode"], r["who"], r["policy"]) ==
                         (task, context, mode, who, policy))  # fmt: skip
            if pts:
                x, y, e = zip(*pts, strict=True)
                ax.errorbar(x, y, yerr=e, marker="o", capsize=2, label=f"{who} {policy}",
                            linestyle="--" if who == "kvpress" else "-")  # fmt: skip
        full = [r["rate"] for r in rows if r["kind"] == "needle" and r["policy"] == "full"
                and r["who"] == "jkv" and (r["task"], r["context"]) == (task, context)]  # fmt: skip
        if full:
            ax.axhline(full[0], color="k", linewidth=0.8, label="full cache")
        ax.set(title=f"{task} {context} {mode}", xlabel="kept fraction", ylim=(-0.05, 1.05))
    axes[0][0].set_ylabel("right answers")
    axes[0][-1].legend(fontsize=6)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)  # fmt: skip
    parser.add_argument("--model", default="smollm2")
    parser.add_argument("--contexts", type=int, nargs="+", default=[1024, 2048])
    parser.add_argument("--tasks", nargs="+", default=list(TASKS), choices=list(TASKS))
    parser.add_argument("--policies", nargs="+", default=POLICIES)
    parser.add_argument("--ratios", type=float, nargs="+", default=RATIOS)
    parser.add_argument("--repeats", type=int, default=1, help="prompts per depth")
    parser.add_argument("--texts", type=int, default=0, help="real texts for (b) and (c)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--peer", choices=("kvpress", "none"), default="none")
    parser.add_argument("--out", type=Path, default=HERE / "results")
    parser.add_argument("--stem", default="quality_real")
    parser.add_argument("--table", action="store_true", help="tabulate every quality_real*.json")
    args = parser.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    if not args.table:
        meta = {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()}
        path = args.out / f"{args.stem}.json"

        def save(rows):
            path.write_text(json.dumps({"args": meta, "rows": rows}, indent=1))

        rows = run(args, save)
        save(rows)
        print(markdown(rows))
        return 0
    rows, seen = [], set()
    for f in sorted(args.out.glob("quality_real*.json")):
        for r in json.loads(f.read_text())["rows"]:
            key = tuple(
                r.get(k) for k in ("kind", "task", "context", "who", "policy", "ratio", "mode")
            )
            if key not in seen:  # a setting run again (the full cache in every file): the first
                seen.add(key)
                rows.append(r)
    (args.out / "quality_real.md").write_text(markdown(rows))
    plot(rows, args.out / "quality_real.png")
    print(markdown(rows))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
