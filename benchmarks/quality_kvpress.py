"""kvpress beside jkv: the same compression methods, run by kvpress on the HF export of jkv's model.

kvpress's protocol (kvpress/pipeline.py, `KVPressTextGenerationPipeline`), which this module
follows step by step so it can return token ids and handle an empty question:
  1. tokenise: `bos_token + context` and `question + "\\n"` separately, no special tokens added
     (no chat template here). The word-level demo tokenizer drops the "\\n", so the ids are
     `<s>` + the words, token for token what `jkv` encodes (the tests check it);
  2. prefill the context through the model with the press's forward hooks on every attention
     layer: each layer's cache is cut to the kept entries right after that layer has attended
     over the whole context (the prefill's own outputs are uncompressed);
  3. feed the question at its original positions (no re-rotation), then decode greedily.
Question-agnostic = the question is step 3's; query-aware = the question is inside the
compressed context and step 3 is empty, so the first answer token comes from the prefill's
last logits (kvpress's pipeline cannot run an empty question: it sends a 0-token forward).
One deviation from the pipeline, on purpose: decoding stops at `</s>` also when it is the
first token (the pipeline checks from the second on); jkv stops there too.

Budgets. jkv's budget is the kept fraction `ratio` of the context, rounded up
(`ceil(ratio * n)` tokens, n counting `<s>`); kvpress's `compression_ratio` is the removed
fraction and its scorers keep `int(n * (1 - compression_ratio))`, so `1 - 0.9` keeps one token
fewer than 10% of 100 (float rounding). `press_for` sets `compression_ratio` per prompt so that
kvpress keeps exactly jkv's token count; rows report the kept fraction measured in the cache.

Settings side by side (kvpress 0.5.5 defaults are used unless `--match-jkv`):

| method | kvpress press | jkv policy |
|---|---|---|
| snapkv | SnapKVPress window_size=64, kernel_size=5 (avg pool); window kept inside the budget | SnapKV window=32, kernel=7, pool=avg |
| streaming | StreamingLLMPress n_sink=4; keys keep their original positions | StreamingLLM sink=4; keys re-rotated to cache positions |
| observed_attention | ObservedAttentionPress: mean attention received from the prompt's queries, no recent window (needs eager attention) | H2O recent=32 + heaviest accumulated attention mass; evicts while decoding |
| pyramidkv | PyramidKVPress beta=20, window_size=64, kernel_size=5; uniform SnapKV budgets unless the layer minimum `kept / beta` reaches `window_size` (so below ~1280 kept tokens) | PyramidKV beta=20, linear layer factors from 2b/(b+1) to 2/(b+1) |
| knorm | KnormPress: keeps the lowest key L2 norms | Quantile keep_norms="high" (L1, seed 2.3); "low" is Knorm's rule |
| adakv | AdaKVPress(SnapKVPress window_size=64, kernel_size=5), alpha_safeguard=0.2; heads share a layer's budget (masked, not removed) | AdaKV window=32, kernel=7, alpha_safeguard=0.2, a head capped at 2x the budget |
| kvzip | KVzipPress n_sink=4, layerwise=False, chunk_size=2048: the context replayed, max attention per slot, ranked over all layers and heads (masked, not removed) | KVzip sink=4, layerwise=False, chunk=2048 (the same scores; a head keeps up to its whole prompt) |
| expected_attention | ExpectedAttentionPress n_future_positions=512, n_sink=4, covariance and value norms on | none |

    python benchmarks/quality_kvpress.py --hf DIR --examples 20 --context 256 [--match-jkv]
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import functools
import json
import math
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # this checkout's jkv first, when run as a script

RATIOS = (0.05, 0.1, 0.25, 0.5)
MODES = ("agnostic", "aware")
ANSWER_NEW_TOKENS = 6  # 5 digits and `</s>`
# name -> (kvpress class, the jkv policy of the same method, {kvpress field: jkv field} for
# the parameters both have). jkv's values are read from its dataclasses, never copied here.
METHODS = {
    "snapkv": ("SnapKVPress", "SnapKV", {"window_size": "window", "kernel_size": "kernel"}),
    "streaming": ("StreamingLLMPress", "StreamingLLM", {"n_sink": "sink"}),
    "observed_attention": ("ObservedAttentionPress", "H2O", {}),
    "pyramidkv": (
        "PyramidKVPress",
        "PyramidKV",
        {"window_size": "window", "kernel_size": "kernel", "beta": "beta"},
    ),
    "knorm": ("KnormPress", "Quantile", {}),
    "expected_attention": ("ExpectedAttentionPress", None, {}),
    "adakv": (
        "AdaKVPress",
        "AdaKV",
        {"window_size": "window", "kernel_size": "kernel", "alpha_safeguard": "alpha_safeguard"},
    ),
    "kvzip": ("KVzipPress", "KVzip", {"n_sink": "sink", "layerwise": "layerwise"}),
}
# The attention implementation a press needs (others run on either): ObservedAttention reads
# the attention weights (eager); the presses that mask instead of removing assert non-eager.
ATTENTION = {"observed_attention": "eager", "adakv": "sdpa", "kvzip": "sdpa"}
# Fields of a press that wraps another (AdaKV's scorer is SnapKV's).
WRAPS = {"AdaKVPress": ("SnapKVPress", ("window_size", "kernel_size"))}


def compression_ratio(kept: float) -> float:
    """kvpress's `compression_ratio` (removed fraction) for a kept fraction `kept` in (0, 1]."""
    if isinstance(kept, bool) or not isinstance(kept, int | float) or not 0.0 < kept <= 1.0:
        raise ValueError(f"kept={kept!r} must be a kept fraction in (0, 1]")
    return max(0.0, 1.0 - kept)


