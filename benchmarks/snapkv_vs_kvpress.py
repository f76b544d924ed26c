"""jkv's SnapKV and StreamingLLM beside kvpress's, on prompts the quality harness never draws.

Part 1, kept indices: for each prompt's context (question-agnostic: the context alone is
compressed), the slots every (layer, kv head) keeps, by jkv (`jkv.prefill`, the positions left in
its cache) and by kvpress (the `topk` indices its `ScorerPress.compress` keeps, recorded on the
way), at the same token count; their overlap |jkv & kvpress| / |kept| per (layer, head),
averaged. Twice: kvpress with its own defaults (window 64, kernel 5) and with jkv's values of the
parameters both have (window 32, kernel 7).
Part 2, exact-match accuracy of both on held-out demo haystacks from seeds the harness does not
use (it draws 1000 + context, 2000 + context, 3000, 4000), both modes, with the binomial standard
error of each rate.

    python benchmarks/snapkv_vs_kvpress.py [--examples 48] [--context 512] [--facts 4]
Writes results/snapkv_vs_kvpress.json.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

import quality  # noqa: E402
import quality_kvpress as qk  # noqa: E402

SEED = 90_000  # far from the harness's seeds
RATIOS = (0.1, 0.25, 0.5)


def kvpress_kept(model, tok, context: str, press) -> list[list[set[int]]]:
    """[layer][kv head] -> the context slots kvpress's scorer keeps."""
    from kvpress.presses.scorer_press import ScorerPress
    from kvpress.utils import compute_n_kept

    kept: dict[int, list[set[int]]] = {}
    original = ScorerPress.compress

    def recording(self, module, hidden_states, keys, values, attentions, kwargs):
        scores = self.score(module, hidden_states, keys, values, attentions, kwargs)
        n_kept = compute_n_kept(keys.shape[2], self.compression_ratio)
        top = scores.topk(n_kept, dim=-1).indices[0]  # [K, kept]
        kept[module.layer_idx] = [set(row.tolist()) for row in top]
        return original(self, module, hidden_states, keys, values, attentions, kwargs)

    c_ids, q_ids = qk.prompt_ids(model, tok, context, "")
    ScorerPress.compress = recording
    try:
        qk.generate_ids(model, c_ids, q_ids, press, 1)
    finally:
        ScorerPress.compress = original
    return [kept[i] for i in sorted(kept)]


def jkv_kept(params, context: str, policy) -> list[list[set[int]]]:
    import numpy as np

    import jkv

    state = jkv.prefill(params, context, kv_policy=policy, kv_dtype="float32")
    out = []
    for layer in state.layers:
        pos, n = np.asarray(layer.positions[0]), np.asarray(layer.lengths[0])
        out.append([set(pos[h, : n[h]].tolist()) for h in range(pos.shape[0])])
    return out


def overlap(a, b) -> float:
    pairs = [(x, y) for la, lb in zip(a, b, strict=True) for x, y in zip(la, lb, strict=True)]
    return sum(len(x & y) / max(len(x), 1) for x, y in pairs) / len(pairs)


def part1(params, model, tok, examples, ratios) -> list[dict]:
    import jkv

    rows = []
    for method, policy_cls in (("snapkv", jkv.SnapKV),):
        for label, overrides in (("kvpress defaults", {}), ("matched", qk.match_jkv(method))):
            for ratio in ratios:
                scores = []
                for context, _, _ in examples:
                    n = len(params.tokenizer.encode(context))
                    kept = max(1, math.ceil(ratio * n))
                    press = qk.press_for(method, ratio, n, overrides)
                    theirs = kvpress_kept(model, tok, context, press)
                    mine = jkv_kept(params, context, policy_cls(budget=kept))
                    scores.append(overlap(mine, theirs))
                row = {"method": method, "kvpress": label, "overrides": overrides,
                       "ratio": ratio, "overlap": sum(scores) / len(scores), "n": len(scores)}  # fmt: skip
                rows.append(row)
                print(f"kept indices {method} {label:16} {ratio:.2f}: overlap {row['overlap']:.3f}")
    return rows


def part2(params, model, tok, examples, ratios) -> list[dict]:
    rows = []
    for mode in ("agnostic", "aware"):
        full = quality.jkv_accuracy(params, examples, None, 1.0, mode)["accuracy"]
        rows.append({"peer": "jkv", "method": "full", "ratio": 1.0, "mode": mode, "accuracy": full})
        for method in ("snapkv", "streaming"):
            for ratio in ratios:
                mine = quality.jkv_accuracy(params, examples, method, ratio, mode)["accuracy"]
                theirs = qk.accuracy(model, tok, examples, method, ratio, mode=mode)["accuracy"]
                for peer, acc in (("jkv", mine), ("kvpress", theirs)):
                    se = math.sqrt(max(acc * (1 - acc), 1e-12) / len(examples))
                    rows.append({"peer": peer, "method": method, "ratio": ratio, "mode": mode,
                                 "accuracy": acc, "se": se, "n": len(examples)})  # fmt: skip
                print(f"{mode:8} {method:9} {ratio:.2f}: jkv {mine:.3f}  kvpress {theirs:.3f}")
    return rows


def main(argv=None) -> int:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--examples", type=int, default=48)
    p.add_argument("--indices-examples", type=int, default=8)
    p.add_argument("--context", type=int, default=512)
    p.add_argument("--facts", type=int, default=4)
    p.add_argument("--parts", nargs="+", type=int, default=[1, 2], choices=[1, 2])
    p.add_argument("--out", default=str(Path(__file__).parent / "results"))
    args = p.parse_args(argv)
    import jkv

    params = jkv.load("demo")
    hf_dir = jkv.export_hf(params, Path(tempfile.mkdtemp()) / "hf")
    model, tok = qk.load_hf(hf_dir)
    examples = quality.haystack_examples(SEED + args.context, args.examples, args.context,
                                         args.facts)  # fmt: skip
    t0 = time.time()
    result = {"benchmark": "snapkv_vs_kvpress", "seed": SEED + args.context,
              "context": args.context, "facts": args.facts, "examples": args.examples}  # fmt: skip
    if 1 in args.parts:
        result["kept_indices"] = part1(params, model, tok, examples[: args.indices_examples],
                                       RATIOS)  # fmt: skip
    if 2 in args.parts:
        result["accuracy"] = part2(params, model, tok, examples, RATIOS)
    result["seconds"] = time.time() - t0
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "snapkv_vs_kvpress.json").write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {out / 'snapkv_vs_kvpress.json'} ({result['seconds']:.0f} s)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
