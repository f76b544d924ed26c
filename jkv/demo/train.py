"""Trains jkv's demo model (a small Llama) on the haystack retrieval task; writes a jkv folder.

  python -m jkv.demo.train --out tmp/demo-train              # train from scratch
  python -m jkv.demo.train --out tmp/demo-train --resume     # continue exactly where it stopped
  python -m jkv.demo.train --eval-only --final tmp/demo-final  # held-out accuracies

The final folder (`--final`) is a jkv checkpoint plus `training.json`: the run's hyperparameters,
curriculum, stage timeline (step, seconds) and, after `--eval-only`, its held-out figures (8
facts at the trained context and at half of it, 1-8 facts, a single needle at both lengths).

Recipe (from a measured trial, shared/notes/demo-training.md): AdamW with warm-up and cosine
decay, global-norm clipping, weight decay on matrices; loss on every token with the 5 answer
digits and the `</s>` after them weighted x`answer_weight`; a curriculum that starts with short
documents and few facts (retrieval does not form from scratch at long context) and moves on once
teacher-forced exact-match accuracy on held-out documents reaches `--advance-at`; a share of
plain-filler rows so free text continues sensibly.

Determinism: the batch of step s is drawn from `default_rng([seed, 0, s])` at the current stage,
held-out sets from `[seed, 1, stage]` (training-time) and `[seed, 2, ...]` (final eval). So a
resumed run sees the same data as an uninterrupted one. Checkpoints (orbax, `<out>/ckpt/<step>`)
hold params, optimizer state, step and the init key; their JSON side holds the stage, the stage
timeline and the run's hyperparameters, which win over the command line on `--resume`.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import hashlib
import json
import shutil
import signal
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import optax
import orbax.checkpoint as ocp

from jkv.checkpoints.orbax import FORMAT
from jkv.demo import haystack
from jkv.demo.tokenizer import save_tokenizer
from jkv_models.config import ModelConfig
from jkv_models.llama import forward, init_params, param_shapes

# (seq_len T, min facts, max facts); the curriculum is the prefix up to --context. 512 and 1024
# end with a stage of 4-8 facts (many facts are the hard case; 1-8 spends half its rows on few).
STAGES = (
    (64, 1, 2),
    (64, 2, 4),
    (128, 1, 4),
    (128, 1, 8),
    (256, 1, 8),
    (512, 1, 8),
    (512, 4, 8),
    (1024, 1, 8),
    (1024, 4, 8),
)
NAME = "jkv-demo"

# Hyperparameters stored in the checkpoint (a resumed run keeps them); None = default below.
# These defaults are the settings of the run that trained the multi-fact model (the final
# folder's training.json holds its timeline and held-out figures).
SAVED = dict(
    seed=0,
    context=512,
    d_model=128,
    layers=4,
    heads=4,
    kv_heads=2,
    mlp=512,
    rope_theta=10000.0,
    steps=12000,
    batch_tokens=4096,
    lr=2e-3,
    warmup=200,
    weight_decay=0.01,
    clip=1.0,
    answer_weight=21.0,
    filler_fraction=0.1,
    recall_fraction=0.0,
    advance_at=0.9,
    eval_every=250,
    eval_docs=128,
)


# On --resume these may change: --steps stretches or shrinks the cosine schedule from there on,
# --context extends or cuts the curriculum (no parameter depends on it), --advance-at moves the
# gate of the stages to come, --recall-fraction the share of recall rows. A run resumed without
# them continues exactly.
RESUME_CAN_CHANGE = ("steps", "context", "advance_at", "recall_fraction")


def curriculum(context: int) -> tuple[tuple[int, int, int], ...]:
    """The stages up to and including sequence length `context`.

    Args:
      context: the longest sequence length to train (one of the `STAGES` lengths).

    Returns:
      (seq_len, min_facts, max_facts) per stage, shortest first.

    Raises:
      ValueError: `context` is not one of the stage lengths.
    """
    lengths = sorted({s[0] for s in STAGES})
    if context not in lengths:
        raise ValueError(f"{context=} must be one of {lengths}")
    return tuple(s for s in STAGES if s[0] <= context)


def model_config(h: dict, max_len: int) -> ModelConfig:
    """The ModelConfig for hyperparameters `h` and a trained context of `max_len` tokens.

    Args:
      h: hyperparameters (`SAVED` keys).
      max_len: `max_position_embeddings`.

    Returns:
      a float32 Llama config with the haystack vocabulary and its `<s>` / `</s>` ids.

    Raises:
      ValueError: `d_model` is not a multiple of `heads` (or ModelConfig's own checks).
    """
    if h["d_model"] % h["heads"]:
        raise ValueError(f"d_model={h['d_model']} must be a multiple of heads={h['heads']}")
    return ModelConfig(
        vocab_size=len(haystack.VOCAB),
        hidden_size=h["d_model"],
        intermediate_size=h["mlp"],
        num_layers=h["layers"],
        num_heads=h["heads"],
        num_kv_heads=h["kv_heads"],
        head_dim=h["d_model"] // h["heads"],
        rope_theta=h["rope_theta"],
        max_position_embeddings=max_len,
        bos_token_id=haystack.BOS_ID,
        eos_token_ids=(haystack.EOS_ID,),
    )


def make_optimizer(h: dict) -> optax.GradientTransformation:
    """AdamW (decay on matrices only) after global-norm clipping, warm-up then cosine to lr/10."""
    schedule = optax.warmup_cosine_decay_schedule(
        0.0, h["lr"], h["warmup"], max(h["steps"], h["warmup"] + 1), end_value=h["lr"] * 0.1
    )
    decay_matrices = lambda params: jax.tree.map(lambda p: p.ndim >= 2, params)
    return optax.chain(
        optax.clip_by_global_norm(h["clip"]),
        optax.adamw(schedule, b2=0.95, weight_decay=h["weight_decay"], mask=decay_matrices),
    )


def _positions(tokens):
    return jnp.broadcast_to(jnp.arange(tokens.shape[1], dtype=jnp.int32), tokens.shape)


ATTENTION_BLOCK = 128


def training_attention(layer, q, k, v, positions, cache, carry):
    """Causal attention for rows at positions 0..T-1, in query blocks that skip masked keys.

    The same maths as the model's own causal attention (`jkv_models.llama.causal_attention`), but
    query block i reads only keys < (i + 1) * block: about 40% less time per step at T=512 on CPU.
    Same signature as `jkv_models.llama.AttentionFn`; `positions` must be `arange(T)` per row.
    """
    del layer, positions
    b, t, n, h = q.shape  # [B, T, N, H]
    kh = k.shape[2]
    qg = (q * h**-0.5).reshape(b, t, kh, n // kh, h)  # [B, T, K, G, H]
    outs = []
    for start in range(0, t, ATTENTION_BLOCK):
        end = min(t, start + ATTENTION_BLOCK)
        scores = jnp.einsum("btkgh,bskh->bkgts", qg[:, start:end], k[:, :end])
        causal = np.arange(start, end)[:, None] >= np.arange(end)[None, :]  # [T', S'] static
        probs = jax.nn.softmax(jnp.where(causal, scores, -1e30), axis=-1)
        outs.append(jnp.einsum("bkgts,bskh->btkgh", probs, v[:, :end]))  # [B, T', K, G, H]
    return jnp.concatenate(outs, axis=1).reshape(b, t, n, h), cache, carry


@functools.cache
def _train_step(config: ModelConfig, h_items: tuple):
    optimizer = make_optimizer(dict(h_items))

    def loss_fn(params, tokens, weights):
        inputs, targets = tokens[:, :-1], tokens[:, 1:]
        logits, _ = forward(
            params, config, inputs, _positions(inputs), attention=training_attention
        )
        ce = optax.softmax_cross_entropy_with_integer_labels(logits, targets)  # [B, T]
        return jnp.sum(ce * weights) / jnp.sum(weights)

    @functools.partial(jax.jit, donate_argnums=0)
    def step(state, tokens, weights):
        loss, grads = jax.value_and_grad(loss_fn)(state["params"], tokens, weights)
        updates, opt_state = optimizer.update(grads, state["opt_state"], state["params"])
        params = optax.apply_updates(state["params"], updates)
        return {**state, "params": params, "opt_state": opt_state}, loss

    return step


@functools.cache
def _predict(config: ModelConfig, blocked: bool):
    attention = training_attention if blocked else None

    @jax.jit
    def predict(params, inputs):
        logits, _ = forward(params, config, inputs, _positions(inputs), attention=attention)
        return jnp.argmax(logits, axis=-1).astype(jnp.int32)  # [B, T]

    return predict


def accuracy(
    params, config: ModelConfig, batch: haystack.Batch, *, blocked: bool = True, chunk: int = 16
) -> float:
    """Exact-match accuracy: share of haystack rows whose 5 answer digits are all the argmax.

    Teacher-forced, which equals greedy decoding's exact match (the first wrong digit fails both).
    `blocked`: use `training_attention` (faster) rather than the model's own causal attention.
    """
    rows = []
    for i in range(0, len(batch.tokens), chunk):
        tokens = batch.tokens[i : i + chunk]
        pred = np.asarray(_predict(config, blocked)(params, jnp.asarray(tokens[:, :-1])))
        mask = batch.answer_mask[i : i + chunk]
        rows.append(np.all((pred == tokens[:, 1:]) | ~mask, axis=1) & mask.any(axis=1))
    return float(np.concatenate(rows).mean())


def eval_set(seed: int, stream: int, index: int, docs: int, seq_len: int, lo: int, hi: int):
    """Held-out haystack documents (no filler rows) from `default_rng([seed, stream, index])`.

    Training batches use stream 0, so streams 1 and 2 never repeat a training batch's draws.
    """
    rng = np.random.default_rng([seed, stream, index])
    return haystack.make_batch(rng, docs, seq_len, min_facts=lo, max_facts=hi)


# ------------------------------------------------------------------------------ checkpoints
def _manager(out: Path):
    options = ocp.CheckpointManagerOptions(max_to_keep=2, enable_async_checkpointing=False)
    return ocp.CheckpointManager((out / "ckpt").resolve(), options=options)


def _save(mngr, step: int, state, meta: dict) -> None:
    args = ocp.args.Composite(state=ocp.args.StandardSave(state), meta=ocp.args.JsonSave(meta))
    mngr.save(step, args=args, force=True)
    mngr.wait_until_finished()


def _restore(mngr, abstract_for):
    step = mngr.latest_step()
    if step is None:
        raise ValueError(f"{mngr.directory}: no checkpoint to resume from")
    meta = mngr.restore(step, args=ocp.args.Composite(meta=ocp.args.JsonRestore()))["meta"]
    abstract = abstract_for(meta["hparams"])
    args = ocp.args.Composite(state=ocp.args.StandardRestore(abstract))
    return mngr.restore(step, args=args)["state"], meta


def _init_state(h: dict, config: ModelConfig):
    key = jax.random.key(h["seed"])
    params = init_params(config, key)
    return {
        "params": params,
        "opt_state": make_optimizer(h).init(params),
        "key": jax.random.key_data(key),
    }


def _abstract_state(h: dict):
    config = model_config(h, curriculum(h["context"])[-1][0])
    return jax.eval_shape(lambda: _init_state(h, config))


# ----------------------------------------------------------------------------------- export
def fingerprint(params) -> str:
    """16 hex digits of SHA-256 over every tensor's path, dtype, shape and bytes."""
    digest = hashlib.sha256(b"jkv-demo")
    leaves = {
        jax.tree_util.keystr(p): leaf for p, leaf in jax.tree_util.tree_leaves_with_path(params)
    }
    for path in sorted(leaves):
        a = np.ascontiguousarray(np.asarray(leaves[path]))
        digest.update(f"{path}|{a.dtype}|{a.shape}|".encode())
        digest.update(a.tobytes())
    return digest.hexdigest()[:16]


RECORD = "training.json"


def export(params, config: ModelConfig, folder: str | Path, record: dict | None = None) -> Path:
    """Writes a jkv checkpoint folder (jkv.json, weights/, tokenizer.json) readable by jkv.load.

    `record` (the run's JSON meta: hparams, step, stage, train_seconds, timeline), if given, is
    written beside them as `training.json` (`--eval-only` adds its held-out figures there).

    Raises:
      ValueError: `folder` exists, is not empty and is not a jkv folder (never deleted).
    """
    folder = Path(folder).resolve()
    if folder.exists() and any(folder.iterdir()) and not (folder / "jkv.json").is_file():
        raise ValueError(f"{folder}: exists and is not a jkv folder; refusing to replace it")
    tmp = folder.with_name(folder.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    params = jax.tree.map(np.asarray, params)
    with ocp.StandardCheckpointer() as ckptr:
        ckptr.save(tmp / "weights", params)
        ckptr.wait_until_finished()
    save_tokenizer(tmp / "tokenizer.json")
    cfg = dataclasses.asdict(config)
    cfg["eos_token_ids"] = list(config.eos_token_ids)
    meta = {"format": FORMAT, "name": NAME, "version": fingerprint(params), "config": cfg}
    (tmp / "jkv.json").write_text(json.dumps(meta, indent=2) + "\n")
    if record is not None:
        stages = curriculum(record["hparams"]["context"])
        record = {**record, "curriculum": [list(st) for st in stages], "version": meta["version"]}
        (tmp / RECORD).write_text(json.dumps(record, indent=1) + "\n")
    shutil.rmtree(folder, ignore_errors=True)
    tmp.rename(folder)
    return folder


def load_exported(folder: str | Path):
    """(params, config) from a folder written by `export`."""
    folder = Path(folder).resolve()
    meta = json.loads((folder / "jkv.json").read_text())
    cfg = dict(meta["config"], eos_token_ids=tuple(meta["config"]["eos_token_ids"]))
    config = ModelConfig(**cfg)
    with ocp.StandardCheckpointer() as ckptr:
        params = ckptr.restore(folder / "weights", param_shapes(config))
    return params, config


def final_eval(params, config: ModelConfig, seed: int, docs: int = 500) -> dict:
    """Held-out exact match with 8 facts at the trained context and at half of it, with 1-8 facts
    at the trained context, and for a single needle (1 fact) at both lengths."""
    t = config.max_position_embeddings
    cases = {
        f"T={t} facts=8": (t, 8, 8),
        f"T={t // 2} facts=8": (t // 2, 8, 8),
        f"T={t} facts=1-8": (t, 1, 8),
        f"T={t} facts=1": (t, 1, 1),
        f"T={t // 2} facts=1": (t // 2, 1, 1),
    }
    out = {}
    for i, (label, (seq_len, lo, hi)) in enumerate(cases.items()):
        if seq_len < haystack.min_tokens(hi):
            continue
        batch = eval_set(seed, 2, i, docs, seq_len, lo, hi)
        out[label] = accuracy(params, config, batch, blocked=False)
    return out


# ------------------------------------------------------------------------------------- main
def _log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", flush=True)


def _hparams(args, saved: dict | None) -> dict:
    given = {k: getattr(args, k) for k in SAVED if getattr(args, k) is not None}
    if saved is None:
        return {**SAVED, **given}
    for k, v in given.items():
        if k not in RESUME_CAN_CHANGE and v != saved[k]:
            raise ValueError(
                f"--{k.replace('_', '-')}={v} differs from the checkpoint's {saved[k]}"
            )
    return {**saved, **given}


def train(args) -> dict:
    """Runs (or resumes) training; returns the final JSON meta. See the module docstring."""
    out = Path(args.out)
    mngr = _manager(out)
    if args.resume and mngr.latest_step() is not None:
        state, meta = _restore(mngr, _abstract_state)
        h = _hparams(args, meta["hparams"])
        meta["hparams"] = h
        _log(f"resumed from step {mngr.latest_step()} (stage {meta['stage']})")
    else:
        if mngr.latest_step() is not None:
            raise ValueError(f"{out / 'ckpt'}: holds checkpoints; pass --resume or another --out")
        h = _hparams(args, None)
        meta = {"hparams": h, "step": 0, "stage": 0, "train_seconds": 0.0, "timeline": []}
        state = None
    stages = curriculum(h["context"])
    meta["stage"] = min(meta["stage"], len(stages) - 1)
    full = model_config(h, stages[-1][0])
    if state is None:
        state = _init_state(h, full)
        meta["timeline"].append({"stage": 0, "step": 0, "train_seconds": 0.0})
    _log(f"model {full.num_params():,} parameters; curriculum {stages}")
    step, t0, seconds0 = meta["step"], time.monotonic(), meta["train_seconds"]
    losses: list = []

    def elapsed() -> float:
        return seconds0 + time.monotonic() - t0

    def checkpoint() -> None:
        if mngr.latest_step() == step:
            return
        meta.update(step=step, train_seconds=round(elapsed(), 1))
        _save(mngr, step, state, meta)

    stopped = False
    # SIGTERM / Ctrl-C: finish the step in flight, checkpoint, exit (resumable).
    interrupted: list[int] = []
    handler = lambda signum, frame: interrupted.append(signum)
    previous = {sig: signal.signal(sig, handler) for sig in (signal.SIGTERM, signal.SIGINT)}
    while step < h["steps"]:
        seq_len, lo, hi = stages[meta["stage"]]
        batch = haystack.make_batch(
            np.random.default_rng([h["seed"], 0, step]),
            max(1, h["batch_tokens"] // seq_len),
            seq_len,
            min_facts=lo,
            max_facts=hi,
            filler_fraction=h["filler_fraction"],
            recall_fraction=h.get("recall_fraction", 0.0),  # absent from older checkpoints
            answer_weight=h["answer_weight"],
        )
        step_fn = _train_step(full, tuple(sorted(h.items())))
        state, loss = step_fn(state, jnp.asarray(batch.tokens), jnp.asarray(batch.weights))
        losses.append(loss)
        step += 1
        if step % args.log_every == 0:
            mean = float(np.mean([float(x) for x in losses]))
            losses.clear()
            _log(
                f"step {step} stage {meta['stage']} T={seq_len} loss {mean:.4f} "
                f"train {elapsed() / 60:.1f} min"
            )
        if step % h["eval_every"] == 0:
            ev = eval_set(h["seed"], 1, meta["stage"], h["eval_docs"], seq_len, lo, hi)
            acc = accuracy(state["params"], full, ev)
            _log(
                f"step {step} stage {meta['stage']} T={seq_len} facts {lo}-{hi} eval acc {acc:.3f}"
            )
            if acc >= h["advance_at"] and meta["stage"] + 1 < len(stages):
                meta["stage"] += 1
                meta["timeline"].append(
                    {
                        "stage": meta["stage"],
                        "step": step,
                        "train_seconds": round(elapsed(), 1),
                        "previous_acc": acc,
                    }
                )
                _log(f"-> stage {meta['stage']}: {stages[meta['stage']]}")
        out_of_time = args.max_minutes is not None and elapsed() - seconds0 > 60 * args.max_minutes
        if out_of_time or step == args.stop_at or interrupted:
            stopped = True
            break
        if step % args.ckpt_every == 0:
            checkpoint()
    for sig, old in previous.items():
        signal.signal(sig, old)
    checkpoint()
    _log(f"checkpointed step {step} ({'stopped' if stopped else 'finished'})")
    if not stopped:
        trained = stages[meta["stage"]][0]
        config = full.replace(max_position_embeddings=trained)
        path = export(state["params"], config, args.final, record=meta)
        _log(f"wrote {path}")
    return meta


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m jkv.demo.train",
        description=__doc__,
        formatter_class=argparse.RawTextHelpFormatter,
    )
    p.add_argument("--out", default="tmp/demo-train", help="checkpoints (and logs) folder")
    p.add_argument("--final", default="tmp/demo-final", help="jkv folder written at the end")
    p.add_argument("--resume", action="store_true", help="continue from the latest checkpoint")
    p.add_argument("--max-minutes", type=float, default=None, help="stop and checkpoint after")
    p.add_argument("--stop-at", type=int, default=None, help="stop and checkpoint at this step")
    p.add_argument("--ckpt-every", type=int, default=500)
    p.add_argument("--log-every", type=int, default=50)
    p.add_argument("--eval-only", action="store_true", help="print held-out accuracy of --final")
    p.add_argument("--export-only", action="store_true", help="write --final from --out's ckpt")
    p.add_argument("--final-docs", type=int, default=500, help="documents per --eval-only case")
    for key, default in SAVED.items():
        kind = type(default)
        p.add_argument(
            f"--{key.replace('_', '-')}",
            type=kind,
            default=None,
            help=f"default {default} (saved in the checkpoint)",
        )
    return p


def main(argv=None) -> int:
    args = _parser().parse_args(argv)
    if args.eval_only:
        params, config = load_exported(args.final)
        seed = SAVED["seed"] if args.seed is None else args.seed
        _log(
            f"{args.final}: {config.num_params():,} parameters, context "
            f"{config.max_position_embeddings}"
        )
        results = final_eval(params, config, seed, args.final_docs)
        for label, acc in results.items():
            print(f"{label}: exact match {acc:.3f} on {args.final_docs} held-out prompts")
        record_path = Path(args.final) / RECORD
        if record_path.is_file():  # written by the training run that made the folder
            record = json.loads(record_path.read_text())
            record["final_eval"] = {
                "command": f"python -m jkv.demo.train --final {args.final} --eval-only",
                **{label: round(acc, 4) for label, acc in results.items()},
                "prompts_per_case": args.final_docs,
                "seed": seed,
            }
            record_path.write_text(json.dumps(record, indent=1) + "\n")
        return 0
    if args.export_only:
        state, meta = _restore(_manager(Path(args.out)), _abstract_state)
        h = meta["hparams"]
        trained = curriculum(h["context"])[meta["stage"]][0]
        export(state["params"], model_config(h, trained), args.final, record=meta)
        _log(f"wrote {args.final} from step {meta['step']} (context {trained})")
        return 0
    train(args)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