def _factory(class_name: str):
    def make(ratio: float, **overrides):
        import kvpress

        if class_name in WRAPS:
            inner, fields = WRAPS[class_name]
            inner_kw = {k: overrides.pop(k) for k in fields if k in overrides}
            scorer = getattr(kvpress, inner)(compression_ratio=compression_ratio(ratio), **inner_kw)
            return getattr(kvpress, class_name)(press=scorer, **overrides)
        return getattr(kvpress, class_name)(compression_ratio=compression_ratio(ratio), **overrides)

    make.__name__ = make.__qualname__ = f"make_{class_name}"
    make.__doc__ = f"kvpress.{class_name} keeping the fraction `ratio`; overrides its fields."
    return make


PRESSES = {name: _factory(cls) for name, (cls, _, _) in METHODS.items()}


def _jkv_defaults(policy: str) -> dict:
    from jkv import policies

    fields = dataclasses.fields(getattr(policies, policy))
    return {f.name: f.default for f in fields if f.name != "budget"}


def side_by_side(name: str) -> dict:
    """kvpress's press fields (its defaults) beside the jkv policy's defaults, for one method."""
    cls, policy, _ = METHODS[name]
    press = dataclasses.asdict(PRESSES[name](0.5))
    press.pop("compression_ratio", None)
    jkv = None if policy is None else {"policy": policy, **_jkv_defaults(policy)}
    return {"kvpress": {"press": cls, **press}, "jkv": jkv}


def match_jkv(name: str) -> dict:
    """Press overrides that give kvpress jkv's values of the parameters both have."""
    _, policy, shared = METHODS[name]
    if not shared:
        return {}
    defaults = _jkv_defaults(policy)
    return {press_field: defaults[jkv_field] for press_field, jkv_field in shared.items()}


def press_for(name: str | None, ratio: float, n_tokens: int, overrides: dict | None = None):
    """The press that keeps jkv's `ceil(ratio * n_tokens)` of an `n_tokens` context (None: full).

    Args:
      name: a `PRESSES` key, or None for no compression.
      ratio: kept fraction in (0, 1]; 1.0 means no compression.
      n_tokens: context tokens, `<s>` included.
      overrides: press fields to set (e.g. `match_jkv(name)`).

    Returns:
      a kvpress press, or None.
    """
    if name is None or ratio >= 1.0:
        return None
    kept = min(n_tokens, max(1, math.ceil(ratio * n_tokens)))
    if kept >= n_tokens:
        return PRESSES[name](1.0, **(overrides or {}))
    # +0.25 token: kvpress truncates (`int`, PyramidKV `round`) n * (1 - compression_ratio),
    # which must land on `kept` whatever the float error of 1 - (1 - kept / n).
    return PRESSES[name]((kept + 0.25) / n_tokens, **(overrides or {}))


