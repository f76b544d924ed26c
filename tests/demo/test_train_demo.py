"""The demo trainer on a tiny config: checkpoint, exact resume, the final jkv folder."""

from __future__ import annotations

import json

import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp
import pytest

from jkv.demo import haystack
from jkv.demo import train as train_demo
from jkv_models.llama import forward, init_params

TINY = [
    "--context", "128", "--d-model", "32", "--layers", "1", "--heads", "2", "--kv-heads", "1",
    "--mlp", "64", "--steps", "6", "--batch-tokens", "256", "--eval-every", "2",
    "--eval-docs", "4", "--advance-at", "0", "--ckpt-every", "2", "--log-every", "1",
]  # fmt: skip


def _run(out, final, *extra):
    return train_demo.main([*TINY, "--out", str(out), "--final", str(final), *extra])


def _latest_params(out):
    state, meta = train_demo._restore(train_demo._manager(out), train_demo._abstract_state)
    return state, meta


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """An uninterrupted tiny run and one stopped at step 3 and resumed (same process: one jit)."""
    root = tmp_path_factory.mktemp("train_demo")
    _run(root / "straight", root / "final_straight")
    _run(root / "split", root / "final_split", "--stop-at", "3")
    stopped = _latest_params(root / "split")
    _run(root / "split", root / "final_split", "--resume")
    return root, stopped


def test_resume_matches_an_uninterrupted_run(runs):
    root, (stopped_state, stopped_meta) = runs
    assert stopped_meta["step"] == 3 and stopped_meta["stage"] == 1  # stopped mid-curriculum
    assert not (root / "final_split.tmp").exists()
    straight, meta_a = _latest_params(root / "straight")
    split, meta_b = _latest_params(root / "split")
    assert meta_a["step"] == meta_b["step"] == 6
    assert [(t["stage"], t["step"]) for t in meta_a["timeline"]] == [(0, 0), (1, 2), (2, 4), (3, 6)]
    assert [(t["stage"], t["step"]) for t in meta_b["timeline"]] == [(0, 0), (1, 2), (2, 4), (3, 6)]
    for a, b in zip(jax.tree.leaves(straight), jax.tree.leaves(split), strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    moved = jax.tree.leaves(stopped_state["params"])[0]
    assert not np.array_equal(np.asarray(moved), np.asarray(jax.tree.leaves(split["params"])[0]))


def test_final_folder_is_a_jkv_checkpoint(runs):
    root, _ = runs
    final = root / "final_split"
    names = sorted(p.name for p in final.iterdir())
    assert names == ["jkv.json", "tokenizer.json", "training.json", "weights"]
    meta = json.loads((final / "jkv.json").read_text())
    assert meta["format"] == 2 and meta["name"] == "jkv-demo" and len(meta["version"]) == 16
    cfg = meta["config"]
    assert cfg["vocab_size"] == len(haystack.VOCAB)
    assert cfg["max_position_embeddings"] == 128  # the longest stage trained (stage 2: T=128)
    assert cfg["bos_token_id"] == haystack.BOS_ID and cfg["eos_token_ids"] == [haystack.EOS_ID]
    assert cfg["rope_scaling"] is None and cfg["num_kv_heads"] < cfg["num_heads"]
    same = json.loads((root / "final_straight" / "jkv.json").read_text())
    assert same["version"] == meta["version"]  # same weights, same fingerprint
    record = json.loads((final / "training.json").read_text())
    assert record["version"] == meta["version"] and record["step"] == 6
    assert record["hparams"]["d_model"] == 32 and record["curriculum"][-1] == [128, 1, 8]
    assert [t["step"] for t in record["timeline"]] == [0, 2, 4, 6]
    params, config = train_demo.load_exported(final)
    with ocp.StandardCheckpointer() as ckptr:
        raw = ckptr.restore(final / "weights")
    assert jax.tree.structure(raw) == jax.tree.structure(params)
    assert train_demo.fingerprint(params) == meta["version"]


def test_jkv_loads_the_final_folder(runs):
    import jkv

    root, _ = runs
    loaded = jkv.load(root / "final_split")
    assert loaded.config.eos_token_ids == (haystack.EOS_ID,)
    assert loaded.tokenizer.encode("A dog slept .")[0] == haystack.BOS_ID


def test_eval_only_prints_accuracies(runs, capsys):
    root, _ = runs
    train_demo.main(["--eval-only", "--final", str(root / "final_split"), "--final-docs", "4"])
    out = capsys.readouterr().out
    # 8 facts at half the context is skipped here: 64 tokens cannot hold 8 facts
    labels = ["T=128 facts=8", "T=128 facts=1-8", "T=128 facts=1", "T=64 facts=1"]
    assert [line.split(":")[0] for line in out.splitlines() if "exact match" in line] == labels
    record = json.loads((root / "final_split" / "training.json").read_text())["final_eval"]
    assert [k for k in record if k.startswith("T=")] == labels
    assert record["prompts_per_case"] == 4 and "--eval-only" in record["command"]


def test_resume_refuses_changed_model_flags(runs):
    root, _ = runs
    with pytest.raises(ValueError, match="d-model"):
        train_demo.main(["--out", str(root / "split"), "--resume", "--d-model", "64"])


def test_fresh_run_refuses_a_used_folder(runs):
    root, _ = runs
    with pytest.raises(ValueError, match="--resume"):
        _run(root / "straight", root / "elsewhere")


def test_training_attention_matches_the_models_causal_attention():
    h = dict(train_demo.SAVED, d_model=32, layers=2, heads=4, kv_heads=2, mlp=64)
    config = train_demo.model_config(h, 512)
    params = init_params(config, jax.random.key(0))
    tokens = jnp.asarray(np.random.default_rng(0).integers(0, config.vocab_size, (2, 300)))
    positions = jnp.broadcast_to(jnp.arange(300), tokens.shape)
    ref, _ = forward(params, config, tokens, positions)
    got, _ = forward(params, config, tokens, positions, attention=train_demo.training_attention)
    np.testing.assert_allclose(np.asarray(got), np.asarray(ref), atol=1e-5, rtol=1e-5)


def test_curriculum_ends_at_the_context():
    assert train_demo.curriculum(512)[-2:] == ((512, 1, 8), (512, 4, 8))
    assert train_demo.curriculum(256)[-1] == (256, 1, 8)
    assert train_demo.curriculum(64) == ((64, 1, 2), (64, 2, 4))
    with pytest.raises(ValueError, match="context=100"):
        train_demo.curriculum(100)