def load_hf(folder, *, attn_implementation: str = "eager"):
    """The HF export of a jkv model, as kvpress runs it: float32 on CPU, in eval mode.

    Args:
      folder: a folder written by `jkv.export_hf` (config.json, model.safetensors,
        tokenizer.json, tokenizer_config.json).
      attn_implementation: "eager" (default) returns attention weights, which
        ObservedAttentionPress needs and SnapKV/PyramidKV then read instead of recomputing
        their window; "sdpa" serves every other press.

    Returns:
      (model, tokenizer).

    Raises:
      ValueError: the folder has no config.json or tokenizer.json.
    """
    import torch
    import transformers

    folder = Path(folder)
    for name in ("config.json", "tokenizer.json"):
        if not (folder / name).is_file():
            raise ValueError(f"{folder}: no {name}; expected a folder written by jkv.export_hf")
    model = transformers.AutoModelForCausalLM.from_pretrained(
        folder, dtype=torch.float32, attn_implementation=attn_implementation
    )
    return model.eval(), transformers.AutoTokenizer.from_pretrained(folder)


@functools.lru_cache(maxsize=4)
def _pipeline(model, tok):
    from kvpress import KVPressTextGenerationPipeline

    return KVPressTextGenerationPipeline(model=model, tokenizer=tok)


def prompt_ids(model, tok, context: str, question: str):
    """kvpress's own tokenisation (`KVPressTextGenerationPipeline.preprocess`).

    Returns:
      (context ids `[1, n]`, question ids `[1, q]`) torch int64 tensors; q may be 0.
    """
    pre = _pipeline(model, tok).preprocess(context, [question], "", int(1e10))
    return pre["context_ids"], pre["questions_ids"][0]


@contextlib.contextmanager
def layer_masks(model):
    """While active, each attention layer gets the causal mask of its own cache length.

    transformers 5 builds one mask for all layers, sized from layer 0's cache. A press with
    per-layer budgets (kvpress's PyramidKV once `kept / beta` reaches its window, e.g. at 50%
    kept) leaves the layers with different lengths, and attention then fails with "The size of
    tensor a (75) must match the size of tensor b (231)". For a batch of one unpadded prompt
    the right mask of a layer with `past` cached entries and `q` new queries is the last
    `past + q` columns (query i sees slot j iff j <= past + i); a longer layer gets visible
    columns in front. A no-op when every layer has the same length.
    """
    import torch

    def fix(module, args, kwargs):
        mask, cache = kwargs.get("attention_mask"), kwargs.get("past_key_values")
        if mask is None or cache is None:
            return None
        layers = cache.layers
        past = layers[module.layer_idx].get_seq_length() if module.layer_idx < len(layers) else 0
        want = past + kwargs["hidden_states"].shape[1]
        if mask.shape[-1] > want:
            mask = mask[..., -want:]
        elif mask.shape[-1] < want:  # eager masks are additive floats, sdpa's booleans
            visible = True if mask.dtype == torch.bool else 0.0
            pad = mask.new_full((*mask.shape[:-1], want - mask.shape[-1]), visible)
            mask = torch.cat([pad, mask], dim=-1)
        return args, {**kwargs, "attention_mask": mask}

    hooks = [
        layer.self_attn.register_forward_pre_hook(fix, with_kwargs=True)
        for layer in model.model.layers
    ]
    try:
        yield
    finally:
        for hook in hooks:
            hook.remove()


def generate_ids(model, context_ids, question_ids, press, max_new_tokens: int):
    """Compresses the context with `press`, feeds the question, decodes greedily.

    Args:
      model: from `load_hf`.
      context_ids: `[1, n]` ids prefilled with the press active.
      question_ids: `[1, q]` ids fed after compression at positions n..n+q-1; q may be 0.
      press: a kvpress press or None.
      max_new_tokens: tokens to generate at most (stops after `</s>`).

    Returns:
      (generated ids, kept entries per layer after compression: the cache's length, less the
      entries a masking press (AdaKV, KVzip) hides, averaged over the kv heads).
    """
    import torch
    from transformers import DynamicCache

    eos = model.generation_config.eos_token_id
    eos = set(eos if isinstance(eos, list) else [eos])
    n, q = context_ids.shape[1], question_ids.shape[1]
    cache = DynamicCache()
    with torch.no_grad(), layer_masks(model):
        with press(model) if press is not None else contextlib.nullcontext():
            out = model(input_ids=context_ids, past_key_values=cache, logits_to_keep=1)
        heads = model.config.num_key_value_heads
        kept = []
        for i, layer in enumerate(model.model.layers):
            masked = getattr(layer.self_attn, "masked_key_indices", None)
            hidden = 0 if masked is None else len(masked[0]) / heads
            kept.append(cache.get_seq_length(i) - hidden)
        if q:
            positions = torch.arange(n, n + q).unsqueeze(0)
            out = model(
                input_ids=question_ids,
                past_key_values=cache,
                position_ids=positions,
                logits_to_keep=1,
            )
        ids = [int(out.logits[0, -1].argmax())]
        for i in range(max_new_tokens - 1):
            if ids[-1] in eos:
                break
            out = model(
                input_ids=torch.tensor([[ids[-1]]]),
                past_key_values=cache,
                position_ids=torch.tensor([[n + q + i]]),
            )
            ids.append(int(out.logits[0, -1].argmax()))
    return ids, kept


def _check(press_name, ratio, examples_or_prompts, what: str) -> None:
    if press_name is not None and press_name not in PRESSES:
        raise ValueError(f"press_name={press_name!r} is not one of {sorted(PRESSES)}")
    if isinstance(ratio, bool) or not isinstance(ratio, int | float) or not 0.0 < ratio <= 1.0:
        raise ValueError(f"ratio={ratio!r} must be a kept fraction in (0, 1]")
    if not examples_or_prompts:
        raise ValueError(f"{what} is empty")


def _row(press_name, ratio, n: int, overrides) -> dict:
    full = press_name is None or ratio >= 1.0
    row = {"peer": "kvpress", "method": "full" if full else press_name, "ratio": ratio, "n": n}
    if not full and overrides:
        row["overrides"] = dict(overrides)
    return row


def _kept_summary(row: dict, kept: list[list[int]], lengths: list[int]) -> None:
    """Adds the measured kept fraction: overall and per layer (PyramidKV's differ)."""
    per_layer = [
        sum(k[i] / n for k, n in zip(kept, lengths, strict=True)) for i in range(len(kept[0]))
    ]
    per_layer = [v / len(kept) for v in per_layer]
    row["kept"] = sum(per_layer) / len(per_layer)
    row["kept_per_layer"] = per_layer


def accuracy(
    model,
    tok,
    examples,
    press_name: str | None,
    ratio: float,
    *,
    mode: str,
    overrides: dict | None = None,
    max_new_tokens: int = ANSWER_NEW_TOKENS,
) -> dict:
    """Exact-match retrieval accuracy of kvpress's press on haystack examples.

    Args:
      model, tok: from `load_hf`.
      examples: `(context, question, answer)` triples; the question starts with "Question".
      press_name: a `PRESSES` key, or None for the full cache.
      ratio: kept fraction of the compressed text in (0, 1]; 1.0 is the full cache.
      mode: "agnostic" (the context is compressed, then the question is fed) or "aware"
        (`context + " " + question` is compressed, nothing is fed after it).
      overrides: press fields to set, e.g. `match_jkv(press_name)`.
      max_new_tokens: greedy tokens per example; the first 5 must equal the answer's ids.

    Returns:
      {"peer": "kvpress", "method", "ratio", "mode", "accuracy", "n", "seconds", "kept",
      "kept_per_layer"} (+ "overrides" when given); "method" is "full" without compression. A press that
      fails on this model gives "error" (the exception) and accuracy NaN instead of raising.

    Raises:
      ValueError: an unknown press or mode, a ratio outside (0, 1], no examples.
    """
    _check(press_name, ratio, examples, "examples")
    if mode not in MODES:
        raise ValueError(f"mode={mode!r} must be one of {MODES}")
    row = {**_row(press_name, ratio, len(examples), overrides), "mode": mode}
    t0 = time.perf_counter()
    right, kept, lengths = 0, [], []
    try:
        for context, question, answer in examples:
            if mode == "aware":
                context, question = context + " " + question, ""
            c_ids, q_ids = prompt_ids(model, tok, context, question)
            press = press_for(press_name, ratio, c_ids.shape[1], overrides)
            ids, k = generate_ids(model, c_ids, q_ids, press, max_new_tokens)
            want = tok.encode(answer, add_special_tokens=False)
            right += ids[: len(want)] == want
            kept.append(k)
            lengths.append(c_ids.shape[1])
        row["accuracy"] = right / len(examples)
        _kept_summary(row, kept, lengths)
    except Exception as e:  # a kvpress/transformers quirk: report it in the row, run on
        row.update(accuracy=math.nan, error=f"{type(e).__name__}: {e}")
    row["seconds"] = time.perf_counter() - t0
    return row


def continuations(
    model,
    tok,
    prompts,
    press_name: str | None,
    ratio: float,
    *,
    new_tokens: int = 32,
    overrides: dict | None = None,
):
    """Greedy continuations of each prompt compressed as the context (empty question).

    Returns:
      (texts, kept per layer of each prompt, prompt lengths); raises what the press raises.
    """
    texts, kept, lengths = [], [], []
    for prompt in prompts:
        c_ids, q_ids = prompt_ids(model, tok, prompt, "")
        press = press_for(press_name, ratio, c_ids.shape[1], overrides)
        ids, k = generate_ids(model, c_ids, q_ids, press, new_tokens)
        texts.append(tok.decode(ids, skip_special_tokens=True))
        kept.append(k)
        lengths.append(c_ids.shape[1])
    return texts, kept, lengths


def rouge_l(hyp: str, ref: str) -> float:
    """ROUGE-L F-measure (rouge_score) over the space-separated tokens, kept as they are."""
    from rouge_score import rouge_scorer

    class Words:  # the default tokenizer lower-cases and drops digits' neighbours and "."
        def tokenize(self, text):
            return text.split()

    return (
        rouge_scorer.RougeScorer(["rougeL"], tokenizer=Words()).score(ref, hyp)["rougeL"].fmeasure
    )


def bleu(hyp: str, ref: str) -> float:
    """Sentence BLEU in [0, 1] (sacrebleu, tokenize="none", exponential smoothing)."""
    import sacrebleu

    return sacrebleu.sentence_bleu(hyp, [ref], tokenize="none", smooth_method="exp").score / 100.0


def agreement(hyps, refs) -> dict:
    """Mean ROUGE-L and BLEU of each hypothesis against its reference.

    Raises:
      ValueError: the lists differ in length or are empty.
    """
    if len(hyps) != len(refs) or not hyps:
        raise ValueError(f"{len(hyps)=} and {len(refs)=} must be equal and non-zero")
    pairs = list(zip(hyps, refs, strict=True))
    return {
        "rouge_l": sum(rouge_l(h, r) for h, r in pairs) / len(pairs),
        "bleu": sum(bleu(h, r) for h, r in pairs) / len(pairs),
    }


def free_text(
    model,
    tok,
    prompts,
    press_name: str | None,
    ratio: float,
    *,
    reference=None,
    new_tokens: int = 32,
    overrides: dict | None = None,
) -> dict:
    """Free-text agreement of kvpress's compressed continuation with a full-cache reference.

    Args:
      model, tok: from `load_hf`.
      prompts: filler texts, each compressed as the context.
      press_name: a `PRESSES` key, or None.
      ratio: kept fraction in (0, 1].
      reference: one reference text per prompt (e.g. jkv's full-cache continuation); None:
        kvpress's own full-cache continuation.
      new_tokens: greedy tokens per prompt.
      overrides: press fields to set.

    Returns:
      {"peer", "method", "ratio", "n", "rouge_l", "bleu", "kept", "kept_per_layer",
      "seconds"} (+ "overrides"); a failing press gives "error" and NaN scores.

    Raises:
      ValueError: an unknown press, a bad ratio, no prompts, or a reference of another length.
    """
    _check(press_name, ratio, prompts, "prompts")
    if reference is not None and len(reference) != len(prompts):
        raise ValueError(f"{len(reference)=} must equal {len(prompts)=}")
    row = _row(press_name, ratio, len(prompts), overrides)
    t0 = time.perf_counter()
    try:
        if reference is None:
            reference, _, _ = continuations(model, tok, prompts, None, 1.0, new_tokens=new_tokens)
        texts, kept, lengths = continuations(
            model, tok, prompts, press_name, ratio, new_tokens=new_tokens, overrides=overrides
        )
        row.update(agreement(texts, reference))
        _kept_summary(row, kept, lengths)
    except Exception as e:  # reported in the row, as in `accuracy`
        row.update(rouge_l=math.nan, bleu=math.nan, error=f"{type(e).__name__}: {e}")
    row["seconds"] = time.perf_counter() - t0
    return row


# ------------------------------------------------------------------------------------ CLI
def haystack_examples(seed: int, n: int, context: int, facts: int):
    """`n` (context, question, answer) triples: each prompt split at its last "Question :"."""
    from jkv.demo.haystack import split_examples

    return split_examples(seed, n, context, facts)


def table(rows, ratios) -> str:
    """Markdown: accuracy per press (rows) and ratio (columns), one block per mode."""
    lines = []
    for mode in MODES:
        sel = [r for r in rows if r["mode"] == mode]
        if not sel:
            continue
        lines += [
            f"accuracy, {mode}",
            "| method | " + " | ".join(f"{r:.0%}" for r in ratios) + " |",
            "|---|" + "---|" * len(ratios),
        ]
        for r in sel:
            if r["method"] == "full":
                lines.append(f"| full cache | {r['accuracy']:.2f} |" + " |" * (len(ratios) - 1))
        for method in dict.fromkeys(r["method"] for r in sel if r["method"] != "full"):
            cells = []
            for ratio in ratios:
                r = next((x for x in sel if x["method"] == method and x["ratio"] == ratio), None)
                cells.append(
                    "-" if r is None else "err" if "error" in r else f"{r['accuracy']:.2f}"
                )
            lines.append(f"| {method} | " + " | ".join(cells) + " |")
        lines.append("")
    errors = {r["method"]: r["error"] for r in rows if "error" in r}
    lines += [f"error {m}: {e}" for m, e in errors.items()]
    return "\n".join(lines)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--hf", required=True, help="a folder written by jkv.export_hf")
    p.add_argument("--examples", type=int, default=20, help="haystack documents")
    p.add_argument("--context", type=int, default=256, help="tokens per document")
    p.add_argument("--facts", type=int, default=4)
    p.add_argument("--seed", type=int, default=None, help="default 1000 + context (quality.py's)")
    p.add_argument("--ratios", type=float, nargs="*", default=list(RATIOS))
    p.add_argument("--presses", nargs="*", default=list(PRESSES), choices=list(PRESSES))
    p.add_argument("--modes", nargs="*", default=list(MODES), choices=list(MODES))
    p.add_argument("--match-jkv", action="store_true", help="jkv's window/kernel/sink values")
    p.add_argument("--threads", type=int, default=2, help="torch threads")
    p.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "quality_kvpress.json"))
    args = p.parse_args(argv)
    if args.examples < 1:
        p.error(f"--examples={args.examples} must be >= 1")
    import torch

    torch.set_num_threads(args.threads)
    seed = 1000 + args.context if args.seed is None else args.seed
    examples = haystack_examples(seed, args.examples, args.context, args.facts)
    model, tok = load_hf(args.hf)
    rows = []
    for mode in args.modes:
        rows.append(accuracy(model, tok, examples, None, 1.0, mode=mode))
        for name in args.presses:
            overrides = match_jkv(name) if args.match_jkv else None
            for ratio in args.ratios:
                rows.append(
                    accuracy(model, tok, examples, name, ratio, mode=mode, overrides=overrides)
                )
                print(
                    f"{mode:8s} {name:18s} {ratio:5.2f} "
                    f"acc {rows[-1]['accuracy']:.2f} kept {rows[-1].get('kept', math.nan):.3f} "
                    f"{rows[-1]['seconds']:.1f}s",
                    file=sys.stderr,
                )
    print(table(rows, args.ratios))
    result = {
        "hf": str(args.hf),
        "context": args.context,
        "facts": args.facts,
        "examples": args.examples,
        "seed": seed,
        "match_jkv": args.match_jkv,
        "side_by_side": {name: side_by_side(name) for name in args.presses},
        "rows": rows,
    }
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
